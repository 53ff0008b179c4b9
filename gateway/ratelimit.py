"""Rate limits per API key and per app: requests/min, LLM tokens/min, concurrent requests.

Policy is data (`Limits`, `Scope`), arithmetic is a pure function (`gcra`), and state
lives in one of two stores with the same async interface:

    limiter = MemoryLimiter()                      # one gateway
    limiter = RedisLimiter(redis.asyncio.Redis.from_url(url))   # gateways sharing a Redis

    scopes = [Scope("key:" + key_id, key_limits), Scope("app:" + app, app_limits)]
    admission = await limiter.admit(scopes, tokens=prompt_tokens + max_tokens)
    if not admission.allowed:   # ember.gateway.errors.ApiError renders {"error": {"type", "message"}}
        raise ApiError(429, ERROR_TYPE, denial_message(admission), headers(admission))
    try:
        response = ...                             # add headers(admission) to it
    finally:
        await limiter.release(admission.ticket, used_tokens=usage.total_tokens)

`admit` checks every scope and charges all of them or none (atomic: one Lua script in
Redis; no await between check and charge in memory). `release` must run once when
the response ends, streaming included: it frees the concurrency slot and settles the
token reservation to the real count (refund or extra charge); `used_tokens=None`
keeps the reservation as charged. A response that outlives `lease_ttl` should call
`renew(ticket)` now and then; a lease nobody renews or releases (a crashed gateway)
stops counting after `lease_ttl`.

Semantics (GCRA, i.e. a token bucket that refills continuously; a full minute's
budget may be spent at once):
- requests: a request needs one unit of the per-minute budget;
- tokens: a request is admitted while the token budget is not exhausted and then
  reserves its estimate, which may drive the budget into debt that later requests
  wait out; requests that reserve no tokens are not checked against it;
- concurrency: at most `max_concurrent` admitted, unreleased requests.

Redis clock: all times come from Redis `TIME`, so gateways with skewed clocks agree.
Every key carries an expiry. The scripts touch several scopes' keys at once, so use
one Redis primary, not Redis Cluster. Redis errors (refused, timed out) propagate:
whether to fail open or answer 503 is the gateway's call.
"""

import math
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

WINDOW = 60.0  # seconds: every limit here is per minute
DEFAULT_LEASE_TTL = 300.0  # seconds a concurrency slot survives without renew/release
CONCURRENCY_RETRY_AFTER = 1.0  # a slot frees when some response ends; there is no schedule to read


# The most each limit may be: past these a limit limits nothing (and an rpm past 2**63 failed the key database's
# write with an OverflowError traceback)
LIMIT_MOST = {"requests_per_minute": 10**9, "tokens_per_minute": 10**12, "max_concurrent": 10**6}


@dataclass(frozen=True)
class Limits:
    """The limits of one key or app; None means unlimited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None

    def __post_init__(self):
        for name, most in LIMIT_MOST.items():
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= most):
                raise ValueError(f"Limits.{name} must be a whole number from 1 to {most:,}, or None (unlimited); "
                                 f"got {value!r}")


@dataclass(frozen=True)
class Scope:
    """A subject the limits apply to, e.g. Scope("key:k_123", Limits(...)) or Scope("app:chat", ...)."""

    name: str
    limits: Limits


class Decision(NamedTuple):
    allowed: bool
    tat: float  # theoretical arrival time after this decision: the bucket is full again at tat
    retry_after: float  # seconds until the same request would be admitted; 0 when allowed
    remaining: int
    reset: float  # seconds until the bucket is full again


def charge(tat: float, now: float, rate: int, cost: float, window: float = WINDOW) -> float:
    """The tat after spending `cost` units unconditionally (negative refunds, never beyond a full bucket)."""
    return max(max(tat, now) + cost * window / rate, now)


def gcra(tat: float, now: float, rate: int, cost: float, need: float | None = None, window: float = WINDOW) -> Decision:
    """Generic cell rate algorithm: `rate` units per `window`, burst of a whole window.

    Admit when the bucket holds `need` units (default: `cost`), then charge `cost`.
    Denied requests change nothing.
    """
    need = cost if need is None else need
    interval = window / rate
    wait = max(tat, now) + need * interval - window - now
    allowed = wait <= 1e-9
    new_tat = charge(tat, now, rate, cost, window) if allowed else tat
    filled = max(new_tat - now, 0.0)
    remaining = max(math.floor((window - filled) / interval + 1e-9), 0)
    return Decision(allowed, new_tat, 0.0 if allowed else wait, remaining, filled)


@dataclass(frozen=True)
class Quota:
    """One dimension's standing, as reported in X-RateLimit-* headers."""

    limit: int
    remaining: int
    reset: float


@dataclass(frozen=True)
class Ticket:
    """What `release` and `renew` need to know about an admitted request."""

    scopes: tuple[Scope, ...]
    reserved_tokens: int
    lease: str


@dataclass(frozen=True)
class Admission:
    allowed: bool
    retry_after: float  # seconds; 0 when allowed
    reason: str  # "requests", "tokens" or "concurrency" when denied; "" when allowed
    requests: Quota | None  # the tightest request limit among the scopes, None if none is limited
    tokens: Quota | None
    ticket: Ticket | None  # None when denied: nothing was charged


def _tightest(quotas: list[Quota]) -> Quota | None:
    return min(quotas, key=lambda q: (q.remaining, -q.reset), default=None)


def _admission(scopes, tokens, lease, tats_before, tats_after, now, busy) -> Admission:
    """Judge one admit from per-scope state: tats_* map (scope, "rpm"|"tpm") -> tat; busy: scope -> live leases."""
    waits: dict[str, float] = {}  # denial reason -> seconds until it would be allowed
    requests: list[Quota] = []
    token_quotas: list[Quota] = []
    for scope in scopes:
        limits = scope.limits
        if limits.requests_per_minute:
            d = gcra(tats_before[scope.name, "rpm"], now, limits.requests_per_minute, 1)
            waits["requests"] = max(waits.get("requests", 0.0), d.retry_after)
        if limits.tokens_per_minute and tokens > 0:
            d = gcra(tats_before[scope.name, "tpm"], now, limits.tokens_per_minute, tokens, need=1)
            waits["tokens"] = max(waits.get("tokens", 0.0), d.retry_after)
        if limits.max_concurrent and busy[scope.name] >= limits.max_concurrent:
            waits["concurrency"] = CONCURRENCY_RETRY_AFTER
    denied = {reason: wait for reason, wait in waits.items() if wait > 1e-9}
    allowed = not denied
    tats = tats_after if allowed else tats_before
    for scope in scopes:
        limits = scope.limits
        if limits.requests_per_minute:
            d = gcra(tats[scope.name, "rpm"], now, limits.requests_per_minute, 0)
            requests.append(Quota(limits.requests_per_minute, d.remaining, d.reset))
        if limits.tokens_per_minute:
            d = gcra(tats[scope.name, "tpm"], now, limits.tokens_per_minute, 0)
            token_quotas.append(Quota(limits.tokens_per_minute, d.remaining, d.reset))
    reason = max(denied, key=lambda r: denied[r], default="")
    return Admission(
        allowed=allowed,
        retry_after=denied.get(reason, 0.0),
        reason=reason,
        requests=_tightest(requests),
        tokens=_tightest(token_quotas),
        ticket=Ticket(tuple(scopes), tokens, lease) if allowed else None,
    )


class Limiter(Protocol):
    """Where the limits' state lives: `MemoryLimiter` (one gateway) or `RedisLimiter` (gateways sharing a Redis)."""

    lease_ttl: float

    async def admit(self, scopes: Sequence[Scope], tokens: int = 0) -> Admission:
        """Check every scope and charge all of them or none."""
        ...

    async def release(self, ticket: Ticket, used_tokens: int | None = None) -> None:
        """Free the concurrency slot and settle the token reservation to `used_tokens` (None: as charged)."""
        ...

    async def renew(self, ticket: Ticket) -> None:
        """Keep a long response's concurrency slot past `lease_ttl`."""
        ...


class MemoryLimiter:
    """State in this process: right for a single gateway. `clock` is injectable for tests."""

    def __init__(self, lease_ttl: float = DEFAULT_LEASE_TTL, clock: Callable[[], float] = time.monotonic):
        self.lease_ttl = lease_ttl
        self.clock = clock
        self.tats: dict[tuple[str, str], float] = {}
        self.leases: dict[str, dict[str, float]] = {}  # scope -> lease id -> expiry

    def _live_leases(self, scope: str, now: float) -> dict[str, float]:
        leases = self.leases.setdefault(scope, {})
        for lease in [lease for lease, expiry in leases.items() if expiry <= now]:
            del leases[lease]
        return leases

    async def admit(self, scopes: Sequence[Scope], tokens: int = 0) -> Admission:
        now = self.clock()
        before, after, busy = {}, {}, {}
        for scope in scopes:
            for dim in ("rpm", "tpm"):
                before[scope.name, dim] = self.tats.get((scope.name, dim), now)
            limits = scope.limits
            if limits.requests_per_minute:
                after[scope.name, "rpm"] = charge(before[scope.name, "rpm"], now, limits.requests_per_minute, 1)
            if limits.tokens_per_minute:
                after[scope.name, "tpm"] = charge(before[scope.name, "tpm"], now, limits.tokens_per_minute, tokens)
            busy[scope.name] = len(self._live_leases(scope.name, now))
        admission = _admission(scopes, tokens, uuid.uuid4().hex, before, after, now, busy)
        if admission.ticket is not None:  # allowed; no await since reading the state: check and charge are one step
            self.tats.update(after)
            for scope in scopes:
                if scope.limits.max_concurrent:
                    self.leases[scope.name][admission.ticket.lease] = now + self.lease_ttl
        return admission

    async def release(self, ticket: Ticket, used_tokens: int | None = None) -> None:
        now = self.clock()
        for scope in ticket.scopes:
            self.leases.get(scope.name, {}).pop(ticket.lease, None)
            rate = scope.limits.tokens_per_minute
            if rate and used_tokens is not None and used_tokens != ticket.reserved_tokens:
                tat = self.tats.get((scope.name, "tpm"), now)
                self.tats[scope.name, "tpm"] = charge(tat, now, rate, used_tokens - ticket.reserved_tokens)

    async def renew(self, ticket: Ticket) -> None:
        now = self.clock()
        for scope in ticket.scopes:
            leases = self._live_leases(scope.name, now)
            if ticket.lease in leases:
                leases[ticket.lease] = now + self.lease_ttl


# The Lua mirrors `gcra` above: it only decides and stores; Python reads the results.
_GCRA_LUA = """
local function charge(tat, now, rate, cost, window)
  return math.max(math.max(tat, now) + cost * window / rate, now)
end
local function gcra(tat, now, rate, cost, need, window)
  local wait = math.max(tat, now) + need * window / rate - window - now
  if wait <= 1e-9 then return true, charge(tat, now, rate, cost, window) end
  return false, tat
end
local function store(key, tat, now)
  if tat <= now then redis.call('DEL', key)
  else redis.call('SET', key, string.format('%.6f', tat), 'PX', math.ceil((tat - now) * 1000) + 1) end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
"""

# KEYS: per scope rpm, tpm, leases. ARGV: window, tokens, lease id, lease ttl, then per scope rpm, tpm,
# max_concurrent (0 = none).
_ADMIT_LUA = _GCRA_LUA + """
local window, tokens, lease, ttl = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
local allowed = true
local before, after, busy = {}, {}, {}
for i = 1, #KEYS / 3 do
  local rpm, tpm, conc = tonumber(ARGV[3 + 3 * i - 1]), tonumber(ARGV[3 + 3 * i]), tonumber(ARGV[3 + 3 * i + 1])
  local rk, tk, ck = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  before[2 * i - 1] = tonumber(redis.call('GET', rk) or now)
  before[2 * i] = tonumber(redis.call('GET', tk) or now)
  after[2 * i - 1], after[2 * i] = before[2 * i - 1], before[2 * i]
  if rpm > 0 then
    local ok, tat = gcra(before[2 * i - 1], now, rpm, 1, 1, window)
    allowed = allowed and ok
    after[2 * i - 1] = tat
  end
  if tpm > 0 and tokens > 0 then
    local ok, tat = gcra(before[2 * i], now, tpm, tokens, 1, window)
    allowed = allowed and ok
    after[2 * i] = tat
  end
  redis.call('ZREMRANGEBYSCORE', ck, '-inf', now)
  busy[i] = redis.call('ZCARD', ck)
  if conc > 0 and busy[i] >= conc then allowed = false end
end
if allowed then
  for i = 1, #KEYS / 3 do
    store(KEYS[3 * i - 2], after[2 * i - 1], now)
    store(KEYS[3 * i - 1], after[2 * i], now)
    if tonumber(ARGV[3 + 3 * i + 1]) > 0 then
      redis.call('ZADD', KEYS[3 * i], now + ttl, lease)
      redis.call('PEXPIRE', KEYS[3 * i], math.ceil(ttl * 1000))
    end
  end
end
local out = {string.format('%.6f', now)}
for i = 1, #before do
  out[#out + 1] = string.format('%.6f', before[i])
  out[#out + 1] = string.format('%.6f', after[i])
end
for i = 1, #busy do out[#out + 1] = busy[i] end
return out
"""

# KEYS: per scope tpm, leases. ARGV: window, token delta, lease id, then per scope tpm (0 = none).
_RELEASE_LUA = _GCRA_LUA + """
local window, delta, lease = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
for i = 1, #KEYS / 2 do
  redis.call('ZREM', KEYS[2 * i], lease)
  local tpm = tonumber(ARGV[3 + i])
  if tpm > 0 and delta ~= 0 then
    local tat = charge(tonumber(redis.call('GET', KEYS[2 * i - 1]) or now), now, tpm, delta, window)
    store(KEYS[2 * i - 1], tat, now)
  end
end
return 1
"""

# KEYS: per scope leases. ARGV: lease id, lease ttl.
_RENEW_LUA = """
local t = redis.call('TIME')
local expiry = tonumber(t[1]) + tonumber(t[2]) / 1000000 + tonumber(ARGV[2])
for i = 1, #KEYS do
  if redis.call('ZADD', KEYS[i], 'XX', 'CH', expiry, ARGV[1]) == 1 then
    redis.call('PEXPIRE', KEYS[i], math.ceil(tonumber(ARGV[2]) * 1000))
  end
end
return 1
"""


class RedisLimiter:
    """State in Redis, shared by every gateway using the same `prefix`; scripts run by EVALSHA."""

    def __init__(self, client, prefix: str = "ember:ratelimit", lease_ttl: float = DEFAULT_LEASE_TTL):
        self.prefix = prefix
        self.lease_ttl = lease_ttl
        self._admit = client.register_script(_ADMIT_LUA)
        self._release = client.register_script(_RELEASE_LUA)
        self._renew = client.register_script(_RENEW_LUA)

    def _key(self, scope: Scope, dim: str) -> str:
        return f"{self.prefix}:{scope.name}:{dim}"

    async def admit(self, scopes: Sequence[Scope], tokens: int = 0) -> Admission:
        keys, args = [], [WINDOW, tokens, uuid.uuid4().hex, self.lease_ttl]
        for scope in scopes:
            keys += [self._key(scope, "rpm"), self._key(scope, "tpm"), self._key(scope, "leases")]
            limits = scope.limits
            args += [limits.requests_per_minute or 0, limits.tokens_per_minute or 0, limits.max_concurrent or 0]
        out = await self._admit(keys=keys, args=args)
        now = float(out[0])
        before, after, busy = {}, {}, {}
        for i, scope in enumerate(scopes):
            for j, dim in enumerate(("rpm", "tpm")):
                before[scope.name, dim] = float(out[1 + 4 * i + 2 * j])
                after[scope.name, dim] = float(out[2 + 4 * i + 2 * j])
            busy[scope.name] = int(out[1 + 4 * len(scopes) + i])
        return _admission(scopes, tokens, args[2], before, after, now, busy)

    async def release(self, ticket: Ticket, used_tokens: int | None = None) -> None:
        delta = 0 if used_tokens is None else used_tokens - ticket.reserved_tokens
        keys, args = [], [WINDOW, delta, ticket.lease]
        for scope in ticket.scopes:
            keys += [self._key(scope, "tpm"), self._key(scope, "leases")]
            args.append(scope.limits.tokens_per_minute or 0)
        await self._release(keys=keys, args=args)

    async def renew(self, ticket: Ticket) -> None:
        keys = [self._key(scope, "leases") for scope in ticket.scopes if scope.limits.max_concurrent]
        if keys:
            await self._renew(keys=keys, args=[ticket.lease, self.lease_ttl])


def _duration(seconds: float) -> str:
    """OpenAI's reset format: "250ms", "1.5s", "6m0s"."""
    seconds = round(seconds, 3)
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    minutes, rest = divmod(seconds, 60)
    rest_text = f"{rest:.3f}".rstrip("0").rstrip(".")
    return f"{int(minutes)}m{rest_text}s" if minutes else f"{rest_text}s"


def headers(admission: Admission) -> dict[str, str]:
    """X-RateLimit-{Limit,Remaining,Reset}-{Requests,Tokens} (OpenAI's names), Retry-After when denied."""
    out = {}
    for name, quota in (("Requests", admission.requests), ("Tokens", admission.tokens)):
        if quota is not None:
            out[f"X-RateLimit-Limit-{name}"] = str(quota.limit)
            out[f"X-RateLimit-Remaining-{name}"] = str(quota.remaining)
            out[f"X-RateLimit-Reset-{name}"] = _duration(quota.reset)
    if not admission.allowed:
        out["Retry-After"] = str(_retry_after_s(admission))
    return out


def _retry_after_s(admission: Admission) -> int:
    return max(math.ceil(admission.retry_after), 1)


ERROR_TYPE = "rate_limit_exceeded"  # the error type of the 429 body


def denial_message(admission: Admission) -> str:
    """The message of the 429 body: which limit, and when to come back."""
    what = {
        "requests": "requests per minute",
        "tokens": "tokens per minute",
        "concurrency": "concurrent requests",
    }[admission.reason]
    return (
        f"Rate limit on {what} reached; retry after {_retry_after_s(admission)} s "
        "(see Retry-After) or ask for a higher limit."
    )
