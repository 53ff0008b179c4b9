"""ReplyOnError under a real uvicorn over a real socket: an unhandled exception is a 500 on a connection that stays
open (the gateway's pooled connections depend on it); one raised mid-stream still cuts the connection."""
import logging
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ember.runtime.unhandled import ReplyOnError


def app() -> FastAPI:
    app = FastAPI()
    app.add_middleware(ReplyOnError, log=logging.getLogger("test"),
                       reply=lambda e: JSONResponse({"error": {"type": type(e).__name__}}, status_code=500))

    @app.exception_handler(KeyError)  # the app's own handlers still come first
    async def missing(request: Request, e: KeyError):
        return JSONResponse({"error": {"type": "not_found"}}, status_code=404)

    port_and_bug(app, "a bug")

    @app.get("/missing")
    async def key():
        raise KeyError("k")

    @app.get("/stream")
    async def stream():
        async def chunks():
            yield b"first "
            raise RuntimeError("broke midway")
        return StreamingResponse(chunks())

    return app


def port_and_bug(app: FastAPI, bug: str) -> None:
    """GET /port: the client's port (the same port, the same connection); GET /boom raises TypeError(bug)."""

    @app.get("/port")
    async def port(request: Request):
        return {"port": request.client.port}

    @app.get("/boom")
    async def boom():
        raise TypeError(bug)


def users_app():
    """A user's FastAPI app: its own Starlette answers 500 to an error and raises it again."""
    app = FastAPI()
    port_and_bug(app, "the user's bug")
    return ReplyOnError(app, log=logging.getLogger("test"), reply=lambda e: JSONResponse({}, status_code=500))


def serving(asgi):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(asgi, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", lambda: (setattr(server, "should_exit", True), thread.join(10))


@pytest.fixture(scope="module")
def url():
    address, stop = serving(app())
    yield address
    stop()


def test_around_a_users_app_an_error_after_its_own_500_leaves_the_connection_open(caplog):
    address, stop = serving(users_app())
    try:
        with httpx.Client(base_url=address) as http, caplog.at_level(logging.ERROR, logger="test"):
            before = http.get("/port").json()["port"]
            failed = http.get("/boom")
            assert failed.status_code == 500 and failed.text == "Internal Server Error"  # Starlette's own reply
            assert http.get("/port").json()["port"] == before
            deadline = time.monotonic() + 10  # logged once the reply was out, by a task that may finish later
            while "the user's bug" not in caplog.text:
                assert time.monotonic() < deadline, "the error was never logged"
                time.sleep(0.05)
    finally:
        stop()


def test_an_unhandled_exception_is_a_500_and_the_connection_serves_the_next_request(url, caplog):
    with httpx.Client(base_url=url) as http:  # one pooled keep-alive connection
        before = http.get("/port").json()["port"]
        with caplog.at_level(logging.ERROR, logger="test"):
            failed = http.get("/boom")
        assert failed.status_code == 500 and failed.json() == {"error": {"type": "TypeError"}}
        assert "unhandled error on GET /boom" in caplog.text and "a bug" in caplog.text  # the traceback is logged
        assert http.get("/port").json()["port"] == before  # the same connection: the server did not close it
        assert http.get("/missing").status_code == 404


def test_an_exception_once_a_stream_started_cuts_the_connection(url):
    with httpx.Client(base_url=url) as http, pytest.raises(httpx.RemoteProtocolError):
        http.get("/stream").read()
