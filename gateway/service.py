"""The gateway as a service: the keys, deployed apps, backend, autoscaler, metrics and rate limits one
`ember serve` runs, and deploying an app into it. The HTTP surface over it is gateway/server.py."""
import asyncio
import logging
import time
from pathlib import Path

from ember.gateway.app_limits import AppLimitStore
from ember.gateway.calls import CallStore, SpawnedCalls
from ember.gateway.inflight import BodyBudget
from ember.gateway.backends.local import LocalBackend
from ember.gateway.deployment import Deployment
from ember.gateway.keys import KeyStore
from ember.gateway.metrics import Metrics
from ember.gateway.ratelimit import Limiter, MemoryLimiter
from ember.gateway.routing import APP_NAME
from ember.gateway.scaler import Scaler
from ember.gateway.secret_files import SecretStore
from ember.home import Home
from ember.runtime import environments

log = logging.getLogger("ember.gateway")

GATEWAY_PATHS = {"admin", "calls", "dashboard", "healthz", "readyz", "metrics"}  # no app can be reached under these


class Gateway:
    def __init__(self, home: Home, backend: LocalBackend | None = None, limiter: Limiter | None = None,
                 routing: str = "affinity"):
        self.home = home
        self.keys = KeyStore(home.db)
        self.deployments: dict[str, Deployment] = {}
        self.backend = backend or LocalBackend(home.logs)
        self.metrics = Metrics()
        self.scaler = Scaler(self.backend, self.deployments, self.metrics.observe_start)
        self.app_limits = AppLimitStore(home.db)
        self.secrets = SecretStore(home.secrets)
        self.calls = SpawnedCalls(CallStore(home.db))
        self.limiter: Limiter = limiter or MemoryLimiter()  # a RedisLimiter when several gateways share the limits
        self.routing = routing
        self.bodies = BodyBudget()  # request-body bytes held at once, across every request
        self.started = time.monotonic()
        self.ready = False
        self.stopping = False  # a stop signal came: new calls are refused
        self.cut_short = asyncio.Event()  # set GRACE seconds later: calls still running answer 503 shutting_down

    def stop_calls(self, grace: float) -> None:
        """On a stop signal (called in the event loop's thread): refuse new calls now, cut running ones after
        `grace` seconds."""
        self.stopping, self.ready = True, False
        loop = asyncio.get_running_loop()
        loop.call_soon_threadsafe(loop.call_later, grace, self.cut_short.set)

    def register(self, package: Path) -> tuple[Deployment, Deployment | None]:
        deployment = Deployment.from_package(package, self.scaler.poke)
        if not APP_NAME.fullmatch(deployment.name):
            raise ValueError(f"app name {deployment.name!r} must match {APP_NAME.pattern} "
                             "(lower-case letters, digits, - and _)")
        if deployment.name in GATEWAY_PATHS:
            raise ValueError(f"app name {deployment.name!r} is taken by the gateway's own /{deployment.name} routes; "
                             "rename the app")
        if self.backend.secrets_here:
            self.secrets.check(deployment.name, {name: unit.spec for name, unit in deployment.units.items()})
        for unit in deployment.units.values():
            unit.router.mode = self.routing
        previous = self.deployments.get(deployment.name)
        self.deployments[deployment.name] = deployment
        return deployment, previous

    async def deploy(self, package: Path) -> Deployment:
        if isinstance(self.backend, LocalBackend):  # its replicas run here: a failed install fails the deploy
            await asyncio.to_thread(environments.ensure_for_package, package, log.info, self.home)
        deployment, previous = self.register(package)
        if previous is not None:  # the new version takes new calls; the old one's replicas finish theirs and stop
            replicas = []
            for unit in previous.units.values():
                unit.queue.fail_waiters(f"app {deployment.name!r} was redeployed while this call waited; retry it")
                replicas += unit.router.replicas.values()
            for replica in replicas:
                replica.stop()
            await asyncio.gather(*(self.backend.stop(r) for r in replicas))
        return deployment
