"""Ember's scaling policy: a pure function from a function's recent load and its
replicas to actions on the cold-start ladder.

Arithmetic in the spirit of Knative's KPA: concurrency (queued + in flight) is
averaged over a panic window; a burst that needs `panic_threshold` times the hot
replicas enters panic, which never lowers its count and forbids any scale-down
until `stable_window` passes without a new burst.

What differs from KPA follows from the ladder. Waking a parked replica costs ~0.3 s,
so the policy scales up on the short window, on the latest sample when it is a
burst, and ahead of arrivals that are clearly rising; parked replicas wake before
new ones start. Scaling down parks (T1: frees the GPU, keeps the process) the least
loaded replicas once the peak demand of the last `park_after` seconds fits without
them, and evicts (T2: stops the process) a replica parked for `scaledown_window`.
Without `park_after`, spare replicas are evicted once `scaledown_window` of demand
fits without them. Every action carries the reason shown in `ember status`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

STARTING, HOT, PARKED = "starting", "hot", "parked"
TOLERANCE = 0.1  # demand within 10% over target adds no replica, as in Kubernetes' HPA


@dataclass(frozen=True)
class ScalingSettings:
    min_replicas: int = 0
    max_replicas: int = 10
    buffer_replicas: int = 0  # idle hot replicas kept beyond demand
    target_concurrency: float = 1.0  # requests per replica the policy aims for
    max_concurrency: int = 1  # requests a replica may run at once
    scaledown_window: float = 60.0  # idle seconds before a replica is evicted (process stopped)
    park_after: float | None = None  # idle seconds before a hot replica parks (None = never)
    stable_window: float = 60.0
    panic_window: float = 6.0
    panic_threshold: float = 2.0
    start_latency: float = 1.5  # expected seconds for a fresh start (node-warm); sets the pre-warm lead
    wake_latency: float = 0.3  # expected seconds to wake a parked replica
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


@dataclass(frozen=True)
class ReplicaView:
    id: str
    state: str  # "starting" | "hot" | "parked"
    in_flight: int
    idle_since: float | None  # None while it has work
    draining: bool = False  # a Park or Evict is waiting for its in-flight requests; routes nothing new

    def __post_init__(self) -> None:
        if self.state not in (STARTING, HOT, PARKED):
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


def prewarm_concurrency(settings: ScalingSettings, history: Sequence[Sample], now: float, lead: float) -> float:
    """Concurrency expected `lead` seconds from now when arrivals are rising, else 0.

    Extrapolates the arrival rate of the last panic window against the one before
    it, and turns rate into concurrency with the service time that Little's law
    gives over the stable window.
    """
    w = settings.panic_window
    recent = sum(s.arrivals for s in window(history, now, w))
    before = sum(s.arrivals for s in window(history, now, 2 * w)) - recent
    # Poisson counts: a rise under 3 standard deviations is noise, not a trend
    if recent - before <= 3 * math.sqrt(recent + before + 1):
        return 0.0
    stable = window(history, now, settings.stable_window)  # newest first
    if len(stable) < 2:
        return 0.0
    # the oldest sample's arrivals fell before the window, so it only marks where it starts
    rate = sum(s.arrivals for s in stable[:-1]) / (now - stable[-1].t)
    service = (sum(s.in_flight for s in stable) / len(stable)) / rate if rate else 0.0
    if service == 0:
        return 0.0
    slope = (recent - before) / w / w
    return (recent / w + slope * lead) * service


def burst(settings: ScalingSettings, hot: Sequence[ReplicaView], starting: Sequence[ReplicaView], latest: Sample) -> float:
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
) -> tuple[list[Action], PolicyMemo]:
    """Actions for one function at time `now`.

    The caller applies them and reports the result in the next call: a Start shows
    up as `count` replicas in state "starting"; a Wake turns a parked replica into
    "starting", or takes a draining one back into routing; a Park or Evict of a
    replica with requests in flight first drains it (no new requests, `draining`
    set) and parks or stops it when the last one finishes. Parked replicas keep the
    `idle_since` they parked with.
    """
    s = settings
    hot = [r for r in replicas if r.state == HOT and not r.draining]
    draining = [r for r in replicas if r.state == HOT and r.draining]
    starting = [r for r in replicas if r.state == STARTING]
    parked = [r for r in replicas if r.state == PARKED]

    panic_avg = mean_concurrency(window(history, now, s.panic_window))
    now_burst = burst(s, hot, starting, history[-1]) if history else 0.0
    # at zero only requests waiting now ask for a replica: past demand was served or timed out
    demand = max(panic_avg, now_burst) if hot or starting else now_burst
    want_panic = replicas_for(demand, s.target_concurrency)

    over_threshold = want_panic >= s.panic_threshold * max(len(hot), 1) and want_panic > len(hot)
    panic_since = now if over_threshold else memo.panic_since
    panicking = panic_since is not None and now - panic_since < s.stable_window
    if not panicking:
        panic_since = None

    have = len(hot) + len(starting)
    if not panicking and have and demand <= have * s.target_concurrency * (1 + TOLERANCE):
        want_panic = min(want_panic, have)  # a few percent over target on a steady load is noise
    lead = s.wake_latency if parked else s.start_latency
    rising = prewarm_concurrency(s, history, now, lead)
    want = max(want_panic, replicas_for(rising, s.target_concurrency))
    if panicking:
        want = max(want, memo.panic_peak)
    peak = want if panicking else 0
    want = min(max(want + s.buffer_replicas, s.min_replicas), s.max_replicas)

    actions: list[Action] = []
    if want > have:
        why = f"{demand:.1f} concurrent over {s.panic_window:g}s needs {want} replicas, have {have}"
        if panicking:
            why = "panic: " + why
        elif replicas_for(rising, s.target_concurrency) > want_panic:
            why = f"rising arrivals: expect {rising:.1f} concurrent in {lead:g}s, want {want}, have {have}"
        # cheapest first: a draining replica is still hot, a parked one needs ~0.3 s
        waking = (draining + sorted(parked, key=lambda r: r.idle_since or 0.0, reverse=True))[: want - have]
        actions += [Wake(r.id, why) for r in waking]
        if want - have - len(waking) > 0:
            actions.append(Start(want - have - len(waking), why))
        return actions, PolicyMemo(panic_since, peak)

    if panicking:  # no scale-down of any kind until the burst has been over a stable window
        return actions, PolicyMemo(panic_since, peak)

    # Capacity is spare only if the peak of the hold window would still fit without it; that
    # peak is of the panic-window averages (noise in single samples is not demand), and no
    # more than the raw peak (a window with no requests at all needs no replica).
    hold = s.park_after if s.park_after is not None else s.scaledown_window
    held = window(history, now, hold)
    recent_peak = min(peak_average(history, now, hold, s.panic_window), max((x.concurrency for x in held), default=0))
    keep = max(want, min(replicas_for(recent_peak, s.target_concurrency) + s.buffer_replicas, s.max_replicas))
    # the least loaded go first, so draining them is quick
    spare = sorted(hot, key=lambda r: (r.in_flight, r.idle_since if r.idle_since is not None else now))
    for r in spare[: max(len(hot) - keep, 0)]:
        why = f"peak {recent_peak:.1f} concurrent over {hold:g}s fits {keep} replicas of {len(hot)}"
        actions.append(Park(r.id, why) if s.park_after is not None else Evict(r.id, why))

    # oldest parked first; past max_parked they go to free host RAM, past the window because it ended
    parked.sort(key=lambda r: r.idle_since if r.idle_since is not None else now)
    for i, r in enumerate(parked):
        idle = now - r.idle_since if r.idle_since is not None else 0.0
        if idle >= s.scaledown_window:
            actions.append(Evict(r.id, f"parked and idle {idle:.0f}s >= scaledown_window {s.scaledown_window:g}s"))
        elif s.max_parked is not None and len(parked) - i > s.max_parked:
            actions.append(Evict(r.id, f"{len(parked)} parked > max_parked {s.max_parked}: frees its host RAM"))
    return actions, PolicyMemo()
