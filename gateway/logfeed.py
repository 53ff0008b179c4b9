"""`GET /admin/logs/follow`: the gateway's log and its replicas' logs as one live stream of JSON lines, which
`ember logs -f [--app A] [--function F] [--replica R]` prints.

Gateway and replica lines are JSON (runtime/logs.py); what user code prints to a replica's stdout or stderr is
plain text, passed on as `{"msg": line, "stream": "output"}`. Every record names its source: `gateway`, or the
app, function and replica of the replica log it came from (files are EMBER_HOME/logs/APP.REPLICA.log).
"""
import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse

from ember.gateway.auth import authenticate

if TYPE_CHECKING:
    from ember.gateway.service import Gateway

POLL = 0.2  # seconds between looks at the files
HEARTBEAT = 5.0  # an empty line this often, so a client that left is noticed
NAME = r"^[A-Za-z0-9_.-]{1,100}$"
GATEWAY_LOG = "gateway.log"
READ_AT_ONCE = 8 << 20  # bytes of one file read per poll
MAX_LINE = 1 << 20  # bytes of one line passed on; a longer one is cut (a progress bar without newlines, say)


class LogFile:
    """One log file read as it grows: whole lines only, as records."""

    def __init__(self, path: Path, source: dict, offset: int):
        self.path, self.source, self.offset = path, source, offset
        self.partial = b""
        self.cut = False  # within a line over MAX_LINE bytes, whose start went out cut short
        self.gone = False  # deleted (an ended replica's, pruned by runtime/log_budget.py): no longer read

    def read(self) -> list[dict]:
        """The whole lines written since the last read, at most READ_AT_ONCE bytes of them (a replica that writes
        faster is followed a poll behind, not read into the gateway's memory at once)."""
        try:
            with self.path.open("rb") as f:
                if f.seek(0, 2) < self.offset:   # rotated (runtime/log_budget.py): the file starts afresh
                    self.offset, self.partial, self.cut = 0, b"", False
                f.seek(self.offset)
                data = f.read(READ_AT_ONCE)
        except FileNotFoundError:
            self.gone = True
            return []
        except OSError:
            return []
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        if self.cut and lines:   # the rest of the over-long line: its start went out already
            lines, self.cut = lines[1:], False
        records = [self.record(line) for line in lines if line.strip()]
        if len(self.partial) > MAX_LINE and not self.cut:   # a line with no end in sight: its start, marked
            records.append(self.record(self.partial[:MAX_LINE] + b" [line cut at %d bytes]" % MAX_LINE))
            self.partial, self.cut = b"", True
        elif self.cut:
            self.partial = b""
        return records

    def record(self, line: bytes) -> dict:
        text = line.decode("utf-8", "replace").rstrip("\r")
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = None
        record = parsed if isinstance(parsed, dict) else {"msg": text, "stream": "output"}
        if "function" in record and "function" not in self.source:
            self.source["function"] = record["function"]  # a replica's JSON lines name its function
        return self.source | record


def backlog(path: Path, lines: int, window: int = 256 * 1024) -> int:
    """The offset where the file's last `lines` lines begin (looking back at most `window` bytes)."""
    with path.open("rb") as f:
        size = f.seek(0, 2)
        if lines == 0:
            return size
        start = f.seek(max(0, size - window))
        tail = f.read()
    position = len(tail) - 1 if tail.endswith(b"\n") else len(tail)
    for _ in range(lines):
        position = tail.rfind(b"\n", 0, position)
        if position < 0:  # fewer lines than asked: from the first whole line
            return start if start == 0 else start + tail.find(b"\n") + 1
    return start + position + 1


class LogFeed:
    def __init__(self, gateway: "Gateway", app: str | None, function: str | None, replica: str | None, lines: int):
        self.gateway, self.app, self.function, self.replica, self.lines = gateway, app, function, replica, lines
        self.files: dict[Path, LogFile] = {}

    def source(self, path: Path) -> dict | None:
        """Who writes the file, or None when the filter excludes every line it can hold."""
        if path.name == GATEWAY_LOG:
            return {"source": "gateway"}
        app, _, replica = path.name.removesuffix(".log").partition(".")
        if not replica or (self.app and app != self.app) or (self.replica and replica != self.replica):
            return None
        source = {"source": "replica", "app": app, "replica": replica}
        unit = next((u for d in self.gateway.deployments.values() for u in d.units.values()
                     if replica in u.router.replicas), None)
        return source | ({"function": unit.name} if unit else {})

    def discover(self, first: bool) -> None:
        for path in sorted(self.gateway.home.logs.glob("*.log")):
            if path in self.files or (source := self.source(path)) is None:
                continue
            try:  # files there at the start show their last lines; files that appear later, all of theirs
                offset = backlog(path, self.lines) if first else 0
            except OSError:
                continue
            self.files[path] = LogFile(path, source, offset)

    def wanted(self, record: dict) -> bool:
        return all(value is None or record.get(field) == value
                   for field, value in (("app", self.app), ("function", self.function), ("replica", self.replica)))

    async def stream(self) -> AsyncIterator[bytes]:
        self.discover(first=True)
        quiet_since = time.monotonic()
        first = True
        # Until the client leaves (a send to it then fails, which ends this generator) or the gateway stops: the
        # follower then sees the stream end instead of its connection cut when the stop's grace period is over.
        while not self.gateway.stopping:
            if not first:
                self.discover(first=False)
            records = [r for f in list(self.files.values()) for r in f.read() if self.wanted(r)]
            self.files = {path: f for path, f in self.files.items() if not f.gone}
            if first:
                records.sort(key=lambda r: str(r.get("ts", "")))
                first = False
            if records:
                quiet_since = time.monotonic()
                yield "".join(json.dumps(r, default=str) + "\n" for r in records).encode()
            elif time.monotonic() - quiet_since > HEARTBEAT:
                quiet_since = time.monotonic()
                yield b"\n"
            await asyncio.sleep(POLL)


def logfeed_router(gateway: "Gateway") -> APIRouter:
    async def admin(request: Request) -> None:
        await authenticate(gateway.keys, request, admin=True)

    router = APIRouter(prefix="/admin/logs", dependencies=[Depends(admin)])

    # Left out of /openapi.json: a stream that never ends on its own is no operation for a client generator or fuzzer.
    @router.get("/follow", include_in_schema=False)
    async def follow(request: Request, app: str | None = Query(None, pattern=NAME),
                     function: str | None = Query(None, pattern=NAME), replica: str | None = Query(None, pattern=NAME),
                     lines: int = Query(10, ge=0, le=10_000)) -> StreamingResponse:
        feed = LogFeed(gateway, app, function, replica, lines)
        return StreamingResponse(feed.stream(), media_type="application/x-ndjson",
                                 headers={"Cache-Control": "no-store"})

    return router
