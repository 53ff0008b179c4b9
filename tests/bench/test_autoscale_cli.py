"""The autoscaling bench's two commands answer a user's mistake with one line naming it, never a traceback or a
replay that runs forever."""
import subprocess
import sys

import pytest

from tests.conftest import ROOT

BENCH = ROOT / "bench"


def run(*args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=60, cwd=cwd)


@pytest.mark.parametrize("args, names", [
    (["--park-after", "-3"], "--park-after -3"),        # a traceback before
    (["--tiers", "wake=-1"], "--tiers wake='-1'"),      # taken before
    (["--tiers", "cold=nan"], "--tiers cold='nan'"),    # taken before
    (["--tiers", "warm="], "--tiers warm=''"),
])
def test_bad_replay_settings_are_named(tmp_path, args, names):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"t": 1764650000, "function": "f", "prompt_tokens": 100, "output_tokens": 20}\n')
    out = run(str(BENCH / "autoscale_sim.py"), "--trace", str(trace), "--json", *args)
    assert out.returncode != 0 and names in out.stderr and "Traceback" not in out.stderr, out.stderr


@pytest.mark.parametrize("line, names", [
    ('{"t": NaN, "function": "f", "prompt_tokens": 1, "output_tokens": 1}', "t must be a finite number"),
    ('{"t": 1, "function": "f", "prompt_tokens": 1e300, "output_tokens": 1}', "prompt_tokens must be"),
])
def test_a_trace_that_would_replay_forever_is_refused(tmp_path, line, names):
    """Both ran until killed before."""
    trace = tmp_path / "t.jsonl"
    trace.write_text(line + "\n")
    out = run(str(BENCH / "autoscale_sim.py"), "--trace", str(trace), "--json")
    assert out.returncode == 1 and "t.jsonl:1: " in out.stderr and names in out.stderr, out.stderr


def test_a_trace_spanning_over_a_week_is_refused_and_a_replay_shows_progress(tmp_path):
    """Requests 1e12 s apart ran until killed before; a day of trace ran a minute in silence."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"t": 0, "function": "f", "prompt_tokens": 1, "output_tokens": 1}\n'
                     '{"t": 1e12, "function": "f", "prompt_tokens": 1, "output_tokens": 1}\n')
    out = run(str(BENCH / "autoscale_sim.py"), "--trace", str(trace), "--json")
    assert out.returncode == 1 and "over a week" in out.stderr and "Traceback" not in out.stderr, out.stderr
    trace.write_text('{"t": 0, "function": "f", "prompt_tokens": 100, "output_tokens": 20}\n'
                     '{"t": 14400, "function": "f", "prompt_tokens": 100, "output_tokens": 20}\n')
    out = run(str(BENCH / "autoscale_sim.py"), "--trace", str(trace), "--json")
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 6, out.stderr
    for name, began, ended in zip(("ember", "kpa-like", "ray-default"), lines[::2], lines[1::2]):
        assert began == f"autoscale_sim: t.jsonl: 2 requests over 14,400 s under {name}..." and \
            ended.startswith(f"autoscale_sim: t.jsonl: {name} done in "), out.stderr
    assert '"ember": {"gpu_s"' in out.stdout


def test_a_trace_of_unix_timestamps_replays_from_its_first_request(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(f'{{"t": {1764650000 + 3 * i}, "function": "f", "prompt_tokens": 100, '
                             f'"output_tokens": 20}}\n' for i in range(5)))
    out = run(str(BENCH / "autoscale_sim.py"), "--trace", str(trace), "--json")
    assert out.returncode == 0, out.stderr
    assert '"ember": {"gpu_s"' in out.stdout


@pytest.mark.parametrize("script, args, names", [
    ("autoscale_sim.py", ["--seeds", "0"], "--seeds: 0 is outside"),            # an empty suite before
    ("autoscale_sim.py", ["--duration", "-5"], "--duration: -5 is outside"),    # a traceback before
    ("autoscale_sim.py", ["--jobs", "0"], "--jobs: 0 is outside"),              # a traceback before
    ("autoscale_traces.py", ["steady", "--rate", "1e9"], "--rate: 1e9 is outside"),
    ("autoscale_traces.py", ["small", "--low", "1", "--high", "0.5"], "--low 1 is above --high 0.5"),
    ("autoscale_traces.py", ["small", "--functions", "0"], "--functions: 0 is outside"),
])
def test_bad_options_are_usage_errors(script, args, names):
    out = run(str(BENCH / script), *args)
    assert out.returncode == 2 and names in out.stderr and "Traceback" not in out.stderr, out.stderr
