"""OpenAI's embeddings API over a sentence-embedding model directory (BERT-like, e.g. all-MiniLM-L6-v2).

    POST /v1/embeddings  {"input": "text" | ["text", ...], "model": NAME, "encoding_format": "float" | "base64"}
    GET  /v1/models

Vectors are unit length (cosine similarity is their dot product); base64 is their float32 little-endian bytes, which
the official openai client asks for by default and decodes. A directory in the sentence-transformers layout
(modules.json) keeps its own pooling; a plain Hugging Face encoder directory gets mean pooling.
"""
import asyncio
import base64
import logging
import time
from typing import Literal

import numpy as np
from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, field_validator

from ember.runtime.engine.serving.errors import APIError, internal_errors, openai_errors

log = logging.getLogger("ember.embeddings")

MAX_INPUTS = 2048  # texts in one request, as OpenAI allows


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input: str | list[str]
    model: str
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _texts(cls, value: str | list[str]) -> str | list[str]:
        texts = [value] if isinstance(value, str) else value
        if not texts:
            raise ValueError("give at least one text")
        if len(texts) > MAX_INPUTS:
            raise ValueError(f"at most {MAX_INPUTS} texts per request, got {len(texts)}; split them over requests")
        if any(not text for text in texts):
            raise ValueError("texts must not be empty strings")
        for i, text in enumerate(texts):   # JSON may carry a lone UTF-16 surrogate ("\ud800"): no tokenizer takes it
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"input[{i}] holds a lone UTF-16 surrogate ({text[e.start]!r} at character "
                                 f"{e.start}); send valid Unicode (a surrogate only as half of a pair)") from None
        return value


class SentenceEmbedder:
    """A sentence-transformers model on CPU (or the device given): texts -> unit vectors and their token counts."""

    def __init__(self, model_dir: str, device: str = "cpu"):
        from sentence_transformers import SentenceTransformer

        self.model = SentenceTransformer(str(model_dir), device=device)
        size = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        self.dimensions = size()  # the method's name changed in sentence-transformers 5
        self.max_tokens: int = self.model.max_seq_length or self.model.tokenizer.model_max_length

    def to_gpu_if_any(self) -> None:
        """Move the weights to this process's GPU when it has one (CUDA_VISIBLE_DEVICES names it)."""
        import torch

        if torch.cuda.is_available():
            self.model.to("cuda")

    def token_counts(self, texts: list[str]) -> list[int]:
        return [len(ids) for ids in self.model.tokenizer(texts, add_special_tokens=True)["input_ids"]]

    def embed(self, texts: list[str], batch_size: int = 32) -> np.ndarray:
        return self.model.encode(texts, batch_size=batch_size, normalize_embeddings=True, convert_to_numpy=True)


def create_app(embedder: SentenceEmbedder, model_name: str) -> FastAPI:
    app = FastAPI(title="Ember embeddings API", docs_url=None, redoc_url=None)
    created = int(time.time())
    one_at_a_time = asyncio.Lock()  # the model's forward uses every core already: requests take turns

    app.state.embedder = embedder
    openai_errors(app)
    internal_errors(app, log)

    def card() -> dict:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "ember",
                "dimensions": embedder.dimensions, "max_model_len": embedder.max_tokens}

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [card()]}

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest) -> dict:
        if body.model != model_name:
            raise APIError(404, f"The model `{body.model}` does not exist. This server serves `{model_name}`.",
                           param="model", code="model_not_found", type="not_found_error")
        if body.dimensions is not None and body.dimensions != embedder.dimensions:
            raise APIError(400, f"Invalid 'dimensions': {model_name} makes {embedder.dimensions}-dimensional vectors "
                                "only; leave dimensions out", param="dimensions")
        texts = [body.input] if isinstance(body.input, str) else body.input
        counts = await asyncio.to_thread(embedder.token_counts, texts)   # megabytes of text: not on the loop
        too_long = [(i, n) for i, n in enumerate(counts) if n > embedder.max_tokens]
        if too_long:
            i, n = too_long[0]
            raise APIError(400, f"input[{i}] is {n} tokens; {model_name} embeds at most {embedder.max_tokens}: "
                                "shorten or split it", param="input", code="context_length_exceeded")
        async with one_at_a_time:
            vectors = await asyncio.to_thread(embedder.embed, texts)
        data = [{"object": "embedding", "index": i, "embedding": _encode(v, body.encoding_format)}
                for i, v in enumerate(vectors)]
        tokens = sum(counts)
        return {"object": "list", "data": data, "model": model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    return app


def _encode(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.tolist()
