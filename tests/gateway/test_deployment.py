"""Decorator scaling knobs reach the policy's settings; the ones left out get the policy's defaults."""
from ember.gateway.autoscaler.costs import CostModel
from ember.gateway.autoscaler.policy import IDLE_HOLD, PARKED_HOLD, ScalingSettings
from ember.gateway.deployment import scaling_settings
from ember.spec import build_spec


def test_every_scaling_knob_in_the_decorator_reaches_the_policy():
    spec = build_spec("@app.function", {
        "stable_window": 30, "panic_window": 3, "panic_threshold": 3, "park_after": 4, "scaledown_window": 120,
        "park": True, "min_replicas": 1, "max_replicas": 7, "buffer_replicas": 1,
        "target_concurrency": 4, "max_concurrency": 8,
    })
    assert scaling_settings(spec) == ScalingSettings(
        min_replicas=1, max_replicas=7, buffer_replicas=1, target_concurrency=4, max_concurrency=8, park=True,
        park_after=4, scaledown_window=120, stable_window=30, panic_window=3, panic_threshold=3)


def test_defaults_are_the_policys_and_parking_is_on():
    settings = scaling_settings(build_spec("@app.function", {}))
    assert (settings.stable_window, settings.panic_window, settings.panic_threshold) == (60, 6, 2)
    assert settings.park and settings.park_after is None and settings.scaledown_window is None
    fast = CostModel(wake_s=0.3, start_s=1.5)
    assert settings.holds(fast, rate=0.0).scaledown == PARKED_HOLD
    assert settings.holds(CostModel(park_frees_gpu=False), rate=0.0).scaledown == IDLE_HOLD


def test_park_false_never_parks_even_where_a_wake_is_fast():
    settings = scaling_settings(build_spec("@app.cls", {"park": False}))
    assert settings.holds(CostModel(wake_s=0.1, start_s=10), rate=1.0).park_after is None


def test_a_short_scaledown_window_shortens_the_demand_windows():
    settings = scaling_settings(build_spec("@app.function", {"scaledown_window": 0.5}))
    assert settings.panic_window == 0.5 and settings.stable_window == 5.0
