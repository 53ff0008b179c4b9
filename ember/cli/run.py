"""`ember run`: one call of a function in a fresh replica process, its result printed."""
import argparse
import asyncio
import json
import sys
from pathlib import Path

from ember.home import Home


def add_to(sub, epilog: str) -> None:
    p = sub.add_parser("run", help="run one call of APP.py::fn in a fresh replica process and print the result",
                       description="Start a replica of the function from its package, call it once with NAME=VALUE "
                                   "arguments (VALUE parsed as JSON when it can be), print the JSON result, stop the "
                                   "replica. A generator's values are printed one JSON line each as they come.")
    p.add_argument("target", metavar="APP.py::fn", help="APP.py::function or APP.py::Class.method")
    p.add_argument("args", nargs="*", default=[], metavar="NAME=VALUE")
    p.set_defaults(run=run)


def _parse_value(text: str):
    """VALUE as JSON when it is JSON, else the text. NaN, Infinity and numbers past a double (1e999) are no JSON a
    call can carry: they stay text (they failed the call's encoding with "Out of range float values")."""
    def no_such_number(value):
        raise ValueError(value)

    try:
        value = json.loads(text, parse_constant=no_such_number)
        json.dumps(value, allow_nan=False)
    except ValueError:
        return text
    return value


def run(args: argparse.Namespace) -> int:
    import httpx

    from ember.gateway.backends.local import LocalBackend
    from ember.package import build, load_app
    from ember.runtime.environments import ensure_for_package
    from ember.runtime.worker import CONTROL_HEADER

    path, sep, target = args.target.partition("::")
    if not sep or not target:
        print("error: name the function as APP.py::function or APP.py::Class.method", file=sys.stderr)
        return 2
    kwargs = {}
    for item in args.args:
        name, eq, value = item.partition("=")
        if not eq:
            print(f"error: argument {item!r} must be NAME=VALUE (VALUE is parsed as JSON when it can be)",
                  file=sys.stderr)
            return 2
        if name in kwargs:
            print(f"error: argument {name!r} is given twice", file=sys.stderr)
            return 2
        try:
            kwargs[name] = _parse_value(value)
        except RecursionError:
            print(f"error: the value of {name!r} is JSON nested deeper than Python reads ({len(value):,} characters); "
                  "flatten it, or pass it from a file through the SDK", file=sys.stderr)
            return 2
    app = load_app(path)
    unit_name, _, method = target.partition(".")
    if unit_name not in app.units:
        print(f"error: {path} has no function or class {unit_name!r}; it has {sorted(app.units)}", file=sys.stderr)
        return 2
    home = Home()
    package = build(app, home)
    ensure_for_package(package, lambda line: print(f"  {line}", file=sys.stderr, flush=True), home)

    async def once() -> int:
        backend = LocalBackend(home.logs, fork=False)  # one replica, one call: a fork server would only add a process
        replica = backend.new_replica(app.name, unit_name)
        await backend.start(replica, package, app.units[unit_name].spec)
        if replica.error:
            print(f"error: {replica.error}\nlog: {replica.log_path}", file=sys.stderr)
            return 1
        try:
            async with httpx.AsyncClient(timeout=app.units[unit_name].spec.timeout + 5) as client:
                async with client.stream("POST", f"http://127.0.0.1:{replica.port}/__ember__/call/"
                                         f"{method or unit_name}", json=kwargs,
                                         headers={CONTROL_HEADER: replica.control_secret or ""}) as reply:
                    if reply.headers.get("content-type", "").startswith("text/event-stream"):
                        return await _print_values(reply)
                    await reply.aread()
        finally:
            await backend.stop(replica)
        body = reply.json()
        if reply.status_code != 200:
            if body["error"]["type"] == "function_error":
                sys.stderr.write(_last_traceback(replica.log_path))
            print(f"error: {body['error']['type']}: {body['error']['message']}", file=sys.stderr)
            return 1
        print(json.dumps(body["result"], indent=2))
        return 0

    return asyncio.run(once())


def _last_traceback(log: Path) -> str:
    """The replica's last traceback in its log (the worker writes the user's frames there): from its first line to
    the exception's own line."""
    lines = log.read_text(errors="replace").splitlines(keepends=True) if log.exists() else []
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last):")]
    if not starts:
        return ""
    block = [lines[starts[-1]]]
    for line in lines[starts[-1] + 1:]:
        block.append(line)
        if not line.startswith(" "):  # the exception's line ends the traceback
            break
    return "".join(block)


async def _print_values(reply) -> int:
    """A generator's values, one JSON line each as it yields them."""
    from ember.client import EventReader, RemoteError

    reader = EventReader()
    try:
        async for line in reply.aiter_lines():
            for value in reader.feed(line):
                print(json.dumps(value), flush=True)
            if reader.done:
                return 0
        reader.finish()
    except RemoteError as exc:
        print(f"error: {exc.type}: {exc.message}", file=sys.stderr)
        return 1
    return 0
