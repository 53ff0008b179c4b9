"""Whether a request may wait in a function's queue while replicas start.

The gateway buffers requests up to a bound and a timeout; past either the caller
gets 503 with a Retry-After long enough for the replicas being started to be up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Admit:
    pass


@dataclass(frozen=True)
class Reject:
    retry_after: int  # whole seconds, as the Retry-After header wants
    reason: str


def admit(
    queue_len: int, bound: int, oldest_wait: float, timeout: float, start_eta: float = 1.5
) -> Admit | Reject:
    """Admit a new request to a queue holding `queue_len`, whose head has waited `oldest_wait` s.

    `start_eta` is how long the replicas now starting still need; a full queue asks the
    caller to come back after it, and a queue whose head is already past `timeout` has
    made no progress, so it asks for a whole timeout.
    """
    if bound < 1 or timeout <= 0:
        raise ValueError(f"queue bound must be >= 1 and timeout > 0, got {bound} and {timeout}")
    if queue_len >= bound:
        return Reject(max(1, math.ceil(start_eta)), f"queue full ({queue_len} waiting, bound {bound})")
    if oldest_wait >= timeout:
        return Reject(
            max(1, math.ceil(timeout)), f"queue stalled: oldest request waited {oldest_wait:.1f}s >= {timeout:g}s"
        )
    return Admit()


def expired(waited: float, timeout: float) -> bool:
    """A queued request that has waited this long gets its 503 instead of a replica."""
    return waited >= timeout
