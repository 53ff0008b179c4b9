"""An exception a route lets through becomes its app's 500 reply inside the app, so the connection stays open.

Starlette hands an exception nobody handled to the app's handler for `Exception` and then raises it again, for the
server to log; uvicorn then closes the connection. Behind the gateway that connection is a pooled keep-alive one,
and the gateway's next call on it, from another client, fails. `ReplyOnError` catches the exception below that
point: it logs it and sends `reply(exc)`. Wrapped around a whole app instead (a user's FastAPI app, whose own
Starlette replied 500 and re-raised), it logs an exception raised after a complete reply and lets the connection be.
Once a response has started but not finished (a stream that broke midway) nothing can be sent any more, and the
exception goes on up, so that the server cuts the connection and the client sees the stream end short rather than
end cleanly."""
import logging
from collections.abc import Callable

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class ReplyOnError:
    def __init__(self, app: ASGIApp, reply: Callable[[Exception], Response], log: logging.Logger):
        self.app, self.reply, self.log = app, reply, log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = complete = False

        async def sending(message: Message) -> None:
            nonlocal started, complete
            started = started or message["type"] == "http.response.start"
            complete = complete or message["type"] == "http.response.body" and not message.get("more_body", False)
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as exc:
            if started and not complete:
                raise
            self.log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if not started:
                await self.reply(exc)(scope, receive, send)
