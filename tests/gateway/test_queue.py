"""The per-function queue: buffers while replicas start, stamps cold starts, fails waiters when a start fails."""
import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from ember.gateway import retry
from ember.gateway.deployment import Unit, scaling_settings
from ember.gateway.errors import ApiError
from ember.gateway.lifecycle import HOT
from ember.gateway.queue import FunctionQueue, Retired
from ember.gateway.replica import GatewayReplica
from ember.gateway.routing import Router
from ember.gateway.scaler import Scaler
from ember.spec import FunctionSpec


def replica(name: str) -> GatewayReplica:
    return GatewayReplica(name, "app", "fn", Path("/dev/null"))


def function_queue(max_concurrency: int, bound: int, on_demand=lambda: None) -> FunctionQueue:
    return FunctionQueue(Router(max_concurrency), wait_timeout=5, bound=bound, on_demand=on_demand)


async def settle(turns: int = 20) -> None:
    """Lets every task that can run do so, however slow the host: turns of the event loop, not a wait on the clock
    (a 10 ms sleep on a loaded 2-core machine could end before the tasks it was for had run)."""
    for _ in range(turns):
        await asyncio.sleep(0)


def ready(queue: FunctionQueue, r: GatewayReplica) -> None:
    r.ready()
    queue.dispatch()


def test_waits_for_a_start_then_reuses_the_slot():
    async def scenario():
        demand = []
        queue = function_queue(1, 4, on_demand=lambda: demand.append(1))
        r = replica("r1")
        queue.router.add(r)
        first = asyncio.create_task(queue.acquire())
        second = asyncio.create_task(queue.acquire())
        await asyncio.sleep(0.05)
        assert queue.depth == 2 and demand == [1, 1]
        ready(queue, r)
        lease = await first
        assert lease.replica is r and lease.cold_start.tier == "node-warm"
        assert lease.cold_start.ms >= 40 and lease.cold_start.header().startswith("node-warm; ms=")
        assert not second.done() and r.in_flight == 1  # max_concurrency=1
        queue.release(r)
        later = await second
        assert later.replica is r and later.cold_start.tier == "node-warm"  # it arrived before the start too
        third = asyncio.create_task(queue.acquire())
        await asyncio.sleep(0.01)
        queue.release(r)
        assert (await third).cold_start is None  # it waited for a busy slot, not for a start
        queue.release(r)
        assert r.in_flight == 0 and r.idle_since is not None
        assert (await queue.acquire()).cold_start is None

    asyncio.run(scenario())


def test_failed_start_answers_every_waiter_503():
    async def scenario():
        queue = function_queue(1, 4)
        r = replica("r1")
        queue.router.add(r)
        waiters = [asyncio.create_task(queue.acquire()) for _ in range(3)]
        await asyncio.sleep(0.01)
        r.fail("enter failed: OSError: disk")
        Scaler._forget(SimpleNamespace(router=queue.router, queue=queue), r)
        for task in waiters:
            with pytest.raises(ApiError) as error:
                await task
            assert error.value.status == 503 and error.value.message == "enter failed: OSError: disk"
        assert queue.depth == 0

    asyncio.run(scenario())


def test_full_queue_and_wake_of_parked():
    async def scenario():
        queue = function_queue(1, 1)
        queue.router.add(replica("starting"))
        waiting = asyncio.create_task(queue.acquire())
        await asyncio.sleep(0.01)
        with pytest.raises(ApiError) as full:
            await queue.acquire()
        assert full.value.status == 503 and "queue full" in full.value.message and full.value.headers["Retry-After"]
        parked = replica("parked")
        parked.ready()
        parked.park()
        queue.router.add(parked)
        queue.dispatch()
        lease = await waiting
        assert lease.replica is parked and parked.state == HOT and lease.cold_start.tier == "parked"

    asyncio.run(scenario())


def test_callers_take_turns_for_free_slots():
    """One caller's backlog does not go first as a block: slots alternate between the callers waiting."""
    async def scenario():
        queue = function_queue(1, 64)
        r = replica("r1")
        queue.router.add(r)
        r.ready()
        assert (await queue.acquire(caller="busy")).replica is r  # the one slot is taken
        order = []

        async def call(caller: str, n: int):
            await queue.acquire(caller=caller)
            order.append(f"{caller}{n}")

        tasks = [asyncio.create_task(call("flood", n)) for n in range(5)]
        await asyncio.sleep(0.01)
        tasks += [asyncio.create_task(call("other", n)) for n in range(2)]
        await asyncio.sleep(0.01)
        for _ in range(7):
            queue.release(r)
            await asyncio.sleep(0.01)
        await asyncio.gather(*tasks)
        assert order == ["flood0", "other0", "flood1", "other1", "flood2", "flood3", "flood4"]
        assert not queue.callers and not queue.turns  # nothing kept for callers with nothing waiting

    asyncio.run(scenario())



def test_a_call_takes_a_slot_per_sequence_and_at_most_a_whole_replica():
    """An LLM request of n=8 takes 8 of a replica's max_concurrency slots; one asking for more than a replica has
    takes all of one; a call that fits nowhere waits, and the queue's demand (what the autoscaler counts) is the
    slots its calls ask for. While it waits it keeps the least loaded replica: later calls take the others' free
    slots, not that one's."""
    async def scenario():
        queue = function_queue(8, 16)
        a, b = replica("a"), replica("b")
        for r in (a, b):
            queue.router.add(r)
            r.ready()
        big = await queue.acquire(sequences=6)
        small = await queue.acquire(sequences=3)   # 2 left on the first replica: it goes to the second
        assert big.slots == 6 and small.slots == 3 and {big.replica, small.replica} == {a, b}
        assert queue.router.load == 9 and queue.router.in_flight == 2
        huge = asyncio.create_task(queue.acquire(sequences=10_000))   # a whole replica: waits for an empty one
        beside = asyncio.create_task(queue.acquire(sequences=2))   # fits beside big: backfilled there at once
        await settle()
        assert not huge.done() and beside.done() and big.replica.load == 8
        held = await beside
        assert held.replica is big.replica
        # small's replica (3 of 8 taken) is the one huge keeps: a call that would fit only there waits behind it
        kept_out = asyncio.create_task(queue.acquire(sequences=1))
        await settle()
        assert not kept_out.done() and queue.depth == 2 and queue.demand == 8 + 1
        queue.release(small.replica, small.slots)
        lease = await huge
        assert lease.replica is small.replica and lease.slots == 8 and small.replica.load == 8
        assert not kept_out.done()   # both replicas full now
        queue.release(held.replica, held.slots)
        assert (await kept_out).replica is big.replica and big.replica.load == 7 and queue.demand == 0
        for done in (big, lease):
            queue.release(done.replica, done.slots)
        assert big.replica.load == 1 and small.replica.load == 0 and small.replica.idle_since is not None

    asyncio.run(scenario())


def test_a_waiting_call_of_a_whole_replica_is_not_passed_by_lighter_calls_on_one_replica():
    """Backfill never starves the head: with one replica, the calls behind a call that needs all of it wait for it,
    though each would fit in the slots that free first."""
    async def scenario():
        queue = function_queue(4, 16)
        only = replica("only")
        queue.router.add(only)
        only.ready()
        first = await queue.acquire(sequences=2)
        second = await queue.acquire(sequences=1)
        whole = asyncio.create_task(queue.acquire(sequences=4))
        light = [asyncio.create_task(queue.acquire()) for _ in range(3)]
        await settle()
        queue.release(first.replica, first.slots)   # 3 slots free: every light call would fit
        await settle()
        assert not whole.done() and not any(t.done() for t in light) and only.load == 1
        queue.release(second.replica, second.slots)
        lease = await whole
        assert lease.slots == 4 and only.load == 4 and not any(t.done() for t in light)
        queue.release(lease.replica, lease.slots)
        await asyncio.gather(*light)
        assert only.load == 3 and queue.depth == 0

    asyncio.run(scenario())


def test_a_full_queue_takes_another_callers_call_in_place_of_the_newest_of_the_largest_backlog():
    async def scenario():
        queue = function_queue(1, 6)
        queue.router.add(replica("starting"))
        flood = [asyncio.create_task(queue.acquire(caller="flood")) for _ in range(6)]
        await settle()
        with pytest.raises(ApiError) as full:  # its own backlog fills the queue: the usual 503
            await queue.acquire(caller="flood")
        assert full.value.status == 503 and "queue full" in full.value.message
        others = [asyncio.create_task(queue.acquire(caller=f"other{n}")) for n in range(3)]
        await settle()
        assert queue.depth == 6 and not any(t.done() for t in others)  # each other caller found a place
        displaced = [t for t in flood if t.done()]
        assert displaced == flood[-3:]  # the newest of the backlog gave way
        for task in displaced:
            error = task.exception()
            assert error.status == 429 and error.type == "queue_share" and error.headers["Retry-After"]
        others.append(asyncio.create_task(queue.acquire(caller="other0")))  # flood holds 3, other0 1: room again
        await settle()
        assert flood[2].done() and not others[-1].done()
        with pytest.raises(ApiError) as even:  # flood 2, other0 2: room is made only for a caller two places behind
            await queue.acquire(caller="other0")
        assert even.value.status == 503 and "queue full" in even.value.message
        for task in flood + others:
            task.cancel()
        await asyncio.gather(*flood, *others, return_exceptions=True)
        assert queue.depth == 0 and not queue.callers and not queue.turns

    asyncio.run(scenario())


def unit(name: str, methods: list[str], queue: FunctionQueue) -> Unit:
    spec = FunctionSpec()
    return Unit("app", name, "class", methods, False, spec, queue.router, queue, scaling_settings(spec))


def test_a_replaced_versions_queue_sends_its_calls_to_the_new_version():
    """A redeploy closes the old version's queues: calls waiting there, and calls that found the old function
    before the redeploy and reach its queue after, take a slot on the new version's replicas; a method the new
    version dropped is a 404 that says so."""
    async def scenario():
        old = unit("Greeter", ["greet", "wave"], function_queue(1, 8))
        busy = replica("old-1")
        busy.ready()
        old.router.add(busy)
        assert (await retry.acquire(old, "greet", None, None))[1].replica is busy  # its one slot is taken
        waiting = asyncio.create_task(retry.acquire(old, "greet", None, None))
        await asyncio.sleep(0.01)
        assert old.queue.depth == 1

        new = unit("Greeter", ["greet"], function_queue(4, 8))
        fresh = replica("new-1")
        fresh.ready()
        new.router.add(fresh)
        old.successor = new
        old.queue.close()
        moved_unit, moved = await waiting
        assert moved_unit is new and moved.replica is fresh and old.queue.depth == 0
        late_unit, late = await retry.acquire(old, "greet", None, None)
        assert late_unit is new and late.replica is fresh and fresh.in_flight == 2
        with pytest.raises(Retired):
            await old.queue.acquire()
        with pytest.raises(ApiError) as dropped:
            await retry.acquire(old, "wave", None, None)
        assert dropped.value.status == 404 and "new version has no Greeter.wave" in dropped.value.message
        old.successor = None  # the new version has no such class at all
        with pytest.raises(ApiError) as gone:
            await retry.acquire(old, "greet", None, None)
        assert gone.value.status == 404 and "was redeployed while this call waited" in gone.value.message

    asyncio.run(scenario())
