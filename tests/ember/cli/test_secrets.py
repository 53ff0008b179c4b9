"""`ember secrets` against a running gateway: set, list, rm, and a deploy refused while a secret it needs is unset."""
from pathlib import Path

import pytest

APPS = Path(__file__).resolve().parents[2] / "gateway" / "apps"


@pytest.fixture(scope="module")
def served(serve_module):
    return serve_module(APPS / "quick.py")


def test_a_deploy_needing_an_unset_secret_fails_at_once_and_names_the_command(served):
    refused = served.cli("deploy", str(APPS / "secretive.py"), check=False)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert "ember secrets set ember-test-token KEY=VALUE" in refused.stderr, refused.stderr
    assert "secretive" not in served.client(served.key(admin=True)).get("/readyz").json()["apps"]

    served.cli("secrets", "set", "ember-test-token", "TEST_TOKEN=s3cr=t", "OTHER=1")
    served.cli("deploy", str(APPS / "secretive.py"))
    with served.client(served.key()) as http:
        assert http.post("/secretive/token", json={}).json()["result"] == "s3cr=t"


def test_set_list_and_remove_round_trip_without_showing_values(served):
    served.cli("secrets", "set", "db", "PASSWORD=hunter2", "USER=me")
    (secret_file,) = (served.home / "secrets").glob("db.env")
    assert secret_file.stat().st_mode & 0o077 == 0, "readable by other users"
    listed = served.cli("secrets", "list").stdout
    assert "db" in listed and "PASSWORD, USER" in listed and "hunter2" not in listed

    served.cli("secrets", "set", "db", "PASSWORD=changed")
    assert secret_file.read_text() == "PASSWORD=changed\n"
    served.cli("secrets", "rm", "db")
    assert "db " not in served.cli("secrets", "list").stdout
    again = served.cli("secrets", "rm", "db", check=False)
    assert again.returncode == 1 and "404 not_found" in again.stderr and "ember secrets list" in again.stderr


@pytest.mark.parametrize("args, message", [
    (["set", "x", "NOEQUALS"], "is not KEY=VALUE"),
    (["set", "x", "1BAD=v"], "environment variable names"),
    (["set", "../escape", "A=b"], "secret names match"),
])
def test_bad_input_is_refused_with_the_rule(served, args, message):
    result = served.cli("secrets", *args, check=False)
    assert result.returncode == 1 and message in result.stderr and "Traceback" not in result.stderr
    assert not list(served.home.glob("**/escape*"))


def test_a_value_that_is_not_utf8_text_is_a_400_not_a_500(served):
    """A JSON string may escape a lone surrogate ("\\ud800"), which no environment can hold."""
    with served.client(served.key(admin=True)) as http:
        answer = http.put("/admin/secrets/lone", content=b'{"values": {"K": "\\ud800"}}',
                          headers={"Content-Type": "application/json"})
    assert answer.status_code in (400, 422), answer.text
    assert answer.json()["error"]["type"] in ("invalid_secret", "invalid_request"), answer.text
    assert not list((served.home / "secrets").glob("lone*"))
