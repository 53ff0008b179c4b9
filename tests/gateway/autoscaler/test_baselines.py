from ember.gateway.autoscaler.baselines import (
    KPA_SETTINGS,
    AlwaysOnMemo,
    KpaMemo,
    RayMemo,
    always_on_decide,
    kpa_decide,
    ray_decide,
)
from ember.gateway.autoscaler.policy import Evict, Park, ReplicaView, Sample, ScalingSettings, Start

KPA = ScalingSettings(target_concurrency=10, max_concurrency=16, **KPA_SETTINGS)
RAY = ScalingSettings(target_concurrency=10, max_concurrency=16, max_replicas=20)


def load(concurrency: int, until: float, since: float = 0.0) -> list[Sample]:
    return [Sample(float(t), 0, concurrency, 1) for t in range(int(since), int(until) + 1)]


def hot(n: int, in_flight: int = 0) -> list[ReplicaView]:
    return [ReplicaView(f"h{i}", "hot", in_flight, None if in_flight else 0.0) for i in range(n)]


def test_kpa_follows_the_stable_window_and_never_parks():
    actions, _ = kpa_decide(KPA, hot(5), load(30, 200), 200.0, KpaMemo())
    assert len(actions) == 2 and all(isinstance(a, Evict) for a in actions)  # 30 / 10 -> 3 of 5


def test_kpa_holds_in_panic_then_scales_down():
    burst = load(5, 60) + load(80, 66, since=61)
    actions, memo = kpa_decide(KPA, hot(1, in_flight=16), burst, 66.0, KpaMemo())
    assert memo.panic_since == 66.0 and actions[0].count >= 5
    quiet = burst + load(0, 120, since=67)
    actions, memo = kpa_decide(KPA, hot(8), quiet, 120.0, memo)
    assert actions == []  # inside the 60 s panic hold
    actions, memo = kpa_decide(KPA, hot(8), quiet + load(0, 127, since=121), 127.0, memo)
    assert memo.panic_since is None and actions and all(isinstance(a, Evict) for a in actions)


def test_kpa_scales_to_zero_only_after_grace():
    history = load(0, 200)
    actions, memo = kpa_decide(KPA, hot(1), history, 200.0, KpaMemo())
    assert actions == [] and memo.zero_since == 200.0
    actions, memo = kpa_decide(KPA, hot(1), history + load(0, 229, since=201), 229.0, memo)
    assert actions == []
    actions, memo = kpa_decide(KPA, hot(1), history + load(0, 230, since=201), 230.0, memo)
    assert [type(a) for a in actions] == [Evict]


def test_ray_waits_its_upscale_delay():
    memo = RayMemo()
    for now in range(100, 130):
        actions, memo = ray_decide(RAY, hot(1, in_flight=8), load(8, now), float(now), memo)
        assert actions == [], now
    actions, memo = ray_decide(RAY, hot(1, in_flight=8), load(8, 130), 130.0, memo)
    assert actions == [Start(3, actions[0].reason)]  # 8 ongoing / target 2


def test_ray_starts_one_at_once_from_zero():
    history = load(0, 10) + [Sample(11.0, 2, 0, 2)]
    actions, _ = ray_decide(RAY, [], history, 11.0, RayMemo())
    assert actions == [Start(1, actions[0].reason)]


def test_always_on_keeps_its_count():
    assert always_on_decide(4, hot(4), load(0, 100), 100.0, AlwaysOnMemo())[0] == []
    actions, _ = always_on_decide(4, hot(2), load(0, 100), 100.0, AlwaysOnMemo())
    assert actions == [Start(2, actions[0].reason)] and not any(isinstance(a, Park) for a in actions)
