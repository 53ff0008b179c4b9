"""LLMEngine: add requests, then step() = schedule, run, postprocess until every request has finished."""
import itertools
import json
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ember.runtime import startup

from . import kernels
from .block_manager import BlockManager
from .config import EngineConfig
from .gpu_memory import ParkReport, WakeReport
from .grammar import FORMAT_COST
from .model_runner import Launched, ModelRunner, RunOutput
from .observer import EngineObserver, StepRecord
from .sampling import SamplingParams
from .scheduler import ScheduledBatch, Scheduler
from .sequence import Sequence, SequenceStatus
from .stats import EngineStats

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestOutput:                   # what one engine step produced for one request
    request_id: str
    new_token_ids: list[int]           # usually 0 or 1 tokens
    new_logprobs: list[dict] | None    # per new token: {"token_id", "logprob", "top": [(token_id, logprob), ...]}
    finished: bool
    finish_reason: str | None          # "stop" (EOS or stop token), "length" (max_tokens or context), "abort",
                                       # FORMAT_COST
    num_prompt_tokens: int
    num_cached_tokens: int             # prompt tokens served from the prefix cache


@dataclass(slots=True)
class _InFlight:                       # overlap scheduling: a step launched, not collected yet
    batch: ScheduledBatch
    launched: Launched
    slots: list[int]                   # per sequence: the index in its token_ids of the placeholder, -1 for none


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.runner = ModelRunner(config)
        began = time.perf_counter()
        self.max_model_len = self.runner.max_model_len
        self.model_name = Path(config.model).name
        self.eos_token_ids = _eos_token_ids(config.model, self.runner.hf_config)
        self.block_manager = BlockManager(self.runner.num_request_blocks, config.block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.observer = EngineObserver(self.scheduler, self.model_name)
        self.seqs: dict[str, Sequence] = {}
        self._aborted: list[RequestOutput] = []
        self._in_flight: _InFlight | None = None     # overlap: the step the device may still be running
        self._needs_host_tokens: set[str] = set()    # overlap: requests whose sampling reads their tokens
        self._ids = itertools.count()
        # The device's owner at any moment: a step or a graph capture (the engine loop's thread) or a park or
        # wake (the worker's); a park must not unmap memory under a running kernel.
        self._device = threading.RLock()
        startup.report({"engine_ms": round((time.perf_counter() - began) * 1000)})  # what follows the runner
        # A GPU replica restored from a snapshot skips the warm-up: the boot that wrote the snapshot compiled and kept
        # every kernel, and a request waiting on a cold start would only wait longer for kernels to load twice.
        if self.runner.device.type != "cuda" or self.runner.weights_start.source != "snapshot":
            began = time.perf_counter()
            self.warmup()
            startup.report({"warmup_ms": round((time.perf_counter() - began) * 1000)})

    def close(self) -> None:
        """Frees the engine's device memory (weights, KV cache, graphs); it must not step again."""
        with self._device:
            self.runner.close()

    def warmup(self) -> None:
        """One prefill and a few decode steps, greedy and sampled, before the first request: whatever the kernels
        need the first time (flashinfer's modules, compiled when the node has none, cuBLAS handles, Triton's
        kernels) happens here, and new modules are kept for the next start (kernels.py). The sampled request
        outlives the greedy one, so decode steps of two sequences and of one both run: a single sequence's products
        take gemv.py's kernels, which a restored replica's first decode step then loads rather than compiles.
        Leaves no trace in the cache or the stats."""
        prompt = [0] * max(min(self.config.block_size + 1, self.max_model_len - 6), 2)
        for i, params in enumerate((SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                                    SamplingParams(max_tokens=5, temperature=1.0, top_p=0.9, top_k=20, seed=0,
                                                   ignore_eos=True))):
            self.add_request(f"warmup-{i}", prompt[:len(prompt) - i], params)
        while self.has_unfinished_requests():
            self.step()
        self.block_manager.forget_cached()
        self.observer.stats = EngineStats()
        if self.runner.device.type == "cuda":
            build_decode_module = getattr(self.runner.attention, "build_decode_module", None)
            if build_decode_module is not None:   # kept with the rest, so no request step compiles it
                try:
                    build_decode_module()
                except Exception as err:  # noqa: BLE001 - the first large decode step then builds it instead
                    logger.warning("flashinfer's decode module was not built at warm-up: %s", err)
            build_streamed = getattr(self.runner.attention, "build_streamed_kernels", None)
            if build_streamed is not None:   # with streamed_decode_min_batch: its kernel, kept with the rest
                try:
                    build_streamed()
                except Exception as err:  # noqa: BLE001 - the first large decode step then compiles it instead
                    logger.warning("the streamed decode kernel was not compiled at warm-up: %s", err)
            kernels.keep(self.runner.store)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    trace_context=None, group: str | None = None) -> None:
        """`trace_context`: the caller's OpenTelemetry context; when set, the request ends with an `llm.request`
        span (written by the observer). `group`: the caller's request this one is part of (one of n choices, one
        prompt of a batch), which the scheduler shares the engine fairly among; default: its own."""
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
        seq = Sequence(request_id, prompt_token_ids, params, generator, self.eos_token_ids, self.max_model_len)
        if group is not None:
            seq.group = group
        self.seqs[request_id] = seq
        if self.config.overlap and _needs_host_tokens(seq):
            self._needs_host_tokens.add(request_id)
        self.scheduler.add(seq)
        self.observer.added(seq, trace_context)
        if self.config.log_token_ids:
            logger.info("request %s prompt_token_ids=%s", request_id, prompt_token_ids)

    def abort_request(self, request_id: str, reason: str = "abort") -> None:
        """Ends a request early and frees its blocks. `reason="stop"` is the API layer matching a stop string."""
        seq = self.seqs.pop(request_id, None)
        if seq is None or seq.status is SequenceStatus.FINISHED:
            return
        self._needs_host_tokens.discard(request_id)
        del seq.token_ids[seq.num_known_tokens:]   # a step in flight samples for it: that token is discarded
        self.scheduler.finish(seq, reason)
        self._aborted.append(self._output(seq, [], None))   # reported by the next step()

    @property
    def stats(self) -> EngineStats:
        return self.observer.stats

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted) or self._in_flight is not None

    @property
    def parked(self) -> bool:
        return self.runner.arena.parked

    def park(self) -> ParkReport:
        """Releases the GPU memory of the weights and the KV cache while keeping their addresses, so CUDA graphs and
        kernel workspaces stay valid; the weights wait in pinned host memory. Only an idle engine parks: the KV
        cache's contents are discarded, and with them every cached prefix."""
        with self._device:
            self._settle()
            if self.has_unfinished_requests():
                raise RuntimeError("cannot park an engine with requests in flight: let them finish or abort them "
                                   "first")
            self.block_manager.forget_cached()
            return self.runner.park()

    def wake(self) -> WakeReport:
        """Maps the memory back at the same addresses and copies the weights in; a no-op when not parked."""
        with self._device:
            return self.runner.wake()

    def capture_idle(self) -> bool:
        """Capture one decode graph still missing, while there is no request to run; False when none is left
        (or the engine is parked). Each takes ~75 ms on an H200, so a request arriving meanwhile waits little."""
        with self._device:
            self._settle()
            return not self.has_unfinished_requests() and self.runner.capture_next_graph()

    def _settle(self) -> None:
        """Wait for a step still in flight whose requests have all finished (or been aborted): it has nothing
        left to report, and the device must be idle before a park or a capture."""
        if self._in_flight is not None and not self.scheduler.has_unfinished():
            self.runner.collect(self._in_flight.launched)
            self._in_flight = None

    def step(self) -> list[RequestOutput]:
        with self._device:
            return self._step()

    def _step(self) -> list[RequestOutput]:
        if self.parked:  # a request reached a parked engine: serve it rather than fault on unmapped memory
            self.wake()
        started, began = time.monotonic(), time.perf_counter()
        if self.config.overlap:
            batch, run, outputs = self._overlap_step()
        else:
            batch = self.scheduler.schedule()
            run = self.runner.run(batch, self.eos_token_ids) if batch.seqs else None
            outputs = self._postprocess(batch, run)
        self.observer.stepped(StepRecord(batch, run, outputs, started, time.perf_counter() - began))
        # only now: until the observer has counted an aborted request, the engine reads as busy, so whoever waits
        # for it to go idle (a test, a park) then sees the abort in its stats
        self._aborted = []
        return outputs

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"generate-{next(self._ids)}" for _ in prompts]
        for request_id, prompt, p in zip(ids, prompts, params_list):
            self.add_request(request_id, prompt, p)
        results: dict[str, list[int]] = {request_id: [] for request_id in ids}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.request_id in results:
                    results[out.request_id].extend(out.new_token_ids)
        return [results[request_id] for request_id in ids]

    def _postprocess(self, batch: ScheduledBatch, run: RunOutput | None) -> list[RequestOutput]:
        outputs = list(self._aborted)   # cleared by _step once the observer has them (see has_unfinished_requests)
        if run is None:
            return outputs
        finish_reason = self._finish_reason
        for seq, n, token, logprob in zip(batch.seqs, batch.num_new_tokens, run.token_ids, run.logprobs):
            seq.num_computed_tokens += n
            if token is None:   # a prefill chunk that did not reach the end of the prompt
                continue
            seq.token_ids.append(token)
            reason = finish_reason(seq, token, len(seq.token_ids))
            if seq.matcher is not None and seq.matcher.advance(token) and reason is None:
                # the format is complete (with ignore_eos, say, the stop token is not one), or costs too much
                reason = FORMAT_COST if seq.matcher.costly else "stop"
            if reason is not None:
                self._finish(seq, reason)
            outputs.append(RequestOutput(seq.request_id, [token], [logprob] if logprob is not None else None,
                                         reason is not None, reason, seq.num_prompt_tokens, seq.num_cached_tokens))
        return outputs

    def _overlap_step(self) -> tuple[ScheduledBatch, RunOutput | None, list[RequestOutput]]:
        """Schedule and launch step N+1, then collect and postprocess step N, which the device ran meanwhile.

        At launch, each sequence that samples gets a placeholder for its token and its computed tokens advance, so
        the scheduler plans N+1 as if N were done; N+1's inputs take N's tokens on the device. A sequence that stops
        at N was scheduled into N+1 too: that output is discarded. While a request needs its tokens on the host
        to sample (penalties, min_tokens, logprobs), a step is launched and collected in one call; where N+1 would
        capture a decode graph first, N is collected alone and N+1 launched by the next call. Where N+1 holds a
        sequence to a format, only its forward pass is launched before N is collected: its sampling is queued after
        N's tokens have advanced the format, while that forward pass runs.
        """
        previous, self._in_flight = self._in_flight, None
        try:
            batch = ScheduledBatch()
            # Only N finishes where N+1 must see its tokens, or where N+1 would likely capture a graph first: N's
            # tokens (a restored replica's first token, say) then reach their clients before the capture, not after
            if previous is None or not (self._needs_host_tokens or self._capture_due()):
                batch = self.scheduler.schedule()
                if batch.seqs:
                    self._in_flight = self._launch(batch, previous)
            if previous is None:
                self._sample(self._in_flight)   # no step before it: its held rows' masks follow from known tokens
                if self._needs_host_tokens:
                    previous, self._in_flight = self._in_flight, None
            run = self.runner.collect(previous.launched) if previous is not None else None
            outputs = self._postprocess_launched(previous, run)
            # N's tokens have advanced the formats' matchers: N+1's masks are written, and its sampling queued,
            # while the device still runs N+1's forward pass
            self._sample(self._in_flight)
            return batch, run, outputs
        except BaseException:
            # the steps' tokens are lost: each sequence samples again from its last known token (the caller
            # decides whether its requests go on, as AsyncLLM aborts those of a failed step)
            for step in (previous, self._in_flight):
                for seq in step.batch.seqs if step is not None else ():
                    del seq.token_ids[seq.num_known_tokens:]
                    if seq.status is SequenceStatus.RUNNING:
                        seq.num_computed_tokens = min(seq.num_computed_tokens, len(seq.token_ids) - 1)
            self._in_flight = None
            raise

    def _capture_due(self) -> bool:
        """Whether the next step is likely a decode step whose graph is not captured yet: the running sequences,
        each one token short of its end (none in a chunked prefill), none waiting (a wrong guess only costs one
        step's overlap)."""
        running = self.scheduler.running
        return (not self.scheduler.waiting and self.runner.capture_due(len(running))
                and all(seq.num_computed_tokens == len(seq.token_ids) - 1 for seq in running))

    def _sample(self, step: _InFlight | None) -> None:
        if step is not None and step.launched.pending is not None:
            self.runner.sample(step.launched)

    def _launch(self, batch: ScheduledBatch, previous: _InFlight | None) -> _InFlight:
        launched = self.runner.launch(batch, self.eos_token_ids, previous.launched if previous is not None else None,
                                      defer_held=True)
        slots = []
        row = 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == len(seq.token_ids):   # it samples: row `row` of this step's tokens
                slots.append(len(seq.token_ids))
                seq.token_ids.append(-1 - row)
                row += 1
            else:
                slots.append(-1)
        return _InFlight(batch, launched, slots)

    def _postprocess_launched(self, step: _InFlight | None, run: RunOutput | None) -> list[RequestOutput]:
        """Put a collected step's tokens in place of its placeholders; stop and report as `_postprocess` does."""
        outputs = list(self._aborted)   # cleared by _step once the observer has them
        if step is None or run is None:
            return outputs
        # per sequence per step, as in Scheduler.schedule: calls only where they may do something
        finish_reason, cache_full_blocks = self._finish_reason, self.block_manager.cache_full_blocks
        block_size, prefix_caching = self.block_manager.block_size, self.block_manager.enable_prefix_caching
        finished, running = SequenceStatus.FINISHED, SequenceStatus.RUNNING
        for seq, slot, token, logprob in zip(step.batch.seqs, step.slots, run.token_ids, run.logprobs):
            if token is None or seq.status is finished:   # a prefill chunk, or aborted meanwhile
                continue
            seq.token_ids[slot] = token
            reason = (finish_reason(seq, token, slot + 1) if token in seq.stop_ids or slot + 1 >= seq.max_len
                      else None)
            if seq.matcher is not None and seq.matcher.advance(token) and reason is None:
                reason = FORMAT_COST if seq.matcher.costly else "stop"   # as in _postprocess
            if reason is not None:
                del seq.token_ids[slot + 1:]   # the placeholder of the step launched since: its output is discarded
                self._finish(seq, reason)
            else:
                # not preempted meanwhile (its blocks are its own), and a block filled up
                if (prefix_caching and seq.status is running
                        and seq.num_computed_tokens // block_size > len(seq.block_hashes)):
                    cache_full_blocks(seq, seq.num_computed_tokens)
                if self._needs_host_tokens and not _needs_host_tokens(seq):   # past its min_tokens
                    self._needs_host_tokens.discard(seq.request_id)
            outputs.append(RequestOutput(seq.request_id, [token], [logprob] if logprob is not None else None,
                                         reason is not None, reason, seq.num_prompt_tokens, seq.num_cached_tokens))
        return outputs

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        del self.seqs[seq.request_id]
        self._needs_host_tokens.discard(seq.request_id)
        if self.config.log_token_ids:
            logger.info("request %s finished (%s) output_token_ids=%s", seq.request_id, reason, seq.output_token_ids)

    @staticmethod
    def _finish_reason(seq: Sequence, token: int, length: int) -> str | None:
        """`length`: the sequence's tokens up to and including `token`."""
        if token in seq.stop_ids and length - seq.num_prompt_tokens >= seq.params.min_tokens:
            return "stop"
        if length >= seq.max_len:
            return "length"
        return None

    def _output(self, seq: Sequence, tokens: list[int], logprobs: list[dict] | None) -> RequestOutput:
        return RequestOutput(seq.request_id, tokens, logprobs, seq.status is SequenceStatus.FINISHED,
                             seq.finish_reason, seq.num_prompt_tokens, seq.num_cached_tokens)


def _needs_host_tokens(seq: Sequence) -> bool:
    """Whether sampling the sequence's next token reads its tokens on the host (so overlap waits for them):
    penalties count them, a min_tokens ban ends with them, logprobs are read with them. (A format's next mask
    follows from them too: its step's forward pass is launched before they are known, and its sampling after.)"""
    p = seq.params
    return p.has_penalties or p.logprobs is not None or seq.num_output_tokens < p.min_tokens


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
