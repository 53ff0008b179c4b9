import asyncio

import pytest
from transformers import AutoTokenizer

from ember.runtime.engine.async_engine import AsyncLLM, EngineDeadError
from ember.runtime.engine.config import EngineConfig
from ember.runtime.engine.engine import LLMEngine
from ember.runtime.engine.sampling import SamplingParams
from ember.runtime.engine.tiny import build_tiny_model
from tests.runtime.engine.helpers import wait_until_idle


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen3")
    llm = AsyncLLM(LLMEngine(EngineConfig(model=str(path), max_model_len=256)), AutoTokenizer.from_pretrained(path))
    yield llm
    llm.shutdown()


def prompt(llm, text="The capital of France is"):
    return llm.tokenizer.encode(text, add_special_tokens=False)


async def collect(stream):
    return [c async for c in stream]


def test_streams_tokens_and_text_that_match_offline_generate(llm):
    params = SamplingParams(max_tokens=12, temperature=0)
    chunks = asyncio.run(collect(llm.generate(prompt(llm), params)))
    tokens = [t for c in chunks for t in c.token_ids]
    assert chunks[-1].finish_reason == "length" and all(c.finish_reason is None for c in chunks[:-1])
    assert len(tokens) == 12
    assert "".join(c.text for c in chunks) == llm.tokenizer.decode(tokens, skip_special_tokens=True)
    # The loop thread owns the engine, so compare against a second engine on the same weights.
    offline = LLMEngine(llm.engine.config).generate([prompt(llm)], params)[0]
    assert tokens == offline


def test_a_caller_that_falls_behind_gets_the_steps_it_missed_as_one_increment(llm):
    """Outputs queued while the caller was busy come out joined (their tokens, logprobs and text in order), so an
    event loop behind the engine catches up; with stop strings every step stays its own increment."""
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)

    async def slow(stop=()):
        chunks = []
        async for c in llm.generate(prompt(llm), params, stop=stop):
            chunks.append(c)
            if len(chunks) == 1:   # busy while the engine runs the rest of the request
                while llm.engine.has_unfinished_requests():
                    await asyncio.sleep(0.01)
                # The engine had finished before its loop thread delivered the last step; a request added now is
                # answered after that delivery (the thread takes commands after delivering, and its posts to this
                # loop run in order), so once it is answered every step waits in the inbox.
                await collect(llm.generate(prompt(llm), SamplingParams(max_tokens=1)))
        return chunks

    chunks = asyncio.run(slow())
    tokens = [t for c in chunks for t in c.token_ids]
    # the first chunk holds what came before the caller first read (a step or a few on a busy machine), the second
    # everything the engine made while the caller was busy (one at a time, they would be 16)
    assert len(chunks) <= 2 and len(tokens) == 16 and chunks[-1].finish_reason == "length"
    assert [e["token_id"] for c in chunks for e in c.logprobs] == tokens
    assert "".join(c.text for c in chunks) == llm.tokenizer.decode(tokens, skip_special_tokens=True)
    assert tokens == [t for c in asyncio.run(collect(llm.generate(prompt(llm), params))) for t in c.token_ids]
    separate = asyncio.run(slow(stop=["\u2603\u2603"]))   # a stop string that never matches
    assert [len(c.token_ids) for c in separate] == [1] * 16
    assert [t for c in separate for t in c.token_ids] == tokens
    # a joined increment says where each token's text ends in it: the texts the steps had one by one
    each = []
    for c in chunks:
        ends = c.token_ends if len(c.token_ids) > 1 else [len(c.text)]
        assert c.token_ends is None or len(c.token_ends) == len(c.token_ids)
        each += [c.text[start:end] for start, end in zip([0, *ends], ends)]
    assert each == [c.text for c in separate]
    assert any(c.token_ends for c in chunks)


def test_n_fans_out_with_seed_plus_i_and_is_reproducible(llm):
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=11)

    def choices():
        chunks = asyncio.run(collect(llm.generate(prompt(llm), params, n=3)))
        return [tuple(t for c in chunks if c.index == i for t in c.token_ids) for i in range(3)]

    first = choices()
    assert first == choices()
    assert len(set(first)) == 3
    single = asyncio.run(collect(llm.generate(prompt(llm), SamplingParams(max_tokens=10, temperature=1.0, seed=12))))
    assert tuple(t for c in single for t in c.token_ids) == first[1]


def test_stop_string_ends_the_request_and_frees_its_blocks(llm):
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=5)
    full = "".join(c.text for c in asyncio.run(collect(llm.generate(prompt(llm), params))))
    stop = full[len(full) // 2:len(full) // 2 + 3]
    success = dict(llm.engine.stats.request_success)
    chunks = asyncio.run(collect(llm.generate(prompt(llm), params, stop=[stop])))
    assert "".join(c.text for c in chunks) == full[:full.find(stop)]
    assert (chunks[-1].finish_reason, chunks[-1].stop_reason) == ("stop", stop)
    wait_until_idle(llm.engine)
    # Not counted as aborted: "stop", or "length" when the engine ran to max_tokens before the abort reached it.
    after = llm.engine.stats.request_success
    assert after["abort"] == success.get("abort", 0)
    assert after["stop"] + after["length"] == success.get("stop", 0) + success.get("length", 0) + 1


def test_closing_the_stream_aborts_the_request_and_frees_kv_blocks(llm):
    async def read_two_then_leave():
        stream = llm.generate(prompt(llm), SamplingParams(max_tokens=200, temperature=1.0, ignore_eos=True))
        got = [await anext(stream), await anext(stream)]
        assert llm.engine.block_manager.usage > 0
        await stream.aclose()
        return got

    aborted = llm.engine.stats.request_success["abort"]
    assert len(asyncio.run(read_two_then_leave())) == 2
    wait_until_idle(llm.engine)
    assert llm.engine.stats.request_success["abort"] == aborted + 1


def test_cancelling_the_consumer_task_aborts_every_choice(llm):
    async def cancel_midway():
        async def consume():
            async for _ in llm.generate(prompt(llm), SamplingParams(max_tokens=200, ignore_eos=True), n=2):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    aborted = llm.engine.stats.request_success["abort"]
    asyncio.run(cancel_midway())
    wait_until_idle(llm.engine)
    assert llm.engine.stats.request_success["abort"] == aborted + 2


def test_refused_request_raises_value_error_before_any_output(llm):
    async def too_long():
        return await collect(llm.generate([1] * 300, SamplingParams(max_tokens=4)))

    with pytest.raises(ValueError, match="max_model_len"):
        asyncio.run(too_long())
    wait_until_idle(llm.engine)


def test_steps_failing_in_a_row_fail_waiting_requests_and_mark_the_engine_and_process_dead(tmp_path, monkeypatch):
    from ember.runtime import health
    from ember.runtime.engine.async_engine import MAX_FAILED_STEPS, RequestFailedError

    monkeypatch.setattr(health, "reason", None)
    monkeypatch.setattr(health, "_listeners", [])
    heard = []
    health.on_failure(heard.append)
    path = build_tiny_model(tmp_path / "m")
    engine = LLMEngine(EngineConfig(model=str(path), max_model_len=128))
    llm = AsyncLLM(engine, AutoTokenizer.from_pretrained(path))

    def broken_forward(*args, **kwargs):
        raise RuntimeError("device lost")

    engine.runner.launch = broken_forward   # the one entry of a step, serial or overlapped
    for _ in range(MAX_FAILED_STEPS - 1):
        with pytest.raises(RequestFailedError, match="device lost"):
            asyncio.run(collect(llm.generate([5, 6, 7], SamplingParams(max_tokens=4))))
        assert llm.alive and not heard
    with pytest.raises(EngineDeadError, match="device lost"):
        asyncio.run(collect(llm.generate([5, 6, 7], SamplingParams(max_tokens=4))))
    assert not llm.alive
    assert len(heard) == 1 and "device lost" in heard[0] == health.reason
    with pytest.raises(EngineDeadError):
        asyncio.run(collect(llm.generate([5, 6, 7], SamplingParams(max_tokens=4))))


def test_shutdown_fails_requests_in_flight(tmp_path):
    path = build_tiny_model(tmp_path / "m")
    llm = AsyncLLM(LLMEngine(EngineConfig(model=str(path), max_model_len=1024)), AutoTokenizer.from_pretrained(path))

    async def shut_down_midway():
        stream = llm.generate([5, 6, 7], SamplingParams(max_tokens=1000, ignore_eos=True))
        await anext(stream)
        await asyncio.to_thread(llm.shutdown)
        return await collect(stream)

    with pytest.raises(EngineDeadError, match="shut down"):
        asyncio.run(shut_down_midway())
    assert not llm.alive


def test_shutdown_frees_the_memory_of_an_engine_it_made_and_only_that(tmp_path):
    path = build_tiny_model(tmp_path / "m")
    made = AsyncLLM.from_config(EngineConfig(model=str(path), max_model_len=256))
    given = AsyncLLM(LLMEngine(EngineConfig(model=str(path), max_model_len=256)), AutoTokenizer.from_pretrained(path))
    assert made.engine.runner.arena.regions and given.engine.runner.arena.regions   # weights and KV cache
    made.shutdown()
    given.shutdown()
    assert made.engine.runner.arena.regions == []
    assert given.engine.runner.arena.regions   # the caller's engine: the caller frees it


def test_a_request_that_fails_a_step_fails_alone_and_the_engine_goes_on(llm, monkeypatch):
    """A fault injected into the forward pass of one request (what an unchecked top_k=2**63 did in the sampler)."""
    from ember.runtime import health
    from ember.runtime.engine.async_engine import RequestFailedError

    monkeypatch.setattr(health, "reason", None)
    original = llm.engine.runner.launch

    def launch(batch, *args, **kwargs):
        if any(seq.request_id == "poison" for seq in batch.seqs):
            raise RuntimeError("Overflow when unpacking long long")
        return original(batch, *args, **kwargs)

    monkeypatch.setattr(llm.engine.runner, "launch", launch)

    async def go():
        with pytest.raises(RequestFailedError, match="Overflow"):
            await collect(llm.generate(prompt(llm), SamplingParams(max_tokens=4), request_id="poison"))
        return [await collect(llm.generate(prompt(llm), SamplingParams(max_tokens=4, temperature=0)))
                for _ in range(2)]

    for chunks in asyncio.run(go()):
        assert sum(len(c.token_ids) for c in chunks) == 4 and chunks[-1].finish_reason == "length"
    assert llm.alive and health.reason is None
    wait_until_idle(llm.engine)  # the failed request's KV blocks came back


def test_missing_graphs_are_captured_only_after_a_second_without_work(llm, monkeypatch):
    # A cold-started replica's request arrives right after its ready line: it must not queue behind a capture.
    import time

    from ember.runtime.engine import async_engine

    monkeypatch.setattr(async_engine, "IDLE_CAPTURE_AFTER", 0.5)
    engine = LLMEngine(llm.engine.config)  # the module's tiny model, in an engine of this test's own
    captures: list[float] = []

    def capture_idle() -> bool:  # three graphs to capture, as a GPU engine would have
        captures.append(time.monotonic())
        return len(captures) <= 3

    steps: list[float] = []
    step = engine.step

    def timed_step():
        steps.append(time.monotonic())
        return step()

    engine.capture_idle = capture_idle
    engine.step = timed_step
    began = time.monotonic()
    own = AsyncLLM(engine, llm.tokenizer)
    try:
        chunks = asyncio.run(collect(own.generate(prompt(own), SamplingParams(max_tokens=4, temperature=0))))
        assert chunks[-1].finish_reason == "length"
        deadline = time.monotonic() + 10
        while len(captures) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(captures) == 4  # three captured, then one answer that nothing is left: the loop sleeps
        assert captures[0] - began >= 0.5
        assert steps and captures[0] - steps[-1] >= 0.5  # the request's steps are work too
        time.sleep(0.7)
        assert len(captures) == 4
    finally:
        own.shutdown()
