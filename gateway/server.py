"""The gateway's HTTP surface. The request path reads top to bottom in `invoke`:
auth -> route (resolve) -> queue -> proxy (call, or forward to an ASGI endpoint)."""
import asyncio
import contextlib
import json
import time
from pathlib import Path

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from ember.gateway import errors, proxy
from ember.gateway.admin import admin_router
from ember.gateway.auth import authenticate
from ember.gateway.backends.local import LocalBackend
from ember.gateway.deployment import Deployment, Unit
from ember.gateway.errors import ApiError
from ember.gateway.keys import KeyStore
from ember.gateway.metrics import Metrics
from ember.gateway.queue import Lease
from ember.gateway.replica import STOPPING
from ember.gateway.routing import Call, Forward, route
from ember.gateway.scaler import Scaler
from ember.home import Home

MAX_BODY = 16 * 1024 * 1024
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


class Gateway:
    """Everything one `ember serve` runs: keys, deployed apps, the local backend and the autoscaler."""

    def __init__(self, home: Home, backend: LocalBackend | None = None):
        self.home = home
        self.keys = KeyStore(home.db)
        self.deployments: dict[str, Deployment] = {}
        self.backend = backend or LocalBackend(home.logs)
        self.scaler = Scaler(self.backend, self.deployments)
        self.metrics = Metrics()
        self.started = time.monotonic()
        self.ready = False

    def register(self, package: Path) -> tuple[Deployment, Deployment | None]:
        deployment = Deployment.from_package(package, self.scaler.poke)
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


async def read_kwargs(request: Request) -> bytes:
    """The call's body, checked to be a JSON object of keyword arguments."""
    if int(request.headers.get("content-length") or 0) > MAX_BODY:
        raise ApiError(413, "body_too_large", f"request body is over {MAX_BODY} bytes")
    body = await request.body()
    if len(body) > MAX_BODY:
        raise ApiError(413, "body_too_large", f"request body is over {MAX_BODY} bytes")
    try:
        kwargs = json.loads(body or b"{}")
    except ValueError as exc:
        raise ApiError(400, "invalid_json", f"request body is not valid JSON: {exc}") from None
    if not isinstance(kwargs, dict):
        raise ApiError(422, "invalid_arguments", f"request body must be a JSON object of keyword arguments, got {type(kwargs).__name__}")
    return body or b"{}"


def resolve(deployments: dict[str, Deployment], app_name: str, rest: str) -> tuple[Unit, Call | Forward]:
    deployment = deployments.get(app_name)
    if deployment is None:
        raise ApiError(404, "not_found", f"no app named {app_name!r}; deployed: {sorted(deployments)}")
    target = route(deployment.units, rest)
    if target is None:
        names = [f"{u.name}.{m}" if u.kind == "class" else m for u in deployment.units.values() for m in u.methods]
        raise ApiError(404, "not_found", f"app {app_name!r} has no function {rest!r}; it serves {names}")
    return deployment.units[target.unit], target


async def call(request: Request, unit: Unit, target: Call) -> tuple[Response, Lease]:
    if request.method != "POST":
        raise ApiError(405, "method_not_allowed", f"call {target.method!r} with POST and a JSON object of keyword arguments")
    body = await read_kwargs(request)
    lease = await unit.queue.acquire()
    try:
        return await proxy.call(request.app.state.client, lease.replica, target.method, body, unit.spec.timeout), lease
    finally:
        unit.queue.release(lease.replica)


async def forward(request: Request, unit: Unit, target: Forward) -> tuple[Response, Lease]:
    """To the app's ASGI endpoint; the replica slot is held until the streamed response ends."""
    lease = await unit.queue.acquire()
    try:
        upstream = await proxy.open_stream(request.app.state.client, lease.replica, request, target.path)
    except BaseException:
        unit.queue.release(lease.replica)
        raise
    return proxy.Relay(upstream, lambda: unit.queue.release(lease.replica)), lease


def create_app(gateway: Gateway) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=64)) as client:
            app.state.client = client
            scaler = asyncio.create_task(gateway.scaler.run())
            gateway.ready = True
            try:
                yield
            finally:
                gateway.ready = False
                scaler.cancel()
                await gateway.scaler.stop_all()

    app = FastAPI(title="Ember gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
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

    @app.api_route("/{app_name}/{rest:path}", methods=METHODS)
    async def invoke(request: Request, app_name: str, rest: str) -> Response:
        authenticate(gateway.keys, request)
        unit, target = resolve(gateway.deployments, app_name, rest)
        if isinstance(target, Call):
            response, lease = await call(request, unit, target)
        else:
            response, lease = await forward(request, unit, target)
        gateway.metrics.observe(app_name, unit.name, response.status_code, lease.cold_start)
        return _stamp(response, lease)

    return app


def _stamp(response: Response, lease: Lease) -> Response:
    """Every reply names its replica; one that waited for a start names the tier, time and breakdown."""
    extra = {"x-ember-replica": lease.replica.id}
    if lease.cold_start:
        extra["x-ember-cold-start"] = lease.cold_start
        if lease.replica.timings and lease.replica.tier != "parked":
            extra["x-ember-start-breakdown"] = ", ".join(f"{k}={v}" for k, v in lease.replica.timings.items())
    if isinstance(response, proxy.Relay):
        response.raw_headers += [(k.encode(), v.encode()) for k, v in extra.items()]
    else:
        response.headers.update(extra)
    return response
