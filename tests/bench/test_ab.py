"""bench/engine/ab.py: each side's settings reach its own fresh process, the sides alternate which runs first, the
medians and B over A come from the records the processes write, and a setting that names nothing is refused with
one line, before any run. A stand-in for speed.py (the GPU's) writes a record from the settings it sees."""
import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

AB = ROOT / "bench" / "engine" / "ab.py"

STAND_IN = '''
import argparse, json, sys
from pathlib import Path
from ember.runtime.engine import fp8
parser = argparse.ArgumentParser()
parser.add_argument("--models", nargs="+")
parser.add_argument("--workdir")
parser.add_argument("--record", action="store_true")
parser.add_argument("--results", type=Path)
parser.add_argument("--log", type=Path)
args = parser.parse_args()
splits = len(fp8.SMALL_SPLITS)
with args.log.open("a") as log:
    log.write(f"{fp8.DEFERRED} {splits} {args.workdir}\\n")
rate = (200.0 if fp8.DEFERRED else 100.0) + 10 * sum(1 for _ in args.log.open())
row = {"name": args.models[0], "ember_b1_tok_s": 5.0, "offline_output_tok_s": 1.0,
       "fp8_kv": {"offline_output_tok_s": rate, "offline_time_split": {"graph_gpu_s": 1000 / rate, "eager_gpu_s": 3.0,
                                                                "seconds": 2000 / rate}}}
args.results.mkdir(parents=True, exist_ok=True)
(args.results / "engine_speed.json").write_text(json.dumps({"machine": "stand-in", "models": [row]}))
'''


def ab(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(AB), *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_the_sides_run_alternately_with_their_settings_and_are_compared(tmp_path):
    script, log, results = tmp_path / "speed.py", tmp_path / "runs.log", tmp_path / "ab.json"
    script.write_text(STAND_IN)
    out = ab("--b", "runtime.engine.fp8.DEFERRED=False", "runtime.engine.fp8.SMALL_SPLITS=()", "--rounds", "3",
             "--script", str(script), "--record", "--results", str(results), "--", "--models", "8B",
             "--log", str(log))
    assert out.returncode == 0, out.stdout + out.stderr
    runs = [line.split() for line in log.read_text().splitlines()]
    # A B, B A, A B: the defaults (deferred, two split rules) and B's settings, in fresh processes
    assert [r[:2] for r in runs] == [["True", "2"], ["False", "0"], ["False", "0"], ["True", "2"],
                                     ["True", "2"], ["False", "0"]]
    assert len({r[2] for r in runs}) == 1, "every run shares one model folder"
    entry = json.loads(results.read_text())[-1]
    assert entry["b"] == ["runtime.engine.fp8.DEFERRED=False", "runtime.engine.fp8.SMALL_SPLITS=()"]
    assert entry["machine"] == "stand-in" and entry["a"] == []
    offline = entry["metrics"]["8B/fp8_kv/offline_tok_s"]
    assert offline["a"] == [210.0, 240.0, 250.0] and offline["b"] == [120.0, 130.0, 160.0]
    assert offline["a_median"] == 240.0 and offline["b_median"] == 130.0 and offline["b_over_a"] == round(130 / 240, 4)
    assert entry["metrics"]["8B/bf16/b1_tok_s"]["b_over_a"] == 1.0
    assert "8B/fp8_kv/graph_gpu_s" in entry["metrics"] and "8B/fp8/offline_tok_s" not in entry["metrics"]
    assert entry["metrics"]["8B/fp8_kv/offline_s"]["a"] == [2000 / 210, 2000 / 240, 2000 / 250]
    assert entry["metrics"]["8B/fp8_kv/eager_gpu_s"]["b_over_a"] == 1.0
    assert "8B/fp8_kv/offline_tok_s" in out.stdout



def test_further_sides_share_side_as_runs_and_each_is_recorded_against_them(tmp_path):
    """--also: sides C (and on) run in every round beside A and B, the order reversed every other round, and each
    is recorded as its own comparison with the same A runs."""
    script, log, results = tmp_path / "speed.py", tmp_path / "runs.log", tmp_path / "ab.json"
    script.write_text(STAND_IN)
    out = ab("--b", "runtime.engine.fp8.DEFERRED=False", "--also", "runtime.engine.fp8.SMALL_SPLITS=()",
             "--script", str(script), "--record", "--results", str(results), "--", "--models", "8B",
             "--log", str(log))
    assert out.returncode == 0, out.stdout + out.stderr
    runs = [line.split()[:2] for line in log.read_text().splitlines()]
    # A B C, then C B A
    assert runs == [["True", "2"], ["False", "2"], ["True", "0"], ["True", "0"], ["False", "2"], ["True", "2"]]
    b_entry, c_entry = json.loads(results.read_text())
    assert b_entry["b"] == ["runtime.engine.fp8.DEFERRED=False"]
    assert c_entry["b"] == ["runtime.engine.fp8.SMALL_SPLITS=()"]
    assert b_entry["a"] == c_entry["a"] == []
    a_runs = b_entry["metrics"]["8B/fp8_kv/offline_tok_s"]["a"]
    assert a_runs == c_entry["metrics"]["8B/fp8_kv/offline_tok_s"]["a"] == [210.0, 260.0]
    assert b_entry["metrics"]["8B/fp8_kv/offline_tok_s"]["b"] == [120.0, 150.0]
    assert c_entry["metrics"]["8B/fp8_kv/offline_tok_s"]["b"] == [230.0, 240.0]
    assert "side C (runtime.engine.fp8.SMALL_SPLITS=()) against A" in out.stdout


def test_two_sides_with_the_same_settings_are_refused_by_name(tmp_path):
    script = tmp_path / "speed.py"
    script.write_text("raise SystemExit('ran')\n")
    out = ab("--script", str(script), "--b", "runtime.engine.fp8.DEFERRED=False", "--also",
             "runtime.engine.fp8.DEFERRED=False")
    assert out.returncode == 2 and "sides B and C have the same settings" in out.stderr, out.stderr


@pytest.mark.parametrize("args, names", [
    (["--b", "runtime.engine.fp8.NOT_A_SETTING=1"], "has no attribute NOT_A_SETTING"),
    (["--b", "runtime.engine.nowhere.X=1"], "does not import"),
    (["--b", "runtime.engine.fp8.DEFERRED=maybe"], "is not a Python literal"),
    (["--b", "DEFERRED"], "MODULE.ATTRIBUTE=VALUE"),
    ([], "the same settings"),
    (["--b", "runtime.engine.fp8.DEFERRED=False", "--", "--record"], "--record and --results are ab.py's"),
])
def test_a_setting_that_names_nothing_is_refused_before_any_run(tmp_path, args, names):
    script = tmp_path / "speed.py"
    script.write_text("raise SystemExit('ran')\n")
    out = ab("--script", str(script), *args)
    assert out.returncode == 2 and names in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_a_side_that_fails_is_named_with_the_end_of_its_output(tmp_path):
    script = tmp_path / "speed.py"
    script.write_text("print('loading'); raise SystemExit('no GPU here')\n")
    out = ab("--b", "runtime.engine.fp8.DEFERRED=False", "--script", str(script))
    assert out.returncode == 1 and "side A failed" in out.stderr and "no GPU here" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_a_setting_of_a_triton_constexpr_global_stays_a_constexpr(monkeypatch):
    """A kernel reads only globals that are Triton constexprs (runtime.engine.fused.PACKED_ROUND), so apply() wraps
    a value for one in its type, and sets any other attribute to the value itself."""
    import importlib.util
    import types

    class constexpr:   # Triton's type, as apply() recognizes it: its name and its `value`
        def __init__(self, value):
            self.value = value

    fake = types.ModuleType("ember.fake_kernels")
    fake.ROUND, fake.WARPS = constexpr(False), 4
    monkeypatch.setitem(sys.modules, "ember.fake_kernels", fake)
    spec = importlib.util.spec_from_file_location("ab_under_test", AB)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.apply(["fake_kernels.ROUND=True", "fake_kernels.WARPS=16"])
    assert type(fake.ROUND) is constexpr and fake.ROUND.value is True
    assert fake.WARPS == 16
