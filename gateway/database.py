"""The gateway's SQLite file (keys, per-app limits): private from its first byte, a busy timeout, and failures that
say what failed. The gateway calls it off its event loop (`asyncio.to_thread`), so a lock another process holds
delays only the requests that need the database, never /healthz or a call whose key is cached."""
import contextlib
import errno
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path

BUSY_TIMEOUT = 5.0  # seconds to wait for another process's lock before answering 503


class DatabaseError(RuntimeError):
    """The database could not do `what`; `status` is the HTTP status that says so (507 full, 503 busy or unusable)."""

    def __init__(self, status: int, type: str, message: str):
        super().__init__(message)
        self.status, self.type, self.message = status, type, message


def private_file(path: Path) -> None:
    """Create `path` as mode 0600 if it is missing, so no other user can read it even for a moment."""
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))


def explain(exc: Exception, path: Path, what: str) -> DatabaseError:
    """The DatabaseError for an sqlite3 or OS error met while doing `what`."""
    text = str(exc).lower()
    full = getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL or getattr(exc, "errno", None) == errno.ENOSPC
    if full or "disk is full" in text:
        return DatabaseError(507, "insufficient_storage", f"could not {what}: the disk holding {path} is full; "
                                                          "free space there and retry")
    if "locked" in text or "busy" in text:
        return DatabaseError(503, "database_busy", f"could not {what}: {path} is locked by another process for over "
                                                   f"{BUSY_TIMEOUT:g} s; retry shortly")
    return DatabaseError(503, "database_unavailable", f"could not {what}: {path}: {exc}; check that the file and its "
                                                      "folder are writable by the gateway")


@contextlib.contextmanager
def connect(path: Path, what: str) -> Iterator[sqlite3.Connection]:
    """One transaction on `path` (committed on success), its failures raised as a DatabaseError naming `what`."""
    try:
        private_file(path)
        conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT)
    except (sqlite3.Error, OSError) as exc:
        raise explain(exc, path, what) from None
    conn.row_factory = sqlite3.Row
    try:
        with conn:
            yield conn
    except (sqlite3.Error, OSError) as exc:
        raise explain(exc, path, what) from None
    finally:
        conn.close()
