"""The `ember` command."""
import argparse
import asyncio
import json
import os
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import httpx

from ember.home import Home

EPILOG = "EMBER_HOME (default ~/.ember) holds the key database, TLS material, packages and logs."


def _admin_client():
    from ember.client import Client

    return Client.from_env()


def cmd_serve(args: argparse.Namespace) -> int:
    from ember.gateway.serve import serve

    return serve(args.app, args.host, args.port, args.new_key, args.backend, args.parked_ram, args.redis, args.routing)


def _upload_progress(total: int):
    """progress(n) for boto3's transfer threads: a line on stderr at every tenth of `total` bytes sent."""
    sent, shown, lock = 0, 0, threading.Lock()

    def progress(n: int) -> None:
        nonlocal sent, shown
        with lock:
            sent += n
            tenths = sent * 10 // max(total, 1)
            if tenths > shown:
                shown = tenths
                print(f"  {sent:,} of {total:,} bytes sent ({min(tenths, 10) * 10}%)", file=sys.stderr, flush=True)

    return progress


def _upload(package: Path) -> dict:
    """Put the package in EMBER_AWS_BUCKET (not again when that hash is there): the body of the gateway's deploy call."""
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    from ember.runtime.aws import upload_package

    bucket = os.environ.get("EMBER_AWS_BUCKET")
    if not bucket:
        raise RuntimeError("--target aws needs EMBER_AWS_BUCKET: the bucket the gateway's AWS backend uses (terraform output `bucket`)")
    size = package.stat().st_size
    print(f"package {package.name} ({size:,} bytes) to s3://{bucket}/packages/", file=sys.stderr, flush=True)
    try:
        key, digest, uploaded = upload_package(boto3.client("s3"), bucket, package, _upload_progress(size))
    except (BotoCoreError, ClientError) as exc:
        raise RuntimeError(f"cannot upload to s3://{bucket}: {exc}; check the bucket exists and the AWS credentials "
                           "(AWS_PROFILE or AWS_ACCESS_KEY_ID) and region may write to it") from None
    if not uploaded:
        print(f"  already in s3://{bucket}/{key}: upload skipped", file=sys.stderr)
    return {"package_url": f"s3://{bucket}/{key}", "sha256": digest}


def cmd_deploy(args: argparse.Namespace) -> int:
    from ember.package import build, load_app

    package = build(load_app(args.app), Home())
    with _admin_client() as client:  # first: a missing EMBER_URL or EMBER_KEY stops the deploy before an upload
        request = _upload(package) if args.target == "aws" else {"package": str(package)}
        reply = client.request("POST", "/admin/deploy", json=request).json()
    print(f"deployed app {reply['app']!r} ({', '.join(reply['functions'])}) from {request.get('package_url', package)}")
    return 0


def _parse_value(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def cmd_run(args: argparse.Namespace) -> int:
    import httpx

    from ember.gateway.backends.local import LocalBackend
    from ember.runtime.worker import CONTROL_HEADER
    from ember.package import build, load_app

    path, sep, target = args.target.partition("::")
    if not sep or not target:
        print("error: name the function as APP.py::function or APP.py::Class.method", file=sys.stderr)
        return 2
    kwargs = {}
    for item in args.args:
        name, eq, value = item.partition("=")
        if not eq:
            print(f"error: argument {item!r} must be NAME=VALUE (VALUE is parsed as JSON when it can be)", file=sys.stderr)
            return 2
        kwargs[name] = _parse_value(value)
    app = load_app(path)
    unit_name, _, method = target.partition(".")
    if unit_name not in app.units:
        print(f"error: {path} has no function or class {unit_name!r}; it has {sorted(app.units)}", file=sys.stderr)
        return 2
    home = Home()
    package = build(app, home)

    async def once() -> int:
        backend = LocalBackend(home.logs, fork=False)  # one replica, one call: a fork server would only add a process
        replica = backend.new_replica(app.name, unit_name)
        await backend.start(replica, package, app.units[unit_name].spec)
        if replica.error:
            print(f"error: {replica.error}\nlog: {replica.log_path}", file=sys.stderr)
            return 1
        try:
            async with httpx.AsyncClient(timeout=app.units[unit_name].spec.timeout + 5) as client:
                reply = await client.post(f"http://127.0.0.1:{replica.port}/__ember__/call/{method or unit_name}", json=kwargs,
                                         headers={CONTROL_HEADER: replica.control_secret or ""})
        finally:
            await backend.stop(replica)
        body = reply.json()
        if reply.status_code != 200:
            print(f"error: {body['error']['type']}: {body['error']['message']}", file=sys.stderr)
            return 1
        print(json.dumps(body["result"], indent=2))
        return 0

    return asyncio.run(once())


DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _seconds(text: str) -> float:
    """'90s', '15m', '12h', '30d' -> seconds."""
    try:
        value, unit = float(text[:-1]), DURATION_UNITS[text[-1]]
    except (ValueError, KeyError, IndexError):
        raise ValueError(f"--expires {text!r}: write a number and a unit, e.g. 90s, 15m, 12h or 30d") from None
    if value <= 0:
        raise ValueError(f"--expires {text!r} must be positive")
    return value * unit


def _key_api():
    """The running gateway's admin API when there is one, so its caches change at once; else None."""
    from ember.client import Client

    home = Home()
    if not home.gateway_file.exists():
        return None
    client = Client.from_env()
    try:
        client.request("GET", "/healthz")
    except httpx.TransportError:  # a gateway.json left by one that is gone
        client.http.close()
        return None
    return client


def _when(ts: float | None) -> str:
    return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M") if ts else "-"


def cmd_keys(args: argparse.Namespace) -> int:
    api = _key_api()
    if args.keys_command == "create":
        request = {"name": args.name, "scopes": args.scope + (["admin"] if args.admin else []),
                   "expires_in": _seconds(args.expires) if args.expires else None,
                   "rpm": args.rpm, "tpm": args.tpm, "concurrency": args.concurrency}
        if api is not None:
            with api:
                key = api.request("POST", "/admin/keys", json=request).json()
            secret = key["secret"]
        else:
            from ember.gateway.keys import KeyStore
            from ember.gateway.ratelimit import Limits

            expires = time.time() + request["expires_in"] if request["expires_in"] else None
            record, secret = KeyStore(Home().db).create(args.name, scopes=request["scopes"], expires=expires,
                                                        limits=Limits(args.rpm, args.tpm, args.concurrency))
            key = record.describe()
        if args.quiet:
            print(secret)
        else:
            scopes = ", ".join(key["scopes"]) or "every app"
            print(f"created key {key['id']} ({key['name']}; {scopes}); it is shown only this once:\n{secret}")
        return 0
    if args.keys_command == "list":
        if api is not None:
            with api:
                rows = api.request("GET", "/admin/keys").json()
        else:
            from ember.gateway.keys import KeyStore

            rows = [k.describe() for k in KeyStore(Home().db).all()]
        if args.json:
            print(json.dumps(rows, indent=2))
            return 0
        now = time.time()
        for key in rows:
            state = f"revoked {_when(key['revoked'])}" if key["revoked"] else "expired" if key["expires"] and key["expires"] <= now else "live"
            limits = " ".join(f"{n}={key[n]}" for n in ("rpm", "tpm", "concurrency") if key[n])
            print(f"{key['id']}  {key['name']:<20} {','.join(key['scopes']) or '*':<24} created {_when(key['created'])}  "
                  f"expires {_when(key['expires'])}  {state}  {limits}")
        return 0
    if api is not None:
        from ember.client import RemoteError

        try:
            with api:
                revoked = api.request("DELETE", f"/admin/keys/{args.key}").json()
        except RemoteError as exc:
            if exc.status != 404:
                raise
            revoked = []
    else:
        from ember.gateway.keys import KeyStore

        revoked = [k.describe() for k in KeyStore(Home().db).revoke(args.key)]
    if not revoked:
        print(f"error: no live key with id or name {args.key!r}; see `ember keys list`", file=sys.stderr)
        return 1
    for key in revoked:
        print(f"revoked key {key['id']} ({key['name']})")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    with _admin_client() as client:
        status = client.request("GET", "/admin/status").json()
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    now = time.time()
    for app, info in status["apps"].items():
        print(f"app {app}  (package {info['package']})")
        for name, unit in info["functions"].items():
            states = ", ".join(f"{n} {state}" for state, n in unit["replicas_by_state"].items())
            print(f"  {name}: replicas {states}; queue depth {unit['queue_depth']}, in flight {unit['in_flight']}")
            for r in unit["replicas"]:
                start = r["start"]
                breakdown = ", ".join(f"{k}={v}" for k, v in start.items() if k != "tier")
                print(f"    {r['id']:<24} {r['state']:<9} in_flight={r['in_flight']} age={r['age_s']}s  start: {start['tier']} {breakdown}")
                if r.get("note"):
                    print(f"      note: {r['note']}")
            for f in unit["failed"]:
                print(f"    FAILED {f['id']} {now - f['at']:.0f}s ago: {f['error']}  (log: {f['log']})")
            for d in unit["decisions"][-5:]:
                print(f"    decision at {datetime.fromtimestamp(d['t']):%H:%M:%S} ({now - d['t']:.0f}s ago): "
                      f"{d['action']} {d['replica'] or d['count']}: {d['reason']}")
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    if args.follow:
        return _follow_logs(args)
    if args.app or args.function:
        raise ValueError("--app and --function filter what `ember logs -f` follows; without -f, use --replica")
    params = {"lines": 200 if args.lines is None else args.lines} | ({"replica": args.replica} if args.replica else {})
    with _admin_client() as client:
        sys.stdout.write(client.request("GET", "/admin/logs", params=params).text)
    return 0


def log_line(record: dict) -> str:
    """One record of `ember logs -f` as a readable line: time, level, where it came from, message, then ids."""
    where = "gateway" if record.get("source") == "gateway" else f"{record.get('app')}/{record.get('function', '?')} " \
        f"{record.get('replica')}"
    ids = " ".join(f"{k}={record[k]}" for k in ("trace_id", "request_id") if record.get(k))
    time_of_day = str(record.get("ts", ""))[11:23]
    level = str(record.get("level", "")).upper()
    return " ".join(part for part in (time_of_day, f"{level:5}" if level else "", f"[{where}]", str(record.get("msg", "")),
                                      ids) if part)


def _follow_logs(args: argparse.Namespace) -> int:
    """Print the gateway's and replicas' log lines as they are written, until Ctrl-C."""
    params = {k: v for k, v in (("app", args.app), ("function", args.function), ("replica", args.replica)) if v}
    params["lines"] = 10 if args.lines is None else max(0, min(args.lines, 10_000))
    with _admin_client() as client:
        try:
            with client.stream("GET", "/admin/logs/follow", params=params, timeout=httpx.Timeout(10, read=None)) as reply:
                for line in reply.iter_lines():
                    if line.strip():
                        record = json.loads(line)
                        print(json.dumps(record) if args.json else log_line(record), flush=True)
        except KeyboardInterrupt:
            pass
    return 0


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="ember", description="Serverless inference: decorate a function, get an HTTPS endpoint.", epilog=EPILOG)
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("serve", help="run gateway, autoscaler and local backend for APP.py in the foreground",
                       description="Serve APP.py over HTTPS on this machine; prints the URL and the dev CA path.", epilog=EPILOG)
    p.add_argument("app", help="the app file, e.g. examples/hello.py")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8443, help="port to listen on; 0 picks a free one (default 8443)")
    p.add_argument("--new-key", metavar="NAME", help="also create an API key NAME and print a ready-to-paste curl")
    p.add_argument("--backend", choices=["local", "aws"], default="local",
                   help="where replicas run: local processes, or the AWS Auto Scaling Group named by EMBER_AWS_ASG (default local)")
    p.add_argument("--parked-ram", metavar="SIZE", help="host RAM parked replicas may hold, e.g. 8GiB (default a quarter of RAM)")
    p.add_argument("--redis", metavar="URL", help="share rate-limit state with other gateways in this Redis (default EMBER_REDIS_URL; "
                                                   "else kept in this process)")
    p.add_argument("--routing", choices=["affinity", "round-robin", "least-loaded"], default="affinity",
                   help="how a replica is chosen: X-Session-ID or prompt prefix by bounded-load hashing, else least loaded "
                        "(affinity, the default); in turn; or least loaded")
    p.set_defaults(run=cmd_serve)

    p = sub.add_parser("deploy", help="package APP.py and deploy it to the running gateway",
                       description="Build APP.py's package and hand it to the gateway (EMBER_URL and EMBER_KEY, else the one "
                                   "`ember serve` runs here). With --target aws the package goes to EMBER_AWS_BUCKET first "
                                   "and the gateway fetches it from there.")
    p.add_argument("app", help="the app file")
    p.add_argument("--target", choices=["local", "aws"], default="local",
                   help="local: the gateway reads the package from this machine; aws: upload it to S3 for the gateway (default local)")
    p.set_defaults(run=cmd_deploy)

    p = sub.add_parser("run", help="run one call of APP.py::fn in a fresh replica process and print the result",
                       description="Start a replica of the function from its package, call it once with NAME=VALUE arguments "
                                   "(VALUE parsed as JSON when it can be), print the JSON result, stop the replica.")
    p.add_argument("target", metavar="APP.py::fn", help="APP.py::function or APP.py::Class.method")
    p.add_argument("args", nargs="*", metavar="NAME=VALUE")
    p.set_defaults(run=cmd_run)

    p = sub.add_parser("keys", help="create, list or revoke API keys",
                       description="Manage API keys through the running gateway's admin API (so a revocation applies to "
                                   "its next request), or in EMBER_HOME's database when no gateway runs. Scopes: 'app:APP' "
                                   "(every function of APP), 'fn:APP/FUNCTION', 'admin'; a key without app: or fn: scopes "
                                   "may call every app.")
    keys = p.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    k = keys.add_parser("create", help="create a key and print it once")
    k.add_argument("--name", required=True, help="a label for the key")
    k.add_argument("--admin", action="store_true", help="allow the /admin API (same as --scope admin)")
    k.add_argument("--scope", action="append", default=[], metavar="SCOPE",
                   help="app:APP or fn:APP/FUNCTION (repeatable); without one the key may call every app")
    k.add_argument("--expires", metavar="DURATION", help="stop working after e.g. 90s, 15m, 12h or 30d (default never)")
    k.add_argument("--rpm", type=int, help="requests per minute for this key")
    k.add_argument("--tpm", type=int, help="LLM tokens (prompt + completion) per minute for this key")
    k.add_argument("--concurrency", type=int, help="requests in flight at once for this key")
    k.add_argument("--quiet", "-q", action="store_true", help="print only the key")
    k = keys.add_parser("list", help="list keys (never their secrets)")
    k.add_argument("--json", action="store_true", help="machine-readable output")
    k = keys.add_parser("revoke", help="revoke a key by id, or all live keys with a name")
    k.add_argument("key", metavar="ID_OR_NAME")
    p.set_defaults(run=cmd_keys)

    p = sub.add_parser("status", help="replicas per function, their state and start times, queue depth, failures",
                       description="Ask the running gateway for replicas per function, queue depth, failures and scaling decisions.")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=cmd_status)

    p = sub.add_parser("logs", help="the gateway's log, or one replica's; -f follows them all",
                       description="Print the tail of the gateway's log (replica starts, failures with their tracebacks, evictions), "
                                   "or of one replica's log with --replica. With -f, follow the gateway's and every replica's "
                                   "log as they are written (JSON lines with trace and request ids), filtered by --app, "
                                   "--function and --replica.")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until Ctrl-C")
    p.add_argument("--app", metavar="APP", help="with -f: only lines of this app")
    p.add_argument("--function", metavar="NAME", help="with -f: only lines of this function (or class)")
    p.add_argument("--replica", metavar="ID", help="a replica id from `ember status`")
    p.add_argument("-n", "--lines", type=int, help="how many lines (default 200; with -f, 10 of each log to begin with)")
    p.add_argument("--json", action="store_true", help="with -f: print each record as its JSON line")
    p.set_defaults(run=cmd_logs)

    # Listed for help only: main() hands `ember snapshot ...` to ember.snapshot.cli before parsing.
    sub.add_parser("snapshot", help="build, list or remove snapshots (ember snapshot --help)")
    return top


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["snapshot"]:  # everything after it, --help included, belongs to the snapshot CLI
        from ember.snapshot.cli import main as snapshot_main

        return snapshot_main(argv[1:])
    args = parser().parse_args(argv)
    from ember.client import RemoteError

    try:
        return args.run(args)
    except RemoteError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (RuntimeError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # EMBER_HOME read-only or full, mostly
        from ember.home import Home

        print(f"error: cannot write {exc.filename or 'a file'} ({exc.strerror or exc}): EMBER_HOME={Home().root} "
              "must be a folder this user can write, on a disk with room; point EMBER_HOME at one", file=sys.stderr)
        return 1
    except httpx.TransportError as exc:
        print(f"error: cannot reach the gateway ({exc}); is `ember serve` running?", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
