"""OpenAI request bodies (plus vLLM's sampling extras) and their translation to SamplingParams.

Unknown fields are accepted and ignored, as vLLM does, so newer clients keep working;
known fields are range-checked here so a bad value is a 400 that names the field, and
OpenAI features this server lacks are refused rather than silently dropped. Every number is bounded
(no NaN or infinity): an integer past what torch takes (a top_k of 2**63, say) would otherwise
fail inside the engine's step loop rather than here.
"""

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from ember.runtime.engine.sampling import INT32_MAX, LOGIT_BIAS_MAX_TOKENS, SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # what torch.Generator.manual_seed takes, with room for seed + n
# Each stop string is looked for in the text after every token (and the text's end against each of its prefixes):
# bounded, so that 16 stop strings of megabytes cannot make every step of the replica crawl.
STOP_MAX_CHARS, STOP_MAX_COUNT = 256, 16
MAX_CHOICES = 2048  # completions (prompts x n) in one request: as many texts as OpenAI's embeddings take in one
# Messages (or Responses input items) in one request. The chat template renders them on the replica's event loop,
# ~13 us each: a 16 MiB body of 470,000 one-letter messages held every other caller of the replica ~6 s.
MAX_MESSAGES = 10_000


# vLLM's extras for features this server does not have, refused rather than ignored as unknown fields are: a client
# that asks for JSON by schema, or for beam search, must not get free text as if it had.
SAMPLING_REFUSED = {
    "guided_json": ("guided_json (constrained decoding)", lambda value: value is not None),
    "guided_regex": ("guided_regex (constrained decoding)", lambda value: value is not None),
    "guided_choice": ("guided_choice (constrained decoding)", lambda value: value is not None),
    "guided_grammar": ("guided_grammar (constrained decoding)", lambda value: value is not None),
    "structured_outputs": ("structured_outputs (constrained decoding)", lambda value: value is not None),
    "use_beam_search": ("use_beam_search (beam search)", bool),
    "prompt_logprobs": ("prompt_logprobs", lambda value: value is not None),
}


class SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str
    n: int | None = Field(1, ge=1, le=128)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: int = Field(0, ge=-1, le=INT32_MAX)
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0, le=10)
    stop_token_ids: list[int] = Field(default_factory=list, max_length=1024)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    use_beam_search: Any = False
    prompt_logprobs: Any = None

    @field_validator(*SAMPLING_REFUSED)
    @classmethod
    def _refused_extra(cls, value, info: ValidationInfo):
        return _refused_by(SAMPLING_REFUSED, value, info)

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, value):
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > STOP_MAX_COUNT:
            raise ValueError(f"at most {STOP_MAX_COUNT} stop strings, got {len(stops)}")
        if any(not 1 <= len(stop) <= STOP_MAX_CHARS for stop in stops):
            raise ValueError(f"each stop string must be 1-{STOP_MAX_CHARS} characters")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_biases(cls, value):
        """OpenAI's form: token ids (of this model's tokenizer) as strings, each to a bias in [-100, 100]."""
        if not value:
            return value
        if len(value) > LOGIT_BIAS_MAX_TOKENS:
            raise ValueError(f"at most {LOGIT_BIAS_MAX_TOKENS} tokens, got {len(value)}")
        for token, bias in value.items():
            if not (token.isascii() and token.isdigit() and len(token) <= 10):
                raise ValueError(f"keys are token ids written as strings, such as \"1234\"; got {token[:40]!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"each bias must be in [-100, 100]; token {token} has {bias}")
        return value

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        return None

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens, temperature=_default(self.temperature, 1.0), top_k=max(self.top_k, 0),
            top_p=_default(self.top_p, 1.0), min_p=self.min_p, seed=self.seed,
            repetition_penalty=self.repetition_penalty, presence_penalty=_default(self.presence_penalty, 0.0),
            frequency_penalty=_default(self.frequency_penalty, 0.0),
            stop_token_ids=list(self.stop_token_ids), ignore_eos=self.ignore_eos,
            logprobs=self.requested_logprobs(), min_tokens=self.min_tokens,
            logit_bias={int(token): bias for token, bias in (self.logit_bias or {}).items()},
        )


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


TOOL_NAME = r"^[A-Za-z0-9_.-]{1,64}$"   # OpenAI's rule for function names
MAX_TOOLS = 128                          # as OpenAI allows


class CalledFunction(BaseModel):
    name: str = Field(max_length=64)
    arguments: str = ""

    def parsed(self) -> Any:
        """The arguments as an object when they are a JSON object (templates write them back as JSON), else as sent."""
        try:
            value = json.loads(self.arguments)
        except (ValueError, RecursionError):   # not JSON, or nested past what the parser takes: as sent
            return self.arguments
        return value if isinstance(value, dict) else self.arguments


class ToolCall(BaseModel):
    """A call an assistant message made earlier in the conversation."""
    id: str = Field("", max_length=256)
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOLS)
    tool_call_id: str | None = Field(None, max_length=256)

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


# Chat fields of features this server does not have: (what the 400 names, whether a value asks for it). The legacy
# function calling and audio output were taken in silence before, and answered with plain text.
CHAT_REFUSED = {
    # needs decoding constrained to a call, which this server does not have; "auto" (the default) and "none" work
    "tool_choice": ("tool_choice other than auto or none (constrained decoding)",
                    lambda value: value not in (None, "none", "auto")),
    "functions": ("functions (legacy function calling; send tools)", bool),
    "function_call": ("function_call", lambda value: value not in (None, "none")),
    "modalities": ("modalities other than text", lambda value: bool(value) and value != ["text"]),
    "audio": ("audio output", lambda value: value is not None),
    "response_format": ("response_format other than text", lambda value: bool(value) and value.get("type") != "text"),
}


# What chat_template_kwargs may not set: the request's own parts and the renderer's options (a client's own
# `chat_template` would replace the model's template), and the special tokens the template reads.
TEMPLATE_RESERVED = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens", "bos_token", "eos_token",
    "unk_token", "pad_token", "sep_token", "cls_token", "mask_token", "additional_special_tokens",
})


class ToolFunction(BaseModel):
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: ToolFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    # vLLM extras: variables for the chat template (Qwen3's enable_thinking, say), and a reply that continues the
    # last message (a prefilled assistant turn) instead of starting a new one
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, value):
        if not value:
            return value
        if len(value) > 32:
            raise ValueError(f"at most 32 variables, got {len(value)}")
        for name in value:
            if not name.isidentifier() or name.startswith("_") or name in TEMPLATE_RESERVED:
                raise ValueError(f"{name[:40]!r} cannot be set: give the template's own variables (such as "
                                 "enable_thinking), not the request's fields or the renderer's options")
        return value

    @field_validator("continue_final_message")
    @classmethod
    def _one_way_to_end(cls, value, info: ValidationInfo):
        if value and info.data.get("add_generation_prompt"):
            raise ValueError("continuing the last message and adding a generation prompt exclude each other: set "
                             "add_generation_prompt to false")
        return value
    response_format: dict | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[Any] | None = None
    audio: Any = None

    @field_validator(*CHAT_REFUSED)
    @classmethod
    def _refused(cls, value, info: ValidationInfo):
        """A feature this server does not have is a 400 naming it (its neutral values pass), never an answer that
        ignored it."""
        return _refused_by(CHAT_REFUSED, value, info)

    @property
    def uses_tools(self) -> bool:
        """Whether the tools go to the template and the reply is read for calls (tool_choice "none": neither)."""
        return bool(self.tools) and self.tool_choice != "none"

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _bounded_batch(cls, value, info: ValidationInfo):
        """A batch of prompts is one request to the engine, queued as one: its sequences (prompts x n) are bounded,
        or one request of 100,000 would hold every later caller's requests behind it for as long as it runs."""
        prompts = 1 if isinstance(value, str) or all(isinstance(p, int) for p in value) else len(value)
        choices = prompts * (info.data.get("n") or 1)
        if choices > MAX_CHOICES:
            raise ValueError(f"at most {MAX_CHOICES} completions per request (prompts x n), got {choices}; split the "
                             "batch over several requests")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value):
        return _unsupported("suffix", value, bool(value))

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value, info: ValidationInfo):
        return _unsupported("best_of other than n", value, value is not None and value != (info.data.get("n") or 1))

    @field_validator("echo")
    @classmethod
    def _no_prompt_logprobs(cls, value, info: ValidationInfo):
        prompt_logprobs = value and info.data.get("logprobs") is not None
        return _unsupported("echo with logprobs (prompt logprobs)", value, prompt_logprobs)

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str):
            return [self.prompt]
        token_ids = [p for p in self.prompt if isinstance(p, int)]
        if len(token_ids) == len(self.prompt):  # one prompt given as token ids
            return [token_ids]
        return [p for p in self.prompt if not isinstance(p, int)]


def _default(value, default):
    return default if value is None else value


def _refused_by(table: dict, value, info: ValidationInfo):
    """A field of a refusal table: a 400 naming the feature when its value asks for it, else the value."""
    feature, refused = table[str(info.field_name)]
    return _unsupported(feature, value, refused(value))


def _unsupported(feature: str, value, refused: bool):
    if refused:
        raise ValueError(f"{feature} is not supported by this server; remove it from the request")
    return value


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize for a completion's text (a chat request's messages take ChatCompletionRequest)."""
    model_config = ConfigDict(extra="allow")

    model: str
    prompt: str


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    tokens: list[int] = Field(max_length=1 << 20)


# --- the Responses API (/v1/responses): its input items become a chat request's messages ---

class ContentText(BaseModel):
    """A text part of a Responses message: input_text from the caller, output_text of an earlier reply."""
    model_config = ConfigDict(extra="allow")

    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentText]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class FunctionCallItem(BaseModel):
    """A call an earlier reply made (an output item the caller sends back)."""
    model_config = ConfigDict(extra="allow")

    type: Literal["function_call"]
    call_id: str = Field(max_length=256)
    name: str = Field(max_length=64)
    arguments: str = ""


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function_call_output"]
    call_id: str = Field(max_length=256)
    output: str | list[ContentText]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)


class ReasoningItem(BaseModel):
    """An earlier reply's reasoning, sent back with its output: taken and left out of the prompt (chat templates
    leave earlier turns' reasoning out too)."""
    model_config = ConfigDict(extra="allow")

    type: Literal["reasoning"]


INPUT_ITEMS: dict[str, type[BaseModel]] = {
    "message": InputMessage, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem}
INPUT_PARTS = ("input_text", "output_text")


class ResponseTool(BaseModel):
    """The Responses API's function tool: the chat API's, unnested."""
    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None

    def as_chat_tool(self) -> dict:
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


# Responses fields of features this server does not have: stored conversations (it keeps no response), background
# runs, formats other than text (constrained decoding), reasoning settings, and logprobs asked through `include`.
RESPONSES_REFUSED = {
    "previous_response_id": ("previous_response_id (this server stores no response: send the whole conversation "
                             "as input)", lambda value: value is not None),
    "conversation": ("conversation (stored conversations)", lambda value: value is not None),
    "background": ("background", bool),
    "text": ("text.format other than text (constrained decoding)",
             lambda value: bool(value) and (value.get("format") or {}).get("type", "text") != "text"),
    "reasoning": ("reasoning settings", lambda value: bool(value) and any(v is not None for v in value.values())),
    "include": ("include", bool),
    "top_logprobs": ("top_logprobs", lambda value: value is not None),
    "truncation": ("truncation other than disabled", lambda value: value not in (None, "disabled")),
    "tool_choice": ("tool_choice other than auto or none (constrained decoding)",
                    lambda value: value not in (None, "none", "auto")),
    "prompt": ("prompt (stored prompt templates)", lambda value: value is not None),
}
METADATA_MAX_KEYS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512   # OpenAI's limits


class ResponsesRequest(SamplingRequest):
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    tools: list[ResponseTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    metadata: dict[str, str] | None = None
    store: bool | None = None
    previous_response_id: Any = None
    conversation: Any = None
    background: Any = None
    text: dict | None = None
    reasoning: dict | None = None
    include: list[Any] | None = None
    top_logprobs: Any = None
    truncation: Any = None
    prompt: Any = None

    @field_validator(*RESPONSES_REFUSED)
    @classmethod
    def _refused(cls, value, info: ValidationInfo):
        return _refused_by(RESPONSES_REFUSED, value, info)

    @field_validator("n")
    @classmethod
    def _one_output(cls, value):
        return _unsupported("n other than 1 (a response has one output)", value, value not in (None, 1))

    @field_validator("input")
    @classmethod
    def _input_items(cls, value):
        """Each item as its model; an item or part this server cannot take is named by its type (an image, say)."""
        if isinstance(value, str):
            if not value:
                raise ValueError("it must not be empty")
            return value
        if not value:
            raise ValueError("it must hold at least one item")
        if len(value) > MAX_MESSAGES:
            raise ValueError(f"at most {MAX_MESSAGES:,} items, got {len(value):,}")
        items = []
        for i, item in enumerate(value):
            kind = item.get("type", "message") if isinstance(item, dict) else None
            if kind not in INPUT_ITEMS:
                raise ValueError(f"item {i} is {_described(item)}; this server takes message, function_call, "
                                 "function_call_output and reasoning items")
            parts = item.get("content") if kind == "message" else item.get("output")
            for part in parts if isinstance(parts, list) and kind != "reasoning" else []:
                if not isinstance(part, dict) or part.get("type") not in INPUT_PARTS:
                    raise ValueError(f"item {i} holds a part of {_described(part)}; this server takes text parts "
                                     "(input_text, output_text) alone")
            try:
                items.append(INPUT_ITEMS[kind].model_validate(item))
            except ValidationError as e:
                first = e.errors(include_url=False)[0]
                where = ".".join(str(part) for part in first["loc"])
                raise ValueError(f"item {i} ({kind}): {where}: {first['msg']}") from None
        return items

    @field_validator("metadata")
    @classmethod
    def _bounded_metadata(cls, value):
        if value and (len(value) > METADATA_MAX_KEYS or any(len(k) > METADATA_KEY_CHARS for k in value)
                      or any(len(v) > METADATA_VALUE_CHARS for v in value.values())):
            raise ValueError(f"at most {METADATA_MAX_KEYS} pairs, keys of at most {METADATA_KEY_CHARS} characters "
                             f"and values of at most {METADATA_VALUE_CHARS}")
        return value

    def requested_max_tokens(self) -> int | None:
        return self.max_output_tokens or self.max_tokens

    def chat_messages(self) -> list[dict]:
        """The conversation as chat messages: the instructions as a system message first, each function call
        joined to the assistant turn that made it, each call's output a tool message; reasoning items left out."""
        messages: list[dict] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        items = [InputMessage(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for item in items:
            if isinstance(item, InputMessage):
                messages.append({"role": item.role, "content": item.text()})
            elif isinstance(item, ReasoningItem):
                continue
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if messages and messages[-1]["role"] == "assistant":
                    messages[-1].setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            else:
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        return messages


JSON_KINDS = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number",
              bool: "a boolean", type(None): "null"}


def _described(value) -> str:
    kind = value.get("type") if isinstance(value, dict) else None
    return f"type {str(kind)[:40]!r}" if kind is not None else f"{JSON_KINDS[type(value)]} with no type"
