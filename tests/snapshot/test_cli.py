"""`ember snapshot build|ls|rm` end to end: real files, real stores, real output."""
import json

import pytest
import torch
from safetensors.torch import save_file

from ember.snapshot import LocalStore, load
from ember.snapshot.cli import main

from .conftest import assert_same, tiny_qwen3


def test_build_from_a_safetensors_file_then_ls_and_rm(tmp_path, mixed_state, capsys):
    src = tmp_path / "weights.safetensors"
    state = {k: v for k, v in mixed_state.items() if k != "empty"}
    save_file(state, src)
    assert main(["build", str(src)]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("built weights ") and "build weights" in err  # the progress bar went to stderr
    assert_same(load(LocalStore().open("weights"))[0], state)

    assert main(["ls", "--json"]) == 0
    [listed] = json.loads(capsys.readouterr().out)
    assert listed["names"] == ["weights"] and listed["tensors"] == len(state)
    assert main(["ls"]) == 0
    assert "weights" in capsys.readouterr().out
    assert main(["rm", "weights"]) == 0 and "removed" in capsys.readouterr().out
    assert LocalStore().ls() == []


def test_build_from_a_hugging_face_model_dir(tmp_path, capsys):
    model = tiny_qwen3()
    model.save_pretrained(tmp_path / "qwen3-tiny")
    assert main(["build", str(tmp_path / "qwen3-tiny"), "--name", "qwen"]) == 0
    loaded, _ = load(LocalStore().open("qwen"))
    state = model.state_dict()
    for name, t in state.items():
        if name in loaded:
            assert torch.equal(loaded[name], t), name
    assert "model.embed_tokens.weight" in loaded
    # stored in the engine's layout: each layer's q/k/v and gate/up rows stacked in one tensor
    layer = "model.layers.1."
    assert torch.equal(loaded[layer + "self_attn.qkv_proj.weight"], torch.cat(
        [state[layer + f"self_attn.{p}_proj.weight"] for p in "qkv"]))
    assert torch.equal(loaded[layer + "mlp.gate_up_proj.weight"], torch.cat(
        [state[layer + "mlp.gate_proj.weight"], state[layer + "mlp.up_proj.weight"]]))
    assert not any(name.endswith(("q_proj.weight", "gate_proj.weight")) for name in loaded)


def test_build_to_s3_and_list_there(tmp_path, s3_env, capsys):
    import boto3
    boto3.client("s3").create_bucket(Bucket="cli-bucket")
    src = tmp_path / "w.safetensors"
    save_file({"w": torch.arange(10.0)}, src)
    assert main(["build", str(src), "--store", "s3://cli-bucket/snaps"]) == 0
    assert "s3://cli-bucket/snaps" in capsys.readouterr().out
    assert main(["ls", "--json", "--store", "s3://cli-bucket/snaps"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["names"] == ["w"]


def test_verify_checks_sha256_and_quarantines_a_corrupt_snapshot(tmp_path, capsys):
    src = tmp_path / "w.safetensors"
    save_file({"w": torch.randn(5000)}, src)
    assert main(["build", str(src)]) == 0
    assert main(["verify", "w"]) == 0 and "match their sha256" in capsys.readouterr().out
    [path] = LocalStore().objects.glob("*.ember")
    with open(path, "r+b") as f:
        f.seek(-100, 2)
        f.write(b"x")
    assert main(["verify", "w"]) == 1
    assert "quarantined" in capsys.readouterr().err and LocalStore().ls() == []


def test_a_huge_header_length_is_reported_by_ls_and_quarantined_by_verify_and_by_a_restore(tmp_path, capsys):
    """The 8-byte length field after the magic, set to 2**62: it used to be read as one allocation (MemoryError)."""
    import struct

    from ember.snapshot import SnapshotCorrupt, restore_into

    for name in ("w", "v"):
        src = tmp_path / f"{name}.safetensors"
        save_file({"w": torch.randn(5000)}, src)
        assert main(["build", str(src), "--name", name]) == 0
        [path] = [p for p in LocalStore().objects.glob("*.ember") if LocalStore()._ref(p.stem).names == (name,)]
        with open(path, "r+b") as f:
            f.seek(8)
            f.write(struct.pack("<Q", 2**62))
    capsys.readouterr()
    assert main(["ls", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [r["tensors"] for r in listed] == [-1, -1] and all("over the" in r["problem"] for r in listed)
    assert main(["ls"]) == 0
    out, err = capsys.readouterr()
    assert out.count("corrupt") == 2 and "ember snapshot verify" in err

    assert main(["verify", "w"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "quarantined" in err and "MemoryError" not in err
    with pytest.raises(SnapshotCorrupt, match="header length"):  # what a replica's start does with the other
        restore_into({"w": torch.zeros(5000)}, LocalStore(), "v")
    assert LocalStore().ls() == [] and len(list(LocalStore().quarantined.glob("*.ember"))) == 2


@pytest.mark.parametrize("argv,message", [
    (["build", "/no/such/dir"], "does not exist"),
    (["rm", "nothing-here"], "ember snapshot build"),
    (["ls", "--store", "ftp://x"], "unknown store"),
])
def test_errors_name_the_fix_and_exit_nonzero(argv, message, capsys):
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_small_snapshots_list_in_readable_units_and_aligned_columns(tmp_path, capsys):
    save_file({"w": torch.zeros(10, 10)}, tmp_path / "small.safetensors")  # ~8 KB
    save_file({"w": torch.zeros(600, 1000)}, tmp_path / "mid.safetensors")  # ~2.4 MB
    assert main(["build", str(tmp_path / "small.safetensors"), "--name", "a-name-longer-than-the-old-24-columns"]) == 0
    assert main(["build", str(tmp_path / "mid.safetensors")]) == 0
    assert " KB in " in capsys.readouterr().out.splitlines()[0]
    assert main(["ls"]) == 0
    header, *rows = capsys.readouterr().out.splitlines()
    assert header.split() == ["ID", "NAME", "SIZE", "TENSORS", "CREATED"] and len(rows) == 2
    sizes = {row.split()[1]: " ".join(row.split()[2:4]) for row in rows}
    assert sizes["mid"].endswith(" MB") and sizes["a-name-longer-than-the-old-24-columns"].endswith(" KB")
    assert "0.00" not in "".join(rows)
    for column in ("SIZE", "TENSORS", "CREATED"):  # every row's value ends (or starts) where the header's does
        end = header.index(column) + len(column)
        assert all(len(row) >= end for row in rows)
    assert len({row.index(" 1 ") for row in rows}) == 1  # the tensors column lines up despite the long name


def test_a_bad_safetensors_file_is_one_line_naming_the_fix(tmp_path, capsys):
    bad = tmp_path / "broken.safetensors"
    bad.write_bytes(b"version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 10\n")  # an LFS pointer
    assert main(["build", str(bad)]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"error: {bad} is not a readable safetensors file") and "re-download" in err


def test_missing_aws_credentials_are_one_line_naming_the_fix(monkeypatch, capsys):
    import boto3

    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)  # an earlier test's session keeps the emulator's credentials
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    assert main(["ls", "--store", "s3://some-bucket/snaps"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: no AWS credentials for --store s3://some-bucket")
    assert "AWS_ACCESS_KEY_ID" in err and "--store local" in err
