"""Per-app rate limits, set through `PUT /admin/apps/{app}/limits` and kept in SQLite."""
import sqlite3
import time
from pathlib import Path

from ember.gateway.ratelimit import Limits

SCHEMA = "CREATE TABLE IF NOT EXISTS app_limits (app TEXT PRIMARY KEY, rpm INTEGER, tpm INTEGER, concurrency INTEGER)"
CACHE_TTL = 1.0  # seconds a change made through another gateway takes to apply here


class AppLimitStore:
    def __init__(self, db: Path):
        self.db = db
        self.cache: dict[str, tuple[float, Limits]] = {}
        with sqlite3.connect(self.db, timeout=10) as conn:
            conn.execute(SCHEMA)

    def get(self, app: str) -> Limits:
        now = time.monotonic()
        cached = self.cache.get(app)
        if cached is not None and now - cached[0] < CACHE_TTL:
            return cached[1]
        with sqlite3.connect(self.db, timeout=10) as conn:
            row = conn.execute("SELECT rpm, tpm, concurrency FROM app_limits WHERE app = ?", (app,)).fetchone()
        limits = Limits(*row) if row else Limits()
        self.cache[app] = (now, limits)
        return limits

    def set(self, app: str, limits: Limits) -> None:
        with sqlite3.connect(self.db, timeout=10) as conn:
            conn.execute("INSERT OR REPLACE INTO app_limits VALUES (?, ?, ?, ?)",
                         (app, limits.requests_per_minute, limits.tokens_per_minute, limits.max_concurrent))
        self.cache.pop(app, None)
