"""Async plumbing between engine streams and the HTTP response: first-item priming, batching, SSE."""

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing

from fastapi.responses import StreamingResponse

from ember.runtime.engine.async_engine import Completion, EngineDeadError, FormatCostError, RequestFailedError


async def start(streams: list[AsyncGenerator[Completion, None]]) -> list[AsyncGenerator[Completion, None]]:
    """Wait for every stream's first item, so a refused request fails before any response byte is sent."""
    tasks = [asyncio.ensure_future(anext(s)) for s in streams]
    try:
        firsts = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:
            await s.aclose()
        raise
    return [_prepend(first, s) for first, s in zip(firsts, streams)]


async def _prepend(first: Completion, rest: AsyncGenerator[Completion, None]) -> AsyncGenerator[Completion, None]:
    async with aclosing(rest):
        yield first
        async for c in rest:
            yield c


async def renumber(stream: AsyncGenerator[Completion, None], offset: int) -> AsyncGenerator[Completion, None]:
    """Prompt i of a batch answers as choices i*n .. i*n+n-1, as OpenAI numbers them."""
    async with aclosing(stream):
        async for c in stream:
            c.prompt_index = offset
            c.index += offset
            yield c


async def merge(streams: list[AsyncGenerator[Completion, None]]) -> AsyncGenerator[Completion, None]:
    """Interleave several streams in arrival order; closing the merge closes them all."""
    if len(streams) == 1:
        async with aclosing(streams[0]):
            async for c in streams[0]:
                yield c
        return
    outputs: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream):
        try:
            async with aclosing(stream):
                async for c in stream:
                    outputs.put_nowait(c)
            outputs.put_nowait(done)
        except Exception as e:  # noqa: BLE001 - handed to the reader, which re-raises it
            outputs.put_nowait(e)

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await outputs.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    """Server-sent events of `events`, each a JSON text, ending in [DONE] (after an error's JSON if the engine
    failed): the chat and completions APIs' stream."""
    async def sse():
        try:
            async for event in events:
                yield f"data: {event}\n\n"
        except (EngineDeadError, RequestFailedError) as e:
            error = {"error": {"message": _failure(e), "type": _kind(e), "param": None, "code": None}}
            yield f"data: {json.dumps(error)}\n\n"
        finally:
            await events.aclose()
        yield "data: [DONE]\n\n"

    return _sse_response(sse())


def typed_event_stream(events: AsyncIterator[tuple[str, str]], sequence: Callable[[], int]) -> StreamingResponse:
    """Server-sent events of (type, JSON text) pairs, each named by its type, with no [DONE]: the Responses API's
    stream. An engine failure ends it with an `error` event numbered by `sequence`."""
    async def sse():
        try:
            async for kind, event in events:
                yield f"event: {kind}\ndata: {event}\n\n"
        except (EngineDeadError, RequestFailedError) as e:
            error = {"type": "error", "code": _kind(e), "message": _failure(e), "param": None,
                     "sequence_number": sequence()}
            yield f"event: error\ndata: {json.dumps(error)}\n\n"
        finally:
            await events.aclose()

    return _sse_response(sse())


def _failure(e: Exception) -> str:
    if isinstance(e, FormatCostError):   # the request's own doing: retrying it would fail the same way
        return str(e)
    return f"{e}; restart the replica" if isinstance(e, EngineDeadError) else f"{e}; retry the request"


def _kind(e: Exception) -> str:
    return "invalid_request_error" if isinstance(e, FormatCostError) else "server_error"


def _sse_response(body: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
