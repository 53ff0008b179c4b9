"""Incremental detokenization and stop strings for one request.

Tokens are decoded through a sliding window (prefix/read offsets, as in vLLM): the
window is decoded with and without the newest tokens, and only the text they add is
emitted, once it no longer ends in U+FFFD, i.e. once a character split across byte
tokens is complete. Where the tokenizer is a plain Rust one, its own DecodeStream keeps
that window (one call into Rust per token instead of two decodes: ~0.8 against ~1.7 us a
token); the window here then only serves the flush of a request's last, incomplete
characters. Text that could still grow into a stop string is held back, so a stop string
never reaches the client.
"""
import functools

# Prompt tokens decoded ahead of the output so tokenizers that drop a leading space
# at the start of a decode (SentencePiece) still produce the right first word.
CONTEXT_TOKENS = 5
REPLACEMENT = "\ufffd"


class Detokenizer:
    def __init__(self, tokenizer, prompt_token_ids, stop=(), include_stop_str_in_output=False,
                 skip_special_tokens=True):
        self.tokenizer = tokenizer
        self.decode = _decoder(tokenizer, skip_special_tokens)
        self.tokens = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.stream = _stream(tokenizer, self.decode, self.tokens, skip_special_tokens)
        self.stop = [s for s in stop if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        # where stop strings are looked for: the output's text (complete characters only) from the first character
        # a stop string may still start at or that is not sent yet; the rest is let go (a long reply was re-copied
        # whole every step)
        self.text = ""
        self.sent = 0           # how much of self.text has been returned
        self.longest_stop = max((len(s) for s in self.stop), default=0)
        self.stop_reason = None  # the stop string that ended the request

    def step(self, token_ids, finished=False) -> str:
        """Take the request's new tokens; return the text that may be sent now.

        After a stop string matched (`stop_reason` is set) the request is over and
        further tokens are ignored. `finished` flushes everything still held.
        """
        if self.stop_reason is not None:
            return ""
        if not self.stop:   # nothing to look for or hold back: the new text goes out whole, and is not kept
            return self._decode_new(token_ids, flush=finished)
        searched = len(self.text)
        self.text += self._decode_new(token_ids, flush=finished)
        match = find_stop(self.text, self.stop, searched)
        if match is not None:
            start, stop = match
            self.stop_reason = stop
            self.text = self.text[: start + len(stop) if self.include_stop_str_in_output else start]
            end = len(self.text)
        elif finished:
            end = len(self.text)
        else:
            end = len(self.text) - partial_stop_len(self.text, self.stop)
        delta = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        keep_from = max(0, min(self.sent, len(self.text) - self.longest_stop + 1))
        if keep_from:
            self.text, self.sent = self.text[keep_from:], self.sent - keep_from
        return delta

    def step_each(self, token_ids, finished=False) -> tuple[str, list[int]]:
        """As `step` for a request without stop strings (whose outputs may be joined), with how long the returned
        text is after each token: where a joined output's tokens start and end in its text."""
        if self.stop:
            raise ValueError("step_each is for a request without stop strings; step holds text back for them")
        ends: list[int] = []
        return self._decode_new(token_ids, flush=finished, ends=ends), ends

    def _decode_new(self, token_ids, flush: bool, ends: list[int] | None = None) -> str:
        if self.stream is None:
            if ends is None:
                self.tokens.extend(token_ids)
                return self._decode_window(flush)
            text = ""
            for i, token in enumerate(token_ids):   # a window a token, so each token's text is known
                self.tokens.append(token)
                text += self._decode_window(flush and i == len(token_ids) - 1)
                ends.append(len(text))
            return text
        decoder, backend = self.stream
        text = ""
        for token in token_ids:
            self.tokens.append(token)
            chunk = decoder.step(backend, token)
            if chunk is not None:  # the window moves as DecodeStream's does, for a flush to start where it stands
                text += chunk
                self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            if ends is not None:
                ends.append(len(text))
        if flush and self.read_offset < len(self.tokens):  # the last characters, complete or not
            text += self._decode_window(flush=True)
            if ends:
                ends[-1] = len(text)
        if len(self.tokens) > 4 * CONTEXT_TOKENS + 64 and self.prefix_offset > 0:  # keep only the window's tokens
            del self.tokens[:self.prefix_offset]
            self.prefix_offset, self.read_offset = 0, self.read_offset - self.prefix_offset
        return text

    def _decode_window(self, flush: bool) -> str:
        prefix = self.decode(self.tokens[self.prefix_offset:self.read_offset])
        full = self.decode(self.tokens[self.prefix_offset:])
        if len(full) <= len(prefix) or (full.endswith(REPLACEMENT) and not flush):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        return full[len(prefix):]


def _decoder(tokenizer, skip_special_tokens: bool):
    """`tokenizer.decode`, or the Rust tokenizer's own decode where transformers' fast tokenizer only forwards to it
    (no subclass decode, no clean-up of spaces): the wrapper cost ~2.5 us a call, twice per token per request."""
    from transformers import PreTrainedTokenizerFast

    kind = type(tokenizer)
    if (isinstance(tokenizer, PreTrainedTokenizerFast) and kind.decode is PreTrainedTokenizerFast.decode
            and kind._decode is PreTrainedTokenizerFast._decode and not tokenizer.clean_up_tokenization_spaces):
        return functools.partial(tokenizer.backend_tokenizer.decode, skip_special_tokens=skip_special_tokens)
    return functools.partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)


def _stream(tokenizer, decode, context: list[int], skip_special_tokens: bool):
    """(DecodeStream primed with `context`, the Rust tokenizer) where `decode` is the Rust tokenizer's own decode
    and the installed tokenizers can prime a stream (0.22 and later); else None, and the window decodes."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(decode, "func", None) != backend.decode:
        return None
    try:
        from tokenizers.decoders import DecodeStream

        return DecodeStream(ids=list(context), skip_special_tokens=skip_special_tokens), backend
    except (ImportError, TypeError, ValueError, OverflowError):  # an old tokenizers, or a prompt id the engine refuses
        return None


def find_stop(text: str, stops: list[str], searched: int) -> tuple[int, str] | None:
    """Earliest stop string in `text`, looking only where it could overlap new text."""
    best = None
    for stop in stops:
        i = text.find(stop, max(0, searched - len(stop) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, stop)
    return best


def partial_stop_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string. Only the text's last
    len(stop) - 1 characters can be one, and only from where the stop's first character occurs in them."""
    longest = 0
    for stop in stops:
        if len(stop) < 2:
            continue
        tail = text[-(len(stop) - 1):]
        start = tail.find(stop[0])
        while start >= 0 and len(tail) - start > longest:
            if stop.startswith(tail[start:]):
                longest = len(tail) - start
                break
            start = tail.find(stop[0], start + 1)
    return longest


def token_text(tokenizer, token_id: int) -> str:
    """One token on its own, as logprobs show it."""
    return tokenizer.decode([token_id], skip_special_tokens=False)
