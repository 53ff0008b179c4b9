"""Offline throughput of the engine, flashinfer against SDPA attention, side by side in one run.

    python bench/engine_throughput.py                      # on the GPU machine
    python bench/engine_throughput.py --requests 8 --output-len 8 --layers 2 --device cpu   # a dry run anywhere

A random-weight Llama (hidden 2048, 16 heads of 128, 4 KV heads, MLP 5632, vocab 32000) is saved as a
Hugging Face directory; every request has a random prompt of 128-512 tokens and generates exactly
--output-len tokens. Prints a table; with --record writes bench/results/engine_throughput.json.
"""
import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ember.runtime.engine.config import EngineConfig
from ember.runtime.engine.engine import LLMEngine
from ember.runtime.engine.sampling import SamplingParams

RESULTS = Path(__file__).parent / "results"


def machine(device: str) -> str:
    cpu = f"{platform.machine()}, {torch.get_num_threads()} torch threads"
    if device == "cuda":
        return f"{torch.cuda.get_device_name()} ({cpu}), torch {torch.__version__}"
    return f"CPU ({cpu}), torch {torch.__version__}"


def run(model_dir: str, backend: str, device: str, prompts: list[list[int]], output_len: int) -> dict:
    dtype = "bfloat16" if device == "cuda" else "float32"
    eng = LLMEngine(EngineConfig(model=model_dir, device=device, dtype=dtype, attention_backend=backend,
                                 num_kv_blocks=4096, max_num_seqs=256, max_num_batched_tokens=8192,
                                 max_model_len=1024))
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    eng.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))   # warm-up
    eng.observer.stats = type(eng.stats)()
    start = time.perf_counter()
    eng.generate(prompts, params)
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    s = eng.stats
    prompt_tokens = sum(map(len, prompts))
    return {
        "backend": backend, "seconds": round(elapsed, 3),
        "output_tok_per_s": round(len(prompts) * output_len / elapsed, 1),
        "total_tok_per_s": round((prompt_tokens + len(prompts) * output_len) / elapsed, 1),
        "steps": s.step_time.count,
        "mean_step_ms": round(1000 * s.step_time.sum / s.step_time.count, 2),
        "mean_step_host_ms": round(1000 * s.step_host_time.sum / s.step_host_time.count, 2),
        "mean_ttft_s": round(s.time_to_first_token.sum / s.time_to_first_token.count, 3),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--record", action="store_true", help="write bench/results/engine_throughput.json")
    args = ap.parse_args()
    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=args.layers,
                         num_attention_heads=16, num_key_value_heads=4, head_dim=128, vocab_size=32000,
                         max_position_embeddings=4096)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 32000, (int(torch.randint(128, 513, (1,), generator=g)),), generator=g).tolist()
               for _ in range(args.requests)]
    backends = ["flashinfer", "sdpa"] if args.device == "cuda" else ["sdpa"]
    rows = []
    with tempfile.TemporaryDirectory() as model_dir:
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(model_dir)
        for backend in backends:
            rows.append(run(model_dir, backend, args.device, prompts, args.output_len))
            print(rows[-1], flush=True)
    result = {"machine": machine(args.device), "model": "random Llama, hidden 2048, "
              f"{args.layers} layers, 16x128 heads, 4 KV heads, vocab 32000",
              "requests": args.requests, "prompt_tokens": sum(map(len, prompts)), "output_len": args.output_len,
              "runs": rows}
    if args.record:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "engine_throughput.json").write_text(json.dumps(result, indent=2) + "\n")
    header = ["backend", "seconds", "output_tok_per_s", "total_tok_per_s", "steps", "mean_step_ms",
              "mean_step_host_ms", "mean_ttft_s"]
    print(f"\n{result['machine']}; {result['model']}; {args.requests} requests, "
          f"{result['prompt_tokens']} prompt tokens, {args.output_len} output tokens each")
    print(" | ".join(header))
    for r in rows:
        print(" | ".join(str(r[h]) for h in header))


if __name__ == "__main__":
    main()
