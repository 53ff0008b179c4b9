"""Sampling parameters and the sampler that turns a batch of logits into one token per row."""
import math
from dataclasses import dataclass, field

import torch

INT32_MAX = 2**31 - 1


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0           # 0 = greedy
    top_k: int = 0                     # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None            # same seed => same output
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None        # return logprob of the sampled token plus this many top alternatives
    min_tokens: int = 0

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError naming the bad field and its valid range. Every field is bounded: a value torch cannot
        hold (top_k=2**63, a NaN) must be refused here, not fail the step loop that serves every request."""
        floats = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
        checks = [(math.isfinite(getattr(self, name)), f"{name}={getattr(self, name)}: must be a finite number")
                  for name in floats] + [
            (1 <= self.max_tokens <= INT32_MAX, f"max_tokens={self.max_tokens}: must be in [1, {INT32_MAX}]"),
            (0 <= self.temperature <= 2, f"temperature={self.temperature}: must be in [0, 2] (0 means greedy)"),
            (0 <= self.top_k <= INT32_MAX, f"top_k={self.top_k}: must be in [0, {INT32_MAX}] (0 disables it)"),
            (self.seed is None or -(2**63) <= self.seed < 2**64, f"seed={self.seed}: must be in [-2**63, 2**64)"),
            (0 < self.top_p <= 1, f"top_p={self.top_p}: must be in (0, 1]"),
            (0 <= self.min_p <= 1, f"min_p={self.min_p}: must be in [0, 1]"),
            (0 < self.repetition_penalty <= 10,
             f"repetition_penalty={self.repetition_penalty}: must be in (0, 10] (1 disables it)"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty={self.presence_penalty}: must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, f"frequency_penalty={self.frequency_penalty}: must be in [-2, 2]"),
            (0 <= self.min_tokens <= self.max_tokens, f"min_tokens={self.min_tokens}: must be in [0, max_tokens]"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, f"logprobs={self.logprobs}: must be in [0, 20]"),
            (all(0 <= t < vocab_size for t in self.stop_token_ids),
             f"stop_token_ids={self.stop_token_ids}: every id must be in [0, {vocab_size})"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass
class SamplingRow:
    """What the sampler needs to know about one sequence of the batch."""
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    banned_token_ids: list[int]        # EOS/stop tokens while fewer than min_tokens were generated


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[dict | None]]:
    """Pick one token per row of `logits` [B, V]; return the ids and, where asked, their logprobs."""
    logits = logits.float()
    raw_logprobs = torch.log_softmax(logits, dim=-1) if any(r.params.logprobs is not None for r in rows) else None
    logits = logits.clone()
    for i, row in enumerate(rows):
        if row.params.has_penalties:
            _apply_penalties(logits[i], row)
        if row.banned_token_ids:
            logits[i, row.banned_token_ids] = float("-inf")

    token_ids = logits.argmax(dim=-1)
    random_rows = [i for i, r in enumerate(rows) if r.params.temperature > 0]
    if random_rows:
        index = torch.tensor(random_rows, device=logits.device)
        picked = _sample_random(logits[index], [rows[i] for i in random_rows])
        token_ids[index] = picked
    token_list = token_ids.tolist()
    return token_list, _logprobs(raw_logprobs, token_list, rows)


def _apply_penalties(logits: torch.Tensor, row: SamplingRow) -> None:
    vocab = logits.shape[-1]
    p = row.params
    output = torch.tensor(row.output_token_ids, dtype=torch.long, device=logits.device)
    counts = torch.bincount(output, minlength=vocab)[:vocab].to(logits.dtype)
    if p.repetition_penalty != 1.0:
        seen = counts > 0
        seen[torch.tensor(row.prompt_token_ids, dtype=torch.long, device=logits.device)] = True
        penalized = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
        logits.copy_(torch.where(seen, penalized, logits))
    logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def _sample_random(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    device = logits.device
    temperature = torch.tensor([r.params.temperature for r in rows], device=device).unsqueeze(1)
    logits = logits / temperature
    top_k = [r.params.top_k for r in rows]
    top_p = [r.params.top_p for r in rows]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        logits = _top_k_top_p(logits, top_k, top_p)
    probs = torch.softmax(logits, dim=-1)
    min_p = torch.tensor([r.params.min_p for r in rows], device=device).unsqueeze(1)
    if (min_p > 0).any():
        probs = torch.where(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0, probs)
    # Exponential race (argmax p/q, q ~ Exp(1)) draws from p; a per-request generator makes it reproducible.
    q = torch.empty_like(probs)
    for i, row in enumerate(rows):
        q[i].exponential_(generator=row.generator)
    return (probs / q).argmax(dim=-1)


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.tensor([kk if kk > 0 else vocab for kk in top_k], device=logits.device).unsqueeze(1)
    drop = rank >= k
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    before = probs.cumsum(dim=-1) - probs           # mass strictly above each token; the top token always stays
    p = torch.tensor(top_p, device=logits.device).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(before > p, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _logprobs(raw: torch.Tensor | None, token_ids: list[int], rows: list[SamplingRow]) -> list[dict | None]:
    out: list[dict | None] = [None] * len(rows)
    if raw is None:
        return out
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    width = max(rows[i].params.logprobs for i in wanted)
    index = torch.tensor(wanted, device=raw.device)
    top_values, top_ids = raw[index].topk(max(width, 1), dim=-1)
    chosen = raw[index, torch.tensor([token_ids[i] for i in wanted], device=raw.device)]
    top_values, top_ids, chosen = top_values.tolist(), top_ids.tolist(), chosen.tolist()
    for j, i in enumerate(wanted):
        n = rows[i].params.logprobs
        out[i] = {"token_id": token_ids[i], "logprob": chosen[j],
                  "top": list(zip(top_ids[j][:n], top_values[j][:n]))}
    return out
