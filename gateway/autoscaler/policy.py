"""Ember's scaling policy: a pure function from a function's recent load, its replicas and
what their starts cost to actions on the cold-start ladder.

Steady load is sized as Knative's KPA sizes it: the concurrency (queued + in flight) averaged
over `stable_window`, at `target_concurrency` per replica. A burst that needs `panic_threshold`
times the hot replicas, in the `panic_window` average or in the latest sample alone, enters
panic: the count never drops while it lasts.

What differs from KPA follows from the ladder and from what this function's starts cost
(`costs.CostModel`, learned from its measured starts, wakes and parks). Where a park frees the
GPU and a wake costs well under a fresh start, spare capacity parks once the peak demand of the
last `park_after` seconds (learned when not set) fits without it, a burst's panic holds only a few
`park_after`s (a panic of load near the target holds the stable window, as KPA's does), parked
replicas wake before new ones start, and a replica parked for `scaledown_window` is evicted. The
last replica parks once an idle stretch that long would come only once in WAKE_ODDS arrivals at the
recent rate, so the function's p99 stays a hot replica's; but where that p99 is already lost, it parks
after PARK_AFTER_FLOOR when the rate is under one arrival per wake's cost in GPU-seconds (the lower of
the stable window's rate and its recent half's: the whole window still counts a burst that ended): the
wakes that costs sit below the p99, and on memoryless arrivals holding any longer never pays. The p99
is the app's (its functions' requests together, `app_tail`), and it is lost where, over the last
~TAIL_HORIZON seconds, more than 1 in TAIL requests queued a wake's delay behind busy replicas (as
with bursts), came after an idle stretch longer than any replica is held (as with many small
functions), or came while the concurrency, averaged over the panic window, overflowed the slots of
the replicas the stable average sizes (a surge, as at a burst's onset): under KPA, which sizes on that
average and holds an idle replica at most IDLE_HOLD, those wait for a start; here, for a wake; or, once
the function has served, waited with no replica to take them (a wake or a start: over a hot replica's
TTFT, so a lost p99 stays lost while parking fast wakes for them). A panic within a stable window of a
burst holds as the burst's does: the average it would be near is the burst's. No scale-down, parking or
not, goes under what the panic window would panic over at once: the next call would panic, take the
capacity back and hold it as long as a panic holds (after a burst the panic window still counts its
tail; as a near-target panic ends, the load that crossed the target is still there). Load that fell, the
mirror of a burst (the stable average asks panic_threshold times the replicas the panic window's does, and more
than one beyond them), parks as after a burst where parking pays: the stable average still counts it, however long
it lasted (a burst longer than the stable window is no burst to it by the time it ends). Where the p99 is already
lost to requests that found no capacity (surges, stranded requests; not queueing behind busy replicas, which filling
slots would add to) and parking pays, replicas fill their `max_concurrency` slots less the concurrency's Poisson
spread (`sized`), never more replicas than the target asks: the target's headroom under the slots holds what comes
while a start runs, and here capacity is a wake away. Where parking does not pay, idle replicas are stopped
as KPA stops them, the last one after `scaledown_window` without a request.
Every action carries the reason shown in `ember status`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist

from ember.gateway.lifecycle import HOT, LIVE, PARKED, STARTING, ReplicaState

from .costs import PARK_AFTER_FLOOR, CostModel, Measured

IDLE_HOLD = 90.0  # default seconds an idle replica stays when it cannot park: KPA's 60 s window + 30 s grace
PARKED_HOLD = 600.0  # default seconds a replica stays parked: it holds host RAM only, and the RAM budget comes first
# Poisson arrivals leave an idle stretch of ln(1000) mean gaps once in 1000 arrivals: that rarely does
# the last replica park while the traffic holds its rate, so a function's p99 stays a hot replica's.
WAKE_ODDS = 1000.0
PANIC_HOLD_PARKS = 4.0  # with parking, panic holds this many park_afters: re-growing costs a wake, not a start
TAIL = 100.0  # the p99's one request in a hundred
# Poisson concurrency c passes c + SPREAD * sqrt(c) (its normal approximation) one time in TAIL
SPREAD = NormalDist().inv_cdf(1 - 1 / TAIL)
TAIL_HORIZON = PARKED_HOLD  # seconds over which a function's requests that queued for capacity are counted


@dataclass(frozen=True)
class ScalingSettings:
    min_replicas: int = 0
    max_replicas: int = 10
    buffer_replicas: int = 0  # idle hot replicas kept beyond demand
    target_concurrency: float = 1.0  # requests per replica the policy aims for
    max_concurrency: int = 1  # requests a replica may run at once
    park: bool = True  # False: never park, stop idle replicas instead
    park_after: float | None = None  # idle seconds before a hot replica parks (None: learned from its wake cost)
    scaledown_window: float | None = None  # idle seconds before a replica stops (None: IDLE_HOLD; PARKED_HOLD parked)
    stable_window: float = 60.0
    panic_window: float = 6.0
    panic_threshold: float = 2.0
    max_parked: int | None = None  # parked replicas whose pinned host RAM the node can spare (None = no bound)

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(
                f"need 0 <= min_replicas <= max_replicas, got {self.min_replicas} and "
                f"{self.max_replicas}: raise max_replicas or lower min_replicas"
            )
        if self.target_concurrency <= 0 or self.target_concurrency > self.max_concurrency:
            raise ValueError(
                f"target_concurrency must be in (0, max_concurrency={self.max_concurrency}], "
                f"got {self.target_concurrency}"
            )
        if not 0 < self.panic_window <= self.stable_window:
            raise ValueError("need 0 < panic_window <= stable_window")
        if self.panic_threshold <= 1:
            raise ValueError(f"panic_threshold must be > 1, got {self.panic_threshold}")

    def park_after_for(self, costs: CostModel, rate: float, tail_lost: bool = False,
                       recent_rate: float | None = None) -> float | None:
        """Idle seconds before the last hot replica parks, or None where it never parks.

        Learned, it is the idle stretch that arrivals at the recent `rate` (per second, over the stable
        window) would leave only once in WAKE_ODDS: a stretch that long says the traffic changed, and
        no sooner than a park-and-wake round trip costs, nor later than an unparkable replica stays.
        `recent_rate` is the rate over the window's recent half (None: `rate`): where it has fallen, a lost p99
        sees it half a window sooner.
        """
        if not self.park or costs.park_refused or costs.parks_fail:   # no setting makes a park possible
            return None
        if self.park_after is not None:
            return self.park_after
        if not costs.park_pays():
            return None
        if tail_lost and min(rate, rate if recent_rate is None else recent_rate) * costs.wake_cost() < 1:
            # Poisson arrivals are memoryless: an idle second costs a GPU-second and spares a wake with odds
            # `rate` however long the replica has idled, so below a wake's worth holding never pays, not even for a
            # round trip's worth; and where more than 1 in TAIL requests already wait for capacity, the wakes it
            # spares sit below the p99. It holds only the floor: a caller's think time between turns. The rate is
            # the lower of the stable window's and its recent half's: after a burst the whole window still counts it.
            return PARK_AFTER_FLOOR
        unlikely = math.log(WAKE_ODDS) / rate if rate > 0 else math.inf
        return min(max(costs.park_after(), unlikely), self.scaledown_for(False))

    def scaledown_for(self, parking: bool) -> float:
        if self.scaledown_window is not None:
            return self.scaledown_window
        return PARKED_HOLD if parking else IDLE_HOLD

    def holds(self, costs: CostModel, rate: float, tail_lost: bool = False,
              recent_rate: float | None = None) -> Holds:
        park_after = self.park_after_for(costs, rate, tail_lost, recent_rate)
        if park_after is None:
            return Holds(None, None, self.stable_window, self.scaledown_for(False))
        # spare capacity beyond the last replica parks after a wake's worth of idleness: waking it costs a wake
        spare_after = min(self.park_after or costs.park_after(), park_after)
        # and re-growing after a park costs a wake, so panic need not hold the peak for a whole stable window
        panic_hold = min(self.stable_window, max(self.panic_window, PANIC_HOLD_PARKS * spare_after))
        return Holds(park_after, spare_after, panic_hold, self.scaledown_for(True))


@dataclass(frozen=True)
class Holds:
    """How long capacity outlasts the demand that needed it, for one call of `decide`."""

    park_after: float | None  # idle seconds before the last hot replica parks (None: it never parks)
    spare_after: float | None  # idle seconds before capacity beyond the demand parks (None: it never parks)
    panic_hold: float  # seconds a panic holds its peak after the burst was last seen
    scaledown: float  # idle seconds before a replica stops (parked ones: seconds parked)


@dataclass(frozen=True)
class ReplicaView:
    id: str
    state: ReplicaState  # starting, hot or parked
    in_flight: int
    idle_since: float | None  # None while it has work
    draining: bool = False  # a Park or Evict is waiting for its in-flight requests; routes nothing new

    def __post_init__(self) -> None:
        if self.state not in LIVE:
            raise ValueError(
                f"replica {self.id}: state {self.state!r} is not one of starting, hot, parked; "
                "leave stopping and failed replicas out of the policy's view"
            )


@dataclass(frozen=True)
class Sample:
    t: float
    queued: int
    in_flight: int
    arrivals: int  # arrivals since previous sample
    measured: tuple[Measured, ...] = ()  # starts, wakes and parks of this function's replicas since the previous sample

    @property
    def concurrency(self) -> int:
        return self.queued + self.in_flight


@dataclass(frozen=True)
class Start:
    count: int
    reason: str


@dataclass(frozen=True)
class Wake:
    replica_id: str
    reason: str


@dataclass(frozen=True)
class Park:
    replica_id: str
    reason: str


@dataclass(frozen=True)
class Evict:
    replica_id: str
    reason: str


Action = Start | Wake | Park | Evict


@dataclass(frozen=True)
class PolicyMemo:
    panic_since: float | None = None  # last time the panic condition held
    panic_peak: int = 0  # replicas wanted at the height of the current panic
    burst_at: float | None = None  # last time the panic condition held, kept after the panic ends
    costs: CostModel = field(default_factory=CostModel)
    tail: Tail = field(default_factory=lambda: Tail())
    panic_burst: bool = False  # the current panic has seen a burst (see `decide`), not only load near the target


@dataclass(frozen=True)
class Tail:
    """A function's requests, the seconds requests spent queued behind its busy hot replicas, and the requests that
    found no replica to route to (stranded), each counted with a weight that fades over TAIL_HORIZON seconds.

    Its p99 is set by capacity it lacked, not by its wakes, where the queueing adds up to more than a wake's delay
    for 1 in TAIL of the requests, or where more than 1 in TAIL of them were stranded, or where more than 1 in TAIL
    came in a surge, while the concurrency averaged over the panic window overflowed the slots of the replicas the
    stable average sizes: a policy that sizes on that average (KPA) has no slot for them until a start ends, whatever
    its panic asks for (a peak over the slots for a moment waits only for one of them to free).

    A request is stranded where it came after the function had been idle IDLE_HOLD or longer: it finds no replica
    under any policy that holds an idle one at most IDLE_HOLD (KPA's window and grace), so it waits for a start, or a
    wake where the replica parked. And once the function has served, a request that waited while none of its replicas
    could take it (all parked, starting or draining) is stranded too: it waited for a wake or a start, which puts it
    over a hot replica's TTFT, so where such requests are more than 1 in TAIL the p99 already is a wake's, and parking
    fast costs it nothing more until they fade. Without them, a p99 lost to requests after long idle stretches was
    regained the moment their share dipped under 1 in TAIL, though the wakes that parking fast had cost were still in
    the window: the last replica went back to holding and forth (small seed 0: the share hovers at 0.8-1.2%).
    A function's first requests ever, and those that wait for its first start, are not counted: every function starts
    once, and a new deployment's first minutes say nothing about its traffic.
    """

    t: float | None = None
    requests: float = 0.0
    queued_s: float = 0.0
    stranded: float = 0.0  # requests that came after an idle stretch of IDLE_HOLD or longer, or waited for a replica
    last_work: float | None = None  # the latest sample with a request in flight, queued or arriving (None: none yet)
    surged: float = 0.0  # requests that came while the panic window's concurrency overflowed the stable count's slots
    served: bool = False  # the function has had a replica to route to (its first start is behind it)

    def add(self, sample: Sample, busy: bool, surge: bool = False, routed: bool = True) -> Tail:
        """`busy`: a hot replica was there to queue behind; `routed`: one could take requests (hot, not draining)."""
        working = sample.arrivals > 0 or sample.concurrency > 0
        last_work = sample.t if working else self.last_work
        if self.t is None:
            return Tail(sample.t, sample.arrivals, 0.0, 0.0, last_work, sample.arrivals if surge else 0, routed)
        dt = max(sample.t - self.t, 0.0)
        fade = math.exp(-dt / TAIL_HORIZON)
        idle_long = self.last_work is not None and sample.t - self.last_work >= IDLE_HOLD
        # requests of this sample still queued with no replica to take them wait for a wake or a start
        waited = min(sample.arrivals, sample.queued) if self.served and not routed else 0
        return Tail(sample.t, fade * self.requests + sample.arrivals,
                    fade * self.queued_s + (sample.queued * dt if busy else 0.0),
                    fade * self.stranded + (sample.arrivals if idle_long else waited), last_work,
                    fade * self.surged + (sample.arrivals if surge else 0), self.served or routed)

    def faded(self, now: float) -> Tail:
        """The same counts as seen at `now` (no later than any sample yet to come)."""
        if self.t is None or now <= self.t:
            return self
        fade = math.exp(-(now - self.t) / TAIL_HORIZON)
        return Tail(now, fade * self.requests, fade * self.queued_s, fade * self.stranded, self.last_work,
                    fade * self.surged, self.served)

    def __add__(self, other: Tail) -> Tail:
        """Two functions' tails pooled: the p99 of their requests together."""
        if other.t is None:
            return self
        if self.t is None:
            return other
        now = max(self.t, other.t)
        a, b = self.faded(now), other.faded(now)
        return Tail(now, a.requests + b.requests, a.queued_s + b.queued_s, a.stranded + b.stranded, self.last_work,
                    a.surged + b.surged, self.served)

    def less(self, other: Tail) -> Tail:
        """This pool without `other`, a tail pooled in it (seen at this pool's time)."""
        if self.t is None or other.t is None:
            return self
        b = other.faded(self.t)
        return Tail(self.t, self.requests - b.requests, self.queued_s - b.queued_s, self.stranded - b.stranded,
                    self.last_work, self.surged - b.surged, self.served)

    def lost(self, wake_s: float, queueing: bool = True) -> bool:
        return self.requests >= TAIL and ((queueing and self.queued_s * TAIL > self.requests * wake_s)
                                          or self.stranded * TAIL > self.requests
                                          or self.surged * TAIL > self.requests)


def app_tail(memos: Iterable[object], now: float) -> Tail:
    """The pooled tail of an app's other functions, from their policy memos (others' memos count for nothing)."""
    pooled = Tail()
    for memo in memos:
        if isinstance(memo, PolicyMemo):
            pooled = pooled + memo.tail
    return pooled.faded(now)


class AppTails:
    """The pooled tail of an app's functions in one round of decisions at `now`, kept as each decision changes its
    function's memo: a function's peers are the pool less its own tail. Pooling the others afresh for each function
    cost O(functions²) a round: 200 functions took the trace simulator 6 minutes for 10 minutes of trace."""

    def __init__(self, memos: Iterable[object], now: float):
        self.now, self.pool = now, app_tail(memos, now)

    def peers(self, memo: object) -> Tail:
        return self.pool.less(_tail(memo))

    def replace(self, old: object, new: object) -> None:
        self.pool = self.pool.less(_tail(old)) + _tail(new).faded(self.now)


def _tail(memo: object) -> Tail:
    return memo.tail if isinstance(memo, PolicyMemo) else Tail()


def window(history: Sequence[Sample], now: float, seconds: float) -> list[Sample]:
    """The samples of the last `seconds` (history is oldest first)."""
    start = now - seconds
    out = []
    for sample in reversed(history):
        if sample.t <= start:
            break
        out.append(sample)
    return out


def mean_concurrency(samples: Sequence[Sample]) -> float:
    return sum(s.concurrency for s in samples) / len(samples) if samples else 0.0


def peak_average(history: Sequence[Sample], now: float, hold: float, width: float) -> float:
    """The highest mean concurrency over any `width`-second window that ends in the last `hold` seconds."""
    samples = window(history, now, hold + width)[::-1]
    best, total, lo = 0.0, 0, 0
    for hi, x in enumerate(samples):
        total += x.concurrency
        while samples[lo].t <= x.t - width:
            total -= samples[lo].concurrency
            lo += 1
        if x.t > now - hold:
            best = max(best, total / (hi - lo + 1))
    return best


def replicas_for(concurrency: float, target: float) -> int:
    # round before ceil so 3.0000000001 replicas of float noise is 3
    return math.ceil(round(concurrency / target, 6))


def sized(concurrency: float, settings: ScalingSettings, fill: bool = False) -> int:
    """Replicas for `concurrency` at the target; with `fill`, no more than hold it in their `max_concurrency` slots
    with its Poisson spread to spare (SPREAD standard deviations: passed one time in TAIL).

    The target's headroom under `max_concurrency` holds the requests that come while new capacity starts. Where that
    capacity is a wake away and the p99 is already a wait for capacity, a request over the slots waits a wake at
    most, which the p99 already counts; the spread keeps those requests near 1 in TAIL.
    """
    at_target = replicas_for(concurrency, settings.target_concurrency)
    if not fill:
        return at_target
    return min(at_target, replicas_for(concurrency + SPREAD * math.sqrt(concurrency), settings.max_concurrency))


def burst(
    settings: ScalingSettings, hot: Sequence[ReplicaView], starting: Sequence[ReplicaView], latest: Sample
) -> float:
    """The latest sample's concurrency when it is a burst the averages would dilute, else 0.

    A burst is a panic-sized load (or any load at zero). Queued requests that fit in
    the free slots of hot and starting replicas ask for no more: that backlog built up
    during a start and drains when the start ends; the panic average catches any
    lasting demand it stands for on the next calls.
    """
    capacity = len(hot) * settings.target_concurrency
    if hot or starting:
        if latest.concurrency < settings.panic_threshold * max(capacity, settings.target_concurrency):
            return 0.0
    free = len(starting) * settings.max_concurrency + sum(max(settings.max_concurrency - r.in_flight, 0) for r in hot)
    return latest.in_flight + max(latest.queued - free, 0)


def decide(
    settings: ScalingSettings,
    replicas: Sequence[ReplicaView],
    history: Sequence[Sample],
    now: float,
    memo: PolicyMemo = PolicyMemo(),
    peers: Tail = Tail(),
) -> tuple[list[Action], PolicyMemo]:
    """Actions for one function at time `now`.

    The caller applies them and reports the result in the next call: a Start shows
    up as `count` replicas in state "starting"; a Wake turns a parked replica into
    "starting", or takes a draining one back into routing; a Park or Evict of a
    replica with requests in flight first drains it (no new requests, `draining`
    set) and parks or stops it when the last one finishes. Parked replicas keep the
    `idle_since` they parked with. What the starts, wakes and parks measured arrives
    in the newest sample's `measured`, read once per call. `peers` pools the tails of
    the other functions of the same app (`app_tail`): whether a p99 is lost is the app's.
    """
    s = settings
    costs = memo.costs
    for measured in history[-1].measured if history else ():
        costs = costs.observe(measured)
    stable = window(history, now, s.stable_window)
    rate = sum(x.arrivals for x in stable) / s.stable_window
    recent_rate = sum(x.arrivals for x in window(history, now, s.stable_window / 2)) / (s.stable_window / 2)
    # a surge: more requests over the panic window than the slots of the replicas the stable average sizes (KPA's
    # count) hold; a moment's Poisson peak over them waits for a slot, not a start
    surge = bool(history) and mean_concurrency(window(history, now, s.panic_window)) > \
        replicas_for(mean_concurrency(stable), s.target_concurrency) * s.max_concurrency
    routed = any(r.state == HOT and not r.draining for r in replicas)
    tail = memo.tail.add(history[-1], any(r.state == HOT for r in replicas), surge, routed) if history else memo.tail
    holds = s.holds(costs, rate, (tail + peers).lost(costs.wake_s), recent_rate)
    park_after, spare_after, scaledown = holds.park_after, holds.spare_after, holds.scaledown
    parking = park_after is not None and spare_after is not None
    # where the p99 is already lost to requests that found no capacity (not to queueing behind busy replicas, which
    # filling slots adds to), and capacity over the slots is a wake away, replicas fill their slots (`sized`)
    fill = parking and (tail + peers).lost(costs.wake_s, queueing=False)

    hot = [r for r in replicas if r.state == HOT and not r.draining]
    draining = [r for r in replicas if r.state == HOT and r.draining]
    starting = [r for r in replicas if r.state == STARTING]
    parked = [r for r in replicas if r.state == PARKED]
    have = len(hot) + len(starting)

    panic_avg = mean_concurrency(window(history, now, s.panic_window))
    # A burst in the latest sample asks for capacity at once, however slow a start: capacity comes a start after it
    # is asked for, and waiting for the panic average to catch up adds its seconds to every request queued meanwhile.
    now_burst = burst(s, hot, starting, history[-1]) if history else 0.0
    # at zero only requests waiting now ask for a replica: past demand was served or timed out
    demand = max(panic_avg, now_burst) if have else now_burst
    want_panic = sized(demand, s, fill)
    over_threshold = want_panic >= s.panic_threshold * max(len(hot), 1) and want_panic > len(hot)
    panic_since = now if over_threshold else memo.panic_since
    # A burst is a panic whose load is panic_threshold times the stable average, or that asks for more than one
    # replica beyond that average's count. Anything less is load near the target crossing it: 1 -> 2 replicas is
    # always a panic, and at 9-10 concurrent against a target of 10 the stable average's own rounding flips it.
    stable_avg = mean_concurrency(stable)
    is_burst = over_threshold and (demand >= s.panic_threshold * stable_avg
                                   or want_panic > sized(stable_avg, s, fill) + 1)
    # a panic within a stable window of a burst is that burst's: the stable average it is measured against counts it
    after_burst = memo.burst_at is not None and now - memo.burst_at < s.stable_window
    burst_at = now if is_burst else memo.burst_at
    panic_burst = is_burst or (over_threshold and after_burst) or (memo.panic_since is not None and memo.panic_burst)
    # A burst's panic holds only a few park_afters: its load is gone when it ends, and re-growing costs a wake. A
    # near-target panic holds the stable window, as KPA's does: the load that crossed the target is still there,
    # and a replica parked under it comes back a wake later, after the requests over the first one's slots queued.
    panic_hold = holds.panic_hold if panic_burst else s.stable_window
    panicking = panic_since is not None and now - panic_since < panic_hold
    if not panicking:
        panic_since, panic_burst = None, False

    # no tolerance over the target, as KPA has none: 2 replicas at 10% over it let Poisson peaks over their slots queue
    steady = sized(stable_avg, s, fill)
    # Capacity is spare only if the peak of the hold window would still fit without it; that peak is of
    # the panic-window averages (noise in single samples is not demand), and no more than the raw peak
    # (a window with no requests at all needs no replica).
    hold = spare_after if parking and spare_after is not None else scaledown
    raw_peak = max((x.concurrency for x in window(history, now, hold)), default=0)
    recent_peak = min(peak_average(history, now, hold, s.panic_window), raw_peak)
    # the load fell, the mirror of a burst: the stable average asks panic_threshold times the replicas the panic
    # window's average does, and more than one beyond them, so it still counts load that ended (a burst's, however
    # long it lasted and the stable average followed it), not a moment's Poisson dip
    now_count = sized(panic_avg, s, fill)
    dropped = steady >= s.panic_threshold * now_count and steady > now_count + 1
    if not have:
        keep = sized(now_burst, s, fill)
    elif parking and (raw_peak == 0 or dropped or (burst_at is not None and now - burst_at < s.stable_window)):
        # the stable average still counts an ended burst or load that fell, or the function is idle: a wake brings
        # capacity back
        keep = min(steady, sized(recent_peak, s, fill))
        if not keep and any(x.concurrency for x in window(history, now, park_after or 0.0)):
            keep = 1  # the last replica waits out the longer park_after
    else:  # as KPA: the stable average's count, and the last replica until a whole hold is idle
        keep = max(steady, 1 if recent_peak > 0 else 0)
    if have and want_panic >= s.panic_threshold * max(keep, 1) and want_panic > keep:
        # never under what the panic window would panic over at once: the next call would panic and take back what
        # this one lets go, and hold it as long as a panic holds (after a burst, the panic window's average still
        # counts the load draining away; as a near-target panic ends, the load that crossed the target is there)
        keep = math.floor(want_panic / s.panic_threshold) + 1
    want = keep
    if panicking:
        want = max(want, want_panic, memo.panic_peak)
    peak = want if panicking else 0
    want = min(max(want + s.buffer_replicas, s.min_replicas), s.max_replicas)
    memo = PolicyMemo(panic_since, peak, burst_at, costs, tail, panic_burst)

    actions: list[Action] = []
    if want > have:
        why = f"{demand:.1f} concurrent over {s.panic_window:g}s, {stable_avg:.1f} over {s.stable_window:g}s: " \
              f"want {want} replicas, have {have}"
        if panicking:
            why = "panic: " + why
        # cheapest first: a draining replica is still hot, a parked one needs a wake
        waking = (draining + sorted(parked, key=lambda r: r.idle_since or 0.0, reverse=True))[: want - have]
        actions += [Wake(r.id, why) for r in waking]
        if want - have - len(waking) > 0:
            actions.append(Start(want - have - len(waking), why))
        return actions, memo

    if panicking:  # no scale-down of any kind until the burst has been over its hold
        return actions, memo

    # the least loaded go first, so draining them is quick
    spare = sorted(hot, key=lambda r: (r.in_flight, r.idle_since if r.idle_since is not None else now))
    for r in spare[: max(len(hot) - want, 0)]:
        why = f"peak {recent_peak:.1f} concurrent over {hold:g}s, {stable_avg:.1f} over {s.stable_window:g}s " \
              f"fit {want} replicas of {len(hot)}"
        actions.append(Park(r.id, why) if parking else Evict(r.id, why))

    # oldest parked first; past max_parked they go to free host RAM, past the window because it ended
    parked.sort(key=lambda r: r.idle_since if r.idle_since is not None else now)
    for i, r in enumerate(parked):
        idle = now - r.idle_since if r.idle_since is not None else 0.0
        if not parking:
            actions.append(Evict(r.id, f"parking no longer pays: {costs.why_not_park()}"))
        elif idle >= scaledown:
            actions.append(Evict(r.id, f"parked and idle {idle:.0f}s >= scaledown_window {scaledown:g}s"))
        elif s.max_parked is not None and len(parked) - i > s.max_parked:
            actions.append(Evict(r.id, f"{len(parked)} parked > max_parked {s.max_parked}: frees its host RAM"))
    return actions, memo
