"""One replica as the gateway sees it: its worker process (see ember.runtime.supervisor), its lifecycle state and
its load. The state changes only through the methods here, each checked against gateway/lifecycle.py."""
import time
from dataclasses import dataclass, field
from enum import StrEnum

from ember.gateway.lifecycle import PARKED, STARTING, ReplicaState, after
from ember.runtime.supervisor import WorkerProcess
from ember.runtime.tiers import Tier


class Drain(StrEnum):
    """What a hot replica becomes once its in-flight calls finish; it routes nothing new meanwhile."""

    PARK = "park"
    EVICT = "evict"


@dataclass(eq=False)
class GatewayReplica(WorkerProcess):
    _state: ReplicaState = field(default=STARTING, repr=False)
    host: str = "127.0.0.1"  # the node it runs on (loopback for the local backend)
    in_flight: int = 0  # calls under way on it
    load: int = 0  # the slots they hold, which max_concurrency bounds: an LLM request takes one per sequence it runs
    idle_since: float | None = None
    created: float = field(default_factory=time.monotonic)
    ready_at: float | None = None  # when it last became able to serve (start or wake)
    draining: Drain | None = None
    parked_at: float | None = None
    parked_bytes: int = 0  # host RAM it holds while parked
    wakes: int = 0  # how many times it woke: a backend that records wakes compares this with what it recorded

    @property
    def state(self) -> ReplicaState:
        return self._state

    def _move(self, move: str) -> None:
        self._state = after(self._state, move, self.id)

    def ready(self) -> None:
        """Its start finished: it serves from now."""
        self._move("ready")
        self.ready_at = self.idle_since = time.monotonic()

    def park(self) -> None:
        """Parked for routing at once: a call that comes while its GPU memory is released wakes it."""
        self._move("park")
        self.draining, self.parked_at = None, time.monotonic()

    def park_refused(self) -> None:
        """Its park did not happen (the replica answered so): it serves on, hot, as it was before."""
        self._move("wake")
        self.parked_at = None

    def wake(self) -> None:
        self._move("wake")
        self.tier, self.ready_at = Tier.PARKED, time.monotonic()
        self.wakes += 1

    def fail(self, error: str) -> None:
        self._move("fail")
        self.error = error

    def stop(self) -> None:
        self._move("stop")
        self.draining = None

    def drain(self, to: Drain) -> None:
        self.draining = to

    def undrain(self) -> None:
        """The drain is called off: it routes calls again."""
        self.draining = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def describe(self, now: float) -> dict:
        return {
            "id": self.id,
            "state": self.state.value,
            "in_flight": self.in_flight,
            "load": self.load,
            "draining": self.draining.value if self.draining else None,
            "address": self.address if self.port else None,
            "gpus": self.gpus,
            "note": self.note,
            "parked_bytes": self.parked_bytes if self.state == PARKED else None,
            "age_s": round(now - self.created, 1),
            "idle_s": None if self.idle_since is None else round(now - self.idle_since, 1),
            "start": {"tier": self.tier, **self.timings},
            "error": self.error,
            "log": str(self.log_path),
        }
