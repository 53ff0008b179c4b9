"""A test app with a short scale-down window, so scale-to-zero is seen within a test."""
import os

import ember

app = ember.App("quick")


@app.function(scaledown_window=1.5, timeout=5)
def add(a: int, b: int) -> dict:
    return {"sum": a + b, "pid": os.getpid()}


@app.function(scaledown_window=30, timeout=1)
def sleepy(seconds: float) -> float:
    import time

    time.sleep(seconds)
    return seconds
