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
    until: float | None = None,
    trace_name: str = "",
) -> Report:
    """Run `trace` under `policy` until `until` (default: the last arrival) and every request is settled."""
    run = Simulation(trace, policy, model, queue, tick)
    run.run(until if until is not None else trace[-1].t if trace else 0.0)
    return run.report(slo_ttft, trace_name)


class Simulation:
    """One trace under one policy: an event loop over arrivals, replica starts, request
    completions and policy ticks, with the GPU and host-RAM bill kept as time passes."""

    HISTORY = 120.0  # seconds of samples kept: every policy here looks back at most 60 s

    def __init__(self, trace: Sequence[Request], policy: Policy, model: ReplicaModel, queue: Queue, tick: float):
        self.trace, self.policy, self.model, self.queue, self.tick = trace, policy, model, queue, tick
        self.events: list[tuple[float, int, str, Any]] = []
        self.seq = 0
        self.replicas: dict[str, Replica] = {}
        self.warm_nodes = set(range(model.warm_nodes))
        self.snapshot = model.snapshot_built
        self.waiting: deque[int] = deque()
        self.outcome: list[tuple[float, float] | None] = [None] * len(trace)  # (queue wait, TTFT); None: a 503
        self.settled = [0] * len(trace)
        self.memo = policy.memo
        self.history: list[Sample] = []
        self.arrivals = 0
        self.gpu_seconds = self.parked_gb_seconds = self.clock = 0.0
        self.starts: Counter[str] = Counter()
        self.actions: Counter[str] = Counter()
        self.peak = self.violations = self.ids = 0
        for i in range(policy.initial_hot):
            self.replicas[f"a{i}"] = Replica(f"a{i}", HOT, i, idle_since=0.0)
            self.warm_nodes.add(i // model.gpus_per_node)

    def push(self, t: float, kind: str, data: Any) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, data))

    def run(self, duration: float) -> None:
        for i, r in enumerate(self.trace):
            self.push(r.t, "arrive", i)
        self.push(0.0, "tick", None)
        while self.events:
            now, _, kind, data = heapq.heappop(self.events)
            self.bill(now)
            if kind == "arrive":
                self.arrive(data, now)
            elif kind == "ready":
                self.ready(data, now)
            elif kind == "done":
                self.done(*data, now)
            else:
                while self.waiting and expired(now - self.trace[self.waiting[0]].t, self.queue.timeout):
                    self.reject(self.waiting.popleft())
                self.decide(now)
                if now < duration or self.waiting or any(r.in_flight for r in self.replicas.values()):
                    self.push(now + self.tick, "tick", None)
        if any(n != 1 for n in self.settled):
            raise AssertionError(f"{self.policy.name}: requests settled {Counter(self.settled)} times, want once each")

    def bill(self, now: float) -> None:
        """A replica holds a GPU while starting or hot; a parked one holds only pinned host RAM."""
        dt, self.clock = now - self.clock, now
        self.gpu_seconds += dt * sum(r.state in (HOT, STARTING) for r in self.replicas.values())
        self.parked_gb_seconds += dt * self.model.host_gb * sum(r.state == PARKED for r in self.replicas.values())

    def live(self) -> int:
        return sum(r.state in (HOT, STARTING) and not r.drain_to for r in self.replicas.values())

    def arrive(self, i: int, now: float) -> None:
        self.arrivals += 1
        self.waiting.append(i)
        self.dispatch(now)
        if not self.waiting or self.waiting[-1] != i:
            return
        eta = min((r.ready_at - now for r in self.replicas.values() if r.state == STARTING), default=self.model.node_warm)
        oldest = now - self.trace[self.waiting[0]].t
        if not isinstance(admit(len(self.waiting) - 1, self.queue.bound, oldest, self.queue.timeout, eta), Admit):
            self.reject(self.waiting.pop())
        elif not self.live():
            self.decide(now)  # a request at zero asks for a decision now, as Knative's activator does

    def ready(self, rid: str, now: float) -> None:
        rep = self.replicas.get(rid)
        if rep is not None and rep.state == STARTING and rep.ready_at == now:
            rep.state, rep.idle_since = HOT, now
            self.warm_nodes.add(rep.gpu // self.model.gpus_per_node)
            self.dispatch(now)

    def done(self, rid: str, i: int, now: float) -> None:
        rep = self.replicas[rid]
        rep.in_flight -= 1
        if rep.in_flight == 0:
            rep.idle_since = now
            self.settle(rep, now)
        self.dispatch(now)

    def dispatch(self, now: float) -> None:
        """Hand queued requests to the least loaded hot replicas with a free slot."""
        while self.waiting:
            free = [r for r in self.replicas.values()
                    if r.state == HOT and not r.drain_to and r.in_flight < self.model.max_concurrency]
            if not free:
                return
            rep = min(free, key=lambda r: (r.in_flight, r.id))
            i = self.waiting.popleft()
            req = self.trace[i]
            rep.in_flight += 1
            rep.idle_since = None
            wait = now - req.t
            self.outcome[i] = (wait, wait + self.model.prefill(req) + 1 / self.model.decode_tokens_per_s)
            self.settled[i] += 1
            self.push(now + self.model.service(req), "done", (rep.id, i))

    def reject(self, i: int) -> None:
        self.outcome[i] = None
        self.settled[i] += 1

    def decide(self, now: float) -> None:
        self.history.append(Sample(now, len(self.waiting), sum(r.in_flight for r in self.replicas.values()), self.arrivals))
        self.arrivals = 0
        if self.history[0].t < now - self.HISTORY:
            self.history = [x for x in self.history if x.t >= now - self.HISTORY]
        actions, self.memo = self.policy.decide([r.view() for r in self.replicas.values()], self.history, now, self.memo)
        for action in actions:
            self.apply(action, now)
        live = self.live()
        self.peak = max(self.peak, live)
        self.violations += not self.policy.min_replicas <= live <= self.policy.max_replicas
        self.dispatch(now)

    def apply(self, action: Action, now: float) -> None:
        """Carry out an action as the gateway would; an action the gateway could not carry out is a policy bug."""
        self.actions[type(action).__name__] += 1
        if isinstance(action, Start):
            for _ in range(action.count):
                self.new_replica(now)
            return
        rep = self.replicas.get(action.replica_id)
        name = type(action).__name__
        if rep is None:
            raise ValueError(f"{self.policy.name}: {action} names no replica")
        if isinstance(action, Wake):
            if rep.state == HOT and rep.drain_to:
                rep.drain_to = None
            elif rep.state == PARKED:
                self.start(rep, now, "parked")
            else:
                raise ValueError(f"{self.policy.name}: wake of a {rep.state} replica that is not draining")
        elif rep.state == STARTING or (isinstance(action, Park) and rep.state != HOT) or rep.drain_to:
            raise ValueError(f"{self.policy.name}: {name} of a {rep.state} replica (draining: {rep.drain_to})")
        else:
            rep.drain_to = type(action)
            self.settle(rep, now)

    def settle(self, rep: Replica, now: float) -> None:
        """Finish a drain once the replica has nothing in flight."""
        if rep.drain_to is None or rep.in_flight:
            return
        if rep.drain_to is Park:
            rep.state, rep.idle_since = PARKED, now
        else:
            del self.replicas[rep.id]
        rep.drain_to = None

    def new_replica(self, now: float) -> None:
        # the lowest free GPU, so nodes that already hold the snapshot are reused first
        taken = {r.gpu for r in self.replicas.values()}
        gpu = next(g for g in range(len(taken) + 1) if g not in taken)
        if gpu // self.model.gpus_per_node in self.warm_nodes:
            tier = "node-warm"
        else:
            tier = "node-cold" if self.snapshot else "full-boot"
            self.snapshot = True
        self.ids += 1
        self.start(Replica(f"r{self.ids}", STARTING, gpu), now, tier)

    def start(self, rep: Replica, now: float, tier: str) -> None:
        rep.state, rep.idle_since, rep.ready_at = STARTING, None, now + self.model.start_latency(tier)
        self.replicas[rep.id] = rep
        self.starts[tier] += 1
        self.push(rep.ready_at, "ready", rep.id)

    def report(self, slo_ttft: float, trace_name: str) -> Report:
        served = [o for o in self.outcome if o is not None]
        waits = sorted(o[0] for o in served)
        ttfts = sorted(o[1] for o in served)
        return Report(
            trace=trace_name,
            policy=self.policy.name,
            requests=len(self.trace),
            served=len(served),
            rejected=len(self.trace) - len(served),
            gpu_seconds=self.gpu_seconds,
            parked_host_gb_seconds=self.parked_gb_seconds,
            cold_starts={t: self.starts[t] for t in TIERS},
            queue_wait_p50=percentile(waits, 0.5),
            queue_wait_p99=percentile(waits, 0.99),
            ttft_p50=percentile(ttfts, 0.5),
            ttft_p99=percentile(ttfts, 0.99),
            slo_ttft=slo_ttft,
            slo_attainment=sum(t <= slo_ttft for t in ttfts) / len(self.trace) if self.trace else 1.0,
            peak_replicas=self.peak,
            bound_violations=self.violations,
            actions=dict(self.actions),
        )
