"""examples/chat.py served by `ember serve`, driven over HTTPS by the official openai client."""
import time
from pathlib import Path

import httpx
import openai
import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "chat.py"
MODEL = "tiny-qwen3"
STORY = [{"role": "user", "content": "Tell me a story about the sea."}]


def _samples(metrics_text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in metrics_text.splitlines() if line and not line.startswith("#")}


def test_openai_client_against_ember_serve(serve, monkeypatch):
    monkeypatch.setenv("EMBER_CHAT_LOG_TOKEN_IDS", "1")
    served = serve(EXAMPLE, timeout=120)
    key = served.key()
    http = httpx.Client(verify=served.tls(), timeout=120)
    client = openai.OpenAI(base_url=f"{served.url}/chat/v1", api_key=key, http_client=http, max_retries=0)
    with http, client:
        # Non-streaming, seeded: reproducible, different seeds differ.
        assert [m.id for m in client.models.list()] == [MODEL]
        first = client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=24, seed=1)
        assert first.choices[0].message.role == "assistant"
        # A random model may sample EOS early: whichever way it ended, usage must agree with it.
        assert (first.usage.completion_tokens == 24) == (first.choices[0].finish_reason == "length")
        text = first.choices[0].message.content
        assert client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=24, seed=1) \
            .choices[0].message.content == text
        assert client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=24, seed=2) \
            .choices[0].message.content != text

        # Streaming through the gateway gives the same text, then a usage chunk.
        stream = client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=24, seed=1, stream=True,
                                                stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == first.usage.completion_tokens

        # A stop string ends the answer before it, in both modes.
        stop = text[len(text) // 2:len(text) // 2 + 2]
        cut = client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=24, seed=1, stop=[stop])
        assert cut.choices[0].message.content == text[:text.find(stop)]
        assert cut.choices[0].finish_reason == "stop"
        streamed = client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=24, seed=1, stop=[stop],
                                                  stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text[:text.find(stop)]

        # OpenAI-shaped errors surface as the client's exception types.
        with pytest.raises(openai.NotFoundError) as missing:
            client.chat.completions.create(model="gpt-4o", messages=STORY)
        assert missing.value.code == "model_not_found"
        with pytest.raises(openai.BadRequestError) as too_long:
            client.completions.create(model=MODEL, prompt="word " * 1100)
        assert too_long.value.code == "context_length_exceeded"
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model=MODEL, messages=STORY, temperature=7)
        assert bad.value.param == "temperature"

        # A client that leaves mid-stream aborts its request and frees its KV blocks.
        label = f'model_name="{MODEL}"'
        aborted = f'ember:request_success_total{{{label},finished_reason="abort"}}'

        metrics_url, auth = f"{served.url}/chat/metrics", {"Authorization": f"Bearer {key}"}

        def idle_metrics() -> dict[str, float]:
            deadline = time.monotonic() + 20
            while True:
                metrics = _samples(http.get(metrics_url, headers=auth).text)
                busy = [metrics[f"ember:{name}{{{label}}}"] for name in
                        ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")]
                if not any(busy):
                    return metrics
                assert time.monotonic() < deadline, f"the engine never went idle: {busy}"
                time.sleep(0.1)

        before = idle_metrics()[aborted]  # stop strings end in aborts too: let those land first
        long = client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=1000, stream=True,
                                              extra_body={"ignore_eos": True})
        for _, _chunk in zip(range(3), long):
            pass
        long.close()
        metrics = idle_metrics()
        assert metrics[aborted] == before + 1, "the abandoned stream ran to its end instead of being aborted"
        finished = [f'ember:request_success_total{{{label},finished_reason="{r}"}}' for r in ("length", "stop")]
        assert sum(metrics[name] for name in finished) >= 4
        assert metrics[f"ember:time_to_first_token_seconds_count{{{label}}}"] >= 7

    # Token ids of every request are in the replica's log, as the example was asked to.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(served.home / "models" / MODEL)
    prompt = tokenizer.apply_chat_template(STORY, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    logs = "".join(p.read_text() for p in (served.home / "logs").rglob("*") if p.is_file())
    assert f"prompt_token_ids={ids}" in logs
    assert "output_token_ids=[" in logs


def test_an_idle_chat_replica_parks_and_its_next_request_wakes_it_with_the_same_answer(serve, monkeypatch):
    monkeypatch.setenv("EMBER_CHAT_PARK_AFTER", "0.5")
    served = serve(EXAMPLE, timeout=120)
    request = {"model": MODEL, "prompt": "The quick brown fox jumps over the lazy dog. " * 4, "max_tokens": 8,
               "temperature": 0}

    def parked() -> list[dict]:
        return [r for fn in served.status()["apps"]["chat"]["functions"].values() for r in fn["replicas"]
                if r["state"] == "parked"]

    with served.client(served.key(), timeout=120) as http:
        first = http.post("/chat/v1/completions", json=request)
        assert first.status_code == 200, first.text
        deadline = time.monotonic() + 20
        while not parked():
            assert time.monotonic() < deadline, "the idle replica never parked"
            time.sleep(0.1)
        second = http.post("/chat/v1/completions", json=request)
    assert second.status_code == 200, second.text
    assert second.headers["x-ember-replica"] == first.headers["x-ember-replica"]
    assert second.headers["x-ember-cold-start"].startswith("parked; ms=")
    # The prompt spans full KV blocks that the park discarded: the same answer means none was reused.
    assert second.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]


def test_the_snapshot_hook_does_cpu_work_only_so_a_fork_server_can_run_it(tmp_path):
    import os
    import subprocess
    import sys

    from ember.runtime.engine.tiny import build_tiny_model

    build_tiny_model(tmp_path / "models" / "tiny-qwen3")  # built once per node, before any fork server

    probe = f"""
import sys, threading
import torch
from ember.package import load_app
chat = load_app({str(EXAMPLE)!r}).units["Chat"]
obj = chat.user_cls()
chat.user_cls.load(obj)
assert hasattr(obj, "tokenizer") and hasattr(obj, "config") and not hasattr(obj, "engine")
assert "ember.runtime.engine.model_runner" in sys.modules  # the engine is imported before the fork ...
assert not torch.cuda.is_initialized() and "flashinfer" not in sys.modules  # ... CUDA is not
assert threading.active_count() == 1, threading.enumerate()  # threads do not survive a fork
print("cpu-only")
"""
    env = {**os.environ, "EMBER_HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert done.stdout.strip() == "cpu-only", done.stderr[-2000:]


def test_the_banner_alone_sets_up_curl_and_the_official_openai_client(serve):
    """With only what `ember serve examples/chat.py --new-key me` printed: its curl, its export line, its snippet."""
    import os
    import shlex
    import subprocess
    import sys

    served = serve(EXAMPLE, "--new-key", "me", timeout=120)
    printed = [line.strip() for line in served.stdout]
    curl = next(line for line in printed if line.startswith("curl --cacert"))
    pasted = subprocess.run(["bash", "-c", curl + " -sS -w '\\n%{http_code}'"], capture_output=True, text=True,
                            timeout=120)
    assert pasted.stdout.endswith("\n200") and '"object":"chat.completion"' in pasted.stdout.replace(" ", "")

    exported = next(line for line in printed if "export OPENAI_BASE_URL=" in line).split("export ", 1)[1]
    settings = dict(word.split("=", 1) for word in shlex.split(exported))
    assert set(settings) == {"OPENAI_BASE_URL", "OPENAI_API_KEY", "SSL_CERT_FILE"}
    ask = (f"c.chat.completions.create(model={MODEL!r}, messages=[{{'role': 'user', 'content': 'Hi'}}], "
           "max_tokens=4).choices[0].message.role")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "SSL_CERT", "EMBER_"))}
    by_env = subprocess.run([sys.executable, "-c", f"import openai; c = openai.OpenAI(max_retries=0); print({ask})"],
                            env=clean | settings, capture_output=True, text=True, timeout=120)
    assert by_env.stdout.strip() == "assistant", by_env.stderr
    snippet = next(line for line in printed if line.startswith("openai.OpenAI("))
    by_snippet = subprocess.run([sys.executable, "-c", f"import httpx, openai; c = {snippet}; print({ask})"],
                                env=clean, capture_output=True, text=True, timeout=120)
    assert by_snippet.stdout.strip() == "assistant", by_snippet.stderr
