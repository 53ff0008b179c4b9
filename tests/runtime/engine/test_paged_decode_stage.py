"""PagedDecode.stage, the path the decode graphs' Triton attention takes its tables by: the same buffers as prepare's,
from a step's arrays (on CPU here; tests/gpu/test_paged_decode_gpu.py runs the kernels on what it staged)."""
import numpy as np
import pytest
import torch

from ember.runtime.engine.config import EngineConfig
from ember.runtime.engine.paged_decode import PagedDecode


def test_stage_fills_the_same_buffers_as_prepare_with_the_steps_width_as_row_stride():
    rng = np.random.default_rng(0)
    staged = PagedDecode(4, 32, 16, 32, 8, 128, torch.device("cpu"))
    prepared = PagedDecode(4, 32, 16, 32, 8, 128, torch.device("cpu"))
    for width in (9, 3, 30, 5):   # narrower and wider steps: the staging buffers are reused and grown
        num_blocks = rng.integers(1, width + 1, 4)
        tables = rng.integers(0, 1000, (4, width)).astype(np.int32)   # past num_blocks: whatever the step left
        lens = (num_blocks - 1) * 16 + rng.integers(1, 17, 4)
        staged.stage(tables, lens)
        prepared.prepare([row[:n].tolist() for row, n in zip(tables, num_blocks)], lens.tolist())
        assert staged.context_lens.tolist() == lens.tolist()
        assert staged.staged_tables().tolist() == tables.tolist()   # the row stride is this step's width
        for row, n in enumerate(num_blocks):   # what a kernel reads: the blocks covering each context
            assert staged.staged_tables()[row, :n].tolist() == prepared.staged_tables()[row, :n].tolist()
        tables[:] = -1   # the step's arrays are the host's again at once: what was staged is a copy
        assert (staged.staged_tables() >= 0).all()
    staged.stage(np.array([[7, 8, 9]], dtype=np.int32), np.array([40]))   # fewer rows than the size
    assert staged.context_lens.tolist() == [40, 1, 1, 1]   # the rest attend to one token
    assert staged.staged_tables()[0].tolist() == [7, 8, 9]
    with pytest.raises(ValueError, match="at most 4 x 32"):
        staged.stage(np.zeros((4, 33), dtype=np.int32), np.ones(4))


@pytest.mark.parametrize("value", [0, -3, 2.5, "64"])
def test_streamed_decode_min_batch_is_validated(value):
    with pytest.raises(ValueError, match="streamed_decode_min_batch"):
        EngineConfig(model="m", streamed_decode_min_batch=value)


def test_streamed_parts_fill_the_multiprocessors_twice_over_up_to_four_parts():
    from ember.runtime.engine.paged_decode import streamed_parts

    for batch in range(9, 257):
        parts = streamed_parts(batch, 8, 132)
        assert 1 <= parts <= 4
        assert parts * batch * 8 >= 2 * 132 or parts == 4   # about two programs on each of the 132
        assert parts == 1 or (parts - 1) * batch * 8 < 2 * 132   # and no more parts than that takes
