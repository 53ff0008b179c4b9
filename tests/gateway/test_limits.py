"""Rate limits over a real HTTPS socket: per key and per app, tokens settled from the reply's usage, and two
gateway processes sharing one real redis-server enforcing one limit together."""
import concurrent.futures
import socket
import time
from pathlib import Path

from tests.conftest import launch, stop_serve
from tests.redis_server import redis_url  # noqa: F401  (pytest fixture)

APPS = Path(__file__).parent / "apps"


def test_requests_per_minute_per_key_and_per_app(serve):
    served = serve(APPS / "quick.py")
    key = served.cli("keys", "create", "--quiet", "--name", "slow", "--rpm", "3").stdout.strip()
    with served.client(key) as http:
        replies = [http.post("/quick/add", json={"a": 1, "b": 1}) for _ in range(4)]
    assert [r.status_code for r in replies] == [200, 200, 200, 429]
    assert [r.headers["x-ratelimit-remaining-requests"] for r in replies[:3]] == ["2", "1", "0"]
    assert replies[0].headers["x-ratelimit-limit-requests"] == "3"
    denied = replies[3]
    assert (
        denied.json()["error"]["type"] == "rate_limit_exceeded"
        and "requests per minute" in denied.json()["error"]["message"]
    )
    assert 1 <= int(denied.headers["retry-after"]) <= 20
    metrics = served.client(None).get("/metrics").text
    assert 'ember_requests_total{app="quick",function="add",code="429"} 1' in metrics

    with served.client(served.key("root", admin=True)) as admin:
        put = admin.put("/admin/apps/quick/limits", json={"rpm": 2})
        assert put.status_code == 200, put.text
        assert admin.get("/admin/apps/quick/limits").json()["rpm"] == 2
        assert admin.put("/admin/apps/Bad..Name/limits", json={"rpm": 2}).status_code == 400
    with served.client(served.key("unlimited")) as http:  # the app's limit binds a key that has none
        assert [http.post("/quick/add", json={"a": 1, "b": 1}).status_code for _ in range(3)] == [200, 200, 429]


def test_concurrency_and_tokens_are_settled_when_the_response_ends(serve):
    served = serve(APPS / "fleet.py")
    key = served.cli("keys", "create", "--quiet", "--name", "llm", "--tpm", "1000", "--concurrency", "1").stdout.strip()
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 600, "words": 5}
    with served.client(key) as http, served.client(key) as other:
        first = http.post("/fleet/v1/chat/completions", json=chat)
        assert first.status_code == 200, first.text
        assert int(first.headers["x-ratelimit-remaining-tokens"]) < 400  # ~610 reserved at admission ...
        after_first = http.post("/fleet/v1/chat/completions", json=chat | {"max_tokens": 1})
        assert int(after_first.headers["x-ratelimit-remaining-tokens"]) > 950  # ... settled to the reply's usage, 12
        stream = chat | {"stream": True, "words": 20, "delay": 0.05, "stream_options": {"include_usage": True}}
        with http.stream("POST", "/fleet/v1/chat/completions", json=stream) as events:
            lines = events.iter_lines()
            assert next(lines).startswith("data:")
            busy = other.post("/fleet/v1/chat/completions", json=chat)  # the stream holds the one slot
            assert busy.status_code == 429 and "concurrent requests" in busy.json()["error"]["message"]
            rest = list(lines)  # to the end: the slot is freed before the client sees it
            assert any('"usage"' in line for line in rest) and "data: [DONE]" in rest
        after_stream = other.post("/fleet/v1/chat/completions", json=chat | {"max_tokens": 1})
        assert after_stream.status_code == 200
        # The stream's usage (27) and one small request, not the stream's 610-token reservation.
        assert int(after_stream.headers["x-ratelimit-remaining-tokens"]) > 900


def test_a_response_reserves_its_max_output_tokens_and_is_settled_from_its_last_events_usage(serve):
    """/v1/responses is an LLM call like the chat API's: reserved at admission, charged what its usage says."""
    served = serve(APPS / "fleet.py")
    key = served.cli("keys", "create", "--quiet", "--name", "llm", "--tpm", "1000").stdout.strip()
    with served.client(key) as http:
        whole = http.post("/fleet/v1/responses", json={"input": "hi", "max_output_tokens": 600, "words": 2})
        assert whole.status_code == 200, whole.text
        assert int(whole.headers["x-ratelimit-remaining-tokens"]) < 400   # ~610 reserved at admission
        stream = {"input": "hi", "max_output_tokens": 600, "words": 30, "stream": True}
        with http.stream("POST", "/fleet/v1/responses", json=stream) as events:
            assert int(events.headers["x-ratelimit-remaining-tokens"]) < 400   # the reply's 27 and 610 more
            events.read()
        after = http.post("/fleet/v1/responses", json={"input": "hi", "max_output_tokens": 1, "words": 1})
    # charged 27 (the first), 307 (the stream's usage, not its 31 events) and 3 reserved: 663 left, and what
    # refilled meanwhile (counted from its events, the stream left about 940)
    assert 620 < int(after.headers["x-ratelimit-remaining-tokens"]) < 800, after.headers


def test_a_redis_that_does_not_answer_fails_limited_requests_closed(serve):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    served = serve(APPS / "quick.py", "--redis", f"redis://:s3cret@127.0.0.1:{port}/0")
    started = "".join(served.stdout)   # said at start, without the password (it served silently before)
    assert f"warning: Redis at redis://127.0.0.1:{port}/0 does not answer" in started, started
    assert "rate_limiter_unavailable until it does" in started and "s3cret" not in started
    with served.client(served.cli("keys", "create", "--quiet", "--name", "l", "--rpm", "5").stdout.strip()) as http:
        reply = http.post("/quick/add", json={"a": 1, "b": 1})
    assert reply.status_code == 503 and reply.json()["error"]["type"] == "rate_limiter_unavailable"
    assert reply.headers["retry-after"] == "1"
    with served.client(served.key("free")) as http:  # a request no limit applies to needs no Redis
        assert http.post("/quick/add", json={"a": 1, "b": 1}).status_code == 200


def test_two_gateways_sharing_redis_admit_exactly_the_limit_together(serve, redis_url, tmp_path):  # noqa: F811
    first = serve(APPS / "quick.py", "--redis", redis_url)
    # One gateway per EMBER_HOME: the second has a home of its own whose key database is the first's.
    second_home = tmp_path / "second-home"
    second_home.mkdir()
    (second_home / "ember.db").symlink_to(first.home / "ember.db")
    started: list = []
    try:
        _share_limits_and_revocations(first, launch(second_home, APPS / "quick.py", "--redis", redis_url,
                                                    started=started))
    finally:
        for process in started:
            stop_serve(process)


def _share_limits_and_revocations(first, second) -> None:
    for served in (first, second):  # start each gateway's replica with a key that has no limit
        with served.client(first.key("warm")) as http:
            assert http.post("/quick/add", json={"a": 0, "b": 0}).status_code == 200
    key = first.cli("keys", "create", "--quiet", "--name", "shared", "--rpm", "10").stdout.strip()
    with first.client(key) as a, second.client(key) as b:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            codes = list(
                pool.map(lambda i: (a if i % 2 else b).post("/quick/add", json={"a": i, "b": 0}).status_code, range(24))
            )
    assert codes.count(200) == 10 and codes.count(429) == 14, codes

    # A revocation through one gateway reaches the other within its key-cache TTL (1 s).
    other = first.key("other")
    with first.client(first.key("root", admin=True)) as admin, second.client(other) as b:
        assert b.post("/quick/add", json={"a": 0, "b": 0}).status_code == 200
        assert admin.delete("/admin/keys/other").status_code == 200
        time.sleep(1.05)
        assert b.post("/quick/add", json={"a": 0, "b": 0}).status_code == 401
