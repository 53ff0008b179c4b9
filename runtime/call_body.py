"""A call's body: a JSON object of keyword arguments. The gateway checks it before it queues a call, the worker
again for whoever reaches it directly (`ember run`); both answer the same errors."""
import json
import math


class BadCallBody(ValueError):
    def __init__(self, status: int, type: str, message: str):
        super().__init__(message)
        self.status, self.type, self.message = status, type, message


def keyword_arguments(body: bytes | bytearray) -> dict:
    """The arguments of a call's body (empty: none), or BadCallBody: 400 for JSON that does not parse (too deep
    included), 422 for JSON that is not an object."""
    try:
        kwargs = json.loads(body or b"{}", parse_constant=_not_json, parse_float=_finite)
    except RecursionError:
        raise BadCallBody(400, "invalid_json", "request body is nested too deeply to be read as JSON") from None
    except ValueError as exc:
        raise BadCallBody(400, "invalid_json", f"request body is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(kwargs, dict):
        raise BadCallBody(422, "invalid_arguments",
                          f"request body must be a JSON object of keyword arguments, got {type(kwargs).__name__}")
    return kwargs


def _not_json(name: str) -> float:
    """Python reads NaN and Infinity; JSON has neither, and a function handed one returns what JSON cannot carry."""
    raise ValueError(f"{name} is not JSON (it has no NaN or Infinity): send a number, or null")


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"the number {text[:40]} is beyond a 64-bit float's range")
    return value
