"""The online part's load: streaming completions from client processes of their own, each timing its tokens.

bench/engine/speed.py ran a level's streams on threads of its own process. At the 0.6B shape's 13,000 output tok/s
one interpreter parsed every SSE event of 64 streams under one GIL; its threads read them in bursts, and more than
half the inter-token latencies it stamped were under 0.1 ms (the ITL p50 of the 0.6B rows at concurrency 32 and 64)
though the replica's steps were milliseconds apart. Here a level's streams are spread over up to CLIENT_PROCESSES
processes (this file run as a script), each with its threads and its own connections: they start, build their
clients, report ready, and stream only when every one of them is ready, so start-up stays out of the level's time.

    python bench/engine/load_client.py    # a worker: one JSON job on stdin, "ready", a line to start, JSON results
"""
from __future__ import annotations

import concurrent.futures
import json
import ssl
import subprocess
import sys
import time
from pathlib import Path

CLIENT_PROCESSES = 8


def _worker() -> None:
    import httpx

    job = json.loads(sys.stdin.readline())
    verify = ssl.create_default_context(cafile=job["cafile"]) if job["cafile"] else True
    with httpx.Client(base_url=job["url"], verify=verify, headers=job["headers"],
                      timeout=httpx.Timeout(30, read=300)) as http:
        def one(prompt: list[int]) -> tuple[float, list[float], int]:
            began = time.perf_counter()
            stamps = []
            body = {**job["body"], "prompt": prompt, "stream": True}
            with http.stream("POST", job["path"], json=body) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:])["choices"]:
                        stamps.append(time.perf_counter())
            return stamps[0] - began, [b - a for a, b in zip(stamps, stamps[1:])], len(stamps)

        print("ready", flush=True)
        sys.stdin.readline()
        with concurrent.futures.ThreadPoolExecutor(job["threads"]) as pool:
            results = list(pool.map(one, job["prompts"]))
    print(json.dumps(results), flush=True)


def stream(url: str, path: str, body: dict, prompts: list[list[int]], concurrency: int, headers: dict | None = None,
           cafile: str | None = None) -> tuple[list[tuple[float, list[float], int]], float]:
    """Stream `prompts` (POST `path` with `body` and each prompt, `stream: true`) with `concurrency` in flight, over
    min(concurrency, CLIENT_PROCESSES) processes; return each request's (TTFT s, inter-token gaps s, chunks) and the
    seconds from the start signal to the last stream's end."""
    processes = min(concurrency, CLIENT_PROCESSES, len(prompts))
    threads = [concurrency // processes + (i < concurrency % processes) for i in range(processes)]
    bounds = [round(len(prompts) * sum(threads[:i]) / concurrency) for i in range(processes + 1)]
    workers = [subprocess.Popen([sys.executable, str(Path(__file__).resolve())], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True) for _ in range(processes)]
    try:
        for i, worker in enumerate(workers):
            worker.stdin.write(json.dumps({"url": url, "path": path, "body": body, "headers": headers or {},
                                           "cafile": cafile, "threads": threads[i],
                                           "prompts": prompts[bounds[i]:bounds[i + 1]]}) + "\n")
            worker.stdin.flush()
        for worker in workers:
            if worker.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a load client process failed to start (exit {worker.wait()})")
        began = time.perf_counter()
        for worker in workers:
            worker.stdin.write("go\n")
            worker.stdin.flush()
        results = []
        for worker in workers:
            line = worker.stdout.readline()
            if not line:
                raise RuntimeError(f"a load client process failed mid-level (exit {worker.wait()}): see its stderr")
            results += [tuple(r) for r in json.loads(line)]
        return results, time.perf_counter() - began
    finally:
        for worker in workers:   # done: their results are read; failed: the level is over
            if worker.poll() is None:
                worker.kill()
            worker.wait()


if __name__ == "__main__":
    _worker()
