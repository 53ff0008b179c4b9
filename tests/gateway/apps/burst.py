"""A test app for bursts: a function that scales out to three replicas, and one with a queue bound of two."""
import os
import time

import ember

app = ember.App("burst")


# The window outlasts a call under CI load, so replicas (and AWS nodes) are not stopped mid-burst.
@app.function(max_replicas=3, target_concurrency=1, max_concurrency=1, scaledown_window=2)
def work(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


@app.function(max_replicas=1, max_concurrency=1, queue_bound=2, scaledown_window=30)
def slow(seconds: float) -> float:
    time.sleep(seconds)
    return seconds
