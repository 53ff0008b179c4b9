"""A test app whose functions' signatures the gateway's OpenAPI document describes: scalars, defaults, a pydantic
model, an unannotated parameter, a class method, a generator and an ASGI endpoint."""
from pydantic import BaseModel

import ember

app = ember.App("typed")


class Item(BaseModel):
    name: str
    price: float = 1.0


@app.function(scaledown_window=30)
def quote(items: list[Item], discount: float = 0.0, note=None) -> dict[str, float]:
    return {"total": sum(item.price for item in items) * (1 - discount)}


@app.function(scaledown_window=30)
def count(up_to: int):
    yield from range(up_to)


@app.cls(scaledown_window=30)
class Shouter:
    @ember.method()
    def shout(self, word: str, times: int = 1) -> str:
        return (word.upper() + " ") * times


@app.function(scaledown_window=30)
@ember.asgi_app(openai_base="/v1")  # says it serves the OpenAI API there (as examples/chat.py's engine does)
def web():
    async def asgi(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})

    return asgi
