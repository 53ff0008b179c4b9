"""Sampling parameters and the sampler that turns a batch of logits into one token per row."""
import math
from dataclasses import dataclass, field

import torch

from .grammar import Grammar, Matcher, mask_logits

INT32_MAX = 2**31 - 1
LOGIT_BIAS_MAX_TOKENS = 300   # as OpenAI's API allows


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
    logit_bias: dict[int, float] = field(default_factory=dict)   # token id -> added to its logit (OpenAI's)
    # the format the output is held to (grammar.py), compiled for this model's vocabulary; None: free text
    grammar: Grammar | None = field(default=None, compare=False)

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
            (len(self.logit_bias) <= LOGIT_BIAS_MAX_TOKENS,
             f"logit_bias: at most {LOGIT_BIAS_MAX_TOKENS} tokens, got {len(self.logit_bias)}"),
            (all(isinstance(t, int) and 0 <= t < vocab_size for t in self.logit_bias),
             f"logit_bias: every token id must be in [0, {vocab_size})"),
            (all(math.isfinite(b) and -100 <= b <= 100 for b in self.logit_bias.values()),
             "logit_bias: every bias must be in [-100, 100]"),
        ]
        if self.grammar is not None and self.grammar.vocab_size != vocab_size:
            checks.append((False, f"grammar: compiled for a vocabulary of {self.grammar.vocab_size} tokens, the model "
                                  f"has {vocab_size}: compile it with this engine's tokenizer"))
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
    allowed: torch.Tensor | None = None   # a format's bitmask of the tokens it allows next (grammar.Matcher)
    # the sequence's place in its format, whose mask the runner writes into `allowed` once the forward is queued
    matcher: Matcher | None = None
    # greedy with nothing to adjust or report: a batch of such rows is one argmax
    plain: bool = field(init=False)

    def __post_init__(self):
        p = self.params
        self.plain = (p.temperature == 0 and not p.has_penalties and not self.banned_token_ids
                      and p.logprobs is None and not p.logit_bias and self.allowed is None and self.matcher is None)


@dataclass
class DrawnLogprobs:
    """The logprobs of the rows that asked for them, still on the device."""
    rows: dict[int, int]                     # row -> how many top alternatives it asked for
    chosen: torch.Tensor                     # [len(rows)]
    top_values: torch.Tensor                 # [len(rows), width]
    top_ids: torch.Tensor


@dataclass
class Draws:
    """One token per row, still on the device; `to_host` is the step's one synchronisation."""
    token_ids: torch.Tensor                  # [B]
    rows: list[SamplingRow]
    logprobs: DrawnLogprobs | None           # None when no row asked for logprobs

    def to_host(self) -> tuple[list[int], list[dict | None]]:
        token_ids = self.token_ids.tolist()
        return token_ids, self.logprobs_to_host(token_ids)

    def copy_to_host(self, buffer: torch.Tensor, done: "torch.cuda.Event | None" = None) -> "HostCopy":
        """Start copying the tokens into `buffer` (host memory, pinned on CUDA) without waiting for them; the
        buffer must not be reused before `HostCopy.result` returned. `done`: the event to record after the copy
        (on CUDA; a new one by default)."""
        host = buffer[:len(self.token_ids)]
        host.copy_(self.token_ids, non_blocking=True)
        event = None
        if self.token_ids.is_cuda:
            event = done if done is not None else torch.cuda.Event()
            event.record()
        return HostCopy(self, host, event)

    def logprobs_to_host(self, token_ids: list[int]) -> list[dict | None]:
        out: list[dict | None] = [None] * len(self.rows)
        if self.logprobs is None:
            return out
        drawn = self.logprobs
        chosen, values, ids = drawn.chosen.tolist(), drawn.top_values.tolist(), drawn.top_ids.tolist()
        for j, (i, n) in enumerate(drawn.rows.items()):
            out[i] = {"token_id": token_ids[i], "logprob": chosen[j], "top": list(zip(ids[j][:n], values[j][:n]))}
        return out


@dataclass
class HostCopy:
    """Draws' tokens on their way to host memory: `result` waits for the copy only, not for later work."""
    draws: Draws
    host: torch.Tensor                       # [B] the slice of the buffer the copy writes
    event: torch.cuda.Event | None           # recorded after the copy on CUDA; None on CPU (copied already)

    def result(self) -> tuple[list[int], list[dict | None]]:
        if self.event is not None:
            self.event.synchronize()
        token_ids = self.host.tolist()
        return token_ids, self.draws.logprobs_to_host(token_ids)


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[dict | None]]:
    """Pick one token per row of `logits` [B, V]; return the ids and, where asked, their logprobs."""
    return draw(logits, rows).to_host()


def draw(logits: torch.Tensor, rows: list[SamplingRow]) -> Draws:
    """The batch's tokens on the device: a handful of batched kernels, whatever the mix of parameters, and no
    synchronisation (the per-row parameters go over as one small copy each)."""
    if all(r.plain for r in rows):   # greedy fast path: one argmax
        return Draws(logits.argmax(dim=-1), rows, None)
    asked = {i: r.params.logprobs for i, r in enumerate(rows) if r.params.logprobs is not None}
    # fp32 log-softmax of the rows that asked only: a full-vocabulary copy per row is 0.6 MB at 151936 tokens
    logprob_index = _device(logits, list(asked), torch.long) if asked else None
    raw_logprobs = torch.log_softmax(logits[logprob_index].float(), dim=-1) if logprob_index is not None else None
    penalized = [i for i, r in enumerate(rows) if r.params.has_penalties]
    banned = [(i, t) for i, r in enumerate(rows) for t in r.banned_token_ids]
    biased = [(i, t, b) for i, r in enumerate(rows) for t, b in r.params.logit_bias.items()]
    random_rows = [i for i, r in enumerate(rows) if r.params.temperature > 0]
    constrained = [(i, r.allowed) for i, r in enumerate(rows) if r.allowed is not None]
    if not (penalized or banned or biased or random_rows or constrained):   # greedy fast path: one argmax
        token_ids = logits.argmax(dim=-1)
    else:
        logits = logits.float().clone()
        if penalized:
            _apply_penalties(logits, [rows[i] for i in penalized], penalized)
        if biased:   # after the penalties, as OpenAI and vLLM apply it; a ban below still wins
            row_index, token_index, bias = zip(*biased)
            logits.index_put_((_device(logits, list(row_index), torch.long), _device(logits, list(token_index),
                              torch.long)), _device(logits, list(bias), torch.float32), accumulate=True)
        if banned:
            row_index, token_index = _device(logits, list(zip(*banned)), torch.long)
            logits[row_index, token_index] = float("-inf")
        if constrained:   # last: a token the format leaves out stays out whatever its bias
            mask_logits(logits, [i for i, _ in constrained], [allowed for _, allowed in constrained])
        token_ids = logits.argmax(dim=-1)
        if random_rows:
            index = _device(logits, random_rows, torch.long)
            token_ids[index] = _sample_random(logits[index], [rows[i] for i in random_rows])
    if logprob_index is None or raw_logprobs is None:
        return Draws(token_ids, rows, None)
    top_values, top_ids = raw_logprobs.topk(max(1, *asked.values()), dim=-1)
    chosen = raw_logprobs.gather(1, token_ids[logprob_index].unsqueeze(1)).squeeze(1)
    return Draws(token_ids, rows, DrawnLogprobs(asked, chosen, top_values, top_ids))


def _device(like: torch.Tensor, values: list, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(like.device, non_blocking=True)


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow], index: list[int]) -> None:
    """Penalties of several rows at once: token counts by one scatter over all their output tokens."""
    vocab = logits.shape[-1]
    sub = logits[_device(logits, index, torch.long)]
    out_rows = [j for j, r in enumerate(rows) for _ in r.output_token_ids]
    out_tokens = [t for r in rows for t in r.output_token_ids]
    counts = torch.zeros_like(sub)
    if out_tokens:
        flat = _device(logits, [j * vocab + t for j, t in zip(out_rows, out_tokens)], torch.long)
        counts.view(-1).index_add_(0, flat, torch.ones(len(out_tokens), device=logits.device))
    repetition = _device(logits, [r.params.repetition_penalty for r in rows], torch.float32).unsqueeze(1)
    if any(r.params.repetition_penalty != 1.0 for r in rows):
        seen = counts > 0
        prompt = [(j, t) for j, r in enumerate(rows) for t in r.prompt_token_ids]
        if prompt:
            seen[tuple(_device(logits, list(zip(*prompt)), torch.long))] = True
        penalized = torch.where(sub > 0, sub / repetition, sub * repetition)
        sub = torch.where(seen, penalized, sub)
    frequency = _device(logits, [r.params.frequency_penalty for r in rows], torch.float32).unsqueeze(1)
    presence = _device(logits, [r.params.presence_penalty for r in rows], torch.float32).unsqueeze(1)
    sub = sub - frequency * counts - presence * (counts > 0).to(sub.dtype)
    logits[_device(logits, index, torch.long)] = sub


def _sample_random(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    temperature = _device(logits, [r.params.temperature for r in rows], torch.float32).unsqueeze(1)
    logits = logits / temperature
    top_k = [r.params.top_k for r in rows]
    top_p = [r.params.top_p for r in rows]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        logits = _top_k_top_p(logits, top_k, top_p)
    probs = torch.softmax(logits, dim=-1)
    if any(r.params.min_p > 0 for r in rows):
        min_p = _device(logits, [r.params.min_p for r in rows], torch.float32).unsqueeze(1)
        probs = torch.where(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0, probs)
    # Exponential race (argmax p/q, q ~ Exp(1)) draws from p. Rows without a seed share one draw; a seeded row
    # draws from its own generator, so its tokens do not depend on its neighbours.
    q = torch.empty_like(probs).exponential_()
    for i, row in enumerate(rows):
        if row.generator is not None:
            q[i].exponential_(generator=row.generator)
    return (probs / q).argmax(dim=-1)


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = _device(logits, [kk if 0 < kk < vocab else vocab for kk in top_k], torch.long).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    before = probs.cumsum(dim=-1) - probs           # mass strictly above each token; the top token always stays
    p = _device(logits, top_p, torch.float32).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(before > p, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
