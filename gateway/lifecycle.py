"""The replica lifecycle: its states and the one table of moves between them. `GatewayReplica`
(gateway/replica.py) changes state only through `after`, so a move from the wrong state is refused where it is
attempted; the autoscaler's policy and simulator read the same states. A new state (forked, parked on disk,
imaged) is one member here and its rows in MOVES.

    starting --ready--> hot --park--> parked --wake--> hot
    starting | hot | parked --fail--> failed
    starting | hot | parked | failed | stopping --stop--> stopping
"""
from enum import StrEnum


class ReplicaState(StrEnum):
    STARTING = "starting"  # its worker runs the enter hooks; calls wait for it
    HOT = "hot"  # serving
    PARKED = "parked"  # alive, its GPU memory released; a call wakes it
    FAILED = "failed"  # its start or its process failed; the gateway forgets it
    STOPPING = "stopping"  # told to stop; routes nothing


STARTING, HOT, PARKED, FAILED, STOPPING = ReplicaState

# What each move leaves from and goes to. Stopping twice is one stop: a shutdown may meet a replica already going.
MOVES: dict[str, tuple[frozenset[ReplicaState], ReplicaState]] = {
    "ready": (frozenset({STARTING}), HOT),
    "park": (frozenset({HOT}), PARKED),
    "wake": (frozenset({PARKED}), HOT),
    "fail": (frozenset({STARTING, HOT, PARKED}), FAILED),
    "stop": (frozenset(ReplicaState), STOPPING),
}
LIVE = frozenset({STARTING, HOT, PARKED})  # the states that can serve, now or after a start or wake


class IllegalTransition(RuntimeError):
    pass


def after(state: ReplicaState, move: str, replica_id: str = "") -> ReplicaState:
    """The state `move` leads to from `state`; refused (IllegalTransition) when `move` does not leave `state`."""
    sources, target = MOVES[move]
    if state not in sources:
        allowed = ", ".join(sorted(s.value for s in sources))
        raise IllegalTransition(f"replica {replica_id or '?'}: cannot {move} a {state.value} replica "
                                f"(only a {allowed} one)")
    return target
