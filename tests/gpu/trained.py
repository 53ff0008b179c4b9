"""A briefly trained model for the GPU tests, on a task whose continuations the context determines.

Random weights give flat next-token distributions: the first bf16 near-tie sends two greedy decoders apart and
free-running agreement then measures the weights, not the engine. A model trained for under a minute to copy a
repeated segment (induction over long distances: paged KV, RoPE positions, prefix reuse) or to continue an
arithmetic progression (tokens that are not in the context) predicts with confidence, as real models do.
"""
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

FIRST_ID = 3            # ids 0-2 are pad, bos and eos
MAX_NOISE = 64          # up to this many random tokens precede the pattern; the model learns to look past them
PERIODS = (8, 48)       # a repeated segment's length, inclusive
STRIDES = (1, 2)        # an arithmetic progression's step, inclusive: 2t - previous is learnable in a minute


def task(n: int, length: int, vocab: int, generator: torch.Generator,
         system: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """n sequences of `length` tokens, per token whether the tokens before it determine it, and which rows copy.

    Each starts with random noise of 0-MAX_NOISE tokens, or with `system` (a prefix shared by every row), then
    either repeats a random segment until the end or counts a, a+s, a+2s, ... mod (vocab - FIRST_ID).
    """
    span = vocab - FIRST_ID
    keys = torch.rand(n, span, generator=generator)
    if system is not None:
        assert len(system) <= MAX_NOISE
        keys[:, system - FIRST_ID] = -1.0       # the segment avoids the prefix's tokens: one place to copy from
    pool = keys.topk(MAX_NOISE + PERIODS[1]).indices   # distinct random tokens within a row
    if system is None:
        noise = torch.randint(0, MAX_NOISE + 1, (n, 1), generator=generator)
    else:
        pool[:, :len(system)] = system - FIRST_ID
        noise = torch.full((n, 1), len(system))
    period = torch.randint(PERIODS[0], PERIODS[1] + 1, (n, 1), generator=generator)
    start = torch.randint(0, span, (n, 1), generator=generator)
    stride = torch.randint(STRIDES[0], STRIDES[1] + 1, (n, 1), generator=generator)
    repeats = torch.rand(n, 1, generator=generator) < 0.5
    i = torch.arange(length)
    k = i - noise                              # position within the pattern; negative inside the noise
    copied = pool.gather(1, torch.where(k < 0, i, noise + k % period))
    counted = torch.where(k < 0, copied, (start + k * stride) % span)
    tokens = torch.where(repeats, copied, counted) + FIRST_ID
    # A copy is known once the segment's first token came back (before that a new segment may be starting);
    # a progression once two of its terms are seen.
    determined = k > torch.where(repeats, period, 1)
    return tokens, determined, repeats.squeeze(1)


def prompts(n: int, vocab: int, generator: torch.Generator, system: torch.Tensor, longest: int = 300,
            continuation: int = 64) -> tuple[list[list[int]], list[list[int]]]:
    """n prompts of the task that end mid-pattern, every other one behind `system`, and their true continuations."""
    plain = task(n - n // 2, longest + continuation, vocab, generator)
    shared = task(n // 2, longest + continuation, vocab, generator, system)
    batch, expected = [], []
    for i in range(n):
        tokens, determined, _ = (row[i // 2] for row in (shared if i % 2 else plain))
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
    copies: float                # the same on the repeated segments alone (induction is the slower to learn)


def train(model, directory: str | Path, *, seconds: float, max_steps: int = 100_000, batch: int = 32,
          length: int = 512, lr: float = 2e-3, warmup: int = 50, target_loss: float = 0.02,
          seed: int = 0, log_every: int = 50) -> Training:
    """Train a Hugging Face causal LM in place on `task` (AdamW, bf16 autocast on CUDA over fp32 weights) until
    the determined tokens' loss falls under `target_loss`, `seconds` pass or `max_steps` are done; save it."""
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0, fused=cuda)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    model.train()
    begin, average, copies, step = time.perf_counter(), None, None, 0
    while step < max_steps and time.perf_counter() - begin < seconds and (average is None or average > target_loss):
        step += 1
        tokens, determined, repeats = (t.to(device) for t in task(batch, length, model.config.vocab_size, generator))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            logits = model(input_ids=tokens, use_cache=False).logits
        losses = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten(), reduction="none")
        optimizer.zero_grad(set_to_none=True)
        losses.mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        known, copied = _mean_losses(losses.detach().view(batch, -1), determined[:, 1:], repeats)
        average = known if average is None else 0.9 * average + 0.1 * known
        copies = copied if copies is None else 0.9 * copies + 0.1 * copied
        if step % log_every == 0:
            print(f"  step {step}: loss {losses.mean().item():.3f}, on determined tokens {average:.4f} "
                  f"(copies {copies:.4f}), {time.perf_counter() - begin:.1f} s", flush=True)
    model.eval()
    model.save_pretrained(directory)
    return Training(step, time.perf_counter() - begin, average, copies)


def _mean_losses(losses: torch.Tensor, determined: torch.Tensor, repeats: torch.Tensor) -> tuple[float, float]:
    copied = determined & repeats[:, None]
    return losses[determined].mean().item(), losses[copied].mean().item() if copied.any() else float("nan")
