"""Benchmarks write bench/results/ only when asked (--record): a plain run prints its table and leaves the tree as it
was."""
import hashlib
import json
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT

BENCH = ROOT / "bench"
WRITES = re.compile(r"\.write_text\(|\.write_bytes\(|\.savefig\(|write_results\(")


def _results() -> dict[str, str]:
    return {str(p.relative_to(BENCH)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((BENCH / "results").rglob("*")) if p.is_file()}


def test_every_benchmark_that_writes_results_asks_for_record():
    unguarded = [str(p.relative_to(ROOT)) for p in sorted(BENCH.rglob("*.py"))
                 if "results" in (text := p.read_text()) and WRITES.search(text) and '"--record"' not in text]
    assert unguarded == [], f"these write bench/results without --record: {unguarded}"


def test_plain_runs_leave_bench_results_alone():
    before = _results()
    for command in (["autoscale_sim.py", "--seeds", "1", "--duration", "60", "--jobs", "1"],
                    ["affinity_movement.py", "--sessions", "40", "--requests", "400"]):
        run = subprocess.run([sys.executable, str(BENCH / command[0]), *command[1:]], capture_output=True, text=True,
                             timeout=120, cwd=ROOT)
        assert run.returncode == 0, run.stderr
        assert run.stdout.strip()  # it printed its report
    assert _results() == before


def test_the_serving_cpu_bench_runs_against_the_server_as_it_is():
    """bench/engine/serve_cpu.py serves the OpenAI app over a stand-in engine: one that lacks what the server reads
    of an engine failed every request (it did, unnoticed, from the structured-output work to session 29)."""
    run = subprocess.run([sys.executable, str(BENCH / "engine" / "serve_cpu.py"), "--rounds", "1", "--concurrency", "2",
                          "--requests", "1"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    [row] = [line.split() for line in run.stdout.splitlines() if line.startswith("this")]
    assert int(row[1]) == 2 and float(row[2]) > 0 and 0 < float(row[3]) <= 1.0   # events per streamed token


def test_engine_speed_joins_the_shares_of_runs_that_each_measured_some_parts(tmp_path):
    """A GPU call has a time limit: each measures some models and parts (--parts), and --merge joins them."""
    import json

    def run(name: str, models: list[dict]) -> str:
        path = tmp_path / name
        path.write_text(json.dumps({"machine": "H200", "copy_bandwidth_gb_s": 4256.0, "models": models}))
        return str(path)

    eight = {"name": "Qwen3-8B shape (random weights)", "weight_bytes": 16381470720, "roofline_b1_tok_s": 259.6}
    first = run("a.json", [eight | {"ember_b1_tok_s": 100.0, "offline_output_tok_s": 7000.0}])
    second = run("b.json", [eight | {"ember_b1_tok_s": 191.0, "online": [{"concurrency": 1}]},
                            {"name": "Qwen3-0.6B shape (random weights)", "weight_bytes": 1, "roofline_b1_tok_s": 9.0}])
    done = subprocess.run([sys.executable, str(BENCH / "engine" / "speed.py"), "--merge", first, second, "--results",
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    merged = json.loads((tmp_path / "out" / "engine_speed.json").read_text())
    by_name = {m["name"]: m for m in merged["models"]}
    assert by_name["Qwen3-8B shape (random weights)"] == eight | {"ember_b1_tok_s": 191.0, "offline_output_tok_s":
                                                                  7000.0, "online": [{"concurrency": 1}]}
    assert [m["name"] for m in merged["models"]] == ["Qwen3-0.6B shape (random weights)",
                                                     "Qwen3-8B shape (random weights)"]
    assert merged["machine"] == "H200"
    bad = subprocess.run([sys.executable, str(BENCH / "engine" / "speed.py"), "--parts", "b1,warp"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "warp" in bad.stderr and "Traceback" not in bad.stderr
    none = subprocess.run([sys.executable, str(BENCH / "engine" / "speed.py"), "--concurrency", "4", "0"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert none.returncode == 2 and "from 1 to 4,096, got '0'" in none.stderr and "Traceback" not in none.stderr


def _speed():
    sys.path.insert(0, str(BENCH / "engine"))
    try:
        import speed
    finally:
        sys.path.remove(str(BENCH / "engine"))
    return speed


def test_the_b64_row_is_the_median_of_its_processes_and_keeps_each_run():
    speed = _speed()
    runs = [{"host_ms": h, "gpu_ms": g, "wall_ms": g, "launch_ms": {"prepare": h / 2, "queue": 0.1}}
            for h, g in ((0.864, 5.73), (0.502, 5.74), (0.622, 5.72))]
    row: dict = {}
    speed.b64_row(row, "8B", "", "", runs)
    assert (row["host_ms_per_step_b64"], row["gpu_ms_per_step_b64"]) == (0.622, 5.73)
    assert row["launch_ms_b64"] == {"prepare": 0.311, "queue": 0.1}
    assert [r["host_ms"] for r in row["b64_runs"]] == [0.864, 0.502, 0.622]
    one: dict = {}
    speed.b64_row(one, "8B", "_serial", " (serial)", runs[:1])
    assert one["host_ms_per_step_b64_serial"] == 0.864 and "b64_runs_serial" not in one


def test_the_offline_floor_counts_the_head_once_per_prompt(tmp_path):
    """Prefill computes logits for each prompt's last token only: a prompt one token longer costs the body's
    products for that token, not the head's too."""
    import json

    speed = _speed()
    hidden, vocab, layers = 64, 1000, 2
    (tmp_path / "config.json").write_text(json.dumps(dict(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        vocab_size=vocab, tie_word_embeddings=False)))
    head = vocab * hidden * 2
    weights = 2 * head + 100_000   # embedding, head and the body's products, in bytes
    flops = 1e12
    # one output token: no decode step, the floor is prefill alone
    short, long = (speed.offline_floor(tmp_path, weights, [n], [1], 1e12, flops) for n in (10, 11))
    body = weights - 2 * head
    attention = 4 * layers * 4 * 16 * (11 * 11 - 10 * 10) / 2
    assert long - short == pytest.approx((body + attention) / flops)
    assert short == pytest.approx((10 * body + head + 4 * layers * 4 * 16 * 100 / 2) / flops)


def test_the_decode_floor_reads_every_sequences_kv_and_the_weights_or_computes_the_products_each_step(tmp_path):
    """speed.py's skewed part: a step of B sequences reads the weights once or computes B tokens' products,
    whichever takes longer, and reads each sequence's K/V so far."""
    import json

    speed = _speed()
    hidden, vocab, layers, kv_heads, head_dim = 64, 1000, 2, 2, 16
    (tmp_path / "config.json").write_text(json.dumps(dict(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=kv_heads,
        head_dim=head_dim, vocab_size=vocab, tie_word_embeddings=False)))
    weights = 2 * vocab * hidden * 2 + 100_000
    products = weights - vocab * hidden * 2   # the embedding is gathered, not read whole
    kv = layers * kv_heads * head_dim * 2 * 2
    prompts, tokens = [5, 300, 7], 4
    for bandwidth, flops in ((1e9, 1e15), (1e15, 1e6)):   # bound by reads, then by products
        expected = sum(max(products / bandwidth, products * len(prompts) / flops)
                       + sum(p + step for p in prompts) * kv / bandwidth for step in range(1, tokens))
        assert speed.decode_floor(tmp_path, weights, prompts, tokens, bandwidth, flops) == pytest.approx(expected)
    # a longer prompt among the same costs its extra K/V in every step, nothing more
    longer = speed.decode_floor(tmp_path, weights, [5, 3000, 7], tokens, 1e9, 1e15)
    shorter = speed.decode_floor(tmp_path, weights, prompts, tokens, 1e9, 1e15)
    assert longer - shorter == pytest.approx((tokens - 1) * 2700 * kv / 1e9)


def test_the_skewed_table_puts_both_kernels_beside_the_floor_and_is_left_out_where_nothing_was_measured():
    speed = _speed()
    measured = {"workload": "one long among short", "requests": 64, "output_tok_s": 5041.2, "decode_graph_steps": 255,
                "decode_gpu_ms_per_step": 7.61, "decode_floor_ms_per_step": 6.02,
                "flashinfer_output_tok_s": 3120.5, "flashinfer_decode_gpu_ms_per_step": 12.4}
    alone = {k: v for k, v in measured.items() if not k.startswith("flashinfer_")}   # --streamed-decode named one
    lines = speed.skewed_rows([{"name": "8B", "skewed": [measured, alone]}, {"name": "0.6B"}])
    rows = [line for line in lines if line.startswith("| 8B")]
    assert rows == ["| 8B | one long among short | 5041.2 | 3120.5 | 7.61 / 12.4 / 6.02 |",
                    "| 8B | one long among short | 5041.2 | - | 7.61 / - / 6.02 |"]
    assert lines[0] == "" and not any("0.6B" in line for line in lines)
    assert speed.skewed_rows([{"name": "8B"}]) == []


def test_the_offline_bound_is_the_longer_of_all_products_and_all_reads_and_never_above_the_floor(tmp_path):
    import json
    import random

    speed = _speed()
    hidden, vocab, layers, heads, kv_heads, head_dim = 64, 1000, 2, 4, 2, 16
    (tmp_path / "config.json").write_text(json.dumps(dict(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, vocab_size=vocab, tie_word_embeddings=True)))
    weights = 200_000   # tied: all of it the products' bytes
    kv = layers * kv_heads * head_dim * 4
    # two sequences: prompts of 3 and 5 tokens, outputs of 4 and 2: decode steps 1..3 and 1
    prompts, outputs = [3, 5], [4, 2]
    context = (3 + 1) + (3 + 2) + (3 + 3) + (5 + 1)
    head = vocab * hidden * 2   # prefill computes the head's product for each prompt's last token only
    products = (sum(prompts) * (weights - head) + len(prompts) * head + 4 * layers * heads * head_dim * (9 + 25) / 2
                + (3 + 1) * weights)
    reads = 4 * weights + context * kv
    slow_compute, slow_reads = (1e15, 1e3), (1e3, 1e15)   # (bandwidth, FLOPS)
    assert speed.offline_bound(tmp_path, weights, prompts, outputs, *slow_reads) == pytest.approx(reads / 1e3)
    assert speed.offline_bound(tmp_path, weights, prompts, outputs, *slow_compute) == pytest.approx(products / 1e3)
    rng = random.Random(0)
    for _ in range(50):
        n = rng.randint(1, 6)
        prompts = [rng.randint(1, 50) for _ in range(n)]
        outputs = [rng.randint(1, 40) for _ in range(n)]
        rates = (rng.uniform(1e9, 1e12), rng.uniform(1e9, 1e12))
        assert (speed.offline_bound(tmp_path, weights, prompts, outputs, *rates)
                <= speed.offline_floor(tmp_path, weights, prompts, outputs, *rates) * (1 + 1e-9))


def test_the_replica_loop_cpu_is_its_main_thread_alone():
    """speed.py's online rows split the replica's CPU: a step loop spinning on another thread is not the loop's."""
    speed = _speed()
    burner = subprocess.Popen([sys.executable, "-c", "import threading, time, sys\n"
                               "def spin():\n    while True: pass\n"
                               "threading.Thread(target=spin, daemon=True).start()\n"
                               "print('up', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert burner.stdout.readline().strip() == "up"
        before_all, before_main = speed.cpu_seconds(burner.pid), speed.main_thread_cpu_seconds([burner.pid])
        import time
        deadline, spent = time.monotonic() + 30, 0.0
        while spent < 0.5 and time.monotonic() < deadline:   # on a loaded machine the spinner gets less than a core
            time.sleep(0.25)
            spent = speed.cpu_seconds(burner.pid)[burner.pid] - before_all[burner.pid]
        main = speed.main_thread_cpu_seconds([burner.pid])[burner.pid] - before_main[burner.pid]
        assert spent >= 0.5 and main < 0.2
        assert speed.main_thread_cpu_seconds([burner.pid, 2**22 + 12345]).keys() == {burner.pid}   # gone: left out
    finally:
        burner.kill()
        burner.wait()


def test_the_online_load_streams_a_level_from_client_processes(tmp_path):
    """speed.py's online load (bench/engine/load_client.py) against the OpenAI app over serve_cpu.py's paced engine
    (a step every 20 ms): every request streams all its tokens, and the gaps between them are the steps', where the
    bench's one interpreter, reading 64 streams, stamped more than half of them under 0.1 ms."""
    sys.path.insert(0, str(BENCH / "engine"))
    import load_client
    import serve_cpu

    from ember.runtime.engine.tiny import build_tiny_model

    server, port = serve_cpu.start_server(build_tiny_model(tmp_path / "tiny"), ROOT / "runtime", 20.0)
    try:
        prompts = [[11 + i] * 16 for i in range(6)]
        body = {"model": serve_cpu.MODEL, "max_tokens": 8, "ignore_eos": True, "temperature": 0}
        results, seconds = load_client.stream(f"http://127.0.0.1:{port}", "/v1/completions", body, prompts, 3)
    finally:
        server.kill()
        server.wait()
    # 8 tokens each; a server that falls a step behind (the 2-core CI machine, busy with other tests) sends two steps'
    # tokens in one event, so a few may come together (a clean-clone CI run saw one stream under 7 events)
    assert len(results) == 6 and all(chunks >= 5 for _, _, chunks in results)
    gaps = sorted(gap for _, request_gaps, _ in results for gap in request_gaps)
    assert gaps[len(gaps) // 2] > 0.010, gaps   # a step is 20 ms; bursts read at once would be ~0
    # three streams in flight throughout: their summed durations are three times the level's
    in_flight = sum(ttft + sum(request_gaps) for ttft, request_gaps, _ in results) / seconds
    assert 2.0 < in_flight <= 3.05, in_flight


def test_kernel_bench_records_the_parts_it_ran_and_keeps_the_rest(tmp_path):
    """kernel_bench.py's parts run one at a time on the GPU (its whole run is longer than a device call); a record
    of one part rewrote kernels.json with that part alone, dropping every row the others had measured."""
    sys.path.insert(0, str(BENCH / "engine"))
    try:
        import kernel_bench
    finally:
        sys.path.remove(str(BENCH / "engine"))
    path = tmp_path / "kernels.json"
    kernel_bench.record(path, {"machine": "first", "gemv": [{"us": 1}], "attention": [{"us": 2}]})
    kernel_bench.record(path, {"machine": "second", "overlap": [{"ms": 3}], "gemv": [{"us": 4}]})
    assert json.loads(path.read_text()) == {"machine": "second", "gemv": [{"us": 4}], "attention": [{"us": 2}],
                                            "overlap": [{"ms": 3}]}


def test_kernel_bench_refuses_a_part_it_does_not_have():
    """A misspelt --parts ran no part and printed only the bandwidth: on the GPU machine, a device call spent."""
    run = subprocess.run([sys.executable, str(BENCH / "engine" / "kernel_bench.py"), "--parts", "gemm,overlaps"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert run.returncode == 2
    assert "unknown overlaps" in run.stderr and "overlap" in run.stderr.split("choose from")[1]
    assert "Traceback" not in run.stderr


def test_merge_keeps_the_summary_note_and_takes_a_later_runs_fields(tmp_path):
    """speed.py --merge: the recorded summary's paragraph (note) survives a merge with a run that has none."""
    import json

    speed = _speed()
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps({"machine": "H200", "copy_bandwidth_gb_s": 4223.2, "matmul_tflops": 811.0,
                                 "note": "Session N: what the table shows.",
                                 "models": [{"name": "Qwen3-8B shape (random weights)", "ember_b1_tok_s": 232.9}]}))
    second.write_text(json.dumps({"machine": "H200", "models": [
        {"name": "Qwen3-8B shape (random weights)", "skewed": [{"workload": "w", "output_tok_s": 1.0}]}]}))
    merged = speed.merge([first, second])
    assert merged["note"] == "Session N: what the table shows."
    assert merged["copy_bandwidth_gb_s"] == 4223.2 and merged["machine"] == "H200"
    (model,) = merged["models"]
    assert model["ember_b1_tok_s"] == 232.9 and model["skewed"][0]["output_tok_s"] == 1.0
    assert "note" not in speed.merge([second])


def _coldstart():
    import importlib.util

    spec = importlib.util.spec_from_file_location("coldstart_bench", BENCH / "coldstart.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _shape(name: str, t1: float, day: str) -> dict:
    return {"name": name, "weight_bytes": 7_300_000_000, "full_boot_s": 7.4, "t2_warm_s": 0.47, "t2_cold_s": 4.5,
            "t1_wake_s": t1, "fresh_kernels_first_request_s": 4.9, "parked_gpu_bytes": 1 << 30, "measured_on": day,
            "floors": {"disk_gbps": 1.2, "page_cache_gbps": 32.0, "pcie_gbps": 55.0, "t1_wake_s": 0.13,
                       "t2_warm_s": 0.23, "t2_cold_s": 5.9},
            "rows": [{"model": name, "rung": "T1 wake", "first_token_s": t1, "cold_start": "parked; ms=0",
                      "breakdown": "", "note": f"{name} on {day}"}]}


def test_coldstart_merge_replaces_the_shapes_it_measured_and_keeps_the_rest_in_order(tmp_path):
    """A GPU call fits one shape's ladder: --record --merge keeps the others' rows and says which run they are from;
    the first shape stays first (bench/autoscale_sim.py's measured tiers read it)."""
    coldstart = _coldstart()
    machine = {"gpu": "NVIDIA H200", "driver": "580"}
    coldstart.write_record(tmp_path, [_shape("4b", 0.2, "2026-12-01"), _shape("8b", 0.33, "2026-12-01")], [],
                           "python bench/coldstart.py --shapes 4b,8b", machine)
    kept = coldstart.kept_models(tmp_path / "coldstart.json")
    coldstart.write_record(tmp_path, [_shape("8b", 0.31, "2026-12-04")], kept,
                           "python bench/coldstart.py --shapes 8b --merge", machine)
    models = json.loads((tmp_path / "coldstart.json").read_text())["models"]
    assert [(m["name"], m["t1_wake_s"], m["measured_on"]) for m in models] == [("4b", 0.2, "2026-12-01"),
                                                                              ("8b", 0.31, "2026-12-04")]
    md = (tmp_path / "coldstart.md").read_text()
    assert "kept from earlier runs: 4b (2026-12-01)" in md
    assert "| 4b | T1 wake | 0.200 |" in md and "| 8b | T1 wake | 0.310 |" in md and "0.330" not in md
    assert "8b: 7.3 GB of weights" in md and "T1 wake <= 0.3 s: NOT met" in md


def test_coldstart_merge_refuses_a_record_without_rows(tmp_path):
    coldstart = _coldstart()
    bare = _shape("4b", 0.2, "2026-12-01")
    del bare["rows"]
    (tmp_path / "coldstart.json").write_text(json.dumps({"machine": {}, "models": [bare]}))
    with pytest.raises(ValueError, match="without --merge"):
        coldstart.kept_models(tmp_path / "coldstart.json")
    for text in ("[1, 2]", '{"models": {"a": 1}}', '{"models": [1]}', "{"):
        (tmp_path / "coldstart.json").write_text(text)
        with pytest.raises(ValueError, match="not a coldstart record"):
            coldstart.kept_models(tmp_path / "coldstart.json")
    assert coldstart.kept_models(tmp_path / "none.json") == []


def test_coldstart_t1_is_the_median_of_each_parked_time():
    coldstart = _coldstart()
    wakes = [{"parked_s": gap, "first_token_s": t}
             for gap, t in zip(coldstart.T1_GAPS, (0.333, 0.28, 0.308, 0.281, 0.304, 0.29))]
    assert coldstart.t1_median(wakes, coldstart.T1_GAPS[0]) == 0.308
    assert coldstart.t1_median(wakes, max(coldstart.T1_GAPS)) == 0.281
    assert coldstart.t1_rung(coldstart.T1_GAPS[0]) == "T1 wake"
    assert coldstart.t1_rung(10.0) == "T1 wake, parked 10 s"


def test_coldstart_reads_a_parks_time_from_the_gateways_log_line():
    coldstart = _coldstart()
    line = ('{"ts": "2026-12-04T03:21:30.946+00:00", "level": "info", "logger": "ember.gateway", "msg": "replica '
            'chat-d2f3adcc parked in 3217 ms (14968418304 bytes of host RAM)", "source": "gateway"}')
    assert coldstart.park_ms(line) == 3217
    assert coldstart.park_ms('{"msg": "replica chat-1 woke"}') is None


def test_prefill_steps_table_marks_the_graph_each_step_pads_to():
    """prefill_steps.py's table, read from its record: a step replays the smallest graph at or above its tokens
    (a 544-token step pads to 1,024), and a mode without a graph there ran eagerly (no mark)."""
    sys.path.insert(0, str(BENCH / "engine"))
    try:
        import prefill_steps
    finally:
        sys.path.remove(str(BENCH / "engine"))
    row = {"sizes": [256, 512, 1024], "512": {"wall_ms": 8.0}, "32+512": {"wall_ms": 17.6}}
    eager = {"sizes": [], "512": {"wall_ms": 26.7}, "32+512": {"wall_ms": 20.0}}
    lines = prefill_steps.table([{"name": "4B", "rows": {"eager": eager, "default": dict(row, sizes=[256, 512]),
                                                         "every size": row}}])
    assert lines[0] == "4B: default sizes [256, 512]"
    assert "512 tokens: eager  26.70, default   8.00 (graph 512), every size   8.00 (graph 512)" in lines[1]
    assert "32+512 tokens: eager  20.00, default  17.60, every size  17.60 (graph 1024)" in lines[2]
    # rows since session 39 carry the host's speed around each engine's steps: printed, and not a step
    timed = {mode: dict(rows, host_loop_ms=[60.5, 131.0 + i]) for i, (mode, rows) in
             enumerate({"eager": eager, "default": dict(row, sizes=[256, 512]), "every size": row}.items())}
    lines = prefill_steps.table([{"name": "4B", "rows": timed}])
    assert lines[1] == ("  host loop ms (before -> after each engine's steps): eager 60.5 -> 131.0, "
                        "default 60.5 -> 132.0, every size 60.5 -> 133.0")
    assert len(lines) == 4 and "512 tokens: eager  26.70" in lines[2]
    recorded = json.loads((BENCH / "results" / "prefill_steps.json").read_text())
    assert [m["name"] for m in recorded["models"]] == ["4B", "8B"] and prefill_steps.table(recorded["models"])


def test_prefill_steps_without_a_gpu_is_one_line():
    run = subprocess.run([sys.executable, str(BENCH / "engine" / "prefill_steps.py"), "--models", "4B"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 1 and "needs a CUDA GPU" in run.stderr and "Traceback" not in run.stderr


def test_prefill_steps_refuses_no_reps():
    run = subprocess.run([sys.executable, str(BENCH / "engine" / "prefill_steps.py"), "--reps", "0"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 2 and "--reps 0: want at least 1" in run.stderr and "Traceback" not in run.stderr
