"""The gateway as a service: the keys, deployed apps, backend, autoscaler, metrics and rate limits one
`ember serve` runs, and deploying an app into it. The HTTP surface over it is gateway/server.py."""
import asyncio
import logging
import time
from pathlib import Path

from ember.gateway.app_limits import AppLimitStore
from ember.gateway.backends import Backend
from ember.gateway.backends.local import LocalBackend
from ember.gateway.calls import CallStore, SpawnedCalls
from ember.gateway.client_limits import ClientLimits
from ember.gateway.deployment import Deployment
from ember.gateway.inflight import BodyBudget
from ember.gateway.keys import KeyStore
from ember.gateway.lifecycle import HOT
from ember.gateway.logfeed import GATEWAY_LOG
from ember.gateway.metrics import Metrics
from ember.gateway.ratelimit import Limiter, MemoryLimiter
from ember.gateway.replica import Drain, GatewayReplica
from ember.gateway.routing import APP_NAME
from ember.gateway.scaler import Scaler
from ember.gateway.secret_files import SecretStore
from ember.gateway.versions import VersionStore
from ember.home import Home
from ember.package import PackageError, read_manifest
from ember.runtime import environments

log = logging.getLogger("ember.gateway")
CLI_USER = "ember serve"  # who deployed the app `ember serve FILE` starts with
# A replaced version's replica stops once its calls are done: after its function's timeout, or this long for an ASGI
# app's streams (whose timeout bounds each chunk, not the whole), at most, plus the slack.
RETIRE_AT_LEAST, RETIRE_SLACK, RETIRE_POLL = 300.0, 5.0, 0.1


class DeployFailed(RuntimeError):
    """A new version failed its check: it is recorded failed and the version that was live keeps serving."""

    def __init__(self, app: str, version: int, error: str, serving: int | None):
        kept = f"version {serving} keeps serving" if serving else "nothing was serving it before"
        super().__init__(f"version {version} of app {app!r} failed to start ({kept}): {error}")
        self.app, self.version, self.error, self.serving = app, version, error, serving


GATEWAY_PATHS = {"admin", "calls", "dashboard", "docs", "healthz", "readyz", "metrics"}  # apps cannot use these


class Gateway:
    def __init__(self, home: Home, backend: Backend | None = None, limiter: Limiter | None = None,
                 routing: str = "affinity", limits: ClientLimits | None = None):
        self.home = home
        self.keys = KeyStore(home.db)
        self.deployments: dict[str, Deployment] = {}
        self.backend: Backend = backend or LocalBackend(home.logs)
        self.metrics = Metrics()
        self.scaler = Scaler(self.backend, self.deployments, self.metrics.observe_start)
        self.app_limits = AppLimitStore(home.db)
        self.secrets = SecretStore(home.secrets)
        self.calls = SpawnedCalls(CallStore(home.db), self.metrics.spawned_call_ended)
        self.versions = VersionStore(home.db)
        self._deploying: dict[str, asyncio.Lock] = {}  # one deploy of an app at a time
        # replaced versions' replicas finishing their calls (_drain): the task that stops each, and what it stops
        self.retiring: dict[asyncio.Task, tuple[Deployment, str, GatewayReplica]] = {}
        self.closing = False  # the gateway is stopping: replaced replicas stop now, calls or not
        self.limiter: Limiter = limiter or MemoryLimiter()  # a RedisLimiter when several gateways share the limits
        self.routing = routing
        limits = limits or ClientLimits()
        self.bodies = BodyBudget(limits.body_budget, limits.body_timeout)  # request-body bytes held at once
        self.send_timeout = limits.send_timeout  # a relayed stream's client must take bytes within it (proxy.Relay)
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

    def _load(self, package: Path) -> Deployment:
        """The app in `package`, its settings validated and the secrets it needs found; not yet serving."""
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
        return deployment

    def _swap(self, deployment: Deployment) -> Deployment | None:
        previous = self.deployments.get(deployment.name)
        self.deployments[deployment.name] = deployment
        return previous

    def restore(self) -> list[str]:
        """Serve again the version of each app that was live when the gateway last ran; the warnings for those whose
        package is gone."""
        warnings = []
        for version in self.versions.live():
            try:
                deployment = self._load(Path(version.package))
            except (PackageError, ValueError) as exc:
                warnings.append(f"app {version.app!r} version {version.version} not restored: {exc}")
                continue
            deployment.version = version.version
            self._swap(deployment)
            log.info("app %s version %s restored", version.app, version.version, extra={"fields": {
                "kind": "deploy", "app": version.app, "version": version.version, "restored": True}})
        return warnings

    def register(self, package: Path, note: str | None = None) -> tuple[Deployment, Deployment | None]:
        """Serve `package` at once, without a check (the app `ember serve FILE` starts with): a new live version
        unless it is the code already live."""
        deployment = self._load(package)
        live = self.deployments.get(deployment.name)
        if live is not None and live.package == package:
            return live, None
        version = self.versions.add(deployment.name, package, read_manifest(package), CLI_USER, note)
        self.versions.go_live(deployment.name, version.version)
        deployment.version = version.version
        log.info("app %s version %s live (%s; package %s)", deployment.name, version.version,
                 ", ".join(sorted(deployment.units)), package.name, extra={"fields": {
                     "kind": "deploy", "app": deployment.name, "version": version.version, "package": package.name}})
        return deployment, self._swap(deployment)

    async def deploy(self, package: Path, deployed_by: str | None = None, note: str | None = None) -> Deployment:
        """Check a new version of an app (one replica of each function started, its enter run) and only then route
        new calls to it, draining the old version's replicas; a version that fails its check raises DeployFailed and
        the old one keeps serving. Deploying the code already live changes nothing."""
        deployment = self._load(package)
        name = deployment.name
        lock = self._deploying.setdefault(name, asyncio.Lock())
        async with lock:
            live = self.deployments.get(name)
            if live is not None and live.package == package:
                return live
            if isinstance(self.backend, LocalBackend):  # its replicas run here: a failed install fails the deploy
                await asyncio.to_thread(environments.ensure_for_package, package, log.info, self.home)
            version = await asyncio.to_thread(self.versions.add, name, package, read_manifest(package), deployed_by,
                                              note)
            deployment.version = version.version
            error = await self._check(deployment)
            if error is not None:
                await asyncio.to_thread(self.versions.fail, name, version.version, error)
                log.warning("app %s version %s failed its check; version %s keeps serving: %s", name,
                            version.version, live.version if live else None, error)
                raise DeployFailed(name, version.version, error, live.version if live else None)
            await asyncio.to_thread(self.versions.go_live, name, version.version)
            previous = self._swap(deployment)
        log.info("app %s version %s live (%s; by %s)", name, version.version, ", ".join(sorted(deployment.units)),
                 deployed_by or "-", extra={"fields": {"kind": "deploy", "app": name, "version": version.version,
                                                       "package": package.name, "by": deployed_by}})
        if previous is not None:  # the new version takes new calls; the old one's replicas finish theirs and stop
            self._drain(previous, deployment)
        return deployment

    async def rollback(self, app: str, to: int | None, deployed_by: str | None) -> Deployment:
        """Deploy again the code of an earlier version (`to`, else the one live before the current one), checked
        like any deploy; it becomes a new version."""
        target = await asyncio.to_thread(self.versions.rollback_target, app, to)
        return await self.deploy(Path(target.package), deployed_by, note=f"rollback to version {target.version}")

    async def _check(self, deployment: Deployment) -> str | None:
        """Start one replica of each function of a version not yet taking calls: None when all came up, else what
        failed, with the end of its log (the user's traceback). The failed ones' siblings are stopped."""
        self.scaler.checking.add(deployment.name)
        try:
            replicas = await asyncio.gather(*(self.scaler.trial(deployment, unit)
                                              for unit in deployment.units.values()))
        finally:
            self.scaler.checking.discard(deployment.name)
        hot = [r for r in replicas if r.state == HOT]
        if len(hot) == len(replicas):
            return None
        for replica in hot:
            replica.stop()
        await asyncio.gather(*(self.backend.stop(r) for r in hot))
        failed = [r for r in replicas if r.error]
        if not failed:
            return "its replicas were stopped before they were ready (the gateway is stopping)"
        replica = failed[0]
        return f"{replica.unit}: {replica.error}{log_tail(replica.log_path)}"

    def _drain(self, previous: Deployment, current: Deployment) -> None:
        """Retire the replaced version: calls that found it but hold no slot yet, waiting in its queues or still on
        their way there (reading their body, charging their key), go to the same function of `current`; each of
        its replicas takes nothing new and stops once the calls it runs are done, in the background (a deploy
        does not wait for them)."""
        for unit in previous.units.values():
            unit.successor = current.units.get(unit.name)
            unit.queue.close()
            limit = max(unit.spec.timeout, RETIRE_AT_LEAST) + RETIRE_SLACK
            for replica in list(unit.router.replicas.values()):
                replica.drain(Drain.EVICT)
                task = asyncio.create_task(self._retire(replica, limit))
                self.retiring[task] = (previous, unit.name, replica)
                task.add_done_callback(self._retired)

    async def _retire(self, replica: GatewayReplica, limit: float) -> None:
        """Stop `replica` once its calls are done, after `limit` seconds at most, or at once when the gateway stops."""
        deadline = time.monotonic() + limit
        while replica.in_flight and not self.closing:
            if time.monotonic() >= deadline:
                log.warning("replica %s of a replaced version still ran %d calls after %g s: stopped", replica.id,
                            replica.in_flight, limit)
                break
            await asyncio.sleep(RETIRE_POLL)
        replica.stop()
        await self.backend.stop(replica)

    def _retired(self, task: asyncio.Task) -> None:
        self.retiring.pop(task, None)
        if not task.cancelled() and task.exception() is not None:
            log.error("stopping a replaced version's replica failed: %s", task.exception())

    async def close(self) -> None:
        """On stop, before the scaler stops the live replicas: the replaced versions' replicas stop now."""
        self.closing = True
        await asyncio.gather(*self.retiring, return_exceptions=True)

    def live_logs(self) -> set[Path]:
        """The log files still written: its own, every replica's it runs (its versions' and the replaced ones' still
        finishing) and its backend's (fork servers)."""
        live = {replica.log_path for deployment in self.deployments.values() for unit in deployment.units.values()
                for replica in unit.router.replicas.values()}
        live |= {replica.log_path for _, _, replica in self.retiring.values()}
        return live | self.backend.own_logs() | {self.home.logs / GATEWAY_LOG}

    def retiring_replicas(self, app: str) -> list[dict]:
        """The replicas of `app`'s replaced versions still finishing their calls, for `ember status`."""
        return [{"id": replica.id, "version": deployment.version, "function": unit, "in_flight": replica.in_flight,
                 "pid": replica.process.pid if replica.process else None}
                for deployment, unit, replica in self.retiring.values() if deployment.name == app]


def log_tail(path: Path, lines: int = 12) -> str:
    """The last lines of a replica's log (where its traceback is), indented under the error."""
    if not path.exists():
        return ""
    tail = path.read_text(errors="replace").splitlines()[-lines:]
    return "\n" + "\n".join(f"    {line}" for line in tail) if tail else ""
