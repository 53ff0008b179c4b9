"""The admin API (admin keys only): status, logs, deploys, API keys and per-app limits, which the `ember` CLI calls."""
import asyncio
import dataclasses
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, Field, model_validator

from ember.gateway.auth import authenticate
from ember.gateway.errors import ApiError, UnknownField
from ember.gateway.keys import LONGEST_KEY_LIFE, check_scopes
from ember.gateway.lifecycle import LIVE, ReplicaState
from ember.gateway.logfeed import backlog
from ember.gateway.ratelimit import LIMIT_MOST, Limits
from ember.gateway.routing import APP_NAME
from ember.gateway.secret_files import MissingSecret, SecretError
from ember.gateway.service import DeployFailed
from ember.gateway.versions import VersionError
from ember.package import PackageError
from ember.runtime.environments import InstallError

if TYPE_CHECKING:
    from ember.gateway.service import Gateway


S3_URL = re.compile(r"s3://(?P<bucket>[a-z0-9][a-z0-9.-]{1,61}[a-z0-9])/(?P<key>[^\x00-\x1f]{1,1024})")
SHA256 = re.compile(r"[0-9a-f]{64}")


class StrictBody(BaseModel):
    """A request body whose unknown fields are refused (400, naming the field and the nearest known one), so a typo
    such as {"rpn": 5} is never read as "no limits"."""

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: object) -> object:
        if isinstance(data, dict):
            known = list(cls.model_fields)
            for name in data:
                if name not in known:
                    raise UnknownField(str(name), known)
        return data


class DeployRequest(StrictBody):
    """One of: a package on this machine, or one in S3 (what `ember deploy --target aws` uploads) and its hash."""

    package: str | None = None  # path of a .pkg under EMBER_HOME/packages on this machine
    package_url: str | None = None  # s3://BUCKET/KEY
    sha256: str | None = None  # of the object at package_url, checked once it is downloaded


class RollbackRequest(StrictBody):
    version: int | None = Field(None, ge=1, description="the version to go back to; default the one live before")


class LimitsBody(StrictBody):
    rpm: int | None = Field(None, ge=1, le=LIMIT_MOST["requests_per_minute"], description="requests per minute")
    tpm: int | None = Field(None, ge=1, le=LIMIT_MOST["tokens_per_minute"],
                            description="LLM tokens (prompt + completion) per minute")
    concurrency: int | None = Field(None, ge=1, le=LIMIT_MOST["max_concurrent"],
                                    description="requests in flight at once")

    def limits(self) -> Limits:
        return Limits(self.rpm, self.tpm, self.concurrency)


class KeyRequest(LimitsBody):
    name: str = Field(min_length=1, max_length=100)
    scopes: list[str] = Field(default_factory=list, max_length=100,
                              description="'admin', 'app:APP' or 'fn:APP/FUNCTION'; none means every app")
    expires_in: float | None = Field(None, gt=0, le=LONGEST_KEY_LIFE, allow_inf_nan=False,
                                     description="seconds until the key stops working")


class SecretBody(StrictBody):
    values: dict[str, str] = Field(description="KEY=VALUE pairs a function that lists the secret gets as environment")


TAIL_WINDOW = 16 << 20  # bytes of a log's end that `ember logs` (GET /admin/logs) reads at most


def tail(path: Path, lines: int) -> str:
    """The file's last `lines` lines, from at most its last TAIL_WINDOW bytes: it read the whole file, so a log of
    gigabytes (a chatty replica, a long-lived gateway) was read into memory for `ember logs`."""
    try:
        start = backlog(path, lines, TAIL_WINDOW)
        with path.open("rb") as f:
            f.seek(start)
            return f.read(TAIL_WINDOW).decode("utf-8", "replace")
    except FileNotFoundError:
        return ""


def admin_router(gateway: "Gateway") -> APIRouter:
    async def admin(request: Request) -> None:
        await authenticate(gateway.keys, request, admin=True)

    router = APIRouter(prefix="/admin", dependencies=[Depends(admin)])

    @router.get("/status")
    async def status() -> dict:
        now = time.monotonic()
        apps = {}
        for name, deployment in gateway.deployments.items():
            units = {}
            for unit_name, unit in deployment.units.items():
                units[unit_name] = {
                    "kind": unit.kind,
                    "methods": unit.methods,
                    "asgi": unit.asgi,
                    "replicas": [r.describe(now) | {"pid": r.process.pid if r.process else None}
                                 for r in unit.router.replicas.values()],
                    "replicas_by_state": {state.value: sum(r.state == state for r in unit.router.replicas.values())
                                          for state in ReplicaState if state in LIVE} | {"failed": len(unit.failures)},
                    "queue_depth": unit.queue.depth,
                    "queue_slots": unit.queue.demand,
                    "in_flight": unit.router.in_flight,
                    "load": unit.router.load,
                    "failed": list(unit.failures),
                    "decisions": [dataclasses.asdict(d) for d in unit.decisions],
                    "settings": unit.spec.model_dump(),
                }
            apps[name] = {"package": str(deployment.package), "version": deployment.version, "functions": units,
                          "prepared": gateway.backend.prepared(name), "retiring": gateway.retiring_replicas(name)}
        return {"uptime_s": round(now - gateway.started, 1), "apps": apps}

    @router.get("/logs", response_class=PlainTextResponse)
    async def logs(
        replica: str | None = Query(None, pattern=r"^[A-Za-z0-9_.-]{1,100}$"), lines: int = Query(200, ge=1, le=100_000)
    ) -> str:
        if replica is None:
            return await asyncio.to_thread(tail, gateway.home.logs / "gateway.log", lines)
        matches = sorted(gateway.home.logs.glob(f"*.{replica}.log"))
        if not matches:
            raise ApiError(404, "not_found", f"no log for replica {replica!r}; `ember status` lists replica ids")
        return await asyncio.to_thread(tail, matches[0], lines)

    def local_package(path: str) -> Path:
        try:
            package = Path(path).resolve()
            found = package.parent == gateway.home.packages and package.is_file()
        except (ValueError, OSError):  # a NUL byte, a name too long
            found = False
        if not found:
            raise ApiError(422, "invalid_package", f"{path[:200]!r} is not a package in {gateway.home.packages}")
        return package

    async def s3_package(url: str, digest: str | None) -> Path:
        """Download the package into EMBER_HOME/packages (unless that hash is there already), checking its sha256."""
        match = S3_URL.fullmatch(url)
        if not match:
            raise ApiError(400, "invalid_package_url", f"package_url must be s3://BUCKET/KEY; got {url[:200]!r}")
        if digest is None or not SHA256.fullmatch(digest):
            raise ApiError(
                400, "invalid_sha256", "with package_url, send sha256: the package's hash as 64 lowercase hex digits"
            )
        import boto3
        from botocore.exceptions import BotoCoreError, ClientError

        from ember.runtime.aws import PackageMismatch, PackageMissing, download_package

        def fetch() -> Path:
            s3 = boto3.session.Session().client("s3")  # a session of its own: boto3's default one is not thread-safe
            return download_package(s3, match["bucket"], match["key"], digest, gateway.home.packages)

        try:
            return await asyncio.to_thread(fetch)
        except PackageMissing as exc:
            raise ApiError(404, "package_not_found", str(exc)) from None
        except PackageMismatch as exc:
            raise ApiError(422, "sha256_mismatch", str(exc)) from None
        except (BotoCoreError, ClientError) as exc:
            raise ApiError(
                502, "s3_error", f"cannot fetch {url[:200]}: {exc}; check the gateway's AWS credentials and region"
            ) from None

    @router.post("/deploy")
    async def deploy(body: DeployRequest, request: Request) -> dict:
        if body.package is not None and body.package_url is None:
            package = local_package(body.package)
        elif body.package_url is not None and body.package is None:
            package = await s3_package(body.package_url, body.sha256)
        else:
            raise ApiError(400, "invalid_request",
                           'send {"package": PATH} or {"package_url": "s3://BUCKET/KEY", "sha256": HASH}')
        return await deployed(gateway.deploy(package, await deployer(request)))

    async def deployer(request: Request) -> str:
        key = await authenticate(gateway.keys, request, admin=True)
        return f"{key.name} ({key.id})"

    async def deployed(deploying) -> dict:
        try:
            deployment = await deploying
        except PackageError as exc:
            raise ApiError(422, "invalid_package", str(exc)) from None
        except MissingSecret as exc:
            raise ApiError(422, "missing_secret", str(exc)) from None
        except InstallError as exc:
            raise ApiError(422, "requirements_failed", str(exc)) from None
        except DeployFailed as exc:
            raise ApiError(422, "deploy_failed", str(exc)) from None
        except VersionError as exc:
            raise ApiError(409, "no_such_version", str(exc)) from None
        except ValueError as exc:  # an app name the gateway cannot route
            raise ApiError(422, "invalid_name", str(exc)) from None
        return {"app": deployment.name, "version": deployment.version, "package": str(deployment.package),
                "functions": sorted(deployment.units)}

    @router.get("/apps")
    async def apps() -> list[dict]:
        live = {v.app: v for v in await asyncio.to_thread(gateway.versions.live)}
        return [
            live[name].describe()
            if name in live
            else {
                "app": name,
                "version": None,
                "functions": sorted(deployment.units),
                "package": str(deployment.package),
            }
            for name, deployment in sorted(gateway.deployments.items())
        ]

    @router.get("/apps/{app}/versions")
    async def versions(app: str) -> list[dict]:
        history = await asyncio.to_thread(gateway.versions.history, _app_name(app))
        if not history:
            raise ApiError(404, "not_found", f"no app named {app!r} was ever deployed; `ember apps list` lists them")
        return [v.describe() for v in history]

    @router.post("/apps/{app}/rollback")
    async def rollback(app: str, body: RollbackRequest, request: Request) -> dict:
        return await deployed(gateway.rollback(_app_name(app), body.version, await deployer(request)))

    @router.post("/keys", status_code=201)
    async def create_key(body: KeyRequest) -> dict:
        try:
            scopes = check_scopes(body.scopes)
        except ValueError as exc:
            raise ApiError(422, "invalid_scope", str(exc)) from None
        expires = time.time() + body.expires_in if body.expires_in else None
        try:
            key, secret = await asyncio.to_thread(gateway.keys.create, body.name, scopes=scopes, expires=expires,
                                                  limits=body.limits())
        except ValueError as exc:  # a name with control characters
            raise ApiError(422, "invalid_request", str(exc)) from None
        return key.describe() | {"secret": secret}

    @router.get("/keys")
    async def list_keys() -> list[dict]:
        return [k.describe() for k in await asyncio.to_thread(gateway.keys.all)]

    @router.delete("/keys/{key}")
    async def revoke_key(key: str) -> list[dict]:
        revoked = await asyncio.to_thread(gateway.keys.revoke, key)
        if not revoked:
            raise ApiError(404, "not_found", f"no live key with id or name {key[:100]!r}; GET /admin/keys lists them")
        return [k.describe() for k in revoked]

    @router.get("/apps/{app}/limits")
    async def app_limits(app: str) -> dict:
        limits = await asyncio.to_thread(gateway.app_limits.get, _app_name(app))
        return {
            "app": app,
            "rpm": limits.requests_per_minute,
            "tpm": limits.tokens_per_minute,
            "concurrency": limits.max_concurrent,
        }

    @router.put("/apps/{app}/limits")
    async def set_app_limits(app: str, body: LimitsBody) -> dict:
        await asyncio.to_thread(gateway.app_limits.set, _app_name(app), body.limits())
        # kept for an app deployed later too; the reply says whether one is deployed now (a typo would limit nothing)
        return {"app": app} | body.model_dump() | {"deployed": app in gateway.deployments,
                                                  "deployed_apps": sorted(gateway.deployments)}

    @router.get("/secrets")
    async def list_secrets() -> list[dict]:
        return await asyncio.to_thread(gateway.secrets.all)

    @router.put("/secrets/{name}")
    async def set_secret(name: str, body: SecretBody) -> dict:
        try:
            keys = await asyncio.to_thread(gateway.secrets.set, name, body.values)
        except SecretError as exc:
            raise ApiError(400, "invalid_secret", str(exc)) from None
        return {"name": name, "keys": keys}

    @router.delete("/secrets/{name}")
    async def remove_secret(name: str) -> dict:
        try:
            removed = await asyncio.to_thread(gateway.secrets.remove, name)
        except SecretError as exc:
            raise ApiError(400, "invalid_secret", str(exc)) from None
        if not removed:
            raise ApiError(404, "not_found", f"no secret named {name[:100]!r}; `ember secrets list` lists them")
        return {"name": name, "removed": True}

    return router


def _app_name(app: str) -> str:
    if not APP_NAME.fullmatch(app):
        raise ApiError(400, "invalid_name", f"app names match {APP_NAME.pattern}; got {app[:80]!r}")
    return app
