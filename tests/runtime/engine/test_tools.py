"""Tool calls in the chat API: the tagged-JSON reader on its own, then the app over the tiny model with a chat
template that writes tools. The model's random weights never write a call, so one test replaces the text of the
real engine's outputs with a call cut into pieces (the one stand-in here); the rest runs as served."""
import asyncio
import json
import shutil

import httpx
import jsonschema
import openai
import pytest

from ember.runtime.engine.api import create_app
from ember.runtime.engine.config import EngineConfig
from ember.runtime.engine.serving.protocol import ChatCompletionRequest
from ember.runtime.engine.serving.reasoning import ReplyParser, ReplyShape, joined
from ember.runtime.engine.serving.tools import ToolCallStream, template_messages
from ember.runtime.engine.tiny import build_tiny_model

from .helpers import engine_writes, uvicorn_thread

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
# a reply with text, then that call, cut as the steps of a stream might cut it
CALL_PIECES = ["Checking. <tool", "_call>\n{\"name\": \"get_we", "ather\", \"arguments\": {\"city\": \"Pa",
               "ris\"}}\n</tool_call>"]


def parse(text: str, parallel: bool = True) -> tuple[str | None, list[dict]]:
    """A whole reply read as the chat API reads it: (its text outside the calls, None when only calls remain; the
    calls)."""
    _, content, calls = joined(ReplyParser(ReplyShape(tools=True, parallel_tool_calls=parallel)).feed(text, final=True))
    return (content.strip() or None) if calls else content, calls


def test_calls_are_read_from_tags_and_anything_else_stays_text():
    content, calls = parse("Let me look." + CALL)
    assert content == "Let me look." and len(calls) == 1
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert parse(CALL + CALL)[0] is None and len(parse(CALL + CALL)[1]) == 2
    assert len(parse(CALL + "\n" + CALL, parallel=False)[1]) == 1
    broken = "<tool_call>{not json}</tool_call> and <tool_call>{\"name\": 3}</tool_call>"
    assert parse(broken) == (broken, [])
    assert parse("no calls <tool_") == ("no calls <tool_", [])
    deep = "<tool_call>" + "[" * 100_000 + "</tool_call>"   # past the JSON parser's depth: text, not a crash
    assert parse(deep) == (deep, [])
    assert parse('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}')[1] == []   # never closed: text
    assert json.loads(parse('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')[1][0]["function"]
                      ["arguments"]) == {"a": 1}


@pytest.mark.parametrize("cut", [1, 2, 3, 7])
def test_a_stream_holds_back_a_tag_split_across_steps(cut):
    text = "Sure <b> " + CALL + " done"
    stream, parts = ToolCallStream(), []
    for at in range(0, len(text), cut):
        parts += stream.feed(text[at:at + cut])
        assert not any("<tool" in p.get("content", "") for p in parts)
    parts += stream.finish()
    assert "".join(p.get("content", "") for p in parts) == "Sure <b>  done"
    assert [p["tool_call"]["function"]["name"] for p in parts if "tool_call" in p] == ["get_weather"]


TEMPLATE = (
    "{%- if greeting is defined %}{{ greeting }}\n{%- endif %}"
    "{%- if tools %}<|im_start|>system\nCall a tool by writing <tool_call>{\"name\": ..., \"arguments\": {...}}"
    "</tool_call>. Tools:\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{%- for call in message.tool_calls or [] %}<tool_call>{\"name\": \"{{ call.function.name }}\", "
    "\"arguments\": {{ call.function.arguments | tojson }}}</tool_call>{%- endfor %}"
    "{%- if message.tool_call_id %} (for {{ message.tool_call_id }}){%- endif %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    plain = build_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen3")
    path = tmp_path_factory.mktemp("tools") / "qwen3"
    shutil.copytree(plain, path)
    (path / "chat_template.jinja").write_text(TEMPLATE)
    app = create_app(EngineConfig(model=str(path), max_num_seqs=8), served_model_name="tiny")
    with uvicorn_thread(app) as url:
        yield app, f"{url}/v1", create_app(EngineConfig(model=str(plain), max_num_seqs=8), served_model_name="tiny")


def forced(app, text: str) -> dict:
    """A logit_bias that makes the tiny model write `text`'s first token over and over: text that is no call."""
    tokenizer = app.state.llm.tokenizer
    return {str(tokenizer.encode(text, add_special_tokens=False)[0]): 100}


def test_tools_reach_the_template_and_earlier_calls_and_results_too(served, client):
    app, _, _ = served
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]
    bare = client.chat.completions.create(model="tiny", messages=history[:1], max_tokens=2)
    with_tools = client.chat.completions.create(model="tiny", messages=history[:1], max_tokens=2, tools=[WEATHER])
    assert with_tools.usage.prompt_tokens > bare.usage.prompt_tokens + 20   # the tool's schema is in the prompt
    request = ChatCompletionRequest(model="tiny", messages=history, tools=[WEATHER])
    rendered = app.state.llm.tokenizer.apply_chat_template(template_messages(request.messages), tokenize=False)
    assert '"arguments": {"city": "Paris"}' in rendered and "(for call_1)" in rendered   # as objects, with ids
    reply = client.chat.completions.create(model="tiny", messages=history, max_tokens=3, tools=[WEATHER],
                                           tool_choice="auto", logit_bias=forced(app, "Paris"))
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason == "length"
    none = client.chat.completions.create(model="tiny", messages=history[:1], max_tokens=2, tools=[WEATHER],
                                          tool_choice="none")
    assert none.usage.prompt_tokens == bare.usage.prompt_tokens   # "none": the tools are not offered


def test_a_call_the_model_writes_comes_back_as_tool_calls(served, monkeypatch):
    """The engine's text for one choice, replaced by a call as it streams out: read into tool_calls both whole
    and streamed, with finish_reason "tool_calls" where the model stopped."""
    app, base_url, _ = served
    engine_writes(monkeypatch, CALL_PIECES)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 4,
            "ignore_eos": True, "tools": [WEATHER]}
    whole = httpx.post(f"{base_url}/chat/completions", json=body, timeout=60).json()
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking."
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        chunks = list(client.chat.completions.create(stream=True, extra_body={"ignore_eos": True},
                                                     **{k: v for k, v in body.items() if k != "ignore_eos"}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert text == "Checking. " and len(deltas) == 1 and deltas[0].index == 0
    assert deltas[0].function.name == "get_weather" and json.loads(deltas[0].function.arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


# Tools whose arguments a random model completes: every value bounded (its strings would rarely close otherwise)
FORECAST = {"type": "function", "function": {"name": "forecast", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1,
                                                                                  "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "clock.now", "parameters": {
    "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Forecast for Paris?"}]


def arguments_fit(call) -> bool:
    tool = {"forecast": FORECAST, "clock.now": CLOCK}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    return True


def test_a_named_tool_choice_makes_the_reply_that_call(client):
    free = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=60, tools=[FORECAST, CLOCK], seed=1)
    assert free.choices[0].message.tool_calls is None   # on its own the model calls nothing
    named = {"type": "function", "function": {"name": "clock.now"}}
    for temperature in (1.0, 0.0):
        reply = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=300, tools=[FORECAST, CLOCK],
                                               tool_choice=named, n=3, seed=1, temperature=temperature)
        for choice in reply.choices:
            [call] = choice.message.tool_calls
            assert call.function.name == "clock.now" and arguments_fit(call) and choice.finish_reason == "tool_calls"
            assert choice.message.content is None
    chunks = list(client.chat.completions.create(model="tiny", messages=ASK, max_tokens=300, tools=[FORECAST, CLOCK],
                                                 tool_choice=named, seed=2, stream=True))
    [delta] = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert delta.function.name == "clock.now" and arguments_fit(delta)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_required_makes_the_reply_calls_one_unless_parallel(client):
    one = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=300, tools=[FORECAST, CLOCK],
                                         tool_choice="required", parallel_tool_calls=False, n=4, seed=3)
    for choice in one.choices:
        [call] = choice.message.tool_calls
        assert arguments_fit(call) and choice.finish_reason == "tool_calls"
    several = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=600, tools=[FORECAST, CLOCK],
                                             tool_choice="required", n=4, seed=3)
    calls = [c.message.tool_calls for c in several.choices]
    assert all(len(made) >= 1 and all(arguments_fit(call) for call in made) for made in calls), calls


@pytest.mark.parametrize("body, param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [WEATHER] * 129}, "tools"),
])
def test_what_tools_cannot_do_here_is_a_400_naming_it(served, body, param):
    reply = httpx.post(f"{served[1]}/chat/completions", timeout=60,
                       json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **body})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"].startswith(param), reply.json()


def test_a_template_without_tool_calls_refuses_tools_by_name(served):
    plain_app = served[2]

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=plain_app), base_url="http://api") as c:
            return await c.post("/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": [WEATHER]})

    reply = asyncio.run(go())
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "tools"
    assert "does not write tool calls" in reply.json()["error"]["message"]
    plain_app.state.llm.shutdown()


def test_template_variables_and_a_continued_last_message(served, client):
    """vLLM's chat_template_kwargs (Qwen3's enable_thinking, say) and continue_final_message were taken in silence
    and ignored (unknown fields pass, as vLLM lets them)."""
    app = served[0]
    hello = [{"role": "user", "content": "hi"}]
    bare = client.chat.completions.create(model="tiny", messages=hello, max_tokens=1)
    greeted = client.chat.completions.create(model="tiny", messages=hello, max_tokens=1,
                                             extra_body={"chat_template_kwargs": {"greeting": "good morning to all"}})
    assert greeted.usage.prompt_tokens > bare.usage.prompt_tokens
    started = hello + [{"role": "assistant", "content": "Once upon a"}]
    continued = client.chat.completions.create(model="tiny", messages=started, max_tokens=1, extra_body={
        "continue_final_message": True, "add_generation_prompt": False})
    tokenizer = app.state.llm.tokenizer
    expected = tokenizer.apply_chat_template(started, continue_final_message=True, tokenize=False)
    assert expected.endswith("Once upon a")
    assert continued.usage.prompt_tokens == len(tokenizer.encode(expected, add_special_tokens=False))
    for extra, param in (({"chat_template_kwargs": {"chat_template": "{{ 'mine' }}"}}, "chat_template_kwargs"),
                         ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
                         ({"continue_final_message": True}, "continue_final_message")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="tiny", messages=started, max_tokens=1, extra_body=extra)
        assert refused.value.param == param


def test_a_tools_parameters_nested_too_deep_are_a_400_naming_tool_choice(served):
    """A forced call's parameter schema is compiled: nested past the formats' depth limit, it is refused before."""
    deep = json.loads('{"type": "object", "properties": {"a": ' * 120 + '{"type": "integer"}' + "}}" * 120)
    tool = {"type": "function", "function": {"name": "f", "parameters": deep}}
    reply = httpx.post(f"{served[1]}/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "tools": [tool],
        "tool_choice": "required"})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "tool_choice" and "deep" in reply.json()["error"]["message"]
