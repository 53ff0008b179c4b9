"""What one request to an app did, filled in along the request path for whoever reports on it (its trace span)."""
from dataclasses import dataclass

from starlette.requests import Request

from ember.gateway.queue import Lease


@dataclass
class CallRecord:
    app: str
    function: str | None = None  # once the path resolved to one (a method name, or the ASGI unit)
    lease: Lease | None = None  # once it held a replica slot
    error: str | None = None  # the error type it was refused with

    def keep(self, request: Request) -> "CallRecord":
        request.state.call = self
        return self


def record_of(scope) -> CallRecord | None:
    return scope.get("state", {}).get("call")
