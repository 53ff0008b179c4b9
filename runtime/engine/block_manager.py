"""Paged KV blocks: refcounts, a hash chain over full blocks for prefix reuse, and an LRU of free cached blocks."""
from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np

from .sequence import Sequence


@dataclass
class Block:
    id: int
    ref_count: int = 0
    hash: int | None = None             # chain hash of (parent hash, tokens) once the block is full and registered
    token_ids: tuple[int, ...] | None = None


class Blocks:
    """Every block by id, each made on first use: an H200's KV cache has ~50,000 blocks, and making all of them up
    front cost a cold start a third of a second."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.made: dict[int, Block] = {}

    def __getitem__(self, block_id: int) -> Block:
        block = self.made.get(block_id)
        if block is None:
            if not 0 <= block_id < self.num_blocks:
                raise IndexError(f"block {block_id} of {self.num_blocks}")
            block = self.made[block_id] = Block(block_id)
        return block

    def __len__(self) -> int:
        return self.num_blocks

    def __iter__(self):
        return (self[i] for i in range(self.num_blocks))


class BlockTables:
    """The block table of every sequence holding blocks, also as a row of one int32 array (`seq.block_row`), so a
    step gathers its batch's tables with one numpy op: flattening 256 Python lists took ~0.9 ms a step. A sequence
    keeps its row from its first block until it is freed; the array doubles when rows or columns run out."""

    def __init__(self, rows: int = 16, width: int = 16):
        self.array = np.zeros((rows, width), dtype=np.int32)
        self.lengths = np.zeros(rows, dtype=np.int32)   # blocks in each row
        self._free_rows = list(range(rows - 1, -1, -1))

    def append(self, seq: Sequence, block_id: int) -> None:
        """Add a block to the end of the sequence's table, the list and the row."""
        seq.block_table.append(block_id)
        if seq.block_row < 0:
            if not self._free_rows:
                self._grow(rows=True)
            seq.block_row = self._free_rows.pop()
        n = len(seq.block_table)
        while n > self.array.shape[1]:
            self._grow(rows=False)
        self.array[seq.block_row, n - 1] = block_id
        self.lengths[seq.block_row] = n

    def release(self, seq: Sequence) -> None:
        seq.block_table = []
        if seq.block_row >= 0:
            self.lengths[seq.block_row] = 0
            self._free_rows.append(seq.block_row)
            seq.block_row = -1

    def _grow(self, rows: bool) -> None:
        old = self.array
        if rows:
            self.array = np.zeros((2 * old.shape[0], old.shape[1]), dtype=np.int32)
            self.lengths = np.concatenate([self.lengths, np.zeros_like(self.lengths)])
            self._free_rows = list(range(self.array.shape[0] - 1, old.shape[0] - 1, -1))
        else:
            self.array = np.zeros((old.shape[0], 2 * old.shape[1]), dtype=np.int32)
        self.array[:old.shape[0], :old.shape[1]] = old


def chain_hash(parent: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = Blocks(num_blocks)
        self.clean: deque[int] = deque(range(num_blocks))       # free, holding nothing worth keeping
        self.evictable: OrderedDict[int, None] = OrderedDict()  # free but still cached; oldest first
        self.cached: dict[int, int] = {}                         # chain hash -> block id
        self.tables = BlockTables()

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.clean) + len(self.evictable)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def adopt_prefix(self, seq: Sequence) -> int:
        """Point a fresh sequence at cached blocks holding its longest known prefix; return the tokens covered."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        seq.block_hashes = []
        if not self.enable_prefix_caching:
            return 0
        # The last token is always recomputed: its logits are needed to sample.
        for i in range((len(seq) - 1) // self.block_size):
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = chain_hash(seq.block_hashes[-1] if seq.block_hashes else None, tokens)
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            self._take(block_id)
            self.tables.append(seq, block_id)
            seq.block_hashes.append(h)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        return seq.num_computed_tokens

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow the block table to hold `num_new_tokens` more tokens; False, taking nothing, when too few blocks are
        free. A decode step needs a new block once every block_size tokens, and the scheduler asks for every running
        sequence: the common answer costs one division."""
        need = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size) - len(seq.block_table)
        if need <= 0:
            return True
        if need > len(self.clean) + len(self.evictable):
            return False
        for _ in range(need):
            block_id = self.clean.popleft() if self.clean else self._evict()
            self.blocks[block_id].ref_count = 1
            self.tables.append(seq, block_id)
        return True

    def cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register the blocks full within the first `num_tokens` tokens so later requests can reuse them.

        Called when those tokens are scheduled: a request admitted later in the same step may already share
        them, since every layer writes the step's K/V before any attention reads it. With overlap scheduling the
        engine calls it again once a placeholder's token is known.
        """
        if not self.enable_prefix_caching or num_tokens // self.block_size <= len(seq.block_hashes):
            return
        num_tokens = min(num_tokens, seq.num_known_tokens)   # a placeholder's block waits until its token is known
        for i in range(len(seq.block_hashes), num_tokens // self.block_size):
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = chain_hash(seq.block_hashes[-1] if seq.block_hashes else None, tokens)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if h not in self.cached:  # an identical block computed by another request keeps the entry
                block.hash, block.token_ids = h, tokens
                self.cached[h] = block.id

    def free(self, seq: Sequence) -> None:
        # Tail blocks go first into the LRU so they are evicted before the shared prefix they extend.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                if block.hash is not None:
                    self.evictable[block_id] = None
                else:
                    self.clean.append(block_id)
        self.tables.release(seq)
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def forget_cached(self) -> None:
        """Drop every cached prefix (the KV cache's contents were discarded); only when no block is in use."""
        used = self.blocks.made.values()  # a block never used holds nothing to forget
        assert all(b.ref_count == 0 for b in used), "forget_cached() while sequences hold blocks"
        for block in used:
            block.hash, block.token_ids = None, None
        self.cached.clear()
        self.evictable.clear()
        self.clean = deque(range(len(self.blocks)))

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self.evictable.pop(block_id, None)
        block.ref_count += 1

    def _evict(self) -> int:
        block_id, _ = self.evictable.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.cached.get(block.hash) == block_id:
            del self.cached[block.hash]
        block.hash, block.token_ids = None, None
        return block_id
