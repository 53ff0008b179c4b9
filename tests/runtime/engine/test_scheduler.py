"""Scheduler properties under random arrivals, lengths, cancellations and cache pressure (hypothesis).

The first test drives Scheduler + BlockManager directly with a stand-in for the model (each completed
sequence gets one token); the second drives the real LLMEngine on a tiny model.
"""
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ember.runtime.engine.block_manager import BlockManager
from ember.runtime.engine.config import EngineConfig
from ember.runtime.engine.engine import LLMEngine
from ember.runtime.engine.sampling import SamplingParams
from ember.runtime.engine.scheduler import ScheduledBatch, Scheduler
from ember.runtime.engine.sequence import Sequence, SequenceStatus

from .hf_models import build

BS = 8


@st.composite
def workloads(draw):
    num_blocks = draw(st.integers(3, 12))
    capacity = num_blocks * BS
    prefixes = [draw(st.lists(st.integers(0, 3), min_size=0, max_size=40)) for _ in range(2)]
    requests = []
    for _ in range(draw(st.integers(1, 12))):
        prefix = draw(st.sampled_from(prefixes))
        tail = draw(st.lists(st.integers(0, 50), min_size=1, max_size=40))
        prompt = (prefix + tail)[:capacity - 1]
        max_tokens = draw(st.integers(1, max(1, min(30, capacity - len(prompt)))))
        arrival = draw(st.integers(0, 15))
        cancel = draw(st.one_of(st.none(), st.integers(arrival, arrival + 20)))
        requests.append((prompt, max_tokens, arrival, cancel))
    return dict(num_blocks=num_blocks, max_num_seqs=draw(st.integers(1, 6)),
                budget=draw(st.integers(1, 64)), prefix_caching=draw(st.booleans()), requests=requests,
                groups=draw(st.integers(1, 4)))   # requests in turn belong to this many callers' requests


def compute(scheduler: Scheduler, batch: ScheduledBatch) -> list[Sequence]:
    """What a model's step does to a scheduled batch: its tokens computed, a token (len % 7) sampled for each sequence
    whose tokens are all in, a sequence at its max_tokens finished. Returns the sequences that finished."""
    done = []
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == len(seq):
            seq.token_ids.append(len(seq) % 7)
            if seq.num_output_tokens >= seq.params.max_tokens:
                scheduler.finish(seq, "length")
                done.append(seq)
    return done


def check_block_accounting(bm: BlockManager, live: list[Sequence]) -> None:
    owners = Counter(b for seq in live for b in seq.block_table)
    for block in bm.blocks:
        assert block.ref_count == owners[block.id]
    free = set(bm.clean) | set(bm.evictable)
    assert len(free) == len(bm.clean) + len(bm.evictable)
    assert not free & set(owners)
    assert len(free) + len(owners) == bm.num_blocks
    rows = [seq.block_row for seq in live if seq.block_table]
    assert len(set(rows)) == len(rows)
    for seq in live:   # the array rows the runner reads mirror the lists
        n = len(seq.block_table)
        assert bm.tables.lengths[seq.block_row] == n and bm.tables.array[seq.block_row, :n].tolist() == seq.block_table


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_every_request_finishes_once_within_budget(w):
    bm = BlockManager(w["num_blocks"], BS, w["prefix_caching"])
    scheduler = Scheduler(bm, w["max_num_seqs"], w["budget"])
    seqs = [Sequence(str(i), prompt, SamplingParams(max_tokens=m)) for i, (prompt, m, _, _) in enumerate(w["requests"])]
    for i, seq in enumerate(seqs):
        seq.group = f"g{i % w['groups']}"
    finished: Counter = Counter()
    for step in range(2000):
        for seq, (_, _, arrival, cancel) in zip(seqs, w["requests"]):
            if arrival == step:
                scheduler.add(seq)
            if cancel == step and arrival <= step and seq.status is not SequenceStatus.FINISHED:
                scheduler.finish(seq, "abort")
                finished[seq.request_id] += 1
        batch = scheduler.schedule()
        assert batch.num_tokens <= w["budget"]
        assert len(scheduler.running) <= w["max_num_seqs"]
        assert len({id(s) for s in batch.seqs}) == len(batch.seqs)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            assert seq.status is SequenceStatus.RUNNING and 1 <= n <= seq.num_uncomputed_tokens
            assert len(seq.block_table) * BS >= seq.num_computed_tokens + n
        check_block_accounting(bm, scheduler.running)
        # the fair share's counts mirror the queues
        assert scheduler._running_groups == Counter(s.group for s in scheduler.running)
        assert scheduler._waiting_groups == Counter(s.group for s in scheduler.waiting)
        for seq in compute(scheduler, batch):
            finished[seq.request_id] += 1
        if step > max(r[2] for r in w["requests"]) and not scheduler.has_unfinished():
            break
    else:
        pytest.fail("the scheduler stopped making progress")
    assert finished == Counter({s.request_id: 1 for s in seqs})
    for seq in seqs:
        if seq.finish_reason == "length":
            assert seq.num_output_tokens == seq.params.max_tokens
    assert all(b.ref_count == 0 for b in bm.blocks) and bm.num_free_blocks == w["num_blocks"]
    assert all(seq.block_row == -1 for seq in seqs) and not bm.tables.lengths.any()


def test_a_later_callers_request_is_admitted_before_the_rest_of_an_earlier_batch():
    """A batch of 100 completions (one group) takes the 4 slots; a request that comes after it gets the next free slot,
    not the 101st; preempted sequences still go first; with one group waiting, arrival order."""
    bm = BlockManager(64, BS, False)
    scheduler = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=1000)
    batch = [Sequence(f"b{i}", [1, 2, 3], SamplingParams(max_tokens=2)) for i in range(100)]
    for seq in batch:
        seq.group = "batch"
        scheduler.add(seq)
    later = Sequence("later", [4, 5], SamplingParams(max_tokens=2))
    assert [s.request_id for s in scheduler.schedule().admitted] == ["b0", "b1", "b2", "b3"]
    scheduler.add(later)
    scheduler.finish(batch[0], "length")
    assert [s.request_id for s in scheduler.schedule().admitted] == ["later"]
    scheduler.finish(batch[1], "length")
    assert [s.request_id for s in scheduler.schedule().admitted] == ["b4"]   # the batch's own order
    scheduler._preempt(later)   # as a full cache does
    scheduler.running.remove(later)
    scheduler.finish(batch[2], "length")
    admitted = scheduler.schedule().admitted
    assert [s.request_id for s in admitted][:1] == ["later"]   # a preempted sequence first


def test_a_request_with_none_running_takes_a_slot_from_the_largest_one_step_later():
    """Every slot held by one batch whose sequences run long: a later request is admitted the next step, in the slot
    of the batch's sequence with the fewest tokens to recompute, which goes to the back of the queue; one a step,
    and none where no request runs more than one (n=1 requests keep arrival order)."""
    bm = BlockManager(64, BS, False)
    scheduler = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=1000)
    batch = [Sequence(f"b{i}", [1, 2, 3] * (i + 1), SamplingParams(max_tokens=50)) for i in range(6)]
    for seq in batch:
        seq.group = "batch"
        scheduler.add(seq)
    first = scheduler.schedule()
    compute(scheduler, first)
    assert [s.request_id for s in first.admitted] == ["b0", "b1", "b2", "b3"]
    later, other = (Sequence(name, [4, 5], SamplingParams(max_tokens=50)) for name in ("later", "other"))
    scheduler.add(later)
    scheduler.add(other)
    step = scheduler.schedule()
    assert [s.request_id for s in step.preempted] == ["b0"]   # 4 tokens computed against 7, 10, 13
    assert [s.request_id for s in step.admitted] == ["later"] and "b0" not in [s.request_id for s in step.seqs]
    assert [s.request_id for s in scheduler.waiting] == ["b4", "b5", "other", "b0"]
    assert batch[0].num_computed_tokens == 0 and batch[0].status is SequenceStatus.WAITING
    compute(scheduler, step)
    step = scheduler.schedule()   # "other" waits with none running: the batch (3 running) gives up b1
    assert [s.request_id for s in step.preempted] == ["b1"] and [s.request_id for s in step.admitted] == ["other"]
    compute(scheduler, step)
    step = scheduler.schedule()   # every waiting group runs a sequence: nothing yields
    assert not step.preempted and not step.admitted
    scheduler.finish(later, "length")
    assert [s.request_id for s in scheduler.schedule().admitted] == ["b4"]   # the batch's own order, b0 at the back

    singles = Scheduler(BlockManager(64, BS, False), max_num_seqs=2, max_num_batched_tokens=1000)
    for i in range(3):
        singles.add(Sequence(f"s{i}", [1, 2], SamplingParams(max_tokens=5)))
    assert [s.request_id for s in singles.schedule().admitted] == ["s0", "s1"]
    step = singles.schedule()
    assert not step.preempted and not step.admitted


def test_a_later_request_gets_its_first_token_within_steps_of_a_batch_that_holds_every_slot(qwen3_dir):
    """The engine with the batch's sequences giving slots up: the later request's first token comes two steps after
    it is added (a step to yield and prefill, one to sample) where it used to wait for a batch sequence to end, and
    every answer, the preempted ones recomputed, is the unpressured engine's."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[7 + i] * (5 + i) for i in range(4)]
    roomy = LLMEngine(EngineConfig(model=qwen3_dir, num_kv_blocks=64, max_model_len=64))
    expected = {str(i): roomy.generate([p], params)[0] for i, p in enumerate(prompts)}
    expected["later"] = roomy.generate([[3, 4, 5]], params)[0]

    eng = LLMEngine(EngineConfig(model=qwen3_dir, num_kv_blocks=64, max_model_len=64, max_num_seqs=2))
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params, group="batch")
    tokens: dict[str, list[int]] = {}

    def step() -> None:
        for out in eng.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)

    for _ in range(4):
        step()
    eng.add_request("later", [3, 4, 5], params)
    steps = 0
    while "later" not in tokens:
        step()
        steps += 1
    assert steps <= 3, f"the later request waited {steps} steps for its first token"
    while eng.has_unfinished_requests():
        step()
    assert tokens == expected


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3-prop")
    build("qwen3", directory)
    return str(directory)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_engine_under_pressure_matches_an_unpressured_engine(qwen3_dir, data):
    prompts = data.draw(st.lists(st.lists(st.integers(3, 60), min_size=1, max_size=30), min_size=1, max_size=6))
    prompts = [[5] * 16 + p if data.draw(st.booleans()) else p for p in prompts]   # shared prefixes for hits
    cancel = data.draw(st.lists(st.booleans(), min_size=len(prompts), max_size=len(prompts)))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    roomy = LLMEngine(EngineConfig(model=qwen3_dir, num_kv_blocks=64, max_model_len=64))
    expected = [roomy.generate([p], params)[0] for p in prompts]

    eng = LLMEngine(EngineConfig(model=qwen3_dir, block_size=8, num_kv_blocks=data.draw(st.integers(7, 16)),
                                 max_model_len=56, max_num_seqs=data.draw(st.integers(1, 4)),
                                 max_num_batched_tokens=data.draw(st.integers(4, 48))))
    tokens: dict[str, list[int]] = {}
    finishes: Counter = Counter()
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
    step = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            finishes[out.request_id] += out.finished
        step += 1
        if step == 3:
            for i, c in enumerate(cancel):
                if c:
                    eng.abort_request(str(i))
        assert step < 500
    assert finishes == Counter({str(i): 1 for i in range(len(prompts))})
    for i, want in enumerate(expected):
        assert tokens.get(str(i), []) == want[:len(tokens.get(str(i), []))]
        if not cancel[i]:
            assert tokens[str(i)] == want
    assert all(b.ref_count == 0 for b in eng.block_manager.blocks)
