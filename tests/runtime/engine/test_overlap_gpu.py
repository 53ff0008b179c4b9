"""Overlap scheduling on a CUDA GPU (bf16, flashinfer, decode graphs): the same tokens as the serial engine.

Run on the GPU machine:
    python -m pytest tests/runtime/engine/test_overlap_gpu.py -m gpu

Only workloads whose batches are the same with and without overlap: a request that stops rides along in the step
launched after its stop, which can change a batch's graph size and so, in bf16, its neighbours' logits.
"""
import pytest
import torch

from ember.runtime.engine.config import EngineConfig
from ember.runtime.engine.engine import LLMEngine
from ember.runtime.engine.sampling import SamplingParams
from ember.runtime.engine.tiny import build_tiny_model

from .hf_models import random_prompts
from .test_overlap import Outcome, run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # head_dim 128: the flashinfer modules of the other GPU tests and the benches (no compile of its own).
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen3", hidden_size=128, num_attention_heads=2,
                                num_key_value_heads=1, head_dim=128))


def both(model_dir: str, scenario, **config) -> Outcome:
    outcomes = []
    for overlap in (False, True):
        eng = LLMEngine(EngineConfig(model=model_dir, max_model_len=512, max_num_seqs=32, overlap=overlap, **config))
        assert eng.runner.graphs is not None
        outcomes.append(scenario(eng))
        assert not eng.has_unfinished_requests() and eng.block_manager.usage == 0
    assert outcomes[1] == outcomes[0]
    return outcomes[1]


@pytest.mark.parametrize("batch", [3, 12])   # the Triton decode of graphs up to 8, flashinfer's above
@pytest.mark.parametrize("seeded", [False, True])
def test_decode_graphs_take_the_previous_steps_tokens_on_the_device(model_dir, batch, seeded):
    params = (SamplingParams(temperature=0.8, top_p=0.9, max_tokens=40, seed=7, ignore_eos=True) if seeded
              else SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    prompts = random_prompts([5 + 3 * i for i in range(batch)], seed=batch)

    def scenario(eng):
        for i, prompt in enumerate(prompts):
            eng.add_request(str(i), prompt, params)
        return run(eng)

    outcome = both(model_dir, scenario)
    assert all(len(tokens) == 40 for tokens, _ in outcome.values())


def test_a_step_loop_that_sleeps_on_the_device_gets_the_same_tokens(model_dir):
    """EngineConfig.device_wait="block": the events the host waits on sleep instead of spinning, and nothing else
    changes, with overlap or without."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = random_prompts([5 + 3 * i for i in range(12)], seed=5)

    def scenario(eng):
        for i, prompt in enumerate(prompts):
            eng.add_request(str(i), prompt, params)
        return run(eng)

    spinning = both(model_dir, scenario)
    blocking = both(model_dir, scenario, device_wait="block")
    assert blocking == spinning


def test_streamed_decode_graphs_take_the_previous_steps_tokens_on_the_device(model_dir):
    """Graphs of 9 or more sequences on paged_decode's streamed kernel (EngineConfig.streamed_decode_min_batch)."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = random_prompts([5 + 3 * i for i in range(12)], seed=12)

    def scenario(eng):
        assert eng.runner.attention.streamed_min_batch == 9
        eng.runner.attention.build_streamed_kernels()   # what the warm-up ran (it logs, not raises, a failure)
        for i, prompt in enumerate(prompts):
            eng.add_request(str(i), prompt, params)
        return run(eng)

    outcome = both(model_dir, scenario, streamed_decode_min_batch=9)
    assert all(len(tokens) == 40 for tokens, _ in outcome.values())


def test_the_first_token_is_not_held_back_by_the_first_graph_capture(model_dir):
    """Decode graphs are captured lazily (the warm-up captured those of 1 and 2 sequences): the first tokens of
    three requests come out before the graph of their decode steps is captured."""
    eng = LLMEngine(EngineConfig(model=model_dir, max_model_len=512, max_num_seqs=32))
    graphs = eng.runner.graphs
    size = graphs.batch_size_for(3)
    assert size not in graphs.graphs
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i, prompt in enumerate(random_prompts([9, 12, 15], seed=1)):
        eng.add_request(str(i), prompt, params)
    first = []
    while not first:
        first = eng.step()
    assert len(first) == 3 and size not in graphs.graphs
    rest = run(eng)
    assert all(len(rest[out.request_id][0]) == 11 for out in first) and size in graphs.graphs


def test_prefills_mixed_with_overlapped_decodes(model_dir):
    """Requests arriving while others decode: eager mixed steps, whose decodes' tokens come from the step before."""
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = random_prompts([9, 40, 17, 70, 33, 5], seed=3)

    def scenario(eng):
        for i, prompt in enumerate(prompts[:3]):
            eng.add_request(str(i), prompt, params)
        outcome = run(eng, steps=6)
        for i, prompt in enumerate(prompts[3:], start=3):
            eng.add_request(str(i), prompt, params)
        return run(eng, outcome)

    both(model_dir, scenario)
