"""Owns the device: the model weights, the KV cache tensors, the attention backend; runs one scheduled batch."""
import collections
import importlib.util
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ember.runtime import startup
from ember.snapshot import image, open_store
from ember.snapshot.store import SnapshotStore

from . import attention as attention_module
from . import fp8, fused, kernels
from .attention import AttentionBatch, FlashInferBackend, SdpaBackend
from .config import EngineConfig
from .cuda_graphs import DecodeGraphs, graph_batch_sizes, row_width
from .gpu_memory import AddressTaken, Arena, CudaDriverError, ParkReport, WakeReport, tensor_bytes
from .grammar import MaskFiller
from .models.loader import load_model, model_config, snapshot_key
from .prefill_graphs import PrefillGraphs, prefill_graph_sizes
from .sampling import Draws, HostCopy, SamplingRow, draw
from .scheduler import ScheduledBatch
from .step_inputs import step_inputs

logger = logging.getLogger(__name__)

KV_CACHE = "kv_cache"  # the arena region of every layer's KV blocks
last_gpu_image: str | None = None  # this process's latest engine start: its GPU memory image, for the start breakdown
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# An eager step (a prefill past the piecewise graphs' sizes) runs its model's last layer after the attention for the
# rows it samples from alone (the model's `keep`): no later layer reads the others. In the offline run's prefill
# steps of 8,192 tokens that leaves ~14 rows of the last layer's o, gate/up and down products, SiLU-mul and norms,
# about 1/36 of the step (~2 ms of ~115 on the 8B shape with FP8 weights); a step that samples nothing runs them whole.
LAST_LAYER_ROWS = True


@dataclass
class Launched:
    """A batch queued on the device, collected by `ModelRunner.collect`."""
    num_seqs: int
    sampled: list[int]                 # the sequences that sample, in the order of the draws' rows
    samples_all: bool
    draws: Draws | None                # the sampled tokens on the device; None when no sequence samples
    copy: HostCopy | None              # with overlap: the draws' tokens on their way to a host buffer
    timer: "_GpuTimer"
    began: float                       # perf_counter() at the launch's start
    blocked: float                     # seconds of the launch spent waiting for the device (the last plan's copies)
    prepared: float                    # once the inputs were on their way and attention was planned
    queued: float                      # once the forward pass and sampling were queued (on CPU: done); a deferred
                                       # sampling (launch's defer_held) is queued later, by ModelRunner.sample
    graph_batch_size: int | None
    # the step's logits and sampling rows while its sampling waits for its held rows' masks (ModelRunner.sample)
    pending: "tuple[torch.Tensor, list[SamplingRow]] | None" = None
    prefill_graph_size: int | None = None   # the piecewise prefill graphs' size the step was padded to


@dataclass
class RunOutput:
    """One batch's sampled tokens and where the step's time went."""
    token_ids: list[int | None]        # per sequence; None for a prefill chunk that did not reach the prompt's end
    logprobs: list[dict | None]
    prepare_seconds: float             # host work before the forward pass was queued
    # host blocked on the device: for the sampled tokens and, with overlap, for the previous plan's copies (on CPU:
    # the forward pass)
    wait_seconds: float
    gpu_seconds: float | None          # device time of the forward pass and sampling (CUDA events); None on CPU
    graph_batch_size: int | None       # the CUDA graph replayed, None when the step ran eagerly
    prefill_graph_size: int | None = None   # a step that prefilled: the piecewise graphs' size it replayed


class ModelRunner:
    def __init__(self, config: EngineConfig):
        setup_began = time.perf_counter()
        self.config = config
        self.device = torch.device(config.device if config.device != "auto"
                                   else ("cuda" if torch.cuda.is_available() else "cpu"))
        if config.dtype == "auto":
            self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        else:
            self.dtype = _DTYPES[config.dtype]
        if config.quantization is not None and (why := fp8.unsupported(self.device, self.dtype)):
            raise ValueError(why)
        if config.kv_cache_dtype == "fp8" and (why := fp8.unsupported(self.device, self.dtype, "kv_cache_dtype")):
            raise ValueError(why)
        self.kv_dtype = fp8.kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        self.store = open_store(config.snapshot_store) if config.snapshot_store else None
        if self.device.type == "cuda":
            kernels.install()
            fused.fit_to(self.device)
        store_done = time.perf_counter()
        # The weights and the KV cache live in the arena, so a park can release them and keep their addresses.
        self.arena = Arena(self.device)
        arena_done = time.perf_counter()
        self.gpu_image = self._reserve_recorded_ranges()
        # seconds per phase of the engine's start; setup: the store, the kernel directory, the arena and the
        # reservation of the recorded address ranges, before the weights and the attention backend start (its
        # parts apart: the arena's is where the CUDA context is made, on a GPU)
        self.start_phases: dict[str, float] = {
            "setup": time.perf_counter() - setup_began, "setup_store": store_done - setup_began,
            "setup_arena": arena_done - store_done, "setup_reserve": time.perf_counter() - arena_done}
        # The attention backend (importing flashinfer, installing its kernels: ~0.7 s on an H200) needs only the
        # model's shape, so it is made on a thread while the weights stream in.
        with ThreadPoolExecutor(1, thread_name_prefix="ember-attention") as pool:
            attention = pool.submit(self._timed_backend, config.model)
            began = time.perf_counter()
            # weights_start: where the weights came from (snapshot or full boot), how long, how fast
            self.model, self.hf_config, self.weights_start = load_model(config.model, self.dtype, self.device,
                                                                        config.snapshot_store, self.arena,
                                                                        config.quantization)
            self.start_phases["weights"] = time.perf_counter() - began
            began = time.perf_counter()
            self.attention = attention.result()
            self.start_phases["attention_wait"] = time.perf_counter() - began  # the part the weights did not hide
        hf = self.hf_config
        self.vocab_size = hf.vocab_size
        self.max_model_len = config.max_model_len or hf.max_position_embeddings
        if self.max_model_len > hf.max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings="
                             f"{hf.max_position_embeddings}: lower it")
        self.block_size = config.block_size
        head_dim = self.model.head_dim
        self.num_kv_heads = hf.num_key_value_heads
        self.num_layers = hf.num_hidden_layers
        if self.model.head_dim != self.attention.head_dim:
            raise ValueError(f"{config.model}: the model's head_dim {self.model.head_dim} is not config.json's "
                             f"{self.attention.head_dim}")
        began = time.perf_counter()
        self.num_blocks = config.num_kv_blocks or self._derive_num_blocks(head_dim)
        use_graphs = isinstance(self.attention, FlashInferBackend) and not config.enforce_eager
        # Graphs pad their batches with a block no request owns: the block manager gets one block fewer.
        self.num_request_blocks = self.num_blocks - use_graphs
        if self.num_request_blocks * self.block_size < self.max_model_len:
            raise ValueError(f"{self.num_request_blocks} KV blocks of {self.block_size} tokens cannot hold one "
                             f"sequence of max_model_len={self.max_model_len}: raise num_kv_blocks or lower "
                             "max_model_len")
        kv_shape = (self.num_blocks, 2, self.block_size, self.num_kv_heads, head_dim)
        mapping = time.perf_counter()
        kv_region = self.arena.region(KV_CACHE, tensor_bytes([(kv_shape, self.kv_dtype)] * self.num_layers),
                                      keep=False)
        self.start_phases["kv_map"] = time.perf_counter() - mapping
        self.kv_caches = [kv_region.take(kv_shape, self.kv_dtype) for _ in range(self.num_layers)]
        self.start_phases["kv_cache"] = time.perf_counter() - began
        began = time.perf_counter()
        self._record_image()
        self.start_phases["image"] = time.perf_counter() - began
        began = time.perf_counter()
        # Graphs, their buffers and flashinfer's workspaces stay in torch's allocator, which a park leaves alone.
        # Lazily (the default) none is captured here: each size on the first step that needs it or while the engine
        # idles, so a restored replica takes its first request sooner.
        self.graphs = self._capture_graphs(None if config.graph_capture == "start" else []) if use_graphs else None
        self.prefill_graphs = self._prefill_graphs() if use_graphs and config.prefill_graphs else None
        if self.prefill_graphs is not None and config.graph_capture == "start":
            while self.capture_next_graph():
                pass
        self.start_phases["graph_capture"] = time.perf_counter() - began
        self._planned: torch.cuda.Event | None = None   # overlap: the last step's plan is on the device
        self._token_buffers: list[torch.Tensor] = []     # overlap: host buffers of sampled tokens (_host_tokens)
        self.masks = MaskFiller(self.vocab_size)          # constrained sequences' masks, written each step
        # steps' GPU timers, in turn: a step's is read when it is collected, before the step after next launches;
        # reusing their events spares each step creating and destroying two (four calls to the driver)
        self._timers = collections.deque(_GpuTimer(self.device.type == "cuda", self.config.device_wait == "block")
                                           for _ in range(3))
        logger.info("model %s on %s (%s), %d KV blocks of %d tokens (%s), attention %s, decode graphs %s; start %s",
                    config.model, self.device, self.dtype, self.num_blocks, self.block_size, self.kv_dtype,
                    type(self.attention).__name__, self.graphs.batch_sizes if self.graphs else "off",
                    {k: round(v, 3) for k, v in self.start_phases.items()})
        # the worker reports weights itself; the rest joins the replica's start breakdown
        startup.report({f"{k}_ms": round(v * 1000) for k, v in self.start_phases.items() if k != "weights"})

    def _image_place(self) -> tuple[SnapshotStore, str] | None:
        """The store and weight snapshot a GPU memory image sits beside; None where there is none (CPU, no store)."""
        if self.store is None or self.arena.driver is None:
            return None
        return self.store, snapshot_key(self.config.model, self.dtype, self.config.quantization)

    def _reserve_recorded_ranges(self) -> str:
        """The device address ranges the last replica of this snapshot held (its GPU memory image), reserved
        before anything else allocates, so the weights and the KV cache land where they were. Returns "reserved",
        "new" (and logs why) or "none" (no image on a CPU or without a store)."""
        global last_gpu_image
        place = self._image_place()
        self.gpu_image_reason: str | None = None
        if place is None:
            last_gpu_image = "none"
            return last_gpu_image
        store, snapshot = place
        try:
            recorded = store.get_blob(image.blob_name(snapshot))
            regions, reason = image.GpuImage.usable(recorded, snapshot, self.arena.identity)
            for r in regions:
                self.arena.reserve(r.name, r.address, r.size)
        except (AddressTaken, CudaDriverError, OSError) as err:
            self.arena.release_reservations()
            reason = f"{type(err).__name__}: {err}"
        if reason is not None:
            logger.info("GPU memory image not used, allocating new address ranges: %s", reason)
        self.gpu_image_reason = reason  # why the image was not used (None when it was)
        last_gpu_image = "reserved" if reason is None else "new"
        return last_gpu_image

    def _record_image(self) -> None:
        """Records where the arena's regions are, for the next replica, unless the image says so already."""
        self.arena.release_reservations()
        place = self._image_place()
        if place is None:
            return
        store, snapshot = place
        now = image.GpuImage(snapshot, self.arena.identity, tuple(
            image.ImageRegion(r.name, r.address, r.size, r.keep) for r in self.arena.regions)).encode()
        try:
            if store.get_blob(image.blob_name(snapshot)) != now:
                store.put_blob(image.blob_name(snapshot), now)
        except Exception as err:  # noqa: BLE001 - without an image the next replica only gets new addresses
            logger.warning("could not record the GPU memory image: %s", err)

    def park(self) -> ParkReport:
        """Releases the device memory of the weights (kept in pinned host memory) and of the KV cache (discarded);
        their addresses stay reserved, so whatever captured them (CUDA graphs, attention plans) stays valid."""
        return self.arena.park()

    def wake(self) -> WakeReport:
        return self.arena.wake()

    def close(self) -> None:
        """Frees the weights, the KV cache and the graphs; the runner must not run again."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # an overlapped step may still run on what is freed next
        self.graphs = self.prefill_graphs = None
        self.arena.release()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _block_bytes(self, head_dim: int) -> int:
        return 2 * self.block_size * self.num_kv_heads * head_dim * self.kv_dtype.itemsize * self.num_layers

    def _derive_num_blocks(self, head_dim: int) -> int:
        if self.config.kv_cache_bytes is not None:
            blocks = self.config.kv_cache_bytes // self._block_bytes(head_dim)
            if blocks < 1:
                raise ValueError(f"kv_cache_bytes={self.config.kv_cache_bytes} holds no KV block of "
                                 f"{self._block_bytes(head_dim)} bytes: raise it")
            return blocks
        if self.device.type != "cuda":
            # host memory for 64 full-length sequences at most (more preempt): CPU engines run tests and tiny models
            return min(self.config.max_num_seqs, 64) * -(-self.max_model_len // self.block_size)
        free, total = torch.cuda.mem_get_info(self.device)
        hf = self.hf_config
        # Headroom for one step's activations: the MLP intermediate of a full token budget and the logits.
        activations = (self.config.max_num_batched_tokens * (2 * hf.intermediate_size + 4 * hf.hidden_size)
                       * self.dtype.itemsize + self.config.max_num_seqs * hf.vocab_size * 4 * 4 + (1 << 30))
        # This engine's share of the GPU less what it holds already; other processes' memory counts only
        # through what is free.
        held = self.arena.mapped_bytes + torch.cuda.memory_reserved(self.device)
        budget = min(self.config.gpu_memory_utilization * total - held, free) - activations
        blocks = int(budget // self._block_bytes(head_dim))
        if blocks < 1:
            raise ValueError("no GPU memory left for the KV cache: raise gpu_memory_utilization or use a smaller model")
        return blocks

    def _timed_backend(self, model_dir: str):
        began = time.perf_counter()
        shape = json.loads((Path(model_dir) / "config.json").read_text())
        num_heads = shape["num_attention_heads"]
        head_dim = shape.get("head_dim") or shape["hidden_size"] // num_heads
        backend = self._make_backend(num_heads, shape.get("num_key_value_heads", num_heads), head_dim)
        self.start_phases["attention"] = time.perf_counter() - began
        if self.device.type == "cuda" and self.config.warm_kernels:
            began = time.perf_counter()
            try:
                parts = warm_kernels(model_dir, self.dtype, self.device, backend, self.config.block_size,
                                     quantization=self.config.quantization,
                                     kv_dtype=self.kv_dtype)
                self.start_phases.update({f"kernel_warm_{name}": seconds for name, seconds in parts.items()})
            except Exception as err:  # noqa: BLE001 - an optimisation: the first request then pays what it skipped
                logger.warning("kernel warm-up skipped (the first request loads the kernels instead): %s", err)
            self.start_phases["kernel_warm"] = time.perf_counter() - began
        return backend

    def _make_backend(self, num_heads: int, num_kv_heads: int, head_dim: int):
        name = self.config.attention_backend
        block_size = self.config.block_size
        args = (num_heads, num_kv_heads, head_dim, block_size, head_dim ** -0.5)
        if name == "auto":
            # flashinfer's paged kernels take half precision only.
            usable = self.device.type == "cuda" and self.dtype != torch.float32
            name = "flashinfer" if usable and importlib.util.find_spec("flashinfer") is not None else "sdpa"
        if name == "flashinfer":
            if self.device.type != "cuda" or self.dtype == torch.float32:
                raise ValueError("attention_backend='flashinfer' needs a CUDA device and bf16/fp16: use 'sdpa' "
                                 "on CPU or in float32")
            kernels.prepare(self.store)  # compiled modules from this node or the store: no request compiles
            return FlashInferBackend(*args, dtype=self.dtype, device=self.device,
                                     streamed_min_batch=self.config.streamed_decode_min_batch,
                                     kv_dtype=self.kv_dtype)
        return SdpaBackend(*args)

    @torch.inference_mode()
    def _capture_graphs(self, sizes: list[int] | None) -> DecodeGraphs:
        max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        return DecodeGraphs(self.model, self.attention, self.kv_caches, graph_batch_sizes(self.config.max_num_seqs),
                            max_blocks_per_seq, scratch_block=self.num_blocks - 1, capture=sizes)

    def _prefill_graphs(self) -> PrefillGraphs | None:
        parameters = sum(p.numel() for p in self.model.parameters())
        sizes = prefill_graph_sizes(self.config.max_num_batched_tokens, parameters)
        return PrefillGraphs(self.model, self.attention, self.kv_caches, sizes, self.num_blocks - 1) if sizes else None

    @torch.inference_mode()
    def capture_next_graph(self) -> bool:
        """Capture one graph not captured yet, the decode graphs first (the engine calls this while idle); False
        when none is left."""
        if self.graphs is None or self.arena.parked:
            return False
        return self.graphs.capture_next() or (self.prefill_graphs is not None and self.prefill_graphs.capture_next())

    def capture_due(self, num_seqs: int) -> bool:
        """Whether a decode step of `num_seqs` sequences would first capture its graph (tens of milliseconds)."""
        if self.graphs is None or not num_seqs:
            return False
        size = self.graphs.batch_size_for(num_seqs)
        return size is not None and size not in self.graphs.graphs

    def run(self, batch: ScheduledBatch, eos_token_ids: set[int]) -> RunOutput:
        """Compute the batch's new tokens; sample for every sequence whose tokens are now all in the cache."""
        return self.collect(self.launch(batch, eos_token_ids))

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, eos_token_ids: set[int], previous: "Launched | None" = None,
               defer_held: bool = False) -> "Launched":
        """Queue the batch's forward pass and sampling on the device (on CPU: run them) without waiting for them.
        `previous`: the step launched before, still running (overlap scheduling), whose sampled tokens the
        batch's placeholders stand for; they go from its output into this step's inputs on the device.
        `defer_held`: where a sequence is held to a format, queue the forward pass only; `sample` queues the
        sampling once the formats' matchers have taken the previous step's tokens (their masks follow from them)."""
        began = time.perf_counter()
        inputs = step_inputs(batch, self.block_size)
        sample_index = inputs.sample_index
        seqs = batch.seqs
        rows = self._sampling_rows(seqs if inputs.samples_all else [seqs[i] for i in inputs.sampled], eos_token_ids)
        self._timers.rotate()
        timer = self._timers[0]
        blocked = time.perf_counter()
        if self._planned is not None:
            # attention plans copy from host buffers they reuse (flashinfer: one pinned buffer per wrapper): the
            # previous step's copies must have left them before this step plans; they run first in that step
            self._planned.synchronize()
        blocked = time.perf_counter() - blocked
        # one new token per sequence: a decode step, replayed from a graph unless above the largest
        graph_size = self.graphs.batch_size_for(len(seqs)) if self.graphs is not None and inputs.decode else None
        prefill_size = None   # else: the piecewise graphs' size a step that prefills pads to, where captured
        if self.graphs is not None and graph_size is not None:
            self.graphs.capture(graph_size)  # once per size, when not done yet
            graph_size = self.graphs.prepare(inputs.tokens, inputs.block_tables, inputs.num_blocks,
                                             inputs.context_lens)
            self._feed(self.graphs.rows(graph_size)[0], inputs.feeds, previous)
            self._planned_now(timer)
            prepared = time.perf_counter()
            logits = self.graphs.replay(graph_size, len(seqs))
            if len(sample_index) < len(seqs):
                logits = logits[torch.from_numpy(sample_index).to(self.device, non_blocking=True)]
        else:
            num_tokens = inputs.tokens.shape[1]
            piecewise = self.prefill_graphs
            prefill_size = piecewise.size_for(num_tokens) if piecewise is not None else None
            if piecewise is not None and prefill_size is not None:   # padded to a size with graphs
                piecewise.prepare(inputs.tokens)
                ids, pos, blocks, offsets = piecewise.rows(prefill_size)[:, :num_tokens]
            else:
                ids, pos, blocks, offsets = aligned_rows(inputs.tokens, self.device)
            self._feed(ids, inputs.feeds, previous)
            self.attention.plan(AttentionBatch(inputs.query_lens, inputs.context_lens, inputs.block_tables,
                                               inputs.num_blocks, blocks, offsets))
            self._planned_now(timer)
            prepared = time.perf_counter()
            index = torch.from_numpy(sample_index).to(self.device, non_blocking=True) if rows else None
            if piecewise is not None and prefill_size is not None:
                hidden = piecewise.replay(prefill_size, num_tokens)
            elif LAST_LAYER_ROWS and index is not None and len(sample_index) < num_tokens:   # those rows' alone
                hidden = self.model(ids, pos, self.attention, self.kv_caches, keep=index)
                index = None
            else:
                hidden = self.model(ids, pos, self.attention, self.kv_caches)
            if rows:
                logits = self.model.compute_logits(hidden if index is None else hidden[index])
        launched = Launched(len(seqs), inputs.sampled, inputs.samples_all, None, None, timer, began, blocked, prepared,
                            0.0, graph_size, (logits, rows) if rows else None, prefill_size)
        if not (defer_held and any(row.matcher is not None for row in rows)):
            self.sample(launched)
        launched.queued = time.perf_counter()
        return launched

    @torch.inference_mode()
    def sample(self, launched: "Launched") -> None:
        """Queue the sampling of a launched step (done by `launch` unless it deferred it)."""
        pending, launched.pending = launched.pending, None
        draws = None
        if pending is not None:
            logits, rows = pending
            self._fill_masks(rows)   # host work while the device runs the forward pass
            draws = draw(logits, rows)
        timer = launched.timer
        if draws is not None and self.config.overlap:
            # the timer's end event also marks the tokens' copy (one event recorded, none made)
            launched.copy = draws.copy_to_host(self._host_tokens(), done=timer.end if timer.enabled else None)
        else:
            timer.stop()
        launched.draws = draws

    def collect(self, launched: "Launched") -> RunOutput:
        """Wait for a launched step's sampled tokens (the step's one synchronisation) and bring them to the host."""
        waiting = time.perf_counter()
        draws, timer = launched.draws, launched.timer
        if launched.copy is not None:
            sampled, sampled_logprobs = launched.copy.result()
        else:   # with none to sample, the stream ends
            sampled, sampled_logprobs = draws.to_host() if draws else timer.synchronize()
        done = time.perf_counter()
        tokens: list[int | None]
        logprobs: list[dict | None]
        if launched.samples_all:
            tokens, logprobs = list(sampled), sampled_logprobs
        else:
            tokens, logprobs = [None] * launched.num_seqs, [None] * launched.num_seqs
            for i, token, logprob in zip(launched.sampled, sampled, sampled_logprobs):
                tokens[i], logprobs[i] = token, logprob
        # On CPU the forward pass runs on the host: all of it counts as the wait for the "device".
        wait = done - waiting + launched.blocked + (0.0 if timer.enabled else launched.queued - launched.prepared)
        return RunOutput(tokens, logprobs, launched.prepared - launched.began - launched.blocked, wait,
                         timer.elapsed(), launched.graph_batch_size, launched.prefill_graph_size)

    def _feed(self, token_ids: torch.Tensor, feeds: np.ndarray, previous: "Launched | None") -> None:
        """Fill the placeholders among the step's token ids with the previous step's sampled tokens, on the device."""
        if not feeds.shape[1]:
            return
        assert previous is not None and previous.draws is not None, "placeholders without the step that samples them"
        n = feeds.shape[1]
        if feeds[0, -1] == n - 1 and feeds[1, -1] == n - 1 and (feeds == np.arange(n)).all():
            # the common decode step: the same sequences in the same order, each token in its row: one copy
            token_ids[:n].copy_(previous.draws.token_ids[:n])
            return
        columns, rows = torch.from_numpy(feeds).to(self.device, non_blocking=True)
        token_ids.index_copy_(0, columns, previous.draws.token_ids[rows])

    def _planned_now(self, timer: "_GpuTimer") -> None:
        """Start the step's GPU timer; with overlap on CUDA, its event also marks where this step's inputs and
        attention plan have been copied to the device (one event where there were two: each call to the driver
        costs ~10 us of host time on the H200 machine)."""
        timer.start()
        if self.config.overlap and timer.enabled:
            self._planned = timer.begin

    def _host_tokens(self) -> torch.Tensor:
        """One of two host buffers of sampled tokens, in turn: a step's tokens are read before the step after the
        next one copies (one step at most is in flight)."""
        if not self._token_buffers:
            pinned = self.device.type == "cuda"
            self._token_buffers = [torch.empty(self.config.max_num_seqs, dtype=torch.long, pin_memory=pinned)
                                   for _ in range(2)]
        self._token_buffers.reverse()
        return self._token_buffers[0]

    def _fill_masks(self, rows: list[SamplingRow]) -> None:
        # a format that ended at the step before (the sequence stopped; this step's token is discarded) has no mask
        held = [(row, row.matcher) for row in rows if row.matcher is not None and not row.matcher.ended]
        if held:
            for (row, _), allowed in zip(held, self.masks.fill([matcher for _, matcher in held])):
                row.allowed = allowed

    def _sampling_rows(self, seqs: list, eos_token_ids: set[int]) -> list[SamplingRow]:
        return [seq.sampling_row or self._sampling_row(seq, eos_token_ids) for seq in seqs]

    def _sampling_row(self, seq, eos_token_ids: set[int]) -> SamplingRow:
        """A new row, cached when settled: past min_tokens, without penalties and without a format, nothing in it
        changes again."""
        p = seq.params
        if seq.matcher is not None:
            # a format decides when the output may end: min_tokens bans no stop token, which may be all it allows;
            # its mask is written once the step's forward pass is queued (_fill_masks)
            return SamplingRow(p, seq.prompt_token_ids if p.has_penalties else [],
                               seq.output_token_ids if p.has_penalties else [], seq.generator, [],
                               matcher=seq.matcher)
        if seq.num_output_tokens < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(eos_token_ids))
            return SamplingRow(p, seq.prompt_token_ids if p.has_penalties else [],
                               seq.output_token_ids if p.has_penalties else [], seq.generator, banned)
        if p.has_penalties:   # the token lists are only read by penalties: copied only for them, every step
            return SamplingRow(p, seq.prompt_token_ids, seq.output_token_ids, seq.generator, [])
        seq.sampling_row = SamplingRow(p, [], [], seq.generator, [])
        return seq.sampling_row

    def make_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)



class _GpuTimer:
    """Device time between two points of the stream, read after the step's one synchronisation; off on CPU. The
    host waits on `end` for the step's tokens: a blocking event lets its thread sleep there (EngineConfig.device_wait);
    `begin`, which marks the step's inputs copied, is waited on briefly and spins."""

    def __init__(self, enabled: bool, blocking: bool = False):
        self.enabled = enabled
        if enabled:
            self.begin = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True, blocking=blocking)

    def start(self) -> None:
        if self.enabled:
            self.begin.record()

    def stop(self) -> None:
        if self.enabled:
            self.end.record()

    def synchronize(self) -> tuple[list, list]:
        if self.enabled:
            self.end.synchronize()
        return [], []

    def elapsed(self) -> float | None:
        return self.begin.elapsed_time(self.end) / 1000 if self.enabled else None


def aligned_rows(tokens: np.ndarray, device: torch.device) -> torch.Tensor:
    """The step's [4, T] inputs on the device with each row starting on a 64-byte boundary. Triton compiles a kernel
    once per combination of its pointers' 16-byte alignment: rows T int64s apart left every other row unaligned
    when T was odd, so the first eager step of odd length compiled a second variant of the K/V write
    (norm_rope_store_ reads the slot offsets, row 3) on a request's path, hundreds of milliseconds."""
    t = tokens.shape[1]
    width = row_width(t)
    if width != t:
        padded = np.zeros((tokens.shape[0], width), dtype=tokens.dtype)
        padded[:, :t] = tokens
        tokens = padded
    return torch.from_numpy(tokens).to(device)[:, :t]


def warm_kernels(model_dir: str, dtype: torch.dtype, device: torch.device, attention, block_size: int,
                 prompt_tokens: int = 24, quantization: str | None = None, kv_dtype: torch.dtype | None = None
                 ) -> dict[str, float]:
    """One prefill and one greedy draw through a single decoder layer of the model's shape on throwaway weights,
    so a restored replica's first request does not pay what the first forward pays once per process: cuBLAS's
    handle and kernels for each product shape, the loading of torch's, Triton's and flashinfer's kernels. Runs on
    the attention thread while the weights stream in (the warm-up forward a full boot runs needs the weights);
    its memory is given back before the KV cache is sized. Tensors match the real ones in shape, dtype and strides,
    so Triton specialises the same way; the values are garbage and nothing of them is kept. Returns the seconds of
    its parts (model, prefill, release), each waiting for its own work on the device (its stream only: the
    weights' copies on theirs go on)."""
    from .models.loader import ARCHITECTURES, empty_model
    from .sampling import SamplingParams

    phases: dict[str, float] = {}
    began = time.perf_counter()

    def done(phase: str) -> None:
        nonlocal began
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        phases[phase], began = time.perf_counter() - began, time.perf_counter()

    config = model_config(Path(model_dir))
    config.num_hidden_layers = 1
    # The embedding and head are the big throwaway tensors (1.2 GB each for Qwen3-8B): bounded, at the cost of the
    # head's product loading its kernel with the first request
    config.vocab_size = min(config.vocab_size, 32768)
    cls = ARCHITECTURES[config.model_type]
    with torch.no_grad():
        model = empty_model(cls, config, dtype, device, quantization=quantization)
        blocks = -(-prompt_tokens // block_size) + 1
        kv = torch.empty((blocks, 2, block_size, config.num_key_value_heads, model.head_dim),
                         dtype=kv_dtype or dtype, device=device)
        ids = torch.zeros(prompt_tokens, dtype=torch.long, device=device)
        positions = torch.arange(prompt_tokens, device=device)
        done("model")
        table = np.arange(blocks, dtype=np.int32)[None]
        slots = torch.arange(prompt_tokens, dtype=torch.long)
        lens = np.array([prompt_tokens], dtype=np.int32)
        attention.plan(AttentionBatch(lens, lens, table, np.array([blocks], dtype=np.int32),
                                      (slots // block_size).to(device), (slots % block_size).to(device)))
        hidden = model(ids, positions, attention, [kv])
        logits = model.compute_logits(hidden[-1:])
        greedy = SamplingParams(max_tokens=1, temperature=0.0)
        draw(logits.float(), [SamplingRow(greedy, [0] * prompt_tokens, [], None, [])])
        if attention_module.RAGGED_PREFILL and device.type == "cuda":
            # the prompt's next chunk, after its first in the cache: RAGGED_PREFILL's paged attention over a prefix
            # and its merge, whose modules load here, not on the first step that continues a cut prompt
            more = blocks * block_size - prompt_tokens
            lens, context = np.array([more], dtype=np.int32), np.array([prompt_tokens + more], dtype=np.int32)
            slots = torch.arange(prompt_tokens, prompt_tokens + more)
            attention.plan(AttentionBatch(lens, context, table, np.array([blocks], dtype=np.int32),
                                          (slots // block_size).to(device), (slots % block_size).to(device)))
            hidden = model(torch.zeros(more, dtype=torch.long, device=device), slots.to(device), attention, [kv])
        if quantization == "fp8" and fp8.DEFERRED and device.type == "cuda":
            # A step of fp8.DEFERRED_MIN_ROWS tokens: its products leave their scales to the norm and SiLU-mul
            # kernels (fp8.Unscaled), whose variants that take them compile here, not on the first step of that
            # many sequences
            rows = fp8.DEFERRED_MIN_ROWS
            blocks = -(-rows // block_size) + 1
            kv = torch.empty((blocks, 2, block_size, config.num_key_value_heads, model.head_dim),
                             dtype=kv_dtype or dtype, device=device)
            table, slots, lens = np.arange(blocks, dtype=np.int32)[None], torch.arange(rows), np.array([rows], np.int32)
            attention.plan(AttentionBatch(lens, lens, table, np.array([blocks], dtype=np.int32),
                                          (slots // block_size).to(device), (slots % block_size).to(device)))
            hidden = model(torch.zeros(rows, dtype=torch.long, device=device), torch.arange(rows, device=device),
                           attention, [kv])
        # No decode step: the batch-1 graph's single-row products (gemv.py) load with the first decode step, which
        # captures that graph anyway, rather than on this branch, which on the 4B shape is T2's critical one
        done("prefill")
    del model, kv, hidden, logits
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        # This thread's cuBLAS workspace (torch keeps one per handle and stream, outside what empty_cache frees);
        # no CUDA graph has been captured yet, so none refers to a workspace
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
            clear_workspaces()
        torch.cuda.empty_cache()  # the KV cache is sized from the free memory next
    done("release")
    return phases
