"""A call's body: a JSON object of keyword arguments. The gateway checks it before it queues a call, the worker
again for whoever reaches it directly (`ember run`); both answer the same errors."""
import json


class BadCallBody(ValueError):
    def __init__(self, status: int, type: str, message: str):
        super().__init__(message)
        self.status, self.type, self.message = status, type, message


def keyword_arguments(body: bytes | bytearray) -> dict:
    """The arguments of a call's body (empty: none), or BadCallBody: 400 for JSON that does not parse (too deep
    included), 422 for JSON that is not an object."""
    try:
        kwargs = json.loads(body or b"{}")
    except RecursionError:
        raise BadCallBody(400, "invalid_json", "request body is nested too deeply to be read as JSON") from None
    except ValueError as exc:
        raise BadCallBody(400, "invalid_json", f"request body is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(kwargs, dict):
        raise BadCallBody(422, "invalid_arguments",
                          f"request body must be a JSON object of keyword arguments, got {type(kwargs).__name__}")
    return kwargs
