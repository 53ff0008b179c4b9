"""`ember deploy APP.py --target aws` against moto_server: the CLI uploads the package to the bucket (once per hash),
the gateway named by EMBER_URL fetches it from S3, checks its sha256 and deploys it, and a node agent serves it."""
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import boto3

from tests.gateway.test_aws import APPS, BUCKET, aws, emulator  # noqa: F401 (fixtures: moto_server, group, node agents)


def deploy(app: Path, home: Path, url: str, key: str, ca: Path, **env: str) -> subprocess.CompletedProcess:
    """`ember deploy APP --target aws` from another machine's point of view: its own EMBER_HOME, the gateway by URL."""
    env = os.environ | {"EMBER_HOME": str(home), "EMBER_URL": url, "EMBER_KEY": key, "EMBER_CA": str(ca)} | env
    return subprocess.run([sys.executable, "-m", "ember.cli", "deploy", str(app), "--target", "aws"],
                          env={k: v for k, v in env.items() if v}, capture_output=True, text=True, timeout=60)


def test_deploy_uploads_once_and_a_node_serves_the_app(aws, serve, tmp_path):
    autoscaling, instances = aws
    served = serve(APPS / "quick.py", "--backend", "aws")
    laptop, admin = tmp_path / "laptop", served.key("deployer", admin=True)

    first = deploy(APPS / "other.py", laptop, served.url, admin, served.ca)
    assert first.returncode == 0, first.stderr
    [package] = (laptop / "packages").glob("*.pkg")
    digest, size = package.stem, package.stat().st_size
    assert f"deployed app 'other' version 1 (secret) from s3://{BUCKET}/packages/{digest}.pkg" in first.stdout
    assert f"{size:,} of {size:,} bytes sent (100%)" in first.stderr
    s3 = boto3.client("s3")
    stored = s3.head_object(Bucket=BUCKET, Key=f"packages/{digest}.pkg")
    assert stored["Metadata"]["sha256"] == digest and stored["ContentLength"] == size
    assert (
        served.home / "packages" / package.name
    ).read_bytes() == package.read_bytes()  # fetched from S3, not shared disk

    with served.client(served.key()) as http:
        reply = http.post("/other/secret", json={})
    assert reply.status_code == 200 and reply.json()["result"] == "other's data"
    # The deploy's check started the first replica (on a new instance), so the call found it hot.
    [replica] = served.status()["apps"]["other"]["functions"]["secret"]["replicas"]
    assert replica["start"]["tier"] == "node-cold" and "x-ember-cold-start" not in reply.headers
    assert len(instances.launched) == 1

    again = deploy(APPS / "other.py", laptop, served.url, admin, served.ca)
    assert again.returncode == 0, again.stderr
    assert (
        f"already in s3://{BUCKET}/packages/{digest}.pkg: upload skipped" in again.stderr
        and "bytes sent" not in again.stderr
    )
    assert s3.head_object(Bucket=BUCKET, Key=f"packages/{digest}.pkg")["LastModified"] == stored["LastModified"]
    # The AWS mode's gateway keeps its versions in its own database too; the same package again is no new version.
    [version] = json.loads(served.cli("apps", "history", "other", "--json").stdout)
    assert (version["version"], version["state"], version["digest"]) == (1, "live", digest)
    assert version["deployed_by"].startswith("deployer (")


def test_deploy_errors_say_what_is_wrong(aws, serve, tmp_path):
    served = serve(APPS / "quick.py", "--backend", "aws")
    tampered = b"not the package that was hashed"
    boto3.client("s3").put_object(Bucket=BUCKET, Key="packages/tampered.pkg", Body=tampered)
    claimed = hashlib.sha256(b"the package").hexdigest()
    with served.client(served.key("deployer", admin=True)) as http:
        def refused(body: dict) -> tuple[int, str, str]:
            reply = http.post("/admin/deploy", json=body)
            return reply.status_code, reply.json()["error"]["type"], reply.json()["error"]["message"]

        status, kind, message = refused({"package_url": f"s3://{BUCKET}/packages/tampered.pkg", "sha256": claimed})
        assert (status, kind) == (422, "sha256_mismatch")
        assert f"has sha256 {hashlib.sha256(tampered).hexdigest()}, not {claimed}" in message
        assert (
            sorted(p.name for p in (served.home / "packages").iterdir() if not p.name.endswith(".pkg")) == []
        )  # no partial file
        assert not (served.home / "packages" / f"{claimed}.pkg").exists()

        status, kind, message = refused({"package_url": f"s3://{BUCKET}/packages/gone.pkg", "sha256": claimed})
        assert (status, kind) == (
            404,
            "package_not_found",
        ) and f"no package at s3://{BUCKET}/packages/gone.pkg" in message
        assert refused({"package_url": "https://example.com/app.pkg", "sha256": claimed})[:2] == (
            400,
            "invalid_package_url",
        )
        assert refused({"package_url": f"s3://{BUCKET}/packages/tampered.pkg"})[:2] == (400, "invalid_sha256")
        assert refused({"package": "x.pkg", "package_url": f"s3://{BUCKET}/x.pkg", "sha256": claimed})[:2] == (
            400,
            "invalid_request",
        )
    assert "other" not in served.status()["apps"]

    no_bucket = deploy(APPS / "other.py", tmp_path / "laptop", served.url, "unused", served.ca, EMBER_AWS_BUCKET="")
    assert no_bucket.returncode == 1 and "--target aws needs EMBER_AWS_BUCKET" in no_bucket.stderr
