"""The chat example's engine behind several warm replicas, for bench/affinity_llm.py (EMBER_BENCH_REPLICAS, default 3).

A bench-specific app because examples/chat.py scales from zero: here every replica is up before the workload
starts, so the routing mode is the only difference between runs."""
import os

import ember

REPLICAS = int(os.environ.get("EMBER_BENCH_REPLICAS", "3"))
app = ember.App("chat")


@app.cls(min_replicas=REPLICAS, max_replicas=REPLICAS, max_concurrency=64, target_concurrency=64, scaledown_window=600,
         timeout=600, env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
class Chat:
    @ember.enter()
    def load(self):
        from ember.home import Home
        from ember.runtime.engine.api import create_app
        from ember.runtime.engine.config import EngineConfig
        from ember.runtime.engine.engine import LLMEngine
        from ember.runtime.engine.tiny import build_tiny_model

        model = os.environ.get("EMBER_CHAT_MODEL") or build_tiny_model(Home().root / "models" / "tiny-qwen3")
        self.api = create_app(LLMEngine(EngineConfig(model=str(model))))

    @ember.asgi_app()
    def web(self):
        return self.api
