"""Llama and Qwen2 decoder stacks (GQA, RoPE with scaling, optional QKV bias, tied or untied embeddings).

Module names follow Hugging Face's so safetensors weights load by name, except two merged projections: q, k and v
are one `qkv_proj` and gate and up one `gate_up_proj` (at batch 1 one product reads the weights faster than three
small ones, and launches once). Products of a single row (batch-1 decode) take gemv.py's kernel where it beats
cuBLAS. `quantize_fp8` makes every decoder product's weight FP8 (fp8.py), before the loader allocates them. The
loader copies each Hugging Face tensor into its rows (the parts are listed in ember.snapshot.writer.MERGED_PROJECTIONS,
so that a snapshot built from a model directory has this layout too).
"""
import torch
from torch import nn

from .. import fp8, fused, gemv


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x) in one pass."""
        return fused.add_rms_norm(x, residual, self.weight, self.eps)


class MergedLinear(gemv.Linear):
    """One product for several of Hugging Face's projections of the same input, their rows stacked in order."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool):
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_sizes = shard_sizes

    def shard_rows(self, index: int) -> slice:
        start = sum(self.shard_sizes[:index])
        return slice(start, start + self.shard_sizes[index])


class Rotary:
    """Rotate-half RoPE; the frequencies and scaling come from the config's rope parameters."""

    def __init__(self, config, head_dim: int):
        with torch.device("cpu"):   # the model itself may be built on the meta device
            self.inv_freq, self.scaling = self._frequencies(config, head_dim)

    @staticmethod
    def _frequencies(config, head_dim: int) -> tuple[torch.Tensor, float]:
        params = getattr(config, "rope_parameters", None) or {
            **(getattr(config, "rope_scaling", None) or {}), "rope_theta": getattr(config, "rope_theta", 10000.0)}
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type == "default":
            exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
            return 1.0 / (params["rope_theta"] ** exponent), 1.0
        if rope_type in ("linear", "llama3", "yarn"):
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
            return ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
        raise ValueError(f"rope type {rope_type!r} is not supported: use default, linear, llama3 or yarn")

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype)[:, None, :], (emb.sin() * self.scaling).to(dtype)[:, None, :]


class LlamaAttention(nn.Module):
    def __init__(self, config, head_dim: int):
        super().__init__()
        self.q_norm: RMSNorm | None = None   # Qwen3 normalises each head of q and k before RoPE
        self.k_norm: RMSNorm | None = None
        self.eps = config.rms_norm_eps
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = head_dim
        # Qwen2 configs carry no attention_bias and always have a QKV bias (and none on o_proj).
        qkv_bias, o_bias = getattr(config, "attention_bias", True), getattr(config, "attention_bias", False)
        h = config.hidden_size
        self.qkv_sizes = [self.num_heads * head_dim, self.num_kv_heads * head_dim, self.num_kv_heads * head_dim]
        self.qkv_proj = MergedLinear(h, self.qkv_sizes, bias=qkv_bias)
        self.o_proj = gemv.Linear(self.num_heads * head_dim, h, bias=o_bias)

    def attend(self, qkv, cos, sin, attention, kv_cache, keep=None):
        """The layer's attention from its merged q/k/v product [T, q + 2 kv]; with `keep` (row indices), o_proj's
        output for those rows alone (K and V are written for every row)."""
        t = qkv.shape[0]
        scales = None
        if isinstance(qkv, fp8.Unscaled):   # the RoPE kernel scales q, k and v as it loads them
            qkv, scales = qkv.raw, (qkv.row_scale, qkv.col_scale)
        # Views into the one product's rows: RoPE rewrites q and k in place, attention reads them strided.
        q, k, v = qkv.split(self.qkv_sizes, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        norms = (self.q_norm.weight, self.k_norm.weight) if self.q_norm is not None else (None, None)
        batch = attention.batch
        fused.norm_rope_store_(q, k, v, cos, sin, *norms, self.eps, kv_cache, batch.slot_blocks, batch.slot_offsets,
                               scales)
        # an FP8 o_proj's input may come quantized from the attention kernel (paged_decode.QUANTIZED_OUT)
        out = attention.attend(q, kv_cache, k, v,
                               quantize=self.o_proj.weight_scale is not None and t > 1 and keep is None)
        if isinstance(out, tuple):
            return self.o_proj.deferred_quantized(*out, q.dtype)
        out = out.reshape(t, self.num_heads * self.head_dim)
        if keep is not None:
            out = out[keep]
        return self.o_proj.deferred(out)   # the next norm scales it


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported: only silu")
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = MergedLinear(config.hidden_size, [config.intermediate_size] * 2, bias=bias)
        self.down_proj = gemv.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def down(self, gate_up):
        """The down product of SiLU(gate) * up, from the merged gate/up product [T, 2 intermediate]."""
        down = self.down_proj
        return gemv.silu_mul_linear(gate_up, down.weight, down.bias, down.weight_scale, defer=True)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, head_dim: int, attention_cls):
        super().__init__()
        self.self_attn = attention_cls(config, head_dim)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, residual, cos, sin, attention, kv_cache, keep=None):
        """`x`: the previous layer's output, not yet added to `residual` (None before the first layer). Returns
        this layer's output and the residual stream, whose sum the next norm takes in the same kernel; each norm
        runs as part of its product's input (gemv.norm_linear: inside the product at batch 1 on CUDA, and with FP8
        weights quantizing the normed rows). With FP8 weights the o, gate/up and down products (with
        fp8.DEFERRED_QKV also q/k/v) may leave their scales to the kernel that reads their output (fp8.Unscaled):
        the norms', the SiLU-mul's (and the RoPE kernel's). `keep` (row indices): everything after the attention
        for those rows alone, whose output and residual it returns (the model's last layer, ModelRunner's
        LAST_LAYER_ROWS)."""
        norm, qkv_proj = self.input_layernorm, self.self_attn.qkv_proj
        qkv, residual = gemv.norm_linear(x, residual, norm.weight, norm.eps, qkv_proj.weight, qkv_proj.bias,
                                         qkv_proj.weight_scale, defer=fp8.DEFERRED_QKV)
        h = self.self_attn.attend(qkv, cos, sin, attention, kv_cache, keep)
        if keep is not None:
            residual = residual[keep]
        norm, gate_up_proj = self.post_attention_layernorm, self.mlp.gate_up_proj
        gate_up, residual = gemv.norm_linear(h, residual, norm.weight, norm.eps, gate_up_proj.weight,
                                             gate_up_proj.bias, gate_up_proj.weight_scale, defer=True)
        return self.mlp.down(gate_up), residual


class LlamaModel(nn.Module):
    def __init__(self, config, head_dim: int, attention_cls):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, head_dim, attention_cls) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    attention_cls = LlamaAttention

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.model = LlamaModel(config, self.head_dim, self.attention_cls)
        self.lm_head = gemv.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(config, self.head_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention, kv_caches,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] for the flattened tokens of one step; with `keep` (row indices, the rows the
        step samples from), those rows' alone [len(keep), hidden]: the last layer writes every row's K and V, and
        runs its o, gate/up and down products and the final norm for those rows only, since no later layer reads
        the others."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        residual = None
        last = len(self.model.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):
            x, residual = layer(x, residual, cos, sin, attention, kv_cache, keep if i == last else None)
        return self.model.norm.add(x, residual)[0]

    def quantize_fp8(self) -> None:
        """FP8 weights, each with a scale per row, for the decoder's products; the embedding and head keep the
        model's dtype, as does a product whose sizes FP8 tensor cores cannot take (not multiples of 16). On the meta
        device, before the loader allocates the parameters."""
        for layer in self.model.layers:
            for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                           layer.mlp.down_proj):
                if linear.in_features % 16 == 0 and linear.out_features % 16 == 0:
                    linear.to_fp8()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
