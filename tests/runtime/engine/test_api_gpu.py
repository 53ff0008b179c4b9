"""The OpenAI-compatible app over the engine on a CUDA GPU (bf16), through a real uvicorn socket.

Run on the GPU machine:
    python -m pytest tests/runtime/engine/test_api_gpu.py -m gpu -s
"""
import json
import math
import time

import httpx
import pytest
import torch

from ember.runtime.engine.api import create_app
from ember.runtime.engine.config import EngineConfig
from ember.runtime.engine.tiny import build_tiny_model
from tests.runtime.engine.helpers import uvicorn_thread, wait_until_idle

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MODEL = "tiny-gpu"
HELLO = [{"role": "user", "content": "Tell me a story about the sea."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # head_dim 64: a size every attention backend takes.
    path = build_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen3", hidden_size=128, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=64)
    free_before = torch.cuda.mem_get_info()[0]
    app = create_app(EngineConfig(model=str(path), max_model_len=1024), served_model_name=MODEL)
    assert app.state.llm.engine.runner.device.type == "cuda"
    with uvicorn_thread(app) as url:
        yield app, url
    # The app's shutdown frees the engine's device memory (it takes most of the GPU), so GPU tests that follow in
    # this process can start engines of their own.
    assert torch.cuda.mem_get_info()[0] > free_before - (1 << 30)


def chat(base, **body):
    return httpx.post(f"{base}/v1/chat/completions", json={"model": MODEL, "messages": HELLO, **body}, timeout=60)


def test_streaming_matches_non_streaming_and_stop_strings_hold(server):
    _, base = server
    whole = chat(base, max_tokens=32, seed=3, logprobs=True, top_logprobs=2).json()["choices"][0]
    text = whole["message"]["content"]
    assert all(math.isfinite(t["logprob"]) and len(t["top_logprobs"]) == 2 for t in whole["logprobs"]["content"])
    with httpx.stream("POST", f"{base}/v1/chat/completions", timeout=60,
                      json={"model": MODEL, "messages": HELLO, "max_tokens": 32, "seed": 3, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = chat(base, max_tokens=32, seed=3, stop=[stop]).json()["choices"][0]
    assert (cut["message"]["content"], cut["finish_reason"]) == (text[:text.find(stop)], "stop")


def test_metrics_count_graph_and_eager_steps_with_their_device_time(server):
    _, base = server
    # a prefill (eager, or piecewise once the idle engine captured its size), then decode steps replayed from graphs
    chat(base, max_tokens=16, ignore_eos=True)
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
               for line in httpx.get(f"{base}/metrics", timeout=60).text.splitlines() if line[:1] not in ("#", "")}
    label = f'model_name="{MODEL}"'

    def steps(kind: str) -> tuple[float, float]:
        return (samples[f'ember:engine_steps_total{{{label},kind="{kind}"}}'],
                samples[f'ember:engine_step_device_seconds_total{{{label},kind="{kind}"}}'])

    assert steps("graph")[0] >= 1 and steps("graph")[1] > 0
    prefills = [steps("eager"), steps("piecewise")]
    assert sum(count for count, _ in prefills) >= 1
    assert all(seconds > 0 for count, seconds in prefills if count)


def test_disconnect_frees_gpu_kv_blocks(server):
    app, base = server
    engine = app.state.llm.engine
    wait_until_idle(engine)  # earlier stop-string requests end in an abort that may still be in flight
    aborted = engine.stats.request_success["abort"]
    with httpx.stream("POST", f"{base}/v1/chat/completions", timeout=60,
                      json={"model": MODEL, "messages": HELLO, "max_tokens": 1000, "stream": True,
                            "ignore_eos": True}) as r:
        for _, _line in zip(range(3), r.iter_lines()):
            pass
    deadline = time.monotonic() + 10
    while engine.has_unfinished_requests() or engine.block_manager.usage > 0:
        assert time.monotonic() < deadline, "the engine still holds requests or KV blocks"
        time.sleep(0.01)
    assert engine.stats.request_success["abort"] == aborted + 1
