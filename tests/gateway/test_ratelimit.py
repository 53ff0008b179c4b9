import asyncio
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import redis
import redis.asyncio as aredis
from hypothesis import given
from hypothesis import strategies as st

from ember.gateway.ratelimit import (
    WINDOW,
    Admission,
    Limits,
    MemoryLimiter,
    Quota,
    RedisLimiter,
    Scope,
    charge,
    denial_message,
    gcra,
    headers,
)
from tests.redis_server import redis_url  # noqa: F401  (pytest fixture)

REPO = Path(__file__).resolve().parents[2]


# --- the arithmetic, without clocks ---------------------------------------------------


def test_gcra_admits_a_full_burst_then_one_per_interval():
    tat, now = 0.0, 100.0
    for expected_remaining in (2, 1, 0):
        d = gcra(tat, now, rate=3, cost=1)
        assert d.allowed and d.remaining == expected_remaining
        tat = d.tat
    denied = gcra(tat, now, rate=3, cost=1)
    assert not denied.allowed and denied.tat == tat
    assert denied.retry_after == pytest.approx(20.0)
    assert denied.reset == pytest.approx(60.0)
    assert not gcra(tat, now + 19.9, rate=3, cost=1).allowed
    assert gcra(tat, now + 20.0, rate=3, cost=1).allowed


def test_gcra_need_below_cost_lets_a_reservation_run_into_debt_that_later_requests_wait_out():
    # 100 tokens/min, 90 already spent: a 500-token reservation is admitted (budget not exhausted) ...
    spent = gcra(0.0, 0.0, rate=100, cost=90)
    reserved = gcra(spent.tat, 0.0, rate=100, cost=500, need=1)
    assert reserved.allowed and reserved.remaining == 0
    assert reserved.tat == pytest.approx(590 * 0.6)
    # ... and the next request waits until one token's worth of the debt is repaid.
    nxt = gcra(reserved.tat, 0.0, rate=100, cost=10, need=1)
    assert not nxt.allowed and nxt.retry_after == pytest.approx(590 * 0.6 + 0.6 - 60)


def test_gcra_refund_restores_budget_but_never_beyond_full():
    spent = gcra(0.0, 0.0, rate=100, cost=80)
    assert spent.remaining == 20
    assert gcra(charge(spent.tat, 0.0, rate=100, cost=-50), 0.0, rate=100, cost=0).remaining == 70
    assert charge(spent.tat, 0.0, rate=100, cost=-500) == 0.0  # full, not a credit
    # Settling applies even to a bucket deep in debt.
    debt = charge(0.0, 0.0, rate=100, cost=300)
    assert charge(debt, 0.0, rate=100, cost=-250) == pytest.approx(30.0)


@given(
    rate=st.integers(1, 40),
    steps=st.lists(st.tuples(st.floats(0, 20, allow_nan=False), st.integers(1, 5)), max_size=60),
)
def test_gcra_never_admits_more_than_a_burst_plus_refill(rate, steps):
    tat, now, admitted = 0.0, 0.0, []
    for dt, cost in steps:
        now += dt
        d = gcra(tat, now, rate, cost)
        if d.allowed:
            admitted.append((now, cost))
            tat = d.tat
        elif cost <= rate:
            # Waiting exactly retry_after is enough.
            assert gcra(tat, now + d.retry_after, rate, cost).allowed
    for i in range(len(admitted)):
        total = 0
        for j in range(i, len(admitted)):
            total += admitted[j][1]
            assert total <= rate * (1 + (admitted[j][0] - admitted[i][0]) / WINDOW) + 1e-6


def test_headers_use_openai_names_and_whole_second_retry_after():
    admission = Admission(
        allowed=False,
        retry_after=2.01,
        reason="tokens",
        requests=Quota(limit=60, remaining=12, reset=48.0),
        tokens=Quota(limit=1000, remaining=0, reset=372.5),
        ticket=None,
    )
    assert headers(admission) == {
        "X-RateLimit-Limit-Requests": "60",
        "X-RateLimit-Remaining-Requests": "12",
        "X-RateLimit-Reset-Requests": "48s",
        "X-RateLimit-Limit-Tokens": "1000",
        "X-RateLimit-Remaining-Tokens": "0",
        "X-RateLimit-Reset-Tokens": "6m12.5s",
        "Retry-After": "3",
    }
    message = denial_message(admission)
    assert "tokens per minute" in message and "retry after 3 s" in message


def test_limits_reject_nonsense_with_the_field_name():
    with pytest.raises(ValueError, match="requests_per_minute"):
        Limits(requests_per_minute=0)
    with pytest.raises(ValueError, match="max_concurrent"):
        Limits(max_concurrent=2.5)


# --- both stores, one behaviour ----------------------------------------------------------


class FakeClock:
    def __init__(self):
        self.now = 1_000.0

    def __call__(self):
        return self.now


@pytest.fixture(params=["memory", "redis"])
def run(request):
    """run(scenario, **limiter_kwargs): scenario(limiter, wait) on a MemoryLimiter (fake clock) or a RedisLimiter."""

    def go(scenario, **kwargs):
        async def main():
            if request.param == "memory":
                clock = FakeClock()

                async def wait(seconds):
                    clock.now += seconds

                await scenario(MemoryLimiter(clock=clock, **kwargs), wait)
            else:
                client = aredis.Redis.from_url(request.getfixturevalue("redis_url"))
                try:
                    await scenario(RedisLimiter(client, prefix=f"t{uuid.uuid4().hex}", **kwargs), asyncio.sleep)
                finally:
                    await client.aclose()

        asyncio.run(main())

    return go


def test_requests_per_minute(run):
    scopes = [Scope("key:a", Limits(requests_per_minute=5))]

    async def scenario(limiter, wait):
        results = [await limiter.admit(scopes) for _ in range(6)]
        assert [r.allowed for r in results] == [True] * 5 + [False]
        assert [r.requests.remaining for r in results] == [4, 3, 2, 1, 0, 0]
        denied = results[-1]
        assert denied.reason == "requests" and denied.ticket is None
        assert 11 < denied.retry_after <= 12  # one request every 12 s
        assert headers(denied)["Retry-After"] == "12"
        assert results[0].tokens is None  # no token limit, no token headers

    run(scenario)


def test_token_reservation_is_settled_when_the_response_ends(run):
    scopes = [Scope("key:a", Limits(tokens_per_minute=1000))]

    async def scenario(limiter, wait):
        first = await limiter.admit(scopes, tokens=1200)  # budget not exhausted: admitted into debt
        assert first.allowed and first.tokens.remaining == 0
        blocked = await limiter.admit(scopes, tokens=10)
        assert not blocked.allowed and blocked.reason == "tokens"
        assert 12 < blocked.retry_after <= 12.06 + 1e-6  # 200 tokens of debt + 1 at 1000/min
        await limiter.release(first.ticket, used_tokens=300)  # refund 900
        second = await limiter.admit(scopes, tokens=100)
        assert second.allowed and 595 <= second.tokens.remaining <= 600
        await limiter.release(second.ticket, used_tokens=1000)  # charge 900 more: 18 s in debt
        assert not (await limiter.admit(scopes, tokens=1)).allowed
        plain = await limiter.admit(scopes)  # a request that uses no tokens is not held back
        assert plain.allowed

    run(scenario)


def test_concurrency_slots_are_acquired_and_released(run):
    scopes = [Scope("app:x", Limits(max_concurrent=2))]

    async def scenario(limiter, wait):
        a, b = await limiter.admit(scopes), await limiter.admit(scopes)
        third = await limiter.admit(scopes)
        assert a.allowed and b.allowed and not third.allowed
        assert third.reason == "concurrency" and headers(third)["Retry-After"] == "1"
        await limiter.release(a.ticket)
        assert (await limiter.admit(scopes)).allowed
        assert not (await limiter.admit(scopes)).allowed

    run(scenario)


def test_a_lease_nobody_renews_expires(run):
    scopes = [Scope("app:x", Limits(max_concurrent=1))]

    async def scenario(limiter, wait):
        held = await limiter.admit(scopes)
        assert held.allowed
        await wait(0.6)
        await limiter.renew(held.ticket)
        await wait(0.6)  # 1.2 s after admit, 0.6 s after renew: still held
        assert not (await limiter.admit(scopes)).allowed
        await wait(0.5)  # crashed gateway: no release, the lease runs out
        assert (await limiter.admit(scopes)).allowed

    run(scenario, lease_ttl=1.0)


def test_scopes_are_charged_all_or_nothing(run):
    key = Scope("key:a", Limits(requests_per_minute=10))
    app = Scope("app:x", Limits(requests_per_minute=2))

    async def scenario(limiter, wait):
        assert (await limiter.admit([key, app])).allowed
        assert (await limiter.admit([key, app])).allowed
        denied = await limiter.admit([key, app])
        assert not denied.allowed
        assert denied.requests == Quota(limit=2, remaining=0, reset=denied.requests.reset)  # the tighter scope
        for _ in range(3):
            assert not (await limiter.admit([key, app])).allowed
        # The denied attempts did not spend the key's budget: 8 of 10 are left.
        alone = [await limiter.admit([key]) for _ in range(9)]
        assert [a.allowed for a in alone] == [True] * 8 + [False]

    run(scenario)


# --- Redis specifics --------------------------------------------------------------------


def test_redis_keys_expire_and_scripts_run_by_evalsha(redis_url):  # noqa: F811
    prefix = f"t{uuid.uuid4().hex}"
    scopes = [Scope("key:a", Limits(requests_per_minute=60, tokens_per_minute=600, max_concurrent=3))]

    async def main():
        client = aredis.Redis.from_url(redis_url)
        try:
            limiter = RedisLimiter(client, prefix=prefix, lease_ttl=30)
            await limiter.admit(scopes, tokens=60)
            keys = await client.keys(f"{prefix}:*")
            assert len(keys) == 3
            for key in keys:
                assert 0 < await client.pttl(key) <= 60_000
            stats = await client.info("commandstats")
            assert stats["cmdstat_evalsha"]["calls"] >= 1
        finally:
            await client.aclose()

    asyncio.run(main())


def test_redis_limiters_on_skewed_clocks_agree(redis_url, monkeypatch):  # noqa: F811
    prefix = f"t{uuid.uuid4().hex}"
    scopes = [Scope("key:a", Limits(requests_per_minute=6))]
    real_time, real_time_ns = time.time, time.time_ns

    def skew(seconds):  # the wall clock is what drifts between hosts
        monkeypatch.setattr(time, "time", lambda: real_time() + seconds)
        monkeypatch.setattr(time, "time_ns", lambda: real_time_ns() + seconds * 10**9)

    async def main():
        client = aredis.Redis.from_url(redis_url)
        try:
            ahead, behind = RedisLimiter(client, prefix=prefix), RedisLimiter(client, prefix=prefix)
            results = []
            for i in range(8):  # gateways one hour apart take turns
                skew(3600 if i % 2 else -3600)
                results.append(await (ahead if i % 2 else behind).admit(scopes))
            assert [r.allowed for r in results] == [True] * 6 + [False] * 2
            assert all(9 < r.retry_after <= 10 for r in results[6:])
        finally:
            await client.aclose()

    asyncio.run(main())


GATEWAY_PROCESS = """
import asyncio, sys
import redis.asyncio as aredis
from ember.gateway.ratelimit import Limits, RedisLimiter, Scope

async def main(url, prefix, attempts):
    client = aredis.Redis.from_url(url)
    limiter = RedisLimiter(client, prefix=prefix)
    scope = Scope("app:shared", Limits(requests_per_minute=20, max_concurrent=1000))
    await client.rpush(prefix + ":ready", 1)
    await client.blpop([prefix + ":go"])
    admitted = 0
    for _ in range(attempts):
        admission = await limiter.admit([scope])
        admitted += admission.allowed
    print(admitted)
    await client.aclose()

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""


def test_two_gateway_processes_sharing_redis_enforce_one_limit(redis_url):  # noqa: F811
    prefix = f"t{uuid.uuid4().hex}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", GATEWAY_PROCESS, redis_url, prefix, "30"], cwd=REPO, stdout=subprocess.PIPE
        )
        for _ in range(2)
    ]
    client = redis.Redis.from_url(redis_url)
    try:
        for _ in procs:  # both connected before either starts, so their attempts interleave
            assert client.blpop([f"{prefix}:ready"], timeout=60), "gateway process did not start"
        client.rpush(f"{prefix}:go", 1, 1)
        counts = [int(p.communicate(timeout=60)[0]) for p in procs]
    finally:
        client.close()
        for p in procs:
            p.kill()
            p.wait()
    # 60 attempts against 20/min: each process alone would admit 20; together they admit 20.
    # (Refill is one request per 3 s, far longer than the few ms the attempts take.)
    assert sum(counts) == 20, counts
    assert all(p.returncode == 0 for p in procs)
