"""The AWS pieces a node agent shares with the gateway and `ember deploy --target aws`: DynamoDB scans, and app
packages in S3, stored content-addressed at packages/<sha256>.pkg and checked against that hash when fetched."""
import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from botocore.exceptions import ClientError

MISSING = ("404", "NoSuchKey", "NoSuchBucket")  # S3 error codes for an object or bucket that is not there


class PackageMissing(LookupError):
    pass


class PackageMismatch(ValueError):
    pass


def scan(table, **kwargs) -> list[dict]:
    items: list[dict] = []
    start: dict[str, Any] = {}  # the next page's ExclusiveStartKey, once there is one
    while True:
        page = table.scan(**kwargs, **start)
        items += page["Items"]
        if "LastEvaluatedKey" not in page:
            return items
        start = {"ExclusiveStartKey": page["LastEvaluatedKey"]}


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def upload_package(s3, bucket: str, path: Path, progress: Callable[[int], None] | None = None) -> tuple[str, str, bool]:
    """Put the package at packages/<sha256>.pkg unless an object with that hash is there: (key, sha256, uploaded).

    `progress(n)` hears each n bytes sent (from boto3's transfer threads).
    """
    digest = sha256_file(path)
    key = f"packages/{digest}.pkg"
    try:
        if s3.head_object(Bucket=bucket, Key=key)["Metadata"].get("sha256") == digest:
            return key, digest, False
    except ClientError as exc:
        if exc.response["Error"]["Code"] not in MISSING + (
            "403",
        ):  # 403: a missing key, to a role without s3:ListBucket
            raise
    s3.upload_file(str(path), bucket, key, ExtraArgs={"Metadata": {"sha256": digest}}, Callback=progress)
    return key, digest, True


def download_package(s3, bucket: str, key: str, digest: str, into: Path) -> Path:
    """Fetch s3://bucket/key to `into`/<sha256>.pkg, checking its hash; a package already there is not fetched again."""
    path = into / f"{digest}.pkg"
    if path.exists():
        return path
    try:
        body = s3.get_object(Bucket=bucket, Key=key)["Body"]
    except ClientError as exc:
        if exc.response["Error"]["Code"] in MISSING:
            raise PackageMissing(f"no package at s3://{bucket}/{key} ({exc.response['Error']['Code']}): "
                                 "upload it with `ember deploy APP.py --target aws`") from None
        raise
    received = hashlib.sha256()
    fd, part = tempfile.mkstemp(dir=into, suffix=".part")  # one per fetch: two fetches of a package must not mix
    try:
        with os.fdopen(fd, "wb") as out:
            for block in body.iter_chunks(1 << 20):
                received.update(block)
                out.write(block)
        if received.hexdigest() != digest:
            raise PackageMismatch(f"s3://{bucket}/{key} has sha256 {received.hexdigest()}, not {digest}: "
                                  "the object changed or the hash is wrong; deploy the app again")
        os.replace(part, path)
    finally:
        if os.path.exists(part):
            os.unlink(part)
    return path
