"""App, Function and Cls: the declarative SDK. Decorator kwargs are the whole configuration."""
import inspect
import re
import time
from collections.abc import Callable
from typing import Any, TypeVar

from typing_extensions import Unpack

from ember import hooks
from ember.remote import Remote
from ember.signature import call_schemas
from ember.spec import FunctionSpec, Settings, SpecError, build_spec, check_requirements

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
APP_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")  # the gateway checks the same on deploy and on every request


def _check_name(kind: str, name: str) -> str:
    if not NAME.match(name):
        raise SpecError(f"{kind} name {name!r} must match {NAME.pattern} (it becomes a URL path segment)")
    return name


Unit = TypeVar("Unit", "Function", "Cls")


class App:
    """A named group of functions and classes served under https://<gateway>/{name}/...

    `requirements`: pip requirements every function of the app gets (before its own `requirements=`)."""

    def __init__(self, name: str, requirements: list[str] | None = None):
        if not isinstance(name, str) or not APP_NAME.fullmatch(name):
            hint = re.sub(r"[^a-z0-9_-]", "-", str(name).lower()).strip("-_")[:63] or "my-app"
            raise SpecError(f"app name {name!r} must be 1-63 lower-case letters, digits, '-' or '_', starting with a "
                            f"letter or digit (it is the first part of every URL); e.g. ember.App({hint!r})")
        self.name = name
        self.units: dict[str, Function | Cls] = {}
        try:
            self.requirements = check_requirements(list(requirements or []))
        except ValueError as exc:
            raise SpecError(f"App({name!r}): {exc}") from None

    def _add(self, unit: "Function | Cls") -> None:
        if unit.name in self.units:
            raise SpecError(f"app {self.name!r} already has a function or class named {unit.name!r}")
        self.units[unit.name] = unit

    def function(self, _fn: object = None, **settings: Unpack[Settings]) -> Callable[[Callable], "Function"]:
        """Serve the decorated function at /{app}/{function}; `settings` are FunctionSpec's fields."""
        return self._decorator("function", _fn, settings, Function)

    def cls(self, _cls: object = None, **settings: Unpack[Settings]) -> Callable[[type], "Cls"]:
        """Serve the decorated class's @ember.method()s at /{app}/{Class}.{method}, one instance per replica."""
        return self._decorator("cls", _cls, settings, Cls)

    def _decorator(self, kind: str, first: object, settings: Settings,
                   make: Callable[["App", Any, FunctionSpec], Unit]) -> Callable[[Any], Unit]:
        if callable(first):
            raise TypeError(f"use @app.{kind}() with parentheses")
        kwargs: dict[str, Any] = dict(settings)
        if self.requirements:
            kwargs["requirements"] = self.requirements + list(settings.get("requirements", []))
        spec = build_spec(f"@app.{kind}", kwargs)

        def register(target: Any) -> Unit:
            unit = make(self, target, spec)
            self._add(unit)
            return unit

        return register

    def manifest(self) -> dict:
        """What the gateway needs to route and scale, without unpickling user code."""
        return {"app": self.name, "units": {name: unit.describe() for name, unit in self.units.items()}}


class Function(Remote):
    """A plain function served as one unit: every call is one invocation."""

    def __init__(self, app: App, fn: Callable, spec: FunctionSpec):
        if not inspect.isfunction(fn):   # a class, a builtin, a bound method: no code of its own to ship
            use = "; a class is served with @app.cls()" if isinstance(fn, type) else ""
            raise SpecError(f"@app.function() decorates a function, got {fn!r}{use}")
        self.app, self.fn, self.spec = app, fn, spec
        self.name = _check_name("function", fn.__name__)
        self.is_asgi = bool(getattr(fn, hooks.ASGI, False))
        marks = [f"@ember.{d}()" for a, d in (HOOKS | {hooks.METHOD: "method"}).items() if hasattr(fn, a)]
        if marks:   # a lifecycle hook or method of no class: it would never run
            raise SpecError(f"{self.name} is a plain @app.function() marked {' and '.join(marks)}, which marks a "
                            "method of an @app.cls() class; put it in one, or drop the mark")

    def describe(self) -> dict:
        methods = [] if self.is_asgi else [self.name]
        params = {m: _required_params(self.fn) for m in methods}
        schemas = {m: call_schemas(self.fn, f"{m} arguments", f"{self.app.name}.{m}") for m in methods}
        try_it = getattr(self.fn, hooks.TRY_IT, None)  # what `ember serve` prints to call an ASGI app
        return {"kind": "function", "methods": methods, "params": params, "schemas": schemas, "asgi": self.is_asgi,
                "spec": self.spec.model_dump()} | ({"try_it": try_it} if try_it else {})

    def local(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def _address(self) -> tuple[str, str, Callable, bool]:
        return self.app.name, self.name, self.fn, False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


class Cls:
    """A class whose instance lives in a replica: enter hooks run once, methods serve calls."""

    def __init__(self, app: App, user_cls: type, spec: FunctionSpec):
        if not isinstance(user_cls, type):
            raise SpecError(f"@app.cls() decorates a class, got {user_cls!r}; a function is served with "
                            "@app.function()")
        self.app, self.user_cls, self.spec = app, user_cls, spec
        self.name = _check_name("class", user_cls.__name__)
        _check_no_arguments(user_cls)
        members = inspect.getmembers(user_cls, callable)
        _check_roles(self.name, members)
        _check_plain_methods(user_cls, members)
        self.methods = [n for n, f in members if getattr(f, hooks.METHOD, False)]
        asgi = [n for n, f in members if getattr(f, hooks.ASGI, False)]
        if len(asgi) > 1:
            raise SpecError(f"class {self.name!r} has more than one @ember.asgi_app() method: {asgi}")
        self.asgi = asgi[0] if asgi else None
        enters = [(n, getattr(f, hooks.ENTER)) for n, f in members if hasattr(f, hooks.ENTER)]
        # snap=True hooks build the state a snapshot captures, so they run before snap=False ones.
        self.enter_hooks = [n for n, snap in enters if snap] + [n for n, snap in enters if not snap]
        self.exit_hooks = [n for n, f in members if getattr(f, hooks.EXIT, False)]
        self.park_hooks = [n for n, f in members if getattr(f, hooks.PARK, False)]
        self.wake_hooks = [n for n, f in members if getattr(f, hooks.WAKE, False)]
        if not self.methods and not self.asgi:
            raise SpecError(f"class {self.name!r} has no @ember.method() or @ember.asgi_app(); nothing to serve")

    def describe(self) -> dict:
        params = {m: _required_params(getattr(self.user_cls, m), bound=True) for m in self.methods}
        schemas = {m: call_schemas(getattr(self.user_cls, m), f"{self.name}.{m} arguments",
                                   f"{self.app.name}.{self.name}.{m}", bound=True) for m in self.methods}
        try_it = getattr(getattr(self.user_cls, self.asgi), hooks.TRY_IT, None) if self.asgi else None
        return {"kind": "class", "methods": self.methods, "params": params, "schemas": schemas,
                "asgi": self.asgi is not None,
                "spec": self.spec.model_dump()} | ({"try_it": try_it} if try_it else {})

    def start(self, on_hook: Callable[[str, float], None] | None = None) -> Any:
        """Create the instance and run its enter hooks (snap=True first)."""
        return self.enter(self.snap(on_hook), on_hook)

    def snap(self, on_hook: Callable[[str, float], None] | None = None) -> Any:
        """Create the instance and run its snap=True hooks: the CPU-only state every replica shares (a fork server
        runs this once, before it forks replicas, so these hooks must not touch CUDA)."""
        return self._run_hooks(self.user_cls(), [n for n in self.enter_hooks if self._snaps(n)], on_hook)

    def enter(self, obj: Any, on_hook: Callable[[str, float], None] | None = None) -> Any:
        """Run the snap=False hooks on an instance `snap()` made: per-process state (GPU, threads, sockets)."""
        return self._run_hooks(obj, [n for n in self.enter_hooks if not self._snaps(n)], on_hook)

    def _snaps(self, hook: str) -> bool:
        return getattr(getattr(self.user_cls, hook), hooks.ENTER)

    @staticmethod
    def _run_hooks(obj: Any, names: list[str], on_hook: Callable[[str, float], None] | None) -> Any:
        for name in names:
            began = time.monotonic()
            getattr(obj, name)()
            if on_hook:
                on_hook(name, time.monotonic() - began)
        return obj

    def stop(self, obj: Any) -> None:
        for name in self.exit_hooks:
            getattr(obj, name)()

    def __call__(self) -> "Instance":
        return Instance(self)


class Instance:
    """A handle on a Cls: `Model().embed.remote(...)` or `.local(...)` (local runs enter hooks once)."""

    def __init__(self, cls: Cls):
        self._cls = cls
        self._obj: Any = None

    def __getattr__(self, name: str) -> "BoundMethod":
        if name not in self._cls.methods:
            raise AttributeError(
                f"{self._cls.name} has no @ember.method() named {name!r}; methods: {self._cls.methods}"
            )
        return BoundMethod(self, name)

    def _local_obj(self) -> Any:
        if self._obj is None:
            self._obj = self._cls.start()
        return self._obj


class BoundMethod(Remote):
    def __init__(self, instance: Instance, name: str):
        self.instance, self.name = instance, name

    def local(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.instance._local_obj(), self.name)(*args, **kwargs)

    def _address(self) -> tuple[str, str, Callable, bool]:
        cls = self.instance._cls
        return cls.app.name, f"{cls.name}.{self.name}", getattr(cls.user_cls, self.name), True


HOOKS = {hooks.ENTER: "enter", hooks.EXIT: "exit", hooks.PARK: "park", hooks.WAKE: "wake"}
SERVES = {hooks.METHOD: "method", hooks.ASGI: "asgi_app"}


def _check_roles(cls_name: str, members: list[tuple[str, Any]]) -> None:
    """A lifecycle hook runs when the replica starts, stops, parks or wakes; it cannot also serve calls."""
    for name, member in members:
        marks = [f"@ember.{d}()" for a, d in (HOOKS | SERVES).items() if hasattr(member, a)]
        hook = any(hasattr(member, a) for a in HOOKS)
        serves = any(hasattr(member, a) for a in SERVES)
        if hook and serves or sum(hasattr(member, a) for a in SERVES) > 1:
            raise SpecError(f"{cls_name}.{name} is marked {' and '.join(marks)}: a lifecycle hook cannot also serve "
                            "calls; keep one of them and, to share code, call one method from the other")


def _check_no_arguments(user_cls: type) -> None:
    """A replica makes the instance as `Class()`: a required constructor argument fails every start."""
    try:
        required = [p.name for p in inspect.signature(user_cls).parameters.values()
                    if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    except (TypeError, ValueError):  # no signature to read (a C-level constructor): let the start say
        return
    if required:
        raise SpecError(f"{user_cls.__name__}() takes required argument{'s' * (len(required) > 1)} "
                        f"{', '.join(map(repr, required))}, but a replica makes its instance with none: give "
                        "them defaults, or set them in an @ember.enter() method")


def _check_plain_methods(user_cls: type, members: list[tuple[str, Any]]) -> None:
    """A marked method runs on the class's instance, its `self` left out of what a caller sends: a staticmethod or
    classmethod under the mark (`@staticmethod` above `@ember.method()`) would lose its first parameter."""
    for name, member in members:
        wrapper = inspect.getattr_static(user_cls, name, None)
        if isinstance(wrapper, (staticmethod, classmethod)) and any(hasattr(member, a) for a in HOOKS | SERVES):
            raise SpecError(f"{user_cls.__name__}.{name} is a {type(wrapper).__name__}: Ember's marks go on plain "
                            f"methods (def {name}(self, ...)); drop the @{type(wrapper).__name__}")


def _required_params(fn: Callable, bound: bool = False) -> dict[str, str | None]:
    """Required keyword arguments and their annotation names: enough to show a caller a working request."""
    params = list(inspect.signature(fn).parameters.values())[1 if bound else 0:]
    return {
        p.name: getattr(p.annotation, "__name__", None) if p.annotation is not p.empty else None
        for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }
