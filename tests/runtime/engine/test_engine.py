"""LLMEngine against transformers' greedy `generate` on the same random weights (fp32, CPU, SDPA)."""
import pytest
import torch

from ember.runtime.engine.config import EngineConfig
from ember.runtime.engine.engine import LLMEngine
from ember.runtime.engine.sampling import SamplingParams

from .hf_models import FAMILIES, build, random_prompts, reference_greedy

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    model = build(request.param, directory)
    cache: dict[tuple, list[int]] = {}

    def reference(prompt: list[int], n: int = GREEDY.max_tokens) -> list[int]:
        key = (tuple(prompt), n)
        if key not in cache:
            cache[key] = reference_greedy(model, prompt, n)
        return cache[key]

    return str(directory), reference


def engine(model_dir: str, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model_dir, **{"max_num_seqs": 8, "num_kv_blocks": 128, **overrides}))


def run_to_completion(eng: LLMEngine, outputs: dict[str, list[int]]) -> None:
    while eng.has_unfinished_requests():
        for out in eng.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)


def test_single_requests(family):
    model_dir, reference = family
    eng = engine(model_dir)
    for prompt in random_prompts([1, 7, 16, 33]):
        assert eng.generate([prompt], GREEDY) == [reference(prompt)]


def test_mixed_lengths_under_continuous_batching(family):
    model_dir, reference = family
    eng = engine(model_dir, max_num_seqs=3, max_num_batched_tokens=64)
    prompts = random_prompts([3, 17, 40, 9, 64, 25], seed=2)
    outputs: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts[:3]):
        eng.add_request(str(i), prompt, GREEDY)
    for _ in range(4):   # the first three are decoding when the rest arrive
        for out in eng.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    for i, prompt in enumerate(prompts[3:], start=3):
        eng.add_request(str(i), prompt, GREEDY)
    run_to_completion(eng, outputs)
    assert [outputs[str(i)] for i in range(len(prompts))] == [reference(p) for p in prompts]


def test_prefix_cache_hits(family):
    model_dir, reference = family
    eng = engine(model_dir)
    shared = random_prompts([40], seed=3)[0]
    tails = random_prompts([5, 11, 1], seed=4)
    first = shared + tails[0]
    assert eng.generate([first], GREEDY) == [reference(first)]
    prompts = [shared + tail for tail in tails[1:]] + [first]   # the last one repeats the first exactly
    outputs: dict[str, list[int]] = {}
    cached = {}
    for i, prompt in enumerate(prompts):
        eng.add_request(str(i), prompt, GREEDY)
    while eng.has_unfinished_requests():
        for out in eng.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            cached[out.request_id] = out.num_cached_tokens
    assert [outputs[str(i)] for i in range(len(prompts))] == [reference(p) for p in prompts]
    # 40 shared tokens fill 2 blocks of 16; the exact repeat (45 tokens) gets no more, its third block is partial.
    assert cached == {"0": 32, "1": 32, "2": 32}
    assert eng.stats.prefix_cache_hits == 96


def test_prefix_shared_by_requests_of_the_same_step(family):
    model_dir, reference = family
    eng = engine(model_dir)
    prompt = random_prompts([37], seed=13)[0]
    for i in range(3):   # as an API request with n=3 would arrive
        eng.add_request(str(i), prompt, GREEDY)
    outputs: dict[str, list[int]] = {}
    cached = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            cached[out.request_id] = out.num_cached_tokens
    assert outputs == {str(i): reference(prompt) for i in range(3)}
    assert cached == {"0": 0, "1": 32, "2": 32}


def test_chunked_prefill(family):
    model_dir, reference = family
    eng = engine(model_dir, max_num_batched_tokens=8, max_num_seqs=4)
    prompts = random_prompts([50, 6, 23], seed=5)
    outputs: dict[str, list[int]] = {}
    eng.add_request("short", prompts[1], GREEDY)
    for out in eng.step():   # "short" is decoding while the long prompt arrives in chunks of at most 8 tokens
        outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    eng.add_request("long", prompts[0], GREEDY)
    eng.add_request("mid", prompts[2], GREEDY)
    steps_until_long = 0
    while "long" not in outputs:
        for out in eng.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        steps_until_long += 1
    assert steps_until_long >= 50 // 8
    run_to_completion(eng, outputs)
    assert outputs["long"] == reference(prompts[0])
    assert outputs["mid"] == reference(prompts[2])
    assert len(outputs["short"]) == GREEDY.max_tokens


def test_forced_preemption(family):
    model_dir, reference = family
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    eng = engine(model_dir, num_kv_blocks=6, max_model_len=96, max_num_batched_tokens=96)
    prompts = random_prompts([20, 14, 26, 9], seed=6)
    assert eng.generate(prompts, params) == [reference(p, 30) for p in prompts]
    assert eng.stats.num_preemptions > 0
    assert eng.block_manager.num_free_blocks == 6


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama-stops")
    return str(directory), build("llama", directory)


def test_stop_conditions(llama):
    model_dir, model = llama
    prompt = random_prompts([10], seed=7)[0]
    greedy = reference_greedy(model, prompt, 8)
    eng = engine(model_dir, max_model_len=14)
    eng.eos_token_ids = {greedy[2]}

    def finish(params):
        eng.add_request("r", prompt, params)
        outs = []
        while eng.has_unfinished_requests():
            outs += eng.step()
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        return [t for o in outs for t in o.new_token_ids], outs[-1].finish_reason

    assert finish(SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)) == (greedy[:3], "length")
    stop_at = greedy.index(greedy[2])
    assert finish(SamplingParams(temperature=0, max_tokens=8)) == (greedy[:stop_at + 1], "stop")
    stop_token = greedy[1]
    assert finish(SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=[stop_token])) == (
        greedy[:greedy.index(stop_token) + 1], "stop")
    # Context length: 10 prompt tokens + 4 outputs reach max_model_len=14.
    assert finish(SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)) == (greedy[:4], "length")
    tokens, reason = finish(SamplingParams(temperature=0, max_tokens=4, min_tokens=4))
    assert reason == "length" and greedy[2] not in tokens


def test_abort_frees_blocks_and_reports_once(llama):
    model_dir, model = llama
    eng = engine(model_dir, num_kv_blocks=16)
    prompts = random_prompts([30, 12], seed=8)
    eng.add_request("a", prompts[0], GREEDY)
    eng.add_request("b", prompts[1], GREEDY)
    eng.step()
    eng.abort_request("a")
    eng.abort_request("a")
    eng.abort_request("never-added")
    outputs: list = []
    while eng.has_unfinished_requests():
        outputs += eng.step()
    finished = [(o.request_id, o.finish_reason) for o in outputs if o.finished]
    assert finished == [("a", "abort"), ("b", "length")]
    assert eng.block_manager.num_free_blocks == 16
    assert all(b.ref_count == 0 for b in eng.block_manager.blocks)


def test_an_abort_is_counted_before_the_engine_reads_idle(llama):
    """Another thread waits for `has_unfinished_requests()` to turn false and then reads the stats (a test, a
    metrics scrape): the abort must be in them by then. It was not, for the moment between a step handing out
    the aborted request's output and the observer counting it (a CI failure)."""
    eng = engine(llama[0])
    eng.add_request("a", random_prompts([20], seed=3)[0], GREEDY)
    eng.step()
    eng.abort_request("a")
    seen: list[tuple[bool, int]] = []
    stepped = eng.observer.stepped

    def watching(record):
        seen.append((eng.has_unfinished_requests(), eng.stats.request_success["abort"]))
        stepped(record)

    eng.observer.stepped = watching
    while eng.has_unfinished_requests():
        eng.step()
    assert seen and all(busy for busy, _ in seen)
    assert eng.stats.request_success["abort"] == 1 and not eng.has_unfinished_requests()


@pytest.mark.parametrize("prompt, params, message", [
    ([], GREEDY, "empty"),
    (list(range(3, 300)), GREEDY, "max_model_len"),
    ([5, 999], GREEDY, "token ids"),
    ([5], SamplingParams(temperature=-1), "temperature"),
    ([5], SamplingParams(top_p=0), "top_p"),
    ([5], SamplingParams(max_tokens=0), "max_tokens"),
    ([5], SamplingParams(stop_token_ids=[10_000]), "stop_token_ids"),
])
def test_add_request_rejects_bad_input(llama, prompt, params, message):
    eng = engine(llama[0])
    with pytest.raises(ValueError, match=message):
        eng.add_request("x", prompt, params)
    assert not eng.has_unfinished_requests()


def test_duplicate_request_id_is_rejected(llama):
    eng = engine(llama[0])
    eng.add_request("x", [5, 6], GREEDY)
    with pytest.raises(ValueError, match="already running"):
        eng.add_request("x", [5, 6], GREEDY)


def test_logprobs_match_transformers(llama):
    model_dir, model = llama
    prompt = random_prompts([9], seed=9)[0]
    eng = engine(model_dir)
    eng.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=1, logprobs=3))
    out = [o for o in eng.step() if o.new_token_ids][0]
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1], dim=-1)
    (entry,) = out.new_logprobs
    top_values, top_ids = expected.topk(3)
    assert entry["token_id"] == out.new_token_ids[0] == top_ids[0].item()
    assert entry["logprob"] == pytest.approx(expected[entry["token_id"]].item(), abs=1e-4)
    assert [t for t, _ in entry["top"]] == top_ids.tolist()
    assert [lp for _, lp in entry["top"]] == pytest.approx(top_values.tolist(), abs=1e-4)


def test_a_prefill_steps_last_layer_runs_past_its_attention_for_the_rows_it_samples_alone(llama, monkeypatch):
    """model_runner.LAST_LAYER_ROWS: a step prefilling three prompts (a token sampled from each one's last) runs
    every layer's products for all its tokens but the last layer's past its attention, which runs for the three
    sampled rows; a decode step (every row samples) runs them all. The tokens and their logprobs are those of the
    whole last layer."""
    from ember.runtime.engine import model_runner
    from ember.runtime.engine.models.llama import LlamaMLP

    prompts = random_prompts([7, 16, 33], seed=13)
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True)
    rows, down = [], LlamaMLP.down

    def counted(self, gate_up):
        rows.append(gate_up.shape[0])
        return down(self, gate_up)

    monkeypatch.setattr(LlamaMLP, "down", counted)
    answers = {}
    for on in (True, False):
        monkeypatch.setattr(model_runner, "LAST_LAYER_ROWS", on)
        eng = engine(llama[0])
        layers = len(eng.runner.model.model.layers)
        rows.clear()
        outputs: dict[str, list] = {}
        for i, prompt in enumerate(prompts):
            eng.add_request(str(i), prompt, params)
        while eng.has_unfinished_requests():
            for out in eng.step():
                outputs.setdefault(out.request_id, []).append((out.new_token_ids, out.new_logprobs))
        answers[on] = outputs
        prefill, decode = rows[:layers], rows[layers:2 * layers]
        assert prefill == [56] * (layers - 1) + ([3] if on else [56])
        assert decode == [3] * layers
    for request, steps in answers[True].items():
        for (tokens, logprobs), (want_tokens, want_logprobs) in zip(steps, answers[False][request]):
            assert tokens == want_tokens
            for got, want in zip(logprobs, want_logprobs):
                assert got["token_id"] == want["token_id"] and [t for t, _ in got["top"]] == [t for t, _ in want["top"]]
                assert got["logprob"] == pytest.approx(want["logprob"], abs=1e-5)


def test_same_seed_same_output_whatever_the_batch(llama):
    eng = engine(llama[0])
    prompt = random_prompts([12], seed=10)[0]
    seeded = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=10, seed=1234, ignore_eos=True)
    alone = eng.generate([prompt], seeded)[0]
    others = random_prompts([5, 30], seed=11)
    noise = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    in_batch = eng.generate([others[0], prompt, others[1]], [noise, seeded, noise])[1]
    other_seed = eng.generate([prompt], SamplingParams(**{**seeded.__dict__, "seed": 99}))[0]
    assert alone == in_batch
    assert other_seed != alone


def test_stats_after_a_run(llama):
    eng = engine(llama[0])
    prompts = random_prompts([20, 20], seed=12)
    eng.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    s = eng.stats
    assert s.time_to_first_token.count == 2 and s.queue_time.count == 2 and s.e2e_request_latency.count == 2
    assert s.inter_token_latency.count == 2 * 4
    assert s.prompt_tokens == 40 and s.generation_tokens == 10
    assert s.prefix_cache_queries == 40 and s.prefix_cache_hits == 0
    assert s.request_success == {"length": 2}
    assert (s.num_running, s.num_waiting, s.kv_cache_usage) == (0, 0, 0.0)
    assert s.step_host_time.count == s.step_time.count > 0


def test_a_steps_inter_token_latencies_land_in_the_buckets_one_observe_each_would_give():
    from ember.runtime.engine.stats import _ITL_BUCKETS, Histogram

    now = 10.0
    # runs of equal times (most requests last stepped together), bucket edges, and a value past the last bucket
    times = [9.996] * 5 + [9.9975, 9.9975, 9.99, now - 0.005, now - 0.005, 9.996, -5.0, now]
    batched, one_by_one = Histogram(_ITL_BUCKETS), Histogram(_ITL_BUCKETS)
    batched.observe_since(now, times)
    batched.observe_since(now, [])
    for t in times:
        one_by_one.observe(now - t)
    assert batched.counts == one_by_one.counts
    assert batched.count == one_by_one.count == len(times)
    assert batched.sum == pytest.approx(one_by_one.sum)


def test_configuration_errors_name_the_fix(llama, tmp_path):
    model_dir = llama[0]
    with pytest.raises(ValueError, match="use 'sdpa'"):
        engine(model_dir, attention_backend="flashinfer", device="cpu")
    with pytest.raises(ValueError, match="raise num_kv_blocks or lower max_model_len"):
        engine(model_dir, num_kv_blocks=4, max_model_len=128)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine(model_dir, max_model_len=10_000)
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(model=model_dir, dtype="int8")
    with pytest.raises(ValueError, match="no config.json"):
        engine(str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        engine(str(tmp_path))


def test_park_and_wake_keep_outputs_and_forget_the_discarded_prefix_cache(family):
    model_dir, reference = family
    eng = engine(model_dir)
    long = random_prompts([40], seed=5)[0]  # spans full blocks, so a second run would reuse cached ones
    assert eng.generate([long], GREEDY) == [reference(long)]
    weights = {name: p.data_ptr() for name, p in eng.runner.model.named_parameters()}
    kv = [t.data_ptr() for t in eng.runner.kv_caches]
    report = eng.park()
    assert eng.parked and report.released_bytes > 0  # the CPU arena filled the KV cache with NaN bytes
    assert all(t.isnan().all() for t in eng.runner.kv_caches)
    eng.wake()
    assert not eng.parked
    assert {name: p.data_ptr() for name, p in eng.runner.model.named_parameters()} == weights
    assert [t.data_ptr() for t in eng.runner.kv_caches] == kv
    eng.add_request("again", long, GREEDY)
    outputs: dict[str, list[int]] = {}
    run_to_completion(eng, outputs)
    assert outputs["again"] == reference(long)
    assert eng.stats.prefix_cache_hits == 0  # a hit would have read the discarded (NaN) blocks


def test_a_parked_engine_wakes_on_its_next_step_and_refuses_to_park_while_busy(family):
    model_dir, reference = family
    eng = engine(model_dir)
    prompt = random_prompts([9], seed=6)[0]
    eng.park()
    assert eng.generate([prompt], GREEDY) == [reference(prompt)] and not eng.parked
    eng.add_request("busy", prompt, GREEDY)
    with pytest.raises(RuntimeError, match="requests in flight"):
        eng.park()


def test_a_kv_cache_byte_budget_sizes_the_cache(family):
    model_dir, _ = family
    eng = engine(model_dir, num_kv_blocks=None, kv_cache_bytes=3 << 20)
    runner = eng.runner
    block_bytes = 2 * runner.block_size * runner.num_kv_heads * runner.model.head_dim * 4 * runner.num_layers
    assert runner.num_blocks == (3 << 20) // block_bytes == eng.block_manager.num_blocks
    with pytest.raises(ValueError, match="holds no KV block"):
        engine(model_dir, num_kv_blocks=None, kv_cache_bytes=1)
    with pytest.raises(ValueError, match="kv_cache_bytes=0"):
        engine(model_dir, num_kv_blocks=None, kv_cache_bytes=0)


def test_the_engine_warm_up_decodes_two_sequences_and_then_one(family):
    """Decode steps of one sequence take other kernels (gemv.py's, on CUDA) than steps of several: the full boot's
    warm-up runs both, so the kernels it keeps cover a restored replica's first single-sequence step."""
    model_dir, _ = family
    eng = engine(model_dir)
    launch, decodes = eng.runner.launch, []

    def recorded(batch, *args, **kwargs):
        if all(n == 1 for n in batch.num_new_tokens):
            decodes.append(len(batch.seqs))
        return launch(batch, *args, **kwargs)

    eng.runner.launch = recorded
    eng.warmup()
    assert 2 in decodes and 1 in decodes
    assert not eng.has_unfinished_requests() and eng.block_manager.usage == 0


def test_the_kernel_warm_up_runs_one_layer_of_the_models_shape_and_changes_no_answer(family):
    # On a GPU it runs on the attention thread while the weights stream in; here it runs the same code on the CPU.
    from ember.runtime.engine.model_runner import warm_kernels

    model_dir, reference = family
    eng = engine(model_dir)
    runner = eng.runner
    for prompt_tokens in (1, 24, 40):  # within one block, a block and a half, more than two blocks
        parts = warm_kernels(model_dir, runner.dtype, runner.device, runner.attention, runner.block_size,
                             prompt_tokens)
        assert list(parts) == ["model", "prefill", "release"]   # its start breakdown's sub-phases
    for prompt in random_prompts([5, 33]):  # the attention backend plans afresh: the warm-up's batch is gone
        assert eng.generate([prompt], GREEDY) == [reference(prompt)]
