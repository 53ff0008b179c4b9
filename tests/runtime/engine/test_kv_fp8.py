"""The FP8 KV cache (EngineConfig.kv_cache_dtype="fp8"): K and V rounded to e4m3 as they are stored, against
transformers whose attention reads K and V rounded the same way (CPU, fp32; the GPU's kernels:
tests/gpu/test_fp8_gpu.py and tests/gpu/test_engine_gpu.py)."""
import copy

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ember.runtime.engine import fp8, fused
from ember.runtime.engine.attention import AttentionBatch, SdpaBackend
from ember.runtime.engine.config import EngineConfig
from ember.runtime.engine.engine import LLMEngine
from ember.runtime.engine.sampling import SamplingParams

from .hf_models import logprob_gaps, random_prompts
from .test_fp8 import engine


def test_the_cache_rounds_to_nearest_e4m3_and_clamps_past_its_range():
    x = torch.tensor([0.0, 1.0, 1.0624, 1.0626, -3.3, 448.0, 500.0, -1e6, 2.0 ** -9, 0.3])
    stored = fp8.to_cache(x, fp8.FP8)
    assert stored.dtype == torch.float8_e4m3fn
    # e4m3 steps by 1/8 between 1 and 2: 1.0624 rounds down, 1.0626 up; 448 is the largest finite value
    assert stored.float().tolist()[:8] == [0.0, 1.0, 1.0, 1.125, -3.25, 448.0, 448.0, -448.0]
    assert stored.float()[8].item() == 2.0 ** -9   # the smallest subnormal
    assert abs(stored.float()[9].item() - 0.3) <= 0.3 * 2.0 ** -4
    assert not torch.isnan(stored.float()).any()
    assert torch.equal(fp8.to_cache(x, torch.bfloat16), x.to(torch.bfloat16))   # other caches: a plain cast


def test_the_kv_write_stores_rounded_values_and_attention_reads_them_back():
    torch.manual_seed(0)
    t, hq, hk, d, block = 5, 4, 2, 16, 8
    q, k, v = torch.randn(t, hq, d), torch.randn(t, hk, d) * 3, torch.randn(t, hk, d)
    cos, sin = torch.ones(t, 1, d), torch.zeros(t, 1, d)   # RoPE at position 0: K as it is
    cache = torch.zeros(2, 2, block, hk, d, dtype=fp8.FP8)
    slots = torch.arange(t)
    fused.norm_rope_store_(q, k, v, cos, sin, None, None, 1e-6, cache, slots // block, slots % block)
    assert torch.equal(cache[0, 0, :t], fp8.to_cache(k, fp8.FP8)) and torch.equal(cache[0, 1, :t],
                                                                                   fp8.to_cache(v, fp8.FP8))
    backend = SdpaBackend(hq, hk, d, block, d ** -0.5)
    lens = torch.tensor([t]).numpy().astype("int32")
    backend.plan(AttentionBatch(lens, lens, torch.tensor([[0]]).numpy().astype("int32"), lens * 0 + 1,
                                slots // block, slots % block))
    out = backend.attend(q, cache)
    assert out.dtype == q.dtype
    # what attention over the dequantized K and V gives, causally
    rounded_k, rounded_v = (x.float().repeat_interleave(hq // hk, 1) for x in (cache[0, 0, :t], cache[0, 1, :t]))
    scores = torch.einsum("thd,shd->hts", q, rounded_k) * d ** -0.5
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    expected = torch.einsum("hts,shd->thd", torch.softmax(scores, -1), rounded_v)
    assert torch.allclose(out, expected, atol=1e-5)


def _fp8_kv_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention over K and V rounded as the FP8 cache rounds them."""
    return sdpa_attention_forward(module, query, fp8.to_cache(key, fp8.FP8).to(key.dtype),
                                  fp8.to_cache(value, fp8.FP8).to(value.dtype), attention_mask, **kwargs)


AttentionInterface.register("ember_fp8_kv", _fp8_kv_attention)


def logprobs_of(eng: LLMEngine, prompts: list[list[int]]) -> dict[int, list[dict]]:
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=5)
    for i, prompt in enumerate(prompts):
        eng.add_request(str(i), prompt, greedy)
    outputs: dict[int, list] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            outputs.setdefault(int(out.request_id), []).extend(out.new_logprobs or [])
    return outputs


@pytest.mark.parametrize("chunked", [False, True])
def test_an_fp8_cache_engine_computes_what_transformers_computes_over_rounded_keys_and_values(model_family, chunked):
    model_dir, model = model_family
    # chunked: prompts prefilled over several steps, so later chunks read earlier chunks' K/V from the FP8 cache
    eng = engine(model_dir, kv_cache_dtype="fp8", **({"max_num_batched_tokens": 16} if chunked else {}))
    assert all(cache.dtype == torch.float8_e4m3fn for cache in eng.runner.kv_caches)
    rounded = copy.deepcopy(model)
    rounded.set_attn_implementation("ember_fp8_kv")
    prompts = random_prompts([5, 23, 40], seed=3)
    outputs = logprobs_of(eng, prompts)
    same_token, to_rounded, to_exact = logprob_gaps([outputs[i] for i in range(len(prompts))], prompts, rounded,
                                                     model)
    # As with FP8 weights (test_fp8.py): equal to fp32 rounding but where a last-bit difference moved a value across
    # an e4m3 rounding boundary
    assert sum(same_token) >= 0.9 * len(same_token)
    assert torch.tensor(to_rounded).median() < 1e-5 and max(to_rounded) < 0.1
    assert torch.tensor(to_exact).median() > 1e-4, "the engine's cache did not round K and V"


def test_fp8_weights_and_cache_together_and_more_blocks_in_the_same_bytes(model_family):
    model_dir, _ = model_family
    budget = 1 << 20
    plain = engine(model_dir, num_kv_blocks=None, kv_cache_bytes=budget)
    both = engine(model_dir, num_kv_blocks=None, kv_cache_bytes=budget, kv_cache_dtype="fp8", quantization="fp8")
    # fp32 on the CPU: a byte a value where the model's dtype takes four (bf16 on a GPU: two)
    assert both.runner.num_blocks // 4 == plain.runner.num_blocks
    assert both.runner.arena.mapped_bytes < plain.runner.arena.mapped_bytes
    prompts = random_prompts([7, 31], seed=5)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ours = both.generate(prompts, greedy)
    assert [len(tokens) for tokens in ours] == [12, 12]
    assert ours == engine(model_dir, kv_cache_dtype="fp8", quantization="fp8").generate(prompts, greedy)


def test_kv_cache_dtype_settings_are_checked():
    with pytest.raises(ValueError, match="kv_cache_dtype='int8': use 'fp8'"):
        EngineConfig(model="unused", kv_cache_dtype="int8")
    assert fp8.unsupported(torch.device("cpu"), torch.float32, "kv_cache_dtype") is None
    assert fp8.kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert fp8.kv_cache_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn
