"""CUDA graphs of the decode step: one per batch size, replayed with the batch padded to the next size up.

A decode step of an 8B model launches hundreds of small kernels; launched from Python they leave the GPU idle
most of the step at small batches. A graph launches them all at once. What a graph reads must sit at the
addresses it was captured with: the step's inputs go through a static buffer (`rows`), the page tables through
the attention backend's graph wrappers (planned on the host before each replay), and the weights and KV cache
are never reallocated (a parked engine unmaps their memory but keeps the addresses). The graphs, their inputs
and outputs live in torch's allocator, which a park leaves alone.

Capturing every size takes ~1.5 s on an H200 (20 sizes), which a cold start would pay before its first token, so
graphs are captured lazily: a decode step whose size has no graph yet captures it first (~75 ms, once), and the
engine captures the rest while it is idle (`capture_next`). The first request of a restored replica, a batch of
one, costs one capture instead of twenty.

Rows past the real batch are padding: token 0 at position 0, writing its K/V into the scratch block that the
block manager never hands out, attending to that block only; their logits are dropped.
"""
import bisect
import logging
import time

import numpy as np
import torch

from .attention import AttentionBatch

logger = logging.getLogger(__name__)


ROW_ALIGN = 8   # int64s: a step's input rows start 64 bytes apart at least


def row_width(tokens: int) -> int:
    """The stride, in int64s, of a step's [4, tokens] input rows. Triton compiles a kernel once per combination of
    its pointers' 16-byte alignment, so rows `tokens` apart (row 3, the slot offsets the K/V write reads, 24 bytes
    in for one token) would compile a second variant of that kernel for every odd length."""
    return -(-tokens // ROW_ALIGN) * ROW_ALIGN


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 1, 16))
    return sorted({s for s in sizes if s <= max_num_seqs} | {max_num_seqs})


class DecodeGraphs:
    def __init__(self, model, attention, kv_caches: list[torch.Tensor], batch_sizes: list[int],
                 max_blocks_per_seq: int, scratch_block: int, capture: list[int] | None = None):
        """`capture`: the sizes to capture now (default: all of them, the largest first); the rest wait for
        `capture_next` or the first step that needs them."""
        self.model, self.attention, self.kv_caches = model, attention, kv_caches
        self.batch_sizes = sorted(batch_sizes)
        self.max_blocks_per_seq = max_blocks_per_seq
        self.scratch_block = scratch_block
        device = kv_caches[0].device
        # The step's inputs, [4, size] for a graph of `size` (token ids, positions, block of each token's KV slot,
        # offset in that block): the first 4 * row_width(size) elements, rows row_width(size) apart, so one copy
        # from the pinned buffer fills them (a strided destination took a copy to a temporary and a kernel besides)
        largest = 4 * row_width(self.batch_sizes[-1])
        self._inputs = torch.zeros(largest, dtype=torch.long, device=device)
        self._pinned_inputs = torch.zeros(largest, dtype=torch.long, pin_memory=device.type == "cuda")
        self._host_inputs = self._pinned_inputs.numpy()
        # per size: the copy's destination and source, and the graph's [4, size] view (slicing a tensor costs a
        # few microseconds of host time on the GPU machine, every step)
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = torch.cuda.graph_pool_handle()  # one memory pool for all of them: only one replays at a time
        self.capture_seconds = 0.0  # spent capturing so far
        for size in sorted(self.batch_sizes if capture is None else capture, reverse=True):
            self.capture(size)      # the largest first, so smaller graphs reuse its memory pool

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    @property
    def pending(self) -> list[int]:
        """Sizes not captured yet, the smallest first (small batches are the common ones)."""
        return [s for s in self.batch_sizes if s not in self.graphs]

    def rows(self, size: int) -> torch.Tensor:
        """The inputs [4, size] a graph of `size` reads."""
        return self._size_views(size)[2]

    def _size_views(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        views = self._views.get(size)
        if views is None:
            width = row_width(size)
            inputs = self._inputs[:4 * width]
            views = self._views[size] = (inputs, self._pinned_inputs[:4 * width], inputs.view(4, width)[:, :size])
        return views

    def capture(self, size: int) -> None:
        """Capture the graph of `size` sequences (no-op when it exists). It writes only the scratch block."""
        if size in self.graphs:
            return
        began = time.perf_counter()
        self.attention.add_graph_batch_size(size, self.max_blocks_per_seq)
        inputs = np.zeros((4, size), dtype=np.int64)
        inputs[2] = self.scratch_block
        self.prepare(inputs, np.full((size, 1), self.scratch_block, dtype=np.int32), np.ones(size, dtype=np.int32),
                     np.ones(size, dtype=np.int32))
        self._forward(size)   # warm-up: loads kernels and settles the allocator outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.logits[size] = self._forward(size)
        self.graphs[size] = graph
        torch.cuda.synchronize(self.kv_caches[0].device)
        self.capture_seconds += time.perf_counter() - began

    def capture_next(self) -> bool:
        """Capture the smallest pending size; False when none was left."""
        pending = self.pending
        if pending:
            self.capture(pending[0])
        return bool(pending)

    def batch_size_for(self, num_seqs: int) -> int | None:
        """The smallest graph size that holds `num_seqs` sequences, or None when none does."""
        i = bisect.bisect_left(self.batch_sizes, num_seqs)
        return self.batch_sizes[i] if i < len(self.batch_sizes) else None

    def prepare(self, inputs: np.ndarray, block_tables: np.ndarray, num_blocks: np.ndarray,
                context_lens: np.ndarray) -> int:
        """Pad one token per sequence to a graph's batch size, copy it in and plan attention; return the size.
        `inputs` [4, n]: token ids, positions, slot blocks and slot offsets; `block_tables` [n, W] whose row i
        starts with sequence i's num_blocks[i] blocks. The graph of that size must exist or be the one being
        captured."""
        n = inputs.shape[1]
        size = self.batch_size_for(n)
        if size is None:
            raise ValueError(f"{n} sequences are more than the largest graph holds ({self.batch_sizes[-1]})")
        # The pinned buffer is rewritten by the next step's prepare, which the model runner starts only after this
        # step's copies ran (as the attention plan's)
        host = self._host_inputs[:4 * row_width(size)].reshape(4, -1)
        host[:, :n] = inputs
        host[:, n:] = 0
        host[2, n:] = self.scratch_block
        device_inputs, pinned_inputs, rows = self._size_views(size)
        device_inputs.copy_(pinned_inputs, non_blocking=True)
        tables = np.empty((size, max(block_tables.shape[1], 1)), dtype=np.int32)
        tables[:n, :block_tables.shape[1]] = block_tables
        tables[n:, 0] = self.scratch_block
        padded_blocks, padded_lens = np.ones(size, dtype=np.int32), np.ones(size, dtype=np.int32)
        padded_blocks[:n], padded_lens[:n] = num_blocks, context_lens
        self.attention.plan(AttentionBatch(
            query_lens=np.ones(size, dtype=np.int32), context_lens=padded_lens, block_tables=tables,
            num_blocks=padded_blocks, slot_blocks=rows[2], slot_offsets=rows[3]),
            graph_batch_size=size)
        return size

    def replay(self, size: int, num_seqs: int) -> torch.Tensor:
        """Logits [num_seqs, vocab] of the batch last prepared; valid until the next replay."""
        self.graphs[size].replay()
        return self.logits[size][:num_seqs]

    def _forward(self, size: int) -> torch.Tensor:
        token_ids, positions = self.rows(size)[:2]
        hidden = self.model(token_ids, positions, self.attention, self.kv_caches)
        return self.model.compute_logits(hidden)
