"""Shared by the engine's API tests: the app behind a real uvicorn socket, waiting for an idle engine, the one
stand-in: the engine's output text replaced by a model's reply that random weights never write, and a JSON schema
for structured outputs."""
import contextlib
import socket
import threading
import time
from collections.abc import Iterator

# A reply format whose every value is of bounded size: a random model inside an unbounded string would rarely close it
# before max_tokens
ORDER = {"type": "object", "properties": {
    "item": {"enum": ["apple", "bread", "milk"]},
    "count": {"type": "integer", "minimum": 1, "maximum": 12},
    "paid": {"type": "boolean"},
    "note": {"type": "string", "maxLength": 4},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
}, "required": ["item", "count", "paid", "note", "tags"], "additionalProperties": False}


@contextlib.contextmanager
def uvicorn_thread(app) -> Iterator[str]:
    """Serves `app` on a free loopback port in a thread; yields its base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive(), "uvicorn failed to start"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def wait_until_idle(engine, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.has_unfinished_requests() or engine.block_manager.usage > 0:
        assert time.monotonic() < deadline, "the engine still holds requests or KV blocks"
        time.sleep(0.01)


def engine_writes(monkeypatch, pieces: list[str]) -> None:
    """The real engine's outputs with their text replaced by `pieces`, one per token (an output that joined steps
    for a caller that fell behind takes one per token, and says where each ends; the last output takes the rest),
    each reply ending as the model stopped."""
    import itertools

    from ember.runtime.engine import async_engine

    real = async_engine.AsyncLLM.generate

    async def writing(self, *args, **kwargs):
        rest = iter(pieces)
        async for c in real(self, *args, **kwargs):
            taken = [next(rest, "") for _ in c.token_ids] or [""]
            if c.finish_reason:
                taken[-1] += "".join(rest)
            c.text = "".join(taken)
            c.token_ends = list(itertools.accumulate(map(len, taken))) if len(taken) > 1 else None
            if c.finish_reason:
                c.finish_reason = "stop"
            yield c

    monkeypatch.setattr(async_engine.AsyncLLM, "generate", writing)
