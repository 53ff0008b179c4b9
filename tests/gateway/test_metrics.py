"""The gateway's /metrics after a known workload against examples/chat.py over real HTTPS: request counts,
duration, queue-wait and cold-start histograms, rate-limit rejections, per-key usage, and the chat function's
engine series scraped from its replica and labelled with app and function. The whole page must parse as
Prometheus text (the official client's parser)."""
import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
BODY = {"model": "tiny-qwen3", "prompt": "The sea", "max_tokens": 4, "ignore_eos": True}
CHAT = {"app": "chat", "function": "Chat"}


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of the page by (name, labels); parsing it whole also checks the exposition format."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(page: dict, metric: str, **labels) -> float:
    return page[(metric, frozenset(labels.items()))]


def buckets(page: dict, name: str, **labels) -> list[tuple[float, float]]:
    found = [(float(dict(k)["le"]), v) for (n, k), v in page.items()
             if n == f"{name}_bucket" and labels.items() <= dict(k).items()]
    return sorted(found)


def check_histogram(page: dict, name: str, count: int, **labels) -> list[tuple[float, float]]:
    """Cumulative buckets that never fall, ending at +Inf with the sample count; returns them."""
    found = buckets(page, name, **labels)
    assert found, f"no {name} buckets for {labels}"
    assert all(a[1] <= b[1] for a, b in zip(found, found[1:])), found
    assert found[-1] == (float("inf"), count) and value(page, f"{name}_count", **labels) == count
    return found


def streamed_usage(reply) -> int:
    for line in reply.text.splitlines():
        if line.startswith("data: {") and '"usage"' in line:
            usage = json.loads(line[6:]).get("usage")
            if usage:
                return usage["total_tokens"]
    raise AssertionError(f"no usage in the stream:\n{reply.text}")


def test_metrics_after_a_known_chat_workload(serve):
    served = serve(ROOT / "examples" / "chat.py", timeout=120)
    key = served.cli("keys", "create", "--quiet", "--name", "metered").stdout.strip()
    limited = served.cli("keys", "create", "--quiet", "--name", "limited", "--rpm", "1").stdout.strip()
    key_id, limited_id = key.split("_")[1], limited.split("_")[1]
    used = 0
    with served.client(key, timeout=120) as http:
        tiers = []
        for _ in range(3):
            reply = http.post("/chat/v1/completions", json=BODY)
            assert reply.status_code == 200, reply.text
            used += reply.json()["usage"]["total_tokens"]
            tiers.append(reply.headers.get("x-ember-cold-start", "").partition(";")[0])
        tier = tiers[0]  # the first call waited for the replica's start, from the tier it names
        assert tier and tiers[1:] == ["", ""]
        streamed = http.post("/chat/v1/completions",
                             json=BODY | {"stream": True, "stream_options": {"include_usage": True}})
        assert streamed.status_code == 200, streamed.text
        used += streamed_usage(streamed)
    with served.client(limited, timeout=120) as http:  # one a minute: the second is refused
        assert [http.post("/chat/v1/completions", json=BODY).status_code for _ in range(2)] == [200, 429]

    page = samples(served.client(None).get("/metrics").text)

    assert value(page, "ember_requests_total", **CHAT, code="200") == 5
    assert value(page, "ember_requests_total", **CHAT, code="429") == 1
    durations = check_histogram(page, "ember_request_duration_seconds", 5, **CHAT, code="200")
    # the first call waited for the replica's start (a few tenths of a second to seconds for the tiny model, by
    # tier and machine), so its duration is past every bucket under that wait
    cold = value(page, "ember_cold_start_seconds_sum", **CHAT, tier=tier)
    assert cold > 0.05
    under = [n for le, n in durations if le < cold]
    assert not under or under[-1] <= 4
    assert value(page, "ember_request_duration_seconds_sum", **CHAT, code="200") >= cold
    check_histogram(page, "ember_request_duration_seconds", 1, **CHAT, code="429")
    waits = check_histogram(page, "ember_queue_wait_seconds", 5, **CHAT)  # the refused call never queued
    assert dict(waits)[0.001] == 4  # only the first call waited, for the start
    assert value(page, "ember_cold_starts_total", **CHAT, tier=tier) == 1
    check_histogram(page, "ember_cold_start_seconds", 1, **CHAT, tier=tier)
    assert value(page, "ember_rate_limited_total", app="chat", key=limited_id, reason="requests") == 1
    assert value(page, "ember_key_requests_total", key=key_id, name="metered") == 4
    assert value(page, "ember_key_tokens_total", key=key_id, name="metered") == used
    assert value(page, "ember_key_requests_total", key=limited_id, name="limited") == 2
    assert value(page, "ember_key_tokens_total", key=limited_id, name="limited") == used / 4  # the refused one: none
    assert value(page, "ember_key_in_flight", key=key_id, name="metered") == 0
    assert value(page, "ember_replicas", **CHAT, state="hot") == 1

    # The engine's own series, summed over the chat function's replicas (one here), under vLLM's names.
    engine = CHAT | {"model_name": "tiny-qwen3"}
    assert value(page, "ember:request_success_total", **engine, finished_reason="length") == 5
    assert value(page, "ember:generation_tokens_total", **engine) == 5 * BODY["max_tokens"]
    check_histogram(page, "ember:time_to_first_token_seconds", 5, **engine)
    assert value(page, "ember:time_to_first_token_seconds_sum", **engine) > 0
    check_histogram(page, "ember:inter_token_latency_seconds", 5 * (BODY["max_tokens"] - 1), **engine)
    assert value(page, "ember:num_requests_running", **engine) == 0
    assert 0.0 <= value(page, "ember:kv_cache_usage_perc", **engine) <= 1.0

    # Every series the shipped Grafana dashboard queries is one this page serves.
    grafana = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text())
    queried = {name for panel in grafana["panels"] for target in panel["targets"]
               for name in re.findall(r"\b(ember[_:][A-Za-z0-9_:]*)", target["expr"])}
    served_names = {name for name, _ in page}
    assert len(queried) > 10 and queried <= served_names, queried - served_names
