"""Which unit a path under /{app}/ reaches: a declared function or method, else the app's ASGI endpoint."""
from dataclasses import dataclass

from ember.gateway.deployment import Unit


@dataclass(frozen=True)
class Call:
    unit: str
    method: str


@dataclass(frozen=True)
class Forward:
    unit: str
    path: str  # what the ASGI app sees: /{rest}


def route(units: dict[str, Unit], rest: str) -> Call | Forward | None:
    first, _, tail = rest.partition("/")
    unit_name, dot, method = first.partition(".")
    unit = units.get(unit_name)
    if unit is not None and not tail:
        if not dot and unit.kind == "function" and unit.methods == [unit_name]:
            return Call(unit_name, unit_name)
        if dot and method in unit.methods:
            return Call(unit_name, method)
    asgi = next((u.name for u in units.values() if u.asgi), None)
    return Forward(asgi, f"/{rest}") if asgi else None
