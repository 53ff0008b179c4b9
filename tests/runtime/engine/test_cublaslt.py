"""runtime/engine/cublaslt.py without a GPU: the choice among timed algorithms, and that nothing reaches cuBLASLt
off CUDA (tests/gpu/test_fp8_gpu.py runs the products)."""
import math

import torch

from ember.runtime.engine import cublaslt, fp8


def test_the_fastest_median_replaces_the_heuristics_first_only_past_the_margin():
    first = [10.0, 10.2, 9.9, 30.0, 10.1]   # median 10.1, one outlier run
    assert cublaslt.fastest([first, [9.0, 9.1, 8.9, 9.0, 9.2]], margin=0.03) == 1
    assert cublaslt.fastest([first, [9.9, 9.9, 9.9, 9.9, 9.9]], margin=0.03) == 0   # 2% faster: noise
    assert cublaslt.fastest([first, [9.5] * 5, [8.0, 8.0, 50.0, 50.0, 50.0]], margin=0.03) == 1   # medians rule
    assert cublaslt.fastest([first, [9.5] * 5], margin=0.0) == 1


def test_a_candidate_that_failed_is_never_chosen():
    assert cublaslt.fastest([[math.inf], [12.0, 12.0]], margin=0.03) == 1
    assert cublaslt.fastest([[10.0] * 3, [math.inf], [11.0] * 3], margin=0.03) == 0
    assert cublaslt.fastest([[10.0] * 3, [1.0, math.inf, 1.0]], margin=0.03) == 0


def test_off_cuda_no_product_goes_through_cublaslt_and_the_switch_changes_nothing(monkeypatch):
    assert not cublaslt.available(torch.device("cpu"))
    torch.manual_seed(0)
    weight, scale = fp8.quantize_rows(torch.randn(64, 128) * 0.02)
    q, q_scale = fp8.quantize_tokens(torch.randn(96, 128, dtype=torch.bfloat16))
    assert cublaslt.matmul(q, weight) is None and cublaslt.matmul(q, weight, q_scale, scale) is None
    monkeypatch.setattr(fp8, "LT_CHOICE", False)
    monkeypatch.setattr(fp8, "LT_SCALED", False)
    off = fp8.deferred_linear(q, q_scale, weight, scale, None, torch.bfloat16)
    for switch in ("LT_CHOICE", "LT_SCALED"):
        monkeypatch.setattr(fp8, switch, True)
        on = fp8.deferred_linear(q, q_scale, weight, scale, None, torch.bfloat16)
        assert isinstance(on, torch.Tensor) and torch.equal(on, off)
    assert cublaslt.choices() == {}
