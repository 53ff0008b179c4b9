"""The five client limits: `ember serve` flags over environment variables over defaults, each checked, a bad one
refused by the CLI in one line naming where it came from."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ember.gateway.client_limits import ClientLimits

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hello.py"
ENV = ("EMBER_HEADER_TIMEOUT", "EMBER_MAX_CONNECTIONS", "EMBER_BODY_TIMEOUT", "EMBER_BODY_BUDGET", "EMBER_SEND_TIMEOUT")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


def test_defaults_then_environment_then_flags(monkeypatch):
    assert ClientLimits.resolve() == ClientLimits(10.0, None, 60.0, 256 << 20, 60.0)
    monkeypatch.setenv("EMBER_HEADER_TIMEOUT", "3.5")
    monkeypatch.setenv("EMBER_MAX_CONNECTIONS", "1000")
    monkeypatch.setenv("EMBER_BODY_TIMEOUT", "20")
    monkeypatch.setenv("EMBER_BODY_BUDGET", str(64 << 20))  # bytes, as before the flags
    monkeypatch.setenv("EMBER_SEND_TIMEOUT", "30")
    assert ClientLimits.resolve() == ClientLimits(3.5, 1000, 20.0, 64 << 20, 30.0)
    assert ClientLimits.resolve(header_timeout="1", max_connections="50", body_timeout="2",
                                body_budget="1GiB", send_timeout="5") == ClientLimits(1.0, 50, 2.0, 1 << 30, 5.0)


@pytest.mark.parametrize("name, text, says", [
    ("header_timeout", "0", "--header-timeout '0' is not valid: give seconds > 0"),
    ("header_timeout", "inf", "--header-timeout 'inf' is not valid"),
    ("max_connections", "1.5", "--max-connections '1.5' is not valid: give a whole number >= 1"),
    ("body_timeout", "-1", "--body-timeout '-1' is not valid"),
    ("body_budget", "1MiB", "--body-budget '1MiB' is not valid: give a size >= 16MiB"),
    ("body_budget", "lots", "--body-budget 'lots' is not valid"),
    ("send_timeout", "0", "--send-timeout '0' is not valid: give seconds > 0"),
])
def test_a_bad_flag_is_refused_naming_it(name, text, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(")):
        ClientLimits.resolve(**{name: text})


def test_a_bad_environment_variable_is_refused_naming_it(monkeypatch):
    monkeypatch.setenv("EMBER_BODY_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="EMBER_BODY_TIMEOUT 'soon' is not valid: give seconds > 0"):
        ClientLimits.resolve()
    assert ClientLimits.resolve(body_timeout="5").body_timeout == 5  # a flag overrides it


def test_ember_serve_refuses_a_bad_limit_in_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "ember.cli", "serve", str(EXAMPLE), "--port", "0",
                             "--max-connections", "none"], env=os.environ | {"EMBER_HOME": str(tmp_path)},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr == "error: --max-connections 'none' is not valid: give a whole number >= 1, e.g. 10000\n"
    assert not (tmp_path / "gateway.json").exists()  # refused before anything started
