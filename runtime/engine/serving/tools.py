"""Tool calls in the chat API, for models whose chat template writes them as tagged JSON (Qwen2.5, Qwen3, Hermes):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The request's `tools` go to the chat template, which tells the model this format; the reply's text is read back
into OpenAI's `tool_calls`. A block that is not such JSON stays in the text, as the model wrote it: a client sees
what it said rather than losing it. Streamed, text goes out as it comes until a tag may begin; a call goes out
whole, in one delta, once its closing tag arrives.
"""
import json
import uuid
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def template_writes_tool_calls(template: str | None) -> bool:
    """Whether a chat template renders tools and their calls in the tagged format read here."""
    return bool(template) and OPEN in str(template)


def _call(block: str) -> dict | None:
    """An OpenAI tool call from the JSON between the tags, or None when it is not {"name": str, "arguments": {...}}."""
    try:
        parsed = json.loads(block)
    except (ValueError, RecursionError):   # a model may write "[[[[..." past the parser's depth: text, not a crash
        return None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        return None
    arguments = parsed.get("arguments", parsed.get("parameters", {}))
    if isinstance(arguments, str):   # some models write the arguments as a JSON string already
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": parsed["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}


class ToolCallStream:
    """A choice's text as it streams, split into content and whole tool calls. `feed` returns the parts that are
    settled (`{"content": str}` or `{"tool_call": dict}`); text that may be the start of a tag is held back.
    `parallel=False` keeps the first call: the text after it is dropped, as a client that asked for one call
    expects one."""

    def __init__(self, parallel: bool = True):
        self.parallel = parallel
        self.held = ""          # text outside a call not yet given out: a possible opening tag's start
        self.inside = False     # within <tool_call> ... </tool_call>
        self.body: list[str] = []   # a call's text so far, in pieces (joined once, when it closes)
        self.tail = ""          # the body's last characters, where a closing tag split across steps begins
        self.calls = 0          # calls read
        self.done = False       # one call made and parallel calls off: the rest is dropped

    def feed(self, text: str) -> list[dict]:
        parts: list[dict] = []
        while not self.done:
            if self.inside:   # each step's text is searched once, with the tail before it: a long call is O(n)
                window = self.tail + text
                end = window.find(CLOSE)
                if end < 0:
                    self.body.append(text)
                    self.tail = window[-(len(CLOSE) - 1):]
                    break
                whole = "".join(self.body) + text
                at = len(whole) - len(window) + end
                block, text = whole[:at], whole[at + len(CLOSE):]
                self.body, self.tail, self.inside = [], "", False
                call = _call(block.strip())
                if call is None:   # not a call after all: the model's text, tags and all
                    parts.append({"content": OPEN + block + CLOSE})
                    continue
                parts.append({"tool_call": call})
                self.calls += 1
                self.done = not self.parallel
            else:
                self.held += text
                start = self.held.find(OPEN)
                if start >= 0:
                    parts.append({"content": self.held[:start]})
                    text, self.held, self.inside = self.held[start + len(OPEN):], "", True
                    continue
                keep = partial_tag(self.held)
                parts.append({"content": self.held[:len(self.held) - keep]})
                self.held = self.held[len(self.held) - keep:]
                break
        return merged(parts)

    def finish(self) -> list[dict]:
        """What is still held when the choice ends: an unclosed call is the model's text."""
        if self.done or not (self.held or self.inside):
            return []
        text = OPEN + "".join(self.body) if self.inside else self.held
        self.held, self.inside, self.body, self.tail = "", False, [], ""
        return [{"content": text}]


def partial_tag(text: str, tag: str = OPEN) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


TEXT_PARTS = ("content", "reasoning")


def merged(parts: list[dict]) -> list[dict]:
    """The parts with empty texts dropped and neighbouring texts of one kind joined."""
    out: list[dict] = []
    for part in parts:
        kind = next((k for k in TEXT_PARTS if k in part), None)
        if kind is not None and not part[kind]:
            continue
        if kind is not None and out and kind in out[-1]:
            out[-1] = {kind: out[-1][kind] + part[kind]}
        else:
            out.append(part)
    return out


def template_messages(messages: list[Any]) -> list[dict]:
    """The chat messages as the template reads them: an assistant's earlier calls with their arguments as objects
    (templates write them back as JSON), a tool's reply with the id of the call it answers."""
    out = []
    for m in messages:
        message: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.function.name, "arguments": c.function.parsed()}}
                                     for c in m.tool_calls]
        out.append(message)
    return out
