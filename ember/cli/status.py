"""`ember status` and `ember logs`: what the running gateway reports through its admin API."""
import argparse
import json
import sys
import time
from datetime import datetime

from ember.cli.admin import admin_client


def add_to(sub, epilog: str) -> None:
    p = sub.add_parser("status", help="replicas per function, their state and start times, queue depth, failures",
                       description="Ask the running gateway for replicas per function, queue depth, failures and "
                                   "scaling decisions.")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=status)

    p = sub.add_parser("logs", help="the gateway's log, or one replica's; -f follows them all",
                       description="Print the tail of the gateway's log (replica starts, failures with their "
                                   "tracebacks, evictions), or of one replica's log with --replica. With -f, follow "
                                   "the gateway's and every replica's log as they are written (JSON lines with trace "
                                   "and request ids), filtered by --app, --function and --replica.")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until Ctrl-C")
    p.add_argument("--app", metavar="APP", help="with -f: only lines of this app")
    p.add_argument("--function", metavar="NAME", help="with -f: only lines of this function (or class)")
    p.add_argument("--replica", metavar="ID", help="a replica id from `ember status`")
    p.add_argument("-n", "--lines", type=int,
                   help="how many lines (default 200; with -f, 10 of each log to begin with)")
    p.add_argument("--json", action="store_true", help="with -f: print each record as its JSON line")
    p.set_defaults(run=logs)


def status(args: argparse.Namespace) -> int:
    with admin_client() as client:
        report = client.request("GET", "/admin/status").json()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    now = time.time()
    for app, info in report["apps"].items():
        print(f"app {app}  (package {info['package']})")
        for name, unit in info["functions"].items():
            states = ", ".join(f"{n} {state}" for state, n in unit["replicas_by_state"].items())
            slots = unit["settings"].get("max_concurrency")
            print(f"  {name}: replicas {states}; queue depth {unit['queue_depth']} ({unit.get('queue_slots', 0)} "
                  f"slots), in flight {unit['in_flight']} ({unit.get('load', 0)} slots, {slots} a replica)")
            for r in unit["replicas"]:
                start = r["start"]
                breakdown = ", ".join(f"{k}={v}" for k, v in start.items() if k != "tier")
                print(f"    {r['id']:<24} {r['state']:<9} in_flight={r['in_flight']} slots={r.get('load', 0)}/{slots} "
                      f"age={r['age_s']}s  "
                      f"start: {start['tier']} {breakdown}")
                if r.get("note"):
                    print(f"      note: {terminal_safe(str(r['note']))}")
            for f in unit["failed"]:
                print(f"    FAILED {f['id']} {now - f['at']:.0f}s ago: {terminal_safe(str(f['error']))}  "
                      f"(log: {f['log']})")   # the error's text is the user code's exception
            for d in unit["decisions"][-5:]:
                print(f"    decision at {datetime.fromtimestamp(d['t']):%H:%M:%S} ({now - d['t']:.0f}s ago): "
                      f"{d['action']} {d['replica'] or d['count']}: {d['reason']}")
        for r in info.get("retiring", []):
            print(f"  replaced: {r['function']} {r['id']} of version {r['version']}, finishing {r['in_flight']} "
                  f"call(s); it stops once they are done")
    return 0


def logs(args: argparse.Namespace) -> int:
    if args.follow:
        return _follow_logs(args)
    if args.app or args.function:
        raise ValueError("--app and --function filter what `ember logs -f` follows; without -f, use --replica")
    params = {"lines": 200 if args.lines is None else args.lines} | ({"replica": args.replica} if args.replica else {})
    with admin_client() as client:
        sys.stdout.write(terminal_safe(client.request("GET", "/admin/logs", params=params).text))
    return 0


def log_line(record: dict) -> str:
    """One record of `ember logs -f` as a readable line: time, level, where it came from, message, then ids."""
    where = "gateway" if record.get("source") == "gateway" else (
        f"{record.get('app')}/{record.get('function', '?')} {record.get('replica')}")
    ids = " ".join(f"{k}={record[k]}" for k in ("trace_id", "request_id") if record.get(k))
    time_of_day = str(record.get("ts", ""))[11:23]
    level = str(record.get("level", "")).upper()
    parts = (time_of_day, f"{level:5}" if level else "", f"[{where}]", str(record.get("msg", "")), ids)
    return terminal_safe(" ".join(part for part in parts if part))


# Control characters but tab and newline: what a replica prints may carry a caller's text, and an escape sequence in
# it would act on the operator's terminal (retitle it, rewrite earlier lines, plant a link) instead of showing.
_CONTROLS = {c: f"\\x{c:02x}" for c in [*range(0x00, 0x09), *range(0x0b, 0x20), *range(0x7f, 0xa0)]}


def terminal_safe(text: str) -> str:
    """`text` with its control characters (but tab and newline, and CR before a newline) written out as \\xNN."""
    return text.replace("\r\n", "\n").translate(_CONTROLS)


def _follow_logs(args: argparse.Namespace) -> int:
    """Print the gateway's and replicas' log lines as they are written, until Ctrl-C."""
    import httpx

    params = {k: v for k, v in (("app", args.app), ("function", args.function), ("replica", args.replica)) if v}
    params["lines"] = 10 if args.lines is None else max(0, min(args.lines, 10_000))
    with admin_client() as client:
        try:
            with client.stream("GET", "/admin/logs/follow", params=params,
                               timeout=httpx.Timeout(10, read=None)) as reply:
                for line in reply.iter_lines():
                    if line.strip():
                        record = json.loads(line)
                        print(json.dumps(record) if args.json else log_line(record), flush=True)
            print("the gateway stopped; run `ember logs -f` again once it is back", file=sys.stderr)
        except KeyboardInterrupt:
            pass
    return 0
