"""The upstream of bench/gateway_stream.py: an OpenAI-style endpoint that streams tokens at a decode step's pace.

POST /v1/chat/completions with {"max_tokens": N, "step_ms": S} answers `stream: true`'s shape: N chunks of
`chat.completion.chunk` JSON as server-sent events, then `data: [DONE]`. Every stream open in the process gets its
next token on the same tick, every S ms, as the requests of one batch get theirs from one decode step, so a relay
sees what it sees in front of a busy engine: many small writes, one per stream per step. A bare ASGI callable keeps
the replica's own cost per token low; bench/gateway_stream.py measures it too (its direct row).
"""
import asyncio
import json

import ember

app = ember.App("stream")

WORDS = [" the", " engine", " streams", " one", " token", " per", " step", " to", " every", " request", ",", " and"]


class Ticker:
    """One clock per step length: a future that completes every step, for every stream waiting on it."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.tick: asyncio.Future | None = None

    async def next(self) -> None:
        if self.tick is None:
            self.tick = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().create_task(self._run())
        await asyncio.shield(self.tick)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            due += self.step_s
            await asyncio.sleep(max(0.0, due - loop.time()))
            tick, self.tick = self.tick, loop.create_future()
            tick.set_result(None)


TICKERS: dict[float, Ticker] = {}


def chunk_template(request_id: str) -> tuple[bytes, bytes]:
    """The bytes before and after a token's JSON string in one event (the shape Ember's OpenAI API streams)."""
    head = json.dumps({"id": request_id, "object": "chat.completion.chunk", "created": 1764460800,
                       "model": "bench-model", "choices": [{"index": 0, "delta": {"content": "@@"}, "logprobs": None,
                                                            "finish_reason": None}]})
    before, after = head.split('"@@"')
    return b"data: " + before.encode(), after.encode() + b"\n\n"


async def stream_upstream(scope, receive, send):
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    if scope["method"] != "POST" or scope["path"] != "/v1/chat/completions":
        await send({"type": "http.response.start", "status": 404, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"error": {"type": "not_found"}}'})
        return
    asked = json.loads(body or b"{}")
    tokens, step_s = int(asked.get("max_tokens", 128)), float(asked.get("step_ms", 20)) / 1000
    ticker = TICKERS.setdefault(step_s, Ticker(step_s))
    before, after = chunk_template(f"chatcmpl-{id(scope):x}")
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
    for i in range(tokens):
        await ticker.next()
        word = WORDS[i % len(WORDS)]
        await send({"type": "http.response.body", "body": before + json.dumps(word).encode() + after,
                    "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


# One replica for the whole run, never parked or stopped: every row reaches the same process.
@app.cls(min_replicas=1, max_replicas=1, max_concurrency=1024, target_concurrency=1024, scaledown_window=3600,
         timeout=600)
class Upstream:
    @ember.asgi_app()
    def web(self):
        return stream_upstream
