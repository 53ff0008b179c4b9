"""What holding replies to a JSON schema costs the engine on the GPU machine: the same requests decoded free and
held to the schema, side by side in one run.

    python bench/engine/structured.py                        # Qwen3-0.6B's shape; prints the numbers
    python bench/engine/structured.py --shapes 0.6B 8B --record   # also writes bench/results/structured.json

The model is a random-weight Qwen3 of each shape (bf16), with a byte-level BPE vocabulary of 151,643 tokens
trained here, in about a minute, on this Python installation's own text: a mask's cost grows with the vocabulary
(xgrammar sorts every token into those the format allows next), and the tiny tokenizer's thousand tokens would
hide it. Per shape:
  - compile: the schema's first compile (with the vocabulary's one-time preprocessing) and a second schema's;
  - masks: host milliseconds to write the masks of 16, 32 and 64 sequences held at different places of a reply,
    row after row (one matcher at a time) and together (xgrammar's batch matcher over MaskFiller's threads);
  - decode, --requests requests of 128-token prompts, sampled at temperature 1 (seeded):
      held        every request held to the schema; each reply's length is kept for the runs below;
      held-early  the same, as the engine ran them before: a step with a held row launched only once the step
                  before it was collected (no overlap scheduling), its masks written row after row before its
                  forward pass was queued; what writing them beside the device saves;
      free        the same requests with the same output lengths (ignore_eos), no format: the engine's own limit;
      mixed       all but --held requests free, --held held, the same lengths; its free requests lose overlap
                  scheduling while a held one shares their steps;
    each with output tok/s, steps, and per step the mean wall, device and host milliseconds (host: wall less the
    time the host waited for the device).
A random model writes whatever its weights favour: the replies are valid JSON because of the masks, which the run
checks. With --record, bench/results/structured.json.
"""
import argparse
import gc
import importlib.metadata
import json
import os
import random
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import jsonschema
import torch

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent / "results" / "structured.json"
VOCAB = 151643             # Qwen3's trained vocabulary; the model's embedding has 151936 rows
TEXT_SUFFIXES = {".py", ".md", ".rst", ".txt"}
SCHEMA = {"type": "object", "properties": {   # a typical extraction schema; every string bounded (see module doc)
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "email": {"type": "string", "maxLength": 60},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
    "address": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "country": {"enum": ["DE", "FR", "JP", "US"]},
    }, "required": ["city", "country"], "additionalProperties": False},
    "active": {"type": "boolean"},
}, "required": ["name", "age", "email", "tags", "address", "active"], "additionalProperties": False}
OTHER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"type": "number"}},
         "required": ["answer", "score"]}


def log(*args) -> None:
    print(*args, flush=True)


def corpus(limit_bytes: int):
    """This Python's own text files (its standard library and installed packages), up to `limit_bytes`."""
    seen = 0
    for root in dict.fromkeys([sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]]):
        for path in sorted(Path(root).rglob("*")):
            if path.suffix not in TEXT_SUFFIXES or not path.is_file():
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            seen += len(text)
            yield text
            if seen > limit_bytes:
                return


def train_large_tokenizer(directory: Path):
    """A byte-level BPE tokenizer of VOCAB tokens (plus the tiny tokenizer's special tokens and chat template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from ember.runtime.engine import tiny

    if (directory / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(directory)
    began = time.perf_counter()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=tiny.SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(120 << 20), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        additional_special_tokens=["<|im_start|>"], chat_template=tiny.CHAT_TEMPLATE,
                                        clean_up_tokenization_spaces=False)
    tokenizer.save_pretrained(directory)
    log(f"trained a {len(tokenizer)}-token BPE vocabulary in {time.perf_counter() - began:.0f} s")
    return tokenizer


def build_model(shape: str, directory: Path, tokenizer) -> None:
    import speed

    if not (directory / "config.json").is_file():
        speed.build_model(shape, directory, tokenizer)   # the model it returns is dropped here
        gc.collect()
        torch.cuda.empty_cache()


def compile_times(grammars, formats) -> dict:
    began = time.perf_counter()
    grammar = grammars.compile(formats.reply_format(formats.AnswerFormat("json_schema", SCHEMA), None, None))
    first = time.perf_counter() - began
    began = time.perf_counter()
    grammars.compile(formats.reply_format(formats.AnswerFormat("json_schema", OTHER), None, None))
    other = time.perf_counter() - began
    return {"grammar": grammar, "first_ms": round(1000 * first, 1), "second_schema_ms": round(1000 * other, 1)}


def mask_fill_times(grammar, vocab_size: int, rows: int) -> dict:
    """Milliseconds to write `rows` masks, one matcher after another and together (median of 20 of each)."""
    from ember.runtime.engine.grammar import MaskFiller, Matcher

    pick = random.Random(rows)
    matchers = []
    shifts = torch.arange(32, dtype=torch.int32)
    while len(matchers) < rows:   # each walked a random number of tokens into a reply
        matcher = Matcher(grammar)
        for _ in range(pick.randrange(1, 120)):
            allowed = ((matcher.allowed().unsqueeze(-1) >> shifts) & 1).view(-1).nonzero().flatten()
            if matcher.advance(int(allowed[pick.randrange(len(allowed))])):
                break
        if not matcher.ended:
            matchers.append(matcher)
    filler = MaskFiller(vocab_size, threaded_rows=2)   # always together
    alone, together = [], []
    for _ in range(20):
        began = time.perf_counter()
        for matcher in matchers:
            matcher.allowed()
        alone.append(time.perf_counter() - began)
        began = time.perf_counter()
        filler.fill(matchers)
        together.append(time.perf_counter() - began)
    return {"rows": rows, "one_by_one_ms": round(1000 * statistics.median(alone), 3),
            "together_ms": round(1000 * statistics.median(together), 3)}


def masks_before_launch(runner) -> None:
    """The engine as it was: a step with a held row launched only once the step before it was collected (no
    overlap), each held row's mask written, row after row, before the step's forward pass is queued."""
    from ember.runtime.engine import engine

    needs_host_tokens = engine._needs_host_tokens
    engine._needs_host_tokens = lambda seq: needs_host_tokens(seq) or seq.matcher is not None
    rows_of = runner._sampling_rows

    def early(seqs, eos_token_ids):
        rows = rows_of(seqs, eos_token_ids)
        for row in rows:
            if row.matcher is not None:
                row.allowed, row.matcher = row.matcher.allowed(), None
        return rows

    runner._sampling_rows = early


def decode_run(eng, prompts: list[list[int]], params: list) -> tuple[list[list[int]], dict]:
    """Generate; output tok/s and the per-step split of wall, device and host time."""
    import speed

    outputs, elapsed, runs = speed.generate_recorded(eng, prompts, params)
    tokens = sum(map(len, outputs))
    device = sum(r.gpu_seconds or 0.0 for r in runs)
    waited = sum(r.wait_seconds for r in runs)
    return outputs, {"output_tok_s": round(tokens / elapsed, 1), "output_tokens": tokens, "seconds": round(elapsed, 3),
                     "steps": len(runs), "wall_ms_per_step": round(1000 * elapsed / len(runs), 3),
                     "gpu_ms_per_step": round(1000 * device / len(runs), 3),
                     "host_ms_per_step": round(1000 * (elapsed - waited) / len(runs), 3)}


def measure(shape: str, args, workdir: Path, tokenizer) -> dict:
    import speed

    from ember.runtime.engine.grammar import FILL_THREADS, Grammars
    from ember.runtime.engine.sampling import SamplingParams
    from ember.runtime.engine.serving import formats

    model_dir = workdir / f"qwen3-{shape.lower()}-bpe151k"
    build_model(shape, model_dir, tokenizer)
    eng = speed.ember_engine(model_dir)   # EngineConfig's defaults: what a user gets
    while eng.capture_idle():   # an engine that has been up has captured its decode graphs
        pass
    grammars = Grammars(tokenizer, eng.runner.vocab_size, eng.eos_token_ids)
    compiled = compile_times(grammars, formats)
    grammar = compiled.pop("grammar")
    row: dict = {"name": f"Qwen3-{shape} shape (random weights)", "vocabulary": len(tokenizer),
                 "fill_threads": FILL_THREADS, "compile": compiled,
                 "masks": [mask_fill_times(grammar, eng.runner.vocab_size, n) for n in (16, 32, 64)]}
    log(f"[{shape}] compile {compiled}; masks {row['masks']}")
    n = args.requests
    prompts = speed.random_prompts(n, 128, 128, seed=1)
    held = [SamplingParams(temperature=1.0, seed=i, max_tokens=2048, grammar=grammar) for i in range(n)]
    # warm: every prompt in the prefix cache, as it is for each run after the first; the masks' first calls
    eng.generate(prompts, SamplingParams(temperature=0, max_tokens=1))
    eng.generate(prompts[:4], held[:4])
    outputs, row["held"] = decode_run(eng, prompts, held)
    for out in outputs:   # the masks held every reply: each parses and keeps to the schema
        jsonschema.validate(json.loads(tokenizer.decode(out, skip_special_tokens=True)), SCHEMA)
    lengths = [len(out) for out in outputs]
    free = [SamplingParams(temperature=1.0, seed=i, max_tokens=lengths[i], ignore_eos=True) for i in range(n)]
    _, row["free"] = decode_run(eng, prompts, free)
    mixed = free[:n - args.held] + held[n - args.held:]
    _, row["mixed"] = decode_run(eng, prompts, mixed)
    masks_before_launch(eng.runner)
    _, row["held_early"] = decode_run(eng, prompts, held)
    row["mixed"]["held"] = args.held
    row["mean_reply_tokens"] = round(statistics.mean(lengths), 1)
    for part in ("held", "held_early", "free", "mixed"):
        log(f"[{shape}] {part}: {row[part]}")
    eng.runner.close()
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["0.6B"], choices=["0.6B", "4B", "8B"])
    parser.add_argument("--requests", type=int, default=64, help="requests per decode run (default 64)")
    parser.add_argument("--held", type=int, default=16, help="held requests among the mixed run's (default 16)")
    parser.add_argument("--workdir", default=None, help="the tokenizer and models (reused when present)")
    parser.add_argument("--record", action="store_true", help=f"write {RESULTS.relative_to(HERE.parent.parent)}")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("this measures decode steps on a CUDA GPU; run it on the GPU machine")
    if not 0 < args.held < args.requests:
        parser.error(f"--held {args.held}: give a number between 1 and --requests - 1 ({args.requests - 1})")
    sys.path.insert(0, str(HERE))
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="ember-structured-"))
    tokenizer = train_large_tokenizer(workdir / "tokenizer")
    result = {"machine": f"{torch.cuda.get_device_name()}, {os.cpu_count()} CPU cores", "torch": torch.__version__,
              "xgrammar": importlib.metadata.version("xgrammar"), "schema": SCHEMA, "requests": args.requests,
              "models": [measure(shape, args, workdir, tokenizer) for shape in args.shapes]}
    if args.record:
        RESULTS.write_text(json.dumps(result, indent=1) + "\n")
        log(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
