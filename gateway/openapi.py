"""The OpenAPI document of the gateway's public surface, with bearer auth and the shared error shape. The invoke
route is a plain Starlette route (FastAPI's parameter solving cost ~0.05 ms a request), so it is described here."""
from fastapi import FastAPI

METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
ERROR = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
ERROR_RESPONSES = {code: {"description": what} | ERROR for code, what in [
    (400, "bad request"), (401, "missing or invalid key"), (403, "key lacks the scope"), (404, "no such app or function"),
    (413, "body too large"), (429, "rate limited"), (503, "no replica available"), (504, "upstream timed out")]}
ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["type", "message"],
                             "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}}}
PUBLIC = ("/healthz", "/readyz", "/metrics")  # need no key


def document(app: FastAPI) -> dict:
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = spec.setdefault("components", {})
        components.setdefault("schemas", {})["Error"] = ERROR_SCHEMA
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        invoke = {"summary": "Call a function, or reach an app's ASGI endpoint",
                  "parameters": [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
                                 for name in ("app_name", "rest")],
                  "responses": {"200": {"description": "the function's result, or the app's reply"}}
                  | {str(code): r for code, r in ERROR_RESPONSES.items()}}
        spec["paths"]["/{app_name}/{rest}"] = {m.lower(): invoke | {"operationId": f"invoke_{m.lower()}"} for m in METHODS}
        spec["security"] = [{"bearer": []}]
        for path in PUBLIC:
            spec["paths"][path]["get"]["security"] = []
        app.openapi_schema = spec
    return app.openapi_schema
