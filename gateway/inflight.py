"""The request-body bytes the gateway holds at once. A body is read whole (up to MAX_BODY) before its request takes a
replica slot, so a slow upload holds memory and a connection, never a replica; the bodies held together stay under
one budget (Envoy's overload manager, in one number). A body is admitted into the budget before it is read (by its
Content-Length; a chunked one as it grows); when the budget is full its request waits, first come first served, its
body left unread so the client's sending pauses (TCP backpressure), and is refused with 503 only after BUDGET_WAIT
(or the body timeout, if shorter)."""
import asyncio
from collections import deque

from ember.gateway.errors import ApiError

BUDGET_WAIT = 10.0  # seconds a body waits for room in the budget before its request is refused


class BodyBudget:
    def __init__(self, limit: int, read_timeout: float, wait: float = BUDGET_WAIT):
        self.limit, self.read_timeout = limit, read_timeout
        self.wait = min(wait, read_timeout)  # never longer than a body may take to arrive
        self.held = 0
        self.waiting: deque[tuple[int, asyncio.Future]] = deque()  # (bytes, granted), in the order they asked

    async def take(self, size: int) -> None:
        """Hold `size` more bytes, waiting up to `wait` seconds behind earlier requests for room."""
        if not self.waiting and self.held + size <= self.limit:
            self.held += size
            return
        granted = asyncio.get_running_loop().create_future()
        entry = (size, granted)
        self.waiting.append(entry)
        try:
            async with asyncio.timeout(self.wait):
                await asyncio.shield(granted)
        except BaseException as exc:  # timed out, or the client left: give up the place, or the bytes just granted
            if granted.done():
                self.give(size)
            else:
                granted.cancel()
                self.waiting.remove(entry)
                self._grant()  # this one may have been first in line, holding back smaller ones that fit
            if isinstance(exc, TimeoutError):
                raise ApiError(503, "gateway_busy", f"the gateway holds {self.held} bytes of request bodies, its "
                               f"budget is {self.limit} (--body-budget) and this body found no room within "
                               f"{self.wait:g} s; retry shortly", {"Retry-After": "1"}) from None
            raise

    def give(self, size: int) -> None:
        self.held -= size
        self._grant()

    def _grant(self) -> None:
        while self.waiting and self.held + self.waiting[0][0] <= self.limit:
            size, granted = self.waiting.popleft()
            self.held += size
            granted.set_result(None)
