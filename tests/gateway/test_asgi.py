"""An app's ASGI endpoint behind the gateway: any path that is not a declared method, SSE streamed through."""
import time
from pathlib import Path

APPS = Path(__file__).parent / "apps"


def test_asgi_forwarding_and_sse_cancellation(serve):
    served = serve(APPS / "streaming.py")
    with served.client(served.key()) as http:
        echo = http.post("/streaming/v1/echo?x=1", json={"hello": "world"})
        assert echo.status_code == 200, echo.text
        reply = echo.json()
        caller = reply.pop("caller")
        assert reply == {"path": "/v1/echo", "query": "x=1", "body": {"hello": "world"}}
        assert echo.headers["x-ember-replica"].startswith("web-")
        # the replica is told which API key called (a format compiler's turns go by it); a client cannot say
        forged = http.post("/streaming/v1/echo", json={}, headers={"x-ember-caller": "someone-else"}).json()
        assert caller and forged["caller"] == caller != "someone-else"
        with served.client(served.key("other")) as other:
            assert other.post("/streaming/v1/echo", json={}).json()["caller"] not in (caller, None)

        assert http.post("/streaming/Web.ping", json={}).json() == {"result": "pong"}

        with http.stream("GET", "/streaming/v1/stream", params={"n": 5}) as whole:
            assert whole.headers["content-type"].startswith("text/event-stream")
            events = [line for line in whole.iter_lines() if line.startswith("data:")]
        assert events == [f"data: {i}" for i in range(5)]

        with http.stream("GET", "/streaming/v1/stream") as partial:
            lines = partial.iter_lines()
            first = [next(lines) for _ in range(4)]
        assert first[0] == "data: 0"

        deadline = time.monotonic() + 10
        while http.get("/streaming/v1/cancelled").json()["cancelled"] < 1:
            assert time.monotonic() < deadline, "the upstream stream was not cancelled after the client left"
            time.sleep(0.1)
        assert http.get("/streaming/v1/nowhere").status_code == 404
        # slots of finished and abandoned streams were returned
        assert served.in_flight_after_settling("streaming", "Web") == 0


def test_a_slow_reader_holds_back_the_producer(serve):
    served = serve(APPS / "streaming.py")
    with served.client(served.key()) as http, served.client(served.key()) as probe:
        with http.stream("GET", "/streaming/v1/big", params={"chunks": 256}) as big:
            chunks = big.iter_raw()
            next(chunks)
            time.sleep(1.5)
            produced = probe.get("/streaming/v1/produced").json()["produced"]
        assert produced < 128, f"{produced} MiB produced for a reader that took 1: no backpressure"
