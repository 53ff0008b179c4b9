"""The `ember` command: one module per command group, wired here.

    ember serve APP.py | ember deploy APP.py | ember run APP.py::fn | ember keys ... | ember status | ember logs
    ember apps list|history APP | ember deploy --rollback APP | ember secrets set|list|rm | ember limits get|set APP
    ember snapshot ...   (handed to ember.snapshot.cli)
"""
import argparse
import os
import sys

import httpx

from ember.cli import apps, deploy, keys, limits, run, secrets, serve, status

EPILOG = "EMBER_HOME (default ~/.ember) holds the key database, TLS material, packages and logs."
GROUPS = [
    serve,
    deploy,
    apps,
    run,
    keys,
    secrets,
    limits,
    status,
]  # each adds its commands with add_to(subparsers, epilog)


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="ember", epilog=EPILOG,
                                  description="Serverless inference: decorate a function, get an HTTPS endpoint.")
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in GROUPS:
        group.add_to(sub, EPILOG)
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
    except BrokenPipeError:  # the reader left (`ember status | head`): stop quietly, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
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
