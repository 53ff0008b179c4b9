"""One warm replica of the engine on the model at EMBER_BENCH_MODEL, for bench/engine/speed.py's online load.

It asks for a GPU: a function that names none runs with CUDA_VISIBLE_DEVICES empty, so its engine ran on the CPU
(the first online runs on the H200: 3 tokens a second)."""
import json
import os
from pathlib import Path

import ember

app = ember.App("speed")


@app.cls(gpu="H200", min_replicas=1, max_replicas=1, max_concurrency=256, target_concurrency=256,
         scaledown_window=600, timeout=600,
         env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
class Engine:
    @ember.enter()
    def load(self):
        from ember.runtime.engine.api import create_app
        from ember.runtime.engine.config import EngineConfig
        from ember.runtime.engine.engine import LLMEngine

        model = os.environ["EMBER_BENCH_MODEL"]
        longest = json.loads((Path(model) / "config.json").read_text())["max_position_embeddings"]
        overlap = os.environ.get("EMBER_BENCH_OVERLAP", "1") == "1"
        wait = os.environ.get("EMBER_BENCH_DEVICE_WAIT")
        wait = {"device_wait": wait} if wait else {}
        prefill_graphs = os.environ.get("EMBER_BENCH_PREFILL_GRAPHS", "1") == "1"
        self.api = create_app(LLMEngine(EngineConfig(model=model, max_model_len=min(4096, longest),
                                                     overlap=overlap, prefill_graphs=prefill_graphs, **wait)))

    @ember.asgi_app()
    def web(self):
        return self.api
