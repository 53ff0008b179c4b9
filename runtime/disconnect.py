"""Awaiting a request's work while its client may hang up: one race for the gateway's calls and the engine's routes."""
import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")


class WorkCancelled(Exception):
    """The work was cancelled before it finished: its client hung up, or (`stopped`) the stop event was set."""

    def __init__(self, stopped: bool):
        super().__init__("stopped" if stopped else "the client disconnected")
        self.stopped = stopped


async def unless_disconnected(request: Request, work: Awaitable[T], stop: asyncio.Event | None = None) -> T:
    """Await `work` (the request's body already read), cancelling it if the client hangs up first, or when `stop` is
    set; then raises WorkCancelled. Cancelling it frees what it held at once (a replica slot, engine requests)."""
    async def hung_up() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(hung_up())
    stopper = asyncio.ensure_future(stop.wait()) if stop is not None else None
    try:
        await asyncio.wait({task, watcher} | ({stopper} if stopper else set()), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
        if stopper is not None:
            stopper.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise WorkCancelled(stopped=stop is not None and stop.is_set())
