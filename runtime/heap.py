"""The collector's share of a serving process.

A replica or a gateway starts by building a large heap that lives as long as the process (modules, the model's
Python objects, the app and its routes: ~250,000 tracked objects with torch and transformers imported) and then
serves a stream of short-lived ones (a request's state, a token's chunk). Python's collector walks the whole heap
in each full collection, and the steady stream of requests sets one off every so often: a pause of ~140 ms on a
2-core CI machine (250,000 objects) in which neither the event loop nor the engine loop's thread runs, so every
stream of the replica stalls at once. Measured with bench/engine/serve_cpu.py's server (49,000 streamed tokens at
concurrency 16): 0.196 s of collections in the event loop's thread (4.0 us a token, one full collection of them
0.17 s) against 0.018 s with the heap frozen.

`settle()` once the process has started moves every object alive then out of the collector's reach
(`gc.freeze`): full collections then walk only what the process made since, which costs no time at the start (a
`gc.collect()` first would: the same ~140 ms, on the cold start's path). What the start left as garbage in a
reference cycle since the last full collection stays in memory for good: bounded, and once a process.
"""
import gc


def settle() -> None:
    """Leave every object alive now out of every later collection (they are never freed: call it once the process
    holds what it keeps for its life, before it serves)."""
    gc.freeze()

