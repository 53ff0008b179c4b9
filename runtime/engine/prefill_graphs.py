"""Piecewise CUDA graphs of the steps that prefill: each layer's products and fused kernels replayed from graphs,
its attention run eagerly between them.

A step that prefills runs eagerly: the decode graphs hold one token per sequence, and a prefill's attention
depends on how the step's tokens split into sequences, which a graph cannot hold fixed. Launched from Python, such a
step of a small model is all host: on the H200, a 256-token prompt of the Qwen3-0.6B shape took 11-16 ms of wall
time for 1.2 ms of kernels (332 launches: ~29 us of host a cuBLAS product, ~40 us a Triton kernel, ~80 us
flashinfer's prefill call), and the 8B shape's took 19-24 ms; that time is the time to first token of a short prompt,
and a stall of every stream decoding beside it.

Here a step's tokens are padded to the next of a few sizes, and each size has one graph per stretch between two
attentions: the first from the embedding to the first layer's q/k/v (normed, rotated, K/V written to the cache),
then each from one layer's attention output to the next layer's q/k/v, the last to the final norm. Between two
replays, the layer's attention runs on the step's real tokens, planned on the host as an eager step plans it, from
q in the graph's output to a buffer the next graph reads. Padding rows are token 0 at position 0, writing their K/V
into the scratch block that no request owns; attention skips them and their rows of the output are dropped.

Sizes stop where a step stops being host-bound: where its products alone take about as long on the GPU as an eager
step's host work (HOST_BOUND_FLOPS), a graph saves nothing and its padding costs. They are captured while the engine
idles, after the decode graphs (0.2-0.3 s in all for the 0.6B and 8B shapes); a step whose size has none yet runs
eagerly. Measured on the H200 against the same engine without them: a 256-token prefill step 15.5 -> 4.1 ms (0.6B)
and 18.9 -> 12.5 ms (8B), one beside 60 decoding sequences 19.8 -> 6.5 and 27.8 -> 18.3 ms; served, the time to
first token at concurrency 1 27.4 -> 9.6 ms (0.6B) and 31.8 -> 15.2 ms (8B), at 4 58.2 -> 11.5 and 64.9 -> 18.8 ms
(bench/README.md, session 31). Answers are unchanged: the GPU tests compare them with eager prefills.

Each piece ends by copying the layer's q into one buffer that every layer and size shares (one small copy kernel a
layer), and attention reads it there. Left a view of the q/k/v product, q kept that product of every layer and size
alive in the pool: ~1.9 GB for the 0.6B shape's sizes, ~0.2 GB for the 8B's, beside the KV cache that
gpu_memory_utilization sizes. Now they hold that buffer and each size's outputs, three tensors of hidden width a
size: 50 MB for the 0.6B shape's sizes, 38 MB for the 8B's (measured on the H200, when the 8B's stopped at
256 tokens; its 512 adds 12.6 MB of outputs by that count, not measured).
"""
import bisect
import time

import numpy as np
import torch

from .attention import AttentionBatch

# An eager step's host work (11-24 ms on the H200 machine, above; 15-29 ms for the 4B and 8B shapes' steps of 256 to
# 1,024 tokens in bench/results/prefill_steps.json) is what its products take on the GPU at about this many FLOPs (at
# ~800 TFLOPS); a step of more tokens is bound by the GPU, where a graph saves nothing and its padding costs. At 8e12
# the 4B shape's 1,024-token size fell out by 3%, and its steps of 513 to 1,024 tokens ran eagerly in 20-30 ms where
# that graph takes 14-18 (the bench, in one run); the 8B's 512 is in by the same bound (12.8 ms against 14.8 eager
# at 512 tokens, 15.8 against 13.9 at 288), its 1,024 out (22.5 ms against 18.4 eager at 768 tokens).
HOST_BOUND_FLOPS = 1.1e13
SIZES = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def prefill_graph_sizes(max_num_batched_tokens: int, parameters: int) -> list[int]:
    """The token counts that get graphs for a model of `parameters` weights (2 FLOPs each a token)."""
    return [s for s in SIZES if s <= max_num_batched_tokens and 2 * parameters * s <= HOST_BOUND_FLOPS]


class _Cut:
    """Stands in for the attention backend while a size is captured: each layer's attention ends the graph being
    captured there, notes where its q sits and which cache it reads, and begins the next graph, which reads the
    attention's output from `out`. With no pieces (the warm-up), it only returns `out`."""

    def __init__(self, batch: AttentionBatch, out: torch.Tensor, q_buffer: torch.Tensor, pool, pieces: list | None):
        self.batch, self.out, self.q_buffer, self.pool, self.pieces = batch, out, q_buffer, pool, pieces
        self.slots: list[tuple[torch.Tensor, torch.Tensor]] = []

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, k: torch.Tensor | None = None,
               v: torch.Tensor | None = None, quantize: bool = False) -> torch.Tensor:
        if self.pieces is not None:
            # q is a view of the layer's q/k/v product: kept as the slot, it would keep that product alive in the pool
            static = self.q_buffer.view(-1)[:q.numel()].view(q.shape)
            static.copy_(q)
            self.pieces[-1].capture_end()
            self.slots.append((static, kv_cache))
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=self.pool)
            self.pieces.append(graph)
        return self.out[:q.shape[0]]


class PrefillGraphs:
    def __init__(self, model, attention, kv_caches: list[torch.Tensor], sizes: list[int], scratch_block: int):
        self.model, self.attention, self.kv_caches = model, attention, kv_caches
        self.sizes = sorted(sizes)
        self.scratch_block = scratch_block
        device = kv_caches[0].device
        largest = self.sizes[-1]
        # the step's inputs [4, size] (token ids, positions, slot blocks, slot offsets), as the decode graphs' are
        self._inputs = torch.zeros(4 * largest, dtype=torch.long, device=device)
        self._pinned_inputs = torch.zeros(4 * largest, dtype=torch.long, pin_memory=True)
        self._host_inputs = self._pinned_inputs.numpy()
        # each layer's attention output, which the graph after it reads (one layer at a time uses it)
        heads, head_dim = attention.num_heads, attention.head_dim
        self._out = torch.zeros(largest, heads, head_dim, dtype=attention.dtype, device=device)
        # each layer's q, copied out of its q/k/v product at the end of the graph before its attention
        self._q = torch.zeros_like(self._out)
        # per size: the graphs in order, each layer's (q, cache) between them, and the final hidden states
        self.captured: dict[int, tuple[list[torch.cuda.CUDAGraph], list[tuple[torch.Tensor, torch.Tensor]],
                                       torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self._stream = torch.cuda.Stream(device)
        self.capture_seconds = 0.0

    @property
    def pending(self) -> list[int]:
        """Sizes not captured yet, the smallest first."""
        return [s for s in self.sizes if s not in self.captured]

    def size_for(self, num_tokens: int) -> int | None:
        """The captured size a step of `num_tokens` tokens pads to, or None (it runs eagerly)."""
        i = bisect.bisect_left(self.sizes, num_tokens)
        size = self.sizes[i] if i < len(self.sizes) else None
        return size if size in self.captured else None

    def capture_next(self) -> bool:
        """Capture the smallest pending size; False when none was left."""
        pending = self.pending
        if pending:
            self.capture(pending[0])
        return bool(pending)

    def rows(self, size: int) -> torch.Tensor:
        return self._inputs[:4 * size].view(4, size)

    def capture(self, size: int) -> None:
        """Capture the graphs of `size` tokens (no-op when they exist). They write only the scratch block."""
        if size in self.captured:
            return
        began = time.perf_counter()
        device = self._inputs.device
        inputs = np.zeros((4, size), dtype=np.int64)
        inputs[2] = self.scratch_block
        self.prepare(inputs)
        rows = self.rows(size)
        batch = AttentionBatch(np.array([size], dtype=np.int32), np.array([size], dtype=np.int32),
                               np.full((1, 1), self.scratch_block, dtype=np.int32), np.ones(1, dtype=np.int32),
                               rows[2], rows[3])
        torch.cuda.synchronize(device)
        self._stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self._stream):
            # warm-up outside the capture: loads the kernels of this size and settles the allocator
            self.model(rows[0], rows[1], _Cut(batch, self._out, self._q, self.pool, None), self.kv_caches)
            torch.cuda.synchronize(device)
            pieces = [torch.cuda.CUDAGraph()]
            cut = _Cut(batch, self._out, self._q, self.pool, pieces)
            pieces[0].capture_begin(pool=self.pool)
            try:
                hidden = self.model(rows[0], rows[1], cut, self.kv_caches)
            finally:
                pieces[-1].capture_end()
        torch.cuda.current_stream(device).wait_stream(self._stream)
        torch.cuda.synchronize(device)
        self.captured[size] = (pieces, cut.slots, hidden)
        self.capture_seconds += time.perf_counter() - began

    def prepare(self, inputs: np.ndarray) -> int:
        """Pad the step's inputs [4, n] to the size of the next graph up and queue their copy; return the size."""
        n = inputs.shape[1]
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        # the pinned buffer is rewritten by the next step's prepare, which the model runner starts only after this
        # step's copies ran (as with the attention plan's)
        host = self._host_inputs[:4 * size].reshape(4, size)
        host[:, :n] = inputs
        host[:, n:] = 0
        host[2, n:] = self.scratch_block
        self._inputs[:4 * size].copy_(self._pinned_inputs[:4 * size], non_blocking=True)
        return size

    def replay(self, size: int, num_tokens: int) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of the step last prepared, its attention planned already; valid until
        the next replay."""
        pieces, slots, hidden = self.captured[size]
        out = self._out[:num_tokens]
        attend = self.attention.attend_into
        for graph, (q, kv_cache) in zip(pieces, slots):
            graph.replay()
            attend(q[:num_tokens], kv_cache, out)
        pieces[-1].replay()
        return hidden[:num_tokens]
