"""Packages: content-hashed, and a fresh process starts from the package alone."""
import json
import os
import subprocess
import sys
import textwrap

from ember.home import Home
from ember.package import build, load_app, read_manifest


def test_a_fresh_process_runs_the_app_from_the_package_alone(tmp_path):
    source = tmp_path / "user_code" / "scorer.py"
    source.parent.mkdir()
    source.write_text(textwrap.dedent('''
        import ember
        from helper_not_on_path import OFFSET  # noqa: F401 - resolved at load, captured by value

        app = ember.App("scorer")
        WEIGHTS = {"a": 2}

        @app.function(max_replicas=3)
        def score(word: str) -> int:
            return WEIGHTS.get(word, 0) + OFFSET
    '''))
    (source.parent / "helper_not_on_path.py").write_text("OFFSET = 40\n")
    sys.path.insert(0, str(source.parent))
    try:
        package = build(load_app(source), Home(tmp_path / "home"))
    finally:
        sys.path.remove(str(source.parent))
    assert package.parent == tmp_path / "home" / "packages" and len(package.stem) == 64
    manifest = read_manifest(package)
    assert manifest["app"] == "scorer" and manifest["source"] == "scorer.py"
    assert manifest["units"]["score"]["spec"]["max_replicas"] == 3

    source.unlink()  # nothing of the user's folder is needed any more
    (source.parent / "helper_not_on_path.py").unlink()
    code = ("import json, sys; from ember.package import unpack; app = unpack(sys.argv[1]); "
            "print(json.dumps(app.units['score'].fn('a')))")
    result = subprocess.run([sys.executable, "-c", code, str(package)], capture_output=True, text=True,
                            cwd="/", env=os.environ, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == 42


def test_same_app_same_package(tmp_path):
    source = tmp_path / "same.py"
    source.write_text("import ember\napp = ember.App('same')\n\n@app.function()\ndef f() -> int:\n    return 1\n")
    home = Home(tmp_path / "home")
    first = build(load_app(source), home)
    assert build(load_app(source), home) == first
    source.write_text(source.read_text().replace("return 1", "return 2"))
    assert build(load_app(source, "same"), home) != first


def test_same_app_same_package_in_every_process(tmp_path):
    """Classes pickled by value and the spec's pickled state must not depend on the process (hash seed, uuids)."""
    source = tmp_path / "classy.py"
    source.write_text(textwrap.dedent("""\
        import ember
        app = ember.App("classy")

        class Helper:
            pass

        @app.cls(max_replicas=2, env={"A": "1"}, secrets=["s"])
        class Model:
            @ember.enter()
            def load(self):
                self.helper = Helper()

            @ember.method()
            def run(self) -> int:
                return 1
        """))
    code = ("import sys; from ember.home import Home; from ember.package import build, load_app; "
            "print(build(load_app(sys.argv[1]), Home(sys.argv[2])).name)")
    names = set()
    for seed in ("1", "2", "3"):
        result = subprocess.run([sys.executable, "-c", code, str(source), str(tmp_path / f"home{seed}")],
                                capture_output=True, text=True, env=os.environ | {"PYTHONHASHSEED": seed}, timeout=60)
        assert result.returncode == 0, result.stderr
        names.add(result.stdout.strip())
    assert len(names) == 1, names


def test_a_module_level_fastapi_app_unpacks_in_a_fresh_process(tmp_path):
    """The pattern Modal's docs use: `web = FastAPI()` at module level, returned by the asgi_app method. Starlette's
    State in it unpickled into a RecursionError, so the replica's import failed."""
    source = tmp_path / "webapp.py"
    source.write_text(textwrap.dedent('''
        from fastapi import FastAPI

        import ember

        web = FastAPI()
        web.state.greeting = "hello"
        app = ember.App("webapp")

        @web.get("/v1/hi")
        async def hi() -> dict:
            return {"said": web.state.greeting}

        @app.cls()
        class Api:
            @ember.asgi_app()
            def serve(self):
                return web
    '''))
    package = build(load_app(source), Home(tmp_path / "home"))
    source.unlink()
    code = ("import sys; from fastapi.testclient import TestClient; from ember.package import unpack; "
            "app = unpack(sys.argv[1]); api = app.units['Api'].user_cls(); "
            "print(TestClient(api.serve()).get('/v1/hi').text)")
    result = subprocess.run([sys.executable, "-c", code, str(package)], capture_output=True, text=True,
                            cwd="/", env=os.environ, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout) == {"said": "hello"}
