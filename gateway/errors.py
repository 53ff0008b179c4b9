"""Every error a client sees is JSON {"error": {"type", "message"}}, never a traceback."""
import difflib
import logging
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ember.gateway.database import DatabaseError
from ember.runtime.unhandled import ReplyOnError

log = logging.getLogger("ember.gateway")


class ApiError(Exception):
    def __init__(self, status: int, type: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.type, self.message, self.headers = status, type, message, headers or {}


class UnknownField(ValueError):
    """A request body names a field its model does not have (raised by the model's validator)."""

    def __init__(self, name: str, known: list[str]):
        near = difflib.get_close_matches(name, known, n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        super().__init__(f"unknown field {name[:100]!r} in the request body; {hint}fields are {', '.join(known)}")


def error_response(status: int, type: str, message: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"type": type, "message": message}}, status_code=status, headers=headers)


HTTP_TYPES = {404: "not_found", 405: "method_not_allowed", 401: "unauthorized"}


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.type, exc.message, exc.headers)

    @app.exception_handler(DatabaseError)
    async def database_error(request: Request, exc: DatabaseError) -> JSONResponse:
        log.error("database: %s", exc.message)
        return error_response(exc.status, exc.type, exc.message, {"Retry-After": "1"} if exc.status == 503 else None)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return error_response(
            exc.status_code, HTTP_TYPES.get(exc.status_code, "http_error"), str(exc.detail), exc.headers
        )

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        unknown = [e["ctx"]["error"] for e in exc.errors() if isinstance(e.get("ctx", {}).get("error"), UnknownField)]
        if unknown:
            return error_response(400, "unknown_field", str(unknown[0]))
        return error_response(
            422, "invalid_request", "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        )

    def internal_error(exc: Exception) -> JSONResponse:
        return error_response(500, "internal_error", "the gateway hit an unexpected error; see its log")

    app.add_middleware(ReplyOnError, log=log, reply=internal_error)  # a client's keep-alive connection stays open

    @app.exception_handler(Exception)  # an error outside it (in a middleware added after it): JSON all the same
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return internal_error(exc)
