"""One request as the engine sees it: its tokens, how many of them are in the KV cache, and its blocks."""
import enum
from collections.abc import Set

import torch

from .grammar import Matcher
from .sampling import SamplingParams, SamplingRow


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 generator: torch.Generator | None = None, eos_token_ids: Set[int] = frozenset(),
                 max_model_len: int | None = None):
        self.request_id = request_id
        self.group = request_id   # the API request it is part of (n choices, a batch): the scheduler's fair share
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        # What ends it, checked per token: a token of stop_ids once past min_tokens ("stop"), or reaching max_len
        # tokens ("length": max_tokens or max_model_len, the first reached)
        self.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_token_ids)
        self.max_len = len(prompt_token_ids) + params.max_tokens
        if max_model_len is not None:
            self.max_len = min(self.max_len, max_model_len)
        self.generator = generator
        # where the output is in the format it is held to (params.grammar), one per sequence: n choices each have one
        self.matcher = Matcher(params.grammar) if params.grammar is not None else None
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chain hashes of the full blocks at the head of block_table
        self.block_row = -1            # its row in BlockManager.tables while it holds blocks
        self.sampling_row: SamplingRow | None = None   # the sampler's view, once it no longer changes per step
        self.num_computed_tokens = 0   # tokens whose K/V are in the cache
        self.num_cached_tokens = 0     # prompt tokens served from the prefix cache on first admission
        self.num_preemptions = 0
        self.yielded = False           # last preempted to give its slot to a request with none running
        self.finish_reason: str | None = None

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids the host knows: all but the placeholders at the tail, which stand for tokens a step
        launched with overlap scheduling is still sampling (-1 - j: row j of that step's sampled tokens)."""
        n = len(self.token_ids)
        while n and self.token_ids[n - 1] < 0:
            n -= 1
        return n

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, tokens={len(self)}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table})")
