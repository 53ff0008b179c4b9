"""An OpenAI-compatible LLM endpoint served by Ember's engine.

    ember serve examples/chat.py                                   # a tiny random-weight model, built locally
    EMBER_CHAT_MODEL=/models/Qwen3-0.6B ember serve examples/chat.py  # a Hugging Face model directory
    EMBER_CHAT_LOG_TOKEN_IDS=1 ember serve examples/chat.py          # log prompt/output token ids per request
    EMBER_CHAT_SCALEDOWN_WINDOW=1 ember serve examples/chat.py       # stop idle replicas after 1 s (default 300)
    EMBER_CHAT_PARK_AFTER=3 ember serve examples/chat.py             # park idle replicas after 3 s (GPU released)
    EMBER_CHAT_GPU_MEMORY_UTILIZATION=0.3 ember serve examples/chat.py  # take 30% of the GPU (default 0.9)
    EMBER_CHAT_KV_CACHE_BYTES=8000000000 ember serve examples/chat.py   # or give the KV cache a byte budget
    EMBER_CHAT_WARM_KERNELS=0 ember serve examples/chat.py           # no kernel warm-up beside the weights (the
                                                                     # first request loads the kernels instead)

Then point any OpenAI client at https://127.0.0.1:8443/chat/v1 with an Ember key (`ember serve examples/chat.py
--new-key me` prints the key, a curl and the `export OPENAI_BASE_URL=... OPENAI_API_KEY=... SSL_CERT_FILE=...` line
the official `openai` package reads):

    curl --cacert ~/.ember/tls/ca.pem -H "Authorization: Bearer $KEY" https://127.0.0.1:8443/chat/v1/models
    curl --cacert ~/.ember/tls/ca.pem -H "Authorization: Bearer $KEY" -H "Content-Type: application/json" \\
         https://127.0.0.1:8443/chat/v1/chat/completions \\
         -d '{"model": "tiny-qwen3", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32}'

The model's name in requests is its directory's name. With no GPU the engine runs on CPU
(torch SDPA), so the same file serves in CI and on an H200.
"""
import logging
import os
from pathlib import Path

import ember

app = ember.App("chat")
MODEL_NAME = Path(os.environ.get("EMBER_CHAT_MODEL") or "tiny-qwen3").name  # what requests call the model


@app.cls(
    gpu="H200",
    snapshot=True,
    max_concurrency=64,
    # The engine batches concurrent requests, so one replica takes many before another is worth starting.
    target_concurrency=32,
    scaledown_window=float(os.environ.get("EMBER_CHAT_SCALEDOWN_WINDOW", "300")),
    park_after=float(os.environ["EMBER_CHAT_PARK_AFTER"]) if os.environ.get("EMBER_CHAT_PARK_AFTER") else None,
    timeout=600,
    env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"},
)
class Chat:
    @ember.enter(snap=True)
    def load(self):
        # CPU work only: the modules, the tokenizer and the configuration. A node's fork server runs this once
        # and forks replicas from it, so nothing here may touch CUDA (flashinfer is imported in the replica).
        from transformers import AutoTokenizer

        import ember.runtime.engine.api  # noqa: F401 - imported before the fork, so no replica imports them
        import ember.runtime.engine.engine  # noqa: F401
        from ember.home import Home
        from ember.runtime.engine.config import EngineConfig
        from ember.runtime.engine.models.loader import prepare
        from ember.runtime.engine.tiny import build_tiny_model

        model = os.environ.get("EMBER_CHAT_MODEL") or build_tiny_model(Home().root / "models" / "tiny-qwen3")
        log_token_ids = os.environ.get("EMBER_CHAT_LOG_TOKEN_IDS", "") not in ("", "0")
        if log_token_ids:
            # The engine logs ids at INFO; the replica's stderr is its log file.
            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        sizing = {}
        if os.environ.get("EMBER_CHAT_GPU_MEMORY_UTILIZATION"):
            sizing["gpu_memory_utilization"] = float(os.environ["EMBER_CHAT_GPU_MEMORY_UTILIZATION"])
        if os.environ.get("EMBER_CHAT_KV_CACHE_BYTES"):
            sizing["kv_cache_bytes"] = int(os.environ["EMBER_CHAT_KV_CACHE_BYTES"])
        if os.environ.get("EMBER_CHAT_WARM_KERNELS"):
            sizing["warm_kernels"] = os.environ["EMBER_CHAT_WARM_KERNELS"] not in ("0", "")
        self.config = EngineConfig(model=str(model), log_token_ids=log_token_ids, **sizing)
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        prepare(model)  # config.json and the weight files' identity, read once here for every replica
        # The chat template is compiled on its first use and cached for the process: here, so replicas inherit it.
        if self.tokenizer.chat_template:
            prompt = self.tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], tokenize=False,
                                                        add_generation_prompt=True)
            self.tokenizer.encode(prompt, add_special_tokens=False)

    @ember.enter(snap=False)
    def serve(self):
        # The GPU work, in the replica: weights from the snapshot, the KV cache, kernels, then the step-loop
        # thread (threads do not survive a fork).
        from ember.runtime.engine.api import create_app
        from ember.runtime.engine.async_engine import AsyncLLM
        from ember.runtime.engine.engine import LLMEngine

        self.engine = LLMEngine(self.config)
        self.api = create_app(AsyncLLM(self.engine, self.tokenizer))

    @ember.park()
    def release_gpu(self):
        # Weights to pinned host memory, KV cache discarded; their addresses stay reserved for the wake.
        self.engine.park()

    @ember.wake()
    def restore_gpu(self):
        self.engine.wake()

    @ember.asgi_app(try_path="/v1/chat/completions", openai_base="/v1", try_body={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16})
    def web(self):
        return self.api
