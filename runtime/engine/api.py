"""The OpenAI-compatible HTTP API of one engine: the routes and how errors become OpenAI JSON.

`create_app` is the whole request path: the handlers' work is in `serving/server.py`,
the request bodies in `serving/protocol.py`.
"""

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from typing import TypeVar

# FastAPI imports pydantic.v1 (its compatibility layer) when it builds the first route that takes a body: 0.17 s
# of a restored replica's start on the H200, inside create_app. Imported here, it is paid where this module is
# imported: in the fork server, before any replica forks.
import pydantic.v1  # noqa: F401
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from ember.runtime import tracing
from ember.runtime.disconnect import WorkCancelled, unless_disconnected
from ember.runtime.engine import grammar, metrics
from ember.runtime.engine.async_engine import AsyncLLM, EngineDeadError, FormatCostError, RequestFailedError
from ember.runtime.engine.config import EngineConfig
from ember.runtime.engine.serving.errors import error_response, internal_errors, openai_errors
from ember.runtime.engine.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponsesRequest,
)
from ember.runtime.engine.serving.responses import ResponsesAPI
from ember.runtime.engine.serving.server import OpenAIServer
from ember.runtime.worker import CALLER_HEADER

T = TypeVar("T")
logger = logging.getLogger(__name__)


def create_app(engine_or_config, served_model_name: str | None = None, warm_formats: bool | None = None) -> FastAPI:
    """An OpenAI-compatible app over an `AsyncLLM`, an `LLMEngine` or an `EngineConfig`; `warm_formats` as in
    OpenAIServer."""
    llm = _async_llm(engine_or_config)
    server = OpenAIServer(llm, served_model_name or llm.engine.model_name, warm_formats)
    responses_api = ResponsesAPI(server)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        server.grammars.close()   # the compile workers
        await asyncio.to_thread(llm.shutdown)

    app = FastAPI(title="Ember OpenAI-compatible API", docs_url=None, redoc_url=None, lifespan=lifespan,
                  **tracing.fastapi_options())
    app.state.llm, app.state.openai = llm, server

    openai_errors(app)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, e: EngineDeadError):
        return error_response(503, f"{e}; restart the replica", "server_error")

    @app.exception_handler(RequestFailedError)
    async def request_failed(request: Request, e: RequestFailedError):
        if isinstance(e, FormatCostError):
            return error_response(400, str(e), code="format_too_costly")
        return error_response(500, f"{e}; the engine goes on serving, retry the request", "server_error")

    internal_errors(app, logger)  # JSON 500s, and the connection stays open for the gateway

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

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        return await _unless_disconnected(request, responses_api.create(body))

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str):
        responses_api.retrieve(response_id)

    @app.post("/tokenize")
    async def tokenize(body: dict):
        return await server.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return server.detokenize(body)

    return app


def _async_llm(engine_or_config) -> AsyncLLM:
    if isinstance(engine_or_config, AsyncLLM):
        return engine_or_config
    if isinstance(engine_or_config, EngineConfig):
        return AsyncLLM.from_config(engine_or_config)
    from transformers import AutoTokenizer

    return AsyncLLM(engine_or_config, AutoTokenizer.from_pretrained(engine_or_config.config.model))


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T | JSONResponse:
    """Run a handler, cancelling it (and so aborting its engine requests) if the client hangs up first.

    Streaming responses get the same from Starlette once they start; this covers the wait
    for the first token and whole non-streaming generations. The caller the gateway named (CALLER_HEADER)
    takes its turn for the format compilers.
    """
    grammar.CALLER.set(request.headers.get(CALLER_HEADER))
    try:
        return await unless_disconnected(request, work)
    except WorkCancelled:  # 499: nginx's "client closed request"; nobody is left to read it
        return error_response(499, "the client disconnected", "client_closed_request")
