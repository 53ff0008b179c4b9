"""A served function's arguments and result as types: the pydantic checks a replica runs on each call's keyword
arguments, and the JSON schemas of the same types that the package's manifest carries for the gateway's OpenAPI
document. Unannotated parameters (and types pydantic cannot build from JSON, such as a torch.Tensor) take any value.
"""
import inspect
import typing
from collections.abc import Callable
from typing import Any

from pydantic import ConfigDict, TypeAdapter, create_model

# a call body names every argument; the replica passes a positional-only one by position (runtime/worker.py)
NAMED = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def _hints(fn: Callable) -> dict[str, Any]:
    try:
        return typing.get_type_hints(fn)
    except Exception:  # a forward reference that does not resolve: check nothing rather than fail every call
        return {}


def argument_types(fn: Callable) -> dict[str, TypeAdapter]:
    """A pydantic TypeAdapter for each parameter of `fn` whose type hint pydantic can check (others pass as sent)."""
    hints = _hints(fn)
    adapters = {}
    for name in inspect.signature(fn).parameters:
        if name in hints and hints[name] is not Any:
            try:
                adapters[name] = TypeAdapter(hints[name])
            except Exception:  # a type pydantic cannot build from JSON (a torch.Tensor, say)
                continue
    return adapters


def _hoist(schema: dict, defs: dict) -> dict:
    """`schema` with its $defs moved into `defs` (the OpenAPI document's components)."""
    defs.update(schema.pop("$defs", {}))
    return schema


def call_schemas(fn: Callable, title: str, prefix: str, bound: bool = False) -> dict:
    """{"arguments", "result", "defs", "stream"} for `fn` (`bound`: a class's method, its self skipped): the JSON
    schema of its keyword-arguments object, built with pydantic's create_model from the same types `argument_types`
    checks, and of its return annotation; shared models are in defs, referenced as #/components/schemas/PREFIX.Name."""
    refs = f"#/components/schemas/{prefix}.{{model}}"
    every = list(inspect.signature(fn).parameters.values())[1 if bound else 0:]
    params = [p for p in every if p.kind in NAMED]
    hints, checked = _hints(fn), argument_types(fn)
    fields = {p.name: (hints[p.name] if p.name in checked else Any, ... if p.default is p.empty else p.default)
              for p in params}
    open_ended = any(p.kind is p.VAR_KEYWORD for p in every)
    config = ConfigDict(extra="allow" if open_ended else "forbid", arbitrary_types_allowed=True)
    defs: dict = {}
    try:
        model = create_model(title, __config__=config, **fields)  # type: ignore[call-overload]
        arguments = _hoist(model.model_json_schema(ref_template=refs), defs)
    except Exception:  # a default JSON cannot show: the names alone
        arguments = {"type": "object", "title": title, "properties": {p.name: {} for p in params},
                     "required": [p.name for p in params if p.default is p.empty]}
    result: dict = {}
    returns = hints.get("return")
    stream = inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn)
    if returns is not None and not stream:
        try:
            result = _hoist(TypeAdapter(returns).json_schema(ref_template=refs), defs)
        except Exception:  # a type pydantic cannot describe: any JSON
            result = {}
    return {"arguments": arguments, "result": result, "defs": {f"{prefix}.{k}": v for k, v in defs.items()},
            "stream": stream}
