"""Invariants of `decide` over arbitrary settings, replicas, histories and memos."""
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.gateway.autoscaler.policy import (
    Evict,
    Park,
    PolicyMemo,
    ReplicaView,
    Sample,
    ScalingSettings,
    Start,
    Wake,
    decide,
)

NOW = 200.0


@st.composite
def scaling(draw):
    lo = draw(st.integers(0, 3))
    hi = draw(st.integers(max(lo, 1), 8))
    max_concurrency = draw(st.integers(1, 16))
    panic = draw(st.sampled_from([2.0, 6.0]))
    return ScalingSettings(
        min_replicas=lo, max_replicas=hi, buffer_replicas=draw(st.integers(0, 2)),
        target_concurrency=draw(st.floats(0.5, max_concurrency)), max_concurrency=max_concurrency,
        scaledown_window=draw(st.none() | st.floats(5.0, 120.0)), park_after=draw(st.none() | st.floats(1.0, 20.0)),
        park=draw(st.booleans()),
        stable_window=draw(st.floats(panic, 60.0)), panic_window=panic,
        max_parked=draw(st.none() | st.integers(0, 3)),
    )


@st.composite
def replica(draw, i: int):
    state = draw(st.sampled_from(["starting", "hot", "parked"]))
    busy = state == "hot" and draw(st.booleans())
    return ReplicaView(f"r{i}", state, draw(st.integers(1, 16)) if busy else 0,
                       None if busy or state == "starting" else draw(st.floats(0.0, NOW)),
                       draining=state == "hot" and draw(st.booleans()))


@st.composite
def situation(draw):
    s = draw(scaling())
    n = draw(st.integers(0, 10))
    replicas = [draw(replica(i)) for i in range(n)]
    loads = draw(
        st.lists(st.tuples(st.integers(0, 60), st.integers(0, 60), st.integers(0, 30)), min_size=0, max_size=240)
    )
    history = [Sample(NOW - 0.5 * (len(loads) - 1 - k), q, f, a) for k, (q, f, a) in enumerate(loads)]
    memo = draw(st.just(PolicyMemo()) | st.builds(PolicyMemo, st.floats(NOW - 100, NOW), st.integers(0, 12)))
    return s, replicas, history, memo


@settings(max_examples=300, deadline=None)
@given(situation())
def test_decide_keeps_its_invariants(case):
    s, replicas, history, memo = case
    actions, after = decide(s, replicas, history, NOW, memo)
    by_id = {r.id: r for r in replicas}
    named = [a.replica_id for a in actions if not isinstance(a, Start)]
    assert len(named) == len(set(named)), "one action per replica"
    assert all(a.reason for a in actions)

    live = sum(r.state in ("hot", "starting") and not r.draining for r in replicas)
    added = sum(a.count for a in actions if isinstance(a, Start)) + sum(isinstance(a, Wake) for a in actions)
    removed = sum(isinstance(a, (Park, Evict)) and by_id[a.replica_id].state == "hot" for a in actions)
    assert not (added and removed), "never up and down at once"
    if added:
        assert live + added <= s.max_replicas
        assert all(a.count >= 1 for a in actions if isinstance(a, Start))
    if any(isinstance(a, Start) for a in actions):
        woken = {a.replica_id for a in actions if isinstance(a, Wake)}
        assert all(r.id in woken for r in replicas if r.state == "parked" or r.draining), "cheaper tiers first"
    if removed:
        assert live - removed >= s.min_replicas
        assert after.panic_since is None, "no scale-down in panic"
    rate = sum(x.arrivals for x in history if x.t > NOW - s.stable_window) / s.stable_window
    holds = s.holds(after.costs, rate)
    park_after = holds.park_after
    if memo.panic_since is not None and NOW - memo.panic_since < holds.panic_hold:
        assert not any(isinstance(a, (Park, Evict)) for a in actions), "no scale-down while a panic holds"
    for a in actions:
        r = by_id.get(getattr(a, "replica_id", None))
        if isinstance(a, Wake):
            assert r.state == "parked" or r.draining
        elif isinstance(a, Park):
            assert r.state == "hot" and not r.draining and park_after is not None
        elif isinstance(a, Evict):
            assert (r.state == "hot" and not r.draining) or r.state == "parked"
