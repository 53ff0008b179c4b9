"""`ember limits` against a running gateway: get and set round trips, and a typo in the body refused, not applied."""
from pathlib import Path

import pytest

APPS = Path(__file__).resolve().parents[2] / "gateway" / "apps"


@pytest.fixture(scope="module")
def served(serve_module):
    return serve_module(APPS / "quick.py")


def test_set_changes_only_the_limits_given_and_get_shows_them(served):
    assert served.cli("limits", "get", "quick").stdout.strip() == "app quick: rpm=off, tpm=off, concurrency=off"
    assert "rpm=2, tpm=off, concurrency=4" in served.cli("limits", "set", "quick", "--rpm", "2", "--concurrency",
                                                         "4").stdout
    assert "rpm=2, tpm=900, concurrency=4" in served.cli("limits", "set", "quick", "--tpm", "900").stdout
    assert "rpm=off, tpm=900, concurrency=4" in served.cli("limits", "set", "quick", "--rpm", "off").stdout

    served.cli("limits", "set", "quick", "--rpm", "2")
    with served.client(served.key()) as http:
        codes = [http.post("/quick/add", json={"a": 1, "b": 2}).status_code for _ in range(3)]
    assert codes == [200, 200, 429]


def test_a_typo_in_the_body_is_refused_and_the_limits_stay(served):
    served.cli("limits", "set", "quick", "--concurrency", "7")
    with served.client(served.key("admin", admin=True)) as admin:
        typo = admin.put("/admin/apps/quick/limits", json={"rpn": 5})
        assert typo.status_code == 400
        assert typo.json()["error"] == {"type": "unknown_field", "message": "unknown field 'rpn' in the request "
                                        "body; did you mean 'rpm'? fields are rpm, tpm, concurrency"}
        assert admin.get("/admin/apps/quick/limits").json()["concurrency"] == 7


def test_limits_of_an_app_not_deployed_are_kept_and_the_reply_says_so(served):
    """A typo in the app's name would limit nothing: the CLI says which apps are deployed."""
    out = served.cli("limits", "set", "quik", "--rpm", "5").stdout
    assert "app quik: rpm=5" in out and "no app named 'quik' is deployed on this gateway (deployed: quick)" in out
    assert "rpm=5" in served.cli("limits", "get", "quik").stdout   # kept, for a later deploy of that name
    assert "no app named" not in served.cli("limits", "set", "quick", "--tpm", "901").stdout


@pytest.mark.parametrize("args, message", [
    (["set", "quick"], "give at least one of --rpm"),
    (["set", "quick", "--rpm", "0"], "must be at least 1"),
    (["get", "Bad..Name"], "app names match"),
])
def test_bad_input_says_what_is_wanted(served, args, message):
    result = served.cli("limits", *args, check=False)
    assert result.returncode != 0 and message in result.stderr and "Traceback" not in result.stderr
