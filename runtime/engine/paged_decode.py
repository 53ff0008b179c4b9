"""Decode attention over the paged KV cache in two Triton kernels, for the decode CUDA graphs.

flashinfer's decode kernel, planned for a CUDA graph, took 15.6 us per layer at batch 1 on the H200 (plus 2.5 us
to merge its splits) for a context of ~200 tokens: a tenth of the step, for 1% of the bytes it reads. These take
8.6 us; at batch 16 and more flashinfer is faster, and StreamedDecode below faster still (attention.py). Here the
context is cut into fixed splits of `split_tokens` (fewer, longer splits for larger batches), one program per
(sequence, KV head, split) runs every query head of its group against its split (online softmax), and a second
kernel merges the splits of each (sequence, head) by their log-sum-exp. The grid is fixed by the graph's batch
size and max_model_len; programs past a sequence's end return at once. Prefill and eager steps stay on flashinfer.
"""
from typing import Any

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only installs never capture graphs
    triton = None

from . import pdl
from .pdl import start as _pdl_start

BLOCK_TOKENS = 64   # tokens gathered per loop iteration
MERGE_CHUNK = 32    # splits the merge reads per loop iteration
# StreamedDecode.forward_quantized (FlashInferBackend.attend's, for an FP8 o_proj): the last of a token's KV-head
# programs to write its heads' output quantizes the token's row to e4m3 with its scale (fp8.quantize_tokens'
# arithmetic, on the bf16 row as stored), in place of the kernel that did it after attention: one kernel boundary
# fewer a layer (the quantizer took 2.9 us of a layer at 256 sequences on an H100). On since session 58, timed with
# LONGEST_FIRST and fused.PACKED_ROUND, the three together against none on an H100 (bench/engine/ab.py -- --models 8B
# --parts fp8_kv --skip-transformers, one round in each order): offline 13,596.4 and 13,557.0 output tok/s against
# 13,374.1 and 13,367.1 (+1.5%), the decode graphs' GPU time 8.19 s both times against 8.33 and 8.32, prefill 2.04 and
# 2.05 against 2.07 and 2.06, batch 1 271.5 against 265.9 and 265.8; not yet timed apart. Their GPU tests passed
# (tests/gpu/test_paged_decode_gpu.py -k "quantizes or longest_first", test_engine_gpu.py -k "quantizing or
# longest_first").
QUANTIZED_OUT = True
# StreamedDecode's programs take the step's sequences longest first (by their first piece: the plan's argsort, staged
# with it), where they took them in batch order. A step's programs fill the multiprocessors in waves as earlier ones
# end; in batch order its last programs are as long as any, and the step waits on the few still running. Longest
# first, the last to start are the shortest. The offline run's contexts (prompts uniform in [100, 1,024] plus the
# tokens made so far) are spread up to ~10x: a model of the scheduler (bench/engine/order_model.py: programs started
# in launch order, four a multiprocessor, the bandwidth shared once fewer than 100-200 run; not a measurement) puts
# batch order 1-10% over the bytes' time at 96-256 sequences and longest first within 2%. The same sums, bit for
# bit, in another order of programs. On since session 58: timed with QUANTIZED_OUT, above.
LONGEST_FIRST = True


def split_tokens(batch_size: int) -> int:
    """Tokens per split: short splits at small batches, where the splits are the only parallelism."""
    return 64 if batch_size <= 8 else 128 if batch_size <= 32 else 256 if batch_size <= 128 else 512


class PagedDecode:
    """Static buffers of one graph batch size (block tables, context lengths, the splits' partial results);
    `prepare` fills them on the host side of a step, `forward` is what the graph captured."""

    def __init__(self, batch_size: int, max_blocks_per_seq: int, block_size: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, device: torch.device):
        self.batch_size, self.block_size = batch_size, block_size
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.split_tokens = split_tokens(batch_size)
        self.num_splits = -(-max_blocks_per_seq * block_size // self.split_tokens)
        # What a step stages, in one int32 buffer the graphs read at fixed addresses: the tables' row stride (the
        # step's widest table, W), the B context lengths, then the B tables, W blocks a row, each part on a 16-byte
        # boundary as the kernels' own buffers were. One queued copy from a pinned buffer fills it: the kernels
        # load the stride, so no device copy re-lays the tables out.
        # Subclasses keep `meta` more ints between the lengths and the tables (StreamedDecode: its plan), and header
        # ints 1-3 are theirs.
        self.max_blocks_per_seq = max_blocks_per_seq
        self._meta_at = 4 + -(-batch_size // 4) * 4
        self._tables_at = self._meta_at + -(-self.meta_size() // 4) * 4
        self.staged = torch.zeros(self._tables_at + batch_size * max_blocks_per_seq, dtype=torch.int32, device=device)
        self.staged[0] = 1
        self.staged[4:4 + batch_size] = 1
        self.context_lens = self.staged[4:4 + batch_size]
        self.tables = self.staged[self._tables_at:]
        self.partial, self.lse = self.split_results(device)
        self._pinned: torch.Tensor | None = None   # stage's host buffer, its numpy view, and its copies by size
        self._host: np.ndarray | None = None
        self._copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def split_results(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The splits' partial outputs and log-sum-exps."""
        b, h = self.batch_size, self.num_heads
        return (torch.empty(b, h, self.num_splits, self.head_dim, dtype=torch.float32, device=device),
                torch.empty(b, h, self.num_splits, dtype=torch.float32, device=device))

    def meta_size(self) -> int:
        return 0

    def stage_meta(self, host: np.ndarray) -> None:
        """Fills the header's ints 1-3 and the meta ints of the step in `host` (the staged buffer's host copy, whose
        lengths, padded rows included, are written already)."""

    def prepare(self, block_tables: list[list[int]], context_lens: list[int]) -> None:
        """`stage` for lists (the batch already padded to this size)."""
        width = max(map(len, block_tables))
        rows = np.zeros((len(block_tables), width), dtype=np.int32)
        for row, table in zip(rows, block_tables):
            row[:len(table)] = table
        self.stage(rows, np.array(context_lens, dtype=np.int32))

    def stage(self, block_tables: np.ndarray, context_lens: np.ndarray) -> None:
        """Copies a step's arrays in ([b, W] tables, [b] lengths; b is this size, or fewer rows for a forward pass of
        fewer) with one queued copy from a pinned buffer: a copy from pageable memory can block the host until the
        device has run the step before (overlap scheduling). Rows past b attend to one token of a block their
        stale table holds (every value ever staged there is a block id). The pinned buffer is rewritten by the next
        step's stage, which the model runner starts only after this step's copies ran."""
        b, width = block_tables.shape
        size = self.batch_size
        if width > self.max_blocks_per_seq or b > size:
            raise ValueError(f"tables of {b} x {width} blocks: this decode takes at most {size} x "
                             f"{self.max_blocks_per_seq}")
        at = self._tables_at
        n = at + b * width
        if self._pinned is None or self._pinned.numel() < n:
            grown = min(max(n, 2 * (0 if self._pinned is None else self._pinned.numel())), self.staged.numel())
            self._pinned = torch.zeros(grown, dtype=torch.int32, pin_memory=self.staged.is_cuda)
            self._host = self._pinned.numpy()
            self._copies.clear()
        host = self._host
        assert host is not None
        host[0] = width
        host[4:4 + b] = context_lens
        host[4 + b:4 + size] = 1
        host[at:n].reshape(b, width)[:] = block_tables
        self.stage_meta(host)
        copy = self._copies.get(n)
        if copy is None:
            copy = self._copies[n] = (self.staged[:n], self._pinned[:n])
        copy[0].copy_(copy[1], non_blocking=True)

    def staged_tables(self) -> torch.Tensor:
        """The tables as the kernels read them, [B, W], W the row stride staged with them (reads the device)."""
        width = int(self.staged[0])
        return self.tables[:self.batch_size * width].view(self.batch_size, width)

    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """q [B, Hq, D] (any token and head strides) against kv_cache [blocks, 2, block_size, Hkv, D] (q's dtype or
        float8 e4m3)."""
        b, hq, d = q.shape
        group = hq // self.num_kv_heads
        _split_kernel[(b, self.num_kv_heads, self.num_splits)](
            q, kv_cache, self.tables, self.context_lens, self.partial, self.lse,
            q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
            kv_cache.stride(3), self.staged, scale, GROUP=group,
            GROUP_PAD=max(16, triton.next_power_of_2(group)), D=d, PAGE=self.block_size, SPLIT=self.split_tokens,
            BLOCK_T=BLOCK_TOKENS, **pdl.args(q.device))
        out = q.new_empty(b, hq, d)
        # the compiled kernel, kept for its register and spill counts (tests)
        self.merge_kernel = _merge_kernel[(b, hq)](self.partial, self.lse, out, self.context_lens, self.num_splits,
                                                   D=d, CHUNK=MERGE_CHUNK, SPLIT=self.split_tokens,
                                                   **pdl.args(q.device))
        return out


# The most pieces streamed_pool cuts a sequence of a small batch's even contexts into; None: as many as fill the
# multiprocessors (at one sequence, ~33 on an H200's 132 with 8 KV heads: 850 tokens in 14 one-tile pieces, 112
# programs, where 4 pieces give 32 programs of 4 tiles). The engine's streamed attention starts at 16 sequences
# (EngineConfig.streamed_decode_min_batch), where 4 pieces already fill them; below, the split kernel and its merge
# kernel take 8.9 us a layer at one sequence of 384 tokens over an FP8 cache and 20.4 at four of 1,024 (H200,
# kernel_bench.py --parts attention_fp8), against 18.0 for the streamed kernel at sixteen of 1,024.
# `kernel_bench.py --parts attention_small` times both ways at 1-16 sequences.
SMALL_BATCH_PIECES: int | None = 4


def streamed_pool(batch_size: int, num_kv_heads: int, multiprocessors: int) -> int:
    """Programs StreamedDecode keeps for the pieces of long contexts: a program for every two sequences, so that a
    piece is at most twice a mean context (measured on the H200: one 32,768-token context among 255 of 843 took
    322 us a layer with 33 programs, 250 with 128, against 213 without it), and at least about two programs a
    multiprocessor (each reads one KV head of one piece). A batch of fewer sequences than that takes a pool that
    cuts even contexts into up to SMALL_BATCH_PIECES pieces each, to fill the multiprocessors."""
    programs = -(-2 * multiprocessors // num_kv_heads)
    if batch_size >= programs:
        return max(programs, batch_size // 2)
    fill = -(-programs // batch_size)
    return batch_size * (fill if SMALL_BATCH_PIECES is None else min(SMALL_BATCH_PIECES, fill))


def streamed_config(cache_dtype: torch.dtype, head_dim: int = 128) -> dict[str, Any]:
    """StreamedDecode's tile, warps, stages and variant for a cache of `cache_dtype`, as bench/engine/kernel_bench.py
    picked them (--parts attention_fp8): a bf16 cache keeps 64 tokens a tile, 4 warps, 3 stages (at its bandwidth
    floor at 256 sequences of 1,024 tokens: 248 us against 252 on the H200, session 47). An FP8 cache, whose tile is
    half the bytes, has K and V as the products' left operands and the products in fp16 (kv_a, f16; widening e4m3
    to bf16 before each product kept the FP8 kernel as slow as bf16's, the fp16 products widen it in one
    instruction per two values), the head dimension permuted so each thread's values lie side by side in shared
    memory (perm), each tile's blocks loaded an iteration ahead so 2 of the 3 stages are in flight
    (prefetch_table), and the softmax sums added up once (defer_sum), at 64 tokens a tile, 4 warps: on the H100,
    200 us at 256 sequences of 1,024 tokens against 218 for session 48's kernel (128 tokens, 2 stages, kv_a and f16
    only) and a 179 floor, 389 against 421 at 2,048 tokens, 55 against 69 at 64 sequences (session 50). A
    `head_dim` under 64 (the kernels take powers of two) keeps the head dimension in order: perm needs a multiple."""
    if cache_dtype.itemsize == 1:
        return {"block_t": 64, "warps": 4, "stages": 3, "kv_a": True, "f16": True, "perm": head_dim % 64 == 0,
                "prefetch_table": True, "defer_sum": True}
    return {"block_t": 64, "warps": 4, "stages": 3}


class StreamedDecode(PagedDecode):
    """The same attention for large batches: each program streams one piece of a sequence's pages for one KV head,
    in a loop Triton pipelines (`stages` tiles in flight), with its products on the tensor cores (in bf16, or in
    fp16 over an FP8 cache: streamed_config).

    A piece is at most `chunk` tokens, a whole number of `block_t` tiles that the host picks each step as the
    step's tokens over `pool`: every sequence's first piece has a program of its own, and the pieces after a long
    sequence's first take the pool's programs (at most `pool` of them, as their tokens are at most the step's over
    `chunk`). So a long context among short ones is spread over as many programs as its share of the step's KV,
    and a step of even contexts of 33 sequences or more (none over the chunk, see streamed_pool) runs one program
    per sequence and KV head, which writes its output directly. A long sequence's pieces write their partial results;
    the last of them to finish (an atomic count per sequence and head) merges them by their log-sum-exp.
    `block_t`, `warps` and `stages` are what bench/engine/kernel_bench.py sweeps; `kv_a` computes with K and V as the
    products' left operands (`_attend_tile_kv_a`); `f16` computes the products in fp16 (q rounded to it, P too),
    to which an FP8 cache widens exactly and more cheaply than to bf16 (q clamped to fp16's ±65,504, where bf16
    reaches further; trained models' queries stay far below it). `heads` (with kv_a): KV heads a program reads
    together, so each token's row it loads is `heads` x the head's bytes (256 over an FP8 cache at 2, as a bf16
    row of one head), its products taking the heads' query rows block-diagonally in the columns GROUP_PAD pads
    anyway. `perm` (with kv_a, one head a program, head_dim a multiple of 64): the products' rows and sums run over
    the head dimension in a permuted order (_k_order, _v_order), so that the values each thread of Hopper's
    4-warp MMA holds of a K or V tile lie side by side in shared memory: over an FP8 cache, a V tile's values were
    read a byte an instruction (a thread's two tokens of one dimension are a token row apart) and K's two bytes an
    instruction; permuted, 4 bytes (V) and 16 (K). Sums over a permuted order are the same sums; the output's
    dimensions are put back as it is stored. `maxnreg`: the registers a thread may take (Triton's option; None,
    the compiler's choice), so that more programs share a multiprocessor, each with a tile in flight, at the cost
    of spills (compiled for the H200, the FP8 kernel at 128-token tiles takes 178 without perm, 142 with it: two
    and three programs of 4 warps; 128 fits four). `defer_sum` (with kv_a): each tile's softmax sums kept per token
    row and added up once, after the last tile: a tile's sum over its tokens spans the 4 warps (shuffles, a
    shared-memory exchange and two barriers), where keeping them costs 16 registers a thread at 128-token tiles.
    `prefetch_table` (with kv_a): each iteration loads the next tile's blocks from the table, so no load in the
    iteration decides its own tile's addresses and Triton's pipeliner keeps stages - 1 tiles of K and V in flight
    (with the table loaded in the iteration, one whatever `stages` is: the table's load takes the first stage)."""

    def __init__(self, batch_size: int, max_blocks_per_seq: int, block_size: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, device: torch.device, pool: int = 33, block_t: int = 64, warps: int = 4,
                 stages: int = 3, kv_a: bool = False, f16: bool = False, heads: int = 1, perm: bool = False,
                 maxnreg: int | None = None, defer_sum: bool = False, prefetch_table: bool = False,
                 longest_first: bool | None = None):
        if pool < 1:
            raise ValueError(f"pool must be at least 1, not {pool}")
        if heads != 1 and (not kv_a or heads < 1 or num_kv_heads % heads or heads & (heads - 1)):
            raise ValueError(f"heads={heads} needs kv_a and a power of two dividing the {num_kv_heads} KV heads")
        if (defer_sum or prefetch_table) and not kv_a:
            raise ValueError("defer_sum and prefetch_table need kv_a")
        if perm and (not kv_a or heads != 1 or head_dim % 64):
            raise ValueError(f"perm needs kv_a, heads=1 and a head_dim that is a multiple of 64 (not {head_dim})")
        self.pool = pool
        super().__init__(batch_size, max_blocks_per_seq, block_size, num_heads, num_kv_heads, head_dim, device)
        self.block_t, self.warps, self.stages, self.kv_a, self.f16 = block_t, warps, stages, kv_a, f16
        self.heads, self.perm, self.defer_sum, self.prefetch_table = heads, perm, defer_sum, prefetch_table
        self.longest_first = LONGEST_FIRST if longest_first is None else longest_first
        self.launch_options = {} if maxnreg is None else {"maxnreg": maxnreg}
        self.first_slots = self.staged[self._meta_at:self._meta_at + batch_size]
        self.extras = self.staged[self._meta_at + batch_size:self._meta_at + batch_size + 2 * pool]
        self._order_at = self._meta_at + batch_size + 2 * pool
        self.order = self.staged[self._order_at:self._order_at + batch_size]
        self.staged[1] = max_blocks_per_seq * block_size   # a chunk no context passes, until a step's plan
        self.arrived = torch.zeros(2 * pool, num_kv_heads, dtype=torch.int32, device=device)
        self.token_arrived = torch.zeros(batch_size, dtype=torch.int32, device=device)   # forward_quantized

    def split_results(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        # a long sequence's pieces, in the pool and first: at most 2 x pool (each long one has one in the pool)
        return (torch.empty(2 * self.pool, self.num_heads, self.head_dim, dtype=torch.float32, device=device),
                torch.empty(2 * self.pool, self.num_heads, dtype=torch.float32, device=device))

    def meta_size(self) -> int:
        # each sequence's first slot; the pool's (sequence, first token); the sequences in their programs' order
        return 2 * self.batch_size + 2 * self.pool

    def stage_meta(self, host: np.ndarray) -> None:
        """The step's plan: header 1 the chunk, header 2 the pool's pieces in use; for each long sequence (over the
        chunk) the slot of its first piece's partial result, its later pieces' slots following it; for each pool
        program, its piece's sequence and first token; with longest_first, the sequences by their first pieces'
        tokens, most first (ties in batch order), which the first-piece programs take in turn."""
        size, tile = self.batch_size, self.block_t
        lens = host[4:4 + size]
        chunk = max(tile, -(-int(lens.sum()) // (self.pool * tile)) * tile)
        host[1] = chunk
        if self.longest_first:
            host[self._order_at:self._order_at + size] = np.argsort(-np.minimum(lens, chunk), kind="stable")
        if lens.max() <= chunk:
            host[2] = 0
            return
        long = np.flatnonzero(lens > chunk)
        pieces = (lens[long] + chunk - 1) // chunk
        later = pieces - 1
        host[self._meta_at + long] = np.cumsum(pieces) - pieces
        n = int(later.sum())   # < the step's tokens over the chunk, which is at most the pool
        seqs = np.repeat(long, later)
        index = np.arange(1, n + 1) - np.repeat(np.cumsum(later) - later, later)   # 1.. within each sequence
        extras = host[self._meta_at + size:self._meta_at + size + 2 * n].reshape(n, 2)
        extras[:, 0] = seqs
        extras[:, 1] = index * chunk
        host[2] = n

    def staged_plan(self) -> tuple[int, list[tuple[int, int]], list[int]]:
        """What the kernels read of the plan (reads the device): the chunk, the pool's pieces in use as (sequence,
        first token), and each sequence's first slot (meaningful for long sequences only)."""
        chunk, n = int(self.staged[1]), int(self.staged[2])
        extras = self.extras[:2 * n].view(n, 2).tolist()
        return chunk, [tuple(e) for e in extras], self.first_slots.tolist()

    def staged_order(self) -> list[int]:
        """The sequences in the order the first-piece programs take them (reads the device): with longest_first the
        step's plan, else batch order."""
        return self.order.tolist() if self.longest_first else list(range(self.batch_size))

    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, scale: float) -> torch.Tensor:
        return self._launch(q, kv_cache, scale, False)[0]

    def forward_quantized(self, q: torch.Tensor, kv_cache: torch.Tensor, scale: float
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention's rows [B, Hq D] quantized to e4m3 and their scales [B, 1] (fp8.quantize_tokens of
        `forward`'s output), as an FP8 product takes its input (QUANTIZED_OUT)."""
        return self._launch(q, kv_cache, scale, True)[1]

    def _launch(self, q: torch.Tensor, kv_cache: torch.Tensor, scale: float, quantize: bool
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        b, hq, d = q.shape
        group = hq // self.num_kv_heads
        out = q.new_empty(b, hq, d)
        quantized = (torch.empty(b, hq * d, dtype=torch.float8_e4m3fn, device=q.device),
                     torch.empty(b, 1, dtype=torch.float32, device=q.device)) if quantize else (out, out)
        # the pool's programs first, so a long context's pieces start with the step's first wave
        _stream_kernel[(self.num_kv_heads // self.heads, self.pool + b)](
            q, kv_cache, self.tables, self.context_lens, self.first_slots, self.extras, self.order, out, self.partial,
            self.lse, self.arrived, q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1),
            kv_cache.stride(2), kv_cache.stride(3), self.staged, scale * _LOG2_E, self.pool, *quantized,
            self.token_arrived, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group * self.heads)), D=d,
            PAGE=self.block_size, BLOCK_T=self.block_t, KV_A=self.kv_a, F16=self.f16, HEADS=self.heads,
            PERM=self.perm, DEFER=self.defer_sum, PREFETCH=self.prefetch_table, ORDER=self.longest_first,
            QUANT=quantize, ROW=triton.next_power_of_2(hq * d), num_warps=self.warps, num_stages=self.stages,
            **self.launch_options, **pdl.args(q.device))
        return out, quantized


_LOG2_E = 1.4426950408889634


def reference(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: list[list[int]], context_lens: list[int],
              scale: float) -> torch.Tensor:
    """The same attention in torch (fp32), for tests."""
    out = []
    group = q.shape[1] // kv_cache.shape[3]
    for i, (table, n) in enumerate(zip(block_tables, context_lens)):
        kv = kv_cache[table].transpose(0, 1).reshape(2, -1, kv_cache.shape[3], kv_cache.shape[4])[:, :n].float()
        k, v = kv[0].repeat_interleave(group, 1), kv[1].repeat_interleave(group, 1)   # [n, Hq, D]
        weights = torch.softmax(torch.einsum("hd,nhd->hn", q[i].float(), k) * scale, dim=-1)
        out.append(torch.einsum("hn,nhd->hd", weights, v))
    return torch.stack(out).to(q.dtype)


if triton is not None:
    @triton.jit
    def _program_start(q_ptr, tables_ptr, lens_ptr, q_stride_t, q_stride_h, stride_ptr, GROUP: tl.constexpr,
                       GROUP_PAD: tl.constexpr, D: tl.constexpr):
        """This program's sequence, KV head and split; the sequence's context length; its query heads (GROUP_PAD
        rows, the first GROUP real), their q, and the sequence's block table (the tables' row stride is staged
        with them, at `stride_ptr`)."""
        table_stride = tl.load(stride_ptr).to(tl.int64)
        seq = tl.program_id(0).to(tl.int64)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        context = tl.load(lens_ptr + seq)
        rows = tl.arange(0, GROUP_PAD)
        heads = kv_head * GROUP + rows
        head_ok = rows < GROUP
        dims = tl.arange(0, D)
        q = tl.load(q_ptr + seq * q_stride_t + heads[:, None] * q_stride_h + dims[None, :], mask=head_ok[:, None],
                    other=0.0)
        return seq, kv_head, split, context, heads, head_ok, q, tables_ptr + seq * table_stride

    @triton.jit
    def _page(tokens, PAGE: tl.constexpr):
        """Each token's page in its sequence's table (tokens // PAGE). Tokens are never negative: as unsigned, the
        division by a power of two is a shift, where signed it rounds toward zero in three more instructions and
        widens to 64 bits with a sign. Compiled for sm_90 (Triton 3.6), the streamed kernel's loop over a 64-token
        tile: 575 -> 544 instructions over an FP8 cache (126 -> 127 registers: still four programs a
        multiprocessor), 524 -> 474 over bf16; the same addresses."""
        return tokens.to(tl.uint32) // PAGE

    @triton.jit
    def _slot(tokens, PAGE: tl.constexpr):
        """Each token's slot in its page (tokens % PAGE), unsigned as _page: a mask."""
        return tokens.to(tl.uint32) % PAGE

    @triton.jit
    def _tile_slots(table, start, end, kv_head, s_block, s_slot, s_head, PAGE: tl.constexpr, BLOCK_T: tl.constexpr):
        """The BLOCK_T tokens from `start`: which are before `end`, and where each one's K of `kv_head` starts in the
        cache (its block from the sequence's `table`, its slot in the block)."""
        tokens = start + tl.arange(0, BLOCK_T)
        valid = tokens < end
        blocks = tl.load(table + _page(tokens, PAGE), mask=valid, other=0).to(tl.int64)
        return valid, blocks * s_block + _slot(tokens, PAGE) * s_slot + kv_head * s_head

    @triton.jit
    def _table_tile(table, start, end, PAGE: tl.constexpr, BLOCK_T: tl.constexpr):
        """The block of each of the BLOCK_T tokens from `start` (0 past `end`), for StreamedDecode's
        prefetch_table."""
        tokens = start + tl.arange(0, BLOCK_T)
        return tl.load(table + _page(tokens, PAGE), mask=tokens < end, other=0)

    @triton.jit
    def _attend_tile(q, cache_ptr, table, start, end, kv_head, s_block, s_kv, s_slot, s_head, scale, m, total, acc,
                     D: tl.constexpr, PAGE: tl.constexpr, BLOCK_T: tl.constexpr, STREAMED: tl.constexpr):
        """The query heads of one KV head against the BLOCK_T tokens from `start` (those before `end`), folded into
        the online softmax's running max `m`, sum `total` and output `acc`. STREAMED: scores in base 2 (`scale`
        includes log2(e)) and P rounded to the cache's dtype for its product with V, on the tensor cores; else
        natural base and P·V in fp32. The cache may hold float8 e4m3 (EngineConfig.kv_cache_dtype): half the
        bytes to read, each value exact in q's dtype."""
        valid, slots = _tile_slots(table, start, end, kv_head, s_block, s_slot, s_head, PAGE=PAGE, BLOCK_T=BLOCK_T)
        dims = tl.arange(0, D)
        # an FP8 cache's values (a scale of 1) widen to q's dtype, exactly
        k = tl.load(cache_ptr + slots[:, None] + dims[None, :], mask=valid[:, None], other=0.0).to(q.dtype)
        scores = tl.dot(q, tl.trans(k)) * scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        if STREAMED:
            p = tl.exp2(scores - m_new[:, None])
            alpha = tl.exp2(m - m_new)
        else:
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m - m_new)
        total = total * alpha + tl.sum(p, axis=1)
        v = tl.load(cache_ptr + s_kv + slots[:, None] + dims[None, :], mask=valid[:, None], other=0.0).to(q.dtype)
        if STREAMED:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        return m_new, total, acc

    @triton.jit
    def _k_order(dims, D: tl.constexpr):
        """StreamedDecode's perm: the cache dimension of each of a K tile's columns, as the product sums them. A thread
        of Hopper's MMA holds, of each of its rows, the columns 2t, 2t+1, 2t+8, 2t+9 of every 16 (t its lane % 4):
        column 16j + 8h + 2t + e reads dimension (D / 4) t + 4j + 2h + e, so a thread's D / 4 columns are one run
        of the cache's row."""
        return (D // 4) * ((dims // 2) % 4) + 4 * (dims // 16) + 2 * ((dims // 8) % 2) + dims % 2

    @triton.jit
    def _v_order(dims, D: tl.constexpr):
        """StreamedDecode's perm: the cache dimension of each row of a V tile (the product's left operand with 4 warps,
        64 rows an instruction, warp w the rows 16w..16w+15 of each, a thread the rows g and g + 8 of its warp's 16):
        row 64i + 16w + 8b + g reads dimension (D / 4) w + (D / 32) g + (D / 64) b + i, so the D / 16 rows a thread
        holds are side by side in each token's row."""
        return ((D // 4) * ((dims // 16) % 4) + (D // 32) * (dims % 8) + (D // 64) * ((dims // 8) % 2)
                + dims // 64)

    @triton.jit
    def _attend_tile_kv_a(q_t, cache_ptr, table, start, end, kv_head, s_block, s_kv, s_slot, s_head, scale, m, total,
                          acc_t, blocks, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_T: tl.constexpr,
                          HEADS: tl.constexpr, PERM: tl.constexpr, DEFER: tl.constexpr, PREFETCH: tl.constexpr):
        """_attend_tile's STREAMED arithmetic with K and V the products' left operands: q_t [HEADS x D, GROUP_PAD]
        and the output acc_t [HEADS x D, GROUP_PAD] transposed, the scores [BLOCK_T, GROUP_PAD]; the HEADS KV heads
        from `kv_head` side by side in each token's row (q_t block-diagonal: each column holds its head's q in its
        KV head's rows). A left operand may stay in registers on Hopper's tensor cores, so a tile widened from FP8
        need not go back through shared memory. PERM: K's columns in _k_order (q_t's rows in it too) and V's rows
        in _v_order (acc_t's rows), each tile loaded in the cache's order and permuted as a view. DEFER: `total` is
        [BLOCK_T, GROUP_PAD], each token row's sums, rescaled with the rest and summed by the caller. PREFETCH:
        `blocks` holds the tile's blocks, loaded an iteration before (_table_tile)."""
        if PREFETCH:
            tokens = start + tl.arange(0, BLOCK_T)
            valid = tokens < end
            slots = blocks.to(tl.int64) * s_block + _slot(tokens, PAGE) * s_slot + kv_head * s_head
        else:
            valid, slots = _tile_slots(table, start, end, kv_head, s_block, s_slot, s_head, PAGE=PAGE,
                                       BLOCK_T=BLOCK_T)
        if HEADS == 1:
            dims = tl.arange(0, D)
        else:   # the heads' rows: contiguous in the cache's layout (s_head == D)
            row = tl.arange(0, HEADS * D)
            dims = (row // D) * s_head + row % D
        k = tl.load(cache_ptr + slots[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
        if PERM:   # dimension (D / 4) t + 4j + 2h + e to column 16j + 8h + 2t + e (_k_order)
            k = tl.reshape(tl.permute(tl.reshape(k, (BLOCK_T, 4, D // 16, 2, 2)), (0, 2, 3, 1, 4)), (BLOCK_T, D))
        k = k.to(q_t.dtype)
        scores = tl.dot(k, q_t) * scale
        scores = tl.where(valid[:, None], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        p = tl.exp2(scores - m_new[None, :])
        alpha = tl.exp2(m - m_new)
        if DEFER:
            total = total * alpha[None, :] + p
        else:
            total = total * alpha + tl.sum(p, axis=0)
        v_t = tl.load(cache_ptr + s_kv + slots[None, :] + dims[:, None], mask=valid[None, :], other=0.0)
        if PERM:   # dimension (D / 4) w + (D / 32) g + (D / 64) b + i to row 64i + 16w + 8b + g (_v_order)
            v_t = tl.reshape(tl.permute(tl.reshape(v_t, (4, 8, 2, D // 64, BLOCK_T)), (3, 0, 2, 1, 4)), (D, BLOCK_T))
        v_t = v_t.to(q_t.dtype)
        acc_t = acc_t * alpha[None, :] + tl.dot(v_t, p.to(v_t.dtype))
        return m_new, total, acc_t

    @triton.jit
    def _split_kernel(q_ptr, cache_ptr, tables_ptr, lens_ptr, partial_ptr, lse_ptr, q_stride_t, q_stride_h,
                      s_block, s_kv, s_slot, s_head, stride_ptr, scale, GROUP: tl.constexpr,
                      GROUP_PAD: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, SPLIT: tl.constexpr,
                      BLOCK_T: tl.constexpr, PDL: tl.constexpr = False):
        _pdl_start(PDL)
        seq, kv_head, split, context, heads, head_ok, q, table = _program_start(
            q_ptr, tables_ptr, lens_ptr, q_stride_t, q_stride_h, stride_ptr, GROUP=GROUP, GROUP_PAD=GROUP_PAD, D=D)
        begin = split * SPLIT
        end = tl.minimum(begin + SPLIT, context)
        num_splits = tl.num_programs(2)
        dims = tl.arange(0, D)
        out_row = (seq * GROUP * tl.num_programs(1) + heads) * num_splits + split   # [Hq] rows of lse
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, D], tl.float32)
        for i in range(SPLIT // BLOCK_T):
            start = begin + i * BLOCK_T
            if start < end:
                m, total, acc = _attend_tile(q, cache_ptr, table, start, end, kv_head, s_block, s_kv, s_slot,
                                             s_head, scale, m, total, acc, D=D, PAGE=PAGE, BLOCK_T=BLOCK_T,
                                             STREAMED=False)
        # A split past the sequence's end ran no iteration and writes nothing: the merge reads the sequence's own
        # splits alone. The grid covers the longest context a graph may take (the engine's max_model_len): at
        # 40,960 tokens, 640 splits a sequence and KV head at up to 8 sequences, where 384 tokens use 6.
        inside = begin < context
        seen = total > 0
        tl.store(partial_ptr + out_row[:, None] * D + dims[None, :], acc / tl.where(seen, total, 1.0)[:, None],
                 mask=head_ok[:, None] & inside)
        tl.store(lse_ptr + out_row, tl.where(seen, m + tl.log(total), float("-inf")), mask=head_ok & inside)

    @triton.jit
    def _merge_kernel(partial_ptr, lse_ptr, out_ptr, lens_ptr, num_splits, D: tl.constexpr, CHUNK: tl.constexpr,
                      SPLIT: tl.constexpr, PDL: tl.constexpr = False):
        _pdl_start(PDL)
        # The sequence's own splits (its context's, of the grid's num_splits), in chunks of CHUNK rows: a
        # [splits, D] tile in one piece (1024 x 128 fp32 at a 40k context) cannot sit in registers, and spills take
        # local memory, which a CUDA context keeps for good.
        seq = tl.program_id(0).to(tl.int64)
        row = seq * tl.num_programs(1) + tl.program_id(1)   # (sequence, head)
        used = tl.cdiv(tl.load(lens_ptr + seq), SPLIT)
        chunk = tl.arange(0, CHUNK)
        dims = tl.arange(0, D)
        top = tl.full([CHUNK], float("-inf"), tl.float32)
        for start in range(0, used, CHUNK):
            splits = start + chunk
            top = tl.maximum(top, tl.load(lse_ptr + row * num_splits + splits, mask=splits < used,
                                          other=float("-inf")))
        top_all = tl.max(top, axis=0)
        total = tl.zeros([CHUNK], tl.float32)
        acc = tl.zeros([D], tl.float32)
        for start in range(0, used, CHUNK):
            splits = start + chunk
            lse = tl.load(lse_ptr + row * num_splits + splits, mask=splits < used, other=float("-inf"))
            weights = tl.exp(lse - top_all)   # 0 for a split that saw no token
            total += weights
            parts = tl.load(partial_ptr + (row * num_splits + splits[:, None]) * D + dims[None, :],
                            mask=(splits[:, None] < used) & (weights[:, None] > 0), other=0.0)
            acc += tl.sum(parts * weights[:, None], axis=0)
        tl.store(out_ptr + row * D + dims, (acc / tl.sum(total, axis=0)).to(out_ptr.dtype.element_ty))

    @triton.jit(do_not_specialize=["pool"])   # one kernel for every graph size's pool
    def _stream_kernel(q_ptr, cache_ptr, tables_ptr, lens_ptr, first_ptr, extras_ptr, order_ptr, out_ptr, partial_ptr,
                       lse_ptr, arrived_ptr, q_stride_t, q_stride_h, s_block, s_kv, s_slot, s_head, stride_ptr,
                       scale_log2, pool, quant_ptr, quant_scale_ptr, token_arrived_ptr, GROUP: tl.constexpr,
                       GROUP_PAD: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_T: tl.constexpr,
                       KV_A: tl.constexpr, F16: tl.constexpr, HEADS: tl.constexpr, PERM: tl.constexpr,
                       DEFER: tl.constexpr, PREFETCH: tl.constexpr, ORDER: tl.constexpr = False,
                       QUANT: tl.constexpr = False, ROW: tl.constexpr = 1, PDL: tl.constexpr = False):
        # _split_kernel's work over one piece of a sequence (StreamedDecode's plan), with a loop whose bounds are the
        # piece's own tokens (Triton pipelines it: the next tiles load while this one computes), scores in base 2,
        # and p rounded to the cache's dtype for its product with V (flash attention's rounding), on the tensor
        # cores. Programs 0..pool-1 of axis 1 take the plan's later pieces of long sequences (those past its count
        # run nothing); program pool + i takes sequence i's first piece (with ORDER, the plan's i-th sequence). Axis 0:
        # HEADS KV heads from kv_head.
        _pdl_start(PDL)
        kv_head = tl.program_id(0) * HEADS
        item = tl.program_id(1)
        if item < pool:
            if item >= tl.load(stride_ptr + 2):
                return   # past the plan's pieces
            seq = tl.load(extras_ptr + 2 * item).to(tl.int64)
            begin = tl.load(extras_ptr + 2 * item + 1)
        else:
            if ORDER:
                seq = tl.load(order_ptr + item - pool).to(tl.int64)
            else:
                seq = (item - pool).to(tl.int64)
            begin = item * 0
        chunk = tl.load(stride_ptr + 1)
        table_stride = tl.load(stride_ptr).to(tl.int64)
        context = tl.load(lens_ptr + seq)
        end = tl.minimum(begin + chunk, context)
        rows = tl.arange(0, GROUP_PAD)
        heads = kv_head * GROUP + rows
        head_ok = rows < GROUP * HEADS
        dims = tl.arange(0, D)
        q = tl.load(q_ptr + seq * q_stride_t + heads[:, None] * q_stride_h + dims[None, :], mask=head_ok[:, None],
                    other=0.0)
        if F16:   # StreamedDecode's f16: products in fp16, to which FP8 widens in one instruction per two values
            q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
        table = tables_ptr + seq * table_stride
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, D], tl.float32)
        if KV_A:   # the same, K and V the left operands (StreamedDecode's kv_a)
            if HEADS == 1:
                q_dims = _k_order(dims, D=D) if PERM else dims
                q_t = tl.load(q_ptr + seq * q_stride_t + heads[None, :] * q_stride_h + q_dims[:, None],
                              mask=head_ok[None, :], other=0.0)
            else:   # block-diagonal: column c's q in the rows of its KV head, zeros in the others'
                hd = tl.arange(0, HEADS * D)
                q_t = tl.load(q_ptr + seq * q_stride_t + heads[None, :] * q_stride_h + (hd % D)[:, None],
                              mask=head_ok[None, :] & ((hd // D)[:, None] == (rows // GROUP)[None, :]), other=0.0)
            if F16:
                q_t = tl.minimum(tl.maximum(q_t.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
            acc_t = tl.zeros([HEADS * D, GROUP_PAD], tl.float32)
            if DEFER:   # each token row's sums, added up after the last tile
                sums = tl.zeros([BLOCK_T, GROUP_PAD], tl.float32)
            else:
                sums = total
            if PREFETCH:   # the first tile's blocks; each iteration loads the next one's
                ahead = _table_tile(table, begin, end, PAGE=PAGE, BLOCK_T=BLOCK_T)
                blocks = ahead
            else:
                blocks = 0
            for start in range(begin, end, BLOCK_T):
                if PREFETCH:
                    blocks = ahead
                    ahead = _table_tile(table, start + BLOCK_T, end, PAGE=PAGE, BLOCK_T=BLOCK_T)
                m, sums, acc_t = _attend_tile_kv_a(q_t, cache_ptr, table, start, end, kv_head, s_block, s_kv, s_slot,
                                                   s_head, scale_log2, m, sums, acc_t, blocks, D=D, PAGE=PAGE,
                                                   BLOCK_T=BLOCK_T, HEADS=HEADS, PERM=PERM, DEFER=DEFER,
                                                   PREFETCH=PREFETCH)
            if DEFER:
                total = tl.sum(sums, axis=0)
            else:
                total = sums
            if HEADS == 1:
                acc = tl.trans(acc_t)
            else:   # each column's own KV head's rows of the product with all the heads' V
                own = tl.arange(0, HEADS)[:, None, None] == (rows // GROUP)[None, None, :]
                acc = tl.trans(tl.sum(tl.where(own, tl.reshape(acc_t, (HEADS, D, GROUP_PAD)), 0.0), axis=0))
        else:
            for start in range(begin, end, BLOCK_T):
                m, total, acc = _attend_tile(q, cache_ptr, table, start, end, kv_head, s_block, s_kv, s_slot, s_head,
                                             scale_log2, m, total, acc, D=D, PAGE=PAGE, BLOCK_T=BLOCK_T,
                                             STREAMED=True)
        num_heads = GROUP * HEADS * tl.num_programs(0)
        if PERM:   # acc's columns back to the cache's dimensions, as they are stored (the merge reads those)
            dims = _v_order(dims, D=D)
        out_rows = (seq * num_heads + heads[:, None]) * D + dims[None, :]
        if context <= chunk:   # one piece, this one: the output directly (every sequence has a token)
            tl.store(out_ptr + out_rows, (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
            if QUANT:
                _quantize_token(out_ptr, quant_ptr, quant_scale_ptr, token_arrived_ptr, seq, num_heads * D, ROW)
        else:
            first = tl.load(first_ptr + seq)
            pieces = tl.cdiv(context, chunk)
            slot_rows = (first + begin // chunk) * num_heads + heads   # every piece holds a token: total > 0
            tl.store(partial_ptr + slot_rows[:, None] * D + dims[None, :], acc / total[:, None], mask=head_ok[:, None])
            tl.store(lse_ptr + slot_rows, m + tl.log2(total), mask=head_ok)
            # The last piece to arrive merges. The barrier orders every thread's stores before the release of the
            # count; the merging program reads the others' through L2.
            tl.debug_barrier()
            counter = arrived_ptr + first * tl.num_programs(0) + tl.program_id(0)
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == pieces - 1:
                tl.debug_barrier()
                top = tl.full([GROUP_PAD], float("-inf"), tl.float32)
                weight = tl.zeros([GROUP_PAD], tl.float32)
                merged = tl.zeros([GROUP_PAD, D], tl.float32)
                for piece in range(0, pieces):
                    rows_j = (first + piece) * num_heads + heads
                    lse = tl.load(lse_ptr + rows_j, mask=head_ok, other=0.0, cache_modifier=".cg")
                    part = tl.load(partial_ptr + rows_j[:, None] * D + dims[None, :], mask=head_ok[:, None],
                                   other=0.0, cache_modifier=".cg")
                    new_top = tl.maximum(top, lse)
                    keep = tl.exp2(top - new_top)
                    w = tl.exp2(lse - new_top)
                    merged = merged * keep[:, None] + part * w[:, None]
                    weight = weight * keep + w
                    top = new_top
                tl.store(out_ptr + out_rows, (merged / weight[:, None]).to(out_ptr.dtype.element_ty),
                         mask=head_ok[:, None])
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")   # for the next layer's launch
                if QUANT:
                    _quantize_token(out_ptr, quant_ptr, quant_scale_ptr, token_arrived_ptr, seq, num_heads * D, ROW)

    @triton.jit
    def _quantize_token(out_ptr, quant_ptr, quant_scale_ptr, token_arrived_ptr, seq, width, ROW: tl.constexpr):
        """Called by the program that has just stored its heads' output of token `seq`: the last of the token's
        programs (axis 0) to do so quantizes the token's row of `width` values (fp8.quantize_tokens' arithmetic,
        on the row as stored), reading the others' heads through L2, and sets the count back to 0."""
        tl.debug_barrier()   # every thread's stores before the count's release
        counter = token_arrived_ptr + seq
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
            tl.debug_barrier()
            cols = tl.arange(0, ROW)
            ok = cols < width
            x = tl.load(out_ptr + seq * width + cols, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
            scale = tl.maximum(tl.max(tl.abs(x), axis=0) / 448.0, 1.0 / (448.0 * 512))
            tl.store(quant_scale_ptr + seq, scale)
            y = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
            tl.store(quant_ptr + seq * width + cols, y.to(tl.float8e4nv), mask=ok)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")   # for the next layer's launch
