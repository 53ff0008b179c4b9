"""The autoscaler loop: sample every function, ask the pure policy, carry out its actions on the backend. Replica
state changes are the replica's own moves (gateway/replica.py); this loop decides when to ask for them."""
import asyncio
import logging
import time
from collections.abc import Callable

from ember.gateway.autoscaler.costs import ParkMeasured, StartMeasured
from ember.gateway.autoscaler.policy import AppTails, Evict, Park, ReplicaView, Sample, Start, Wake, decide
from ember.gateway.backends import Backend, ParkRefused
from ember.gateway.backends.local import parked_over_budget
from ember.gateway.deployment import Deployment, ScalingDecision, Unit
from ember.gateway.lifecycle import FAILED, LIVE, PARKED, STOPPING
from ember.gateway.replica import Drain, GatewayReplica

log = logging.getLogger("ember.gateway")
INTERVAL = 0.5
RETRY_AFTER_FAILURE = 30.0  # seconds before a failed unit is started again without a new call


def measured_start(replica: GatewayReplica) -> StartMeasured | None:
    """What a finished start tells the function's cost model: the tier it came from and its seconds end to end."""
    total_ms = replica.timings.get("total_ms")
    return StartMeasured(replica.tier, total_ms / 1000) if isinstance(total_ms, int | float) else None


class Scaler:
    def __init__(self, backend: Backend, deployments: dict[str, Deployment],
                 on_start: Callable[[str, str, str, dict], None] | None = None):
        self.backend, self.deployments = backend, deployments
        self.on_start = on_start  # (app, function, tier, breakdown) of each finished start: the gateway's metrics
        self._poke = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self.checking: set[str] = set()  # apps a new version of which is starting its trial replicas

    def poke(self) -> None:
        self._poke.set()

    async def run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._poke.wait(), INTERVAL)
            except TimeoutError:
                pass
            self._poke.clear()
            for deployment in list(self.deployments.values()):
                if deployment.name not in self.checking:  # a new version's check has the app's fork server
                    self.backend.prepare(deployment.name, deployment.package)
                # whether the p99 is already lost is the app's: its other functions' requests count with each one's.
                # Pooled once a round, each unit's taken out for its peers: pooling the others afresh for every unit
                # cost O(functions²) a round (an app of 200 functions: 40,000 pools twice a second).
                now = time.monotonic()
                tails = AppTails((unit.memo for unit in deployment.units.values()), now)
                for unit in deployment.units.values():
                    try:
                        self.tick(deployment, unit, now, tails)
                    except Exception:  # one function's bad tick must not stop scaling for every other one
                        log.exception("autoscaler tick failed for %s/%s", unit.app, unit.name)
            self._free_gpus()

    def tick(self, deployment: Deployment, unit: Unit, now: float, tails: AppTails) -> None:
        """One call of the policy for `unit`; `tails` pools its app's functions' tails this round."""
        router = unit.router
        for replica in [r for r in router.replicas.values() if r.draining and r.in_flight == 0]:
            self._finish(unit, replica)
        # in slots, as max_concurrency and target_concurrency count them: an LLM request of n=8 is 8
        unit.history.append(Sample(now, unit.queue.demand, router.load, unit.queue.arrivals - unit.arrivals_seen,
                                   tuple(unit.measured)))
        unit.arrivals_seen = unit.queue.arrivals
        unit.measured.clear()
        views = [ReplicaView(r.id, r.state, r.load, r.idle_since, draining=r.draining is not None)
                 for r in router.replicas.values() if r.state in LIVE]
        before = unit.memo
        actions, unit.memo = decide(unit.settings, views, unit.history, now, before, tails.peers(before))
        tails.replace(before, unit.memo)
        for action in actions:
            if isinstance(action, Start) and self._held(unit):
                continue
            unit.decisions.append(ScalingDecision.of(action, time.time()))
            self.apply(deployment, unit, action)

    def apply(self, deployment: Deployment, unit: Unit, action: Start | Wake | Park | Evict) -> None:
        if isinstance(action, Start):
            for _ in range(action.count):
                new = self.backend.new_replica(unit.app, unit.name)
                unit.router.add(new)
                self._spawn(self._start(deployment, unit, new))
            return
        replica = unit.router.replicas.get(action.replica_id)
        if replica is None:
            return
        if isinstance(action, Wake):
            parked = replica.state == PARKED
            unit.router.wake(replica)
            unit.queue.dispatch()
            if parked:
                self._spawn(self._wake(unit, replica))
            return
        replica.drain(Drain.PARK if isinstance(action, Park) else Drain.EVICT)
        log.info("replica %s: %s (%s)", replica.id, replica.draining, action.reason)
        if replica.in_flight == 0:
            self._finish(unit, replica)

    def _finish(self, unit: Unit, replica: GatewayReplica) -> None:
        """Carry out a drained replica's park or evict."""
        if replica.draining == Drain.PARK and self.backend.can_park:
            replica.park()  # at once for routing: a call that comes during the park wakes it (the worker serialises)
            self._spawn(self._park(unit, replica))
            return
        self._evict(unit, replica)

    def _free_gpus(self) -> None:
        """A start waits for a GPU that a parked replica holds: evict the longest parked holder (T1 -> T2)."""
        pool = self.backend.gpus
        if pool is None or not pool.waiting:
            return
        holders = [(u, r) for d in self.deployments.values() for u in d.units.values()
                   for r in u.router.replicas.values() if r.state == PARKED and r.gpus]
        if holders:
            unit, replica = min(holders, key=lambda h: h[1].parked_at or 0.0)
            reason = f"a start waits for a GPU: parked replica frees GPU {','.join(replica.gpus)}"
            self._evict(unit, replica, reason)

    def _evict(self, unit: Unit, replica: GatewayReplica, reason: str | None = None) -> None:
        """Stop the replica; a `reason` marks an eviction the backend asked for, recorded beside the policy's."""
        if reason:
            unit.decisions.append(ScalingDecision.of(Evict(replica.id, reason), time.time()))
            log.info("replica %s: evict (%s)", replica.id, reason)
        replica.stop()
        self._forget(unit, replica)
        self._spawn(self.backend.stop(replica))

    @staticmethod
    def _forget(unit: Unit, replica: GatewayReplica) -> None:
        """Out of routing; when it failed and no other replica is coming, its waiters learn why now."""
        unit.router.remove(replica)
        if replica.error and not unit.router.any_live():
            unit.queue.fail_waiters(replica.error)

    async def _park(self, unit: Unit, replica: GatewayReplica) -> None:
        """Release its GPU memory; then, if parked replicas hold more host RAM than the budget, evict the oldest."""
        try:
            parked = await self.backend.park(replica)
        except ParkRefused as exc:  # it serves on, its GPU memory held: hot again, and the function parks no more
            log.warning("replica %s cannot park (%s); it stays hot, and %s/%s's replicas stop when idle instead of "
                        "parking", replica.id, exc, unit.app, unit.name)
            unit.measured.append(ParkMeasured(0, refused=True))   # the policy parks this function no more
            if replica.state == PARKED:   # no call came meanwhile to wake it: it routes again as it was
                replica.park_refused()
                unit.queue.dispatch()
            return
        except Exception as exc:  # a replica that cannot park is stopped instead: its GPU memory must be freed
            log.warning("replica %s could not park (%s: %s); stopping it", replica.id, type(exc).__name__, exc)
            unit.measured.append(ParkMeasured(0, failed=True))   # a second in a row and the function parks no more
            if replica.state == PARKED:
                self._evict(unit, replica)
            return
        replica.parked_bytes = parked["host_bytes"]
        unit.measured.append(ParkMeasured(int(parked.get("device_bytes_released", 0))))
        log.info("replica %s parked in %s ms (%s bytes of host RAM)", replica.id, parked["ms"], parked["host_bytes"])
        owners = {r.id: (u, r) for d in self.deployments.values() for u in d.units.values()
                  for r in u.router.replicas.values() if r.state == PARKED and r.parked_at is not None}
        held = sum(r.parked_bytes for _, r in owners.values())
        budget = self.backend.parked_ram
        holders = [(r.id, r.parked_bytes, r.parked_at) for _, r in owners.values() if r.parked_at is not None]
        for victim in parked_over_budget(holders, budget):
            owner, evicted = owners[victim]
            reason = f"parked replicas hold {held} bytes of host RAM > budget {budget}: oldest parked goes"
            self._evict(owner, evicted, reason)

    async def _wake(self, unit: Unit, replica: GatewayReplica) -> None:
        try:
            woke = await self.backend.wake(replica)
        except Exception as exc:  # the next call wakes it anyway, or fails over to another replica
            log.warning("replica %s wake failed: %s: %s", replica.id, type(exc).__name__, exc)
            return
        replica.timings["wake_ms"] = woke["ms"]
        unit.measured.append(StartMeasured("parked", woke["ms"] / 1000))

    @staticmethod
    def _held(unit: Unit) -> bool:
        """After a failed start, start again only for a new call (or after a while), so a crash in enter does not
        loop."""
        if unit.last_failure is None:
            return False
        arrivals, at = unit.last_failure
        return unit.queue.arrivals == arrivals and time.monotonic() - at < RETRY_AFTER_FAILURE

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def trial(self, deployment: Deployment, unit: Unit) -> GatewayReplica:
        """Start one replica of a function of a version not yet taking calls (its enter runs); the replica comes back
        hot, serving once the version goes live, or failed with its error and out of routing."""
        replica = self.backend.new_replica(unit.app, unit.name)
        unit.router.add(replica)
        if await self._boot(deployment, unit, replica):
            # The check counts as one call: the policy keeps the replica warm for its hold, as after any call.
            unit.history.append(Sample(time.monotonic(), 0, 1, 0))
            self._spawn(self._serve(unit, replica))
        return replica

    async def _start(self, deployment: Deployment, unit: Unit, replica: GatewayReplica) -> None:
        if await self._boot(deployment, unit, replica):
            await self._serve(unit, replica)

    async def _boot(self, deployment: Deployment, unit: Unit, replica: GatewayReplica) -> bool:
        """Start the replica; True when it is hot."""
        log.info("starting replica %s of %s/%s", replica.id, unit.app, unit.name)
        try:
            await self.backend.start(replica, deployment.package, unit.spec)
        except Exception as exc:  # a spawn error is a failed start, reported like a crash in enter
            if replica.state in LIVE:
                replica.fail(f"start failed: {type(exc).__name__}: {exc}")
        if replica.state == FAILED:
            self._failed(unit, replica)
            return False
        if replica.state == STOPPING:
            return False
        log.info("replica %s ready on port %s (%s)", replica.id, replica.port, replica.timings)
        unit.last_failure = None
        if self.on_start is not None:
            self.on_start(unit.app, unit.name, replica.tier, replica.timings)
        if (measured := measured_start(replica)) is not None:
            unit.measured.append(measured)
        unit.queue.dispatch()
        return True

    async def _serve(self, unit: Unit, replica: GatewayReplica) -> None:
        """Until the hot replica exits: a stop asked for, or a failure while serving."""
        code = await self.backend.wait(replica)
        if replica.state == STOPPING:
            return
        if code == 0:  # it was asked to stop by someone else (Ctrl-C reaches the whole process group)
            log.info("replica %s stopped", replica.id)
            replica.stop()
            self._forget(unit, replica)
            return
        # the backend may know better than the exit code (the AWS backend: a node gone silent)
        replica.fail(replica.error or f"worker exited with code {code} while serving")
        self._failed(unit, replica)

    def _failed(self, unit: Unit, replica: GatewayReplica) -> None:
        tail = ""
        if replica.log_path.exists():
            tail = "".join(replica.log_path.read_text(errors="replace").splitlines(keepends=True)[-15:])
        log.error("replica %s of %s/%s failed: %s (log: %s)\n%s", replica.id, unit.app, unit.name, replica.error,
                  replica.log_path, tail)
        unit.failures.append(replica.describe(time.monotonic()) | {"at": time.time()})
        unit.last_failure = (unit.queue.arrivals, time.monotonic())
        self._forget(unit, replica)

    async def stop_all(self) -> None:
        replicas = [r for d in self.deployments.values() for u in d.units.values() for r in u.router.replicas.values()]
        for replica in replicas:
            replica.stop()
        await asyncio.gather(*(self.backend.stop(r) for r in replicas))
        await self.backend.close()
