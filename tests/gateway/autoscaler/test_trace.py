"""JSON-lines traces round-trip, and a bad line is named with its number."""
import pytest

from ember.gateway.autoscaler.trace import Request, read_jsonl, write_jsonl


def test_jsonl_round_trip_keeps_functions_and_sorts_by_time():
    trace = [Request(2.5, 100, 20, "b"), Request(1.0, 300, 40, "a")]
    back = read_jsonl(write_jsonl(trace).splitlines())
    assert back == sorted(trace, key=lambda r: r.t)


def test_a_bad_line_names_its_number_and_the_fields_wanted():
    with pytest.raises(
        ValueError, match=r"t.jsonl:2: want \{\"t\", \"function\", \"prompt_tokens\", \"output_tokens\"\}"
    ):
        read_jsonl(['{"t": 1, "function": "f", "prompt_tokens": 1, "output_tokens": 1}', '{"t": 2}'], "t.jsonl")
