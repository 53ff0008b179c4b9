"""LLMEngine: add requests, then step() = schedule, run, postprocess until every request has finished."""
import itertools
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from ember.runtime import tracing

from . import kernels
from .block_manager import BlockManager
from .config import EngineConfig
from .gpu_memory import ParkReport, WakeReport
from .model_runner import ModelRunner
from .sampling import SamplingParams
from .scheduler import ScheduledBatch, Scheduler
from .sequence import Sequence, SequenceStatus
from .stats import EngineStats

logger = logging.getLogger(__name__)


@dataclass
class RequestOutput:                   # what one engine step produced for one request
    request_id: str
    new_token_ids: list[int]           # usually 0 or 1 tokens
    new_logprobs: list[dict] | None    # per new token: {"token_id", "logprob", "top": [(token_id, logprob), ...]}
    finished: bool
    finish_reason: str | None          # "stop" (EOS or stop token), "length" (max_tokens or context), "abort"
    num_prompt_tokens: int
    num_cached_tokens: int             # prompt tokens served from the prefix cache


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.runner = ModelRunner(config)
        self.max_model_len = self.runner.max_model_len
        self.model_name = Path(config.model).name
        self.eos_token_ids = _eos_token_ids(config.model, self.runner.hf_config)
        self.block_manager = BlockManager(self.runner.num_request_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.stats = EngineStats()
        self.seqs: dict[str, Sequence] = {}
        self._aborted: list[RequestOutput] = []
        self._ids = itertools.count()
        self.warmup()

    def warmup(self) -> None:
        """One prefill and a few decode steps, greedy and sampled, before the first request: whatever the kernels
        need the first time (flashinfer's modules, compiled when the node has none, cuBLAS handles) happens here,
        and new modules are kept for the next start (kernels.py). Leaves no trace in the cache or the stats."""
        prompt = [0] * max(min(self.config.block_size + 1, self.max_model_len - 4), 2)
        for i, params in enumerate((SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                                    SamplingParams(max_tokens=3, temperature=1.0, top_p=0.9, top_k=20, seed=0,
                                                   ignore_eos=True))):
            self.add_request(f"warmup-{i}", prompt[:len(prompt) - i], params)
        while self.has_unfinished_requests():
            self.step()
        self.block_manager.forget_cached()
        self.stats = EngineStats()
        if self.runner.device.type == "cuda":
            kernels.keep(self.runner.store)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    trace_context=None) -> None:
        """`trace_context`: the caller's OpenTelemetry context; when set, the request ends with an `llm.request` span."""
        if request_id in self.seqs:
            raise ValueError(f"request_id {request_id!r} is already running: use a unique id per request")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty: pass at least one token")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens but max_model_len is "
                             f"{self.max_model_len}: shorten the prompt below {self.max_model_len} tokens")
        vocab = self.runner.vocab_size
        if not all(0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab}): check the tokenizer matches the model")
        params.validate(vocab)
        generator = self.runner.make_generator(params.seed) if params.seed is not None else None
        seq = Sequence(request_id, prompt_token_ids, params, generator)
        seq.trace_context = trace_context
        self.seqs[request_id] = seq
        self.scheduler.add(seq)
        if self.config.log_token_ids:
            logger.info("request %s prompt_token_ids=%s", request_id, prompt_token_ids)

    def abort_request(self, request_id: str, reason: str = "abort") -> None:
        """Ends a request early and frees its blocks. `reason="stop"` is the API layer matching a stop string."""
        seq = self.seqs.pop(request_id, None)
        if seq is None or seq.status is SequenceStatus.FINISHED:
            return
        self.scheduler.finish(seq, reason)
        self.stats.request_success[reason] += 1
        if reason != "abort":
            self.stats.e2e_request_latency.observe(time.monotonic() - seq.arrival_time)
        self._aborted.append(self._output(seq, [], None))
        if seq.trace_context is not None:
            self._trace(seq, time.monotonic())

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted)

    @property
    def parked(self) -> bool:
        return self.runner.arena.parked

    def park(self) -> ParkReport:
        """Releases the GPU memory of the weights and the KV cache while keeping their addresses, so CUDA graphs and
        kernel workspaces stay valid; the weights wait in pinned host memory. Only an idle engine parks: the KV
        cache's contents are discarded, and with them every cached prefix."""
        if self.has_unfinished_requests():
            raise RuntimeError("cannot park an engine with requests in flight: let them finish or abort them first")
        self.block_manager.forget_cached()
        return self.runner.park()

    def wake(self) -> WakeReport:
        """Maps the memory back at the same addresses and copies the weights in; a no-op when not parked."""
        return self.runner.wake()

    def step(self) -> list[RequestOutput]:
        if self.parked:  # a request reached a parked engine: serve it rather than fault on unmapped memory
            self.wake()
        start = time.perf_counter()
        scheduled = time.monotonic()
        outputs, self._aborted = self._aborted, []
        batch = self.scheduler.schedule()
        forward = 0.0
        if batch.seqs:
            run = self.runner.run(batch, self.eos_token_ids)
            forward = run.wait_seconds
            outputs += self._postprocess(batch, run.token_ids, run.logprobs, scheduled)
        self._record_step(batch, time.perf_counter() - start, forward)
        return outputs

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"generate-{next(self._ids)}" for _ in prompts]
        for request_id, prompt, p in zip(ids, prompts, params_list):
            self.add_request(request_id, prompt, p)
        results = {request_id: [] for request_id in ids}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.request_id in results:
                    results[out.request_id].extend(out.new_token_ids)
        return [results[request_id] for request_id in ids]

    def _postprocess(self, batch: ScheduledBatch, tokens, logprobs, scheduled: float) -> list[RequestOutput]:
        now = time.monotonic()
        outputs = []
        for seq, n, token, logprob in zip(batch.seqs, batch.num_new_tokens, tokens, logprobs):
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = scheduled
                self.stats.queue_time.observe(scheduled - seq.arrival_time)
                self.stats.prefix_cache_queries += seq.num_prompt_tokens
                self.stats.prefix_cache_hits += seq.num_cached_tokens
                self.stats.prompt_tokens += seq.num_prompt_tokens
            seq.num_computed_tokens += n
            if token is None:   # a prefill chunk that did not reach the end of the prompt
                continue
            seq.token_ids.append(token)
            self.stats.generation_tokens += 1
            if seq.last_token_time is None:
                seq.first_token_time = now
                self.stats.time_to_first_token.observe(now - seq.arrival_time)
            else:
                self.stats.inter_token_latency.observe(now - seq.last_token_time)
            seq.last_token_time = now
            reason = self._finish_reason(seq, token)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                del self.seqs[seq.request_id]
                self.stats.request_success[reason] += 1
                self.stats.e2e_request_latency.observe(now - seq.arrival_time)
                if self.config.log_token_ids:
                    logger.info("request %s finished (%s) output_token_ids=%s", seq.request_id, reason,
                                seq.output_token_ids)
                if seq.trace_context is not None:
                    self._trace(seq, now)
            outputs.append(self._output(seq, [token], [logprob] if logprob is not None else None))
        return outputs

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens and (
                token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids)):
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or len(seq) >= self.max_model_len:
            return "length"
        return None

    def _output(self, seq: Sequence, tokens: list[int], logprobs: list[dict] | None) -> RequestOutput:
        return RequestOutput(seq.request_id, tokens, logprobs, seq.status is SequenceStatus.FINISHED,
                             seq.finish_reason, seq.num_prompt_tokens, seq.num_cached_tokens)

    def _trace(self, seq: Sequence, finished: float) -> None:
        """The request's `llm.request` span under its caller's context, with `llm.queued`, `llm.prefill` and
        `llm.decode` children built from its timestamps and one event per preemption. Forward passes are batched
        across requests, so a span per pass would be shared by every trace in the batch: per-request spans from
        timestamps (as vLLM's request spans) say where this request's time went."""
        from opentelemetry import trace

        offset = time.time_ns() - time.monotonic_ns()

        def ns(t: float) -> int:
            return int(t * 1e9) + offset

        tracer = tracing.tracer()
        span = tracer.start_span("llm.request", seq.trace_context, start_time=ns(seq.arrival_time))
        if not span.is_recording():  # the caller's trace was sampled out
            return
        p, scheduled = seq.params, seq.first_scheduled_time or finished
        attributes = {
            "gen_ai.request.id": seq.request_id,
            "gen_ai.request.model": self.model_name, "gen_ai.response.model": self.model_name,
            "gen_ai.request.max_tokens": p.max_tokens, "gen_ai.request.temperature": p.temperature,
            "gen_ai.request.top_p": p.top_p, "gen_ai.usage.input_tokens": seq.num_prompt_tokens,
            "gen_ai.usage.output_tokens": seq.num_output_tokens,
            "gen_ai.usage.cache_read.input_tokens": seq.num_cached_tokens,
            "gen_ai.response.finish_reasons": [seq.finish_reason or "abort"],
            "gen_ai.latency.time_in_queue": scheduled - seq.arrival_time,
            "gen_ai.latency.e2e": finished - seq.arrival_time, "ember.preemptions": seq.num_preemptions}
        if seq.first_token_time is not None:
            attributes["gen_ai.latency.time_to_first_token"] = seq.first_token_time - seq.arrival_time
        span.set_attributes(attributes)
        inside = trace.set_span_in_context(span)
        tracer.start_span("llm.queued", inside, start_time=ns(seq.arrival_time)).end(ns(scheduled))
        if seq.first_token_time is not None:
            tracer.start_span("llm.prefill", inside, start_time=ns(scheduled)).end(ns(seq.first_token_time))
            tracer.start_span("llm.decode", inside, start_time=ns(seq.first_token_time)).end(ns(finished))
        for t in seq.preempted_at:
            span.add_event("llm.preempted", timestamp=ns(t))
        span.end(ns(finished))

    def _record_step(self, batch: ScheduledBatch, elapsed: float, forward: float) -> None:
        s = self.stats
        s.num_preemptions += len(batch.preempted)
        for seq in batch.preempted:
            if seq.trace_context is not None:
                seq.preempted_at.append(time.monotonic())
        s.num_running = len(self.scheduler.running)
        s.num_waiting = len(self.scheduler.waiting)
        s.kv_cache_usage = self.block_manager.usage
        s.step_time.observe(elapsed)
        s.step_host_time.observe(elapsed - forward)


def _eos_token_ids(model_dir: str, hf_config) -> set[int]:
    ids = set()
    sources = [getattr(hf_config, "eos_token_id", None)]
    generation_config = Path(model_dir) / "generation_config.json"
    if generation_config.is_file():
        sources.append(json.loads(generation_config.read_text()).get("eos_token_id"))
    for source in sources:
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list):
            ids.update(source)
    return ids
