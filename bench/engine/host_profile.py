"""Where the engine's host time per step goes, on a machine without a GPU (or, with --model, on one).

    python bench/engine/host_profile.py                         # 64 and 256 running sequences, a table
    python bench/engine/host_profile.py --offline               # also speed.py's offline workload, host seconds
    python bench/engine/host_profile.py --against DIR           # the same, also for the engine in DIR, side by side
    python bench/engine/host_profile.py --seqs 256 --cprofile   # cProfile's top functions of the decode steps
    python bench/engine/host_profile.py --model DIR --offline   # a real model, on the GPU where there is one
    python bench/engine/host_profile.py --overlap               # EngineConfig(overlap=True)

The real LLMEngine runs on the CPU with the tiny model of runtime/engine/tiny.py, and everything a GPU step does
on the host runs as it would on the GPU: the decode steps go through DecodeGraphs.prepare and
FlashInferBackend.plan (with stand-ins, here only, for what runs on the device: flashinfer's wrappers copy their
plan's tables into their buffers, a graph "replay" looks the logits up, the sampler's argmax is not counted). The
forward pass is that look-up: the logits of a row are a fixed random vector per input token, so the tokens are
deterministic, vary, and must be the same for any two engines (the token checksum says so). Not counted:
flashinfer's own planning, kernel launches, graph captures, host-to-device copies, and the device time itself.
With --model the engine runs as it is, stand-ins and all, and the table adds those: capture (DecodeGraphs.capture,
lazy captures included), replay (the graph's launch), and the device wait (RunOutput.wait_seconds, taken out of
to_host, where the host blocks).

Per step, in microseconds of host time, split by phase (self time: a phase inside another is not counted twice):
schedule (Scheduler.schedule), inputs (ModelRunner.run less the phases below), rows (sampling rows, where the
runner builds them in one call; an engine that builds them one call per sequence counts them in inputs, as a
wrapper per call would cost more than the call), graph_prepare (DecodeGraphs.prepare less attention planning),
plan (the attention backend's), draw, to_host, postprocess, observer, step_other (the rest of LLMEngine.step),
detokenize (the text per request as AsyncLLM makes it on its callers' event loops: outside LLMEngine.step, but on
the same host and GIL), and the garbage collector's share of all of them.

--overlap runs EngineConfig(overlap=True): its inputs checksum must equal the serial engine's; its token checksum
does not, as its outputs lag one step (the last measured step's tokens are still in flight).

--against DIR runs this script again in a second process whose `ember.runtime` is DIR/runtime (a checkout of
another commit, e.g. `git archive BASE runtime | tar -x -C DIR`), with the same workload. Prints only; records
nothing.
"""
import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
import types
import zlib
from pathlib import Path

import torch

PHASES = ("schedule", "inputs", "rows", "capture", "graph_prepare", "plan", "replay", "draw", "to_host", "postprocess",
          "observer", "step_other")
FORWARD = "forward"   # the stand-in for the device's work: not host time
WAIT = "device wait"  # on a GPU: the host blocked on the device (RunOutput.wait_seconds), not host time
GC = "(of which gc)"  # the cyclic garbage collector, inside the other phases
VOCAB_DRAWS = 7       # logits table seed


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


class Phases:
    """Self time per phase: a timed call inside another is subtracted from the outer one."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._children: list[float] = []

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            self._children.append(0.0)
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - began
                inner = self._children.pop()
                self.seconds[name] = self.seconds.get(name, 0.0) + elapsed - inner
                if self._children:
                    self._children[-1] += elapsed
        return timed

    def reset(self) -> None:
        self.seconds = {}

    def collected(self, phase: str, info: dict) -> None:
        """gc.callbacks: the cyclic collector's time, also counted in the phase it interrupted."""
        if phase == "start":
            self._gc_began = time.perf_counter()
        elif hasattr(self, "_gc_began"):
            self.seconds[GC] = self.seconds.get(GC, 0.0) + time.perf_counter() - self._gc_began


PHASE_TIMER = Phases()   # one per process: the module-level functions are wrapped once


class LogitsTable:
    """The forward pass's stand-in: row i of the logits is a fixed random vector of input token i."""

    def __init__(self, vocab: int):
        g = torch.Generator().manual_seed(VOCAB_DRAWS)
        self.table = torch.randn(vocab, vocab, generator=g)

    def __call__(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.table[token_ids]


class InputsDigest:
    """CRC-32 of everything the device would read, step after step: token ids, positions, KV slots, and the
    attention's tables as the wrappers and the Triton decode take them. Two engines that prepare the same steps
    get the same digest."""

    def __init__(self):
        self.crc = 0

    def add(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            self.crc = zlib.crc32(t.contiguous().numpy().tobytes(), self.crc)


DIGEST = InputsDigest()


class StubModel:
    """The eager steps' model: the hidden state is the input token, the logits its row of the table."""

    def __init__(self, logits: LogitsTable, phases: Phases):
        self.logits = logits
        self.compute_logits = phases.wrap(FORWARD, lambda hidden: self.logits(hidden.squeeze(1)))
        self.digest = phases.wrap(FORWARD, DIGEST.add)

    def __call__(self, ids, positions, attention, kv_caches):
        self.digest(ids, positions, attention.batch.slot_blocks, attention.batch.slot_offsets)
        return ids.unsqueeze(1)


def fake_flashinfer(digest):
    """flashinfer's wrappers as far as the host sees them: plan() copies the tables into the wrapper's buffers (a
    graph wrapper's static ones), as the real one does before its own planning."""
    module = types.ModuleType("flashinfer")

    class Wrapper:
        def __init__(self, workspace, layout, use_cuda_graph=False, paged_kv_indptr_buffer=None,
                     paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None):
            self.buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)

        def plan(self, *args, **kwargs):
            digest(*[a for a in args if isinstance(a, torch.Tensor)])
            tables = [a for a in args if isinstance(a, torch.Tensor)][-3:]
            if self.buffers[0] is not None:
                for buffer, table in zip(self.buffers, tables):
                    buffer[:len(table)].copy_(table, non_blocking=True)
            else:
                self.tables = [t.clone() for t in tables]

    module.BatchPrefillWithPagedKVCacheWrapper = Wrapper
    module.BatchDecodeWithPagedKVCacheWrapper = Wrapper
    return module


def emulate_gpu_path(eng, phases: Phases) -> None:
    """Swap the CPU engine's SDPA attention and eager decode for the GPU's host path: FlashInferBackend and
    DecodeGraphs, with stand-ins for flashinfer's wrappers and the graphs' replay."""
    from ember.runtime.engine import cuda_graphs
    from ember.runtime.engine.attention import FlashInferBackend

    runner = eng.runner
    sys.modules["flashinfer"] = fake_flashinfer(phases.wrap(FORWARD, DIGEST.add))
    logits = LogitsTable(runner.vocab_size)
    runner.model = StubModel(logits, phases)
    old = runner.attention
    runner.attention = FlashInferBackend(old.num_heads, old.num_kv_heads, old.head_dim, old.block_size, old.scale,
                                         dtype=runner.dtype, device=runner.device)

    class HostGraphs(cuda_graphs.DecodeGraphs):
        """Capture and replay without CUDA; everything else is DecodeGraphs' own."""

        def capture(self, size: int) -> None:
            if size not in self.graphs:
                self.attention.add_graph_batch_size(size, self.max_blocks_per_seq)
                self.graphs[size] = None
                self.logits[size] = torch.empty(size, runner.vocab_size)

        def replay(self, size: int, num_seqs: int) -> torch.Tensor:
            return self._replay(size, num_seqs)

    def replay(self, size: int, num_seqs: int) -> torch.Tensor:
        # an engine of --against from before DecodeGraphs.rows kept its inputs as one [4, max size] tensor
        rows = self.rows(size) if hasattr(self, "rows") else self.inputs[:, :size]
        DIGEST.add(rows)
        if self.attention.graph is not None:   # the Triton decode of small batches: its tables
            DIGEST.add(self.attention.graph.block_tables, self.attention.graph.context_lens)
        torch.index_select(logits.table, 0, rows[0], out=self.logits[size])
        return self.logits[size][:num_seqs]

    HostGraphs._replay = phases.wrap(FORWARD, replay)
    pool_handle = torch.cuda.graph_pool_handle
    torch.cuda.graph_pool_handle = lambda: None
    try:
        max_blocks_per_seq = -(-runner.max_model_len // runner.block_size)
        runner.graphs = HostGraphs(runner.model, runner.attention, runner.kv_caches,
                                   cuda_graphs.graph_batch_sizes(eng.config.max_num_seqs), max_blocks_per_seq,
                                   scratch_block=runner.num_blocks - 1, capture=[])
    finally:
        torch.cuda.graph_pool_handle = pool_handle


def instrument(eng, phases: Phases, real: bool) -> None:
    """Time the step's phases; with a real model on a GPU also the graph captures and replays (their launch),
    and the wait for the device (RunOutput.wait_seconds, taken out of to_host where it happens)."""
    from ember.runtime.engine import model_runner, sampling

    runner = eng.runner
    eng.scheduler.schedule = phases.wrap("schedule", eng.scheduler.schedule)
    overlap = getattr(eng.config, "overlap", False)

    def waited(out, where: str):
        if out.gpu_seconds is not None:   # the wait is the device's time, not the host's
            phases.seconds[where] = phases.seconds.get(where, 0.0) - out.wait_seconds
            phases.seconds[WAIT] = phases.seconds.get(WAIT, 0.0) + out.wait_seconds
        return out

    if overlap:   # launch and collect in place of run; the wait happens in collect
        runner.launch = phases.wrap("inputs", runner.launch)
        collect = phases.wrap("to_host", runner.collect)
        runner.collect = lambda launched: waited(collect(launched), "to_host")
        eng._postprocess_launched = phases.wrap("postprocess", eng._postprocess_launched)
    else:
        run = phases.wrap("inputs", runner.run)

        def run_and_wait(*args):
            out = run(*args)
            # the wait happened in to_host, or in run itself when nothing was sampled
            return waited(out, "to_host" if any(t is not None for t in out.token_ids) else "inputs")

        runner.run = run_and_wait
    if hasattr(runner, "_sampling_rows"):   # an engine that builds a step's rows in one call (else: in inputs)
        runner._sampling_rows = phases.wrap("rows", runner._sampling_rows)
    if runner.graphs is not None:
        runner.graphs.prepare = phases.wrap("graph_prepare", runner.graphs.prepare)
        if real:   # real graphs: their capture and launch
            runner.graphs.capture = phases.wrap("capture", runner.graphs.capture)
            runner.graphs.replay = phases.wrap("replay", runner.graphs.replay)
    runner.attention.plan = phases.wrap("plan", runner.attention.plan)
    if not hasattr(model_runner.draw, "timed_by"):   # module-level: wrapped once per process
        model_runner.draw = phases.wrap("draw", model_runner.draw)
        model_runner.draw.timed_by = phases
        sampling.Draws.to_host = phases.wrap("to_host", sampling.Draws.to_host)
        if runner.device.type == "cpu":
            # the sampler's argmax over [B, vocab] runs on the device: ~1.3 us a row on this CPU, a launch there
            torch.Tensor.argmax = phases.wrap(FORWARD, torch.Tensor.argmax)
        gc.callbacks.append(phases.collected)
    eng._postprocess = phases.wrap("postprocess", eng._postprocess)
    eng.observer.stepped = phases.wrap("observer", eng.observer.stepped)
    eng.step = phases.wrap("step_other", eng.step)


def make_engine(model_dir: Path, max_num_seqs: int, args, phases: Phases):
    from ember.runtime.engine.config import EngineConfig
    from ember.runtime.engine.engine import LLMEngine

    blocks = None if args.model and torch.cuda.is_available() else max_num_seqs * -(-args.max_model_len // 16) + 1
    # serial steps unless --overlap (an engine of --against may not have the flag)
    overlap = {"overlap": args.overlap} if "overlap" in EngineConfig.__dataclass_fields__ else {}
    eng = LLMEngine(EngineConfig(model=str(model_dir), max_num_seqs=max_num_seqs, max_num_batched_tokens=8192,
                                 max_model_len=args.max_model_len, num_kv_blocks=blocks, **overlap))
    if not args.model:
        emulate_gpu_path(eng, phases)
    elif eng.runner.device.type == "cpu":   # the real forward pass on the CPU: the device's stand-in
        eng.runner.model.forward = phases.wrap(FORWARD, eng.runner.model.forward)
    instrument(eng, phases, real=bool(args.model))
    return eng


def prompts(n: int, low: int, high: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (int(torch.randint(low, high + 1, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def detokenizers(tokenizer, requests: dict[str, list[int]]) -> dict:
    from ember.runtime.engine.detokenizer import Detokenizer

    return {rid: Detokenizer(tokenizer, prompt) for rid, prompt in requests.items()}


def detokenize(outputs, detoks: dict, phases: Phases) -> None:
    began = time.perf_counter()
    for out in outputs:
        detoks[out.request_id].step(out.new_token_ids, finished=out.finished)
    phases.seconds["detokenize"] = phases.seconds.get("detokenize", 0.0) + time.perf_counter() - began


def steady(model_dir: Path, tokenizer, seqs: int, args) -> dict:
    """`seqs` requests of ~prompt_len tokens, all prefilled, then `steps` decode steps with all of them running."""
    from ember.runtime.engine.sampling import SamplingParams

    phases = PHASE_TIMER
    eng = make_engine(model_dir, seqs, args, phases)
    DIGEST.crc = 0
    requests = {f"r{i}": p for i, p in enumerate(prompts(seqs, args.prompt_len - 50, args.prompt_len + 50,
                                                          eng.runner.vocab_size, seed=seqs))}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_model_len - args.prompt_len - 60, ignore_eos=True)
    for rid, prompt in requests.items():
        eng.add_request(rid, prompt, params)
    # a random-weight model of a real shape samples ids past the tiny tokenizer's vocabulary: no text to make
    detoks = detokenizers(tokenizer, requests) if len(tokenizer) >= eng.runner.vocab_size else None
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    prefill_steps = 0
    while len(eng.scheduler.running) < seqs or any(s.num_uncomputed_tokens > 1 for s in eng.scheduler.running):
        for out in eng.step():
            tokens[out.request_id] += out.new_token_ids
        prefill_steps += 1
    phases.reset()
    profile = cProfile.Profile() if args.cprofile else None
    began = time.perf_counter()
    for _ in range(args.steps):
        if profile:
            profile.enable()
        outputs = eng.step()
        if detoks is not None:
            detokenize(outputs, detoks, phases)
        if profile:
            profile.disable()
        for out in outputs:
            tokens[out.request_id] += out.new_token_ids
    wall = time.perf_counter() - began
    assert all(len(s.token_ids) > 0 for s in eng.scheduler.running) and len(eng.scheduler.running) == seqs
    result = per_step(phases, args.steps, wall)
    result.update(seqs=seqs, prefill_steps=prefill_steps, token_checksum=checksum(tokens), inputs_checksum=DIGEST.crc)
    if profile:
        result["cprofile"] = top_functions(profile, args.cprofile_lines)
    return result


def offline(model_dir: Path, args) -> dict:
    """speed.py's offline workload: 256 requests, prompt and output lengths uniform in [100, 1024], greedy,
    ignore_eos, 256 sequences and 8192 tokens a step."""
    from ember.runtime.engine.sampling import SamplingParams

    phases = PHASE_TIMER
    eng = make_engine(model_dir, 256, args, phases)
    DIGEST.crc = 0
    vocab = eng.runner.vocab_size
    g = torch.Generator().manual_seed(0)
    n = args.offline_requests
    prompt_lens = torch.randint(100, 1025, (n,), generator=g).tolist()
    output_lens = torch.randint(100, 1025, (n,), generator=g).tolist()
    batch = [torch.randint(10, vocab, (length,), generator=g).tolist() for length in prompt_lens]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in output_lens]
    steps = 0
    step = eng.step

    def counted():
        nonlocal steps
        steps += 1
        return step()

    eng.step = counted
    phases.reset()
    began = time.perf_counter()
    outputs = eng.generate(batch, params)
    wall = time.perf_counter() - began
    assert [len(o) for o in outputs] == output_lens
    result = per_step(phases, steps, wall)
    result.update(seqs="offline", host_seconds=round(wall - phases.seconds.get(FORWARD, 0.0)
                                                     - phases.seconds.get(WAIT, 0.0), 2),
                  token_checksum=checksum(dict(enumerate(outputs))), inputs_checksum=DIGEST.crc)
    return result


def per_step(phases: Phases, steps: int, wall: float) -> dict:
    us = {name: round(1e6 * seconds / steps, 1) for name, seconds in phases.seconds.items() if name != FORWARD}
    host = 1e6 * (wall - phases.seconds.get(FORWARD, 0.0) - phases.seconds.get(WAIT, 0.0)) / steps
    return {"steps": steps, "host_us": round(host, 1), "phases_us": us}


def checksum(tokens: dict) -> int:
    """CRC-32 of every request's tokens, in request order: equal for two engines that produce the same tokens."""
    return zlib.crc32(json.dumps(sorted((str(k), v) for k, v in tokens.items())).encode())


def top_functions(profile: cProfile.Profile, lines: int) -> str:
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(lines)
    return out.getvalue()


def measure(args) -> list[dict]:
    from ember.runtime.engine.tiny import build_tiny_model, train_tokenizer

    if args.model:
        from transformers import AutoTokenizer

        model_dir = Path(args.model)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    else:
        model_dir = build_tiny_model(Path(args.workdir) / "tiny-host-profile",
                                     max_position_embeddings=args.max_model_len)
        tokenizer = train_tokenizer()
    rows = []
    for seqs in args.seqs:
        rows.append(best_of(args.repeat, lambda seqs=seqs: steady(model_dir, tokenizer, seqs, args)))
        log(f"  {seqs} sequences: {rows[-1]['host_us']} us/step")
    if args.offline:
        rows.append(best_of(args.repeat, lambda: offline(model_dir, args)))
        log(f"  offline: {rows[-1]['host_seconds']} s of host")
    return rows


def best_of(repeat: int, measure_once) -> dict:
    """The run of least host time: this machine's other work only ever adds to it."""
    rows = []
    for _ in range(repeat):
        rows.append(measure_once())
        gc.collect()   # the engine just measured, before the next one takes the device's memory
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return min(rows, key=lambda row: row["host_us"])


def against(args, directory: str) -> list[dict]:
    """The same measurement in a second process whose ember.runtime is `directory`/runtime."""
    argv = [a for a in sys.argv[1:]]
    i = argv.index("--against")
    del argv[i:i + 2]
    code = (f"import sys, ember.runtime; ember.runtime.__path__[:] = [{str(Path(directory) / 'runtime')!r}]; "
            f"sys.argv = [{__file__!r}] + {argv!r} + ['--json']; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            "import host_profile; host_profile.main()")
    out = subprocess.run([sys.executable, "-c", code], check=True, stdout=subprocess.PIPE, text=True,
                         env=os.environ).stdout
    return json.loads(out.strip().splitlines()[-1])


def table(columns: dict[str, list[dict]]) -> str:
    names = list(columns)
    lines = []
    for rows in zip(*columns.values()):
        seqs = rows[0]["seqs"]
        header = f"{'sequences: ' + str(seqs):<24}" + "".join(f"{n:>14}" for n in names)
        lines += ["", header, "-" * len(header)]
        phases = [p for p in (*PHASES, "detokenize", GC, WAIT) if any(p in r["phases_us"] for r in rows)]
        for phase in phases:
            lines.append(f"{phase:<24}" + "".join(f"{r['phases_us'].get(phase, 0.0):>14.1f}" for r in rows))
        lines.append(f"{'host us/step':<24}" + "".join(f"{r['host_us']:>14.1f}" for r in rows))
        if seqs == "offline":
            lines.append(f"{'host s (all steps)':<24}" + "".join(f"{r['host_seconds']:>14}" for r in rows))
        lines.append(f"{'steps':<24}" + "".join(f"{r['steps']:>14}" for r in rows))
        lines.append(f"{'token checksum':<24}" + "".join(f"{r['token_checksum']:>14}" for r in rows))
        if any(r.get("inputs_checksum") for r in rows):
            lines.append(f"{'inputs checksum':<24}" + "".join(f"{r.get('inputs_checksum', '-'):>14}" for r in rows))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, nargs="*", default=[64, 256], help="running sequences per decode step")
    parser.add_argument("--steps", type=int, default=200, help="decode steps measured per batch size")
    parser.add_argument("--prompt-len", type=int, default=500, help="prompt tokens (uniform in +-50)")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=1, help="measure each this many times, keep the fastest")
    parser.add_argument("--offline", action="store_true", help="also speed.py's offline workload (256 requests)")
    parser.add_argument("--offline-requests", type=int, default=256)
    parser.add_argument("--cprofile", action="store_true", help="print cProfile's top functions of the decode steps")
    parser.add_argument("--cprofile-lines", type=int, default=30)
    parser.add_argument("--against", metavar="DIR", help="also measure the engine of DIR/runtime, side by side")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "ember-host-profile"),
                        help="where the tiny model is built (and reused)")
    parser.add_argument("--model", help="a model directory to run for real (on the GPU where there is one: "
                                            "e.g. speed.py's --workdir model), without the stand-ins")
    parser.add_argument("--overlap", action="store_true",
                        help="EngineConfig(overlap=True): launch and collect in place of run (on a CPU the device's "
                             "stand-in runs at launch, so this shows the host's cost of overlapping, not its gain)")
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON line (for --against)")
    args = parser.parse_args()
    torch.set_num_threads(1)   # the host path is single-threaded; a second thread only adds noise here
    columns = {}
    if args.against:
        log(f"engine of {args.against}:")
        columns["against"] = against(args, args.against)
    log("engine of this checkout:" if not args.json else "engine:")
    rows = measure(args)
    if args.json:
        print(json.dumps(rows))
        return
    columns["this"] = rows
    print(table(columns))
    for name, rows in columns.items():
        for row in rows:
            if "cprofile" in row:
                print(f"\n== cProfile, {name}, {row['seqs']} sequences, {row['steps']} decode steps ==")
                print(row["cprofile"])


if __name__ == "__main__":
    main()
