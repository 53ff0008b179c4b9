"""What a replica with snapshot=True does: restore, or full boot then capture; corrupt snapshots fall back."""
import logging

import pytest
import torch

from ember.snapshot import LocalStore, SnapshotCorrupt, SnapshotMismatch, capture, restore_into, restore_or_boot

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


def test_restore_or_boot_boots_fully_once_then_starts_from_the_snapshot():
    store = LocalStore()
    reference = boot(0)
    full_boots = []

    def load_weights(model):
        full_boots.append(1)
        model.load_state_dict(reference.state_dict())

    model, start = restore_or_boot(lambda: boot(1), load_weights, store, "qwen3")
    assert start.source == "full" and start.captured.names == ("qwen3",) and start.fallback_reason is None
    model, start = restore_or_boot(lambda: boot(1), load_weights, store, "qwen3")
    assert start.source == "snapshot" and start.load.bytes > 0 and len(full_boots) == 1
    for name, t in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], t), name


def test_restore_or_boot_falls_back_on_a_corrupt_snapshot_with_a_fresh_model_and_rewrites_it():
    store = LocalStore()
    reference = boot(0)
    bad = capture(reference, store, "qwen3", chunk_size=64 << 10)
    path = store.objects / f"{bad.id}.ember"
    with open(path, "r+b") as f:
        f.seek(-3000, 2)
        f.write(b"\xff\xff")
    built = []

    def make_model():
        built.append(boot(1))
        return built[-1]

    model, start = restore_or_boot(make_model, lambda m: m.load_state_dict(reference.state_dict()), store, "qwen3")
    assert start.source == "full" and "corrupt" in start.fallback_reason
    assert len(built) == 2 and model is built[1]  # the half-restored model is dropped
    assert not path.exists() and list(store.quarantined.glob(f"{bad.id}.*.ember"))
    assert store.resolve("qwen3") == start.captured.id  # the name now points at a sound snapshot
    _, again = restore_or_boot(lambda: boot(1), lambda m: None, store, "qwen3")
    assert again.source == "snapshot"
