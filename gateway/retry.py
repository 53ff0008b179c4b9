"""Sending a request to a replica: a slot from the function's queue, then the request, sent once more to another
hot replica when the first failed before its first response byte. Each attempt is a CLIENT span when tracing is on."""
import dataclasses
import logging
from typing import Awaitable, Callable, TypeVar

import aiohttp
from starlette.requests import Request
from starlette.responses import Response

from ember.gateway import proxy
from ember.gateway.body import MAX_BODY
from ember.gateway.deployment import Unit
from ember.gateway.queue import Lease
from ember.gateway.replica import Replica
from ember.gateway.routing import Call, Forward
from ember.gateway.settlement import Settlement
from ember.gateway.usage import UsageMeter
from ember.runtime.tracing import ClientSpan

log = logging.getLogger("ember.gateway")

Reply = TypeVar("Reply", Response, aiohttp.ClientResponse)  # a call's whole reply, or a stream's head


async def send_with_retry(unit: Unit, lease: Lease, key: str | None, retryable: bool,
                          send: Callable[[Replica, dict | None], Awaitable[Reply]]) -> tuple[Reply, Lease]:
    """`send(replica, trace_headers)`; a replica that fails before its first response byte is retried once on another
    hot one. The lease's slot is released on failure; on success the caller owns it."""
    while True:
        replica = lease.replica
        try:
            with ClientSpan("replica", {"ember.replica.id": replica.id, "ember.attempt": lease.attempt,
                                        "server.address": replica.host, "server.port": replica.port},
                            carry={"x-ember-replica": replica.id}) as hop:
                reply = await send(replica, hop.headers)
                hop.reply(reply.status_code if isinstance(reply, Response) else reply.status)
            return reply, lease
        except proxy.Unreachable as exc:
            unit.queue.release(replica)
            retry = unit.queue.try_acquire(key, frozenset({replica.id})) if retryable and lease.attempt == 1 else None
            if retry is None:
                raise exc.error from None
            log.warning("replica %s failed before answering (%s); retrying on %s", replica.id, exc.error.message,
                        retry.replica.id)
            lease = dataclasses.replace(lease, replica=retry.replica, attempt=2)
        except BaseException:
            unit.queue.release(replica)
            raise


async def call(request: Request, unit: Unit, target: Call, body: bytes, key: str | None) -> tuple[Response, Lease]:
    """A function call: its slot is free again once the whole reply is here."""
    client = request.app.state.client
    response, lease = await send_with_retry(
        unit, await unit.queue.acquire(key), key, True,
        lambda replica, trace: proxy.call(client, replica, target.method, body, unit.spec.timeout, trace))
    unit.queue.release(lease.replica)
    return response, lease


async def forward(request: Request, unit: Unit, target: Forward, body: bytes | None, key: str | None,
                  meter: UsageMeter | None, settle: Settlement) -> tuple[Response, Lease]:
    """To the app's ASGI endpoint; the replica slot and rate-limit charge are held until the streamed response ends.
    Only a body the gateway holds (read for an LLM request, or none for GET/HEAD) can be sent twice."""
    client = request.app.state.client
    held = body is not None or request.method in ("GET", "HEAD", "OPTIONS", "DELETE")
    upstream, lease = await send_with_retry(
        unit, await unit.queue.acquire(key), key, held,
        lambda replica, trace: proxy.open_stream(client, replica, request, target.path, body, unit.spec.timeout,
                                                 MAX_BODY, trace))

    async def close() -> None:
        unit.queue.release(lease.replica)
        await settle()

    settle.hold()
    return proxy.Relay(upstream, close, meter), lease
