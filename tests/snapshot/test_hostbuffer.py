"""Load buffers of huge-page-backed host memory (pinning them needs a GPU: tests/gpu/test_snapshot_gpu.py)."""
import os

import torch

from ember.snapshot.hostbuffer import HUGE, HostBuffer


def test_buffer_is_huge_page_aligned_and_holds_what_is_written():
    buf = HostBuffer(3 * HUGE + 4096)
    try:
        assert buf.address % HUGE == 0
        assert buf.tensor.numel() == 3 * HUGE + 4096 and buf.size == 4 * HUGE
        data = torch.randint(0, 256, (buf.tensor.numel(),), dtype=torch.uint8)
        buf.tensor.copy_(data)
        assert torch.equal(buf.tensor, data)
    finally:
        buf.close()
    buf.close()  # twice is harmless


def test_direct_io_reads_into_it(tmp_path):
    path = tmp_path / "blob"
    payload = os.urandom(2 * HUGE)
    path.write_bytes(payload)
    buf = HostBuffer(2 * HUGE)
    try:
        flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
        try:
            fd = os.open(path, flags)
        except OSError:  # a filesystem without O_DIRECT (tmpfs): the alignment is still what it needs
            fd = os.open(path, os.O_RDONLY)
        try:
            got = os.preadv(fd, [memoryview(buf.tensor.numpy())], 0)
        except OSError:
            os.close(fd)
            fd = os.open(path, os.O_RDONLY)
            got = os.preadv(fd, [memoryview(buf.tensor.numpy())], 0)
        os.close(fd)
        assert got == len(payload) and bytes(buf.tensor.numpy()) == payload
    finally:
        buf.close()


def test_load_falls_back_to_torch_memory_when_huge_page_buffers_cannot_be_mapped(tmp_path, monkeypatch):
    from ember.snapshot import LocalStore, capture, load, loader

    def refuse(*args, **kwargs):
        raise MemoryError("no address space left (simulated)")

    monkeypatch.setattr(loader, "HostBuffer", refuse)
    state = {f"w{i}": torch.randn(300 + i, 257) for i in range(6)}
    store = LocalStore(tmp_path)
    capture(state, store, "s", chunk_size=64 << 10)
    source = store.open("s")
    tensors, report = load(source, threads=3)
    source.close()
    assert report.chunks > 6
    assert all(torch.equal(tensors[k], v) for k, v in state.items())


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_every_slice_of_a_large_buffer_is_faulted_in_when_made(monkeypatch):
    """The pages are touched at allocation (in slices across threads), not during the first read or copy: the
    process holds the whole buffer as soon as it exists, odd sizes and a slice smaller than the rest included."""
    from ember.snapshot import hostbuffer

    monkeypatch.setattr(hostbuffer, "TOUCH_SLICE", 4 * HUGE)
    for nbytes in (13 * HUGE + 4096, 64 * HUGE):
        before = _rss()
        buf = HostBuffer(nbytes)
        try:
            assert _rss() - before >= buf.size - HUGE
            assert int(buf.tensor.count_nonzero()) == 0
        finally:
            buf.close()


def test_touch_writes_zeros_over_exactly_its_range(monkeypatch):
    import ctypes

    from ember.snapshot import hostbuffer

    monkeypatch.setattr(hostbuffer, "TOUCH_SLICE", 4 * HUGE)   # slices of different lengths, one thread each
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    block = (ctypes.c_uint8 * (40 * HUGE))()
    ctypes.memset(block, 7, len(block))
    start = ctypes.addressof(block) + HUGE
    hostbuffer.touch(start, 37 * HUGE + 100)
    data = bytes(block)
    assert set(data[:HUGE]) == {7} and set(data[HUGE:38 * HUGE + 100]) == {0} and set(data[38 * HUGE + 100:]) == {7}
