"""CUDA graphs of the decode step: one per batch size, replayed with the batch padded to the next size up.

A decode step of an 8B model launches hundreds of small kernels; launched from Python they leave the GPU idle
most of the step at small batches. A graph launches them all at once. What a graph reads must sit at the
addresses it was captured with: the step's inputs go through `inputs` (a static buffer), the page tables through
the attention backend's graph wrappers (planned on the host before each replay), and the weights and KV cache
are never reallocated (a parked engine unmaps their memory but keeps the addresses). The graphs, their inputs
and outputs live in torch's allocator, which a park leaves alone.

Rows past the real batch are padding: token 0 at position 0, writing its K/V into the scratch block that the
block manager never hands out, attending to that block only; their logits are dropped.
"""
import bisect
import logging

import torch

from .attention import AttentionBatch

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 1, 16))
    return sorted({s for s in sizes if s <= max_num_seqs} | {max_num_seqs})


class DecodeGraphs:
    def __init__(self, model, attention, kv_caches: list[torch.Tensor], batch_sizes: list[int],
                 max_blocks_per_seq: int, scratch_block: int):
        self.model, self.attention, self.kv_caches = model, attention, kv_caches
        self.batch_sizes = sorted(batch_sizes)
        self.scratch_block = scratch_block
        device = kv_caches[0].device
        # Rows: token ids, positions, block of each token's KV slot, offset in that block.
        self.inputs = torch.zeros(4, self.batch_sizes[-1], dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        pool = None
        for size in reversed(self.batch_sizes):   # the largest first, so smaller graphs reuse its memory pool
            attention.add_graph_batch_size(size, max_blocks_per_seq)
            self.prepare([0] * size, [0] * size, [scratch_block] * size, [0] * size, [[scratch_block]] * size,
                         [1] * size)
            self._forward(size)   # warm-up: loads kernels and settles the allocator outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(device)

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def batch_size_for(self, num_seqs: int) -> int | None:
        """The smallest graph that holds `num_seqs` sequences, or None when none does."""
        i = bisect.bisect_left(self.batch_sizes, num_seqs)
        return self.batch_sizes[i] if i < len(self.batch_sizes) else None

    def prepare(self, token_ids: list[int], positions: list[int], slot_blocks: list[int], slot_offsets: list[int],
                block_tables: list[list[int]], context_lens: list[int]) -> int:
        """Pad one token per sequence to a graph's batch size, copy it in and plan attention; return the size."""
        n = len(token_ids)
        size = self.batch_size_for(n)
        pad = size - n
        rows = torch.tensor([token_ids + [0] * pad, positions + [0] * pad,
                             slot_blocks + [self.scratch_block] * pad, slot_offsets + [0] * pad])
        self.inputs[:, :size].copy_(rows, non_blocking=True)
        self.attention.plan(AttentionBatch(
            query_lens=[1] * size, context_lens=context_lens + [1] * pad,
            block_tables=block_tables + [[self.scratch_block]] * pad,
            slot_blocks=self.inputs[2, :size], slot_offsets=self.inputs[3, :size]), graph_batch_size=size)
        return size

    def replay(self, size: int, num_seqs: int) -> torch.Tensor:
        """Logits [num_seqs, vocab] of the batch last prepared; valid until the next replay."""
        self.graphs[size].replay()
        return self.logits[size][:num_seqs]

    def _forward(self, size: int) -> torch.Tensor:
        token_ids, positions = self.inputs[0, :size], self.inputs[1, :size]
        hidden = self.model(token_ids, positions, self.attention, self.kv_caches)
        return self.model.compute_logits(hidden)
