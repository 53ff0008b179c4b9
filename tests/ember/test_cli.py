"""The `ember` command: help for every command, keys without a gateway, the quickstart curl."""
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hello.py"
COMMANDS = ["serve", "deploy", "run", "keys", "secrets", "limits", "status", "logs"]


def ember(*args: str, home: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ember.cli", *args], env=os.environ | {"EMBER_HOME": str(home)},
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("command", COMMANDS + ["keys create", "keys list", "keys revoke", "secrets set", "limits set"])
def test_every_command_has_help(command, tmp_path):
    result = ember(*command.split(), "--help", home=tmp_path)
    assert result.returncode == 0 and "usage: ember" in result.stdout
    assert len(result.stdout.splitlines()) > 3


def test_top_level_help_lists_commands(tmp_path):
    out = ember("--help", home=tmp_path).stdout
    assert all(re.search(rf"^\s+{c}\s", out, re.M) for c in COMMANDS + ["snapshot"])


def test_keys_work_on_the_database_without_a_gateway(tmp_path):
    created = ember("keys", "create", "--name", "alice", home=tmp_path)
    secret = created.stdout.split()[-1]
    assert secret.startswith("ek_") and "shown only this once" in created.stdout
    assert secret not in ember("keys", "list", home=tmp_path).stdout
    assert "alice" in ember("keys", "list", home=tmp_path).stdout
    assert ember("keys", "revoke", "alice", home=tmp_path).returncode == 0
    missing = ember("keys", "revoke", "alice", home=tmp_path)
    assert missing.returncode == 1 and "no live key" in missing.stderr


def test_keys_create_refuses_expiries_and_limits_no_key_could_have_and_list_survives_an_old_one(tmp_path):
    """`--expires nans` made a key that never expired, `--expires 99999999999999999999d` one that broke `ember keys
    list` for every key, and `--rpm` past 2**63 printed an OverflowError traceback."""
    import sqlite3

    for args, says in ((["--expires", "nans"], "must be positive and at most 3650d"),
                       (["--expires", "99999999999999999999d"], "must be positive and at most 3650d"),
                       (["--rpm", "99999999999999999999999"], "--rpm: 99999999999999999999999 is outside 1 to"),
                       (["--tpm", "0"], "--tpm: 0 is outside 1 to")):
        result = ember("keys", "create", "--name", "k", *args, home=tmp_path)
        assert result.returncode != 0 and says in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert ember("keys", "create", "--name", "k", "--expires", "3650d", home=tmp_path).returncode == 0
    with sqlite3.connect(tmp_path / "ember.db") as db:   # a key an earlier version let through
        db.execute("UPDATE api_keys SET expires = 1e20")
    listed = ember("keys", "list", home=tmp_path)
    assert listed.returncode == 0 and "expires never" in listed.stdout, listed.stderr


def test_status_without_a_gateway_says_what_to_do(tmp_path):
    result = ember("status", home=tmp_path)
    assert result.returncode == 1 and "ember serve" in result.stderr and "Traceback" not in result.stderr


def test_misspelt_setting_fails_at_load(tmp_path):
    app = tmp_path / "typo.py"
    app.write_text("import ember\napp = ember.App('t')\n\n@app.function(max_replica=2)\ndef f():\n    return 1\n")
    result = ember("run", f"{app}::f", home=tmp_path)
    assert result.returncode == 1
    assert "unknown argument 'max_replica' for @app.function; did you mean 'max_replicas'?" in result.stderr


@pytest.mark.parametrize("decorated, message", [
    ("@app.cls()\nclass C:\n    @ember.method\n    def m(self):\n        return 1\n",
     "use @ember.method() with parentheses"),
    ("@app.cls()\nclass C:\n    @ember.enter(snap='no')\n    def e(self):\n        pass\n",
     "@ember.enter(snap=...) is True or False; got 'no'"),
])
def test_a_misused_decorator_is_a_one_line_error_not_a_traceback(tmp_path, decorated, message):
    """The decorators' TypeErrors reached the CLI raw: `ember run` printed Python's traceback for a missing ()."""
    app = tmp_path / "misused.py"
    app.write_text("import ember\napp = ember.App('m')\n\n" + decorated)
    result = ember("run", f"{app}::C.m", home=tmp_path)
    assert result.returncode == 1 and message in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_run_calls_a_function_of_positional_only_parameters_by_name(tmp_path):
    """A call body names every argument, so `def f(a, /)` could never be called ("unknown argument 'a'")."""
    app = tmp_path / "positional.py"
    app.write_text("import ember\napp = ember.App('p')\n\n@app.function()\n"
                   "def f(a: int, b: int = 20, /, *, c: int = 0):\n    return [a, b, c]\n")
    assert json.loads(ember("run", f"{app}::f", "a=1", "c=3", home=tmp_path).stdout) == [1, 20, 3]
    assert json.loads(ember("run", f"{app}::f", "b=5", "a=1", home=tmp_path).stdout) == [1, 5, 0]
    missing = ember("run", f"{app}::f", "b=5", home=tmp_path)
    assert missing.returncode == 1 and "missing required argument 'a'; it takes (a, b, c)" in missing.stderr


def test_printed_curl_works_with_cacert(serve):
    served = serve(EXAMPLE, "--new-key", "quickstart")
    text = "".join(served.stdout)
    assert f"CA certificate: {served.ca}" in text
    curl = next(line.strip() for line in served.stdout if line.strip().startswith("curl --cacert"))
    result = subprocess.run(shlex.split(curl) + ["-sS", "-i"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr  # curl verified the certificate against ca.pem
    assert "x-ember-cold-start: node-warm" in result.stdout.lower()
    assert '{"result": 9.0}' in result.stdout


def test_snapshot_is_handed_to_the_snapshot_cli(tmp_path):
    result = ember("snapshot", "--help", home=tmp_path)
    assert result.returncode == 0 and "build" in result.stdout and "ls" in result.stdout


def test_deploy_a_second_app_to_the_running_gateway(serve):
    served = serve(EXAMPLE)
    other = Path(__file__).resolve().parents[1] / "gateway" / "apps" / "quick.py"
    deployed = served.cli("deploy", str(other), "--target", "local")
    assert "deployed app 'quick'" in deployed.stdout
    listed = json.loads(served.cli("status", "--json").stdout)  # the report GET /admin/status gives (served.status())
    assert set(listed["apps"]) == {"hello", "quick"}
    assert set(served.status()["apps"]) == {"hello", "quick"}
    with served.client(served.key()) as http:
        assert http.post("/quick/add", json={"a": 1, "b": 2}).json()["result"]["sum"] == 3
        # `sleepy` keeps an idle replica 30 s (`add` 1.5 s, less than a deploy can take on a busy machine)
        first = http.post("/quick/sleepy", json={"seconds": 0})
        again = served.cli("deploy", str(other))  # the code already live: nothing changes (test_versions.py has more)
        assert "deployed app 'quick' version 1" in again.stdout
        second = http.post("/quick/sleepy", json={"seconds": 0})
        assert first.status_code == second.status_code == 200, (first.text, second.text)
        assert second.headers["x-ember-replica"] == first.headers["x-ember-replica"]
    aws = served.cli(
        "deploy", str(other), "--target", "aws", check=False
    )  # tests/gateway/test_deploy_aws.py deploys for real
    assert aws.returncode == 1 and "--target aws needs EMBER_AWS_BUCKET" in aws.stderr


def test_run_prints_a_generators_values_and_its_error(tmp_path):
    generators = Path(__file__).resolve().parents[1] / "runtime" / "apps" / "generators.py"
    result = ember("run", f"{generators}::fails_after", "n=3", home=tmp_path)
    assert result.returncode == 1
    assert result.stdout.splitlines() == ["0", "1", "2"]
    assert "error: function_error: ValueError: ran out after 3" in result.stderr and "Traceback" not in result.stderr


def test_run_takes_values_json_cannot_carry_as_text_and_refuses_a_name_given_twice(tmp_path):
    """NaN, Infinity and 1e999 parse as Python JSON but cannot be sent: the call failed with "Out of range float
    values are not JSON compliant". A repeated name silently took the last value."""
    app = tmp_path / "echo.py"
    app.write_text("import ember\napp = ember.App('e')\n\n@app.function()\ndef echo(x):\n    return x\n")
    for value in ("NaN", "1e999", "[1, -Infinity]"):
        result = ember("run", f"{app}::echo", f"x={value}", home=tmp_path)
        assert result.returncode == 0 and result.stdout.strip() == json.dumps(value), result.stderr
    assert json.loads(ember("run", f"{app}::echo", "x=[1, 2.5]", home=tmp_path).stdout) == [1, 2.5]
    twice = ember("run", f"{app}::echo", "x=1", "x=2", home=tmp_path)
    assert twice.returncode == 2 and "argument 'x' is given twice" in twice.stderr and "Traceback" not in twice.stderr
    deep = ember("run", f"{app}::echo", "x=" + "[" * 100_000, home=tmp_path)
    assert deep.returncode == 2 and "the value of 'x' is JSON nested deeper" in deep.stderr, deep.stderr


SLOW_APP = Path(__file__).resolve().parents[1] / "gateway" / "apps" / "slow.py"


def test_run_of_a_failing_function_prints_the_users_traceback(tmp_path):
    result = ember("run", f"{SLOW_APP}::boom", "x=3", home=tmp_path)
    assert result.returncode == 1
    err = result.stderr
    assert err.startswith("Traceback (most recent call last):\n"), err
    assert f'File "{SLOW_APP}", line 17, in boom\n    return divide(x)' in err  # the user's file, line and source
    assert f'File "{SLOW_APP}", line 21, in divide\n    return x // 0' in err
    assert "<dynamic-code>" not in err and "worker.py" not in err and "concurrent" not in err
    assert err.rstrip().endswith("error: function_error: ZeroDivisionError: integer division or modulo by zero")



@pytest.mark.parametrize("command", ["deploy", "run", "serve"])
def test_an_app_file_that_fails_to_import_is_reported_at_the_users_line_without_embers_frames(command, tmp_path):
    app = tmp_path / "broken.py"
    app.write_text("import ember\napp = ember.App('broken')\n\ndef helper():\n    return {}['model']\n\nhelper()\n")
    target = {"run": f"{app}::f"}.get(command, str(app))
    result = ember(command, target, *(["--port", "0"] if command == "serve" else []), home=tmp_path)
    assert result.returncode == 1
    assert result.stderr.startswith(f"error: importing {app} failed:\n"), result.stderr
    assert f'File "{app}", line 7, in <module>\n    helper()' in result.stderr
    assert f'File "{app}", line 5, in helper\n    return {{}}[\'model\']' in result.stderr
    assert result.stderr.rstrip().endswith("KeyError: 'model'")
    assert "Traceback" not in result.stderr and "importlib" not in result.stderr and "ember/" not in result.stderr

    app.write_text("import ember\napp = ember.App('broken')\ndef f(:\n")
    result = ember(command, target, *(["--port", "0"] if command == "serve" else []), home=tmp_path)
    assert result.returncode == 1 and f'File "{app}", line 3' in result.stderr and "SyntaxError" in result.stderr
    not_python = tmp_path / "notes.txt"
    not_python.write_text("hello\n")
    result = ember(command, {"run": f"{not_python}::f"}.get(command, str(not_python)), home=tmp_path)
    assert result.returncode == 1 and result.stderr == (
        f"error: {not_python} is not a Python file: give the .py file that defines the ember.App\n")


def test_a_module_level_object_that_cannot_be_shipped_is_named_with_the_fix(tmp_path):
    app = tmp_path / "locked.py"
    app.write_text("import threading\nimport ember\n\nguard = threading.Lock()\napp = ember.App('locked')\n\n"
                   "@app.function()\ndef f() -> int:\n    with guard:\n        return 1\n")
    result = ember("run", f"{app}::f", home=tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith(
        "error: app 'locked' cannot be packaged: locked.guard: cannot pickle '_thread.lock'")
    assert "@ember.enter() hook" in result.stderr

@pytest.mark.parametrize("args, says", [
    (["--port", "99999"], "99999 is not a port number: use 0 to 65535"),
    (["--port", "-1"], "-1 is not a port number"),
    (["--port", "http"], "'http' is not a port number"),
    (["--host", "999.1.1.1", "--port", "0"], "cannot listen on --host 999.1.1.1"),
])
def test_a_port_or_host_that_cannot_be_listened_on_is_named_without_a_traceback(args, says, tmp_path):
    result = ember("serve", str(EXAMPLE), *args, home=tmp_path)
    assert result.returncode != 0 and says in result.stderr + result.stdout
    assert "Traceback" not in result.stderr + result.stdout


def test_a_bad_app_name_is_refused_the_same_way_by_run_and_serve(tmp_path):
    app = tmp_path / "bad.py"
    app.write_text("import ember\napp = ember.App('Bad_Name')\n\n@app.function()\ndef f() -> int:\n    return 1\n")
    ran, served = ember("run", f"{app}::f", home=tmp_path), ember("serve", str(app), "--port", "0", home=tmp_path)
    assert ran.returncode == served.returncode == 1
    assert ran.stderr == served.stderr
    assert ran.stderr.startswith("error: app name 'Bad_Name' must be") and "ember.App('bad_name')" in ran.stderr


def test_output_cut_short_by_head_ends_quietly(tmp_path):
    from ember.gateway.keys import KeyStore

    store = KeyStore(tmp_path / "ember.db")
    for n in range(1500):  # ~200 KB of listing: more than a pipe holds, so the writer meets the closed pipe
        store.create(f"key-{n}")
    piped = subprocess.run(["bash", "-c", f"{shlex.quote(sys.executable)} -m ember.cli keys list | head -1; "
                                          "echo status=${PIPESTATUS[0]}"],
                           env=os.environ | {"EMBER_HOME": str(tmp_path)}, capture_output=True, text=True, timeout=60)
    assert piped.stdout.splitlines()[-1] == "status=0" and "key-0" in piped.stdout
    assert piped.stderr == ""  # no BrokenPipeError, no "Exception ignored"


def test_logs_show_a_replicas_control_characters_instead_of_sending_them_to_the_terminal():
    """What a replica prints may carry a caller's text: an escape sequence in it retitled or cleared the terminal
    of whoever ran `ember logs`."""
    from ember.cli.status import log_line, terminal_safe

    shown = log_line({"app": "a", "function": "f", "replica": "f-1", "msg": "hi\x1b]0;pwned\x07 \x1b[2J\x9b2J\rx"})
    assert shown == "[a/f f-1] hi\\x1b]0;pwned\\x07 \\x1b[2J\\x9b2J\\x0dx"
    assert terminal_safe("line\r\nnext\ttab\n") == "line\nnext\ttab\n"   # text as written stays as it was
    assert terminal_safe("naïve 日本 🙂") == "naïve 日本 🙂"
