"""What the gateway reads of a request before it picks a replica: the body, counted against one size limit as it
arrives, a call's keyword arguments, an LLM request's token estimate and routing key, the X-Session-ID."""
import json
import re
from dataclasses import dataclass
from typing import AsyncIterator

from starlette.requests import Request

from ember.gateway.affinity import prefix_key, prompt_text
from ember.gateway.errors import ApiError
from ember.gateway.routing import SESSION, Forward
from ember.gateway.usage import OPENAI_PATHS, UsageMeter, estimate, max_tokens

MAX_BODY = 16 * 1024 * 1024
SESSION_ID = re.compile(r"[\x21-\x7e]{1,256}")  # printable ASCII: it only feeds a hash


def too_large(limit: int = MAX_BODY) -> ApiError:
    return ApiError(413, "body_too_large", f"request body is over {limit} bytes")


class CountedBody:
    """The client's body as it arrives, counted: past `limit` bytes it ends with a 413 (Content-Length alone is not
    trusted). `over` tells a caller that streamed it upstream why the upload stopped."""

    def __init__(self, request: Request, limit: int = MAX_BODY):
        self.request, self.limit, self.over = request, limit, False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        size = 0
        async for chunk in self.request.stream():
            size += len(chunk)
            if size > self.limit:
                self.over = True
                raise too_large(self.limit)
            yield chunk


async def read_body(request: Request) -> bytes:
    """The whole body, refused early when its declared length is already over the limit."""
    try:
        declared = int(request.headers.get("content-length") or 0)
    except ValueError:
        raise ApiError(400, "invalid_request", "Content-Length is not a number") from None
    if declared > MAX_BODY:
        raise too_large()
    return b"".join([chunk async for chunk in CountedBody(request)])


async def read_kwargs(request: Request) -> bytes:
    """The call's body, checked to be a JSON object of keyword arguments."""
    body = await read_body(request) or b"{}"
    try:
        kwargs = json.loads(body)
    except ValueError as exc:
        raise ApiError(400, "invalid_json", f"request body is not valid JSON: {exc}") from None
    if not isinstance(kwargs, dict):
        raise ApiError(422, "invalid_arguments",
                       f"request body must be a JSON object of keyword arguments, got {type(kwargs).__name__}")
    return body


def session_id(request: Request) -> str | None:
    """The routing key of X-Session-ID, if the request has one."""
    value = request.headers.get("x-session-id")
    if value is None:
        return None
    if not SESSION_ID.fullmatch(value):
        raise ApiError(400, "invalid_session_id", "X-Session-ID must be 1-256 printable ASCII characters without spaces")
    return SESSION + value


@dataclass
class LlmRequest:
    """An OpenAI completion POST as the gateway holds it: the bytes forwarded as read, their token estimate for the
    rate limits, the meter that counts what the reply really used, and the routing key."""

    body: bytes | None
    tokens: int
    meter: UsageMeter | None
    affinity: str | None


async def read_llm(request: Request, target: Forward, session: str | None) -> LlmRequest:
    """Read only an OpenAI completion POST; any other request to an ASGI endpoint streams through unread."""
    if request.method != "POST" or target.path not in OPENAI_PATHS:
        return LlmRequest(None, 0, None, session)
    body = await read_body(request)
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):  # the engine answers it with its own 400
        return LlmRequest(body, 0, None, session)
    tokens = estimate(parsed)
    return LlmRequest(body, tokens, UsageMeter(tokens - max_tokens(parsed)), session or prefix_key(prompt_text(parsed)))
