"""Sends a call or a forwarded request to a replica over loopback HTTP."""
from typing import Callable

import anyio
import httpx
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ember.gateway.errors import ApiError
from ember.gateway.replica import Replica

# Connection-level headers that must not cross a proxy (RFC 9110 7.6.1), plus the caller's credentials.
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
              "transfer-encoding", "upgrade", "host", "authorization", "content-length"}


def _unreachable(replica: Replica, exc: Exception) -> ApiError:
    return ApiError(503, "replica_unavailable", f"replica {replica.id} did not answer: {type(exc).__name__}", {"Retry-After": "1"})


async def call(client: httpx.AsyncClient, replica: Replica, method: str, body: bytes, timeout: float) -> Response:
    """A function call: the replica's JSON reply (result or error) passed through with its status."""
    try:
        reply = await client.post(
            f"http://{replica.address}/__ember__/call/{method}", content=body,
            headers={"content-type": "application/json"}, timeout=timeout + 5,
        )
    except httpx.TimeoutException:
        raise ApiError(504, "timeout", f"call exceeded the function's timeout of {timeout:g} s") from None
    except httpx.TransportError as exc:
        raise _unreachable(replica, exc) from None
    return Response(reply.content, status_code=reply.status_code, media_type="application/json")


async def open_stream(client: httpx.AsyncClient, replica: Replica, request: Request, path: str) -> httpx.Response:
    """Start forwarding `request` to the replica's ASGI app at `path`; the body streams both ways."""
    headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP]
    upstream = client.build_request(
        request.method, f"http://{replica.address}{path}", params=request.url.query or None,
        headers=headers, content=request.stream(), timeout=httpx.Timeout(None, connect=5),
    )
    try:
        return await client.send(upstream, stream=True)
    except httpx.TransportError as exc:
        raise _unreachable(replica, exc) from None


class Relay(Response):
    """Streams an upstream response to the client as it arrives (SSE untouched, backpressure by awaiting
    each send); a client disconnect closes the upstream connection, which cancels the request there."""

    def __init__(self, upstream: httpx.Response, on_close: Callable[[], None]):
        self.upstream, self.on_close = upstream, on_close
        self.status_code = upstream.status_code
        self.background = None
        passed = [(k, v) for k, v in upstream.headers.multi_items() if k.lower() not in HOP_BY_HOP]
        self.raw_headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in passed]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def pump() -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.upstream.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
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
            await self.upstream.aclose()
            self.on_close()
