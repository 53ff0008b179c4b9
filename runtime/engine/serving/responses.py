"""OpenAI's Responses API (/v1/responses) over the chat path: the input items become a chat request, rendered by the
model's chat template as the chat API renders it, and the reply comes back as a response object or as its stream of
typed events. No response is stored: a conversation is sent whole each time, as with the chat API."""

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from ember.runtime.engine.serving.errors import APIError
from ember.runtime.engine.serving.protocol import ChatCompletionRequest, ResponsesRequest, SamplingRequest
from ember.runtime.engine.serving.reasoning import ReplyParser, ReplyShape, joined
from ember.runtime.engine.serving.server import OpenAIServer, Usage, json_text
from ember.runtime.engine.serving.streams import typed_event_stream

# The sampling fields a response request shares with the chat API, passed on as they are (vLLM's extras too).
SHARED = tuple(name for name in SamplingRequest.model_fields if name not in ("n", "max_tokens", "stream",
                                                                             "stream_options"))


class ResponsesAPI:
    def __init__(self, server: OpenAIServer):
        self.server = server

    async def create(self, req: ResponsesRequest):
        self.server.check_model(req.model)
        chat = chat_request(req)
        try:
            prompt_ids, reply_shape = await self.server.chat_prompt(chat)
        except APIError as e:   # named as this API's fields: the instructions are the first message, if any
            if not (e.param or "").startswith("messages"):
                raise
            field = "instructions" if req.instructions is not None and e.param == "messages.0.content" else "input"
            raise APIError(e.status, e.message.replace(f"'{e.param}'", f"'{field}'"), field, e.code, e.type) from None
        held_to = await self.server.chat_grammar(chat, reply_shape, "text")
        [stream] = await self.server.submit(chat, [prompt_ids], "input", held_to)
        shape = ResponseShape(req, self.server.model_name)
        if req.stream:
            events = ResponseEvents(shape)
            return typed_event_stream(events.stream(stream, reply_shape), events.next_number)
        return await reply(shape, stream, reply_shape)

    def retrieve(self, response_id: str) -> None:
        raise APIError(404, f"No response with id '{response_id[:100]}': this server stores no response. Send the "
                       "whole conversation as input instead of previous_response_id.", param="response_id",
                       code="response_not_found", type="not_found_error")


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    body = {name: getattr(req, name) for name in SHARED}
    body.update(messages=req.chat_messages(), max_tokens=req.requested_max_tokens(),
                tools=[tool.as_chat_tool() for tool in req.tools] if req.tools else None,
                tool_choice=req.chat_tool_choice(), parallel_tool_calls=req.parallel_tool_calls,
                response_format=req.chat_response_format())
    extra = req.model_extra or {}
    if "chat_template_kwargs" in extra:   # vLLM's template variables (Qwen3's enable_thinking)
        body["chat_template_kwargs"] = extra["chat_template_kwargs"]
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:   # answered as a body's own errors are: a 400 naming the field
        raise RequestValidationError(e.errors(include_url=False)) from None


class ResponseShape:
    """What every form of one response repeats: its id, its model and the request's settings, echoed."""

    def __init__(self, req: ResponsesRequest, model: str):
        self.id, self.created, self.model = f"resp_{uuid.uuid4().hex}", int(time.time()), model
        self.echo = {
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {}, "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": None, "reasoning": {"effort": None, "summary": None}, "store": False,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "text": {"format": req.text.format.echo() if req.text is not None and req.text.format is not None
                     else {"type": "text"}},
            "tool_choice": req.tool_choice or "auto",
            "tools": [tool.model_dump(exclude_none=True) for tool in req.tools or []], "truncation": "disabled",
            "user": req.user, "background": False}

    def response(self, status: str, output: list[dict], usage: Usage | None = None, incomplete: dict | None = None,
                 reasoning_tokens: int = 0) -> dict:
        # usage last, after the echoed tools: a long reply's usage is read from its end by the gateway's meter
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
                "incomplete_details": incomplete, "model": self.model, "output": output, **self.echo,
                "usage": response_usage(usage, reasoning_tokens) if usage else None}


async def reply(shape: ResponseShape, stream, reply_shape: ReplyShape) -> dict:
    parser, parts, usage, finish = ReplyParser(reply_shape), [], Usage(), None
    async with aclosing(stream):
        async for c in stream:
            usage.add(c)
            parts += parser.read(c)
            finish = c.finish_reason or finish
    reasoning, content, calls = joined(parts)
    status, incomplete = ending(finish)
    ended = "incomplete" if incomplete else "completed"
    thought = ended if parser.still_thinking else "completed"   # cut short while it reasoned, or done with it
    output = [reasoning_item(new_id("rs"), reasoning, thought)] if reasoning else []
    if calls:
        content = content.strip()
    if content or not calls:
        output.append(message_item(new_id("msg"), content, ended))
    output += [call_item(new_id("fc"), call, "completed") for call in calls]
    return shape.response(status, output, usage, incomplete, parser.reasoning_tokens)


class ResponseEvents:
    """One streamed response's events, numbered in order: a reasoning item opens at the reply's first reasoning, a
    message item at its first answer text; each closes before the next item or at the end."""

    def __init__(self, shape: ResponseShape):
        self.shape = shape
        self.sequence = 0
        self.output: list[dict] = []   # the items so far, each completed as it closes
        self.open: tuple[dict, int, list[str]] | None = None   # the item being written: item, index, text

    def next_number(self) -> int:
        self.sequence += 1
        return self.sequence - 1

    def event(self, kind: str, **fields) -> tuple[str, str]:
        return kind, json_text({"type": kind, "sequence_number": self.next_number(), **fields})

    async def stream(self, stream, reply_shape: ReplyShape) -> AsyncIterator[tuple[str, str]]:
        yield self.event("response.created", response=self.shape.response("in_progress", []))
        yield self.event("response.in_progress", response=self.shape.response("in_progress", []))
        parser, usage, finish = ReplyParser(reply_shape), Usage(), None
        async with aclosing(stream):
            async for c in stream:
                usage.add(c)
                finish = c.finish_reason or finish
                for part in parser.read(c):
                    if "tool_call" in part:
                        events = self.call(part["tool_call"])
                    elif "reasoning" in part:
                        events = self.text("reasoning", part["reasoning"])
                    else:
                        events = self.text("message", part["content"])
                    for event in events:
                        yield event
        status, incomplete = ending(finish)
        if not any(item["type"] == "message" for item in self.output) and not parser.made_calls:
            for event in self.close() + self.open_item("message"):   # an answer of nothing is still a message
                yield event
        for event in self.close("incomplete" if incomplete else "completed"):
            yield event
        kind = "response.incomplete" if incomplete else "response.completed"
        yield self.event(kind, response=self.shape.response(status, self.output, usage, incomplete,
                                                            parser.reasoning_tokens))

    def open_item(self, kind: str) -> list[tuple[str, str]]:
        """A message (its output_text part added) or a reasoning item, in progress."""
        index = len(self.output)
        if kind == "message":
            item = message_item(new_id("msg"), None, "in_progress")
        else:
            item = reasoning_item(new_id("rs"), None, "in_progress")
        self.output.append(item)
        self.open = (item, index, [])
        events = [self.event("response.output_item.added", output_index=index, item=item)]
        if kind == "message":
            events.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                     content_index=0, part=output_text("")))
        return events

    def text(self, kind: str, delta: str) -> list[tuple[str, str]]:
        """A delta of the message's text or of the reasoning's: opens its item (closing the other) if need be."""
        events = []
        if self.open is None or self.open[0]["type"] != kind:
            events = self.close() + self.open_item(kind)
        assert self.open is not None   # opened above
        item, index, pieces = self.open
        pieces.append(delta)
        if kind == "message":
            events.append(self.event("response.output_text.delta", item_id=item["id"], output_index=index,
                                     content_index=0, delta=delta, logprobs=[]))
        else:
            events.append(self.event("response.reasoning_text.delta", item_id=item["id"], output_index=index,
                                     content_index=0, delta=delta))
        return events

    def close(self, status: str = "completed") -> list[tuple[str, str]]:
        """The open item's last events, its text whole."""
        if self.open is None:
            return []
        item, index, pieces = self.open
        self.open = None
        text = "".join(pieces)
        if item["type"] == "reasoning":
            item.update(content=[reasoning_text(text)], status=status)
            return [self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                               content_index=0, text=text),
                    self.event("response.output_item.done", output_index=index, item=item)]
        item.update(content=[output_text(text)], status=status)
        return [self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                           text=text, logprobs=[]),
                self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                           part=output_text(text)),
                self.event("response.output_item.done", output_index=index, item=item)]

    def call(self, call: dict) -> list[tuple[str, str]]:
        """A whole function call (the model's call closes before it is sent): its item, arguments in one delta."""
        events = self.close()
        item = call_item(new_id("fc"), call, "in_progress")
        index = len(self.output)
        arguments, item["arguments"] = item["arguments"], ""
        events.append(self.event("response.output_item.added", output_index=index, item=item))
        item.update(arguments=arguments, status="completed")
        self.output.append(item)
        events += [self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                              delta=arguments),
                   self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                              name=item["name"], arguments=arguments),
                   self.event("response.output_item.done", output_index=index, item=item)]
        return events


def ending(finish_reason: str | None) -> tuple[str, dict | None]:
    """The response's status and incomplete_details for how the engine ended it."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> dict:
    """An assistant message; `text` None while it is being written (its content part is added by an event)."""
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [] if text is None else [output_text(text)]}


def reasoning_text(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def reasoning_item(item_id: str, text: str | None, status: str) -> dict:
    """The model's reasoning, as written (no summary is made); `text` None while it is being written."""
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": [] if text is None else [reasoning_text(text)]}


def call_item(item_id: str, call: dict, status: str) -> dict:
    """A function call item of a chat-format call ({"id", "function": {"name", "arguments"}})."""
    return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}


def response_usage(usage: Usage, reasoning_tokens: int = 0) -> dict:
    counts = usage.as_dict()
    return {"input_tokens": counts["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": counts["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": counts["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens}, "total_tokens": counts["total_tokens"]}
