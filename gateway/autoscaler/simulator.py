"""A discrete-event simulator that runs a scaling policy against a trace.

The trace may hold several functions; each gets its own instance of the policy (own
queue, samples and memo), called every `tick` seconds of simulated time with the same
`ReplicaView`s and `Sample`s the gateway gives it, and all of them share one cluster of
GPUs. A start takes the latency of the tier it comes from (node-warm on a node that
has run the function, node-cold elsewhere), and reports that latency to the policy as
the gateway reports a measured start; a request holds one of a replica's
`max_concurrency` slots for prefill plus decode. A replica holds a GPU while starting
or hot; a parked one holds what the backend keeps for it: pinned host RAM where a park
frees the GPU, else the GPU itself. The cluster has `nodes` x `gpus_per_node` GPUs (or
no bound): a start that finds none free evicts the longest-parked replica holding one,
else stops the longest-idle hot replica with nothing in flight, else waits, shown to its
policy as starting, for the first GPU another replica gives back.
Requests that find no free slot wait in their function's queue under `admission.admit`.
Deterministic: no clock, no threads.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ember.gateway.lifecycle import HOT, PARKED, STARTING, ReplicaState

from .admission import Admit, admit, expired
from .costs import CostModel, Measured, ParkMeasured, StartMeasured
from .policy import Action, Evict, Park, ReplicaView, Sample, Start, Wake
from .trace import Request

TIERS = ("parked", "node-warm", "node-cold", "full-boot")


@dataclass(frozen=True)
class ReplicaModel:
    wake: float = 0.3  # T1: 16 GB of weights over pinned H2D at 55 GB/s
    node_warm: float = 1.5  # T2: fork + CUDA init + image from page cache
    node_cold: float = 4.0  # T3: image streamed from the object store
    full_boot: float = 40.0  # T4: engine boot, then a snapshot is written
    prefill_tokens_per_s: float = 20_000.0
    decode_tokens_per_s: float = 60.0  # per sequence, at any batch up to max_concurrency
    max_concurrency: int = 16
    host_gb: float = 16.0  # pinned host RAM a parked replica keeps
    park_frees_gpu: bool = True  # False: the backend keeps a parked replica's GPU memory, billed as GPU-seconds
    gpus_per_node: int = 8  # a snapshot on a node's disk makes starts on all its GPUs node-warm
    nodes: int | None = None  # nodes in the cluster, shared by every function of a trace (None: as many as asked)
    warm_nodes: int = 1  # nodes holding each function's snapshot at t=0: the one `ember snapshot build` ran on
    snapshot_built: bool = True  # False: the first start ever is a full boot

    def start_latency(self, tier: str) -> float:
        return {
            "parked": self.wake,
            "node-warm": self.node_warm,
            "node-cold": self.node_cold,
            "full-boot": self.full_boot,
        }[tier]

    def prefill(self, r: Request) -> float:
        return r.prompt_tokens / self.prefill_tokens_per_s

    def service(self, r: Request) -> float:
        return self.prefill(r) + r.output_tokens / self.decode_tokens_per_s

    def costs(self) -> CostModel:
        """What the backend tells a new function its starts cost, before any of its own are measured."""
        return CostModel(wake_s=self.wake, start_s=self.node_warm, park_frees_gpu=self.park_frees_gpu)


@dataclass(frozen=True)
class Policy:
    """A policy bound to its settings: decide(replicas, history, now, memo[, peers]) -> (actions, memo)."""

    name: str
    decide: Callable[..., tuple[list[Action], Any]]  # peers is passed only where `peers` is set
    memo: Any
    min_replicas: int
    max_replicas: int
    initial_hot: int = 0  # replicas already hot at t=0 (always-on)
    # what decide is told of the trace's other functions (the same app): peers(every function's memo, now) -> a
    # round (policy.AppTails): round.peers(a function's memo) is its `peers`; round.replace(old, new) as memos change
    peers: Callable[[list[Any], float], Any] | None = None


@dataclass(frozen=True)
class Queue:
    bound: int = 512
    timeout: float = 30.0


@dataclass
class SimulatedReplica:
    """A replica as the simulator models it: the gateway's states, a node and GPU, and a drain to finish."""

    id: str
    function: str
    state: ReplicaState
    node: int
    gpu: int | None  # None while parked on a backend whose park frees the GPU, or waiting for one to start
    in_flight: int = 0
    idle_since: float | None = None
    ready_at: float = 0.0
    tier: str = ""
    drain_to: type[Park] | type[Evict] | None = None  # what to do once the last request finishes

    def view(self) -> ReplicaView:
        return ReplicaView(self.id, self.state, self.in_flight, self.idle_since, self.drain_to is not None)


@dataclass
class FunctionRun:
    """One function's side of the simulation: its queue, samples and the policy's memo."""

    name: str
    memo: Any
    warm_nodes: set[int]
    snapshot: bool
    waiting: deque[int] = field(default_factory=deque)
    history: list[Sample] = field(default_factory=list)
    arrivals: int = 0
    measured: list[Measured] = field(default_factory=list)


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
    bound_violations: int  # ticks with a function's live replicas outside [min_replicas, max_replicas]
    actions: dict[str, int] = field(default_factory=dict)
    functions: int = 1
    gpu_waits: int = 0  # starts that found every GPU of the cluster taken and waited for one
    timeline: list[tuple[float, int, int]] = field(default_factory=list)  # (t, GPU-holding replicas, parked) per tick


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
    """Run `trace` under `policy` (one instance per function in it) until `until` (default: the last arrival)
    and every request is settled."""
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
        self.replicas: dict[str, SimulatedReplica] = {}
        names = sorted({r.function for r in trace}) or ["f"]
        self.functions = {name: FunctionRun(name, policy.memo, set(range(model.warm_nodes)), model.snapshot_built)
                          for name in names}
        self.outcome: list[tuple[float, float] | None] = [None] * len(trace)  # (queue wait, TTFT); None: a 503
        self.settled = [0] * len(trace)
        self.gpu_seconds = self.parked_gb_seconds = self.clock = 0.0
        self.starts: Counter[str] = Counter()
        self.actions: Counter[str] = Counter()
        self.peak = self.violations = self.ids = 0
        self.timeline: list[tuple[float, int, int]] = []
        self.pending: deque[str] = deque()  # starting replicas waiting for a free GPU, oldest first
        self.gpu_waits = 0
        for name in names:
            for _ in range(policy.initial_hot):
                self.ids += 1
                gpu = self.free_gpu()
                if gpu < 0:
                    raise ValueError(f"{policy.name}: {policy.initial_hot} replicas of each of {len(names)} functions "
                                     f"do not fit {model.nodes} nodes of {model.gpus_per_node} GPUs")
                rep = SimulatedReplica(f"r{self.ids}", name, HOT, gpu // model.gpus_per_node, gpu, idle_since=0.0)
                self.replicas[rep.id] = rep

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
                replica_id, index = data
                self.done(replica_id, index, now)
            else:
                self.place_pending(now)
                round_ = None if self.policy.peers is None else \
                    self.policy.peers([f.memo for f in self.functions.values()], now)
                for fn in self.functions.values():
                    while fn.waiting and expired(now - self.trace[fn.waiting[0]].t, self.queue.timeout):
                        self.reject(fn.waiting.popleft())
                    self.decide(fn, now, round_)
                held = sum(r.gpu is not None for r in self.replicas.values())
                self.timeline.append((now, held, sum(r.state == PARKED for r in self.replicas.values())))
                busy = any(fn.waiting for fn in self.functions.values()) or \
                    any(r.in_flight for r in self.replicas.values())
                if now < duration or busy:
                    self.push(now + self.tick, "tick", None)
        if any(n != 1 for n in self.settled):
            raise AssertionError(f"{self.policy.name}: requests settled {Counter(self.settled)} times, want once each")

    def bill(self, now: float) -> None:
        """A replica holds a GPU while starting or hot, and while parked where the park keeps it; else host RAM."""
        dt, self.clock = now - self.clock, now
        if dt <= 0:
            return
        gpus = parked_host = 0
        for r in self.replicas.values():
            if r.gpu is not None:
                gpus += 1
            elif r.state == PARKED:
                parked_host += 1
        self.gpu_seconds += dt * gpus
        self.parked_gb_seconds += dt * self.model.host_gb * parked_host

    def live(self, fn: FunctionRun) -> int:
        return sum(r.function == fn.name and r.state in (HOT, STARTING) and not r.drain_to
                   for r in self.replicas.values())

    def arrive(self, i: int, now: float) -> None:
        fn = self.functions[self.trace[i].function]
        fn.arrivals += 1
        fn.waiting.append(i)
        self.dispatch(fn, now)
        if not fn.waiting or fn.waiting[-1] != i:
            return
        eta = min((r.ready_at - now for r in self.replicas.values()
                   if r.function == fn.name and r.state == STARTING and r.gpu is not None),
                  default=self.model.node_warm)
        oldest = now - self.trace[fn.waiting[0]].t
        if not isinstance(admit(len(fn.waiting) - 1, self.queue.bound, oldest, self.queue.timeout, eta), Admit):
            self.reject(fn.waiting.pop())
        elif not self.live(fn):
            self.decide(fn, now)  # a request at zero asks for a decision now, as Knative's activator does

    def ready(self, rid: str, now: float) -> None:
        rep = self.replicas.get(rid)
        if rep is not None and rep.state == STARTING and rep.ready_at == now:
            fn = self.functions[rep.function]
            rep.state, rep.idle_since = HOT, now
            fn.warm_nodes.add(rep.node)
            fn.measured.append(StartMeasured(rep.tier, self.model.start_latency(rep.tier)))
            self.dispatch(fn, now)

    def done(self, rid: str, i: int, now: float) -> None:
        rep = self.replicas[rid]
        rep.in_flight -= 1
        if rep.in_flight == 0:
            rep.idle_since = now
            self.settle(rep, now)
        self.dispatch(self.functions[rep.function], now)

    def dispatch(self, fn: FunctionRun, now: float) -> None:
        """Hand the function's queued requests to its least loaded hot replicas with a free slot."""
        while fn.waiting:
            free = [r for r in self.replicas.values() if r.function == fn.name and r.state == HOT
                    and not r.drain_to and r.in_flight < self.model.max_concurrency]
            if not free:
                return
            rep = min(free, key=lambda r: (r.in_flight, r.id))
            i = fn.waiting.popleft()
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

    def decide(self, fn: FunctionRun, now: float, round_: Any = None) -> None:
        """`round_`: the policy's peers round of this tick (one is made for a decision out of turn)."""
        mine = [r for r in self.replicas.values() if r.function == fn.name]
        fn.history.append(Sample(now, len(fn.waiting), sum(r.in_flight for r in mine), fn.arrivals, tuple(fn.measured)))
        fn.arrivals = 0
        fn.measured.clear()
        if fn.history[0].t < now - self.HISTORY:
            fn.history = [x for x in fn.history if x.t >= now - self.HISTORY]
        views = [r.view() for r in mine]
        if self.policy.peers is None:
            actions, fn.memo = self.policy.decide(views, fn.history, now, fn.memo)
        else:
            if round_ is None:
                round_ = self.policy.peers([f.memo for f in self.functions.values()], now)
            before = fn.memo
            actions, fn.memo = self.policy.decide(views, fn.history, now, fn.memo, round_.peers(before))
            round_.replace(before, fn.memo)
        for action in actions:
            self.apply(fn, action, now)
        live = self.live(fn)
        self.peak = max(self.peak, sum(r.state in (HOT, STARTING) for r in self.replicas.values()))
        self.violations += not self.policy.min_replicas <= live <= self.policy.max_replicas
        self.dispatch(fn, now)

    def apply(self, fn: FunctionRun, action: Action, now: float) -> None:
        """Carry out an action as the gateway would; an action the gateway could not carry out is a policy bug."""
        self.actions[type(action).__name__] += 1
        if isinstance(action, Start):
            for _ in range(action.count):
                self.new_replica(fn.name, now)
            return
        rep = self.replicas.get(action.replica_id)
        name = type(action).__name__
        if rep is None or rep.function != fn.name:
            raise ValueError(f"{self.policy.name}: {action} names no replica of {fn.name}")
        if isinstance(action, Wake):
            if rep.state == HOT and rep.drain_to:
                rep.drain_to = None
            elif rep.state == PARKED:
                self.wake(rep, now)
            else:
                raise ValueError(f"{self.policy.name}: wake of a {rep.state} replica that is not draining")
        elif rep.state == STARTING or (isinstance(action, Park) and rep.state != HOT) or rep.drain_to:
            raise ValueError(f"{self.policy.name}: {name} of a {rep.state} replica (draining: {rep.drain_to})")
        else:
            rep.drain_to = type(action)
            self.settle(rep, now)

    def settle(self, rep: SimulatedReplica, now: float) -> None:
        """Finish a drain once the replica has nothing in flight."""
        if rep.drain_to is None or rep.in_flight:
            return
        if rep.drain_to is Park:
            rep.state, rep.idle_since = PARKED, now
            if self.model.park_frees_gpu:
                rep.gpu = None
            gb_freed = 16 << 30 if self.model.park_frees_gpu else 0
            self.functions[rep.function].measured.append(ParkMeasured(gb_freed))
        else:
            del self.replicas[rep.id]
        rep.drain_to = None
        self.place_pending(now)

    def free_gpu(self, node: int | None = None) -> int:
        """The lowest free GPU (on `node` if given), so nodes already in use are filled first; -1 if none is free."""
        taken = {r.gpu for r in self.replicas.values() if r.gpu is not None}
        per = self.model.gpus_per_node
        if node is not None:
            candidates = range(node * per, (node + 1) * per)
        else:
            candidates = range(self.model.nodes * per if self.model.nodes is not None else len(taken) + 1)
        return next((g for g in candidates if g not in taken), -1)

    def make_room(self) -> bool:
        """Stop a replica so a start can have its GPU: the longest-parked one that holds a GPU (a park that frees
        nothing), else the longest-idle hot one with nothing in flight, of any function. False if none is idle."""
        holders = [r for r in self.replicas.values() if r.state == PARKED and r.gpu is not None]
        if not holders:
            holders = [r for r in self.replicas.values()
                       if r.state == HOT and not r.in_flight and not r.drain_to and r.idle_since is not None]
        if not holders:
            return False
        victim = min(holders, key=lambda r: (r.idle_since or 0.0, r.id))
        self.actions["EvictForRoom" if victim.state == PARKED else "StopIdleForRoom"] += 1
        del self.replicas[victim.id]
        return True

    def place_pending(self, now: float) -> None:
        """Start the replicas that wait for a GPU, oldest first, while GPUs are free."""
        while self.pending:
            rep = self.replicas.get(self.pending[0])
            if rep is None or rep.gpu is not None:
                self.pending.popleft()
                continue
            gpu = self.free_gpu()
            if gpu < 0 and self.make_room():
                gpu = self.free_gpu()
            if gpu < 0:
                return
            self.pending.popleft()
            self.place(rep, gpu, now)

    def wake(self, rep: SimulatedReplica, now: float) -> None:
        if rep.gpu is None:  # the process stays on its node: it needs a GPU there
            gpu = self.free_gpu(rep.node)
            if gpu < 0:  # none free: what wakes is a fresh replica wherever there is room
                del self.replicas[rep.id]
                self.new_replica(rep.function, now)
                self.place_pending(now)
                return
            rep.gpu = gpu
        self.start(rep, now, "parked")

    def new_replica(self, function: str, now: float) -> SimulatedReplica:
        self.ids += 1
        rep = SimulatedReplica(f"r{self.ids}", function, STARTING, -1, None, ready_at=math.inf)
        self.replicas[rep.id] = rep
        gpu = self.free_gpu()
        if gpu < 0 and self.make_room():
            gpu = self.free_gpu()
        if gpu < 0:  # the cluster is full: it starts when another replica gives its GPU back
            self.gpu_waits += 1
            self.pending.append(rep.id)
        else:
            self.place(rep, gpu, now)
        return rep

    def place(self, rep: SimulatedReplica, gpu: int, now: float) -> None:
        fn = self.functions[rep.function]
        rep.gpu, rep.node = gpu, gpu // self.model.gpus_per_node
        if rep.node in fn.warm_nodes:
            tier = "node-warm"
        else:
            tier = "node-cold" if fn.snapshot else "full-boot"
            fn.snapshot = True
        self.start(rep, now, tier)

    def start(self, rep: SimulatedReplica, now: float, tier: str) -> None:
        rep.state, rep.idle_since, rep.tier = STARTING, None, tier
        rep.ready_at = now + self.model.start_latency(tier)
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
            functions=len(self.functions),
            gpu_waits=self.gpu_waits,
            timeline=self.timeline,
        )
