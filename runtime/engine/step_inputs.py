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
    starts = [s.num_computed_tokens for s in seqs]
    start = np.array(starts, dtype=np.int64)
    rows = np.array([s.block_row for s in seqs], dtype=np.intp)
    decode = sum(counts) == len(counts)   # every count is at least 1
    if decode:
        token_ids = [s.token_ids[p] for s, p in zip(seqs, starts)]
        query_lens = np.ones(len(seqs), dtype=np.int64)
        ends = np.arange(1, len(seqs) + 1)
        positions, token_rows = start, rows
    else:
        token_ids = []
        for s, p, n in zip(seqs, starts, counts):
            token_ids += s.token_ids[p:p + n]
        query_lens = np.array(counts, dtype=np.int64)
        ends = np.cumsum(query_lens)
        positions = np.arange(ends[-1]) - np.repeat(ends - query_lens - start, query_lens)
        token_rows = np.repeat(rows, query_lens)
    tokens = np.empty((4, len(token_ids)), dtype=np.int64)
    tokens[0] = token_ids
    feed = np.flatnonzero(tokens[0] < 0)
    feeds = np.stack([feed, -1 - tokens[0, feed]])
    tokens[0, feed] = 0
    tokens[1] = positions
    tokens[2] = tables.array[token_rows, positions // block_size]
    tokens[3] = positions % block_size
    context_lens = start + query_lens
    num_blocks = tables.lengths[rows]
    lengths = np.array([len(s.token_ids) for s in seqs], dtype=np.int64)
    sampled = np.flatnonzero(context_lens == lengths)
    return StepInputs(tokens, query_lens, context_lens, tables.array[rows, :num_blocks.max()], num_blocks,
                      sampled.tolist(), ends[sampled] - 1, decode, feeds)
