"""The policies Ember's is measured against, as pure functions of the same shape as
`policy.decide`. None of them parks: they start and evict only.

- always-on: a fixed fleet sized for the trace's peak.
- KPA-like: Knative's KPA arithmetic (stable and panic windows, no scale-down in
  panic, scale to zero after a grace period once the stable window is empty).
- Ray Serve default: `target_ongoing_requests=2`, averaged over a 30 s look-back,
  a change applied only after it has been wanted for `upscale_delay_s=30` /
  `downscale_delay_s=600`, smoothing factors 1; from zero it starts one at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .policy import (
    HOT,
    STARTING,
    Action,
    Evict,
    ReplicaView,
    Sample,
    ScalingSettings,
    Start,
    mean_concurrency,
    replicas_for,
    window,
)


def scale_to(count: int, replicas: Sequence[ReplicaView], reason: str) -> list[Action]:
    """Start or evict to reach `count` replicas, evicting the least loaded (they drain first)."""
    live = [r for r in replicas if r.state in (HOT, STARTING) and not r.draining]
    if count > len(live):
        return [Start(count - len(live), reason)]
    hot = sorted((r for r in live if r.state == HOT), key=lambda r: r.in_flight)
    return [Evict(r.id, reason) for r in hot[: len(live) - count]]


@dataclass(frozen=True)
class AlwaysOnMemo:
    pass


def always_on_decide(
    count: int, replicas: Sequence[ReplicaView], history: Sequence[Sample], now: float, memo: AlwaysOnMemo
) -> tuple[list[Action], AlwaysOnMemo]:
    return scale_to(count, replicas, f"always on: {count} replicas sized for peak"), memo


KPA_SETTINGS = dict(stable_window=60.0, panic_window=6.0, panic_threshold=2.0, scaledown_window=30.0)


@dataclass(frozen=True)
class KpaMemo:
    panic_since: float | None = None
    panic_peak: int = 0
    zero_since: float | None = None  # when the stable window first wanted zero replicas


def kpa_decide(
    settings: ScalingSettings, replicas: Sequence[ReplicaView], history: Sequence[Sample], now: float, memo: KpaMemo
) -> tuple[list[Action], KpaMemo]:
    """Knative KPA; `settings.scaledown_window` is its scale-to-zero grace period."""
    s = settings
    ready = sum(r.state == HOT and not r.draining for r in replicas)
    live = sum(r.state in (HOT, STARTING) and not r.draining for r in replicas)
    stable = replicas_for(mean_concurrency(window(history, now, s.stable_window)), s.target_concurrency)
    panic = replicas_for(mean_concurrency(window(history, now, s.panic_window)), s.target_concurrency)

    panic_since = now if panic >= s.panic_threshold * max(ready, 1) and panic > ready else memo.panic_since
    panicking = panic_since is not None and now - panic_since < s.stable_window
    if panicking:
        want, why = max(panic, memo.panic_peak), f"panic: want {max(panic, memo.panic_peak)}"
    else:
        panic_since, want, why = None, stable, f"stable: want {stable}"
    if live == 0 and history and history[-1].queued:  # the activator wakes a function at zero
        want, why = max(want, 1), "request at zero"
    want = min(max(want, s.min_replicas), s.max_replicas)

    zero_since = memo.zero_since
    if want == 0 and live > 0:
        zero_since = now if zero_since is None else zero_since
        if now - zero_since < s.scaledown_for(parking=False):
            want = 1
    else:
        zero_since = None
    memo = KpaMemo(panic_since, want if panicking else 0, zero_since)
    if panicking and want < live:
        return [], memo
    return scale_to(want, replicas, why), memo


RAY_TARGET_ONGOING = 2.0
RAY_LOOK_BACK = 30.0
RAY_UPSCALE_DELAY = 30.0
RAY_DOWNSCALE_DELAY = 600.0


@dataclass(frozen=True)
class RayMemo:
    wanted_since: float | None = None  # when the current direction of change was first wanted
    direction: int = 0


def ray_decide(
    settings: ScalingSettings, replicas: Sequence[ReplicaView], history: Sequence[Sample], now: float, memo: RayMemo
) -> tuple[list[Action], RayMemo]:
    """Ray Serve's default replica-queue-length policy, with Ember's min/max replicas."""
    s = settings
    live = sum(r.state in (HOT, STARTING) and not r.draining for r in replicas)
    ongoing = mean_concurrency(window(history, now, RAY_LOOK_BACK))
    if live == 0:
        if history and history[-1].queued:
            return scale_to(max(1, s.min_replicas), replicas, "request at zero"), RayMemo()
        return scale_to(s.min_replicas, replicas, "min_replicas"), RayMemo()
    want = min(max(replicas_for(ongoing, RAY_TARGET_ONGOING), s.min_replicas), s.max_replicas)
    direction = (want > live) - (want < live)
    if direction == 0:
        return [], RayMemo()
    since = memo.wanted_since if memo.direction == direction and memo.wanted_since is not None else now
    delay = RAY_UPSCALE_DELAY if direction > 0 else RAY_DOWNSCALE_DELAY
    if now - since < delay:
        return [], RayMemo(since, direction)
    why = f"{ongoing:.1f} ongoing over {RAY_LOOK_BACK:g}s wanted {want} replicas for {delay:g}s"
    return scale_to(want, replicas, why), RayMemo()
