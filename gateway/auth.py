"""API-key authentication: `Authorization: Bearer ek_...` checked against the hashed keys in SQLite."""
from fastapi import Request

from ember.gateway.errors import ApiError
from ember.gateway.keys import ApiKey, KeyStore


def authenticate(keys: KeyStore, request: Request, admin: bool = False) -> ApiKey:
    header = request.headers.get("authorization", "")
    scheme, _, secret = header.partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise ApiError(401, "unauthorized", "missing API key: send 'Authorization: Bearer ek_...' (create one with `ember keys create --name NAME`)",
                       {"WWW-Authenticate": "Bearer"})
    key = keys.verify(secret.strip())
    if key is None:
        raise ApiError(401, "unauthorized", "invalid or revoked API key", {"WWW-Authenticate": "Bearer"})
    if admin and not key.admin:
        raise ApiError(403, "forbidden", "this endpoint needs an admin key (`ember keys create --name NAME --admin`)")
    return key
