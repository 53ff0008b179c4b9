"""The per-function queue: hands each call a replica slot, buffering calls while replicas start."""
import asyncio
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from ember.gateway.affinity import ReplicaLoad
from ember.gateway.autoscaler.admission import Reject, admit
from ember.gateway.errors import ApiError
from ember.gateway.replica import HOT, PARKED, STARTING, Replica
from ember.gateway.routing import SESSION, SessionTable, choose


@dataclass(frozen=True)
class ColdStart:
    """How the replica a call waited for became ready: the tier it came from and how long the call waited."""

    tier: str
    ms: int

    def header(self) -> str:
        """The X-Ember-Cold-Start value."""
        return f"{self.tier}; ms={self.ms}"


@dataclass(frozen=True)
class Lease:
    """A call's slot on a replica, and how it got it."""

    replica: Replica
    cold_start: ColdStart | None  # when the call waited for a start or wake
    waited_s: float = 0.0  # in the queue
    granted_ns: int = 0  # wall clock when a call that waited was handed its slot
    attempt: int = 1  # 2 for the one retry on another replica


@dataclass(eq=False)
class Waiter:
    future: asyncio.Future
    since: float
    key: str | None  # affinity key: session id or prompt prefix


class FunctionQueue:
    def __init__(self, max_concurrency: int, wait_timeout: float, bound: int, on_demand: Callable[[], None]):
        self.max_concurrency, self.wait_timeout, self.bound = max_concurrency, wait_timeout, bound
        self.on_demand = on_demand  # wakes the autoscaler so a queued call does not wait for its next tick
        self.replicas: dict[str, Replica] = {}
        self.waiters: deque[Waiter] = deque()
        self.arrivals = 0
        self.routing = "affinity"  # or "round-robin" / "least-loaded": see routing.choose
        self.turn = 0
        self.sessions = SessionTable()

    @property
    def depth(self) -> int:
        return len(self.waiters)

    @property
    def in_flight(self) -> int:
        return sum(r.in_flight for r in self.replicas.values())

    def _free(self, key: str | None = None, avoid: frozenset[str] = frozenset()) -> Replica | None:
        """A hot replica with a free slot, chosen by the routing mode; else a parked one, woken (on the local CPU
        backend waking is free)."""
        hot = [r for r in self.replicas.values()
               if r.state == HOT and not r.draining and r.in_flight < self.max_concurrency and r.id not in avoid]
        if hot:
            self.turn += 1
            session = self.routing == "affinity" and key is not None and key.startswith(SESSION)
            if session:
                loads = self.sessions.loads(key, [r.id for r in hot])
            else:
                loads = [ReplicaLoad(r.id, r.in_flight) for r in hot]
            chosen = choose(self.routing, key, loads, self.turn)
            if session:
                self.sessions.record(key, chosen)
            return self.replicas[chosen]
        parked = [r for r in self.replicas.values() if r.state == PARKED]
        if parked:
            self.wake(parked[0])
            return parked[0]
        return None

    def _take(self, replica: Replica) -> None:
        replica.in_flight += 1
        replica.idle_since = None

    async def acquire(self, key: str | None = None) -> Lease:
        self.arrivals += 1
        now = time.monotonic()
        if not self.waiters and (replica := self._free(key)) is not None:
            cold = self._cold_start(replica, now, now)
            self._take(replica)
            return Lease(replica, cold)
        oldest = now - self.waiters[0].since if self.waiters else 0.0
        starting = any(r.state == STARTING for r in self.replicas.values())
        decision = admit(len(self.waiters), self.bound, oldest, self.wait_timeout, 1.5 if starting else 3.0)
        if isinstance(decision, Reject):
            raise ApiError(503, "overloaded", f"{decision.reason}; retry later", {"Retry-After": str(decision.retry_after)})
        waiter = Waiter(asyncio.get_running_loop().create_future(), now, key)
        self.waiters.append(waiter)
        self._dispatch()  # a slot may have opened without a release (a park or drain undone)
        self.on_demand()
        try:
            replica = await asyncio.wait_for(asyncio.shield(waiter.future), self.wait_timeout)
        except asyncio.TimeoutError:
            self._abandon(waiter)
            raise ApiError(503, "no_replica", f"no replica became ready within {self.wait_timeout:g} s", {"Retry-After": "5"}) from None
        except asyncio.CancelledError:
            self._abandon(waiter)
            raise
        granted = time.monotonic()
        return Lease(replica, self._cold_start(replica, waiter.since, granted), granted - now, time.time_ns())

    def try_acquire(self, key: str | None, avoid: frozenset[str]) -> Lease | None:
        """A slot on a replica other than `avoid`, now or never: the one retry after a replica failed."""
        replica = self._free(key, avoid)
        if replica is None:
            return None
        self._take(replica)
        return Lease(replica, None)

    def _abandon(self, waiter: Waiter) -> None:
        if waiter in self.waiters:
            self.waiters.remove(waiter)
        elif waiter.future.done() and not waiter.future.exception():
            self.release(waiter.future.result())  # a slot was handed over just as the caller left

    @staticmethod
    def _cold_start(replica: Replica, since: float, now: float) -> ColdStart | None:
        if replica.ready_at is None or replica.ready_at < since:
            return None
        return ColdStart(replica.tier, round((now - since) * 1000))

    def _dispatch(self) -> None:
        while self.waiters and (replica := self._free(self.waiters[0].key)) is not None:
            waiter = self.waiters.popleft()
            self._take(replica)
            waiter.future.set_result(replica)

    def release(self, replica: Replica) -> None:
        replica.in_flight -= 1
        if replica.in_flight == 0:
            replica.idle_since = time.monotonic()
        self._dispatch()

    def add(self, replica: Replica) -> None:
        self.replicas[replica.id] = replica

    def ready(self, replica: Replica) -> None:
        self._dispatch()

    def wake(self, replica: Replica) -> None:
        if replica.draining:  # still hot: taking it back into routing costs nothing
            replica.draining = None
            return
        # CPU-only local backend: a parked replica is a live process merely marked parked, so waking is a state change.
        replica.state, replica.tier, replica.ready_at = HOT, "parked", time.monotonic()

    def remove(self, replica: Replica) -> None:
        self.replicas.pop(replica.id, None)
        if replica.error and not any(r.state in (STARTING, HOT, PARKED) for r in self.replicas.values()):
            self.fail_waiters(replica.error)

    def fail_waiters(self, error: str) -> None:
        """No replica is coming: callers get a 503 with the reason instead of waiting out their timeout."""
        while self.waiters:
            waiter = self.waiters.popleft()
            waiter.future.set_exception(ApiError(503, "replica_failed", error, {"Retry-After": "5"}))
