"""The gateway's HTTP surface: the app factory, and the request path of a call, which reads top to bottom in
`invoke`: auth -> resolve -> authorise -> read body -> rate limit -> queue and send (retried once elsewhere) ->
stamp headers; the rate limit is settled when the response ends. Tracing wraps the invoke route from outside."""
import asyncio
import contextlib
import posixpath
import re
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar
from urllib.parse import unquote

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.middleware import Middleware
from starlette.routing import Route

from ember.gateway import dashboard, errors, openapi, proxy, retry, spans
from ember.gateway.admin import admin_router
from ember.gateway.auth import authenticate, authorize
from ember.gateway.body import read_forward, read_kwargs, session_id
from ember.gateway.calls import calls_router, wants_spawn
from ember.gateway.deployment import Deployment, Unit
from ember.gateway.errors import ApiError
from ember.gateway.header_limit import HeaderLimit
from ember.gateway.keys import ApiKey
from ember.gateway.logfeed import logfeed_router
from ember.gateway.queue import Lease
from ember.gateway.ratelimit import Admission, headers
from ember.gateway.record import CallRecord
from ember.gateway.routing import APP_NAME, Call, Forward, route
from ember.gateway.service import Gateway
from ember.gateway.settlement import Settlement, charge
from ember.gateway.stamp import stamp
from ember.runtime import log_budget, logs, tracing
from ember.runtime.disconnect import WorkCancelled, unless_disconnected

QUIET = ("/healthz", "/readyz", f"{dashboard.PATH}/api/", f"{dashboard.PATH}/static/")  # polled: ids, no access line


def reserved(path: str) -> bool:
    """A path the replica keeps for the gateway (/__ember__/...), in any spelling: decoded, dot segments resolved,
    slashes collapsed, as the replica's router would read it."""
    normal = posixpath.normpath(re.sub(r"/+", "/", "/" + unquote(path)))
    return normal.lower().startswith("/__ember__")


SHUTTING_DOWN = "the gateway is shutting down"
T = TypeVar("T")


async def answer_unless_disconnected(request: Request, work: Awaitable[T], cut_short: asyncio.Event) -> T:
    """Await `work`, cancelling it if the client hangs up first: the call is cancelled on the replica (its connection
    closes) and every slot it held, the replica's and the key's, is freed at once. The same when the stopping
    gateway's grace period ends (`cut_short`), which answers 503."""
    try:
        return await unless_disconnected(request, work, cut_short)
    except WorkCancelled as cancelled:
        if cancelled.stopped:
            raise ApiError(503, "shutting_down", f"{SHUTTING_DOWN}: this call was cut short after the grace period; "
                                                 "retry it when the gateway is back", {"Retry-After": "5"}) from None
        raise ApiError(499, "client_closed_request", "the client disconnected; its call was cancelled") from None


def resolve(deployments: dict[str, Deployment], app_name: str, rest: str) -> tuple[Unit, Call | Forward]:
    if not APP_NAME.fullmatch(app_name):
        raise ApiError(400, "invalid_name", f"app names match {APP_NAME.pattern}; got {app_name[:80]!r}")
    deployment = deployments.get(app_name)
    if deployment is None:
        raise ApiError(404, "not_found", f"no app named {app_name!r}; `ember status` lists the deployed apps")
    target = route(deployment.units, rest)
    if isinstance(target, Forward) and reserved(target.path):
        target = None
    if target is None:
        names = [f"{u.name}.{m}" if u.kind == "class" else m for u in deployment.units.values() for m in u.methods]
        raise ApiError(404, "not_found", f"app {app_name!r} has no function {rest[:200]!r}; it serves {names}")
    return deployment.units[target.unit], target


def create_app(gateway: Gateway, background: Sequence[Callable[[], Coroutine[Any, Any, None]]] = ()) -> FastAPI:
    """The gateway's ASGI app; `background` tasks (ember serve's file watcher) run while it serves."""
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async with proxy.client() as client:
            app.state.client = client
            tasks = [asyncio.create_task(gateway.scaler.run()), asyncio.create_task(log_budget.keep_bounded(
                gateway.home.logs, gateway.live_logs))] + [asyncio.create_task(run()) for run in background]
            gateway.ready = True
            try:
                yield
            finally:
                gateway.ready = False
                for task in tasks:
                    task.cancel()
                await gateway.close()  # the replaced versions' replicas
                await gateway.scaler.stop_all()
                await asyncio.to_thread(tracing.flush)

    app = FastAPI(title="Ember gateway", version="1", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None, **tracing.fastapi_options())
    app.state.cut_short = gateway.cut_short  # streams relayed when a stop's grace period ends are ended (proxy.Relay)
    app.state.send_timeout = gateway.send_timeout  # and those whose client takes no bytes for that long are dropped
    errors.install(app)
    app.include_router(admin_router(gateway))
    app.include_router(logfeed_router(gateway))
    app.include_router(calls_router(gateway.keys, gateway.calls))
    dashboard.install(app, gateway)
    app.include_router(openapi.docs_router())

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"ok": True}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        if not gateway.ready:
            raise ApiError(503, "not_ready", "the gateway is starting or stopping", {"Retry-After": "1"})
        return JSONResponse({"ok": True, "apps": sorted(gateway.deployments)})

    @app.get("/metrics")
    async def metrics(request: Request) -> PlainTextResponse:
        await gateway.metrics.engines.refresh(request.app.state.client, gateway.deployments)
        return PlainTextResponse(gateway.metrics.render(gateway.deployments), media_type="text/plain; version=0.0.4")

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi_document(request: Request) -> JSONResponse:
        # The gateway's own routes for anyone; the deployed functions only to a key, and only those it may call.
        key = await authenticate(gateway.keys, request) if "authorization" in request.headers else None
        return JSONResponse(openapi.document(app, gateway.deployments, key))

    async def invoke(request: Request) -> Response:
        record = CallRecord(request.path_params["app_name"]).keep(request)
        try:
            if gateway.stopping:
                raise ApiError(503, "shutting_down", f"{SHUTTING_DOWN}; retry when it is back", {"Retry-After": "5"})
            key = await authenticate(gateway.keys, request)  # before anything reads the body
            unit, target = resolve(gateway.deployments, record.app, request.path_params["rest"])
        except ApiError as exc:
            record.error = exc.type
            raise
        record.function = target.method if isinstance(target, Call) else unit.name
        try:
            response, lease, admission = await answer(request, key, unit, target)
        except ApiError as exc:  # refusals (403, 413, 429, 503, ...) show in /metrics next to answers
            record.error = exc.type
            gateway.metrics.observe(record.app, unit.name, exc.status, None)
            raise
        limit_headers = headers(admission) if admission else {}
        if lease is None:  # spawned: the call runs on after this reply
            gateway.metrics.observe(record.app, unit.name, response.status_code, None)
            response.headers.update(limit_headers)
            return response
        record.lease = lease
        gateway.metrics.observe(record.app, unit.name, response.status_code, lease.cold_start, lease.waited_s)
        return stamp(response, lease, limit_headers)

    async def answer(request: Request, key: ApiKey, unit: Unit,
                     target: Call | Forward) -> tuple[Response, Lease | None, Admission | None]:
        authorize(key, unit.app, unit.name)
        session = session_id(request)
        try:
            if isinstance(target, Call):
                if request.method != "POST":
                    raise ApiError(405, "method_not_allowed",
                                   f"call {target.method!r} with POST and a JSON object of keyword arguments")
                body, tokens, meter, affinity = await read_kwargs(request, gateway.bodies), 0, None, session
                sequences = 1
            else:
                held = await read_forward(request, target, session, gateway.bodies)
                body, tokens, meter, affinity = held.body, held.tokens, held.meter, held.affinity
                sequences = held.slots
            admission = await charge(gateway.limiter, gateway.app_limits, key, unit.app, tokens)
            settle = Settlement(gateway.limiter, admission, meter)
            try:
                if isinstance(target, Call) and wants_spawn(request):
                    return await spawn(request, unit, target, body, affinity, settle, key.id), None, admission
                if isinstance(target, Call):
                    response, lease = await answer_unless_disconnected(request, retry.call(
                        request.app.state.client, unit, target, body, affinity, settle, retried(unit), key.id),
                        gateway.cut_short)
                else:
                    response, lease = await answer_unless_disconnected(request, retry.forward(
                        request, unit, target, body, affinity, meter, settle, retried(unit), key.id, sequences),
                        gateway.cut_short)
            except BaseException:
                await settle()
                raise
        finally:  # the body went upstream (or nowhere): its bytes leave the budget
            gateway.bodies.give(getattr(request.state, "body_held", 0))
        return response, lease, admission

    def retried(unit: Unit):
        return lambda reason: gateway.metrics.retried(unit.app, unit.name, reason)

    async def spawn(request: Request, unit: Unit, target: Call, body: bytes | bytearray, affinity: str | None,
                    settle: Settlement, caller: str) -> Response:
        """Run the call in the background (it holds its rate-limit charge until it ends); 202 and its id now."""
        client = request.app.state.client

        async def run() -> Response:
            response, _ = await retry.call(client, unit, target, body, affinity, settle, retried(unit), caller)
            return response

        path = target.method if unit.kind == "function" else f"{unit.name}.{target.method}"
        call_id = await gateway.calls.spawn(unit.app, path, run, settle, len(body))
        return JSONResponse({"call_id": call_id}, 202, {"Location": f"/calls/{call_id}"})

    traced = Middleware(tracing.ServerSpans, describe=spans.describe, finish=spans.finish)
    app.router.routes.append(Route(spans.INVOKE_ROUTE, invoke, methods=openapi.METHODS, middleware=[traced]))
    app.add_middleware(HeaderLimit)
    app.add_middleware(logs.AccessLog, on_start=gateway.metrics.started, on_end=gateway.metrics.ended, quiet=QUIET)
    return app
