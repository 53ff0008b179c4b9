"""One replica: load a package, run enter hooks, serve calls on 127.0.0.1, run exit hooks on SIGTERM.

    python -m ember.runtime.worker --package P --target NAME

stdout is the control channel to the gateway: one line, runtime/control.py's Ready (port, timings, control_secret)
or Failed (phase, error); the gateway sends control_secret in the x-ember-control header of every
request to /__ember__/. A replica that cannot go on (runtime/health.py) exits with code 3. Everything the user's
code prints goes to stderr, which the gateway sends to the replica's log file.
"""
import time

STARTED = time.monotonic()  # before heavy imports: the gateway measures spawn time up to here

import argparse  # noqa: E402
import asyncio  # noqa: E402
import contextlib  # noqa: E402
import contextvars  # noqa: E402
import hmac  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import secrets  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import stat  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from ember.runtime import control, health, heap, logs, startup, tracing  # noqa: E402
from ember.runtime.call_body import (  # noqa: E402
    BadCallBody,
    ResultNotJson,
    keyword_arguments,
    plain_encoding,  # noqa: E402
    result_json,
)
from ember.runtime.generators import EventStream, ValueSource, is_generator  # noqa: E402


class ControlChannel:
    """The original stdout, kept for the gateway; fd 1 is pointed at the log so user prints land there."""

    def __init__(self) -> None:
        self._out = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)
        sys.stdout = sys.stderr

    def send(self, message: control.ControlMessage) -> None:
        self._out.write(control.encode(message) + "\n")
        self._out.flush()


def by_position(fn, kwargs: dict) -> tuple[tuple, dict]:
    """`kwargs` as the call's (args, kwargs): a call body names every argument, and a positional-only parameter
    (`def f(x, /)`) can only be passed by position. Those before the last one named take their defaults; at the
    first one missing without a default the rest stay named, and binding them fails as for any missing argument."""
    params = [p for p in inspect.signature(fn).parameters.values() if p.kind is p.POSITIONAL_ONLY]
    named = [i for i, p in enumerate(params) if p.name in kwargs]
    if not named:
        return (), kwargs
    args, rest = [], dict(kwargs)
    for p in params[:named[-1] + 1]:
        if p.name in rest:
            args.append(rest.pop(p.name))
        elif p.default is not p.empty:
            args.append(p.default)
        else:
            return (), kwargs
    return tuple(args), rest


def argument_problem(fn, kwargs: dict) -> str | None:
    """Why `kwargs` cannot call `fn` — every unknown and missing name, and what it takes — or None when they can."""
    signature = inspect.signature(fn)
    try:
        args, rest = by_position(fn, kwargs)
        signature.bind(*args, **rest)
        return None
    except TypeError as exc:
        params = signature.parameters.values()
        named = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        open_ended = any(p.kind is p.VAR_KEYWORD for p in params)
        unknown = [] if open_ended else [k for k in kwargs if k not in named]
        missing = [p.name for p in params if p.name in named and p.default is p.empty and p.name not in kwargs]
        parts = ([f"unknown argument{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown))}"] if unknown else []) + (
            [f"missing required argument{'s' * (len(missing) > 1)} {', '.join(map(repr, missing))}"] if missing else []
        )
        if not parts:
            return str(exc)
        return f"{'; '.join(parts)}; it takes ({', '.join(named)})"


def checked_arguments(adapters: dict[str, Any], kwargs: dict) -> tuple[dict, str | None]:
    """`kwargs` checked against the type hints (values as pydantic coerced them), or a message naming each bad one."""
    from pydantic import ValidationError

    values, problems = dict(kwargs), []
    for name, value in kwargs.items():
        if name not in adapters:
            continue
        try:
            values[name] = adapters[name].validate_python(value)
        except ValidationError as exc:
            for error in exc.errors(include_url=False):
                where = ".".join([name, *map(str, error["loc"])])
                problems.append(f"{where}: {error['msg']} (got {json.dumps(error['input'], default=repr)[:80]})")
    return values, "; ".join(problems) or None


RUNTIME_FILES = (str(Path(__file__).resolve().parent), str(Path(asyncio.__file__).resolve().parent.parent))


def print_user_traceback(exc: BaseException) -> None:
    """The traceback from the user's first frame on: the worker's and the thread pool's frames above it say nothing
    about the user's code (all of them when no user frame is there)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(RUNTIME_FILES):
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb or exc.__traceback__)


def _error_response(status: int, type: str, message: str, headers: dict[str, str] | None = None):
    from starlette.responses import JSONResponse

    return JSONResponse({"error": {"type": type, "message": message}}, status_code=status, headers=headers)


# On a refusal the replica sends before a call starts: nothing ran, so the gateway may send it to another replica.
NOT_STARTED = "x-ember-not-started"
# On a reply after which the replica will exit (a call it could not stop still runs): route nothing more to it.
RECYCLING = "x-ember-recycling"
CANCEL_GRACE = 2.0  # seconds a cancelled coroutine may take to unwind before it counts as unstoppable


class LoadedUnit:
    """The loaded unit (a function or a class instance) and the calls it serves.

    A call ends when it returns, when it overruns the function's timeout, or when its client hangs up. A coroutine is
    cancelled then; a thread cannot be, so the replica marks itself failed (runtime/health.py): it refuses new calls,
    finishes the others and exits, and the gateway starts a fresh one. Its slot is never free while that work runs.
    """

    def __init__(self, unit: Any, obj: Any):
        from concurrent.futures import ThreadPoolExecutor

        self.unit, self.obj = unit, obj
        self.timeout = unit.spec.timeout
        self.parking = Parking(obj, getattr(unit, "park_hooks", []), getattr(unit, "wake_hooks", []),
                               checkpoint=unit.spec.park_with == "cuda-checkpoint")
        # As many threads as calls may run at once: a full pool must never queue a call behind a stuck one.
        self.threads = ThreadPoolExecutor(unit.spec.max_concurrency, thread_name_prefix="ember-call")
        self.types: dict[str, dict[str, Any]] = {}  # method -> its parameters' validators, built on first call

    def target(self, method: str) -> Callable | None:
        if self.obj is None:
            return self.unit.fn if method == self.unit.name and not self.unit.is_asgi else None
        return getattr(self.obj, method) if method in self.unit.methods else None

    def asgi(self) -> Callable | None:
        if self.obj is None:
            return self.unit.fn() if self.unit.is_asgi else None
        return getattr(self.obj, self.unit.asgi)() if self.unit.asgi else None

    async def call(self, request):
        if health.reason is not None:
            return _error_response(503, "replica_unavailable", f"this replica is being replaced ({health.reason})",
                                   {NOT_STARTED: "1", "Retry-After": "1"})
        await self.parking.ready()  # the gateway routes a call to a parked replica as its wake
        method = request.path_params["method"]
        fn = self.target(method)
        if fn is None:
            return _error_response(404, "not_found", f"{self.unit.name} has no method {method!r}")
        try:
            plain_encoding(request.headers.get("content-encoding"))
            kwargs = keyword_arguments(await request.body())
        except BadCallBody as exc:
            return _error_response(exc.status, exc.type, exc.message)
        problem = argument_problem(fn, kwargs)
        if problem is None:
            if method not in self.types:
                from ember.signature import argument_types  # pydantic is imported on the first call, not at start

                self.types[method] = argument_types(fn)
            kwargs, problem = checked_arguments(self.types[method], kwargs)
        if problem is not None:
            return _error_response(422, "invalid_arguments", problem)
        args, kwargs = by_position(fn, kwargs)
        if is_generator(fn):
            return EventStream(ValueSource(fn(*args, **kwargs), self.threads), self.unit.name, self.timeout,
                               CANCEL_GRACE, _error_response, {RECYCLING: "1"})
        return await self._run(fn, args, kwargs, request)

    async def _run(self, fn: Callable, args: tuple, kwargs: dict, request):
        from starlette.responses import Response

        in_thread = not inspect.iscoroutinefunction(fn)
        if in_thread:
            context = contextvars.copy_context()  # the trace context, as asyncio.to_thread would carry it
            work = asyncio.get_running_loop().run_in_executor(self.threads, lambda: context.run(fn, *args, **kwargs))
        else:
            work = asyncio.ensure_future(fn(*args, **kwargs))
        hang_up = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, hang_up}, timeout=self.timeout, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # this handler was cancelled (the server stops): the call goes with it
            work.cancel()
            raise
        finally:
            gone = hang_up.done()
            hang_up.cancel()
        if not work.done():
            left = "its client disconnected" if gone else f"it overran its timeout of {self.timeout:g} s"
            stopped = await self._stop(work, in_thread)
            if not stopped:
                health.fail(f"a call to {self.unit.name} could not be stopped after {left}")
            if gone:
                return _error_response(499, "client_closed_request", "the client disconnected; the call was cancelled")
            return _error_response(504, "timeout", f"call exceeded the function's timeout of {self.timeout:g} s",
                                   None if stopped else {RECYCLING: "1"})
        try:
            result = work.result()
        except Exception as exc:  # the user's error goes to the caller as JSON, the traceback to the log
            print_user_traceback(exc)
            return _error_response(500, "function_error", f"{type(exc).__name__}: {exc}")
        try:
            body = result_json({"result": result})
        except ResultNotJson as exc:
            return _error_response(500, "result_not_json", f"the function returned a value JSON cannot encode: "
                                   f"{str(exc)[:300]}")
        return Response(body, media_type="application/json")

    @staticmethod
    async def _stop(work: asyncio.Future, in_thread: bool) -> bool:
        """Cancel the call; False when it goes on running (a thread, or a coroutine that ignores the cancel)."""
        work.cancel()
        if in_thread:
            return False
        done, _ = await asyncio.wait({work}, timeout=CANCEL_GRACE)
        return bool(done)


async def _disconnected(request) -> None:
    """Returns once the client has hung up (its body was read already, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ParkRefused(Exception):
    """The park did not happen and the replica serves as it did before it (the driver cannot checkpoint the
    process; the park hooks were undone). Answered 409 `park_refused`: the gateway keeps it hot, parking no more."""


class Parking:
    """Park (T1): release the replica's GPU memory and keep its process; wake: restore it before the next call.

    A class's @ember.park() hooks run first (an LLM engine releases its weights and KV cache there), then the GPU
    tensors of the instance's torch modules move to pinned host RAM; a wake moves them back and then runs the
    @ember.wake() hooks. One at a time: a call that arrives while a park is under way waits for it, then wakes.
    On a CPU-only replica there is no device memory to release, so parking only runs the hooks. With `checkpoint`
    (park_with="cuda-checkpoint"), the driver's checkpoint API moves all of the process's GPU state to host memory
    instead of Ember moving modules (runtime/cuda_checkpoint.py).
    """

    def __init__(self, obj: Any, park_hooks: Sequence[str] = (), wake_hooks: Sequence[str] = (),
                 checkpoint: bool = False):
        self.obj, self.parked, self.checkpoint = obj, False, checkpoint
        self.park_hooks, self.wake_hooks = list(park_hooks), list(wake_hooks)
        self.lock = asyncio.Lock()
        self.devices: dict[Any, Any] = {}  # tensor -> the CUDA device it came from

    def _tensors(self):
        torch = sys.modules.get("torch")
        if torch is None or self.obj is None:
            return
        for value in vars(self.obj).values():
            if isinstance(value, torch.nn.Module):
                yield from value.parameters()
                yield from value.buffers()

    def _park(self) -> None:
        for name in self.park_hooks:
            getattr(self.obj, name)()
        if self.checkpoint:
            from ember.runtime.cuda_checkpoint import checkpoint_self
            try:
                checkpoint_self("park")
            except Exception as exc:   # the process keeps serving: what the park hooks released comes back
                for name in self.wake_hooks:
                    getattr(self.obj, name)()
                raise ParkRefused(str(exc)) from exc
            return
        for t in self._tensors():
            if t.is_cuda:
                self.devices[t] = t.device
                t.data = t.data.to("cpu").pin_memory()
        if self.devices:
            sys.modules["torch"].cuda.empty_cache()

    def _wake(self) -> None:
        if self.checkpoint:
            from ember.runtime.cuda_checkpoint import checkpoint_self
            checkpoint_self("wake")
        for t, device in self.devices.items():
            t.data = t.data.to(device, non_blocking=True)
        if self.devices:
            sys.modules["torch"].cuda.synchronize()
        self.devices.clear()
        for name in self.wake_hooks:
            getattr(self.obj, name)()

    async def park(self) -> dict:
        async with self.lock:
            began, released = time.monotonic(), 0
            if not self.parked:
                before = device_bytes()
                await asyncio.to_thread(self._park)
                self.parked = True
                # A checkpointed process's CUDA calls wait for its wake: it holds no device memory meanwhile.
                released = max(before - (0 if self.checkpoint else device_bytes()), 0)
            return {"parked": True, "ms": round((time.monotonic() - began) * 1000), "host_bytes": rss_bytes(),
                    "device_bytes_released": released}

    async def wake(self) -> dict:
        async with self.lock:
            began = time.monotonic()
            if self.parked:
                await asyncio.to_thread(self._wake)
                self.parked = False
            return {"parked": False, "ms": round((time.monotonic() - began) * 1000)}

    async def ready(self) -> None:
        """Before a call: wake if parked, or wait for a park under way and then wake."""
        if self.parked or self.lock.locked():
            await self.wake()


def device_bytes() -> int:
    """GPU memory in use on this process's device, as the driver counts it (0 without CUDA initialised)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0
    free, total = torch.cuda.mem_get_info()
    return total - free


def rss_bytes() -> int:
    """Host RAM this process holds (what a parked replica costs the node)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


CALL_PATH = "/__ember__/call/"
CONTROL = "/__ember__/"
CONTROL_HEADER = "x-ember-control"  # carries the replica's secret on every request to its control routes
CALLER_HEADER = "x-ember-caller"  # the gateway's name for a forwarded request's caller (its API key's id)
REPLICA_QUIET = ("/__ember__/health", "/metrics")  # polled by the gateway: no access line each time


def build_asgi(replica: LoadedUnit, secret: str):
    """Internal routes under /__ember__/, for whoever holds the replica's `secret` (the gateway that started it; a
    request a client sent through the gateway never carries it); every other path goes to the user's ASGI app."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from ember.runtime.unhandled import ReplyOnError

    async def health_check(request):
        if health.reason is not None:
            return JSONResponse({"ok": False, "reason": health.reason, "parked": replica.parking.parked}, 503)
        return JSONResponse({"ok": True, "parked": replica.parking.parked})

    async def park(request):
        try:
            return JSONResponse(await replica.parking.park())
        except ParkRefused as exc:
            return _error_response(409, "park_refused", str(exc))

    async def wake(request):
        return JSONResponse(await replica.parking.wake())

    # An error these let through is logged and the gateway's keep-alive connection stays open (runtime/unhandled.py).
    log = logging.getLogger("ember.worker")
    def failed(kind: str):
        return lambda e: _error_response(500, kind, f"{type(e).__name__}: {str(e)[:200]}")

    internal = ReplyOnError(Starlette(routes=[
        Route("/__ember__/call/{method}", replica.call, methods=["POST"]),
        Route("/__ember__/health", health_check),
        Route("/__ember__/park", park, methods=["POST"]),
        Route("/__ember__/wake", wake, methods=["POST"]),
    ]), log=log, reply=failed("internal_error"))
    user_app = replica.asgi()
    if user_app is not None:
        user_app = ReplyOnError(user_app, log=log, reply=failed("app_error"))
    expected = secret.encode()

    def authorised(scope) -> bool:
        sent = [v for k, v in scope["headers"] if k == CONTROL_HEADER.encode()]
        return len(sent) == 1 and hmac.compare_digest(sent[0], expected)

    # The gateway's CLIENT span reaches here as `traceparent`; the user's code runs inside this SERVER span.
    traced_internal = tracing.ServerSpans(internal, describe_call)
    traced_user_app = None if user_app is None else \
        tracing.ServerSpans(user_app, lambda scope: describe_request(scope, replica.unit.name))

    async def root(scope, receive, send):
        if scope["type"] == "lifespan":
            await (user_app or internal)(scope, receive, send)
        elif scope["path"].startswith(CONTROL) or traced_user_app is None:
            if not authorised(scope):
                if scope["type"] == "http":
                    await _error_response(404, "not_found", f"no route {scope['path'][:200]!r}")(scope, receive, send)
                return
            await traced_internal(scope, receive, send)
        else:
            if health.reason is not None and scope["type"] == "http":  # going away: let the gateway go elsewhere
                refusal = _error_response(503, "replica_unavailable",
                                          f"this replica is being replaced ({health.reason})",
                                          {NOT_STARTED: "1", "Retry-After": "1"})
                return await refusal(scope, receive, send)
            await replica.parking.ready()
            await traced_user_app(scope, receive, send)

    return root


def describe_call(scope) -> tuple[str, dict] | None:
    """A call's SERVER span (the other control routes are not traced)."""
    if not scope["path"].startswith(CALL_PATH):
        return None
    function = scope["path"][len(CALL_PATH):]
    return describe_request(scope, function, f"call {function}")


def describe_request(scope, function: str, name: str | None = None) -> tuple[str, dict]:
    replica_id = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"x-ember-replica"), "")
    return name or f"{scope['method']} {scope['path']}", {
        "ember.function": function, "ember.replica.id": replica_id,
        "http.request.method": scope["method"], "url.path": scope["path"]}


def _serve(app, sock: socket.socket, stops: list[int]) -> None:
    """Serve `app` on `sock` until SIGTERM or SIGINT; `stops` holds the ones that came before the server started."""
    import uvicorn

    class ReplicaServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            # Stop serving on SIGTERM instead of re-raising it, so exit hooks still run.
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: setattr(self, "should_exit", True))
            if stops:
                self.should_exit = True
            yield

    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5, lifespan="auto")
    server = ReplicaServer(config)

    def unhealthy(reason: str) -> None:  # from any thread: uvicorn polls should_exit on its own loop
        print(f"ember: replica unhealthy, exiting so the gateway starts a fresh one: {reason}", file=sys.stderr,
              flush=True)
        server.should_exit = True

    health.on_failure(unhealthy)
    server.run(sockets=[sock])  # uvicorn's loop factory: uvloop where installed


def read_secrets(names: list[str]) -> dict[str, str]:
    """The KEY=VALUE lines of EMBER_HOME/secrets/NAME.env for each secret the function lists; a file other users
    may read is used, with a warning in the replica's log that says how to make it private."""
    from ember.home import Home

    values = {}
    for name in names:
        path = Home().secrets / f"{name}.env"
        if not path.is_file():
            raise FileNotFoundError(f"secret {name!r} not found: create {path} with KEY=VALUE lines")
        if path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            print(f"ember: warning: secret file {path} can be read by other users of this machine; "
                  f"make it private with `chmod 600 {path}`", file=sys.stderr, flush=True)
        for line in path.read_text().splitlines():
            key, sep, value = line.partition("=")
            if sep and not line.lstrip().startswith("#"):
                values[key.strip()] = value.strip()
    return values


EXIT_UNHEALTHY = 3  # the replica could not go on (runtime/health.py says why, in its log): replace it


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM this replica if its gateway dies without stopping it (no orphaned replicas)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def unit_environment(unit: Any) -> None:
    """The environment a unit's hooks run in: its spec's env and secrets, and where an engine keeps its snapshots."""
    # snapshot=True: the LLM engine restores its weights from (or, after a full boot, writes) this store;
    # `EMBER_SNAPSHOT_STORE=s3://bucket/prefix ember serve` overrides the default.
    if unit.spec.snapshot:
        os.environ.setdefault("EMBER_SNAPSHOT_STORE", "local")
    else:
        os.environ.pop("EMBER_SNAPSHOT_STORE", None)
    os.environ.update(unit.spec.env)
    os.environ.update(read_secrets(unit.spec.secrets))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ember.runtime.worker", description=__doc__.splitlines()[0])
    parser.add_argument("--package", required=True, help="path of the .pkg file")
    parser.add_argument("--target", required=True, help="function or class name inside the app")
    args = parser.parse_args(argv)
    _die_with_parent()
    if tracing.setup("ember-worker"):  # before the user's enter hooks, so they can trace too
        logs.follow_spans()
    channel = ControlChannel()

    def load() -> tuple[Any, Any]:
        from ember.package import unpack

        unit = unpack(args.package).units[args.target]
        unit_environment(unit)
        return unit, None

    return serve(channel, STARTED, load)


def run_forked(unit: Any, snapped: Any, env: dict[str, str], control_fd: int, log_fd: int, lifeline_fd: int,
               started: float, prepared: dict[str, int] | None = None) -> int:
    """A replica forked from a fork server (runtime/forkserver.py): the unit is loaded and its snap=True hooks ran
    (`snapped` is that instance), so it takes its own descriptors and environment and goes on from enter(snap=False).
    `prepared`: a standby's prepare_cuda() timings, done before its request came (they join the start breakdown)."""
    os.dup2(control_fd, 1)
    os.dup2(log_fd, 2)
    os.close(control_fd)
    os.close(log_fd)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(env)  # CUDA_VISIBLE_DEVICES before anything can touch CUDA
    _end_with_lifeline(lifeline_fd)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()  # every fork starts from its fork server's generator state: replicas must not sample alike
    if tracing.setup("ember-worker"):
        logs.follow_spans()
    channel = ControlChannel()

    def load() -> tuple[Any, Any]:
        unit_environment(unit)
        return unit, snapped

    return serve(channel, started, load, prepared)


def _end_with_lifeline(fd: int) -> None:
    """SIGTERM this replica once `fd` reads EOF: its supervisor, which holds the other end, is gone (a forked replica's
    parent is its fork server, so the parent-death signal a spawned worker uses would fire on the wrong death)."""
    import threading

    def watch() -> None:
        with contextlib.suppress(OSError):
            while os.read(fd, 1):
                pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="ember-lifeline", daemon=True).start()


def prepare_cuda() -> dict[str, int]:
    """A standby's work before its request (runtime/forkserver.py): CUDA initialised, the device's primary context
    made, cuBLAS and Triton's driver utilities loaded, which a start otherwise pays in cuda_init, its first
    allocation, its first product and its first Triton kernel; {"standby_cuda_ms": ...}, or {} with no torch or no
    GPU to prepare. Its memory (torch's cache, cuBLAS's workspace) is given back: an engine sizes its KV cache from
    what is free."""
    torch = sys.modules.get("torch")
    if not os.environ.get("CUDA_VISIBLE_DEVICES") or torch is None or not torch.cuda.is_available():
        return {}
    began = time.monotonic()
    torch.cuda.init()
    square = torch.ones(16, 16, dtype=torch.bfloat16, device="cuda")  # the context is made here
    (square @ square).sum().item()
    del square
    clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear_workspaces is not None:
        clear_workspaces()
    torch.cuda.empty_cache()
    triton = sys.modules.get("triton")   # its CUDA driver utilities, which its first kernel launch loads
    if triton is not None:
        with contextlib.suppress(Exception):   # an optimisation: the first launch loads them instead
            triton.runtime.driver.active.get_current_target()
    return {"standby_cuda_ms": round((time.monotonic() - began) * 1000)}


def cuda_init() -> dict[str, int]:
    """Initialise CUDA before the enter hooks when this replica has a GPU and torch is loaded, so the start's
    breakdown shows what it cost (cuda_init_ms) apart from the hooks; {} when there is nothing to initialise."""
    torch = sys.modules.get("torch")
    if not os.environ.get("CUDA_VISIBLE_DEVICES") or torch is None:
        return {}
    began = time.monotonic()
    if not torch.cuda.is_available():
        if torch.backends.cuda.is_built():  # a CUDA torch given a GPU that it cannot see: never serve on the CPU
            raise RuntimeError(
                f"this replica was given GPU {os.environ['CUDA_VISIBLE_DEVICES']} but torch sees no CUDA device: "
                "something asked CUDA for its devices before the fork (in the fork server or a snap=True hook, "
                "where CUDA_VISIBLE_DEVICES is empty) and torch kept the answer; keep CUDA calls, including "
                "torch.cuda.is_available(), in @ember.enter(snap=False)")
        return {}
    torch.cuda.init()
    return {"cuda_init_ms": round((time.monotonic() - began) * 1000)}


@contextlib.contextmanager
def profiled_start():
    """With EMBER_PROFILE_START=DIR, the enter hooks run under cProfile (the calling thread only) and their stats go
    to DIR/start-PID.prof and .txt (the 40 costliest calls by cumulative time): where a replica's start goes."""
    folder = os.environ.get("EMBER_PROFILE_START")
    if not folder:
        yield
        return
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()
    profile.enable()
    try:
        yield
    finally:
        profile.disable()
        try:
            path = Path(folder)
            path.mkdir(parents=True, exist_ok=True)
            profile.dump_stats(path / f"start-{os.getpid()}.prof")
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(40)
            (path / f"start-{os.getpid()}.txt").write_text(text.getvalue())
        except OSError as err:
            print(f"ember: EMBER_PROFILE_START={folder}: could not write the start's profile: {err}", file=sys.stderr,
                  flush=True)


def serve(channel: ControlChannel, started: float, load: Callable[[], tuple[Any, Any]],
          prepared: dict[str, int] | None = None) -> int:
    """Load the unit (`load()` -> the unit and its instance when its snap=True hooks already ran), run its enter
    hooks, say ready on the control channel and serve until SIGTERM; the process's exit code. `prepared`: what a
    standby did before the request (it joins the breakdown, outside the start's time)."""
    timings: dict[str, int | str] = dict(prepared or {})
    phase = "import"
    try:
        unit, snapped = load()
        logs.setup_replica(unit.name)
        timings["import_ms"] = round((time.monotonic() - started) * 1000)
        phase = "enter"
        startup.phases.clear()  # a forked replica reports its own start, not its template's
        timings.update(cuda_init())
        began = time.monotonic()
        loader = sys.modules.get("ember.runtime.engine.models.loader")
        weights_before = getattr(loader, "last_start", None)  # a fork's template may have loaded some already
        if hasattr(unit, "user_cls"):
            with profiled_start():
                obj = unit.enter(unit.snap() if snapped is None else snapped)
        else:
            obj = None
        timings["enter_ms"] = round((time.monotonic() - began) * 1000)
        weights = getattr(sys.modules.get("ember.runtime.engine.models.loader"), "last_start", None)
        if weights is not None and weights is not weights_before:  # the enter hooks loaded weights: snapshot or full
            timings.update(weights=weights.source, weights_ms=round(weights.seconds * 1000))
        timings.update(startup.phases)
        gpu_image = getattr(sys.modules.get("ember.runtime.engine.model_runner"), "last_gpu_image", None)
        if gpu_image is not None:  # "reserved": the engine's memory is at the device addresses its image recorded
            timings["gpu_image"] = gpu_image
        phase = "serve"
        secret = secrets.token_urlsafe(32)
        asgi = logs.AccessLog(build_asgi(LoadedUnit(unit, obj), secret), quiet=REPLICA_QUIET)
        # IPPROTO_TCP, so asyncio sets TCP_NODELAY: headers and body go out in two sends, and Nagle
        # with delayed ACK would hold every reply ~40 ms.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
    except BaseException as exc:
        traceback.print_exc()
        channel.send(control.Failed(phase, f"{type(exc).__name__}: {exc}"))
        return 1
    # A stop that comes between the ready line and the server's own handlers still runs the exit hooks.
    stops: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _: stops.append(signum))
    heap.settle()  # what the start built lives as long as the replica: no collection walks it again
    channel.send(control.Ready(sock.getsockname()[1], started, timings, secret))
    try:
        _serve(asgi, sock, stops)
    finally:
        if obj is not None:
            unit.stop(obj)
    if health.reason is not None:  # a call that could not be stopped may still hold a thread: do not wait for it
        sys.stderr.flush()
        os._exit(EXIT_UNHEALTHY)
    return 0


if __name__ == "__main__":
    sys.exit(main())
