"""A test app that parks when idle: a class whose park and wake are counted."""
import os

import ember

app = ember.App("parking")


@app.cls(park_after=0.5, scaledown_window=6)
class Model:
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


@app.cls(park_after=0.5, scaledown_window=6, park_with="cuda-checkpoint")
class Opaque:
    """Parks through the driver's checkpoint, which a machine without a CUDA driver cannot do."""

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
