"""What a request asks its reply to look like, as a format the engine holds the reply to (engine/grammar.py).

An answer format comes from the chat API's `response_format` (json_object, json_schema), the Responses API's
`text.format`, or vLLM's extras (`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, and the
`structured_outputs` object that replaced them). A forced tool call comes from `tool_choice` ("required", or a named
function): the reply is then one call (or, with parallel tool calls, one or more) in the tagged format the chat
template teaches the model (serving/tools.py), its arguments held to the function's parameter schema. A template that
reasons first keeps its reasoning block: the format applies to what follows `</think>`.

The format is written in xgrammar's structural-tag language, as plain JSON: this module imports no grammar engine.
"""
from dataclasses import dataclass
from typing import Any

from ember.runtime.engine.serving import reasoning, tools

# Whitespace a JSON reply may put in one place: enough for pretty-printed nesting, and a bound on the runs of blanks
# a model can fall into when any whitespace is allowed (every run costs tokens and ends nothing)
MAX_WHITESPACE = 16
AFTER_REASONING = r"[ \t\r\n]{0,8}"   # between </think> and the answer (Qwen3 writes "\n\n")


@dataclass(frozen=True)
class AnswerFormat:
    """What the answer must be. kind: json_schema (value: the schema), json_object, regex (the pattern), choice (the
    strings), grammar (EBNF text)."""
    kind: str
    value: Any = None

    def tag(self) -> dict:
        if self.kind == "json_schema":
            return _json(self.value)
        if self.kind == "json_object":
            return _json({"type": "object"})
        if self.kind == "regex":
            return {"type": "regex", "pattern": self.value}
        if self.kind == "choice":
            return {"type": "or", "elements": [{"type": "const_string", "value": choice} for choice in self.value]}
        if self.kind == "grammar":
            return {"type": "grammar", "grammar": self.value}
        raise ValueError(f"unknown answer format {self.kind!r}")


@dataclass(frozen=True)
class ToolForcing:
    """A tool_choice that makes the reply a call: `name` for one function, None for any of `tools` ("required")."""
    tools: tuple[dict, ...]              # the chat API's tool objects ({"type": "function", "function": {...}})
    name: str | None
    parallel: bool

    def tag(self) -> dict:
        if self.name is not None:
            [tool] = [t for t in self.tools if t["function"]["name"] == self.name]
            return _call(tool["function"])
        return {"type": "tags_with_separator", "tags": [_call(t["function"]) for t in self.tools], "separator": "\n",
                "at_least_one": True, "stop_after_first": not self.parallel}


def reply_format(answer: AnswerFormat | None, forcing: ToolForcing | None, shape: "reasoning.ReplyShape | None",
                 offered: tuple[dict, ...] = ()) -> dict | None:
    """The structural tag of a reply, or None for free text. `offered`: the tools the model may call instead of
    answering in `answer` (tool_choice auto)."""
    if forcing is not None:
        body = forcing.tag()
    elif answer is not None:
        body = answer.tag()
        if offered:
            calls = ToolForcing(offered, None, True).tag()
            body = {"type": "or", "elements": [body, calls]}
    else:
        return None
    if shape is not None and shape.reasoning:
        think = {"type": "tag", "begin": "" if shape.inside else reasoning.OPEN,
                 "content": {"type": "any_text", "excludes": [reasoning.OPEN, reasoning.CLOSE]},
                 "end": reasoning.CLOSE}
        block = {"type": "sequence", "elements": [think, {"type": "regex", "pattern": AFTER_REASONING}]}
        # a prompt that opened the block has the reply finish it; else the model may reason first or answer at once
        prefix = block if shape.inside else {"type": "optional", "content": block}
        body = {"type": "sequence", "elements": [prefix, body]}
    return {"type": "structural_tag", "format": body}


def _json(schema: Any) -> dict:
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_WHITESPACE}


def _call(function: dict) -> dict:
    """One tool call as the template writes it; the name needs no escaping (tools' names are [A-Za-z0-9_.-])."""
    parameters = function.get("parameters") or {"type": "object"}
    return {"type": "tag", "begin": f'{tools.OPEN}\n{{"name": "{function["name"]}", "arguments": ',
            "content": _json(parameters), "end": "}\n" + tools.CLOSE}
