"""The upstream of bench/gateway_load.py: an OpenAI-compatible endpoint that answers at once.

One replica serves `/v1/chat/completions` with a small fixed completion (real JSON, the
shape the OpenAI client and LiteLLM parse) so that every row of the benchmark measures
the path to it, not the work behind it. A bare ASGI callable keeps the replica's own cost
per request as low as uvicorn allows; the direct row measures exactly that cost.
"""
import json

import ember

app = ember.App("upstream")

COMPLETION = json.dumps({
    "id": "chatcmpl-bench",
    "object": "chat.completion",
    "created": 1764460800,
    "model": "bench-model",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "pong"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10},
}).encode()
NOT_FOUND = json.dumps(
    {"error": {"type": "not_found", "message": "this upstream serves POST /v1/chat/completions only"}}
).encode()


async def openai_upstream(scope, receive, send):
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    more = True
    while more:  # drain the request body so the connection stays usable for the next request
        more = (await receive()).get("more_body", False)
    found = scope["method"] == "POST" and scope["path"] == "/v1/chat/completions"
    body = COMPLETION if found else NOT_FOUND
    await send({"type": "http.response.start", "status": 200 if found else 404,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


# One replica for the whole run, never parked or stopped: every row reaches the same process.
@app.cls(
    min_replicas=1, max_replicas=1, max_concurrency=1024, target_concurrency=1024, scaledown_window=3600, timeout=30
)
class Upstream:
    @ember.asgi_app()
    def web(self):
        return openai_upstream
