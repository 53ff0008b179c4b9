"""The app behind a real uvicorn socket, driven by the official `openai` client."""

import httpx
import openai
import pytest

from ember.runtime.engine.api import create_app
from ember.runtime.engine.config import EngineConfig
from ember.runtime.engine.tiny import build_tiny_model
from tests.runtime.engine.helpers import uvicorn_thread, wait_until_idle

MODEL = "tiny-chat"
HELLO = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    # A long context, so the disconnect tests' requests cannot finish before the client leaves.
    path = build_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen3", max_position_embeddings=8192)
    app = create_app(EngineConfig(model=str(path), max_num_seqs=8), served_model_name=MODEL)
    with uvicorn_thread(app) as url:
        yield app, f"{url}/v1"


def test_models_and_chat(client):
    assert [m.id for m in client.models.list()] == [MODEL]
    reply = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, seed=1)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason in ("length", "stop")
    assert reply.usage.completion_tokens <= 8 and reply.usage.prompt_tokens > 0
    again = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, seed=1)
    assert again.choices[0].message.content == reply.choices[0].message.content


def test_streaming_chat_with_usage_and_n(client):
    expected = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, seed=7, n=2)
    stream = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, seed=7, n=2, stream=True,
                                            stream_options={"include_usage": True})
    texts, usage = {0: "", 1: ""}, None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
        usage = chunk.usage or usage
    assert texts == {c.index: c.message.content for c in expected.choices}
    assert usage.completion_tokens == expected.usage.completion_tokens


def test_completions_with_stop(client):
    full = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=30, seed=3).choices[0].text
    stop = full[10:12]
    cut = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=30, seed=3, stop=[stop])
    assert cut.choices[0].text == full[:full.find(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_errors_map_to_the_clients_exception_types(client):
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4o", messages=HELLO)
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=MODEL, prompt="word " * 9000)
    assert too_long.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=HELLO, top_p=1.5)
    assert bad.value.param == "top_p"
    with pytest.raises(openai.BadRequestError) as chatty:   # rendered on the event loop: bounded before that
        client.chat.completions.create(model=MODEL, messages=HELLO * 10_001)
    assert chatty.value.param == "messages" and "at most 10000 items" in str(chatty.value)


def test_disconnecting_mid_stream_aborts_and_frees_kv_blocks(served, client):
    engine = served[0].state.llm.engine
    wait_until_idle(engine)  # an earlier stop-string request's abort may still be in flight
    aborted = engine.stats.request_success["abort"]
    stream = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8000, stream=True,
                                            extra_body={"ignore_eos": True})
    for _, _chunk in zip(range(3), stream):
        pass
    assert engine.has_unfinished_requests()
    stream.close()
    wait_until_idle(engine)
    assert engine.stats.request_success["abort"] == aborted + 1


def test_disconnecting_before_a_non_streaming_reply_aborts_it(served):
    app, base_url = served
    engine = app.state.llm.engine
    wait_until_idle(engine)  # an earlier stop-string request's abort may still be in flight
    aborted = engine.stats.request_success["abort"]
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base_url}/completions", json=body, timeout=httpx.Timeout(0.3, connect=5))
    wait_until_idle(engine)
    assert engine.stats.request_success["abort"] == aborted + 1


def test_logprobs_and_streamed_completions_parse_in_the_client(client):
    reply = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3, logprobs=True, top_logprobs=2,
                                           extra_body={"ignore_eos": True})
    content = reply.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    whole = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, seed=2)
    parts = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, seed=2, stream=True)
    assert "".join(c.choices[0].text for c in parts) == whole.choices[0].text


def test_disconnecting_from_a_batched_stream_aborts_every_prompt(served, client):
    engine = served[0].state.llm.engine
    wait_until_idle(engine)  # an earlier stop-string request's abort may still be in flight
    aborted = engine.stats.request_success["abort"]
    stream = client.completions.create(model=MODEL, prompt=["Once upon a time", "Hello"], n=2, max_tokens=8000,
                                       stream=True, extra_body={"ignore_eos": True})
    for _, _chunk in zip(range(4), stream):
        pass
    stream.close()
    wait_until_idle(engine)
    assert engine.stats.request_success["abort"] == aborted + 4
