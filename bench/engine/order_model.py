"""A model, not a measurement: how much a decode step's streamed attention loses to the order its programs start in.

    python bench/engine/order_model.py [--saturating 100 200] [--slots 528] [--seed 0]

paged_decode.StreamedDecode runs one program per (sequence piece, KV head); the GPU starts them in launch order as
earlier ones end, `slots` at a time (four programs of 4 warps on each of an H200's 132 multiprocessors). Here each
program's work is its piece's tokens (plus a few tokens' worth for its start), and the programs running share the
bandwidth once fewer than `saturating` of them run: each then goes at most at the rate that many would each get,
so a step's last few programs run alone at well under the GPU's bandwidth. The steps are an offline run's (prompts
uniform in [100, 1,024], seeded, plus the tokens every sequence has made), the plan paged_decode's (a chunk of
about the step's tokens over the pool, streamed_pool's). For each batch it prints the step's time in batch order
and longest first (paged_decode.LONGEST_FIRST) over the time its work would take at the full bandwidth. How many
programs it takes to reach the bandwidth is the model's guess (the FP8 kernel keeps two 16 KB tiles in flight a
program); `kernel_bench.py --parts attention_order` times the kernel itself.
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

START_TOKENS = 8.0   # a program's start (its q, its table, the pipeline's first tiles) in tokens of work
KV_HEADS = 8


def pieces(contexts: np.ndarray, pool: int, tile: int = 64) -> tuple[list[int], list[int]]:
    """Each sequence's first piece and the pool's later pieces, as StreamedDecode.stage_meta cuts them."""
    chunk = max(tile, -(-int(contexts.sum()) // (pool * tile)) * tile)
    firsts, later = [], []
    for n in contexts.tolist():
        firsts.append(min(n, chunk))
        later += [min(chunk, n - i * chunk) for i in range(1, -(-n // chunk))]
    return firsts, later


def programs(firsts: list[int], later: list[int], order) -> list[float]:
    """Each program's work in launch order: the pool's later pieces first, then the first pieces in `order`, a
    sequence's KV heads side by side."""
    return ([n + START_TOKENS for n in later for _ in range(KV_HEADS)]
            + [firsts[i] + START_TOKENS for i in order for _ in range(KV_HEADS)])


def step_time(work: list[float], slots: int, saturating: int) -> float:
    """Programs started in order as slots free; each running one progresses at min(1, saturating / running)."""
    pending, running, now = list(reversed(work)), [], 0.0
    while pending and len(running) < slots:
        running.append(pending.pop())
    while running:
        rate = min(1.0, saturating / len(running))
        least = min(running)
        now += least / rate
        running = [w - least for w in running if w - least > 1e-9]
        while pending and len(running) < slots:
            running.append(pending.pop())
    return now


def main() -> None:
    from ember.runtime.engine.paged_decode import streamed_pool

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--saturating", nargs="+", type=int, default=[100, 200],
                        help="programs running at once that reach the bandwidth")
    parser.add_argument("--slots", type=int, default=528, help="programs running at most (4 on each of 132 SMs)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    steps = {batch: [rng.integers(100, 1025, batch) + made for made in (50, 200, 400, 700, 900)]
             for batch in (256, 192, 160, 129, 96, 64, 33)}
    for saturating in args.saturating:
        print(f"{saturating} programs reach the bandwidth: step time over its work's at the bandwidth, mean of "
              f"{len(steps[256])} steps")
        for batch, contexts_list in steps.items():
            ratios = []
            for contexts in contexts_list:
                firsts, later = pieces(contexts, streamed_pool(batch, KV_HEADS, args.slots // 4))

                longest = sorted(range(batch), key=lambda i: (-firsts[i], i))
                in_batch_order, in_longest_order = (programs(firsts, later, order) for order in (range(batch), longest))
                ideal = sum(in_batch_order) / saturating
                ratios.append((step_time(in_batch_order, args.slots, saturating) / ideal,
                               step_time(in_longest_order, args.slots, saturating) / ideal))
            batch_order, longest_first = np.mean(ratios, axis=0)
            print(f"  {batch:3d} sequences: batch order {batch_order:.3f}, longest first {longest_first:.3f}")


if __name__ == "__main__":
    main()
