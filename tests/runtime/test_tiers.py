"""The cold-start tier of a replica start, and the breakdown header."""
from ember.runtime.tiers import Tier, breakdown_header, start_tier


def test_the_tier_follows_where_the_start_found_its_state():
    assert start_tier() == Tier.NODE_WARM  # package on this node, no weights: a function or a plain class
    assert start_tier(weights="snapshot") == Tier.NODE_WARM
    assert start_tier(weights="snapshot", pulled=True) == Tier.NODE_COLD
    assert start_tier(pulled=True) == Tier.NODE_COLD
    assert start_tier(weights="full") == Tier.FULL_BOOT  # nothing to restore from, wherever the package came from
    assert start_tier(weights="full", pulled=True) == Tier.FULL_BOOT


def test_tiers_are_named_as_the_ladder_names_them():
    assert [(t.rung, str(t)) for t in Tier] == [("T0", "hot"), ("T1", "parked"), ("T2", "node-warm"),
                                                ("T3", "node-cold"), ("T4", "full-boot")]
    assert f"{Tier.NODE_WARM}; ms=5" == "node-warm; ms=5"


def test_a_breakdown_header_stays_one_list_of_key_value_pairs():
    header = breakdown_header({"start": "spawn", "fallback": "hooks left threads (a, b), which\nfork", "total_ms": 9})
    assert header == "start=spawn, fallback=hooks left threads (a; b); which fork, total_ms=9"
    assert dict(part.split("=", 1) for part in header.split(", "))["total_ms"] == "9"
