"""What a replica with snapshot=True does: restore, or full boot then capture; corrupt snapshots fall back."""
import logging

import pytest
import torch

from ember.snapshot import LocalStore, SnapshotCorrupt, SnapshotMismatch, capture, restore_into

from .conftest import tiny_qwen3


def boot(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return tiny_qwen3()


def test_first_boot_captures_and_second_restores_every_weight_bit_identical():
    store = LocalStore()
    original = boot(0)
    assert restore_into(boot(1), store, "qwen3") is None  # no snapshot yet: the caller boots fully
    ref = capture(original, store, "qwen3", chunk_size=64 << 10)
    assert ref.names == ("qwen3",) and ref.tensors == len(original.state_dict())
    fresh = boot(1)
    report = restore_into(fresh, store, "qwen3", device="cpu", threads=3)
    assert report.chunks > 1 and report.bytes >= sum(t.nbytes for t in original.state_dict().values())
    for name, t in original.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], t), name
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(fresh(ids).logits, original(ids).logits)


def test_flipped_byte_is_reported_quarantined_and_the_next_start_boots_fully(caplog):
    store = LocalStore()
    ref = capture(boot(0), store, "qwen3", chunk_size=64 << 10)
    path = store.objects / f"{ref.id}.ember"
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size - 5000)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x80]))
    with caplog.at_level(logging.WARNING, "ember.snapshot"), pytest.raises(SnapshotCorrupt, match="quarantined"):
        restore_into(boot(1), store, "qwen3")
    assert "quarantined" in caplog.text
    assert list(store.quarantined.glob("*.ember")) and not path.exists()
    assert restore_into(boot(1), store, "qwen3") is None


def test_truncated_snapshot_is_quarantined_before_any_byte_is_copied():
    store = LocalStore()
    ref = capture(boot(0), store, "qwen3")
    path = store.objects / f"{ref.id}.ember"
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)
    model = boot(1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(SnapshotCorrupt, match="truncated"):
        restore_into(model, store, "qwen3")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert restore_into(boot(1), store, "qwen3") is None


def test_snapshot_of_another_model_is_a_mismatch_not_corruption():
    store = LocalStore()
    capture({"only": torch.ones(3)}, store, "qwen3")
    with pytest.raises(SnapshotMismatch, match="rebuild the snapshot"):
        restore_into(boot(1), store, "qwen3")
    assert store.resolve("qwen3")  # intact snapshots are not quarantined


def test_restore_refuses_a_module_on_another_device():
    store = LocalStore()
    capture(boot(0), store, "qwen3")
    with pytest.raises(ValueError, match="move the module first"):
        restore_into(boot(1), store, "qwen3", device="cuda")
