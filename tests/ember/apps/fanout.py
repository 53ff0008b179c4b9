"""A test app for the SDK's .map, .starmap and .spawn: a slow square that needs several replicas for a wide map,
a function that fails for some inputs, and a cancellable one."""
import asyncio
import os
import time
from pathlib import Path

import ember

app = ember.App("fanout")


@app.function(max_concurrency=4, target_concurrency=4, max_replicas=4, scaledown_window=60)
def square(x: int) -> dict:
    time.sleep(0.05)
    return {"square": x * x, "pid": os.getpid()}


@app.function(max_concurrency=8, scaledown_window=60)
def add(a: int, b: int = 0) -> int:
    return a + b


@app.function(max_concurrency=4, scaledown_window=60)
def blob(size: int) -> str:
    return "x" * size


@app.function(max_concurrency=8, scaledown_window=60)
def picky(x: int) -> int:
    if x % 3 == 0:
        raise ValueError(f"no multiples of 3: {x}")
    return x


@app.function(max_concurrency=2, scaledown_window=60, timeout=120)
async def wait(seconds: float, marker: str = "") -> float:
    """Sleeps; `marker` records whether the sleep ended or was cancelled."""
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        if marker:
            Path(marker).write_text("cancelled")
        raise
    if marker:
        Path(marker).write_text("finished")
    return seconds


@app.cls(max_concurrency=8, scaledown_window=60)
class Doubler:
    @ember.method()
    def double(self, x: int) -> int:
        return 2 * x


@app.function(max_concurrency=1, max_replicas=1, scaledown_window=60, timeout=120)
async def one_at_a_time(seconds: float, marker: str) -> float:
    """Writes `marker` when it starts: a call that waited in the queue and was cancelled there never does."""
    Path(marker).write_text("started")
    await asyncio.sleep(seconds)
    return seconds


@app.function(max_replicas=1, max_concurrency=1, queue_bound=4, scaledown_window=60)
def narrow(x: int) -> int:
    time.sleep(0.02)
    return x
