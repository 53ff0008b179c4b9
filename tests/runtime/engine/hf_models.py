"""Tiny random-weight models of the real architectures, saved as Hugging Face directories, plus their reference."""
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

VOCAB = 500
EOS = 2
_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, initializer_range=0.1,
               bos_token_id=1, eos_token_id=EOS, pad_token_id=0)

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, dict(rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}, num_hidden_layers=3)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=32, num_key_value_heads=1)),
}


def build(family: str, directory, seed: int = 0):
    """Save a random model of `family` to `directory`; return the transformers model (fp32, eval)."""
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**_COMMON, **extra})).eval()
    model.save_pretrained(directory)
    return model


def reference_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy continuation, ignoring EOS."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def random_prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Keep special ids (0..2) out of prompts so EOS only appears when the model emits it.
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def logprob_gaps(outputs: list[list[dict]], prompts: list[list[int]], reference, exact
                 ) -> tuple[list[bool], list[float], list[float]]:
    """For each token the engine drew after each prompt (`outputs[i]`, its logprob entries): whether `reference`'s
    greedy choice at that position is the same token, and how far the engine's logprob of it is from the
    `reference` model's and from the `exact` one's (both transformers models, fed the engine's own tokens)."""
    same_token, to_reference, to_exact = [], [], []
    with torch.no_grad():
        for prompt, ours in zip(prompts, outputs):
            sequence = torch.tensor([prompt + [entry["token_id"] for entry in ours]])
            expected = torch.log_softmax(reference(sequence).logits[0, len(prompt) - 1:-1], dim=-1)
            unrounded = torch.log_softmax(exact(sequence).logits[0, len(prompt) - 1:-1], dim=-1)
            for j, entry in enumerate(ours):
                same_token.append(entry["token_id"] == expected[j].argmax().item())
                to_reference.append(abs(entry["logprob"] - expected[j, entry["token_id"]].item()))
                to_exact.append(abs(entry["logprob"] - unrounded[j, entry["token_id"]].item()))
    return same_token, to_reference, to_exact
