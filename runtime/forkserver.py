"""The fork server: one per app package version on a node; a replica start is a fork() of it, not a fresh process.

    python -m ember.runtime.forkserver --package P --socket PATH

It loads the package once (the user's module and what it imports; torch too when a unit asks for a GPU) without a
GPU (CUDA_VISIBLE_DEVICES=""), prints one JSON line {"event": "ready", "import_ms"} or {"event": "failed", "error"},
and answers fork requests on the Unix socket PATH. The supervisor (runtime/supervisor.py) starts and replaces it.

Once ready it forks a template per unit, all at once (a deploy builds them, not the first request): a child that
runs the unit's `@ember.enter(snap=True)` hooks once (Modal's CPU-snapshot semantics: their host memory is then
shared copy-on-write by every replica) and refuses to fork when they left CUDA initialised or threads running, since
a forked child could not use either. Each template's outcome goes to the supervisor as a JSON line on stdout
({"event": "template", "unit", "snap_ms"} or with "refused"); a start that arrives before its template is ready
waits for it, and says how long (snap_ms). The template
forks each replica: the child takes its control pipe, log and lifeline from the request, sets its environment
(CUDA_VISIBLE_DEVICES first) and runs ember.runtime.worker's start from `enter(snap=False)` on. A unit that was
refused is started by a plain spawn instead, with the reason in its start breakdown.

Each request is one connection (SOCK_SEQPACKET: one message per send). The supervisor sends a ForkRequest with
three descriptors (the child's stdout, its log, the read end of its lifeline); the answer is Forked or Refused, and
once the replica exits, Exited on the same connection. A connection that closes without Exited means its template
is gone: the replica may still run, and the supervisor watches its pid instead.
"""
import time

STARTED = time.monotonic()  # before heavy imports: import_ms counts from here

import argparse  # noqa: E402
import contextlib  # noqa: E402
import ctypes  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import selectors  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from ember.runtime import heap  # noqa: E402

# tqdm's progress-bar monitor only wakes to check its bars; a child that shows a bar starts its own
FORK_SAFE_THREADS = {"tqdm_monitor"}
MAX_MESSAGE = 1 << 20  # a ForkRequest carries the replica's environment
REQUEST_FDS = 3  # control pipe (the child's stdout), log (its stderr), lifeline (EOF once the supervisor is gone)


@dataclass
class ForkRequest:
    """Supervisor -> fork server: fork a replica of `unit` with this environment (sent with REQUEST_FDS fds)."""
    unit: str
    env: dict[str, str]
    snap_ms: int | None = None  # set by the fork server: how long this request waited for the unit's template


@dataclass
class Forked:
    """The replica runs as `pid`; `snap_ms` when its start waited for the unit's snap=True hooks to finish;
    `standby`: it was the unit's standby for these GPUs, which had initialised CUDA before the request came."""
    pid: int
    snap_ms: int | None = None
    standby: bool = False


@dataclass
class Standby:
    """Supervisor -> fork server -> template: keep one child of `unit` ready for the next replica on the GPUs of
    `env` (its CUDA_VISIBLE_DEVICES): forked and with CUDA initialised and its context made while the GPU is idle,
    it becomes that replica when the fork request comes, which then skips both (CUDA init and the context: ~0.3 s
    on an H200). `drop`: end the one kept for those GPUs, whose memory (its context) another replica now needs.
    No answer is sent."""
    unit: str
    env: dict[str, str]
    drop: bool = False


@dataclass
class Refused:
    """This unit cannot be forked (the reason names the fix); the supervisor spawns it instead."""
    reason: str


@dataclass
class Exited:
    """The replica exited with `code` (negative: killed by that signal), as asyncio's Process.returncode says."""
    code: int


@dataclass
class TemplateReady:
    """Template -> fork server: the unit's snap=True hooks ran in `snap_ms`; it forks replicas now."""
    snap_ms: int


MESSAGES = {cls.__name__: cls for cls in (ForkRequest, Forked, Refused, Exited, TemplateReady, Standby)}
Message = ForkRequest | Forked | Refused | Exited | TemplateReady | Standby


def encode(message: Message) -> bytes:
    return json.dumps({"type": type(message).__name__, **asdict(message)}).encode()


def decode(data: bytes) -> Message | None:
    """The message in `data`; None for b"" (the other end closed)."""
    if not data:
        return None
    fields = json.loads(data)
    return MESSAGES[fields.pop("type")](**fields)


def send(sock: socket.socket, message: Message, fds: Sequence[int] = ()) -> None:
    socket.send_fds(sock, [encode(message)], list(fds))


def receive(sock: socket.socket, fds: int = 0) -> tuple[Message | None, list[int]]:
    data, received, _, _ = socket.recv_fds(sock, MAX_MESSAGE, fds)
    return decode(data), received


CUDA_ERROR_NOT_INITIALIZED = 3


def cuda_initialised() -> bool:
    """Whether torch, or anything else, initialised CUDA in this process (then a forked child cannot use the GPU).
    torch.cuda.is_available() initialises the driver without torch's flag, so the driver is asked too."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return True
    with open("/proc/self/maps") as maps:
        if not any("/libcuda.so" in line for line in maps):
            return False  # the driver library is not even loaded
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    context = ctypes.c_void_p()
    # side-effect free: NOT_INITIALIZED until something called cuInit
    return libcuda.cuCtxGetCurrent(ctypes.byref(context)) != CUDA_ERROR_NOT_INITIALIZED


def fork_hazard(what: str) -> str | None:
    """Why this process must not fork replicas after `what` ran, or None when it may."""
    if cuda_initialised():
        return (f"{what} initialised CUDA, which a forked replica cannot use: keep GPU work (and imports that touch "
                f"CUDA, such as flashinfer) in @ember.enter(snap=False)")
    threads = [t.name for t in threading.enumerate()
               if t is not threading.main_thread() and t.name not in FORK_SAFE_THREADS]
    if threads:
        return (f"{what} left threads running ({', '.join(threads)}), which a fork does not copy: start them in "
                f"@ember.enter(snap=False)")
    return None


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send `sig` to this process when its parent exits."""
    PR_SET_PDEATHSIG = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)


def fork_child(child: Callable[[], int]) -> int:
    """Fork; the child runs `child()` and exits with what it returns (1 and its traceback on stderr if it raises),
    never returning into the parent's code. Returns the child's pid in the parent."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = child()
        except BaseException:
            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)
    return pid


def dying(pid: int) -> bool:
    """Whether `pid` is gone or on its way out: killed (SIGKILL pending) or inside the kernel's exit, which for a
    process with a CUDA context lasts seconds while the driver frees its memory. Such a process cannot take a
    request although waitpid does not report it yet."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        flags = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[6])
    except (OSError, ValueError, IndexError):
        return True
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    sigkill = 1 << (signal.SIGKILL - 1)
    killed = any(int(fields.get(key, "0"), 16) & sigkill for key in ("SigPnd", "ShdPnd"))
    return bool(flags & PF_EXITING) or fields.get("State", "").split()[:1] in (["Z"], ["X"]) or killed


PF_EXITING = 0x4   # linux/sched.h: set on a task as it enters do_exit


def close_fds(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


@dataclass
class Template:
    """The fork server's view of one unit's template process."""
    pid: int | None
    channel: socket.socket | None
    refused: str | None = None
    ready: bool = False       # its snap=True hooks finished (or it refused)
    snap_ms: int | None = None


class ForkServer:
    """Accepts fork requests and hands each to its unit's template; every unit's template is forked at start."""

    def __init__(self, app: Any, listener: socket.socket, control=None):
        self.app, self.listener, self.control = app, listener, control
        self.templates: dict[str, Template] = {}

    def run(self) -> None:
        for name in self.app.units:
            self._begin(name)
        while True:
            self._reap()
            with selectors.DefaultSelector() as selector:
                selector.register(self.listener, selectors.EVENT_READ)
                for name, template in self.templates.items():
                    if not template.ready and template.channel is not None:
                        selector.register(template.channel, selectors.EVENT_READ, name)
                events = selector.select(timeout=1.0)
            for key, _ in events:
                if key.data is not None and key.data in self.templates:
                    self._finish(key.data)
            if not any(key.fileobj is self.listener for key, _ in events):
                continue
            conn, _ = self.listener.accept()
            with conn:
                conn.settimeout(10)
                try:
                    self._handle(conn)
                except (OSError, ValueError, KeyError, TypeError) as exc:  # a bad request costs only its connection
                    print(f"ember fork server: request dropped: {type(exc).__name__}: {exc}", file=sys.stderr)

    def _handle(self, conn: socket.socket) -> None:
        request, fds = receive(conn, REQUEST_FDS)
        try:
            if isinstance(request, Standby) and not fds:
                self._pass_standby(request)
                return
            if not isinstance(request, ForkRequest) or len(fds) != REQUEST_FDS:
                send(conn, Refused(f"a fork request is a ForkRequest with {REQUEST_FDS} descriptors"))
                return
            if request.unit not in self.app.units:
                send(conn, Refused(f"this fork server's package has no unit {request.unit!r}"))
                return
            if request.unit not in self.templates:
                self._begin(request.unit)
            template = self.templates[request.unit]
            if not template.ready:  # this start waits for the unit's snap=True hooks
                began = time.monotonic()
                template = self._finish(request.unit)
                request.snap_ms = round((time.monotonic() - began) * 1000)
            if template.refused is None and template.channel is not None:
                try:
                    send(template.channel, request, [conn.fileno(), *fds])
                    return
                except OSError as exc:  # the template died since: the next request prepares a new one
                    self._forget(request.unit)
                    template.refused = f"the template of {request.unit} is gone ({exc})"
            send(conn, Refused(template.refused or f"the template of {request.unit} is gone"))
        finally:
            close_fds(fds)

    def _pass_standby(self, request: Standby) -> None:
        """To the unit's template, once it is ready (a standby of a unit still running its snap=True hooks, or one
        refused, is not kept: the start forks or spawns as it would have)."""
        template = self.templates.get(request.unit)
        if template is None or not template.ready or template.refused is not None or template.channel is None:
            return
        try:
            send(template.channel, request)
        except OSError:  # the template died since: the next fork request prepares a new one
            self._forget(request.unit)

    def _begin(self, unit_name: str) -> None:
        """Fork the unit's template, which runs its snap=True hooks and then says it is ready or refuses."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)

        def template() -> int:
            ours.close()
            self.listener.close()
            for other in self.templates.values():
                if other.channel is not None:
                    other.channel.close()
            if self.control is not None:
                self.control.close()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            die_with_parent(signal.SIGKILL)  # a template without its fork server has nobody to serve
            return UnitTemplate(self.app.units[unit_name], theirs).run()

        pid = fork_child(template)
        theirs.close()
        self.templates[unit_name] = Template(pid, ours)

    def _finish(self, unit_name: str) -> Template:
        """Wait for the unit's template to say it is ready or refuses; tell the supervisor which."""
        template = self.templates[unit_name]
        if template.channel is None:  # it refused already: nothing more comes
            return template
        ready, _ = receive(template.channel)
        if isinstance(ready, TemplateReady):
            template.snap_ms = ready.snap_ms
        else:
            template.channel.close()
            template.pid, template.channel = None, None
            template.refused = ready.reason if isinstance(ready, Refused) else "its template process exited while " \
                "it ran the snap=True hooks (log: this replica's log has its traceback)"
            print(f"ember fork server: {unit_name} is started by spawn instead: {template.refused}", file=sys.stderr,
                  flush=True)
        template.ready = True
        event = {"event": "template", "unit": unit_name, "snap_ms": template.snap_ms}
        if template.refused is not None:
            event["refused"] = template.refused
        if self.control is not None:
            with contextlib.suppress(OSError, ValueError):  # the supervisor stopped reading: only it loses the news
                self.control.write(json.dumps(event) + "\n")
        return template

    def _forget(self, unit_name: str) -> None:
        template = self.templates.pop(unit_name, None)
        if template is not None and template.channel is not None:
            template.channel.close()

    def _reap(self) -> None:
        """Collect templates that exited; a unit whose template died gets a fresh one on its next request."""
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            for name, template in list(self.templates.items()):
                if template.pid == pid and template.ready:
                    self._forget(name)


class UnitTemplate:
    """A process that ran one unit's snap=True hooks and forks a replica for each request its fork server passes."""

    def __init__(self, unit: Any, channel: socket.socket):
        self.unit, self.channel = unit, channel
        self.replicas: dict[int, socket.socket] = {}  # pid -> the connection its Exited goes to
        # CUDA_VISIBLE_DEVICES -> (pid, the socket its fork request goes to) of the standby kept for those GPUs
        self.standbys: dict[str, tuple[int, socket.socket]] = {}

    def run(self) -> int:
        from ember.runtime.worker import unit_environment

        began = time.monotonic()
        try:
            unit_environment(self.unit)
            self.obj = self.unit.snap() if hasattr(self.unit, "user_cls") else None
        except BaseException as exc:
            traceback.print_exc()
            send(self.channel, Refused(f"a snap=True hook raised {type(exc).__name__}: {exc}; in a fork server they "
                                       f"run without a GPU: move GPU work to @ember.enter(snap=False)"))
            return 1
        hazard = fork_hazard(f"the snap=True hooks of {self.unit.name}")
        if hazard:
            send(self.channel, Refused(hazard))
            return 1
        # Replicas share the template's heap copy-on-write; a collection in one that walked it would write to every
        # object's header and so copy its pages. Frozen, no collection walks it.
        heap.settle()
        send(self.channel, TemplateReady(round((time.monotonic() - began) * 1000)))
        while True:
            with selectors.DefaultSelector() as selector:
                selector.register(self.channel, selectors.EVENT_READ)
                # short: a replica's exit reaches the supervisor (which then frees its GPU) within this
                ready = selector.select(timeout=0.05)
            if ready:
                request, fds = receive(self.channel, 1 + REQUEST_FDS)
                if request is None:
                    return 0  # the fork server is gone
                if isinstance(request, ForkRequest):
                    self._fork(request, fds)
                elif isinstance(request, Standby):
                    self._standby(request)
            self._reap()

    def _fork(self, request: ForkRequest, fds: list[int]) -> None:
        conn = socket.socket(fileno=fds[0])
        control, log, lifeline = fds[1:]
        pid = self._hand_to_standby(request, [control, log, lifeline])
        standby = pid is not None
        if pid is None:
            def replica() -> int:
                forked_at = time.monotonic()
                conn.close()
                self._close_inherited()
                from ember.runtime.worker import run_forked

                return run_forked(self.unit, self.obj, request.env, control, log, lifeline, forked_at)

            pid = fork_child(replica)
        close_fds([control, log, lifeline])
        try:
            send(conn, Forked(pid, request.snap_ms, standby))
        except OSError:  # the supervisor gave up on this start; the replica's lifeline ends it
            pass
        self.replicas[pid] = conn

    def _close_inherited(self) -> None:
        """In a child: the template's sockets, which only the template may hold (a standby reads EOF once the
        template drops it)."""
        self.channel.close()
        for other in self.replicas.values():
            other.close()
        for _, sock in self.standbys.values():
            sock.close()

    def _hand_to_standby(self, request: ForkRequest, fds: list[int]) -> int | None:
        """The pid of the standby kept for the request's GPUs, now given the request; None when there is none."""
        kept = self.standbys.pop(request.env.get("CUDA_VISIBLE_DEVICES", ""), None)
        if kept is None:
            return None
        pid, sock = kept
        with sock:
            try:
                # it exited (its CUDA init failed, say), or was killed and is still freeing its context: a fork
                if os.waitpid(pid, os.WNOHANG)[0] == pid or dying(pid):
                    return None
                send(sock, request, fds)
            except OSError:  # it is gone (reaped already, or its socket closed as it died): a fork instead
                return None
        return pid

    def _standby(self, request: Standby) -> None:
        """Fork a standby for the GPUs of `request.env`, or with `drop`, end the one kept for them."""
        devices = request.env.get("CUDA_VISIBLE_DEVICES", "")
        if request.drop:
            kept = self.standbys.pop(devices, None)
            if kept is not None:
                kept[1].close()  # it reads EOF and exits, giving its context's GPU memory back
            return
        if devices in self.standbys:
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)

        def standby() -> int:
            ours.close()
            self._close_inherited()
            die_with_parent(signal.SIGKILL)  # a standby without its template has nobody to serve
            return run_standby(self.unit, self.obj, request.env, theirs)

        pid = fork_child(standby)
        theirs.close()
        self.standbys[devices] = (pid, ours)

    def _reap(self) -> None:
        while True:   # replicas, and standbys that exited (dropped, or their CUDA init failed)
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.replicas.pop(pid, None)
            if conn is not None:
                with conn, contextlib.suppress(OSError):
                    send(conn, Exited(os.waitstatus_to_exitcode(status)))
            for devices, (kept, sock) in list(self.standbys.items()):
                if kept == pid:   # a standby that exited before its request (its CUDA init failed, say)
                    sock.close()
                    del self.standbys[devices]


def run_standby(unit: Any, snapped: Any, env: dict[str, str], channel: socket.socket) -> int:
    """A standby: initialise CUDA with the replica's environment, then wait for its fork request and go on as the
    replica it asks for; exit 0 when the template drops it (EOF) first."""
    os.environ.clear()
    os.environ.update(env)  # CUDA_VISIBLE_DEVICES before anything touches CUDA
    from ember.runtime.worker import prepare_cuda, run_forked

    prepared = prepare_cuda()
    request, fds = receive(channel, REQUEST_FDS)
    channel.close()
    if not isinstance(request, ForkRequest) or len(fds) != REQUEST_FDS:
        close_fds(fds)
        return 0
    control, log, lifeline = fds
    return run_forked(unit, snapped, request.env, control, log, lifeline, time.monotonic(), prepared)


def preload(app: Any) -> list[str]:
    """Import what every replica of `app` needs before a fork (what the user's module imports is loaded already):
    the replica's HTTP server (preload_serving), and preload_gpu() when a unit asks for a GPU. The modules imported."""
    loaded = preload_serving()
    return loaded + (preload_gpu() if any(unit.spec.gpu for unit in app.units.values()) else [])


# What a replica's HTTP server imports after its enter hooks, on the way to its first reply: the worker's Starlette
# routes, uvicorn's protocol, lifespan and loop modules (chosen by what is installed: httptools or h11, uvloop or
# asyncio) and anyio's asyncio backend and streams, which Starlette loads on its first request. ~0.15 s on a 2-core
# CI machine, paid by the first request of every replica unless the fork server imported them.
SERVING_MODULES = ("uvicorn.protocols.http.auto", "uvicorn.protocols.websockets.auto", "uvicorn.lifespan.on",
                   "uvicorn.loops.auto", "uvicorn.loops.asyncio", "uvloop", "uvicorn.loops.uvloop",
                   "anyio._backends._asyncio", "anyio.streams.memory", "anyio.streams.stapled",
                   "starlette.applications", "starlette.requests", "starlette.responses", "starlette.routing",
                   "ember.runtime.unhandled")


def preload_serving() -> list[str]:
    """The modules of SERVING_MODULES imported (each one that is installed)."""
    loaded = []
    for module in SERVING_MODULES:
        with contextlib.suppress(ImportError):
            importlib.import_module(module)
            loaded.append(module)
    return loaded


def preload_gpu() -> list[str]:
    """torch; flashinfer, the engine's attention (~1 s to import), when the supervisor named the GPU architecture
    (otherwise its import would ask the GPU, which a fork server must not touch); and Triton's compiler front end:
    the hash of Triton's own sources and its Gluon modules, which each replica's first kernel launch would
    otherwise pay (0.4 and 0.2 s on the H200) before its first token. The modules (or steps) done."""
    loaded = []
    with contextlib.suppress(ImportError):
        import torch  # noqa: F401

        loaded.append("torch")
    arch_known = bool(os.environ.get("FLASHINFER_CUDA_ARCH_LIST"))
    if arch_known and importlib.util.find_spec("flashinfer") is not None and _safe_to_import("flashinfer"):
        import flashinfer  # noqa: F401

        loaded.append("flashinfer")
    if importlib.util.find_spec("triton") is not None and _safe_to_import("triton.experimental.gluon"):
        importlib.import_module("triton.experimental.gluon")
        from triton.runtime.cache import triton_key

        triton_key()  # cached for the process's life, so every fork inherits it
        loaded.append("triton")
    return loaded


def _safe_to_import(module: str) -> bool:
    """Whether importing `module` leaves this process fit to fork, tried first in a child (which then exits), so a
    module that touches CUDA or starts a thread on import is left for each replica to import instead."""
    def attempt() -> int:
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - reported, and the parent does not import it
            print(f"ember fork server: {module} not preloaded ({type(exc).__name__}: {exc})", file=sys.stderr)
            return 1
        hazard = fork_hazard(f"importing {module}")
        if hazard:
            print(f"ember fork server: {module} not preloaded: {hazard}", file=sys.stderr)
        return 0 if hazard is None else 3

    _, status = os.waitpid(fork_child(attempt), 0)
    return os.waitstatus_to_exitcode(status) == 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ember.runtime.forkserver", description=__doc__.splitlines()[0])
    parser.add_argument("--package", required=True, help="path of the .pkg file")
    parser.add_argument("--socket", required=True, help="Unix socket path to listen on")
    parser.add_argument("--units", help="fork only these units (comma-separated): the ones whose environment this "
                                        "interpreter is; default every unit of the package")
    args = parser.parse_args(argv)
    die_with_parent()
    control = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # what the user's module prints goes to the log; stdout was only for the ready line
    try:
        from ember.package import unpack

        app = unpack(args.package)
        if args.units:
            app.units = {name: unit for name, unit in app.units.items() if name in args.units.split(",")}
        preloaded = preload(app)
        hazard = fork_hazard(f"importing the package {os.path.basename(args.package)}")
        if hazard:
            raise RuntimeError(hazard)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(args.socket)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(args.socket)
        listener.listen(64)
    except BaseException as exc:
        traceback.print_exc()
        control.write(json.dumps({"event": "failed", "error": f"{type(exc).__name__}: {exc}"}) + "\n")
        return 1
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the supervisor stops this one
    import_ms = round((time.monotonic() - STARTED) * 1000)
    control.write(json.dumps({"event": "ready", "import_ms": import_ms, "preloaded": preloaded}) + "\n")
    try:
        ForkServer(app, listener, control).run()
    finally:
        with contextlib.suppress(OSError):
            os.unlink(args.socket)
    return 0


if __name__ == "__main__":
    sys.exit(main())
