"""examples/chat.py's engine with snapshot=True and a 1 s scale-down window, so a test sees two cold starts."""
import ember

app = ember.App("chatsnap")


@app.cls(snapshot=True, scaledown_window=1, max_concurrency=8,
         env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
class Chat:
    @ember.enter(snap=True)
    def load(self):
        from ember.home import Home
        from ember.runtime.engine.config import EngineConfig
        from ember.runtime.engine.engine import LLMEngine
        from ember.runtime.engine.tiny import build_tiny_model

        # No snapshot argument: the worker's EMBER_SNAPSHOT_STORE reaches the engine, as in examples/chat.py.
        model = build_tiny_model(Home().root / "models" / "tiny-qwen3")
        self.engine = LLMEngine(EngineConfig(model=str(model), max_num_seqs=4, num_kv_blocks=64))

    @ember.enter(snap=False)
    def serve(self):
        from ember.runtime.engine.api import create_app

        self.api = create_app(self.engine)

    @ember.asgi_app()
    def web(self):
        return self.api
