"""The gateway's HTTP surface. The request path reads top to bottom in `invoke`:
auth -> resolve -> authorise -> read body (calls and LLM requests only) -> rate limit -> queue -> proxy
(call, or forward to an ASGI endpoint) -> settle the rate limit when the response ends."""
import asyncio
import contextlib
import json
import logging
import re
import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from ember.gateway import errors, proxy
from ember.gateway.admin import admin_router
from ember.gateway.affinity import prefix_key, prompt_text
from ember.gateway.app_limits import AppLimitStore
from ember.gateway.auth import authenticate, authorize
from ember.gateway.backends.local import LocalBackend
from ember.gateway.deployment import Deployment, Unit
from ember.gateway.errors import ApiError
from ember.gateway.header_limit import HeaderLimit
from ember.gateway.keys import ApiKey, KeyStore
from ember.gateway.metrics import Metrics
from ember.gateway.queue import Lease
from ember.gateway.ratelimit import ERROR_TYPE, Admission, Limits, MemoryLimiter, Scope, denial_message, headers
from ember.gateway.replica import STOPPING
from ember.gateway.routing import APP_NAME, SESSION, Call, Forward, route
from ember.gateway.scaler import Scaler
from ember.gateway.usage import OPENAI_PATHS, UsageMeter, estimate, max_tokens
from ember.home import Home
from ember.runtime import tracing

log = logging.getLogger("ember.gateway")

MAX_BODY = 16 * 1024 * 1024
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
UNLIMITED = Limits()
SESSION_ID = re.compile(r"[\x21-\x7e]{1,256}")  # printable ASCII: it only feeds a hash


class Gateway:
    """Everything one `ember serve` runs: keys, deployed apps, the local backend and the autoscaler."""

    def __init__(self, home: Home, backend: LocalBackend | None = None, limiter=None, routing: str = "affinity"):
        self.home = home
        self.keys = KeyStore(home.db)
        self.deployments: dict[str, Deployment] = {}
        self.backend = backend or LocalBackend(home.logs)
        self.scaler = Scaler(self.backend, self.deployments)
        self.metrics = Metrics()
        self.app_limits = AppLimitStore(home.db)
        self.limiter = limiter or MemoryLimiter()  # a RedisLimiter when several gateways share the limits
        self.routing = routing
        self.started = time.monotonic()
        self.ready = False

    def register(self, package: Path) -> tuple[Deployment, Deployment | None]:
        deployment = Deployment.from_package(package, self.scaler.poke)
        if not APP_NAME.fullmatch(deployment.name):
            raise ValueError(f"app name {deployment.name!r} must match {APP_NAME.pattern} (lower-case letters, digits, - and _)")
        for unit in deployment.units.values():
            unit.queue.routing = self.routing
        previous = self.deployments.get(deployment.name)
        self.deployments[deployment.name] = deployment
        return deployment, previous

    async def deploy(self, package: Path) -> Deployment:
        deployment, previous = self.register(package)
        if previous is not None:  # the new version takes new calls; the old one's replicas finish theirs and stop
            replicas = []
            for unit in previous.units.values():
                unit.queue.fail_waiters(f"app {deployment.name!r} was redeployed while this call waited; retry it")
                replicas += unit.queue.replicas.values()
            for replica in replicas:
                replica.state = STOPPING
            await asyncio.gather(*(self.backend.stop(r) for r in replicas))
        return deployment

    async def admit(self, key: ApiKey, app: str, tokens: int) -> Admission | None:
        """Charge the key's and the app's limits, or answer 429; None when neither has any."""
        app_limits = self.app_limits.cached(app) or await asyncio.to_thread(self.app_limits.get, app)
        scopes = [s for s in (Scope(f"key:{key.id}", key.limits), Scope(f"app:{app}", app_limits)) if s.limits != UNLIMITED]
        if not scopes:
            return None
        try:
            admission = await self.limiter.admit(scopes, tokens=tokens)
        except Exception as exc:  # Redis down or unreachable: fail closed, limits are a promise to the operator
            log.error("rate limiter unavailable: %s: %s", type(exc).__name__, exc)
            raise ApiError(503, "rate_limiter_unavailable", "the rate-limit store (Redis) is not answering; retry shortly",
                           {"Retry-After": "1"}) from None
        if not admission.allowed:
            raise ApiError(429, ERROR_TYPE, denial_message(admission), headers(admission))
        return admission


class Settlement:
    """Frees the rate-limit charge once, when the response has ended, with the tokens it really used; a stream
    that holds a concurrency slot renews it meanwhile, so it outlives the limiter's lease TTL."""

    def __init__(self, gateway: Gateway, admission: Admission | None, meter: UsageMeter | None):
        self.gateway, self.admission, self.meter = gateway, admission, meter
        self.renewal: asyncio.Task | None = None

    def hold(self) -> None:
        if self.admission is not None and any(s.limits.max_concurrent for s in self.admission.ticket.scopes):
            self.renewal = asyncio.create_task(self._renew(self.admission))

    async def _renew(self, admission: Admission) -> None:
        while True:
            await asyncio.sleep(self.gateway.limiter.lease_ttl / 3)
            with contextlib.suppress(Exception):  # a missed renewal costs nothing until the lease would expire
                await self.gateway.limiter.renew(admission.ticket)

    async def __call__(self) -> None:
        admission, self.admission = self.admission, None
        if admission is None:
            return
        if self.renewal is not None:
            self.renewal.cancel()
        try:
            await self.gateway.limiter.release(admission.ticket, used_tokens=self.meter.total() if self.meter else None)
        except Exception as exc:  # the lease expires by itself; the reply already went out
            log.error("rate limiter release failed: %s: %s", type(exc).__name__, exc)


async def read_body(request: Request) -> bytes:
    """The whole body, counted as it arrives: Content-Length alone is not trusted."""
    try:
        declared = int(request.headers.get("content-length") or 0)
    except ValueError:
        raise ApiError(400, "invalid_request", "Content-Length is not a number") from None
    if declared > MAX_BODY:
        raise ApiError(413, "body_too_large", f"request body is over {MAX_BODY} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY:
            raise ApiError(413, "body_too_large", f"request body is over {MAX_BODY} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def read_kwargs(request: Request) -> bytes:
    """The call's body, checked to be a JSON object of keyword arguments."""
    body = await read_body(request) or b"{}"
    try:
        kwargs = json.loads(body)
    except ValueError as exc:
        raise ApiError(400, "invalid_json", f"request body is not valid JSON: {exc}") from None
    if not isinstance(kwargs, dict):
        raise ApiError(422, "invalid_arguments", f"request body must be a JSON object of keyword arguments, got {type(kwargs).__name__}")
    return body


def session_id(request: Request) -> str | None:
    """The routing key of X-Session-ID, if the request has one."""
    value = request.headers.get("x-session-id")
    if value is None:
        return None
    if not SESSION_ID.fullmatch(value):
        raise ApiError(400, "invalid_session_id", "X-Session-ID must be 1-256 printable ASCII characters without spaces")
    return SESSION + value


async def read_llm(request: Request, target: Forward, session: str | None) -> tuple[bytes | None, int, UsageMeter | None, str | None]:
    """For an OpenAI completion POST: its bytes (forwarded as read), token estimate, usage meter and routing key."""
    if request.method != "POST" or target.path not in OPENAI_PATHS:
        return None, 0, None, session
    body = await read_body(request)
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):  # the engine answers it with its own 400
        return body, 0, None, session
    tokens = estimate(parsed)
    return body, tokens, UsageMeter(tokens - max_tokens(parsed)), session or prefix_key(prompt_text(parsed))


def resolve(deployments: dict[str, Deployment], app_name: str, rest: str) -> tuple[Unit, Call | Forward]:
    if not APP_NAME.fullmatch(app_name):
        raise ApiError(400, "invalid_name", f"app names match {APP_NAME.pattern}; got {app_name[:80]!r}")
    deployment = deployments.get(app_name)
    if deployment is None:
        raise ApiError(404, "not_found", f"no app named {app_name!r}; deployed: {sorted(deployments)}")
    target = route(deployment.units, rest)
    if target is None:
        names = [f"{u.name}.{m}" if u.kind == "class" else m for u in deployment.units.values() for m in u.methods]
        raise ApiError(404, "not_found", f"app {app_name!r} has no function {rest[:200]!r}; it serves {names}")
    return deployment.units[target.unit], target


async def send_with_retry(unit: Unit, lease: Lease, key: str | None, retryable: bool, send) -> tuple:
    """`send(replica, trace_headers)`; a replica that fails before its first response byte is retried once on another
    hot one. The lease's slot is released on failure; on success the caller owns it."""
    for attempt in (1, 2):
        try:
            if tracing.enabled:
                return await hop(send, lease.replica, attempt), lease
            return await send(lease.replica, None), lease
        except proxy.Unreachable as exc:
            unit.queue.release(lease.replica)
            retry = unit.queue.try_acquire(key, frozenset({lease.replica.id})) if retryable and attempt == 1 else None
            if retry is None:
                raise exc.error from None
            log.warning("replica %s failed before answering (%s); retrying on %s", lease.replica.id, exc.error.message, retry.replica.id)
            lease = Lease(retry.replica, lease.cold_start)
        except BaseException:
            unit.queue.release(lease.replica)
            raise


async def call(request: Request, unit: Unit, target: Call, body: bytes, key: str | None) -> tuple[Response, Lease]:
    client = request.app.state.client
    lease = await (queued(unit, key) if tracing.enabled else unit.queue.acquire(key))
    response, lease = await send_with_retry(
        unit, lease, key, True,
        lambda replica, trace: proxy.call(client, replica, target.method, body, unit.spec.timeout, trace))
    unit.queue.release(lease.replica)
    return response, lease


async def forward(request: Request, unit: Unit, target: Forward, body: bytes | None, key: str | None,
                  meter: UsageMeter | None, settle: Settlement) -> tuple[Response, Lease]:
    """To the app's ASGI endpoint; the replica slot and rate-limit charge are held until the streamed response ends.
    Only a body the gateway holds (read for an LLM request, or none for GET/HEAD) can be sent twice."""
    client = request.app.state.client
    held = body is not None or request.method in ("GET", "HEAD", "OPTIONS", "DELETE")
    lease = await (queued(unit, key) if tracing.enabled else unit.queue.acquire(key))
    upstream, lease = await send_with_retry(
        unit, lease, key, held,
        lambda replica, trace: proxy.open_stream(client, replica, request, target.path, body, unit.spec.timeout,
                                                 MAX_BODY, trace))

    async def close() -> None:
        unit.queue.release(lease.replica)
        await settle()

    settle.hold()
    return proxy.Relay(upstream, close, meter), lease


# Tracing (runtime/tracing.py): reached only when `tracing.enabled`, so a gateway without it pays one flag read a hop.
QUEUED = 0.0005  # a free slot is handed over without awaiting (microseconds): a longer acquire waited in the queue


async def traced(request: Request, handle) -> Response:
    """`handle` inside a SERVER span that continues the caller's `traceparent`; a streamed reply ends it with the stream.
    Status codes follow OpenTelemetry's HTTP server conventions: 5xx marks the span an error, 4xx names error.type."""
    from opentelemetry import context, trace
    from opentelemetry.trace import SpanKind

    app_name = request.path_params["app_name"]
    span = tracing.tracer().start_span(
        f"{request.method} /{app_name}", tracing.extract(request.headers), SpanKind.SERVER,
        attributes={"http.request.method": request.method, "http.route": INVOKE_PATH, "url.path": request.url.path,
                    "ember.app": app_name, "ember.retries": 0})
    token = context.attach(trace.set_span_in_context(span))
    try:
        response = await handle(request)
    except ApiError as exc:
        _end(span, exc.status, exc.type)
        raise
    except BaseException as exc:
        span.record_exception(exc)
        _end(span, 500, type(exc).__name__)
        raise
    finally:
        context.detach(token)
    if isinstance(response, proxy.Relay):
        on_close, status = response.on_close, response.status_code

        async def close() -> None:
            try:
                await on_close()
            finally:
                _end(span, status)

        response.on_close = close
    else:
        _end(span, response.status_code)
    return response


def _end(span, status: int, error_type: str | None = None) -> None:
    from opentelemetry.trace import StatusCode

    span.set_attribute("http.response.status_code", status)
    if error_type is not None:
        span.set_attribute("error.type", error_type)
    if status >= 500:
        span.set_status(StatusCode.ERROR, error_type or f"HTTP {status}")
    span.end()


def name_span(method: str, unit: Unit, target: Call | Forward) -> None:
    from opentelemetry import trace

    function = target.method if isinstance(target, Call) else unit.name
    span = trace.get_current_span()
    span.update_name(f"{method} /{unit.app}/{function}")
    span.set_attribute("ember.function", function)


def describe_span(lease: Lease) -> None:
    from opentelemetry import trace

    span = trace.get_current_span()
    span.set_attribute("ember.replica.id", lease.replica.id)
    if lease.cold_start:
        tier, _, ms = lease.cold_start.partition("; ms=")
        span.set_attributes({"ember.cold_start.tier": tier, "ember.cold_start.ms": int(ms)})


async def queued(unit: Unit, key: str | None) -> Lease:
    """`unit.queue.acquire`, its wait on the SERVER span, and a child span for it when the call waited in line."""
    from opentelemetry import trace

    began, began_ns = time.monotonic(), time.time_ns()
    lease = await unit.queue.acquire(key)
    waited = time.monotonic() - began
    trace.get_current_span().set_attribute("ember.queue.wait_ms", round(waited * 1000, 3))
    if waited >= QUEUED:
        span = tracing.tracer().start_span("ember.queue", start_time=began_ns,
                                           attributes={"ember.replica.id": lease.replica.id})
        if lease.cold_start:
            span.set_attribute("ember.cold_start", lease.cold_start)
        span.end(began_ns + int(waited * 1e9))
    return lease


async def hop(send, replica, attempt: int):
    """One attempt at a replica as a CLIENT span, whose context rides upstream as `traceparent`; a retry is another.
    It lasts until the reply (a stream: its head; the SERVER span lasts to the stream's end)."""
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind, StatusCode

    if attempt > 1:
        trace.get_current_span().set_attribute("ember.retries", attempt - 1)
    with tracing.tracer().start_as_current_span(
            "replica", kind=SpanKind.CLIENT, attributes={"ember.replica.id": replica.id, "ember.attempt": attempt,
                                                         "server.address": replica.host, "server.port": replica.port}) as span:
        reply = await send(replica, tracing.inject({"x-ember-replica": replica.id}))
        status = reply.status_code if isinstance(reply, Response) else reply.status  # a call's reply, or a stream's head
        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            span.set_status(StatusCode.ERROR, f"HTTP {status}")
        return reply


def create_app(gateway: Gateway) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async with proxy.client() as client:
            app.state.client = client
            scaler = asyncio.create_task(gateway.scaler.run())
            gateway.ready = True
            try:
                yield
            finally:
                gateway.ready = False
                scaler.cancel()
                await gateway.scaler.stop_all()
                await asyncio.to_thread(tracing.flush)

    app = FastAPI(title="Ember gateway", version="1", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  **tracing.fastapi_options())
    errors.install(app)
    app.include_router(admin_router(gateway))

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"ok": True}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        if not gateway.ready:
            raise ApiError(503, "not_ready", "the gateway is starting or stopping", {"Retry-After": "1"})
        return JSONResponse({"ok": True, "apps": sorted(gateway.deployments)})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(gateway.metrics.render(gateway.deployments), media_type="text/plain; version=0.0.4")

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi() -> JSONResponse:
        return JSONResponse(spec(app))

    async def invoke(request: Request) -> Response:
        if tracing.enabled:
            return await traced(request, handle)
        return await handle(request)

    async def handle(request: Request) -> Response:
        app_name, rest = request.path_params["app_name"], request.path_params["rest"]
        key = await authenticate(gateway.keys, request)  # before anything reads the body
        unit, target = resolve(gateway.deployments, app_name, rest)
        if tracing.enabled:
            name_span(request.method, unit, target)
        try:
            response, lease, admission = await answer(request, key, unit, target)
        except ApiError as exc:  # refusals (403, 413, 429, 503, ...) show in /metrics next to answers
            gateway.metrics.observe(app_name, unit.name, exc.status, None)
            raise
        gateway.metrics.observe(app_name, unit.name, response.status_code, lease.cold_start)
        if tracing.enabled:
            describe_span(lease)
        return _stamp(response, lease, headers(admission) if admission else {})

    async def answer(request: Request, key: ApiKey, unit: Unit, target: Call | Forward) -> tuple[Response, Lease, Admission | None]:
        authorize(key, unit.app, unit.name)
        session = session_id(request)
        if isinstance(target, Call):
            if request.method != "POST":
                raise ApiError(405, "method_not_allowed", f"call {target.method!r} with POST and a JSON object of keyword arguments")
            body, tokens, meter, affinity = await read_kwargs(request), 0, None, session
        else:
            body, tokens, meter, affinity = await read_llm(request, target, session)
        admission = await gateway.admit(key, unit.app, tokens)
        settle = Settlement(gateway, admission, meter)
        try:
            if isinstance(target, Call):
                response, lease = await call(request, unit, target, body, affinity)
                await settle()
            else:
                response, lease = await forward(request, unit, target, body, affinity, meter, settle)
        except BaseException:
            await settle()
            raise
        return response, lease, admission

    # A plain Starlette route: FastAPI's parameter solving cost ~0.05 ms a request on the hot path. `spec` documents it.
    app.router.routes.append(Route(INVOKE_PATH, invoke, methods=METHODS))
    app.add_middleware(HeaderLimit)
    return app


INVOKE_PATH = "/{app_name}/{rest:path}"
ERROR = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
ERROR_RESPONSES = {code: {"description": what} | ERROR for code, what in [
    (400, "bad request"), (401, "missing or invalid key"), (403, "key lacks the scope"), (404, "no such app or function"),
    (413, "body too large"), (429, "rate limited"), (503, "no replica available"), (504, "upstream timed out")]}


def spec(app: FastAPI) -> dict:
    """The OpenAPI document of the public surface, with bearer auth and the shared error shape."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        document = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = document.setdefault("components", {})
        components.setdefault("schemas", {})["Error"] = {
            "type": "object", "required": ["error"],
            "properties": {"error": {"type": "object", "required": ["type", "message"],
                                     "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}}}
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        invoke = {"summary": "Call a function, or reach an app's ASGI endpoint",
                  "parameters": [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}} for name in ("app_name", "rest")],
                  "responses": {"200": {"description": "the function's result, or the app's reply"}} | {str(code): r for code, r in ERROR_RESPONSES.items()}}
        document["paths"]["/{app_name}/{rest}"] = {m.lower(): invoke | {"operationId": f"invoke_{m.lower()}"} for m in METHODS}
        document["security"] = [{"bearer": []}]
        for path in ("/healthz", "/readyz", "/metrics"):
            document["paths"][path]["get"]["security"] = []
        app.openapi_schema = document
    return app.openapi_schema


def _stamp(response: Response, lease: Lease, limits: dict[str, str]) -> Response:
    """Every reply names its replica; one that waited for a start names the tier, time and breakdown."""
    extra = {"x-ember-replica": lease.replica.id} | {k.lower(): v for k, v in limits.items()}
    if lease.cold_start:
        extra["x-ember-cold-start"] = lease.cold_start
        if lease.replica.timings and lease.replica.tier != "parked":
            extra["x-ember-start-breakdown"] = ", ".join(f"{k}={v}" for k, v in lease.replica.timings.items())
    if isinstance(response, proxy.Relay):
        response.raw_headers += [(k.encode(), v.encode()) for k, v in extra.items()]
    else:
        response.headers.update(extra)
    return response
