"""Benchmarks write bench/results/ only when asked (--record): a plain run prints its table and leaves the tree as it
was."""
import hashlib
import re
import subprocess
import sys

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
