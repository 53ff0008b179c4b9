"""A step's inputs built with numpy, and the block tables as attention takes them, against the same built token by
token from the sequences' lists."""
import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ember.runtime.engine.attention import AttentionBatch
from ember.runtime.engine.block_manager import BlockManager
from ember.runtime.engine.model_runner import aligned_rows
from ember.runtime.engine.sampling import SamplingParams
from ember.runtime.engine.scheduler import ScheduledBatch, Scheduler
from ember.runtime.engine.sequence import Sequence
from ember.runtime.engine.step_inputs import step_inputs

from .test_scheduler import BS, compute, workloads


def by_token(batch: ScheduledBatch) -> dict:
    ids, positions, blocks, offsets, sample_index, sampled = [], [], [], [], [], []
    for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
        start = seq.num_computed_tokens
        ids += seq.token_ids[start:start + n]
        positions += range(start, start + n)
        blocks += [seq.block_table[p // BS] for p in range(start, start + n)]
        offsets += [p % BS for p in range(start, start + n)]
        if start + n == len(seq):
            sample_index.append(len(ids) - 1)
            sampled.append(i)
    return dict(tokens=[ids, positions, blocks, offsets], sample_index=sample_index, sampled=sampled,
                context_lens=[s.num_computed_tokens + n for s, n in zip(batch.seqs, batch.num_new_tokens)],
                tables=[s.block_table for s in batch.seqs],
                decode=all(n == 1 for n in batch.num_new_tokens))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_inputs_match_the_token_by_token_build(w):
    bm = BlockManager(w["num_blocks"], BS, w["prefix_caching"])
    scheduler = Scheduler(bm, w["max_num_seqs"], w["budget"])
    for i, (prompt, max_tokens, _, _) in enumerate(w["requests"]):
        scheduler.add(Sequence(str(i), prompt, SamplingParams(max_tokens=max_tokens)))
    for _ in range(500):
        if not scheduler.has_unfinished():
            break
        batch = scheduler.schedule()
        if batch.seqs:
            inputs, expected = step_inputs(batch, BS), by_token(batch)
            assert inputs.tokens.tolist() == expected["tokens"]
            assert inputs.sample_index.tolist() == expected["sample_index"] and inputs.sampled == expected["sampled"]
            assert inputs.context_lens.tolist() == expected["context_lens"]
            attention = AttentionBatch(inputs.query_lens, inputs.context_lens, inputs.block_tables,
                                       inputs.num_blocks, torch.empty(0), torch.empty(0))
            assert [t.tolist() for t in attention.tables()] == expected["tables"]
            indptr, indices = attention.paged_kv()   # as flashinfer takes them
            assert indices.tolist() == [b for t in expected["tables"] for b in t]
            assert indptr.tolist() == [sum(len(t) for t in expected["tables"][:i])
                                       for i in range(len(expected["tables"]) + 1)]
            assert inputs.decode == expected["decode"]
        compute(scheduler, batch)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 70))
def test_the_rows_a_step_hands_its_kernels_start_aligned_whatever_its_length(t):
    """Triton compiles a kernel once per combination of its pointers' 16-byte alignment: a step of odd length must
    hand the K/V write rows that start where an even one's do, or its first such step compiles on a request's path."""
    tokens = np.arange(4 * t, dtype=np.int64).reshape(4, t)
    rows = aligned_rows(tokens, torch.device("cpu"))
    assert rows.shape == (4, t) and torch.equal(rows, torch.from_numpy(tokens))
    base = rows.untyped_storage().data_ptr()
    assert all((row.data_ptr() - base) % 64 == 0 for row in rows), [row.data_ptr() - base for row in rows]


def test_the_prefix_tables_cover_each_sequences_cached_tokens_before_the_step():
    """attention.prefix_tables (RAGGED_PREFILL's paged attention over the cached prefixes): each sequence's blocks
    up to its prefix's last token, that token's place in its block, and which of the step's tokens have a prefix; a
    sequence without one gets one token of its first block, which the merge leaves out."""
    from ember.runtime.engine.attention import prefix_tables

    block = 4
    # prefixes of 0, 4 (a whole block), 6 and 16 tokens before 3, 5, 1 and 2 new ones
    query_lens = np.array([3, 5, 1, 2], dtype=np.int32)
    context_lens = np.array([3, 9, 7, 18], dtype=np.int32)
    tables = np.array([[7, 0, 0, 0, 0], [3, 9, 4, 0, 0], [5, 6, 0, 0, 0], [1, 2, 8, 10, 11]], dtype=np.int32)
    slots = torch.zeros(int(query_lens.sum()), dtype=torch.long)
    batch = AttentionBatch(query_lens, context_lens, tables, -(-context_lens // block), slots, slots)
    indptr, indices, last, rows = prefix_tables(batch, block)
    assert indptr.tolist() == [0, 1, 2, 4, 8]
    assert indices.tolist() == [7, 3, 5, 6, 1, 2, 8, 10]
    assert last.tolist() == [1, 4, 2, 4]
    assert rows.tolist() == [False] * 3 + [True] * 8
    assert indptr.dtype == indices.dtype == last.dtype == np.int32


def test_the_prefix_span_takes_the_rows_from_the_first_sequence_with_a_prefix_to_the_last():
    """attention.prefix_span and prefix_tables over it: the prefix's attention of RAGGED_PREFILL runs over the rows
    of the sequences from the first with a cached prefix to the last, those without one among them masked; a step
    with none has no span."""
    from ember.runtime.engine.attention import prefix_span, prefix_tables

    block = 4
    tables = np.array([[7, 0, 0, 0, 0], [3, 9, 4, 0, 0], [5, 6, 0, 0, 0], [1, 2, 8, 10, 11]], dtype=np.int32)

    def batch(query_lens, context_lens):
        query_lens, context_lens = np.array(query_lens, np.int32), np.array(context_lens, np.int32)
        slots = torch.zeros(int(query_lens.sum()), dtype=torch.long)
        return AttentionBatch(query_lens, context_lens, tables, -(-context_lens // block), slots, slots)

    assert prefix_span(batch([3, 5, 1, 2], [3, 5, 1, 2])) is None
    # only the first sequence has a prefix (6 tokens before 3): a step continuing a prompt cut at the one before
    step = batch([3, 5, 1, 2], [9, 5, 1, 2])
    span, a, b = prefix_span(step)
    assert (span.start, span.stop, a, b) == (0, 1, 0, 3)
    indptr, indices, last, rows = prefix_tables(step, block, span)
    assert (indptr.tolist(), indices.tolist(), last.tolist(), rows.tolist()) == ([0, 2], [7, 0], [2], [True] * 3)
    # the second and fourth have one, the third (between them) none: its row in the span, masked
    step = batch([3, 5, 1, 2], [3, 9, 1, 18])
    span, a, b = prefix_span(step)
    assert (span.start, span.stop, a, b) == (1, 4, 3, 11)
    indptr, indices, last, rows = prefix_tables(step, block, span)
    assert indptr.tolist() == [0, 1, 2, 6] and indices.tolist() == [3, 5, 1, 2, 8, 10]
    assert last.tolist() == [4, 1, 4] and rows.tolist() == [True] * 5 + [False] + [True] * 2


def test_staged_host_arrays_reach_the_device_buffer_and_grow_it():
    """attention.Staged: each call's values in the device buffer's first rows, the buffers kept while they fit and
    doubled (at least) when they do not."""
    from ember.runtime.engine.attention import Staged

    staged = Staged(torch.int32, torch.device("cpu"), 4)
    first = staged(np.array([3, 1, 2], dtype=np.int32))
    assert first.tolist() == [3, 1, 2] and staged.pinned.numel() == 4
    buffer = staged.staged
    assert staged(np.array([5], dtype=np.int32)).tolist() == [5] and staged.staged is buffer
    assert staged(np.arange(9, dtype=np.int32)).tolist() == list(range(9))
    assert staged.staged is not buffer and staged.pinned.numel() == 9
    rows = Staged(torch.bool, torch.device("cpu"), 2)
    assert rows(np.array([False, True, True])).tolist() == [False, True, True]
