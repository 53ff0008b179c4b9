"""The decode graphs' Triton attention (runtime/engine/paged_decode.py) against attention in fp32 torch."""
import numpy as np
import pytest
import torch

from ember.runtime.engine import paged_decode

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(paged_decode.triton is None, reason="needs Triton")]


PAGE, KV_HEADS, HEADS, D, MAX_BLOCKS = 16, 8, 32, 128, 128


def paged(lengths: list[int], g: torch.Generator):
    """Sequences of these lengths with their blocks in random order, and q a strided view as the engine's:
    (lengths, tables, cache, q)."""
    order = torch.randperm(sum(-(-n // PAGE) for n in lengths) + 1, generator=g).tolist()
    tables, used = [], 0
    for n in lengths:
        tables.append(order[used:used + -(-n // PAGE)])
        used += len(tables[-1])
    cache = torch.randn(len(order), 2, PAGE, KV_HEADS, D, generator=g).bfloat16().cuda()
    qkv = torch.randn(len(lengths), HEADS + 2 * KV_HEADS, D, generator=g).bfloat16().cuda()
    return lengths, tables, cache, qkv[:, :HEADS]


def scattered(batch_size: int):
    """`paged` with lengths from one token to past several splits."""
    g = torch.Generator().manual_seed(batch_size)
    lengths = [1, 2047, 15, 16, 17, 64, 65, 1000][:batch_size]
    lengths += torch.randint(1, MAX_BLOCKS * PAGE, (batch_size - len(lengths),), generator=g).tolist()
    return paged(lengths, g)


@pytest.mark.parametrize("batch_size", [1, 3, 16, 40, 200])
def test_split_attention_matches_the_reference_over_scattered_blocks(batch_size):
    lengths, tables, cache, q = scattered(batch_size)
    decode = paged_decode.PagedDecode(batch_size, MAX_BLOCKS, PAGE, HEADS, KV_HEADS, D, torch.device("cuda"))
    decode.prepare(tables, lengths)
    out = decode.forward(q, cache, D ** -0.5)
    expected = paged_decode.reference(q, cache, tables, lengths, D ** -0.5)
    close = dict(atol=2 ** -7, rtol=2 ** -7)   # a bf16 rounding step of the output
    torch.testing.assert_close(out.float(), expected.float(), **close)
    # a new step with shorter tables reuses the buffers
    decode.prepare([t[:1] for t in tables], [min(n, PAGE) for n in lengths])
    expected = paged_decode.reference(q, cache, [t[:1] for t in tables], [min(n, PAGE) for n in lengths], D ** -0.5)
    torch.testing.assert_close(decode.forward(q, cache, D ** -0.5).float(), expected.float(), **close)


def padded(tables: list[list[int]]) -> np.ndarray:
    rows = np.zeros((len(tables), max(map(len, tables))), dtype=np.int32)
    for row, table in zip(rows, tables):
        row[:len(table)] = table
    return rows


# p is rounded to bf16 before its product with V, as flash attention does: two bf16 steps of the output
STREAMED_CLOSE = dict(atol=2 ** -6, rtol=2 ** -6)


@pytest.mark.parametrize("batch_size,pool,block_t,stages,kv_a,heads,perm", [
    (40, 33, 64, 3, False, 1, False), (200, 33, 32, 2, False, 1, False), (40, 200, 128, 4, False, 1, False),
    (3, 1, 64, 3, False, 1, False), (16, 64, 64, 3, False, 1, False), (40, 33, 64, 3, True, 1, False),
    (200, 33, 128, 2, True, 1, False), (40, 200, 128, 2, True, 1, False), (40, 200, 64, 2, True, 2, False),
    (200, 33, 32, 2, True, 4, False), (200, 33, 64, 3, True, 1, True), (40, 200, 128, 2, True, 1, True)])
def test_streamed_attention_matches_the_reference(batch_size, pool, block_t, stages, kv_a, heads, perm):
    """The large-batch kernel with pools that leave every sequence one piece (its output written directly) and that
    cut many into pieces (merged by the last to arrive), its tables staged from a padded array as the engine
    stages a step; with K and V as the products' left operands too (kv_a), several KV heads a program, and the
    head dimension permuted (perm)."""
    lengths, tables, cache, q = scattered(batch_size)
    decode = paged_decode.StreamedDecode(batch_size, MAX_BLOCKS, PAGE, HEADS, KV_HEADS, D, torch.device("cuda"),
                                         pool=pool, block_t=block_t, stages=stages, kv_a=kv_a, heads=heads,
                                         perm=perm)
    decode.stage(padded(tables), np.array(lengths))
    expected = paged_decode.reference(q, cache, tables, lengths, D ** -0.5)
    torch.testing.assert_close(decode.forward(q, cache, D ** -0.5).float(), expected.float(), **STREAMED_CLOSE)


@pytest.mark.parametrize("lengths", [[2048] + [64] * 39, [2048, 2047, 1] + [17] * 61, [2048] * 3 + [16] * 13])
def test_streamed_attention_spreads_long_contexts_and_merges_them_in_a_graph(lengths):
    """Long contexts among short ones, replayed from a CUDA graph as the engine runs it: each step's plan (a new
    chunk and pieces) is read at replay, and the counts the merges leave let the next layer and step merge again.
    Planned over the same tables, an even step after a skewed one writes every output directly."""
    lengths, tables, cache, q = paged(lengths, torch.Generator().manual_seed(len(lengths)))
    decode = paged_decode.StreamedDecode(len(lengths), MAX_BLOCKS, PAGE, HEADS, KV_HEADS, D, torch.device("cuda"))
    decode.stage(padded(tables), np.array(lengths))
    chunk, extras, _ = decode.staged_plan()
    assert extras and max(lengths) > chunk   # the long ones are in pieces
    out = torch.empty_like(q)
    decode.forward(q, cache, D ** -0.5)   # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(3):   # three layers' launches over the same plan
            out.copy_(decode.forward(q, cache, D ** -0.5))
    even = [min(n, 64) for n in lengths]
    for step_lengths in (lengths, even, lengths):
        decode.stage(padded(tables), np.array(step_lengths))
        graph.replay()
        expected = paged_decode.reference(q, cache, tables, step_lengths, D ** -0.5)
        torch.testing.assert_close(out.float(), expected.float(), **STREAMED_CLOSE)
    assert not decode.arrived.any()   # every merge reset its count



@pytest.mark.parametrize("lengths", [[2048, 2047, 1] + [17] * 61, [300] * 40])
def test_the_streamed_kernel_quantizes_its_output_as_the_quantizer_does(lengths):
    """paged_decode.QUANTIZED_OUT: forward_quantized's e4m3 rows and scales are fp8.quantize_tokens' of forward's
    output, bit for bit, whether a token's heads are written directly or merged from pieces (the skewed plan),
    replayed from a CUDA graph over three layers' launches; every token's count is back at 0 after."""
    from ember.runtime.engine import fp8

    lengths, tables, cache, q = paged(lengths, torch.Generator().manual_seed(len(lengths) + 1))
    decode = paged_decode.StreamedDecode(len(lengths), MAX_BLOCKS, PAGE, HEADS, KV_HEADS, D, torch.device("cuda"),
                                         **paged_decode.streamed_config(torch.bfloat16))
    decode.stage(padded(tables), np.array(lengths))
    decode.forward_quantized(q, cache, D ** -0.5)   # compiles outside the capture
    rows, scales = torch.empty(len(lengths), HEADS * D, dtype=fp8.FP8, device="cuda"), torch.empty(len(lengths), 1,
                                                                                                   device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(3):
            got = decode.forward_quantized(q, cache, D ** -0.5)
            rows.copy_(got[0])
            scales.copy_(got[1])
    graph.replay()
    want = fp8.quantize_tokens(decode.forward(q, cache, D ** -0.5).reshape(len(lengths), -1))
    assert torch.equal(rows.view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(scales, want[1])
    assert not decode.token_arrived.any() and not decode.arrived.any()


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_longest_first_programs_give_batch_orders_bits(cache_dtype):
    """paged_decode.LONGEST_FIRST: the first-piece programs take the sequences longest first, the plan's order read
    at each replay of a graph (three layers' launches) over steps whose order differs (skewed, with pieces to merge;
    then even), with the engine's configuration for each cache; the outputs, and the quantized
    rows of forward_quantized, are batch order's bit for bit: each sequence and head sums the same tiles."""
    from ember.runtime.engine import fp8

    lengths, tables, cache, q = paged([2048, 17, 2047, 1] + [300, 1000, 40, 700] * 15,
                                      torch.Generator().manual_seed(11))
    if cache_dtype != torch.bfloat16:
        cache = fp8.to_cache(cache, cache_dtype)
    steps = [lengths, [min(n, 64) for n in lengths]]
    config = paged_decode.streamed_config(cache_dtype)
    ordered = paged_decode.StreamedDecode(len(lengths), MAX_BLOCKS, PAGE, HEADS, KV_HEADS, D, torch.device("cuda"),
                                          longest_first=True, **config)
    plain = paged_decode.StreamedDecode(len(lengths), MAX_BLOCKS, PAGE, HEADS, KV_HEADS, D, torch.device("cuda"),
                                        longest_first=False, **config)
    ordered.stage(padded(tables), np.array(lengths))
    ordered.forward(q, cache, D ** -0.5)   # compiles outside the capture
    ordered.forward_quantized(q, cache, D ** -0.5)
    out, rows = torch.empty_like(q), torch.empty(len(lengths), HEADS * D, dtype=fp8.FP8, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(3):
            out.copy_(ordered.forward(q, cache, D ** -0.5))
            rows.copy_(ordered.forward_quantized(q, cache, D ** -0.5)[0])
    for step in steps:
        ordered.stage(padded(tables), np.array(step))
        plain.stage(padded(tables), np.array(step))
        assert ordered.staged_order() != list(range(len(lengths)))
        graph.replay()
        assert torch.equal(out, plain.forward(q, cache, D ** -0.5))
        assert torch.equal(rows.view(torch.uint8), plain.forward_quantized(q, cache, D ** -0.5)[0].view(torch.uint8))
    assert not ordered.arrived.any() and not ordered.token_arrived.any()


def test_the_merge_keeps_its_tiles_in_registers_at_the_longest_context():
    """A 40,960-token context is 640 splits at batch 1: the merge walks them in chunks. Its one-piece tile had
    spilled to local memory, which the CUDA context keeps for good (a parked replica then held ~1.9 GiB more)."""
    page, kv_heads, heads, d = 16, 8, 32, 128
    max_blocks = 40960 // page
    g = torch.Generator().manual_seed(7)
    lengths = [1, 40960]
    tables = [[0], list(range(1, max_blocks + 1))]
    cache = torch.randn(max_blocks + 1, 2, page, kv_heads, d, generator=g).bfloat16().cuda()
    q = torch.randn(2, heads, d, generator=g).bfloat16().cuda()
    decode = paged_decode.PagedDecode(2, max_blocks, page, heads, kv_heads, d, torch.device("cuda"))
    decode.prepare(tables, lengths)
    out = decode.forward(q, cache, d ** -0.5)
    expected = paged_decode.reference(q, cache, tables, lengths, d ** -0.5)
    torch.testing.assert_close(out.float(), expected.float(), atol=2 ** -7, rtol=2 ** -7)
    assert decode.merge_kernel.n_spills == 0, decode.merge_kernel.n_spills
