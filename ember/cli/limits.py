"""`ember limits get | set APP`: an app's rate limits (requests and tokens per minute, calls in flight), shared by
every key that calls it, through the running gateway's admin API."""
import argparse
import json
from urllib.parse import quote

from ember.cli.admin import admin_client

FIELDS = {"rpm": "requests per minute", "tpm": "LLM tokens (prompt + completion) per minute",
          "concurrency": "requests in flight at once"}


def add_to(sub, epilog: str) -> None:
    p = sub.add_parser("limits", help="show or change an app's rate limits",
                       description="An app's limits apply to all its callers together, beside each key's own. "
                                   "They are kept by the running gateway (EMBER_URL and EMBER_KEY, else the one "
                                   "`ember serve` runs here).")
    actions = p.add_subparsers(dest="limits_command", required=True, metavar="ACTION")
    g = actions.add_parser("get", help="print APP's limits")
    g.add_argument("app", metavar="APP")
    g.add_argument("--json", action="store_true", help="machine-readable output")
    g.set_defaults(run=get_limits)
    s = actions.add_parser("set", help="change APP's limits; the ones not given stay as they are",
                           description="Change the limits given; 'off' removes one. Example: "
                                       "ember limits set chat --rpm 600 --concurrency off")
    s.add_argument("app", metavar="APP")
    for name, what in FIELDS.items():
        s.add_argument(f"--{name}", type=_limit, metavar="N|off", help=what)
    s.set_defaults(run=set_limits)


def _limit(text: str) -> int | str:
    if text == "off":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number or 'off'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1 (or 'off' for no limit)")
    return value


def _show(limits: dict) -> str:
    return ", ".join(f"{name}={limits[name] if limits[name] is not None else 'off'}" for name in FIELDS)


def get_limits(args: argparse.Namespace) -> int:
    with admin_client() as client:
        limits = client.request("GET", f"/admin/apps/{quote(args.app, safe='')}/limits").json()
    print(json.dumps(limits, indent=2) if args.json else f"app {args.app}: {_show(limits)}")
    return 0


def set_limits(args: argparse.Namespace) -> int:
    given = {name: getattr(args, name) for name in FIELDS if getattr(args, name) is not None}
    if not given:
        raise ValueError(f"give at least one of {', '.join('--' + n for n in FIELDS)}, e.g. "
                         f"`ember limits set {args.app} --rpm 600`")
    with admin_client() as client:
        current = client.request("GET", f"/admin/apps/{quote(args.app, safe='')}/limits").json()
        body = {name: current[name] for name in FIELDS} | {n: None if v == "off" else v for n, v in given.items()}
        limits = client.request("PUT", f"/admin/apps/{quote(args.app, safe='')}/limits", json=body).json()
    print(f"app {args.app}: {_show(limits)}")
    if limits.get("deployed") is False:
        apps = ", ".join(limits.get("deployed_apps") or []) or "none"
        print(f"note: no app named {args.app!r} is deployed on this gateway (deployed: {apps}); its limits apply "
              "once one is")
    return 0
