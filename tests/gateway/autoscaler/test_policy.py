from dataclasses import replace

import pytest

from ember.gateway.autoscaler.costs import PARK_AFTER_FLOOR, CostModel, StartMeasured
from ember.gateway.autoscaler.policy import (
    IDLE_HOLD,
    TAIL_HORIZON,
    AppTails,
    Evict,
    Park,
    PolicyMemo,
    ReplicaView,
    Sample,
    ScalingSettings,
    Start,
    Tail,
    Wake,
    app_tail,
    decide,
)


def load(concurrency: int, until: float, since: float = 0.0, arrivals: int = 3) -> list[Sample]:
    """One sample a second of `concurrency` requests in flight."""
    return [Sample(float(t), 0, concurrency, arrivals) for t in range(int(since), int(until) + 1)]


def hot(n: int, in_flight: int = 0, idle_since: float | None = 0.0, prefix: str = "h") -> list[ReplicaView]:
    return [ReplicaView(f"{prefix}{i}", "hot", in_flight, None if in_flight else idle_since) for i in range(n)]


def run(settings: ScalingSettings, replicas, history, now, memo=PolicyMemo()):
    actions, memo = decide(settings, replicas, history, now, memo)
    assert all(a.reason for a in actions), "every action explains itself for `ember status`"
    return actions, memo


PARKING = ScalingSettings(
    target_concurrency=10, max_concurrency=16, park_after=5.0, scaledown_window=60.0, stable_window=20.0
)


def test_starts_from_zero_on_the_first_queued_request():
    history = load(0, 9) + [Sample(10.0, 3, 0, 3)]
    actions, _ = run(PARKING, [], history, 10.0)
    assert actions == [Start(1, actions[0].reason)]


def test_steady_load_at_target_takes_no_action_for_ten_minutes():
    replicas = hot(3, in_flight=8)
    memo = PolicyMemo()
    for now in range(60, 660):
        actions, memo = run(PARKING, replicas, load(24, now, since=now - 120), float(now), memo)
        assert actions == [], f"flapped at t={now}: {actions}"


def test_scales_up_to_cover_concurrency_and_counts_starting_replicas():
    replicas = hot(2, in_flight=16) + [ReplicaView("s0", "starting", 0, None)]
    actions, _ = run(PARKING, replicas, load(45, 30), 30.0)
    assert actions == [Start(2, actions[0].reason)]  # 45 / 10 -> 5 replicas, 3 live


def test_never_more_than_max_replicas():
    s = ScalingSettings(target_concurrency=10, max_concurrency=16, max_replicas=5)
    actions, _ = run(s, hot(2, in_flight=16), load(400, 30), 30.0)
    assert actions == [Start(3, actions[0].reason)]


def test_never_parks_below_min_replicas():
    s = ScalingSettings(min_replicas=2, target_concurrency=10, max_concurrency=16, park_after=5.0)
    actions, _ = run(s, hot(3), load(0, 300), 300.0)
    assert [type(a) for a in actions] == [Park]
    actions, _ = run(s, [], load(0, 300), 300.0)
    assert actions == [Start(2, actions[0].reason)]


def test_wakes_parked_replicas_before_starting_new_ones():
    parked = [ReplicaView(f"p{i}", "parked", 0, 50.0 + i) for i in range(2)]
    actions, _ = run(PARKING, hot(1, in_flight=16) + parked, load(45, 100), 100.0)
    assert [type(a) for a in actions] == [Wake, Wake, Start]
    assert {a.replica_id for a in actions[:2]} == {"p0", "p1"}
    assert actions[2].count == 2


def test_takes_a_draining_replica_back_before_waking_a_parked_one():
    draining = ReplicaView("d0", "hot", 3, None, draining=True)
    parked = ReplicaView("p0", "parked", 0, 10.0)
    actions, _ = run(PARKING, hot(1, in_flight=16) + [draining, parked], load(15, 100), 100.0)
    assert actions == [Wake("d0", actions[0].reason)]


def test_parks_spare_capacity_only_after_the_park_window():
    replicas = hot(1, in_flight=4) + hot(2, idle_since=40.0, prefix="idle")
    history = load(25, 40) + load(4, 60, since=41)
    assert run(PARKING, replicas, history[:-16], 44.0)[0] == []  # 25 concurrent 4 s ago still needs 3
    actions, _ = run(PARKING, replicas, history, 60.0)
    assert sorted(a.replica_id for a in actions) == ["idle0", "idle1"]
    assert all(isinstance(a, Park) for a in actions)


def test_parks_least_loaded_replica_first_and_lets_it_drain():
    replicas = [ReplicaView("busy", "hot", 6, None), ReplicaView("light", "hot", 1, None)]
    actions, _ = run(PARKING, replicas, load(7, 60), 60.0)
    assert actions == [Park("light", actions[0].reason)]


def test_no_scale_down_of_any_kind_in_panic():
    s = PARKING
    burst = load(1, 30) + load(60, 36, since=31)
    actions, memo = run(s, hot(1, in_flight=16), burst, 36.0)
    assert memo.panic_since == 36.0 and sum(a.count for a in actions if isinstance(a, Start)) >= 5
    # the burst stops dead; within the stable window nothing parks or is evicted
    six_idle = hot(6, idle_since=37.0)
    quiet = burst + load(0, 55, since=37)
    for now in (40.0, 50.0, 55.0):
        actions, memo = run(s, six_idle, [x for x in quiet if x.t <= now], now, memo)
        assert not [a for a in actions if isinstance(a, (Park, Evict))], f"scaled down in panic at {now}"
    actions, memo = run(s, six_idle, quiet + load(0, 57, since=56), 57.0, memo)
    assert memo.panic_since is None
    assert sorted(type(a).__name__ for a in actions) == ["Park"] * 6


def test_scale_to_zero_only_after_the_scaledown_window():
    s = ScalingSettings(target_concurrency=10, max_concurrency=16, scaledown_window=60.0, park=False)
    history = load(5, 100) + load(0, 159, since=101)
    one = hot(1, idle_since=100.5)
    assert run(s, one, history, 159.0)[0] == []
    actions, _ = run(s, one, history + load(0, 161, since=160), 161.0)
    assert actions == [Evict("h0", actions[0].reason)]


def test_parked_replicas_are_evicted_after_the_scaledown_window():
    parked = [ReplicaView("p0", "parked", 0, 100.0), ReplicaView("p1", "parked", 0, 130.0)]
    actions, _ = run(PARKING, parked, load(0, 165), 165.0)
    assert actions == [Evict("p0", actions[0].reason)]


def test_buffer_replicas_stay_hot_beyond_demand():
    s = ScalingSettings(target_concurrency=10, max_concurrency=16, buffer_replicas=1, park_after=5.0)
    assert run(s, hot(2, in_flight=5), load(10, 100), 100.0)[0] == []
    actions, _ = run(s, hot(1, in_flight=10), load(10, 100), 100.0)
    assert actions == [Start(1, actions[0].reason)]


@pytest.mark.parametrize(
    "kwargs, word",
    [
        (dict(min_replicas=3, max_replicas=2), "max_replicas"),
        (dict(target_concurrency=4, max_concurrency=2), "target_concurrency"),
    ],
)
def test_bad_settings_say_what_to_fix(kwargs, word):
    with pytest.raises(ValueError, match=word):
        ScalingSettings(**kwargs)


def test_parked_replicas_beyond_max_parked_are_evicted_oldest_first():
    s = ScalingSettings(target_concurrency=10, max_concurrency=16, park_after=5.0, scaledown_window=600.0, max_parked=1)
    parked = [ReplicaView(f"p{i}", "parked", 0, 100.0 + i) for i in range(3)]
    actions, _ = run(s, parked, load(0, 200), 200.0)
    assert [(type(a), a.replica_id) for a in actions] == [(Evict, "p0"), (Evict, "p1")]


def test_at_zero_past_demand_starts_nothing():
    # a caller queued and got its 503 (say the replica crashed in enter): no one is waiting now
    history = load(0, 20) + [Sample(21.0, 1, 0, 1), Sample(22.0, 0, 0, 0)]
    assert run(PARKING, [], history, 22.0)[0] == []


def test_demand_just_over_target_adds_a_replica_as_kpa_does():
    # no tolerance: 3 replicas at 32 concurrent would leave Poisson peaks over their 48 slots to queue
    three = hot(3, in_flight=10)
    assert run(PARKING, three, load(30, 100), 100.0)[0] == []
    actions, _ = run(PARKING, three, load(32, 100), 100.0)
    assert actions == [Start(1, actions[0].reason)]


def test_a_burst_in_the_latest_sample_is_not_diluted_by_the_average():
    history = load(5, 29) + [Sample(30.0, 44, 16, 50)]  # the 6 s average is 13: alone it asks for 2
    full = hot(1, in_flight=16)
    actions, memo = run(PARKING, full, history, 30.0)
    assert actions == [Start(5, actions[0].reason)] and memo.panic_since == 30.0
    # two replicas already starting have 32 free slots for the 44 queued: only 12 ask for more
    starting = [ReplicaView(f"s{i}", "starting", 0, None) for i in range(2)]
    assert run(PARKING, full + starting, history, 30.0)[0] == []


DEFAULTS = ScalingSettings(target_concurrency=10, max_concurrency=16)  # every scaling knob at its default
FAST = PolicyMemo(costs=CostModel(wake_s=0.3, start_s=1.5))
SLOW_WAKE = PolicyMemo(costs=CostModel(wake_s=13.0, start_s=13.0))
HOLDS_GPU = PolicyMemo(costs=CostModel(wake_s=0.3, start_s=1.5, park_frees_gpu=False))


def test_steady_load_is_sized_on_the_stable_average_not_the_panic_peak():
    # 60 s at 12 concurrent, the last 6 s at 21: the panic window alone would ask for 3 of 16 slots each
    history = load(12, 54) + load(21, 60, since=55)
    assert run(DEFAULTS, hot(2, in_flight=8), history, 60.0, FAST)[0] == []


def test_by_default_an_idle_function_parks_only_once_its_idle_stretch_is_unlikely_at_its_rate():
    # 12 arrivals a minute, idle for the last 10 s: at that rate a 10 s gap is common, so it stays hot
    busy = [Sample(float(t), 0, 2 if t < 50 else 0, 1 if t % 5 == 0 and t < 50 else 0) for t in range(61)]
    assert run(DEFAULTS, hot(1, idle_since=50.0), busy, 60.0, FAST)[0] == []
    # after a burst, 120 arrivals in the minute, 10 s idle: the traffic has changed, it parks
    burst = [Sample(float(t), 0, 20 if t < 50 else 0, 4 if t < 30 else 0) for t in range(61)]
    actions, _ = run(DEFAULTS, hot(1, idle_since=50.0), burst, 60.0, FAST)
    assert [type(a) for a in actions] == [Park]


def test_parks_nothing_where_a_wake_is_slow_or_the_park_keeps_the_gpu_and_evicts_what_is_parked():
    idle = load(1, 100) + load(0, 200, since=101)
    for memo in (SLOW_WAKE, HOLDS_GPU):
        assert run(DEFAULTS, hot(1, idle_since=100.0), idle[:151], 150.0, memo)[0] == []  # under the 90 s hold
        actions, _ = run(DEFAULTS, hot(1, idle_since=100.0), idle, 200.0, memo)
        assert [type(a) for a in actions] == [Evict]
        actions, _ = run(DEFAULTS, [ReplicaView("p0", "parked", 0, 190.0)], idle, 200.0, memo)
        assert actions == [Evict("p0", actions[0].reason)] and "no longer pays" in actions[0].reason


def test_learns_from_measured_wakes_and_stops_parking():
    memo = FAST
    for t in range(5):
        slow = Sample(float(t), 0, 1, 1, measured=(StartMeasured("parked", 13.0),))
        _, memo = run(DEFAULTS, hot(1, in_flight=1), [slow], float(t), memo)
    assert not memo.costs.park_pays()
    actions, _ = run(DEFAULTS, [ReplicaView("p0", "parked", 0, 3.0)], [Sample(5.0, 0, 0, 0)], 5.0, memo)
    assert [type(a) for a in actions] == [Evict]


def test_a_burst_in_the_latest_sample_starts_capacity_at_once_however_slow_a_start():
    # 2 concurrent for a minute, then 40 in the latest sample: the 6 s average (8.3) still asks for 1 replica, and
    # with 13 s starts, waiting for it to catch up would add its seconds to every request queued meanwhile
    history = load(2, 59) + [Sample(60.0, 24, 16, 30)]
    for memo in (FAST, SLOW_WAKE):
        actions, after = run(DEFAULTS, hot(1, in_flight=16), history, 60.0, memo)
        assert actions == [Start(3, actions[0].reason)] and after.panic_since == 60.0


def test_after_a_burst_spare_capacity_parks_within_seconds_where_kpa_holds_a_minute():
    burst = load(60, 40) + load(5, 60, since=41)  # 6 replicas' worth, then 5 concurrent for 20 s
    replicas = hot(1, in_flight=5) + hot(5, idle_since=41.0, prefix="idle")
    actions, _ = run(DEFAULTS, replicas, burst, 60.0, replace(FAST, burst_at=40.0))  # the burst panicked at 40 s
    assert sorted(a.replica_id for a in actions) == [f"idle{i}" for i in range(5)]
    assert all(isinstance(a, Park) for a in actions)
    # where a wake costs a start, KPA's stable average still counts the burst: 5 of the 6 stay
    actions, _ = run(DEFAULTS, replicas, burst, 60.0, replace(SLOW_WAKE, burst_at=40.0))
    assert [type(a) for a in actions] == [Evict]


def test_after_a_burst_spare_capacity_parks_no_lower_than_the_panic_window_would_panic_over():
    # 60 concurrent until 50 s, then 4: the 6 s average (22.7, 3 replicas' worth) still counts the burst's tail
    falling = load(60, 50) + load(4, 54, since=51)
    replicas = hot(1, in_flight=4) + hot(5, idle_since=51.0, prefix="idle")
    actions, memo = run(DEFAULTS, replicas, falling, 54.0, replace(FAST, burst_at=50.0))
    # the last 3.3 s fit 1 replica, but 1 would panic at once over the 3 the average asks for (2 x 1 <= 3)
    assert [type(a) for a in actions] == [Park] * 4 and memo.panic_since is None
    two = hot(1, in_flight=4) + hot(1, idle_since=51.0, prefix="idle")
    actions, memo = run(DEFAULTS, two, falling, 54.0, memo)
    assert actions == [] and memo.panic_since is None  # 2 replicas: no panic, and nothing woken back


def test_a_panic_that_ends_scales_down_no_lower_than_the_panic_window_would_panic_over_at_once():
    # 9 concurrent for a minute, 11 over the last 6 s: the 60 s average (9.2) sizes 1 replica, the panic window 2;
    # letting the second go would panic at once (2 >= 2 x 1), take it back and hold it another stable window
    crossing = load(9, 54) + load(11, 60, since=55)
    two = hot(1, in_flight=6) + hot(1, in_flight=5, prefix="b")
    for memo, goes in ((FAST, Park), (SLOW_WAKE, Evict)):  # with parking, and where parking does not pay
        ended = replace(memo, panic_since=0.0, panic_peak=2)  # a near-target panic, a stable window old
        actions, after = run(DEFAULTS, two, crossing, 60.0, ended)
        assert actions == [] and after.panic_since is None
        # once the panic window's average fits one replica, the second goes
        actions, after = run(DEFAULTS, two, load(9, 60), 60.0, ended)
        assert [type(a) for a in actions] == [goes] and after.panic_since is None


def test_a_rate_that_fell_is_seen_half_a_stable_window_sooner():
    # 3 arrivals a second until 25 s, then one request at 50 s that ran until 55 s; the p99 is already lost
    history = [Sample(t / 2, 0, 8 if t < 50 else int(100 <= t < 110), 1 if t < 50 and t % 2 else int(t == 100))
               for t in range(117)]
    lost = PolicyMemo(tail=Tail(58.0, requests=300.0, queued_s=9.0))
    # over 60 s that is 1.3 a second, over which a 3 s idle stretch is common; over the last 30 s, one arrival
    # (0.03 a second, under one per wake's cost): it parks after the floor
    actions, _ = run(DEFAULTS, [ReplicaView("h0", "hot", 0, 55.0)], history, 58.0, lost)
    assert [type(a) for a in actions] == [Park]


def test_a_request_at_zero_wakes_a_parked_replica_before_starting_one():
    parked = [ReplicaView("p0", "parked", 0, 10.0)]
    actions, _ = run(DEFAULTS, parked, load(0, 99) + [Sample(100.0, 1, 0, 1)], 100.0, FAST)
    assert actions == [Wake("p0", actions[0].reason)]


def trickle(now: float) -> list[Sample]:
    """A request every 20 s (0.05 req/s); the last ran from t=50 to 56, so the replica is idle since 56."""
    return [Sample(t / 2, 0, int(50 <= t / 2 < 56), int(t / 2 in (10.0, 30.0, 50.0))) for t in range(int(2 * now) + 1)]


def test_last_replica_parks_after_the_floor_where_the_p99_is_already_a_wait_for_capacity():
    s = ScalingSettings(target_concurrency=10, max_concurrency=16)
    idle = [ReplicaView("h0", "hot", 0, 56.0)]
    # requests spent 9 s queued behind busy replicas: 30 wakes' worth (0.3 s), 10% of 300 requests
    lost = PolicyMemo(tail=Tail(58.0, requests=300.0, queued_s=9.0))
    # idle 2.5 s: past PARK_AFTER_FLOOR, short of a round trip's 3.3 s; at 0.05 req/s holding never pays
    now = 56.0 + PARK_AFTER_FLOOR + 0.5
    actions, memo = run(s, idle, trickle(now), now, lost)
    assert [type(a) for a in actions] == [Park] and memo.tail.lost(0.3)
    assert run(s, idle, trickle(57.0), 57.0, lost)[0] == []  # 1 s idle: under the floor
    # the same trickle where requests queued for only 2 wakes' worth: it holds until an idle stretch is unlikely
    calm = PolicyMemo(tail=Tail(58.0, requests=300.0, queued_s=0.6))
    actions, memo = run(s, idle, trickle(60.0), 60.0, calm)
    assert actions == [] and not memo.tail.lost(0.3)
    # and where a park keeps the GPU, the tail changes nothing: parking does not pay
    keeps = PolicyMemo(costs=CostModel(park_frees_gpu=False), tail=lost.tail)
    actions, _ = run(s, idle, trickle(60.0), 60.0, keeps)
    assert actions == []


def test_tail_counts_requests_that_come_while_a_surge_overflows_the_slots_the_stable_average_sizes():
    # a minute at 4 concurrent sizes one replica (16 slots); 20 concurrent over the 6 s panic window overflows it:
    # a reactive policy that sizes on the stable average adds capacity for those requests, a start (KPA) or a wake
    calm = load(4, 53, arrivals=1)
    _, memo = run(DEFAULTS, hot(1, in_flight=16), calm + load(20, 60, since=54, arrivals=5), 60.0, FAST)
    assert memo.tail.surged == 5
    _, memo = run(DEFAULTS, hot(1, in_flight=15), calm + load(15, 60, since=54, arrivals=5), 60.0, FAST)
    assert memo.tail.surged == 0  # 15 fits one replica's 16 slots
    # a Poisson peak over the slots for a moment waits for a slot to free, not for a start: no surge
    _, memo = run(DEFAULTS, hot(1, in_flight=16), load(4, 59, arrivals=1) + [Sample(60.0, 4, 16, 5)], 60.0, FAST)
    assert memo.tail.surged == 0
    # 2 surged requests in 150: the p99 is already a wait for capacity; 1 in 150 is not
    assert Tail(0.0, requests=150.0, surged=2.0).lost(0.3) and not Tail(0.0, requests=150.0, surged=1.0).lost(0.3)
    pooled = Tail(0.0, requests=100.0, surged=1.0) + Tail(0.0, requests=50.0, surged=1.0)
    assert pooled.surged == 2.0 and pooled.lost(0.3)


def test_a_panic_within_a_stable_window_of_a_burst_holds_as_the_burst_does():
    # 8 concurrent, then 11 for 6 s: near the target, 1 -> 2 replicas; no burst against a stable average of ~8.5
    history = load(8, 33) + load(11, 40, since=34)
    after = load(5, 55, since=41)  # the load falls back under one replica's target
    two = hot(1, in_flight=5) + hot(1, in_flight=0, idle_since=50.0, prefix="spare")
    for burst_at, holds in ((None, True), (30.0, False)):
        actions, memo = run(DEFAULTS, hot(1, in_flight=11), history, 40.0, replace(FAST, burst_at=burst_at))
        assert [type(a) for a in actions] == [Start] and memo.panic_since == 40.0
        assert memo.panic_burst is not holds
        actions, memo = run(DEFAULTS, two, history + after, 55.0, memo)
        # a near-target panic holds the stable window, as KPA's does; one a burst's stable average still counts
        # (the burst panicked at 30 s) holds a few park_afters, then the spare replica parks
        assert actions == [] if holds else [type(a) for a in actions] == [Park]


def test_tail_counts_seconds_queued_behind_hot_replicas_and_fades():
    tail = Tail().add(Sample(0.0, 0, 16, 50), busy=True)
    tail = tail.add(Sample(0.5, 8, 16, 30), busy=True).add(Sample(1.0, 6, 0, 30), busy=False)
    assert tail.requests == pytest.approx(110, rel=1e-2) and tail.queued_s == pytest.approx(4, rel=1e-2)
    assert tail.lost(0.3) and not tail.lost(4.0)  # 4 s queued: 13 wakes of 0.3 s, but not one of 4 s
    assert not Tail(0.0, requests=50.0, queued_s=10.0).lost(0.3)  # too few requests to have a p99
    later = tail.add(Sample(TAIL_HORIZON * 5, 0, 0, 0), busy=True)
    assert later.requests < 1 and later.queued_s < 0.1


def test_tail_counts_requests_that_come_after_an_idle_stretch_no_hold_would_bridge():
    tail = Tail().add(Sample(0.0, 1, 0, 1), busy=False)  # a function's first request ever: every function starts once
    assert tail.stranded == 0 and tail.last_work == 0.0
    tail = tail.add(Sample(IDLE_HOLD - 1, 0, 0, 1), busy=False)  # inside any hold: a hot replica serves it
    assert tail.stranded == 0
    tail = tail.add(Sample(2 * IDLE_HOLD, 1, 0, 1), busy=False)  # idle IDLE_HOLD + 1 s: a start or a wake
    assert tail.stranded == pytest.approx(1, rel=0.2) and tail.last_work == 2 * IDLE_HOLD
    # 2 such requests in 150: the p99 is already a wait for capacity; 1 in 150 is not
    assert Tail(0.0, requests=150.0, stranded=2.0).lost(0.3) and not Tail(0.0, requests=150.0, stranded=1.0).lost(0.3)


def test_tail_counts_requests_that_wait_with_no_replica_to_take_them_once_the_function_has_served():
    # waiting for the first start: every function starts once, so those say nothing of its p99
    tail = Tail().add(Sample(0.0, 0, 0, 0), busy=False, routed=False)
    tail = tail.add(Sample(0.5, 2, 0, 2), busy=False, routed=False).add(Sample(1.0, 3, 0, 1), busy=False, routed=False)
    assert tail.stranded == 0 and not tail.served
    tail = tail.add(Sample(2.0, 0, 3, 0), busy=True)  # the first replica is hot
    assert tail.served
    # parked since, 2 s idle: the 2 requests that came queue for a wake (or a start), over a hot replica's TTFT
    tail = tail.add(Sample(10.0, 2, 0, 2), busy=False, routed=False)
    assert tail.stranded == pytest.approx(2, rel=1e-2)
    # a request that came and was routed at once, or one queued behind a hot replica, did not wait for one
    tail = tail.add(Sample(10.5, 1, 16, 1), busy=True, routed=True)
    assert tail.stranded == pytest.approx(2, rel=1e-2)
    # a draining replica takes nothing new: requests queued while the only hot one drains wait for a wake
    _, memo = run(DEFAULTS, [ReplicaView("h0", "hot", 1, None, draining=True)],
                  load(1, 59) + [Sample(60.0, 1, 1, 1)], 60.0, replace(FAST, tail=tail))
    assert memo.tail.stranded == pytest.approx(tail.faded(60.0).stranded + 1)


def test_a_p99_lost_to_stranded_requests_stays_lost_while_parking_fast_keeps_waking():
    # a trickle every 5 s (0.2 req/s, under one arrival per wake's cost) in an app whose p99 was lost, 3 of 150
    # requests stranded; 2 of them fade out of the tail within ~4 minutes, but every request since woke a replica
    # parked after the floor, and those are over a hot replica's TTFT too: the p99 stays lost, the parks go on
    s = ScalingSettings(target_concurrency=10, max_concurrency=16)
    memo = replace(FAST, tail=Tail(0.0, requests=150.0, stranded=3.0, last_work=0.0, served=True))
    replicas: list[ReplicaView] = [ReplicaView("h0", "hot", 0, 0.0)]
    history: list[Sample] = []
    parks = wakes = 0
    for tick in range(1, 2 * 1200):
        now = tick / 2
        arrivals = int(now % 5 == 0)
        state = replicas[0].state
        history.append(Sample(now, arrivals if state == "parked" else 0, arrivals if state == "hot" else 0,
                              arrivals))
        actions, memo = decide(s, replicas, history[-240:], now, memo)
        for a in actions:
            if isinstance(a, Park):
                replicas, parks = [ReplicaView("h0", "parked", 0, now)], parks + 1
            elif isinstance(a, Wake):
                replicas, wakes = [ReplicaView("h0", "hot", 1, None)], wakes + 1
        if state == "hot" and not arrivals and replicas[0].state == "hot" and replicas[0].in_flight:
            replicas = [ReplicaView("h0", "hot", 0, now)]  # the request (0.5 s of work) is done
        if now >= 1000:
            assert memo.tail.lost(0.3), f"regained the p99 at t={now} while still waking for every request"
    assert parks >= 200 and wakes >= 200  # one of each per request for 20 minutes
    # the same trickle in an app whose p99 is a hot replica's holds the replica: nothing strands, nothing parks
    calm = replace(FAST, tail=Tail(0.0, requests=150.0, last_work=0.0, served=True))
    history = [Sample(t / 2, 0, int(t % 10 == 0), int(t % 10 == 0)) for t in range(240)]
    actions, memo = decide(s, [ReplicaView("h0", "hot", 0, 118.0)], history, 119.5, calm)
    assert actions == [] and not memo.tail.lost(0.3)


def test_an_apps_functions_pool_their_tails_and_a_lost_pool_parks_a_trickle_after_a_round_trip():
    s = ScalingSettings(target_concurrency=10, max_concurrency=16)
    idle = [ReplicaView("h0", "hot", 0, 56.0)]
    mine = PolicyMemo(tail=Tail(59.5, requests=60.0))  # this function's own 60 requests say nothing of a p99
    actions, _ = run(s, idle, trickle(60.0), 60.0, mine)
    assert actions == []
    # its app's other functions: 2,000 requests, 30 of which came after an idle stretch of IDLE_HOLD or more
    others = [PolicyMemo(tail=Tail(50.0, requests=1000.0, stranded=15.0)) for _ in range(2)]
    peers = app_tail(others + [object()], 60.0)  # a memo of another policy counts for nothing
    assert peers.t == 60.0 and peers.requests == pytest.approx(2000 * 0.984, rel=1e-2)
    actions, memo = decide(s, idle, trickle(60.0), 60.0, mine, peers)
    assert [type(a) for a in actions] == [Park] and not memo.tail.lost(0.3)  # the pool's p99 is lost, not its own
    assert app_tail([], 60.0) == Tail()


def test_a_round_of_decisions_gives_each_function_the_others_pool_as_their_memos_change():
    """AppTails keeps the pool of a tick's round and takes one function's tail out for its peers: what pooling the
    others afresh gives (that cost O(functions²) a round), memos changing as each decides."""
    memos = [PolicyMemo(tail=Tail(50.0 + i, requests=100.0 * i, queued_s=0.5 * i, stranded=i, surged=2 * i))
             for i in range(5)] + [object(), PolicyMemo()]
    round_ = AppTails(memos, 60.0)
    fields = ("requests", "queued_s", "stranded", "surged")
    for i, memo in enumerate(list(memos)):
        fresh = app_tail(memos[:i] + memos[i + 1:], 60.0)
        peers = round_.peers(memo)
        assert [getattr(peers, f) for f in fields] == pytest.approx([getattr(fresh, f) for f in fields], abs=1e-9)
        if isinstance(memo, PolicyMemo):   # the function decides: its tail now holds this tick's sample
            memos[i] = PolicyMemo(tail=Tail(60.0, requests=memo.tail.requests + 7, stranded=memo.tail.stranded + 1))
            round_.replace(memo, memos[i])
    pooled = app_tail(memos, 60.0)
    assert [getattr(round_.pool, f) for f in fields] == pytest.approx([getattr(pooled, f) for f in fields])


def test_load_that_fell_after_outlasting_the_stable_window_parks_as_after_a_burst():
    # 90 concurrent for 110 s, long enough that the stable average followed it and no burst is on record, then the
    # load ends: 1 request in flight over the last 10 s. The stable average (75) still counts it: 8 replicas' worth
    fell = load(90, 110) + load(1, 120, since=111)
    replicas = hot(1, in_flight=1) + hot(8, idle_since=112.0, prefix="idle")
    actions, _ = run(DEFAULTS, replicas, fell, 120.0, FAST)
    assert sorted(a.replica_id for a in actions) == [f"idle{i}" for i in range(8)]
    assert all(isinstance(a, Park) for a in actions)
    # where a wake costs a start, KPA's stable average sizes it: 8 of the 9 stay
    actions, _ = run(DEFAULTS, replicas, fell, 120.0, SLOW_WAKE)
    assert [type(a) for a in actions] == [Evict]
    # a request at zero after such load wakes one replica, not the 7 the stable average still asks for
    quiet = load(90, 110) + load(0, 125, since=111) + [Sample(126.0, 1, 0, 1)]
    parked = [ReplicaView(f"p{i}", "parked", 0, 115.0) for i in range(8)]
    woken = [ReplicaView("w0", "starting", 0, None)]
    assert [type(a) for a in run(DEFAULTS, parked + woken, quiet, 126.5, FAST)[0]] == []
    # a dip of steady load from 2 replicas' worth to 1 over the panic window is Poisson noise, not load that fell
    dip = load(15, 54) + load(8, 60, since=55)
    assert run(DEFAULTS, hot(2, in_flight=4), dip, 60.0, FAST)[0] == []


def test_where_the_p99_is_lost_to_surges_or_stranded_requests_replicas_fill_their_slots_less_the_poisson_spread():
    # 81 concurrent for a minute on 9 replicas (the target of 10 each). Where the app's p99 is already a wait for
    # capacity, a slot is filled up to max_concurrency, less the spread that 81 concurrent Poisson requests pass one
    # time in 100 (2.33 x 9): ceil((81 + 21) / 16) = 7 replicas; each request over the slots waits a wake at most
    steady = load(81, 60)
    nine = hot(9, in_flight=9)
    surged = replace(FAST, tail=Tail(0.0, requests=300.0, surged=6.0))
    actions, _ = run(DEFAULTS, nine, steady, 60.0, surged)
    assert [type(a) for a in actions] == [Park, Park]
    stranded = replace(FAST, tail=Tail(0.0, requests=300.0, stranded=6.0))
    assert [type(a) for a in run(DEFAULTS, nine, steady, 60.0, stranded)[0]] == [Park, Park]
    # a p99 lost to queueing behind busy replicas is not: filling slots would queue more and keep it lost
    queued = replace(FAST, tail=Tail(0.0, requests=300.0, queued_s=30.0))
    assert queued.tail.lost(0.3) and not queued.tail.lost(0.3, queueing=False)
    assert run(DEFAULTS, nine, steady, 60.0, queued)[0] == []
    # nor where the p99 is a hot replica's, or where a wake is slow (capacity over the slots would wait a start)
    assert run(DEFAULTS, nine, steady, 60.0, FAST)[0] == []
    assert run(DEFAULTS, nine, steady, 60.0, replace(SLOW_WAKE, tail=surged.tail))[0] == []
