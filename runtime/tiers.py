"""The cold-start ladder's tiers, and which one a replica start came from (a pure function of what the start did)."""
import enum
from collections.abc import Mapping


class Tier(enum.StrEnum):
    """Where a replica came back from, fastest first (the names docs/design.md's ladder uses, on the wire and in
    metrics)."""

    HOT = "hot"  # T0: a running replica; nothing to do
    PARKED = "parked"  # T1: the process was kept, its GPU memory released; a wake maps it back
    NODE_WARM = "node-warm"  # T2: package and snapshot on this node (forked from its fork server when warm)
    NODE_COLD = "node-cold"  # T3: the package (and snapshot) pulled from the object store
    FULL_BOOT = "full-boot"  # T4: no snapshot to restore: the engine booted from the model files (and wrote one)

    @property
    def rung(self) -> str:
        return f"T{list(Tier).index(self)}"


def start_tier(weights: str | None = None, pulled: bool = False) -> Tier:
    """The tier of a finished replica start, from where its state came from (how it started, forked from the fork
    server or spawned, is in its breakdown).

    `weights`: how its enter hooks got model weights ("snapshot", "full", or None when they loaded none);
    `pulled`: its package came from the object store rather than this node's disk.
    """
    if weights == "full":
        return Tier.FULL_BOOT
    if pulled:
        return Tier.NODE_COLD
    return Tier.NODE_WARM


def breakdown_header(timings: Mapping[str, object]) -> str:
    """X-Ember-Start-Breakdown: `key=value, ...`, each value kept to one header-safe token-ish string."""
    def clean(value: object) -> str:
        text = str(value).replace(",", ";").replace("\r", " ").replace("\n", " ")
        return text if len(text) <= 200 else text[:197] + "..."

    return ", ".join(f"{key}={clean(value)}" for key, value in timings.items())
