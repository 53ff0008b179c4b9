"""Paths under /{app}/ reach a declared function or method, else the app's ASGI endpoint."""
from ember.gateway.deployment import Unit
from ember.gateway.routing import Call, Forward, route
from ember.spec import FunctionSpec


def unit(name: str, kind: str, methods: list[str], asgi: bool = False) -> Unit:
    return Unit("app", name, kind, methods, asgi, FunctionSpec(), router=None, queue=None, settings=None)


def test_routes():
    plain = {"square": unit("square", "function", ["square"]), "Model": unit("Model", "class", ["predict"])}
    assert route(plain, "square") == Call("square", "square")
    assert route(plain, "Model.predict") == Call("Model", "predict")
    assert route(plain, "Model.nope") is None
    assert route(plain, "Model") is None
    assert route(plain, "square/extra") is None
    assert route(plain, "v1/chat/completions") is None

    with_asgi = plain | {"Engine": unit("Engine", "class", ["health"], asgi=True)}
    assert route(with_asgi, "v1/chat/completions") == Forward("Engine", "/v1/chat/completions")
    assert route(with_asgi, "Engine.health") == Call("Engine", "health")
    assert route(with_asgi, "square") == Call("square", "square")
    assert route(with_asgi, "square/extra") == Forward("Engine", "/square/extra")
    assert route(with_asgi, "") == Forward("Engine", "/")


def test_choose_by_mode():
    from ember.gateway.affinity import ReplicaLoad, pick
    from ember.gateway.routing import choose

    loads = [ReplicaLoad("a", 2), ReplicaLoad("b", 0), ReplicaLoad("c", 1)]
    assert [choose("round-robin", "s1", loads, turn) for turn in range(4)] == ["a", "b", "c", "a"]
    assert choose("least-loaded", "s1", loads, 0) == "b"
    assert choose("affinity", None, loads, 0) == "b"  # no key: least loaded
    sticky = {choose("affinity", "session-7", loads, turn) for turn in range(5)}
    assert sticky == {pick("session-7", loads)}
