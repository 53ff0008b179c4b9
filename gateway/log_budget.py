"""Log files kept to a size: the gateway's own log and each replica's (EMBER_HOME/logs/*.log) grow as long as their
processes write, and a replica that prints without end (or prints what its callers send) filled the disk the
gateway's database and packages share.

A file over LOG_MAX_BYTES is copied to NAME.log.1 (replacing the last one) and cut to nothing. Its writers keep
their descriptors: every log here is opened for appending, so their next lines start the file afresh. Lines
written between the copy and the cut are lost (as with logrotate's copytruncate); readers that follow a file
(`ember logs -f`) start again from its beginning when it shrinks.
"""
import asyncio
import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger("ember.gateway")

LOG_MAX_BYTES = 256 << 20  # one log file's size before it is rotated; at most twice this on disk per file
CHECK_EVERY = 10.0  # seconds between looks at the files' sizes


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


async def keep_bounded(folder: Path, limit: int = LOG_MAX_BYTES, every: float = CHECK_EVERY) -> None:
    """Rotate the folder's large logs every `every` seconds, for as long as the gateway runs."""
    while True:
        for path in await asyncio.to_thread(rotate_large, folder, limit):
            log.info("rotated %s at %d MiB (the previous part is %s.1)", path.name, limit >> 20, path.name)
        await asyncio.sleep(every)
