"""AsyncLLM: the engine's step loop in one background thread, requests as async iterators.

`LLMEngine.step()` is not thread-safe, so only the loop thread touches the engine:
callers hand it add/abort commands through a queue that it drains before every step,
and it hands each step's outputs back to the callers' event loops.

A step that raises fails only the requests it was running (vLLM's rule: one bad request must not take
the server down); after MAX_FAILED_STEPS failures with no token produced in between, the engine is deemed
unable to go on, every request fails, and the process is marked unhealthy (runtime/health.py) so its replica is
replaced.
"""

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ember.runtime import health, tracing
from ember.runtime.engine import grammar
from ember.runtime.engine.detokenizer import Detokenizer

if TYPE_CHECKING:
    from ember.runtime.engine.engine import RequestOutput

log = logging.getLogger("ember.engine")
# Seconds without work before the loop captures missing CUDA graphs: a replica that just started was started for a
# request, which arrives within milliseconds of its ready line and must not queue behind a capture (~0.1-0.2 s each).
IDLE_CAPTURE_AFTER = 1.0
MAX_FAILED_STEPS = 3  # failed steps with no token made between them: the engine (a sticky CUDA error) cannot go on


class EngineDeadError(RuntimeError):
    """The step loop failed; every request in flight failed with it."""


class RequestFailedError(RuntimeError):
    """The engine failed while running this request; it goes on serving the others."""


class FormatCostError(RequestFailedError):
    """The request's format cost too much to follow for a token (grammar.FOLLOW_SECONDS): the request's fault."""

    def __init__(self):
        super().__init__(f"following the format took over {grammar.FOLLOW_SECONDS:g} s for one token, in which the "
                         "replica's other sequences waited: the reply ends here; simplify the format (an ambiguous "
                         "grammar's cost grows with each token)")


@dataclass
class Completion:
    """What one choice of a request produced since the last one: text, tokens, and why it ended."""
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict] | None
    finish_reason: str | None      # "stop" | "length" | "abort" once finished, else None
    stop_reason: str | int | None  # the stop string or stop token that ended it
    num_prompt_tokens: int
    num_cached_tokens: int
    prompt_index: int = 0          # which prompt of a batched request this choice answers
    # where each token's text ends in `text`, for an increment of several tokens (steps joined for a caller that fell
    # behind): what is counted by the token (reasoning) reads it; None for one token, whose text is all of it
    token_ends: list[int] | None = None


# What the loop thread hands a caller: (choice index, that choice's step output), or the error that ended it.
Delivery = tuple[int, "RequestOutput"] | BaseException


class _Inbox:
    """What the loop thread delivered to one generate() call, in order. Only its caller's event loop touches it
    (the loop thread posts `put` there): a deque and a future cost less per step than an asyncio.Queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: deque[Delivery] = deque()
        self._waiter: asyncio.Future | None = None

    def put(self, item: Delivery) -> None:
        self.items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait(self) -> None:
        """Return once something was delivered."""
        while not self.items:
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None


@dataclass
class _Route:
    inbox: _Inbox
    index: int


@dataclass
class _Add:
    """A caller's request for the loop thread; `done` settles once the engine took or refused it."""
    request_id: str
    prompt_token_ids: list[int]
    params: object                 # SamplingParams
    route: _Route
    done: asyncio.Future
    trace_context: object | None
    group: str | None = None       # the caller's request it is part of: the scheduler's fair share


@dataclass
class _Abort:
    request_id: str
    reason: str


class AsyncLLM:
    def __init__(self, engine, tokenizer) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.error: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._routes: dict[str, _Route] = {}  # touched only by the loop thread
        self._closed = False
        self._idle_capture_failed = False
        self._idle_tasks: queue.SimpleQueue = queue.SimpleQueue()   # when_idle's, not started yet
        self._busy_at = time.monotonic()  # when the engine last had work (its start counts)
        self.owns_engine = False  # made by from_config: a shutdown frees its device memory
        self._thread = threading.Thread(target=self._run, name="ember-engine-loop", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config) -> "AsyncLLM":
        from transformers import AutoTokenizer

        from ember.runtime.engine.engine import LLMEngine

        llm = cls(LLMEngine(config), AutoTokenizer.from_pretrained(config.model))
        llm.owns_engine = True
        return llm

    @property
    def alive(self) -> bool:
        return self.error is None and self._thread.is_alive()

    async def generate(self, prompt_token_ids: list[int], params, *, n: int = 1, stop=(),
                       include_stop_str_in_output: bool = False, skip_special_tokens: bool = True,
                       request_id: str | None = None, group: str | None = None) -> AsyncGenerator[Completion, None]:
        """Run `n` samples of one prompt; yields each choice's increments as they come. `group`: the caller's request
        this is part of (a prompt of a batch), which the engine's scheduler shares fairly with others; default: this
        call (its n samples).

        Raises ValueError (before the first yield) when the engine refuses the request.
        Closing the iterator early aborts what is still running, which frees its KV blocks.
        """
        if not self.alive:
            raise EngineDeadError(f"the engine loop has stopped: {self.error!r}")
        request_id = request_id or uuid.uuid4().hex
        trace_context = tracing.current_context() if tracing.enabled else None  # the engine's spans join this trace
        ids = [request_id if n == 1 else f"{request_id}-{i}" for i in range(n)]
        group = group or request_id
        inbox = _Inbox(asyncio.get_running_loop())
        detokenizers = [Detokenizer(self.tokenizer, prompt_token_ids, stop, include_stop_str_in_output,
                                    skip_special_tokens) for _ in range(n)]
        running: set[int] = set()
        try:
            for i, rid in enumerate(ids):
                # n samples of one seeded request must differ from each other, reproducibly.
                sample = params if params.seed is None or n == 1 else replace(params, seed=params.seed + i)
                running.add(i)  # before the await, so a cancelled add is still aborted
                await self._add(rid, prompt_token_ids, sample, _Route(inbox, i), trace_context, group)
            while running:
                if not inbox.items:
                    await inbox.wait()
                item = inbox.items.popleft()
                if isinstance(item, RequestFailedError):
                    raise item
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"the engine loop failed: {item!r}") from item
                i, out = item
                if i not in running:
                    continue
                while not stop and inbox.items:   # a caller that fell behind gets one increment for the steps it missed
                    following = inbox.items[0]
                    if isinstance(following, BaseException) or following[0] != i:
                        break
                    out = _joined(out, following[1])
                    inbox.items.popleft()
                if out.finish_reason == grammar.FORMAT_COST:
                    running.discard(i)
                    raise FormatCostError()
                detok = detokenizers[i]
                ends = None
                if len(out.new_token_ids) > 1 and not detok.stop:
                    text, ends = detok.step_each(out.new_token_ids, finished=out.finished)
                else:
                    text = detok.step(out.new_token_ids, finished=out.finished)
                finish, stop_reason = (out.finish_reason, None) if out.finished else (None, None)
                if detok.stop_reason is not None:
                    finish, stop_reason = "stop", detok.stop_reason
                elif finish == "stop" and out.new_token_ids and out.new_token_ids[-1] in params.stop_token_ids:
                    stop_reason = out.new_token_ids[-1]
                if finish is not None:
                    running.discard(i)
                    if not out.finished:  # a stop string matched in the text: the engine did not see it
                        self.abort(ids[i], reason="stop")
                yield Completion(i, text, out.new_token_ids, out.new_logprobs, finish, stop_reason,
                                 out.num_prompt_tokens, out.num_cached_tokens, token_ends=ends)
        finally:
            for i in running:
                self.abort(ids[i])

    def abort(self, request_id: str, reason: str = "abort") -> None:
        self._send(_Abort(request_id, reason))

    def shutdown(self) -> None:
        self._closed = True
        self._wakeup.set()
        self._thread.join(timeout=10)
        if self.owns_engine and not self._thread.is_alive():
            # A process that serves again (a test, an embedding app) gets the GPU memory back now, not whenever the
            # collector finds the engine; a loop still inside a step keeps it.
            self.engine.close()

    async def _add(self, request_id, prompt_token_ids, params, route, trace_context, group=None) -> None:
        done = asyncio.get_running_loop().create_future()
        self._send(_Add(request_id, list(prompt_token_ids), params, route, done, trace_context, group))
        if self.error is not None:  # the loop died after generate() checked: nobody else will answer
            self._drain_commands(dead=self.error)
        await done

    def _send(self, command) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def _run(self) -> None:
        failed_steps = 0
        try:
            while not self._closed:
                self._drain_commands()
                if not self.engine.has_unfinished_requests():
                    wait = None
                    if self._commands.empty():
                        wait = IDLE_CAPTURE_AFTER - (time.monotonic() - self._busy_at)
                        if wait <= 0:
                            wait = None
                            if self._capture_idle():
                                continue  # one graph captured; look for requests before the next
                            self._start_idle_tasks()
                    self._wakeup.wait(wait)
                    self._wakeup.clear()
                    continue
                self._busy_at = time.monotonic()
                try:
                    outputs = self.engine.step()
                except Exception as e:
                    failed_steps += 1
                    if failed_steps >= MAX_FAILED_STEPS:
                        raise
                    self._fail_step(e)
                    continue
                if any(out.new_token_ids for out in outputs):  # the model ran and produced tokens: it can go on
                    failed_steps = 0
                self._deliver(outputs)
            error: BaseException = EngineDeadError("the engine was shut down")
        except BaseException as e:  # noqa: BLE001 - every waiting caller must hear of it
            log.exception("engine loop failed")
            error = e
            health.fail(f"the LLM engine cannot go on: {e!r}")
        self.error = error
        for route in self._routes.values():
            _post(route.inbox.loop, route.inbox.put, error)
        self._routes.clear()
        self._drain_commands(dead=error)

    def when_idle(self, task: Callable[[], None]) -> None:
        """Run `task` once, in a thread of its own, once the engine has been idle IDLE_CAPTURE_AFTER seconds with no
        CUDA graph left to capture: host work a replica can do ahead of the request that would otherwise wait for
        it, off its start path. A task that fails is logged."""
        self._idle_tasks.put(task)
        self._wakeup.set()

    def _start_idle_tasks(self) -> None:
        while not self._idle_tasks.empty():
            threading.Thread(target=_logged, args=(self._idle_tasks.get_nowait(),), name="ember-idle-task",
                             daemon=True).start()

    def _capture_idle(self) -> bool:
        """Use idle time to capture a CUDA graph the engine lacks; a failed capture only leaves that size eager."""
        capture = getattr(self.engine, "capture_idle", None)
        if capture is None or self._idle_capture_failed:
            return False
        try:
            return capture()
        except Exception:  # noqa: BLE001 - serving goes on without the graph
            log.exception("capturing a CUDA graph while idle failed; batch sizes without a graph run eagerly")
            self._idle_capture_failed = True
            return False

    def _fail_step(self, error: Exception) -> None:
        """Fail and abort the requests the failed step was running (the waiting ones when none ran yet)."""
        log.error("engine step failed; failing the requests it ran", exc_info=error)
        scheduler = self.engine.scheduler
        touched = [seq.request_id for seq in (scheduler.running or scheduler.waiting)]
        for request_id in touched:
            route = self._routes.pop(request_id, None)
            self.engine.abort_request(request_id)
            if route is not None:
                _post(route.inbox.loop, route.inbox.put,
                      RequestFailedError(f"the engine failed on this request: {error!r}"))

    def _drain_commands(self, dead: BaseException | None = None) -> None:
        """Hands every queued command to the engine; once the loop has died (`dead`), answers adds with that
        error and drops aborts, without touching the engine."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Abort):
                if dead is None:
                    self._routes.pop(command.request_id, None)
                    self.engine.abort_request(command.request_id, command.reason)
            elif dead is not None:
                _post(command.route.inbox.loop, _settle, command.done, EngineDeadError(repr(dead)))
            else:
                self._admit(command)

    def _admit(self, command: _Add) -> None:
        try:
            self.engine.add_request(command.request_id, command.prompt_token_ids, command.params,
                                    command.trace_context, group=command.group)
        except ValueError as e:
            _post(command.route.inbox.loop, _settle, command.done, e)
        except Exception as e:  # a bug this request hit: it fails alone, the loop goes on
            log.exception("engine refused request %s", command.request_id)
            _post(command.route.inbox.loop, _settle, command.done,
                  RequestFailedError(f"the engine could not add this request: {e!r}"))
        else:
            self._routes[command.request_id] = command.route
            _post(command.route.inbox.loop, _settle, command.done, None)

    def _deliver(self, outputs) -> None:
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            route = self._routes.get(out.request_id)
            if route is None:
                continue
            if out.finished:
                del self._routes[out.request_id]
            batches.setdefault(route.inbox.loop, []).append((route.inbox, (route.index, out)))
        for loop, batch in batches.items():
            if not _post(loop, _put_all, batch):
                # The caller's event loop is gone: nobody will read these, so stop them; an abort the
                # caller queued before it went (a matched stop string) goes first and keeps its reason.
                self._drain_commands()
                for _, (_, out) in batch:
                    self._routes.pop(out.request_id, None)
                    self.engine.abort_request(out.request_id)


def _joined(first: "RequestOutput", then: "RequestOutput") -> "RequestOutput":
    """Two consecutive outputs of one request as one. Under load the caller's event loop (detokenizing, framing
    and sending every chunk) can fall behind the engine's steps; joined, the outputs it missed cost one chunk, not
    one each, so it catches up instead of queueing more. Not with stop strings: those are matched in the text, and
    the tokens after a match must not be reported. `then`, which only this caller holds, becomes the joined one
    (dataclasses.replace cost more than the rest of a join)."""
    if first.new_logprobs is not None or then.new_logprobs is not None:
        then.new_logprobs = [*(first.new_logprobs or ()), *(then.new_logprobs or ())]
    then.new_token_ids = [*first.new_token_ids, *then.new_token_ids]
    return then


def _post(loop: asyncio.AbstractEventLoop, fn, *args) -> bool:
    try:
        loop.call_soon_threadsafe(fn, *args)
        return True
    except RuntimeError:  # the loop was closed
        return False


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _put_all(batch) -> None:
    for inbox, item in batch:
        inbox.put(item)


def _logged(task: Callable[[], None]) -> None:
    try:
        task()
    except Exception:  # noqa: BLE001 - the replica serves on; the work is done when a request needs it
        log.exception("an idle-time task failed: %s", getattr(task, "__qualname__", task))
