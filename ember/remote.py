"""Calling a deployed function or method from Python: `.remote`, `.remote_gen`, `.map`, `.starmap` and `.spawn`,
each with an asyncio twin as `.aio` (`await f.remote.aio(x)`, `async for v in f.map.aio(xs)`)."""
import asyncio
import inspect
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any

from ember.client import AsyncClient, Client, RemoteError

# Calls of one map in flight at once: generous, so the gateway's queue (and so the autoscaler) sees the fan-out
# (a function's queue holds 256 by default), yet one connection each fits a 1,024-descriptor limit; a call the
# gateway refuses because its queue is full, a rate limit is hit or another key took its place in the queue never
# ran, and is sent again.
MAP_WINDOW = 512
REFUSED = {(503, "overloaded"), (429, "rate_limit_exceeded"), (429, "queue_share")}
RESUBMIT_DELAY = 1.0  # seconds, when the refusal names no Retry-After
GET_WAIT = 30.0  # seconds one poll of a spawned call waits at the gateway for it to finish


class aio_twin:
    """A blocking SDK method whose asyncio twin is reachable as `.aio` on it."""

    def __init__(self, aio: Callable):
        self.aio = aio

    def __call__(self, blocking: Callable) -> "aio_twin":
        self.blocking = blocking
        self.__doc__ = blocking.__doc__
        return self

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return TwinMethod(self.blocking.__get__(obj, owner), self.aio.__get__(obj, owner))


class TwinMethod:
    def __init__(self, blocking: Callable, aio: Callable):
        self._blocking, self.aio = blocking, aio
        self.__doc__ = blocking.__doc__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._blocking(*args, **kwargs)


def as_kwargs(fn: Callable, args: tuple, kwargs: dict, bound: bool = False) -> dict:
    """The HTTP contract carries keyword arguments only; bind positionals by the signature."""
    if not args:
        return kwargs
    signature = inspect.signature(fn)
    if bound:
        params = list(signature.parameters.values())[1:]
        signature = signature.replace(parameters=params)
    return dict(signature.bind(*args, **kwargs).arguments)


def blocking_iter(make: Callable[[], AsyncIterator[Any]]) -> Iterator[Any]:
    """Iterate an async iterator from blocking code: it runs on its own event loop in a thread; leaving the loop
    early cancels it (and so every call it has in flight)."""
    items: queue.Queue = queue.Queue()
    running: dict[str, Any] = {}
    END = object()

    async def pump() -> None:
        running["loop"], running["task"] = asyncio.get_running_loop(), asyncio.current_task()
        try:
            async for value in make():
                items.put((value, None))
            items.put((END, None))
        except BaseException as exc:
            items.put((END, exc))

    thread = threading.Thread(target=asyncio.run, args=(pump(),), name="ember-map", daemon=True)
    thread.start()
    try:
        while True:
            value, error = items.get()
            if error is not None:
                raise error
            if value is END:
                return
            yield value
    finally:
        if thread.is_alive() and "loop" in running:
            try:
                running["loop"].call_soon_threadsafe(running["task"].cancel)
            except RuntimeError:  # the loop closed after the check: the pump has already ended, nothing to cancel
                pass
        thread.join()


class Remote:
    """What a deployed function or method can be asked through the gateway; a subclass says where it lives."""

    def _address(self) -> tuple[str, str, Callable, bool]:
        """(app name, the call's path under the app, the Python function, whether it is a bound method)."""
        raise NotImplementedError

    def _kwargs(self, args: tuple, kwargs: dict) -> tuple[str, str, dict]:
        app, target, fn, bound = self._address()
        return app, target, as_kwargs(fn, args, kwargs, bound)

    async def _remote_aio(self, *args: Any, **kwargs: Any) -> Any:
        app, target, body = self._kwargs(args, kwargs)
        async with AsyncClient.from_env() as client:
            return await client.call(app, target, body)

    @aio_twin(_remote_aio)
    def remote(self, *args: Any, **kwargs: Any) -> Any:
        """Run it once in a replica and return its result."""
        app, target, body = self._kwargs(args, kwargs)
        with Client.from_env() as client:
            return client.call(app, target, body)

    async def _remote_gen_aio(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        app, target, body = self._kwargs(args, kwargs)
        async with AsyncClient.from_env() as client:
            async for value in client.iterate(app, target, body):
                yield value

    @aio_twin(_remote_gen_aio)
    def remote_gen(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        """Run a generator function in a replica and iterate its values as it yields them."""
        app, target, body = self._kwargs(args, kwargs)
        with Client.from_env() as client:
            yield from client.iterate(app, target, body)

    async def _starmap_aio(self, inputs: Iterable[tuple], kwargs: dict | None = None, order_outputs: bool = True,
                           return_exceptions: bool = False) -> AsyncIterator[Any]:
        calls = [self._kwargs(tuple(args), kwargs or {}) for args in inputs]
        async with AsyncClient.from_env(connections=MAP_WINDOW) as client:
            window = asyncio.Semaphore(MAP_WINDOW)
            tasks = [asyncio.ensure_future(_submit(client, window, *call)) for call in calls]
            try:
                for done in (tasks if order_outputs else asyncio.as_completed(tasks)):
                    try:
                        yield await done
                    except Exception as exc:  # a RemoteError, or the gateway could not be reached
                        if not return_exceptions:
                            raise
                        yield exc
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    @aio_twin(_starmap_aio)
    def starmap(self, inputs: Iterable[tuple], kwargs: dict | None = None, order_outputs: bool = True,
                return_exceptions: bool = False) -> Iterator[Any]:
        """`.map` for functions of several arguments: each input is a tuple of positional arguments."""
        return blocking_iter(lambda: self._starmap_aio(inputs, kwargs, order_outputs, return_exceptions))

    def _map_aio(self, *iterables: Iterable, kwargs: dict | None = None, order_outputs: bool = True,
                 return_exceptions: bool = False) -> AsyncIterator[Any]:
        return self._starmap_aio(zip(*iterables), kwargs, order_outputs, return_exceptions)

    @aio_twin(_map_aio)
    def map(self, *iterables: Iterable, kwargs: dict | None = None, order_outputs: bool = True,
            return_exceptions: bool = False) -> Iterator[Any]:
        """Run it once per input, in parallel across replicas, and iterate the results: in input order, or as they
        finish (`order_outputs=False`); a failed call raises RemoteError, or is yielded as one with
        `return_exceptions=True`. Several iterables give several positional arguments, as the builtin map does."""
        return self.starmap(zip(*iterables), kwargs, order_outputs, return_exceptions)

    async def _spawn_aio(self, *args: Any, **kwargs: Any) -> "FunctionCall":
        app, target, body = self._kwargs(args, kwargs)
        async with AsyncClient.from_env() as client:
            reply = await client.request("POST", f"/{app}/{target}", json=body, headers=SPAWN)
        return FunctionCall(reply.json()["call_id"])

    @aio_twin(_spawn_aio)
    def spawn(self, *args: Any, **kwargs: Any) -> "FunctionCall":
        """Start it in a replica and return at once; the handle's `.get()` waits for the result, from any process."""
        app, target, body = self._kwargs(args, kwargs)
        with Client.from_env() as client:
            return FunctionCall(client.request("POST", f"/{app}/{target}", json=body, headers=SPAWN).json()["call_id"])


SPAWN = {"Prefer": "respond-async"}  # RFC 7240: answer 202 with the call's id instead of waiting for its result


async def _submit(client: AsyncClient, window: asyncio.Semaphore, app: str, target: str, body: dict) -> Any:
    """One call of a map; sent again after a refusal that says it never ran (a full queue, a rate limit)."""
    async with window:
        while True:
            try:
                return await client.call(app, target, body)
            except RemoteError as exc:
                if (exc.status, exc.type) not in REFUSED:
                    raise
                await asyncio.sleep(exc.retry_after or RESUBMIT_DELAY)


class FunctionCall:
    """A spawned call, by its id: `.get(timeout)` waits for its result, `.cancel()` stops it. The gateway keeps the
    call's record, so `FunctionCall.from_id(call_id)` in another process reaches the same call."""

    def __init__(self, call_id: str):
        self.call_id = call_id

    @classmethod
    def from_id(cls, call_id: str) -> "FunctionCall":
        return cls(call_id)

    def __repr__(self) -> str:
        return f"FunctionCall({self.call_id!r})"

    async def _get_aio(self, timeout: float | None = None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        async with AsyncClient.from_env() as client:
            while True:
                reply = await client.request("GET", f"/calls/{self.call_id}", params=_wait(deadline))
                if (record := reply.json())["state"] in FINISHED:
                    return _outcome(record)
                _check_deadline(deadline, self.call_id, timeout)

    @aio_twin(_get_aio)
    def get(self, timeout: float | None = None) -> Any:
        """The call's result once it has finished; RemoteError if it failed or was cancelled, TimeoutError if it
        has not finished within `timeout` seconds (it goes on running)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with Client.from_env() as client:
            while True:
                record = client.request("GET", f"/calls/{self.call_id}", params=_wait(deadline)).json()
                if record["state"] in FINISHED:
                    return _outcome(record)
                _check_deadline(deadline, self.call_id, timeout)

    async def _cancel_aio(self) -> None:
        async with AsyncClient.from_env() as client:
            await client.request("DELETE", f"/calls/{self.call_id}")

    @aio_twin(_cancel_aio)
    def cancel(self) -> None:
        """Stop the call: a queued call never runs, a running one is cancelled in its replica."""
        with Client.from_env() as client:
            client.request("DELETE", f"/calls/{self.call_id}")


FINISHED = {"succeeded", "failed", "cancelled"}


def _wait(deadline: float | None) -> dict:
    left = GET_WAIT if deadline is None else max(0.0, min(GET_WAIT, deadline - time.monotonic()))
    return {"wait": f"{left:.3f}"}


def _check_deadline(deadline: float | None, call_id: str, timeout: float | None) -> None:
    if deadline is not None and time.monotonic() >= deadline:
        raise TimeoutError(f"call {call_id} has not finished within {timeout:g} s; it is still running")


def _outcome(record: dict) -> Any:
    if record["state"] == "succeeded":
        return record["result"]
    error = record.get("error") or {}
    raise RemoteError(record.get("status") or 500, error.get("type", record["state"]), error.get("message", ""))
