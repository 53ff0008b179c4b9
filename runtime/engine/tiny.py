"""A small random-weight model with a locally trained tokenizer, for tests and demos.

No model hub is reachable here, so `build_tiny_model` writes a complete Hugging Face
model directory from a real architecture config: random weights (safetensors, saved by
the transformers model class), a byte-level BPE tokenizer trained on the built-in corpus
below, ChatML special tokens and chat template, and eos in config and generation_config.
"""

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

# English only: emoji and CJK text then encode as raw byte tokens, which is what
# exercises the detokenizer's handling of characters split across tokens.
CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Once upon a time there was a small town by the sea, where the people woke early and worked hard.
The weather today is sunny with a light breeze from the west, and tomorrow it may rain in the evening.
Machine learning models learn patterns from data; a language model predicts the next token in a sequence.
Please write a short poem about the moon, the stars, and the quiet night over the sleeping city.
What is the capital of France? The capital of France is Paris, a city known for art and food.
How many days are there in a week? There are seven days in a week and twelve months in a year.
She opened the door, looked outside, and smiled at the children playing in the garden.
The server answered every request quickly, because the cache already held the most common answers.
Numbers like 1, 2, 3, 10, 42, 100 and 2024 appear in text, as do dates such as 2024-05-01.
Hello! How are you? I am fine, thank you. Can you help me with my homework, please?
Good morning, good afternoon, good evening, and good night to everyone reading this message.
The engine schedules requests, runs the model on the GPU, and streams tokens back to the client.
Café, naïve, résumé, jalapeño and Straße are words that came into English from other languages.
def main():\n    print("hello, world")\n    return 0\n
{"name": "ember", "version": 1, "items": [1, 2, 3], "ok": true}
In the beginning the river was wide and slow, and the boats carried bread, wine and letters.
A good story has a beginning, a middle and an end; a good answer is short, clear and correct.
The library opens at nine in the morning and closes at six in the evening, except on Sundays.
Water boils at one hundred degrees at sea level, and freezes at zero degrees Celsius.
The teacher asked the students to read the chapter again and to write down their questions.
Our team shipped the new release on Friday after the tests passed on every machine we own.
The market was full of apples, oranges, bananas, grapes, lemons, carrots, onions and fresh bread.
He walked along the river, crossed the old stone bridge, and sat down on a bench under the trees.
If you want to learn to cook, start with simple dishes: eggs, rice, soup, pasta and salad.
The mountain was covered in snow, and the climbers waited for the wind to calm before the last climb.
Thank you for your message. I will read it carefully and reply as soon as I can.
The history of the world is a story of people, places, ideas, wars, trade, music and science.
Children love games, songs, animals, colors and stories about dragons, kings and brave friends.
The doctor said that sleep, water, exercise and good food are the best medicine for most people.
Every request has a prompt, a model, a number of tokens, and a temperature that controls randomness.
The system is fast, simple and reliable; it starts in one second and scales down to zero when idle.
"""

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Real architecture, toy sizes: big enough to exercise GQA, rotary and tied embeddings.
FAMILY_DEFAULTS = {
    "qwen3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=True),
    "qwen2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True),
    "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=False),
}

VOCAB_SIZE = 1024
# Bump when the output of the builder changes, so cached directories are rebuilt.
FORMAT_VERSION = 1
MARKER = "ember_tiny.json"


def build_tiny_model(path, family: str = "qwen3", seed: int = 0, **overrides) -> Path:
    """Write (or reuse) a tiny model directory at `path`; `overrides` go into the model config."""
    if family not in FAMILY_DEFAULTS:
        raise ValueError(f"unknown family {family!r}: choose one of {sorted(FAMILY_DEFAULTS)}")
    path = Path(path)
    key = _content_key(family, seed, overrides)
    if _built_with(path) == key:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # Replicas starting together on one EMBER_HOME build once; the others wait, then reuse it.
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _built_with(path) == key:
            return path
        if path.exists() and _built_with(path) is None and any(path.iterdir()):
            raise FileExistsError(f"{path} exists and is not a tiny model directory: pass an empty or new path")
        staging = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
        try:
            _write(staging, family, seed, overrides)
            (staging / MARKER).write_text(json.dumps({"key": key, "family": family, "seed": seed}))
            shutil.rmtree(path, ignore_errors=True)
            os.replace(staging, path)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return path


def _content_key(family: str, seed: int, overrides: dict) -> str:
    blob = json.dumps([FORMAT_VERSION, family, seed, overrides, CORPUS, CHAT_TEMPLATE, VOCAB_SIZE], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _built_with(path: Path) -> str | None:
    try:
        return json.loads((path / MARKER).read_text())["key"]
    except (OSError, ValueError, KeyError):
        return None


def _write(out: Path, family: str, seed: int, overrides: dict) -> None:
    import torch
    import transformers
    from transformers import GenerationConfig

    tokenizer = train_tokenizer()
    tokenizer.save_pretrained(out)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")

    config_cls, model_cls = {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    }[family]
    settings = {**FAMILY_DEFAULTS[family], "vocab_size": len(tokenizer), "eos_token_id": eos,
                "pad_token_id": eot, "bos_token_id": None, **overrides}
    config = config_cls(**settings)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    model.generation_config = GenerationConfig(eos_token_id=[eos, eot], pad_token_id=eot, bos_token_id=None)
    model.save_pretrained(out)


def train_tokenizer():
    """Byte-level BPE trained on CORPUS, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=FAMILY_DEFAULTS["qwen3"]["max_position_embeddings"],
    )
