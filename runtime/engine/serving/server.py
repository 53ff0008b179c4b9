"""The OpenAI endpoints' work: prompt tokens in, `Completion` streams out, shaped as OpenAI JSON or events."""

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from ember.runtime.engine import grammar
from ember.runtime.engine.async_engine import AsyncLLM, Completion
from ember.runtime.engine.detokenizer import token_text
from ember.runtime.engine.serving import formats, protocol, tools
from ember.runtime.engine.serving.errors import APIError
from ember.runtime.engine.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingRequest,
    TokenizeRequest,
)
from ember.runtime.engine.serving.reasoning import ReplyParser, ReplyShape, joined, starts_inside, template_thinks
from ember.runtime.engine.serving.streams import event_stream, merge, renumber, start

# JSON has no -inf; OpenAI clients expect a number, vLLM sends this floor too.
MIN_LOGPROB = -9999.0
ENCODE_INLINE = 2000  # characters a prompt may have to be tokenized on the event loop (~2 ms at most)
json_text = json.JSONEncoder(ensure_ascii=False).encode   # json.dumps(o, ensure_ascii=False), with no new encoder each
TAG_MAX_DEPTH = protocol.FORMAT_MAX_DEPTH + 8   # a schema's depth, and the few levels of the tag around it


class OpenAIServer:
    def __init__(self, llm: AsyncLLM, model_name: str, warm_formats: bool | None = None):
        """`warm_formats`: make constrained decoding ready once the engine idles after its start, not at the first
        constrained request (Grammars.warm); None: on a GPU, where the host has cores to spare for it."""
        self.llm, self.model_name, self.tokenizer = llm, model_name, llm.tokenizer
        self.created = int(time.time())
        self.thinks = template_thinks(getattr(self.tokenizer, "chat_template", None))   # reasoning, then answer
        engine = llm.engine
        self.grammars = grammar.Grammars(self.tokenizer, engine.runner.vocab_size, engine.eos_token_ids)
        if warm_formats if warm_formats is not None else engine.runner.device.type == "cuda":
            llm.when_idle(self.grammars.warm)

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "ember",
                "max_model_len": self.llm.engine.max_model_len}

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist. This server serves `{self.model_name}`.",
                           param="model", code="model_not_found", type="not_found_error")

    async def chat(self, req: ChatCompletionRequest):
        self.check_model(req.model)
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "Invalid 'top_logprobs': set 'logprobs' to true to use it.", param="top_logprobs")
        prompt_ids, shape = await self.chat_prompt(req)
        [stream] = await self.submit(req, [prompt_ids], "messages", await self.chat_grammar(req, shape))
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        if req.stream:
            return event_stream(self._chat_events(req, response_id, stream, shape))
        return await self._chat_reply(req, response_id, stream, shape)

    async def chat_prompt(self, req: ChatCompletionRequest) -> tuple[list[int], ReplyShape]:
        """The token ids the chat template makes of the request's messages (and tools), and how the reply's text is
        to be read (for reasoning, where the prompt leaves it, and for tool calls)."""
        for i, m in enumerate(req.messages):
            _unicode(m.text(), f"messages.{i}.content")
        if req.uses_tools and not tools.template_writes_tool_calls(self.tokenizer.chat_template):
            raise APIError(400, "This model's chat template does not write tool calls in a format this server reads "
                           f"({tools.OPEN} JSON {tools.CLOSE}, as Qwen's and Hermes' templates do); send the "
                           "request without tools, or serve a model whose template has them.", param="tools")
        try:
            prompt = self.tokenizer.apply_chat_template(
                tools.template_messages(req.messages), add_generation_prompt=req.add_generation_prompt, tokenize=False,
                tools=[t.model_dump(exclude_none=True) for t in req.tools or []] if req.uses_tools else None,
                continue_final_message=req.continue_final_message, **(req.chat_template_kwargs or {}))
        except Exception as e:  # a template's own raise_exception() is how it rejects a conversation
            raise APIError(400, f"The chat template rejected the messages: {e}", param="messages") from e
        shape = ReplyShape(reasoning=self.thinks, inside=self.thinks and starts_inside(prompt), tools=req.uses_tools,
                           parallel_tool_calls=req.parallel_tool_calls)
        return await self._encode(_unicode(prompt, "messages")), shape

    async def chat_grammar(self, req: ChatCompletionRequest, shape: ReplyShape,
                           format_param: str | None = None) -> grammar.Grammar | None:
        """The format a chat reply is held to: its answer format, or the call its tool_choice forces, after any
        reasoning; None for free text. `format_param`: the field that set the answer format, where not the chat
        API's own (the Responses API's text)."""
        forcing = req.tool_forcing() if req.uses_tools else None
        offered = tuple(t.model_dump(exclude_none=True) for t in req.tools or []) if req.uses_tools else ()
        tag = formats.reply_format(req.answer_format(), forcing, shape, offered)
        return await self.compile(tag, "tool_choice" if forcing is not None else format_param or _format_param(req))

    async def compile(self, tag: dict | None, param: str | None) -> grammar.Grammar | None:
        """`tag` compiled for this model, off the event loop (a large schema takes a while); a 400 naming `param`
        where it cannot be."""
        if tag is None:
            return None
        missing = grammar.missing()
        if missing is not None:
            raise APIError(400, f"Invalid '{param}': {missing}.", param=param)
        if protocol._depth(tag) > TAG_MAX_DEPTH:   # tools' parameter schemas are checked only here
            raise APIError(400, f"Invalid '{param}': the format nests objects and arrays more than "
                           f"{protocol.FORMAT_MAX_DEPTH} deep.", param=param)
        try:
            return await asyncio.to_thread(self.grammars.compile, tag)
        except grammar.FormatError as e:
            raise APIError(400, f"Invalid '{param}': the format cannot be compiled: {e}", param=param) from None
        except grammar.CompileBusy as e:
            raise APIError(503, f"This replica is busy compiling other formats ({e}): retry the request shortly.",
                           param=param, type="server_error") from None

    async def _chat_reply(self, req: ChatCompletionRequest, response_id: str, stream, shape: ReplyShape) -> dict:
        choices: dict[int, dict[str, Any]] = {}
        texts: dict[int, list[str]] = {}   # joined once at the end: += on a long reply copies it every step
        parsers: dict[int, ReplyParser] = {}   # a reply read for reasoning or calls: its parts, as they come
        parts: dict[int, list[dict]] = {}
        usage = Usage()
        async with aclosing(stream):
            async for c in stream:
                usage.add(c)
                choice = choices.setdefault(c.index, {
                    "index": c.index, "message": {"role": "assistant", "content": ""},
                    "logprobs": {"content": []} if req.logprobs else None, "finish_reason": None})
                if shape.plain:
                    texts.setdefault(c.index, []).append(c.text)
                else:
                    parser = parsers.setdefault(c.index, ReplyParser(shape))
                    parts.setdefault(c.index, []).extend(parser.read(c))
                if req.logprobs and c.logprobs:
                    choice["logprobs"]["content"] += self._chat_logprobs(c.logprobs)
                if c.finish_reason:
                    choice["finish_reason"] = c.finish_reason
                    choice["stop_reason"] = c.stop_reason
        for index, choice in choices.items():
            if shape.plain:
                choice["message"]["content"] = "".join(texts[index])
                continue
            reasoning, content, calls = joined(parts.get(index, []))
            message = choice["message"]
            if shape.reasoning:
                message["reasoning_content"] = reasoning or None
            message["content"] = content
            if calls:
                message.update(content=content.strip() or None, tool_calls=calls)
                if choice["finish_reason"] == "stop":
                    choice["finish_reason"] = "tool_calls"
        reasoning_tokens = sum(p.reasoning_tokens for p in parsers.values()) if shape.reasoning else None
        return {"id": response_id, "object": "chat.completion", "created": int(time.time()), "model": self.model_name,
                "choices": [choices[i] for i in sorted(choices)], "usage": usage.as_dict(reasoning_tokens),
                "system_fingerprint": None}

    async def tokenize(self, body: dict) -> dict:
        """vLLM's /tokenize: the ids a chat request's messages ("messages") or a completion's text ("prompt") make,
        as the chat and completions endpoints count them."""
        try:   # a handler's own validation: its errors answer as a body's do (400 naming the field)
            req = (ChatCompletionRequest if "messages" in body else TokenizeRequest).model_validate(body)
        except ValidationError as e:
            raise RequestValidationError(e.errors(include_url=False)) from None
        self.check_model(req.model)
        if isinstance(req, ChatCompletionRequest):
            ids, _ = await self.chat_prompt(req)
        else:
            ids = await self._encode(_unicode(req.prompt, "prompt"))
        return {"count": len(ids), "max_model_len": self.llm.engine.max_model_len, "tokens": ids}

    def detokenize(self, req: DetokenizeRequest) -> dict:
        self.check_model(req.model)
        vocab = len(self.tokenizer)
        if any(not 0 <= t < vocab for t in req.tokens):
            raise APIError(400, f"Invalid 'tokens': every id must be in [0, {vocab}).", param="tokens")
        return {"prompt": self.tokenizer.decode(req.tokens)}

    async def completions(self, req: CompletionRequest):
        self.check_model(req.model)
        prompts = req.prompts()
        if not prompts or any(len(p) == 0 for p in prompts):
            raise APIError(400, "Invalid 'prompt': it must not be empty.", param="prompt")
        prompt_ids = [await self._encode(_unicode(p, "prompt")) if isinstance(p, str) else p for p in prompts]
        held_to = await self.compile(formats.reply_format(req.answer_format(), None, None), _format_param(req))
        streams = await self.submit(req, prompt_ids, "prompt", held_to)
        n = req.n or 1
        merged = merge([renumber(s, i * n) for i, s in enumerate(streams)])
        echoes = {i * n + j: self.tokenizer.decode(ids) if req.echo else "" for i, ids in enumerate(prompt_ids)
                  for j in range(n)}
        response_id = f"cmpl-{uuid.uuid4().hex}"
        if req.stream:
            return event_stream(self._completion_events(req, response_id, merged, echoes))
        choices: dict[int, dict[str, Any]] = {}
        texts: dict[int, list[str]] = {}   # joined once at the end, as in chat
        lengths: dict[int, int] = {}       # characters so far: where the next logprob's text_offset is
        usage = Usage()
        async with aclosing(merged):
            async for c in merged:
                usage.add(c)
                choice = choices.setdefault(c.index, {
                    "index": c.index, "text": "", "finish_reason": None,
                    "logprobs": _empty_completion_logprobs() if req.logprobs is not None else None})
                pieces = texts.setdefault(c.index, [echoes[c.index]])
                length = lengths.get(c.index, len(echoes[c.index]))
                if choice["logprobs"] is not None and c.logprobs:
                    self._completion_logprobs(choice["logprobs"], c.logprobs, length)
                pieces.append(c.text)
                lengths[c.index] = length + len(c.text)
                if c.finish_reason:
                    choice["finish_reason"] = c.finish_reason
                    choice["stop_reason"] = c.stop_reason
        for index, choice in choices.items():
            choice["text"] = "".join(texts[index])
        return {"id": response_id, "object": "text_completion", "created": int(time.time()), "model": self.model_name,
                "choices": [choices[i] for i in sorted(choices)], "usage": usage.as_dict(),
                "system_fingerprint": None}

    async def _encode(self, text: str) -> list[int]:
        """Token ids of `text`. A long text is tokenized in a thread (the tokenizer lets go of the GIL): a 12 MB
        prompt took 11 s on 2 cores, in which the replica's event loop served nothing else, not even its health."""
        if len(text) < ENCODE_INLINE:
            return self.tokenizer.encode(text, add_special_tokens=False)
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=False)

    async def submit(self, req: SamplingRequest, prompts: list[list[int]], prompt_param: str,
                     held_to: grammar.Grammar | None = None):
        """Submit every prompt and wait for its first output, so a refused request is a 400, not a broken stream.
        `held_to`: the format every reply is held to."""
        limit = self.llm.engine.max_model_len
        for stop in req.stop_strings or []:
            _unicode(stop, "stop")
        streams = []
        group = uuid.uuid4().hex   # the batch's prompts share the engine as one caller's request
        for ids in prompts:
            max_tokens = req.requested_max_tokens()
            if len(ids) + (max_tokens or 1) > limit:
                raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                               f"{len(ids) + (max_tokens or 0)} tokens ({len(ids)} in the {prompt_param}, "
                               f"{max_tokens or 0} in the completion). Please reduce the length of the "
                               f"{prompt_param} or completion.", param=prompt_param, code="context_length_exceeded")
            params = req.sampling_params(max_tokens or limit - len(ids))
            params.grammar = held_to
            streams.append(self.llm.generate(ids, params, n=req.n or 1, stop=req.stop_strings,
                                             include_stop_str_in_output=req.include_stop_str_in_output,
                                             skip_special_tokens=req.skip_special_tokens, group=group))
        try:
            return await start(streams)
        except ValueError as e:
            raise APIError(400, str(e), param=_param_named_in(str(e))) from e

    async def _chat_events(self, req, response_id, stream, shape: ReplyShape) -> AsyncIterator[str]:
        created, usage, started = int(time.time()), Usage(), set()
        chunks = ChunkJSON(response_id, "chat.completion.chunk", created, self.model_name, req.include_usage)
        parsers: dict[int, ReplyParser] = {}
        async with aclosing(stream):
            async for c in stream:
                usage.add(c)
                if c.index not in started:
                    started.add(c.index)
                    yield chunks.choice({"index": c.index, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None})
                logprobs = {"content": self._chat_logprobs(c.logprobs)} if req.logprobs and c.logprobs else None
                if not shape.plain:
                    parser = parsers.setdefault(c.index, ReplyParser(shape))
                    for chunk in _part_chunks(chunks, c, parser, logprobs):
                        yield chunk
                    continue
                # a chunk for every step that made tokens, its text empty while the detokenizer holds it back (half
                # a UTF-8 character, a possible stop string): a client sees each token arrive, as with vLLM
                if not (c.finish_reason or logprobs):
                    if c.text or c.token_ids:
                        yield chunks.content(c.index, c.text)
                elif c.finish_reason:
                    yield chunks.choice({"index": c.index, "delta": {"content": c.text} if c.text else {},
                                         "logprobs": logprobs, "finish_reason": c.finish_reason,
                                         "stop_reason": c.stop_reason})
                else:
                    yield chunks.choice({"index": c.index, "delta": {"content": c.text}, "logprobs": logprobs,
                                         "finish_reason": None})
        if req.include_usage:
            reasoning_tokens = sum(p.reasoning_tokens for p in parsers.values()) if shape.reasoning else None
            yield json_text({"id": response_id, "object": "chat.completion.chunk", "created": created,
                             "model": self.model_name, "choices": [], "usage": usage.as_dict(reasoning_tokens),
                             "system_fingerprint": None})

    async def _completion_events(self, req, response_id, stream, echoes) -> AsyncIterator[str]:
        created, usage, offsets = int(time.time()), Usage(), {}
        chunks = ChunkJSON(response_id, "text_completion", created, self.model_name, req.include_usage)
        async with aclosing(stream):
            async for c in stream:
                usage.add(c)
                text = c.text
                if c.index not in offsets:
                    text = echoes[c.index] + text
                    offsets[c.index] = len(echoes[c.index])
                logprobs = None
                if req.logprobs is not None and c.logprobs:
                    logprobs = _empty_completion_logprobs()
                    self._completion_logprobs(logprobs, c.logprobs, offsets[c.index])
                offsets[c.index] += len(c.text)
                if not (c.finish_reason or logprobs):
                    if text or c.token_ids:   # as in chat: a chunk per step's tokens
                        yield chunks.text(c.index, text)
                    continue
                choice = {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason}
                if c.finish_reason:
                    choice["stop_reason"] = c.stop_reason
                yield chunks.choice(choice)
        if req.include_usage:
            yield json_text({"id": response_id, "object": "text_completion", "created": created,
                             "model": self.model_name, "choices": [], "usage": usage.as_dict(),
                             "system_fingerprint": None})

    def _chat_logprobs(self, entries: list[dict]) -> list[dict]:
        def item(token_id, logprob):
            text = token_text(self.tokenizer, token_id)
            return {"token": text, "logprob": max(logprob, MIN_LOGPROB), "bytes": list(text.encode())}

        return [{**item(e["token_id"], e["logprob"]), "top_logprobs": [item(t, lp) for t, lp in e["top"]]}
                for e in entries]

    def _completion_logprobs(self, into: dict, entries: list[dict], offset: int) -> None:
        for e in entries:
            text = token_text(self.tokenizer, e["token_id"])
            into["tokens"].append(text)
            into["token_logprobs"].append(max(e["logprob"], MIN_LOGPROB))
            into["top_logprobs"].append({token_text(self.tokenizer, t): max(lp, MIN_LOGPROB) for t, lp in e["top"]})
            into["text_offset"].append(offset)
            offset += len(text)


def _part_chunks(chunks: "ChunkJSON", c: Completion, parser: ReplyParser, logprobs: dict | None):
    """A step's chunks of a choice whose text is read for reasoning or tool calls: its settled reasoning and answer,
    its whole calls, the step's logprobs on the first, and the finish (reason "tool_calls" where a call was made and
    the model stopped)."""
    sent = False
    for part in parser.read(c):
        if "content" in part:
            delta: dict = {"content": part["content"]}
        elif "reasoning" in part:
            delta = {"reasoning_content": part["reasoning"]}
        else:
            delta = {"tool_calls": [{"index": parser.calls_sent, **part["tool_call"]}]}
            parser.calls_sent += 1
        yield chunks.choice({"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": None})
        logprobs, sent = None, True
    if logprobs is not None or (not sent and c.token_ids and not c.finish_reason):
        # the step's logprobs, or its tokens' text held back (a tag may be starting): the client sees each step come,
        # as with a plain reply
        yield chunks.choice({"index": c.index, "delta": {"content": ""}, "logprobs": logprobs, "finish_reason": None})
    if c.finish_reason:
        reason = "tool_calls" if parser.made_calls and c.finish_reason == "stop" else c.finish_reason
        yield chunks.choice({"index": c.index, "delta": {}, "logprobs": None, "finish_reason": reason,
                             "stop_reason": c.stop_reason})


class ChunkJSON:
    """The JSON of one streamed response's chunks, as json.dumps(chunk, ensure_ascii=False) writes it. What every
    chunk repeats (id, object, created, model, the fields after the choices) is rendered once, and a choice of
    text alone fills a template: dumping each chunk whole cost ~3.5 us of the replica's event loop per token."""

    def __init__(self, response_id: str, kind: str, created: int, model: str, include_usage: bool):
        envelope = json_text({"id": response_id, "object": kind, "created": created, "model": model})
        self.head = envelope[:-1] + ', "choices": ['
        self.tail = '], "system_fingerprint": null' + (', "usage": null' if include_usage else "") + "}"

    def choice(self, choice: dict) -> str:
        return self.head + json_text(choice) + self.tail

    def text(self, index: int, text: str) -> str:
        """A completion's choice of `text` with no logprobs and no finish reason."""
        return (f'{self.head}{{"index": {index}, "text": {json_text(text)}, "logprobs": null, "finish_reason": null}}'
                f"{self.tail}")

    def content(self, index: int, content: str) -> str:
        """A chat choice whose delta is `content`, with no logprobs and no finish reason."""
        return (f'{self.head}{{"index": {index}, "delta": {{"content": {json_text(content)}}}, "logprobs": null, '
                f'"finish_reason": null}}{self.tail}')


class Usage:
    """Prompt tokens count once per prompt (not per choice), as OpenAI counts them."""

    def __init__(self) -> None:
        self.prompts: dict[int, tuple[int, int]] = {}
        self.completion_tokens = 0

    def add(self, c: Completion) -> None:
        self.completion_tokens += len(c.token_ids)
        self.prompts[c.prompt_index] = (c.num_prompt_tokens, max(c.num_cached_tokens,
                                                                 self.prompts.get(c.prompt_index, (0, 0))[1]))

    def as_dict(self, reasoning_tokens: int | None = None) -> dict:
        """OpenAI's usage; `reasoning_tokens`, for a model that reasons, the completion tokens it reasoned in."""
        prompt = sum(p for p, _ in self.prompts.values())
        cached = sum(c for _, c in self.prompts.values())
        usage = {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens,
                 "total_tokens": prompt + self.completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}
        if reasoning_tokens is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
        return usage


def _empty_completion_logprobs() -> dict:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def _format_param(req: SamplingRequest) -> str | None:
    """The field that set a request's answer format."""
    return next((name for name in req.format_fields() if getattr(req, name) is not None), None)


def _param_named_in(message: str) -> str | None:
    """The engine's ValueErrors start with the field they are about, e.g. 'top_k=-3: must be ...'."""
    head = message.split("=", 1)[0].split(":", 1)[0]
    return head if head.isidentifier() else None


def _unicode(text: str, param: str) -> str:
    """`text`, if it is valid Unicode: JSON may carry a lone UTF-16 surrogate ("\\ud800"), which no tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"Invalid '{param}': it holds a lone UTF-16 surrogate ({text[e.start]!r} at character "
                       f"{e.start}); send valid Unicode (a surrogate only as half of a pair)", param=param) from None
    return text
