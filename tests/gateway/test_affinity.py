import zlib
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ember.gateway.affinity import ReplicaLoad, load_cap, pick, prefix_key, prompt_text, weight

SESSIONS = [f"session-{i}" for i in range(1000)]


def place(keys, replica_ids, epsilon):
    """Assign keys one by one, each counting as one unit of load: session id -> replica id."""
    load = dict.fromkeys(replica_ids, 0)
    where = {}
    for key in keys:
        chosen = pick(key, [ReplicaLoad(r, load[r]) for r in replica_ids], epsilon)
        load[chosen] += 1
        where[key] = chosen
    return where


def test_1000_sessions_over_4_replicas_stay_bounded_and_a_fifth_takes_about_a_fifth():
    epsilon = 0.1
    four = place(SESSIONS, ["r0", "r1", "r2", "r3"], epsilon)
    five = place(SESSIONS, ["r0", "r1", "r2", "r3", "r4"], epsilon)
    for where, n in ((four, 4), (five, 5)):
        assert max(Counter(where.values()).values()) <= load_cap(999, n, epsilon)  # (1+ε)·1000/n, rounded up
    moved = [s for s in SESSIONS if four[s] != five[s]]
    # Ideal is 1/5; the bound pushes a few more. Modulo hashing would move ~4/5.
    assert 0.15 <= len(moved) / len(SESSIONS) <= 0.30, len(moved)
    assert sum(five[s] == "r4" for s in moved) >= 0.75 * len(moved)  # most movers went to the new replica
    modulo_moved = sum(zlib.crc32(s.encode()) % 4 != zlib.crc32(s.encode()) % 5 for s in SESSIONS)
    assert modulo_moved / len(SESSIONS) > 0.5  # the tolerance above would catch modulo hashing


def test_removing_a_replica_moves_little_beyond_its_own_sessions():
    four = place(SESSIONS, ["r0", "r1", "r2", "r3"], 0.25)
    three = place(SESSIONS, ["r0", "r1", "r3"], 0.25)
    must = [s for s in SESSIONS if four[s] == "r2"]
    moved = [s for s in SESSIONS if four[s] != three[s]]
    assert set(must) <= set(moved)
    assert len(moved) <= 1.1 * len(must)


@given(
    key=st.text(max_size=20),
    loads=st.lists(st.integers(0, 50), min_size=1, max_size=8),
    epsilon=st.floats(0, 2),
)
def test_the_chosen_replica_stays_within_the_bound(key, loads, epsilon):
    replicas = [ReplicaLoad(f"r{i}", load) for i, load in enumerate(loads)]
    chosen = next(r for r in replicas if r.id == pick(key, replicas, epsilon))
    assert chosen.load + 1 <= load_cap(sum(loads), len(loads), epsilon)
    # The order replicas are listed in changes nothing.
    assert pick(key, replicas[::-1], epsilon) == chosen.id


@given(
    keys=st.lists(st.sampled_from(["hot"] * 5 + [f"k{i}" for i in range(30)]), max_size=200),
    n=st.integers(1, 6),
    epsilon=st.floats(0, 1),
)
def test_no_replica_ever_exceeds_1_plus_epsilon_times_the_mean(keys, n, epsilon):
    # A hot key repeated many times is the case the bound is for.
    ids = [f"r{i}" for i in range(n)]
    load = dict.fromkeys(ids, 0)
    for placed, key in enumerate(keys, start=1):
        load[pick(key, [ReplicaLoad(r, load[r]) for r in ids], epsilon)] += 1
        assert max(load.values()) <= load_cap(placed - 1, n, epsilon)


@given(
    placed=st.lists(st.tuples(st.sampled_from(["hot"] * 5 + [f"k{i}" for i in range(30)]), st.integers(1, 16)),
                    max_size=100),
    n=st.integers(1, 6),
    epsilon=st.floats(0, 1),
)
def test_a_request_of_many_sequences_is_placed_within_the_bound_for_all_of_them(placed, n, epsilon):
    """An LLM request with n choices adds n to its replica's load: the bound counts all of them, wherever one
    replica can take them within it."""
    ids = [f"r{i}" for i in range(n)]
    load = dict.fromkeys(ids, 0)
    for key, adding in placed:
        cap = load_cap(sum(load.values()), n, epsilon, adding)
        chosen = pick(key, [ReplicaLoad(r, load[r]) for r in ids], epsilon, adding)
        if min(load.values()) + adding <= cap:
            assert load[chosen] + adding <= cap
        load[chosen] += adding
    top, other = ReplicaLoad("top", 5), ReplicaLoad("other", 3)
    key = next(k for k in SESSIONS if weight(k, "top") > weight(k, "other"))
    assert pick(key, [top, other], 0.25) == "top" and pick(key, [top, other], 0.25, adding=4) == "other"


def test_without_load_pressure_pick_is_plain_rendezvous():
    ids = [f"r{i}" for i in range(5)]
    for key in SESSIONS[:50]:
        assert pick(key, [ReplicaLoad(r, 0) for r in ids], 0.25) == max(ids, key=lambda r: weight(key, r))


def test_pick_rejects_bad_input_with_the_fix():
    with pytest.raises(ValueError, match="at least one replica"):
        pick("s", [], 0.25)
    with pytest.raises(ValueError, match="epsilon must be >= 0"):
        pick("s", [ReplicaLoad("r0", 0)], -0.5)


SYSTEM = "You are a support agent for Ember. " * 20  # 700 characters, more than the routed prefix


def chat(system, user):
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


def test_chats_sharing_a_long_system_prompt_share_a_key():
    a = prefix_key(prompt_text(chat(SYSTEM, "How do I deploy?")))
    b = prefix_key(prompt_text(chat(SYSTEM, "Why is my cold start slow?")))
    other = prefix_key(prompt_text(chat("You are a pirate. " * 40, "How do I deploy?")))
    assert a is not None and a == b and a != other
    replicas = [ReplicaLoad(f"r{i}", 0) for i in range(4)]
    assert pick(a, replicas) == pick(b, replicas)


def test_prefix_key_is_block_aligned_and_skips_prompts_too_short_to_matter():
    base = "x" * 130
    assert prefix_key(base + "a") == prefix_key(base + "b")  # both cut at 128
    assert prefix_key("y" + base[1:]) != prefix_key(base)
    assert prefix_key("short prompt") is None
    assert prefix_key(None) is None
    long = "z" * 600
    assert prefix_key(long + "tail one") == prefix_key(long + "a different tail")


def test_prompt_text_reads_completion_prompts_in_every_openai_shape():
    text = "The quick brown fox " * 10
    assert prompt_text({"prompt": text}) == text
    assert prompt_text({"prompt": [text, "second"]}) == text
    assert prompt_text({"prompt": [[1, 2, 3]]}) == "1 2 3"
    assert prompt_text({"prompt": [1, 2, 3]}) == "1 2 3"
    assert prompt_text({"prompt": []}) is None
    # A response's instructions and input route as the chat of the same conversation does.
    assert prompt_text({"instructions": SYSTEM, "input": "q"}) == prompt_text(chat(SYSTEM, "q"))
    items = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "q"}]
    assert prompt_text({"input": items}) == prompt_text(chat(SYSTEM, "q"))
    assert prompt_text({"input": 42}) is None and prompt_text({"input": {"role": "user"}}) is None
    # Chat content given as parts still renders, and the role matters.
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]}
    assert text in prompt_text(parts)
    assert prompt_text(chat(SYSTEM, "q")) != prompt_text({"messages": [{"role": "user", "content": SYSTEM}]})
