"""The worker's control line to its supervisor: one JSON line on the worker's stdout once it serves (Ready) or cannot
(Failed). Both sides use these dataclasses; encode/decode is the one place the wire shape lives."""
import json
from dataclasses import asdict, dataclass


@dataclass
class Ready:
    """The worker serves on 127.0.0.1:`port`; the supervisor sends `control_secret` with each /__ember__/ request."""
    port: int
    started: float  # the worker process's time.monotonic() when it began (before its heavy imports)
    timings: dict[str, int | str]  # ms per start phase (import_ms, enter_ms, ...) and what the enter hooks loaded
    control_secret: str


@dataclass
class Failed:
    """The worker could not start: `phase` (import, enter, serve) names where, `error` what went wrong."""
    phase: str
    error: str


ControlMessage = Ready | Failed
EVENTS: dict[str, type[ControlMessage]] = {"ready": Ready, "failed": Failed}


def encode(message: ControlMessage) -> str:
    """The line: {"event": "ready" | "failed", ...the message's fields}."""
    event = next(name for name, cls in EVENTS.items() if isinstance(message, cls))
    return json.dumps({"event": event, **asdict(message)})


def decode(line: bytes | str) -> ControlMessage | None:
    """The message on `line`; None when it is empty or not a control message (the worker died before it said)."""
    try:
        fields = json.loads(line)
        return EVENTS[fields.pop("event")](**fields)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
