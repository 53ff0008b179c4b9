"""PagedDecode.stage, the path the decode graphs' Triton attention takes its tables by: the same buffers as prepare's,
from a step's arrays (on CPU here; tests/gpu/test_paged_decode_gpu.py runs the kernels on what it staged)."""
import numpy as np
import pytest
import torch

from ember.runtime.engine.config import EngineConfig
from ember.runtime.engine.paged_decode import PagedDecode, StreamedDecode, streamed_config


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


def test_streamed_pool_is_a_program_for_two_sequences_two_a_multiprocessor_or_four_pieces_a_sequence():
    from ember.runtime.engine.paged_decode import streamed_pool

    assert streamed_pool(256, 8, 132) == 128   # a piece at most twice the mean context
    assert streamed_pool(64, 8, 132) == streamed_pool(33, 8, 132) == 33   # the H200, 8 KV heads: 264 programs
    assert streamed_pool(32, 8, 132) == 64    # even contexts: 2 pieces each
    assert streamed_pool(16, 8, 132) == 48    # 3 each
    assert streamed_pool(1, 8, 132) == 4      # at most 4 each
    assert streamed_pool(264, 1, 132) == 264 and streamed_pool(256, 1, 132) == 512
    assert streamed_pool(256, 32, 132) == 128


def test_a_small_batch_without_the_piece_cap_fills_the_multiprocessors(monkeypatch):
    """paged_decode.SMALL_BATCH_PIECES None: a batch under two programs a multiprocessor cuts each context into as
    many pieces as fill them, and the step's plan then cuts one 850-token context into one-tile pieces."""
    from ember.runtime.engine import paged_decode

    monkeypatch.setattr(paged_decode, "SMALL_BATCH_PIECES", None)
    assert paged_decode.streamed_pool(1, 8, 132) == 33    # 33 x 8 KV heads: two programs a multiprocessor
    assert paged_decode.streamed_pool(4, 8, 132) == 36    # 9 pieces each
    assert paged_decode.streamed_pool(16, 8, 132) == 48   # as with the cap: 3 each fill them
    assert paged_decode.streamed_pool(64, 8, 132) == 33   # batches that fill them alone are the same
    decode = StreamedDecode(1, 64, 16, 32, 8, 128, torch.device("cpu"), pool=paged_decode.streamed_pool(1, 8, 132))
    decode.stage(np.zeros((1, 54), dtype=np.int32), np.array([850]))
    chunk, extras, _ = decode.staged_plan()
    assert chunk == 64 and len(extras) == 13   # 14 pieces: the first, and 13 of the pool's


@pytest.mark.parametrize("lengths", [
    [843] * 256,                          # even: one piece a sequence, written directly
    [16384] + [512] * 63,                 # one long context among short ones
    [16384, 16384] + [512] * 62,
    [4096] * 4 + [256] * 124,
    [40960] + [1] * 15,                   # everything in one sequence
    [1, 2, 3],                            # fewer rows than the size: the rest are one token each
    list(range(1, 257)),
])
def test_the_streamed_plan_cuts_each_context_into_pieces_the_pool_can_hold(lengths):
    """Every token of every sequence is in exactly one piece of at most `chunk` tokens (a whole number of tiles);
    the pieces after a sequence's first fit the pool; a long sequence's pieces have slots of their own, in order."""
    from ember.runtime.engine.paged_decode import StreamedDecode, streamed_pool

    size, page, tile = max(len(lengths), 16), 16, 64
    pool = streamed_pool(size, 8, 132)
    decode = StreamedDecode(size, 40960 // page, page, 32, 8, 128, torch.device("cpu"), pool=pool, block_t=tile)
    tables = np.zeros((len(lengths), max(-(-n // page) for n in lengths)), dtype=np.int32)
    for _ in range(2):   # a second step over the first's leftovers plans the same
        decode.stage(tables, np.array(lengths))
        chunk, extras, first_slots = decode.staged_plan()
        lens = lengths + [1] * (size - len(lengths))
        assert chunk % tile == 0 and chunk >= tile
        assert chunk <= max(tile, -(-sum(lens) // (pool * tile)) * tile)   # no longer than the step needs
        assert len(extras) <= pool
        pieces: dict[int, list[int]] = {}
        for seq, begin in extras:
            pieces.setdefault(seq, []).append(begin)
        used_slots = []
        for seq, n in enumerate(lens):
            begins = [0] + pieces.get(seq, [])
            assert begins == [i * chunk for i in range(-(-n // chunk))], (seq, n, begins)
            if n > chunk:
                used_slots += [first_slots[seq] + i for i in range(len(begins))]
        assert sorted(used_slots) == list(range(len(used_slots)))   # disjoint, packed
        assert len(used_slots) <= 2 * pool
    if lengths == [843] * 256:
        assert extras == []   # nothing to merge
    if lengths[0] == 16384:
        assert len(pieces[0]) >= 8   # the long one is spread over the pool


@pytest.mark.parametrize("options", [{"heads": 2}, {"heads": 3, "kv_a": True}, {"heads": 16, "kv_a": True},
                                     {"heads": 0, "kv_a": True}])
def test_streamed_decode_takes_several_kv_heads_a_program_only_with_kv_a_and_a_power_of_two_dividing_them(options):
    with pytest.raises(ValueError, match="heads="):
        StreamedDecode(4, 32, 16, 32, 8, 128, torch.device("cpu"), **options)
    assert StreamedDecode(4, 32, 16, 32, 8, 128, torch.device("cpu"), kv_a=True, heads=4).heads == 4


@pytest.mark.parametrize("options,head_dim", [({"perm": True}, 128), ({"perm": True, "kv_a": True, "heads": 2}, 128),
                                              ({"perm": True, "kv_a": True}, 96)])
def test_streamed_decode_permutes_the_head_dimension_only_with_kv_a_one_head_and_a_multiple_of_64(options, head_dim):
    with pytest.raises(ValueError, match="perm needs"):
        StreamedDecode(4, 32, 16, 32, 8, head_dim, torch.device("cpu"), **options)
    assert StreamedDecode(4, 32, 16, 32, 8, 64, torch.device("cpu"), kv_a=True, perm=True).perm


@pytest.mark.parametrize("option", ["defer_sum", "prefetch_table"])
def test_streamed_decode_defers_the_sums_or_reads_the_table_ahead_only_with_kv_a(option):
    with pytest.raises(ValueError, match="defer_sum and prefetch_table need kv_a"):
        StreamedDecode(4, 32, 16, 32, 8, 128, torch.device("cpu"), **{option: True})
    assert getattr(StreamedDecode(4, 32, 16, 32, 8, 128, torch.device("cpu"), kv_a=True, **{option: True}), option)


@pytest.mark.parametrize("head_dim", [16, 32, 64, 128, 256])
def test_the_engines_streamed_configuration_builds_for_every_head_dim_its_kernel_takes(head_dim):
    """streamed_config permutes the head dimension of an FP8 cache only where perm can (a multiple of 64): a model
    with 16- or 32-wide heads (a small test model's) gets the kernel, not a ValueError at its first large batch."""
    for dtype in (torch.float8_e4m3fn, torch.bfloat16):
        config = streamed_config(dtype, head_dim)
        decode = StreamedDecode(4, 32, 16, 32, 8, head_dim, torch.device("cpu"), **config)
        assert decode.perm == (dtype.itemsize == 1 and head_dim % 64 == 0)


@pytest.mark.parametrize("lengths", [
    [300, 1800, 120, 950, 950, 2, 640],        # even lengths' ties keep batch order
    [16384, 90, 16384, 700] + [512] * 60,       # long ones (over the chunk) tie at its length, first
    [1, 5, 1],                                  # fewer rows than the size: the padded rows (one token) come last
])
def test_longest_first_stages_the_sequences_by_their_first_pieces_most_tokens_first(lengths, monkeypatch):
    """With longest_first the first-piece programs take the sequences by their first piece's tokens (a context, or
    the chunk where it is cut), most first, equal ones in batch order, so the shortest make the step's last wave;
    each sequence once. Without, batch order. The module's LONGEST_FIRST is what a decode built without the
    option takes."""
    from ember.runtime.engine import paged_decode

    size = max(len(lengths), 16)
    pool = paged_decode.streamed_pool(size, 8, 132)
    tables = np.zeros((len(lengths), max(-(-n // 16) for n in lengths)), dtype=np.int32)
    monkeypatch.setattr(paged_decode, "LONGEST_FIRST", True)
    ordered = StreamedDecode(size, 40960 // 16, 16, 32, 8, 128, torch.device("cpu"), pool=pool)
    plain = StreamedDecode(size, 40960 // 16, 16, 32, 8, 128, torch.device("cpu"), pool=pool, longest_first=False)
    for decode in (ordered, plain):
        decode.stage(tables, np.array(lengths))
    chunk = ordered.staged_plan()[0]
    firsts = [min(n, chunk) for n in lengths + [1] * (size - len(lengths))]
    order = ordered.staged_order()
    assert sorted(order) == list(range(size))
    assert order == sorted(range(size), key=lambda seq: (-firsts[seq], seq))
    assert plain.staged_order() == list(range(size))
    assert ordered.staged_plan() == plain.staged_plan()   # the pieces are the same; only their programs' order moves
    if lengths[0] == 16384:
        assert order[:2] == [0, 2] and chunk < 16384
