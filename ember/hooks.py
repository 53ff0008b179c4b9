"""Lifecycle markers for methods of an @app.cls class: enter, exit, park, wake, method, asgi_app."""
from collections.abc import Callable

ENTER = "__ember_enter__"  # value: snap flag
EXIT = "__ember_exit__"
PARK = "__ember_on_park__"
WAKE = "__ember_on_wake__"
METHOD = "__ember_method__"
ASGI = "__ember_asgi__"
TRY_IT = "__ember_try_it__"  # value: {"path", "body", "openai_base"}, what `ember serve` prints to call the ASGI app


def _marker(decorator: str, attribute: str, value: object) -> Callable:
    def mark(fn: Callable) -> Callable:
        if isinstance(fn, (staticmethod, classmethod)):   # callable, but the mark would be lost on the wrapper
            raise TypeError(f"@ember.{decorator}() decorates a plain method (def name(self, ...)), not a "
                            f"{type(fn).__name__}; drop the @{type(fn).__name__}")
        if not callable(fn):
            raise TypeError(f"@ember.{decorator}() decorates a function or method, got {fn!r}")
        setattr(fn, attribute, value)
        return fn

    return mark


def _no_bare_use(decorator: str, first: object) -> None:
    if callable(first):
        raise TypeError(f"use @ember.{decorator}() with parentheses")


def enter(_fn: object = None, *, snap: bool = False) -> Callable:
    """Run when a replica starts. snap=True hooks run first, once per app version on a node, in its fork server:
    every replica is forked from the state they built (host memory shared copy-on-write), so they must do CPU work
    only — read config and tokenizers, import modules, load weights into host memory — and must not touch CUDA or
    leave threads running. snap=False hooks run in each replica, with its GPU: build engines, start threads.
    A unit whose snap=True hooks touch CUDA still works: its replicas are spawned instead of forked, and each start's
    breakdown says why."""
    _no_bare_use("enter", _fn)
    if not isinstance(snap, bool):   # snap="no" would be truthy
        raise TypeError(f"@ember.enter(snap=...) is True or False; got {snap!r}")
    return _marker("enter", ENTER, snap)


def exit(_fn: object = None) -> Callable:  # noqa: A001 - mirrors enter/exit lifecycle naming
    """Run when a replica stops (SIGTERM)."""
    _no_bare_use("exit", _fn)
    return _marker("exit", EXIT, True)


def park(_fn: object = None) -> Callable:
    """Run when an idle replica parks, before Ember moves the GPU tensors of the instance's torch modules to host
    memory: release the GPU memory Ember cannot see (an LLM engine's weights and KV cache: `self.engine.park()`).
    The process and its host state stay; the replica serves again after its @ember.wake() hooks ran."""
    _no_bare_use("park", _fn)
    return _marker("park", PARK, True)


def wake(_fn: object = None) -> Callable:
    """Run when a parked replica takes a call, before the call and after Ember moved the modules back to the GPU:
    restore what the @ember.park() hooks released (`self.engine.wake()`)."""
    _no_bare_use("wake", _fn)
    return _marker("wake", WAKE, True)


def method(_fn: object = None) -> Callable:
    """Expose a method of an @app.cls class as /{app}/{Class}.{method}."""
    _no_bare_use("method", _fn)
    return _marker("method", METHOD, True)


def asgi_app(_fn: object = None, *, try_path: str | None = None, try_body: dict | None = None,
             openai_base: str | None = None) -> Callable:
    """The decorated callable returns an ASGI app (e.g. FastAPI) served under /{app}/... . `try_path` (with a JSON
    `try_body` to POST, else a GET) is the call `ember serve --new-key` prints; `openai_base` (e.g. "/v1") says the
    app speaks the OpenAI API there, so `ember serve` also prints the settings an OpenAI client needs."""
    _no_bare_use("asgi_app", _fn)
    if try_body is not None and not isinstance(try_body, dict):
        raise TypeError(f"@ember.asgi_app(try_body=...) is a dict to send as JSON; got {try_body!r}")
    for name, path in (("try_path", try_path), ("openai_base", openai_base)):
        if path is not None and not (isinstance(path, str) and path.startswith("/")):
            raise TypeError(f"@ember.asgi_app({name}=...) is a path under the app, starting with '/'; got {path!r}")
    mark = _marker("asgi_app", ASGI, True)

    def mark_with_example(fn: Callable) -> Callable:
        mark(fn)
        if try_path or openai_base:
            setattr(fn, TRY_IT, {"path": try_path, "body": try_body, "openai_base": openai_base})
        return fn

    return mark_with_example
