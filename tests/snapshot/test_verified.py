"""Verified marks: a local snapshot checked since it last changed is read from the page cache without checksums;
any change to the file, a read from the disk, another boot or EMBER_SNAPSHOT_VERIFY=always checks every chunk."""
import os
import time

import pytest

from ember.snapshot import LocalStore, SnapshotCorrupt, capture, load
from ember.snapshot.store import SETTLED_NS, staging_path
from ember.snapshot.writer import write_state_dict

from .conftest import assert_same


def flip(path, offset: int, bit: int = 1) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ bit]))


def test_a_snapshot_written_here_is_trusted_from_the_page_cache_and_a_later_change_is_caught(mixed_state):
    store = LocalStore()
    capture(mixed_state, store, "mixed", chunk_size=4096)
    tensors, report = load(store.open("mixed"), threads=3)
    assert report.trusted == report.chunks > 1
    assert_same(tensors, mixed_state)
    source = store.open("mixed")
    flip(source.path, source.header.data_offset + source.header.tensors[3].offset + 100)  # at once: the same tick
    with pytest.raises(SnapshotCorrupt, match="fails its checksum"):
        load(store.open("mixed"), threads=3)


def test_writing_the_same_bytes_back_still_ends_the_trust(mixed_state):
    store = LocalStore()
    capture(mixed_state, store, "mixed", chunk_size=4096)
    source = store.open("mixed")
    at = source.header.data_offset + 10
    flip(source.path, at)
    flip(source.path, at)  # the content is as written, but the file was changed
    tensors, report = load(store.open("mixed"), threads=2)
    assert report.trusted == 0
    assert_same(tensors, mixed_state)


def test_a_file_put_without_its_digests_is_checked_once_then_trusted(mixed_state):
    store = LocalStore()
    path = staging_path()
    write_state_dict(mixed_state, path, chunk_size=4096)
    store.put(path, "copied")  # as if it came from elsewhere: nothing vouches for its bytes yet
    assert load(store.open("copied"), threads=2)[1].trusted == 0
    time.sleep(SETTLED_NS / 1e9)  # a file changed moments before a load is not marked by it
    assert load(store.open("copied"), threads=2)[1].trusted == 0
    tensors, report = load(store.open("copied"), threads=2)
    assert report.trusted == report.chunks
    assert_same(tensors, mixed_state)


def test_ember_snapshot_verify_always_checks_every_chunk(mixed_state, monkeypatch):
    store = LocalStore()
    capture(mixed_state, store, "mixed", chunk_size=4096)
    monkeypatch.setenv("EMBER_SNAPSHOT_VERIFY", "always")
    assert load(store.open("mixed"))[1].trusted == 0


def test_a_mark_from_another_boot_is_not_trusted(mixed_state):
    store = LocalStore()
    ref = capture(mixed_state, store, "mixed", chunk_size=4096)
    mark = store.root / "verified" / ref.id
    boot, rest = mark.read_text().split(" ", 1)
    mark.write_text("0" * len(boot) + " " + rest)  # the page cache of that boot is gone
    assert load(store.open("mixed"))[1].trusted == 0
    report = load(store.open("mixed"))[1]
    assert report.trusted == report.chunks  # that full check marked it for this boot


def test_chunks_read_from_the_disk_are_checked_even_when_the_file_is_marked(mixed_state):
    store = LocalStore()
    capture(mixed_state, store, "mixed", chunk_size=4096)
    source = store.open("mixed")
    os.fsync(source.fd)  # dirty pages cannot be dropped
    os.posix_fadvise(source.fd, 0, 0, os.POSIX_FADV_DONTNEED)
    if source.direct_fd is None or any(source.trusts(i) for i in range(len(source.header.chunks))):
        pytest.skip("this filesystem keeps the file in memory (tmpfs): no read comes from a disk")
    assert source.verified  # the mark holds; the bytes are just not in memory
    tensors, report = load(source, threads=2)  # O_DIRECT: the page cache stays empty
    assert report.trusted == 0
    assert_same(tensors, mixed_state)
    with open(source.path, "rb") as f:  # the file back in the page cache
        f.read()
    report = load(store.open("mixed"), threads=2)[1]
    assert report.trusted == report.chunks


def test_rm_and_quarantine_drop_the_mark(mixed_state):
    store = LocalStore()
    ref = capture(mixed_state, store, "mixed", chunk_size=4096)
    assert (store.root / "verified" / ref.id).exists()
    store.quarantine(ref.id, "test")
    assert not (store.root / "verified" / ref.id).exists()
    ref = capture(mixed_state, store, "again", chunk_size=4096)
    store.rm("again")
    assert not (store.root / "verified" / ref.id).exists()


def test_a_mark_that_cannot_be_written_only_means_the_next_load_checks(mixed_state):
    store = LocalStore()
    store.marks.folder.write_text("not a folder")  # every mark write now fails
    capture(mixed_state, store, "mixed", chunk_size=4096)
    for _ in range(2):
        tensors, report = load(store.open("mixed"), threads=2)
        assert report.trusted == 0
        assert_same(tensors, mixed_state)
    store.rm("mixed")


def test_a_garbled_mark_is_no_mark(mixed_state):
    store = LocalStore()
    ref = capture(mixed_state, store, "mixed", chunk_size=4096)
    (store.marks.folder / ref.id).write_bytes(b"\xff\xfe\x00garbage")
    tensors, report = load(store.open("mixed"), threads=2)
    assert report.trusted == 0
    assert_same(tensors, mixed_state)
