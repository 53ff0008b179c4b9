"""The engine's numbers. Names follow vLLM's metrics where the meaning is the same (noted per field)."""
import bisect
from collections import Counter
from dataclasses import dataclass, field

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 10.0)
_STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...]                     # upper bounds; one more implicit +Inf bucket
    counts: list[int] = field(default_factory=list)  # per bucket (not cumulative), len(buckets) + 1
    sum: float = 0.0
    count: int = 0

    def __post_init__(self):
        self.counts = self.counts or [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def observe_since(self, now: float, times: list[float]) -> None:
        """Observe `now - t` for each of `times`: a step's inter-token latencies, most of them from the same
        previous step, so a bucket is looked up only where the time differs from the one before."""
        counts, buckets = self.counts, self.buckets
        last, i, value, total = None, 0, 0.0, 0.0
        for t in times:
            if t != last:
                last, value = t, now - t
                i = bisect.bisect_left(buckets, value)
            counts[i] += 1
            total += value
        self.sum += total
        self.count += len(times)

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations <= bound) pairs ending with +Inf, as Prometheus exposes them."""
        out, total = [], 0
        for bound, n in zip((*self.buckets, float("inf")), self.counts):
            total += n
            out.append((bound, total))
        return out


@dataclass
class EngineStats:
    # vllm:time_to_first_token_seconds
    time_to_first_token: Histogram = field(default_factory=lambda: Histogram(_LATENCY_BUCKETS))
    # vllm:inter_token_latency_seconds
    inter_token_latency: Histogram = field(default_factory=lambda: Histogram(_ITL_BUCKETS))
    # vllm:request_queue_time_seconds
    queue_time: Histogram = field(default_factory=lambda: Histogram(_LATENCY_BUCKETS))
    # vllm:e2e_request_latency_seconds
    e2e_request_latency: Histogram = field(default_factory=lambda: Histogram(_LATENCY_BUCKETS))
    # step() minus forward pass and sampling: schedule, inputs, postprocess
    step_host_time: Histogram = field(default_factory=lambda: Histogram(_STEP_BUCKETS))
    # whole step(), forward pass included
    step_time: Histogram = field(default_factory=lambda: Histogram(_STEP_BUCKETS))
    num_running: int = 0              # vllm:num_requests_running
    num_waiting: int = 0              # vllm:num_requests_waiting
    kv_cache_usage: float = 0.0       # vllm:kv_cache_usage_perc (a fraction, 1 = full)
    prefix_cache_queries: int = 0     # vllm:prefix_cache_queries (prompt tokens looked up)
    prefix_cache_hits: int = 0        # vllm:prefix_cache_hits (prompt tokens found)
    prompt_tokens: int = 0            # vllm:prompt_tokens_total
    generation_tokens: int = 0        # vllm:generation_tokens_total
    num_preemptions: int = 0          # vllm:num_preemptions_total
    request_success: Counter = field(default_factory=Counter)  # vllm:request_success_total{finished_reason}
    # Ember's own: forward passes by kind, "graph" (a decode step replayed from a CUDA graph), "piecewise" (a step
    # that prefilled, replayed from prefill_graphs.py's graphs with attention between them) or "eager" (prefills and
    # steps mixing them with decodes where no piecewise graph fits, decode batches without a graph), and their
    # device seconds (CUDA only)
    steps: dict[str, int] = field(default_factory=lambda: {"graph": 0, "piecewise": 0, "eager": 0})
    step_device_seconds: dict[str, float] = field(default_factory=lambda: {"graph": 0.0, "piecewise": 0.0,
                                                                           "eager": 0.0})
