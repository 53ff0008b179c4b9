"""Sends a call or a forwarded request to a replica over loopback HTTP.

The upstream URL is always http://{replica address}{path}: nothing the client sends chooses the host or port."""
import asyncio
import json
import logging
import math
from collections.abc import Awaitable, Callable

import aiohttp
import anyio
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send
from yarl import URL

from ember.gateway.errors import ApiError, error_response
from ember.gateway.replica import Drain, GatewayReplica
from ember.gateway.usage import UsageMeter
from ember.runtime.worker import CALLER_HEADER, CONTROL_HEADER, NOT_STARTED, RECYCLING

log = logging.getLogger("ember.gateway")

# Connection-level headers that must not cross a proxy (RFC 9110 7.6.1), plus the caller's credentials.
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
              "transfer-encoding", "upgrade", "host", "authorization", "content-length", CONTROL_HEADER,
              CALLER_HEADER}
# From a reply: hop-by-hop headers, and date/server, which uvicorn writes itself. Content-Length stays: the body
# passes unchanged, so the client gets it whole rather than chunked.
REPLY_DROP = {k.encode() for k in HOP_BY_HOP - {"content-length"} | {"date", "server"}}
CLOCK_SLACK = 0.005  # seconds: a stall this close to the send timeout is one (StallWatch)
WHOLE_BODY = 256 * 1024  # a non-SSE reply up to this size (by its Content-Length) is read whole, then sent in one piece
CALL_HEADERS = {"content-type": "application/json"}
TRACE_HEADERS = {"traceparent", "tracestate", "x-ember-replica"}  # a traced hop sends its own
MAX_HEADER_LINE = 64 * 1024
BODY_SLICE = 256 * 1024  # a held body goes upstream in slices of this size, each written once the last has drained


def client() -> aiohttp.ClientSession:
    """The gateway's one upstream client. Replicas' uvicorn closes idle connections after 5 s: closing ours after 4 s
    means a pooled connection is never reused just as the replica closes it. No cookie jar: one caller's cookies
    must never ride along on another's request (aiohttp's jar keeps those of named hosts). Reply header lines
    up to 64 KiB, as httpx took them (aiohttp's default is 8 KiB)."""
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4)
    return aiohttp.ClientSession(connector=connector, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(),
                                 max_line_size=MAX_HEADER_LINE, max_field_size=MAX_HEADER_LINE)


class HeldBody(aiohttp.payload.Payload):
    """A request body the gateway holds, sent from its one buffer without a copy: aiohttp hands a bytes body to the
    transport whole, and asyncio copies what the socket does not take at once (twice, on Python 3.11), so each body
    on its way to a slow replica would be held two or three times."""

    _autoclose = True  # memory only: nothing to close

    def __init__(self, body: bytes | bytearray, content_type: str = "application/octet-stream"):
        super().__init__(body, content_type=content_type)
        self._size = len(body)

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return bytes(self._value).decode(encoding, errors)

    async def write(self, writer) -> None:
        with memoryview(self._value) as view:
            for start in range(0, len(view), BODY_SLICE):
                await writer.write(view[start:start + BODY_SLICE], LIMIT=0)  # waits for the transport to drain


class Unreachable(Exception):
    """The request never reached the replica's code (no connection, or the replica refused it before starting):
    safe to send the same request elsewhere."""

    def __init__(self, replica: GatewayReplica, why: str):
        super().__init__(f"replica {replica.id}: {why}")
        self.error = ApiError(503, "replica_unavailable", f"replica {replica.id} did not take the request: {why}",
                              {"Retry-After": "1"})


class ReplicaFailed(Exception):
    """The replica failed after the request reached it: the call may have run, so it is sent again only where the
    function's spec allows it (`retries=`)."""

    def __init__(self, replica: GatewayReplica, exc: Exception):
        super().__init__(f"replica {replica.id}: {type(exc).__name__}")
        self.error = ApiError(502, "replica_failed", f"replica {replica.id} failed while handling the request "
                              f"({type(exc).__name__}); it may or may not have run: retry only if that is safe",
                              {"Retry-After": "1"})


def _failure(replica: GatewayReplica, exc: aiohttp.ClientError) -> Exception:
    """A connection that could not be made reached nothing; any later failure may have reached the code."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        return Unreachable(replica, f"{type(exc).__name__}: {exc.os_error.strerror or exc}")
    return ReplicaFailed(replica, exc)


def _settle_replica(replica: GatewayReplica, headers) -> None:
    """The replica's reply says whether it takes more: refused before starting (Unreachable), or going away."""
    if headers.get(RECYCLING) or headers.get(NOT_STARTED):
        replica.drain(Drain.EVICT)  # it exits once its calls end: route nothing new to it
    if headers.get(NOT_STARTED):
        raise Unreachable(replica, "it is being replaced")


def _timeout(timeout: float) -> ApiError:
    return ApiError(504, "timeout", f"the replica did not answer within the function's timeout of {timeout:g} s")


def _url(replica: GatewayReplica, path: str, query: str = "") -> URL:
    """`path` (decoded by the router) quoted again; `query` exactly as the client sent it, not quoted twice."""
    url = URL.build(scheme="http", host=replica.host, port=replica.port, path=path)
    return URL(f"{url}?{query}", encoded=True) if query else url


def is_sse(reply: aiohttp.ClientResponse) -> bool:
    return reply.headers.get("content-type", "").startswith("text/event-stream")


async def call(
    client: aiohttp.ClientSession,
    replica: GatewayReplica,
    method: str,
    body: bytes | bytearray,
    timeout: float,
    trace: dict | None = None,
) -> Response | aiohttp.ClientResponse:
    """A function call: the replica's JSON reply (result or error) passed through with its status, or the open
    upstream reply for a `Relay`: a generator's stream of events, or a result over WHOLE_BODY (relayed as it comes,
    not read into the gateway's memory first: a function returning a gigabyte made the gateway hold one per call).
    `trace`: the trace context headers of this hop, when tracing is on."""
    limit = aiohttp.ClientTimeout(total=None, sock_connect=timeout + 5, sock_read=timeout + 5)
    try:
        headers = CALL_HEADERS | {CONTROL_HEADER: replica.control_secret or ""} | (trace or {})
        reply = await client.post(_url(replica, f"/__ember__/call/{method}"), data=HeldBody(body), headers=headers,
                                  timeout=limit, allow_redirects=False)
        large = reply.status == 200 and (reply.content_length is None or reply.content_length > WHOLE_BODY)
        stream = (is_sse(reply) or large) and not reply.headers.get(NOT_STARTED)
        try:
            _settle_replica(replica, reply.headers)
            if stream:
                return reply
            return Response(await reply.read(), status_code=reply.status, media_type="application/json")
        finally:
            if not stream:
                reply.release()
    except TimeoutError:
        raise _timeout(timeout) from None
    except aiohttp.ClientError as exc:
        raise _failure(replica, exc) from None


async def open_stream(
    client: aiohttp.ClientSession,
    replica: GatewayReplica,
    request: Request,
    path: str,
    body: bytes | bytearray,
    timeout: float,
    trace: dict | None = None,
    caller: str | None = None,
) -> aiohttp.ClientResponse:
    """Start forwarding `request` with the `body` the gateway read to the replica's ASGI app at `path`. `timeout`
    bounds the wait for each response chunk. `trace`, when tracing is on: this hop's trace context headers, which
    replace the client's. `caller`: the API key's id, named to the replica (a client's own header is dropped)."""
    headers = [(k, v) for k, v in request.headers.items() if k not in HOP_BY_HOP]
    if caller is not None:
        headers.append((CALLER_HEADER, caller))
    if trace is not None:
        headers = [(k, v) for k, v in headers if k not in trace and k not in TRACE_HEADERS] + list(trace.items())
    try:
        upstream = await client.request(
            request.method, _url(replica, path, request.scope["query_string"].decode("latin-1")), headers=headers,
            data=HeldBody(body) if body or request.method not in ("GET", "HEAD", "OPTIONS", "DELETE") else None,
            allow_redirects=False, timeout=aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=timeout),
        )
    except TimeoutError:
        raise _timeout(timeout) from None
    except aiohttp.ClientError as exc:
        raise _failure(replica, exc) from None
    if upstream.headers.get(NOT_STARTED):
        upstream.release()
    _settle_replica(replica, upstream.headers)
    return upstream


def _sse_error(type: str, message: str) -> dict:
    """The body message that ends an SSE stream with an error event."""
    error = json.dumps({"error": {"type": type, "message": message}})
    return {"type": "http.response.body", "body": f"event: error\ndata: {error}\n\n".encode(), "more_body": True}


def _client(scope: Scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "?"


class StallWatch:
    """Ends a stream whose client has taken none of it for `stall` seconds: a send pending that long. The relay marks
    each send's start and end (`since`); one timer, rearmed at most once per `stall`, checks, so no chunk pays for a
    timeout of its own."""

    def __init__(self, stall: float):
        self.stall = stall
        self.since: float | None = None  # when the send in progress began
        self.timer: asyncio.TimerHandle | None = None

    def start(self, loop: asyncio.AbstractEventLoop, cancel: Callable[[], object], say: Callable[[], None]) -> None:
        if math.isinf(self.stall):
            return

        def check() -> None:
            since, now = self.since, loop.time()
            left = self.stall if since is None else since + self.stall - now
            if left <= CLOCK_SLACK:  # uvloop's clock counts whole milliseconds: a timer may fire just before its time
                self.timer = None
                say()
                cancel()
                return
            self.timer = loop.call_later(left, check)

        self.timer = loop.call_later(self.stall, check)

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


class Relay(Response):
    """Streams an upstream response to the client as it arrives (SSE untouched, backpressure by awaiting
    each send); a client disconnect closes the upstream connection, which cancels the request there. So does a
    client that takes none of the reply's bytes for the gateway's send timeout (a reader that stalls, on purpose or
    not, would otherwise hold its replica slot for as long as it likes): its connection is dropped.
    An upstream that fails mid-stream ends an SSE stream with an `event: error`; other bodies are cut off.
    A small non-SSE reply of known length is read whole and sent in one piece, with no disconnect watch."""

    def __init__(
        self, upstream: aiohttp.ClientResponse, on_close: Callable[[], Awaitable[None]], meter: UsageMeter | None = None
    ):
        self.upstream, self.on_close, self.meter = upstream, on_close, meter
        self.closed = False
        self.cut = False  # ended by a stopping gateway, not by the replica
        self.status_code = upstream.status
        self.background = None
        self.sse = upstream.headers.get("content-type", "").startswith("text/event-stream")
        drop = REPLY_DROP | {b"content-length"} if self.sse else REPLY_DROP  # an SSE body may gain an error event
        self.raw_headers = [(k.lower(), v) for k, v in upstream.raw_headers if k.lower() not in drop]
        length = upstream.content_length
        self.whole = not self.sse and length is not None and length <= WHOLE_BODY

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.whole:
            return await self._send_whole(scope, receive, send)

        app_state = getattr(scope.get("app"), "state", None)
        stall = getattr(app_state, "send_timeout", None) or math.inf
        watch, loop = StallWatch(stall), asyncio.get_running_loop()

        async def pump() -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            try:
                async for chunk in self.upstream.content.iter_any():
                    if self.meter is not None:
                        self.meter.feed(chunk)
                    watch.since = loop.time()  # the send returns once the client's side drains
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    watch.since = None
            except aiohttp.ClientError as exc:
                if not self.cut:
                    log.warning("upstream failed mid-response: %s: %s", type(exc).__name__, exc)
                    if not self.sse:
                        raise
                    await send(_sse_error("replica_failed", f"the replica failed mid-stream ({type(exc).__name__}); "
                                                            "retry the request"))
            if self.cut and self.sse:
                await send(_sse_error("shutting_down", "the gateway is shutting down: this stream was cut short after "
                                                       "the grace period; retry it"))
            await self.close()  # before the client sees the end, so its next request finds the slot and tokens settled
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def watch_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        async def watch_stop(cut_short: asyncio.Event) -> None:
            """A stopping gateway's grace period ended: the stream ends here (for SSE with an error event), so the
            client sees a finished reply rather than a dropped connection."""
            await cut_short.wait()
            self.cut = True
            self.upstream.close()  # pump's read ends; it finishes the reply

        def stalled() -> None:
            log.warning("client %s took none of a streamed reply for %g s: dropped, its call cancelled "
                        "(--send-timeout)", _client(scope), stall)

        try:
            async with anyio.create_task_group() as group:
                async def first_done(job: Callable) -> None:
                    await job()
                    group.cancel_scope.cancel()

                group.start_soon(first_done, pump)
                group.start_soon(first_done, watch_disconnect)
                cut_short = getattr(app_state, "cut_short", None)
                if cut_short is not None:
                    group.start_soon(watch_stop, cut_short)
                watch.start(loop, group.cancel_scope.cancel, stalled)  # an unfinished reply: the server closes it
        except OSError:
            pass  # the client went away mid-send
        finally:
            watch.stop()
            await self.close()

    async def _send_whole(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            body = await self.upstream.read()
        except aiohttp.ClientError as exc:
            log.warning("upstream failed mid-response: %s: %s", type(exc).__name__, exc)
            await self.close()
            reply = error_response(
                502, "replica_failed", f"the replica failed mid-response ({type(exc).__name__}); retry the request"
            )
            return await reply(scope, receive, send)
        if self.meter is not None:
            self.meter.feed(body)
        await self.close()  # settled before the client has the reply, as for a stream
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            await send({"type": "http.response.body", "body": body})
        except OSError:
            pass  # the client went away

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.upstream.content.at_eof():
                self.upstream.release()  # read to the end: the connection goes back to the pool
            else:
                self.upstream.close()  # abandoned: closing the connection cancels the request on the replica
            await self.on_close()
