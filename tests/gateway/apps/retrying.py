"""A test app for retries=: functions that fail a set number of times (their attempts counted in a file the caller
names) before they succeed."""
import time
from pathlib import Path

import ember

app = ember.App("retrying")


def _attempt(path: str) -> int:
    """Record this attempt's time; the number of attempts so far, this one included."""
    with open(path, "a") as f:
        f.write(f"{time.time()}\n")
    return len(Path(path).read_text().split())


@app.function(retries=ember.Retries(max_retries=3, backoff_coefficient=2.0, initial_delay=0.2), scaledown_window=60)
def flaky(path: str, fail_times: int) -> int:
    attempt = _attempt(path)
    if attempt <= fail_times:
        raise RuntimeError(f"attempt {attempt} fails")
    return attempt


@app.function(scaledown_window=60)
def once(path: str) -> int:
    raise RuntimeError(f"attempt {_attempt(path)} fails")
