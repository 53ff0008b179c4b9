"""`ember secrets set | list | rm`: the secrets functions list in `secrets=[...]`, kept by the running gateway
(its admin API) and checked when an app that needs them is deployed."""
import argparse
import json
from datetime import datetime

from ember.cli.admin import admin_client


def add_to(sub, epilog: str) -> None:
    p = sub.add_parser("secrets", help="set, list or remove the secrets functions read as environment variables",
                       description="Secrets a function declares with secrets=[NAME] reach its replicas as environment "
                                   "variables. They are kept by the running gateway (EMBER_URL and EMBER_KEY, else "
                                   "the one `ember serve` runs here); values are never printed back.")
    actions = p.add_subparsers(dest="secrets_command", required=True, metavar="ACTION")
    s = actions.add_parser("set", help="create or replace secret NAME with KEY=VALUE pairs")
    s.add_argument("name", metavar="NAME", help="the name functions list in secrets=[...]")
    s.add_argument("pairs", nargs="+", metavar="KEY=VALUE", help="environment variables the secret sets")
    s.set_defaults(run=set_secret)
    s = actions.add_parser("list", help="list secrets and their keys (never their values)")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(run=list_secrets)
    s = actions.add_parser("rm", help="remove secret NAME")
    s.add_argument("name", metavar="NAME")
    s.set_defaults(run=remove_secret)


def _path(name: str) -> str:
    from ember.gateway.secret_files import SECRET_NAME

    if not SECRET_NAME.fullmatch(name):
        raise ValueError(f"secret names match {SECRET_NAME.pattern}; got {name[:100]!r}")
    return f"/admin/secrets/{name}"


def _pairs(pairs: list[str]) -> dict[str, str]:
    values = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"{pair!r} is not KEY=VALUE; write e.g. `ember secrets set hf HF_TOKEN=hf_...`")
        values[key] = value
    return values


def set_secret(args: argparse.Namespace) -> int:
    values = _pairs(args.pairs)
    with admin_client() as client:
        reply = client.request("PUT", _path(args.name), json={"values": values}).json()
    print(f"secret {reply['name']!r} set ({', '.join(reply['keys'])})")
    return 0


def list_secrets(args: argparse.Namespace) -> int:
    with admin_client() as client:
        rows = client.request("GET", "/admin/secrets").json()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no secrets; set one with `ember secrets set NAME KEY=VALUE ...`")
    for row in rows:
        updated = datetime.fromtimestamp(row["updated"]).strftime("%Y-%m-%d %H:%M")
        print(f"{row['name']:<24} {', '.join(row['keys']):<40} updated {updated}")
    return 0


def remove_secret(args: argparse.Namespace) -> int:
    with admin_client() as client:
        client.request("DELETE", _path(args.name))
    print(f"secret {args.name!r} removed")
    return 0
