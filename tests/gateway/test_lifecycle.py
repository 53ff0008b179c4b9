"""gateway/lifecycle.py and the moves of gateway/replica.py: every legal move lands where the table says, every
other one is refused with a message naming the replica, the move and the state it was in, and leaves it there."""
from pathlib import Path

import pytest

from ember.gateway.lifecycle import (
    FAILED,
    HOT,
    LIVE,
    MOVES,
    PARKED,
    STARTING,
    STOPPING,
    IllegalTransition,
    ReplicaState,
    after,
)
from ember.gateway.replica import GatewayReplica


def replica_in(state: ReplicaState) -> GatewayReplica:
    """A replica brought to `state` by legal moves only."""
    replica = GatewayReplica("r1", "app", "fn", Path("/dev/null"))
    path = {STARTING: [], HOT: ["ready"], PARKED: ["ready", "park"], FAILED: ["fail"], STOPPING: ["stop"]}[state]
    for move in path:
        if move == "fail":
            replica.fail("enter failed")
        else:
            getattr(replica, move)()
    assert replica.state == state
    return replica


def make(replica: GatewayReplica, move: str) -> None:
    if move == "fail":
        replica.fail("it crashed")
    else:
        getattr(replica, move)()


@pytest.mark.parametrize("state", list(ReplicaState))
@pytest.mark.parametrize("move", list(MOVES))
def test_each_move_is_taken_from_its_states_and_refused_from_the_others(state, move):
    sources, target = MOVES[move]
    replica = replica_in(state)
    if state in sources:
        make(replica, move)
        assert replica.state == target == after(state, move)
    else:
        with pytest.raises(IllegalTransition) as refused:
            make(replica, move)
        assert f"replica r1: cannot {move} a {state.value} replica" in str(refused.value)
        assert replica.state == state  # a refused move changes nothing


def test_the_table_refuses_what_the_gateway_must_never_do():
    refused = [(STARTING, "park"), (STARTING, "wake"), (HOT, "ready"), (HOT, "wake"), (PARKED, "park"),
               (FAILED, "ready"), (FAILED, "wake"), (STOPPING, "ready"), (STOPPING, "wake"), (STOPPING, "fail")]
    for state, move in refused:
        with pytest.raises(IllegalTransition):
            after(state, move)


def test_moves_keep_the_facts_that_go_with_the_state():
    replica = replica_in(HOT)
    assert replica.ready_at is not None and replica.idle_since == replica.ready_at
    replica.park()
    assert replica.parked_at is not None and replica.draining is None
    replica.wake()
    assert replica.tier == "parked" and replica.state == HOT
    replica.fail("worker exited with code 1 while serving")
    assert replica.error == "worker exited with code 1 while serving" and replica.state not in LIVE
    assert replica.describe(0.0)["state"] == "failed"


def test_state_cannot_be_assigned_around_the_owner():
    replica = replica_in(STARTING)
    with pytest.raises(AttributeError):
        replica.state = HOT
