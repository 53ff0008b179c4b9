"""examples/embeddings.py served by `ember serve` returns real sentence vectors, from its method and from its
OpenAI-shaped /v1/embeddings (driven by the official openai client)."""
import math
from pathlib import Path

import httpx
import openai
import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "embeddings.py"


def _cos(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def test_paraphrases_are_closer_than_unrelated_sentences(serve):
    served = serve(EXAMPLE)
    sentences = [
        "A man is playing a guitar on stage.",
        "Someone performs music with a guitar in front of an audience.",
        "The quarterly tax report is due next Tuesday.",
    ]
    with served.client(served.key(), timeout=300) as http:
        reply = http.post("/embeddings/Embedder.embed", json={"sentences": sentences, "batch_size": 2})
        assert reply.status_code == 200, reply.text
        vectors = reply.json()["result"]
        bad = http.post("/embeddings/Embedder.embed", json={"sentences": []})
    http = httpx.Client(verify=served.tls(), timeout=120)
    client = openai.OpenAI(base_url=f"{served.url}/embeddings/v1", api_key=served.key(), http_client=http,
                           max_retries=0)
    with http, client:
        shaped = client.embeddings.create(model="all-MiniLM-L6-v2", input=sentences)
    assert [d.embedding for d in shaped.data] == [pytest.approx(v, abs=1e-5) for v in vectors]
    assert shaped.usage.prompt_tokens > len(sentences)
    assert len(vectors) == 3 and all(len(v) == 384 for v in vectors)
    assert all(abs(math.sqrt(sum(x * x for x in v)) - 1) < 1e-3 for v in vectors)
    paraphrase, unrelated = _cos(vectors[0], vectors[1]), _cos(vectors[0], vectors[2])
    assert paraphrase > unrelated + 0.3, (paraphrase, unrelated)
    assert bad.status_code == 500 and "non-empty list" in bad.json()["error"]["message"]
