"""Per-app rate limits, set through `PUT /admin/apps/{app}/limits` and kept in SQLite."""
import time
from pathlib import Path

from ember.gateway.database import connect
from ember.gateway.ratelimit import Limits

SCHEMA = "CREATE TABLE IF NOT EXISTS app_limits (app TEXT PRIMARY KEY, rpm INTEGER, tpm INTEGER, concurrency INTEGER)"
CACHE_TTL = 1.0  # seconds a change made through another gateway takes to apply here


class AppLimitStore:
    def __init__(self, db: Path):
        self.db = db
        self.cache: dict[str, tuple[float, Limits]] = {}
        with connect(db, "open the app-limits table") as conn:
            conn.execute(SCHEMA)

    def cached(self, app: str) -> Limits | None:
        """The app's limits when the cache knows them, without touching the database."""
        cached = self.cache.get(app)
        return cached[1] if cached is not None and time.monotonic() - cached[0] < CACHE_TTL else None

    def get(self, app: str) -> Limits:
        now = time.monotonic()
        cached = self.cached(app)
        if cached is not None:
            return cached
        with connect(self.db, f"read the limits of app {app!r}") as conn:
            row = conn.execute("SELECT rpm, tpm, concurrency FROM app_limits WHERE app = ?", (app,)).fetchone()
        limits = Limits(*row) if row else Limits()
        self.cache[app] = (now, limits)
        return limits

    def set(self, app: str, limits: Limits) -> None:
        with connect(self.db, f"save the limits of app {app!r}") as conn:
            conn.execute("INSERT OR REPLACE INTO app_limits VALUES (?, ?, ?, ?)",
                         (app, limits.requests_per_minute, limits.tokens_per_minute, limits.max_concurrent))
        self.cache.pop(app, None)
