"""One replica as the gateway sees it: its process, port, state and load."""
import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

STARTING, HOT, PARKED, FAILED, STOPPING = "starting", "hot", "parked", "failed", "stopping"


@dataclass(eq=False)
class Replica:
    id: str
    app: str
    unit: str
    log_path: Path
    state: str = STARTING
    host: str = "127.0.0.1"  # the node it runs on (loopback for the local backend)
    port: int | None = None
    in_flight: int = 0
    idle_since: float | None = None
    created: float = field(default_factory=time.monotonic)
    ready_at: float | None = None  # when it last became able to serve (start or wake)
    tier: str = "node-warm"  # the cold-start tier its last start or wake came from
    timings: dict[str, int] = field(default_factory=dict)  # spawn/import/enter/total ms of its start
    error: str | None = None
    draining: str | None = None  # "park" or "evict" once its in-flight calls finish; routes nothing new
    process: asyncio.subprocess.Process | None = None
    gpus: list[str] = field(default_factory=list)  # CUDA_VISIBLE_DEVICES it was given
    note: str | None = None  # why it waits (for a GPU, a node) or runs degraded (no GPU here)
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
