"""examples/embeddings.py served by `ember serve` returns real sentence vectors."""
import math
from pathlib import Path

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
    assert len(vectors) == 3 and all(len(v) == 384 for v in vectors)
    assert all(abs(math.sqrt(sum(x * x for x in v)) - 1) < 1e-3 for v in vectors)
    paraphrase, unrelated = _cos(vectors[0], vectors[1]), _cos(vectors[0], vectors[2])
    assert paraphrase > unrelated + 0.3, (paraphrase, unrelated)
    assert bad.status_code == 500 and "non-empty list" in bad.json()["error"]["message"]
