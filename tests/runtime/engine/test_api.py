"""The OpenAI-compatible app in-process (httpx ASGITransport) over the real engine and a tiny model."""
import asyncio
import json

import httpx
import pytest

from ember.runtime.engine.api import create_app
from ember.runtime.engine.config import EngineConfig
from ember.runtime.engine.engine import LLMEngine
from ember.runtime.engine.serving.server import ChunkJSON
from ember.runtime.engine.tiny import build_tiny_model

MODEL = "tiny-chat"
HELLO = [{"role": "user", "content": "Hello, how are you?"}]


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen3")
    app = create_app(EngineConfig(model=str(path), max_model_len=256), served_model_name=MODEL)
    yield app
    app.state.llm.shutdown()


@pytest.fixture
def call(app):
    """call(method, path, json=...) -> httpx.Response, each in a fresh client."""

    def call(method, path, **kwargs):
        async def go():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as client:
                return await client.request(method, path, **kwargs)

        return asyncio.run(go())

    return call


def chat(call, **body):
    return call("POST", "/v1/chat/completions", json={"model": MODEL, "messages": HELLO, **body})


def events(response):
    """The chunks of a streamed response, each checked to be written as json.dumps(chunk, ensure_ascii=False)."""
    assert response.headers["content-type"].startswith("text/event-stream")
    lines = [line for line in response.text.split("\n\n") if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert [f"data: {json.dumps(chunk, ensure_ascii=False)}" for chunk in chunks] == lines[:-1]
    return chunks


def test_models_lists_the_served_model(call):
    body = call("GET", "/v1/models").json()
    assert [m["id"] for m in body["data"]] == [MODEL]
    assert body["data"][0]["max_model_len"] == 256
    assert call("GET", f"/v1/models/{MODEL}").json()["id"] == MODEL
    missing = call("GET", "/v1/models/other")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_chat_completion_shape_usage_and_greedy_determinism(app, call):
    first = chat(call, max_tokens=8, temperature=0, ignore_eos=True)
    assert first.status_code == 200
    body = first.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    [choice] = body["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    tokenizer = app.state.llm.tokenizer
    prompt = tokenizer.apply_chat_template(HELLO, add_generation_prompt=True, tokenize=False)
    assert body["usage"]["prompt_tokens"] == len(tokenizer.encode(prompt, add_special_tokens=False))
    assert body["usage"]["completion_tokens"] == 8
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 8
    assert chat(call, max_tokens=8, temperature=0, ignore_eos=True).json()["choices"][0]["message"] == choice["message"]


def test_max_completion_tokens_wins_over_max_tokens(call):
    body = chat(call, max_tokens=3, max_completion_tokens=5, ignore_eos=True).json()
    assert body["usage"]["completion_tokens"] == 5


def test_streaming_chat_matches_non_streaming_and_ends_with_usage(call):
    expected = chat(call, max_tokens=10, seed=4, ignore_eos=True).json()["choices"][0]["message"]["content"]
    chunks = events(
        chat(call, max_tokens=10, seed=4, ignore_eos=True, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == expected
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10
    assert all(c["usage"] is None for c in chunks[:-1])
    plain = events(chat(call, max_tokens=3, stream=True))
    assert all("usage" not in c for c in plain)


def test_seed_reproduces_and_different_seeds_differ(call):
    texts = [chat(call, max_tokens=16, seed=s).json()["choices"][0]["message"]["content"] for s in (1, 1, 2)]
    assert texts[0] == texts[1] != texts[2]


def test_n_choices_differ_and_share_one_prompt_in_usage(call):
    body = chat(call, max_tokens=6, n=3, seed=9, ignore_eos=True).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert len({c["message"]["content"] for c in body["choices"]}) == 3
    assert body["usage"]["completion_tokens"] == 18
    assert body["usage"]["prompt_tokens"] == chat(call, max_tokens=1).json()["usage"]["prompt_tokens"]


def test_stop_string_is_not_leaked_in_plain_or_streaming_responses(call):
    full = chat(call, max_tokens=40, seed=21).json()["choices"][0]["message"]["content"]
    stop = full[len(full) // 2:len(full) // 2 + 2]
    expected = full[:full.find(stop)]
    [choice] = chat(call, max_tokens=40, seed=21, stop=stop).json()["choices"]
    assert (choice["message"]["content"], choice["finish_reason"], choice["stop_reason"]) == (expected, "stop", stop)
    chunks = events(chat(call, max_tokens=40, seed=21, stop=[stop, "never-generated"], stream=True))
    deltas = [c["choices"][0]["delta"].get("content", "") for c in chunks]
    assert "".join(deltas) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    kept = chat(call, max_tokens=40, seed=21, stop=stop, include_stop_str_in_output=True).json()
    assert kept["choices"][0]["message"]["content"] == expected + stop


def test_chat_logprobs(call):
    [choice] = chat(call, max_tokens=4, logprobs=True, top_logprobs=2, ignore_eos=True).json()["choices"]
    content = choice["logprobs"]["content"]
    assert len(content) == 4
    for entry in content:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["logprob"] >= entry["logprob"] - 1e-6
    assert "".join(e["token"] for e in content) == choice["message"]["content"]


def test_completions_batch_n_token_ids_and_echo(app, call):
    tokenizer = app.state.llm.tokenizer
    ids = tokenizer.encode("Once upon a time", add_special_tokens=False)
    body = call("POST", "/v1/completions", json={"model": MODEL, "prompt": ["The capital of France is", "Hello"],
                                                  "n": 2, "max_tokens": 3, "seed": 1, "ignore_eos": True}).json()
    assert body["object"] == "text_completion"
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    lengths = [len(tokenizer.encode(p, add_special_tokens=False)) for p in ["The capital of France is", "Hello"]]
    assert body["usage"] == {"prompt_tokens": sum(lengths), "completion_tokens": 12,
                             "total_tokens": sum(lengths) + 12, "prompt_tokens_details": {"cached_tokens": 0}}
    by_ids = call("POST", "/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 5, "temperature": 0,
                                                    "echo": True}).json()
    by_text = call("POST", "/v1/completions", json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 5,
                                                     "temperature": 0}).json()
    assert by_ids["choices"][0]["text"] == "Once upon a time" + by_text["choices"][0]["text"]


def test_completions_streaming_and_logprobs(call):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 6, "seed": 3, "logprobs": 1, "ignore_eos": True}
    plain = call("POST", "/v1/completions", json=body).json()["choices"][0]
    assert len(plain["logprobs"]["tokens"]) == 6 and len(plain["logprobs"]["top_logprobs"][0]) == 1
    chunks = events(call("POST", "/v1/completions", json={**body, "stream": True,
                                                          "stream_options": {"include_usage": True}}))
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == plain["text"]
    assert chunks[-1]["usage"]["completion_tokens"] == 6


def test_streaming_sends_a_chunk_per_token_while_the_text_is_held_back(call):
    """Text that may begin a stop string is held back; each token still reaches the client as a chunk (empty text),
    so a streaming client sees tokens arrive (its TTFT and ITL) whatever the detokenizer holds. (With stop strings
    a step's tokens are never joined with the next step's, as they are for a client that falls behind.)"""
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 12, "seed": 5, "ignore_eos": True, "stream": True,
            "stop": ["\u2603\u2603"]}
    texts = [c["choices"][0]["text"] for c in events(call("POST", "/v1/completions", json=body))]
    assert len(texts) == 12
    # from the fifth token on, every text so far is a prefix of this stop string, which never completes
    stop = "".join(texts[4:]) + "\u2603"
    chunks = events(call("POST", "/v1/completions", json={**body, "stop": [stop]}))
    assert len(chunks) == 12 and [c["choices"][0]["text"] for c in chunks[4:-1]] == [""] * 7
    assert "".join(c["choices"][0]["text"] for c in chunks) == "".join(texts)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    chat_chunks = events(chat(call, max_tokens=12, seed=5, ignore_eos=True, stream=True, stop=["\u2603\u2603"]))
    assert len(chat_chunks) == 13   # the role's chunk, then one a token


@pytest.mark.parametrize("text", ["", " plain", 'quote " and backslash \\', "new\nline\ttab\x01\x1f",
                                  "caf\u00e9 \u2603 \U0001f600", "\u2028\u2029 \ud800 lone surrogate"])
def test_streamed_chunks_are_written_as_json_dumps_writes_them(text):
    chunks = ChunkJSON("cmpl-1", "text_completion", 1700000000, 'model "x"', include_usage=True)
    envelope = {"id": "cmpl-1", "object": "text_completion", "created": 1700000000, "model": 'model "x"'}

    def dumped(choice):
        return json.dumps({**envelope, "choices": [choice], "system_fingerprint": None, "usage": None},
                          ensure_ascii=False)

    assert chunks.text(3, text) == dumped({"index": 3, "text": text, "logprobs": None, "finish_reason": None})
    assert chunks.content(0, text) == dumped({"index": 0, "delta": {"content": text}, "logprobs": None,
                                              "finish_reason": None})
    choice = {"index": 1, "text": text, "logprobs": None, "finish_reason": "stop", "stop_reason": text}
    assert chunks.choice(choice) == dumped(choice)
    plain = ChunkJSON("cmpl-1", "text_completion", 1700000000, 'model "x"', include_usage=False)
    assert json.loads(plain.text(0, text)) == {**envelope, "choices": [{"index": 0, "text": text, "logprobs": None,
                                                                        "finish_reason": None}],
                                               "system_fingerprint": None}


def test_repeated_prompt_hits_the_prefix_cache(call):
    body = {"model": MODEL, "prompt": "The quick brown fox jumps over the lazy dog. " * 4, "max_tokens": 1}
    call("POST", "/v1/completions", json=body)
    usage = call("POST", "/v1/completions", json=body).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 16


@pytest.mark.parametrize("path, body, status, param, code", [
    ("/v1/chat/completions", {"model": "gpt-4", "messages": HELLO}, 404, "model", "model_not_found"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model", "model_not_found"),
    ("/v1/chat/completions", {"model": MODEL, "messages": HELLO, "temperature": 3}, 400, "temperature",
     "invalid_value"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages", "invalid_value"),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages", "invalid_value"),
    ("/v1/chat/completions", {"messages": HELLO}, 400, "model", "invalid_value"),
    ("/v1/chat/completions", {"model": MODEL, "messages": HELLO, "n": 0}, 400, "n", "invalid_value"),
    ("/v1/chat/completions", {"model": MODEL, "messages": HELLO, "top_logprobs": 2}, 400, "top_logprobs", None),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages.0.role", "invalid_value"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi " * 300}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 300}, 400, "prompt", "context_length_exceeded"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi " * 300}]}, 400,
     "messages", "context_length_exceeded"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt", None),
    ("/v1/completions", {"model": MODEL, "prompt": [5, 99999]}, 400, None, None),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop_token_ids": [99999]}, 400, "stop_token_ids", None),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "min_tokens": 5}, 400, "min_tokens", None),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias", "invalid_value"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias", "invalid_value"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"99999": 1}}, 400, "logit_bias", None),
    ("/v1/chat/completions", {"model": MODEL, "messages": HELLO, "logit_bias": {str(t): 1 for t in range(301)}}, 400,
     "logit_bias", "invalid_value"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "suffix": "end"}, 400, "suffix", "invalid_value"),
    # vLLM's beam search was ignored as an unknown field: a sampled reply as if it had applied (its structured
    # outputs are taken: test_formats)
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "use_beam_search": True}, 400, "use_beam_search",
     "invalid_value"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "prompt_logprobs": 1}, 400, "prompt_logprobs",
     "invalid_value"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 2, "best_of": 3}, 400, "best_of", "invalid_value"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 1, "echo": True}, 400, "echo", "invalid_value"),
    ("/v1/chat/completions", {"model": MODEL, "messages": HELLO, "tools": [{"type": "function"}]}, 400,
     "tools.0.function", "invalid_value"),
    ("/v1/chat/completions", {"model": MODEL, "messages": HELLO, "response_format": {"type": "grammar"}}, 400,
     "response_format.type", "invalid_value"),
    # Legacy function calling and audio output were taken in silence and answered with plain text
    ("/v1/chat/completions", {"model": MODEL, "messages": HELLO, "functions": [{"name": "f"}]}, 400, "functions",
     "invalid_value"),
    ("/v1/chat/completions", {"model": MODEL, "messages": HELLO, "function_call": "auto"}, 400, "function_call",
     "invalid_value"),
    ("/v1/chat/completions", {"model": MODEL, "messages": HELLO, "modalities": ["text", "audio"]}, 400, "modalities",
     "invalid_value"),
    ("/v1/chat/completions", {"model": MODEL, "messages": HELLO, "audio": {"voice": "alloy", "format": "wav"}}, 400,
     "audio", "invalid_value"),
    # Values torch cannot hold, which used to fail inside the step loop and take the engine down with them.
    ("/v1/chat/completions", {"model": MODEL, "messages": HELLO, "top_k": 2**63}, 400, "top_k", "invalid_value"),
    ("/v1/chat/completions", {"model": MODEL, "messages": HELLO, "seed": 2**64}, 400, "seed", "invalid_value"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2**63}, 400, "max_tokens", "invalid_value"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "min_tokens": 2**40}, 400, "min_tokens", "invalid_value"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "repetition_penalty": 1e300}, 400, "repetition_penalty",
     "invalid_value"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": ["x"] * 17}, 400, "stop", "invalid_value"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": ["x" * 257]}, 400, "stop", "invalid_value"),
    ("/v1/chat/completions", {"model": MODEL, "messages": HELLO, "stop": "x" * 257}, 400, "stop", "invalid_value"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": ["ok", ""]}, 400, "stop", "invalid_value"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop_token_ids": [1] * 1025}, 400, "stop_token_ids",
     "invalid_value"),
    ("/v1/completions", {"model": MODEL, "prompt": [5, 2**63]}, 400, None, None),
    # One request of 100,000 completions would queue every later caller's requests behind it for as long as it ran.
    ("/v1/completions", {"model": MODEL, "prompt": ["hi"] * 100_000}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {"model": MODEL, "prompt": [[5]] * 17, "n": 128}, 400, "prompt", "invalid_value"),
])
def test_bad_requests_get_openai_shaped_errors(call, path, body, status, param, code):
    response = call("POST", path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] in ("invalid_request_error", "not_found_error")
    assert (error["param"], error["code"]) == (param, code)
    assert "Value error" not in error["message"]


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "https://x/cat.png"}}, "hi",
                                  {"text": "x"}])
def test_a_chat_part_that_is_not_text_is_named(call, part):
    """An image part used to fail on the union's first branch: "Invalid 'messages.0.content.str': Input should be a
    valid string", which names neither the part nor what the server takes."""
    content = [{"type": "text", "text": "what is this?"}, part]
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
    response = call("POST", "/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages.0.content" and "text parts alone" in error["message"]
    assert ("'image_url'" in error["message"]) == (isinstance(part, dict) and "type" in part)



@pytest.mark.parametrize("path, fields, param", [
    ("/v1/chat/completions", '"messages": [{"role": "user", "content": "hi \\ud800 there"}]', "messages.0.content"),
    ("/v1/completions", '"prompt": "hi \\udfff"', "prompt"),
    ("/v1/completions", '"prompt": "hi", "stop": ["\\ud83d"]', "stop"),
    ("/v1/responses", '"input": "hi \\ud800"', "input"),
    ("/v1/responses", '"input": "hi", "instructions": "\\udbff"', "instructions"),
    ("/v1/responses", '"input": "hi", "metadata": {"k": "\\udc00"}', "metadata"),   # echoed in the reply
    ("/v1/responses", '"input": "hi", "user": "\\udc00"', "user"),
    ("/v1/completions", '"prompt": "hi", "guided_grammar": "root ::= \\"\\ud800\\""', "guided_grammar"),
    ("/v1/chat/completions", '"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": '
     '"json_schema", "json_schema": {"name": "a", "schema": {"enum": ["\\udfff"]}}}', "response_format"),
])
def test_a_lone_surrogate_in_the_text_is_a_400_naming_it(call, path, fields, param):
    """Valid JSON, invalid Unicode: the tokenizer raised a TypeError, a 500 that closed the gateway's connection;
    echoed in a Responses reply, it failed the reply's encoding (a 500)."""
    body = ('{"model": "' + MODEL + '", "max_tokens": 2, ' + fields + "}").encode()
    response = call("POST", path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "lone UTF-16 surrogate" in error["message"], error
    assert chat(call, max_tokens=2).status_code == 200


def test_an_error_that_quotes_a_lone_surrogate_back_is_still_json(call):
    """The model name is quoted in its 404: a lone surrogate there failed the error's own encoding (a 500)."""
    body = b'{"model": "gpt-\\ud800", "messages": [{"role": "user", "content": "hi"}]}'
    response = call("POST", "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 404, response.text
    assert response.json()["error"]["code"] == "model_not_found" and "\\ud800" in response.json()["error"]["message"]

def test_logit_bias_forces_and_bans_tokens(app, call):
    """OpenAI's logit_bias (token id -> bias in [-100, 100]) was refused as unsupported."""
    def tokens(**body):
        reply = call("POST", "/v1/completions", json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6,
                                                      "temperature": 0, "ignore_eos": True, "logprobs": 0, **body})
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["logprobs"]["tokens"]

    greedy = tokens()
    forced = tokens(logit_bias={"7": 100})   # +100 outweighs any logit of a tiny random model
    assert len(set(forced)) == 1 and forced != greedy
    tokenizer = app.state.llm.tokenizer
    ids = {tokenizer.convert_tokens_to_ids(tokenizer.tokenize(text))[0] for text in greedy}
    banned = tokens(logit_bias={str(t): -100 for t in ids})
    assert len(banned) == 6 and not set(banned) & set(greedy)
    sampled = call("POST", "/v1/chat/completions", json={"model": MODEL, "messages": HELLO, "max_tokens": 5,
                                                         "temperature": 1, "seed": 3, "logit_bias": {"7": 100}})
    assert sampled.status_code == 200 and sampled.json()["usage"]["completion_tokens"] == 5


def test_neutral_values_of_unsupported_features_are_accepted(call):
    accepted = [
        ("/v1/chat/completions", {"messages": HELLO, "tools": [], "tool_choice": "none", "logit_bias": {},
                                  "response_format": {"type": "text"}, "functions": [], "function_call": "none",
                                  "modalities": ["text"], "audio": None}),
        ("/v1/completions", {"prompt": "hi", "n": 2, "best_of": 2, "suffix": "", "echo": True,
                             "use_beam_search": False, "guided_json": None}),
    ]
    for path, body in accepted:
        response = call("POST", path, json={"model": MODEL, "max_tokens": 2, **body})
        assert response.status_code == 200, response.text


def test_malformed_json_and_unknown_routes_are_json_errors(call):
    bad = call("POST", "/v1/completions", content=b'{"model": ', headers={"content-type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
    for body in (b'{"model": "\xff\xfe"}', b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"):  # not UTF-8; too deep
        bad = call("POST", "/v1/completions", content=body, headers={"content-type": "application/json"})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json", bad.text
    missing = call("GET", "/v2/everything")
    assert missing.status_code == 404 and "error" in missing.json()
    wrong_method = call("GET", "/v1/chat/completions")
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()


def test_health_and_metrics_use_vllm_names(call):
    assert call("GET", "/health").json() == {"status": "ok"}
    chat(call, max_tokens=3)
    text = call("GET", "/metrics").text
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
               for line in text.splitlines() if line and not line.startswith("#")}
    label = f'model_name="{MODEL}"'
    for name in ["time_to_first_token_seconds", "inter_token_latency_seconds", "request_queue_time_seconds"]:
        assert samples[f"ember:{name}_count{{{label}}}"] > 0
        assert samples[f'ember:{name}_bucket{{{label},le="+Inf"}}'] == samples[f"ember:{name}_count{{{label}}}"]
    for name in ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"]:
        assert f"ember:{name}{{{label}}}" in samples
    assert samples[f"ember:prefix_cache_queries_total{{{label}}}"] > 0
    assert f"ember:prefix_cache_hits_total{{{label}}}" in samples
    assert samples[f'ember:request_success_total{{{label},finished_reason="length"}}'] > 0
    # on a CPU every forward pass is eager (CUDA graphs need a GPU) and no device time is measured
    assert samples[f'ember:engine_steps_total{{{label},kind="eager"}}'] >= 3
    assert samples[f'ember:engine_steps_total{{{label},kind="graph"}}'] == 0
    assert samples[f'ember:engine_steps_total{{{label},kind="piecewise"}}'] == 0
    assert samples[f'ember:engine_step_device_seconds_total{{{label},kind="eager"}}'] == 0


@pytest.mark.parametrize("name, value", [("temperature", "NaN"), ("top_p", "Infinity"), ("min_p", "-Infinity")])
def test_non_finite_numbers_are_refused_by_name(call, name, value):
    body = f'{{"model": "{MODEL}", "prompt": "hi", "{name}": {value}}}'.encode()  # Python's json reads these
    response = call("POST", "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["param"] == name


def test_an_engine_that_cannot_go_on_answers_503_and_marks_the_replica_unhealthy(tmp_path, monkeypatch):
    from ember.runtime import health
    from ember.runtime.engine.async_engine import MAX_FAILED_STEPS

    monkeypatch.setattr(health, "reason", None)
    monkeypatch.setattr(health, "_listeners", [])
    path = build_tiny_model(tmp_path / "m")
    engine = LLMEngine(EngineConfig(model=str(path), max_model_len=128))

    def broken_forward(*args, **kwargs):
        raise RuntimeError("device lost")

    engine.runner.launch = broken_forward   # the one entry of a step, serial or overlapped
    app = create_app(engine, served_model_name=MODEL)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as client:
            body = {"model": MODEL, "messages": HELLO, "max_tokens": 2}
            failed = [await client.post("/v1/chat/completions", json=body) for _ in range(MAX_FAILED_STEPS - 1)]
            dead = [await client.post("/v1/chat/completions", json=body),
                    await client.post("/v1/chat/completions", json={**body, "stream": True}),
                    await client.get("/health")]
            return failed, dead

    failed, dead = asyncio.run(go())
    for response in failed:  # each failed step fails the request it ran; the engine tries the next one
        assert response.status_code == 500 and "device lost" in response.json()["error"]["message"]
    for response in dead:
        assert response.status_code == 503
        assert response.json()["error"]["type"] == "server_error"
        assert "device lost" in response.json()["error"]["message"]
    assert "device lost" in health.reason


def test_create_app_imports_nothing_the_api_module_did_not(tmp_path):
    # A fork server imports the api module once; each replica's create_app must not import more (FastAPI's lazy
    # pydantic.v1 import was 0.17 s of a restored replica's start on the H200).
    import subprocess
    import sys

    model = build_tiny_model(tmp_path / "qwen3")
    script = (
        "import sys\n"
        "from ember.runtime.engine.api import create_app\n"
        "from ember.runtime.engine.async_engine import AsyncLLM\n"
        "from ember.runtime.engine.config import EngineConfig\n"
        "from ember.runtime.engine.engine import LLMEngine\n"
        f"llm = AsyncLLM(LLMEngine(EngineConfig(model={str(model)!r}, max_model_len=64)), None)\n"
        "before = set(sys.modules)\n"
        "create_app(llm)\n"
        "print(sorted(set(sys.modules) - before))\n"
        "llm.shutdown()\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_a_huge_prompt_is_tokenized_off_the_event_loop(app):
    """A prompt of megabytes takes seconds to tokenize; meanwhile the replica answers its health check (and streams
    other requests) instead of freezing until the prompt is refused."""
    huge = "hello world données 🙂 " * 200_000  # 4.4 M characters: seconds of tokenizing

    async def scenario():
        done = []
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api",
                                     timeout=120) as client:
            async def big():
                reply = await client.post("/v1/completions", json={"model": MODEL, "prompt": huge, "max_tokens": 1})
                done.append(("big", reply.status_code))

            async def health():
                await asyncio.sleep(0.2)  # the big prompt is being tokenized by now
                done.append(("health", (await client.get("/health")).status_code))

            await asyncio.gather(big(), health())
        return done

    assert asyncio.run(scenario()) == [("health", 200), ("big", 400)]


def test_a_later_callers_request_does_not_wait_for_all_of_an_earlier_batch(tmp_path):
    """The engine shares its sequences fairly among callers' requests: one request that arrives while a batch of 48
    completions fills the engine's 4 slots is admitted at the next free slot, so it ends long before the batch."""
    path = build_tiny_model(tmp_path / "qwen3")
    app = create_app(EngineConfig(model=str(path), max_model_len=256, max_num_seqs=4), served_model_name=MODEL)
    done = []

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api",
                                     timeout=300) as client:
            async def batch():
                reply = await client.post("/v1/completions", json={
                    "model": MODEL, "prompt": ["once upon a time"] * 48, "max_tokens": 96, "ignore_eos": True})
                done.append(("batch", reply.status_code, len(reply.json()["choices"])))

            async def later():
                # the batch fills the engine by now and holds it for seconds (12 rounds of 96 steps; of 24 steps,
                # a quiet machine had finished it, 0.34 s, before this request came). Admitted first come first
                # served, after the batch's 48, this one's 120 steps would end after the batch's last round.
                await asyncio.sleep(0.3)
                reply = await client.post("/v1/completions", json={
                    "model": MODEL, "prompt": "hello", "max_tokens": 120, "ignore_eos": True})
                done.append(("later", reply.status_code, len(reply.json()["choices"])))

            await asyncio.gather(batch(), later())

    asyncio.run(scenario())
    assert done == [("later", 200, 1), ("batch", 200, 48)]


def test_tokenize_counts_as_the_endpoints_do_and_detokenize_reverses_it(call):
    """vLLM's /tokenize and /detokenize: a client counts a prompt's tokens before it sends it."""
    reply = chat(call, max_tokens=1).json()
    counted = call("POST", "/tokenize", json={"model": MODEL, "messages": HELLO}).json()
    assert counted["count"] == len(counted["tokens"]) == reply["usage"]["prompt_tokens"]
    assert counted["max_model_len"] == 256
    text = call("POST", "/tokenize", json={"model": MODEL, "prompt": "Once upon a time"}).json()
    completion = call("POST", "/v1/completions", json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1})
    assert text["count"] == completion.json()["usage"]["prompt_tokens"]
    back = call("POST", "/detokenize", json={"model": MODEL, "tokens": text["tokens"]}).json()
    assert back == {"prompt": "Once upon a time"}
    for path, body, param in (("/tokenize", {"model": MODEL, "prompt": 5}, "prompt"),
                              ("/tokenize", {"model": MODEL, "messages": []}, "messages"),
                              ("/tokenize", {"model": MODEL, "prompt": "x\ud800"}, "prompt"),
                              ("/detokenize", {"model": MODEL, "tokens": [1, 10**9]}, "tokens"),
                              ("/detokenize", {"model": MODEL, "tokens": "abc"}, "tokens")):
        refused = call("POST", path, content=json.dumps(body), headers={"content-type": "application/json"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
    assert call("POST", "/tokenize", json={"model": "other", "prompt": "x"}).status_code == 404
