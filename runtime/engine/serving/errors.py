"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}}."""

from fastapi.responses import JSONResponse


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type


def error_response(status: int, message: str, type: str = "invalid_request_error", param=None, code=None):
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)
