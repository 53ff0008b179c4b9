"""Hardening over a real HTTPS socket: size limits, timeouts, name checks, JSON errors everywhere, and the
OpenAPI spec of the public surface fuzzed by schemathesis."""
import json
from pathlib import Path

import hypothesis
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ember.gateway.body import MAX_BODY

APPS = Path(__file__).parent / "apps"


def test_size_limits_timeouts_and_names_answer_json(serve):
    served = serve(APPS / "quick.py")
    with served.client(served.key(), timeout=30) as http:
        declared = http.post(
            "/quick/add", content=b"{" + b" " * MAX_BODY + b"}", headers={"content-type": "application/json"}
        )
        assert declared.status_code == 413 and declared.json()["error"]["type"] == "body_too_large"
        # No Content-Length (chunked): counted as it arrives.
        chunked = http.post("/quick/add", content=iter([b" " * (1 << 20)] * 17))
        assert chunked.status_code == 413 and chunked.json()["error"]["type"] == "body_too_large"

        big = http.post("/quick/add", json={"a": 1, "b": 2}, headers={"x-filler": "y" * 40_000})
        assert big.status_code == 431 and big.json()["error"]["type"] == "headers_too_large"
        many = http.post("/quick/add", json={"a": 1, "b": 2}, headers={f"x-h{i}": "1" for i in range(120)})
        assert many.status_code == 431

        slow = http.post("/quick/sleepy", json={"seconds": 10})  # its timeout is 1 s
        assert slow.status_code == 504 and slow.json()["error"]["type"] == "timeout"

        for path in ["/Quick/add", "/qu%20ick/add", "/-quick/add", "/" + "a" * 70 + "/add"]:
            reply = http.post(path, json={})
            assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_name", path
        assert http.post("/quick/nothing", json={}).json()["error"]["type"] == "not_found"
        assert http.get("/quick/add").status_code == 405
        assert http.post("/quick/add", content=b"[1]").status_code == 422
        assert http.post("/quick/add", content=b"{nope").json()["error"]["type"] == "invalid_json"
        # A large body is checked by the replica, not on the gateway's event loop: the same answers.
        large = http.post("/quick/add", content=b'{"a": 1, "b": "' + b"x" * (1 << 20) + b'"')
        assert large.status_code == 400 and large.json()["error"]["type"] == "invalid_json", large.text
        wrong = http.post("/quick/add", json={"a": 1, "b": 2, "pad": "x" * (1 << 20)})
        assert wrong.status_code == 422 and "unknown argument 'pad'" in wrong.json()["error"]["message"], wrong.text

    spec = served.client(served.key("reader")).get("/openapi.json").json()
    assert {"/admin/keys", "/admin/keys/{key}", "/admin/apps/{app}/limits", "/quick/add", "/healthz"} <= set(
        spec["paths"]
    )
    assert spec["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"


def test_schemathesis_finds_no_server_error_and_every_error_is_json(serve):
    served = serve(APPS / "quick.py")
    session = requests.Session()
    session.trust_env = False  # a REQUESTS_CA_BUNDLE in the environment would override the dev CA
    session.verify = str(served.ca)
    session.headers["Authorization"] = f"Bearer {served.key('fuzzer-admin-0a1b2c3d', admin=True)}"
    spec = session.get(f"{served.url}/openapi.json").json()
    schema = schemathesis.openapi.from_dict(spec)
    checked = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.path == "/quick/sleepy":  # its timeout is 1 s: a longer sleep answers 504 by design
            continue

        @given(case=operation.as_strategy())
        @settings(max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck),
                  phases=[hypothesis.Phase.generate])
        def fuzz(case):
            if case.path == "/admin/keys/{key}" and case.method == "DELETE":
                case.path_parameters = {"key": case.path_parameters["key"] + "-unknown"}  # keep the fuzzer's own key
            response = case.call(base_url=served.url, session=session, verify=str(served.ca))
            assert response.status_code < 500, (
                f"{case.method} {case.formatted_path}: {response.status_code} {response.text[:300]}"
            )
            if response.status_code >= 400 and case.method != "HEAD":  # a HEAD reply has no body by definition
                assert "application/json" in str(response.headers.get("content-type")), (
                    f"{case.method} {case.formatted_path}: {response.text[:300]}"
                )
                error = response.json()["error"]
                assert isinstance(error["type"], str) and isinstance(error["message"], str)

        fuzz()
        checked += 1
    assert checked >= 15


NAMES = st.text(alphabet=st.characters(codec="ascii"), min_size=0, max_size=80)


@given(name=NAMES)
def test_app_names_are_lower_case_words_of_at_most_63_characters(name):
    from ember.gateway.routing import APP_NAME

    ok = bool(APP_NAME.fullmatch(name))
    expected = 1 <= len(name) <= 63 and name[0] in "abcdefghijklmnopqrstuvwxyz0123456789" and all(
        c in "abcdefghijklmnopqrstuvwxyz0123456789_-" for c in name)
    assert ok == expected


@given(
    scope=st.text(max_size=40) | st.sampled_from(["admin", "app:chat", "fn:chat/Chat", "app:../x", "fn:a/b/c", "app:"])
)
def test_scopes_are_checked_against_the_grammar(scope):
    from ember.gateway.keys import check_scopes

    valid = scope == "admin" or scope.startswith(("app:", "fn:"))
    try:
        assert check_scopes([scope]) == [scope]
    except ValueError as exc:
        assert "app:APP" in str(exc)
    else:
        assert valid and "/" not in scope.removeprefix("fn:").split("/", 1)[-1] and ".." not in scope


@given(chunks=st.lists(st.binary(max_size=64), max_size=20), usage=st.integers(0, 10**6) | st.none())
def test_usage_meter_reads_usage_wherever_the_chunks_split(chunks, usage):
    from ember.gateway.usage import UsageMeter

    body = b"".join(f"data: {json.dumps({'choices': [{'delta': {'content': 'x'}}]})}\n\n".encode() for _ in range(3))
    if usage is not None:
        body += f"data: {json.dumps({'choices': [], 'usage': {'total_tokens': usage}})}\n\n".encode()
    body += b"data: [DONE]\n\n"
    meter = UsageMeter(prompt_estimate=10)
    cuts = sorted({min(len(c), len(body)) for c in chunks} | {0, len(body)})  # arbitrary split points
    for start, end in zip(cuts, cuts[1:]):
        meter.feed(body[start:end])
    meter.feed(b"")
    assert meter.total() == (usage if usage is not None else 10 + 3)
    assert meter.tail is None  # a stream's bytes are not kept


@given(chunks=st.lists(st.binary(max_size=64), max_size=20), usage=st.integers(0, 10**6) | st.none())
def test_usage_meter_reads_a_json_replys_usage_wherever_the_chunks_split(chunks, usage):
    from ember.gateway.usage import UsageMeter

    reply = {"choices": [{"message": {"content": "data: not an event"}}]}
    body = b"  " + json.dumps(reply | ({"usage": {"total_tokens": usage}} if usage is not None else {})).encode()
    meter = UsageMeter(prompt_estimate=10)
    cuts = sorted({min(len(c), len(body)) for c in chunks} | {0, len(body)})
    for start, end in zip(cuts, cuts[1:]):
        meter.feed(body[start:end])
    assert meter.total() == (usage if usage is not None else 10)


def test_usage_meter_reads_the_end_of_a_json_reply_past_a_mebibyte_and_holds_no_huge_line():
    """It kept a JSON reply's first MiB, where its usage is not: a key was charged its prompt's estimate alone for
    a large non-streamed reply (n=128, say). And every chunk was added to a line buffer a JSON reply never ends,
    re-copied per chunk: quadratic on the gateway's event loop in the reply's size."""
    from ember.gateway.usage import JSON_TAIL, UsageMeter

    text = "a model's \"usage\": {\"total_tokens\": 1} " * 60_000   # ~2.6 MB, quoting a fake usage in its text
    body = json.dumps({"choices": [{"message": {"content": text}}], "usage": {"total_tokens": 123_456},
                       "system_fingerprint": None}).encode()
    assert len(body) > 2 * JSON_TAIL
    meter = UsageMeter(prompt_estimate=10)
    for at in range(0, len(body), 65_536):
        meter.feed(body[at:at + 65_536])
        assert len(meter.tail) <= JSON_TAIL and meter.partial == b""
    assert meter.total() == 123_456
    events = UsageMeter(prompt_estimate=10)   # an event stream with a line of megabytes: not held, and read on
    events.feed(b"data: " + b"x" * 3_000_000)
    for _ in range(40):
        events.feed(b"y" * 65_536)
        assert len(events.partial) <= JSON_TAIL
    events.feed(b'\n\ndata: {"choices": [], "usage": {"total_tokens": 77}}\n\ndata: [DONE]\n\n')
    assert events.total() == 77
    fake_only = UsageMeter(prompt_estimate=10)   # no usage of its own: the quoted one does not count
    fake_only.feed(json.dumps({"choices": [{"message": {"content": text}}]}).encode())
    assert fake_only.total() == 10


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=40)
@given(size=st.integers(0, 70_000), count=st.integers(0, 150))
def test_header_limit(size, count):
    import asyncio

    from ember.gateway.header_limit import MAX_HEADER_BYTES, MAX_HEADERS, HeaderLimit

    reached = []

    async def app(scope, receive, send):
        reached.append(True)

    sent = []

    async def send(message):
        sent.append(message)

    headers = [(b"x-big", b"y" * size)] + [(f"x-{i}".encode(), b"1") for i in range(count)]
    asyncio.run(HeaderLimit(app)({"type": "http", "headers": headers, "raw_path": b"/a/b"}, None, send))
    too_big = sum(len(k) + len(v) + 4 for k, v in headers) + 4 > MAX_HEADER_BYTES or len(headers) > MAX_HEADERS
    assert bool(reached) != too_big
    if too_big:
        assert sent[0]["status"] == 431 and json.loads(sent[1]["body"])["error"]["type"] == "headers_too_large"


def test_a_batch_of_prompts_is_estimated_at_every_prompts_completions():
    """A key's token limit admits a request by its estimate: a batch of 2048 prompts asks 2048 times the tokens of
    one (settled from the reply's usage later, but by then they were spent)."""
    from ember.gateway.usage import estimate, max_tokens

    one = {"prompt": "hi", "max_tokens": 100, "n": 2}
    assert max_tokens(one) == 200
    assert max_tokens(one | {"prompt": [5, 6, 7]}) == 200   # one prompt of token ids
    assert max_tokens(one | {"prompt": ["hi"] * 2048}) == 2048 * 200
    assert max_tokens(one | {"prompt": [[5], [6, 7]]}) == 400
    assert max_tokens({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "prompt": ["a", "b"]}) == 10
    assert estimate(one | {"prompt": ["hi"] * 2048}) > 2048 * 200
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    schema = {"type": "function", "function": {"name": "f", "parameters": {"description": "x" * 40_000}}}
    assert estimate(chat | {"tools": [schema]}) > estimate(chat) + 9_000   # the template writes the tools in
    # a response: its instructions, input and tools are the prompt, max_output_tokens the completion
    response = {"input": "hi", "max_output_tokens": 300}
    assert max_tokens(response) == 300 and estimate(response) < 310
    assert estimate(response | {"input": "x" * 40_000}) > 10_300
    assert estimate(response | {"instructions": "x" * 40_000}) > 10_300
    assert estimate(response | {"input": [{"role": "user", "content": "x" * 40_000}]}) > 10_300
    assert estimate(response | {"tools": [schema]}) > estimate(response) + 9_000


def test_usage_meter_reads_a_streamed_responses_usage_from_its_last_event():
    """The Responses API's stream carries its usage inside the `response` of its last event, not at the top of an
    event as the chat stream does: read at the top alone, every response was charged its prompt's estimate and a
    count of its events."""
    from ember.gateway.usage import UsageMeter

    def event(kind: str, **fields) -> bytes:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n".encode()

    meter = UsageMeter(prompt_estimate=10)
    tools = [{"type": "function", "name": "f", "parameters": {"properties": {"total_tokens": {}, "usage": {}}}}]
    meter.feed(event("response.created", response={"tools": tools, "usage": None}))   # a schema names them too
    for _ in range(5):
        meter.feed(event("response.output_text.delta", delta='"usage": {"total_tokens": 1}'))
    done = {"output": [], "metadata": {"usage": "x"}, "usage": {"input_tokens": 7, "total_tokens": 4242}}
    meter.feed(event("response.completed", response=done))
    assert meter.total() == 4242
