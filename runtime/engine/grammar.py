"""Constrained decoding: a reply held to a format (a JSON schema, a regex, a list of choices, a tool call), token by
token.

A format is written in xgrammar's structural-tag language (serving/formats.py builds it from an OpenAI request);
`Grammars` compiles it against this model's vocabulary, once per distinct format, in the caller's thread (the
server compiles off its event loop). Each constrained sequence gets its own `Matcher`. Before a
step samples the sequence, the matcher writes the tokens the format allows next into a bitmask; the sampler sets
every other token's logit to -inf. After the step the sampled token advances the matcher, and a format that is
complete ends the sequence ("stop"). A mask follows from the step before's token, so with overlap scheduling a step
that holds a sequence launches its forward pass before that token is on the host, and its sampling once the token has
advanced the matcher (engine.py `_overlap_step`); the step's masks are written meanwhile, while the forward pass runs
(`MaskFiller`: from THREADED_ROWS rows, one call over several host threads).

A format is first compiled in a worker process (grammar_worker.py; forked by a zygote process that imported xgrammar
once, so a worker costs milliseconds, not the seconds of a fresh import): a compile runs in C++ that no thread can stop,
and a few KB of format can take minutes (measured on the tiny model's 1,024-token vocabulary, 2 cores: an EBNF
grammar of 160 ambiguous rules, 6.8 KB, over 10 s; a regex of 800 alternatives 8 s; a schema's oneOf nested nine
deep, 62 KB, 1.2 s on a 152k-token vocabulary). A compile still running after COMPILE_SECONDS is refused as the
request's fault (400) and its worker killed; the format is remembered as refused, so sending it again costs nothing.
A worker that ends mid-compile some other way (a crash, the kernel's OOM killer, a kill from outside) costs the format
one more try on a fresh worker; ending a second one refuses it (400, remembered).
One the worker compiled in time is compiled again here, where it is used (the compile is deterministic: it ends in
about the same time, and uses the same memory, which the worker reports: over MAX_COMPILED_BYTES is refused). Reading
it back would cost more: a typical schema's is ~5 MB of JSON on a 152k-token vocabulary (0.27 s to write, 0.1 s to
read, where it compiles in 0.1 s), and a regex of 400 alternatives' 926 MB (63 s to write) on a 1,024-token one. A
worker may allocate WORKER_MEMORY_BYTES: a compile that needs more fails there. A format's cost can also grow with
each token it holds (an ambiguous grammar's ~5x a token), which would stall the step loop: the worker walks
PROBE_TOKENS tokens through each format, timing each (over FOLLOW_SECONDS / 2 is a 400), and a held sequence whose
mask or step still costs over FOLLOW_SECONDS ends with a FormatCostError (a 400) while the others go on.
At most COMPILE_WORKERS formats compile at once, in the workers and here; a request that finds MAX_WAITING others
waiting for a worker, or MAX_WAITING_PER_CALLER of its own caller's (the API key the gateway names in
worker.CALLER_HEADER), is told to retry (503). Callers take turns for a free worker (next_ticket): the caller with
the fewest compiles running, then the one served longest ago, its oldest format first; so one client's flood of
costly formats holds at most its share of the workers. Compiled formats are kept (CACHE_BYTES): a format compiles
once per replica however many requests use it. A worker that crashes on a format costs that request a 400, not the
replica.

xgrammar is never imported on a replica's start path. A GPU replica imports it and reads the vocabulary (0.6-1 s for
152k tokens on the H200 machine) once it idles after its start (`Grammars.warm`); elsewhere the first constrained
request does (about 1.4 s more on a 2-core machine, most of it transformers' own import).
"""
import contextvars
import functools
import hashlib
import importlib.util
import itertools
import json
import logging
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

import torch

logger = logging.getLogger(__name__)

COMPILE_THREADS = 2                # per worker: compiling shares the host with the engine's step loop
COMPILE_WORKERS = 2                # worker processes per replica, started as formats need them
COMPILE_SECONDS = 10.0             # a format still compiling after this is refused and its worker killed
MAX_WAITING = 16                   # compiles waiting for a worker, past which a request is answered 503
MAX_WAITING_PER_CALLER = 4         # of them one caller's (an API key's, as the gateway names it)
TURNS_KEPT = 1024                  # callers whose last compile is remembered, for their turns
# the caller whose request compiles a format (set by the OpenAI app's handlers; threads started with
# asyncio.to_thread carry it): None where no gateway named one
CALLER: contextvars.ContextVar[str | None] = contextvars.ContextVar("ember_format_caller", default=None)
WORKER_START_SECONDS = 120.0       # a zygote (it imports xgrammar and torch) or worker not ready by then is given up on
WORKER_WAIT_SECONDS = 30.0         # a format waits for a worker this long beyond three compiles' deadlines
MAX_COMPILED_BYTES = 128 << 20     # a compiled format's memory (a schema on a 152k-token vocabulary: ~1 MiB)
WORKER_MEMORY_BYTES = 4 << 30      # what a worker may allocate beyond what it holds once started
REFUSED_KEPT = 1024                # formats refused (by the compiler, the deadline or the walk), remembered
CACHE_BYTES = 256 << 20            # compiled formats kept for reuse
WORKER_CACHE_BYTES = 16 << 20      # a worker's (it compiles each format once: this process keeps what compiled)
FILL_THREADS = max(1, min(8, (os.cpu_count() or 2) // 2))   # per replica: a step's masks, written side by side
# Fewer masks than this are written one after another: handing rows to threads costs ~0.8 ms a call on the H200
# machine, where one row of a JSON schema takes 0.04-0.09 ms (bench/engine/structured.py: 16 rows 0.7 ms alone,
# 0.9-1.1 ms together; 64 rows 5.7 ms alone, 1.8 ms together)
THREADED_ROWS = 24
# A format whose mask or step for one token takes longer ends its sequence with an error (FormatCostError): the step
# loop waits for it, and so does every sequence in the batch. A typical schema takes 0.04-0.09 ms a token on a
# 152k-token vocabulary; an ambiguous grammar's cost grows ~5x a token (20 rules of four ways each: 2 ms, 27, 178, 764)
FOLLOW_SECONDS = 0.2
FORMAT_COST = "format_cost"   # the finish reason of such a sequence (engine.py); AsyncLLM fails its request
PROBE_TOKENS = 24             # a worker walks this far through each format it compiles, timing each token
INSTALL_HINT = "install xgrammar on the replica (pip install 'xgrammar>=0.2.9')"


class FormatError(ValueError):
    """The format cannot be compiled (a schema feature xgrammar lacks, a bad regex, too complex to compile in
    time): the request's fault."""


class CompileBusy(RuntimeError):
    """Every compile worker is taken and MAX_WAITING requests wait for one: retry later."""


class Grammar:
    """A compiled format for one vocabulary; shared by every sequence that asks for it."""
    __slots__ = ("compiled", "vocab_size", "description")

    def __init__(self, compiled: Any, vocab_size: int, description: str):
        self.compiled, self.vocab_size, self.description = compiled, vocab_size, description

    def __repr__(self) -> str:
        return f"Grammar({self.description[:80]})"


def missing() -> str | None:
    """Why constrained decoding is unavailable here, or None when it is."""
    try:
        import xgrammar  # noqa: F401
    except ImportError as e:
        return f"constrained decoding needs xgrammar, which this replica lacks ({e}): {INSTALL_HINT}"
    return None


class Grammars:
    """Compiles formats for one model's tokenizer in worker processes. The tokenizer's vocabulary is read on the
    first compile (or `warm`)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Iterable[int], seconds: float | None = None,
                 workers: int = COMPILE_WORKERS):
        """`seconds`: how long a format may take to compile; by default EMBER_FORMAT_COMPILE_SECONDS where set, else
        COMPILE_SECONDS."""
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, sorted(stop_token_ids)
        self.seconds, self.workers = compile_seconds() if seconds is None else seconds, workers
        self._info: Any = None
        self._compiler: Any = None
        self._compile_slots = threading.Semaphore(max(1, workers))   # this process's own compiles at once
        self._pool: CompilePool | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Grammar] = OrderedDict()   # by the format's text, least recently used first
        self._cache_bytes = 0
        self._refused: OrderedDict[bytes, str] = OrderedDict()    # by the format's digest: why it was refused
        self._compiling: dict[str, Future] = {}                    # a format asked for again while it compiles

    def compile(self, tag: dict) -> Grammar:
        """`tag`: a structural tag (`{"type": "structural_tag", "format": {...}}`). Blocks for the compile: tens of
        milliseconds for a typical schema on a 152k-token vocabulary, at most `seconds` (then FormatError); the
        same format again returns at once."""
        text = json.dumps(tag, ensure_ascii=False)   # key order kept: a schema's properties are written in it
        try:
            text.encode()
        except UnicodeEncodeError as e:
            raise FormatError(f"it holds a lone UTF-16 surrogate ({text[e.start]!r}): send valid Unicode") from None
        with self._lock:
            if (grammar := self._cache.get(text)) is not None:
                self._cache.move_to_end(text)
                return grammar
            if (reason := self._refused.get(_digest(text))) is not None:
                raise FormatError(reason)
            pending = self._compiling.get(text)
            if pending is None:
                pending = self._compiling[text] = Future()
                mine = True
            else:
                mine = False
        if not mine:
            return pending.result()
        try:
            grammar = self._compile(text)
        except BaseException as e:
            pending.set_exception(e)
            raise
        else:
            pending.set_result(grammar)
            return grammar
        finally:
            with self._lock:
                del self._compiling[text]

    def _compile(self, text: str) -> Grammar:
        """A worker compiles the format first, within `seconds`; once it has, so does this process (in about the
        same time: xgrammar's compile is deterministic), at most `workers` at once. The compiled format is not sent
        back: on a 152k-token vocabulary it is ~5 MB of JSON that took 0.27 s to write and 0.1 s to read, where a
        typical schema compiles in 0.1 s."""
        pool = self._ready()
        for attempt in (1, 2):
            try:
                reply = pool.compile(text)
            except CompileTimeout:
                reply = {"error": f"it did not compile within {self.seconds:g} s (the cost grows fast with a "
                                  "format's alternatives: a grammar's ambiguous rules, a regex's many-way choices, a "
                                  f"schema's long enums and nested anyOf/oneOf): simplify it, or raise the replica's "
                                  f"{SECONDS_VARIABLE}"}
            except WorkerDied as e:
                # A worker can be killed from outside, even in the instant between the pool's check that an idle one
                # lives and its handing it the format, so one death says nothing of the format: it compiles once more
                # on a fresh worker. Dying twice on it is the format's doing, and remembered as any refusal.
                if attempt == 1:
                    logger.warning("a compile worker ended mid-compile (%s): compiling the format again", e)
                    continue
                reply = {"error": f"the compiler failed on it twice ({e}): simplify it"}
            break
        if "error" not in reply and reply["bytes"] > MAX_COMPILED_BYTES:
            reply = {"error": f"it compiles to {reply['bytes'] / 2 ** 20:.0f} MiB, over {MAX_COMPILED_BYTES >> 20} "
                              "MiB (a typical schema takes under 2): simplify it"}
        if "error" in reply:   # the same format would fail the same way: remembered, it costs no worker again
            with self._lock:
                self._refused[_digest(text)] = reply["error"]
                while len(self._refused) > REFUSED_KEPT:
                    self._refused.popitem(last=False)
            raise FormatError(reply["error"])
        with self._compile_slots:
            try:
                compiled = self._compiler.compile_structural_tag(json.dumps(_strict_strings(json.loads(text)),
                                                                            ensure_ascii=False))
            except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError, ValueError or its own
                raise FormatError(_first_line(e)) from None
        grammar = Grammar(compiled, self.vocab_size, text)
        with self._lock:
            self._cache[text] = grammar
            self._cache_bytes += compiled.memory_size_bytes
            while self._cache_bytes > CACHE_BYTES and len(self._cache) > 1:
                self._cache_bytes -= self._cache.popitem(last=False)[1].compiled.memory_size_bytes
        return grammar

    def warm(self) -> None:
        """Import xgrammar, read the vocabulary and start the zygote and a compile worker now (0.6-1 s for 152k
        tokens on the H200 machine, and the zygote's start beside it), so that the first constrained request does not
        wait for them; nothing where xgrammar is missing."""
        if importlib.util.find_spec("xgrammar") is None:
            return
        began = time.perf_counter()
        self._ready().start_one()
        logger.info("constrained decoding ready: the vocabulary read and a compile worker started in %.2f s",
                    time.perf_counter() - began)

    def close(self) -> None:
        """Stops the compile workers (a later compile starts new ones)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    def _ready(self) -> "CompilePool":
        with self._lock:
            if self._pool is None:
                reason = missing()
                if reason is not None:
                    raise RuntimeError(reason)
                import xgrammar as xgr
                if self._compiler is None:
                    self._info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                                    stop_token_ids=self.stop_token_ids)
                    self._compiler = xgr.GrammarCompiler(self._info, max_threads=COMPILE_THREADS,
                                                         cache_limit_bytes=CACHE_BYTES)
                setup = {"tokenizer_info": self._info.serialize_json(), "max_threads": COMPILE_THREADS,
                         "cache_bytes": WORKER_CACHE_BYTES, "memory_bytes": WORKER_MEMORY_BYTES,
                         "probe_tokens": PROBE_TOKENS, "probe_seconds": FOLLOW_SECONDS / 2}
                self._pool = CompilePool(setup, self.workers, self.seconds)
            return self._pool


SECONDS_VARIABLE = "EMBER_FORMAT_COMPILE_SECONDS"


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


def compile_seconds() -> float:
    text = os.environ.get(SECONDS_VARIABLE)
    if text is None:
        return COMPILE_SECONDS
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise ValueError(f"{SECONDS_VARIABLE}={text!r}: give a number of seconds above 0, e.g. 30")
    return seconds


class CompileTimeout(Exception):
    pass


class WorkerDied(Exception):
    pass


Ticket = tuple[int, "str | None"]   # a format waiting for a compile worker: (its arrival, its caller)


def next_ticket(waiting: Iterable[Ticket], running: Counter, turns: Iterable["str | None"]) -> Ticket:
    """Whose format a free worker takes: the caller with the fewest compiles running, then the one served longest
    ago (`turns`: callers by their last service, oldest first; one never served comes first), its oldest format. So
    callers take turns: one that queued many gets every other worker while another waits."""
    last = {caller: i for i, caller in enumerate(turns)}
    return min(waiting, key=lambda ticket: (running[ticket[1]], last.get(ticket[1], -1), ticket[0]))


class CompilePool:
    """Up to `workers` compile worker processes, each compiling one format at a time, forked by one zygote process
    (started with the first worker). A worker is started when a format finds none free (and fewer than `workers`
    live); one whose compile passes `seconds` is killed, and its replacement forked at once."""

    def __init__(self, setup: dict, workers: int, seconds: float, max_waiting: int = MAX_WAITING):
        self.setup, self.workers, self.seconds, self.max_waiting = setup, max(1, workers), seconds, max_waiting
        self._idle: list[_Worker] = []
        self._live = 0       # started or starting, idle or busy
        self._waiting: list[Ticket] = []   # formats waiting for a worker
        self._running: Counter = Counter()   # compiles in the workers, by caller
        self._turns: OrderedDict[str | None, None] = OrderedDict()   # callers by their last compile, oldest first
        self._arrivals = itertools.count()
        self._closed = False
        self._cond = threading.Condition()
        self._zygote: _Zygote | None = None
        self._zygote_lock = threading.Lock()   # held while one starts (seconds): the others wait for it

    def compile(self, text: str) -> dict:
        """The worker's reply for the format's text: {"ok", "seconds", "bytes"} or {"error"}; CompileTimeout past
        `seconds` (the worker is killed), WorkerDied when it ended some other way, CompileBusy when too many wait
        (in all, or of this format's caller: CALLER)."""
        caller = CALLER.get()
        worker = self._take(caller)
        try:
            reply = worker.request({"tag": text}, self.seconds)
        except (CompileTimeout, WorkerDied):
            self._lose(worker, caller)
            # its replacement starts now, not with the next format
            threading.Thread(target=self.start_one, kwargs={"spare": True}, daemon=True).start()
            raise
        except BaseException:
            self._lose(worker, caller)
            raise
        self._give(worker, caller)
        return reply

    def start_one(self, spare: bool = False) -> None:
        """Starts a worker now if none is live, or with `spare` if fewer than `workers` are (idle time pays its
        start, not a request); a spare that fails to start is logged."""
        with self._cond:
            if self._closed or self._live >= (self.workers if spare else 1):
                return
            self._live += 1
        try:
            worker = self._new_worker()
        except BaseException:
            self._lose(None, compiled=False)
            if not spare:
                raise
            logger.exception("a spare compile worker failed to start")
            return
        self._give(worker, compiled=False)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._cond.notify_all()
        for worker in idle:
            worker.kill()
        with self._zygote_lock:
            zygote, self._zygote = self._zygote, None
        if zygote is not None:
            zygote.kill()

    def _take(self, caller: str | None) -> "_Worker":
        with self._cond:
            if self._closed:
                raise CompileBusy("the replica is shutting down")
            if not self._free() or self._waiting:   # it waits: in line, its caller's turn
                if len(self._waiting) >= self.max_waiting:
                    raise CompileBusy(f"{len(self._waiting)} formats are waiting to compile")
                if caller is not None and sum(c == caller for _, c in self._waiting) >= MAX_WAITING_PER_CALLER:
                    raise CompileBusy(f"{MAX_WAITING_PER_CALLER} formats of this API key's requests are waiting to "
                                      "compile")
            ticket = (next(self._arrivals), caller)
            self._waiting.append(ticket)
            try:
                # long enough for the formats ahead to compile or be cut off, and for a worker to start
                waited = 3 * self.seconds + WORKER_WAIT_SECONDS
                deadline = time.monotonic() + waited
                while not self._free() or next_ticket(self._waiting, self._running, self._turns) != ticket:
                    left = deadline - time.monotonic()
                    if left <= 0 or self._closed:
                        raise CompileBusy(f"no compile worker was free for {waited:g} s")
                    self._cond.wait(left)
                self._running[caller] += 1
                self._turns.pop(caller, None)
                self._turns[caller] = None
                while len(self._turns) > TURNS_KEPT:
                    self._turns.popitem(last=False)
                while self._idle:
                    worker = self._idle.pop()
                    if worker.alive():
                        return worker
                    self._live -= 1   # it died while idle (killed from outside): not this format's doing
                    worker.kill()
                self._live += 1
            finally:
                self._waiting.remove(ticket)
                self._cond.notify_all()   # the next in line may be another waiter now
        try:
            return self._new_worker()
        except BaseException:
            self._lose(None, caller)
            raise

    def _free(self) -> bool:
        return bool(self._idle) or self._live < self.workers

    def _new_worker(self) -> "_Worker":
        """A worker forked by the zygote; the zygote is started first (seconds) where none is alive, and again once
        where it died since (killed from outside)."""
        for attempt in (1, 2):
            zygote = self._zygote_ready()
            try:
                return _Worker(zygote)
            except WorkerDied:
                if attempt == 2 or zygote.alive():
                    raise
        raise AssertionError("unreachable")

    def _zygote_ready(self) -> "_Zygote":
        with self._zygote_lock:
            if self._closed:
                raise CompileBusy("the replica is shutting down")
            if self._zygote is not None and not self._zygote.alive():
                self._zygote.kill()
                self._zygote = None
            if self._zygote is None:
                self._zygote = _Zygote(self.setup)
            return self._zygote

    def _give(self, worker: "_Worker", caller: str | None = None, compiled: bool = True) -> None:
        """`worker` idle again, after a compile of `caller`'s where `compiled` (a new worker's start: none)."""
        with self._cond:
            if compiled:
                self._done(caller)
            if not self._closed:
                self._idle.append(worker)
                self._cond.notify_all()   # the waiter whose turn it is, whichever it is
                return
        worker.kill()

    def _lose(self, worker: "_Worker | None", caller: str | None = None, compiled: bool = True) -> None:
        if worker is not None:
            worker.kill()
        with self._cond:
            if compiled:
                self._done(caller)
            self._live -= 1
            self._cond.notify_all()

    def _done(self, caller: str | None) -> None:
        self._running[caller] -= 1
        if self._running[caller] <= 0:
            del self._running[caller]


class _Frames:
    """Reads frames from a pipe within deadlines."""

    def __init__(self, fd: int, ended):
        """`ended()`: why the pipe closed (for WorkerDied)."""
        from . import grammar_worker
        self.fd, self._ended, self._header = fd, ended, grammar_worker.HEADER
        self._buffer = bytearray()

    def read(self, seconds: float) -> dict:
        """The next frame within `seconds` (CompileTimeout), or WorkerDied at the pipe's end."""
        deadline = time.monotonic() + seconds
        while True:
            if len(self._buffer) >= self._header.size:
                (size,) = self._header.unpack_from(self._buffer)
                if len(self._buffer) >= self._header.size + size:
                    data = bytes(self._buffer[self._header.size:self._header.size + size])
                    del self._buffer[:self._header.size + size]
                    return json.loads(data)
            left = deadline - time.monotonic()
            if left <= 0:
                raise CompileTimeout()
            readable, _, _ = select.select([self.fd], [], [], left)
            if readable:
                chunk = os.read(self.fd, 1 << 20)
                if not chunk:
                    raise WorkerDied(self._ended())
                self._buffer += chunk


class _Zygote:
    """The process that imports xgrammar and reads the vocabulary once (seconds), then forks compile workers on
    request (milliseconds each): grammar_worker.main."""

    def __init__(self, setup: dict):
        import socket

        from . import grammar_worker
        self._frames_module = grammar_worker
        began = time.perf_counter()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.process = subprocess.Popen([sys.executable, "-m", grammar_worker.__name__, str(theirs.fileno())],
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
                                            pass_fds=[theirs.fileno()])
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._socket = ours
        assert self.process.stdout is not None and self.process.stdin is not None
        self._frames = _Frames(self.process.stdout.fileno(), self._ended)
        self._lock = threading.Lock()
        try:
            grammar_worker.write_frame(self.process.stdin, setup)
            ready = self._frames.read(WORKER_START_SECONDS)
        except (OSError, CompileTimeout, WorkerDied) as e:
            self.kill()
            raise WorkerDied(f"the compile zygote did not start: {e or type(e).__name__}") from None
        if not ready.get("ready"):
            self.kill()
            raise WorkerDied(f"the compile zygote answered {str(ready)[:200]} to its setup")
        logger.info("compile zygote %d ready in %.2f s", self.process.pid, time.perf_counter() - began)

    def alive(self) -> bool:
        return self.process.poll() is None

    def fork(self) -> tuple[int, int, int]:
        """A new worker: its pid, and this end of its stdin (to write) and of its stdout (to read)."""
        import socket
        worker_in, ours_in = os.pipe()
        ours_out, worker_out = os.pipe()
        try:
            with self._lock:
                try:
                    socket.send_fds(self._socket, [b"f"], [worker_in, worker_out])
                except OSError as e:
                    raise WorkerDied(f"the compile zygote is gone ({e})") from None
                reply = self._frames.read(WORKER_START_SECONDS)
        except BaseException:
            os.close(ours_in)
            os.close(ours_out)
            raise
        finally:
            os.close(worker_in)
            os.close(worker_out)
        if "pid" not in reply:
            os.close(ours_in)
            os.close(ours_out)
            raise WorkerDied(f"the compile zygote answered {str(reply)[:200]}")
        return reply["pid"], ours_in, ours_out

    def kill(self) -> None:
        self._socket.close()
        if self.process.poll() is None:
            self.process.kill()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            logger.warning("compile zygote %d did not end after SIGKILL", self.process.pid)
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()

    def _ended(self) -> str:
        code = self.process.poll()
        return "the compile zygote's pipe closed" if code is None else f"the compile zygote exited with {code}"


class _Worker:
    """One compile worker, forked by the zygote (not this process's child: it is watched through a pidfd), and its
    pipes."""

    def __init__(self, zygote: _Zygote):
        from . import grammar_worker
        self._frames_module = grammar_worker
        self.pid, stdin, stdout = zygote.fork()
        self._stdin = os.fdopen(stdin, "wb", buffering=0)
        self._stdout = stdout
        try:
            self._pidfd: int | None = os.pidfd_open(self.pid)
        except ProcessLookupError:
            self._pidfd = None   # already gone: its pipe says so below
        self._frames = _Frames(stdout, self._ended)
        try:
            ready = self._frames.read(WORKER_START_SECONDS)
        except BaseException:
            self.kill()
            raise
        if not ready.get("ready"):
            self.kill()
            raise WorkerDied(f"the worker answered {str(ready)[:200]} when it started")

    def alive(self) -> bool:
        if self._pidfd is None:
            return False
        readable, _, _ = select.select([self._pidfd], [], [], 0)   # a pidfd reads as ready once its process ends
        return not readable

    def request(self, message: dict, seconds: float) -> dict:
        try:
            self._frames_module.write_frame(self._stdin, message)
        except (OSError, ValueError) as e:
            raise WorkerDied(f"its pipe closed: {e}") from None
        return self._frames.read(seconds)

    def kill(self) -> None:
        if self._pidfd is not None:
            try:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
            readable, _, _ = select.select([self._pidfd], [], [], 5)
            if not readable:
                logger.warning("compile worker %d did not end after SIGKILL", self.pid)
            os.close(self._pidfd)
            self._pidfd = None
        if not self._stdin.closed:
            self._stdin.close()
            os.close(self._stdout)

    def _ended(self) -> str:
        return "the worker's pipe closed" if self.alive() else "the worker exited"


# xgrammar (0.2.9) writes a string of bounded length (minLength, maxLength) as repeats of any character but quote,
# backslash and line breaks: other control characters pass raw, which is not JSON (a strict parser refuses the
# reply). Its other strings leave out every control character, as this does.
LOOSE_CHARACTER, STRICT_CHARACTER = '[^\\"\\\\\\r\\n]', '[^\\0-\\x1f\\"\\\\]'


def _strict_strings(node: Any) -> Any:
    """`node` (part of a structural tag) with each JSON schema in it given as the grammar xgrammar makes of it, its
    bounded strings' characters those a JSON string holds unescaped. Such a string holds no escapes (no quote,
    backslash or line break), as in xgrammar. Compiles cost what the schema's would: the repeat stays one rule."""
    if isinstance(node, list):
        return [_strict_strings(item) for item in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and "json_schema" in node:
        return {"type": "grammar", "grammar": _schema_grammar(json.dumps(node["json_schema"], ensure_ascii=False),
                                                              node.get("max_whitespace_cnt"))}
    return {key: _strict_strings(value) for key, value in node.items()}


@functools.lru_cache(maxsize=256)
def _schema_grammar(schema: str, max_whitespace: int | None) -> str:
    import xgrammar as xgr
    grammar = str(xgr.Grammar.from_json_schema(schema, any_whitespace=True, max_whitespace_cnt=max_whitespace))
    return grammar.replace(LOOSE_CHARACTER, STRICT_CHARACTER)


class Matcher:
    """One sequence's place in its format."""
    __slots__ = ("_matcher", "_bitmask", "ended", "costly")

    def __init__(self, grammar: Grammar):
        import xgrammar as xgr
        self._matcher = xgr.GrammarMatcher(grammar.compiled)
        self._bitmask = xgr.allocate_token_bitmask(1, grammar.vocab_size)
        self.ended = False
        self.costly = False   # a token's mask or step cost over FOLLOW_SECONDS: the sequence ends at its next token

    def allowed(self) -> torch.Tensor | None:
        """The tokens the format allows next, as a bitmask row (int32, host; bit t of word t // 32 for token t), or
        None where it allows every token (free text). The row is this matcher's, overwritten by its next call."""
        began = time.perf_counter()
        constrained = self._matcher.fill_next_token_bitmask(self._bitmask, 0)
        self._timed(began)
        return self._bitmask[0] if constrained else None

    def advance(self, token_id: int) -> bool:
        """Take the sampled token; True when the format is over (complete, or the token broke it: then the sequence
        ends rather than going on unconstrained), or has cost too much to follow (`costly`)."""
        began = time.perf_counter()
        if not self._matcher.accept_token(token_id):
            logger.warning("a constrained sequence sampled token %d, which its format does not allow: it ends here",
                           token_id)
            self.ended = True
        elif self._matcher.is_terminated():
            self.ended = True
        self._timed(began)
        return self.ended

    def _timed(self, began: float) -> None:
        seconds = time.perf_counter() - began
        if seconds > FOLLOW_SECONDS and not self.costly:
            logger.warning("a format cost %.2f s to follow for one token (over %.2f s): its sequence ends", seconds,
                           FOLLOW_SECONDS)
            self.costly = self.ended = True


class MaskFiller:
    """Writes a step's masks, one row per constrained sequence: from THREADED_ROWS rows on, in one call that spreads
    them over FILL_THREADS host threads (xgrammar's batch matcher), as tens of microseconds a row on a 152k-token
    vocabulary add up over a large batch. A batch call that took over FOLLOW_SECONDS is followed by one step's
    masks written row by row, each timed, so that the row that costs too much is found (Matcher.costly)."""

    def __init__(self, vocab_size: int, threaded_rows: int = THREADED_ROWS):
        self.vocab_size, self.threaded_rows = vocab_size, max(2, threaded_rows)
        self._batch: Any = None
        self._rows: torch.Tensor | None = None
        self._one_by_one = False

    def fill(self, matchers: list[Matcher]) -> list[torch.Tensor | None]:
        """Each matcher's mask (as Matcher.allowed; a row of a buffer this filler reuses at its next call)."""
        if len(matchers) < self.threaded_rows or self._one_by_one:
            self._one_by_one = False
            return [matcher.allowed() for matcher in matchers]
        import xgrammar as xgr
        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher(max_threads=FILL_THREADS)
        rows = self._rows
        if rows is None or len(rows) < len(matchers):
            grown = max(len(matchers), 2 * (0 if rows is None else len(rows)))
            rows = self._rows = xgr.allocate_token_bitmask(grown, self.vocab_size)
        began = time.perf_counter()
        self._batch.batch_fill_next_token_bitmask([m._matcher for m in matchers], rows)
        self._one_by_one = time.perf_counter() - began > FOLLOW_SECONDS
        return list(rows[:len(matchers)])


def mask_logits(logits: torch.Tensor, rows: list[int], bitmasks: list[torch.Tensor]) -> None:
    """Set to -inf, in the given rows of `logits` [B, V] (in place), every token its row's bitmask leaves out."""
    vocab = logits.shape[-1]
    bits = torch.stack(bitmasks).to(logits.device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1)[:, :vocab].bool()
    index = torch.tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


# xgrammar's C++ errors open with its log prefix, "[02:54:07] /project/cpp/json_schema_converter.cc:5082: ": a
# client is told what in its format failed, not where in xgrammar's source
_SOURCE_PREFIX = re.compile(r"^(\[[0-9:]+\] )?\S+\.(cc|cpp|h):\d+: ")


def _first_line(error: Exception) -> str:
    text = str(error).strip() or type(error).__name__
    line = text.splitlines()[0]
    return (_SOURCE_PREFIX.sub("", line) or line)[:500]
