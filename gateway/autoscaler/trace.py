"""Seeded request traces for the autoscaling simulator.

Each trace is a list of requests in arrival order; arrivals are Poisson at a rate
that varies with time (drawn by thinning), token counts are log-normal around a
chat-like prompt and answer.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Request:
    t: float
    prompt_tokens: int
    output_tokens: int
    function: str = "f"


# A request's token counts past this are no request a replica could serve (the longest context windows are ~1M)
# and would keep a replay's simulation going for days of simulated time.
MAX_TOKENS = 1_000_000
# A week of trace: the simulator steps every policy tick (0.5 s) through it, which takes hours past that; a trace
# whose times are far apart by mistake (milliseconds read as seconds, one stray timestamp) would never end.
MAX_SPAN_S = 7 * 86400.0


def read_jsonl(lines: Iterable[str], source: str = "trace") -> list[Request]:
    """Requests from JSON lines `{"t", "function", "prompt_tokens", "output_tokens"}`, sorted by time. Times are
    seconds from any origin: they are counted from the whole second of the first request (a trace of Unix
    timestamps replays from its first request; one that starts within its first second is unchanged). Token
    counts are whole numbers from 0 to MAX_TOKENS; a function name is a non-empty string; the requests span at most
    MAX_SPAN_S."""
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(_request(json.loads(line)))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{source}:{n}: want {{\"t\", \"function\", \"prompt_tokens\", \"output_tokens\"}}, "
                             f"got {line.strip()[:80]!r} ({type(exc).__name__}: {exc})") from None
    if not out:
        raise ValueError(f"{source}: no requests (one JSON object a line: "
                         f"{{\"t\", \"function\", \"prompt_tokens\", \"output_tokens\"}})")
    origin = math.floor(min(r.t for r in out))
    first, last = min(out, key=lambda r: r.t), max(out, key=lambda r: r.t)
    if last.t - first.t > MAX_SPAN_S:
        raise ValueError(f"{source}: its requests span {last.t - first.t:,.0f} s (t {first.t:g} to {last.t:g}), over "
                         f"a week ({MAX_SPAN_S:,.0f} s) of replay: t is in seconds; split a longer trace")
    return sorted((Request(r.t - origin, r.prompt_tokens, r.output_tokens, r.function) for r in out),
                  key=lambda r: r.t)


def _request(row: object) -> Request:
    if not isinstance(row, dict):
        raise TypeError("a line must be a JSON object")
    t = row["t"]
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
        raise ValueError(f"t must be a finite number of seconds, not {t!r}")
    counts = []
    for key in ("prompt_tokens", "output_tokens"):
        value = row[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) \
                or not 0 <= value <= MAX_TOKENS:
            raise ValueError(f"{key} must be a whole number from 0 to {MAX_TOKENS:,}, not {value!r}")
        counts.append(int(value))
    function = row.get("function", "f")
    if not isinstance(function, str) or not function:
        raise ValueError(f"function must be a non-empty string, not {function!r}")
    return Request(float(t), counts[0], counts[1], function)


def write_jsonl(trace: Iterable[Request]) -> str:
    return "".join(json.dumps({"t": round(r.t, 4), "function": r.function, "prompt_tokens": r.prompt_tokens,
                               "output_tokens": r.output_tokens}) + "\n" for r in trace)


def tokens(rng: random.Random) -> tuple[int, int]:
    prompt = int(min(max(rng.lognormvariate(math.log(500), 0.8), 16), 8000))
    output = int(min(max(rng.lognormvariate(math.log(150), 0.6), 8), 1000))
    return prompt, output


def poisson(rate: Callable[[float], float], peak: float, duration: float, rng: random.Random) -> list[Request]:
    """Arrivals at `rate(t)` req/s (never above `peak`) over [0, duration)."""
    out: list[Request] = []
    t = 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= duration:
            return out
        if rng.random() * peak < rate(t):
            out.append(Request(t, *tokens(rng)))


def steady(duration: float, rng: random.Random, rate: float = 8.0) -> list[Request]:
    return poisson(lambda t: rate, rate, duration, rng)


def diurnal(duration: float, rng: random.Random, mean: float = 8.0) -> list[Request]:
    """One day compressed into `duration`: trough near 5% of the mean, peak near 1.95x."""
    return poisson(lambda t: mean * (1 - 0.95 * math.cos(2 * math.pi * t / duration)), 2 * mean, duration, rng)


def on_off(
    duration: float, rng: random.Random, rate: float = 25.0, on: float = 60.0, off: float = 240.0
) -> list[Request]:
    return poisson(lambda t: rate if t % (on + off) < on else 0.0, rate, duration, rng)


def spike(
    duration: float, rng: random.Random, base: float = 0.1, peak: float = 40.0, at: float = 0.4, width: float = 30.0
) -> list[Request]:
    start = duration * at
    return poisson(lambda t: peak if start <= t < start + width else base, peak, duration, rng)


def sessions(
    duration: float,
    rng: random.Random,
    rate: float = 0.5,
    turns: tuple[int, int] = (3, 12),
    think: tuple[float, float] = (2.0, 12.0),
) -> list[Request]:
    """Many short chat sessions: each sends a few turns separated by a think time."""
    out = []
    for begin in poisson(lambda t: rate, rate, duration, rng):
        t = begin.t
        for _ in range(rng.randint(*turns)):
            if t >= duration:
                break
            out.append(Request(t, *tokens(rng)))
            t += rng.uniform(*think)
    return sorted(out, key=lambda r: r.t)


TRACES = {"steady": steady, "diurnal": diurnal, "on_off": on_off, "spike": spike, "sessions": sessions}


def generate(name: str, duration: float, seed: int) -> list[Request]:
    if name not in TRACES:
        raise ValueError(f"unknown trace {name!r}; choose one of {', '.join(TRACES)}")
    return TRACES[name](duration, random.Random(seed))
