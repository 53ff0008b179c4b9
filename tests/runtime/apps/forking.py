"""An app whose module imports torch and whose class builds its state in a snap=True hook (test_forkserver)."""
import gc
import os
import sys

import torch

import ember
from ember.runtime import startup
from tests.runtime.apps import heavy  # by reference: imported (with torch) by each process that loads the package

app = ember.App("forking")


@app.function()
def imported_in() -> dict:
    return {"imported_in": heavy.IMPORTED_IN, "pid": os.getpid(), "sum": int(torch.arange(10).sum())}


@app.cls()
class Snapped:
    @ember.enter(snap=True)
    def build(self):
        self.built_in = os.getpid()
        self.table = torch.arange(1000)  # host memory every forked replica shares copy-on-write
        startup.report({"table_ms": 1})  # the template's, not any replica's start
        if os.environ.get("FORKING_SNAP_LOG"):
            with open(os.environ["FORKING_SNAP_LOG"], "a") as log:
                log.write(f"{os.getpid()}\n")
        if os.environ.get("FORKING_TOUCH_CUDA") == "1":
            torch.cuda._initialized = True  # what torch's lazy CUDA init sets: CI has no GPU to really touch

    @ember.enter(snap=False)
    def connect(self):
        self.pid = os.getpid()
        self.modules_at_enter = set(sys.modules)
        startup.report({"connect_ms": 2, "cache": "cold"})  # what an engine adds to its start's breakdown

    @ember.method()
    def late_imports(self) -> list[str]:
        """Modules of the replica's HTTP stack imported after its enter hooks: on the way to its first reply."""
        stack = ("uvicorn", "anyio", "h11", "httptools", "uvloop", "wsproto", "websockets", "starlette")
        return sorted(m for m in set(sys.modules) - self.modules_at_enter if m.split(".")[0] in stack)

    @ember.method()
    def where(self) -> dict:
        return {"built_in": self.built_in, "pid": self.pid, "sum": int(self.table.sum())}

    @ember.method()
    def heap(self) -> dict:
        """What this replica's collector still walks: how many objects its start froze, whether this instance (built
        by the snap=True hook: in the template, where the replica was forked) is among them, and whether an object
        made now is walked."""
        made_now = [self]
        walked = {id(o) for o in gc.get_objects()}
        return {"frozen": gc.get_freeze_count(), "instance_walked": id(self) in walked,
                "new_walked": id(made_now) in walked}
