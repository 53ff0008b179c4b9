"""Structured outputs: replies held to a JSON schema, a regex, a list of choices or a grammar, through the OpenAI API
(chat, completions, Responses) over the tiny random-weight model, and in the engine beside free-text requests.

A random model writes whatever its weights happen to favour: every reply that is valid here is valid because the
format held it, which each test shows against the same request without the format."""
import json
import re

import httpx
import jsonschema
import pytest
from transformers import AutoTokenizer

from ember.runtime.engine.api import create_app
from ember.runtime.engine.config import EngineConfig
from ember.runtime.engine.engine import LLMEngine
from ember.runtime.engine.grammar import Grammars
from ember.runtime.engine.sampling import SamplingParams
from ember.runtime.engine.serving import formats
from ember.runtime.engine.serving.reasoning import ReplyShape
from ember.runtime.engine.tiny import build_tiny_model

from .helpers import ORDER, uvicorn_thread, wait_until_idle

HELLO = [{"role": "user", "content": "Order something."}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen3")
    app = create_app(EngineConfig(model=str(path), max_num_seqs=16), served_model_name="tiny")
    with uvicorn_thread(app) as url:
        yield app, f"{url}/v1"


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "order", "schema": schema, "strict": True}}


def test_every_choice_holds_to_the_schema_sampled_or_greedy(client):
    free = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=60, n=4, seed=1)
    assert not any(_is_json(c.message.content) for c in free.choices)   # what the model writes on its own
    for temperature in (1.0, 0.0):
        reply = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=600, n=4, seed=1,
                                               temperature=temperature, response_format=schema_format(ORDER))
        for choice in reply.choices:
            assert choice.finish_reason == "stop", choice
            jsonschema.validate(json.loads(choice.message.content), ORDER)
    sampled = {json.dumps(json.loads(c.message.content)) for c in client.chat.completions.create(
        model="tiny", messages=HELLO, max_tokens=600, n=8, seed=2, response_format=schema_format(ORDER)).choices}
    assert len(sampled) > 1   # the format limits what may be sampled, not which of it


def test_a_streamed_reply_holds_to_the_schema(client):
    chunks = list(client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=600, seed=3, stream=True,
                                                 response_format=schema_format(ORDER)))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), ORDER)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_json_object_beats_a_bias_toward_anything_else(served, client):
    """json_object: the reply is an object. A +100 bias on "}" makes the model write "}}}}" on its own; held to
    JSON it opens with "{" (the tokens that begin with more than "{" are biased away), and then takes "}" as soon
    as it may."""
    tokenizer = served[0].state.llm.tokenizer
    close = tokenizer.encode("}", add_special_tokens=False)[0]
    texts = [tokenizer.decode([i]) for i in range(len(tokenizer))]
    longer = [i for i, text in enumerate(texts) if text.startswith("{") and text != "{"]
    bias = {str(close): 100, **{str(i): -100 for i in longer}}
    free = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=4, logit_bias=bias)
    assert free.choices[0].message.content.startswith("}}")
    held = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=20, logit_bias=bias,
                                          response_format={"type": "json_object"})
    assert json.loads(held.choices[0].message.content) == {} and held.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("extra, check", [
    ({"guided_regex": r"(yes|no), [0-9]{1,3}!"}, lambda text: re.fullmatch(r"(yes|no), [0-9]{1,3}!", text)),
    ({"guided_choice": ["red", "green", "light blue"]}, lambda text: text in ("red", "green", "light blue")),
    ({"structured_outputs": {"choice": ["up", "down"]}}, lambda text: text in ("up", "down")),
    ({"guided_grammar": 'root ::= "x" ("-" [0-9])*'}, lambda text: re.fullmatch(r"x(-[0-9])*", text)),
    ({"guided_json": json.dumps(ORDER)}, lambda text: jsonschema.validate(json.loads(text), ORDER) is None),
])
def test_vllm_extras_hold_completions_and_chat_replies(client, extra, check):
    completion = client.completions.create(model="tiny", prompt="The answer:", max_tokens=600, n=3, seed=4,
                                           extra_body=extra)
    chat = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=600, n=3, seed=4, extra_body=extra)
    texts = [c.text for c in completion.choices] + [c.message.content for c in chat.choices]
    assert all(check(text) for text in texts), texts


def test_the_responses_api_holds_output_text_to_text_format(client):
    response = client.responses.create(model="tiny", input="Order something.", max_output_tokens=200,
                                       text={"format": {"type": "json_schema", "name": "order", "schema": ORDER}})
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), ORDER)
    assert response.text.format.type == "json_schema" and response.text.format.name == "order"


@pytest.mark.parametrize("body, param, named", [
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", ""),
    ({"response_format": schema_format({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}})},
     "response_format", "cannot be compiled"),
    ({"response_format": schema_format({"type": "string", "enum": ["x" * 60_000, "y" * 60_000]})},
     "response_format", "at most 100,000"),
    ({"response_format": schema_format(json.loads('{"items": ' * 150 + "{}" + "}" * 150))}, "response_format",
     "more than 100 deep"),
    ({"response_format": schema_format({"type": "nonsense"})}, "response_format", 'Unsupported type "nonsense"'),
    ({"guided_regex": "(unclosed"}, "guided_regex", "cannot be compiled"),
    ({"guided_regex": "(" * 5000 + "a" + ")" * 5000}, "guided_regex", "cannot be compiled"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_json": "{not json"}, "guided_json", "not JSON"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "exactly one of json"),
    ({"guided_json": ORDER, "response_format": {"type": "json_object"}}, None, "response_format and guided_json"),
])
def test_a_format_that_cannot_hold_a_reply_is_a_400_naming_it(served, body, param, named):
    reply = httpx.post(f"{served[1]}/chat/completions", timeout=60,
                       json={"model": "tiny", "messages": HELLO, "max_tokens": 4, **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and named in error["message"], error
    assert "Traceback" not in error["message"]
    assert not re.search(r"\.(cc|cpp|h):\d+", error["message"]), error   # no path into xgrammar's sources


def test_a_text_format_is_free_text(client):
    reply = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=8, seed=1,
                                           response_format={"type": "text"})
    free = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=8, seed=1)
    assert reply.choices[0].message.content == free.choices[0].message.content


def test_held_and_free_requests_share_steps_and_neither_changes_the_other(served):
    """In one engine, free-text requests' greedy tokens are those they get alone, and held requests beside them keep
    to their formats, with overlap scheduling on: a step's forward pass is launched before the step before it is
    collected, its masks written after. Neither min_tokens nor ignore_eos keeps a finished format going."""
    llm = served[0].state.llm
    engine = LLMEngine(EngineConfig(model=llm.engine.config.model, max_num_seqs=16, overlap=True))
    tokenizer = AutoTokenizer.from_pretrained(llm.engine.config.model)
    grammars = Grammars(tokenizer, engine.runner.vocab_size, engine.eos_token_ids)
    order = grammars.compile(formats.reply_format(formats.AnswerFormat("json_schema", ORDER), None, None))
    choice = grammars.compile(formats.reply_format(formats.AnswerFormat("choice", ["yes", "no"]), None, None))
    prompts = [tokenizer.encode(text) for text in ("Hello there", "The weather today", "Numbers like")]
    free = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    alone = engine.generate(prompts, free)
    launches, overlapped = [], []   # each collect: whether a later step was launched before it
    launch, collect = engine.runner.launch, engine.runner.collect
    engine.runner.launch = lambda *args, **kwargs: launches.append(launch(*args, **kwargs)) or launches[-1]
    engine.runner.collect = lambda launched: overlapped.append(launched is not launches[-1]) or collect(launched)
    mixed = engine.generate(prompts * 2, [free] * 3 + [
        SamplingParams(max_tokens=600, temperature=1.0, seed=5, grammar=order),
        SamplingParams(max_tokens=600, temperature=0.0, min_tokens=50, grammar=choice),
        SamplingParams(max_tokens=600, temperature=0.0, ignore_eos=True, grammar=choice)])
    assert mixed[:3] == alone
    assert sum(overlapped) > 0.8 * len(overlapped)   # all but the first steps and the last
    jsonschema.validate(json.loads(tokenizer.decode(mixed[3], skip_special_tokens=True)), ORDER)
    assert tokenizer.decode(mixed[4], skip_special_tokens=True) in ("yes", "no")
    # ignore_eos: the format's end is its stop token, and nothing comes after it
    assert tokenizer.decode(mixed[5][:-1]) in ("yes", "no") and mixed[5][-1] in engine.eos_token_ids
    wait_until_idle(engine)
    engine.runner.close()


def test_a_reasoning_template_keeps_its_block_before_the_format(served):
    """With a template that thinks, the format applies after </think>: a reply may reason first (or, where the
    prompt opened the block, must finish it), then answer in the format."""
    import xgrammar as xgr

    tokenizer = served[0].state.llm.tokenizer
    grammars = Grammars(tokenizer, served[0].state.llm.engine.runner.vocab_size, [tokenizer.eos_token_id])
    answer = formats.AnswerFormat("choice", ["yes", "no"])

    def accepts(shape: ReplyShape, text: str) -> bool:
        matcher = xgr.GrammarMatcher(grammars.compile(formats.reply_format(answer, None, shape)).compiled)
        return matcher.accept_string(text) and matcher.is_completed()

    closed, inside = ReplyShape(reasoning=True), ReplyShape(reasoning=True, inside=True)
    assert accepts(closed, "yes") and accepts(closed, "<think>\nhmm, maybe\n</think>\n\nno")
    assert not accepts(closed, "hmm</think>no") and not accepts(closed, "<think>x</think>maybe")
    assert accepts(inside, "hmm, maybe</think>\n\nyes") and not accepts(inside, "yes")
    assert not accepts(ReplyShape(), "<think>x</think>yes")


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_any_path_the_masks_allow_is_a_reply_the_schema_accepts(served):
    """Whatever a model picks among the tokens a mask allows (here: at random, every other pick a single byte where
    one is allowed, control characters among them), the reply is JSON a strict parser reads and holds to the schema.
    One allowance: xgrammar counts a malformed UTF-8 sequence (an overlong or surrogate one, which a random model
    writes and a trained one does not) as one character of a bounded string, where a decoder reads one replacement
    character per byte; the lengths are read with each run of replacement characters as one."""
    import random

    import torch

    from ember.runtime.engine.grammar import Matcher

    llm = served[0].state.llm
    grammars = Grammars(llm.tokenizer, llm.engine.runner.vocab_size, llm.engine.eos_token_ids)
    code = {"type": "string", "minLength": 2, "maxLength": 3}
    schema = {**ORDER, "properties": {**ORDER["properties"], "code": code}, "required": [*ORDER["required"], "code"]}
    grammar = grammars.compile(formats.reply_format(formats.AnswerFormat("json_schema", schema), None, None))
    shifts = torch.arange(32, dtype=torch.int32)
    pieces = llm.tokenizer.convert_ids_to_tokens(list(range(len(llm.tokenizer))))
    single_bytes = {token for token, piece in enumerate(pieces) if len(piece) == 1}   # byte-level BPE: one symbol
    at_most = {**schema, "properties": {**schema["properties"], "code": {"type": "string", "maxLength": 3}}}
    for seed in range(150):
        pick, matcher, tokens = random.Random(seed), Matcher(grammar), []
        while not matcher.ended:
            allowed = ((matcher.allowed().unsqueeze(-1) >> shifts) & 1).view(-1).nonzero().flatten().tolist()
            bytes_allowed = single_bytes.intersection(allowed) if pick.random() < 0.5 else None
            tokens.append(pick.choice(sorted(bytes_allowed) if bytes_allowed else allowed))
            matcher.advance(tokens[-1])
            assert len(tokens) < 2000
        assert tokens[-1] in llm.engine.eos_token_ids
        reply = json.loads(llm.tokenizer.decode(tokens, skip_special_tokens=True))
        jsonschema.validate({key: re.sub("\ufffd+", "\ufffd", value) if isinstance(value, str) else value
                             for key, value in reply.items()}, at_most)
        assert len(reply["code"]) >= 2


def test_a_steps_masks_written_together_equal_each_written_alone(served):
    """MaskFiller writes several sequences' masks in one call, on several threads, into a buffer it grows: each row
    is the mask that sequence's matcher writes alone."""
    import torch

    from ember.runtime.engine.grammar import MaskFiller, Matcher

    llm = served[0].state.llm
    vocab = llm.engine.runner.vocab_size
    grammar = Grammars(llm.tokenizer, vocab, llm.engine.eos_token_ids).compile(
        formats.reply_format(formats.AnswerFormat("json_schema", ORDER), None, None))
    matchers = [Matcher(grammar) for _ in range(5)]
    for i, matcher in enumerate(matchers):   # each at its own place: '{"item": "milk", "count": 1...'
        for token in llm.tokenizer.encode('{"item": "milk", "count": 1, "paid": true, "note": "ab"'[:12 * i]):
            assert not matcher.advance(token)
    alone = [matcher.allowed().clone() for matcher in matchers]
    assert len({tuple(row.tolist()) for row in alone}) == 5
    filler = MaskFiller(vocab, threaded_rows=2)   # threads from two rows on: one row is written alone
    for group in (matchers[:2], matchers[::-1], matchers[3:4]):
        together = filler.fill(group)
        assert all(torch.equal(row, alone[matchers.index(m)]) for row, m in zip(together, group, strict=True))


def test_a_server_that_warms_formats_is_ready_before_its_first_constrained_request(served):
    """With warm_formats (a GPU replica's default), the engine's first idle moment after its start reads the
    vocabulary for constrained decoding in a thread of its own; without, nothing is read before a request asks."""
    import time

    config = EngineConfig(model=served[0].state.llm.engine.config.model, max_num_seqs=4)
    warm = create_app(config, served_model_name="tiny", warm_formats=True)
    cold = create_app(config, served_model_name="tiny", warm_formats=False)
    try:
        deadline = time.monotonic() + 60
        pool = None
        while (pool is None or not pool._idle) and time.monotonic() < deadline:   # the vocabulary, then a worker
            pool = warm.state.openai.grammars._pool
            time.sleep(0.05)
        assert warm.state.openai.grammars._compiler is not None and pool is not None and len(pool._idle) == 1
        assert cold.state.openai.grammars._compiler is None and cold.state.openai.grammars._pool is None
    finally:
        for app in (warm, cold):
            app.state.openai.grammars.close()
            app.state.llm.shutdown()
