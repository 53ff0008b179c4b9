"""gateway/settlement.py: the rate-limit charge of a request, given back when its reply ends."""
import asyncio

from ember.gateway.ratelimit import Limits, MemoryLimiter, Scope
from ember.gateway.settlement import Settlement


def test_a_long_stream_keeps_its_concurrency_slot_past_the_lease_ttl_and_frees_it_at_the_end():
    async def scenario() -> list[bool]:
        limiter = MemoryLimiter(lease_ttl=0.3)
        scopes = [Scope("key:k", Limits(max_concurrent=1))]
        settle = Settlement(limiter, await limiter.admit(scopes), meter=None)
        settle.hold()
        await asyncio.sleep(1.0)  # three lease TTLs into the stream
        during = (await limiter.admit(scopes)).allowed
        await settle()
        await settle()  # once only
        after = await limiter.admit(scopes)
        await asyncio.sleep(0)
        return [during, after.allowed, settle.renewal.cancelled()]

    assert asyncio.run(scenario()) == [False, True, True]
