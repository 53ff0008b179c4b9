"""`ember serve --model DIR`: the app that serves a Hugging Face model directory, written for it (no app file).

A causal LM (config.json's architectures end in ForCausalLM) gets Ember's engine behind /v1/chat/completions,
/v1/completions, /v1/responses and /v1/models, with weight snapshots on (examples/chat.py's shape); an encoder
(BERT-like) gets /v1/embeddings and /v1/models (ember.runtime.embeddings). The app file goes to EMBER_HOME/apps/NAME.py.
"""
import json
import re
from dataclasses import dataclass
from pathlib import Path

from ember.home import Home
from ember.runtime.supervisor import detect_gpus, gpu_architectures

ENCODER_TYPES = {"bert", "roberta", "xlm-roberta", "distilbert", "mpnet", "electra", "deberta-v2", "nomic_bert"}
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}

CHAT_APP = '''"""Written by `ember serve --model {model_dir}`: the engine's OpenAI-compatible API for {served!r}."""
import ember

MODEL, SERVED = {model_dir!r}, {served!r}
app = ember.App({app!r})


@app.cls(gpu="H200", snapshot=True, max_concurrency=64, target_concurrency=32, scaledown_window=300, timeout=600,
         env={env!r})
class Model:
    @ember.enter(snap=True)
    def load(self):
        # CPU work only, so a fork server can run it once: modules, tokenizer, configuration.
        from transformers import AutoTokenizer

        import ember.runtime.engine.api  # noqa: F401 - imported before the fork
        import ember.runtime.engine.engine  # noqa: F401
        from ember.runtime.engine.config import EngineConfig

        self.config = EngineConfig(model=MODEL{engine_options})
        self.tokenizer = AutoTokenizer.from_pretrained(MODEL)

    @ember.enter(snap=False)
    def serve(self):
        from ember.runtime.engine.api import create_app
        from ember.runtime.engine.async_engine import AsyncLLM
        from ember.runtime.engine.engine import LLMEngine

        self.engine = LLMEngine(self.config)
        self.api = create_app(AsyncLLM(self.engine, self.tokenizer), SERVED)

    @ember.park()
    def release_gpu(self):
        self.engine.park()

    @ember.wake()
    def restore_gpu(self):
        self.engine.wake()

    @ember.asgi_app()
    def web(self):
        return self.api
'''

EMBEDDINGS_APP = '''"""Written by `ember serve --model {model_dir}`: OpenAI's /v1/embeddings for {served!r}."""
import ember

MODEL, SERVED = {model_dir!r}, {served!r}
app = ember.App({app!r})


@app.cls(gpu={gpu!r}, cpu=2, memory=2048, max_concurrency=8, target_concurrency=4, scaledown_window=300,
         timeout=120, env={env!r})
class Model:
    @ember.enter(snap=True)
    def load(self):
        # On the CPU, so a fork server can run it once; each replica moves the weights to its GPU, if it has one.
        from ember.runtime.embeddings import SentenceEmbedder, create_app

        self.embedder = SentenceEmbedder(MODEL)
        self.api = create_app(self.embedder, SERVED)

    @ember.enter(snap=False)
    def place(self):
        self.embedder.to_gpu_if_any()

    @ember.asgi_app()
    def web(self):
        return self.api
'''


@dataclass(frozen=True)
class ModelApp:
    path: Path  # the app file written
    app: str  # its app name: the URL's first segment
    served: str  # the model's name in requests
    kind: str  # "chat" or "embeddings"


def model_kind(model_dir: Path) -> str:
    """'chat' or 'embeddings', from the directory's config.json; ValueError naming what is missing otherwise."""
    config_path = model_dir / "config.json"
    if not model_dir.is_dir():
        raise FileNotFoundError(f"--model {model_dir}: no such directory; give a Hugging Face model directory "
                                "(config.json, *.safetensors and the tokenizer files)")
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise ValueError(f"--model {model_dir}: no config.json there; give a Hugging Face model directory") from None
    except ValueError as exc:
        raise ValueError(f"--model {model_dir}: config.json is not JSON ({exc})") from None
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"--model {model_dir}: no *.safetensors weights there (.bin checkpoints are not read); "
                         "convert them with transformers' save_pretrained(safe_serialization=True)")
    if not (model_dir / "tokenizer.json").exists() and not (model_dir / "tokenizer_config.json").exists():
        raise ValueError(f"--model {model_dir}: no tokenizer files (tokenizer.json or tokenizer_config.json) there")
    architectures = config.get("architectures") or []
    if any(a.endswith("ForCausalLM") for a in architectures):
        kind = "chat"
    elif config.get("model_type") in ENCODER_TYPES:
        kind = "embeddings"
    else:
        raise ValueError(f"--model {model_dir}: cannot serve architectures {architectures} (model_type "
                         f"{config.get('model_type')!r}); it serves causal LMs (*ForCausalLM: chat and completions) "
                         f"and encoders ({', '.join(sorted(ENCODER_TYPES))}: embeddings)")
    for shard in shards:
        if problem := safetensors_problem(shard):
            raise ValueError(f"--model {model_dir}: {shard.name} {problem} (a download cut short?): fetch it again")
    return kind


def safetensors_problem(path: Path) -> str | None:
    """What makes `path` no whole safetensors file, from its header alone (8 bytes of length, a JSON header, then
    the tensors' bytes, which must reach the file's end): before, a truncated shard served, and every request got a
    503 naming "invalid header length" once a replica tried to load it. None when it is whole."""
    size = path.stat().st_size
    with path.open("rb") as file:
        head = file.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < length <= min(size - 8, 100 << 20):
            return f"is not a safetensors file ({size} bytes, header length {length})"
        try:
            header = json.loads(file.read(length))
            end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"),
                      default=0)
        except (ValueError, TypeError, KeyError, IndexError):
            return "has a header that is not safetensors JSON"
    if 8 + length + end > size:
        return f"is cut short: its tensors end at byte {8 + length + end:,}, the file has {size:,}"
    return None


def app_name(served: str) -> str:
    """A URL-safe app name from a model name: 'Qwen3-0.6B' -> 'qwen3-0-6b'."""
    name = re.sub(r"[^a-z0-9_-]+", "-", served.lower()).strip("-_")[:63]
    if not name:
        raise ValueError(f"cannot make an app name from {served!r}; give one with --name (letters, digits, - and _)")
    return name


def _pre_fp8_gpus() -> str | None:
    """The compute capabilities under 8.9 (no FP8) of this machine's GPUs, from nvidia-smi; None where every GPU has
    FP8, where there is none (the CPU runs FP8's arithmetic on rounded values) or where nvidia-smi says nothing."""
    if not detect_gpus() or not (caps := gpu_architectures()):
        return None
    lacking = [cap for cap in caps.split()
               if (version := re.match(r"(\d+)\.(\d+)", cap)) and tuple(map(int, version.groups())) < (8, 9)]
    return " ".join(lacking) or None


def write_model_app(model_dir: str | Path, name: str | None, home: Home, quantization: str | None = None,
                    kv_cache_dtype: str | None = None) -> ModelApp:
    """The app file for `model_dir`; `quantization` and `kv_cache_dtype` (a causal LM's): EngineConfig's, e.g.
    "fp8"."""
    model_dir = Path(model_dir).resolve()
    kind = model_kind(model_dir)
    if quantization and kind != "chat":
        raise ValueError(f"--quantization {quantization}: only a causal LM's weights are quantized; "
                         f"{model_dir.name} is an encoder, served as it is: drop --quantization")
    if kv_cache_dtype and kind != "chat":
        raise ValueError(f"--kv-cache-dtype {kv_cache_dtype}: only a causal LM keeps a KV cache; "
                         f"{model_dir.name} is an encoder: drop --kv-cache-dtype")
    fp8_flags = [flag for flag, value in (("--quantization", quantization), ("--kv-cache-dtype", kv_cache_dtype))
                 if value == "fp8"]
    if fp8_flags and (lacking := _pre_fp8_gpus()):
        raise ValueError(f"{' and '.join(f'{flag} fp8' for flag in fp8_flags)} need{'s' * (len(fp8_flags) == 1)} FP8 "
                         f"support (compute capability 8.9 or newer: Ada, Hopper); this machine's GPUs are {lacking}: "
                         f"drop {' and '.join(fp8_flags)}")
    served = name or model_dir.name
    app = app_name(served)
    template = CHAT_APP if kind == "chat" else EMBEDDINGS_APP
    path = home.root / "apps" / f"{app}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    # An encoder takes a GPU only on a machine that has one (a whole GPU, as vllm serve would); else it runs on CPU.
    gpu = "H200" if kind == "embeddings" and detect_gpus() else None
    engine_options = (f", quantization={quantization!r}" if quantization else "") + (
        f", kv_cache_dtype={kv_cache_dtype!r}" if kv_cache_dtype else "")
    path.write_text(template.format(model_dir=str(model_dir), served=served, app=app, env=OFFLINE, gpu=gpu,
                                    engine_options=engine_options))
    return ModelApp(path, app, served, kind)
