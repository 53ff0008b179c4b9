"""App, Cls and hooks: what a class declares, the order its enter hooks run, and the manifest."""
import pytest

import ember
from ember.spec import SpecError


def make_app(calls: list):
    app = ember.App("demo")

    @app.function(max_replicas=2)
    def double(x: int, scale: float = 1.0) -> float:
        return 2 * x * scale

    @app.cls(max_concurrency=2)
    class Model:
        @ember.enter(snap=False)
        def connect(self):
            calls.append("connect")

        @ember.enter(snap=True)
        def load(self):
            calls.append("load")

        @ember.method()
        def predict(self, text: str) -> str:
            return text.upper()

        @ember.exit()
        def close(self):
            calls.append("close")

    return app, double, Model


def test_snap_hooks_run_before_the_others_and_exit_hooks_on_stop():
    calls = []
    app, _, Model = make_app(calls)
    assert Model.enter_hooks == ["load", "connect"]
    obj = Model.start()
    assert calls == ["load", "connect"]
    Model.stop(obj)
    assert calls == ["load", "connect", "close"]


def test_manifest_describes_routes_and_settings():
    app, _, _ = make_app([])
    manifest = app.manifest()
    assert manifest["app"] == "demo"
    assert manifest["units"]["double"]["methods"] == ["double"]
    assert manifest["units"]["double"]["params"] == {"double": {"x": "int"}}
    assert manifest["units"]["double"]["spec"]["max_replicas"] == 2
    assert manifest["units"]["Model"] | {"spec": None, "schemas": None} == {
        "kind": "class", "methods": ["predict"], "params": {"predict": {"text": "str"}}, "asgi": False, "spec": None,
        "schemas": None}
    double = manifest["units"]["double"]["schemas"]["double"]
    assert double["arguments"]["properties"] == {"x": {"title": "X", "type": "integer"},
                                                  "scale": {"default": 1.0, "title": "Scale", "type": "number"}}
    assert double["arguments"]["required"] == ["x"] and double["result"] == {"type": "number"}
    predict = manifest["units"]["Model"]["schemas"]["predict"]
    assert list(predict["arguments"]["properties"]) == ["text"] and predict["result"] == {"type": "string"}


def test_local_calls_and_errors():
    calls = []
    app, double, Model = make_app(calls)
    assert double.local(3, scale=0.5) == 3.0
    model = Model()
    assert model.predict.local("hi") == "HI" and model.predict.local(text="x") == "X"
    assert calls == ["load", "connect"]  # enter hooks ran once for the handle
    with pytest.raises(AttributeError, match="Model has no @ember.method\\(\\) named 'nope'"):
        _ = model.nope
    with pytest.raises(ember.SpecError, match="already has a function or class named 'double'"):
        app.function()(double.fn)


def test_class_without_methods_is_rejected():
    app = ember.App("demo")
    with pytest.raises(ember.SpecError, match="no @ember.method\\(\\) or @ember.asgi_app\\(\\)"):
        @app.cls()
        class Empty:
            pass


@pytest.mark.parametrize("hook", ["enter", "exit", "park", "wake"])
def test_a_lifecycle_hook_that_also_serves_calls_is_refused_at_load(hook):
    app = ember.App("roles")
    with pytest.raises(SpecError, match=rf"Model.load is marked @ember.{hook}\(\) and @ember.method\(\)"):
        @app.cls()
        class Model:
            @getattr(ember, hook)()
            @ember.method()
            def load(self):
                pass
    assert app.units == {}
