"""Log files kept to a size and a number, in the gateway's EMBER_HOME/logs and a node agent's work/logs: each log
grows as long as its process writes, and a replica that prints without end (or prints what its callers send) filled
the disk the gateway's database and packages share; and every replica start writes a new file, so a function that
scales to zero and back left one more file each time, for ever.

A file over LOG_MAX_BYTES is copied to NAME.log.1 (replacing the last one) and cut to nothing. Its writers keep
their descriptors: every log here is opened for appending, so their next lines start the file afresh. Lines
written between the copy and the cut are lost (as with logrotate's copytruncate); readers that follow a file
(`ember logs -f`) start again from its beginning when it shrinks.

The log of a process that has ended (a replica, a fork server) is kept ENDED_KEEP_SECONDS after its last line, and
of those, the ENDED_KEEP_FILES newest; older ones are deleted with their .1 part. A live one's log (the owner names
them: its replicas', its fork servers', its own) is never deleted, however quiet, nor any log written in the last
ENDED_GRACE_SECONDS (a replica starting, not yet known).
"""
import asyncio
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

LOG_MAX_BYTES = 256 << 20  # one log file's size before it is rotated; at most twice this on disk per file
CHECK_EVERY = 10.0  # seconds between looks at the files' sizes
ENDED_KEEP_SECONDS = 7 * 24 * 3600  # an ended replica's log, after its last line
ENDED_KEEP_FILES = 500  # ended replicas' logs kept at most (newest first)
ENDED_GRACE_SECONDS = 3600  # a log written this recently is kept whatever the count


def rotate_large(folder: Path, limit: int = LOG_MAX_BYTES) -> list[Path]:
    """Rotate each log in `folder` over `limit` bytes; the ones rotated."""
    rotated = []
    for path in folder.glob("*.log"):
        try:
            if path.stat().st_size <= limit:
                continue
            shutil.copyfile(path, path.with_name(path.name + ".1"))
            os.truncate(path, 0)
        except OSError as exc:  # gone meanwhile, or the disk is full: the next look tries again
            log.warning("could not rotate %s: %s", path, exc)
            continue
        rotated.append(path)
    return rotated


def prune_ended(folder: Path, live: set[Path], now: float, keep_seconds: float = ENDED_KEEP_SECONDS,
                keep_files: int = ENDED_KEEP_FILES, grace: float = ENDED_GRACE_SECONDS) -> list[Path]:
    """Delete the logs not in `live` past their age or count; the ones deleted."""
    ended = []
    for path in folder.glob("*.log"):
        if path in live:
            continue
        try:
            ended.append((path.stat().st_mtime, path))
        except OSError:   # gone meanwhile
            continue
    ended.sort(reverse=True)
    deleted = []
    for rank, (written, path) in enumerate(ended):
        age = now - written
        if age <= grace or (rank < keep_files and age <= keep_seconds):
            continue
        for part in (path, path.with_name(path.name + ".1")):
            part.unlink(missing_ok=True)
        deleted.append(path)
    return deleted


async def keep_bounded(folder: Path, live: Callable[[], set[Path]] = set, limit: int = LOG_MAX_BYTES,
                       every: float = CHECK_EVERY) -> None:
    """Rotate the folder's large logs, and delete ended processes' old ones, every `every` seconds, for as long as
    its owner runs; `live()` is the logs still written."""
    while True:
        for path in await asyncio.to_thread(rotate_large, folder, limit):
            log.info("rotated %s at %d MiB (the previous part is %s.1)", path.name, limit >> 20, path.name)
        try:
            deleted = await asyncio.to_thread(prune_ended, folder, live(), time.time())
        except OSError as exc:
            log.warning("could not prune ended replicas' logs: %s", exc)
            deleted = []
        if deleted:
            log.info("deleted %d ended processes' logs (older than %d days, or past the newest %d)", len(deleted),
                     ENDED_KEEP_SECONDS // 86400, ENDED_KEEP_FILES)
        await asyncio.sleep(every)
