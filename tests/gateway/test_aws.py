"""The AWS backend against moto_server: a call at zero raises the group's desired capacity, a node agent (a local
process standing in for the instance) claims the assignment and serves it, and the idle instance goes after the
window."""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import boto3
import httpx
import pytest

from ember.gateway.backends.aws import create_tables, nodes_needed, place
from tests.aws_emulator import aws_env, moto_server
from tests.gateway.test_backend_local import wait_for

APPS = Path(__file__).parent / "apps"
GROUP, BUCKET = "ember-gpu", "ember-packages"


def test_nodes_needed_fit_replicas_and_keep_busy_nodes():
    assert nodes_needed(0, 2, 0) == 0
    assert nodes_needed(3, 2, 0) == 2
    assert nodes_needed(1, 2, 2) == 2  # scale-in never takes a node that runs a replica


def test_place_prefers_a_live_node_with_a_free_slot_that_holds_the_package():
    def node(node_id, packages, slots=1, state="ready", heartbeat=100.0):
        return {"node_id": node_id, "packages": packages, "slots": slots, "state": state, "heartbeat": str(heartbeat)}

    def running(node_id, state="ready"):
        return {"node_id": node_id, "state": state}

    nodes = [node("a", ["other"]), node("b", ["pkg"], slots=2), node("c", ["pkg"], slots=2)]
    assert place(nodes, [], "pkg", 101.0, 15) == "b"  # a holder, ties broken by id
    assert place(nodes, [running("b")], "pkg", 101.0, 15) == "c"  # the least busy holder
    full = [running("b"), running("b", "parked"), running("c", "stop"), running("c")]
    assert place(nodes, full, "pkg", 101.0, 15) is None
    assert place(nodes, [running("b", "stopped"), running("b", "failed")], "pkg", 101.0, 15) == "b"  # gone: no slot
    assert place(nodes, [], "new", 101.0, 15) is None  # nobody holds it: any node, or a new instance (T3)
    gone = [node("b", ["pkg"], state="draining"), node("c", ["pkg"], heartbeat=50.0)]
    assert place(gone, [], "pkg", 101.0, 15) is None  # draining, or silent past the heartbeat timeout


class FakeInstances:
    """Plays EC2: a node agent process for every instance the group launches, gone when the group drops it."""

    def __init__(self, autoscaling, work: Path, slots: int, group: str = GROUP):
        self.autoscaling, self.work, self.slots, self.group = autoscaling, work, slots, group
        self.agents: dict[str, subprocess.Popen] = {}
        self.launched: list[str] = []
        self.desired_seen: list[int] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.done.wait(0.2):
            [group] = self.autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=[self.group])[
                "AutoScalingGroups"
            ]
            self.desired_seen.append(group["DesiredCapacity"])
            live = {i["InstanceId"] for i in group["Instances"] if i["LifecycleState"] in ("Pending", "InService")}
            for instance in sorted(live - set(self.agents)):
                log = open(self.work / f"{instance}.log", "w")
                self.agents[instance] = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "ember.runtime.node_agent",
                        "--instance-id",
                        instance,
                        "--address",
                        "127.0.0.1",
                        "--slots",
                        str(self.slots),
                        "--work",
                        str(self.work / instance),
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
                self.launched.append(instance)
            for instance in set(self.agents) - live:  # terminated by the group
                self.agents[instance].terminate()

    def stop(self) -> None:
        self.done.set()
        self.thread.join()
        for process in self.agents.values():
            process.terminate()
        for process in self.agents.values():
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture(scope="module")
def emulator():
    with moto_server() as endpoint:
        yield endpoint


@pytest.fixture
def aws(emulator, tmp_path, monkeypatch, request):
    slots = getattr(request, "param", 1)  # replicas per node
    httpx.post(f"{emulator}/moto-api/reset").raise_for_status()  # a fresh account for each test
    env = aws_env(emulator) | {
        "EMBER_AWS_ASG": GROUP,
        "EMBER_AWS_BUCKET": BUCKET,
        "EMBER_AWS_REPLICAS_PER_NODE": str(slots),
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    boto3.client("s3").create_bucket(Bucket=BUCKET)
    create_tables(boto3.resource("dynamodb"), "ember-")
    ec2, autoscaling = boto3.client("ec2"), boto3.client("autoscaling")
    image = ec2.describe_images()["Images"][0]["ImageId"]
    ec2.create_launch_template(
        LaunchTemplateName="ember-node", LaunchTemplateData={"ImageId": image, "InstanceType": "g5.xlarge"}
    )
    autoscaling.create_auto_scaling_group(
        AutoScalingGroupName=GROUP, LaunchTemplate={"LaunchTemplateName": "ember-node"}, MinSize=0, MaxSize=3,
        DesiredCapacity=0, AvailabilityZones=["us-east-1a"])
    instances = FakeInstances(autoscaling, tmp_path, slots)
    try:
        yield autoscaling, instances
    finally:
        instances.stop()


def desired(autoscaling) -> int:
    return autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=[GROUP])["AutoScalingGroups"][0][
        "DesiredCapacity"
    ]


def test_call_at_zero_scales_the_group_out_and_back_in(aws, serve):
    autoscaling, instances = aws
    served = serve(APPS / "quick.py", "--backend", "aws")
    assert desired(autoscaling) == 0
    with served.client(served.key()) as http:
        reply = http.post("/quick/add", json={"a": 2, "b": 3})
        assert desired(autoscaling) == 1  # read while the replica is still up
    assert reply.status_code == 200 and reply.json()["result"]["sum"] == 5
    assert reply.headers["x-ember-cold-start"].startswith("node-cold; ms=")
    [instance] = instances.launched
    assert reply.json()["result"]["pid"] != os.getpid()
    [replica] = served.status()["apps"]["quick"]["functions"]["add"]["replicas"]
    assert replica["address"].startswith("127.0.0.1:") and replica["start"]["tier"] == "node-cold"

    deadline = time.monotonic() + 20
    while desired(autoscaling) != 0:  # scaledown_window 1.5 s, then the idle instance is terminated
        assert time.monotonic() < deadline, "the group never scaled back to zero"
        time.sleep(0.3)
    instances.agents[instance].wait(10)  # the group terminated it (its agent may have seen the drain first and left)
    nodes = boto3.resource("dynamodb").Table("ember-nodes").get_item(Key={"node_id": instance})["Item"]
    assert nodes["state"] == "draining"
    assert boto3.resource("dynamodb").Table("ember-replicas").scan()["Items"] == []


@pytest.mark.parametrize("aws", [2], indirect=True)
def test_a_burst_sizes_the_group_to_replicas_over_slots(aws, serve):
    from concurrent.futures import ThreadPoolExecutor

    autoscaling, instances = aws
    served = serve(APPS / "burst.py", "--backend", "aws")
    with served.client(served.key()) as http, ThreadPoolExecutor(6) as pool:
        replies = list(pool.map(lambda _: http.post("/burst/work", json={"seconds": 1.5}), range(6)))
    assert [r.status_code for r in replies] == [200] * 6
    replicas = {r.headers["x-ember-replica"] for r in replies}
    assert len(replicas) == 3 and max(instances.desired_seen) == 2  # ceil(3 replicas / 2 per node)
    assert len(instances.launched) == 2
    nodes = {r["address"] for r in served.status()["apps"]["burst"]["functions"]["work"]["replicas"]}
    assert len(nodes) == 3  # three workers on two agents, each on its own port


def test_a_start_no_node_takes_fails_with_the_reason(aws, serve, monkeypatch):
    autoscaling, instances = aws
    autoscaling.update_auto_scaling_group(AutoScalingGroupName=GROUP, MaxSize=0)
    monkeypatch.setenv("EMBER_AWS_START_TIMEOUT", "2")
    served = serve(APPS / "quick.py", "--backend", "aws")
    with served.client(served.key()) as http:
        reply = http.post("/quick/add", json={"a": 2, "b": 3})
    assert reply.status_code == 503 and reply.headers["retry-after"]
    message = reply.json()["error"]["message"]
    assert (
        "still pending after 2 s; group ember-gpu wants 0 instances (at its MaxSize: raise max_size), "
        "0 node agents alive"
        in message
    )
    assert instances.launched == [] and boto3.resource("dynamodb").Table("ember-replicas").scan()["Items"] == []


def test_a_node_that_goes_silent_fails_its_replica_and_leaves_the_group(aws, serve, monkeypatch):
    autoscaling, instances = aws
    monkeypatch.setenv("EMBER_AWS_HEARTBEAT_TIMEOUT", "2")
    served = serve(APPS / "quick.py", "--backend", "aws")
    with served.client(served.key()) as http:
        assert http.post("/quick/sleepy", json={"seconds": 0}).status_code == 200  # scaledown_window 30 s: it stays up
    [instance] = instances.launched
    instances.agents[instance].kill()  # the instance dies without a word
    deadline = time.monotonic() + 20
    while not (failed := served.status()["apps"]["quick"]["functions"]["sleepy"]["failed"]):
        assert time.monotonic() < deadline, "the silent node's replica was never failed"
        time.sleep(0.3)
    assert (
        f"node {instance} sent no heartbeat for" in failed[0]["error"]
        and "the instance or its node agent is gone" in failed[0]["error"]
    )
    while desired(autoscaling) != 0 or instance in [i["InstanceId"] for i in autoscaling.describe_auto_scaling_groups(
            AutoScalingGroupNames=[GROUP])["AutoScalingGroups"][0]["Instances"]]:
        assert time.monotonic() < deadline, "the dead instance was never terminated"
        time.sleep(0.3)


def test_an_idle_replica_parks_on_its_node_and_the_next_call_wakes_it_there(aws, serve):
    autoscaling, instances = aws
    served = serve(APPS / "parking.py", "--backend", "aws")
    assignments = boto3.resource("dynamodb").Table("ember-replicas")
    with served.client(served.key()) as http:
        first = http.post("/parking/Model.predict", json={})
        assert first.status_code == 200 and first.headers["x-ember-cold-start"].startswith("node-cold; ms=")
        [parked] = wait_for(lambda: [i for i in assignments.scan()["Items"] if i["state"] == "parked"], 10, "a park")
        assert parked["replica_id"] == first.headers["x-ember-replica"] and parked["parked_bytes"] > 10 * 2**20
        second = http.post("/parking/Model.predict", json={})
    assert second.headers["x-ember-replica"] == first.headers["x-ember-replica"]
    assert second.headers["x-ember-cold-start"].startswith("parked; ms=")
    assert second.json()["result"] == {"pid": first.json()["result"]["pid"], "parks": 1, "wakes": 1}  # same process
    [instance] = instances.launched
    [woken] = wait_for(lambda: [i for i in assignments.scan()["Items"] if "woken" in i], 20, "the wake recorded")
    assert woken["node_id"] == instance and woken["state"] in ("ready", "parked")  # it parks again after 0.5 s idle
    assert desired(autoscaling) == 1


def test_a_new_replica_starts_on_the_node_that_holds_its_package(aws, tmp_path):
    import asyncio
    import shutil

    from ember.gateway.backends.aws import AwsBackend, AwsSettings
    from ember.home import Home
    from ember.package import build, load_app, read_manifest
    from ember.runtime.aws import sha256_file
    from ember.spec import FunctionSpec

    autoscaling, _ = aws
    autoscaling.update_auto_scaling_group(AutoScalingGroupName=GROUP, MaxSize=0)  # only the two nodes started here
    package = build(load_app(str(APPS / "quick.py")), Home(tmp_path / "laptop"))
    (tmp_path / "holder" / "packages").mkdir(parents=True)
    shutil.copy(package, tmp_path / "holder" / "packages" / f"{sha256_file(package)}.pkg")  # deployed here before
    # the fresh node waits out a long grace: on a loaded host the holder may take over the default 2 s to poll, and
    # the fresh node then took the replica (a clean-clone CI run saw it start node-cold)
    agents = [subprocess.Popen([sys.executable, "-m", "ember.runtime.node_agent", "--instance-id", f"i-{name}",
                                "--address", "127.0.0.1", "--work", str(tmp_path / name), "--prefer-grace", "60"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for name in ("fresh", "holder")]
    nodes = boto3.resource("dynamodb").Table("ember-nodes")
    try:
        wait_for(lambda: len(nodes.scan()["Items"]) == 2, 20, "both node agents to register")
        backend = AwsBackend(tmp_path / "logs", AwsSettings(GROUP, BUCKET))
        replica = backend.new_replica("quick", "add")
        spec = FunctionSpec(**read_manifest(package)["units"]["add"]["spec"])
        asyncio.run(backend.start(replica, package, spec))
        item = boto3.resource("dynamodb").Table("ember-replicas").get_item(Key={"replica_id": replica.id})["Item"]
        assert (item["prefer"], item["node_id"], replica.tier) == ("i-holder", "i-holder", "node-warm")
        secret = {"x-ember-control": replica.control_secret}
        health = httpx.get(f"http://{replica.address}/__ember__/health", headers=secret)
        assert health.status_code == 200  # the holder's relay reaches the worker
        asyncio.run(backend.stop(replica))
    finally:
        for agent in agents:
            agent.terminate()
            agent.wait(10)
