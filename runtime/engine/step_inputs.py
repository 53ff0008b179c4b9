"""One step's model inputs, built from the scheduled batch with a few numpy ops over the whole batch.

A decode step of 256 sequences built them token by token in Python lists (~4 us a sequence); here the Python
left is one pass over the sequences per field read (computed tokens, length, block-table row, input token), and
the rest (positions, KV slots, block tables, which rows sample, which tokens are placeholders) is array
arithmetic. The block tables come from BlockTables' rows, gathered in one indexing op.
"""
from dataclasses import dataclass

import numpy as np

from .scheduler import ScheduledBatch


@dataclass
class StepInputs:
    tokens: np.ndarray          # [4, T] int64: token ids, positions, block of each token's KV slot, offset in it
    query_lens: np.ndarray      # [B] new tokens per sequence
    context_lens: np.ndarray    # [B] tokens in the cache per sequence after this step
    block_tables: np.ndarray    # [B, W] int32: row i starts with sequence i's num_blocks[i] blocks
    num_blocks: np.ndarray      # [B]
    sampled: list[int]          # the sequences whose tokens are all computed after this step: they sample
    sample_index: np.ndarray    # [len(sampled)] int64: each one's last token in `tokens`
    decode: bool                # one new token per sequence
    # [2, F] int64: the tokens that are placeholders (overlap scheduling), as their columns in `tokens` and the
    # rows of the previous step's sampled tokens that hold them; the runner fills them in on the device
    feeds: np.ndarray

    @property
    def samples_all(self) -> bool:
        return len(self.sampled) == len(self.query_lens)


def step_inputs(batch: ScheduledBatch, block_size: int) -> StepInputs:
    seqs, counts, tables = batch.seqs, batch.num_new_tokens, batch.tables
    assert tables is not None, "the scheduler hands every batch its block tables"
    if sum(counts) == len(counts):   # every count is at least 1: a decode step
        return _decode_inputs(seqs, tables, block_size)
    starts = [s.num_computed_tokens for s in seqs]
    start = np.array(starts, dtype=np.int64)
    rows = np.array([s.block_row for s in seqs], dtype=np.intp)
    token_ids = []
    for s, p, n in zip(seqs, starts, counts):
        token_ids += s.token_ids[p:p + n]
    query_lens = np.array(counts, dtype=np.int64)
    ends = np.cumsum(query_lens)
    positions = np.arange(ends[-1]) - np.repeat(ends - query_lens - start, query_lens)
    token_rows = np.repeat(rows, query_lens)
    tokens = np.empty((4, len(token_ids)), dtype=np.int64)
    tokens[0] = token_ids
    feeds = _placeholders(tokens[0])
    tokens[1] = positions
    tokens[2] = tables.array[token_rows, positions // block_size]
    tokens[3] = positions % block_size
    context_lens = start + query_lens
    num_blocks = tables.lengths[rows]
    lengths = np.array([len(s.token_ids) for s in seqs], dtype=np.int64)
    sampled = np.flatnonzero(context_lens == lengths)
    return StepInputs(tokens, query_lens, context_lens, tables.array[rows, :num_blocks.max()], num_blocks,
                      sampled.tolist(), ends[sampled] - 1, False, feeds)


def _decode_inputs(seqs: list, tables, block_size: int) -> StepInputs:
    """One token per sequence, the step that runs hundreds of times per request: one pass over the sequences
    gathers the four numbers each contributes (computed tokens, table row, length, input token) into one array."""
    n = len(seqs)
    flat: list[int] = []
    gather = flat.extend
    for s in seqs:
        p, ids = s.num_computed_tokens, s.token_ids
        gather((p, s.block_row, len(ids), ids[p]))
    start, rows, lengths, token_ids = np.array(flat, dtype=np.int64).reshape(n, 4).T
    tokens = np.empty((4, n), dtype=np.int64)
    tokens[0] = token_ids
    feeds = _placeholders(tokens[0])
    tokens[1] = start
    tokens[2] = tables.array[rows, start // block_size]
    tokens[3] = start % block_size
    context_lens = start + 1
    num_blocks = tables.lengths[rows]
    if (context_lens == lengths).all():   # every sequence samples (the rule, but for a prompt's last chunk)
        sampled_list, sample_index = list(range(n)), np.arange(n)
    else:
        sampled = np.flatnonzero(context_lens == lengths)
        sampled_list, sample_index = sampled.tolist(), sampled
    return StepInputs(tokens, np.ones(n, dtype=np.int64), context_lens, tables.array[rows, :num_blocks.max()],
                      num_blocks, sampled_list, sample_index, True, feeds)


def _placeholders(token_ids: np.ndarray) -> np.ndarray:
    """[2, F]: the columns of the placeholder tokens (negative: -1 - j stands for row j of the previous step's
    sampled tokens) and those rows; the placeholders become 0 here and are filled in on the device."""
    feed = np.flatnonzero(token_ids < 0)
    feeds = np.empty((2, len(feed)), dtype=np.int64)
    feeds[0] = feed
    feeds[1] = -1 - token_ids[feed]
    token_ids[feed] = 0
    return feeds
