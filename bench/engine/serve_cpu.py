"""The replica's host CPU per streamed token on its serving side: AsyncLLM's outputs to bytes on the socket.

    python bench/engine/serve_cpu.py                               # concurrency 16 and 64, this checkout
    python bench/engine/serve_cpu.py --against /work/main          # also the runtime of another checkout, alternated
    python bench/engine/serve_cpu.py --cpu-engine                  # the real engine on the CPU in place of the pace
    python bench/engine/serve_cpu.py --against . --against-http h11   # this checkout's HTTP stack against h11
    python bench/engine/serve_cpu.py --concurrency 64 --rounds 3 --record

The OpenAI app of runtime/engine/api.py is served by uvicorn in a process of its own, configured as
runtime/worker.py serves a replica, with the tokenizer of the tiny model of runtime/engine/tiny.py. Its AsyncLLM
runs a stand-in engine: a step sleeps --step-ms (a GPU's decode step, in which the GIL is free) and then gives each
running request its next token, in turn from real text, so the detokenizer has real work; with --cpu-engine it runs
the real LLMEngine over the tiny model on the CPU (one torch thread), whose forward passes hold the machine's
second core and make the main thread's numbers noisier. This process is the client: N keep-alive connections each
stream speed.py's online request (256 prompt token ids, 128 output tokens, `stream: true`) one after another. The
server's CPU seconds come from /proc, split into its main thread (the event loop: HTTP, the OpenAI handlers,
detokenizing, SSE framing, the socket sends: what this bench is for) and the rest (the engine loop thread).

--against DIR serves a second app whose `ember.runtime` is DIR/runtime (e.g. /work/main, or
`git archive BASE runtime | tar -x -C DIR`), and runs the levels on the two servers in turn, round by round, so
that both see the same machine. Each row is the round of least main-thread CPU per token: this machine's other
work only ever adds to it. --against-http h11 has the second server parse HTTP with h11 whatever is installed (a
replica's uvicorn picks httptools where it is, as Ember's dependencies install it). With --record the rows go to
bench/results/serve_cpu.json (serve_cpu_http.json with --against-http h11).
"""
import argparse
import asyncio
import gc
import importlib.util
import json
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "serve_cpu.json"
MODEL = "tiny"
PROMPT_TOKENS, OUTPUT_TOKENS = 256, 128
SERVER_CPU = 1   # the servers run on this core and the client on the others: less noise from moving between cores
# what uvicorn's "auto" picks, as for a replica: uvloop and httptools where installed, else asyncio's loop and h11
HTTP_STACK = " + ".join(("uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
                         "httptools" if importlib.util.find_spec("httptools") else "h11"))


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


class PacedEngine:
    """Stands in for LLMEngine, for AsyncLLM: each step sleeps `step_seconds`, then gives every running request its
    next token, taken in turn from the tiny model's corpus (a request starts at its own place in it)."""

    def __init__(self, tokenizer, step_seconds: float) -> None:
        from ember.runtime.engine.tiny import CORPUS

        self.model_name, self.max_model_len = MODEL, 1024
        # what the OpenAI server reads of an engine besides its steps (the vocabulary for structured outputs)
        self.runner = types.SimpleNamespace(vocab_size=len(tokenizer), device=types.SimpleNamespace(type="cpu"))
        self.eos_token_ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        self.step_seconds = step_seconds
        self.text = tokenizer.encode(CORPUS)
        self.running: dict[str, list[int]] = {}   # request id -> [prompt tokens, where in the text, tokens left]
        self.added = 0

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)

    def add_request(self, request_id, prompt_token_ids, params, trace_context=None, group=None) -> None:
        self.running[request_id] = [len(prompt_token_ids), 37 * self.added, params.max_tokens]
        self.added += 1

    def abort_request(self, request_id, reason="abort") -> None:
        self.running.pop(request_id, None)

    def step(self) -> list:
        from ember.runtime.engine.engine import RequestOutput

        time.sleep(self.step_seconds)
        outputs = []
        for request_id, state in list(self.running.items()):
            prompt_tokens, at, left = state
            state[1:] = at + 1, left - 1
            if left == 1:
                del self.running[request_id]
            outputs.append(RequestOutput(request_id, [self.text[at % len(self.text)]], None, left == 1,
                                         "length" if left == 1 else None, prompt_tokens, 0))
        return outputs


def serve(model_dir: str, step_ms: float, http: str = "auto") -> None:
    """Run the app on a free loopback port until killed (over the real engine where `step_ms` is 0); prints the
    port once it listens."""
    import torch
    import uvicorn
    from transformers import AutoTokenizer

    from ember.runtime.engine.api import create_app
    from ember.runtime.engine.async_engine import AsyncLLM
    from ember.runtime.engine.config import EngineConfig

    torch.set_num_threads(1)
    os.sched_setaffinity(0, {SERVER_CPU})
    if step_ms:
        llm = AsyncLLM(PacedEngine(AutoTokenizer.from_pretrained(model_dir), step_ms / 1000),
                       AutoTokenizer.from_pretrained(model_dir))
        app = create_app(llm, served_model_name=MODEL)
    else:
        app = create_app(EngineConfig(model=model_dir, max_model_len=1024, max_num_seqs=256), served_model_name=MODEL)
    gc.freeze()   # as a replica's worker does once it has started (runtime/heap.py); the --against runtime may not
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)   # connections wait in its backlog until uvicorn accepts them
    print(sock.getsockname()[1], flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="auto", http=http)).run(sockets=[sock])


def start_server(model_dir: Path, runtime: Path, step_ms: float, http: str = "auto") -> tuple[subprocess.Popen, int]:
    """A server process whose `ember.runtime` is `runtime` (a checkout's runtime/ folder), parsing HTTP with `http`
    (uvicorn's choice)."""
    code = (f"import sys, ember.runtime; ember.runtime.__path__[:] = [{str(runtime)!r}]; "
            f"sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            f"import serve_cpu; serve_cpu.serve({str(model_dir)!r}, {step_ms!r}, {http!r})")
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                               env=os.environ | {"TOKENIZERS_PARALLELISM": "false"})
    port = process.stdout.readline().strip()
    if not port:
        raise RuntimeError(f"the server of {runtime} exited with {process.wait()} before listening")
    return process, int(port)


def thread_cpu(pid: int) -> tuple[float, float]:
    """CPU seconds so far of `pid`'s main thread and of its other threads (schedstat's nanoseconds on the CPU: /stat
    counts in ticks of 10 ms)."""
    main = other = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            seconds = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0]) / 1e9
        except OSError:
            continue   # a thread that ended just now
        if int(tid) == pid:
            main += seconds
        else:
            other += seconds
    return main, other


async def stream_one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, prompt: list[int]) -> int:
    """One streaming completion on a keep-alive connection; returns how many SSE events carried choices."""
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": OUTPUT_TOKENS, "ignore_eos": True,
                       "temperature": 0, "stream": True}).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%s" % (len(body), body))
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"the server answered {head[:200]!r}")
    parts = []
    while size := int((await reader.readuntil(b"\r\n"))[:-2], 16):   # chunked transfer encoding, to its 0 chunk
        parts.append((await reader.readexactly(size + 2))[:-2])
    await reader.readexactly(2)
    events = b"".join(parts).decode().split("\n\n")
    if events[-2:] != ["data: [DONE]", ""]:
        raise RuntimeError(f"the stream did not end in [DONE]: {events[-3:]!r}")
    chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-2]]
    if chunks[-1]["choices"][0]["finish_reason"] != "length":
        raise RuntimeError(f"the stream ended without its {OUTPUT_TOKENS} tokens: {chunks[-1]!r}")
    return sum(1 for chunk in chunks if chunk["choices"])


async def load(port: int, concurrency: int, prompts: list[list[int]]) -> int:
    """`concurrency` connections stream `prompts` between them; returns the SSE events they got."""
    queue = list(reversed(prompts))

    async def connection() -> int:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        events = 0
        try:
            while queue:
                events += await stream_one(reader, writer, queue.pop())
        finally:
            writer.close()
        return events

    return sum(await asyncio.gather(*(connection() for _ in range(concurrency))))


def measure(server: subprocess.Popen, port: int, concurrency: int, requests: int, seed: int) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 1000) for _ in range(PROMPT_TOKENS)] for _ in range(requests)]
    main_before, other_before = thread_cpu(server.pid)
    began = time.perf_counter()
    events = asyncio.run(load(port, concurrency, prompts))
    elapsed = time.perf_counter() - began
    main_after, other_after = thread_cpu(server.pid)
    tokens = requests * OUTPUT_TOKENS
    return {"concurrency": concurrency, "requests": requests, "output_tok_s": round(tokens / elapsed),
            "events_per_token": round(events / tokens, 3),
            "main_us_per_token": round(1e6 * (main_after - main_before) / tokens, 1),
            "main_us_per_event": round(1e6 * (main_after - main_before) / events, 1),
            "other_us_per_token": round(1e6 * (other_after - other_before) / tokens, 1)}


def commit(checkout: Path) -> str:
    """`checkout`'s commit, with a + where its runtime/ differs from it."""
    def git(*args):
        return subprocess.run(["git", "-C", str(checkout), *args], capture_output=True, text=True).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + ("+" if git("status", "--porcelain", "runtime") else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--requests", type=int, default=4, help="requests per connection at each level")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each level on each server; the least is kept")
    parser.add_argument("--step-ms", type=float, default=5.0, help="the stand-in engine's step (ms)")
    parser.add_argument("--cpu-engine", action="store_true", help="the real engine over the tiny model on the CPU")
    parser.add_argument("--against", metavar="DIR", help="also serve the runtime of DIR/runtime, in turn with this")
    parser.add_argument("--against-http", choices=["auto", "h11"], default="auto",
                        help="the --against server's HTTP parser (auto: as this one's)")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "ember-serve-cpu"),
                        help="where the tiny model is built (and reused)")
    parser.add_argument("--record", action="store_true", help=f"write the rows to {RESULTS.relative_to(ROOT)}")
    args = parser.parse_args()

    from ember.runtime.engine.tiny import build_tiny_model

    model_dir = build_tiny_model(Path(args.workdir) / "qwen3")
    os.sched_setaffinity(0, set(range(os.cpu_count() or 1)) - {SERVER_CPU} or {SERVER_CPU})
    runtimes = {"this": ROOT / "runtime"} | ({"against": Path(args.against) / "runtime"} if args.against else {})
    step_ms = 0 if args.cpu_engine else args.step_ms
    http = {"this": "auto", "against": args.against_http}
    servers = {name: start_server(model_dir, runtime, step_ms, http[name]) for name, runtime in runtimes.items()}
    best: dict[tuple[str, int], dict] = {}
    try:
        for server, port in servers.values():   # the first requests load what the first step needs
            measure(server, port, 4, 4, seed=0)
        for round_ in range(args.rounds):
            for concurrency in args.concurrency:
                for name, (server, port) in servers.items():
                    row = measure(server, port, concurrency, concurrency * args.requests, seed=round_ + 1)
                    log(f"round {round_ + 1} {name:7}", row)
                    kept = best.get((name, concurrency))
                    if kept is None or row["main_us_per_token"] < kept["main_us_per_token"]:
                        best[name, concurrency] = row
    finally:
        for server, _ in servers.values():
            server.kill()
            server.wait()
    log(f"uvicorn serves with {HTTP_STACK}")
    columns = ["concurrency", "output_tok_s", "events_per_token", "main_us_per_token", "main_us_per_event",
               "other_us_per_token"]
    print(f"{'server':8}" + "".join(f"{c:>20}" for c in columns))
    for (name, _), row in sorted(best.items(), key=lambda item: (item[0][1], item[0][0] != "against")):
        print(f"{name:8}" + "".join(f"{row[c]:>20}" for c in columns))
    if args.record:
        result = {"machine": f"{platform.node()}: {os.cpu_count()} CPUs, {platform.machine()}",
                  "engine": "tiny on the CPU" if args.cpu_engine else f"paced, {args.step_ms} ms a step",
                  "http": HTTP_STACK, "against_http": args.against_http if args.against else None,
                  "this": commit(ROOT), "against": args.against and commit(Path(args.against)),
                  "rounds": args.rounds,
                  "rows": [{"server": name, **row} for (name, _), row in best.items()]}
        path = RESULTS.with_name("serve_cpu_http.json") if args.against and args.against_http == "h11" else RESULTS
        path.write_text(json.dumps(result, indent=1) + "\n")
        log(f"wrote {path}")


if __name__ == "__main__":
    main()
