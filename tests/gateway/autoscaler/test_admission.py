import pytest

from ember.gateway.autoscaler.admission import Admit, Reject, admit, expired


def test_admits_while_the_queue_has_room_and_moves():
    assert admit(queue_len=3, bound=4, oldest_wait=2.0, timeout=30.0) == Admit()


def test_full_queue_asks_to_retry_after_the_start_in_progress():
    verdict = admit(queue_len=4, bound=4, oldest_wait=0.5, timeout=30.0, start_eta=2.2)
    assert isinstance(verdict, Reject) and verdict.retry_after == 3 and "full" in verdict.reason


def test_retry_after_is_at_least_one_second():
    assert admit(queue_len=9, bound=4, oldest_wait=0.0, timeout=30.0, start_eta=0.3).retry_after == 1


def test_stalled_queue_rejects_for_a_whole_timeout():
    verdict = admit(queue_len=1, bound=100, oldest_wait=31.0, timeout=30.0)
    assert verdict == Reject(30, verdict.reason) and "stalled" in verdict.reason


def test_expired_at_the_timeout():
    assert not expired(29.9, 30.0) and expired(30.0, 30.0)


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="bound"):
        admit(queue_len=0, bound=0, oldest_wait=0.0, timeout=30.0)
