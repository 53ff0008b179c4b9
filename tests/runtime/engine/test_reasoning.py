"""A reply's reasoning apart from its answer: the tag reader on its own (split anywhere across steps), then the app
over the tiny model with chat templates that think (Qwen3's way, whose reply opens the block, and DeepSeek-R1's,
whose prompt does). The model's random weights never write the tags, so the served tests replace the text of the
real engine's outputs with a reply that reasons (the stand-in test_tools uses too)."""
import contextlib
import itertools
import json
import shutil

import httpx
import openai
import pytest

from ember.runtime.engine.api import create_app
from ember.runtime.engine.config import EngineConfig
from ember.runtime.engine.serving.reasoning import ReasoningStream, ReplyParser, ReplyShape, joined, starts_inside
from ember.runtime.engine.tiny import build_tiny_model

from .helpers import engine_writes, uvicorn_thread
from .test_tools import CALL

THOUGHT = "<think>\nThe user wants a city. Paris.\n</think>\n\nParis."


def split(text: str, cut: int, inside: bool = False) -> tuple[str, str]:
    stream, parts = ReasoningStream(inside), []
    for at in range(0, len(text), cut):
        parts += stream.feed(text[at:at + cut])
    parts += stream.finish()
    return ("".join(p.get("reasoning", "") for p in parts), "".join(p.get("content", "") for p in parts))


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 8, 1000])
def test_reasoning_and_answer_split_wherever_the_steps_cut(cut):
    assert split(THOUGHT, cut) == ("\nThe user wants a city. Paris.\n", "Paris.")
    assert split("  \n" + THOUGHT, cut)[1] == "Paris."   # whitespace before the block
    assert split("The user wants a city.</think>Paris.", cut, inside=True) == ("The user wants a city.", "Paris.")
    assert split("Paris. <think>not a block</think>", cut) == ("", "Paris. <think>not a block</think>")
    assert split("<think>cut off while thinking", cut) == ("cut off while thinking", "")
    assert split("<thin", cut) == ("", "<thin")   # the reply ended on what only looked like a tag's start
    assert split("<think></think>", cut) == ("", "")


def test_a_reply_of_endless_whitespace_is_an_answer_and_held_back_no_further():
    stream = ReasoningStream(inside=False)
    assert stream.feed(" " * 200) == []   # still may open a block
    assert stream.feed(" " * 100) == [{"content": " " * 300}]
    assert stream.feed("<think>") == [{"content": "<think>"}]


def test_calls_are_read_from_the_answer_and_reasoning_tokens_counted_to_the_block_end():
    parser = ReplyParser(ReplyShape(reasoning=True, tools=True))
    steps = ["<think>maybe " + CALL[:20], CALL[20:] + " no", "</think>\n", "\n" + CALL]
    parts = [p for i, step in enumerate(steps) for p in parser.feed(step, tokens=3, final=i == len(steps) - 1)]
    reasoning, content, calls = joined(parts)
    assert reasoning == "maybe " + CALL + " no" and content == ""   # a call written in the reasoning is not made
    assert [c["function"]["name"] for c in calls] == ["get_weather"] and parser.made_calls
    assert parser.reasoning_tokens == 9   # the three steps up to the one that closed the block


def test_reasoning_tokens_are_the_blocks_steps_and_an_answers_opening_is_none_of_them():
    def counted(steps: list[str]) -> int:
        parser = ReplyParser(ReplyShape(reasoning=True))
        for i, step in enumerate(steps):
            parser.feed(step, tokens=2, final=i == len(steps) - 1)
        return parser.reasoning_tokens

    assert counted(["<thi", "nk>abc", "</think>x", "y"]) == 6   # an opening tag cut in two counts from its start
    assert counted(["  ", "<", "Hello", " world"]) == 0          # undecided, then an answer
    assert counted(["<think>a", "b", "c"]) == 6                  # cut off while reasoning: every step


REPLY_TOKENS = ["  ", "<think>", "\nThe", " user", " wants", " a city.", "\n</", "think", ">\n\n", "Paris", "."]


@pytest.mark.parametrize("joins", [[1] * 11, [11], [3, 8], [2, 7, 2], [6, 3, 2], [9, 2], [8, 3], [1, 1, 9], [4, 4, 3]])
def test_reasoning_tokens_end_at_the_token_that_closed_the_block_however_the_steps_were_joined(joins):
    """A caller that fell behind gets several steps' tokens in one output (async_engine._joined), with where each
    token's text ends: the count is the same as step by step, up to and with the token that wrote the closing tag's
    last character, whatever else the output holds."""
    def counted(tokens: list[str], inside: bool = False) -> int:
        parser, at = ReplyParser(ReplyShape(reasoning=True, inside=inside)), 0
        for k in joins:
            taken, at = tokens[at:at + k], at + k
            ends = list(itertools.accumulate(map(len, taken))) if k > 1 else None
            parser.feed("".join(taken), k, final=at == len(tokens), token_ends=ends)
        return parser.reasoning_tokens

    assert counted(REPLY_TOKENS) == 9   # the opening whitespace, the tag, ..., ">\n\n"
    assert counted(["\nThe", " user", " wants", " a", " city.", "\n</", "think", ">\n\n", "Paris", ".", "!"],
                   inside=True) == 8
    assert counted(["Paris", ".", " <", "think", ">", "x", "</", "think", ">", "!", "!"]) == 0   # an answer's


def test_a_prompt_left_inside_a_block_starts_the_reply_in_it():
    assert starts_inside("<|im_start|>assistant\n<think>\n")
    assert not starts_inside("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not starts_inside("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


QWEN3 = ("{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
         "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n"
         "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}"
         "{%- endif %}")
DEEPSEEK_R1 = ("{%- for message in messages %}<|im_start|>{{ message.role }}\n"
               "{{ message.content.split('</think>')[-1] }}<|im_end|>\n{%- endfor %}"
               "{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n{%- endif %}")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The tiny model served under each template: its API's base URL by the template's name."""
    plain = build_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen3")
    with contextlib.ExitStack() as stack:
        urls = {}
        for name, template in (("qwen3", QWEN3), ("r1", DEEPSEEK_R1)):
            path = tmp_path_factory.mktemp(name) / "qwen3"
            shutil.copytree(plain, path)
            (path / "chat_template.jinja").write_text(template)
            app = create_app(EngineConfig(model=str(path), max_num_seqs=8), served_model_name="tiny")
            urls[name] = f"{stack.enter_context(uvicorn_thread(app))}/v1"
        yield urls


@pytest.fixture
def writes(monkeypatch):
    """The engine's outputs with their text replaced by `reply` cut into pieces, one per step."""
    def use(reply: str, cut: int = 7) -> None:
        engine_writes(monkeypatch, [reply[at:at + cut] for at in range(0, len(reply), cut)])
    return use


ASK = {"model": "tiny", "messages": [{"role": "user", "content": "A city?"}], "max_tokens": 40,
       "extra_body": {"ignore_eos": True}}


def test_the_chat_api_gives_the_reasoning_apart_whole_and_streamed(served, writes):
    writes(THOUGHT)
    with openai.OpenAI(base_url=served["qwen3"], api_key="unused", max_retries=0) as client:
        whole = client.chat.completions.create(**ASK)
        chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **ASK))
    message = whole.choices[0].message
    assert message.content == "Paris." and message.reasoning_content == "\nThe user wants a city. Paris.\n"
    # a token a 7-character piece: the block closes in the piece holding the tag's last character, joined or not
    closing = THOUGHT.index("</think>") + len("</think>")
    assert whole.usage.completion_tokens_details.reasoning_tokens == -(-closing // 7) < whole.usage.completion_tokens
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    # the first step's "<think>", held: its own chunk with no text (below), or, for a client that fell behind (a
    # loaded CI host), joined with the steps after it, whose reasoning that chunk then starts
    assert deltas[0].role == "assistant" and (deltas[1].content == "" or message.reasoning_content.startswith(
        deltas[1].reasoning_content))
    assert "".join(d.content or "" for d in deltas) == "Paris."
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == message.reasoning_content
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == \
        whole.usage.completion_tokens_details.reasoning_tokens


def test_a_step_whose_text_is_held_back_still_sends_a_chunk():
    """A step that wrote only what may be a tag ("<think>", "</th") sends a chunk with no text, so a client sees each
    token come, as with a plain reply; its finishing step sends the finish alone."""
    from ember.runtime.engine.async_engine import Completion
    from ember.runtime.engine.serving.server import ChunkJSON, _part_chunks

    chunks, parser = ChunkJSON("id", "chat.completion.chunk", 0, "tiny", False), ReplyParser(ReplyShape(reasoning=True))

    def step(text: str, finish: str | None = None) -> list[dict]:
        c = Completion(0, text, [7], None, finish, None, 3, 0)
        return [json.loads(chunk)["choices"][0] for chunk in _part_chunks(chunks, c, parser, None)]

    assert [c["delta"] for c in step("<think>")] == [{"content": ""}]
    assert [c["delta"] for c in step("\nThe us")] == [{"reasoning_content": "\nThe us"}]
    assert [c["delta"] for c in step("</th")] == [{"content": ""}]
    assert [c["delta"] for c in step("ink>Paris")] == [{"content": "Paris"}]
    assert [(c["delta"], c["finish_reason"]) for c in step("", "length")] == [({}, "length")]


def test_a_template_that_opens_the_block_starts_the_reply_in_it(served, writes):
    writes("The user wants a city.\n</think>\n\nParis.")
    reply = httpx.post(f"{served['r1']}/chat/completions", timeout=60,
                       json={k: v for k, v in ASK.items() if k != "extra_body"} | {"ignore_eos": True}).json()
    message = reply["choices"][0]["message"]
    assert message["reasoning_content"] == "The user wants a city.\n" and message["content"] == "Paris."


def test_thinking_turned_off_in_the_template_leaves_the_reply_an_answer(served, writes):
    writes("Paris. <think> is a tag I like.")
    reply = httpx.post(f"{served['qwen3']}/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "A city?"}], "max_tokens": 40, "ignore_eos": True,
        "chat_template_kwargs": {"enable_thinking": False}}).json()
    message = reply["choices"][0]["message"]
    assert message["content"] == "Paris. <think> is a tag I like." and message["reasoning_content"] is None
    assert reply["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0


def test_a_response_has_a_reasoning_item_before_its_message(served, writes):
    writes(THOUGHT)
    settings = {"model": "tiny", "input": "A city?", "max_output_tokens": 40, "extra_body": {"ignore_eos": True}}
    with openai.OpenAI(base_url=served["qwen3"], api_key="unused", max_retries=0) as client:
        whole = client.responses.create(**settings)
        events = list(client.responses.create(stream=True, **settings))
        again = client.responses.create(model="tiny", max_output_tokens=2,   # its output sent back as input
                                        input=[{"role": "user", "content": "A city?"}, *whole.output,
                                               {"role": "user", "content": "Why?"}])
        answer_only = client.responses.create(model="tiny", max_output_tokens=2,
                                              input=[{"role": "user", "content": "A city?"}, whole.output[1],
                                                     {"role": "user", "content": "Why?"}])
    reasoning, message = whole.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "\nThe user wants a city. Paris.\n"
    assert reasoning.summary == [] and message.type == "message" and whole.output_text == "Paris."
    assert whole.usage.output_tokens_details.reasoning_tokens > 0
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_item.added", 3)
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == reasoning.content[0].text
    assert [item.type for item in events[-1].response.output] == ["reasoning", "message"]
    assert again.usage.input_tokens == answer_only.usage.input_tokens   # the reasoning item taken, left out
    wire = json.loads(whole.model_dump_json())
    assert wire["output"][0]["status"] == "completed" and wire["output"][1]["content"][0]["text"] == "Paris."
