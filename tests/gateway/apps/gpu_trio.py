"""A test app that keeps three GPU replicas: on a two-GPU machine the third waits for a GPU."""
import os
import time

import ember

app = ember.App("trio")


@app.function(gpu="H200", min_replicas=3, max_replicas=3, scaledown_window=30)
def devices(seconds: float = 0.0) -> str:
    time.sleep(seconds)
    return os.environ["CUDA_VISIBLE_DEVICES"]
