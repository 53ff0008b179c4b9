"""The quickstart app: a plain function and a class whose state is built once per replica.

    ember serve examples/hello.py
    curl --cacert ~/.ember/tls/ca.pem -H "Authorization: Bearer $KEY" -d '{"x": 7}' https://127.0.0.1:8443/hello/square
    curl ... -d '{"name": "Ada"}' https://127.0.0.1:8443/hello/Greeter.greet
"""
import os

import ember

app = ember.App("hello")


@app.function(scaledown_window=60, timeout=30)
def square(x: float) -> float:
    return x * x


@app.cls(scaledown_window=60, max_concurrency=4, target_concurrency=2)
class Greeter:
    @ember.enter(snap=True)
    def load(self):
        # Stands in for loading weights: state a snapshot could capture.
        self.greetings = {"en": "Hello", "fr": "Bonjour", "de": "Hallo"}

    @ember.enter(snap=False)
    def connect(self):
        # Per-process state that must not be snapshotted (pids, sockets, CUDA contexts).
        self.pid = os.getpid()

    @ember.method()
    def greet(self, name: str, lang: str = "en") -> dict:
        if lang not in self.greetings:
            raise ValueError(f"unknown lang {lang!r}; one of {sorted(self.greetings)}")
        return {"greeting": f"{self.greetings[lang]}, {name}!", "pid": self.pid}

    @ember.exit()
    def close(self):
        print(f"replica {self.pid} shutting down", flush=True)
