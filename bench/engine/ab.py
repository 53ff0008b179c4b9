"""An engine setting against another, end to end, side by side in one run: bench/engine/speed.py in fresh processes,
alternately with module attributes set one way and the other, on the same model directory.

    python bench/engine/ab.py --b runtime.engine.fp8.DEFERRED=False -- --models 8B --parts fp8_kv --skip-transformers
    python bench/engine/ab.py --a runtime.engine.pdl.ENABLED=True --rounds 3 -- --models 8B --parts b1,offline
    python bench/engine/ab.py --b runtime.engine.fp8.SMALL_SPLITS=() --record -- --models 8B --parts fp8_kv
    python bench/engine/ab.py --b runtime.engine.paged_decode.QUANTIZED_OUT=True \
        --also runtime.engine.attention.RAGGED_PREFILL=True --also runtime.engine.gemv.FP8_THIN=None -- --models 8B ...

A setting is a module of the ember package, an attribute it already has and a Python literal (runtime.engine.fp8
.DEFERRED=False); a side with none runs the defaults. Round 1 runs A then B, round 2 B then A, and so on, so neither
side always runs first after the model's build. The arguments after `--` go to speed.py (a --workdir is added where
they have none, so the model is built once); each process records into a folder of its own, from which this reads,
for each model and part (the row itself, fp8, fp8_kv), batch-1 and offline output tok/s, the offline run's seconds
and its GPU seconds in decode graphs and in eager (prefill) steps, and prints every run and the medians with B over
A. `--also SETTING...` (repeatable) adds a further side, C, D and on, each compared with A as B is, on the same A
runs: one call times several switches against one set of A runs (each round runs every side, in reverse order every
other round). With --record each comparison (B, then each further side, against A) is appended to
bench/results/engine_ab.json with the machine. Absolute numbers hold only on the GPU machine. The settings reach
speed.py's own process, where its b1, offline, fp8 and fp8_kv parts run their engines, not the processes it starts
(the b64 part's engines, the online part's `ember serve`).
"""
import argparse
import ast
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent / "results" / "engine_ab.json"
PARTS = ("", "fp8", "fp8_kv")   # the row's own fields, then its FP8 parts' (speed.py's ember_fp8)
METRICS = {"b1_tok_s": ("ember_b1_tok_s",), "offline_tok_s": ("offline_output_tok_s",),
           "offline_s": ("offline_time_split", "seconds"), "graph_gpu_s": ("offline_time_split", "graph_gpu_s"),
           "eager_gpu_s": ("offline_time_split", "eager_gpu_s")}


def parse_setting(text: str) -> tuple[str, str, object]:
    """(module under ember, attribute, value) of `MODULE.ATTR=LITERAL`, checked: the module imports, has the
    attribute, and the value is a Python literal."""
    target, sep, literal = text.partition("=")
    module, _, attribute = target.rpartition(".")
    if not sep or not module or not attribute:
        raise ValueError(f"{text!r}: write a setting as MODULE.ATTRIBUTE=VALUE, e.g. runtime.engine.fp8.DEFERRED=False")
    try:
        value = ast.literal_eval(literal)
    except (ValueError, SyntaxError):
        raise ValueError(f"{text!r}: {literal!r} is not a Python literal (True, 2, 0.5, 'text', (16, 4))") from None
    try:
        loaded = importlib.import_module(f"ember.{module}")
    except ImportError as err:
        raise ValueError(f"{text!r}: ember.{module} does not import ({err}); name a module of the ember "
                         "package, e.g. runtime.engine.fp8") from None
    if not hasattr(loaded, attribute):
        raise ValueError(f"{text!r}: ember.{module} has no attribute {attribute}; a setting replaces one it has")
    return module, attribute, value


def apply(settings: list[str]) -> None:
    """Sets each setting's attribute; a value for a Triton constexpr global (a kernel reads only those, e.g.
    runtime.engine.fused.PACKED_ROUND) becomes one, which Triton keys its compiled kernels by."""
    for text in settings:
        module, attribute, value = parse_setting(text)
        loaded = importlib.import_module(f"ember.{module}")
        current = getattr(loaded, attribute)
        if type(current).__name__ == "constexpr" and hasattr(current, "value"):
            value = type(current)(value)
        setattr(loaded, attribute, value)


def metrics(result: dict) -> dict[str, float]:
    """`model/part/metric` -> value, for what a speed.py record holds."""
    out = {}
    for row in result.get("models", []):
        for part in PARTS:
            fields = row if not part else row.get(part)
            if not isinstance(fields, dict):
                continue
            for name, path in METRICS.items():
                value = fields
                for key in path:
                    value = value.get(key) if isinstance(value, dict) else None
                if isinstance(value, (int, float)):
                    out[f"{row.get('name', '?')}/{part or 'bf16'}/{name}"] = float(value)
    return out


def run_side(script: Path, settings: list[str], speed_args: list[str], folder: Path) -> dict:
    """One fresh process of `script` with `settings` applied, recording into `folder`: its record."""
    command = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(settings), "--script",
               str(script), "--", *speed_args, "--record", "--results", str(folder)]
    started = time.monotonic()
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        tail = "\n".join(done.stdout.splitlines()[-15:])
        raise RuntimeError(f"{script.name} exited {done.returncode} after {time.monotonic() - started:.0f} s:\n{tail}")
    return json.loads((folder / "engine_speed.json").read_text())


def compare(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per metric: each side's runs, medians, and B over A."""
    names = sorted(set().union(*(set(m) for side in runs.values() for m in side)))
    table = {}
    for name in names:
        values = {side: [m[name] for m in ms if name in m] for side, ms in runs.items()}
        row: dict = {side: v for side, v in values.items()}
        medians = {side: statistics.median(v) for side, v in values.items() if v}
        row.update({f"{side}_median": round(m, 3) for side, m in medians.items()})
        if medians.get("a") and "b" in medians:
            row["b_over_a"] = round(medians["b"] / medians["a"], 4)
        table[name] = row
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", nargs="*", default=[], metavar="SETTING", help="side A's settings (none: defaults)")
    parser.add_argument("--b", nargs="*", default=[], metavar="SETTING", help="side B's settings (none: defaults)")
    parser.add_argument("--also", action="append", nargs="+", default=[], metavar="SETTING",
                        help="a further side's settings, compared with A as B is (repeatable: sides C, D, ...)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each side (default 2)")
    parser.add_argument("--record", action="store_true", help=f"append the comparison to {RESULTS}")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the file --record appends to")
    parser.add_argument("--script", type=Path, default=HERE / "speed.py", help=argparse.SUPPRESS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("speed_args", nargs="*", help="after --: speed.py's arguments")
    args = parser.parse_args()
    if args.child is not None:   # one side's process: apply its settings, then run the script as its own main
        apply(json.loads(args.child))
        sys.argv = [str(args.script), *args.speed_args]
        sys.path.insert(0, str(args.script.parent))
        import runpy
        runpy.run_path(str(args.script), run_name="__main__")
        return
    if "--record" in args.speed_args or "--results" in args.speed_args:
        parser.exit(2, "ab.py: speed.py's --record and --results are ab.py's to set; give ab.py --record\n")
    if args.rounds < 1:
        parser.exit(2, "ab.py: --rounds must be 1 or more\n")
    sides = {"a": args.a, "b": args.b} | {chr(ord("c") + i): also for i, also in enumerate(args.also)}
    if len(sides) > 26:
        parser.exit(2, "ab.py: at most 24 --also sides\n")
    try:
        parsed = {side: [parse_setting(s) for s in settings] for side, settings in sides.items()}
    except ValueError as err:
        parser.exit(2, f"ab.py: {err}\n")
    for side, settings in parsed.items():
        same = next((other for other in parsed if other < side and parsed[other] == settings), None)
        if same is not None:
            parser.exit(2, f"ab.py: sides {same.upper()} and {side.upper()} have the same settings; give each side a "
                           "setting of its own to compare\n")
    with tempfile.TemporaryDirectory(prefix="ember-ab-") as scratch:
        speed_args = list(args.speed_args)
        if "--workdir" not in speed_args:   # one model build for every run
            speed_args += ["--workdir", os.path.join(scratch, "models")]
        runs: dict[str, list[dict]] = {side: [] for side in sides}
        machine = None
        for round_ in range(args.rounds):
            for side in list(sides) if round_ % 2 == 0 else list(sides)[::-1]:
                label = " ".join(sides[side]) or "defaults"
                print(f"ab: round {round_ + 1} of {args.rounds}, side {side.upper()} ({label})", flush=True)
                try:
                    record = run_side(args.script, sides[side], speed_args, Path(scratch) / f"{side}{round_}")
                except RuntimeError as err:
                    sys.exit(f"ab.py: side {side.upper()} failed: {err}")
                machine = machine or record.get("machine")
                runs[side].append(metrics(record))
    entries = []
    for side in list(sides)[1:]:   # each against A, as side B of its own entry
        table = compare({"a": runs["a"], "b": runs[side]})
        label = " ".join(sides[side]) or "defaults"
        print(f"\nside {side.upper()} ({label}) against A\n"
              f"{'metric':48s} {'A median':>12s} {side.upper() + ' median':>12s} {side.upper() + '/A':>8s}"
              f"   runs A | {side.upper()}")
        for name, row in table.items():
            print(f"{name:48s} {row.get('a_median', '-'):>12} {row.get('b_median', '-'):>12} "
                  f"{row.get('b_over_a', '-'):>8}   {row['a']} | {row['b']}")
        entries.append({"machine": machine, "date": time.strftime("%Y-%m-%d"), "speed_args": args.speed_args,
                        "a": args.a, "b": sides[side], "rounds": args.rounds, "metrics": table})
    if args.record:
        existing = json.loads(args.results.read_text()) if args.results.exists() else []
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps([*existing, *entries], indent=1) + "\n")
        print(f"ab: appended to {args.results}")


if __name__ == "__main__":
    main()
