"""A small run of bench/affinity_llm.py: through the gateway to the real LLM engine, multi-turn chats routed by
session affinity find more of their prompt in the replicas' prefix caches than under round robin."""
import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "affinity_llm.py"


def test_affinity_beats_round_robin_on_prefix_cache_hits(tmp_path):
    spec = importlib.util.spec_from_file_location("affinity_llm", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    # One conversation at a time: with two threads over two replicas, round robin can hand each thread
    # the same replica every time and look as sticky as affinity.
    affinity, round_robin = bench.compare(tmp_path, replicas=2, conversations=4, turns=3, parallel=1, max_tokens=4)
    assert affinity["mode"] == "affinity" and round_robin["mode"] == "round-robin"
    assert affinity["prompt_tokens"] == round_robin["prompt_tokens"] > 0  # the same seeded workload in both runs
    assert affinity["hit_rate"] > round_robin["hit_rate"] + 0.1, (affinity, round_robin)
