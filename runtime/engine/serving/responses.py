"""OpenAI's Responses API (/v1/responses) over the chat path: the input items become a chat request, rendered by the
model's chat template as the chat API renders it, and the reply comes back as a response object or as its stream of
typed events. No response is stored: a conversation is sent whole each time, as with the chat API."""

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from ember.runtime.engine.serving import tools
from ember.runtime.engine.serving.errors import APIError
from ember.runtime.engine.serving.protocol import ChatCompletionRequest, ResponsesRequest, SamplingRequest
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
        prompt_ids = await self.server.chat_prompt(chat)
        [stream] = await self.server.submit(chat, [prompt_ids], "input")
        shape = ResponseShape(req, self.server.model_name)
        if req.stream:
            events = ResponseEvents(shape)
            return typed_event_stream(events.stream(stream, chat), events.next_number)
        return await reply(shape, stream, chat)

    def retrieve(self, response_id: str) -> None:
        raise APIError(404, f"No response with id '{response_id[:100]}': this server stores no response. Send the "
                       "whole conversation as input instead of previous_response_id.", param="response_id",
                       code="response_not_found", type="not_found_error")


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    body = {name: getattr(req, name) for name in SHARED}
    body.update(messages=req.chat_messages(), max_tokens=req.requested_max_tokens(),
                tools=[tool.as_chat_tool() for tool in req.tools] if req.tools else None, tool_choice=req.tool_choice,
                parallel_tool_calls=req.parallel_tool_calls)
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
            "top_p": 1.0 if req.top_p is None else req.top_p, "text": {"format": {"type": "text"}},
            "tool_choice": req.tool_choice or "auto",
            "tools": [tool.model_dump(exclude_none=True) for tool in req.tools or []], "truncation": "disabled",
            "user": req.user, "background": False}

    def response(self, status: str, output: list[dict], usage: Usage | None = None,
                 incomplete: dict | None = None) -> dict:
        # usage last, after the echoed tools: a long reply's usage is read from its end by the gateway's meter
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
                "incomplete_details": incomplete, "model": self.model, "output": output, **self.echo,
                "usage": response_usage(usage) if usage else None}


async def reply(shape: ResponseShape, stream, chat: ChatCompletionRequest) -> dict:
    pieces, usage, finish = [], Usage(), None
    async with aclosing(stream):
        async for c in stream:
            usage.add(c)
            pieces.append(c.text)
            finish = c.finish_reason or finish
    text = "".join(pieces)
    content, calls = tools.parse(text, chat.parallel_tool_calls) if chat.uses_tools else (text, [])
    status, incomplete = ending(finish)
    output = []
    if content or not calls:
        output.append(message_item(new_id("msg"), content or "", "incomplete" if incomplete else "completed"))
    output += [call_item(new_id("fc"), call, "completed") for call in calls]
    return shape.response(status, output, usage, incomplete)


class ResponseEvents:
    """One streamed response's events, numbered in order: a message item opens at the reply's first text and
    closes before a function call's item or at the end."""

    def __init__(self, shape: ResponseShape):
        self.shape = shape
        self.sequence = 0
        self.output: list[dict] = []   # the items so far, each completed as it closes
        self.open: tuple[dict, int, list[str]] | None = None   # the message being written: item, index, text

    def next_number(self) -> int:
        self.sequence += 1
        return self.sequence - 1

    def event(self, kind: str, **fields) -> tuple[str, str]:
        return kind, json_text({"type": kind, "sequence_number": self.next_number(), **fields})

    async def stream(self, stream, chat: ChatCompletionRequest) -> AsyncIterator[tuple[str, str]]:
        yield self.event("response.created", response=self.shape.response("in_progress", []))
        yield self.event("response.in_progress", response=self.shape.response("in_progress", []))
        usage, finish = Usage(), None
        calling = tools.ToolCallStream(chat.parallel_tool_calls) if chat.uses_tools else None
        async with aclosing(stream):
            async for c in stream:
                usage.add(c)
                finish = c.finish_reason or finish
                if calling is None:
                    parts = [{"content": c.text}]
                else:
                    parts = calling.feed(c.text) + (calling.finish() if c.finish_reason else [])
                for part in parts:
                    events = self.call(part["tool_call"]) if "tool_call" in part else self.text(part["content"])
                    for event in events:
                        yield event
        status, incomplete = ending(finish)
        if not self.output and self.open is None:   # an empty reply is still one message
            for event in self.open_message():
                yield event
        for event in self.close_message("incomplete" if incomplete else "completed"):
            yield event
        kind = "response.incomplete" if incomplete else "response.completed"
        yield self.event(kind, response=self.shape.response(status, self.output, usage, incomplete))

    def open_message(self) -> list[tuple[str, str]]:
        item = message_item(new_id("msg"), None, "in_progress")
        index = len(self.output)
        self.output.append(item)
        self.open = (item, index, [])
        return [self.event("response.output_item.added", output_index=index, item=item),
                self.event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                           part=output_text(""))]

    def text(self, delta: str) -> list[tuple[str, str]]:
        if not delta:
            return []
        events = self.open_message() if self.open is None else []
        assert self.open is not None   # opened above
        item, index, pieces = self.open
        pieces.append(delta)
        events.append(self.event("response.output_text.delta", item_id=item["id"], output_index=index,
                                 content_index=0, delta=delta, logprobs=[]))
        return events

    def close_message(self, status: str) -> list[tuple[str, str]]:
        if self.open is None:
            return []
        item, index, pieces = self.open
        self.open = None
        text = "".join(pieces)
        item.update(content=[output_text(text)], status=status)
        return [self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                           text=text, logprobs=[]),
                self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                           part=output_text(text)),
                self.event("response.output_item.done", output_index=index, item=item)]

    def call(self, call: dict) -> list[tuple[str, str]]:
        """A whole function call (the model's call closes before it is sent): its item, arguments in one delta."""
        events = self.close_message("completed")
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


def call_item(item_id: str, call: dict, status: str) -> dict:
    """A function call item of a chat-format call ({"id", "function": {"name", "arguments"}})."""
    return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}


def response_usage(usage: Usage) -> dict:
    counts = usage.as_dict()
    return {"input_tokens": counts["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": counts["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": counts["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": counts["total_tokens"]}
