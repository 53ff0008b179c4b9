"""A generator function's call, answered as server-sent events: one `data: <json>` event per yielded value as it is
produced, then `event: done`; an exception after the first value ends the stream with `event: error` and the JSON
error (the traceback goes to the replica's log). An exception, timeout or disconnect before the first value is
answered as for any call, so the gateway may still retry it. A client that hangs up closes the generator."""
import asyncio
import contextvars
import inspect
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ember.runtime import health
from ember.runtime.call_body import ResultNotJson, result_json

DONE = object()  # what a pull returns once the generator is exhausted
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]


def is_generator(fn: Callable) -> bool:
    return inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn)


def event(data: Any, name: str | None = None) -> bytes:
    head = f"event: {name}\n" if name else ""
    return f"{head}data: {result_json(data)}\n\n".encode()


def error_event(type: str, message: str) -> bytes:
    return event({"error": {"type": type, "message": message}}, "error")


class ValueSource:
    """Pulls a generator's values one at a time: a sync generator's in the call's thread pool (its code may block),
    an async generator's on the loop. `pull()` is a future of the next value, DONE, or the user's exception."""

    def __init__(self, generator: Any, threads: ThreadPoolExecutor):
        self.generator, self.threads = generator, threads
        self.is_async = inspect.isasyncgen(generator)
        self.context = contextvars.copy_context()  # the trace context, as the thread of a plain call gets it
        self.pending: asyncio.Future | None = None

    def pull(self) -> asyncio.Future:
        if self.is_async:
            self.pending = asyncio.ensure_future(anext(self.generator, DONE))
        else:
            self.pending = asyncio.get_running_loop().run_in_executor(
                self.threads, lambda: self.context.run(next, self.generator, DONE))
        return self.pending

    async def close(self, grace: float) -> bool:
        """Stop the generator (its `finally` blocks run); False when a pull under way did not end within `grace`."""
        pending = self.pending
        if pending is not None and not pending.done():
            if self.is_async:
                pending.cancel()
            done, _ = await asyncio.wait({pending}, timeout=grace)
            if not done:
                return False
        try:
            if self.is_async:
                await asyncio.wait_for(self.generator.aclose(), grace)
            else:
                await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(
                    self.threads, lambda: self.context.run(self.generator.close)), grace)
        except TimeoutError:
            return False
        except Exception as exc:  # its cleanup raised: the stream is over either way
            traceback.print_exception(exc)
        return True


class EventStream:
    """The ASGI reply of a generator call. Nothing is sent until the first value is in (or the call failed first),
    so a failure before it gets a plain JSON error and status; `error_reply(status, type, message, headers)` builds
    those, and `recycling` are the headers of one after which this replica exits (a generator it could not stop)."""

    def __init__(self, source: ValueSource, function: str, timeout: float, grace: float,
                 error_reply: Callable[..., Any], recycling: dict[str, str]):
        self.source, self.function, self.timeout, self.grace = source, function, timeout, grace
        self.error_reply, self.recycling = error_reply, recycling

    async def __call__(self, scope, receive, send) -> None:
        deadline = time.monotonic() + self.timeout
        hang_up = asyncio.ensure_future(_disconnected(receive))
        started = False
        try:
            while True:
                pull = self.source.pull()
                await asyncio.wait({pull, hang_up}, timeout=max(deadline - time.monotonic(), 0),
                                   return_when=asyncio.FIRST_COMPLETED)
                if not pull.done():
                    return await self._stop(send, started, gone=hang_up.done())
                try:
                    value = pull.result()
                except Exception as exc:
                    traceback.print_exception(exc)
                    return await self._fail(send, started, 500, "function_error", f"{type(exc).__name__}: {exc}")
                if value is DONE:
                    if not started:
                        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
                    await send({"type": "http.response.body", "body": event({}, "done")})
                    return
                try:
                    chunk = event(value)
                except ResultNotJson as exc:
                    await self.source.close(self.grace)
                    return await self._fail(send, started, 500, "result_not_json", "the generator yielded a value "
                                            f"JSON cannot encode: {str(exc)[:300]}")
                if not started:
                    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
                    started = True
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            hang_up.cancel()

    async def _fail(self, send, started: bool, status: int, type: str, message: str) -> None:
        if started:
            await send({"type": "http.response.body", "body": error_event(type, message)})
        else:
            await self.error_reply(status, type, message)({"type": "http"}, None, send)

    async def _stop(self, send, started: bool, gone: bool) -> None:
        """The client hung up or the call overran its timeout: close the generator, freeing its slot."""
        left = "its client disconnected" if gone else f"it overran its timeout of {self.timeout:g} s"
        stopped = await self.source.close(self.grace)
        if not stopped:
            health.fail(f"a call to {self.function} could not be stopped after {left}")
        if gone:
            return
        message = f"call exceeded the function's timeout of {self.timeout:g} s"
        if started:
            return await send({"type": "http.response.body", "body": error_event("timeout", message)})
        reply = self.error_reply(504, "timeout", message, None if stopped else self.recycling)
        await reply({"type": "http"}, None, send)


async def _disconnected(receive) -> None:
    """Returns once the client has hung up (its body was read already, so the next message is the disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass
