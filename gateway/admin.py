"""The admin API (admin keys only): status, logs and deploys, which the `ember` CLI calls."""
import time
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from ember.gateway.auth import authenticate
from ember.gateway.errors import ApiError

if TYPE_CHECKING:
    from ember.gateway.server import Gateway


class DeployRequest(BaseModel):
    package: str  # path of a .pkg under EMBER_HOME/packages on this machine


def tail(path: Path, lines: int) -> str:
    if not path.exists():
        return ""
    return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-lines:])


def admin_router(gateway: "Gateway") -> APIRouter:
    def admin(request: Request) -> None:
        authenticate(gateway.keys, request, admin=True)

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
                    "replicas": [r.describe(now) for r in unit.queue.replicas.values()],
                    "queue_depth": unit.queue.depth,
                    "in_flight": unit.queue.in_flight,
                    "failed": list(unit.failures),
                    "decisions": list(unit.decisions),
                    "settings": unit.spec.model_dump(),
                }
            apps[name] = {"package": str(deployment.package), "functions": units}
        return {"uptime_s": round(now - gateway.started, 1), "apps": apps}

    @router.get("/logs", response_class=PlainTextResponse)
    async def logs(replica: str | None = None, lines: int = 200) -> str:
        if replica is None:
            return tail(gateway.home.logs / "gateway.log", lines)
        matches = sorted(gateway.home.logs.glob(f"*.{replica}.log"))
        if not matches:
            raise ApiError(404, "not_found", f"no log for replica {replica!r}; `ember status` lists replica ids")
        return tail(matches[0], lines)

    @router.post("/deploy")
    async def deploy(body: DeployRequest) -> dict:
        package = Path(body.package).resolve()
        if package.parent != gateway.home.packages or not package.is_file():
            raise ApiError(422, "invalid_package", f"{package} is not a package in {gateway.home.packages}")
        deployment = await gateway.deploy(package)
        return {"app": deployment.name, "package": str(package), "functions": sorted(deployment.units)}

    return router
