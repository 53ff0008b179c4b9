"""Where replicas run: worker processes on this machine, or on the nodes of an AWS Auto Scaling Group."""
from pathlib import Path


def backend_for(kind: str, logs: Path, parked_ram: str | None = None):
    """The backend `ember serve --backend KIND` runs replicas on: "local" processes or an "aws" Auto Scaling Group."""
    if kind == "aws":
        from ember.gateway.backends.aws import AwsBackend

        return AwsBackend.from_env(logs)
    from ember.gateway.backends.local import LocalBackend, parse_size

    return LocalBackend(logs, parked_ram=None if parked_ram is None else parse_size(parked_ram))
