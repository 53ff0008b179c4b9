"""A test app for scaling settings: a pre-warmed function and one that needs a second replica under load."""
import os
import time

import ember

app = ember.App("scaling")


@app.function(min_replicas=1, scaledown_window=1)
def warm() -> int:
    return os.getpid()


@app.function(max_concurrency=1, max_replicas=2, scaledown_window=30)
def busy(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


@app.cls(max_concurrency=8, target_concurrency=4, max_replicas=3, scaledown_window=30, timeout=30)
class Llm:
    """A fake OpenAI endpoint: streams `max_tokens` chunks, `delay` s apart, whatever `n` asks."""

    @ember.asgi_app()
    def web(self):
        import asyncio

        from fastapi import FastAPI, Request
        from fastapi.responses import StreamingResponse

        api = FastAPI()

        @api.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()

            async def events():
                for _ in range(int(body.get("max_tokens", 4))):
                    yield 'data: {"choices": [{"text": "x"}]}\n\n'
                    await asyncio.sleep(float(body.get("delay", 0.0)))
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        return api
