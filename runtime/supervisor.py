"""Runs replicas' worker processes on this machine: hands out GPUs, spawns `python -m ember.runtime.worker`,
reads its ready or failed line, and stops it (SIGTERM, then SIGKILL). The local backend and the node agent both use it."""
import asyncio
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ember.spec import FunctionSpec

START_TIMEOUT = 600.0  # seconds a replica may take to run its enter hooks


@dataclass(eq=False)
class WorkerProcess:
    """One replica's worker process, as the supervisor that runs it sees it."""

    id: str
    app: str
    unit: str
    log_path: Path
    process: asyncio.subprocess.Process | None = None
    port: int | None = None  # where it serves once ready (on 127.0.0.1 when a supervisor here runs it)
    control_secret: str | None = None  # the worker's, sent with every request to its /__ember__/ routes
    gpus: list[str] = field(default_factory=list)  # CUDA_VISIBLE_DEVICES it was given
    timings: dict[str, int] = field(default_factory=dict)  # spawn/import/enter/total ms of its start
    error: str | None = None
    note: str | None = None  # why it waits (for a GPU, a node) or runs degraded (no GPU here)
    stopping: bool = False  # stop() was called: a start still under way must not leave it running


def detect_gpus() -> list[str]:
    """GPU indices from EMBER_GPUS=0,1,... or `nvidia-smi -L`; never initialises CUDA in the caller."""
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


class GpuPool:
    """Hands out whole GPUs to workers; a start that finds too few free waits for a release."""

    def __init__(self, gpus: list[str]):
        self.gpus = gpus
        self.holders: dict[str, str] = {}  # gpu -> worker id
        self.waiting = 0  # starts waiting for a GPU: the gateway's autoscaler evicts a parked holder for them
        self._released = asyncio.Condition()

    def free(self) -> list[str]:
        return [g for g in self.gpus if g not in self.holders]

    async def acquire(self, worker: WorkerProcess, count: int) -> list[str]:
        async with self._released:
            while len(self.free()) < count:
                worker.note = (f"waiting for {count} free GPU(s): {len(self.free())} of {len(self.gpus)} free, "
                               f"held by {sorted(set(self.holders.values()))}")
                self.waiting += 1
                try:
                    await self._released.wait()
                finally:
                    self.waiting -= 1
            worker.note = None
            taken = self.free()[:count]
            self.holders.update(dict.fromkeys(taken, worker.id))
            return taken

    async def release(self, worker: WorkerProcess) -> None:
        async with self._released:
            held = [g for g, holder in self.holders.items() if holder == worker.id]
            for gpu in held:
                del self.holders[gpu]
            if held:
                self._released.notify_all()


class Supervisor:
    """Starts, watches and stops the worker processes of this machine, each with the GPUs its function asks for."""

    def __init__(self, gpus: list[str], log: logging.Logger):
        self.gpus, self.log = GpuPool(gpus), log  # the caller's log: the gateway's, or the node agent's
        self.require_gpu = os.environ.get("EMBER_REQUIRE_GPU") == "1"  # a gpu= function must not quietly run on CPU

    async def _devices(self, worker: WorkerProcess, spec: FunctionSpec) -> str | None:
        """CUDA_VISIBLE_DEVICES for the worker; None when it cannot have what it asks for (worker.error says why)."""
        count = gpu_count(spec)
        if count == 0:
            return ""  # a function without gpu= must not grab a GPU another replica was given
        if not self.gpus.gpus:
            if self.require_gpu:
                worker.error = f"start failed: gpu={spec.gpu!r} but this machine has no GPU (EMBER_REQUIRE_GPU=1); unset it to run on CPU"
                return None
            worker.note = f"gpu={spec.gpu!r} asked for, but this machine has no GPU: running on CPU"
            self.log.warning("replica %s: %s", worker.id, worker.note)
            return ""
        if count > len(self.gpus.gpus):
            worker.error = (f"start failed: gpu={spec.gpu!r} asks for {count} GPUs but this machine has {len(self.gpus.gpus)}; "
                            f"lower the count in gpu=")
            return None
        worker.gpus = await self.gpus.acquire(worker, count)
        return ",".join(worker.gpus)

    async def start(self, worker: WorkerProcess, package: Path, spec: FunctionSpec) -> bool:
        """Spawn the worker and wait for its ready line: True once it serves on 127.0.0.1:`worker.port`.

        False when it failed (worker.error says why) or was stopped before it was ready (worker.stopping).
        """
        began = time.monotonic()
        devices = await self._devices(worker, spec)
        if devices is None:
            return False
        if worker.stopping:  # stopped (redeploy, shutdown) while it waited for a GPU
            await self.gpus.release(worker)
            return False
        with open(worker.log_path, "ab") as log_file:
            worker.process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "ember.runtime.worker", "--package", str(package), "--target", worker.unit,
                stdout=asyncio.subprocess.PIPE, stderr=log_file, stdin=asyncio.subprocess.DEVNULL,
                env=os.environ | {"PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": devices},
            )
        try:
            line = await asyncio.wait_for(worker.process.stdout.readline(), START_TIMEOUT)
        except asyncio.TimeoutError:
            line = json.dumps({"event": "failed", "phase": "enter", "error": f"no ready signal within {START_TIMEOUT:g} s"}).encode()
            worker.process.kill()
        message = json.loads(line) if line.strip() else {}
        if message.get("event") != "ready":
            code = await worker.process.wait()
            await self.gpus.release(worker)
            if not worker.stopping:  # a worker that exits because it was told to is not a failed start
                error = message.get("error") or f"worker exited with code {code} before it was ready"
                worker.error = f"{message.get('phase', 'start')} failed: {error}"
            return False
        if worker.stopping:  # stopped while it started: it must not outlive its stop
            await self.stop(worker)
            return False
        timings = message["timings"]
        worker.timings = {
            "spawn_ms": round((message["started"] - began) * 1000),
            "import_ms": timings["import_ms"],
            "enter_ms": timings["enter_ms"],
            **{k: timings[k] for k in ("weights", "weights_ms") if k in timings},  # snapshot or full, from the engine
            "total_ms": round((time.monotonic() - began) * 1000),
        }
        worker.port, worker.control_secret = message["port"], message["control_secret"]
        return True

    async def wait(self, worker: WorkerProcess) -> int:
        """Until the worker exits; its exit code."""
        code = await worker.process.wait()
        await self.gpus.release(worker)
        return code

    async def stop(self, worker: WorkerProcess, grace: float = 10.0) -> None:
        """SIGTERM (the worker finishes in-flight calls and runs exit hooks), then SIGKILL after `grace`."""
        worker.stopping = True
        process = worker.process
        if process is None or process.returncode is not None:
            await self.gpus.release(worker)
            return
        process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), grace)
        except asyncio.TimeoutError:
            process.kill()
            await process.wait()
        await self.gpus.release(worker)
