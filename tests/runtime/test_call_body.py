"""runtime/call_body.py: the one check of a call's body that the gateway and the worker share."""
import pytest

from ember.runtime.call_body import BadCallBody, keyword_arguments


def test_an_object_is_the_arguments_and_an_empty_body_is_none():
    assert keyword_arguments(b'{"x": 1}') == {"x": 1}
    assert keyword_arguments(b"") == {}


@pytest.mark.parametrize("body, status, kind", [
    (b"{nope", 400, "invalid_json"), (b"[" * 100_000, 400, "invalid_json"),
    (b"[1, 2]", 422, "invalid_arguments"), (b'"x"', 422, "invalid_arguments"),
    (b'{"x": NaN}', 400, "invalid_json"), (b'{"x": -Infinity}', 400, "invalid_json"),
    (b'{"x": [1e400]}', 400, "invalid_json")])
def test_what_is_not_an_object_of_arguments_is_refused_with_its_status(body, status, kind):
    with pytest.raises(BadCallBody) as refused:
        keyword_arguments(body)
    assert (refused.value.status, refused.value.type) == (status, kind)
    assert len(refused.value.message) < 300


def test_json_numbers_keep_their_values():
    assert keyword_arguments(b'{"a": 1e308, "b": -2.5e-300, "c": 10000000000000000000000, "d": 0.1}') == {
        "a": 1e308, "b": -2.5e-300, "c": 10**22, "d": 0.1}
