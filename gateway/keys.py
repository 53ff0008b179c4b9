"""API keys: random `ek_` secrets shown once, stored as sha256 hashes in SQLite, with scopes, expiry and limits.

Scopes say what a key may call:
    "app:chat"          every function of app `chat`
    "fn:hello/greet"    one function (or class: "fn:shop/Cart") of one app
    "admin"             the /admin API, and every app
A key with no app: or fn: scope may call every app (but not /admin). The secret has 256
random bits, so a plain sha256 is a sound hash (no password stretching needed).
"""
import contextlib
import hashlib
import hmac
import json
import math
import re
import secrets
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from ember.gateway.database import DatabaseError, connect
from ember.gateway.ratelimit import Limits

LONGEST_KEY_LIFE = 10 * 365 * 86400.0   # seconds: a key that should outlive this should not expire

SCHEMA = """
CREATE TABLE IF NOT EXISTS api_keys (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    hash TEXT NOT NULL,
    admin INTEGER NOT NULL,
    created REAL NOT NULL,
    revoked REAL
)
"""
# Added after the first release: databases from it gain these columns on open.
NEW_COLUMNS = [
    ("scopes", "TEXT NOT NULL DEFAULT '[]'"),
    ("expires", "REAL"),
    ("rpm", "INTEGER"),
    ("tpm", "INTEGER"),
    ("concurrency", "INTEGER"),
]
NAME = r"[a-z0-9][a-z0-9_-]{0,62}"
SCOPE = re.compile(rf"admin|app:{NAME}|fn:{NAME}/[A-Za-z_][A-Za-z0-9_]{{0,62}}")
CACHE_TTL = 1.0  # seconds another gateway's revocation may take to reach this one; this one's own are immediate
STALE_TTL = 60.0  # seconds a key read before may still serve while the database cannot be read


def check_scopes(scopes: list[str]) -> list[str]:
    for scope in scopes:
        if not isinstance(scope, str) or not SCOPE.fullmatch(scope):
            raise ValueError(
                f"scope {scope!r} is not one of 'admin', 'app:APP', 'fn:APP/FUNCTION' (lower-case app names)"
            )
    return sorted(set(scopes))


@dataclass(frozen=True)
class ApiKey:
    id: str
    name: str
    admin: bool
    created: float
    revoked: float | None
    scopes: tuple[str, ...] = ()
    expires: float | None = None
    limits: Limits = field(default_factory=Limits)

    def live(self, now: float) -> bool:
        return self.revoked is None and (self.expires is None or now < self.expires)

    def allows(self, app: str, unit: str) -> bool:
        """May this key call `unit` of `app`? Decided on the route the gateway resolved, nothing the client sent."""
        if self.admin:
            return True
        grants = [s for s in self.scopes if s.startswith(("app:", "fn:"))]
        return not grants or f"app:{app}" in grants or f"fn:{app}/{unit}" in grants

    def describe(self) -> dict:
        return {
            "id": self.id,
            "name": self.name,
            "admin": self.admin,
            "scopes": list(self.scopes),
            "created": self.created,
            "expires": self.expires,
            "revoked": self.revoked,
            "rpm": self.limits.requests_per_minute,
            "tpm": self.limits.tokens_per_minute,
            "concurrency": self.limits.max_concurrent,
        }


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class KeyStore:
    """Keys in SQLite, read through a short cache. A revoke this gateway took is enforced here at once, even when the
    database could not record it (a full disk): it stays pending in memory and is written again on the next change."""

    def __init__(self, db: Path):
        self.db = db
        self.cache: dict[str, tuple[float, ApiKey]] = {}  # hash -> (when read, key): no SQLite read per request
        self.pending: dict[str, float] = {}  # id or name -> when revoked here, not yet in the database
        with connect(db, "open the key database") as conn:
            conn.execute(SCHEMA)
            have = {row["name"] for row in conn.execute("PRAGMA table_info(api_keys)")}
            for column, kind in NEW_COLUMNS:
                if column not in have:
                    conn.execute(f"ALTER TABLE api_keys ADD COLUMN {column} {kind}")

    def create(self, name: str, admin: bool = False, scopes: Sequence[str] = (), expires: float | None = None,
               limits: Limits = Limits()) -> tuple[ApiKey, str]:
        """Returns the key record and its secret; the secret is not stored and cannot be shown again."""
        scopes = check_scopes(list(scopes) + (["admin"] if admin else []))
        if expires is not None and not (math.isfinite(expires) and expires <= time.time() + LONGEST_KEY_LIFE):
            # A NaN was stored as NULL (a key that never expires); a year past 9999 broke `ember keys list`
            raise ValueError(f"a key expires within {LONGEST_KEY_LIFE // 86400:.0f} days; got {expires!r}")
        if not name or len(name) > 100 or not name.isprintable():
            raise ValueError(f"a key's name must be 1-100 printable characters (no control characters, which "
                             f"`ember keys list` would print to a terminal); got {name[:100]!r}")
        self._save_pending()
        key_id = secrets.token_hex(4)
        secret = f"ek_{key_id}_{secrets.token_urlsafe(32)}"
        key = ApiKey(key_id, name, "admin" in scopes, time.time(), None, tuple(scopes), expires, limits)
        with connect(self.db, f"save the new key {name!r}") as conn:
            conn.execute(
                "INSERT INTO api_keys "
                "(id, name, hash, admin, created, revoked, scopes, expires, rpm, tpm, concurrency) "
                "VALUES (?, ?, ?, ?, ?, NULL, ?, ?, ?, ?, ?)",
                (
                    key_id,
                    name,
                    _hash(secret),
                    int(key.admin),
                    key.created,
                    json.dumps(scopes),
                    expires,
                    limits.requests_per_minute,
                    limits.tokens_per_minute,
                    limits.max_concurrent,
                ),
            )
        return key, secret

    def cached(self, secret: str) -> tuple[bool, ApiKey | None]:
        """(True, what verify() would answer) when the cache knows, without the database; else (False, None)."""
        cached = self.cache.get(_hash(secret))
        now = time.time()
        if cached is None or now - cached[0] >= CACHE_TTL:
            return False, None
        return True, self._enforced(cached[1], now)

    def verify(self, secret: str) -> ApiKey | None:
        """The live key for this secret, or None. The id in the secret finds the row; the hash proves it."""
        parts = secret.split("_", 2)
        if len(parts) != 3 or parts[0] != "ek":
            return None
        known, key = self.cached(secret)
        if known:
            return key
        digest, now = _hash(secret), time.time()
        try:
            with connect(self.db, "check the API key") as conn:
                row = conn.execute("SELECT * FROM api_keys WHERE id = ?", (parts[1],)).fetchone()
        except DatabaseError:
            stale = self.cache.get(digest)
            if stale is None or now - stale[0] > STALE_TTL:
                raise
            return self._enforced(stale[1], now)  # locked or unreadable for a while: the key as last read serves
        if row is None or not hmac.compare_digest(row["hash"], digest):
            return None
        key = self._key(row)
        self.cache[digest] = (now, key)
        return self._enforced(key, now)

    def _enforced(self, key: ApiKey, now: float) -> ApiKey | None:
        revoked_here = self.pending.get(key.id) or self.pending.get(key.name)
        if revoked_here is not None and key.created <= revoked_here:
            return None
        return key if key.live(now) else None

    def all(self) -> list[ApiKey]:
        """Every key, a revocation still pending here shown as made."""
        with contextlib.suppress(DatabaseError):  # reading works on a full disk; the pending ones wait for room
            self._save_pending()
        with connect(self.db, "list the keys") as conn:
            keys = [self._key(r) for r in conn.execute("SELECT * FROM api_keys ORDER BY created")]
        return [replace(k, revoked=self._revoked_here(k)) if k.revoked is None and self._revoked_here(k) else k
                for k in keys]

    def _revoked_here(self, key: ApiKey) -> float | None:
        when = self.pending.get(key.id) or self.pending.get(key.name)
        return when if when is not None and key.created <= when else None

    def revoke(self, key_id_or_name: str) -> list[ApiKey]:
        """Revoke by id, or every live key with that name; returns what was revoked. Takes effect at once here: when
        the database cannot record it, it is still enforced by this gateway (DatabaseError says so) and saved later."""
        now = time.time()
        try:
            with connect(self.db, f"find key {key_id_or_name[:100]!r}") as conn:
                rows = conn.execute("SELECT * FROM api_keys WHERE (id = ? OR name = ?) AND revoked IS NULL",
                                    (key_id_or_name, key_id_or_name)).fetchall()
        except DatabaseError as exc:  # which keys it names is unknown: enforce it by id and by name meanwhile
            self._hold(key_id_or_name, now)
            raise self._not_saved(key_id_or_name, exc) from None
        if not rows:
            return []
        for row in rows:
            self._hold(row["id"], now)
        try:
            self._save_pending()
        except DatabaseError as exc:
            raise self._not_saved(key_id_or_name, exc) from None
        return [replace(self._key(r), revoked=now) for r in rows]

    def delete(self, name: str, key_id: str | None = None) -> int:
        """Remove the key `key_id` of that name and every revoked key named `name`: for a key a gateway mints for
        itself (the CLI's), which would otherwise leave a row per restart. Others' live keys of the name stay (another
        gateway sharing this database has its own). Returns how many went."""
        with connect(self.db, f"delete the keys named {name[:100]!r}") as conn:
            gone = conn.execute("DELETE FROM api_keys WHERE name = ? AND (id = ? OR revoked IS NOT NULL)",
                                (name, key_id)).rowcount
        self.cache.clear()
        return gone

    def _hold(self, key_id_or_name: str, when: float) -> None:
        self.pending.setdefault(key_id_or_name, when)
        self.cache.clear()

    @staticmethod
    def _not_saved(key: str, exc: DatabaseError) -> DatabaseError:
        return DatabaseError(exc.status, exc.type, f"{key[:100]!r} is revoked on this gateway, which refuses it from "
                                                   f"now on, but {exc.message} (the revocation is saved on the next "
                                                   "change; until then other gateways and a restart do not see it)")

    def _save_pending(self) -> None:
        """Write the revocations the database could not take before; each stays enforced here until it is written."""
        if not self.pending:
            return
        with connect(self.db, "save the revocation") as conn:
            conn.executemany("UPDATE api_keys SET revoked = ? WHERE (id = ? OR name = ?) AND revoked IS NULL "
                             "AND created <= ?", [(when, key, key, when) for key, when in self.pending.items()])
        self.pending.clear()
        self.cache.clear()

    @staticmethod
    def _key(row: sqlite3.Row) -> ApiKey:
        limits = Limits(row["rpm"], row["tpm"], row["concurrency"])
        return ApiKey(row["id"], row["name"], bool(row["admin"]), row["created"], row["revoked"],
                      tuple(json.loads(row["scopes"])), row["expires"], limits)
