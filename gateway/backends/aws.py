"""The AWS backend: replicas run on the instances of an Auto Scaling Group, whose node agents pull their work.

The gateway writes an assignment (a row of the replicas table, state "pending") and sizes the group to
ceil(replicas / replicas-per-node); a node agent (ember.runtime.node_agent) claims it with a conditional
write, pulls the package from S3, starts the worker and writes back its address. A node that already holds the
package on disk is preferred for a new replica (T2) before a node that must pull it or a new instance (T3). An idle
replica parks on its node (T1: the worker keeps its process, its assignment says "parked") and the next call wakes
it there. Scale-in removes only idle instances, each marked draining first so its agent claims nothing more.
"""
import asyncio
import contextlib
import json
import logging
import math
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import boto3
from boto3.dynamodb.conditions import Attr
from botocore.exceptions import ClientError

from ember.gateway.backends.local import LocalBackend
from ember.gateway.lifecycle import PARKED, STOPPING
from ember.gateway.replica import GatewayReplica
from ember.runtime.aws import scan, upload_package
from ember.runtime.supervisor import GpuPool
from ember.runtime.tiers import Tier
from ember.spec import FunctionSpec

log = logging.getLogger("ember.gateway")
POLL = 0.2
ACTIVE = ("pending", "claimed", "ready", "parked")  # assignment states that hold a slot on a node
PARKED_RAM = 64 << 30  # host bytes parked replicas may hold across the group before the oldest is evicted


@dataclass(frozen=True)
class AwsSettings:
    group: str  # the Auto Scaling Group's name
    bucket: str  # packages live under packages/<sha256>.pkg
    tables: str = "ember-"  # prefix of the nodes and replicas tables
    replicas_per_node: int = 1
    start_timeout: float = 600.0  # seconds an assignment may take: instance boot, package pull, enter hooks
    heartbeat_timeout: float = 15.0  # a node silent this long is gone, and so are its replicas
    parked_ram: int = PARKED_RAM

    @classmethod
    def from_env(cls) -> "AwsSettings":
        missing = [v for v in ("EMBER_AWS_ASG", "EMBER_AWS_BUCKET") if not os.environ.get(v)]
        if missing:
            raise RuntimeError(f"--backend aws needs {' and '.join(missing)} set (the Auto Scaling Group and bucket "
                               "that terraform/examples/basic outputs)")
        return cls(
            os.environ["EMBER_AWS_ASG"],
            os.environ["EMBER_AWS_BUCKET"],
            os.environ.get("EMBER_AWS_TABLES", "ember-"),
            int(os.environ.get("EMBER_AWS_REPLICAS_PER_NODE", "1")),
            float(os.environ.get("EMBER_AWS_START_TIMEOUT", "600")),
            float(os.environ.get("EMBER_AWS_HEARTBEAT_TIMEOUT", "15")),
            int(os.environ.get("EMBER_AWS_PARKED_RAM", str(PARKED_RAM))),
        )


def clients():
    """boto3 clients and tables; AWS_ENDPOINT_URL (an emulator, in tests) is honoured by boto3 itself."""
    return boto3.client("autoscaling"), boto3.client("s3"), boto3.resource("dynamodb")


def nodes_needed(active: int, per_node: int, busy_nodes: int) -> int:
    """Instances the group should have: enough slots for every replica, and never fewer than the nodes running some."""
    return max(math.ceil(active / per_node), busy_nodes)


def place(nodes: list[dict], assignments: list[dict], digest: str, now: float, heartbeat_timeout: float) -> str | None:
    """The node a new replica should start on: a live, ready node with a free slot that holds its package (T2), the
    least busy of them. None when no node holds it: any node with a slot claims it, or a new instance does (T3)."""
    busy: dict[str, int] = {}
    for a in assignments:
        if a.get("node_id") and a["state"] in ACTIVE + ("stop",):
            busy[a["node_id"]] = busy.get(a["node_id"], 0) + 1
    holders = [n for n in nodes if n.get("state") == "ready" and now - float(n.get("heartbeat", 0)) < heartbeat_timeout
               and digest in n.get("packages", ()) and busy.get(n["node_id"], 0) < int(n.get("slots", 1))]
    return min(holders, key=lambda n: (busy.get(n["node_id"], 0), n["node_id"]))["node_id"] if holders else None


def create_tables(dynamodb, prefix: str) -> None:
    """The two tables (terraform creates them in a real account; tests and `ember` dev setups call this)."""
    for name, key in ((f"{prefix}nodes", "node_id"), (f"{prefix}replicas", "replica_id")):
        dynamodb.create_table(
            TableName=name,
            KeySchema=[{"AttributeName": key, "KeyType": "HASH"}],
            AttributeDefinitions=[{"AttributeName": key, "AttributeType": "S"}],
            BillingMode="PAY_PER_REQUEST",
        )


class AwsBackend:
    tier = Tier.NODE_COLD  # until a node says otherwise: a fresh instance pulls the package from the object store
    can_park = True
    secrets_here = False  # a node's agent reads its own EMBER_HOME/secrets
    gpus: GpuPool | None = None  # each node's agent hands out its own

    def __init__(self, logs: Path, settings: AwsSettings):
        self.logs, self.settings = logs, settings
        self.parked_ram = settings.parked_ram
        self.autoscaling, self.s3, dynamodb = clients()
        self.nodes = dynamodb.Table(f"{settings.tables}nodes")
        self.replicas = dynamodb.Table(f"{settings.tables}replicas")
        self.uploaded: dict[Path, tuple[str, str]] = {}  # package -> (S3 key, sha256)
        self._sizing = asyncio.Lock()
        self._wakes_recorded: dict[str, int] = {}  # replica id -> the wakes its assignment shows

    @classmethod
    def from_env(cls, logs: Path) -> "AwsBackend":
        return cls(logs, AwsSettings.from_env())

    def new_replica(self, app: str, unit: str) -> GatewayReplica:
        replica_id = f"{unit.lower().replace('.', '-')}-{uuid.uuid4().hex[:8]}"
        return GatewayReplica(replica_id, app, unit, self.logs / f"{app}.{replica_id}.log", tier=self.tier)

    def _upload(self, package: Path) -> tuple[str, str]:
        if package not in self.uploaded:
            key, digest, _ = upload_package(self.s3, self.settings.bucket, package)
            self.uploaded[package] = (key, digest)
        return self.uploaded[package]

    async def start(self, replica: GatewayReplica, package: Path, spec: FunctionSpec) -> None:
        began = time.monotonic()
        key, digest = await asyncio.to_thread(self._upload, package)
        nodes, assignments = await asyncio.gather(asyncio.to_thread(scan, self.nodes),
                                                  asyncio.to_thread(scan, self.replicas))
        prefer = place(nodes, assignments, digest, time.time(), self.settings.heartbeat_timeout)
        await asyncio.to_thread(self.replicas.put_item, Item={
            "replica_id": replica.id, "app": replica.app, "unit": replica.unit, "package": key, "sha256": digest,
            "gpus": str(spec.gpu or ""), "state": "pending", "created": str(time.time()),
        } | ({"prefer": prefer} if prefer else {}))
        await self.resize()
        deadline = began + self.settings.start_timeout
        while True:
            item = await self._item(replica)
            state = str(item.get("state")) if item is not None else "stopped"
            if item is not None and state == "ready":
                break
            if item is None or state in ("failed", "stopped") or time.monotonic() > deadline:
                if replica.state != STOPPING:  # a replica the gateway stopped meanwhile did not fail
                    error = item.get("error") if item is not None and state == "failed" else None
                    replica.fail(error or await self._why_not_started(replica, state))
                await self._forget(replica)
                return
            replica.note = f"assignment {state}" + (
                f" on node {item['node_id']}" if item.get("node_id") else ": waiting for a node"
            )
            await asyncio.sleep(POLL)
        now = time.monotonic()
        replica.host, replica.port, replica.note = item["host"], int(item["port"]), None
        replica.control_secret = item.get("control_secret")
        node_start = json.loads(item.get("start") or "{}")  # the node's supervisor's breakdown of the worker's start
        replica.tier = Tier(item.get("tier", self.tier))
        replica.timings = {
            "claim_ms": int(item.get("claim_ms", 0)),
            "pull_ms": int(item.get("pull_ms", 0)),
            "boot_ms": int(item.get("boot_ms", 0)),
            **{k: v for k, v in node_start.items() if k != "total_ms"},
            "total_ms": round((now - began) * 1000),
        }
        if replica.state != STOPPING:
            replica.ready()

    async def _why_not_started(self, replica: GatewayReplica, state: str) -> str:
        group = await asyncio.to_thread(self._group)
        nodes = [
            n
            for n in await asyncio.to_thread(scan, self.nodes)
            if time.time() - float(n.get("heartbeat", 0)) < self.settings.heartbeat_timeout
        ]
        full = " (at its MaxSize: raise max_size)" if group["DesiredCapacity"] >= group["MaxSize"] else ""
        return (
            f"start failed: assignment {replica.id} still {state} after {self.settings.start_timeout:g} s; group "
            f"{self.settings.group} wants {group['DesiredCapacity']} instances{full}, {len(nodes)} node agents alive: "
            "check the instances boot and run `python -m ember.runtime.node_agent` (its log is on the instance)"
        )

    async def _item(self, replica: GatewayReplica) -> dict | None:
        reply = await asyncio.to_thread(self.replicas.get_item, Key={"replica_id": replica.id}, ConsistentRead=True)
        return reply.get("Item")

    async def wait(self, replica: GatewayReplica) -> int:
        """Until the replica ends: 0 when it was stopped, 1 when it failed or its node went silent.

        A call routed to a parked replica wakes it in the worker; that wake is recorded here, where it is seen first
        (by the replica's wake count: it may wake and park again while this loop waits on DynamoDB).
        """
        interval, checked = min(1.0, self.settings.heartbeat_timeout / 4), 0.0
        while True:
            await self._record_wakes(replica)
            if time.monotonic() - checked < interval:
                await asyncio.sleep(POLL / 2)
                continue
            checked = time.monotonic()
            item = await self._item(replica)
            if item is None or item["state"] == "stopped":
                return 0
            if item["state"] == "failed":
                replica.error = item.get("error")
                await self._forget(replica)
                return 1
            node = (await asyncio.to_thread(self.nodes.get_item, Key={"node_id": item["node_id"]})).get("Item")
            silent = time.time() - float(node.get("heartbeat", 0)) if node else math.inf
            if silent > self.settings.heartbeat_timeout:
                replica.error = (f"node {item['node_id']} sent no heartbeat for {silent:.0f} s "
                                 f"(> {self.settings.heartbeat_timeout:g} s): the instance or its node agent is gone")
                await self._forget(replica)
                return 1

    async def park(self, replica: GatewayReplica) -> dict:
        """Park it on its node (through the node agent's relay to the worker), then record it in its assignment."""
        parked = await LocalBackend._control(replica, "park")
        await self._record_wakes(replica)  # a wake since the last park comes first in its record
        await self._record(replica, "ready", "parked", parked_bytes=parked["host_bytes"])
        if replica.state != PARKED:  # a call woke it while the park was under way
            await self._record_wakes(replica)
        return parked

    async def wake(self, replica: GatewayReplica) -> dict:
        woke = await LocalBackend._control(replica, "wake")
        await self._record_wakes(replica)
        return woke

    async def _record_wakes(self, replica: GatewayReplica) -> None:
        """Record a wake the assignment does not show yet (counted on the replica; one record however many)."""
        if replica.wakes > self._wakes_recorded.get(replica.id, 0):
            self._wakes_recorded[replica.id] = replica.wakes
            await self._record(replica, "parked", "ready", woken=str(time.time()))

    async def _record(self, replica: GatewayReplica, was: str, now: str, **values) -> None:
        """Move the assignment from `was` to `now`; a stop or failure written meanwhile wins."""
        names = {"#s": "state"} | {f"#{k}": k for k in values}
        with contextlib.suppress(ClientError):  # the condition failed: the assignment moved on without us
            await asyncio.to_thread(
                self.replicas.update_item, Key={"replica_id": replica.id}, ConditionExpression="#s = :was",
                UpdateExpression="SET " + ", ".join(["#s = :now"] + [f"#{k} = :{k}" for k in values]),
                ExpressionAttributeNames=names,
                ExpressionAttributeValues={":was": was, ":now": now} | {f":{k}": v for k, v in values.items()})

    async def stop(self, replica: GatewayReplica, grace: float = 10.0) -> None:
        """Ask its node agent to stop it; once stopped (or after `grace`), forget it and shrink the group."""
        await asyncio.to_thread(
            self.replicas.update_item,
            Key={"replica_id": replica.id},
            UpdateExpression="SET #s = :stop",
            ExpressionAttributeNames={"#s": "state"},
            ExpressionAttributeValues={":stop": "stop"},
        )
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            item = await self._item(replica)
            if item is None or item["state"] in ("stopped", "failed") or not item.get("node_id"):
                break
            await asyncio.sleep(POLL)
        await self._forget(replica)

    def prepare(self, app: str, package: Path) -> None:
        """Nothing to warm here: a node starts an app's fork server with its first replica of it."""

    async def close(self) -> None:
        """Nothing runs on this machine: the node agents stop their fork servers when they exit."""

    def prepared(self, app: str) -> dict | None:
        return None  # the nodes prepare an app when its first replica arrives

    def own_logs(self) -> set[Path]:
        return set()   # its processes run on the nodes

    async def _forget(self, replica: GatewayReplica) -> None:
        self._wakes_recorded.pop(replica.id, None)
        await asyncio.to_thread(self.replicas.delete_item, Key={"replica_id": replica.id})
        await self.resize()

    def _group(self) -> dict:
        return self.autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=[self.settings.group])[
            "AutoScalingGroups"
        ][0]

    async def resize(self) -> None:
        async with self._sizing:
            await asyncio.to_thread(self._resize)

    def _resize(self) -> None:
        """Desired capacity = nodes the active assignments need; the surplus leaves as idle instances only."""
        active = [r for r in scan(self.replicas) if r["state"] in ACTIVE + ("stop",)]
        busy = {r["node_id"] for r in active if r.get("node_id")}
        group = self._group()
        want = min(nodes_needed(len(active), self.settings.replicas_per_node, len(busy)), group["MaxSize"])
        instances = [i["InstanceId"] for i in group["Instances"] if i["LifecycleState"] in ("Pending", "InService")]
        if want > group["DesiredCapacity"]:
            log.info(
                "group %s: desired %d -> %d for %d replicas",
                self.settings.group,
                group["DesiredCapacity"],
                want,
                len(active),
            )
            self.autoscaling.set_desired_capacity(
                AutoScalingGroupName=self.settings.group, DesiredCapacity=want, HonorCooldown=False
            )
            return
        for instance in [i for i in instances if i not in busy][: max(len(instances) - want, 0)]:
            # draining first: its agent claims no new assignment between this and its termination
            self.nodes.update_item(
                Key={"node_id": instance},
                UpdateExpression="SET #s = :d",
                ExpressionAttributeNames={"#s": "state"},
                ExpressionAttributeValues={":d": "draining"},
            )
            if any(
                r.get("node_id") == instance for r in scan(self.replicas, FilterExpression=Attr("node_id").eq(instance))
            ):
                continue  # it claimed one just before the mark: keep it
            log.info("group %s: terminating idle instance %s", self.settings.group, instance)
            self.autoscaling.terminate_instance_in_auto_scaling_group(
                InstanceId=instance, ShouldDecrementDesiredCapacity=True
            )
