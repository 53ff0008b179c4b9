"""The request-body bytes the gateway holds at once. A body is read whole (up to MAX_BODY) before its request takes a
replica slot, so a slow upload holds memory and a connection, never a replica; the bodies held together stay under
one budget (Envoy's overload manager, in one number), and past it a request is refused at once with 503."""
import os

from ember.gateway.errors import ApiError

BODY_BUDGET = int(os.environ.get("EMBER_BODY_BUDGET", str(256 << 20)))  # bytes of request bodies held at once


class BodyBudget:
    def __init__(self, limit: int = BODY_BUDGET):
        self.limit, self.held = limit, 0

    def take(self, size: int) -> None:
        if self.held + size > self.limit:
            raise ApiError(503, "gateway_busy", f"the gateway holds {self.held} bytes of request bodies, near its "
                           f"budget of {self.limit}; retry shortly", {"Retry-After": "1"})
        self.held += size

    def give(self, size: int) -> None:
        self.held -= size
