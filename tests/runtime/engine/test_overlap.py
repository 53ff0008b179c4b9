"""Overlap scheduling (EngineConfig.overlap): the same tokens, finish reasons and freed blocks as the serial engine,
whatever ends a request, on the CPU, where launching a step runs it and collecting it only reads its tokens."""
import asyncio

import pytest
from transformers import AutoTokenizer

from ember.runtime.engine.async_engine import AsyncLLM
from ember.runtime.engine.config import EngineConfig
from ember.runtime.engine.engine import LLMEngine
from ember.runtime.engine.sampling import SamplingParams
from ember.runtime.engine.tiny import build_tiny_model

from .helpers import wait_until_idle
from .hf_models import build, random_prompts, reference_greedy

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
Outcome = dict[str, tuple[list[int], str | None]]   # request id -> (its tokens, its finish reason)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama-overlap")
    return str(directory), build("llama", directory)


def engine(model_dir: str, overlap: bool, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model_dir, overlap=overlap,
                                  **{"max_num_seqs": 8, "num_kv_blocks": 128, **overrides}))


def run(eng: LLMEngine, outcome: Outcome | None = None, steps: int | None = None) -> Outcome:
    """Step until the engine is idle (or `steps` steps); each request's tokens and finish reason so far."""
    outcome = {} if outcome is None else outcome
    while eng.has_unfinished_requests() and (steps is None or steps > 0):
        for out in eng.step():
            tokens, _ = outcome.get(out.request_id, ([], None))
            outcome[out.request_id] = (tokens + out.new_token_ids, out.finish_reason)
        steps = None if steps is None else steps - 1
    return outcome


def assert_idle(eng: LLMEngine) -> None:
    bm = eng.block_manager
    assert not eng.has_unfinished_requests() and not eng.seqs
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)


def serial_and_overlapped(scenario, model_dir: str, **overrides) -> Outcome:
    """Run `scenario(engine)` on a serial and on an overlapping engine; both must end the same, idle."""
    outcomes = []
    for overlap in (False, True):
        eng = engine(model_dir, overlap, **overrides)
        outcomes.append(scenario(eng))
        assert_idle(eng)
    assert outcomes[1] == outcomes[0]
    return outcomes[1]


def record_calls(eng) -> list[str]:
    """The order of the runner's launches and collects from now on."""
    calls: list[str] = []
    launch, collect = eng.runner.launch, eng.runner.collect
    eng.runner.launch = lambda *args, **kwargs: calls.append("launch") or launch(*args, **kwargs)
    eng.runner.collect = lambda launched: calls.append("collect") or collect(launched)
    return calls


def test_steps_overlap_one_in_flight_at_most(llama):
    model_dir, _ = llama
    eng = engine(model_dir, overlap=True)
    calls = record_calls(eng)
    prompts = random_prompts([5, 9])
    assert eng.generate(prompts, GREEDY) == [reference_greedy(llama[1], p, 12) for p in prompts]
    # step N+1 launches before step N is collected, every step but the first and the last
    assert calls == ["launch"] + ["launch", "collect"] * 11 + ["collect"]


def test_a_step_waiting_on_a_graph_capture_lets_the_step_in_flight_report_first(llama):
    """A decode step whose graph is not captured yet (on the GPU: tens of ms) is launched only after the step in
    flight is collected, so a restored replica's first token is not held back by its first capture. CPU engines
    have no graphs: here the runner says a capture is due for each batch size not decoded yet."""
    model_dir, model = llama
    eng = engine(model_dir, overlap=True)
    calls = record_calls(eng)
    decoded: set[int] = set()
    launch = eng.runner.launch

    def launched(batch, *args, **kwargs):
        if all(n == 1 for n in batch.num_new_tokens):
            decoded.add(len(batch.seqs))
        return launch(batch, *args, **kwargs)

    eng.runner.launch = launched
    eng.runner.capture_due = lambda num_seqs: num_seqs not in decoded
    prompt = random_prompts([9], seed=3)[0]
    eng.add_request("r", prompt, GREEDY)
    first = []
    while not first:
        first = eng.step()
    # the prefill's token comes out of the step that collected it, with no decode step launched before it
    assert calls == ["launch", "collect"] and first[0].new_token_ids == reference_greedy(model, prompt, 1)
    assert first[0].new_token_ids + run(eng)["r"][0] == reference_greedy(model, prompt, 12)
    # the capture's step launched on its own; every step after it overlaps again
    assert calls == ["launch", "collect", "launch"] + ["launch", "collect"] * 10 + ["collect"]
    assert_idle(eng)

    # A prompt prefilled in chunks of 16 tokens: its chunks still overlap (no decode graph is near) until its last
    # chunk's token is in flight
    eng = engine(model_dir, overlap=True, max_num_batched_tokens=16)
    calls = record_calls(eng)
    decoded.clear()
    launch = eng.runner.launch
    eng.runner.launch = launched
    eng.runner.capture_due = lambda num_seqs: num_seqs not in decoded
    prompt = random_prompts([50], seed=4)[0]
    assert eng.generate([prompt], GREEDY) == [reference_greedy(model, prompt, 12)]
    assert calls == (["launch"] + ["launch", "collect"] * 3 + ["collect", "launch"] + ["launch", "collect"] * 10
                     + ["collect"])


def test_steps_run_one_at_a_time_until_min_tokens_is_reached(llama):
    model_dir, model = llama
    eng = engine(model_dir, overlap=True)
    calls = record_calls(eng)
    prompt = random_prompts([7], seed=14)[0]
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=4, ignore_eos=True)
    assert eng.generate([prompt], params) == [reference_greedy(model, prompt, 12)]
    # stop tokens are banned from its first four tokens: the host counts them before each of those steps
    assert calls == ["launch", "collect"] * 4 + ["launch"] + ["launch", "collect"] * 7 + ["collect"]


def test_greedy_under_continuous_batching_and_chunked_prefill(llama):
    model_dir, model = llama
    prompts = random_prompts([3, 17, 40, 9, 64, 25], seed=2)

    def scenario(eng):
        for i, prompt in enumerate(prompts[:3]):
            eng.add_request(str(i), prompt, GREEDY)
        outcome = run(eng, steps=4)   # the first three are decoding when the rest arrive
        for i, prompt in enumerate(prompts[3:], start=3):
            eng.add_request(str(i), prompt, GREEDY)
        return run(eng, outcome)

    outcome = serial_and_overlapped(scenario, model_dir, max_num_seqs=3, max_num_batched_tokens=16)
    assert [outcome[str(i)][0] for i in range(len(prompts))] == [reference_greedy(model, p, 12) for p in prompts]


def test_seeded_sampling(llama):
    prompts = random_prompts([12, 5, 30, 8], seed=10)
    params = [SamplingParams(temperature=1.0, top_p=0.95, top_k=20, max_tokens=10, seed=1234 + i, ignore_eos=True)
              for i in range(len(prompts))]

    def scenario(eng):
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            eng.add_request(str(i), prompt, p)
        return run(eng)

    serial_and_overlapped(scenario, llama[0])


def test_eos_stop_token_max_tokens_context_length_and_min_tokens(llama):
    """Each way of ending a request, in one batch with requests that go on: a request that stops was already
    launched into the next step, whose output for it is dropped."""
    model_dir, model = llama
    prompt = random_prompts([10], seed=7)[0]
    greedy = reference_greedy(model, prompt, 8)
    params = {"eos": SamplingParams(temperature=0, max_tokens=8),
              "stop-token": SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=[greedy[1]]),
              "max-tokens": SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
              "context": SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
              "min-tokens": SamplingParams(temperature=0, max_tokens=4, min_tokens=4)}

    def scenario(eng):
        eng.eos_token_ids = {greedy[2]}
        for name, p in params.items():
            eng.add_request(name, prompt, p)
        return run(eng)

    outcome = serial_and_overlapped(scenario, model_dir, max_model_len=14)
    stop_at = greedy.index(greedy[2])
    assert outcome["eos"] == (greedy[:stop_at + 1], "stop")
    assert outcome["stop-token"] == (greedy[:greedy.index(greedy[1]) + 1], "stop")
    assert outcome["max-tokens"] == (greedy[:3], "length")
    assert outcome["context"] == (greedy[:4], "length")
    assert outcome["min-tokens"][1] == "length" and greedy[2] not in outcome["min-tokens"][0]


def test_requests_stopping_at_every_step_beside_long_ones(llama):
    """EOS ends a sampled request at an arbitrary step while others decode on: no token of the step launched
    after its stop reaches it, and its blocks come back."""
    model_dir, _ = llama
    prompts = random_prompts([4, 11, 6, 19, 7, 13], seed=21)
    params = SamplingParams(temperature=1.0, max_tokens=24, seed=5)

    def scenario(eng):
        eng.eos_token_ids = set(range(3, 500, 20))
        for i, prompt in enumerate(prompts):
            eng.add_request(str(i), prompt, params if i % 2 else GREEDY)
        return run(eng)

    outcome = serial_and_overlapped(scenario, model_dir)
    stopped = [len(tokens) for tokens, reason in outcome.values() if reason == "stop"]
    assert len(set(stopped)) >= 2   # at different steps


def test_prefix_cache_hits_on_prompts_and_on_generated_tokens(llama):
    """A block is registered once all its tokens are known: a placeholder's block waits for its token."""
    model_dir, _ = llama
    shared = random_prompts([40], seed=3)[0]
    tails = random_prompts([5, 11, 1], seed=4)
    cached = []

    def scenario(eng):
        first = shared + tails[0]
        eng.add_request("first", first, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
        outcome = run(eng)
        for i, tail in enumerate(tails[1:] + [tails[0]]):   # the last repeats the first
            eng.add_request(str(i), shared + tail, GREEDY)
        eng.add_request("continued", first + outcome["first"][0], GREEDY)   # 65 tokens, 4 blocks known
        hits = {}
        while eng.has_unfinished_requests():
            for out in eng.step():
                tokens, _ = outcome.get(out.request_id, ([], None))
                outcome[out.request_id] = (tokens + out.new_token_ids, out.finish_reason)
                hits[out.request_id] = out.num_cached_tokens
        cached.append(hits)
        return outcome

    serial_and_overlapped(scenario, model_dir)
    assert cached[1] == cached[0] == {"0": 32, "1": 32, "2": 32, "continued": 64}


def test_preemption_under_a_small_kv_cache(llama):
    model_dir, model = llama
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    prompts = random_prompts([20, 14, 26, 9], seed=6)
    preemptions = []

    def scenario(eng):
        for i, prompt in enumerate(prompts):
            eng.add_request(str(i), prompt, params)
        outcome = run(eng)
        preemptions.append(eng.stats.num_preemptions)
        return outcome

    outcome = serial_and_overlapped(scenario, model_dir, num_kv_blocks=6, max_model_len=96,
                                    max_num_batched_tokens=96)
    assert [outcome[str(i)][0] for i in range(4)] == [reference_greedy(model, p, 30) for p in prompts]
    assert all(n > 0 for n in preemptions)


def test_abort_mid_stream(llama):
    model_dir, _ = llama
    prompts = random_prompts([30, 12, 7], seed=8)

    def scenario(eng):
        for i, prompt in enumerate(prompts):
            eng.add_request(str(i), prompt, GREEDY)
        outcome = run(eng, steps=5)
        eng.abort_request("0")
        eng.abort_request("0")
        outcome = run(eng, outcome, steps=2)
        eng.abort_request("2")
        outcome = run(eng, outcome)
        # the tokens an aborted request got depend on when the abort came; every one has a prefix of its run
        return {k: (v[0][:1], v[1]) if v[1] == "abort" else v for k, v in outcome.items()}

    outcome = serial_and_overlapped(scenario, model_dir)
    assert {k: reason for k, (_, reason) in outcome.items()} == {"0": "abort", "1": "length", "2": "abort"}


def test_penalties_and_logprobs_run_serially_beside_overlapped_requests(llama):
    model_dir, _ = llama
    prompts = random_prompts([9, 14, 6], seed=9)
    params = [SamplingParams(temperature=0, max_tokens=10, logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.3, frequency_penalty=0.5,
                             ignore_eos=True),
              GREEDY]
    logprobs = []

    def scenario(eng):
        eng.add_request("plain", prompts[2], GREEDY)
        outcome = run(eng, steps=3)   # overlapping when the others arrive
        eng.add_request("logprobs", prompts[0], params[0])
        eng.add_request("penalties", prompts[1], params[1])
        seen = []
        while eng.has_unfinished_requests():
            for out in eng.step():
                tokens, _ = outcome.get(out.request_id, ([], None))
                outcome[out.request_id] = (tokens + out.new_token_ids, out.finish_reason)
                if out.request_id == "logprobs":
                    seen += out.new_logprobs
        logprobs.append(seen)
        return outcome

    serial_and_overlapped(scenario, model_dir)
    assert len(logprobs[1]) == 10
    for serial, overlapped in zip(*logprobs):
        assert overlapped["token_id"] == serial["token_id"]
        assert overlapped["logprob"] == pytest.approx(serial["logprob"], abs=1e-5)
        assert [t for t, _ in overlapped["top"]] == [t for t, _ in serial["top"]]


def test_park_and_capture_wait_for_the_step_in_flight(llama):
    model_dir, model = llama
    eng = engine(model_dir, overlap=True)
    prompt = random_prompts([9], seed=6)[0]
    greedy = reference_greedy(model, prompt, 8)
    k = next(i for i in range(1, 8) if greedy[i] not in greedy[:i])
    eng.eos_token_ids = {greedy[k]}
    eng.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=8))
    outcome = run(eng, steps=k + 2)   # it stops at its token k + 1, collected while the step after is in flight
    assert outcome["r"][1] == "stop" and eng.has_unfinished_requests()
    assert eng.park().released_bytes > 0 and not eng.has_unfinished_requests()
    eng.wake()
    assert eng.generate([prompt], GREEDY) == [reference_greedy(model, prompt, 12)]


def test_the_flag_is_validated(llama):
    with pytest.raises(ValueError, match="overlap='yes'"):
        EngineConfig(model=llama[0], overlap="yes")


@pytest.mark.parametrize("value", ["sleep", "", None, True])
def test_the_device_wait_is_validated(llama, value):
    with pytest.raises(ValueError, match="device_wait=.*use 'block'"):
        EngineConfig(model=llama[0], device_wait=value)
    assert EngineConfig(model=llama[0], device_wait="spin").device_wait == "spin"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen3")


async def collect(stream):
    return [c async for c in stream]


def per_choice(chunks) -> list[tuple]:
    """Each choice's stream as a client reads it: its text and token ids joined, and how it ended. How the chunks
    of different choices interleave, and where one choice's text is cut between chunks, depend on timing."""
    choices: dict[int, list] = {}
    for c in chunks:
        text, ids, _, _ = choices.setdefault(c.index, ["", [], None, None])
        choices[c.index] = [text + c.text, ids + list(c.token_ids), c.finish_reason, c.stop_reason]
    return [tuple(choices[i]) for i in sorted(choices)]


def test_async_streaming_matches_the_serial_engine(tiny):
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    prompt = tokenizer.encode("The capital of France is", add_special_tokens=False)

    def streams(overlap: bool):
        llm = AsyncLLM(LLMEngine(EngineConfig(model=str(tiny), max_model_len=256, overlap=overlap)), tokenizer)
        try:
            greedy = asyncio.run(collect(llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0))))
            seeded = asyncio.run(collect(llm.generate(prompt, SamplingParams(max_tokens=10, temperature=1.0,
                                                                              seed=11), n=3)))
            full = "".join(c.text for c in asyncio.run(collect(llm.generate(
                prompt, SamplingParams(max_tokens=40, temperature=1.0, seed=5)))))
            stop = full[len(full) // 2:len(full) // 2 + 3]
            stopped = asyncio.run(collect(llm.generate(prompt, SamplingParams(max_tokens=40, temperature=1.0, seed=5),
                                                       stop=[stop])))
            wait_until_idle(llm.engine)   # the stop string's abort reaches the loop after the last chunk
            return [per_choice(chunks) for chunks in (greedy, seeded, stopped)]
        finally:
            llm.shutdown()

    serial, overlapped = streams(False), streams(True)
    assert overlapped == serial
    _, _, reason, stop_reason = overlapped[2][0]
    assert reason == "stop" and isinstance(stop_reason, str)   # the stop string matched


def test_a_failed_collect_loses_no_token(llama):
    """A step that raises takes its tokens and those of the step launched after it: both are sampled again."""
    model_dir, model = llama
    prompts = random_prompts([6, 21], seed=12)
    eng = engine(model_dir, overlap=True)
    for i, prompt in enumerate(prompts):
        eng.add_request(str(i), prompt, GREEDY)
    outcome = run(eng, steps=4)
    collect = eng.runner.collect

    def fails_once(launched):
        del eng.runner.collect
        raise RuntimeError("device error")

    eng.runner.collect = fails_once
    with pytest.raises(RuntimeError, match="device error"):
        eng.step()
    outcome = run(eng, outcome)
    assert eng.runner.collect == collect
    assert [outcome[str(i)] for i in range(2)] == [(reference_greedy(model, p, 12), "length") for p in prompts]
    assert_idle(eng)


def test_a_later_request_takes_a_slot_from_a_batch_that_holds_them_all(llama):
    """Eight sequences of one request fill every slot; a request that comes later gets its first token within a few
    steps (one of the batch gives its slot up and is recomputed later) and every sequence still ends as greedy."""
    model_dir, model = llama
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    prompts = random_prompts([12, 9, 15, 7, 11, 10, 8, 14, 6], seed=11)
    waited = []

    def scenario(eng):
        for i, prompt in enumerate(prompts[:8]):
            eng.add_request(f"batch-{i}", prompt, params, group="batch")
        outcome = run(eng, steps=3)
        eng.add_request("late", prompts[8], params)
        steps = 0
        while "late" not in outcome:
            outcome = run(eng, outcome, steps=1)
            steps += 1
        waited.append((steps, eng.stats.num_preemptions))
        return run(eng, outcome)

    outcome = serial_and_overlapped(scenario, model_dir)
    assert [outcome[f"batch-{i}"][0] for i in range(8)] + [outcome["late"][0]] == [
        reference_greedy(model, p, 30) for p in prompts]
    assert all(steps <= 3 and preemptions == 1 for steps, preemptions in waited), waited
