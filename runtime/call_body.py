"""A call's body: a JSON object of keyword arguments. The gateway checks it before it queues a call, the worker
again for whoever reaches it directly (`ember run`); both answer the same errors. And the JSON of a call's result."""
import dataclasses
import datetime
import decimal
import enum
import json
import math
import sys
import uuid
from pathlib import PurePath
from typing import Any


class BadCallBody(ValueError):
    def __init__(self, status: int, type: str, message: str):
        super().__init__(message)
        self.status, self.type, self.message = status, type, message


def plain_encoding(content_encoding: str | None) -> None:
    """A call's body is read as sent: a compressed one (Content-Encoding: gzip) is refused by name, where it would
    fail as JSON that does not parse (or, compressed JSON-looking text, be read wrongly)."""
    if content_encoding and content_encoding.strip().lower() != "identity":
        raise BadCallBody(415, "unsupported_encoding", f"Content-Encoding {content_encoding[:40]!r} is not taken: "
                          "send the call's JSON body uncompressed, without a Content-Encoding header")


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


def result_json(value: Any) -> str:
    """`value` as JSON, as a web framework would send it: pydantic models, dataclasses, dates and times, UUIDs,
    decimals, paths, enums, sets and tuples, and numpy or torch arrays and scalars (by `tolist`) too. What JSON cannot
    carry (NaN, infinity, an object of no such kind) raises ResultNotJson, whose message says what and how to fix it."""
    try:
        return json.dumps(value, allow_nan=False, default=_jsonable)
    except ResultNotJson:
        raise
    except ValueError as exc:  # NaN or infinity (allow_nan), or a circular reference
        if "Circular reference" in str(exc):
            raise ResultNotJson("the value contains itself (a circular reference)") from None
        if "integer string conversion" in str(exc):   # Python writes out at most sys.get_int_max_str_digits()
            raise ResultNotJson(f"the value holds an integer of more than {sys.get_int_max_str_digits()} digits, "
                                "which Python will not write out as JSON: return it as a string") from None
        raise ResultNotJson(f"{exc} (JSON has no NaN or infinity: return None or a string for them)") from None
    except RecursionError:
        raise ResultNotJson("the value is nested too deeply (or refers to itself)") from None


class ResultNotJson(ValueError):
    """A function's result (or a generator's value) that JSON cannot carry."""


def _jsonable(value: Any) -> Any:
    """What json.dumps cannot encode by itself, as something it can (called once per such object)."""
    if hasattr(value, "model_dump") and callable(value.model_dump):  # pydantic v2
        return value.model_dump(mode="json")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (uuid.UUID, decimal.Decimal, PurePath)):
        return str(value)
    if isinstance(value, (set, frozenset)):
        return list(value)
    if hasattr(value, "tolist") and callable(value.tolist):  # numpy arrays and scalars, torch tensors
        return value.tolist()
    raise ResultNotJson(f"Object of type {type(value).__name__} is not JSON serializable: return plain data (dict, "
                        "list, str, number, bool, None), a pydantic model or a dataclass")
