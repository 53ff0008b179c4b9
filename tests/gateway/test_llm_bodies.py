"""OpenAI request bodies the gateway reads to estimate tokens and pick a replica (gateway/body.py, affinity.py), in
shapes no client should send, over a real HTTPS socket: whatever the JSON holds, the gateway forwards it and the
replica's answer comes back (the engine's API answers such bodies with its own 400); the gateway never fails on it."""
import json
from pathlib import Path

APPS = Path(__file__).parent / "apps"
LONG = "x" * 400   # long enough for a prefix key (gateway/affinity.py)

BODIES = [
    {"messages": "hi"},
    {"messages": {"role": "user", "content": "hi"}},
    {"messages": [1, 2]},
    {"messages": [None, {"role": "user", "content": "hi"}]},
    {"messages": [{"role": "user", "content": "\ud800" + LONG}]},
    {"prompt": "\ud800" + LONG},
    {"prompt": ["\udfff" + LONG, "b"]},
    {"prompt": [[1, 2], [3]]},
    {"prompt": {"text": LONG}},
    {"prompt": 1e300, "max_tokens": 2.5, "n": "two"},
]


def test_malformed_llm_bodies_are_forwarded_not_failed_on(serve):
    served = serve(APPS / "fleet.py")
    key = served.cli("keys", "create", "--quiet", "--name", "llm", "--tpm", "100000").stdout.strip()
    with served.client(key) as http:
        for body in BODIES:
            raw = json.dumps(body | {"max_tokens": 2} if "max_tokens" not in body else body).encode()
            reply = http.post("/fleet/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
            assert reply.status_code == 200, (body, reply.status_code, reply.text)   # the fake replica answers all
            assert "pid" in reply.json(), (body, reply.text)
