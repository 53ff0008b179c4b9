"""Spawned calls: `POST /{app}/{fn}` with `Prefer: respond-async` answers 202 and the call's id at once, and the
gateway runs the call in the background through the same queue, retries and rate-limit charge as any call (so the
autoscaler sees spawned work as queued work). Each call's record (state, status, reply) lives in the gateway's SQLite,
so `GET /calls/{id}` answers from any client and after the spawner has gone; `DELETE /calls/{id}` cancels it.
`CallStore` owns a call's state: pending -> succeeded | failed | cancelled, never out of a finished one."""
import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from ember.gateway import proxy
from ember.gateway.auth import authenticate, authorize
from ember.gateway.database import connect
from ember.gateway.errors import ApiError
from ember.gateway.keys import KeyStore

log = logging.getLogger("ember.gateway")

PENDING, SUCCEEDED, FAILED, CANCELLED = "pending", "succeeded", "failed", "cancelled"
SCHEMA = ("CREATE TABLE IF NOT EXISTS calls (id TEXT PRIMARY KEY, app TEXT NOT NULL, function TEXT NOT NULL, "
          "state TEXT NOT NULL, status INTEGER, reply TEXT, created REAL NOT NULL, finished REAL)")
RETENTION = 7 * 24 * 3600.0  # seconds a finished call's record is kept
MAX_WAIT = 60.0  # seconds one GET may wait for a call to finish
MAX_STORED_RESULT = 64 << 20  # bytes of a spawned call's result kept for its caller (in the gateway's database)
# Spawned calls not yet finished in one gateway, and the bytes of their bodies, which each holds until it runs: a
# client spawning without end held every body in memory, past the budget that bounds bodies being read.
MAX_SPAWNED, MAX_SPAWNED_BYTES = 10_000, 1 << 30
SPAWN_PREFERENCE = "respond-async"  # RFC 7240: `Prefer: respond-async` asks for 202 and the call's id


def wants_spawn(request: Request) -> bool:
    preferences = request.headers.get("prefer", "").lower().replace(" ", "").split(",")
    return SPAWN_PREFERENCE in preferences


async def _stored(relay: "proxy.Relay") -> tuple[str, int, str]:
    """A spawned call's large result, read to keep until its caller fetches it; over MAX_STORED_RESULT it fails
    by name (the gateway's database holds it: a result of gigabytes would be written there whole)."""
    data = bytearray()
    try:
        async for chunk in relay.upstream.content.iter_any():
            data += chunk
            if len(data) > MAX_STORED_RESULT:
                return FAILED, 413, _error_reply(
                    "result_too_large", f"the result is over {MAX_STORED_RESULT >> 20} MiB, more than a spawned "
                    "call keeps for its caller: call the function with .remote() (its result is relayed as it "
                    "comes), or return where the data is (a path, a bucket key) rather than the data")
    finally:
        await relay.close()
    return SUCCEEDED, relay.status_code, data.decode()


class CallStore:
    """The records of spawned calls in SQLite. Calls a previous gateway process left pending can never finish: they
    are marked failed when the store opens."""

    def __init__(self, db: Path):
        self.db = db
        now = time.time()
        with connect(db, "open the spawned-calls table") as conn:
            conn.execute(SCHEMA)
            conn.execute("DELETE FROM calls WHERE finished < ?", (now - RETENTION,))
            reply = _error_reply("gateway_restarted", "the gateway stopped before this call finished; spawn it again")
            conn.execute("UPDATE calls SET state = ?, status = 503, reply = ?, finished = ? WHERE state = ?",
                         (FAILED, reply, now, PENDING))

    def create(self, app: str, function: str) -> str:
        call_id = f"fc-{secrets.token_urlsafe(16)}"
        with connect(self.db, "record a spawned call") as conn:
            conn.execute("INSERT INTO calls (id, app, function, state, created) VALUES (?, ?, ?, ?, ?)",
                         (call_id, app, function, PENDING, time.time()))
        return call_id

    def finish(self, call_id: str, state: str, status: int, reply: str) -> bool:
        """Record how a pending call ended; False when it had ended already (a cancel that came first wins)."""
        with connect(self.db, f"record the end of call {call_id}") as conn:
            changed = conn.execute("UPDATE calls SET state = ?, status = ?, reply = ?, finished = ? "
                                   "WHERE id = ? AND state = ?", (state, status, reply, time.time(), call_id, PENDING))
            return changed.rowcount == 1

    def get(self, call_id: str) -> dict | None:
        with connect(self.db, f"read call {call_id}") as conn:
            row = conn.execute("SELECT * FROM calls WHERE id = ?", (call_id,)).fetchone()
        return dict(row) if row else None


def _error_reply(type: str, message: str) -> str:
    return json.dumps({"error": {"type": type, "message": message}})


def describe(record: dict) -> dict:
    """What GET /calls/{id} answers: the record, with the result or the error once it has finished."""
    out = {"call_id": record["id"], "app": record["app"], "function": record["function"], "state": record["state"],
           "created": record["created"], "finished": record["finished"]}
    if record["state"] != PENDING:
        out["status"] = record["status"]
        out |= json.loads(record["reply"])
    return out


Run = Callable[[], Awaitable[Response]]  # the call through the queue: its whole reply (its slot freed)


class SpawnedCalls:
    """The spawned calls this gateway is running, each an asyncio task that writes its record when it ends and
    reports how it ended to `on_end(app, unit, state)` (the gateway's metrics)."""

    def __init__(self, store: CallStore, on_end: Callable[[str, str, str], None] = lambda *_: None):
        self.store, self.on_end = store, on_end
        self.running: dict[str, asyncio.Task] = {}
        self.held = 0  # bytes of the running calls' bodies

    async def spawn(self, app: str, function: str, run: Run, settle: Callable[[], Awaitable[None]],
                    size: int = 0) -> str:
        """Start `run` in the background and return its call's id; `size`: the bytes of its body, held till it ends.
        Over MAX_SPAWNED calls or MAX_SPAWNED_BYTES of bodies it is a 429 (nothing recorded, nothing run)."""
        if len(self.running) >= MAX_SPAWNED or self.held + size > MAX_SPAWNED_BYTES:
            raise ApiError(429, "too_many_spawned_calls", f"this gateway runs {len(self.running)} spawned calls "
                           f"holding {self.held >> 20} MiB of arguments, its most ({MAX_SPAWNED} calls, "
                           f"{MAX_SPAWNED_BYTES >> 20} MiB): wait for some to finish, or call the function directly",
                           {"Retry-After": "5"})
        call_id = await asyncio.to_thread(self.store.create, app, function)
        unit = function.partition(".")[0]  # a method's unit is its class
        task = asyncio.create_task(self._run(call_id, run, settle, lambda state: self.on_end(app, unit, state)),
                                   name=f"spawned {call_id}")
        self.running[call_id] = task
        self.held += size

        def ended(_: asyncio.Task) -> None:
            self.running.pop(call_id, None)
            self.held -= size

        task.add_done_callback(ended)
        return call_id

    async def _run(self, call_id: str, run: Run, settle: Callable[[], Awaitable[None]],
                   ended: Callable[[str], None]) -> None:
        try:
            state, status, reply = await self._attempt(run)
        except asyncio.CancelledError:
            state, status, reply = CANCELLED, 499, _error_reply("cancelled", "the call was cancelled")
        except Exception as exc:
            log.exception("spawned call %s failed in the gateway", call_id)
            state, status, reply = FAILED, 500, _error_reply("internal_error", f"{type(exc).__name__} in the gateway")
        finally:
            await settle()
        if await asyncio.to_thread(self.store.finish, call_id, state, status, reply):
            ended(state)

    @staticmethod
    async def _attempt(run: Run) -> tuple[str, int, str]:
        """Run the call; while the function's queue is full it waits its turn (the spawn was already accepted)."""
        while True:
            try:
                response = await run()
            except ApiError as exc:
                if exc.type == "overloaded":
                    await asyncio.sleep(float(exc.headers.get("Retry-After", 1)))
                    continue
                return FAILED, exc.status, _error_reply(exc.type, exc.message)
            if isinstance(response, proxy.Relay) and response.sse:
                await response.close()  # a generator's stream has no one to read it
                return FAILED, 400, _error_reply("is_generator", "a generator function cannot be spawned: iterate "
                                                 "its values with .remote_gen() (a streamed POST) instead")
            if isinstance(response, proxy.Relay):   # a large result, relayed: kept up to MAX_STORED_RESULT
                return await _stored(response)
            state = SUCCEEDED if response.status_code == 200 else FAILED
            return state, response.status_code, bytes(response.body).decode()

    async def wait(self, call_id: str, seconds: float, stop: asyncio.Event | None = None) -> None:
        """Until the call finishes, `seconds` pass, or `stop` is set (a stopping gateway's grace period ended)."""
        task = self.running.get(call_id)
        if task is None or seconds <= 0:
            return
        stopped = asyncio.ensure_future(stop.wait()) if stop is not None else None
        try:
            await asyncio.wait({task} | ({stopped} if stopped else set()), timeout=seconds,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            if stopped is not None:
                stopped.cancel()

    async def cancel(self, call_id: str) -> None:
        task = self.running.get(call_id)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({task})


def calls_router(keys: KeyStore, calls: SpawnedCalls) -> APIRouter:
    router = APIRouter(prefix="/calls")

    async def read(call_id: str) -> dict:
        record = await asyncio.to_thread(calls.store.get, call_id)
        if record is None:
            raise ApiError(404, "not_found", f"no spawned call {call_id[:100]!r} (finished calls are kept "
                                             f"{RETENTION / 86400:g} days)")
        return record

    async def owned(request: Request, call_id: str) -> dict:
        """The call's record, for a key that may call its function."""
        key = await authenticate(keys, request)
        record = await read(call_id)
        authorize(key, record["app"], record["function"].partition(".")[0])  # a method's unit is its class
        return record

    @router.get("/{call_id}")
    async def get_call(request: Request, call_id: str, wait: float = 0.0) -> JSONResponse:
        """The call's state, and its result or error once finished; `wait` seconds (at most 60) for it to finish."""
        record = await owned(request, call_id)
        if record["state"] == PENDING and wait > 0:
            await calls.wait(call_id, min(wait, MAX_WAIT), getattr(request.app.state, "cut_short", None))
            record = await read(call_id)
        return JSONResponse(describe(record))

    @router.delete("/{call_id}")
    async def cancel_call(request: Request, call_id: str) -> JSONResponse:
        """Cancel the call: a queued one never runs, a running one is cancelled in its replica. A finished call is
        left as it ended."""
        await owned(request, call_id)
        await calls.cancel(call_id)
        return JSONResponse(describe(await read(call_id)))

    return router
