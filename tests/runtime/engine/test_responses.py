"""OpenAI's Responses API over the tiny model behind a real uvicorn socket, driven by the official `openai` client:
the chat API's reply to the same conversation, whole and as numbered events; function calls and their outputs in
the input, and calls the model writes in the output; what it cannot do, refused by name. The model's random weights
never write a call, so one test replaces the text of the real engine's outputs with a call (as test_tools does)."""
import json
import shutil

import httpx
import openai
import pytest

from ember.runtime.engine.api import create_app
from ember.runtime.engine.config import EngineConfig
from ember.runtime.engine.serving.protocol import ResponsesRequest
from ember.runtime.engine.serving.responses import chat_request
from ember.runtime.engine.tiny import build_tiny_model

from .helpers import engine_writes, uvicorn_thread, wait_until_idle
from .test_tools import CALL_PIECES, TEMPLATE

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
STORY = "Tell me a story."


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    plain = build_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen3", max_position_embeddings=8192)
    path = tmp_path_factory.mktemp("tools") / "qwen3"
    shutil.copytree(plain, path)
    (path / "chat_template.jinja").write_text(TEMPLATE)   # a template that writes tools, calls and their results
    app = create_app(EngineConfig(model=str(path), max_num_seqs=8), served_model_name="tiny")
    with uvicorn_thread(app) as url:
        yield app, f"{url}/v1"


def test_a_response_is_the_chat_reply_to_the_same_conversation(client):
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": STORY}],
        max_tokens=6, seed=3, extra_body={"ignore_eos": True})
    reply = client.responses.create(model="tiny", instructions="Be brief.", input=STORY, max_output_tokens=6,
                                    extra_body={"seed": 3, "ignore_eos": True})
    assert reply.output_text == chat.choices[0].message.content and reply.id.startswith("resp_")
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    [message] = reply.output
    assert message.type == "message" and message.role == "assistant" and message.status == "incomplete"
    assert reply.usage.input_tokens == chat.usage.prompt_tokens and reply.usage.output_tokens == 6
    assert reply.usage.total_tokens == reply.usage.input_tokens + 6
    assert reply.instructions == "Be brief." and reply.max_output_tokens == 6 and reply.store is False
    as_items = client.responses.create(model="tiny", max_output_tokens=6, extra_body={"seed": 3, "ignore_eos": True},
                                       input=[{"role": "system", "content": "Be brief."},
                                              {"type": "message", "role": "user",
                                               "content": [{"type": "input_text", "text": STORY}]}])
    assert as_items.output_text == reply.output_text and as_items.id != reply.id


def test_a_reply_the_model_ends_is_completed(served, client):
    tokenizer = served[0].state.llm.tokenizer
    eos = {str(tokenizer.eos_token_id): 100}   # the first token is the end: an empty, finished reply
    reply = client.responses.create(model="tiny", input=STORY, extra_body={"logit_bias": eos},
                                    metadata={"ticket": "42"})
    assert reply.status == "completed" and reply.incomplete_details is None and reply.output_text == ""
    assert reply.output[0].status == "completed" and reply.metadata == {"ticket": "42"}
    events = list(client.responses.create(model="tiny", input=STORY, stream=True, extra_body={"logit_bias": eos}))
    assert events[-1].type == "response.completed" and events[-1].response.output[0].content[0].text == ""


def test_a_streamed_response_is_the_whole_reply_in_numbered_events(served, client):
    settings = {"model": "tiny", "input": STORY, "max_output_tokens": 8, "extra_body": {"seed": 5}}
    whole = client.responses.create(**settings)
    events = list(client.responses.create(stream=True, **settings))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    end = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          end]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.total_tokens == whole.usage.total_tokens
    assert events[0].response.id == final.id and events[0].response.status == "in_progress"
    # on the wire: each event named by its type, and no [DONE] (the Responses stream has none)
    with httpx.stream("POST", f"{served[1]}/responses", timeout=60,
                      json={"model": "tiny", "input": STORY, "max_output_tokens": 3, "stream": True}) as raw:
        lines = [line for line in raw.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    datas = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert names == [d["type"] for d in datas] and len(names) * 2 == len(lines)


HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
           {"type": "function_call_output", "call_id": "call_1", "output": "18 C and sunny"}]


def test_function_calls_and_their_outputs_reach_the_template(client):
    chat = chat_request(ResponsesRequest(model="tiny", input=HISTORY, tools=[WEATHER], instructions="Help."))
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool"]
    [call] = chat.messages[2].tool_calls
    assert call.id == "call_1" and call.function.name == "get_weather" and chat.messages[3].tool_call_id == "call_1"
    assert chat.tools[0].function.name == "get_weather" and chat.tools[0].function.parameters == WEATHER["parameters"]
    chat_history = [{"role": "user", "content": "Weather in Paris?"},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]
    as_chat = client.chat.completions.create(model="tiny", messages=chat_history, max_tokens=1,
                                             tools=[{"type": "function", "function": {
                                                 k: v for k, v in WEATHER.items() if k != "type"}}])
    reply = client.responses.create(model="tiny", input=HISTORY, max_output_tokens=1, tools=[WEATHER])
    assert reply.usage.input_tokens == as_chat.usage.prompt_tokens   # the same prompt, token for token
    bare = client.responses.create(model="tiny", input=HISTORY, max_output_tokens=1, tools=[WEATHER],
                                   tool_choice="none")
    assert bare.usage.input_tokens < reply.usage.input_tokens - 20   # "none": the tools are not offered


def test_a_call_the_model_writes_comes_back_as_a_function_call_item(served, monkeypatch):
    engine_writes(monkeypatch, CALL_PIECES)
    settings = {"model": "tiny", "input": "Weather?", "max_output_tokens": 4, "tools": [WEATHER],
                "extra_body": {"ignore_eos": True}}
    with openai.OpenAI(base_url=served[1], api_key="unused", max_retries=0) as client:
        whole = client.responses.create(**settings)
        events = list(client.responses.create(stream=True, **settings))
    message, call = whole.output
    assert message.type == "message" and message.content[0].text == "Checking."
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id.startswith("call_")
    assert whole.status == "completed"
    kinds = [e.type for e in events]
    assert kinds.count("response.output_item.added") == 2 and kinds.count("response.output_item.done") == 2
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.name == "get_weather" and json.loads(done.arguments) == {"city": "Paris"} and done.output_index == 1
    streamed = events[-1].response.output
    assert [item.type for item in streamed] == ["message", "function_call"]
    assert streamed[0].content[0].text == "Checking. " and streamed[1].arguments == call.arguments


def test_a_forced_function_call_is_the_output(client):
    forecast = {"type": "function", "name": "forecast", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}}
    response = client.responses.create(model="tiny", input="Forecast?", max_output_tokens=300,
                                       tools=[WEATHER, forecast], tool_choice={"type": "function", "name": "forecast"})
    [call] = response.output
    assert call.type == "function_call" and call.name == "forecast"
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome") and response.status == "completed"
    assert response.tool_choice.name == "forecast"


@pytest.mark.parametrize("body, param, named", [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "stores no response"),
    ({"conversation": "conv_1"}, "conversation", "conversation"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "needs schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"$ref": "#/nowhere"}}}}, "text",
     "cannot be compiled"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x"}]}]}, "input",
     "input_image"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "item_reference"),
    ({"input": [42]}, "input", "a number with no type"),
    ({"input": ""}, "input", "empty"),
    ({"input": []}, "input", "at least one"),
    ({"input": [{"role": "user", "content": "a"}] * 10_001}, "input", "at most 10,000 items"),
    ({"input": [{"role": "critic", "content": "hi"}]}, "input", "item 0 (message): role: Input should be"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input", "item 0 (function_call): call_id: Field required"),
    ({"n": 2}, "n", "one output"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice",
     "must be none, auto, required"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_time"}}, "tool_choice",
     "not among the tools"),
    ({"tools": [{"type": "web_search"}]}, "tools", ""),
    ({"background": True}, "background", "background"),
    ({"include": ["message.output_text.logprobs"]}, "include", "include"),
    ({"reasoning": {"effort": "high"}}, "reasoning", "reasoning"),
    ({"truncation": "auto"}, "truncation", "truncation"),
    ({"metadata": {"k" * 65: "v"}}, "metadata", "at most 16"),
    ({"max_output_tokens": 0}, "max_output_tokens", ""),
    ({"input": "word " * 9000}, "input", "maximum context length"),
])
def test_what_responses_cannot_do_here_is_a_400_naming_it(served, body, param, named):
    reply = httpx.post(f"{served[1]}/responses", json={"model": "tiny", "input": "hi", **body}, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"].startswith(param) and named in error["message"], error


def test_an_unknown_model_and_a_stored_response_are_404s(served, client):
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model="gpt-5", input=STORY)
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError) as stored:
        client.responses.retrieve("resp_123")
    assert stored.value.code == "response_not_found" and "stores no response" in str(stored.value)


def test_leaving_a_response_aborts_it_streamed_or_whole(served, client):
    engine = served[0].state.llm.engine
    wait_until_idle(engine)
    aborted = engine.stats.request_success["abort"]
    stream = client.responses.create(model="tiny", input=STORY, max_output_tokens=6000, stream=True,
                                     extra_body={"ignore_eos": True})
    for _, _event in zip(range(5), stream):
        pass
    assert engine.has_unfinished_requests()
    stream.close()
    wait_until_idle(engine)
    assert engine.stats.request_success["abort"] == aborted + 1
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{served[1]}/responses", timeout=httpx.Timeout(0.3, connect=5),
                   json={"model": "tiny", "input": STORY, "max_output_tokens": 6000, "ignore_eos": True})
    wait_until_idle(engine)
    assert engine.stats.request_success["abort"] == aborted + 2
