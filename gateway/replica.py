"""One replica as the gateway sees it: its worker process (see ember.runtime.supervisor), state and load."""
import time
from dataclasses import dataclass, field

from ember.runtime.supervisor import WorkerProcess

STARTING, HOT, PARKED, FAILED, STOPPING = "starting", "hot", "parked", "failed", "stopping"


@dataclass(eq=False)
class Replica(WorkerProcess):
    state: str = STARTING
    host: str = "127.0.0.1"  # the node it runs on (loopback for the local backend)
    in_flight: int = 0
    idle_since: float | None = None
    created: float = field(default_factory=time.monotonic)
    ready_at: float | None = None  # when it last became able to serve (start or wake)
    draining: str | None = None  # "park" or "evict" once its in-flight calls finish; routes nothing new
    parked_at: float | None = None
    parked_bytes: int = 0  # host RAM it holds while parked

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def describe(self, now: float) -> dict:
        return {
            "id": self.id,
            "state": self.state,
            "in_flight": self.in_flight,
            "draining": self.draining,
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
