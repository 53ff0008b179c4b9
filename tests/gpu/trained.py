"""A briefly trained model for the GPU tests: confident where random weights are flat.

Random weights give flat next-token distributions: the first bf16 near-tie sends two greedy decoders apart, and
free-running agreement then measures the weights, not the engine. A trained model predicts with confidence, as
real models do on most tokens. The task here is learned in seconds: after a noise prefix (or a prefix shared by
many prompts, for prefix-cache hits), each sequence follows a fixed random successor map, so every token after
the chain's first is determined by the one before it. Attention still runs over the whole context, through the
paged KV cache. (A first version trained on copying repeated segments and on arithmetic progressions; in 75 s
per family on one H200 it learned neither: bench/results/engine_gpu.md.)
"""
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

FIRST_ID = 3            # ids 0-2 are pad, bos and eos
MAX_NOISE = 64          # up to this many random tokens precede the chain; the model learns to look past them


def successor(vocab: int, seed: int = 1234) -> torch.Tensor:
    """The fixed map (token - FIRST_ID) -> next token of every chain: one random cycle through all non-special ids,
    so no chain settles into a short loop."""
    order = torch.randperm(vocab - FIRST_ID, generator=torch.Generator().manual_seed(seed))
    nxt = torch.empty_like(order)
    nxt[order] = order.roll(-1)
    return nxt + FIRST_ID


def task(n: int, length: int, vocab: int, generator: torch.Generator,
         system: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """n sequences of `length` tokens, and per token whether the tokens before it determine it.

    Each starts with 0-MAX_NOISE random tokens, or with `system` (the same prefix in every row), then follows
    the successor map from a random first token.
    """
    nxt = successor(vocab)
    if system is None:
        noise = torch.randint(FIRST_ID, vocab, (n, MAX_NOISE), generator=generator)
        lengths = torch.randint(0, MAX_NOISE + 1, (n, 1), generator=generator)
    else:
        noise = system.expand(n, -1)
        lengths = torch.full((n, 1), len(system))
    chain = torch.empty(n, length, dtype=torch.long)
    chain[:, 0] = torch.randint(FIRST_ID, vocab, (n,), generator=generator)
    for i in range(1, length):
        chain[:, i] = nxt[chain[:, i - 1] - FIRST_ID]
    k = torch.arange(length) - lengths                     # position within the chain; negative in the prefix
    prefix = noise.gather(1, torch.arange(length).clamp(max=noise.shape[1] - 1).expand(n, -1))
    tokens = torch.where(k < 0, prefix, chain.gather(1, k.clamp(min=0)))
    return tokens, k >= 1


def prompts(n: int, vocab: int, generator: torch.Generator, system: torch.Tensor, longest: int = 300,
            continuation: int = 64) -> tuple[list[list[int]], list[list[int]]]:
    """n prompts of the task that end inside the chain, every other one behind `system`, and their true
    continuations."""
    plain = task(n - n // 2, longest + continuation, vocab, generator)
    shared = task(n // 2, longest + continuation, vocab, generator, system)
    batch, expected = [], []
    for i in range(n):
        tokens, determined = (row[i // 2] for row in (shared if i % 2 else plain))
        first = int(determined.nonzero()[0])
        cut = int(torch.randint(first, longest + 1, (1,), generator=generator))
        batch.append(tokens[:cut].tolist())
        expected.append(tokens[cut:cut + continuation].tolist())
    return batch, expected


@dataclass
class Training:
    steps: int
    seconds: float
    loss: float                  # cross-entropy on the determined tokens, averaged over the last steps


def train(model, directory: str | Path, *, seconds: float, max_steps: int = 100_000, batch: int = 32,
          length: int = 512, lr: float = 1e-3, warmup: int = 50, target_loss: float = 0.02,
          seed: int = 0, log_every: int = 50) -> Training:
    """Train a Hugging Face causal LM in place on `task` (AdamW, bf16 autocast on CUDA over fp32 weights) until
    the determined tokens' loss falls under `target_loss`, `seconds` pass or `max_steps` are done; save it."""
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0, fused=cuda)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    model.train()
    begin, average, step = time.perf_counter(), None, 0
    while step < max_steps and time.perf_counter() - begin < seconds and (average is None or average > target_loss):
        step += 1
        tokens, determined = (t.to(device) for t in task(batch, length, model.config.vocab_size, generator))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            logits = model(input_ids=tokens, use_cache=False).logits
        losses = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten(), reduction="none")
        optimizer.zero_grad(set_to_none=True)
        losses.mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        known = losses.detach()[determined[:, 1:].flatten()].mean().item()
        average = known if average is None else 0.9 * average + 0.1 * known
        if step % log_every == 0:
            print(f"  step {step}: loss {losses.mean().item():.3f}, on determined tokens {average:.4f}, "
                  f"{time.perf_counter() - begin:.1f} s", flush=True)
    model.eval()
    model.save_pretrained(directory)
    return Training(step, time.perf_counter() - begin, average)
