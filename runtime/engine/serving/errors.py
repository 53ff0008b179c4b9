"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}}."""
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ember.runtime.unhandled import ReplyOnError


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type


def error_response(status: int, message: str, type: str = "invalid_request_error", param=None, code=None):
    body = {"error": {"message": _encodable(message), "type": type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def _encodable(text: str) -> str:
    """`text` with any lone UTF-16 surrogate (a request's own, quoted back: a model name of "\\ud800") written as
    its escape, which UTF-8 can carry; the reply would otherwise fail to encode and become a 500."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def internal_errors(app: FastAPI, log: logging.Logger) -> None:
    """An exception no handler took becomes a JSON 500 naming it, inside the app, so the gateway's keep-alive
    connection stays open (runtime/unhandled.py); add it after the app's other middleware and handlers."""
    def internal_error(e: Exception) -> JSONResponse:
        return error_response(500, f"internal error: {type(e).__name__}: {e}", "server_error")

    app.add_middleware(ReplyOnError, log=log, reply=internal_error)

    @app.exception_handler(Exception)  # an error outside it (a middleware added after it): JSON all the same
    async def unhandled(request: Request, e: Exception):
        return internal_error(e)


def openai_errors(app: FastAPI) -> None:
    """Every error of `app` in OpenAI's shape: its own APIErrors, a body that fails validation (400 naming the
    parameter, as OpenAI answers, not FastAPI's 422) and Starlette's 404/405."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return error_response(e.status, e.message, e.type, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, e: RequestValidationError):
        first = e.errors()[0]
        if first.get("type") == "json_invalid":
            return error_response(400, f"The request body is not valid JSON: {first.get('ctx', {}).get('error', '')}",
                                  code="invalid_json")
        param = ".".join(str(part) for part in first.get("loc", ()) if part != "body") or None
        reason = first["msg"].removeprefix("Value error, ")
        message = f"Invalid '{param}': {reason}" if param else f"Invalid request body: {reason}"
        return error_response(400, message, param=param, code="invalid_value")

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        if e.status_code == 400 and e.detail == "There was an error parsing the body":  # FastAPI's, for a body
            return error_response(400, "The request body is not valid JSON: it must be UTF-8 text, its arrays and "
                                  "objects nested at most a few hundred deep", code="invalid_json")  # json.loads fails
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(e.status_code, f"{request.method} {request.url.path}: {e.detail}", kind)
