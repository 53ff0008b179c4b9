"""The per-function queue: hands each call a replica slot, buffering calls while replicas start. Which replica
is the router's choice (gateway/routing.py); what state it is in, the replica's own (gateway/replica.py).

Callers (API keys) take turns, round-robin: a free slot goes to the oldest call of the caller whose turn it is, and a
caller served goes to the back of the turns, so a caller with a thousand calls queued gets every other slot while
another caller waits, not all of them first. A full queue still takes a call from a caller holding two places fewer
than another: that other caller's newest call gives up its place (429 `queue_share`), so one caller's backlog can
fill the queue, but not keep others out of it.

A call takes as many of a replica's `max_concurrency` slots as it runs sequences at once (an LLM request with n=8
takes 8, one of a batch of 4 prompts 4; any other call one), and at most all of them: a call too large for any
replica's free slots waits, and the autoscaler counts the slots the queue asks for, not its calls. While it waits
at the head of the queue it keeps the replica nearest to fitting it (the least loaded) for itself, and the calls
behind it may take the other replicas' free slots (backfill): the heavy call is not passed on the replica it will
get, and the other replicas' slots do not sit idle behind it."""
import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from ember.gateway.autoscaler.admission import Reject, admit
from ember.gateway.errors import ApiError
from ember.gateway.lifecycle import HOT, STARTING
from ember.gateway.replica import GatewayReplica
from ember.gateway.routing import Router


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

    replica: GatewayReplica
    cold_start: ColdStart | None  # when the call waited for a start or wake
    waited_s: float = 0.0  # in the queue
    granted_ns: int = 0  # wall clock when a call that waited was handed its slot
    attempt: int = 1  # 2 for the one retry on another replica
    slots: int = 1  # of the replica's max_concurrency: what release gives back


class Retired(Exception):
    """The queue's function belongs to a version that no longer takes calls (a redeploy replaced it): nothing was
    sent to a replica yet, so the call may go to the version that did."""


@dataclass(eq=False)
class Waiter:
    future: "asyncio.Future[GatewayReplica]"
    since: float
    key: str | None  # affinity key: session id or prompt prefix
    caller: str | None = None  # the API key's id: callers take turns
    slots: int = 1


class FunctionQueue:
    """Calls waiting for a slot, in arrival order, callers taking turns; each is handed the router's pick as soon as
    one has a free slot."""

    def __init__(self, router: Router, wait_timeout: float, bound: int, on_demand: Callable[[], None]):
        self.router, self.wait_timeout, self.bound = router, wait_timeout, bound
        self.on_demand = on_demand  # wakes the autoscaler so a queued call does not wait for its next tick
        self.waiters: OrderedDict[Waiter, None] = OrderedDict()  # every waiting call, in arrival order
        self.arrivals = 0
        self.callers: dict[str | None, OrderedDict[Waiter, None]] = {}  # caller -> its waiting calls, in order
        self.turns: OrderedDict[str | None, None] = OrderedDict()  # callers with calls waiting: whose turn is next
        self.retired = False  # its version was replaced: acquire raises Retired (close)

    @property
    def depth(self) -> int:
        return len(self.waiters)

    @property
    def demand(self) -> int:
        """The replica slots the waiting calls ask for."""
        return sum(waiter.slots for waiter in self.waiters)

    def slots_for(self, sequences: int) -> int:
        """The slots a call running `sequences` at once takes: one each, at most a whole replica's."""
        return max(1, min(sequences, self.router.max_concurrency))

    @staticmethod
    def _take(replica: GatewayReplica, slots: int) -> None:
        replica.in_flight += 1
        replica.load += slots
        replica.idle_since = None

    async def acquire(self, key: str | None = None, caller: str | None = None, sequences: int = 1) -> Lease:
        """Slots for a call with affinity `key` from `caller` (an API key's id) that runs `sequences` at once,
        waiting for them if need be."""
        if self.retired:
            raise Retired()
        self.arrivals += 1
        now = time.monotonic()
        slots = self.slots_for(sequences)
        if not self.waiters and (replica := self.router.pick(key, slots=slots)) is not None:
            cold = self._cold_start(replica, now, now)
            self._take(replica, slots)
            return Lease(replica, cold, slots=slots)
        oldest = now - next(iter(self.waiters)).since if self.waiters else 0.0
        starting = any(r.state == STARTING for r in self.router.replicas.values())
        decision = admit(len(self.waiters), self.bound, oldest, self.wait_timeout, 1.5 if starting else 3.0)
        if isinstance(decision, Reject) and not (len(self.waiters) >= self.bound and self._make_room(caller)):
            raise ApiError(503, "overloaded", f"{decision.reason}; retry later",
                           {"Retry-After": str(decision.retry_after)})
        waiter = Waiter(asyncio.get_running_loop().create_future(), now, key, caller, slots)
        self.waiters[waiter] = None
        self.callers.setdefault(caller, OrderedDict())[waiter] = None
        self.turns.setdefault(caller, None)  # a caller that was not waiting joins the back of the turns
        self.dispatch()  # a slot may have opened without a release (a park or drain undone)
        self.on_demand()
        try:
            granted_replica = await asyncio.wait_for(asyncio.shield(waiter.future), self.wait_timeout)
        except TimeoutError:
            self._abandon(waiter)
            raise ApiError(503, "no_replica", f"no replica became ready within {self.wait_timeout:g} s",
                           {"Retry-After": "5"}) from None
        except asyncio.CancelledError:
            self._abandon(waiter)
            raise
        granted = time.monotonic()
        return Lease(granted_replica, self._cold_start(granted_replica, waiter.since, granted), granted - now,
                     time.time_ns(), slots=slots)

    def try_acquire(self, key: str | None, avoid: frozenset[str], slots: int = 1) -> Lease | None:
        """`slots` on a replica other than `avoid`, now or never: the one retry after a replica failed."""
        replica = self.router.pick(key, avoid, slots)
        if replica is None:
            return None
        self._take(replica, slots)
        return Lease(replica, None, slots=slots)

    def _abandon(self, waiter: Waiter) -> None:
        if waiter in self.waiters:
            self._remove(waiter)
        elif waiter.future.done() and not waiter.future.exception():
            self.release(waiter.future.result(), waiter.slots)  # handed over just as the caller left

    @staticmethod
    def _cold_start(replica: GatewayReplica, since: float, now: float) -> ColdStart | None:
        if replica.ready_at is None or replica.ready_at < since:
            return None
        return ColdStart(replica.tier, round((now - since) * 1000))

    def dispatch(self) -> None:
        """Hand free slots to the waiters, the oldest call of the caller whose turn it is first: after a release, or
        when a replica became ready or woke. A head call that fits nowhere yet keeps the least loaded replica for
        itself, and later calls that fit on another replica go there (`_backfill`)."""
        while self.waiters:
            head = self._next()
            replica = self.router.pick(head.key, slots=head.slots)
            if replica is None:
                self._backfill(head)
                return
            self._grant(head, replica)

    def _backfill(self, head: Waiter) -> None:
        """The calls behind `head`, in arrival order, each on a replica other than the one `head` keeps, where one
        has their slots free."""
        hot = [r for r in self.router.replicas.values() if r.state == HOT and not r.draining]
        if not hot:
            return
        kept = min(hot, key=lambda r: (r.load, r.id))

        def room() -> int:   # the most slots free on one replica other than the kept one
            return max((self.router.max_concurrency - r.load for r in hot if r is not kept), default=0)

        free = room()
        for waiter in list(self.waiters):
            if free <= 0:   # the common case, every replica full: no pass over the queue
                return
            if waiter is head or waiter.slots > free:
                continue
            if (replica := self.router.pick(waiter.key, frozenset({kept.id}), waiter.slots)) is not None:
                self._grant(waiter, replica)
                free = room()

    def _grant(self, waiter: Waiter, replica: GatewayReplica) -> None:
        self._remove(waiter)
        if waiter.caller in self.turns:
            self.turns.move_to_end(waiter.caller)  # served: the other callers' turns come first
        self._take(replica, waiter.slots)
        waiter.future.set_result(replica)

    def _make_room(self, caller: str | None) -> bool:
        """In a full queue, the newest call of the caller holding the most places gives its place up to `caller`,
        when that caller holds at least two more places than `caller`."""
        heaviest = max(self.callers, key=lambda c: len(self.callers[c]))
        held, mine = len(self.callers[heaviest]), len(self.callers.get(caller, ()))
        if heaviest == caller or held < mine + 2:
            return False
        displaced = next(reversed(self.callers[heaviest]))
        self._remove(displaced)
        displaced.future.set_exception(ApiError(
            429, "queue_share", f"this call gave its place in the full queue (bound {self.bound}) to another "
            f"caller's: this key's calls held {held} of its places; retry later, or send fewer at once",
            {"Retry-After": "1"}))
        return True

    def _next(self) -> Waiter:
        """The oldest call of the caller whose turn it is."""
        return next(iter(self.callers[next(iter(self.turns))]))

    def _remove(self, waiter: Waiter) -> None:
        del self.waiters[waiter]
        mine = self.callers[waiter.caller]
        del mine[waiter]
        if not mine:
            del self.callers[waiter.caller]
            del self.turns[waiter.caller]

    def release(self, replica: GatewayReplica, slots: int = 1) -> None:
        """A call on `replica` that held `slots` (its lease's) ended."""
        replica.in_flight -= 1
        replica.load -= slots
        if replica.in_flight == 0:
            replica.idle_since = time.monotonic()
        self.dispatch()

    def fail_waiters(self, error: str) -> None:
        """No replica is coming: callers get a 503 with the reason instead of waiting out their timeout."""
        while self.waiters:
            waiter = next(iter(self.waiters))
            self._remove(waiter)
            waiter.future.set_exception(ApiError(503, "replica_failed", error, {"Retry-After": "5"}))

    def close(self) -> None:
        """Its version was replaced: the calls waiting, and every call that comes later (one that found this
        function before the redeploy and reaches the queue after it), raise Retired, to go to the new version."""
        self.retired = True
        while self.waiters:
            waiter = next(iter(self.waiters))
            self._remove(waiter)
            waiter.future.set_exception(Retired())
