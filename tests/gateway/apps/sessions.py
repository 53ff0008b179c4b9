"""A test app for session affinity at scale: four warm replicas, a fifth when five calls arrive at once."""
import os
import time

import ember

app = ember.App("sessions")


@app.function(min_replicas=4, max_replicas=5, max_concurrency=1, target_concurrency=1, scaledown_window=120, timeout=30)
def hold(seconds: float = 0.0) -> int:
    time.sleep(seconds)
    return os.getpid()
