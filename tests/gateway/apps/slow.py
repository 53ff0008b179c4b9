"""A test app whose calls take as long as asked, to stop a gateway with calls in flight, and one that raises."""
import time

import ember

app = ember.App("slow")


@app.function(scaledown_window=30, timeout=60)
def wait(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


@app.function(scaledown_window=30, timeout=10)
def boom(x: int) -> int:
    return divide(x)


def divide(x: int) -> int:
    return x // 0
