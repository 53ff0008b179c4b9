"""A deployed app: its package and, per function or class, the spec, queue and scaling record."""
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ember.gateway.autoscaler.costs import CostModel, Measured
from ember.gateway.autoscaler.policy import Evict, Park, PolicyMemo, Sample, ScalingSettings, Start, Wake
from ember.gateway.queue import FunctionQueue
from ember.gateway.routing import Router
from ember.package import read_manifest
from ember.spec import FunctionSpec

QUEUE_WAIT = 300.0  # seconds a call may wait for a replica: long enough for a model load in enter


def scaling_settings(spec: FunctionSpec) -> ScalingSettings:
    """The policy's settings for a function: what its decorator says, the rest derived from it or defaulted.

    The gateway and bench/autoscale_sim.py both build Ember's policy from this, so what the benchmark
    measures for a function with default settings is what `ember serve` runs for it.
    """
    # A demand window longer than the idle window would hold idle replicas past their park_after or scaledown_window.
    idle_window = spec.park_after or spec.scaledown_window or 6.0
    panic_window = spec.panic_window or min(6.0, idle_window, spec.stable_window or 6.0)
    stable_window = spec.stable_window or min(60.0, 10 * (spec.scaledown_window or 6.0))
    return ScalingSettings(
        min_replicas=spec.min_replicas,
        max_replicas=spec.max_replicas,
        buffer_replicas=spec.buffer_replicas,
        target_concurrency=spec.target_concurrency,
        max_concurrency=spec.max_concurrency,
        scaledown_window=spec.scaledown_window,
        park=spec.park,
        park_after=spec.park_after,
        panic_window=panic_window,
        stable_window=max(panic_window, stable_window),
        panic_threshold=spec.panic_threshold,
    )


@dataclass(frozen=True)
class ScalingDecision:
    """One scaling action taken, as `ember status` shows it: the policy's, or an eviction the backend's limits
    forced."""

    t: float  # wall clock
    action: str  # start, wake, park or evict
    reason: str
    replica: str | None = None
    count: int | None = None  # replicas started

    @classmethod
    def of(cls, action: Start | Wake | Park | Evict, t: float) -> "ScalingDecision":
        if isinstance(action, Start):
            return cls(t, "start", action.reason, count=action.count)
        return cls(t, type(action).__name__.lower(), action.reason, replica=action.replica_id)


@dataclass(eq=False)
class Unit:
    """One function or class: the scaling unit (a class's methods share its replicas)."""

    app: str
    name: str
    kind: str
    methods: list[str]
    asgi: bool
    spec: FunctionSpec
    router: Router
    queue: FunctionQueue
    settings: ScalingSettings
    history: deque[Sample] = field(default_factory=lambda: deque(maxlen=1000))
    memo: PolicyMemo = field(default_factory=PolicyMemo)
    measured: list[Measured] = field(default_factory=list)  # starts, wakes and parks since the last tick
    decisions: deque[ScalingDecision] = field(default_factory=lambda: deque(maxlen=20))
    failures: deque[dict] = field(default_factory=lambda: deque(maxlen=5))
    schemas: dict[str, dict] = field(default_factory=dict)  # method -> its arguments' and result's JSON schemas
    openai_base: str | None = None  # an ASGI unit that serves the OpenAI API under this path (ember serve --model)
    successor: "Unit | None" = None  # the same function of the version that replaced this one (a redeploy)
    arrivals_seen: int = 0
    last_failure: tuple[int, float] | None = None  # (arrivals, monotonic time) when a start last failed


@dataclass(eq=False)
class Deployment:
    name: str
    package: Path
    units: dict[str, Unit]
    version: int | None = None  # its number in the gateway's version history (gateway/versions.py)

    @classmethod
    def from_package(cls, package: Path, on_demand: Callable[[], None]) -> "Deployment":
        manifest = read_manifest(package)
        units = {}
        for name, info in manifest["units"].items():
            spec = FunctionSpec(**info["spec"])
            router = Router(spec.max_concurrency)
            queue = FunctionQueue(router, wait_timeout=QUEUE_WAIT, bound=spec.queue_bound, on_demand=on_demand)
            # Until its own parks say otherwise, only a GPU function is expected to free something by parking.
            memo = PolicyMemo(costs=CostModel(park_frees_gpu=spec.gpu is not None))
            units[name] = Unit(manifest["app"], name, info["kind"], info["methods"], info["asgi"], spec, router,
                               queue, scaling_settings(spec), memo=memo, schemas=info.get("schemas", {}),
                               openai_base=(info.get("try_it") or {}).get("openai_base"))
        return cls(manifest["app"], package, units)
