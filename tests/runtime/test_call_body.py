"""runtime/call_body.py: the one check of a call's body that the gateway and the worker share."""
import json

import pytest

from ember.runtime.call_body import BadCallBody, ResultNotJson, keyword_arguments, result_json


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


def test_results_are_encoded_as_a_web_framework_would():
    import dataclasses
    import datetime
    import decimal
    import enum
    import uuid

    import numpy
    import torch
    from pydantic import BaseModel

    class Size(enum.Enum):
        BIG = "big"

    class Item(BaseModel):
        name: str
        made: datetime.datetime

    @dataclasses.dataclass
    class Order:
        item: Item
        size: Size
        ids: set

    value = {"order": Order(Item(name="a", made=datetime.datetime(2026, 12, 1, 8, 30)), Size.BIG, {uuid.UUID(int=1)}),
             "price": decimal.Decimal("9.90"), "wait": datetime.timedelta(minutes=1), "pair": (1, 2),
             "scores": numpy.array([0.5, 1.5]), "count": numpy.int64(3), "logits": torch.tensor([[1.0, 2.0]])}
    assert json.loads(result_json(value)) == {
        "order": {"item": {"name": "a", "made": "2026-12-01T08:30:00"}, "size": "big",
                  "ids": ["00000000-0000-0000-0000-000000000001"]},
        "price": "9.90", "wait": 60.0, "pair": [1, 2], "scores": [0.5, 1.5], "count": 3, "logits": [[1.0, 2.0]]}


@pytest.mark.parametrize("value, says", [
    (float("nan"), "JSON has no NaN or infinity"), ({"x": [float("inf")]}, "JSON has no NaN or infinity"),
    (object(), "Object of type object is not JSON serializable: return plain data"),
    (b"raw", "Object of type bytes is not JSON serializable"),
    ((looped := []).append(looped) or looped, "contains itself"),
    ({"n": 10 ** 5000}, "an integer of more than 4300 digits, which Python will not write out as JSON: return it"),
])
def test_what_json_cannot_carry_is_named(value, says):
    with pytest.raises(ResultNotJson, match=says):
        result_json(value)
