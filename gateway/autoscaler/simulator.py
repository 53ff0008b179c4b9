"""A discrete-event simulator that runs a scaling policy against a trace.

The policy is called every `tick` seconds of simulated time with the same
`ReplicaView`s and `Sample`s the gateway gives it, and its actions are applied to
a replica model: a start takes the latency of the tier it comes from, a request
holds one of a replica's `max_concurrency` slots for prefill plus decode, and a
replica holds a GPU while starting or hot. Requests that find no free slot wait in
the function's queue under `admission.admit`. Deterministic: no clock, no threads.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .admission import Admit, admit, expired
from .policy import HOT, PARKED, STARTING, Action, Evict, Park, ReplicaView, Sample, Start, Wake
from .trace import Request

TIERS = ("parked", "node-warm", "node-cold", "full-boot")


@dataclass(frozen=True)
class ReplicaModel:
    wake: float = 0.3  # T1: 16 GB of weights over pinned H2D at 55 GB/s
    node_warm: float = 1.5  # T2: fork + CUDA init + image from page cache
    node_cold: float = 4.5  # T3: image streamed from the object store
    full_boot: float = 40.0  # T4: engine boot, then a snapshot is written
    prefill_tokens_per_s: float = 20_000.0
    decode_tokens_per_s: float = 60.0  # per sequence, at any batch up to max_concurrency
    max_concurrency: int = 16
    host_gb: float = 16.0  # pinned host RAM a parked replica keeps
    gpus_per_node: int = 8  # a snapshot on a node's disk makes starts on all its GPUs node-warm
    warm_nodes: int = 1  # nodes holding the snapshot at t=0: the one `ember snapshot build` ran on
    snapshot_built: bool = True  # False: the first start ever is a full boot

    def start_latency(self, tier: str) -> float:
        return {"parked": self.wake, "node-warm": self.node_warm, "node-cold": self.node_cold, "full-boot": self.full_boot}[tier]

    def prefill(self, r: Request) -> float:
        return r.prompt_tokens / self.prefill_tokens_per_s

    def service(self, r: Request) -> float:
        return self.prefill(r) + r.output_tokens / self.decode_tokens_per_s


@dataclass(frozen=True)
class Policy:
    """A policy bound to its settings: decide(replicas, history, now, memo) -> (actions, memo)."""

    name: str
    decide: Callable[[Sequence[ReplicaView], Sequence[Sample], float, Any], tuple[list[Action], Any]]
    memo: Any
    min_replicas: int
    max_replicas: int
    initial_hot: int = 0  # replicas already hot at t=0 (always-on)


@dataclass(frozen=True)
class Queue:
    bound: int = 512
    timeout: float = 30.0


@dataclass
class Replica:
    id: str
    state: str
    gpu: int  # a parked replica keeps its GPU reserved to wake on
    in_flight: int = 0
    idle_since: float | None = None
    ready_at: float = 0.0
    drain_to: type[Park] | type[Evict] | None = None  # what to do once the last request finishes

    def view(self) -> ReplicaView:
        return ReplicaView(self.id, self.state, self.in_flight, self.idle_since, self.drain_to is not None)


@dataclass
class Report:
    trace: str
    policy: str
    requests: int
    served: int
    rejected: int
    gpu_seconds: float
    parked_host_gb_seconds: float
    cold_starts: dict[str, int]
    queue_wait_p50: float
    queue_wait_p99: float
    ttft_p50: float
    ttft_p99: float
    slo_ttft: float
    slo_attainment: float  # share of all requests (503s count as misses) with TTFT <= slo_ttft
    peak_replicas: int
    bound_violations: int  # ticks with live replicas outside [min_replicas, max_replicas]
    actions: dict[str, int] = field(default_factory=dict)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, math.ceil(q * len(sorted_values)) - 1)]


def simulate(
    trace: Sequence[Request],
    policy: Policy,
    model: ReplicaModel = ReplicaModel(),
    queue: Queue = Queue(),
    tick: float = 1.0,
    slo_ttft: float = 2.0,
    history_seconds: float = 120.0,
    until: float | None = None,
    trace_name: str = "",
) -> Report:
    """Run `trace` under `policy` until `until` (default: the last arrival) and every request is settled."""
    events: list[tuple[float, int, str, Any]] = []
    seq = 0

    def push(t: float, kind: str, data: Any) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, data))

    for i, r in enumerate(trace):
        push(r.t, "arrive", i)
    push(0.0, "tick", None)

    replicas: dict[str, Replica] = {}
    warm_nodes: set[int] = set(range(model.warm_nodes))
    snapshot = model.snapshot_built
    waiting: deque[int] = deque()
    outcome: list[tuple[float, float] | None] = [None] * len(trace)  # (queue wait, ttft); None = 503
    settled = [0] * len(trace)
    memo = policy.memo
    history: list[Sample] = []
    arrivals = 0
    gpu = parked_gb = 0.0
    last = 0.0
    starts: Counter[str] = Counter()
    actions: Counter[str] = Counter()
    peak = violations = 0
    ids = 0

    def new_replica(now: float) -> None:
        # the lowest free GPU, so nodes that already hold the snapshot are reused first
        nonlocal ids, snapshot
        taken = {r.gpu for r in replicas.values()}
        gpu = next(g for g in range(len(taken) + 1) if g not in taken)
        if gpu // model.gpus_per_node in warm_nodes:
            tier = "node-warm"
        else:
            tier = "node-cold" if snapshot else "full-boot"
            snapshot = True
        ids += 1
        start(Replica(f"r{ids}", STARTING, gpu), now, tier)

    def start(rep: Replica, now: float, tier: str) -> None:
        rep.state, rep.idle_since, rep.ready_at = STARTING, None, now + model.start_latency(tier)
        replicas[rep.id] = rep
        starts[tier] += 1
        push(rep.ready_at, "ready", rep.id)

    def dispatch(now: float) -> None:
        while waiting:
            free = [r for r in replicas.values() if r.state == HOT and not r.drain_to and r.in_flight < model.max_concurrency]
            if not free:
                return
            rep = min(free, key=lambda r: (r.in_flight, r.id))
            i = waiting.popleft()
            req = trace[i]
            rep.in_flight += 1
            rep.idle_since = None
            outcome[i] = (now - req.t, now - req.t + model.prefill(req) + 1 / model.decode_tokens_per_s)
            settled[i] += 1
            push(now + model.service(req), "done", (rep.id, i))

    def reject(i: int) -> None:
        outcome[i] = None
        settled[i] += 1

    def apply(action: Action, now: float) -> None:
        actions[type(action).__name__] += 1
        if isinstance(action, Start):
            for _ in range(action.count):
                new_replica(now)
            return
        rep = replicas.get(action.replica_id)
        if rep is None:
            raise ValueError(f"{policy.name}: {action} names no replica")
        if isinstance(action, Wake):
            if rep.state == HOT and rep.drain_to:
                rep.drain_to = None
            elif rep.state == PARKED:
                start(rep, now, "parked")
            else:
                raise ValueError(f"{policy.name}: wake of a {rep.state} replica that is not draining")
        elif rep.state == STARTING or (isinstance(action, Park) and rep.state != HOT) or rep.drain_to:
            raise ValueError(f"{policy.name}: {type(action).__name__} of a {rep.state} replica (draining: {rep.drain_to})")
        else:
            rep.drain_to = type(action)
            settle(rep, now)

    def settle(rep: Replica, now: float) -> None:
        """Finish a drain once the replica has nothing in flight."""
        if rep.drain_to is None or rep.in_flight:
            return
        if rep.drain_to is Park:
            rep.state, rep.idle_since = PARKED, now
        else:
            del replicas[rep.id]
        rep.drain_to = None

    def decide_now(now: float) -> None:
        nonlocal arrivals, history, memo, peak, violations
        in_flight = sum(r.in_flight for r in replicas.values())
        history.append(Sample(now, len(waiting), in_flight, arrivals))
        arrivals = 0
        if history[0].t < now - history_seconds:
            history = [x for x in history if x.t >= now - history_seconds]
        decided, memo = policy.decide([r.view() for r in replicas.values()], history, now, memo)
        for action in decided:
            apply(action, now)
        live = sum(r.state in (HOT, STARTING) and not r.drain_to for r in replicas.values())
        peak = max(peak, live)
        violations += not policy.min_replicas <= live <= policy.max_replicas
        dispatch(now)

    for i in range(policy.initial_hot):
        replicas[f"a{i}"] = Replica(f"a{i}", HOT, i, idle_since=0.0)
        warm_nodes.add(i // model.gpus_per_node)

    duration = until if until is not None else trace[-1].t if trace else 0.0
    while events:
        now, _, kind, data = heapq.heappop(events)
        live = sum(r.state in (HOT, STARTING) for r in replicas.values())
        gpu += (now - last) * live
        parked_gb += (now - last) * model.host_gb * sum(r.state == PARKED for r in replicas.values())
        last = now
        if kind == "arrive":
            arrivals += 1
            waiting.append(data)
            dispatch(now)
            if waiting and waiting[-1] == data:
                eta = min((r.ready_at - now for r in replicas.values() if r.state == STARTING), default=model.node_warm)
                oldest = now - trace[waiting[0]].t
                if not isinstance(admit(len(waiting) - 1, queue.bound, oldest, queue.timeout, eta), Admit):
                    reject(waiting.pop())
                elif not any(r.state in (HOT, STARTING) and not r.drain_to for r in replicas.values()):
                    decide_now(now)  # a request at zero asks for a decision now, as Knative's activator does
        elif kind == "ready":
            rep = replicas.get(data)
            if rep is not None and rep.state == STARTING and rep.ready_at == now:
                rep.state, rep.idle_since = HOT, now
                warm_nodes.add(rep.gpu // model.gpus_per_node)
                dispatch(now)
        elif kind == "done":
            rid, i = data
            rep = replicas[rid]
            rep.in_flight -= 1
            if rep.in_flight == 0:
                rep.idle_since = now
                settle(rep, now)
            dispatch(now)
        else:
            while waiting and expired(now - trace[waiting[0]].t, queue.timeout):
                reject(waiting.popleft())
            decide_now(now)
            if now < duration or waiting or any(r.in_flight for r in replicas.values()):
                push(now + tick, "tick", None)

    if any(n != 1 for n in settled):
        raise AssertionError(f"{policy.name}: requests settled {Counter(settled)} times, want exactly once each")
    served = [o for o in outcome if o is not None]
    waits = sorted(o[0] for o in served)
    ttfts = sorted(o[1] for o in served)
    return Report(
        trace=trace_name,
        policy=policy.name,
        requests=len(trace),
        served=len(served),
        rejected=len(trace) - len(served),
        gpu_seconds=gpu,
        parked_host_gb_seconds=parked_gb,
        cold_starts={t: starts[t] for t in TIERS},
        queue_wait_p50=percentile(waits, 0.5),
        queue_wait_p99=percentile(waits, 0.99),
        ttft_p50=percentile(ttfts, 0.5),
        ttft_p99=percentile(ttfts, 0.99),
        slo_ttft=slo_ttft,
        slo_attainment=sum(t <= slo_ttft for t in ttfts) / len(trace) if trace else 1.0,
        peak_replicas=peak,
        bound_violations=violations,
        actions=dict(actions),
    )
