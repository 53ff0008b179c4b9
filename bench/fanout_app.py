"""The app bench/fanout.py serves: a call that takes a fixed time, and the same values produced as a list or
yielded one by one."""
import time

import ember

app = ember.App("fanout-bench")


@app.function(max_concurrency=4, target_concurrency=4, max_replicas=8, scaledown_window=120)
def work(x: int, seconds: float) -> int:
    time.sleep(seconds)
    return x


@app.function(max_concurrency=4, scaledown_window=120)
def as_list(n: int, seconds_each: float) -> list[int]:
    values = []
    for i in range(n):
        time.sleep(seconds_each)
        values.append(i)
    return values


@app.function(max_concurrency=4, scaledown_window=120)
def as_stream(n: int, seconds_each: float):
    for i in range(n):
        time.sleep(seconds_each)
        yield i
