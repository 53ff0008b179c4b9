"""`ember keys create | list | revoke`. A `KeyBook` is where the keys are reached: the running gateway's admin API
(so its caches change at once), or the database in EMBER_HOME when no gateway runs; `open_key_book` is the one
place that chooses."""
import argparse
import sys
import time
from datetime import datetime
from typing import Protocol

from ember.cli.admin import running_gateway
from ember.client import Client, RemoteError
from ember.gateway.keys import LONGEST_KEY_LIFE
from ember.gateway.ratelimit import LIMIT_MOST
from ember.home import Home

DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class KeyBook(Protocol):
    def create(self, name: str, scopes: list[str], expires_in: float | None, rpm: int | None, tpm: int | None,
               concurrency: int | None) -> tuple[dict, str]:
        """The new key's description and its secret, shown once."""
        ...

    def all(self) -> list[dict]:
        ...

    def revoke(self, key: str) -> list[dict]:
        """The keys revoked: the one with id `key`, or every live key named `key`; none when nothing matched."""
        ...


class GatewayKeys:
    def __init__(self, api: Client):
        self.api = api

    def create(self, name, scopes, expires_in, rpm, tpm, concurrency):
        request = {"name": name, "scopes": scopes, "expires_in": expires_in, "rpm": rpm, "tpm": tpm,
                   "concurrency": concurrency}
        with self.api:
            key = self.api.request("POST", "/admin/keys", json=request).json()
        return key, key["secret"]

    def all(self):
        with self.api:
            return self.api.request("GET", "/admin/keys").json()

    def revoke(self, key):
        try:
            with self.api:
                return self.api.request("DELETE", f"/admin/keys/{key}").json()
        except RemoteError as exc:
            if exc.status != 404:
                raise
            return []


class DatabaseKeys:
    def __init__(self, home: Home):
        from ember.gateway.keys import KeyStore

        self.store = KeyStore(home.db)

    def create(self, name, scopes, expires_in, rpm, tpm, concurrency):
        from ember.gateway.ratelimit import Limits

        expires = time.time() + expires_in if expires_in else None
        record, secret = self.store.create(name, scopes=scopes, expires=expires, limits=Limits(rpm, tpm, concurrency))
        return record.describe(), secret

    def all(self):
        return [k.describe() for k in self.store.all()]

    def revoke(self, key):
        return [k.describe() for k in self.store.revoke(key)]


def open_key_book() -> KeyBook:
    api = running_gateway()
    return GatewayKeys(api) if api is not None else DatabaseKeys(Home())


def add_to(sub, epilog: str) -> None:
    p = sub.add_parser("keys", help="create, list or revoke API keys",
                       description="Manage API keys through the running gateway's admin API (so a revocation applies "
                                   "to its next request), or in EMBER_HOME's database when no gateway runs. Scopes: "
                                   "'app:APP' (every function of APP), 'fn:APP/FUNCTION', 'admin'; a key without app: "
                                   "or fn: scopes may call every app.")
    keys = p.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    k = keys.add_parser("create", help="create a key and print it once")
    k.add_argument("--name", required=True, help="a label for the key")
    k.add_argument("--admin", action="store_true", help="allow the /admin API (same as --scope admin)")
    k.add_argument("--scope", action="append", default=[], metavar="SCOPE",
                   help="app:APP or fn:APP/FUNCTION (repeatable); without one the key may call every app")
    k.add_argument("--expires", metavar="DURATION", help="stop working after e.g. 90s, 15m, 12h or 30d (default never)")
    k.add_argument("--rpm", type=_limit("requests_per_minute"), help="requests per minute for this key")
    k.add_argument("--tpm", type=_limit("tokens_per_minute"),
                   help="LLM tokens (prompt + completion) per minute for this key")
    k.add_argument("--concurrency", type=_limit("max_concurrent"), help="requests in flight at once for this key")
    k.add_argument("--quiet", "-q", action="store_true", help="print only the key")
    k.set_defaults(run=create)
    k = keys.add_parser("list", help="list keys (never their secrets)")
    k.add_argument("--json", action="store_true", help="machine-readable output")
    k.set_defaults(run=list_keys)
    k = keys.add_parser("revoke", help="revoke a key by id, or all live keys with a name")
    k.add_argument("key", metavar="ID_OR_NAME")
    k.set_defaults(run=revoke)


def _limit(name: str):
    """An argparse type: a whole number from 1 to what Limits takes for `name`."""
    most = LIMIT_MOST[name]

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not 1 <= value <= most:
            raise argparse.ArgumentTypeError(f"{text} is outside 1 to {most:,}")
        return value
    return parse


def _seconds(text: str) -> float:
    """'90s', '15m', '12h', '30d' -> seconds."""
    try:
        value, unit = float(text[:-1]), DURATION_UNITS[text[-1]]
    except (ValueError, KeyError, IndexError):
        raise ValueError(f"--expires {text!r}: write a number and a unit, e.g. 90s, 15m, 12h or 30d") from None
    if not 0 < value * unit <= LONGEST_KEY_LIFE:   # NaN too: it was taken, and the key never expired
        raise ValueError(f"--expires {text!r} must be positive and at most {LONGEST_KEY_LIFE / 86400:.0f}d")
    return value * unit


def _when(ts: float | None) -> str:
    try:
        return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M") if ts else "-"
    except (OverflowError, ValueError, OSError):   # a key made before expiries were bounded: past year 9999
        return "never"


def create(args: argparse.Namespace) -> int:
    expires_in = _seconds(args.expires) if args.expires else None
    key, secret = open_key_book().create(args.name, args.scope + (["admin"] if args.admin else []), expires_in,
                                         args.rpm, args.tpm, args.concurrency)
    if args.quiet:
        print(secret)
    else:
        scopes = ", ".join(key["scopes"]) or "every app"
        print(f"created key {key['id']} ({key['name']}; {scopes}); it is shown only this once:\n{secret}")
    return 0


def list_keys(args: argparse.Namespace) -> int:
    import json

    rows = open_key_book().all()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    now = time.time()
    for key in rows:
        expired = key["expires"] and key["expires"] <= now
        state = f"revoked {_when(key['revoked'])}" if key["revoked"] else "expired" if expired else "live"
        limits = " ".join(f"{n}={key[n]}" for n in ("rpm", "tpm", "concurrency") if key[n])
        print(f"{key['id']}  {key['name']:<20} {','.join(key['scopes']) or '*':<24} created {_when(key['created'])}  "
              f"expires {_when(key['expires'])}  {state}  {limits}")
    return 0


def revoke(args: argparse.Namespace) -> int:
    revoked = open_key_book().revoke(args.key)
    if not revoked:
        print(f"error: no live key with id or name {args.key!r}; see `ember keys list`", file=sys.stderr)
        return 1
    for key in revoked:
        print(f"revoked key {key['id']} ({key['name']})")
    return 0
