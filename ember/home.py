"""EMBER_HOME: where local state lives (SQLite db, TLS material, packages, snapshots, logs)."""
import os
from pathlib import Path


class Home:
    def __init__(self, root: str | os.PathLike | None = None):
        self.root = Path(root or os.environ.get("EMBER_HOME") or Path.home() / ".ember").expanduser().resolve()

    def _dir(self, name: str) -> Path:
        path = self.root / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    @property
    def db(self) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        return self.root / "ember.db"

    @property
    def tls(self) -> Path:
        return self._dir("tls")

    @property
    def ca(self) -> Path:
        return self.tls / "ca.pem"

    @property
    def packages(self) -> Path:
        return self._dir("packages")

    @property
    def snapshots(self) -> Path:
        return self._dir("snapshots")

    @property
    def secrets(self) -> Path:
        """One NAME.env file (KEY=VALUE lines) per secret a function lists in `secrets=[...]`."""
        return self._dir("secrets")

    @property
    def logs(self) -> Path:
        return self._dir("logs")

    @property
    def gateway_file(self) -> Path:
        """Written by a running `ember serve`: its URL, so the CLI can find it."""
        return self.root / "gateway.json"

    @property
    def cli_key_file(self) -> Path:
        """The admin key `ember serve` mints for the CLI on this machine (mode 0600)."""
        return self.root / "cli.key"
