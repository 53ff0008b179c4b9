"""Two GPU units for the standby tests (tests/runtime/test_standby.py); on CPU they run without a GPU. torch is
imported with the module, as a GPU app's is: a standby initialises CUDA through it (on a GPU machine)."""
import os

import torch  # noqa: F401

import ember

app = ember.App("standby")


@app.function(gpu="H200")
def first() -> dict:
    return {"pid": os.getpid(), "devices": os.environ.get("CUDA_VISIBLE_DEVICES")}


@app.function(gpu="H200")
def second() -> dict:
    return {"pid": os.getpid(), "devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
