"""Engine configuration: the one dataclass that says which model runs where and how big the batches are."""
import os
from dataclasses import dataclass, field

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_BACKENDS = ("auto", "flashinfer", "sdpa")


@dataclass
class EngineConfig:
    model: str  # a Hugging Face model directory (config.json + *.safetensors [+ tokenizer files])
    dtype: str = "auto"                # "auto": bf16 on CUDA, fp32 on CPU; or "float32"/"bfloat16"/"float16"
    device: str = "auto"               # "auto": cuda if available else cpu
    block_size: int = 16               # tokens per KV block
    num_kv_blocks: int | None = None   # None: from kv_cache_bytes, else gpu_memory_utilization on GPU, else
                                       # max_model_len for min(max_num_seqs, 64) sequences on CPU
    # The fraction of the GPU's memory this engine may take, weights, activations and KV cache together (as in
    # vLLM): engines of several small models share a GPU by giving each a part.
    gpu_memory_utilization: float = 0.9
    kv_cache_bytes: int | None = None  # a byte budget for the KV cache instead of gpu_memory_utilization
    # vLLM's defaults: a user who sets nothing gets batches large enough for the weights read by each decode step
    # to serve many sequences (on the H200 the 8B shape's offline run gave 4,375 output tok/s at 64 and 2048, an
    # older engine; 7,388 at 256 and 8192, this one)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192 # token budget per step (prefill chunks + decodes)
    max_model_len: int | None = None   # None: from config.max_position_embeddings
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"    # "flashinfer" on CUDA when importable, else "sdpa"
    enforce_eager: bool = False        # True disables CUDA graphs
    # Decode graphs of at least this many sequences run paged_decode's streamed Triton attention instead of
    # flashinfer's decode kernel (and, under 9, instead of paged_decode's split kernel); None: flashinfer's for
    # every batch over 8. On the H200 the streamed kernel is faster from 16 sequences (bench/engine/kernel_bench.py
    # --parts attention: 24.9 against 30.9 us at 16 x 1024 tokens, 245.8 against 365.2 us at 256 x 1024, the
    # bandwidth floor 254.7); --parts attention_small times it under 16.
    streamed_decode_min_batch: int | None = 16
    # "lazy": capture each decode graph on the first step that needs it or while the engine idles (a cold start
    # does not wait ~1.5 s for twenty captures); "start": all of them before the engine serves.
    graph_capture: str = "lazy"
    # Steps that prefill (eager without this) replay piecewise graphs of their padded token count, each layer's
    # attention run between them, up to the size where the GPU's work outlasts an eager step's host work
    # (prefill_graphs.py); captured as the decode graphs are. Off with enforce_eager.
    prefill_graphs: bool = True
    # CUDA: one throwaway decoder layer of the model's shape runs on the attention thread while the weights stream
    # in, so the first request does not load cuBLAS's, Triton's and flashinfer's kernels (~0.5 s on an H200).
    warm_kernels: bool = True
    # "fp8": each decoder product's weight quantized to float8 e4m3 as it loads, a scale per output row, and each
    # product's input per token as it runs (fp8.py): half the weight bytes, Hopper's FP8 tensor cores, outputs that
    # differ from the checkpoint's by the quantization's error. None (the default): the weights as the dtype holds.
    quantization: str | None = None
    # "fp8": the KV cache in float8 e4m3 (K and V rounded as they are stored, a scale of 1, values past e4m3's 448
    # clamped; attention reads them back to the model's dtype): half the cache's bytes, so twice the blocks in the
    # same memory and half the bytes each decode step's attention reads. "auto" (the default): the model's dtype.
    kv_cache_dtype: str = "auto"
    log_token_ids: bool = False        # log prompt/output token ids per request
    # Overlap scheduling: the host schedules and launches step N+1 while the device runs step N, whose tokens reach
    # step N+1's inputs on the device. A request with penalties or logprobs, or short of its min_tokens, needs its
    # tokens on the host before the next step, so while one is in the engine the steps run one at a time. On by
    # default: on the H200 it gained 6% at batch 1 and offline (bench/results/engine_speed.json).
    overlap: bool = True
    # How the step loop waits for each step's tokens on CUDA: "spin" polls, as CUDA does by default, holding a core
    # of the replica's host while the engine steps; "block" sleeps until the device signals (an event made with
    # blocking sync). On the H200, 8B shape, one run: online output tok/s the same at every concurrency (c1 214.8
    # against 215.3, c64 6,862 against 6,770) with the replica's CPU per token 1,255 against 4,766 us at c1 and 103
    # against 145 at c64; but the host's work per batch-64 step ran slower after each sleep (0.74 against 0.42 ms,
    # one process each), which a host-bound engine (a small model at small batches) would pay in tok/s. So "block"
    # is for hosts that pack replicas densely, and the default spins.
    device_wait: str = "spin"
    # Weight snapshots: "local" ($EMBER_HOME/snapshots) or "s3://bucket/prefix"; None boots from safetensors
    # every time. A replica of a snapshot=True function gets EMBER_SNAPSHOT_STORE from its worker.
    snapshot_store: str | None = field(default_factory=lambda: os.environ.get("EMBER_SNAPSHOT_STORE") or None)

    def __post_init__(self):
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: use one of {_DTYPES}")
        if self.attention_backend not in _BACKENDS:
            raise ValueError(f"attention_backend={self.attention_backend!r}: use one of {_BACKENDS}")
        if self.graph_capture not in ("lazy", "start"):
            raise ValueError(f"graph_capture={self.graph_capture!r}: use 'lazy' or 'start'")
        if self.block_size <= 0 or self.block_size % 8:
            raise ValueError(f"block_size={self.block_size}: use a positive multiple of 8, e.g. 16")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks}: use at least 1, or None to size it automatically")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes={self.kv_cache_bytes}: use a positive byte count, or None to size the "
                             "KV cache from gpu_memory_utilization")
        if self.snapshot_store not in (None, "local") and not self.snapshot_store.startswith("s3://"):
            raise ValueError(f"snapshot_store={self.snapshot_store!r} (EMBER_SNAPSHOT_STORE): use 'local', "
                             "'s3://bucket/prefix', or None for no snapshots")
        if self.streamed_decode_min_batch is not None and (
                not isinstance(self.streamed_decode_min_batch, int) or self.streamed_decode_min_batch < 1):
            raise ValueError(f"streamed_decode_min_batch={self.streamed_decode_min_batch!r}: use a batch size of at "
                             "least 1, or None for flashinfer's decode kernel")
        if self.device_wait not in ("block", "spin"):
            raise ValueError(f"device_wait={self.device_wait!r}: use 'block' (the step loop sleeps on the device) or "
                             "'spin' (it polls, a core busy while the engine steps)")
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization={self.quantization!r}: use 'fp8' (FP8 weights, a scale per row) or None")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r}: use 'fp8' (float8 e4m3) or 'auto' (the "
                             "model's dtype)")
        if not isinstance(self.prefill_graphs, bool):
            raise ValueError(f"prefill_graphs={self.prefill_graphs!r}: use True or False")
        if not isinstance(self.overlap, bool):
            raise ValueError(f"overlap={self.overlap!r}: use True or False")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization}: use a fraction in (0, 1]")
