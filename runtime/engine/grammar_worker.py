"""The processes that compile formats for grammar.Grammars, so that one which would compile for hours can be
stopped: its process is killed.

xgrammar's compile runs in C++ that no thread can interrupt, and a few KB of format can keep it going for long (on
the tiny model's 1,024-token vocabulary, 2 cores: an EBNF grammar of 160 ambiguous rules, 6.8 KB, over 10 s; a schema
whose oneOf nests twelve deep 12.5 s, ~8x more each two levels). In the replica's own process such a compile could
only be abandoned, holding a core until it ended.

A replica starts one zygote (`python -m ember.runtime.engine.grammar_worker FD`), which imports xgrammar and reads
the vocabulary once (3-5 s of a core on a 2-core machine: xgrammar imports torch and transformers), and then forks a
compile worker each time the replica asks (milliseconds, and the worker shares the zygote's memory until it writes):
a worker killed for a format that compiles too long is replaced at once, for nothing. Both speak in frames over
pipes: an 8-byte length, then UTF-8 JSON. The zygote reads its setup from stdin (the vocabulary as xgrammar's
TokenizerInfo, serialised, and the limits) and answers {"ready": true} on stdout; then, for each pair of pipe ends
the replica sends on the Unix socket FD (SCM_RIGHTS: the worker's stdin and stdout), it forks a worker and answers
{"pid": its pid}. A worker answers {"ready": true} on its own pipe and then, per format, {"tag": structural tag
text}, with {"ok": true, "seconds": the compile's, "bytes": the compiled format's size in memory} or {"error": the
compiler's complaint, or what a token cost where a walk through the format (`probe`) found one too costly}. Anything
else either process writes goes to stderr. A worker holds at most the memory it started with and the setup's
"memory_bytes". The zygote ends when the replica closes the socket (or dies); a worker when its zygote is gone, or
its pipe closes.
"""
import json
import os
import struct
import sys
import threading
import time
import warnings
from typing import IO, Any

HEADER = struct.Struct("<Q")
MAX_FRAME = 1 << 31


def write_frame(stream: IO[bytes], message: dict) -> None:
    body = json.dumps(message, ensure_ascii=False).encode()
    data = memoryview(HEADER.pack(len(body)) + body)
    while data:   # a raw pipe may take part of a large write
        written = stream.write(data)
        data = data[written or 0:]
    stream.flush()


def exit_with_parent(parent: int) -> None:
    """Ends this process once its parent is gone (a compile in C++ would otherwise run on to its end)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def read_frame(stream: IO[bytes]) -> dict | None:
    """The next message, or None at the end of the stream."""
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    (size,) = HEADER.unpack(header)
    if size > MAX_FRAME:
        raise ValueError(f"a frame of {size} bytes")
    data = stream.read(size)
    if len(data) < size:
        return None
    return json.loads(data)


def main() -> None:
    """The zygote: imports xgrammar and reads the setup, then forks a worker for each pair of pipe ends sent on the
    socket whose descriptor is argv[1], until the replica closes it."""
    import signal
    import socket

    forks = socket.socket(fileno=int(sys.argv[1]))
    # The frames own stdout: whatever xgrammar or torch print goes to stderr instead
    frames_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    frames_in = sys.stdin.buffer
    import xgrammar as xgr

    import ember.runtime.engine.grammar  # noqa: F401 - the workers' compiles need it: imported once, here

    setup = read_frame(frames_in)
    if setup is None:
        return
    info = xgr.TokenizerInfo.deserialize_json(setup["tokenizer_info"])
    write_frame(frames_out, {"ready": True})
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)   # workers that end are reaped by the kernel, not waited for
    # torch's import leaves a second thread, idle, in this process (Python 3.12 warns of fork() beside threads); the
    # forked worker touches nothing of it, as torch's own DataLoader workers, forked the same way, do not
    warnings.filterwarnings("ignore", message=r".*use of fork\(\) may lead to deadlocks", category=DeprecationWarning)
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(forks, 16, 2)
        except OSError:
            return
        if not message:   # the replica closed its end, or is gone
            return
        if len(fds) != 2:
            for fd in fds:
                os.close(fd)
            write_frame(frames_out, {"error": f"a fork request carried {len(fds)} descriptors, not 2"})
            continue
        zygote = os.getpid()
        pid = os.fork()
        if pid == 0:
            try:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                forks.close()
                frames_in.close()
                frames_out.close()
                serve(info, setup, os.fdopen(fds[0], "rb"), os.fdopen(fds[1], "wb"), zygote)
            finally:
                os._exit(0)
        for fd in fds:
            os.close(fd)
        write_frame(frames_out, {"pid": pid})


def serve(info, setup: dict, frames_in: IO[bytes], frames_out: IO[bytes], zygote: int) -> None:
    """A worker, forked by the zygote: compiles the formats it is sent, one at a time, until its stdin closes or
    the zygote is gone."""
    import xgrammar as xgr

    from ember.runtime.engine.grammar import _first_line, _strict_strings

    threading.Thread(target=exit_with_parent, args=(zygote,), daemon=True).start()
    compiler = xgr.GrammarCompiler(info, max_threads=setup["max_threads"], cache_limit_bytes=setup["cache_bytes"])
    write_frame(frames_out, {"ready": True})
    limit_memory(setup["memory_bytes"])
    while (request := read_frame(frames_in)) is not None:
        began = time.perf_counter()
        reply: dict[str, Any]
        try:
            tag = _strict_strings(json.loads(request["tag"]))
            compiled = compiler.compile_structural_tag(json.dumps(tag, ensure_ascii=False))
            seconds = time.perf_counter() - began
            worst = probe(compiled, info, setup["probe_tokens"], setup["probe_seconds"])
            if worst > setup["probe_seconds"]:
                reply = {"error": f"following it cost {worst:.2f} s for one token, over {setup['probe_seconds']:g} s "
                                  "(an ambiguous grammar's cost grows with each token): simplify it"}
            else:
                reply = {"ok": True, "seconds": seconds, "bytes": compiled.memory_size_bytes}
        except MemoryError:
            reply = {"error": f"compiling it needed more than {setup['memory_bytes'] >> 20} MiB"}
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError, ValueError or its own for a bad format
            reply = {"error": _first_line(e)}
        write_frame(frames_out, reply)


def probe(compiled, info, tokens: int, budget: float) -> float:
    """The longest a mask or a step took over a walk of up to `tokens` tokens through the compiled format, each
    drawn (seeded) from those its mask allows, a stop token only where nothing else is: a format whose cost grows
    with each token (an ambiguous grammar's ~5x a token) shows it within a few. Stops once past `budget`."""
    import random

    import numpy as np
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    stops = np.array(info.stop_token_ids, dtype=np.int64)
    draw = random.Random(0)
    worst = 0.0
    for _ in range(tokens):
        began = time.perf_counter()
        constrained = matcher.fill_next_token_bitmask(bitmask, 0)
        worst = max(worst, time.perf_counter() - began)
        if worst > budget or not constrained:
            break
        bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")[:info.vocab_size]
        allowed = np.flatnonzero(bits)
        choices = allowed[~np.isin(allowed, stops)] if len(allowed) > len(stops) else allowed
        if not len(choices):
            break
        began = time.perf_counter()
        accepted = matcher.accept_token(int(choices[draw.randrange(len(choices))]))
        worst = max(worst, time.perf_counter() - began)
        if worst > budget or not accepted or matcher.is_terminated():
            break
    return worst


def limit_memory(extra: int) -> None:
    """Caps this process's data (heap and anonymous mappings) at what it holds now plus `extra` bytes, so that a
    format whose compile would take the host's memory fails here instead."""
    import resource
    with open("/proc/self/status") as status:
        held = next((int(line.split()[1]) * 1024 for line in status if line.startswith("VmData:")), None)
    if held is not None:
        resource.setrlimit(resource.RLIMIT_DATA, (held + extra, held + extra))


if __name__ == "__main__":
    main()
