"""The local content-addressed store, and how it handles corrupt and truncated snapshots."""
import os
from pathlib import Path

import pytest
import torch

from ember.snapshot import LocalStore, SnapshotCorrupt, SnapshotNotFound, capture, load, open_store


def test_store_lives_in_ember_home_and_addresses_content(ember_home, mixed_state):
    store = open_store("local")
    assert store.root == ember_home / "snapshots"
    first = capture(mixed_state, store, "a")
    again = capture(mixed_state, store, "b")
    assert first.id == again.id and len(store.ls()) == 1 and store.ls()[0].names == ("a", "b")
    other = capture({"x": torch.ones(3)}, store, "a")  # a name moves to new content
    assert store.resolve("a") == other.id and store.resolve("b") == first.id
    assert store.resolve(first.id[:8]) == first.id
    assert not list((store.root / "tmp").glob("*"))


def test_rm_by_name_or_id_and_unknown_keys(mixed_state):
    store = LocalStore()
    ref = capture(mixed_state, store, "m")
    with pytest.raises(SnapshotNotFound, match="ember snapshot build"):
        store.open("nope")
    assert store.rm("m").id == ref.id and store.ls() == []
    ref = capture(mixed_state, store, "m")
    store.rm(ref.id[:10])
    with pytest.raises(SnapshotNotFound):
        store.resolve("m")


def test_bad_names_are_refused(mixed_state):
    store = LocalStore()
    for bad in ("../escape", ".hidden", "a b", ""):
        with pytest.raises(ValueError, match="not allowed"):
            capture(mixed_state, store, bad or "/")
    assert store.ls() == []


def test_truncated_file_is_caught_at_open(mixed_state):
    store = LocalStore()
    ref = capture(mixed_state, store, "m")
    path = store.objects / f"{ref.id}.ember"
    os.truncate(path, path.stat().st_size - 4096)
    with pytest.raises(SnapshotCorrupt, match="truncated"):
        store.open("m")
    os.truncate(path, 10)
    with pytest.raises(SnapshotCorrupt, match="bad magic"):
        store.open("m")


def test_quarantine_moves_the_object_aside_and_drops_its_names(mixed_state):
    store = LocalStore()
    ref = capture(mixed_state, store, "m")
    dest = Path(store.quarantine(ref.id, "chunk 3 fails its checksum"))
    assert dest.exists() and "chunk 3" in dest.with_suffix(".reason").read_text()
    assert store.ls() == []
    with pytest.raises(SnapshotNotFound):
        store.open("m")


def test_page_cache_and_direct_reads_give_the_same_bytes(mixed_state):
    store = LocalStore()
    capture(mixed_state, store, "m", chunk_size=4096)
    source = store.open("m")
    warm, _ = load(source)
    os.posix_fadvise(source.fd, 0, 0, os.POSIX_FADV_DONTNEED)  # now every chunk goes the O_DIRECT way where allowed
    assert not source.cache.holds(source.header.data_offset, source.header.data_size) or not source.direct_io
    cold, _ = load(source)
    assert all(torch.equal(warm[k].reshape(-1).view(torch.uint8), cold[k].reshape(-1).view(torch.uint8)) for k in warm)


def test_blobs_beside_the_snapshots_round_trip_and_refuse_bad_names(ember_home):
    store = LocalStore()
    assert store.get_blob("kernels-x.tgz") is None
    store.put_blob("kernels-x.tgz", b"one")
    store.put_blob("kernels-x.tgz", b"two")  # replaced whole
    assert store.get_blob("kernels-x.tgz") == b"two"
    assert [p.name for p in (ember_home / "snapshots" / "blobs").iterdir()] == ["kernels-x.tgz"]
    with pytest.raises(ValueError, match="not allowed"):
        store.put_blob("../escape", b"x")
