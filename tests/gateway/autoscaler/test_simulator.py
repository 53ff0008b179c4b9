from functools import partial

import pytest

from ember.gateway.autoscaler.baselines import KPA_SETTINGS, KpaMemo, RayMemo, kpa_decide, ray_decide
from ember.gateway.autoscaler.costs import StartMeasured
from ember.gateway.autoscaler.policy import PolicyMemo, ScalingSettings, decide
from ember.gateway.autoscaler.simulator import Policy, Queue, ReplicaModel, simulate
from ember.gateway.autoscaler.trace import Request, generate

FUNCTION = dict(min_replicas=1, max_replicas=3, target_concurrency=10.0, max_concurrency=16)
EMBER = ScalingSettings(**FUNCTION, park_after=5.0, scaledown_window=60.0, stable_window=20.0)
KPA = ScalingSettings(**FUNCTION, **KPA_SETTINGS)


def policies(settings=EMBER):
    return [
        Policy("ember", partial(decide, settings), PolicyMemo(), settings.min_replicas, settings.max_replicas),
        Policy("kpa-like", partial(kpa_decide, KPA), KpaMemo(), KPA.min_replicas, KPA.max_replicas),
        Policy("ray-default", partial(ray_decide, KPA), RayMemo(), KPA.min_replicas, KPA.max_replicas),
    ]


@pytest.mark.parametrize("policy", policies(), ids=lambda p: p.name)
def test_short_bursty_trace_serves_every_request_once_within_bounds(policy):
    trace = generate("on_off", 400.0, seed=3)
    report = simulate(trace, policy, until=400.0)
    assert report.served + report.rejected == report.requests == len(trace)
    assert report.bound_violations == 0
    assert 1 <= report.peak_replicas <= 3
    assert report.gpu_seconds >= 400.0 * 1  # min_replicas=1 holds a GPU the whole time


def test_same_seed_same_report():
    trace = generate("spike", 300.0, seed=1)
    assert simulate(trace, policies()[0], until=300.0) == simulate(trace, policies()[0], until=300.0)


def test_a_full_queue_turns_requests_away():
    # 200 requests at once against one slot: the queue bound of 20 sends the rest a 503
    trace = [Request(1.0 + i * 1e-3, 100, 50) for i in range(200)]
    one = ScalingSettings(max_replicas=1, target_concurrency=1, max_concurrency=1)
    report = simulate(trace, Policy("one", partial(decide, one), PolicyMemo(), 0, 1),
                      ReplicaModel(max_concurrency=1), Queue(bound=20, timeout=30.0))
    assert report.rejected >= 170 and report.served + report.rejected == 200


def test_parking_is_counted_as_host_ram_not_gpu():
    trace = [Request(1.0, 200, 60), Request(100.0, 200, 60)]
    s = ScalingSettings(
        target_concurrency=1, max_concurrency=1, park_after=2.0, scaledown_window=300.0, stable_window=10.0
    )
    report = simulate(trace, Policy("ember", partial(decide, s), PolicyMemo(), 0, 10), ReplicaModel(max_concurrency=1))
    assert report.cold_starts["parked"] == 1  # the second request woke the first replica
    assert report.gpu_seconds < 30.0 and report.parked_host_gb_seconds > 16.0 * 80


def test_steady_regular_load_does_not_flap():
    trace = [Request(i * 0.25, 400, 120) for i in range(2400)]  # 4 req/s of 2 s work: 8 concurrent
    s = ScalingSettings(target_concurrency=4, max_concurrency=8, park_after=5.0, stable_window=20.0)
    report = simulate(trace, Policy("ember", partial(decide, s), PolicyMemo(), 0, 10), ReplicaModel(max_concurrency=8))
    # the ramp-up overshoots and parks the surplus once; nothing is ever started or woken again
    fresh = report.cold_starts["node-warm"] + report.cold_starts["node-cold"]
    assert fresh == report.peak_replicas and report.cold_starts["parked"] == 0, report
    assert report.actions.get("Park", 0) < report.peak_replicas


def test_a_park_that_frees_nothing_is_billed_as_the_gpu_it_keeps():
    trace = [Request(1.0, 200, 60), Request(100.0, 200, 60)]
    s = ScalingSettings(
        target_concurrency=1, max_concurrency=1, park_after=2.0, scaledown_window=300.0, stable_window=10.0
    )
    policy = Policy("ember", partial(decide, s), PolicyMemo(), 0, 10)
    frees = simulate(trace, policy, ReplicaModel(max_concurrency=1))
    keeps = simulate(trace, policy, ReplicaModel(max_concurrency=1, park_frees_gpu=False))
    assert keeps.parked_host_gb_seconds == 0 and keeps.gpu_seconds > frees.gpu_seconds + 80


def test_functions_of_one_trace_get_their_own_replicas_on_a_shared_cluster():
    # two functions, each with one request at a time: each needs its own replica, and the second one's
    # first start lands on a node-warm GPU of the shared node
    trace = sorted([Request(float(t), 100, 30, "a") for t in range(0, 60, 10)]
                   + [Request(t + 5.0, 100, 30, "b") for t in range(0, 60, 10)], key=lambda r: r.t)
    one = ScalingSettings(max_replicas=1, target_concurrency=1, max_concurrency=1, park=False)
    report = simulate(trace, Policy("ember", partial(decide, one), PolicyMemo(), 0, 1), ReplicaModel(max_concurrency=1),
                      until=60.0)
    assert report.functions == 2 and report.served == 12
    assert report.cold_starts["node-warm"] == 2 and report.peak_replicas == 2


def test_starts_report_their_measured_tier_to_the_policy():
    seen = []

    def spy(replicas, history, now, memo):
        seen.extend(m for m in history[-1].measured)
        return decide(ScalingSettings(max_replicas=1, target_concurrency=1, max_concurrency=1), replicas, history,
                      now, memo)

    simulate(
        [Request(1.0, 100, 30)], Policy("spy", spy, PolicyMemo(), 0, 1), ReplicaModel(max_concurrency=1, node_warm=2.0)
    )
    assert seen == [StartMeasured("node-warm", 2.0)]


def test_a_full_cluster_makes_a_start_wait_for_a_gpu_then_take_an_idle_replicas():
    # one node of one GPU, two functions: b's request comes while a's replica is starting, so b's start waits;
    # once a's request is done its idle replica is stopped for b's start
    trace = [Request(1.0, 100, 30, "a"), Request(2.0, 100, 30, "b")]
    one = ScalingSettings(max_replicas=1, target_concurrency=1, max_concurrency=1, park=False, scaledown_window=5.0,
                          stable_window=5.0, panic_window=2.0)
    cluster = ReplicaModel(max_concurrency=1, nodes=1, gpus_per_node=1)
    report = simulate(trace, Policy("ember", partial(decide, one), PolicyMemo(), 0, 1), cluster, until=30.0)
    assert report.served == 2 and report.gpu_waits == 1 and report.actions["StopIdleForRoom"] == 1
    unbounded = simulate(trace, Policy("ember", partial(decide, one), PolicyMemo(), 0, 1),
                         ReplicaModel(max_concurrency=1, gpus_per_node=1), until=30.0)
    assert unbounded.gpu_waits == 0 and "StopIdleForRoom" not in unbounded.actions
    a_done = 1.0 + cluster.node_warm + cluster.service(trace[0])
    assert report.ttft_p99 >= a_done - 2.0 + cluster.node_warm  # b's start began only once a's replica was idle
    assert max(held for _, held, _ in report.timeline) == 1


def test_a_start_on_a_full_cluster_evicts_a_parked_replica_that_keeps_its_gpu():
    trace = [Request(1.0, 100, 30, "a"), Request(20.0, 100, 30, "b")]
    s = ScalingSettings(max_replicas=1, target_concurrency=1, max_concurrency=1, park_after=2.0,
                        scaledown_window=300.0, stable_window=10.0)
    keeps = ReplicaModel(max_concurrency=1, park_frees_gpu=False, nodes=1, gpus_per_node=1)
    report = simulate(trace, Policy("ember", partial(decide, s), PolicyMemo(), 0, 1), keeps, until=30.0)
    assert report.served == 2 and report.gpu_waits == 0 and report.actions["EvictForRoom"] == 1


def test_more_always_on_replicas_than_the_cluster_holds_is_a_clear_error():
    with pytest.raises(ValueError, match="do not fit 1 nodes of 2 GPUs"):
        simulate([Request(1.0, 100, 30)], Policy("always", lambda r, h, n, m: ([], m), None, 3, 3, initial_hot=3),
                 ReplicaModel(nodes=1, gpus_per_node=2))
