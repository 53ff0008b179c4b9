"""`ember deploy`: build an app's package and hand it to the running gateway (through S3 for the AWS backend)."""
import argparse
import os
import sys
import threading
from pathlib import Path

from ember.cli.admin import admin_client
from ember.home import Home


def add_to(sub, epilog: str) -> None:
    p = sub.add_parser("deploy", help="package APP.py and deploy it to the running gateway",
                       description="Build APP.py's package and hand it to the gateway (EMBER_URL and EMBER_KEY, else "
                                   "the one `ember serve` runs here). With --target aws the package goes to "
                                   "EMBER_AWS_BUCKET first and the gateway fetches it from there. The new version "
                                   "takes calls only once one replica of each function started; if one fails, the "
                                   "version live before keeps serving and the error is printed.")
    p.add_argument("app", nargs="?", help="the app file")
    p.add_argument("--rollback", metavar="APP", help="go back to an earlier version of the deployed app APP (the one "
                                                     "live before the current one, or --to VERSION)")
    p.add_argument("--to", type=int, metavar="VERSION", help="with --rollback: the version (`ember apps history APP`)")
    p.add_argument("--target", choices=["local", "aws"], default="local",
                   help="local: the gateway reads the package from this machine; aws: upload it to S3 for the gateway "
                        "(default local)")
    p.set_defaults(run=deploy)


def deploy(args: argparse.Namespace) -> int:
    if (args.app is None) == (args.rollback is None):
        raise ValueError("give the app file (`ember deploy APP.py`) or --rollback APP, not both")
    if args.to is not None and args.rollback is None:
        raise ValueError("--to VERSION goes with --rollback APP")
    if args.rollback is not None:
        return rollback(args.rollback, args.to)
    from ember.package import build, load_app

    home = Home()
    package = build(load_app(args.app), home)
    with admin_client() as client:  # first: a missing EMBER_URL or EMBER_KEY stops the deploy before an upload
        if args.target == "local":  # the gateway here then finds the requirements installed, and the user saw it
            from ember.runtime.environments import ensure_for_package

            ensure_for_package(package, lambda line: print(f"  {line}", file=sys.stderr, flush=True), home)
        request = _upload(package) if args.target == "aws" else {"package": str(package)}
        reply = client.request("POST", "/admin/deploy", json=request).json()
    print(f"deployed app {reply['app']!r} version {reply['version']} ({', '.join(reply['functions'])}) from "
          f"{request.get('package_url', package)}")
    return 0


def rollback(app: str, to: int | None) -> int:
    from ember.gateway.routing import APP_NAME

    if not APP_NAME.fullmatch(app):
        raise ValueError(f"--rollback takes an app name (`ember apps list`), matching {APP_NAME.pattern}; got {app!r}")
    with admin_client() as client:
        reply = client.request("POST", f"/admin/apps/{app}/rollback", json={"version": to}).json()
    print(f"rolled app {reply['app']!r} back: version {reply['version']} ({', '.join(reply['functions'])}) now serves")
    return 0


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
    """Put the package in EMBER_AWS_BUCKET (not again when that hash is there): the body of the gateway's deploy
    call."""
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    from ember.runtime.aws import upload_package

    bucket = os.environ.get("EMBER_AWS_BUCKET")
    if not bucket:
        raise RuntimeError("--target aws needs EMBER_AWS_BUCKET: the bucket the gateway's AWS backend uses "
                           "(terraform output `bucket`)")
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
