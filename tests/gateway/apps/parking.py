"""A test app that parks when idle: classes whose park and wake are counted."""
import os

import ember

app = ember.App("parking")


class Counted:
    @ember.enter()
    def load(self):
        self.parks = self.wakes = 0

    @ember.park()
    def release(self):
        self.parks += 1

    @ember.wake()
    def restore(self):
        self.wakes += 1

    @ember.method()
    def predict(self) -> dict:
        return {"pid": os.getpid(), "parks": self.parks, "wakes": self.wakes}


@app.cls(park_after=0.5, scaledown_window=6)
class Model(Counted):
    pass


@app.cls(park_after=0.5, scaledown_window=6, park_with="cuda-checkpoint")
class Opaque(Counted):
    """Parks through the driver's checkpoint, which a machine without a CUDA driver cannot do."""


@app.cls(park_after=0.5, scaledown_window=6)
class Unparkable(Counted):
    """Its park hook fails: each park stops the replica instead."""

    @ember.park()
    def release(self):
        raise RuntimeError("the park hook failed")
