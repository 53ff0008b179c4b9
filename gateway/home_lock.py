"""One `ember serve` per EMBER_HOME: the live gateway holds an exclusive lock on EMBER_HOME/gateway.lock.

The kernel drops a flock when its holder dies, so a lock left by a gateway killed with kill -9 is simply taken over by
the next one; the pid and URL written into the file only serve the message a second gateway prints."""
import fcntl
import json
import os

from ember.home import Home


class HomeInUse(RuntimeError):
    """Another live gateway serves from this EMBER_HOME; the message names it and the fix."""


class HomeLock:
    def __init__(self, home: Home):
        self.path = home.root / "gateway.lock"
        home.logs  # noqa: B018 - makes EMBER_HOME (with a clear error when it cannot be made)
        # Not inherited by replicas (Python's default), so a replica that outlives its gateway does not hold it.
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._holder()
            os.close(self.fd)
            raise HomeInUse(f"another `ember serve` (pid {holder.get('pid', '?')}, {holder.get('url', 'starting')}) "
                            f"already serves from EMBER_HOME={home.root}: stop it first, or give this one a home of "
                            "its own (EMBER_HOME=/some/other/folder ember serve ...)") from None

    def _holder(self) -> dict:
        try:
            return json.loads(os.pread(self.fd, 4096, 0) or b"{}")
        except ValueError:
            return {}

    def record(self, url: str) -> None:
        """Name this gateway in the lock file, for the message a second `ember serve` prints."""
        data = json.dumps({"pid": os.getpid(), "url": url}).encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)

    def __enter__(self) -> "HomeLock":
        return self

    def __exit__(self, *exc: object) -> None:
        os.ftruncate(self.fd, 0)
        os.close(self.fd)  # closing drops the flock
