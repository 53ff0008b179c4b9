"""The engine on a CUDA GPU in bf16: against transformers, and flashinfer against SDPA.

Random-weight models of each family with head_dim 128 (flashinfer's common case). Run on the GPU machine:
    python -m pytest tests/gpu/test_engine_gpu.py -m gpu -s
"""
import gc

import pytest
import torch

from ember.runtime.engine.config import EngineConfig
from ember.runtime.engine.engine import LLMEngine
from ember.runtime.engine.sampling import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

VOCAB = 8192
_COMMON = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8,
               num_key_value_heads=2, head_dim=128, vocab_size=VOCAB, max_position_embeddings=4096,
               initializer_range=0.05, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _families():
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM)
    return {
        "llama": (LlamaConfig, LlamaForCausalLM, dict(rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024})),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM, {}),
    }


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(3, VOCAB, (64,), generator=g).tolist()   # half the prompts share it: prefix hits
    out = []
    for i in range(n):
        length = int(torch.randint(4, 300, (1,), generator=g))
        body = torch.randint(3, VOCAB, (length,), generator=g).tolist()
        out.append(system + body if i % 2 else body)
    return out


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def family(request, tmp_path_factory):
    config_cls, model_cls, extra = _families()[request.param]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**_COMMON, **extra}))
    directory = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(directory)
    model = model.to(device="cuda", dtype=torch.bfloat16).eval()
    yield request.param, str(directory), model
    del model
    gc.collect()
    torch.cuda.empty_cache()


def engine(model_dir: str, backend: str = "flashinfer") -> LLMEngine:
    return LLMEngine(EngineConfig(model=model_dir, dtype="bfloat16", num_kv_blocks=8192, max_num_seqs=128,
                                  max_num_batched_tokens=4096, max_model_len=1024, attention_backend=backend))


def first_token_logprobs(eng: LLMEngine, batch: list[list[int]]) -> list[dict]:
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=20)
    for i, p in enumerate(batch):
        eng.add_request(str(i), p, params)
    out = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.new_logprobs:
                out[o.request_id] = o.new_logprobs[0]
    return [out[str(i)] for i in range(len(batch))]


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    same = sum(x == y for s, t in zip(a, b) for x, y in zip(s, t))
    return same / sum(len(s) for s in a)


@torch.no_grad()
def hf_greedy(model, batch: list[list[int]], n: int) -> list[list[int]]:
    out = []
    for i in range(0, len(batch), 64):
        chunk = batch[i:i + 64]
        width = max(map(len, chunk))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk], device="cuda")
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device="cuda")
        gen = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                             pad_token_id=0)
        out += gen[:, width:].tolist()
    return out


def test_first_token_logprobs_match_transformers(family):
    name, model_dir, model = family
    batch = prompts(32, seed=1)
    eng = engine(model_dir)
    ours = first_token_logprobs(eng, batch)
    worst, top1 = 0.0, 0
    with torch.no_grad():
        for p, entry in zip(batch, ours):
            ref = torch.log_softmax(model(torch.tensor([p], device="cuda")).logits[0, -1].float(), -1)
            ids = torch.tensor([t for t, _ in entry["top"]], device="cuda")
            diff = (torch.tensor([lp for _, lp in entry["top"]], device="cuda") - ref[ids]).abs().max().item()
            worst = max(worst, diff)
            top1 += entry["token_id"] == ref.argmax().item()
    print(f"\n[{name}] first-token top-20 logprobs vs transformers bf16: max |diff| {worst:.4f}, "
          f"top-1 agreement {top1}/{len(batch)}")
    assert worst < 0.1
    assert top1 >= len(batch) - 1


def test_greedy_agrees_with_transformers_on_256_prompts(family):
    name, model_dir, model = family
    batch, n = prompts(256, seed=2), 32
    eng = engine(model_dir)
    ours = eng.generate(batch, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    theirs = hf_greedy(model, batch, n)
    rate = agreement(ours, theirs)
    print(f"\n[{name}] greedy token agreement with transformers over 256 prompts x {n} tokens: {rate:.4f} "
          f"(prefix hits {eng.stats.prefix_cache_hits} of {eng.stats.prefix_cache_queries} prompt tokens)")
    assert eng.stats.prefix_cache_hits > 0
    assert rate >= 0.95


def test_flashinfer_and_sdpa_agree(family):
    name, model_dir, _ = family
    batch, n = prompts(64, seed=3), 32
    results = {}
    for backend in ("flashinfer", "sdpa"):
        eng = engine(model_dir, backend)
        results[backend] = (first_token_logprobs(eng, batch),
                            eng.generate(batch, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)))
        del eng
        torch.cuda.empty_cache()
    (fi_lp, fi_out), (sd_lp, sd_out) = results["flashinfer"], results["sdpa"]
    worst = max(abs(a["logprob"] - b["logprob"]) for a, b in zip(fi_lp, sd_lp) if a["token_id"] == b["token_id"])
    rate = agreement(fi_out, sd_out)
    print(f"\n[{name}] flashinfer vs sdpa: first-token logprob max |diff| {worst:.4f}, greedy agreement {rate:.4f}")
    assert worst < 0.1
    assert rate >= 0.95
