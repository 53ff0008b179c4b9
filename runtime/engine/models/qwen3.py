"""Qwen3: the Llama stack plus an RMSNorm over each head of q and k before RoPE."""
from .llama import LlamaAttention, LlamaForCausalLM, RMSNorm


class Qwen3Attention(LlamaAttention):
    def __init__(self, config, head_dim: int):
        super().__init__(config, head_dim)
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
