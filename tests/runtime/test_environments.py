"""Per-function requirements (runtime/environments.py): installed once into a cached environment at deploy time,
seen by that function's replicas (spawned and forked) and by no other function."""
import base64
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from ember.home import Home
from ember.runtime import environments


def make_wheel(folder: Path, name: str = "ember_probe", version: str = "0.1", value: int = 42,
               requires_python: str | None = None) -> Path:
    """A pure-Python wheel built by hand (no build backend, no network): `import NAME` gives NAME.VALUE."""
    dist = f"{name}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n"
    if requires_python:
        metadata += f"Requires-Python: {requires_python}\n"
    files = {f"{name}/__init__.py": f"VALUE = {value}\n", f"{dist}/METADATA": metadata,
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: ember-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = [f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).decode().rstrip('=')},"
              f"{len(text.encode())}" for path, text in files.items()] + [f"{dist}/RECORD,,"]
    files[f"{dist}/RECORD"] = "\n".join(record) + "\n"
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
    return wheel


APP = '''
import sys

import ember

app = ember.App("deps")


@app.function(requirements=[{wheel!r}], scaledown_window=30)
def uses() -> dict:
    import ember_probe

    return {{"value": ember_probe.VALUE, "python": sys.executable}}


@app.function(scaledown_window=30)
def plain() -> dict:
    try:
        import ember_probe  # noqa: F401
    except ImportError:
        return {{"sees_it": False, "python": sys.executable}}
    return {{"sees_it": True, "python": sys.executable}}
'''


def test_a_function_imports_its_own_requirement_and_another_does_not_see_it(serve, tmp_path):
    wheel = make_wheel(tmp_path / "wheels")
    (tmp_path / "app.py").write_text(APP.format(wheel=str(wheel)))
    served = serve(tmp_path / "app.py", timeout=180)
    banner = "".join(served.stdout)
    assert "requirements of uses:" in banner and "Successfully installed ember-probe-0.1" in banner
    with served.client(served.key(), timeout=60) as http:
        uses = http.post("/deps/uses", json={})
        plain = http.post("/deps/plain", json={})
    assert uses.status_code == 200, uses.text
    assert uses.json()["result"]["value"] == 42
    assert uses.json()["result"]["python"].startswith(str(served.home / "envs"))
    assert plain.json()["result"] == {"sees_it": False, "python": sys.executable}
    assert "start=fork" in uses.headers["x-ember-start-breakdown"]  # from the fork server of its environment

    # The gateway process itself never saw the requirement either.
    assert subprocess.run([sys.executable, "-c", "import ember_probe"], capture_output=True).returncode != 0

    # A deploy whose requirement cannot install fails before anything changes: in the CLI, and in the gateway.
    broken = make_wheel(tmp_path / "broken", name="ember_broken", requires_python=">=4")
    (tmp_path / "broken.py").write_text(APP.format(wheel=str(broken)).replace('"deps"', '"broken"'))
    refused = served.cli("deploy", str(tmp_path / "broken.py"), check=False)
    assert refused.returncode == 1 and "requires a different Python" in refused.stderr, refused.stderr
    from ember.package import build, load_app

    package = build(load_app(tmp_path / "broken.py"), Home(served.home))
    with served.client(served.key(admin=True), timeout=120) as admin:
        reply = admin.post("/admin/deploy", json={"package": str(package)})
    assert reply.status_code == 422 and reply.json()["error"]["type"] == "requirements_failed", reply.text
    assert "requires a different Python" in reply.json()["error"]["message"]
    assert "broken" not in served.status()["apps"]


def test_a_failed_install_fails_the_deploy_with_pips_reason(tmp_path):
    wheel = make_wheel(tmp_path / "wheels", requires_python=">=4")
    (tmp_path / "app.py").write_text(APP.format(wheel=str(wheel)))
    done = subprocess.run([sys.executable, "-m", "ember.cli", "serve", str(tmp_path / "app.py"), "--port", "0"],
                          env=os.environ | {"EMBER_HOME": str(tmp_path / "home")}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1
    assert "error: installing" in done.stderr and "requires a different Python" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert not list((tmp_path / "home" / "envs").glob("*/bin")), "a failed environment was left behind"


def test_an_environment_is_installed_once_and_keyed_by_its_content(tmp_path):
    home = Home(tmp_path / "home")
    wheel = make_wheel(tmp_path / "wheels")
    assert environments.python_for([str(wheel)], home) is None
    lines: list[str] = []
    python = environments.ensure([str(wheel)], lines.append, home)
    assert environments.python_for([str(wheel)], home) == python
    probe = "import ember, ember_probe, fastapi; print(ember_probe.VALUE)"  # its own package, and the shared ones
    assert subprocess.run([python, "-c", probe], capture_output=True, text=True).stdout.strip() == "42"
    again: list[str] = []
    assert environments.ensure([str(wheel)], again.append, home) == python and again == []  # cached
    assert any("installing" in line for line in lines)

    make_wheel(tmp_path / "wheels", value=7)  # same path, new content: a new environment
    assert environments.python_for([str(wheel)], home) is None
    other = environments.ensure([str(wheel)], None, home)
    assert other != python
    assert subprocess.run([other, "-c", probe], capture_output=True, text=True).stdout.strip() == "7"


@pytest.mark.parametrize("lines, summary", [
    (["Processing /x.whl", "ERROR: Package 'x' requires a different Python: 3.11.7 not in '>=4'"],
     "ERROR: Package 'x' requires a different Python: 3.11.7 not in '>=4'"),
    (["Resolved 1 package", "  error: Failed to fetch: `https://pypi.org/simple/x/`"],
     "error: Failed to fetch: `https://pypi.org/simple/x/`"),
    (["a", "b", "c", "d"], "b | c | d"),
])
def test_an_install_failure_is_summarised_by_its_error_lines(lines, summary):
    assert environments.summarise(lines) == summary


def test_requirements_are_checked_when_the_app_loads(tmp_path):
    import ember
    from ember.spec import SpecError

    with pytest.raises(SpecError, match=r"requirements\[0\]: no file or folder at .*missing"):
        ember.App("x", requirements=[str(tmp_path / "missing")])
    app = ember.App("x", requirements=["numpy>=1"])
    with pytest.raises(SpecError, match="is not a pip requirement"):
        app.function(requirements=["not a requirement!"])

    def f():
        return 1

    unit = app.function(requirements=[str(tmp_path)])(f)
    assert unit.spec.requirements == ["numpy>=1", str(tmp_path)]  # the app's first, then the function's own
    assert app.manifest()["units"]["f"]["spec"]["requirements"] == ["numpy>=1", str(tmp_path)]
