"""A test app with several warm replicas: session affinity, retries after a replica dies, a fake OpenAI endpoint."""
import asyncio
import json
import os
import time

import ember

app = ember.App("fleet")


# retries=1: safe to run twice, so a call whose replica dies mid-call may go to another
# (tests/gateway/test_replica_choice.py)
@app.function(min_replicas=3, max_replicas=3, max_concurrency=4, scaledown_window=60, timeout=20, retries=1)
def where(seconds: float = 0.0) -> int:
    time.sleep(seconds)
    return os.getpid()


@app.cls(min_replicas=2, max_replicas=2, max_concurrency=8, target_concurrency=8, scaledown_window=60, timeout=20)
class Llm:
    @ember.asgi_app()
    def web(self):
        from fastapi import FastAPI, Request
        from fastapi.responses import StreamingResponse

        api = FastAPI()

        @api.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            words = int(body.get("words", body.get("max_tokens", 4)))  # "words": stop early, as at an EOS
            usage = {"prompt_tokens": 7, "completion_tokens": words, "total_tokens": 7 + words}
            if not body.get("stream"):
                return {"choices": [{"message": {"content": "x " * words}}], "usage": usage, "pid": os.getpid()}

            async def events():
                for _ in range(words):
                    yield f"data: {json.dumps({'choices': [{'delta': {'content': 'x'}}]})}\n\n"
                    await asyncio.sleep(float(body.get("delay", 0.0)))
                if body.get("stream_options", {}).get("include_usage"):
                    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        @api.post("/v1/responses")
        async def responses(request: Request):
            """The Responses API's shape: usage in the `response` of the last event (each delta here is 10 tokens)."""
            body = await request.json()
            words = int(body.get("words", body.get("max_output_tokens", 4)))
            usage = {"input_tokens": 7, "output_tokens": 10 * words, "total_tokens": 7 + 10 * words}
            if not body.get("stream"):
                return {"object": "response", "output": [], "usage": usage}

            def event(kind: str, **fields) -> str:
                return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"

            async def events():
                yield event("response.created", response={"output": [], "usage": None})
                for _ in range(words):
                    yield event("response.output_text.delta", delta="x")
                yield event("response.completed", response={"output": [], "usage": usage})

            return StreamingResponse(events(), media_type="text/event-stream")

        @api.get("/v1/pid")
        async def pid() -> dict:
            return {"pid": os.getpid()}

        return api
