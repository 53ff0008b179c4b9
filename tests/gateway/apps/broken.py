"""A test app whose class crashes in its enter hook."""
import ember

app = ember.App("broken")


@app.cls(scaledown_window=30)
class Model:
    @ember.enter()
    def load(self):
        raise ZeroDivisionError("weights are missing (on purpose)")

    @ember.method()
    def predict(self, x: int) -> int:
        return x
