"""Sending a request to a replica: a slot from the function's queue, then the request, at most once unless it never
reached a replica's code or the function's `retries=` allows more. Each attempt is a CLIENT span when tracing is on.

Retries live here, in the gateway, rather than in the worker: a lost replica cannot retry its own call, the gateway
can send the retry to another replica and free the slot during the backoff, and one place counts them for /metrics.
Only a call that did not succeed is run again: the function raised (the worker's 500 `function_error`) or its
replica was lost mid-call; a result, a timeout or a bad request is final."""
import asyncio
import dataclasses
import functools
import json
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import aiohttp
from starlette.requests import Request
from starlette.responses import Response

from ember.gateway import proxy
from ember.gateway.deployment import Unit
from ember.gateway.errors import ApiError
from ember.gateway.queue import Lease, Retired
from ember.gateway.replica import GatewayReplica
from ember.gateway.routing import Call, Forward
from ember.gateway.settlement import Settlement
from ember.gateway.usage import UsageMeter
from ember.runtime import logs
from ember.runtime.tracing import ClientSpan

log = logging.getLogger("ember.gateway")

Reply = TypeVar("Reply", bound=Response | aiohttp.ClientResponse)  # a call's whole reply, or a stream's head
REPLICA_LOST, FUNCTION_ERROR = "replica_lost", "function_error"  # why a call ran again, as /metrics counts it


@dataclasses.dataclass
class RetryBudget:
    """The retries one call has left under its function's `retries=`; each one taken is reported to `on_retry`."""

    left: int
    on_retry: Callable[[str], None]

    def take(self, reason: str) -> bool:
        if self.left <= 0:
            return False
        self.left -= 1
        self.on_retry(reason)
        return True


async def send_with_retry(unit: Unit, lease: Lease, key: str | None,
                          send: Callable[[GatewayReplica, dict | None], Awaitable[Reply]],
                          budget: RetryBudget) -> tuple[Reply, Lease]:
    """`send(replica, trace_headers)`, at most once by default: a request that never reached a replica's code
    (no connection, or refused before it started) is sent once more to another hot replica; one whose replica failed
    after it arrived is sent again only while the call's retry `budget` lasts. The lease's slot is released on
    failure; on success the caller owns it."""
    unreached = 1  # a request that reached no code may go elsewhere once, outside the budget
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
            unit.queue.release(replica, lease.slots)
            allowed = unreached > 0 if isinstance(exc, proxy.Unreachable) else budget.left > 0
            retry = unit.queue.try_acquire(key, frozenset(tried), lease.slots) if allowed else None
            if retry is None:
                raise exc.error from None
            if isinstance(exc, proxy.Unreachable):
                unreached -= 1
            else:
                budget.take(REPLICA_LOST)
            log.warning("%s; sending it to %s", exc.error.message, retry.replica.id)
            lease = dataclasses.replace(lease, replica=retry.replica, attempt=lease.attempt + 1)
            tried.add(retry.replica.id)
        except BaseException:
            unit.queue.release(replica, lease.slots)
            raise


async def acquire(unit: Unit, method: str | None, key: str | None, caller: str | None,
                  sequences: int = 1) -> tuple[Unit, Lease]:
    """Slots for a call to `unit` (`method` of it, or None for its ASGI app) that runs `sequences` at once. A call
    that reaches the queue of a version a redeploy replaced goes to the same function of the version that replaced
    it: it was sent nowhere yet. The unit whose slots it holds, and its lease of them."""
    while True:
        try:
            return unit, await unit.queue.acquire(key, caller, sequences)
        except Retired:
            unit = successor(unit, method)


def successor(unit: Unit, method: str | None) -> Unit:
    """What replaced `unit` and serves `method`, else an error saying what the new version lacks."""
    new = unit.successor
    serves = new is not None and (new.asgi if method is None else method in new.methods)
    if new is None or not serves:
        what = f"function {unit.name!r}" if method is None or unit.kind == "function" else f"{unit.name}.{method}"
        raise ApiError(404, "not_found", f"app {unit.app!r} was redeployed while this call waited, and its new "
                                         f"version has no {what}; `ember status` lists what it serves")
    return new


def raised(reply: Response) -> bool:
    """Whether the worker answered that the function raised."""
    if reply.status_code != 500:
        return False
    try:
        return json.loads(bytes(reply.body))["error"]["type"] == FUNCTION_ERROR
    except (ValueError, KeyError, TypeError):
        return False


async def call(client: aiohttp.ClientSession, unit: Unit, target: Call, body: bytes | bytearray, key: str | None,
               settle: Settlement, on_retry: Callable[[str], None],
               caller: str | None = None) -> tuple[Response, Lease]:
    """A function call: its slot and rate-limit charge are free again once the whole reply is here, or, for a
    generator's events, once the relayed stream ends. A call whose function raised runs again after the backoff
    of the function's `retries=`, with no slot held while it waits."""
    policy = unit.spec.retry_policy
    budget, attempts = RetryBudget(policy.max_retries, on_retry), 0
    while True:
        unit, lease = await acquire(unit, target.method, key, caller)
        lease = dataclasses.replace(lease, attempt=attempts + 1)
        reply, lease = await send_with_retry(
            unit, lease, key,
            functools.partial(call_on, client, target.method, body, unit.spec.timeout), budget)
        attempts = lease.attempt
        if isinstance(reply, aiohttp.ClientResponse) or not raised(reply) or not budget.take(FUNCTION_ERROR):
            break
        unit.queue.release(lease.replica, lease.slots)
        delay = policy.delay(policy.max_retries - budget.left)
        log.warning("%s/%s raised on attempt %d; running it again in %.3g s", unit.app, target.method, attempts,
                    delay)
        await asyncio.sleep(delay)
    if isinstance(reply, aiohttp.ClientResponse):
        async def close() -> None:
            unit.queue.release(lease.replica, lease.slots)
            await settle()

        settle.hold()
        return proxy.Relay(reply, close), lease
    unit.queue.release(lease.replica, lease.slots)
    await settle()
    return reply, lease


def call_on(client: aiohttp.ClientSession, method: str, body: bytes | bytearray, timeout: float,
            replica: GatewayReplica, trace: dict | None) -> Awaitable[Response | aiohttp.ClientResponse]:
    """proxy.call with the replica and trace headers last, as send_with_retry passes them."""
    return proxy.call(client, replica, method, body, timeout, trace)


async def forward(request: Request, unit: Unit, target: Forward, body: bytes | bytearray, key: str | None,
                  meter: UsageMeter | None, settle: Settlement, on_retry: Callable[[str], None],
                  caller: str | None = None, sequences: int = 1) -> tuple[Response, Lease]:
    """To the app's ASGI endpoint, with the body the gateway read before it took its slots (one per sequence the
    request runs, see FunctionQueue); they and the rate-limit charge are held until the streamed response ends.
    Only a lost replica is retried: an ASGI reply has no sign that the function raised."""
    client = request.app.state.client
    unit, lease = await acquire(unit, None, key, caller, sequences)
    upstream, lease = await send_with_retry(
        unit, lease, key,
        lambda replica, trace: proxy.open_stream(client, replica, request, target.path, body, unit.spec.timeout,
                                                 trace, caller),
        RetryBudget(unit.spec.retry_policy.max_retries, on_retry))

    async def close() -> None:
        unit.queue.release(lease.replica, lease.slots)
        await settle()

    settle.hold()
    return proxy.Relay(upstream, close, meter), lease
