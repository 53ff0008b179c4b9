"""One replica: load a package, run enter hooks, serve calls on 127.0.0.1, run exit hooks on SIGTERM.

    python -m ember.runtime.worker --package P --target NAME

stdout is the control channel to the gateway: one JSON line {"event": "ready", "port", "timings"}
or {"event": "failed", "phase", "error"}. Everything the user's code prints goes to stderr,
which the gateway sends to the replica's log file.
"""
import time

STARTED = time.monotonic()  # before heavy imports: the gateway measures spawn time up to here

import argparse  # noqa: E402
import asyncio  # noqa: E402
import contextlib  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from typing import Any, Callable  # noqa: E402

from ember.runtime import tracing  # noqa: E402


class ControlChannel:
    """The original stdout, kept for the gateway; fd 1 is pointed at the log so user prints land there."""

    def __init__(self) -> None:
        self._out = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)
        sys.stdout = sys.stderr

    def send(self, **message: Any) -> None:
        self._out.write(json.dumps(message) + "\n")
        self._out.flush()


def argument_problem(fn, kwargs: dict) -> str | None:
    """Why `kwargs` cannot call `fn` — every unknown and missing name, and what it takes — or None when they can."""
    signature = inspect.signature(fn)
    try:
        signature.bind(**kwargs)
        return None
    except TypeError as exc:
        params = signature.parameters.values()
        named = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        open_ended = any(p.kind is p.VAR_KEYWORD for p in params)
        unknown = [] if open_ended else [k for k in kwargs if k not in named]
        missing = [p.name for p in params if p.name in named and p.default is p.empty and p.name not in kwargs]
        parts = ([f"unknown argument{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown))}"] if unknown else []) + \
                ([f"missing required argument{'s' * (len(missing) > 1)} {', '.join(map(repr, missing))}"] if missing else [])
        if not parts:
            return str(exc)
        return f"{'; '.join(parts)}; it takes ({', '.join(named)})"


def _error_response(status: int, type: str, message: str):
    from starlette.responses import JSONResponse

    return JSONResponse({"error": {"type": type, "message": message}}, status_code=status)


class Replica:
    """The loaded unit (a function or a class instance) and the calls it serves."""

    def __init__(self, unit: Any, obj: Any):
        self.unit, self.obj = unit, obj
        self.timeout = unit.spec.timeout
        self.parking = Parking(obj, getattr(unit, "park_hooks", []), getattr(unit, "wake_hooks", []))

    def target(self, method: str) -> Callable | None:
        if self.obj is None:
            return self.unit.fn if method == self.unit.name and not self.unit.is_asgi else None
        return getattr(self.obj, method) if method in self.unit.methods else None

    def asgi(self) -> Callable | None:
        if self.obj is None:
            return self.unit.fn() if self.unit.is_asgi else None
        return getattr(self.obj, self.unit.asgi)() if self.unit.asgi else None

    async def call(self, request):
        await self.parking.ready()  # the gateway routes a call to a parked replica as its wake
        fn = self.target(request.path_params["method"])
        if fn is None:
            return _error_response(404, "not_found", f"{self.unit.name} has no method {request.path_params['method']!r}")
        try:
            kwargs = json.loads(await request.body() or b"{}")
        except ValueError as exc:
            return _error_response(400, "invalid_json", f"request body is not valid JSON: {exc}")
        if not isinstance(kwargs, dict):
            return _error_response(422, "invalid_arguments", "request body must be a JSON object of keyword arguments")
        problem = argument_problem(fn, kwargs)
        if problem is not None:
            return _error_response(422, "invalid_arguments", problem)
        try:
            if inspect.iscoroutinefunction(fn):
                result = await asyncio.wait_for(fn(**kwargs), self.timeout)
            else:
                result = await asyncio.wait_for(asyncio.to_thread(fn, **kwargs), self.timeout)
        except asyncio.TimeoutError:
            return _error_response(504, "timeout", f"call exceeded the function's timeout of {self.timeout:g} s")
        except Exception as exc:  # the user's error goes to the caller as JSON, the traceback to the log
            traceback.print_exc()
            return _error_response(500, "function_error", f"{type(exc).__name__}: {exc}")
        try:
            body = json.dumps({"result": result})
        except (TypeError, ValueError) as exc:
            return _error_response(500, "result_not_json", f"the function returned a value JSON cannot encode: {exc}")
        from starlette.responses import Response

        return Response(body, media_type="application/json")


class Parking:
    """Park (T1): release the replica's GPU memory and keep its process; wake: restore it before the next call.

    A class's @ember.park() hooks run first (an LLM engine releases its weights and KV cache there), then the GPU
    tensors of the instance's torch modules move to pinned host RAM; a wake moves them back and then runs the
    @ember.wake() hooks. One at a time: a call that arrives while a park is under way waits for it, then wakes.
    On a CPU-only replica there is no device memory to release, so parking only runs the hooks.
    """

    def __init__(self, obj: Any, park_hooks: list[str] = (), wake_hooks: list[str] = ()):
        self.obj, self.parked = obj, False
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
        for t in self._tensors():
            if t.is_cuda:
                self.devices[t] = t.device
                t.data = t.data.to("cpu").pin_memory()
        if self.devices:
            sys.modules["torch"].cuda.empty_cache()

    def _wake(self) -> None:
        for t, device in self.devices.items():
            t.data = t.data.to(device, non_blocking=True)
        if self.devices:
            sys.modules["torch"].cuda.synchronize()
        self.devices.clear()
        for name in self.wake_hooks:
            getattr(self.obj, name)()

    async def park(self) -> dict:
        async with self.lock:
            began = time.monotonic()
            before = device_bytes()
            if not self.parked:
                await asyncio.to_thread(self._park)
                self.parked = True
            return {"parked": True, "ms": round((time.monotonic() - began) * 1000), "host_bytes": rss_bytes(),
                    "device_bytes_released": max(before - device_bytes(), 0)}

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


def build_asgi(replica: Replica):
    """Internal routes under /__ember__/; every other path goes to the user's ASGI app, if any."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def health(request):
        return JSONResponse({"ok": True, "parked": replica.parking.parked})

    async def park(request):
        return JSONResponse(await replica.parking.park())

    async def wake(request):
        return JSONResponse(await replica.parking.wake())

    internal = Starlette(routes=[
        Route("/__ember__/call/{method}", replica.call, methods=["POST"]),
        Route("/__ember__/health", health),
        Route("/__ember__/park", park, methods=["POST"]),
        Route("/__ember__/wake", wake, methods=["POST"]),
    ])
    user_app = replica.asgi()

    async def root(scope, receive, send):
        if scope["type"] == "lifespan":
            await (user_app or internal)(scope, receive, send)
        elif scope["path"].startswith("/__ember__/") or user_app is None:
            if tracing.enabled and scope["path"].startswith(CALL_PATH):
                function = scope["path"][len(CALL_PATH):]
                await traced(internal, scope, receive, send, f"call {function}", function)
            else:
                await internal(scope, receive, send)
        else:
            await replica.parking.ready()
            if tracing.enabled and scope["type"] == "http":
                await traced(user_app, scope, receive, send, f"{scope['method']} {scope['path']}", replica.unit.name)
            else:
                await user_app(scope, receive, send)

    return root


async def traced(app, scope, receive, send, name: str, function: str) -> None:
    """Serve one request inside a SERVER span that continues the gateway's trace context; the context is current
    while `app` runs, so the user's code (an LLM engine, say) can add child spans to the same trace."""
    from opentelemetry import context, trace
    from opentelemetry.trace import SpanKind, StatusCode

    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
    span = tracing.tracer().start_span(
        name, tracing.extract(headers), SpanKind.SERVER,
        attributes={"ember.function": function, "ember.replica.id": headers.get("x-ember-replica", ""),
                    "http.request.method": scope["method"], "url.path": scope["path"]})
    status = 500

    async def sending(message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        await send(message)

    token = context.attach(trace.set_span_in_context(span))
    try:
        await app(scope, receive, sending)
    except BaseException as exc:
        span.record_exception(exc)
        raise
    finally:
        context.detach(token)
        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            span.set_status(StatusCode.ERROR, f"HTTP {status}")
        span.end()


def _serve(app, sock: socket.socket) -> None:
    import uvicorn

    class ReplicaServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            # Stop serving on SIGTERM instead of re-raising it, so exit hooks still run.
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: setattr(self, "should_exit", True))
            yield

    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5, lifespan="auto")
    ReplicaServer(config).run(sockets=[sock])  # uvicorn's loop factory: uvloop where installed


def read_secrets(names: list[str]) -> dict[str, str]:
    """The KEY=VALUE lines of EMBER_HOME/secrets/NAME.env for each secret the function lists."""
    from ember.home import Home

    values = {}
    for name in names:
        path = Home().secrets / f"{name}.env"
        if not path.is_file():
            raise FileNotFoundError(f"secret {name!r} not found: create {path} with KEY=VALUE lines")
        for line in path.read_text().splitlines():
            key, sep, value = line.partition("=")
            if sep and not line.lstrip().startswith("#"):
                values[key.strip()] = value.strip()
    return values


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM this replica if its gateway dies without stopping it (no orphaned replicas)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ember.runtime.worker", description=__doc__.splitlines()[0])
    parser.add_argument("--package", required=True, help="path of the .pkg file")
    parser.add_argument("--target", required=True, help="function or class name inside the app")
    args = parser.parse_args(argv)
    _die_with_parent()
    tracing.setup("ember-worker")  # before the user's enter hooks, so they can trace too
    control = ControlChannel()
    timings = {}
    phase = "import"
    try:
        from ember.package import unpack

        app = unpack(args.package)
        unit = app.units[args.target]
        # snapshot=True: the LLM engine restores its weights from (or, after a full boot, writes) this store;
        # `EMBER_SNAPSHOT_STORE=s3://bucket/prefix ember serve` overrides the default.
        if unit.spec.snapshot:
            os.environ.setdefault("EMBER_SNAPSHOT_STORE", "local")
        else:
            os.environ.pop("EMBER_SNAPSHOT_STORE", None)
        os.environ.update(unit.spec.env)
        os.environ.update(read_secrets(unit.spec.secrets))
        timings["import_ms"] = round((time.monotonic() - STARTED) * 1000)
        phase = "enter"
        began = time.monotonic()
        obj = unit.start() if hasattr(unit, "user_cls") else None
        timings["enter_ms"] = round((time.monotonic() - began) * 1000)
        weights = getattr(sys.modules.get("ember.runtime.engine.models.loader"), "last_start", None)
        if weights is not None:  # an engine loaded weights in the enter hooks: from a snapshot or a full boot
            timings.update(weights=weights.source, weights_ms=round(weights.seconds * 1000))
        phase = "serve"
        asgi = build_asgi(Replica(unit, obj))
        # IPPROTO_TCP, so asyncio sets TCP_NODELAY: headers and body go out in two sends, and Nagle
        # with delayed ACK would hold every reply ~40 ms.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
    except BaseException as exc:
        traceback.print_exc()
        control.send(event="failed", phase=phase, error=f"{type(exc).__name__}: {exc}")
        return 1
    control.send(event="ready", port=sock.getsockname()[1], started=STARTED, timings=timings)
    try:
        _serve(asgi, sock)
    finally:
        if obj is not None:
            unit.stop(obj)
    return 0


if __name__ == "__main__":
    sys.exit(main())
