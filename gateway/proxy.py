"""Sends a call or a forwarded request to a replica over loopback HTTP.

The upstream URL is always http://{replica address}{path}: nothing the client sends chooses the host or port."""
import json
import logging
from typing import AsyncIterator, Awaitable, Callable

import anyio
import httpx
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ember.gateway.errors import ApiError
from ember.gateway.replica import Replica
from ember.gateway.usage import UsageMeter

log = logging.getLogger("ember.gateway")

# Connection-level headers that must not cross a proxy (RFC 9110 7.6.1), plus the caller's credentials.
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
              "transfer-encoding", "upgrade", "host", "authorization", "content-length"}


class Unreachable(Exception):
    """The replica failed before the first byte of its response: safe to send the same request elsewhere."""

    def __init__(self, replica: Replica, exc: Exception):
        super().__init__(f"replica {replica.id}: {type(exc).__name__}")
        self.error = ApiError(503, "replica_unavailable", f"replica {replica.id} did not answer: {type(exc).__name__}", {"Retry-After": "1"})


def _timeout(timeout: float) -> ApiError:
    return ApiError(504, "timeout", f"the replica did not answer within the function's timeout of {timeout:g} s")


def _url(replica: Replica, path: str) -> httpx.URL:
    return httpx.URL(scheme="http", host=replica.host, port=replica.port, path=path)


async def call(client: httpx.AsyncClient, replica: Replica, method: str, body: bytes, timeout: float) -> Response:
    """A function call: the replica's JSON reply (result or error) passed through with its status."""
    try:
        reply = await client.post(
            _url(replica, f"/__ember__/call/{method}"), content=body,
            headers={"content-type": "application/json"}, timeout=timeout + 5,
        )
    except httpx.TimeoutException:
        raise _timeout(timeout) from None
    except httpx.TransportError as exc:
        raise Unreachable(replica, exc) from None
    return Response(reply.content, status_code=reply.status_code, media_type="application/json")


async def _counted(stream: AsyncIterator[bytes], limit: int) -> AsyncIterator[bytes]:
    size = 0
    async for chunk in stream:
        size += len(chunk)
        if size > limit:
            raise ApiError(413, "body_too_large", f"request body is over {limit} bytes")
        yield chunk


async def open_stream(client: httpx.AsyncClient, replica: Replica, request: Request, path: str, body: bytes | None,
                      timeout: float, max_body: int) -> httpx.Response:
    """Start forwarding `request` to the replica's ASGI app at `path`: `body` when the gateway read it, else the
    client's body streamed through. `timeout` bounds the wait for each response chunk."""
    headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP]
    upstream = client.build_request(
        request.method, _url(replica, path), params=request.url.query or None, headers=headers,
        content=body if body is not None else _counted(request.stream(), max_body),
        timeout=httpx.Timeout(timeout, connect=5),
    )
    try:
        return await client.send(upstream, stream=True)
    except httpx.TimeoutException:
        raise _timeout(timeout) from None
    except httpx.TransportError as exc:
        raise Unreachable(replica, exc) from None


class Relay(Response):
    """Streams an upstream response to the client as it arrives (SSE untouched, backpressure by awaiting
    each send); a client disconnect closes the upstream connection, which cancels the request there.
    An upstream that fails mid-stream ends an SSE stream with an `event: error`; other bodies are cut off."""

    def __init__(self, upstream: httpx.Response, on_close: Callable[[], Awaitable[None]], meter: UsageMeter | None = None):
        self.upstream, self.on_close, self.meter = upstream, on_close, meter
        self.closed = False
        self.status_code = upstream.status_code
        self.background = None
        passed = [(k, v) for k, v in upstream.headers.multi_items() if k.lower() not in HOP_BY_HOP]
        self.raw_headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in passed]
        self.sse = upstream.headers.get("content-type", "").startswith("text/event-stream")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def pump() -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            try:
                async for chunk in self.upstream.aiter_raw():
                    if self.meter is not None:
                        self.meter.feed(chunk)
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except httpx.TransportError as exc:
                log.warning("upstream failed mid-response: %s: %s", type(exc).__name__, exc)
                if not self.sse:
                    raise
                error = {"error": {"type": "replica_failed", "message": f"the replica failed mid-stream ({type(exc).__name__}); retry the request"}}
                await send({"type": "http.response.body", "body": f"event: error\ndata: {json.dumps(error)}\n\n".encode(), "more_body": True})
            await self.close()  # before the client sees the end, so its next request finds the slot and tokens settled
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def watch_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        try:
            async with anyio.create_task_group() as group:
                async def first_done(job: Callable) -> None:
                    await job()
                    group.cancel_scope.cancel()

                group.start_soon(first_done, pump)
                group.start_soon(first_done, watch_disconnect)
        except OSError:
            pass  # the client went away mid-send
        finally:
            await self.close()

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            await self.upstream.aclose()
            await self.on_close()
