"""LLM token accounting for rate limits: an estimate at admission, the real count when the response ends.

    tokens = estimate(body)          # prompt (~4 characters a token) + max_tokens
    meter = UsageMeter(tokens - max_tokens)
    for chunk in response: meter.feed(chunk)   # SSE or JSON, never buffered whole
    used = meter.total()             # the reply's `usage` when it had one, else prompt + counted content chunks
"""
import json

from ember.runtime import logs

OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
DEFAULT_MAX_TOKENS = 256  # what a request without max_tokens is charged until its usage is known
CHARS_PER_TOKEN = 4
JSON_TAIL = 1 << 20  # a non-streamed reply's usage sits at its end; keep at most this much of it


def max_tokens(body: dict) -> int:
    """The most completion tokens the request asks for: max_tokens for each of n choices of each prompt of a batch
    (a completions request may hold a list of prompts, each completed n times; a response's is max_output_tokens)."""
    value = body.get("max_completion_tokens") or body.get("max_output_tokens") or body.get("max_tokens")
    count = value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else DEFAULT_MAX_TOKENS
    return count * sequences(body)


def sequences(body: dict) -> int:
    """The sequences the engine runs for the request at once: n choices of each prompt of a batch."""
    n = body.get("n")
    return max(n if isinstance(n, int) and not isinstance(n, bool) else 1, 1) * batch_size(body)


def batch_size(body: dict) -> int:
    """Prompts in a completions request: a list of strings or of token-id lists is a batch; one string, or one list
    of token ids, is one prompt."""
    prompt = body.get("prompt") if body.get("messages") is None else None
    if isinstance(prompt, list) and prompt and not all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return len(prompt)
    return 1


def prompt_tokens(body: dict) -> int:
    """The prompt's tokens at CHARS_PER_TOKEN: the messages, prompts or a response's instructions and input, and the
    tools a chat template writes into the prompt too (a request of a megabyte of tool schemas and one short message
    is a megabyte of prompt)."""
    messages, tools = body.get("messages"), body.get("tools")
    if messages is not None:
        parts = [messages]
    elif "input" in body:   # the Responses API
        parts = [body.get("instructions"), body.get("input")]
    else:
        return len(json.dumps(body.get("prompt"))) // CHARS_PER_TOKEN + 1
    if isinstance(tools, list):
        parts.append(tools)
    return sum(len(json.dumps(part)) for part in parts) // CHARS_PER_TOKEN + 1


def estimate(body: dict) -> int:
    return prompt_tokens(body) + max_tokens(body)


class UsageMeter:
    """Fed the response bytes as they pass; parses only the SSE lines that carry `usage`."""

    def __init__(self, prompt_estimate: int):
        self.prompt_estimate = prompt_estimate
        self.partial = b""
        self.chunks = 0
        self.usage: int | None = None
        self.tail: bytearray | None = bytearray()  # a JSON reply's end, where its usage is; None for a stream
        self.sorted = False  # whether the first bytes have said which of the two the reply is
        self.trimmed = False  # whether a JSON reply's start was let go (its tail alone is kept)
        self.skipping = False  # within a line of events over JSON_TAIL bytes, let go
        logs.annotate(usage=self)  # the request's key is charged what it used when the reply ends

    def feed(self, data: bytes) -> None:
        if not self.sorted and (start := (bytes(self.tail or b"") + data).lstrip()[:1]):
            self.sorted = True
            if start != b"{":
                self.tail = None  # events: their usage is read as they pass, and none of them is kept
        if self.tail is not None:
            # a JSON reply: its last JSON_TAIL bytes, where the usage is (it kept the first, so the usage of a reply
            # over 1 MiB was lost and the key charged its prompt alone), and no line splitting: a reply has no
            # newline, so each chunk re-copied all the reply before it, quadratic on the gateway's event loop
            self.tail += data
            if len(self.tail) > JSON_TAIL:
                del self.tail[:len(self.tail) - JSON_TAIL]
                self.trimmed = True
            return
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        if self.skipping and lines:   # the end of a line too long to be an event's: not read
            lines, self.skipping = lines[1:], False
        if len(self.partial) > JSON_TAIL:   # no event is a MiB: let it go rather than re-copy it per chunk
            self.partial, self.skipping = b"", True
        for line in lines:
            if not line.startswith(b"data:") or line.startswith(b"data: [DONE]"):
                continue
            if b'"usage"' in line and b'"total_tokens"' in line:
                self._read_usage(line[5:])
            else:
                self.chunks += 1

    def _read_usage(self, text: bytes) -> None:
        """total_tokens of an event's or a reply's usage: at its top, or in the `response` a Responses stream's
        last event carries."""
        try:
            parsed = json.loads(text)
            usage = parsed.get("usage") or (parsed.get("response") or {}).get("usage") or {}
        except (ValueError, AttributeError):
            return
        if isinstance(usage.get("total_tokens"), int):
            self.usage = usage["total_tokens"]

    def total(self) -> int:
        if self.usage is None and self.chunks == 0 and self.tail is not None:
            if self.trimmed:
                self.usage = _last_usage(bytes(self.tail))
            elif self.tail.lstrip().startswith(b"{"):
                self._read_usage(bytes(self.tail))  # a plain JSON reply, whole
        if self.usage is not None:
            return self.usage
        return self.prompt_estimate + self.chunks


def _last_usage(tail: bytes) -> int | None:
    """total_tokens of the last `"usage": {...}` in the end of a JSON reply too long to keep whole. A model's text
    cannot forge one: inside a JSON string its quotes are escaped (`\\"usage\\"`), and the reply's own usage comes
    after its choices."""
    at = tail.rfind(b'"usage"')
    rest = tail[at + len(b'"usage"'):].lstrip() if at >= 0 else b""
    if not rest.startswith(b":"):
        return None
    try:
        usage, _ = json.JSONDecoder().raw_decode(rest[1:].lstrip().decode("utf-8", "replace"))
    except ValueError:
        return None
    total = usage.get("total_tokens") if isinstance(usage, dict) else None
    return total if isinstance(total, int) and not isinstance(total, bool) else None
