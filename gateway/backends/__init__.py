"""Where replicas run: worker processes on this machine, or on the nodes of an AWS Auto Scaling Group. `Backend` is
the contract the autoscaler holds both to."""
from pathlib import Path
from typing import Protocol

from ember.gateway.replica import GatewayReplica
from ember.runtime.supervisor import GpuPool
from ember.runtime.tiers import Tier
from ember.spec import FunctionSpec


class ParkRefused(Exception):
    """A replica answered that it cannot park (its driver cannot checkpoint it) and serves on as before."""


class Backend(Protocol):
    tier: Tier  # the cold-start tier a fresh replica comes from
    can_park: bool  # whether `park` and `wake` may be called
    parked_ram: int  # bytes of host RAM parked replicas may hold together
    gpus: GpuPool | None  # this machine's GPUs, when the backend hands them out here
    secrets_here: bool  # replicas read secrets from this gateway's EMBER_HOME, so a deploy can check them

    def new_replica(self, app: str, unit: str) -> GatewayReplica:
        """A replica in state starting, not yet started."""
        ...

    async def start(self, replica: GatewayReplica, package: Path, spec: FunctionSpec) -> None:
        """Start it; on return it is hot, failed (with replica.error) or stopping, and has its address and timings."""
        ...

    async def wait(self, replica: GatewayReplica) -> int:
        """Until it exits: its exit code (0: asked to stop)."""
        ...

    async def park(self, replica: GatewayReplica) -> dict:
        """Release its GPU memory; the reply has `ms` and `host_bytes`, the RAM it holds parked. ParkRefused where
        the replica cannot park and still serves."""
        ...

    async def wake(self, replica: GatewayReplica) -> dict:
        """Take its GPU memory back; the reply has `ms`."""
        ...

    async def stop(self, replica: GatewayReplica, grace: float = 10.0) -> None:
        ...

    async def close(self) -> None:
        """After the replicas were stopped: release what the backend itself holds (fork servers, clients)."""
        ...

    def own_logs(self) -> set[Path]:
        """The log files its own processes here write besides its replicas' (fork servers): never pruned."""
        ...

    def prepare(self, app: str, package: Path) -> None:
        """Warm what the app's replicas start from on this machine (its fork servers), ahead of the first one."""
        ...

    def prepared(self, app: str) -> dict | None:
        """How far the app's deploy-time preparation on this machine is (its fork server and unit templates), for
        `ember status`; None where nothing is prepared here."""
        ...


def backend_for(kind: str, logs: Path, parked_ram: str | None = None) -> Backend:
    """The backend `ember serve --backend KIND` runs replicas on: "local" processes or an "aws" Auto Scaling Group."""
    if kind == "aws":
        from ember.gateway.backends.aws import AwsBackend

        return AwsBackend.from_env(logs)
    from ember.gateway.backends.local import LocalBackend, parse_size

    return LocalBackend(logs, parked_ram=None if parked_ram is None else parse_size(parked_ram))
