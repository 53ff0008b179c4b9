"""The local backend: each replica is a worker process on this machine (python -m ember.runtime.worker)."""
import asyncio
import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path

from ember.gateway.replica import FAILED, HOT, Replica

START_TIMEOUT = 600.0  # seconds a replica may take to run its enter hooks


class LocalBackend:
    # A fresh process whose package is on local disk is the node-warm tier of the ladder.
    tier = "node-warm"

    def __init__(self, logs: Path):
        self.logs = logs

    def new_replica(self, app: str, unit: str) -> Replica:
        replica_id = f"{unit.lower().replace('.', '-')}-{uuid.uuid4().hex[:8]}"
        return Replica(replica_id, app, unit, self.logs / f"{app}.{replica_id}.log", tier=self.tier)

    async def start(self, replica: Replica, package: Path) -> None:
        """Spawn the worker and wait for its ready or failed line; sets state, port, timings, error."""
        began = time.monotonic()
        with open(replica.log_path, "ab") as log:
            replica.process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "ember.runtime.worker", "--package", str(package), "--target", replica.unit,
                stdout=asyncio.subprocess.PIPE, stderr=log, stdin=asyncio.subprocess.DEVNULL,
                env=os.environ | {"PYTHONUNBUFFERED": "1"},
            )
        try:
            line = await asyncio.wait_for(replica.process.stdout.readline(), START_TIMEOUT)
        except asyncio.TimeoutError:
            line = json.dumps({"event": "failed", "phase": "enter", "error": f"no ready signal within {START_TIMEOUT:g} s"}).encode()
            replica.process.kill()
        message = json.loads(line) if line.strip() else {}
        if message.get("event") != "ready":
            code = await replica.process.wait()
            error = message.get("error") or f"worker exited with code {code} before it was ready"
            replica.state, replica.error = FAILED, f"{message.get('phase', 'start')} failed: {error}"
            return
        now = time.monotonic()
        timings = message["timings"]
        replica.timings = {
            "spawn_ms": round((message["started"] - began) * 1000),
            "import_ms": timings["import_ms"],
            "enter_ms": timings["enter_ms"],
            "total_ms": round((now - began) * 1000),
        }
        replica.port, replica.state, replica.ready_at, replica.idle_since = message["port"], HOT, now, now

    async def wait(self, replica: Replica) -> int:
        return await replica.process.wait()

    async def stop(self, replica: Replica, grace: float = 10.0) -> None:
        """SIGTERM (the worker finishes in-flight calls and runs exit hooks), then SIGKILL after `grace`."""
        process = replica.process
        if process is None or process.returncode is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), grace)
        except asyncio.TimeoutError:
            process.kill()
            await process.wait()
