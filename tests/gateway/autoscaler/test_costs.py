"""The cost model learns a function's wake and start seconds and whether its park frees the GPU."""
from ember.gateway.autoscaler.costs import PARK_AFTER_FLOOR, CostModel, ParkMeasured, StartMeasured


def test_measured_starts_move_the_estimates_from_the_prior():
    model = CostModel(wake_s=0.3, start_s=1.5)
    for _ in range(10):
        model = model.observe(StartMeasured("parked", 13.0)).observe(StartMeasured("node-warm", 13.0))
    assert 12.5 < model.wake_s <= 13.0 and 12.5 < model.start_s <= 13.0
    assert (model.wakes, model.starts) == (10, 10)


def test_the_first_measurement_weighs_as_much_as_the_prior():
    assert CostModel(wake_s=1.0).observe(StartMeasured("parked", 3.0)).wake_s == 2.0


def test_parking_stops_paying_when_a_wake_costs_about_a_start():
    fast = CostModel(wake_s=0.3, start_s=1.5)
    assert fast.park_pays()
    slow = fast
    for _ in range(5):
        slow = slow.observe(StartMeasured("parked", 13.0))
    assert not slow.park_pays() and "costs about as much as a start" in slow.why_not_park()


def test_a_park_that_frees_no_gpu_memory_stops_parking():
    model = CostModel().observe(ParkMeasured(gpu_bytes_freed=0))
    assert not model.park_pays() and "frees no GPU memory" in model.why_not_park()
    assert model.observe(ParkMeasured(gpu_bytes_freed=16 << 30)).park_pays()


def test_park_after_grows_with_the_wake_and_has_a_floor():
    assert CostModel(wake_s=0.01).park_after() == PARK_AFTER_FLOOR
    assert CostModel(wake_s=1.0).park_after() > CostModel(wake_s=0.5).park_after() > PARK_AFTER_FLOOR


def test_a_refused_park_stops_parking_even_where_the_user_set_park_after():
    from ember.gateway.autoscaler.policy import ScalingSettings

    refused = CostModel().observe(ParkMeasured(0, refused=True))
    assert not refused.park_pays() and "cannot park here" in refused.why_not_park()
    assert refused.observe(ParkMeasured(gpu_bytes_freed=16 << 30)).park_refused   # a refusal is not forgotten
    explicit = ScalingSettings(target_concurrency=1, max_concurrency=1, park_after=0.5)
    assert explicit.park_after_for(CostModel().observe(ParkMeasured(0)), rate=1.0) == 0.5   # the user's choice
    assert explicit.park_after_for(refused, rate=1.0) is None


def test_two_failed_parks_in_a_row_stop_parking_and_a_park_that_works_between_them_resets_the_count():
    from ember.gateway.autoscaler.policy import ScalingSettings

    failed = ParkMeasured(0, failed=True)
    once = CostModel().observe(failed)
    assert once.park_pays() and once.park_frees_gpu   # one may be a fluke, and says nothing of what a park frees
    assert not once.observe(ParkMeasured(16 << 30)).observe(failed).parks_fail   # not in a row
    twice = once.observe(failed)
    assert twice.parks_fail and not twice.park_pays() and "last 2 parks failed" in twice.why_not_park()
    explicit = ScalingSettings(target_concurrency=1, max_concurrency=1, park_after=0.5)
    assert explicit.park_after_for(once, rate=1.0) == 0.5 and explicit.park_after_for(twice, rate=1.0) is None
