"""The autoscaler loop: sample every function, ask the pure policy, carry out its actions on the backend."""
import asyncio
import logging
import time

from ember.gateway.autoscaler.policy import Evict, Park, ReplicaView, Sample, Start, Wake, decide
from ember.gateway.backend import LocalBackend
from ember.gateway.deployment import Deployment, Unit
from ember.gateway.replica import FAILED, HOT, PARKED, STARTING, STOPPING, Replica

log = logging.getLogger("ember.gateway")
INTERVAL = 0.5
RETRY_AFTER_FAILURE = 30.0  # seconds before a failed unit is started again without a new call


class Scaler:
    def __init__(self, backend: LocalBackend, deployments: dict[str, Deployment]):
        self.backend, self.deployments = backend, deployments
        self._poke = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()

    def poke(self) -> None:
        self._poke.set()

    async def run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._poke.wait(), INTERVAL)
            except asyncio.TimeoutError:
                pass
            self._poke.clear()
            for deployment in list(self.deployments.values()):
                for unit in deployment.units.values():
                    try:
                        self.tick(deployment, unit, time.monotonic())
                    except Exception:  # one function's bad tick must not stop scaling for every other one
                        log.exception("autoscaler tick failed for %s/%s", unit.app, unit.name)

    def tick(self, deployment: Deployment, unit: Unit, now: float) -> None:
        queue = unit.queue
        for replica in [r for r in queue.replicas.values() if r.draining and r.in_flight == 0]:
            self._finish(unit, replica)
        unit.history.append(Sample(now, queue.depth, queue.in_flight, queue.arrivals - unit.arrivals_seen))
        unit.arrivals_seen = queue.arrivals
        views = [
            ReplicaView(r.id, r.state, r.in_flight, r.idle_since, draining=r.draining is not None)
            for r in queue.replicas.values() if r.state in (STARTING, HOT, PARKED)
        ]
        actions, unit.memo = decide(unit.settings, views, unit.history, now, unit.memo)
        for action in actions:
            if isinstance(action, Start) and self._held(unit):
                continue
            unit.decisions.append({"t": time.time(), "action": type(action).__name__.lower(), "reason": action.reason,
                                   "replica": getattr(action, "replica_id", None), "count": getattr(action, "count", None)})
            self.apply(deployment, unit, action)

    def apply(self, deployment: Deployment, unit: Unit, action: Start | Wake | Park | Evict) -> None:
        if isinstance(action, Start):
            for _ in range(action.count):
                replica = self.backend.new_replica(unit.app, unit.name)
                unit.queue.add(replica)
                self._spawn(self._start(deployment, unit, replica))
            return
        replica = unit.queue.replicas.get(action.replica_id)
        if replica is None:
            return
        if isinstance(action, Wake):
            unit.queue.wake(replica)
            unit.queue.ready(replica)
            return
        replica.draining = "park" if isinstance(action, Park) else "evict"
        log.info("replica %s: %s (%s)", replica.id, replica.draining, action.reason)
        if replica.in_flight == 0:
            self._finish(unit, replica)

    def _finish(self, unit: Unit, replica: Replica) -> None:
        """Carry out a drained replica's park or evict."""
        if replica.draining == "park":
            # CPU-only local backend: no GPU memory to release, so parking just marks the live process parked.
            replica.state, replica.draining = PARKED, None
            return
        replica.state, replica.draining = STOPPING, None
        unit.queue.remove(replica)
        self._spawn(self.backend.stop(replica))

    @staticmethod
    def _held(unit: Unit) -> bool:
        """After a failed start, start again only for a new call (or after a while), so a crash in enter does not loop."""
        if unit.last_failure is None:
            return False
        arrivals, at = unit.last_failure
        return unit.queue.arrivals == arrivals and time.monotonic() - at < RETRY_AFTER_FAILURE

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _start(self, deployment: Deployment, unit: Unit, replica: Replica) -> None:
        log.info("starting replica %s of %s/%s", replica.id, unit.app, unit.name)
        try:
            await self.backend.start(replica, deployment.package)
        except Exception as exc:  # a spawn error is a failed start, reported like a crash in enter
            replica.state, replica.error = FAILED, f"start failed: {type(exc).__name__}: {exc}"
        if replica.state == FAILED:
            self._failed(unit, replica)
            return
        log.info("replica %s ready on port %s (%s)", replica.id, replica.port, replica.timings)
        unit.last_failure = None
        unit.queue.ready(replica)
        code = await self.backend.wait(replica)
        if replica.state == STOPPING:
            return
        if code == 0:  # it was asked to stop by someone else (Ctrl-C reaches the whole process group)
            log.info("replica %s stopped", replica.id)
            replica.state = STOPPING
            unit.queue.remove(replica)
            return
        replica.state, replica.error = FAILED, f"worker exited with code {code} while serving"
        self._failed(unit, replica)

    def _failed(self, unit: Unit, replica: Replica) -> None:
        tail = "".join(replica.log_path.read_text(errors="replace").splitlines(keepends=True)[-15:]) if replica.log_path.exists() else ""
        log.error("replica %s of %s/%s failed: %s (log: %s)\n%s", replica.id, unit.app, unit.name, replica.error, replica.log_path, tail)
        unit.failures.append(replica.describe(time.monotonic()) | {"at": time.time()})
        unit.last_failure = (unit.queue.arrivals, time.monotonic())
        unit.queue.remove(replica)

    async def stop_all(self) -> None:
        replicas = [r for d in self.deployments.values() for u in d.units.values() for r in u.queue.replicas.values()]
        for replica in replicas:
            replica.state = STOPPING
        await asyncio.gather(*(self.backend.stop(r) for r in replicas))
