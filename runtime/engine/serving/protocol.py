"""OpenAI request bodies (plus vLLM's sampling extras) and their translation to SamplingParams.

Unknown fields are accepted and ignored, as vLLM does, so newer clients keep working;
known fields are range-checked here so a bad value is a 400 that names the field, and
OpenAI features this server lacks are refused rather than silently dropped. Every number is bounded
(no NaN or infinity): an integer past what torch takes (a top_k of 2**63, say) would otherwise
fail inside the engine's step loop rather than here.
"""

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from ember.runtime.engine.sampling import INT32_MAX, LOGIT_BIAS_MAX_TOKENS, SamplingParams
from ember.runtime.engine.serving.formats import AnswerFormat, ToolForcing


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
# that asks for beam search must not get a sampled reply as if it had.
SAMPLING_REFUSED = {
    "use_beam_search": ("use_beam_search (beam search)", bool),
    "prompt_logprobs": ("prompt_logprobs", lambda value: value is not None),
}
# A format (a schema's JSON, a regex, a grammar, the choices together) is compiled for each new one, on the replica's
# host: bounded, as OpenAI bounds schemas. 100,000 characters compile in well under a second.
FORMAT_MAX_CHARS = 100_000
FORMAT_MAX_DEPTH = 100   # objects and arrays within each other in a schema (OpenAI takes 10 levels of properties)
# vLLM's structured_outputs keys this server takes, and its older guided_* fields, as answer formats
STRUCTURED_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                    "json_object": "json_object"}
GUIDED_KINDS = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
                "guided_grammar": "grammar"}


def _answer_format(kind: str, value: Any) -> AnswerFormat:
    """An answer format from a request's value, checked: the schema an object (or JSON text of one), a regex or
    grammar text, the choices strings; each within FORMAT_MAX_CHARS."""
    if kind == "json_schema" and isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            raise ValueError("the schema is a string that is not JSON: send the schema as an object") from None
    if kind == "json_schema" and not isinstance(value, (dict, bool)):
        raise ValueError("the schema must be a JSON Schema object")
    if kind in ("regex", "grammar") and not (isinstance(value, str) and value):
        raise ValueError(f"the {kind} must be a non-empty string")
    if kind == "choice" and not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
        raise ValueError("the choices must be a non-empty list of non-empty strings")
    if kind == "json_object" and value not in (None, True):
        raise ValueError("json_object takes true")
    if kind == "json_schema" and _depth(value) > FORMAT_MAX_DEPTH:
        raise ValueError(f"the schema nests objects and arrays more than {FORMAT_MAX_DEPTH} deep")
    try:
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    except (ValueError, RecursionError):
        raise ValueError("the format is nested too deeply") from None
    _encodable(text)
    size = len(text)
    if size > FORMAT_MAX_CHARS:
        raise ValueError(f"the format is {size:,} characters; at most {FORMAT_MAX_CHARS:,}")
    return AnswerFormat(kind, None if kind == "json_object" else value)


def _encodable(*texts: str) -> None:
    """ValueError for text a reply echoes that UTF-8 cannot carry: a lone UTF-16 surrogate ("\\ud800"), which JSON
    may hold; echoed, it would fail the reply's encoding."""
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"it holds a lone UTF-16 surrogate ({text[e.start]!r} at character {e.start}); send "
                             "valid Unicode (a surrogate only as half of a pair)") from None


def _depth(value: Any) -> int:
    """How deep objects and arrays nest in a parsed JSON value (without recursing: a body may nest a thousand deep)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


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

    @field_validator(*GUIDED_KINDS)
    @classmethod
    def _guided(cls, value, info: ValidationInfo):
        return value if value is None else _answer_format(GUIDED_KINDS[str(info.field_name)], value)

    @field_validator("structured_outputs")
    @classmethod
    def _structured(cls, value):
        if value is None:
            return value
        given = {k: v for k, v in value.items() if v is not None and v is not False} if isinstance(value, dict) else {}
        if len(given) != 1 or next(iter(given)) not in STRUCTURED_KINDS:
            raise ValueError(f"give exactly one of {', '.join(STRUCTURED_KINDS)}; got "
                             f"{', '.join(map(str, given)) or 'none'}")
        [(key, spec)] = given.items()
        return _answer_format(STRUCTURED_KINDS[key], spec)

    @model_validator(mode="after")
    def _one_format(self):
        self.answer_format()
        return self

    def answer_format(self) -> AnswerFormat | None:
        """The format the answer is held to, or None for free text; a ValueError when more than one field sets one."""
        given = {}
        for name in self.format_fields():
            value = getattr(self, name)
            if isinstance(value, ResponseFormat):
                value = value.answer_format()
            if value is not None:
                given[name] = value
        if len(given) > 1:
            raise ValueError(f"the reply's format is set by {' and '.join(given)}: set it by one of them")
        return next(iter(given.values()), None)

    def format_fields(self) -> tuple[str, ...]:
        return (*GUIDED_KINDS, "structured_outputs")

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

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value):
        """A part this server cannot take is named by its type (an image, say), not by the union's first branch."""
        for part in value if isinstance(value, list) else ():
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ValueError(f"a part of {_described(part)}; this server takes text parts alone")
        return value

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


# Chat fields of features this server does not have: (what the 400 names, whether a value asks for it). The legacy
# function calling and audio output were taken in silence before, and answered with plain text.
CHAT_REFUSED = {
    "functions": ("functions (legacy function calling; send tools)", bool),
    "function_call": ("function_call", lambda value: value not in (None, "none")),
    "modalities": ("modalities other than text", lambda value: bool(value) and value != ["text"]),
    "audio": ("audio output", lambda value: value is not None),
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


class JSONSchemaSpec(BaseModel):
    """response_format's json_schema: OpenAI's name, description, schema and strict (held to the schema either way)."""
    model_config = ConfigDict(populate_by_name=True)

    name: str = Field("response", pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: Any = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("type json_schema needs json_schema.schema: the JSON Schema of the reply")
        self.answer_format()   # bounded and well-formed
        return self

    def answer_format(self) -> AnswerFormat | None:
        if self.type == "text":
            return None
        if self.type == "json_object" or self.json_schema is None:
            return AnswerFormat("json_object")
        return _answer_format("json_schema", self.json_schema.schema_)


TOOL_CHOICES = "none, auto, required, or {\"type\": \"function\", \"function\": {\"name\": ...}}"


def _tool_choice(value: Any, named: Any) -> str | None:
    """The chosen function's name, "required", or None for none and auto; a ValueError for any other form. `named`:
    the name a function choice gives (None when `value` is not one)."""
    if value in (None, "none", "auto"):
        return None
    if value == "required":
        return value
    if isinstance(named, str):
        return named
    raise ValueError(f"tool_choice must be {TOOL_CHOICES}; got {json.dumps(value)[:100]}")


def _forcing(tools: list[dict] | None, choice: str | None, parallel: bool) -> ToolForcing | None:
    if choice is None:
        return None
    if not tools:
        raise ValueError(f"tool_choice {choice!r} needs tools: send the tools the model may call")
    names = [t["function"]["name"] for t in tools]
    if choice != "required" and choice not in names:
        raise ValueError(f"tool_choice names function {choice!r}, which is not among the tools ({', '.join(names)})")
    return ToolForcing(tuple(tools), None if choice == "required" else choice, parallel)


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
    response_format: ResponseFormat | None = None
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

    @field_validator("tool_choice")
    @classmethod
    def _known_tool_choice(cls, value, info: ValidationInfo):
        """One of the forms, and where it forces a call, of a function among the tools (validated before it)."""
        function = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
        choice = _tool_choice(value, function.get("name") if isinstance(function, dict) else None)
        _forcing([t.model_dump() for t in info.data.get("tools") or []], choice, True)
        return value

    @property
    def uses_tools(self) -> bool:
        """Whether the tools go to the template and the reply is read for calls (tool_choice "none": neither)."""
        return bool(self.tools) and self.tool_choice != "none"

    def tool_forcing(self) -> ToolForcing | None:
        """What tool_choice forces (one named function, or a call of any: "required"), or None."""
        value = self.tool_choice
        function = value.get("function") if isinstance(value, dict) else None
        tools = [t.model_dump(exclude_none=True) for t in self.tools or []]
        return _forcing(tools, _tool_choice(value, function.get("name") if isinstance(function, dict) else None),
                        self.parallel_tool_calls)

    def format_fields(self) -> tuple[str, ...]:
        return ("response_format", *super().format_fields())

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
# runs, reasoning settings, and logprobs asked through `include`.
RESPONSES_REFUSED = {
    "previous_response_id": ("previous_response_id (this server stores no response: send the whole conversation "
                             "as input)", lambda value: value is not None),
    "conversation": ("conversation (stored conversations)", lambda value: value is not None),
    "background": ("background", bool),
    "reasoning": ("reasoning settings", lambda value: bool(value) and any(v is not None for v in value.values())),
    "include": ("include", bool),
    "top_logprobs": ("top_logprobs", lambda value: value is not None),
    "truncation": ("truncation other than disabled", lambda value: value not in (None, "disabled")),
    "prompt": ("prompt (stored prompt templates)", lambda value: value is not None),
}
METADATA_MAX_KEYS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512   # OpenAI's limits


class TextFormat(BaseModel):
    """The Responses API's text.format: text, json_object, or json_schema with the schema's fields beside its type."""
    model_config = ConfigDict(populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str = Field("response", pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: Any = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema":
            if self.schema_ is None:
                raise ValueError("type json_schema needs schema: the JSON Schema of the reply")
            _answer_format("json_schema", self.schema_)
        return self

    def echo(self) -> dict:
        """As a response echoes it: the type, and a schema's fields with it."""
        if self.type != "json_schema":
            return {"type": self.type}
        return self.model_dump(by_alias=True, exclude_none=True)


class TextSettings(BaseModel):
    model_config = ConfigDict(extra="allow")   # verbosity and what comes: no format of their own

    format: TextFormat | None = None


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
    text: TextSettings | None = None
    reasoning: dict | None = None
    include: list[Any] | None = None
    top_logprobs: Any = None
    truncation: Any = None
    prompt: Any = None

    @field_validator(*RESPONSES_REFUSED)
    @classmethod
    def _refused(cls, value, info: ValidationInfo):
        return _refused_by(RESPONSES_REFUSED, value, info)

    @field_validator("tool_choice")
    @classmethod
    def _known_tool_choice(cls, value):
        named = value.get("name") if isinstance(value, dict) and value.get("type") == "function" else None
        try:
            _tool_choice(value, named)
        except ValueError:
            raise ValueError("tool_choice must be none, auto, required, or {\"type\": \"function\", \"name\": "
                             f"...}}; got {json.dumps(value)[:100]}") from None
        return value

    def chat_tool_choice(self) -> Any:
        """tool_choice in the chat API's form (a named function nests its name there)."""
        if isinstance(self.tool_choice, dict):
            return {"type": "function", "function": {"name": self.tool_choice["name"]}}
        return self.tool_choice

    def chat_response_format(self) -> dict | None:
        """text.format in the chat API's form (its json_schema's fields nest there)."""
        form = self.text.format if self.text is not None else None
        if form is None or form.type != "json_schema":
            return form.model_dump(include={"type"}) if form is not None else None
        return {"type": "json_schema", "json_schema": {"name": form.name, "description": form.description,
                                                       "schema": form.schema_, "strict": form.strict}}

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
        for text in (value or {}).items():
            _encodable(*text)
        return value

    @field_validator("user")
    @classmethod
    def _echoed_user(cls, value):
        if value is not None:
            _encodable(value)
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
