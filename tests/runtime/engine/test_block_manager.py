"""Paged blocks: refcounts, the prefix hash chain, and the LRU of free cached blocks."""
from ember.runtime.engine.block_manager import BlockManager
from ember.runtime.engine.sampling import SamplingParams
from ember.runtime.engine.sequence import Sequence

BS = 16


def computed(bm: BlockManager, tokens: list[int], name: str = "s") -> Sequence:
    """A sequence whose tokens are all computed and whose full blocks are registered."""
    seq = Sequence(name, tokens, SamplingParams())
    bm.adopt_prefix(seq)
    n = seq.num_uncomputed_tokens
    assert bm.allocate(seq, n)
    bm.cache_full_blocks(seq, len(seq))
    seq.num_computed_tokens += n
    return seq


def test_allocate_and_free_balance_refcounts():
    bm = BlockManager(8, BS)
    seq = computed(bm, list(range(40)))
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    bm.free(seq)
    assert bm.num_free_blocks == 8 and all(b.ref_count == 0 for b in bm.blocks)


def test_prefix_hit_shares_full_blocks_and_recomputes_the_last_token():
    bm = BlockManager(8, BS)
    a = computed(bm, list(range(40)), "a")
    b = Sequence("b", list(range(40)) + [99], SamplingParams())
    assert bm.adopt_prefix(b) == 32
    assert b.block_table == a.block_table[:2]
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    exact = Sequence("c", list(range(32)), SamplingParams())
    assert bm.adopt_prefix(exact) == 16   # the whole prompt is cached, but its last token must be recomputed


def test_chain_hash_depends_on_the_whole_prefix():
    bm = BlockManager(8, BS)
    computed(bm, list(range(40)), "a")
    other_first_block = Sequence("b", [7] * 16 + list(range(16, 40)), SamplingParams())
    assert bm.adopt_prefix(other_first_block) == 0


def test_eviction_takes_clean_blocks_first_then_the_oldest_tail():
    bm = BlockManager(4, BS)
    old = computed(bm, list(range(33)), "old")          # 2 full cached blocks + 1 partial
    bm.free(old)
    # 3 blocks: the never-used one, the old partial one, then the LRU cached block (old's tail, freed first).
    new = computed(bm, list(range(100, 133)), "new")
    assert new.block_table == [3, 2, 1]
    bm.free(new)
    again = Sequence("again", list(range(33)), SamplingParams())
    assert bm.adopt_prefix(again) == 16                  # old's head block survived
    bm.free(again)
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_eviction_drops_the_hash_entry():
    bm = BlockManager(2, BS)
    a = computed(bm, list(range(17)), "a")
    bm.free(a)
    b = computed(bm, list(range(50, 82)), "b")          # needs both blocks: evicts a's cached block
    bm.free(b)
    assert bm.adopt_prefix(Sequence("a2", list(range(17)), SamplingParams())) == 0


def test_without_prefix_caching_nothing_is_shared():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    computed(bm, list(range(40)), "a")
    assert bm.adopt_prefix(Sequence("b", list(range(40)), SamplingParams())) == 0


def test_block_tables_rows_mirror_the_lists_and_grow():
    bm = BlockManager(2000, BS)
    seqs = [computed(bm, list(range(i, i + 20 * BS + i)), str(i)) for i in range(40)]  # > 16 rows, > 16 blocks
    bm.free(seqs[3])
    again = computed(bm, list(range(1000, 1000 + 5 * BS)), "again")   # takes the freed row
    assert again.block_row == 3 and seqs[3].block_row == -1
    for seq in seqs[:3] + seqs[4:] + [again]:
        n = len(seq.block_table)
        assert bm.tables.lengths[seq.block_row] == n
        assert bm.tables.array[seq.block_row, :n].tolist() == seq.block_table
