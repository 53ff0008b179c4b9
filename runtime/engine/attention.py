"""Paged attention behind one interface: `plan(batch)` once per step, then `attend(q, kv_cache, k, v)` per layer.

KV cache layout per layer: [num_blocks, 2 (K, V), block_size, num_kv_heads, head_dim] (flashinfer's NHD), in the
model's dtype or, with EngineConfig.kv_cache_dtype="fp8", float8 e4m3 (a scale of 1), which every backend reads back
to q's dtype.
Tokens of a step are flattened: sequence after sequence, each sequence's new tokens in order.
"""
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from . import paged_decode
from .paged_decode import PagedDecode, StreamedDecode, streamed_config, streamed_pool


@dataclass
class AttentionBatch:
    query_lens: np.ndarray         # [B] new tokens per sequence this step
    context_lens: np.ndarray       # [B] tokens in the cache per sequence after this step (cached + new)
    block_tables: np.ndarray       # [B, W] int32: row i starts with sequence i's num_blocks[i] blocks
    num_blocks: np.ndarray         # [B] blocks per sequence, covering context_lens
    slot_blocks: torch.Tensor      # [T] block of each new token (on the device)
    slot_offsets: torch.Tensor     # [T] offset in that block

    @property
    def is_decode_only(self) -> bool:
        return bool((self.query_lens == 1).all())

    def tables(self) -> list[np.ndarray]:
        """Each sequence's blocks."""
        return [row[:n] for row, n in zip(self.block_tables, self.num_blocks.tolist())]

    def paged_kv(self) -> tuple[np.ndarray, np.ndarray]:
        """The tables as flashinfer takes them: (indptr [B + 1], indices), int32."""
        indptr = np.zeros(len(self.num_blocks) + 1, dtype=np.int32)
        np.cumsum(self.num_blocks, out=indptr[1:])
        width = self.block_tables.shape[1]
        return indptr, self.block_tables[np.arange(width) < self.num_blocks[:, None]].astype(np.int32, copy=False)


# Eager prefill steps on flashinfer attend over the step's own K and V in the model's dtype (its ragged prefill: fa3
# on Hopper), merged with a paged attention over each prompt's cached prefix where one has some, instead of over the
# cache alone: with an FP8 cache and a bf16 query flashinfer's paged prefill runs fa2 (its fa3 takes an FP8 cache only
# with an FP8 query). Prefill graphs' steps keep the cache's. Off: on the H200 (session 56) the kernel alone wins
# (kernel_bench.py --parts prefill_attention, a layer's 8,192-token step: 127 against the FP8 cache's 245 us at 14
# prompts of 585 tokens, 154 against 340 at 8 of 1,024, 448 against 1,148 at 2 of 4,096), but end to end it loses
# (bench/engine/ab.py --b runtime.engine.attention.RAGGED_PREFILL=True -- --models 8B --parts fp8_kv, two rounds:
# offline 14,537.9 against 14,375.7 output tok/s, the prefill steps' GPU time 2.09 against 2.15 s); likely (not
# measured) because most of the offline run's steps continue a prompt cut at the step before, and the prefix's paged
# attention and the merge then ran over every row of the step, masked. They now take the rows of prefix_span alone
# (the continued prompt's, there), untimed: the same ab.py again. The kernel warm-up (model_runner.warm_kernels) runs a
# second chunk of its prompt, so the prefix's attention and the merge load there.
RAGGED_PREFILL = False


def prefix_tables(batch: AttentionBatch, block_size: int, span: slice = slice(None)
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The paged attention over the cached prefix (its context before this step's tokens) of each sequence in `span`
    (all, or the batch's sequences from one with a prefix to the last with one: prefix_span), as flashinfer takes
    it: (indptr [B + 1], indices, last page lengths [B], int32; rows [T] bool: the span's tokens whose sequence has
    a prefix). A sequence with none gets its first block's first token, whose attention the merge leaves out
    (flashinfer's paged kernels take no empty context)."""
    query_lens = batch.query_lens[span]
    prefix = batch.context_lens[span] - query_lens
    pages = np.maximum(-(-prefix // block_size), 1).astype(np.int32)
    indptr = np.zeros(len(pages) + 1, dtype=np.int32)
    np.cumsum(pages, out=indptr[1:])
    tables = batch.block_tables[span]
    indices = tables[np.arange(tables.shape[1]) < pages[:, None]].astype(np.int32, copy=False)
    last = np.where(prefix > 0, (prefix - 1) % block_size + 1, 1).astype(np.int32)
    return indptr, indices, last, np.repeat(prefix > 0, query_lens)


def prefix_span(batch: AttentionBatch) -> tuple[slice, int, int] | None:
    """The sequences from the batch's first with a cached prefix to its last (a slice), and their tokens' rows [a,
    b) in the step; None where none has one. A step of the offline run continues, most often, one prompt cut at the
    step before (its first sequence): the prefix's attention and the merge then take that prompt's rows alone, not
    the step's thousands."""
    having = np.flatnonzero(batch.context_lens > batch.query_lens)
    if not len(having):
        return None
    rows = np.concatenate([[0], np.cumsum(batch.query_lens)])
    first, last = int(having[0]), int(having[-1]) + 1
    return slice(first, last), int(rows[first]), int(rows[last])


class SdpaBackend:
    """Gathers each sequence's K/V from its blocks and runs torch SDPA with a causal mask offset by the prefix."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, scale: float):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.block_size, self.scale = block_size, scale

    def plan(self, batch: AttentionBatch) -> None:
        device = batch.slot_blocks.device
        self.batch = batch
        self.tables, self.masks = [], []
        for n, ctx, table in zip(batch.query_lens.tolist(), batch.context_lens.tolist(), batch.tables()):
            self.tables.append(torch.from_numpy(table.astype(np.int64)).to(device))
            query_pos = torch.arange(ctx - n, ctx, device=device)
            self.masks.append(torch.arange(ctx, device=device)[None, :] <= query_pos[:, None])

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, k: torch.Tensor | None = None,
               v: torch.Tensor | None = None, quantize: bool = False) -> torch.Tensor:
        """q's attention over the cache, which holds the step's K and V already (fused.norm_rope_store_); k and v,
        the step's own, are not read here, nor is `quantize` (always the output in q's dtype)."""
        out = torch.empty_like(q)
        start = 0
        for n, ctx, table, mask in zip(self.batch.query_lens.tolist(), self.batch.context_lens.tolist(), self.tables,
                                       self.masks):
            kv = kv_cache[table].transpose(0, 1).reshape(2, -1, self.num_kv_heads, self.head_dim)[:, :ctx].to(q.dtype)
            o = F.scaled_dot_product_attention(
                q[start:start + n].transpose(0, 1), kv[0].transpose(0, 1), kv[1].transpose(0, 1),
                attn_mask=mask, scale=self.scale, enable_gqa=True)
            out[start:start + n] = o.transpose(0, 1)
            start += n
        return out


class Staged:
    """Host arrays on the device, queued from a pinned buffer (grown as needed) that the next call rewrites. A graph
    wrapper copies page indices given on the host into its buffer with a blocking copy, which waited for the step
    the device was running and so undid overlap scheduling (on the H200, 6.4 ms of host time per batch-64 step);
    and a copy from pageable memory waits the same way. The model runner starts the next plan only after this
    plan's copies ran."""

    def __init__(self, dtype: torch.dtype, device: torch.device, least: int):
        self.dtype, self.device, self.least = dtype, device, least
        self.pinned: torch.Tensor | None = None
        self.staged: torch.Tensor | None = None

    def __call__(self, values: np.ndarray) -> torch.Tensor:
        n = len(values)
        if self.pinned is None or self.staged is None or self.pinned.numel() < n:
            size = max(n, 2 * (0 if self.pinned is None else self.pinned.numel()), self.least)
            self.pinned = torch.empty(size, dtype=self.dtype, pin_memory=self.device.type == "cuda")
            self.staged = torch.empty(size, dtype=self.dtype, device=self.device)
        self.pinned[:n].numpy()[:] = values
        self.staged[:n].copy_(self.pinned[:n], non_blocking=True)
        return self.staged[:n]


class FlashInferBackend:
    """flashinfer's paged kernels: the decode wrapper when every sequence adds one token, else the prefill one.

    A decode batch replayed by a CUDA graph runs, up to `triton_graph_max_batch` sequences, paged_decode's Triton
    kernels, and above, a flashinfer decode wrapper: either of its own fixed batch size, whose page tables live in
    buffers the graph captured (`plan` refreshes them on the host side of each step). Measured on the H200
    (bench/engine/decode_profile.py), the Triton kernels take 8.6 us where flashinfer takes 16.2 at batch 1 and a
    256-token context, but 69 us where it takes 31 at batch 16 and 1024 tokens. With `streamed_min_batch`, graphs
    of at least that many sequences run paged_decode's streamed kernel instead of flashinfer's (EngineConfig's
    default: 16, from which bench/engine/kernel_bench.py measured it faster on the H200; 245.8 against 365.2 us at
    batch 256 and 1024 tokens; a `streamed_min_batch` under `triton_graph_max_batch` takes those graphs from the
    split kernel too: kernel_bench.py --parts attention_small compares them). flashinfer's decode stays for steps
    without a graph, and for the graphs above `triton_graph_max_batch` when `streamed_min_batch` is None.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, scale: float,
                 dtype: torch.dtype, device: torch.device, triton_graph_max_batch: int = 8,
                 streamed_min_batch: int | None = None, kv_dtype: torch.dtype | None = None):
        import flashinfer

        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.block_size, self.scale, self.dtype = block_size, scale, dtype
        self.kv_dtype = kv_dtype or dtype
        self.device = device
        self.triton_graph_max_batch = triton_graph_max_batch
        self.streamed_min_batch = streamed_min_batch
        self.workspace = torch.zeros(256 * 1024 * 1024, dtype=torch.uint8, device=device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.triton_graph_decode: dict[int, PagedDecode] = {}   # batch size -> Triton decode of graphs this size
        self.graph_decode: dict[int, Any] = {}    # batch size -> graph-safe flashinfer wrapper (flashinfer is untyped)
        self.graph: PagedDecode | None = None       # the Triton decode of the batch planned last, if any
        self.max_blocks_per_seq: int | None = None   # the graphs' table width, once one was added
        self._device_indices = Staged(torch.int32, device, 1 << 16)   # the graph wrappers' page indices
        self.ragged: Any = None   # with RAGGED_PREFILL: the step's own K/V, the prefix's paged attention, its rows
        self.prefix: Any = None
        self.prefix_span: tuple[slice, int, int] | None = None   # prefix_span's, for the planned step
        self.prefix_rows: torch.Tensor | None = None   # which of the span's rows have a prefix (None: every one)
        self.fresh = False   # the prefill step last planned may attend over its own K and V
        self._device_rows = Staged(torch.bool, device, 1 << 14)

    def add_graph_batch_size(self, batch_size: int, max_blocks_per_seq: int) -> None:
        """The decode attention of graphs of `batch_size` sequences; only one graph runs at a time, so the
        flashinfer wrappers share the float workspace."""
        import flashinfer

        self.max_blocks_per_seq = max_blocks_per_seq
        shape = (batch_size, max_blocks_per_seq, self.block_size, self.num_heads, self.num_kv_heads, self.head_dim,
                 self.device)
        if self.streamed_min_batch is not None and batch_size >= self.streamed_min_batch:
            sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            self.triton_graph_decode[batch_size] = StreamedDecode(
                *shape, pool=streamed_pool(batch_size, self.num_kv_heads, sms),
                **streamed_config(self.kv_dtype, self.head_dim))
            return
        if batch_size <= self.triton_graph_max_batch:
            self.triton_graph_decode[batch_size] = PagedDecode(*shape)
            return

        def buffer(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=self.device)

        self.graph_decode[batch_size] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=buffer(batch_size + 1),
            paged_kv_indices_buffer=buffer(batch_size * max_blocks_per_seq),
            paged_kv_last_page_len_buffer=buffer(batch_size))

    def build_decode_module(self) -> None:
        """Plans a one-sequence decode on the eager decode wrapper, which builds (or loads) flashinfer's decode
        module. Graphs of more than `triton_graph_max_batch` sequences run it; a full boot's warm-up decodes at
        most two, so without this a node compiled the module inside its first step of nine or more sequences (on
        the H200, seconds of every running request's time). Reads no KV: the next plan replaces this one."""
        one = np.ones(1, dtype=np.int32)
        slots = torch.zeros(1, dtype=torch.long, device=self.device)
        self.plan(AttentionBatch(query_lens=one, context_lens=one, block_tables=np.zeros((1, 1), dtype=np.int32),
                                 num_blocks=one, slot_blocks=slots, slot_offsets=slots))

    def build_streamed_kernels(self) -> None:
        """With streamed_min_batch, compiles (or loads) the streamed decode kernel on a one-sequence batch shaped as
        the graphs' (table width, q's strides, the pool), so a node's first large batch does not compile it inside
        a step. Reads no real KV."""
        if self.streamed_min_batch is None or self.max_blocks_per_seq is None:
            return
        cache = torch.zeros(2, 2, self.block_size, self.num_kv_heads, self.head_dim, dtype=self.kv_dtype,
                            device=self.device)
        qkv = torch.zeros(1, self.num_heads + 2 * self.num_kv_heads, self.head_dim, dtype=self.dtype,
                          device=self.device)
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        decode = StreamedDecode(1, self.max_blocks_per_seq, self.block_size, self.num_heads, self.num_kv_heads,
                                self.head_dim, self.device, pool=streamed_pool(1, self.num_kv_heads, sms),
                                **streamed_config(self.kv_dtype, self.head_dim))
        decode.stage(np.zeros((1, 1), dtype=np.int32), np.ones(1, dtype=np.int32))
        decode.forward(qkv[:, :self.num_heads], cache, self.scale)
        if paged_decode.QUANTIZED_OUT:   # the variant an FP8 o_proj's layers run
            decode.forward_quantized(qkv[:, :self.num_heads], cache, self.scale)
        torch.cuda.synchronize(self.device)

    def plan(self, batch: AttentionBatch, graph_batch_size: int | None = None) -> None:
        """`graph_batch_size`: plan the graph's attention of that size (the batch is padded to it)."""
        self.batch = batch
        self.graph = None
        self.fresh = False
        if graph_batch_size and graph_batch_size in self.triton_graph_decode:
            self.graph = self.triton_graph_decode[graph_batch_size]
            self.graph.stage(batch.block_tables, batch.context_lens)
            return
        indptr, indices = batch.paged_kv()
        kv_indptr, kv_indices = torch.from_numpy(indptr), torch.from_numpy(indices)
        last_page_len = torch.from_numpy(((batch.context_lens - 1) % self.block_size + 1).astype(np.int32))
        common = dict(num_kv_heads=self.num_kv_heads, page_size=self.block_size, sm_scale=self.scale,
                      q_data_type=self.dtype, kv_data_type=self.kv_dtype)
        if batch.is_decode_only:
            self.wrapper = self.graph_decode[graph_batch_size] if graph_batch_size else self.decode
            if graph_batch_size:
                kv_indices = self._device_indices(indices)
            self.wrapper.plan(kv_indptr, kv_indices, last_page_len, num_qo_heads=self.num_heads,
                             head_dim=self.head_dim, **common)
        else:
            self.wrapper = self.prefill
            qo_indptr = torch.from_numpy(np.concatenate([[0], np.cumsum(batch.query_lens)]).astype(np.int32))
            self.prefill.plan(qo_indptr, kv_indptr, kv_indices, last_page_len, num_qo_heads=self.num_heads,
                              head_dim_qk=self.head_dim, causal=True, **common)
            if RAGGED_PREFILL:
                self._plan_fresh(batch, qo_indptr, common)

    def _plan_fresh(self, batch: AttentionBatch, qo_indptr: torch.Tensor, common: dict) -> None:
        """RAGGED_PREFILL's plans: the step's tokens over their own K and V (causal), and where a sequence has a
        cached prefix, over the prefix's pages (every token sees all of it)."""
        import flashinfer

        if self.ragged is None:
            self.ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD")
            self.prefix = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.ragged.plan(qo_indptr, qo_indptr, num_qo_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                         head_dim_qk=self.head_dim, causal=True, sm_scale=self.scale, q_data_type=self.dtype,
                         kv_data_type=self.dtype)
        self.prefix_rows, self.prefix_span = None, prefix_span(batch)
        if self.prefix_span is not None:
            span, first_row, _ = self.prefix_span
            indptr, indices, last, rows = prefix_tables(batch, self.block_size, span)
            self.prefix.plan(qo_indptr[span.start:span.stop + 1] - first_row, torch.from_numpy(indptr),
                             torch.from_numpy(indices), torch.from_numpy(last), num_qo_heads=self.num_heads,
                             head_dim_qk=self.head_dim, causal=False, **common)
            self.prefix_rows = None if rows.all() else self._device_rows(rows)
        self.fresh = True

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, k: torch.Tensor | None = None,
               v: torch.Tensor | None = None, quantize: bool = False
               ) -> "torch.Tensor | tuple[torch.Tensor, torch.Tensor]":
        """q's attention over the cache, which holds the step's K and V already (fused.norm_rope_store_). With
        RAGGED_PREFILL, a prefill step given its own K and V [T, Hk, D] (in q's dtype) attends over them, and over
        the cache only for the prefixes. `quantize`: the caller's product takes an FP8 input; a graph's streamed
        kernel with paged_decode.QUANTIZED_OUT then returns the output's rows quantized to e4m3 [T, Hq D] and their
        scales [T, 1] instead (fp8.quantize_tokens' values)."""
        if self.graph is not None:
            if quantize and paged_decode.QUANTIZED_OUT and isinstance(self.graph, StreamedDecode):
                return self.graph.forward_quantized(q, kv_cache, self.scale)
            return self.graph.forward(q, kv_cache, self.scale)
        if self.wrapper is self.prefill and self.fresh and k is not None and v is not None:
            if self.prefix_span is None:
                return self.ragged.run(q, k, v)
            import flashinfer

            out, lse = self.ragged.run(q, k, v, return_lse=True)
            _, a, b = self.prefix_span   # the span's rows: views, merged in place
            prefix_out, prefix_lse = self.prefix.run(q[a:b], kv_cache, return_lse=True)
            flashinfer.merge_state_in_place(out[a:b], lse[a:b], prefix_out, prefix_lse, mask=self.prefix_rows)
            return out
        if self.wrapper is self.prefill:
            # given no output, flashinfer's prefill allocates it zeroed: a fill kernel a layer (~20 us of an eager
            # step's host time each) for rows its attention writes whole
            out = torch.empty((q.shape[0], self.num_heads, self.head_dim), dtype=q.dtype, device=q.device)
            self.wrapper.run(q, kv_cache, out=out)
            return out
        return self.wrapper.run(q, kv_cache)

    def attend_into(self, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor) -> None:
        """As `attend`, planned without a graph size, written into `out` (prefill_graphs.py: the buffer its graph
        after this layer's attention reads)."""
        self.wrapper.run(q, kv_cache, out=out)
