"""Build a model from a Hugging Face directory: config.json picks the architecture, safetensors fill the weights."""
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig

from .llama import LlamaForCausalLM
from .qwen3 import Qwen3ForCausalLM

ARCHITECTURES = {"llama": LlamaForCausalLM, "qwen2": LlamaForCausalLM, "qwen3": Qwen3ForCausalLM}


def load_model(model_dir: str, dtype: torch.dtype, device: torch.device):
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise ValueError(f"{model_dir!r} has no config.json: pass a Hugging Face model directory")
    config = AutoConfig.from_pretrained(path)
    cls = ARCHITECTURES.get(config.model_type)
    if cls is None:
        raise ValueError(f"model_type {config.model_type!r} is not supported: use one of {sorted(ARCHITECTURES)}")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir!r} has no *.safetensors weights")
    with torch.device("meta"):
        model = cls(config)
    model = model.to_empty(device=device).to(dtype)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = set(params)
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                if name not in params:
                    continue
                params[name].data.copy_(f.get_tensor(name))
                missing.discard(name)
    if config.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"weights missing from {model_dir!r}: {sorted(missing)[:5]}")
    return model.eval(), config
