"""A test app serving a tiny FastAPI app that streams SSE, next to a declared method."""
import asyncio

import ember

app = ember.App("streaming")


@app.cls(max_concurrency=8, target_concurrency=8, scaledown_window=30)
class Web:
    @ember.enter()
    def start(self):
        self.cancelled = 0
        self.produced = 0

    @ember.method()
    def ping(self) -> str:
        return "pong"

    @ember.asgi_app()
    def web(self):
        from fastapi import FastAPI, Request
        from fastapi.responses import StreamingResponse

        api = FastAPI()

        @api.post("/v1/echo")
        async def echo(request: Request) -> dict:
            return {"path": request.url.path, "query": request.url.query, "body": await request.json(),
                    "caller": request.headers.get("x-ember-caller")}

        @api.get("/v1/stream")
        async def stream(n: int = 1000):
            async def events():
                finished = False
                try:
                    for i in range(n):
                        yield f"data: {i}\n\n"
                        await asyncio.sleep(0.05)
                    finished = True
                finally:
                    if not finished:
                        self.cancelled += 1

            return StreamingResponse(events(), media_type="text/event-stream")

        @api.get("/v1/big")
        async def big(chunks: int = 256):
            async def megabytes():
                for _ in range(chunks):
                    self.produced += 1
                    yield b"x" * (1 << 20)

            return StreamingResponse(megabytes(), media_type="application/octet-stream")

        @api.get("/v1/produced")
        async def produced() -> dict:
            return {"produced": self.produced}

        @api.get("/v1/cancelled")
        async def cancelled() -> dict:
            return {"cancelled": self.cancelled}

        return api
