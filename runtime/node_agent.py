"""The node agent: runs on each instance of the Auto Scaling Group and runs the replicas assigned to it.

    python -m ember.runtime.node_agent --instance-id ID --address HOST [--gpus N] [--slots N] [--work DIR]

It registers the instance (address, GPUs, heartbeat, the packages it holds on disk) in the nodes table, claims
pending assignments from the replicas table with a conditional write (one the gateway placed on another node that
holds its package only once that node had PREFER_GRACE to take it), pulls each package from S3 (its sha256 checked),
starts the worker under a Supervisor (the one the local backend uses), publishes it on the instance's address,
and writes back the replica's address and state. A replica whose assignment turns to "stop" is stopped. Once its
instance is marked draining and runs nothing, the agent exits: the gateway is about to terminate the instance.
Reads EMBER_AWS_BUCKET, EMBER_AWS_TABLES (default "ember-") and AWS_ENDPOINT_URL like the gateway.
"""
import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import boto3
from botocore.exceptions import ClientError

from ember.package import read_manifest
from ember.runtime import log_budget
from ember.runtime.aws import download_package, scan
from ember.runtime.supervisor import Supervisor, WorkerProcess
from ember.spec import FunctionSpec

log = logging.getLogger("ember.node_agent")
POLL = 0.2
PREFER_GRACE = 2.0  # seconds a replica placed on a node holding its package waits for that node before any may claim it


async def publish(address: str, port: int) -> asyncio.Server:
    """Relay connections to the node's address on a fresh port to a worker on 127.0.0.1:`port`.

    Workers listen on loopback only; the agent decides what the gateway can reach.
    """
    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            upstream = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(pipe(reader, upstream[1]), pipe(upstream[0], writer))

    return await asyncio.start_server(connect, address, 0)


class NodeAgent:
    def __init__(self, instance_id: str, address: str, gpus: int, slots: int, work: Path, bucket: str, tables: str,
                 prefer_grace: float = PREFER_GRACE):
        self.instance_id, self.address, self.slots, self.work, self.bucket = instance_id, address, slots, work, bucket
        self.prefer_grace = prefer_grace
        (work / "logs").mkdir(parents=True, exist_ok=True)
        (work / "packages").mkdir(parents=True, exist_ok=True)
        self.supervisor = Supervisor([str(i) for i in range(gpus)], log)
        self.gpus = gpus
        self.s3 = boto3.client("s3")
        dynamodb = boto3.resource("dynamodb")
        self.nodes, self.replicas = dynamodb.Table(f"{tables}nodes"), dynamodb.Table(f"{tables}replicas")
        self.running: dict[str, WorkerProcess] = {}
        self.tasks: set[asyncio.Task] = set()

    def holds(self) -> list[str]:
        """sha256 of every package on this node's disk: a replica of one starts here without a pull (T2)."""
        return sorted(p.stem for p in (self.work / "packages").glob("*.pkg"))

    def heartbeat(self) -> str:
        """Register or refresh this node; returns its state ("ready", or "draining" once the gateway marked it)."""
        reply = self.nodes.update_item(
            Key={"node_id": self.instance_id}, ReturnValues="ALL_NEW",
            UpdateExpression="SET address = :a, gpus = :g, slots = :n, heartbeat = :t, packages = :p, "
                             "#s = if_not_exists(#s, :ready)",
            ExpressionAttributeNames={"#s": "state"},
            ExpressionAttributeValues={":a": self.address, ":g": self.gpus, ":n": self.slots, ":t": str(time.time()),
                                       ":p": self.holds(), ":ready": "ready"},
        )
        return reply["Attributes"]["state"]

    def live_logs(self) -> set[Path]:
        """The log files still written here: its replicas' and their fork servers'."""
        return ({replica.log_path for replica in self.running.values()}
                | {server.log_path for server in self.supervisor.forkservers.values()})

    async def run(self) -> None:
        self._spawn(log_budget.keep_bounded(self.work / "logs", self.live_logs))
        while True:
            state = self.heartbeat()
            if state == "draining" and not self.running:
                log.info("node %s is draining and idle: exiting", self.instance_id)
                return
            for item in scan(self.replicas):
                free = state == "ready" and len(self.running) < self.slots
                if item["state"] == "pending" and free and self._mine(item):
                    self._claim(item)
                elif (
                    item.get("node_id") == self.instance_id
                    and item["state"] == "stop"
                    and item["replica_id"] in self.running
                ):
                    self._spawn(self._stop(self.running[item["replica_id"]]))
            await asyncio.sleep(POLL)

    def _mine(self, item: dict) -> bool:
        """Placed here, placed nowhere, or its preferred node had its chance."""
        prefer = item.get("prefer")
        return prefer in (None, self.instance_id) or time.time() - float(item["created"]) > self.prefer_grace

    def _claim(self, item: dict) -> None:
        """Take a pending assignment; the condition makes exactly one node win it."""
        try:
            self.replicas.update_item(
                Key={"replica_id": item["replica_id"]}, ConditionExpression="#s = :pending",
                UpdateExpression="SET #s = :claimed, node_id = :me, claim_ms = :ms",
                ExpressionAttributeNames={"#s": "state"},
                ExpressionAttributeValues={":pending": "pending", ":claimed": "claimed", ":me": self.instance_id,
                                           ":ms": round((time.time() - float(item["created"])) * 1000)},
            )
        except ClientError as exc:
            if exc.response["Error"]["Code"] == "ConditionalCheckFailedException":
                return  # another node won it
            raise
        replica = WorkerProcess(
            item["replica_id"],
            item["app"],
            item["unit"],
            self.work / "logs" / f"{item['app']}.{item['replica_id']}.log",
        )
        self.running[replica.id] = replica
        log.info("claimed %s (%s/%s)", replica.id, replica.app, replica.unit)
        self._spawn(self._serve(replica, item))

    def _set(self, replica: WorkerProcess, **values) -> None:
        names = {f"#{k}": k for k in values}
        self.replicas.update_item(
            Key={"replica_id": replica.id},
            UpdateExpression="SET " + ", ".join(f"#{k} = :{k}" for k in values),
            ExpressionAttributeNames=names,
            ExpressionAttributeValues={f":{k}": v for k, v in values.items()},
            ConditionExpression="attribute_exists(replica_id)",
        )

    async def _serve(self, replica: WorkerProcess, item: dict) -> None:
        try:
            began = time.monotonic()
            held = item["sha256"] in self.holds()
            package = await asyncio.to_thread(download_package, self.s3, self.bucket, item["package"], item["sha256"],
                                              self.work / "packages")
            pulled = time.monotonic()
            spec = FunctionSpec(**read_manifest(package)["units"][replica.unit]["spec"])
            if not await self.supervisor.start(replica, package, spec, pulled=not held):
                if replica.error:  # else it was stopped while it started, and _stop wrote that
                    self._set(replica, state="failed", error=replica.error)
                return
            assert replica.port is not None  # start() returned True: it serves on its port
            relay = await publish(self.address, replica.port)
            public = relay.sockets[0].getsockname()[1]
            self._set(replica, state="ready", host=self.address, port=public, control_secret=replica.control_secret,
                      pull_ms=round((pulled - began) * 1000),
                      boot_ms=round((time.monotonic() - pulled) * 1000),
                      tier=str(replica.tier), start=json.dumps(replica.timings))
            log.info(
                "replica %s ready on %s:%s (worker on 127.0.0.1:%s)", replica.id, self.address, public, replica.port
            )
            async with relay:
                code = await self.supervisor.wait(replica)
            if not replica.stopping:
                self._set(
                    replica,
                    state="failed",
                    error=f"worker exited with code {code} while serving "
                    f"(log on node {self.instance_id}: {replica.log_path})",
                )
        except ClientError as exc:  # the gateway forgot the assignment (it gave up or was stopped): stop serving it
            log.info("replica %s: assignment gone (%s); stopping", replica.id, exc.response["Error"]["Code"])
            await self.supervisor.stop(replica)
        except Exception as exc:  # a failed pull or a bad package is this assignment's failure, not the agent's
            log.exception("replica %s failed", replica.id)
            with contextlib.suppress(ClientError):
                self._set(
                    replica,
                    state="failed",
                    error=f"start failed on node {self.instance_id}: {type(exc).__name__}: {exc}",
                )
            await self.supervisor.stop(replica)
        finally:
            self.running.pop(replica.id, None)

    async def _stop(self, replica: WorkerProcess) -> None:
        await self.supervisor.stop(replica)
        with contextlib.suppress(ClientError):  # the gateway may already have forgotten it
            self._set(replica, state="stopped")

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def stop_all(self) -> None:
        await asyncio.gather(*(self.supervisor.stop(r) for r in list(self.running.values())))
        await self.supervisor.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ember.runtime.node_agent", description=__doc__.splitlines()[0])
    parser.add_argument("--instance-id", required=True, help="this instance's EC2 id (from the instance metadata)")
    parser.add_argument("--address", required=True, help="the address the gateway reaches this instance at")
    parser.add_argument("--gpus", type=int, default=0, help="GPUs on this instance (default 0)")
    parser.add_argument("--slots", type=int, default=1, help="replicas this instance runs at once (default 1)")
    parser.add_argument("--work", type=Path, default=Path(os.environ.get("EMBER_HOME", "/var/lib/ember")),
                        help="where packages and replica logs go")
    parser.add_argument("--prefer-grace", type=float, default=PREFER_GRACE,
                        help=f"seconds a replica placed on another node (it holds the package) waits for that node "
                             f"before this one may claim it (default {PREFER_GRACE:g})")
    args = parser.parse_args(argv)
    if not 0 <= args.prefer_grace < float("inf"):
        parser.error("--prefer-grace: give a number of seconds, 0 or more")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    bucket = os.environ.get("EMBER_AWS_BUCKET")
    if not bucket:
        print("error: set EMBER_AWS_BUCKET to the bucket the gateway uploads packages to", file=sys.stderr)
        return 2
    agent = NodeAgent(
        args.instance_id,
        args.address,
        args.gpus,
        args.slots,
        args.work,
        bucket,
        os.environ.get("EMBER_AWS_TABLES", "ember-"),
        args.prefer_grace,
    )

    async def run() -> None:
        task = asyncio.current_task()
        assert task is not None  # run() is a task of asyncio.run
        for sig in (signal.SIGTERM, signal.SIGINT):  # stop the replicas (their exit hooks run) before leaving
            asyncio.get_running_loop().add_signal_handler(sig, task.cancel)
        try:
            await agent.run()
        except asyncio.CancelledError:
            pass
        finally:
            await agent.stop_all()

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
