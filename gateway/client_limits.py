"""What one client may take of the gateway: time to send its headers (and finish the TLS handshake), connections held
at once, time to send a body, the request-body bytes held across all requests, and time to take a streamed reply's
bytes. Each is an `ember serve` flag, else
an environment variable, else a default; a bad value is refused naming where it came from and what would do."""
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ember.gateway.backends.local import parse_size

MIN_BODY_BUDGET = 16 << 20  # one body of the largest size (body.MAX_BODY) must fit


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise ValueError
    return value


def _count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError
    return value


def _budget(text: str) -> int:
    value = parse_size(text)
    if value < MIN_BODY_BUDGET:
        raise ValueError
    return value


# (flag, environment variable, parser, what a value must be)
SETTINGS: dict[str, tuple[str, str, Callable[[str], float | int], str]] = {
    "header_timeout": ("--header-timeout", "EMBER_HEADER_TIMEOUT", _seconds, "seconds > 0, e.g. 10"),
    "max_connections": ("--max-connections", "EMBER_MAX_CONNECTIONS", _count, "a whole number >= 1, e.g. 10000"),
    "body_timeout": ("--body-timeout", "EMBER_BODY_TIMEOUT", _seconds, "seconds > 0, e.g. 60"),
    "body_budget": ("--body-budget", "EMBER_BODY_BUDGET", _budget, "a size >= 16MiB (the largest body), e.g. 256MiB"),
    "send_timeout": ("--send-timeout", "EMBER_SEND_TIMEOUT", _seconds, "seconds > 0, e.g. 60"),
}


@dataclass(frozen=True)
class ClientLimits:
    header_timeout: float = 10.0  # seconds from a connection's first byte (or accept, for TLS) to its last header
    max_connections: int | None = None  # None: what the file-descriptor limit allows (connections.connection_cap)
    body_timeout: float = 60.0  # seconds a request body may take to arrive
    body_budget: int = 256 << 20  # bytes of request bodies held at once, across every request
    send_timeout: float = 60.0  # seconds a client may leave a streamed reply unread before it is dropped

    @classmethod
    def resolve(cls, **flags: str | None) -> "ClientLimits":
        """Flags (the text given, or None) win over environment variables, which win over the defaults."""
        values: dict[str, Any] = {}  # field -> its value, of the type SETTINGS' parser for it gives
        for name, (flag, env, parse, expected) in SETTINGS.items():
            text, source = flags.get(name), flag
            if text is None:
                text, source = os.environ.get(env), env
            if not text:
                continue
            try:
                values[name] = parse(text)
            except ValueError:
                raise ValueError(f"{source} {text!r} is not valid: give {expected}") from None
        return cls(**values)
