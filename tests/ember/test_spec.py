"""FunctionSpec and the decorators: wrong settings fail at load time with a message that names the fix."""
import pytest

import ember
from ember.spec import FunctionSpec, SpecError, build_spec


def test_misspelt_argument_names_the_nearest_valid_one():
    app = ember.App("a")
    with pytest.raises(
        SpecError, match=r"unknown argument 'max_replica' for @app.function; did you mean 'max_replicas'\?"
    ):
        app.function(max_replica=3)
    with pytest.raises(
        SpecError, match=r"unknown argument 'scaledown' for @app.cls; did you mean 'scaledown_window'\?"
    ):
        app.cls(scaledown=3)
    with pytest.raises(SpecError, match=r"unknown argument 'zzz'.*valid arguments: gpu, cpu"):
        build_spec("@app.function", {"zzz": 1})


@pytest.mark.parametrize("settings, fragment", [
    ({"min_replicas": 3, "max_replicas": 2}, "min_replicas (3) must be <= max_replicas (2)"),
    ({"scaledown_window": 0}, "scaledown_window: Input should be greater than 0"),
    ({"gpu": "H200:0"}, "gpu must look like 'H200' or 'H200:2'"),
    ({"target_concurrency": 4, "max_concurrency": 2}, "target_concurrency (4.0) must be <= max_concurrency (2)"),
    ({"timeout": -1}, "timeout: Input should be greater than 0"),
    ({"env": {"A": 1}}, "env.A: Input should be a valid string"),
    ({"stable_window": 0}, "stable_window: Input should be greater than 0"),
    ({"panic_window": -1}, "panic_window: Input should be greater than 0"),
    ({"panic_threshold": 1}, "panic_threshold: Input should be greater than 1"),
    ({"panic_window": 10, "stable_window": 5}, "panic_window (10) must be <= stable_window (5)"),
    ({"park_after": 10, "scaledown_window": 10}, "park_after (10) must be < scaledown_window (10)"),
    ({"park": "sometimes"}, "park: Input should be a valid boolean"),
    ({"park_after": 5, "park": False}, "park_after (5) needs park=True"),
    # each below was taken before: an infinite timeout failed every call with a gateway 500, an env key or
    # value os.environ refuses failed every replica's start (a 503 naming "embedded null byte")
    ({"timeout": float("inf")}, "timeout: Input should be a finite number"),
    ({"timeout": 1e300}, "timeout: Input should be less than or equal to 86400"),
    ({"scaledown_window": float("nan")}, "scaledown_window: Input should be a finite number"),
    ({"cpu": float("inf")}, "cpu: Input should be a finite number"),
    ({"panic_threshold": float("inf")}, "panic_threshold: Input should be a finite number"),
    ({"min_replicas": 10 ** 6, "max_replicas": 10 ** 6}, "min_replicas: Input should be less than or equal to 10000"),
    ({"max_concurrency": 10 ** 9}, "max_concurrency: Input should be less than or equal to 10000"),
    ({"env": {"A\0B": "x"}}, "env keys are environment variable names"),
    ({"env": {"": "x"}}, "env keys are environment variable names"),
    ({"env": {"A=B": "x"}}, "env keys are environment variable names"),
    ({"env": {"K": "v\0w"}}, "the value of env K must be UTF-8 text"),
    ({"env": {"K": "\ud800"}}, "the value of env K must be UTF-8 text"),
    ({"secrets": ["../../etc/passwd"]}, "secret names match"),
    ({"gpu": "H200:99999999999999999999"}, "gpu must look like 'H200' or 'H200:2' (1 to 8 GPUs of one host)"),
    ({"gpu": "H200:9"}, "gpu must look like 'H200' or 'H200:2'"),
    ({"gpu": "x" * 10000}, "gpu must look like 'H200' or 'H200:2'"),
])
def test_ranges_are_checked(settings, fragment):
    with pytest.raises(SpecError) as error:
        build_spec("@app.function", settings)
    assert fragment in str(error.value)


def test_valid_settings():
    spec = build_spec(
        "@app.function", {"gpu": "H200:2", "min_replicas": 1, "max_replicas": 4, "secrets": ["hf"], "env": {"A": "b"}}
    )
    assert spec.gpu == "H200:2" and spec.max_replicas == 4 and spec.env == {"A": "b"}
    assert FunctionSpec().gpu is None and FunctionSpec().scaledown_window is None  # None: the policy's default


def test_misspelt_scaling_knob_names_the_nearest_one():
    with pytest.raises(
        SpecError, match=r"unknown argument 'panic_treshold' for @app.function; did you mean 'panic_threshold'\?"
    ):
        ember.App("a").function(panic_treshold=3)
    with pytest.raises(SpecError, match=r"did you mean 'stable_window'\?"):
        ember.App("a").cls(stable_windw=30)


def test_decorators_need_parentheses_and_names_must_be_url_safe():
    app = ember.App("a")
    with pytest.raises(TypeError, match=r"@app.function\(\) with parentheses"):
        app.function(lambda: 1)
    with pytest.raises(TypeError, match=r"@ember.method\(\) with parentheses"):
        ember.method(lambda self: 1)
    with pytest.raises(SpecError, match="app name 'my app'"):
        ember.App("my app")


def test_marks_go_on_plain_methods_of_a_class():
    """A mark on a staticmethod, a mark's snap flag given as text, or a hook on a plain function were accepted and
    then did nothing (or the opposite): `snap="no"` snapped, a static @ember.method() was "no method" at call time."""
    app = ember.App("a")
    with pytest.raises(TypeError, match="not a staticmethod; drop the @staticmethod"):
        ember.method()(staticmethod(lambda: 1))
    with pytest.raises(TypeError, match=r"snap=\.\.\.\) is True or False; got 'no'"):
        ember.enter(snap="no")
    with pytest.raises(TypeError, match="try_body=...\\) is a dict"):
        ember.asgi_app(try_path="/x", try_body="{}")

    class Static:
        @staticmethod
        @ember.method()
        def twice(x):
            return 2 * x

    with pytest.raises(SpecError, match="Static.twice is a staticmethod"):
        app.cls()(Static)

    def setup():
        pass

    with pytest.raises(SpecError, match=r"marked @ember.enter\(\), which marks a method of an @app.cls\(\) class"):
        app.function()(ember.enter()(setup))


def test_each_decorator_takes_what_it_serves():
    """@app.function() on a class or a builtin and a class whose constructor needs arguments loaded, and every
    replica start then failed ("import failed: AttributeError: ... '__globals__'", "enter failed: TypeError")."""
    app = ember.App("a")

    class Needs:
        def __init__(self, size: int, *rest, scale: float = 1.0):
            self.size = size

        @ember.method()
        def get(self):
            return self.size

    with pytest.raises(SpecError, match="a class is served with @app.cls"):
        app.function()(Needs)
    with pytest.raises(SpecError, match="decorates a function, got <built-in function len>"):
        app.function()(len)
    with pytest.raises(SpecError, match="a function is served with @app.function"):
        app.cls()(lambda: 1)
    with pytest.raises(SpecError, match=r"Needs\(\) takes required argument 'size', but a replica makes"):
        app.cls()(Needs)


def test_the_typed_settings_name_every_field_of_the_spec():
    from typing import get_type_hints

    from ember.spec import FunctionSpec, Settings

    typed = get_type_hints(Settings)
    assert set(typed) == set(FunctionSpec.model_fields), "add the new FunctionSpec field to ember.spec.Settings too"
    for name, field in FunctionSpec.model_fields.items():
        assert typed[name] == field.annotation, name


def test_retries_take_an_int_or_a_backoff_policy():
    from ember.spec import FunctionSpec, Retries, SpecError, build_spec

    assert FunctionSpec().retries == Retries(0, backoff_coefficient=1.0)
    fixed = build_spec("@app.function", {"retries": 2}).retries
    assert fixed.max_retries == 2 and [fixed.delay(n) for n in (1, 2)] == [1.0, 1.0]
    backoff = Retries(5, backoff_coefficient=3.0, initial_delay=0.5, max_delay=4.0)
    assert [backoff.delay(n) for n in (1, 2, 3, 4)] == [0.5, 1.5, 4.0, 4.0]
    spec = FunctionSpec(retries=backoff)
    assert FunctionSpec(**spec.model_dump()) == spec  # the manifest's round trip
    with pytest.raises(SpecError, match="retries must be from 0 to 10, got 11"):
        build_spec("@app.function", {"retries": 11})
    with pytest.raises(SpecError, match="retries.Retries.backoff_coefficient"):
        build_spec("@app.function", {"retries": {"max_retries": 1, "backoff_coefficient": 0.5}})
