"""The engine's stats as Prometheus text, named as vLLM names them with `ember:` for `vllm:`."""

from ember.runtime.engine.stats import EngineStats, Histogram

PREFIX = "ember:"

# (metric name, EngineStats field, help)
HISTOGRAMS = [
    ("time_to_first_token_seconds", "time_to_first_token", "Time from arrival to the first output token."),
    ("inter_token_latency_seconds", "inter_token_latency", "Time between consecutive output tokens of a request."),
    ("request_queue_time_seconds", "queue_time", "Time a request waited before it was first scheduled."),
    ("e2e_request_latency_seconds", "e2e_request_latency", "Time from arrival to the last output token."),
    ("engine_step_host_time_seconds", "step_host_time", "Host (CPU) time of one engine step, forward pass excluded."),
    ("engine_step_time_seconds", "step_time", "Wall time of one engine step, forward pass included."),
]
GAUGES = [
    ("num_requests_running", "num_running", "Requests in the running batch."),
    ("num_requests_waiting", "num_waiting", "Requests waiting to be scheduled."),
    ("kv_cache_usage_perc", "kv_cache_usage", "Fraction of KV cache blocks in use (1 = full)."),
]
COUNTERS = [
    ("prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    ("prompt_tokens", "prompt_tokens", "Prompt tokens processed."),
    ("generation_tokens", "generation_tokens", "Tokens generated."),
    ("num_preemptions", "num_preemptions",
     "Sequences preempted: the KV cache ran out, or a request with none running took one's slot."),
]

KINDS = ("graph", "piecewise", "eager")   # of engine steps


def render(stats: EngineStats, model_name: str) -> str:
    """Prometheus text exposition (version 0.0.4) of one engine's stats."""
    label = f'model_name="{_escape(model_name)}"'
    lines = []
    for name, attr, help_text in GAUGES:
        lines += _header(name, "gauge", help_text)
        lines.append(f"{PREFIX}{name}{{{label}}} {_number(getattr(stats, attr))}")
    for name, attr, help_text in COUNTERS:
        lines += _header(name, "counter", help_text)
        lines.append(f"{PREFIX}{name}_total{{{label}}} {_number(getattr(stats, attr))}")
    lines += _header("request_success", "counter", "Finished requests, by finish reason.")
    for reason in ("stop", "length", "abort"):
        count = stats.request_success.get(reason, 0)
        lines.append(f'{PREFIX}request_success_total{{{label},finished_reason="{reason}"}} {count}')
    lines += _header("engine_steps", "counter", "Forward passes, by kind: graph (a decode step replayed from a CUDA "
                     "graph), piecewise (a step that prefilled, replayed from per-size graphs with attention between "
                     "them) or eager (prefills no piecewise graph fits, decode batches without a graph).")
    lines += [f'{PREFIX}engine_steps_total{{{label},kind="{kind}"}} {stats.steps[kind]}' for kind in KINDS]
    lines += _header("engine_step_device_seconds", "counter", "Device (GPU) seconds of the forward passes and "
                     "sampling, by kind of step; 0 on CPU.")
    lines += [f'{PREFIX}engine_step_device_seconds_total{{{label},kind="{kind}"}} '
              f'{_number(stats.step_device_seconds[kind])}' for kind in KINDS]
    for name, attr, help_text in HISTOGRAMS:
        lines += _header(name, "histogram", help_text)
        lines += _histogram(name, getattr(stats, attr), label)
    return "\n".join(lines) + "\n"


def _histogram(name: str, histogram: Histogram, label: str) -> list[str]:
    total = histogram.sum  # read before the buckets, which the engine thread may be bumping
    buckets = histogram.cumulative()
    lines = [f'{PREFIX}{name}_bucket{{{label},le="{_bound(bound)}"}} {count}' for bound, count in buckets]
    # _count taken from the +Inf bucket so the two always agree within one scrape.
    lines += [f"{PREFIX}{name}_sum{{{label}}} {_number(total)}", f"{PREFIX}{name}_count{{{label}}} {buckets[-1][1]}"]
    return lines


def _header(name: str, kind: str, help_text: str) -> list[str]:
    return [f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} {kind}"]


def _bound(value: float) -> str:
    return "+Inf" if value == float("inf") else repr(float(value))


def _number(value) -> str:
    return repr(float(value)) if isinstance(value, float) else str(int(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
