"""JSON-lines traces round-trip, and a bad line is named with its number."""
import pytest

from ember.gateway.autoscaler.trace import Request, read_jsonl, write_jsonl


def test_jsonl_round_trip_keeps_functions_and_sorts_by_time():
    trace = [Request(2.5, 100, 20, "b"), Request(0.5, 300, 40, "a")]
    back = read_jsonl(write_jsonl(trace).splitlines())
    assert back == sorted(trace, key=lambda r: r.t)


def test_a_bad_line_names_its_number_and_the_fields_wanted():
    with pytest.raises(
        ValueError, match=r"t.jsonl:2: want \{\"t\", \"function\", \"prompt_tokens\", \"output_tokens\"\}"
    ):
        read_jsonl(['{"t": 1, "function": "f", "prompt_tokens": 1, "output_tokens": 1}', '{"t": 2}'], "t.jsonl")


LINE = '{{"t": {t}, "function": {function}, "prompt_tokens": {prompt}, "output_tokens": {output}}}'


def line(t="1", function='"f"', prompt="10", output="5") -> str:
    return LINE.format(t=t, function=function, prompt=prompt, output=output)


@pytest.mark.parametrize("bad, field", [
    (line(t="NaN"), "t must be a finite number"), (line(t="Infinity"), "t must be a finite number"),
    (line(t='"3"'), "t must be a finite number"), (line(t="true"), "t must be a finite number"),
    (line(prompt="-1"), "prompt_tokens must be a whole number"), (line(output="2.5"), "output_tokens must be"),
    (line(prompt="1e300"), "prompt_tokens must be a whole number from 0 to 1,000,000"),
    (line(output="null"), "output_tokens must be"), (line(function="5"), "function must be a non-empty string"),
    (line(function='""'), "function must be a non-empty string"), ("[1, 2]", "a line must be a JSON object"),
])
def test_a_value_no_replay_could_run_is_named(bad, field):
    """Before, a NaN time, a count of 1e300 tokens or a negative one were taken as they were: the replay ran
    forever (NaN, 1e300) or simulated a request of negative length."""
    with pytest.raises(ValueError, match="t.jsonl:2: .*" + field):
        read_jsonl([line(), bad], "t.jsonl")


def test_an_empty_trace_is_an_error_not_a_replay_of_nothing():
    with pytest.raises(ValueError, match="t.jsonl: no requests"):
        read_jsonl(["", "  "], "t.jsonl")


def test_times_count_from_the_first_requests_whole_second():
    """A trace of Unix timestamps replays from its first request (before, a replay simulated the 1.7e9 seconds
    before it, tick by tick); a trace that starts within its first second keeps its times."""
    unix = read_jsonl([line(t="1764650000.25"), line(t="1764650003.75", function='"g"')])
    assert [(r.t, r.function) for r in unix] == [(0.25, "f"), (3.75, "g")]
    assert [r.t for r in read_jsonl([line(t="0.4"), line(t="2")])] == [0.4, 2.0]
    assert [r.t for r in read_jsonl([line(t="-5"), line(t="-2.5")])] == [0.0, 2.5]


def test_a_trace_spanning_more_than_a_week_is_named_not_replayed_for_ever():
    """Times 1e12 s apart (a stray timestamp, milliseconds read as seconds) had the replay step every policy tick
    through them: it never ended."""
    week = read_jsonl([line(t="100"), line(t=str(100 + 7 * 86400))])
    assert week[-1].t == 7 * 86400
    with pytest.raises(ValueError, match=r"t.jsonl: its requests span 1,000,000,000,005 s \(t -5 to 1e\+12\), over a "
                                         r"week .*t is in seconds"):
        read_jsonl([line(t="-5"), line(t="1e12")], "t.jsonl")
