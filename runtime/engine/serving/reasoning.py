"""A reply's reasoning apart from its answer, for models whose chat template has them think between tags first
(Qwen3, DeepSeek-R1, QwQ):

    <think>
    The user asks for ... so ...
    </think>

    The answer.

The reasoning goes out as `reasoning_content` in the chat API (as vLLM's reasoning parsers and DeepSeek's API give
it) and as a reasoning item in the Responses API; the answer as the content. A template whose generation prompt
opens the block itself (DeepSeek-R1's ends in "<think>\n") starts the reply inside it; one that closes it (Qwen3's
with enable_thinking false writes an empty block) starts it outside. Streamed, text goes out as it comes, but for a
few characters that may be a tag's start.
"""
from dataclasses import dataclass

from ember.runtime.engine.serving.tools import ToolCallStream, merged, partial_tag

OPEN, CLOSE = "<think>", "</think>"
UNDECIDED_MAX = 256   # characters of whitespace a reply may start with before it is taken for an answer


def template_thinks(template: str | None) -> bool:
    return bool(template) and OPEN in str(template) and CLOSE in str(template)


def starts_inside(prompt: str) -> bool:
    """Whether a rendered prompt leaves the reply inside an open reasoning block."""
    return prompt.rfind(OPEN) > prompt.rfind(CLOSE)


class ReasoningStream:
    """A choice's text as it streams, split into `{"reasoning": str}` and `{"content": str}` parts."""

    def __init__(self, inside: bool):
        # start: the reply may still open with <think> (after whitespace); inside: reasoning; after: the block has
        # closed and the whitespace after it is dropped; answer: the rest is content
        self.state = "inside" if inside else "start"
        self.held = ""   # text not yet given out: the reply's opening, or a possible closing tag's start
        self.fed = 0     # characters fed so far (`held` is always their end)
        self.closed_at: int | None = None   # where in them the closing tag ended

    def feed(self, text: str) -> list[dict]:
        parts: list[dict] = []
        self.held += text
        self.fed += len(text)
        while self.held:
            if self.state == "start":
                opening = self.held.lstrip()
                if opening.startswith(OPEN):
                    self.held, self.state = opening[len(OPEN):], "inside"
                elif OPEN.startswith(opening) and len(self.held) <= UNDECIDED_MAX:
                    break   # "", "<th": wait for more
                else:
                    self.state = "answer"
            elif self.state == "inside":
                end = self.held.find(CLOSE)
                if end < 0:
                    keep = partial_tag(self.held, CLOSE)
                    parts.append({"reasoning": self.held[:len(self.held) - keep]})
                    self.held = self.held[len(self.held) - keep:]
                    break
                parts.append({"reasoning": self.held[:end]})
                self.closed_at = self.fed - len(self.held) + end + len(CLOSE)
                self.held, self.state = self.held[end + len(CLOSE):], "after"
            elif self.state == "after":
                self.held = self.held.lstrip()
                if self.held:
                    self.state = "answer"
            else:
                parts.append({"content": self.held})
                self.held = ""
        return merged(parts)

    def finish(self) -> list[dict]:
        """What is still held when the choice ends: an unclosed block's end is reasoning, an undecided start text."""
        held, self.held = self.held, ""
        if not held or self.state == "after":
            return []
        return [{"reasoning": held}] if self.state == "inside" else [{"content": held}]


@dataclass
class ReplyShape:
    """How a choice's text is read: for reasoning (and where it starts), for tool calls (and how many)."""
    reasoning: bool = False
    inside: bool = False
    tools: bool = False
    parallel_tool_calls: bool = True

    @property
    def plain(self) -> bool:
        return not (self.reasoning or self.tools)


class ReplyParser:
    """A choice's text, streamed, as parts: `{"reasoning": str}`, `{"content": str}` and `{"tool_call": dict}`
    (calls are read from the answer alone, never from the reasoning)."""

    def __init__(self, shape: ReplyShape):
        self.reasoning = ReasoningStream(shape.inside) if shape.reasoning else None
        self.calls = ToolCallStream(shape.parallel_tool_calls) if shape.tools else None
        self.calls_sent = 0   # calls streamed so far (each delta's index)
        self.made_calls = False
        self.reasoning_tokens = 0   # output tokens up to the one that closed the reasoning
        self.undecided = 0          # tokens of the reply's opening, before it showed whether it reasons

    @property
    def still_thinking(self) -> bool:
        return self.reasoning is not None and self.reasoning.state == "inside"

    def read(self, c) -> list[dict]:
        """The parts a choice's increment (an async_engine.Completion) completes."""
        return self.feed(c.text, len(c.token_ids), bool(c.finish_reason), c.token_ends)

    def feed(self, text: str, tokens: int = 0, final: bool = False, token_ends: list[int] | None = None) -> list[dict]:
        """The parts `text` completes; `tokens` it took, and with several, where each one's text ends in it
        (Completion.token_ends): the reasoning is counted to the token that closed it, however the steps came."""
        if self.reasoning is None:
            parts = [{"content": text}]
        else:
            before, began = self.reasoning.state, self.reasoning.fed
            parts = self.reasoning.feed(text) + (self.reasoning.finish() if final else [])
            closed_at, closed, in_block = self.reasoning.closed_at, False, tokens
            if closed_at is not None and closed_at > began:   # the block closed in this text
                closed, in_block = True, _tokens_to(token_ends, closed_at - began, tokens)
            if before == "inside":
                self.reasoning_tokens += in_block
            elif before == "start":   # counted once the opening shows a block (an answer's opening is not)
                if closed or self.reasoning.state == "inside":
                    self.reasoning_tokens, self.undecided = self.reasoning_tokens + self.undecided + in_block, 0
                else:
                    self.undecided += tokens
        if self.calls is None:
            return merged(parts)
        out: list[dict] = []
        for part in parts:
            out += self.calls.feed(part["content"]) if "content" in part else [part]
        out += self.calls.finish() if final else []
        self.made_calls = self.made_calls or any("tool_call" in part for part in out)
        return merged(out)


def _tokens_to(token_ends: list[int] | None, end: int, tokens: int) -> int:
    """How many of a step's tokens it took to write its text up to `end`: all of them without their ends."""
    if not token_ends:
        return tokens
    return next((i + 1 for i, at in enumerate(token_ends) if at >= end), tokens)


def joined(parts: list[dict]) -> tuple[str, str, list[dict]]:
    """A whole reply's (reasoning, content, calls)."""
    return ("".join(p["reasoning"] for p in parts if "reasoning" in p),
            "".join(p["content"] for p in parts if "content" in p),
            [p["tool_call"] for p in parts if "tool_call" in p])
