"""EMBER_HOME: where local state lives (SQLite db, TLS material, packages, snapshots, logs)."""
import os
from pathlib import Path


class HomeError(RuntimeError):
    """EMBER_HOME cannot be used (read-only, not a folder, no permission); the message says how to fix it."""


class Home:
    def __init__(self, root: str | os.PathLike | None = None):
        self.root = Path(root or os.environ.get("EMBER_HOME") or Path.home() / ".ember").expanduser().resolve()

    def _dir(self, name: str, mode: int = 0o777) -> Path:
        """The folder, made if missing (with `mode`, less the umask); a HomeError, not a traceback, if it cannot be."""
        path = self.root / name if name else self.root
        try:
            path.mkdir(mode=mode, parents=True, exist_ok=True)
        except OSError as exc:
            raise HomeError(f"cannot create {path} ({exc.strerror or exc}): EMBER_HOME={self.root} must be a folder "
                            "this user can write; point EMBER_HOME at one, or fix its permissions") from None
        return path

    @property
    def db(self) -> Path:
        """The SQLite file; created mode 0600 by whoever opens it first (ember.gateway.database)."""
        return self._dir("") / "ember.db"

    @property
    def tls(self) -> Path:
        """The dev CA and the server certificate; the private keys in it are created mode 0600."""
        return self._dir("tls", 0o700)

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
        return self._dir("secrets", 0o700)

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
