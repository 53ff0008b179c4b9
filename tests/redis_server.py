"""A real, throwaway `redis-server` for tests.

    from tests.redis_server import redis_url      # pytest fixture: "redis://127.0.0.1:PORT/0"

    def test_something(redis_url): ...

or, outside pytest, `with redis_server() as url: ...`. Each server runs on a free port
in its own temp dir with persistence off, and is shut down (and reaped) on exit. The
fixture is module-scoped: tests in one module share a server, so give each test its
own key prefix (or FLUSHDB) rather than relying on an empty database.
"""

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

import pytest

STARTUP_TIMEOUT_S = 10.0


def _binary() -> str:
    path = shutil.which("redis-server") or "/usr/bin/redis-server"
    if not os.path.exists(path):
        raise RuntimeError("redis-server not found: install it (apt-get install redis-server) or put it on PATH")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pings(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    """Start redis-server, wait until it answers PING, yield its URL, stop it."""
    binary = _binary()
    with tempfile.TemporaryDirectory(prefix="ember-redis-") as tmp:
        # Free-port probing can race another process; a couple of fresh ports settle it.
        for _ in range(3):
            port = _free_port()
            log = open(f"{tmp}/redis.log", "w+b")
            proc = subprocess.Popen(
                [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", tmp],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            while proc.poll() is None and time.monotonic() < deadline and not _pings(port):
                time.sleep(0.02)
            if proc.poll() is None and _pings(port):
                break
            proc.kill()
            proc.wait()
            log.seek(0)
            output = log.read().decode(errors="replace")
            log.close()
        else:
            raise RuntimeError(f"redis-server did not start on 127.0.0.1 (last output):\n{output[-2000:]}")
        try:
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with redis_server() as url:
        yield url
