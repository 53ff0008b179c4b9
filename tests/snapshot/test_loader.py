"""The loader round trip on CPU: every byte back, whatever the chunking and thread count."""
import pytest
import torch

from ember.snapshot import LocalStore, SnapshotCorrupt, SnapshotMismatch, capture, load
from ember.snapshot.loader import audit, plan

from .conftest import assert_same


@pytest.mark.parametrize("chunk_size,threads", [(4096, 1), (3 * 4096, 3), (1 << 20, 8)])
def test_every_dtype_round_trips_bit_identical(mixed_state, chunk_size, threads):
    store = LocalStore()
    capture(mixed_state, store, "mixed", chunk_size=chunk_size)
    source = store.open("mixed")
    assert source.header.chunk_size == chunk_size
    tensors, report = load(source, threads=threads)
    assert_same(tensors, mixed_state)
    assert report.bytes == source.header.data_size and report.chunks == len(source.header.chunks)
    assert set(report.phases) >= {"read", "verify", "copy", "pin"} and report.gbps > 0


def test_plan_covers_every_byte_of_every_tensor_once(mixed_state):
    store = LocalStore()
    capture(mixed_state, store, "mixed", chunk_size=4096)
    header = store.open("mixed").header
    covered = {t.name: 0 for t in header.tensors}
    for pieces in plan(header):
        for name, a, b, _ in pieces:
            covered[name] += b - a
    assert covered == {t.name: t.nbytes for t in header.tensors}


def test_loads_into_preallocated_targets_in_place_and_reports_progress(mixed_state):
    store = LocalStore()
    capture(mixed_state, store, "mixed", chunk_size=8192)
    targets = {k: torch.empty_like(v) for k, v in mixed_state.items()}
    before = {k: v.data_ptr() for k, v in targets.items()}
    seen = []
    tensors, _ = load(store.open("mixed"), targets, threads=2, progress=lambda done, total: seen.append((done, total)))
    assert {k: v.data_ptr() for k, v in tensors.items()} == before
    assert_same(targets, mixed_state)
    assert seen[-1][0] == seen[-1][1] and [d for d, _ in seen] == sorted(d for d, _ in seen)


def test_targets_that_do_not_match_are_refused_before_any_copy(mixed_state):
    store = LocalStore()
    capture(mixed_state, store, "mixed")
    targets = {k: torch.zeros_like(v) for k, v in mixed_state.items()}
    targets["f32"] = torch.zeros(301, 256)
    with pytest.raises(SnapshotMismatch, match="f32"):
        load(store.open("mixed"), targets)
    assert all(not t.any() for t in targets.values() if t.numel())


def test_flipped_byte_fails_both_the_load_check_and_the_sha256_audit(mixed_state):
    store = LocalStore()
    capture(mixed_state, store, "mixed", chunk_size=4096)
    source = store.open("mixed")
    with open(source.path, "r+b") as f:
        f.seek(source.header.data_offset + source.header.tensors[3].offset + 100)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(SnapshotCorrupt, match="fails its checksum"):
        load(store.open("mixed"), threads=4)
    with pytest.raises(SnapshotCorrupt, match="sha256"):
        audit(store.open("mixed"))


def test_ember_snapshot_threads_sets_the_reader_threads_and_a_bad_value_names_the_fix(mixed_state, monkeypatch):
    store = LocalStore()
    capture(mixed_state, store, "mixed", chunk_size=4096)
    monkeypatch.setenv("EMBER_SNAPSHOT_THREADS", "3")
    tensors, report = load(store.open("mixed"))
    assert report.threads == 3
    assert_same(tensors, mixed_state)
    assert load(store.open("mixed"), threads=2)[1].threads == 2  # an explicit count wins
    monkeypatch.setenv("EMBER_SNAPSHOT_THREADS", "many")
    with pytest.raises(ValueError, match="EMBER_SNAPSHOT_THREADS='many'"):
        load(store.open("mixed"))


def test_a_page_cache_read_is_checked_piece_by_piece_and_a_flip_in_any_piece_is_caught():
    from ember.snapshot.store import PIECE

    g = torch.Generator().manual_seed(2)
    state = {"big": torch.randint(0, 255, (5 * PIECE + 12345,), generator=g, dtype=torch.uint8),
             "small": torch.randn(1000, generator=g)}
    store = LocalStore()
    capture(state, store, "big", chunk_size=4 * PIECE)  # the first chunk is four pieces
    source = store.open("big")
    pieces: list[memoryview] = []
    buffer = memoryview(bytearray(source.header.chunk_size))
    n = source.read_chunk(0, buffer, pieces.append)
    assert [len(p) for p in pieces] == [PIECE] * 4 and n == 4 * PIECE  # /tmp has no O_DIRECT: the cached path
    assert b"".join(bytes(p) for p in pieces) == bytes(buffer[:n])
    assert_same(load(source, threads=2)[0], state)
    with open(source.path, "r+b") as f:  # one bit of the third piece
        f.seek(source.header.data_offset + 2 * PIECE + 777)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 4]))
    with pytest.raises(SnapshotCorrupt, match="chunk 0 .* fails its checksum"):
        load(store.open("big"), threads=2)


def test_a_load_hands_the_gil_over_quickly_while_it_runs_and_restores_the_interval_after(mixed_state):
    import sys
    import threading

    from ember.snapshot.loader import LOAD_SWITCH_INTERVAL

    store = LocalStore()
    capture(mixed_state, store, "mixed", chunk_size=4096)
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.004)
    try:
        seen: list[float] = []
        started, both_running = threading.Event(), threading.Barrier(2)

        def one_load(other: bool) -> None:
            def progress(done: int, total: int) -> None:
                seen.append(sys.getswitchinterval())
                started.set()
                if other and done == total:
                    both_running.wait(timeout=10)  # this load ends only after the main thread's has
            load(store.open("mixed"), threads=2, progress=progress)

        other = threading.Thread(target=one_load, args=(True,))
        other.start()
        assert started.wait(timeout=10)
        one_load(False)
        assert sys.getswitchinterval() == pytest.approx(LOAD_SWITCH_INTERVAL)  # the other load still runs
        both_running.wait(timeout=10)
        other.join()
        assert seen and all(s == pytest.approx(LOAD_SWITCH_INTERVAL) for s in seen)
        assert sys.getswitchinterval() == pytest.approx(0.004)
    finally:
        sys.setswitchinterval(before)
