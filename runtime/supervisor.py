"""Runs replicas' worker processes on this machine: hands out GPUs, starts each worker by a fork of its app's fork
server (runtime/forkserver.py) or else a spawn of `python -m ember.runtime.worker`, reads its ready or failed line,
and stops it (SIGTERM, then SIGKILL). The local backend and the node agent both use it.

One fork server runs per app, for the package version it last started: a start with another package (a deploy)
replaces it, and one that died is restarted while that start is spawned. EMBER_FORK_SERVER=0 spawns every worker."""
import asyncio
import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ember.runtime import control, environments, forkserver
from ember.runtime.tiers import Tier, start_tier
from ember.spec import FunctionSpec

START_TIMEOUT = 600.0  # seconds a replica may take to run its enter hooks


@dataclass(eq=False)
class WorkerProcess:
    """One replica's worker process, as the supervisor that runs it sees it."""

    id: str
    app: str
    unit: str
    log_path: Path
    process: "asyncio.subprocess.Process | ForkedProcess | None" = None
    port: int | None = None  # where it serves once ready (on 127.0.0.1 when a supervisor here runs it)
    control_secret: str | None = None  # the worker's, sent with every request to its /__ember__/ routes
    gpus: list[str] = field(default_factory=list)  # CUDA_VISIBLE_DEVICES it was given
    timings: dict[str, int | str] = field(default_factory=dict)  # how its start went: fork or spawn, ms per phase
    tier: Tier = Tier.NODE_WARM  # the cold-start tier its last start or wake came from
    error: str | None = None
    note: str | None = None  # why it waits (for a GPU, a node) or runs degraded (no GPU here)
    stopping: bool = False  # stop() was called: a start still under way must not leave it running
    forked_from: str | None = None  # the socket of the fork server that forked it (its GPU's standby goes there)


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


def gpu_architectures() -> str | None:
    """The GPUs' compute capabilities as flashinfer's FLASHINFER_CUDA_ARCH_LIST wants them ("9.0"), from
    `nvidia-smi` (never CUDA): with it a fork server can import flashinfer without a GPU. None when unknown."""
    if os.environ.get("FLASHINFER_CUDA_ARCH_LIST"):
        return os.environ["FLASHINFER_CUDA_ARCH_LIST"]
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    caps = sorted({line.strip() for line in out.stdout.splitlines() if re.fullmatch(r"\d+\.\d+", line.strip())})
    return " ".join(caps) if out.returncode == 0 and caps else None


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


EXIT_UNKNOWN = 255  # a forked worker whose fork server went away: its exit code cannot be read


class ForkedProcess:
    """A worker forked by a fork server, with the part of asyncio.subprocess.Process the supervisor uses: its
    stdout (the control channel), wait(), send_signal() and kill(). Its exit code comes over the fork request's
    connection; if that closes first (the fork server died), its pid is watched and the code is EXIT_UNKNOWN."""

    def __init__(self, pid: int, stdout: asyncio.StreamReader, conn: socket.socket, lifeline: int, launched: float):
        self.pid, self.stdout = pid, stdout
        self.returncode: int | None = None
        self.launched = launched  # when the fork began: once the unit's snap=True hooks ran, if it waited for them
        self._conn, self._lifeline = conn, lifeline  # the lifeline's write end: the worker ends when it closes
        self._exit = asyncio.ensure_future(self._watch())

    async def _watch(self) -> int:
        loop = asyncio.get_running_loop()
        try:
            message = forkserver.decode(await loop.sock_recv(self._conn, forkserver.MAX_MESSAGE))
        except OSError:
            message = None
        code = message.code if isinstance(message, forkserver.Exited) else await self._watch_pid()
        self._conn.close()
        os.close(self._lifeline)
        self.returncode = code
        return code

    async def _watch_pid(self) -> int:
        try:
            pidfd = os.pidfd_open(self.pid)
        except ProcessLookupError:
            return EXIT_UNKNOWN
        exited = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_reader(pidfd, exited.set)
        try:
            await exited.wait()
        finally:
            loop.remove_reader(pidfd)
            os.close(pidfd)
        return EXIT_UNKNOWN

    async def wait(self) -> int:
        return await asyncio.shield(self._exit)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


@dataclass(eq=False)
class ForkServerProcess:
    """One app's fork server, as its supervisor sees it."""

    app: str
    package: Path
    socket_path: str
    log_path: Path
    process: asyncio.subprocess.Process | None = None
    ready: "asyncio.Future[str | None]" = field(init=False)  # None once it serves, or why it cannot; set at creation
    import_ms: int | None = None
    # unit -> its template's outcome, as the fork server reports them: {"snap_ms": N} or {"refused": why}
    templates: dict[str, dict] = field(default_factory=dict)
    reader: asyncio.Task | None = None
    key: str = ""  # its entry in Supervisor.forkservers: the app, plus its environment's key when it has one
    python: str = sys.executable  # the interpreter of the units' environment (runtime/environments.py)
    units: tuple[str, ...] = ()  # the units it forks, when not every unit of the package shares its environment

    def status(self) -> dict:
        """For `ember status`: importing, ready (with each unit's template) or why it cannot serve."""
        if not self.ready.done() or self.ready.cancelled():
            return {"state": "importing"}
        if self.ready.result() is not None:
            return {"state": "failed", "reason": self.ready.result()}
        running = self.process is not None and self.process.returncode is None
        return {"state": "ready" if running else "exited", "import_ms": self.import_ms,
                "templates": dict(self.templates)}

    def died(self) -> str | None:
        """Why it no longer serves when it did once, else None."""
        served = self.ready.done() and self.ready.result() is None
        if served and self.process is not None and self.process.returncode is not None:
            return f"the fork server of {self.app} exited with code {self.process.returncode} (log: {self.log_path})"
        return None


class Supervisor:
    """Starts, watches and stops the worker processes of this machine, each with the GPUs its function asks for."""

    def __init__(self, gpus: list[str], log: logging.Logger, fork: bool | None = None):
        self.gpus, self.log = GpuPool(gpus), log  # the caller's log: the gateway's, or the node agent's
        self.require_gpu = os.environ.get("EMBER_REQUIRE_GPU") == "1"  # a gpu= function must not quietly run on CPU
        self.fork = os.environ.get("EMBER_FORK_SERVER", "1") != "0" if fork is None else fork
        # a GPU that a forked replica gave back gets a standby of its unit (forkserver.Standby), CUDA initialised,
        # for the next replica there (EMBER_GPU_STANDBY=0 turns it off). On the H200 it took the 4B shape's T2 start
        # with a warm page cache from 1.168 to 0.776 s (bench/coldstart.py --no-standby for the other side)
        self.standby = os.environ.get("EMBER_GPU_STANDBY", "1") != "0"
        self.standbys: dict[str, tuple[str, str, str]] = {}  # gpu -> (app, unit, fork server socket) of its standby
        self.forkservers: dict[str, ForkServerProcess] = {}  # app -> the fork server of its latest package
        self._sockets: str | None = None  # a short private directory: Unix socket paths must fit in 108 bytes

    async def _devices(self, worker: WorkerProcess, spec: FunctionSpec) -> str | None:
        """CUDA_VISIBLE_DEVICES for the worker; None when it cannot have what it asks for (worker.error says why)."""
        count = gpu_count(spec)
        if count == 0:
            return ""  # a function without gpu= must not grab a GPU another replica was given
        if not self.gpus.gpus:
            if self.require_gpu:
                worker.error = (f"start failed: gpu={spec.gpu!r} but this machine has no GPU (EMBER_REQUIRE_GPU=1); "
                                "unset it to run on CPU")
                return None
            worker.note = f"gpu={spec.gpu!r} asked for, but this machine has no GPU: running on CPU"
            self.log.warning("replica %s: %s", worker.id, worker.note)
            return ""
        if count > len(self.gpus.gpus):
            worker.error = (
                f"start failed: gpu={spec.gpu!r} asks for {count} GPUs but this machine has {len(self.gpus.gpus)}; "
                f"lower the count in gpu="
            )
            return None
        worker.gpus = await self.gpus.acquire(worker, count)
        for gpu in worker.gpus:   # a standby of another unit would hold memory this replica's start sizes from
            if self.standbys.get(gpu, (None, None))[:2] != (worker.app, worker.unit) or count != 1:
                await self._drop_standby(gpu)
        return ",".join(worker.gpus)

    async def _keep_standby(self, worker: WorkerProcess) -> None:
        """After a forked single-GPU replica that served gave its GPU back: ask its fork server for a standby there."""
        if not (self.standby and worker.forked_from and worker.port is not None and len(worker.gpus) == 1):
            return
        gpu = worker.gpus[0]
        if gpu in self.gpus.holders or gpu in self.standbys or self.gpus.waiting:  # taken, or about to be
            return
        env = os.environ | {"PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": gpu}
        # recorded first: a start that takes the GPU meanwhile finds it and drops it (after this message)
        self.standbys[gpu] = (worker.app, worker.unit, worker.forked_from)
        if not await self._tell(worker.forked_from, forkserver.Standby(worker.unit, env)):
            if self.standbys.get(gpu) == (worker.app, worker.unit, worker.forked_from):
                del self.standbys[gpu]

    async def _drop_standby(self, gpu: str) -> None:
        """End the standby kept on `gpu`, if any."""
        kept = self.standbys.pop(gpu, None)
        if kept is not None:
            await self._tell(kept[2], forkserver.Standby(kept[1], {"CUDA_VISIBLE_DEVICES": gpu}, drop=True))

    async def _tell(self, socket_path: str, message: "forkserver.Standby") -> bool:
        """Send a fork server a message that has no answer; False when it cannot be reached."""
        loop = asyncio.get_running_loop()
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
            conn.setblocking(False)
            try:
                await asyncio.wait_for(loop.sock_connect(conn, socket_path), 5)
                forkserver.send(conn, message)
            except (OSError, TimeoutError):
                return False
        return True

    async def start(self, worker: WorkerProcess, package: Path, spec: FunctionSpec, pulled: bool = False) -> bool:
        """Fork (or else spawn) the worker and wait for its ready line: True once it serves on 127.0.0.1:`worker.port`.

        False when it failed (worker.error says why) or was stopped before it was ready (worker.stopping).
        `pulled`: the package came from the object store (the start's tier says so).
        """
        began = time.monotonic()
        python = environments.python_for(spec.requirements)
        if python is None:  # a deploy installs it; a node that got the package from elsewhere installs it now
            try:
                python = await asyncio.to_thread(environments.ensure, spec.requirements)
            except environments.InstallError as exc:
                worker.error = f"start failed: {exc}"
                return False
        devices = await self._devices(worker, spec)
        if devices is None:
            return False
        if worker.stopping:  # stopped (redeploy, shutdown) while it waited for a GPU
            await self.gpus.release(worker)
            return False
        env = os.environ | {"PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": devices}
        how: dict[str, int | str] = {}  # how the process came to be: fork or spawn, a fallback's reason, waits
        if worker.gpus and (gpu_wait := round((time.monotonic() - began) * 1000)):
            how["gpu_wait_ms"] = gpu_wait
        forked = await self._fork(worker, package, env, how, spec.requirements) if self.fork else None
        if len(worker.gpus) == 1 and worker.gpus[0] in self.standbys:   # a standby of this unit was kept there
            if how.get("start") == "standby":
                del self.standbys[worker.gpus[0]]   # it is this replica now
            else:   # forked afresh or spawned beside it: its context's memory goes back
                await self._drop_standby(worker.gpus[0])
        process: asyncio.subprocess.Process | ForkedProcess
        if forked is not None:
            process, stdout, launched = forked, forked.stdout, forked.launched
        else:
            launched = time.monotonic()
            with open(worker.log_path, "ab") as log_file:
                process = await asyncio.create_subprocess_exec(
                    python, "-m", "ember.runtime.worker", "--package", str(package), "--target", worker.unit,
                    stdout=asyncio.subprocess.PIPE, stderr=log_file, stdin=asyncio.subprocess.DEVNULL, env=env,
                )
            stdout = piped_stdout(process)
            how["start"] = "spawn"
        worker.process = process
        message: control.ControlMessage | None
        try:
            message = control.decode(await asyncio.wait_for(stdout.readline(), START_TIMEOUT))
        except TimeoutError:
            message = control.Failed("enter", f"no ready signal within {START_TIMEOUT:g} s")
            process.kill()
        if not isinstance(message, control.Ready):
            code = await process.wait()
            await self.gpus.release(worker)
            if not worker.stopping:  # a worker that exits because it was told to is not a failed start
                worker.error = f"{message.phase} failed: {message.error}" if message is not None else \
                    f"start failed: worker exited with code {code} before it was ready"
            return False
        if worker.stopping:  # stopped while it started: it must not outlive its stop
            await self.stop(worker)
            return False
        worker.timings = start_breakdown(how, message, began, launched, time.monotonic())
        weights = message.timings.get("weights")
        worker.tier = start_tier(weights if isinstance(weights, str) else None, pulled)
        worker.port, worker.control_secret = message.port, message.control_secret
        log = self.log.warning if "fallback" in how else self.log.info
        log("replica %s started: %s %s", worker.id, worker.tier, worker.timings)
        return True

    async def _fork(self, worker: WorkerProcess, package: Path, env: dict[str, str], how: dict[str, int | str],
                    requirements: list[str]) -> "ForkedProcess | None":
        """Fork the worker from its app's fork server; None (and how["fallback"] says why) when it cannot be."""
        asked = time.monotonic()
        server = self._forkserver(worker.app, package, worker.log_path.parent, requirements)
        importing = not server.ready.done()
        reason = server.died()
        if reason is not None:  # a fresh one for the next start, a spawn for this one
            reason += "; restarted"
            self._retire(server)
            self._forkserver(worker.app, package, worker.log_path.parent, requirements)
        else:  # one that could not start (its imports failed, or touched CUDA) stays refused for this package
            try:
                reason = await asyncio.shield(server.ready)
            except asyncio.CancelledError:
                if not server.ready.cancelled():  # this start itself was cancelled
                    raise
                reason = f"the fork server of {worker.app} was replaced by another version's while this start waited"
        if reason is None:
            if importing:  # this start waited for the fork server's imports
                how["forkserver_wait_ms"] = round((time.monotonic() - asked) * 1000)
            try:
                return await self._request_fork(server, worker, env, how)
            except (OSError, ValueError) as exc:
                reason = f"the fork server of {worker.app} did not answer ({type(exc).__name__}: {exc}); restarting it"
                self._retire(server)
                self._forkserver(worker.app, package, worker.log_path.parent, requirements)
        how["fallback"] = reason
        return None

    async def _request_fork(self, server: ForkServerProcess, worker: WorkerProcess, env: dict[str, str],
                            how: dict[str, int | str]) -> "ForkedProcess | None":
        loop = asyncio.get_running_loop()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.setblocking(False)
        control_read, control_write = os.pipe()
        lifeline_read, lifeline_write = os.pipe()
        ours = [control_read, lifeline_write]  # closed on the way out unless a worker now holds the other ends
        theirs = [control_write, lifeline_read]  # the child's copies travel to the fork server; these always close
        try:
            theirs.append(os.open(worker.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644))
            await loop.sock_connect(conn, server.socket_path)
            requested = time.monotonic()
            forkserver.send(conn, forkserver.ForkRequest(worker.unit, env), [control_write, theirs[2], lifeline_read])
            forkserver.close_fds(theirs)
            theirs = []
            answer = await asyncio.wait_for(loop.sock_recv(conn, forkserver.MAX_MESSAGE), START_TIMEOUT)
            reply = forkserver.decode(answer)
            if not isinstance(reply, forkserver.Forked):
                how["fallback"] = reply.reason if isinstance(reply, forkserver.Refused) else \
                    f"the fork server of {worker.app} closed the request without an answer"
                return None
            how["start"] = "standby" if reply.standby else "fork"
            worker.forked_from = server.socket_path
            if reply.snap_ms is not None:
                how["snap_ms"] = reply.snap_ms  # this start waited for the unit's snap=True hooks in the fork server
            stdout = asyncio.StreamReader()
            pipe = open(control_read, "rb", buffering=0)
            await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdout), pipe)
            ours = []
            return ForkedProcess(reply.pid, stdout, conn, lifeline_write, requested + (reply.snap_ms or 0) / 1000)
        finally:
            forkserver.close_fds(theirs + ours)
            if ours:
                conn.close()

    def prepare(self, app: str, package: Path, logs: Path) -> None:
        """Start the app's fork servers for `package` ahead of its first replica (no-op when they run already): one
        per environment whose requirements are installed."""
        if self.fork:
            for requirements in environments.groups(package):
                if environments.python_for(list(requirements)) is not None:
                    self._forkserver(app, package, logs, list(requirements))

    def _forkserver(self, app: str, package: Path, logs: Path, requirements: list[str]) -> ForkServerProcess:
        """The fork server of the app's units with these requirements, for `package`: the running one, or a new one
        (replacing another version's)."""
        key = app if not requirements else f"{app}+{environments.environment_key(requirements)}"
        server = self.forkservers.get(key)
        if server is not None and server.package == package:
            return server
        for old in [s for s in self.forkservers.values() if s.app == app and s.package != package]:
            self._retire(old)
        if self._sockets is None:
            self._sockets = tempfile.mkdtemp(prefix="ember-fork-")
        version = hashlib.sha256(f"{package}\0{key}".encode()).hexdigest()[:12]
        groups = environments.groups(package)
        units = tuple(groups.get(tuple(requirements), ())) if len(groups) > 1 else ()
        server = ForkServerProcess(app, package, os.path.join(self._sockets, f"{version}.sock"),
                                   logs / f"{app}.forkserver-{version}.log", key=key,
                                   python=environments.python_for(requirements) or sys.executable, units=units)
        server.ready = asyncio.ensure_future(self._launch(server))
        self.forkservers[key] = server
        return server

    async def _launch(self, server: ForkServerProcess) -> str | None:
        """Start the fork server and wait for its ready line: None once it serves, else why it cannot."""
        # No GPU before the fork. torch keeps the first device count it is given for the process's life, forks
        # included: asked through NVML, torch.cuda.is_available() in the fork server caches nothing.
        env = os.environ | {"PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": "", "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
        if self.gpus.gpus and (archs := await asyncio.to_thread(gpu_architectures)):
            env["FLASHINFER_CUDA_ARCH_LIST"] = archs  # what it would ask the GPU: the fork server may import it
        with open(server.log_path, "ab") as log_file:
            server.process = process = await asyncio.create_subprocess_exec(
                server.python, "-m", "ember.runtime.forkserver", "--package", str(server.package),
                "--socket", server.socket_path, *(["--units", ",".join(server.units)] if server.units else []),
                stdout=asyncio.subprocess.PIPE, stderr=log_file, stdin=asyncio.subprocess.DEVNULL, env=env)
        stdout = piped_stdout(process)
        try:
            line = await asyncio.wait_for(stdout.readline(), START_TIMEOUT)
            message = json.loads(line) if line.strip() else {}
        except (TimeoutError, ValueError):
            message = {}
        if message.get("event") == "ready":
            server.import_ms = message["import_ms"]
            self.log.info("fork server of %s ready in %s ms (%s)", server.app, server.import_ms, server.package.name)
            server.reader = asyncio.ensure_future(self._read_templates(server, stdout))
            return None
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        reason = f"the fork server of {server.app} could not start: {message.get('error') or 'no ready line'} " \
                 f"(log: {server.log_path})"
        self.log.warning("%s; its replicas are spawned", reason)
        return reason

    async def _read_templates(self, server: ForkServerProcess, stdout: asyncio.StreamReader) -> None:
        """The fork server's later lines: each unit's template, ready (its snap=True hooks ran) or refused."""
        while line := await stdout.readline():
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if event.get("event") == "template":
                    server.templates[event["unit"]] = {k: v for k, v in event.items() if k in ("snap_ms", "refused")}
                    self.log.info("fork server of %s: template of %s %s", server.app, event["unit"],
                                  f"refused: {event['refused']}" if "refused" in event else
                                  f"ready (snap=True hooks {event['snap_ms']} ms)")

    def _retire(self, server: ForkServerProcess) -> None:
        """Stop a fork server that was replaced or died; the replicas it forked run on."""
        if self.forkservers.get(server.key) is server:
            del self.forkservers[server.key]
        if not server.ready.done():
            server.ready.cancel()
        if server.process is not None and server.process.returncode is None:
            server.process.terminate()
        if server.reader is not None:
            server.reader.cancel()

    async def close(self) -> None:
        """Stop every fork server (their replicas are stopped on their own)."""
        servers = list(self.forkservers.values())
        for server in servers:
            self._retire(server)
        await asyncio.gather(*(s.process.wait() for s in servers if s.process is not None))
        if self._sockets is not None:  # each serve made one; left behind, they pile up in /tmp
            shutil.rmtree(self._sockets, ignore_errors=True)
            self._sockets = None

    async def wait(self, worker: WorkerProcess) -> int:
        """Until the worker exits; its exit code."""
        if worker.process is None:
            raise ValueError(f"replica {worker.id} has no process to wait for: start it first")
        code = await worker.process.wait()
        await self.gpus.release(worker)
        await self._keep_standby(worker)
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
        except TimeoutError:
            process.kill()
            await process.wait()
        await self.gpus.release(worker)
        await self._keep_standby(worker)


def piped_stdout(process: asyncio.subprocess.Process) -> asyncio.StreamReader:
    """The stdout of a process started with stdout=PIPE (asyncio types it Optional for the other cases)."""
    if process.stdout is None:
        raise ValueError("the process was started without stdout=PIPE")
    return process.stdout


def start_breakdown(how: dict[str, int | str], ready: control.Ready, began: float, launched: float,
                    now: float) -> dict[str, int | str]:
    """A start's breakdown: fork or spawn (and a fallback's reason), the waits before it, ms from `launched` to the
    new process's first line, what the worker reported (import, enter hooks, weights, whatever else its timings
    carry) and the total from `began`."""
    phase = "fork_ms" if how.get("start") in ("fork", "standby") else "spawn_ms"
    return {**how, phase: max(round((ready.started - launched) * 1000), 0), **ready.timings,
            "total_ms": round((now - began) * 1000)}
