"""The gateway's client connections, guarded the way Envoy and nginx guard theirs: a request's headers must arrive
within the header timeout, and the connections held at once are capped below the file-descriptor limit. At the cap a new
connection is still taken (a health check or a normal client sends its headers at once); to make room, the
connection that has waited longest for its headers is closed, so slow-header clients only ever push out each other.
HTTP parse errors answer JSON like every other error: 431 when the request line and headers are too large. A reply
sent before its request's body was read (413, 401, 503 busy) leaves the client still sending: the rest is read and
dropped, within the body timeout, and the connection goes on (closing with input unread would reset it, and the
client would lose the reply). Where the connection must close after that reply (`Connection: close`, HTTP/1.0), the
close waits until the client has stopped sending for LINGER seconds (nginx's lingering close), LINGER_MAX (or the
body timeout, if shorter) at most.

`ember serve` hands `GuardedH11` to uvicorn as its HTTP protocol (gateway/serve.py)."""
import asyncio
import json
import logging
import resource
import weakref
from typing import cast

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from ember.gateway import memory
from ember.gateway.header_limit import MAX_HEADER_BYTES

log = logging.getLogger("ember.gateway")

LINGER = 1.0  # seconds an error reply's connection stays open, its input read and dropped
LINGER_MAX = 30.0  # seconds a closing connection reads a refused body at most (nginx's lingering_time)
FD_RESERVE = 512  # descriptors kept for replicas' sockets, log files and the database
STORM = 256  # connections at once that count as a storm: when they are down to a quarter, freed memory is handed back


def connection_cap(configured: int | None) -> int:
    """`configured` (--max-connections), else what the descriptor limit allows after FD_RESERVE (the soft limit is
    raised to the hard one first)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return configured or max(64, soft - FD_RESERVE)


class Guard:
    """The connections of one server and those still waiting for a request's headers, oldest first."""

    def __init__(self, cap: int, header_timeout: float, body_timeout: float):
        self.cap, self.header_timeout, self.body_timeout = cap, header_timeout, body_timeout
        self.open = 0
        self.peak = 0  # most connections at once since memory was last handed back
        self.waiting: dict[GuardedH11, None] = {}  # insertion-ordered: the first waited longest
        self.evicted = self.timed_out = 0  # counts, for the log and bench/hostile.py

    def storm_over(self) -> None:
        """After a storm of connections, their TLS and protocol objects are freed, but the small blocks they leave
        scattered through glibc's heaps stay with the process (2,000 slow TLS clients kept ~350 MiB): trim them."""
        if self.peak >= STORM and self.open <= self.peak // 4:
            memory.trim()
            self.peak = self.open

    def make_room(self) -> None:
        """Over the cap: close the connections that have waited longest for their headers."""
        while self.open > self.cap and self.waiting:
            oldest = next(iter(self.waiting))
            self.evicted += 1
            oldest.close("evicted: the gateway is at its connection cap and this one had sent no full request")


class GuardedH11(H11Protocol):
    guard: Guard  # set by `protocol()`: one per server

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.header_timer: asyncio.TimerHandle | None = None
        self.discarding = False  # an error reply went out: what the client still sends is read and dropped
        self.drain_timer: asyncio.TimerHandle | None = None  # the rest of an answered request's body is arriving

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.raw_transport = transport
        self.transport = cast(asyncio.Transport, Lingering(transport, self))  # what uvicorn's cycles close
        self.linger_timer: asyncio.TimerHandle | None = None
        self.last_input = 0.0
        self.guard.open += 1
        self.guard.peak = max(self.guard.peak, self.guard.open)
        self._await_headers()
        self.guard.make_room()

    def connection_lost(self, exc) -> None:
        self.guard.open -= 1
        self._headers_done()
        for timer in (self.drain_timer, self.linger_timer):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)
        self.guard.storm_over()

    def data_received(self, data: bytes) -> None:
        if self.discarding:
            self.last_input = self.loop.time()
            return
        cycle = self.cycle
        answered = cycle is not None and cycle.response_complete
        if answered and self.conn.their_state is h11.SEND_BODY:  # the body of a request answered before it was read
            self._drain()
        elif answered or cycle is None:
            if self.header_timer is None:
                self._await_headers()  # the first bytes of the next request on a kept-alive connection
        super().data_received(data)  # h11 drops body data that comes after the reply
        if self.cycle is not cycle:  # h11 produced a new request: its headers are all here
            self._headers_done()
        if self.drain_timer is not None and self.conn.their_state is not h11.SEND_BODY:  # the refused body is in
            self.drain_timer.cancel()
            self.drain_timer = None
            if self.cycle is cycle and not self.transport.is_closing():
                self._await_headers()  # the next request's headers, from now

    def _drain(self) -> None:
        if self.drain_timer is None:
            self.drain_timer = self.loop.call_later(
                self.guard.body_timeout, self.close,
                f"the rest of a refused request body did not arrive within {self.guard.body_timeout:g} s")

    def _await_headers(self) -> None:
        self.guard.waiting[self] = None
        self.header_timer = self.loop.call_later(self.guard.header_timeout, self._header_timeout)

    def _headers_done(self) -> None:
        self.guard.waiting.pop(self, None)
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def _header_timeout(self) -> None:
        self.header_timer = None
        self.guard.timed_out += 1
        self.close(f"no full request headers within {self.guard.header_timeout:g} s")

    def close(self, why: str) -> None:
        self._headers_done()
        if not self.raw_transport.is_closing():
            log.debug("closing connection from %s: %s", self.client, why)
            self.raw_transport.close()

    def close_after_input(self) -> None:
        """A close asked for while the client still sends the body of a request already answered: read and drop
        what comes until it has been quiet for LINGER seconds (LINGER_MAX at most), then close."""
        if self.conn.their_state is not h11.SEND_BODY or self.raw_transport.is_closing() or self.discarding:
            if not self.discarding:
                self.raw_transport.close()
            return
        self.discarding = True
        self.raw_transport.resume_reading()
        self.last_input = self.loop.time()
        deadline = self.last_input + min(self.guard.body_timeout, LINGER_MAX)

        def check() -> None:
            quiet_until = self.last_input + LINGER
            if self.loop.time() >= min(quiet_until, deadline):
                self.close("the answered request's body stopped coming")
            else:
                self.linger_timer = self.loop.call_at(min(quiet_until, deadline), check)

        self.linger_timer = self.loop.call_later(LINGER, check)

    def send_400_response(self, msg: str) -> None:
        """h11 could not parse the request: JSON, as every error; 431 when its headers overflowed h11's buffer."""
        too_large = len(self.conn.trailing_data[0]) >= MAX_HEADER_BYTES
        if too_large:
            status, kind, message = 431, "headers_too_large", \
                f"request line and headers must stay under {MAX_HEADER_BYTES} bytes"
        else:
            status, kind, message = 400, "invalid_http", "the request is not valid HTTP/1.1"
        body = json.dumps({"error": {"type": kind, "message": message}}).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                   (b"content-length", str(len(body)).encode())]
        try:
            self.transport.write(self.conn.send(h11.Response(status_code=status, headers=headers)))
            self.transport.write(self.conn.send(h11.Data(data=body)))
            self.transport.write(self.conn.send(h11.EndOfMessage()))
        except h11.LocalProtocolError:  # h11 is in an error state from the bad request: write the reply raw
            reason = b"Request Header Fields Too Large" if too_large else b"Bad Request"
            raw = b"".join(k + b": " + v + b"\r\n" for k, v in headers)
            self.transport.write(b"HTTP/1.1 %d %s\r\n%s\r\n%s" % (status, reason, raw, body))
        # Close a moment later, reading meanwhile: closing with unread input resets the connection, and the client,
        # still sending its headers, would lose the reply (nginx's lingering close).
        self._headers_done()
        self.discarding = True
        self.loop.call_later(LINGER, self.close, "unparseable request")


class Lingering:
    """The connection's transport as uvicorn sees it: a close while the client still sends a body becomes
    GuardedH11.close_after_input; everything else goes straight through."""

    def __init__(self, transport: asyncio.Transport, protocol: GuardedH11):
        # A weak reference: the protocol holds this, and a cycle would keep every closed connection's objects (TLS
        # buffers included) until the garbage collector ran, not free them when the connection ends.
        self._transport, self._protocol = transport, weakref.ref(protocol)

    def close(self) -> None:
        protocol = self._protocol()
        if protocol is None:
            self._transport.close()
        else:
            protocol.close_after_input()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


def protocol(cap: int | None, header_timeout: float, body_timeout: float) -> type[GuardedH11]:
    """A GuardedH11 class with a Guard of its own, for one uvicorn server."""
    return type("GatewayH11", (GuardedH11,), {"guard": Guard(connection_cap(cap), header_timeout, body_timeout)})
