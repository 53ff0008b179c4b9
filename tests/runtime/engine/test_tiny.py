import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from ember.runtime.engine.tiny import build_tiny_model


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_builds_a_loadable_model_directory(tmp_path, family):
    path = build_tiny_model(tmp_path / family, family=family)
    config = AutoConfig.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert config.model_type == family
    assert 500 <= len(tokenizer) == config.vocab_size <= 2048
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token_id == eos == config.eos_token_id
    assert eos in GenerationConfig.from_pretrained(path).eos_token_id
    ids = torch.tensor([tokenizer.encode("Hello world", add_special_tokens=False)])
    assert model(ids).logits.shape == (1, ids.shape[1], config.vocab_size)


def test_tokenizer_round_trips_words_and_splits_emoji_into_bytes(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "m"))
    text = "The capital of France is Paris. Café 🙂 日本語"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert len(tokenizer.encode(" capital", add_special_tokens=False)) == 1
    assert len(tokenizer.encode("🙂", add_special_tokens=False)) == 4


def test_chat_template_is_chatml(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "m"))
    prompt = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_same_inputs_give_identical_files_and_seed_changes_weights(tmp_path):
    a = build_tiny_model(tmp_path / "a", seed=1)
    b = build_tiny_model(tmp_path / "b", seed=1)
    c = build_tiny_model(tmp_path / "c", seed=2)
    for name in ["model.safetensors", "tokenizer.json", "config.json"]:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_second_build_is_a_cache_hit_and_overrides_rebuild(tmp_path):
    path = build_tiny_model(tmp_path / "m")
    weights = path / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert build_tiny_model(tmp_path / "m") == path
    assert weights.stat().st_mtime_ns == before
    build_tiny_model(tmp_path / "m", num_hidden_layers=3)
    assert json.loads((path / "config.json").read_text())["num_hidden_layers"] == 3


def test_refuses_to_overwrite_a_directory_it_did_not_build(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a tiny model directory"):
        build_tiny_model(tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_unknown_family_names_the_choices(tmp_path):
    with pytest.raises(ValueError, match="llama"):
        build_tiny_model(tmp_path / "m", family="gpt2")


def test_concurrent_builds_of_one_path_build_once(tmp_path):
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        paths = list(pool.map(lambda _: build_tiny_model(tmp_path / "shared", seed=4), range(3)))
    assert paths == [tmp_path / "shared"] * 3
    assert sorted(p.name for p in tmp_path.iterdir()) == [".shared.lock", "shared"]
    AutoModelForCausalLM.from_pretrained(tmp_path / "shared")
