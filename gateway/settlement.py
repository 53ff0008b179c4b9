"""Rate limits on the request path: `charge` takes a request's share of its key's and its app's limits before it is
queued (or answers 429); a `Settlement` gives the charge back once, when the reply has ended."""
import asyncio
import contextlib
import logging

from ember.gateway.app_limits import AppLimitStore
from ember.gateway.errors import ApiError
from ember.gateway.keys import ApiKey
from ember.gateway.ratelimit import ERROR_TYPE, Admission, Limiter, Limits, Scope, Ticket, denial_message, headers
from ember.gateway.usage import UsageMeter
from ember.runtime import logs

log = logging.getLogger("ember.gateway")

UNLIMITED = Limits()


async def charge(limiter: Limiter, app_limits: AppLimitStore, key: ApiKey, app: str, tokens: int) -> Admission | None:
    """Charge the key's and the app's limits, or answer 429; None when neither has any."""
    limits = app_limits.cached(app)
    if limits is None:
        limits = await asyncio.to_thread(app_limits.get, app)
    scopes = [s for s in (Scope(f"key:{key.id}", key.limits), Scope(f"app:{app}", limits)) if s.limits != UNLIMITED]
    if not scopes:
        return None
    try:
        admission = await limiter.admit(scopes, tokens=tokens)
    except Exception as exc:  # Redis down or unreachable: fail closed, limits are a promise to the operator
        log.error("rate limiter unavailable: %s: %s", type(exc).__name__, exc)
        raise ApiError(503, "rate_limiter_unavailable", "the rate-limit store (Redis) is not answering; retry shortly",
                       {"Retry-After": "1"}) from None
    if not admission.allowed:
        logs.annotate(rate_limited=admission.reason)  # counted in /metrics by the limit that refused
        raise ApiError(429, ERROR_TYPE, denial_message(admission), headers(admission))
    return admission


class Settlement:
    """Frees the rate-limit charge once, when the response has ended, with the tokens it really used; a stream
    that holds a concurrency slot renews it meanwhile, so it outlives the limiter's lease TTL."""

    def __init__(self, limiter: Limiter, admission: Admission | None, meter: UsageMeter | None):
        self.limiter, self.meter = limiter, meter
        self.ticket = admission.ticket if admission is not None else None  # what was charged; None once released
        self.renewal: asyncio.Task | None = None

    def hold(self) -> None:
        if self.ticket is not None and any(s.limits.max_concurrent for s in self.ticket.scopes):
            self.renewal = asyncio.create_task(self._renew(self.ticket))

    async def _renew(self, ticket: Ticket) -> None:
        while True:
            await asyncio.sleep(self.limiter.lease_ttl / 3)
            with contextlib.suppress(Exception):  # a missed renewal costs nothing until the lease would expire
                await self.limiter.renew(ticket)

    async def __call__(self) -> None:
        ticket, self.ticket = self.ticket, None
        if ticket is None:
            return
        if self.renewal is not None:
            self.renewal.cancel()
        try:
            await self.limiter.release(ticket, used_tokens=self.meter.total() if self.meter else None)
        except Exception as exc:  # the lease expires by itself; the reply already went out
            log.error("rate limiter release failed: %s: %s", type(exc).__name__, exc)
