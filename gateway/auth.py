"""API-key authentication and authorisation, decided on the route the gateway resolved and before any body is read."""
import asyncio

from fastapi import Request

from ember.gateway.errors import ApiError
from ember.gateway.keys import ApiKey, KeyStore
from ember.runtime import logs


async def authenticate(keys: KeyStore, request: Request, admin: bool = False) -> ApiKey:
    """The key the request carries; a key the cache does not know is read from SQLite off the event loop."""
    header = request.headers.get("authorization", "")
    scheme, _, secret = header.partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise ApiError(
            401,
            "unauthorized",
            "missing API key: send 'Authorization: Bearer ek_...' (create one with `ember keys create --name NAME`)",
            {"WWW-Authenticate": "Bearer"},
        )
    known, key = keys.cached(secret.strip())
    if not known:
        key = await asyncio.to_thread(keys.verify, secret.strip())
    if key is None:
        raise ApiError(401, "unauthorized", "invalid, expired or revoked API key", {"WWW-Authenticate": "Bearer"})
    logs.annotate(key=key.id, key_name=key.name)
    if admin and not key.admin:
        raise ApiError(403, "forbidden", "this endpoint needs an admin key (`ember keys create --name NAME --admin`)")
    return key


def authorize(key: ApiKey, app: str, unit: str) -> None:
    if not key.allows(app, unit):
        raise ApiError(
            403,
            "forbidden",
            f"key {key.id} ({key.name}) may not call {app}/{unit}; its scopes are {list(key.scopes)} "
            f"(create one with --scope app:{app} or --scope fn:{app}/{unit})",
        )
