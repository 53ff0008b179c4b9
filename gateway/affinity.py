"""Which replica serves a request: rendezvous hashing with bounded load. Pure functions.

    replicas = [ReplicaLoad("r1", load=3), ReplicaLoad("r2", load=5), ...]
    key = request.headers.get("X-Session-ID") or prefix_key(prompt_text(body))
    replica_id = pick(key, replicas) if key else <least loaded>      # epsilon=DEFAULT_EPSILON

`pick` ranks replicas by a stable hash of (key, replica id), highest first, and takes
the first whose load after this request stays within ceil((1+ε)·(total+1)/n), where
total is the sum of the given loads: no replica ends up above (1+ε)× the mean, and
one always qualifies (the least loaded one does). Adding or removing a replica only
moves the keys whose top-ranked replica changed, plus the few the bound pushes on.
`pick` keeps no state: a key stays on its replica while that replica is within the
bound, spills to its next-ranked one while it is not, and returns when load drops.
`load` is whatever the caller balances — in-flight requests for prefix routing, live
sessions for session affinity — as long as it counts the same thing for every replica.

Without a session, LLM requests route by `prefix_key`: a hash of the start of the
prompt, cut at a block boundary, so requests that share a long prefix (system prompt,
few-shot examples, earlier turns) reach the replica whose prefix cache holds it.
"""

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

DEFAULT_EPSILON = (
    0.25  # the usual choice for bounded-load hashing: hot keys spill before a replica runs 25% over the mean
)
PREFIX_BLOCK_CHARS = 64  # ~16 tokens, one KV-cache block: shorter shared prefixes save too little to route on
PREFIX_MAX_CHARS = (
    512  # ~128 tokens: a shared prefix this long is worth a trip to its replica; later text is per-request
)


@dataclass(frozen=True)
class ReplicaLoad:
    id: str
    load: int


def weight(key: str, replica_id: str) -> int:
    """The rendezvous weight of a replica for a key; stable across processes and restarts."""
    digest = hashlib.blake2b(f"{key}\x00{replica_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def load_cap(total: int, n: int, epsilon: float, added: int = 1) -> int:
    """The most load any replica may carry once `added` more units are placed among n replicas."""
    return math.ceil((1 + epsilon) * (total + added) / n)


def pick(key: str, replicas: Sequence[ReplicaLoad], epsilon: float = DEFAULT_EPSILON, adding: int = 1) -> str:
    """The highest-ranked replica for `key` whose load stays within the bound once it takes `adding` more (an LLM
    request's sequences)."""
    if not replicas:
        raise ValueError("pick() needs at least one replica")
    if epsilon < 0:
        raise ValueError(f"epsilon must be >= 0 (0.1-0.5 is usual), got {epsilon}")
    cap = load_cap(sum(r.load for r in replicas), len(replicas), epsilon, adding)
    best = min(replicas, key=lambda r: (r.load + adding > cap, -weight(key, r.id)))
    return best.id


def prompt_text(body: Mapping) -> str | None:
    """The text an OpenAI completion, chat or response request starts with, as the engine will see it first."""
    messages = body.get("messages")
    if messages is None and "input" in body:   # a response: its instructions, then its input, as chat messages
        instructions, given = body.get("instructions"), body.get("input")
        if not isinstance(given, (str, list)):
            return None   # not an input the engine takes: it answers 400, from any replica
        messages = [{"role": "system", "content": instructions}] if instructions else []
        messages += [{"role": "user", "content": given}] if isinstance(given, str) else given
    if messages:
        if not isinstance(messages, list):
            return None   # not a chat the engine takes: it answers 400, from any replica
        # Role and content in order is what the chat template renders; the exact template doesn't matter for routing.
        return "".join(f"{m.get('role', '')}\x1f{json.dumps(m.get('content'), sort_keys=True)}\x1e"
                       for m in messages if isinstance(m, dict)) or None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch routes by its first prompt
    if isinstance(prompt, list):
        return " ".join(map(str, prompt)) or None  # token ids
    return prompt if isinstance(prompt, str) else None


def prefix_key(text: str | None, block: int = PREFIX_BLOCK_CHARS, max_chars: int = PREFIX_MAX_CHARS) -> str | None:
    """A key shared by prompts with the same first `max_chars` characters, cut down to whole blocks.

    None when the prompt is shorter than one block: there is no prefix worth routing for.
    """
    if not text:
        return None
    length = min(len(text), max_chars) // block * block
    if length == 0:
        return None
    # JSON may carry lone surrogates ("\ud800"), which strict UTF-8 refuses: keyed as they are (the engine refuses them)
    return "prefix:" + hashlib.blake2b(text[:length].encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
