"""The gateway's relay to a replica over a real HTTPS socket: reply headers, whole and streamed bodies, redirects
passed back, a reply cut mid-body, and an upload over the body limit."""
import textwrap

from ember.gateway.body import MAX_BODY
from ember.gateway.proxy import WHOLE_BODY

APP = textwrap.dedent("""
    import ember

    app = ember.App("relay")


    async def upstream(scope, receive, send):
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        received, more = 0, True
        while more:
            message = await receive()
            received += len(message.get("body", b""))
            more = message.get("more_body", False)
        path = scope["path"]
        size = int(scope["query_string"] or 0) if path == "/sized" else 0
        if path == "/cut":  # promises more than it sends, then fails: uvicorn drops the connection
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", b"1000")]})
            await send({"type": "http.response.body", "body": b'{"partial":', "more_body": True})
            raise RuntimeError("the replica failed mid-body")
        if path == "/moved":
            moved = [(b"location", b"/elsewhere"), (b"x-long", b"y" * 20_000)]
            await send({"type": "http.response.start", "status": 302, "headers": moved})
            await send({"type": "http.response.body", "body": b""})
            return
        if path == "/cookie":  # sets one, and answers with the cookies the request carried
            body = dict(scope["headers"]).get(b"cookie", b"")
            await send({"type": "http.response.start", "status": 200, "headers": [(b"set-cookie", b"secret=alice")]})
            await send({"type": "http.response.body", "body": body})
            return
        if path == "/query":
            body = scope["query_string"]
        else:
            body = b"x" * size if path == "/sized" else str(received).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


    @app.cls(scaledown_window=30)
    class Web:
        @ember.asgi_app()
        def web(self):
            return upstream
""")


def test_replies_pass_through_with_their_length_and_one_date_and_server(serve, tmp_path):
    app = tmp_path / "relay.py"
    app.write_text(APP)
    served = serve(app)
    with served.client(served.key()) as http:
        for size in (10, WHOLE_BODY + 1):  # read whole, and streamed
            reply = http.get(f"/relay/sized?{size}")
            assert reply.status_code == 200 and reply.content == b"x" * size, reply.text[:300]
            assert reply.headers["content-length"] == str(size) and "transfer-encoding" not in reply.headers
            assert len(reply.headers.get_list("date")) == 1 and reply.headers.get_list("server") == ["uvicorn"]
            assert reply.headers["x-ember-replica"].startswith("web-")

        query = "a=%2F&b=c+d&e=%E2%9C%93&f"
        assert http.get(f"/relay/query?{query}").text == query  # passed as sent, not decoded or quoted twice

        assert http.get("/relay/cookie").headers["set-cookie"] == "secret=alice"
        http.cookies.clear()
        assert http.get("/relay/cookie").text == ""  # the gateway sends no cookie of its own
        assert http.get("/relay/cookie", headers={"cookie": "mine=1"}).text == "mine=1"

        moved = http.get("/relay/moved")  # the client's to follow, not the gateway's
        assert (
            moved.status_code == 302
            and moved.headers["location"] == "/elsewhere"
            and len(moved.headers["x-long"]) == 20_000
        )

        cut = http.get("/relay/cut")
        assert cut.status_code == 502 and cut.json()["error"]["type"] == "replica_failed"

        upload = http.post("/relay/upload", content=iter([b" " * (1 << 20)] * 3))  # chunked, streamed through
        assert upload.status_code == 200 and upload.text == str(3 << 20)
        over = http.post("/relay/upload", content=iter([b" " * (1 << 20)] * (MAX_BODY // (1 << 20) + 1)))
        assert over.status_code == 413 and over.json()["error"]["type"] == "body_too_large"

        assert http.get("/relay/sized?3").text == "xxx"  # the gateway still serves after all that
    assert served.in_flight_after_settling("relay", "Web") == 0


def test_the_stall_watch_ends_only_a_send_pending_for_the_whole_timeout():
    """StallWatch (the relay's --send-timeout): sends that each finish keep a stream going however long it runs; one
    send pending for the timeout ends it, once, and stop() leaves nothing armed."""
    import asyncio

    from ember.gateway.proxy import StallWatch

    stall = 0.4

    async def scenario() -> tuple[list[float], list[float], float]:
        loop = asyncio.get_running_loop()
        flowing, stalled = StallWatch(stall), StallWatch(stall)
        ended: dict[str, list[float]] = {"flowing": [], "stalled": []}
        flowing.start(loop, lambda: ended["flowing"].append(loop.time()), lambda: None)
        stalled.start(loop, lambda: ended["stalled"].append(loop.time()), lambda: None)
        finish = loop.time() + 3 * stall
        while loop.time() < finish:  # sends of ~0.02 s each for three timeouts: none pending for a whole one
            flowing.since = stalled.since = loop.time()
            await asyncio.sleep(0.02)
            flowing.since = stalled.since = None
        stalled.since = last = loop.time()  # a client that takes nothing from here on
        await asyncio.sleep(2.5 * stall)
        flowing.stop()
        stalled.stop()
        assert flowing.timer is None and stalled.timer is None
        return ended["flowing"], ended["stalled"], last

    flowing, stalled, last = asyncio.run(scenario())
    assert flowing == []
    assert len(stalled) == 1 and stall - 0.01 <= stalled[0] - last <= 2.5 * stall, (stalled, last)
