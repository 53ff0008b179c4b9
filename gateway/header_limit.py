"""431 for requests whose headers are too large, before any route runs (uvicorn's httptools parser sets no limit)."""
from starlette.types import ASGIApp, Receive, Scope, Send

from ember.gateway.errors import error_response

MAX_HEADER_BYTES = 32 * 1024
MAX_HEADERS = 100


class HeaderLimit:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = scope["headers"]
            size = sum(len(k) + len(v) + 4 for k, v in headers) + len(scope.get("raw_path") or b"")
            if size > MAX_HEADER_BYTES or len(headers) > MAX_HEADERS:
                response = error_response(
                    431,
                    "headers_too_large",
                    f"request line and headers must stay under {MAX_HEADER_BYTES} bytes and {MAX_HEADERS} fields",
                )
                return await response(scope, receive, send)
        await self.app(scope, receive, send)
