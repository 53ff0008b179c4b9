"""A test app for GPU handout: what CUDA_VISIBLE_DEVICES each replica was given."""
import os
import time

import ember

app = ember.App("gpus")


@app.function(gpu="H200", max_replicas=3, scaledown_window=30)
def devices(seconds: float = 0.0) -> str:
    time.sleep(seconds)
    return os.environ["CUDA_VISIBLE_DEVICES"]


@app.function(scaledown_window=30)
def cpu() -> str:
    return os.environ["CUDA_VISIBLE_DEVICES"]


@app.function(gpu="H200", park_after=0.5, scaledown_window=30)
def parks() -> str:
    return os.environ["CUDA_VISIBLE_DEVICES"]
