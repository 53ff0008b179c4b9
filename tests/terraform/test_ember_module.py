"""terraform/: the module formats, inits offline against the provider mirror (terraform/cli.tfrc) and validates; its
worked example applies against moto_server, `ember deploy --target aws` ships an app into what it built, a call through
a gateway in AWS mode reaches a node agent, and destroy leaves the account empty."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import boto3
import pytest

from tests.aws_emulator import aws_env, moto_server
from tests.gateway.test_aws import APPS, FakeInstances

TERRAFORM = Path(__file__).resolve().parents[2] / "terraform"
MIRROR = Path("/opt/tf-plugins")
needs_terraform = pytest.mark.skipif(shutil.which("terraform") is None or not MIRROR.is_dir(),
                                     reason="needs terraform and the provider mirror in /opt/tf-plugins")
# What the example creates that moto serves; ElastiCache is missing: moto's replication groups have no member
# clusters, so the provider cannot read one back. The example runs one gateway, so Redis is off (redis = null).
EMULATED = ("acm", "autoscaling", "cloudwatch", "dynamodb", "ec2", "elasticache", "elbv2", "iam", "kms", "logs", "s3",
            "secretsmanager", "sts", "wafv2")


def emulator_override(endpoint: str) -> str:
    """A provider block (merged over the example's by terraform's *_override.tf rule) that talks to the emulator."""
    endpoints = "\n".join(f'    {service} = "{endpoint}"' for service in EMULATED)
    return f'''provider "aws" {{
  region                      = "us-east-1"
  access_key                  = "test"
  secret_key                  = "test"
  skip_credentials_validation = true
  skip_metadata_api_check     = true
  skip_requesting_account_id  = true
  s3_use_path_style           = true
  endpoints {{
{endpoints}
  }}
}}
'''


def example_copy(tmp_path: Path) -> Path:
    shutil.copytree(TERRAFORM, tmp_path / "terraform")  # init writes a lock file and .terraform/ beside the config
    return tmp_path / "terraform" / "examples" / "basic"


def terraform(example: Path, *args: str, timeout: float = 120) -> str:
    # GOGC=400: terraform and the AWS provider (Go) collect garbage a quarter as often; on the 2-core CI machine this
    # test's terraform CPU fell from 124 s to ~75 s (with destroy's -refresh=false), in a few hundred MB more memory
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")} | {
        "TF_CLI_CONFIG_FILE": str(TERRAFORM / "cli.tfrc"), "TF_IN_AUTOMATION": "1", "CHECKPOINT_DISABLE": "1",
        "GOGC": "400"}
    result = subprocess.run(["terraform", args[0], "-no-color", *args[1:]], cwd=example, env=env, capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, f"terraform {' '.join(args)}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


@needs_terraform
def test_module_formats_inits_offline_and_validates(tmp_path):
    example = example_copy(tmp_path)
    terraform(example, "fmt", "-check", "-recursive", "../..")
    assert "hashicorp/aws" in terraform(example, "init", "-backend=false", "-input=false")
    assert "The configuration is valid" in terraform(example, "validate")


@pytest.mark.slow  # about 3 minutes: the provider waits ~60 s on the load balancer and on the lifecycle rules
@pytest.mark.timeout(900)
@needs_terraform
def test_example_applies_serves_a_deployed_app_and_destroys(tmp_path, serve, monkeypatch):
    example = example_copy(tmp_path)
    with moto_server() as endpoint:
        for key, value in aws_env(endpoint).items():
            monkeypatch.setenv(key, value)
        monkeypatch.delenv("AWS_PROFILE", raising=False)
        (example / "emulator_override.tf").write_text(emulator_override(endpoint))
        certificate = boto3.client("acm").request_certificate(DomainName="ember.example.com")["CertificateArn"]
        image = boto3.client("ec2").describe_images()["Images"][0]["ImageId"]
        variables = ["-var", f"certificate_arn={certificate}", "-var", f"node_ami_id={image}", "-var",
                     f"gateway_ami_id={image}", "-var", "deletion_protection=false", "-var", "force_destroy=true"]
        terraform(example, "init", "-backend=false", "-input=false")
        # Two gateways share rate limits: the plan adds Redis, its auth token and the gateway's way in.
        terraform(example, "plan", "-input=false", "-out=two-gateways.plan", *variables, "-var", "gateway_count=2")
        planned = json.loads(terraform(example, "show", "-json", "two-gateways.plan"))
        addresses = {c["address"].removeprefix("module.ember.") for c in planned["resource_changes"]}
        assert {"aws_elasticache_replication_group.redis[0]", "aws_secretsmanager_secret.redis[0]",
                "aws_vpc_security_group_egress_rule.gateway_to_redis[0]"} <= addresses
        terraform(example, "apply", "-auto-approve", "-input=false", *variables, timeout=400)
        out = {k: v["value"] for k, v in json.loads(terraform(example, "output", "-json")).items()}
        assert out.get("redis_endpoint") is None  # one gateway: no Redis unless asked

        # What an auditor looks for, read back from the emulator.
        s3, dynamodb, elbv2 = boto3.client("s3"), boto3.client("dynamodb"), boto3.client("elbv2")
        assert s3.get_bucket_versioning(Bucket=out["bucket"])["Status"] == "Enabled"
        [rule] = s3.get_bucket_encryption(Bucket=out["bucket"])["ServerSideEncryptionConfiguration"]["Rules"]
        assert rule["ApplyServerSideEncryptionByDefault"]["SSEAlgorithm"] == "aws:kms"
        assert s3.get_bucket_logging(Bucket=out["bucket"])["LoggingEnabled"]["TargetPrefix"] == "s3/"
        replicas_table = f"{out['tables']}replicas"
        assert dynamodb.describe_table(TableName=replicas_table)["Table"]["SSEDescription"]["SSEType"] == "KMS"
        backups = dynamodb.describe_continuous_backups(TableName=replicas_table)["ContinuousBackupsDescription"]
        assert backups["PointInTimeRecoveryDescription"]["PointInTimeRecoveryStatus"] == "ENABLED"
        [lb] = elbv2.describe_load_balancers()["LoadBalancers"]
        attributes = {a["Key"]: a["Value"] for a in elbv2.describe_load_balancer_attributes(
            LoadBalancerArn=lb["LoadBalancerArn"])["Attributes"]}
        assert attributes["routing.http.drop_invalid_header_fields.enabled"] == "true"
        assert attributes["access_logs.s3.enabled"] == "true"
        acl = boto3.client("wafv2").get_web_acl_for_resource(ResourceArn=lb["LoadBalancerArn"])["WebACL"]
        assert {r["Name"] for r in acl["Rules"]} == {"common", "known-bad-inputs"}
        groups = {g["logGroupName"] for g in boto3.client("logs").describe_log_groups()["logGroups"]}
        assert {"/ember/ember/gateway", "/ember/ember/nodes", "aws-waf-logs-ember"} <= groups

        # The outputs are what a gateway and `ember deploy --target aws` read.
        for key, value in out["gateway_env"].items():
            monkeypatch.setenv(key, value)
        assert out["gateway_env"]["EMBER_AWS_ASG"] == out["node_group"]
        instances = FakeInstances(boto3.client("autoscaling"), tmp_path, slots=1, group=out["node_group"])
        served = None
        try:
            served = serve(APPS / "quick.py", "--backend", "aws")
            env = os.environ | {"EMBER_HOME": str(tmp_path / "laptop"), "EMBER_URL": served.url,
                                "EMBER_CA": str(served.ca), "EMBER_KEY": served.key("deployer", admin=True),
                                "EMBER_AWS_BUCKET": out["bucket"]}
            deployed = subprocess.run([sys.executable, "-m", "ember.cli", "deploy", str(APPS / "other.py"), "--target",
                                       "aws"], env=env, capture_output=True, text=True, timeout=60)
            assert deployed.returncode == 0, deployed.stderr
            assert f"from s3://{out['bucket']}/packages/" in deployed.stdout
            with served.client(served.key()) as http:
                reply = http.post("/other/secret", json={})
            assert reply.status_code == 200 and reply.json()["result"] == "other's data"
            # The deploy checks the new version on a replica (which then serves), so the call may find it hot: its
            # start is what came from the S3 store to a fresh node.
            with served.client(served.key("root", admin=True)) as admin:
                functions = admin.get("/admin/status").json()["apps"]["other"]["functions"]
            [replica] = [r for f in functions.values() for r in f["replicas"]
                         if r["id"] == reply.headers["x-ember-replica"]]
            assert replica["start"]["tier"] == "node-cold", replica
            [instance] = instances.launched  # an instance of the group terraform made ran the node agent that served it
            node = boto3.resource("dynamodb").Table(f"{out['tables']}nodes").get_item(Key={"node_id": instance})["Item"]
            assert node["state"] in ("ready", "draining")
        finally:
            instances.stop()
            if served:  # before destroy: a live gateway would keep sizing the group
                served.process.terminate()

        # the state is the apply's, just made: reading every resource back first (refresh) doubled destroy's CPU
        terraform(example, "destroy", "-auto-approve", "-input=false", "-refresh=false", *variables, timeout=400)
        assert dynamodb.list_tables()["TableNames"] == []
        assert s3.list_buckets()["Buckets"] == []
        assert elbv2.describe_load_balancers()["LoadBalancers"] == []
