"""The OpenAI-compatible HTTP API of one engine: /v1/models, /v1/completions, /v1/chat/completions.

Read top to bottom: errors, then `create_app` (the routes), then the two handlers that
turn a request into prompt tokens, sampling params and a stream of `Completion`s, and
the response builders that shape those as OpenAI JSON or server-sent events.
"""

import asyncio
import contextlib
import json
import time
import uuid
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from ember.runtime.engine import metrics
from ember.runtime.engine.async_engine import AsyncLLM, Completion, EngineDeadError
from ember.runtime.engine.config import EngineConfig
from ember.runtime.engine.detokenizer import token_text
from ember.runtime.engine.serving.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest

# JSON has no -inf; OpenAI clients expect a number, vLLM sends this floor too.
MIN_LOGPROB = -9999.0


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type


def error_response(status: int, message: str, type: str = "invalid_request_error", param=None, code=None):
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def create_app(engine_or_config, served_model_name: str | None = None) -> FastAPI:
    """An OpenAI-compatible app over an `AsyncLLM`, an `LLMEngine` or an `EngineConfig`."""
    llm = _async_llm(engine_or_config)
    server = OpenAIServer(llm, served_model_name or llm.engine.model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.to_thread(llm.shutdown)

    app = FastAPI(title="Ember OpenAI-compatible API", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.llm = llm

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return error_response(e.status, e.message, e.type, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, e: RequestValidationError):
        first = e.errors()[0]
        if first.get("type") == "json_invalid":
            return error_response(400, f"The request body is not valid JSON: {first.get('ctx', {}).get('error', '')}",
                                  code="invalid_json")
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = ".".join(loc) or None
        message = f"Invalid '{param}': {first['msg']}" if param else f"Invalid request body: {first['msg']}"
        return error_response(400, message, param=param, code="invalid_value")

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(e.status_code, f"{request.method} {request.url.path}: {e.detail}", kind)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, e: EngineDeadError):
        return error_response(503, f"{e}; restart the replica", "server_error")

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        return error_response(500, f"internal error: {type(e).__name__}: {e}", "server_error")

    @app.get("/health")
    async def health():
        if not llm.alive:
            raise EngineDeadError(f"the engine loop has stopped: {llm.error!r}")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(llm.engine.stats, server.model_name),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [server.model_card()]}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str):
        server.check_model(model)
        return server.model_card()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _unless_disconnected(request, server.completions(body))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _unless_disconnected(request, server.chat(body))

    return app


def _async_llm(engine_or_config) -> AsyncLLM:
    if isinstance(engine_or_config, AsyncLLM):
        return engine_or_config
    if isinstance(engine_or_config, EngineConfig):
        return AsyncLLM.from_config(engine_or_config)
    from transformers import AutoTokenizer

    return AsyncLLM(engine_or_config, AutoTokenizer.from_pretrained(engine_or_config.config.model))


async def _unless_disconnected(request: Request, work):
    """Run a handler, cancelling it (and so aborting its engine requests) if the client hangs up first.

    Streaming responses get the same from Starlette once they start; this covers the wait
    for the first token and whole non-streaming generations.
    """
    async def hung_up():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(hung_up())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    # 499: nginx's "client closed request"; nobody is left to read it.
    return error_response(499, "the client disconnected", "client_closed_request")


class OpenAIServer:
    def __init__(self, llm: AsyncLLM, model_name: str):
        self.llm, self.model_name, self.tokenizer = llm, model_name, llm.tokenizer
        self.created = int(time.time())

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
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                                        tokenize=False)
        except Exception as e:  # a template's own raise_exception() is how it rejects a conversation
            raise APIError(400, f"The chat template rejected the messages: {e}", param="messages") from e
        prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        [stream] = await self._start(req, [prompt_ids], "messages")
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        if req.stream:
            return _event_stream(self._chat_events(req, response_id, stream))
        choices, usage = {}, _Usage()
        async for c in stream:
            usage.add(c)
            choice = choices.setdefault(c.index, {"index": c.index, "message": {"role": "assistant", "content": ""},
                                                  "logprobs": {"content": []} if req.logprobs else None,
                                                  "finish_reason": None})
            choice["message"]["content"] += c.text
            if req.logprobs and c.logprobs:
                choice["logprobs"]["content"] += self._chat_logprobs(c.logprobs)
            if c.finish_reason:
                choice["finish_reason"] = c.finish_reason
                choice["stop_reason"] = c.stop_reason
        return {"id": response_id, "object": "chat.completion", "created": int(time.time()), "model": self.model_name,
                "choices": [choices[i] for i in sorted(choices)], "usage": usage.as_dict(),
                "system_fingerprint": None}

    async def completions(self, req: CompletionRequest):
        self.check_model(req.model)
        prompts = req.prompts()
        if not prompts or any(len(p) == 0 for p in prompts):
            raise APIError(400, "Invalid 'prompt': it must not be empty.", param="prompt")
        prompt_ids = [self.tokenizer.encode(p, add_special_tokens=False) if isinstance(p, str) else p
                      for p in prompts]
        streams = await self._start(req, prompt_ids, "prompt")
        n = req.n or 1
        # Prompt i's choices are numbered i*n .. i*n+n-1, as OpenAI numbers batched prompts.
        merged = _merge([_renumber(s, i * n) for i, s in enumerate(streams)])
        echoes = {i * n + j: self.tokenizer.decode(ids) if req.echo else "" for i, ids in enumerate(prompt_ids)
                  for j in range(n)}
        response_id = f"cmpl-{uuid.uuid4().hex}"
        if req.stream:
            return _event_stream(self._completion_events(req, response_id, merged, echoes))
        choices, usage = {}, _Usage()
        async for c in merged:
            usage.add(c)
            choice = choices.setdefault(c.index, {"index": c.index, "text": echoes[c.index], "finish_reason": None,
                                                  "logprobs": _empty_completion_logprobs()
                                                  if req.logprobs is not None else None})
            if choice["logprobs"] is not None and c.logprobs:
                self._completion_logprobs(choice["logprobs"], c.logprobs, len(choice["text"]))
            choice["text"] += c.text
            if c.finish_reason:
                choice["finish_reason"] = c.finish_reason
                choice["stop_reason"] = c.stop_reason
        return {"id": response_id, "object": "text_completion", "created": int(time.time()), "model": self.model_name,
                "choices": [choices[i] for i in sorted(choices)], "usage": usage.as_dict(),
                "system_fingerprint": None}

    async def _start(self, req: SamplingRequest, prompts: list[list[int]], prompt_param: str):
        """Submit every prompt and wait for its first output, so a refused request is a 400, not a broken stream."""
        limit = self.llm.engine.max_model_len
        streams = []
        for ids in prompts:
            max_tokens = req.requested_max_tokens()
            if len(ids) + (max_tokens or 1) > limit:
                raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                               f"{len(ids) + (max_tokens or 0)} tokens ({len(ids)} in the {prompt_param}, "
                               f"{max_tokens or 0} in the completion). Please reduce the length of the "
                               f"{prompt_param} or completion.", param=prompt_param, code="context_length_exceeded")
            params = req.sampling_params(max_tokens or limit - len(ids))
            streams.append(self.llm.generate(ids, params, n=req.n or 1, stop=req.stop_strings,
                                             include_stop_str_in_output=req.include_stop_str_in_output,
                                             skip_special_tokens=req.skip_special_tokens))
        tasks = [asyncio.ensure_future(anext(s)) for s in streams]
        try:
            firsts = await asyncio.gather(*tasks)
        except BaseException as e:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for s in streams:
                await s.aclose()
            if isinstance(e, ValueError):
                raise APIError(400, str(e), param=_param_named_in(str(e))) from e
            raise
        return [_prepend(first, s) for first, s in zip(firsts, streams)]

    async def _chat_events(self, req, response_id, stream) -> AsyncIterator[dict]:
        created, usage, started = int(time.time()), _Usage(), set()

        def chunk(index, delta, finish_reason=None, logprobs=None, **extra):
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason, **extra}
            body = {"id": response_id, "object": "chat.completion.chunk", "created": created,
                    "model": self.model_name, "choices": [choice], "system_fingerprint": None}
            if req.include_usage:
                body["usage"] = None
            return body

        async for c in stream:
            usage.add(c)
            if c.index not in started:
                started.add(c.index)
                yield chunk(c.index, {"role": "assistant", "content": ""})
            logprobs = {"content": self._chat_logprobs(c.logprobs)} if req.logprobs and c.logprobs else None
            if c.text or c.finish_reason or logprobs:
                extra = {"stop_reason": c.stop_reason} if c.finish_reason else {}
                yield chunk(c.index, {"content": c.text} if c.text else {}, c.finish_reason, logprobs, **extra)
        if req.include_usage:
            yield {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                   "choices": [], "usage": usage.as_dict(), "system_fingerprint": None}

    async def _completion_events(self, req, response_id, stream, echoes) -> AsyncIterator[dict]:
        created, usage, offsets = int(time.time()), _Usage(), {}
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
            if not (text or c.finish_reason or logprobs):
                continue
            choice = {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason}
            if c.finish_reason:
                choice["stop_reason"] = c.stop_reason
            body = {"id": response_id, "object": "text_completion", "created": created, "model": self.model_name,
                    "choices": [choice], "system_fingerprint": None}
            if req.include_usage:
                body["usage"] = None
            yield body
        if req.include_usage:
            yield {"id": response_id, "object": "text_completion", "created": created, "model": self.model_name,
                   "choices": [], "usage": usage.as_dict(), "system_fingerprint": None}

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


class _Usage:
    """Prompt tokens count once per prompt (not per choice), as OpenAI counts them."""

    def __init__(self):
        self.prompts: dict[int, tuple[int, int]] = {}
        self.completion_tokens = 0

    def add(self, c: Completion) -> None:
        self.completion_tokens += len(c.token_ids)
        self.prompts[c.prompt_index] = (c.num_prompt_tokens, max(c.num_cached_tokens,
                                                                 self.prompts.get(c.prompt_index, (0, 0))[1]))

    def as_dict(self) -> dict:
        prompt = sum(p for p, _ in self.prompts.values())
        cached = sum(c for _, c in self.prompts.values())
        return {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens,
                "total_tokens": prompt + self.completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}


def _empty_completion_logprobs() -> dict:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def _param_named_in(message: str) -> str | None:
    """The engine's ValueErrors start with the field they are about, e.g. 'top_k=-3: must be ...'."""
    head = message.split("=", 1)[0].split(":", 1)[0]
    return head if head.isidentifier() else None


async def _prepend(first: Completion, rest: AsyncIterator[Completion]) -> AsyncIterator[Completion]:
    try:
        yield first
        async for c in rest:
            yield c
    finally:
        await rest.aclose()


async def _renumber(stream: AsyncIterator[Completion], offset: int) -> AsyncIterator[Completion]:
    try:
        async for c in stream:
            c.prompt_index = offset
            c.index += offset
            yield c
    finally:
        await stream.aclose()


async def _merge(streams: list[AsyncIterator[Completion]]) -> AsyncIterator[Completion]:
    """Interleave several streams in arrival order; closing the merge closes them all."""
    if len(streams) == 1:
        async for c in streams[0]:
            yield c
        return
    outputs: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream):
        try:
            async for c in stream:
                await outputs.put(c)
            await outputs.put(done)
        except Exception as e:  # noqa: BLE001 - handed to the reader, which re-raises it
            await outputs.put(e)

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await outputs.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _event_stream(events: AsyncIterator[dict]) -> StreamingResponse:
    async def sse():
        try:
            async for event in events:
                yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
        except EngineDeadError as e:
            error = {"error": {"message": f"{e}; restart the replica", "type": "server_error", "param": None,
                               "code": None}}
            yield f"data: {json.dumps(error)}\n\n"
        finally:
            await events.aclose()
        yield "data: [DONE]\n\n"

    return StreamingResponse(sse(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
