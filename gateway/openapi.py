"""The OpenAPI document of the gateway's public surface, with bearer auth and the shared error shape, and one path
per deployed function (`/{app}/{function}`, `/{app}/{Class}.{method}`) whose request body and result are the JSON
schemas of its signature (ember/signature.py, carried in the package's manifest). An app's ASGI endpoint is one
templated path, with the OpenAI routes spelled out when it serves a model. The invoke route is a plain Starlette
route (FastAPI's parameter solving cost ~0.05 ms a request), so all of this is written here."""
from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse

from ember.gateway.deployment import Deployment, Unit
from ember.gateway.errors import ApiError
from ember.gateway.keys import ApiKey

METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
ERROR = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
ERROR_RESPONSES = {
    code: {"description": what} | ERROR
    for code, what in [
        (400, "bad request"),
        (401, "missing or invalid key"),
        (403, "key lacks the scope"),
        (404, "no such app or function"),
        (413, "body too large"),
        (429, "rate limited"),
        (503, "no replica available"),
        (504, "upstream timed out"),
    ]
}
CALL_ERRORS = {422: "the arguments do not fit the function's signature (the message names each field)",
               500: "the function raised (its error type and message)"}
ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["type", "message"],
                             "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}}}
PUBLIC = ("/healthz", "/readyz", "/metrics")  # need no key
STATIC = Path(__file__).parent / "static"
DOCS_ASSETS = {"docs.html": "text/html", "docs.js": "text/javascript", "docs.css": "text/css"}
DOCS_HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff",
                "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'; base-uri 'none'"}
OPENAI_ROUTES = [("post", "/chat/completions", "chat completion (OpenAI API; \"stream\": true for server-sent events)"),
                 ("post", "/completions", "text completion (OpenAI API)"),
                 ("post", "/responses", "response (OpenAI Responses API; \"stream\": true for typed events)"),
                 ("post", "/embeddings", "embeddings (OpenAI API)"),
                 ("get", "/models", "the model served (OpenAI API)")]


def _errors(extra: dict[int, str] | None = None) -> dict:
    errors = {str(code): r for code, r in ERROR_RESPONSES.items()}
    return errors | {str(code): {"description": what} | ERROR for code, what in (extra or {}).items()}


def call_operation(app: str, unit: Unit, method: str) -> dict:
    """POST /{app}/{target}: its keyword arguments as a JSON object, its result as {"result": ...}."""
    target = method if unit.kind == "function" else f"{unit.name}.{method}"
    schemas = unit.schemas.get(method, {})
    arguments = schemas.get("arguments") or {"type": "object"}
    if schemas.get("stream"):
        ok = {"description": "server-sent events: `data: <json>` for each value the generator yields, then "
                             "`event: done`", "content": {"text/event-stream": {"schema": {"type": "string"}}}}
    else:
        result = {"type": "object", "required": ["result"], "properties": {"result": schemas.get("result") or {}}}
        ok = {"description": "what the function returned", "content": {"application/json": {"schema": result}}}
    return {"post": {"tags": [app], "operationId": f"{app}.{target}", "summary": f"call {target} of app {app}",
                     "requestBody": {"required": True, "content": {"application/json": {"schema": arguments}}},
                     "responses": {"200": ok} | _errors(CALL_ERRORS)}}


def asgi_paths(app: str, unit: Unit) -> dict:
    """The app's ASGI endpoint: any path under /{app}/, and the OpenAI routes of a model it serves."""
    paths: dict[str, dict] = {}
    if unit.openai_base is not None:
        base = f"/{app}{unit.openai_base.rstrip('/')}"
        for verb, route, summary in OPENAI_ROUTES:
            body = {"requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "description": "as OpenAI's API takes it"}}}}} if verb == "post" else {}
            paths[base + route] = {verb: {"tags": [app], "operationId": f"{app}.openai{route.replace('/', '.')}",
                                          "summary": summary} | body | {
                "responses": {"200": {"description": "as OpenAI's API answers"}} | _errors()}}
    any_path: dict[str, object] = {"tags": [app],
                                   "summary": f"the ASGI app {unit.name} of {app}: any method and path under /{app}/",
                                   "parameters": [{"name": "path", "in": "path", "required": True,
                                                   "schema": {"type": "string"}}],
                                   "responses": {"200": {"description": "the app's reply"}} | _errors()}
    paths[f"/{app}/{{path}}"] = {m.lower(): any_path | {"operationId": f"{app}.asgi.{m.lower()}"} for m in METHODS}
    return paths


def document(app: FastAPI, deployments: dict[str, Deployment], key: ApiKey | None = None) -> dict:
    """The gateway's own routes (built once) and, for `key`, the deployed functions it may call (as they are now):
    without a key the document names no app, so it lists nothing an unauthenticated caller could not guess."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = spec.setdefault("components", {})
        components.setdefault("schemas", {})["Error"] = ERROR_SCHEMA
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        spec["security"] = [{"bearer": []}]
        for path in PUBLIC:
            spec["paths"][path]["get"]["security"] = []
        app.openapi_schema = spec
    spec = app.openapi_schema
    paths, schemas = dict(spec["paths"]), dict(spec["components"]["schemas"])
    for name, deployment in sorted(deployments.items()):
        for unit in deployment.units.values():
            if key is None or not key.allows(name, unit.name):
                continue
            for method in unit.methods:
                target = method if unit.kind == "function" else f"{unit.name}.{method}"
                paths[f"/{name}/{target}"] = call_operation(name, unit, method)
                schemas |= unit.schemas.get(method, {}).get("defs", {})
            if unit.asgi:
                paths |= asgi_paths(name, unit)
    return spec | {"paths": paths, "components": spec["components"] | {"schemas": schemas}}


def docs_router() -> APIRouter:
    """/docs: a page (static/docs.html and docs.js, no CDN: the machine may be offline) that renders the document."""
    router = APIRouter(prefix="/docs", include_in_schema=False)

    @router.get("")
    async def page() -> FileResponse:
        return FileResponse(STATIC / "docs.html", media_type="text/html", headers=DOCS_HEADERS)

    @router.get("/static/{name}")
    async def asset(name: str) -> FileResponse:
        if name not in DOCS_ASSETS:
            raise ApiError(404, "not_found", f"no docs asset {name[:100]!r}")
        return FileResponse(STATIC / name, media_type=DOCS_ASSETS[name], headers=DOCS_HEADERS)

    return router
