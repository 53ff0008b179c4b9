"""The arena's CPU fallback: the calls the engine makes on a GPU, with plain torch tensors underneath."""
import pytest
import torch

from ember.runtime.engine.gpu_memory import ALIGN, Arena, tensor_bytes


def test_regions_hand_out_aligned_views_that_fill_them_exactly():
    shapes = [((3, 5), torch.float32), ((7,), torch.bfloat16), ((2, 2), torch.float16)]
    arena = Arena("cpu")
    region = arena.region("weights", tensor_bytes(shapes), keep=True)
    tensors = [region.take(shape, dtype) for shape, dtype in shapes]
    assert [t.data_ptr() % ALIGN for t in tensors] == [0, 0, 0]
    assert [(tuple(t.shape), t.dtype) for t in tensors] == [(s, d) for s, d in shapes]
    assert tensors[1].data_ptr() - tensors[0].data_ptr() == ALIGN
    with pytest.raises(ValueError, match="cannot hold"):
        region.take((1,), torch.float32)


def test_park_keeps_kept_regions_and_fills_discarded_ones_with_nan():
    arena = Arena("cpu")
    weights = arena.region("weights", 64, keep=True).take((16,), torch.float32)
    cache = arena.region("kv_cache", 64, keep=False).take((32,), torch.bfloat16)
    weights.copy_(torch.arange(16.0))
    cache.fill_(3)
    report = arena.park()
    assert arena.parked and report.released_bytes == 64 and report.host_copy_bytes == 0
    assert arena.park().released_bytes == 0  # parking twice is a no-op
    arena.wake()
    assert not arena.parked and torch.equal(weights, torch.arange(16.0)) and cache.isnan().all()


def test_region_names_are_unique_free_replaces_and_a_parked_arena_allocates_nothing():
    arena = Arena("cpu")
    arena.region("weights", 64, keep=True)
    with pytest.raises(ValueError, match="already has a region"):
        arena.region("weights", 64, keep=True)
    arena.free("weights")
    arena.region("weights", 128, keep=True)
    assert [r.nbytes for r in arena.regions] == [128]
    arena.park()
    with pytest.raises(RuntimeError, match="wake it"):
        arena.region("kv_cache", 64, keep=False)


def test_a_mapping_is_backed_in_pieces_and_releases_each_of_them():
    """A wake maps a kept region in pieces (gpu_memory.WAKE_PIECE): each piece is its own physical allocation,
    all of them released by one unmap, while the range and its array interface stay. The driver is a stand-in: the
    calls themselves run on a GPU (tests/gpu/test_park_gpu.py)."""
    from ember.runtime.engine.gpu_memory import _Mapping

    class Driver:
        def __init__(self):
            self.live, self.next = {}, 1

        def map(self, address, size):
            self.live[self.next] = (address, size)
            self.next += 1
            return self.next - 1

        def unmap(self, address, size, handle):
            assert self.live.pop(handle) == (address, size)

    driver = Driver()
    mapping = _Mapping(driver, torch.device("cpu"), 1 << 30, 6 << 20)
    assert mapping.__cuda_array_interface__["data"] == (1 << 30, False)
    assert mapping.__cuda_array_interface__["shape"] == (6 << 20,)
    for at in range(0, 6 << 20, 2 << 20):
        mapping.map(at, 2 << 20)
    assert mapping.pieces == [((1 << 30) + (i << 21), 2 << 20, i + 1) for i in range(3)]
    assert sorted(driver.live.values()) == [((1 << 30) + (i << 21), 2 << 20) for i in range(3)]
    mapping.unmap()
    assert mapping.pieces is None and not driver.live
    mapping.map(0, 6 << 20)   # mapped whole again after a park
    assert mapping.pieces == [(1 << 30, 6 << 20, 4)]
    mapping.freed = True      # nothing to free on a CPU at exit
