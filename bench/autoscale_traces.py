"""Seeded held-out-style traces for bench/autoscale_sim.py, of four kinds, written as JSON lines.

    python bench/autoscale_traces.py KIND --seed N [--duration S] [--out PATH] [kind options]

- day: one day compressed into the trace, rate from `--low` to `--high` req/s and back, interpolated
  geometrically (`--shape log`, night lasts) or linearly (`--shape linear`).
- bursts: heavy-tailed bursts over a trickle: gaps between bursts exponential (`--gap` mean s), burst
  length and rate Pareto (`--alpha`, smaller is heavier) above `--burst-s` s and `--burst-rate` req/s.
- small: `--functions` functions, each at its own rate drawn uniformly (`--spread linear`) or
  log-uniformly (`--spread log`) from `--low` to `--high` req/s.
- steady: `--rate` req/s.

Arrivals are Poisson at the rate of the moment; prompt and answer lengths are log-normal around
500 and 150 tokens. Same kind, options and seed: same file.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from pathlib import Path

from ember.gateway.autoscaler.trace import MAX_SPAN_S, Request, poisson, write_jsonl

KINDS = ("day", "bursts", "small", "steady")


def day(duration: float, rng: random.Random, low: float = 0.02, high: float = 3.0, shape: str = "log") -> list[Request]:
    def rate(t: float) -> float:
        x = (1 - math.cos(2 * math.pi * t / duration)) / 2  # 0 at midnight, 1 at noon
        return low * (high / low) ** x if shape == "log" else low + (high - low) * x
    return poisson(rate, high, duration, rng)


def bursts(duration: float, rng: random.Random, gap: float = 180.0, burst_s: float = 10.0, burst_rate: float = 8.0,
           alpha: float = 1.5, trickle: float = 0.05) -> list[Request]:
    spans = []  # (start, end, rate)
    t = rng.expovariate(1 / gap)
    while t < duration:
        length = min(burst_s * rng.paretovariate(alpha), duration / 4)
        spans.append((t, t + length, min(burst_rate * rng.paretovariate(alpha), 20 * burst_rate)))
        t += length + rng.expovariate(1 / gap)
    peak = max([trickle] + [r for _, _, r in spans])
    return poisson(lambda x: trickle + sum(r for a, b, r in spans if a <= x < b), peak + trickle, duration, rng)


def small(duration: float, rng: random.Random, functions: int = 20, low: float = 0.01, high: float = 0.2,
          spread: str = "linear") -> list[Request]:
    out = []
    for i in range(functions):
        rate = rng.uniform(low, high) if spread == "linear" else math.exp(rng.uniform(math.log(low), math.log(high)))
        out += [Request(r.t, r.prompt_tokens, r.output_tokens, f"fn{i:02d}")
                for r in poisson(lambda t: rate, rate, duration, rng)]
    return sorted(out, key=lambda r: r.t)


def steady(duration: float, rng: random.Random, rate: float = 5.0) -> list[Request]:
    return poisson(lambda t: rate, rate, duration, rng)


def generate(kind: str, duration: float, seed: int, **options) -> list[Request]:
    makers = {"day": day, "bursts": bursts, "small": small, "steady": steady}
    if kind not in makers:
        raise ValueError(f"unknown trace kind {kind!r}; choose one of {', '.join(KINDS)}")
    return makers[kind](duration, random.Random(f"{kind}-{seed}"), **options)


MAX_DURATION_S = MAX_SPAN_S    # a week of trace; longer takes hours to replay
MAX_RATE = 1000.0              # req/s of one rate: a week at it is 600M requests


def bounded(kind: type, low: float, high: float, low_open: bool = True):
    """An argparse type: a `kind` number in (low, high] (or [low, high] when not `low_open`), finite."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (math.isfinite(value) and (value > low if low_open else value >= low) and value <= high):
            raise argparse.ArgumentTypeError(f"{text} is outside {'(' if low_open else '['}{low:g}, {high:g}]")
        return value
    return parse


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=KINDS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--duration", type=bounded(float, 0, MAX_DURATION_S), default=3600.0,
                    help="seconds of trace (default 3600)")
    ap.add_argument("--out", type=Path, help="file to write (default: stdout)")
    rate, seconds = bounded(float, 0, MAX_RATE), bounded(float, 0, MAX_DURATION_S)
    ap.add_argument("--low", type=rate, help="req/s")
    ap.add_argument("--high", type=rate, help="req/s")
    ap.add_argument("--shape", choices=("log", "linear"))
    ap.add_argument("--gap", type=seconds)
    ap.add_argument("--burst-s", type=seconds)
    ap.add_argument("--burst-rate", type=rate, help="req/s")
    ap.add_argument("--alpha", type=bounded(float, 0, 100))
    ap.add_argument("--functions", type=bounded(int, 1, 10_000, low_open=False))
    ap.add_argument("--spread", choices=("log", "linear"))
    ap.add_argument("--rate", type=rate, help="req/s")
    args = ap.parse_args()
    if args.low is not None and args.high is not None and args.low > args.high:
        ap.error(f"--low {args.low:g} is above --high {args.high:g}")
    options = {k: v for k, v in vars(args).items() if k not in ("kind", "seed", "duration", "out") and v is not None}
    try:
        text = write_jsonl(generate(args.kind, args.duration, args.seed, **options))
    except TypeError as exc:
        sys.exit(f"option not known for {args.kind}: {exc}")
    if args.out:
        args.out.write_text(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
