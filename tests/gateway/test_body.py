"""gateway/body.py with a real Starlette request: a large body is not parsed on the gateway's event loop (an LLM
request's tokens are estimated in a thread, a call's arguments are checked by its replica), which goes on serving
others meanwhile."""
import asyncio
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.requests import Request

from ember.gateway.body import PARSE_INLINE, _completion_usage, read_forward, read_kwargs
from ember.gateway.errors import ApiError
from ember.gateway.inflight import BodyBudget
from ember.gateway.routing import Forward


def request(path: str, body: bytes, headers: tuple[tuple[bytes, bytes], ...] = ()) -> Request:
    chunks = [body[at:at + (1 << 20)] for at in range(0, len(body), 1 << 20)]

    async def receive():
        chunk = chunks.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

    scope = {"type": "http", "method": "POST", "path": path,
             "headers": [(b"content-length", str(len(body)).encode()), *headers], "query_string": b""}
    return Request(scope, receive)


async def ticks_while(work) -> tuple[object, int]:
    """What `work` returns, and how often the event loop ran another task (every millisecond) while it ran."""
    ticks, done = 0, asyncio.Event()

    async def ticker():
        nonlocal ticks
        while not done.is_set():
            await asyncio.sleep(0.001)
            ticks += 1

    counting = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    before = ticks
    try:
        return await work, ticks - before
    finally:
        done.set()
        await counting


def test_a_large_llm_request_is_estimated_while_the_event_loop_serves_others():
    messages = [{"role": "user", "content": "x"}] * 300_000  # 10 MB of small objects: ~0.5 s of estimating
    body = json.dumps({"model": "m", "messages": messages, "max_tokens": 7}).encode()
    assert len(body) > 100 * PARSE_INLINE

    async def scenario():
        return await ticks_while(read_forward(request("/app/v1/chat/completions", body),
                                              Forward("Chat", "/v1/chat/completions"), None, BodyBudget(64 << 20, 30)))

    read, ticks = asyncio.run(scenario())
    assert read.tokens > 300_000 and read.meter is not None and read.affinity is not None
    assert ticks >= 5, f"the event loop ran other work {ticks} times while the body was estimated"


def test_a_small_call_body_is_checked_here_and_a_large_one_left_to_the_replica():
    budget = BodyBudget(64 << 20, 30)
    with pytest.raises(ApiError) as small:
        asyncio.run(read_kwargs(request("/app/fn", b"[1, 2"), budget))
    assert small.value.status == 400 and small.value.type == "invalid_json"
    large = b"[" + b"1, " * PARSE_INLINE
    assert asyncio.run(read_kwargs(request("/app/fn", large), budget)) == large  # not parsed on the event loop
    with pytest.raises(ApiError) as packed:   # a large compressed body too: refused before it is read
        asyncio.run(read_kwargs(request("/app/fn", large, ((b"content-encoding", b"gzip"),)), budget))
    assert packed.value.status == 415 and packed.value.type == "unsupported_encoding"


# any code point, lone surrogates too (JSON carries them as "\ud800"), and strings long enough for a prefix key
TEXT = st.text(st.characters(exclude_categories=()), max_size=600)
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | TEXT,
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["messages", "prompt", "max_tokens", "max_completion_tokens", "n", "model"]),
                       JSON, max_size=4))
def test_any_json_object_gets_an_estimate_and_no_error(body):
    """An OpenAI body's estimate, routing key and sequences, whatever its fields hold (lone surrogates included):
    the engine refuses what it cannot take, with its own 400; the gateway must not fail first."""
    raw = json.dumps(body).encode()
    tokens, prompt, key, sequences = _completion_usage(raw)
    assert tokens >= 1 and 1 <= prompt <= tokens and (key is None or key.startswith("prefix:"))
    assert sequences >= 1


@pytest.mark.parametrize("body, sequences", [
    ({"prompt": ["a", "b", "c"], "n": 4}, 12), ({"prompt": [[1, 2], [3]], "n": 2}, 4), ({"prompt": [1, 2, 3]}, 1),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 8}, 8), ({"input": "hi"}, 1), ({"n": "two"}, 1),
    ({"n": -3}, 1), ({"n": True}, 1), ({"prompt": "a", "n": 0}, 1)])
def test_a_request_runs_a_sequence_per_choice_of_each_prompt(body, sequences):
    """What the request takes of a replica's max_concurrency (gateway/queue.py)."""
    assert _completion_usage(json.dumps(body).encode())[3] == sequences
