"""A second app, deployed next to another one to test that a key scoped to one cannot reach the other."""
import ember

app = ember.App("other")


@app.function(scaledown_window=30, timeout=5)
def secret() -> str:
    return "other's data"
