"""What the engine's steps did, read after each one: the stats behind /metrics and each request's trace spans.

The engine schedules, runs and postprocesses; this observer reads each step's record (the batch, the runner's
timings, the outputs) and keeps the request timestamps and trace contexts that the step loop has no use for.
"""
import time
from dataclasses import dataclass, field

from ember.runtime import tracing

from .model_runner import RunOutput
from .scheduler import ScheduledBatch, Scheduler
from .sequence import Sequence
from .stats import EngineStats


@dataclass
class StepRecord:
    batch: ScheduledBatch
    run: RunOutput | None          # None when nothing was scheduled (a step that only reports aborts)
    outputs: list                  # the step's RequestOutputs
    started: float                 # time.monotonic() when the step began
    seconds: float                 # the step's wall time


@dataclass
class _Timeline:
    seq: Sequence
    trace_context: object | None   # the caller's OpenTelemetry context, when tracing is on
    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    preempted_at: list[float] = field(default_factory=list)


class EngineObserver:
    def __init__(self, scheduler: Scheduler, model_name: str):
        self.scheduler, self.model_name = scheduler, model_name
        self.stats = EngineStats()
        self.requests: dict[str, _Timeline] = {}

    def added(self, seq: Sequence, trace_context=None) -> None:
        self.requests[seq.request_id] = _Timeline(seq, trace_context)

    def stepped(self, step: StepRecord) -> None:
        s, now = self.stats, time.monotonic()
        for seq in step.batch.admitted:   # a request is first scheduled when first admitted
            timeline = self.requests.get(seq.request_id)
            if timeline is not None and timeline.first_scheduled is None:
                timeline.first_scheduled = step.started
                s.queue_time.observe(step.started - timeline.arrival)
                s.prefix_cache_queries += seq.num_prompt_tokens
                s.prefix_cache_hits += seq.num_cached_tokens
                s.prompt_tokens += seq.num_prompt_tokens
        s.num_preemptions += len(step.batch.preempted)
        for seq in step.batch.preempted:
            if seq.request_id in self.requests:
                self.requests[seq.request_id].preempted_at.append(now)
        # per request per step: the inter-token latencies go into their histogram in one call
        requests, gaps, tokens = self.requests, [], 0
        for out in step.outputs:
            timeline = requests.get(out.request_id)
            if timeline is None:
                continue
            if out.new_token_ids:
                tokens += len(out.new_token_ids)
                if timeline.last_token is None:
                    timeline.first_token = now
                    s.time_to_first_token.observe(now - timeline.arrival)
                else:
                    gaps.append(timeline.last_token)
                timeline.last_token = now
            if out.finished:
                self._finished(timeline, out.finish_reason, now)
        s.generation_tokens += tokens
        s.inter_token_latency.observe_since(now, gaps)
        s.num_running = len(self.scheduler.running)
        s.num_waiting = len(self.scheduler.waiting)
        s.kv_cache_usage = self.scheduler.block_manager.usage
        if (run := step.run) is not None:
            if run.graph_batch_size is not None:
                kind = "graph"
            elif run.prefill_graph_size is not None:
                kind = "piecewise"
            else:
                kind = "eager"
            s.steps[kind] += 1
            if run.gpu_seconds is not None:
                s.step_device_seconds[kind] += run.gpu_seconds
        s.step_time.observe(step.seconds)
        s.step_host_time.observe(step.seconds - (step.run.wait_seconds if step.run else 0.0))

    def _finished(self, timeline: _Timeline, reason: str, now: float) -> None:
        del self.requests[timeline.seq.request_id]
        self.stats.request_success[reason] += 1
        if reason != "abort":
            self.stats.e2e_request_latency.observe(now - timeline.arrival)
        if timeline.trace_context is not None:
            self._trace(timeline, now)

    def _trace(self, timeline: _Timeline, finished: float) -> None:
        """The request's `llm.request` span under its caller's context, with `llm.queued`, `llm.prefill` and
        `llm.decode` children built from its timestamps and one event per preemption. Forward passes are batched
        across requests, so a span per pass would be shared by every trace in the batch: per-request spans from
        timestamps (as vLLM's request spans) say where this request's time went."""
        from opentelemetry import trace

        offset = time.time_ns() - time.monotonic_ns()

        def ns(t: float) -> int:
            return int(t * 1e9) + offset

        seq = timeline.seq
        tracer = tracing.tracer()
        span = tracer.start_span("llm.request", timeline.trace_context, start_time=ns(timeline.arrival))
        if not span.is_recording():  # the caller's trace was sampled out
            return
        p, scheduled = seq.params, timeline.first_scheduled or finished
        attributes = {
            "gen_ai.request.id": seq.request_id,
            "gen_ai.request.model": self.model_name, "gen_ai.response.model": self.model_name,
            "gen_ai.request.max_tokens": p.max_tokens, "gen_ai.request.temperature": p.temperature,
            "gen_ai.request.top_p": p.top_p, "gen_ai.usage.input_tokens": seq.num_prompt_tokens,
            "gen_ai.usage.output_tokens": seq.num_output_tokens,
            "gen_ai.usage.cache_read.input_tokens": seq.num_cached_tokens,
            "gen_ai.response.finish_reasons": [seq.finish_reason or "abort"],
            "gen_ai.latency.time_in_queue": scheduled - timeline.arrival,
            "gen_ai.latency.e2e": finished - timeline.arrival, "ember.preemptions": seq.num_preemptions}
        if timeline.first_token is not None:
            attributes["gen_ai.latency.time_to_first_token"] = timeline.first_token - timeline.arrival
        span.set_attributes(attributes)
        inside = trace.set_span_in_context(span)
        tracer.start_span("llm.queued", inside, start_time=ns(timeline.arrival)).end(ns(scheduled))
        if timeline.first_token is not None:
            tracer.start_span("llm.prefill", inside, start_time=ns(scheduled)).end(ns(timeline.first_token))
            tracer.start_span("llm.decode", inside, start_time=ns(timeline.first_token)).end(ns(finished))
        for t in timeline.preempted_at:
            span.add_event("llm.preempted", timestamp=ns(t))
        span.end(ns(finished))
