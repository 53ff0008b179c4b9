"""`ember apps list | history APP`: the apps the running gateway serves and every version deployed of each."""
import argparse
import json
from datetime import datetime

from ember.cli.admin import admin_client


def add_to(sub, epilog: str) -> None:
    p = sub.add_parser("apps", help="list deployed apps, or one app's versions",
                       description="The apps the running gateway serves, with the version live; `history APP` lists "
                                   "every version deployed (live, retired or failed, and why). "
                                   "`ember deploy --rollback APP [--to VERSION]` goes back to one.")
    actions = p.add_subparsers(dest="apps_command", required=True, metavar="ACTION")
    a = actions.add_parser("list", help="apps, their live version, functions and when it was deployed")
    a.add_argument("--json", action="store_true", help="machine-readable output")
    a.set_defaults(run=list_apps)
    a = actions.add_parser("history", help="every version of APP, newest first")
    a.add_argument("app", metavar="APP")
    a.add_argument("--json", action="store_true", help="machine-readable output")
    a.set_defaults(run=history)


def _when(ts: float | None) -> str:
    return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S") if ts else "-"


def list_apps(args: argparse.Namespace) -> int:
    with admin_client() as client:
        rows = client.request("GET", "/admin/apps").json()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'APP':<20} {'VERSION':>7}  {'DEPLOYED':<19}  FUNCTIONS")
    for row in rows:
        version = row["version"] if row["version"] is not None else "-"
        print(f"{row['app']:<20} {version:>7}  {_when(row.get('created')):<19}  {', '.join(row['functions'])}")
    return 0


def history(args: argparse.Namespace) -> int:
    from ember.gateway.routing import APP_NAME

    if not APP_NAME.fullmatch(args.app):
        raise ValueError(f"app names match {APP_NAME.pattern}; got {args.app!r}")
    with admin_client() as client:
        rows = client.request("GET", f"/admin/apps/{args.app}/versions").json()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'VERSION':>7}  {'STATE':<8} {'DEPLOYED':<19}  {'BY':<28} {'PACKAGE':<14} NOTE")
    for row in rows:
        print(f"{row['version']:>7}  {row['state']:<8} {_when(row['created']):<19}  {row['deployed_by'] or '-':<28} "
              f"{row['digest'][:12]:<14} {row['note'] or ''}")
        if row["error"]:
            print("         " + row["error"].splitlines()[0])
    return 0
