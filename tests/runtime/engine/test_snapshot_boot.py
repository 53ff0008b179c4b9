"""The engine's weights through a snapshot store: first boot writes it, the next restores it; corrupt ones fall back."""
import logging
import shutil
from pathlib import Path

import boto3
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from ember.runtime.engine.config import EngineConfig
from ember.runtime.engine.engine import LLMEngine
from ember.runtime.engine.models import loader
from ember.runtime.engine.sampling import SamplingParams
from ember.snapshot import LocalStore
from ember.snapshot.cli import main as snapshot_cli
from ember.snapshot.store import read_header
from tests.snapshot.conftest import s3_endpoint, s3_env  # noqa: F401  (moto_server fixtures)

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 300, 4000, 12], [9, 9, 12]]


def build(directory, seed: int) -> str:
    """A tied-embedding Qwen3 whose fp32 weights span two 8 MiB snapshot chunks (the embedding alone is 10 MB)."""
    config = Qwen3Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, vocab_size=20000, max_position_embeddings=256,
                         tie_word_embeddings=True, eos_token_id=2)
    torch.manual_seed(seed)
    Qwen3ForCausalLM(config).save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build(tmp_path_factory.mktemp("qwen3"), seed=0)


@pytest.fixture(scope="module")
def reference(model_dir):
    """Greedy outputs of an engine that never touches a snapshot."""
    return boot(model_dir, snapshot_store=None).generate(PROMPTS, GREEDY)


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("EMBER_SNAPSHOT_STORE", raising=False)
    return tmp_path / "home"


def boot(model_dir: str, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model_dir, **{"max_num_seqs": 4, "num_kv_blocks": 32, **overrides}))


def only_object(store: LocalStore):
    (path,) = store.objects.glob("*.ember")
    return path


def test_first_boot_writes_the_snapshot_and_the_second_restores_it(model_dir, reference, monkeypatch):
    monkeypatch.setenv("EMBER_SNAPSHOT_STORE", "local")  # what a snapshot=True replica's worker sets
    first = boot(model_dir)
    assert first.config.snapshot_store == "local"
    start = first.runner.weights_start
    assert start.source == "full" and start.captured is not None and start.fallback_reason is None
    store = LocalStore()
    assert [r.id for r in store.ls()] == [start.captured.id]
    assert start.captured.names[0].startswith(f"{first.model_name}.float32.")
    # The tied head is the embedding's tensor: captured once.
    names = {t.name for t in read_header(only_object(store)).tensors}
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert len(names) == len(list(first.runner.model.parameters()))
    assert first.generate(PROMPTS, GREEDY) == reference

    second = boot(model_dir)
    start = second.runner.weights_start
    model = second.runner.model
    assert start.source == "snapshot" and start.captured is None and loader.last_start is start
    assert start.load.chunks >= 2 and start.load.bytes >= sum(p.nbytes for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert second.generate(PROMPTS, GREEDY) == reference
    assert len(store.ls()) == 1


def flip_last_chunk(path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size - 5000)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x80]))


def truncate(path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 8192)


@pytest.mark.parametrize("damage, reason", [(flip_last_chunk, "checksum"), (truncate, "truncated")])
def test_corrupt_snapshot_is_quarantined_and_the_engine_boots_fully(model_dir, reference, damage, reason, caplog):
    boot(model_dir, snapshot_store="local")
    store = LocalStore()
    path = only_object(store)
    damage(path)
    with caplog.at_level(logging.WARNING):
        engine = boot(model_dir, snapshot_store="local")
    start = engine.runner.weights_start
    assert start.source == "full" and "corrupt" in start.fallback_reason and reason in start.fallback_reason
    assert "booted from the full weights" in caplog.text
    (quarantined,) = store.quarantined.glob("*.ember")
    assert quarantined.name.startswith(path.stem) and reason in quarantined.with_suffix(".reason").read_text()
    # The partly restored model was dropped: what serves is the full boot, bit for bit.
    assert engine.generate(PROMPTS, GREEDY) == reference
    # The full boot wrote a sound snapshot again, and the next start uses it.
    assert start.captured is not None and only_object(store) == path
    again = boot(model_dir, snapshot_store="local")
    assert again.runner.weights_start.source == "snapshot"
    assert again.generate(PROMPTS, GREEDY) == reference


def test_a_changed_dtype_or_model_never_restores_the_old_snapshot(model_dir, tmp_path):
    assert boot(model_dir, snapshot_store="local").runner.weights_start.source == "full"
    bf16 = boot(model_dir, snapshot_store="local", dtype="bfloat16").runner.weights_start
    assert bf16.source == "full" and ".bfloat16." in bf16.captured.names[0]
    assert len(LocalStore().ls()) == 2

    # Same shapes and header, other weights: the sampled content digest tells them apart.
    retrained = build(tmp_path / "retrained", seed=1)
    start = boot(retrained, snapshot_store="local").runner.weights_start
    assert start.source == "full" and start.fallback_reason is None
    assert len(LocalStore().ls()) == 3

    # The same model (the same directory name: the served model's name) at another path with other mtimes,
    # as on another node's disk, restores.
    copy = shutil.copytree(model_dir, tmp_path / "node2" / Path(model_dir).name, copy_function=shutil.copy)
    assert boot(str(copy), snapshot_store="local").runner.weights_start.source == "snapshot"


def test_a_snapshot_built_ahead_with_the_cli_serves_the_first_start(model_dir, reference):
    key = loader.snapshot_key(model_dir, torch.float32)
    assert snapshot_cli(["build", model_dir, "--name", key]) == 0
    engine = boot(model_dir, snapshot_store="local")
    assert engine.runner.weights_start.source == "snapshot"
    assert engine.generate(PROMPTS, GREEDY) == reference


def test_snapshot_store_setting_is_checked():
    with pytest.raises(ValueError, match="EMBER_SNAPSHOT_STORE"):
        EngineConfig(model="unused", snapshot_store="gs://bucket")


def test_snapshots_through_s3(model_dir, reference, s3_env):  # noqa: F811
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket="weights")
    store = "s3://weights/engine"
    first = boot(model_dir, snapshot_store=store).runner.weights_start
    assert first.source == "full" and first.captured.store == store
    restored = boot(model_dir, snapshot_store=store)
    start = restored.runner.weights_start
    assert start.source == "snapshot" and start.load.source.startswith("s3://weights/engine/objects/")
    assert restored.generate(PROMPTS, GREEDY) == reference

    key = f"engine/objects/{first.captured.id}.ember"
    body = bytearray(s3.get_object(Bucket="weights", Key=key)["Body"].read())
    body[-5000] ^= 0x80
    s3.put_object(Bucket="weights", Key=key, Body=bytes(body))
    engine = boot(model_dir, snapshot_store=store)
    assert engine.runner.weights_start.source == "full"
    assert s3.list_objects_v2(Bucket="weights", Prefix="engine/quarantine/")["KeyCount"] == 2  # object + reason
    assert engine.generate(PROMPTS, GREEDY) == reference


def test_what_prepare_read_is_read_again_once_its_file_changes(tmp_path):
    import json
    import os

    model = Path(build(tmp_path / "m", seed=0))
    loader.prepare(model)  # as a fork server's snap=True hook does
    key = loader.snapshot_key(model, torch.float32)
    config = loader.model_config(model)
    config.num_hidden_layers = 1  # a caller's change stays its own
    assert loader.model_config(model).num_hidden_layers == 2
    # new weights of the same size, and a new config.json: a replica forked after this must not see the old ones
    shutil.copy(build(tmp_path / "other", seed=1) + "/model.safetensors", model / "model.safetensors")
    settings = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**settings, "max_position_embeddings": 128}))
    os.utime(model / "config.json", ns=(1, 1))  # a different mtime even on a coarse-grained clock
    assert loader.snapshot_key(model, torch.float32) != key
    assert loader.model_config(model).max_position_embeddings == 128
