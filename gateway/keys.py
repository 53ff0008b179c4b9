"""API keys: random `ek_` secrets shown once, stored as sha256 hashes in SQLite."""
import hashlib
import hmac
import secrets
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

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


@dataclass(frozen=True)
class ApiKey:
    id: str
    name: str
    admin: bool
    created: float
    revoked: float | None


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class KeyStore:
    def __init__(self, db: Path):
        self.db = db
        with self._connect() as conn:
            conn.execute(SCHEMA)

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.db, timeout=10)
        conn.row_factory = sqlite3.Row
        return conn

    def create(self, name: str, admin: bool = False) -> tuple[ApiKey, str]:
        """Returns the key record and its secret; the secret is not stored and cannot be shown again."""
        key_id = secrets.token_hex(4)
        secret = f"ek_{key_id}_{secrets.token_urlsafe(32)}"
        key = ApiKey(key_id, name, admin, time.time(), None)
        with self._connect() as conn:
            conn.execute("INSERT INTO api_keys VALUES (?, ?, ?, ?, ?, NULL)", (key_id, name, _hash(secret), int(admin), key.created))
        return key, secret

    def verify(self, secret: str) -> ApiKey | None:
        """The live key for this secret, or None. The id in the secret finds the row; the hash proves it."""
        parts = secret.split("_", 2)
        if len(parts) != 3 or parts[0] != "ek":
            return None
        with self._connect() as conn:
            row = conn.execute("SELECT * FROM api_keys WHERE id = ? AND revoked IS NULL", (parts[1],)).fetchone()
        if row is None or not hmac.compare_digest(row["hash"], _hash(secret)):
            return None
        return self._key(row)

    def all(self) -> list[ApiKey]:
        with self._connect() as conn:
            return [self._key(r) for r in conn.execute("SELECT * FROM api_keys ORDER BY created")]

    def revoke(self, key_id_or_name: str) -> list[ApiKey]:
        """Revoke by id, or every live key with that name; returns what was revoked."""
        with self._connect() as conn:
            rows = conn.execute(
                "SELECT * FROM api_keys WHERE (id = ? OR name = ?) AND revoked IS NULL", (key_id_or_name, key_id_or_name)
            ).fetchall()
            now = time.time()
            conn.executemany("UPDATE api_keys SET revoked = ? WHERE id = ?", [(now, r["id"]) for r in rows])
        return [ApiKey(r["id"], r["name"], bool(r["admin"]), r["created"], now) for r in rows]

    @staticmethod
    def _key(row: sqlite3.Row) -> ApiKey:
        return ApiKey(row["id"], row["name"], bool(row["admin"]), row["created"], row["revoked"])
