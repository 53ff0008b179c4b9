"""Sending a request to a replica: a slot from the function's queue, then the request, at most once unless it never
reached a replica's code or the function's `retries=` allows more. Each attempt is a CLIENT span when tracing is on."""
import dataclasses
import logging
from typing import Awaitable, Callable, TypeVar

import aiohttp
from starlette.requests import Request
from starlette.responses import Response

from ember.gateway import proxy
from ember.gateway.deployment import Unit
from ember.gateway.queue import Lease
from ember.gateway.replica import GatewayReplica
from ember.gateway.routing import Call, Forward
from ember.gateway.settlement import Settlement
from ember.gateway.usage import UsageMeter
from ember.runtime import logs
from ember.runtime.tracing import ClientSpan

log = logging.getLogger("ember.gateway")

Reply = TypeVar("Reply", Response, aiohttp.ClientResponse)  # a call's whole reply, or a stream's head


async def send_with_retry(unit: Unit, lease: Lease, key: str | None,
                          send: Callable[[GatewayReplica, dict | None], Awaitable[Reply]]) -> tuple[Reply, Lease]:
    """`send(replica, trace_headers)`, at most once by default: a request that never reached a replica's code
    (no connection, or refused before it started) is sent once more to another hot replica; one whose replica failed
    after it arrived is sent again only as often as the function's `retries=` allows. The lease's slot is released on
    failure; on success the caller owns it."""
    unreached, failed = 1, unit.spec.retries  # further attempts each kind of failure allows
    tried = {lease.replica.id}
    while True:
        replica = lease.replica
        try:
            with ClientSpan("replica", {"ember.replica.id": replica.id, "ember.attempt": lease.attempt,
                                        "server.address": replica.host, "server.port": replica.port},
                            carry={"x-ember-replica": replica.id, **logs.request_id_header()}) as hop:
                reply = await send(replica, hop.headers or logs.outgoing_headers())  # ids ride along untraced too
                hop.reply(reply.status_code if isinstance(reply, Response) else reply.status)
            return reply, lease
        except (proxy.Unreachable, proxy.ReplicaFailed) as exc:
            unit.queue.release(replica)
            allowed = unreached if isinstance(exc, proxy.Unreachable) else failed
            retry = unit.queue.try_acquire(key, frozenset(tried)) if allowed > 0 else None
            if retry is None:
                raise exc.error from None
            if isinstance(exc, proxy.Unreachable):
                unreached -= 1
            else:
                failed -= 1
            log.warning("%s; sending it to %s", exc.error.message, retry.replica.id)
            lease = dataclasses.replace(lease, replica=retry.replica, attempt=lease.attempt + 1)
            tried.add(retry.replica.id)
        except BaseException:
            unit.queue.release(replica)
            raise


async def call(client: aiohttp.ClientSession, unit: Unit, target: Call, body: bytes, key: str | None,
               settle: Settlement) -> tuple[Response, Lease]:
    """A function call: its slot and rate-limit charge are free again once the whole reply is here, or, for a
    generator's events, once the relayed stream ends."""
    reply, lease = await send_with_retry(
        unit, await unit.queue.acquire(key), key,
        lambda replica, trace: proxy.call(client, replica, target.method, body, unit.spec.timeout, trace))
    if isinstance(reply, aiohttp.ClientResponse):
        async def close() -> None:
            unit.queue.release(lease.replica)
            await settle()

        settle.hold()
        return proxy.Relay(reply, close), lease
    unit.queue.release(lease.replica)
    await settle()
    return reply, lease


async def forward(request: Request, unit: Unit, target: Forward, body: bytes, key: str | None,
                  meter: UsageMeter | None, settle: Settlement) -> tuple[Response, Lease]:
    """To the app's ASGI endpoint, with the body the gateway read before it took the slot; the replica slot and
    rate-limit charge are held until the streamed response ends."""
    client = request.app.state.client
    upstream, lease = await send_with_retry(
        unit, await unit.queue.acquire(key), key,
        lambda replica, trace: proxy.open_stream(client, replica, request, target.path, body, unit.spec.timeout,
                                                 trace))

    async def close() -> None:
        unit.queue.release(lease.replica)
        await settle()

    settle.hold()
    return proxy.Relay(upstream, close, meter), lease
