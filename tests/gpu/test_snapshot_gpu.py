"""The snapshot loader on a real GPU: pinned ring, CUDA streams, checksums before copies."""
import pytest
import torch

from ember.snapshot import LocalStore, SnapshotCorrupt, capture, load, restore_into

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def tiny_qwen3() -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    config = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=512)
    return Qwen3ForCausalLM(config).to(torch.bfloat16)


def test_restore_into_cuda_module_is_bit_identical(tmp_path):
    store = LocalStore(tmp_path)
    source_model = tiny_qwen3()
    capture(source_model, store, "qwen3", chunk_size=64 << 10)
    target = tiny_qwen3().cuda()
    for p in target.parameters():
        p.data.zero_()
    report = restore_into(target, store, "qwen3", device="cuda", threads=4)
    assert report.device.startswith("cuda") and report.chunks > 4
    expected = source_model.state_dict()
    for name, t in target.state_dict().items():
        assert t.is_cuda and torch.equal(t.cpu(), expected[name]), name


def test_load_allocates_on_cuda_across_dtypes(tmp_path):
    store = LocalStore(tmp_path)
    state = {
        "f32": torch.randn(300, 301),
        "bf16": torch.randn(4097).bfloat16(),
        "i8": torch.randint(-9, 9, (70000,), dtype=torch.int8),
        "mask": torch.rand(999) > 0.5,
        "scalar": torch.tensor(3.5, dtype=torch.float16),
    }
    capture(state, store, "mixed", chunk_size=16 << 10)
    tensors, _ = load(store.open("mixed"), device="cuda", threads=3)
    for name, t in state.items():
        assert tensors[name].is_cuda and torch.equal(tensors[name].cpu(), t), name


def test_flipped_byte_is_caught_before_the_model_is_served(tmp_path):
    store = LocalStore(tmp_path)
    capture(tiny_qwen3(), store, "qwen3", chunk_size=64 << 10)
    path = next(store.objects.glob("*.ember"))
    header = store.open("qwen3").header
    with open(path, "r+b") as f:
        f.seek(header.data_offset + header.data_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(SnapshotCorrupt):
        restore_into(tiny_qwen3().cuda(), store, "qwen3", device="cuda")
    assert list(store.quarantined.glob("*.ember")) and restore_into(tiny_qwen3().cuda(), store, "qwen3") is None


def _random_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {f"w{i}": torch.randn(1000 + 37 * i, 1024, generator=g).bfloat16() for i in range(16)}


def _evict(path) -> None:
    import os
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def test_warm_and_cold_loads_are_bit_identical(tmp_path):
    store = LocalStore(tmp_path)
    state = _random_state()
    capture(state, store, "state", chunk_size=1 << 20)
    path = next(store.objects.glob("*.ember"))
    targets = {k: torch.zeros_like(v, device="cuda") for k, v in state.items()}
    for warm in (True, False):
        if warm:
            path.read_bytes()
        else:
            _evict(path)  # chunks come from disk with O_DIRECT
        for t in targets.values():
            t.zero_()
        source = store.open("state")
        _, report = load(source, targets, threads=4)
        source.close()
        assert report.chunks > 16
        assert all(torch.equal(targets[k].cpu(), v) for k, v in state.items()), f"warm={warm}"


def test_host_buffer_is_pinned_until_closed():
    import ctypes

    from ember.snapshot import cudart
    from ember.snapshot.hostbuffer import HUGE, HostBuffer
    lib = cudart.runtime()
    assert lib is not None, "torch's libcudart was not found in /proc/self/maps"
    lib.cudaHostGetFlags.argtypes = [ctypes.POINTER(ctypes.c_uint), ctypes.c_void_p]
    buf = HostBuffer(3 << 20, lib)
    flags = ctypes.c_uint()
    assert buf.address % HUGE == 0 and buf.tensor.numel() == 3 << 20
    assert lib.cudaHostGetFlags(ctypes.byref(flags), buf.address) == 0  # registered with CUDA
    buf.tensor.copy_(torch.arange(3 << 20, dtype=torch.int64).to(torch.uint8))
    on_gpu = buf.tensor.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(on_gpu.cpu(), buf.tensor)
    address = buf.address
    buf.close()
    assert lib.cudaHostGetFlags(ctypes.byref(flags), address) != 0  # unregistered
    lib.cudaGetLastError()
