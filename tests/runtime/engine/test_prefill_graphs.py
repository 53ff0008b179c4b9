"""Which steps get piecewise prefill graphs (prefill_graphs.py); their answers are tested on the GPU
(tests/gpu/test_engine_gpu.py: graphs against eager prefills)."""
import pytest

from ember.runtime.engine.config import EngineConfig
from ember.runtime.engine.prefill_graphs import HOST_BOUND_FLOPS, prefill_graph_sizes

QWEN3_0_6B = 596_049_920   # parameters, the embedding (tied) counted once
QWEN3_4B = 4_022_468_096
QWEN3_8B = 8_190_735_360


def test_small_models_get_graphs_up_to_large_steps_and_large_models_only_for_short_ones():
    assert prefill_graph_sizes(8192, QWEN3_0_6B) == [16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
    # bench/results/prefill_steps.json: the 4B's 1,024-token graph halves an eager step's time at 768-1,024 tokens;
    # at 2,048 (and the 8B's 1,024) the products are the GPU's work already and the eager launches hide behind them
    assert prefill_graph_sizes(8192, QWEN3_4B) == [16, 32, 64, 128, 256, 512, 1024]
    assert prefill_graph_sizes(8192, QWEN3_8B) == [16, 32, 64, 128, 256, 512]
    assert prefill_graph_sizes(8192, 400_000_000_000) == []


def test_no_size_passes_the_step_budget_or_the_host_bound():
    for budget in (1, 15, 16, 100, 300, 8192):
        for parameters in (10_000_000, QWEN3_0_6B, QWEN3_8B, 70_000_000_000):
            sizes = prefill_graph_sizes(budget, parameters)
            assert sizes == sorted(sizes) and all(s <= budget for s in sizes)
            assert all(2 * parameters * s <= HOST_BOUND_FLOPS for s in sizes)
    assert prefill_graph_sizes(300, QWEN3_0_6B)[-1] == 256


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_the_flag_is_validated(tmp_path, value):
    with pytest.raises(ValueError, match="prefill_graphs=.*use True or False"):
        EngineConfig(model=str(tmp_path), prefill_graphs=value)
