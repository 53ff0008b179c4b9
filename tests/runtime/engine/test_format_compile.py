"""A format compiles first in a worker process, within a deadline (EMBER_FORMAT_COMPILE_SECONDS): one that would
compile for minutes (a few KB of ambiguous grammar or many-way regex can) is a 400 naming it, its
worker killed, the same format again refused at once; a worker that dies mid-compile costs its format a retry on a
fresh worker, and a second death refuses that format alone; a replica's compile workers end with it; and none of
it holds up the replica's other requests."""
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import jsonschema
import pytest

from ember.runtime.engine.api import create_app
from ember.runtime.engine.config import EngineConfig
from ember.runtime.engine.grammar import next_ticket
from ember.runtime.engine.tiny import build_tiny_model
from ember.runtime.worker import CALLER_HEADER

from .helpers import ORDER, uvicorn_thread

HELLO = [{"role": "user", "content": "Order something."}]
SECONDS = 2.0


def ambiguous_grammar(rules: int, letter: str = "a") -> str:
    """EBNF of a few KB whose compile takes seconds a rule past ~60 (on the tiny model's vocabulary, 80 rules took
    9 s on a 2-core machine, 160 over 20 s): each rule a choice of ways to write the next one."""
    return "root ::= r0\n" + "\n".join(f'r{i} ::= r{i + 1} r{i + 1} | "{letter}" r{i + 1} | r{i + 1} "b" | ""'
                                        for i in range(rules)) + f"\nr{rules} ::= [a-z]*"


def costly_after(prefix_numbers: int, rules: int = 20) -> str:
    """EBNF that is cheap to follow through a literal prefix (0 to prefix_numbers - 1, space-separated: over 40
    tokens for 40 numbers) and then grows ~5x a token (the ambiguous rules: 2, 27, 178, 764 ms for 20 of them)."""
    prefix = " ".join(str(i) for i in range(prefix_numbers))
    return ambiguous_grammar(rules, "d").replace("root ::= r0", f'root ::= "{prefix}" r0', 1)


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen3")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EMBER_FORMAT_COMPILE_SECONDS", str(SECONDS))
        app = create_app(EngineConfig(model=str(path), max_num_seqs=8), served_model_name="tiny")
    assert app.state.openai.grammars.seconds == SECONDS
    with uvicorn_thread(app) as url:
        yield app, f"{url}/v1"


def chat(url: str, timeout: float = 120, **body) -> httpx.Response:
    return httpx.post(f"{url}/chat/completions", timeout=timeout,
                      json={"model": "tiny", "messages": HELLO, "max_tokens": 8, **body})


def workers(parent: int | None = None) -> dict[int, float]:
    """The compile workers of this process (or `parent`): the children of its zygote; pid -> CPU seconds so far."""
    zygotes = set(_children(os.getpid() if parent is None else parent))
    return {pid: cpu for zygote in zygotes for pid, cpu in _children(zygote).items()}


def _children(parent: int) -> dict[int, float]:
    """`parent`'s child processes running grammar_worker (zygotes, or the workers they fork): pid -> CPU seconds."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == parent and b"grammar_worker" in cmdline and fields[0] != "Z":
            found[int(entry.name)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return found


def busy_workers(seconds: float = 1.0) -> set[int]:
    """The workers that used over a third of a core over `seconds`."""
    before = workers()
    time.sleep(seconds)
    after = workers()
    return {pid for pid, cpu in after.items() if cpu - before.get(pid, cpu) > seconds / 3}


def test_a_format_too_complex_to_compile_in_time_is_a_400_and_the_replica_serves_on(served):
    app, url = served
    answers: dict[str, httpx.Response] = {}
    took: dict[str, float] = {}

    def ask(name: str, **body) -> None:
        began = time.monotonic()
        answers[name] = chat(url, **body)
        took[name] = time.monotonic() - began

    slow = threading.Thread(target=ask, args=("slow",), kwargs={"guided_grammar": ambiguous_grammar(100)})
    slow.start()
    deadline = time.monotonic() + 60
    while not (compiling := busy_workers(0.3)) and time.monotonic() < deadline:
        pass   # its worker starting, then compiling
    assert compiling, "no worker compiled the format"
    ask("free", max_tokens=16)                                                  # beside it: free text,
    ask("held", max_tokens=300, response_format=schema_format(ORDER))           # and a format that compiles
    slow.join()
    assert answers["free"].status_code == 200 and answers["held"].status_code == 200, answers
    jsonschema.validate(json.loads(answers["held"].json()["choices"][0]["message"]["content"]), ORDER)
    refused = answers["slow"]
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "guided_grammar" and f"did not compile within {SECONDS:g} s" in error["message"]
    assert "EMBER_FORMAT_COMPILE_SECONDS" in error["message"]
    assert took["slow"] < SECONDS + 60   # its deadline, after at most a worker's start (seconds on this machine)
    assert not set(workers()) & compiling, "the worker compiling the refused format is still at it"
    began = time.monotonic()
    again = chat(url, guided_grammar=ambiguous_grammar(100))
    assert again.status_code == 400 and "did not compile" in again.json()["error"]["message"]
    assert time.monotonic() - began < SECONDS   # remembered: no second compile, which would take the deadline
    assert chat(url, max_tokens=300, response_format=schema_format(ORDER)).status_code == 200


def test_a_format_whose_workers_die_twice_mid_compile_is_refused_alone(served):
    """One death is retried on a fresh worker (it may have been killed from outside); the second is the format's."""
    app, url = served
    grammars = app.state.openai.grammars
    pool = grammars._ready()
    grammars.seconds = pool.seconds = 120.0   # killed from outside long before its deadline, however loaded the host
    answers = {}
    killed: list[int] = []
    try:
        slow = threading.Thread(target=lambda: answers.setdefault("slow", chat(
            url, guided_grammar=ambiguous_grammar(140, "a"))))
        slow.start()
        zygote = pool._zygote.process.pid if pool._zygote is not None else None
        for _ in range(2):   # the first compile, then its retry on a fresh worker
            deadline = time.monotonic() + 60
            while not (compiling := busy_workers(0.3)) and time.monotonic() < deadline:
                pass
            assert compiling, "no worker compiled the format"
            zygote = zygote or pool._zygote.process.pid
            for pid in workers():   # the compiling one and any idle one (their zygote lives on)
                try:
                    fd = os.pidfd_open(pid)
                except ProcessLookupError:
                    continue
                os.kill(pid, signal.SIGKILL)
                select.select([fd], [], [], 10)   # landed before the next round looks for a busy worker
                os.close(fd)
                killed.append(pid)
        slow.join()
    finally:
        grammars.seconds = pool.seconds = SECONDS
    assert answers["slow"].status_code == 400, answers["slow"].text
    assert "the compiler failed on it twice" in answers["slow"].json()["error"]["message"]
    began = time.monotonic()
    again = chat(url, guided_grammar=ambiguous_grammar(140, "a"))
    assert again.status_code == 400 and "failed on it twice" in again.json()["error"]["message"]
    assert time.monotonic() - began < SECONDS   # remembered: no worker pays for it again
    held = chat(url, max_tokens=300, response_format=schema_format({**ORDER, "title": "after"}))
    assert held.status_code == 200, held.text
    jsonschema.validate(json.loads(held.json()["choices"][0]["message"]["content"]), ORDER)
    assert pool._zygote.process.pid == zygote, "the workers' replacements came from a new zygote"


def test_a_worker_killed_as_it_is_handed_a_format_costs_the_format_nothing(served):
    """The pool checks an idle worker lives before handing it a format; a SIGKILL can land just after. Here it has
    landed, and the check is made to miss it, as it would in that instant: the format compiles on a fresh worker."""
    app, url = served
    pool = app.state.openai.grammars._ready()
    pool.start_one()
    with pool._cond:
        assert pool._idle
        worker = pool._idle[-1]   # the next one handed out
    with contextlib.suppress(ProcessLookupError):   # an earlier test's kills may have ended it already
        os.kill(worker.pid, signal.SIGKILL)
    select.select([worker._pidfd], [], [], 10)
    assert not worker.alive()
    worker.alive = lambda: True   # the instant between the check and the kill landing
    held = chat(url, max_tokens=300, response_format=schema_format({**ORDER, "title": "handed"}))
    assert held.status_code == 200, held.text
    jsonschema.validate(json.loads(held.json()["choices"][0]["message"]["content"]), ORDER)


def test_a_zygote_killed_from_outside_is_replaced(served):
    """Its workers end with it; the next format starts another zygote and compiles."""
    app, url = served
    pool = app.state.openai.grammars._ready()
    pool.start_one()
    zygote = pool._zygote.process.pid
    orphans = set(_children(zygote))
    assert orphans
    os.kill(zygote, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while _running(orphans) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _running(orphans), "workers outlived their zygote"
    held = chat(url, max_tokens=300, response_format=schema_format({**ORDER, "title": "zygote"}))
    assert held.status_code == 200, held.text
    assert pool._zygote.process.pid != zygote


def test_formats_past_the_waiting_limit_are_told_to_retry(served, monkeypatch):
    """One worker and no room to wait: a second format while the first compiles is a 503 to retry."""
    monkeypatch.setenv("EMBER_FORMAT_COMPILE_SECONDS", str(SECONDS))
    app = create_app(EngineConfig(model=served[0].state.llm.engine.config.model, max_num_seqs=4),
                     served_model_name="tiny")
    app.state.openai.grammars.workers = 1
    app.state.openai.grammars._ready().max_waiting = 0
    answers = {}
    with uvicorn_thread(app) as url:
        url = f"{url}/v1"
        slow = threading.Thread(target=lambda: answers.setdefault("slow", chat(
            url, guided_grammar=ambiguous_grammar(100, "d"))))
        slow.start()
        deadline = time.monotonic() + 60
        while not busy_workers(0.3) and time.monotonic() < deadline:
            pass
        busy = chat(url, response_format=schema_format({"type": "array", "title": "waits"}))
        slow.join()
        assert busy.status_code == 503, busy.text
        assert "retry" in busy.json()["error"]["message"] and busy.json()["error"]["type"] == "server_error"
        assert answers["slow"].status_code == 400
        app.state.openai.grammars._ready().max_waiting = 4   # to wait for the worker started in the killed one's place
        assert chat(url, response_format=schema_format({"type": "array", "title": "waits"})).status_code == 200


def test_a_free_worker_goes_to_the_caller_with_fewest_running_then_longest_unserved():
    from collections import Counter

    waiting = [(1, "a"), (2, "a"), (3, "b"), (4, None), (5, "c")]
    assert next_ticket(waiting, Counter(), []) == (1, "a")                   # none served yet: the oldest
    assert next_ticket(waiting, Counter(), ["a"]) == (3, "b")                # a was served: the others first
    assert next_ticket(waiting, Counter(), ["b", None, "a"]) == (5, "c")     # c never was
    assert next_ticket(waiting, Counter(b=1, c=1, a=1), ["c", "a", "b"]) == (4, None)
    busy = Counter({"a": 1, "b": 1, "c": 2, None: 1})
    assert next_ticket(waiting, busy, ["c", "a", "b", None]) == (1, "a")   # fewest running, then served longest ago


def test_callers_take_turns_for_the_compile_workers(served, monkeypatch):
    """One worker; caller A floods it with formats that cannot compile in time, and its fifth waiting is a 503 that
    names its own share; caller B's format, sent after A's four waited, takes the worker as soon as it is free, before
    A's, which go one by one (each killed at the deadline)."""
    # B must wait before A's first compile is killed: at a 2 s deadline, on a loaded 2-core CI host, A's four waits
    # and fifth 503 took longer once, and A's second took the worker before B came (a clean clone's run, session 32)
    monkeypatch.setenv("EMBER_FORMAT_COMPILE_SECONDS", str(2.5 * SECONDS))
    app = create_app(EngineConfig(model=served[0].state.llm.engine.config.model, max_num_seqs=4),
                     served_model_name="tiny")
    app.state.openai.grammars.workers = 1
    done: list[tuple[str, int]] = []

    def send(url, caller, name, **body):
        reply = httpx.post(f"{url}/chat/completions", timeout=120, headers={CALLER_HEADER: caller},
                           json={"model": "tiny", "messages": HELLO, "max_tokens": 4, **body})
        done.append((name, reply.status_code))
        return reply

    with uvicorn_thread(app) as url:
        url = f"{url}/v1"
        threads = [threading.Thread(target=send, args=(url, "a", "a0"),
                                    kwargs={"guided_grammar": ambiguous_grammar(100, "d")})]
        threads[0].start()
        deadline = time.monotonic() + 60
        while not busy_workers(0.3) and time.monotonic() < deadline:
            pass
        for i in range(1, 5):   # each its own format: the same one would wait on the first's compile
            threads.append(threading.Thread(target=send, args=(url, "a", f"a{i}"),
                                            kwargs={"guided_grammar": ambiguous_grammar(100 + i, "d")}))
            threads[-1].start()
        pool = app.state.openai.grammars._ready()
        while len(pool._waiting) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        over = send(url, "a", "a5", guided_grammar=ambiguous_grammar(110, "d"))
        assert over.status_code == 503 and "this API key" in over.json()["error"]["message"], over.text
        b = send(url, "b", "b", response_format=schema_format({"type": "array", "title": "turns"}))
        for thread in threads:
            thread.join()
    assert b.status_code == 200, b.text
    order = [name for name, _ in done]
    assert order.index("b") < min(order.index(f"a{i}") for i in range(1, 5)), done   # after a0, before a1-a4
    assert all(status == 400 for name, status in done if name.startswith("a") and name != "a5"), done


def test_compile_workers_end_with_their_replica(tmp_path):
    """A replica killed outright leaves no worker compiling on, nor its zygote: the zygote ends with the replica's
    socket, each worker with its zygote."""
    path = build_tiny_model(tmp_path / "qwen3")
    script = textwrap.dedent(f"""
        import json, sys, threading, time
        from transformers import AutoTokenizer
        from ember.runtime.engine.grammar import Grammars
        tokenizer = AutoTokenizer.from_pretrained({str(path)!r})
        grammars = Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id], seconds=600)
        tag = {{"type": "structural_tag", "format": {{"type": "grammar", "grammar": {ambiguous_grammar(400)!r}}}}}
        threading.Thread(target=grammars.compile, args=(tag,), daemon=True).start()
        time.sleep(600)
    """)
    replica = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline, compiling = time.monotonic() + 90, set()
        while not compiling and time.monotonic() < deadline:
            compiling = {pid for pid, cpu in workers(replica.pid).items() if cpu > 0.5}
            time.sleep(0.5)
        assert compiling, "the replica's worker did not start compiling"
        zygotes = set(_children(replica.pid))
    finally:
        replica.kill()
        replica.wait()
    deadline = time.monotonic() + 30   # within a second or two of the replica's end
    while _running(compiling | zygotes) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _running(compiling | zygotes)


def _running(pids: set[int]) -> set[int]:
    """Those of `pids` that are neither gone nor zombies."""
    running = set()
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                running.add(pid)
        except OSError:
            pass
    return running


def test_a_format_that_grows_too_costly_to_follow_ends_its_request_with_a_400(served):
    """Past the walk a worker takes through each format it compiles, a token whose mask costs over
    grammar.FOLLOW_SECONDS ends its sequence: a 400 (an error event when streamed), while the requests beside it go
    on."""
    url = served[1]
    answers = {}
    slow = threading.Thread(target=lambda: answers.setdefault("held", chat(
        url, max_tokens=400, guided_grammar=costly_after(40))))
    slow.start()
    free = chat(url, max_tokens=64)
    slow.join()
    assert free.status_code == 200
    reply = answers["held"]
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "format_too_costly"
    assert "simplify the format" in error["message"] and "retry" not in error["message"]
    with httpx.stream("POST", f"{url}/chat/completions", timeout=120, json={
            "model": "tiny", "messages": HELLO, "max_tokens": 400, "stream": True,
            "guided_grammar": costly_after(40, rules=21)}) as stream:
        events = [line.removeprefix("data: ") for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    failure = json.loads(events[-2])["error"]
    assert failure["type"] == "invalid_request_error" and "simplify the format" in failure["message"]
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-2]
                   if json.loads(e).get("choices"))
    assert text.startswith("0 1 2 3")   # the prefix came through before the format grew costly


def test_a_costly_row_in_a_threaded_batch_is_found_at_the_next_step(served):
    """MaskFiller writes 24 rows or more in one call: one that took over FOLLOW_SECONDS is followed by a step
    written row by row, which finds the costly matcher and no other."""
    from ember.runtime.engine import grammar

    grammars = served[0].state.openai.grammars
    grammars._ready()
    cheap = grammars.compile(grammar_tag({"type": "json_schema", "json_schema": ORDER}))
    costly = grammar.Grammar(grammars._compiler.compile_grammar(ambiguous_grammar(20, "d")), grammars.vocab_size,
                             "costly")
    matchers = [grammar.Matcher(cheap) for _ in range(grammar.THREADED_ROWS)] + [grammar.Matcher(costly)]
    walker = matchers[-1]
    for _ in range(3):   # its fourth mask takes ~0.8 s
        row = walker.allowed()
        assert row is not None
        walker._matcher.accept_token(_some_allowed(row, grammars.vocab_size))
    walker.costly = False
    filler = grammar.MaskFiller(grammars.vocab_size)
    filler.fill(matchers)
    assert filler._one_by_one and not any(m.costly for m in matchers)
    filler.fill(matchers)
    assert [m.costly for m in matchers] == [False] * grammar.THREADED_ROWS + [True]
    assert not filler._one_by_one


def grammar_tag(body: dict) -> dict:
    return {"type": "structural_tag", "format": body}


def _some_allowed(row, vocab_size: int) -> int:
    """The middle one of the tokens a mask row allows, other than the stop token 0."""
    allowed = [t for t in range(1, vocab_size) if (int(row[t // 32]) >> (t % 32)) & 1]
    return allowed[len(allowed) // 2]
