"""Continuous batching with chunked prefill under a token budget; preemption by recompute when blocks run out.

Waiting sequences are admitted in arrival order, but fairly across requests: a sequence's `group` is the API request
it belongs to (n choices, a batch of prompts), and the next one admitted is the first of those whose group has the
fewest running sequences, so a batch of 2,048 completions does not hold a later caller's request behind all of it.
Where every slot is taken and a request waits with none of its sequences running, the request with the most running
gives one up (the one with the fewest tokens to recompute), a step at a time: otherwise a later caller waited until
one of the batch's sequences ended, minutes for long completions. Sequences preempted because the cache ran out go
first; one that gave its slot up waits its turn.

No clocks, threads or devices here: `schedule()` is a function of the queues and the free blocks, so a
property test can drive it directly.
"""
from collections import Counter, deque
from dataclasses import dataclass, field

from .block_manager import BlockManager, BlockTables
from .sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)   # tokens computed this step, per sequence
    preempted: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)    # moved from waiting to running this step
    tables: BlockTables | None = None                         # the block manager's: each sequence's blocks as a row

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(n)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []   # admission order: the newest is preempted first
        self._waiting_groups: Counter[str] = Counter()   # waiting sequences by group
        self._running_groups: Counter[str] = Counter()   # running sequences by group

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self._waiting_groups[seq.group] += 1

    def _next_waiting(self) -> int:
        """The index in `waiting` of the next sequence to admit: the head when it was preempted or when one group
        is all that waits (the common case, checked in O(1)), else the first of the groups with the fewest
        running sequences."""
        head = self.waiting[0]
        fewest = self._running_groups[head.group]
        if (head.num_preemptions and not head.yielded) or fewest == 0 or len(self._waiting_groups) == 1:
            return 0
        best = 0
        for i, seq in enumerate(self.waiting):
            running = self._running_groups[seq.group]
            if running < fewest:
                best, fewest = i, running
                if not running:
                    break
        return best

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch(tables=self.block_manager.tables)
        budget = self.max_num_batched_tokens
        if self.waiting and len(self.running) >= self.max_num_seqs:
            self._yield_a_slot(batch)
        yielded = len(batch.preempted)
        # This loop runs for every running sequence every step (~1 us each on the GPU machine's host): its calls
        # are bound once, and the block manager is called only where a block fills up or one more is needed,
        # which the loop tells by the same arithmetic the calls would start with (once per block_size tokens).
        manager = self.block_manager
        cache_full_blocks = manager.cache_full_blocks
        block_size, prefix_caching = manager.block_size, manager.enable_prefix_caching
        add_seq, add_count = batch.seqs.append, batch.num_new_tokens.append
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            # Its last token never needs K/V: with overlap scheduling, a sequence whose placeholder is its last
            # token (the length limit ends it) sits out the step rather than compute one that is thrown away.
            computed = seq.num_computed_tokens
            n = min(len(seq.token_ids), seq.max_len - 1) - computed
            if n > budget:
                n = budget
            if n <= 0:
                i += 1
                continue
            end = computed + n
            if end > len(seq.block_table) * block_size and not self._allocate_or_preempt(seq, n, batch):
                break
            if prefix_caching and end // block_size > len(seq.block_hashes):
                cache_full_blocks(seq, end)
            add_seq(seq)
            add_count(n)
            budget -= n
            i += 1
        if len(batch.preempted) > yielded:   # the cache is full: admitting more would only preempt again
            return batch
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            at = self._next_waiting()
            seq = self.waiting[at]
            cached = self.block_manager.adopt_prefix(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            if not self.block_manager.allocate(seq, n):
                self.block_manager.free(seq)
                break
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = cached
            self.block_manager.cache_full_blocks(seq, seq.num_computed_tokens + n)
            if at:
                del self.waiting[at]
            else:
                self.waiting.popleft()
            self._moved(seq, self._waiting_groups, self._running_groups)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.add(seq, n)
            batch.admitted.append(seq)
            budget -= n
        return batch

    def _yield_a_slot(self, batch: ScheduledBatch) -> None:
        """Every slot is taken: if a waiting group has no running sequence and some group runs two or more, the
        largest group's running sequence with the fewest computed tokens goes back to the waiting queue's end (into
        the batch's preempted list), and the admission after the running sequences gives its slot to the first group
        with none running. One a step, so a flood of small requests costs a batch one recompute a step at most."""
        if len(self._running_groups) == len(self.running):   # one running sequence a group: nobody holds more
            return
        head = self.waiting[0]
        if head.num_preemptions and not head.yielded:   # the cache ran out: that sequence goes first
            return
        if all(group in self._running_groups for group in self._waiting_groups):
            return
        group = max(self._running_groups, key=self._running_groups.__getitem__)
        victim = min((seq for seq in self.running if seq.group == group), key=lambda seq: seq.num_computed_tokens)
        self.running.remove(victim)
        self._preempt(victim, yielded=True)
        batch.preempted.append(victim)

    def _allocate_or_preempt(self, seq: Sequence, n: int, batch: ScheduledBatch) -> bool:
        """Blocks for `n` more tokens of a running sequence, preempting the newest running ones (into the batch's
        list) until they fit; False when `seq` itself had to go."""
        while not self.block_manager.allocate(seq, n):
            victim = self.running.pop()
            self._preempt(victim)
            batch.preempted.append(victim)
            if victim is seq:
                return False
        return True

    @staticmethod
    def _moved(seq: Sequence, source: Counter, to: Counter | None = None) -> None:
        source[seq.group] -= 1
        if not source[seq.group]:
            del source[seq.group]
        if to is not None:
            to[seq.group] += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._moved(seq, self._running_groups)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            self._moved(seq, self._waiting_groups)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _preempt(self, seq: Sequence, yielded: bool = False) -> None:
        """Drop the sequence's KV and queue it, first (the cache ran out) or last (it `yielded` its slot to a request
        with none); its tokens (prompt + outputs so far) are recomputed."""
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        seq.yielded = yielded
        if yielded:
            self.waiting.append(seq)
        else:
            self.waiting.appendleft(seq)
        self._moved(seq, self._running_groups, self._waiting_groups)
