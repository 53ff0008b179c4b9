"""The local backend: each replica is a worker process on this machine, run by ember.runtime.supervisor."""
import logging
import os
import re
import uuid
from pathlib import Path

import httpx

from ember.gateway.backends import ParkRefused
from ember.gateway.replica import GatewayReplica
from ember.runtime.supervisor import GpuPool, Supervisor, detect_gpus
from ember.runtime.tiers import Tier
from ember.runtime.worker import CONTROL_HEADER
from ember.spec import FunctionSpec

PARKED_RAM_FRACTION = 0.25  # of the machine's RAM, when `ember serve --parked-ram` is not given
SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'8GiB', '512MB', '1.5G', '1000' -> bytes (K/M/G/T are powers of 1024 with or without the i)."""
    match = SIZE.match(text)
    if not match:
        raise ValueError(f"cannot read {text!r} as a size; write it like 8GiB, 512MiB or a number of bytes")
    unit = (match[2] or "B").upper()[0]
    return int(float(match[1]) * 1024 ** "BKMGT".index(unit))


def machine_ram() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def parked_over_budget(parked: list[tuple[str, int, float]], budget: int) -> list[str]:
    """Parked replicas (id, host bytes, parked at) to evict, oldest first, until the rest fit in `budget` bytes."""
    total = sum(size for _, size, _ in parked)
    evict = []
    for replica_id, size, _ in sorted(parked, key=lambda p: p[2]):
        if total <= budget:
            break
        evict.append(replica_id)
        total -= size
    return evict


class LocalBackend:
    tier = Tier.NODE_WARM  # the package is on this machine's disk; each start says what it did beside that
    can_park = True
    secrets_here = True

    def __init__(self, logs: Path, parked_ram: int | None = None, gpus: list[str] | None = None,
                 fork: bool | None = None):
        self.logs = logs
        self.parked_ram = int(machine_ram() * PARKED_RAM_FRACTION) if parked_ram is None else parked_ram
        # fork: start replicas from a fork server per app (default: unless EMBER_FORK_SERVER=0)
        self.workers = Supervisor(detect_gpus() if gpus is None else gpus, logging.getLogger("ember.gateway"), fork)
        self.gpus: GpuPool | None = (
            self.workers.gpus
        )  # the autoscaler evicts a parked holder when a start waits for one

    def new_replica(self, app: str, unit: str) -> GatewayReplica:
        replica_id = f"{unit.lower().replace('.', '-')}-{uuid.uuid4().hex[:8]}"
        return GatewayReplica(replica_id, app, unit, self.logs / f"{app}.{replica_id}.log", tier=self.tier)

    async def start(self, replica: GatewayReplica, package: Path, spec: FunctionSpec) -> None:
        """Start the replica's worker; sets its state (hot, failed with replica.error, or stopping), port and
        timings."""
        if await self.workers.start(replica, package, spec):
            replica.ready()
        elif replica.error:
            replica.fail(replica.error)
        else:
            replica.stop()

    async def wait(self, replica: GatewayReplica) -> int:
        return await self.workers.wait(replica)

    async def park(self, replica: GatewayReplica) -> dict:
        """Ask the worker to release its GPU memory; the reply says how much host RAM it holds parked."""
        return await self._control(replica, "park")

    async def wake(self, replica: GatewayReplica) -> dict:
        return await self._control(replica, "wake")

    @staticmethod
    async def _control(replica: GatewayReplica, action: str) -> dict:
        async with httpx.AsyncClient(timeout=60) as client:
            reply = await client.post(f"http://{replica.address}/__ember__/{action}",
                                      headers={CONTROL_HEADER: replica.control_secret or ""})
        if reply.status_code == 409 and action == "park":
            raise ParkRefused(reply.json()["error"]["message"])
        reply.raise_for_status()
        return reply.json()

    async def stop(self, replica: GatewayReplica, grace: float = 10.0) -> None:
        await self.workers.stop(replica, grace)

    def prepare(self, app: str, package: Path) -> None:
        """Warm the app's fork server for `package` (a deploy replaces the last one), so its first start forks."""
        self.workers.prepare(app, package, self.logs)

    def prepared(self, app: str) -> dict | None:
        server = self.workers.forkservers.get(app)
        if server is None:
            return None
        status = {"forkserver": server.status()}
        standbys = {gpu: unit for gpu, (owner, unit, _) in self.workers.standbys.items() if owner == app}
        if standbys:   # EMBER_GPU_STANDBY=1: GPUs where the next replica of a unit is ready, CUDA initialised
            status["standbys"] = standbys
        return status

    async def close(self) -> None:
        """Stop the fork servers (after the replicas were stopped)."""
        await self.workers.close()

    def own_logs(self) -> set[Path]:
        return {server.log_path for server in self.workers.forkservers.values()}
