"""The S3 store: multipart upload in, parallel ranged GETs out, streamed straight into the loader's buffers.

Layout under s3://bucket/prefix: objects/<id>.ember, refs/<name> (body: the id),
quarantine/<id>.ember (+ .reason).
"""
import os
import time
from collections.abc import Callable

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from ember.snapshot.errors import SnapshotCorrupt, SnapshotError, SnapshotNotFound
from ember.snapshot.format import PREAMBLE, decode, parse_preamble
from ember.snapshot.store import SnapshotRef, check_name, pick, read_header

ATTEMPTS = 4
HEAD_GUESS = 256 << 10  # one GET usually brings the whole header


def client(max_connections: int = 32):
    """An S3 client with retries; AWS_ENDPOINT_URL (e.g. a local emulator) is honoured by boto3 itself."""
    return boto3.client("s3", config=Config(retries={"max_attempts": 8, "mode": "adaptive"},
                                            max_pool_connections=max_connections))


class S3Source:
    """Reads one snapshot object with a ranged GET per chunk; no temporary file."""

    direct_io = False
    default_threads = 16

    def __init__(self, s3, bucket: str, key: str, snapshot_id: str):
        self.s3, self.bucket, self.key, self.id = s3, bucket, key, snapshot_id
        self.url = f"s3://{bucket}/{key}"
        size = s3.head_object(Bucket=bucket, Key=key)["ContentLength"]
        if size < PREAMBLE:
            raise SnapshotCorrupt(snapshot_id, f"truncated: {size} bytes")
        head = self._get(0, min(size, HEAD_GUESS))
        length = parse_preamble(head, snapshot_id)
        if PREAMBLE + length > size:
            raise SnapshotCorrupt(snapshot_id, "truncated inside the header")
        if PREAMBLE + length > len(head):
            head += self._get(len(head), PREAMBLE + length)
        self.header = decode(head[PREAMBLE:PREAMBLE + length], snapshot_id)
        if size < self.header.file_size:
            raise SnapshotCorrupt(snapshot_id, f"truncated: {size} of {self.header.file_size} bytes")

    def _get(self, start: int, end: int) -> bytes:
        into = bytearray(end - start)
        self._ranged(start, end, memoryview(into))
        return bytes(into)

    def _ranged(self, start: int, end: int, into: memoryview) -> None:
        """GETs bytes [start, end) straight into `into`, retrying a dropped, short or stalled stream."""
        for attempt in range(ATTEMPTS):
            try:
                body = self.s3.get_object(Bucket=self.bucket, Key=self.key, Range=f"bytes={start}-{end - 1}")["Body"]
                at = 0
                for piece in body.iter_chunks(1 << 20):
                    if at + len(piece) > end - start:
                        break
                    into[at:at + len(piece)] = piece
                    at += len(piece)
                if at == end - start:
                    return
                problem: object = f"got {at} bytes, expected {end - start}"
            except (BotoCoreError, ConnectionError) as err:  # dropped connection, cut-off body, timeout
                problem = err
            if attempt == ATTEMPTS - 1:
                raise SnapshotError(f"{self.url}: bytes {start}-{end - 1} unreadable after {ATTEMPTS} tries: {problem}")
            time.sleep(0.2 * 2 ** attempt)

    def read_chunk(self, index: int, into: memoryview, each_piece: Callable[[memoryview], None] | None = None) -> int:
        start, end = self.header.chunk_span(index)
        self._ranged(start + self.header.data_offset, end + self.header.data_offset, into[:end - start])
        if each_piece is not None:
            each_piece(into[:end - start])
        return end - start

    def trusts(self, index: int) -> bool:
        return False  # every byte comes over the network

    def mark_verified(self) -> None:
        pass

    def close(self) -> None:
        pass


class S3Store:
    def __init__(self, bucket: str, prefix: str = "", s3=None, part_size: int = 64 << 20, concurrency: int = 16):
        self.s3 = s3 or client(concurrency * 2)
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self.transfer = TransferConfig(multipart_threshold=part_size, multipart_chunksize=part_size,
                                       max_concurrency=concurrency)

    def _key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def _object(self, snapshot_id: str) -> str:
        return self._key("objects", f"{snapshot_id}.ember")

    def _list(self, folder: str) -> list[dict]:
        pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self._key(folder) + "/")
        return [o for page in pages for o in page.get("Contents", [])]

    def _names(self) -> dict[str, str]:
        return {o["Key"].rsplit("/", 1)[1]: self.s3.get_object(Bucket=self.bucket, Key=o["Key"])["Body"].read().decode()
                for o in self._list("refs")}

    def _ids(self) -> list[str]:
        return [o["Key"].rsplit("/", 1)[1].removesuffix(".ember") for o in self._list("objects")]

    def put(self, path: str | os.PathLike, name: str | None = None, digested: bool = False) -> SnapshotRef:
        """Uploads a written snapshot file (multipart, parallel parts), names it, then deletes the local file.
        `digested` changes nothing here: every read from S3 is checked."""
        if name:
            check_name(name)
        header = read_header(path)
        self.s3.upload_file(str(path), self.bucket, self._object(header.id), Config=self.transfer)
        if name:
            self.s3.put_object(Bucket=self.bucket, Key=self._key("refs", name), Body=header.id.encode())
        os.remove(path)
        return self._ref(header.id)

    def put_blob(self, name: str, data: bytes) -> None:
        """Keeps a small file beside the snapshots (a GPU memory image, compiled kernels) under `name`."""
        self.s3.put_object(Bucket=self.bucket, Key=self._key("blobs", check_name(name)), Body=data)

    def get_blob(self, name: str) -> bytes | None:
        try:
            return self.s3.get_object(Bucket=self.bucket, Key=self._key("blobs", check_name(name)))["Body"].read()
        except ClientError as err:
            if err.response["Error"]["Code"] in ("NoSuchKey", "404"):
                return None
            raise

    def resolve(self, key: str) -> str:
        try:
            snapshot_id = self.s3.get_object(Bucket=self.bucket, Key=self._key("refs", key))["Body"].read().decode()
            return snapshot_id
        except ClientError as err:
            if err.response["Error"]["Code"] not in ("NoSuchKey", "404"):
                raise
        return pick(key, self._ids(), self.url)

    def open(self, key: str) -> S3Source:
        snapshot_id = self.resolve(key)
        try:
            return S3Source(self.s3, self.bucket, self._object(snapshot_id), snapshot_id)
        except ClientError as err:
            if err.response["Error"]["Code"] in ("NoSuchKey", "404"):
                raise SnapshotNotFound(key, self.url) from None
            raise

    def _ref(self, snapshot_id: str, names: dict[str, str] | None = None) -> SnapshotRef:
        key = self._object(snapshot_id)
        size = self.s3.head_object(Bucket=self.bucket, Key=key)
        tensors, problem = -1, None
        try:
            tensors = len(S3Source(self.s3, self.bucket, key, snapshot_id).header.tensors)
        except SnapshotCorrupt as err:
            problem = err.reason
        except SnapshotError as err:
            problem = str(err)
        names = self._names() if names is None else names
        return SnapshotRef(snapshot_id, tuple(sorted(n for n, i in names.items() if i == snapshot_id)),
                           size["ContentLength"], tensors, size["LastModified"].timestamp(), self.url, problem)

    def ls(self) -> list[SnapshotRef]:
        names = self._names()
        return sorted((self._ref(i, names) for i in self._ids()), key=lambda r: r.created)

    def rm(self, key: str) -> SnapshotRef:
        ref = self._ref(self.resolve(key))
        for name in ref.names:
            self.s3.delete_object(Bucket=self.bucket, Key=self._key("refs", name))
        self.s3.delete_object(Bucket=self.bucket, Key=self._object(ref.id))
        return ref

    def quarantine(self, snapshot_id: str, reason: str) -> str:
        for name, target in self._names().items():
            if target == snapshot_id:
                self.s3.delete_object(Bucket=self.bucket, Key=self._key("refs", name))
        dest = self._key("quarantine", f"{snapshot_id}.{int(time.time())}.ember")
        self.s3.copy({"Bucket": self.bucket, "Key": self._object(snapshot_id)}, self.bucket, dest, Config=self.transfer)
        self.s3.delete_object(Bucket=self.bucket, Key=self._object(snapshot_id))
        self.s3.put_object(Bucket=self.bucket, Key=dest.removesuffix(".ember") + ".reason", Body=reason.encode())
        return f"s3://{self.bucket}/{dest}"
