"""Structured outputs on a CUDA GPU: each step's masks applied to the logits on the device, in decode steps replayed
from CUDA graphs with overlap scheduling, beside free-text requests. Run on the GPU machine:
    python -m pytest tests/gpu/test_formats_gpu.py -m gpu -s
"""
import json
import re
import time

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from ember.runtime.engine.config import EngineConfig
from ember.runtime.engine.engine import LLMEngine
from ember.runtime.engine.grammar import Grammars
from ember.runtime.engine.sampling import SamplingParams
from ember.runtime.engine.serving import formats
from ember.runtime.engine.tiny import build_tiny_model
from tests.runtime.engine.helpers import ORDER

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# flashinfer's common case (head_dim 128), with the tiny tokenizer and a vocabulary past it, as real models pad theirs
SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, head_dim=128, vocab_size=8192, max_position_embeddings=4096)


def test_formats_hold_in_graph_steps_beside_free_requests(tmp_path, home_with_kept_kernels):
    path = build_tiny_model(tmp_path / "model", **SHAPE)
    tokenizer = AutoTokenizer.from_pretrained(path)
    engine = LLMEngine(EngineConfig(model=str(path), max_num_seqs=64, max_model_len=2048, num_kv_blocks=4096))
    assert engine.runner.graphs is not None and engine.config.overlap
    grammars = Grammars(tokenizer, engine.runner.vocab_size, engine.eos_token_ids)
    began = time.perf_counter()
    order = grammars.compile(formats.reply_format(formats.AnswerFormat("json_schema", ORDER), None, None))
    compiled = time.perf_counter() - began
    texts = ["Hello there", "The weather today", "Numbers like 1, 2, 3", "Once upon a time"]
    prompts = [tokenizer.encode(f"{texts[i % 4]} {i}") for i in range(64)]
    free = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
    began = time.perf_counter()
    engine.generate(prompts, free)
    all_free = time.perf_counter() - began
    held = [SamplingParams(max_tokens=1200, temperature=1.0 if i % 2 else 0.0, seed=i, grammar=order)
            for i in range(16)]
    graph_steps = engine.stats.steps["graph"]
    began = time.perf_counter()
    mixed = engine.generate(prompts, [free] * 48 + held)
    with_held = time.perf_counter() - began
    print(f"\nschema compiled in {compiled * 1000:.1f} ms; 64 free requests x 96 tokens {all_free:.2f} s, 48 free + "
          f"16 held (mean {sum(map(len, mixed[48:])) / 16:.0f} tokens) {with_held:.2f} s, "
          f"{engine.stats.steps['graph'] - graph_steps} steps from graphs")
    assert engine.stats.steps["graph"] - graph_steps > 50
    assert all(len(tokens) == 96 for tokens in mixed[:48])
    for tokens in mixed[48:]:
        assert tokens[-1] in engine.eos_token_ids   # ended by the format, not by max_tokens
        reply = json.loads(tokenizer.decode(tokens, skip_special_tokens=True))
        # a malformed UTF-8 sequence (a random model writes them) is one character to xgrammar, one per byte read back
        reply["note"] = re.sub("\ufffd+", "\ufffd", reply["note"])
        jsonschema.validate(reply, ORDER)
    engine.runner.close()
