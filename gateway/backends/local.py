"""The local backend: each replica is a worker process on this machine (python -m ember.runtime.worker)."""
import asyncio
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx

from ember.gateway.replica import FAILED, HOT, STOPPING, Replica
from ember.spec import FunctionSpec

log = logging.getLogger("ember.gateway")
START_TIMEOUT = 600.0  # seconds a replica may take to run its enter hooks
PARKED_RAM_FRACTION = 0.25  # of the machine's RAM, when `ember serve --parked-ram` is not given
SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'8GiB', '512MB', '1.5G', '1000' -> bytes (K/M/G/T are powers of 1024 with or without the i)."""
    match = SIZE.match(text)
    if not match:
        raise ValueError(f"cannot read {text!r} as a size; write it like 8GiB, 512MiB or a number of bytes")
    unit = (match[2] or "B").upper()[0]
    return int(float(match[1]) * 1024 ** "BKMGT".index(unit))


def machine_ram() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def detect_gpus() -> list[str]:
    """GPU indices from EMBER_GPUS=0,1,... or `nvidia-smi -L`; never initialises CUDA in the gateway."""
    listed = os.environ.get("EMBER_GPUS")
    if listed is not None:
        return [g.strip() for g in listed.split(",") if g.strip()]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


def gpu_count(spec: FunctionSpec) -> int:
    if spec.gpu is None:
        return 0
    _, _, count = spec.gpu.partition(":")
    return int(count or 1)


def parked_over_budget(parked: list[tuple[str, int, float]], budget: int) -> list[str]:
    """Parked replicas (id, host bytes, parked at) to evict, oldest first, until the rest fit in `budget` bytes."""
    total = sum(size for _, size, _ in parked)
    evict = []
    for replica_id, size, _ in sorted(parked, key=lambda p: p[2]):
        if total <= budget:
            break
        evict.append(replica_id)
        total -= size
    return evict


class GpuPool:
    """Hands out whole GPUs to replicas; a start that finds too few free waits for a release."""

    def __init__(self, gpus: list[str]):
        self.gpus = gpus
        self.holders: dict[str, str] = {}  # gpu -> replica id
        self.waiting = 0  # starts waiting for a GPU: the autoscaler evicts a parked holder for them
        self._released = asyncio.Condition()

    def free(self) -> list[str]:
        return [g for g in self.gpus if g not in self.holders]

    async def acquire(self, replica: Replica, count: int) -> list[str]:
        async with self._released:
            while len(self.free()) < count:
                replica.note = (f"waiting for {count} free GPU(s): {len(self.free())} of {len(self.gpus)} free, "
                                f"held by {sorted(set(self.holders.values()))}")
                self.waiting += 1
                try:
                    await self._released.wait()
                finally:
                    self.waiting -= 1
            replica.note = None
            taken = self.free()[:count]
            self.holders.update(dict.fromkeys(taken, replica.id))
            return taken

    async def release(self, replica: Replica) -> None:
        async with self._released:
            held = [g for g, holder in self.holders.items() if holder == replica.id]
            for gpu in held:
                del self.holders[gpu]
            if held:
                self._released.notify_all()


class LocalBackend:
    # A fresh process whose package is on local disk is the node-warm tier of the ladder.
    tier = "node-warm"
    can_park = True

    def __init__(self, logs: Path, parked_ram: int | None = None, gpus: list[str] | None = None):
        self.logs = logs
        self.parked_ram = int(machine_ram() * PARKED_RAM_FRACTION) if parked_ram is None else parked_ram
        self.gpus = GpuPool(detect_gpus() if gpus is None else gpus)
        self.require_gpu = os.environ.get("EMBER_REQUIRE_GPU") == "1"

    def new_replica(self, app: str, unit: str) -> Replica:
        replica_id = f"{unit.lower().replace('.', '-')}-{uuid.uuid4().hex[:8]}"
        return Replica(replica_id, app, unit, self.logs / f"{app}.{replica_id}.log", tier=self.tier)

    async def _devices(self, replica: Replica, spec: FunctionSpec) -> str | None:
        """CUDA_VISIBLE_DEVICES for the replica; None when it cannot have what it asks for (replica.error says why)."""
        count = gpu_count(spec)
        if count == 0:
            return ""  # a function without gpu= must not grab a GPU another replica was given
        if not self.gpus.gpus:
            if self.require_gpu:
                replica.error = f"start failed: gpu={spec.gpu!r} but this machine has no GPU (EMBER_REQUIRE_GPU=1); unset it to run on CPU"
                return None
            replica.note = f"gpu={spec.gpu!r} asked for, but this machine has no GPU: running on CPU"
            log.warning("replica %s: %s", replica.id, replica.note)
            return ""
        if count > len(self.gpus.gpus):
            replica.error = (f"start failed: gpu={spec.gpu!r} asks for {count} GPUs but this machine has {len(self.gpus.gpus)}; "
                             f"lower the count in gpu=")
            return None
        replica.gpus = await self.gpus.acquire(replica, count)
        return ",".join(replica.gpus)

    async def start(self, replica: Replica, package: Path, spec: FunctionSpec) -> None:
        """Spawn the worker and wait for its ready or failed line; sets state, port, timings, error."""
        began = time.monotonic()
        devices = await self._devices(replica, spec)
        if devices is None:
            replica.state = FAILED
            return
        if replica.state == STOPPING:  # stopped (redeploy, shutdown) while it waited for a GPU
            await self.gpus.release(replica)
            return
        with open(replica.log_path, "ab") as log_file:
            replica.process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "ember.runtime.worker", "--package", str(package), "--target", replica.unit,
                stdout=asyncio.subprocess.PIPE, stderr=log_file, stdin=asyncio.subprocess.DEVNULL,
                env=os.environ | {"PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": devices},
            )
        try:
            line = await asyncio.wait_for(replica.process.stdout.readline(), START_TIMEOUT)
        except asyncio.TimeoutError:
            line = json.dumps({"event": "failed", "phase": "enter", "error": f"no ready signal within {START_TIMEOUT:g} s"}).encode()
            replica.process.kill()
        message = json.loads(line) if line.strip() else {}
        if message.get("event") != "ready":
            code = await replica.process.wait()
            await self.gpus.release(replica)
            error = message.get("error") or f"worker exited with code {code} before it was ready"
            replica.state, replica.error = FAILED, f"{message.get('phase', 'start')} failed: {error}"
            return
        if replica.state == STOPPING:  # stopped while it started: it must not outlive its stop
            await self.stop(replica)
            return
        now = time.monotonic()
        timings = message["timings"]
        replica.timings = {
            "spawn_ms": round((message["started"] - began) * 1000),
            "import_ms": timings["import_ms"],
            "enter_ms": timings["enter_ms"],
            **{k: timings[k] for k in ("weights", "weights_ms") if k in timings},  # snapshot or full, from the engine
            "total_ms": round((now - began) * 1000),
        }
        replica.port, replica.state, replica.ready_at, replica.idle_since = message["port"], HOT, now, now

    async def wait(self, replica: Replica) -> int:
        code = await replica.process.wait()
        await self.gpus.release(replica)
        return code

    async def park(self, replica: Replica) -> dict:
        """Ask the worker to release its GPU memory; the reply says how much host RAM it holds parked."""
        return await self._control(replica, "park")

    async def wake(self, replica: Replica) -> dict:
        return await self._control(replica, "wake")

    @staticmethod
    async def _control(replica: Replica, action: str) -> dict:
        async with httpx.AsyncClient(timeout=60) as client:
            reply = await client.post(f"http://{replica.address}/__ember__/{action}")
        reply.raise_for_status()
        return reply.json()

    async def stop(self, replica: Replica, grace: float = 10.0) -> None:
        """SIGTERM (the worker finishes in-flight calls and runs exit hooks), then SIGKILL after `grace`."""
        process = replica.process
        if process is None or process.returncode is not None:
            await self.gpus.release(replica)
            return
        process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), grace)
        except asyncio.TimeoutError:
            process.kill()
            await process.wait()
        await self.gpus.release(replica)
