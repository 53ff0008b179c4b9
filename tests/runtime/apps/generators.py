"""A test app of generator functions: values streamed as produced, errors mid-stream, async generators, and a
generator whose `finally` records that it was closed."""
import asyncio
import time
from pathlib import Path

import ember

app = ember.App("generators")


def _wait_for(path: Path, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.005)


@app.function(max_concurrency=4, scaledown_window=60)
def count(n: int, gate: str = ""):
    """0..n-1; with `gate`, everything after the first value waits until that file exists."""
    for i in range(n):
        if i == 1 and gate:
            _wait_for(Path(gate))
        yield {"i": i, "at": time.time()}


@app.function(max_concurrency=4, scaledown_window=60)
def fails_after(n: int):
    yield from range(n)
    raise ValueError(f"ran out after {n}")


@app.function(max_concurrency=4, scaledown_window=60)
async def acount(n: int):
    for i in range(n):
        await asyncio.sleep(0)
        yield i


@app.function(max_concurrency=1, max_replicas=1, scaledown_window=60)
def endless(marker: str):
    """Yields until its client leaves; its `finally` writes `marker` once it was closed."""
    i = 0
    try:
        while True:
            yield i
            i += 1
            time.sleep(0.01)
    finally:
        Path(marker).write_text(f"closed after {i}")


@app.function(scaledown_window=60)
def plain() -> int:
    return 1


@app.function(timeout=1, scaledown_window=60)
async def slow_ticks(n: int):
    """One value every 0.3 s: more than its 1 s timeout allows for n > 3."""
    for i in range(n):
        yield i
        await asyncio.sleep(0.3)
