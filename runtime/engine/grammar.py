"""Constrained decoding: a reply held to a format (a JSON schema, a regex, a list of choices, a tool call), token by
token.

A format is written in xgrammar's structural-tag language (serving/formats.py builds it from an OpenAI request);
`Grammars` compiles it against this model's vocabulary, once per distinct format (xgrammar caches it), in the
caller's thread: the server compiles off its event loop. Each constrained sequence gets its own `Matcher`. Before a
step samples the sequence, the matcher writes the tokens the format allows next into a bitmask; the sampler sets
every other token's logit to -inf. After the step the sampled token advances the matcher, and a format that is
complete ends the sequence ("stop"). A mask follows from the step before's token, so with overlap scheduling a step
that holds a sequence launches its forward pass before that token is on the host, and its sampling once the token has
advanced the matcher (engine.py `_overlap_step`); the step's masks are written meanwhile, while the forward pass runs
(`MaskFiller`: from THREADED_ROWS rows, one call over several host threads).

xgrammar is never imported on a replica's start path. A GPU replica imports it and reads the vocabulary (0.6-1 s for
152k tokens on the H200 machine) once it idles after its start (`Grammars.warm`); elsewhere the first constrained
request does (about 1.4 s more on a 2-core machine, most of it transformers' own import).
"""
import functools
import importlib.util
import json
import logging
import os
import threading
import time
from collections.abc import Iterable
from typing import Any

import torch

logger = logging.getLogger(__name__)

COMPILE_THREADS = 2                # per replica: compiling shares the host with the engine's step loop
CACHE_BYTES = 256 << 20            # compiled formats kept for reuse (xgrammar's cache evicts past it)
FILL_THREADS = max(1, min(8, (os.cpu_count() or 2) // 2))   # per replica: a step's masks, written side by side
# Fewer masks than this are written one after another: handing rows to threads costs ~0.8 ms a call on the H200
# machine, where one row of a JSON schema takes 0.04-0.09 ms (bench/engine/structured.py: 16 rows 0.7 ms alone,
# 0.9-1.1 ms together; 64 rows 5.7 ms alone, 1.8 ms together)
THREADED_ROWS = 24
INSTALL_HINT = "install xgrammar on the replica (pip install 'xgrammar>=0.2.9')"


class FormatError(ValueError):
    """The format cannot be compiled (a schema feature xgrammar lacks, a bad regex): the request's fault."""


class Grammar:
    """A compiled format for one vocabulary; shared by every sequence that asks for it."""
    __slots__ = ("compiled", "vocab_size", "description")

    def __init__(self, compiled: Any, vocab_size: int, description: str):
        self.compiled, self.vocab_size, self.description = compiled, vocab_size, description

    def __repr__(self) -> str:
        return f"Grammar({self.description[:80]})"


def missing() -> str | None:
    """Why constrained decoding is unavailable here, or None when it is."""
    try:
        import xgrammar  # noqa: F401
    except ImportError as e:
        return f"constrained decoding needs xgrammar, which this replica lacks ({e}): {INSTALL_HINT}"
    return None


class Grammars:
    """Compiles formats for one model's tokenizer. The tokenizer's vocabulary is read on the first compile."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Iterable[int]):
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, sorted(stop_token_ids)
        self._compiler: Any = None
        self._lock = threading.Lock()

    def compile(self, tag: dict) -> Grammar:
        """`tag`: a structural tag (`{"type": "structural_tag", "format": {...}}`). Blocks for the compile: tens of
        milliseconds for a typical schema on a 152k-token vocabulary, seconds for a huge one."""
        compiler = self._ready()
        text = json.dumps(tag, ensure_ascii=False)   # key order kept: a schema's properties are written in it
        try:
            compiled = compiler.compile_structural_tag(json.dumps(_strict_strings(tag), ensure_ascii=False))
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError, ValueError or its own for a bad format
            raise FormatError(_first_line(e)) from None
        return Grammar(compiled, self.vocab_size, text)

    def warm(self) -> None:
        """Import xgrammar and read the vocabulary now (0.6-1 s for 152k tokens on the H200 machine), so that the
        first constrained request does not wait for them; nothing where xgrammar is missing."""
        if importlib.util.find_spec("xgrammar") is None:
            return
        began = time.perf_counter()
        self._ready()
        logger.info("constrained decoding ready: the vocabulary read in %.2f s", time.perf_counter() - began)

    def _ready(self):
        with self._lock:
            if self._compiler is None:
                reason = missing()
                if reason is not None:
                    raise RuntimeError(reason)
                import xgrammar as xgr
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=COMPILE_THREADS, cache_limit_bytes=CACHE_BYTES)
            return self._compiler


# xgrammar (0.2.9) writes a string of bounded length (minLength, maxLength) as repeats of any character but quote,
# backslash and line breaks: other control characters pass raw, which is not JSON (a strict parser refuses the
# reply). Its other strings leave out every control character, as this does.
LOOSE_CHARACTER, STRICT_CHARACTER = '[^\\"\\\\\\r\\n]', '[^\\0-\\x1f\\"\\\\]'


def _strict_strings(node: Any) -> Any:
    """`node` (part of a structural tag) with each JSON schema in it given as the grammar xgrammar makes of it, its
    bounded strings' characters those a JSON string holds unescaped. Such a string holds no escapes (no quote,
    backslash or line break), as in xgrammar. Compiles cost what the schema's would: the repeat stays one rule."""
    if isinstance(node, list):
        return [_strict_strings(item) for item in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and "json_schema" in node:
        return {"type": "grammar", "grammar": _schema_grammar(json.dumps(node["json_schema"], ensure_ascii=False),
                                                              node.get("max_whitespace_cnt"))}
    return {key: _strict_strings(value) for key, value in node.items()}


@functools.lru_cache(maxsize=256)
def _schema_grammar(schema: str, max_whitespace: int | None) -> str:
    import xgrammar as xgr
    grammar = str(xgr.Grammar.from_json_schema(schema, any_whitespace=True, max_whitespace_cnt=max_whitespace))
    return grammar.replace(LOOSE_CHARACTER, STRICT_CHARACTER)


class Matcher:
    """One sequence's place in its format."""
    __slots__ = ("_matcher", "_bitmask", "ended")

    def __init__(self, grammar: Grammar):
        import xgrammar as xgr
        self._matcher = xgr.GrammarMatcher(grammar.compiled)
        self._bitmask = xgr.allocate_token_bitmask(1, grammar.vocab_size)
        self.ended = False

    def allowed(self) -> torch.Tensor | None:
        """The tokens the format allows next, as a bitmask row (int32, host; bit t of word t // 32 for token t), or
        None where it allows every token (free text). The row is this matcher's, overwritten by its next call."""
        if not self._matcher.fill_next_token_bitmask(self._bitmask, 0):
            return None
        return self._bitmask[0]

    def advance(self, token_id: int) -> bool:
        """Take the sampled token; True when the format is over (complete, or the token broke it: then the sequence
        ends rather than going on unconstrained)."""
        if not self._matcher.accept_token(token_id):
            logger.warning("a constrained sequence sampled token %d, which its format does not allow: it ends here",
                           token_id)
            self.ended = True
        elif self._matcher.is_terminated():
            self.ended = True
        return self.ended


class MaskFiller:
    """Writes a step's masks, one row per constrained sequence: from THREADED_ROWS rows on, in one call that spreads
    them over FILL_THREADS host threads (xgrammar's batch matcher), as tens of microseconds a row on a 152k-token
    vocabulary add up over a large batch."""

    def __init__(self, vocab_size: int, threaded_rows: int = THREADED_ROWS):
        self.vocab_size, self.threaded_rows = vocab_size, max(2, threaded_rows)
        self._batch: Any = None
        self._rows: torch.Tensor | None = None

    def fill(self, matchers: list[Matcher]) -> list[torch.Tensor | None]:
        """Each matcher's mask (as Matcher.allowed; a row of a buffer this filler reuses at its next call)."""
        if len(matchers) < self.threaded_rows:
            return [matcher.allowed() for matcher in matchers]
        import xgrammar as xgr
        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher(max_threads=FILL_THREADS)
        rows = self._rows
        if rows is None or len(rows) < len(matchers):
            grown = max(len(matchers), 2 * (0 if rows is None else len(rows)))
            rows = self._rows = xgr.allocate_token_bitmask(grown, self.vocab_size)
        self._batch.batch_fill_next_token_bitmask([m._matcher for m in matchers], rows)
        return list(rows[:len(matchers)])


def mask_logits(logits: torch.Tensor, rows: list[int], bitmasks: list[torch.Tensor]) -> None:
    """Set to -inf, in the given rows of `logits` [B, V] (in place), every token its row's bitmask leaves out."""
    vocab = logits.shape[-1]
    bits = torch.stack(bitmasks).to(logits.device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1)[:, :vocab].bool()
    index = torch.tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def _first_line(error: Exception) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0][:500]
