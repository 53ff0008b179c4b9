"""The S3 store against a real AWS API emulator process (moto_server): multipart up, ranged GETs down."""
import uuid

import boto3
import pytest
import torch

from ember.snapshot import SnapshotCorrupt, capture, load, open_store, restore_into
from ember.snapshot.s3 import S3Store

from .conftest import assert_same, tiny_qwen3

PART = 5 << 20  # the smallest part S3 (and moto) accepts


@pytest.fixture
def bucket(s3_env):
    name = f"ember-{uuid.uuid4().hex[:8]}"
    boto3.client("s3").create_bucket(Bucket=name)
    return name


def big_state() -> dict[str, torch.Tensor]:
    """~12 MiB, so a 5 MiB part size gives a real three-part upload."""
    g = torch.Generator().manual_seed(2)
    return {"embed": torch.randn(1024, 2048, generator=g), "norm": torch.randn(2048, generator=g).bfloat16(),
            "head": torch.randn(512, 2048, generator=g).half(), "mask": torch.rand(333, generator=g) > 0.5}


def test_multipart_upload_and_ranged_parallel_load_round_trip(bucket, mixed_state):
    store = S3Store(bucket, "team/snaps", part_size=PART)
    state = {**big_state(), **mixed_state}
    ref = capture(state, store, "big", chunk_size=1 << 20)
    key = f"team/snaps/objects/{ref.id}.ember"
    etag = boto3.client("s3").head_object(Bucket=bucket, Key=key)["ETag"]
    assert etag.strip('"').endswith("-3"), etag  # three parts, so the multipart path really ran
    source = store.open("big")
    assert source.url == f"s3://{bucket}/{key}"
    tensors, report = load(source, threads=6)
    assert_same(tensors, state)
    assert report.chunks == len(source.header.chunks) > 10 and not report.direct_io


def test_restore_a_real_model_through_s3(bucket):
    store = open_store(f"s3://{bucket}/p")
    torch.manual_seed(0)
    original = tiny_qwen3()
    capture(original, store, "qwen3", chunk_size=16 << 10)
    fresh = tiny_qwen3()
    assert restore_into(fresh, store, "qwen3").bytes > 0
    for name, t in original.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], t), name


def test_ls_resolve_and_rm(bucket):
    store = S3Store(bucket, "x", part_size=PART)
    a = capture({"w": torch.ones(10)}, store, "a")
    capture({"w": torch.ones(10)}, store, "b")
    [only] = store.ls()
    assert only.id == a.id and only.names == ("a", "b") and only.tensors == 1
    assert store.resolve(a.id[:8]) == a.id
    store.rm("a")
    assert store.ls() == [] and restore_into({"w": torch.zeros(10)}, store, "b") is None


def corrupt_object(bucket: str, key: str, edit) -> None:
    s3 = boto3.client("s3")
    body = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(edit(body)))


def test_flipped_byte_in_the_object_is_caught_and_quarantined(bucket):
    store = S3Store(bucket, "c", part_size=PART)
    ref = capture(big_state(), store, "m", chunk_size=1 << 20)
    key = f"c/objects/{ref.id}.ember"

    def flip(body: bytearray) -> bytearray:
        body[len(body) // 2] ^= 0x10
        return body

    corrupt_object(bucket, key, flip)
    targets = {k: torch.empty_like(v) for k, v in big_state().items()}
    with pytest.raises(SnapshotCorrupt, match="checksum"):
        restore_into(targets, store, "m")
    listed = boto3.client("s3").list_objects_v2(Bucket=bucket, Prefix="c/quarantine/")["Contents"]
    assert {o["Key"].rsplit(".", 1)[1] for o in listed} == {"ember", "reason"}
    assert restore_into(targets, store, "m") is None


def test_truncated_object_is_caught_before_loading(bucket):
    store = S3Store(bucket, "t", part_size=PART)
    ref = capture(big_state(), store, "m", chunk_size=1 << 20)
    corrupt_object(bucket, f"t/objects/{ref.id}.ember", lambda body: body[: len(body) - 8192])
    with pytest.raises(SnapshotCorrupt, match="truncated"):
        restore_into({k: torch.empty_like(v) for k, v in big_state().items()}, store, "m")
    assert store.ls() == []


class DroppingProxy:
    """An HTTP proxy to the emulator that cuts off the body of the first `drops` ranged GETs mid-stream."""

    def __init__(self, upstream: str, drops: int):
        import socketserver
        import threading
        from http.client import HTTPConnection
        from urllib.parse import urlparse

        host, port = urlparse(upstream).hostname, urlparse(upstream).port
        proxy = self
        self.drops, self.dropped = drops, 0

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                head = b""
                while not head.endswith(b"\r\n\r\n"):
                    line = self.rfile.readline()
                    if not line:
                        return
                    head += line
                method, path, _ = head.split(b"\r\n", 1)[0].decode().split(" ")
                headers = dict(line.split(": ", 1) for line in head.decode().split("\r\n")[1:] if ": " in line)
                up = HTTPConnection(host, port)
                up.request(method, path, headers=headers)
                reply = up.getresponse()
                body = reply.read()
                cut = "Range" in headers and proxy.dropped < proxy.drops
                out = f"HTTP/1.1 {reply.status} {reply.reason}\r\n"
                for k, v in reply.getheaders():
                    if k.lower() not in ("connection", "transfer-encoding", "content-length"):
                        out += f"{k}: {v}\r\n"
                length = reply.getheader("Content-Length") if method == "HEAD" else len(body)
                out += f"Content-Length: {length}\r\nConnection: close\r\n\r\n"
                self.wfile.write(out.encode() + (body[: len(body) // 2] if cut else body))
                if cut:
                    proxy.dropped += 1

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_connection_dropped_mid_chunk_is_retried(bucket, s3_endpoint):
    state = big_state()
    ref = capture(state, S3Store(bucket, "r", part_size=PART), "m", chunk_size=1 << 20)
    proxy = DroppingProxy(s3_endpoint, drops=3)
    try:
        store = S3Store(bucket, "r", s3=boto3.client("s3", endpoint_url=proxy.url))
        source = store.open(ref.id)
        tensors, _ = load(source, threads=2)
    finally:
        proxy.close()
    assert proxy.dropped == 3
    assert_same(tensors, state)


def test_an_unreachable_store_falls_back_to_a_full_boot(s3_env):
    """A bucket that is not there (or a store that cannot be reached) must not fail a replica's start."""
    from ember.snapshot import restore_or_boot

    torch.manual_seed(0)
    reference = tiny_qwen3()
    store = S3Store(f"missing-{uuid.uuid4().hex[:8]}", "snaps", part_size=PART)
    model, start = restore_or_boot(tiny_qwen3, lambda m: m.load_state_dict(reference.state_dict()), store, "qwen3")
    assert start.source == "full" and start.captured is None  # nothing could be written either
    assert "NoSuchBucket" in start.fallback_reason or "ClientError" in start.fallback_reason, start.fallback_reason
    for name, t in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], t), name


def test_blobs_round_trip_through_s3(bucket):
    store = S3Store(bucket, "team/a")
    assert store.get_blob("image.json") is None
    store.put_blob("image.json", b'{"regions": []}')
    assert store.get_blob("image.json") == b'{"regions": []}'
    assert boto3.client("s3").head_object(Bucket=bucket, Key="team/a/blobs/image.json")["ContentLength"] == 15
