"""What the gateway reads of a request before it picks a replica: the whole body, counted against one size limit, a
time limit and the gateway's in-flight byte budget as it arrives; a call's keyword arguments, an LLM request's token
estimate and routing key, the X-Session-ID."""
import asyncio
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from starlette.requests import Request

from ember.gateway.affinity import prefix_key, prompt_text
from ember.gateway.errors import ApiError
from ember.gateway.inflight import BodyBudget
from ember.gateway.routing import SESSION, Forward
from ember.gateway.usage import OPENAI_PATHS, UsageMeter, estimate, max_tokens, sequences
from ember.runtime.call_body import BadCallBody, keyword_arguments, plain_encoding

MAX_BODY = 16 * 1024 * 1024
# Bytes of JSON the event loop parses itself (well under a millisecond). 14 MB of small messages took 0.57 s to parse
# and estimate, in which the gateway served no one else: a larger LLM request is estimated in a thread (json.loads
# holds the GIL throughout, the estimate lets go between bytecodes), and a larger call body is left for the replica
# to check (runtime/call_body.py, the same errors), on the caller's replica's time rather than everyone's gateway's.
PARSE_INLINE = 64 << 10
T = TypeVar("T")
SESSION_ID = re.compile(r"[\x21-\x7e]{1,256}")  # printable ASCII: it only feeds a hash


def too_large(limit: int = MAX_BODY) -> ApiError:
    return ApiError(413, "body_too_large", f"request body is over {limit} bytes")


async def read_body(request: Request, budget: BodyBudget) -> bytearray:
    """The whole body, within MAX_BODY and the budget's read timeout. Its bytes are taken from the gateway's body
    budget before they are read: all its Content-Length at once, into one buffer of that size filled in place; a
    chunked body as it grows (Content-Length alone is not trusted: h11 ends the body there). The bytes taken are in
    request.state.body_held."""
    try:
        declared = int(request.headers.get("content-length") or 0)
    except ValueError:
        raise ApiError(400, "invalid_request", "Content-Length is not a number") from None
    if declared > MAX_BODY:
        raise too_large()
    request.state.body_held = 0
    await budget.take(declared)  # may wait, its body unread, while the budget is full
    request.state.body_held = declared
    body, filled = bytearray(declared), 0
    try:
        async with asyncio.timeout(budget.read_timeout):
            async for chunk in request.stream():
                end = filled + len(chunk)
                if end > MAX_BODY:
                    raise too_large()
                if end <= declared:
                    body[filled:end] = chunk
                else:  # chunked
                    await budget.take(end - request.state.body_held)
                    request.state.body_held = end
                    body += chunk
                filled = end
    except TimeoutError:
        raise ApiError(408, "body_timeout", f"the request body did not arrive within {budget.read_timeout:g} s "
                       "(--body-timeout)") from None
    return body


async def read_kwargs(request: Request, budget: BodyBudget) -> bytes | bytearray:
    """The call's body, checked to be a JSON object of keyword arguments when small (see PARSE_INLINE); forwarded as
    read."""
    try:
        plain_encoding(request.headers.get("content-encoding"))
    except BadCallBody as exc:
        raise ApiError(exc.status, exc.type, exc.message) from None
    body = await read_body(request, budget) or b"{}"
    if len(body) > PARSE_INLINE:
        return body
    try:
        keyword_arguments(body)
    except BadCallBody as exc:
        raise ApiError(exc.status, exc.type, exc.message) from None
    return body


def session_id(request: Request) -> str | None:
    """The routing key of X-Session-ID, if the request has one."""
    value = request.headers.get("x-session-id")
    if value is None:
        return None
    if not SESSION_ID.fullmatch(value):
        raise ApiError(
            400, "invalid_session_id", "X-Session-ID must be 1-256 printable ASCII characters without spaces"
        )
    return SESSION + value


@dataclass
class ForwardRequest:
    """A request for an ASGI endpoint as the gateway holds it: its body (read whole before it takes a replica slot)
    and, for an OpenAI completion POST, its token estimate for the rate limits, the meter that counts what the reply
    really used, the routing key, and the replica slots it takes (one per sequence the engine runs for it)."""

    body: bytes | bytearray  # bytearray: read in place into a buffer of its Content-Length
    tokens: int
    meter: UsageMeter | None
    affinity: str | None
    slots: int = 1


async def read_forward(request: Request, target: Forward, session: str | None, budget: BodyBudget) -> ForwardRequest:
    declares_body = "content-length" in request.headers or "transfer-encoding" in request.headers
    body = await read_body(request, budget) if declares_body else b""
    if request.method != "POST" or target.path not in OPENAI_PATHS:
        return ForwardRequest(body, 0, None, session)
    usage = await off_loop(_completion_usage, body)
    if usage is None:  # the engine answers it with its own 400
        return ForwardRequest(body, 0, None, session)
    tokens, prompt_tokens, key, slots = usage
    return ForwardRequest(body, tokens, UsageMeter(prompt_tokens), session or key, slots)


def _completion_usage(body: bytes | bytearray) -> tuple[int, int, str | None, int] | None:
    """An OpenAI completion request's token estimate (prompt and output), its prompt's, its routing key and the
    sequences it runs; None for a body that is not a JSON object."""
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(parsed, dict):
        return None
    tokens = estimate(parsed)
    return tokens, tokens - max_tokens(parsed), prefix_key(prompt_text(parsed)), sequences(parsed)


async def off_loop(work: Callable[[bytes | bytearray], T], body: bytes | bytearray) -> T:
    """`work(body)`, in a thread when the body is large (see PARSE_INLINE)."""
    if len(body) <= PARSE_INLINE:
        return work(body)
    return await asyncio.to_thread(work, body)
