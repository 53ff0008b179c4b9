"""A test app for scaling settings: a pre-warmed function and one that needs a second replica under load."""
import os
import time

import ember

app = ember.App("scaling")


@app.function(min_replicas=1, scaledown_window=1)
def warm() -> int:
    return os.getpid()


@app.function(max_concurrency=1, max_replicas=2, scaledown_window=30)
def busy(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()
