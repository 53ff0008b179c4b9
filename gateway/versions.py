"""Every deploy of an app is a version, kept in the gateway's SQLite file so a restarted gateway serves what was live.

A version is `checking` while one replica of each of its functions starts (its `enter` runs); then `live` (taking
new calls) or `failed` (the error says why; the previous version kept serving). Going live retires the version that
was live. This module is the one owner of those states: it refuses a move from the wrong one."""
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ember.gateway.database import connect

SCHEMA = """
CREATE TABLE IF NOT EXISTS app_versions (
    app TEXT NOT NULL,
    version INTEGER NOT NULL,
    package TEXT NOT NULL,
    digest TEXT NOT NULL,
    functions TEXT NOT NULL,
    specs TEXT NOT NULL,
    created REAL NOT NULL,
    deployed_by TEXT,
    note TEXT,
    state TEXT NOT NULL,
    error TEXT,
    PRIMARY KEY (app, version)
)
"""
CHECKING, LIVE, RETIRED, FAILED = "checking", "live", "retired", "failed"
INTERRUPTED = "the gateway stopped before this version's check finished; deploy it again"


class VersionError(ValueError):
    """No such version, or one that cannot make the move asked for; the message says which and what to do."""


@dataclass(frozen=True)
class Version:
    app: str
    version: int
    package: str
    digest: str
    functions: list[str]
    specs: dict[str, dict]  # function or class -> its FunctionSpec settings
    created: float
    deployed_by: str | None
    note: str | None
    state: str
    error: str | None

    @classmethod
    def of(cls, row) -> "Version":
        return cls(row["app"], row["version"], row["package"], row["digest"], json.loads(row["functions"]),
                   json.loads(row["specs"]), row["created"], row["deployed_by"], row["note"], row["state"],
                   row["error"])

    def describe(self) -> dict:
        return asdict(self)


class VersionStore:
    def __init__(self, db: Path):
        self.db = db
        with connect(db, "open the app-versions table") as conn:
            conn.execute(SCHEMA)
            # A version still checking belongs to a gateway that stopped mid-deploy: it never took traffic.
            conn.execute("UPDATE app_versions SET state = ?, error = ? WHERE state = ?",
                         (FAILED, INTERRUPTED, CHECKING))

    def add(self, app: str, package: Path, manifest: dict, deployed_by: str | None, note: str | None) -> Version:
        """A new version of `app`, numbered after its last one, in state checking."""
        units = manifest["units"]
        with connect(self.db, f"record a version of app {app!r}") as conn:
            last = conn.execute("SELECT MAX(version) FROM app_versions WHERE app = ?", (app,)).fetchone()[0]
            conn.execute("INSERT INTO app_versions VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, NULL)",
                         (app, (last or 0) + 1, str(package), package.stem, json.dumps(sorted(units)),
                          json.dumps({name: unit["spec"] for name, unit in units.items()}), time.time(), deployed_by,
                          note, CHECKING))
        return self.get(app, (last or 0) + 1)

    def get(self, app: str, version: int) -> Version:
        with connect(self.db, f"read version {version} of app {app!r}") as conn:
            row = conn.execute("SELECT * FROM app_versions WHERE app = ? AND version = ?", (app, version)).fetchone()
        if row is None:
            raise VersionError(f"app {app!r} has no version {version}; `ember apps history {app}` lists them")
        return Version.of(row)

    def history(self, app: str) -> list[Version]:
        """Every version of `app`, newest first."""
        with connect(self.db, f"read the versions of app {app!r}") as conn:
            rows = conn.execute("SELECT * FROM app_versions WHERE app = ? ORDER BY version DESC", (app,)).fetchall()
        return [Version.of(row) for row in rows]

    def live(self) -> list[Version]:
        """The version each app serves, by app name."""
        with connect(self.db, "read the live app versions") as conn:
            rows = conn.execute("SELECT * FROM app_versions WHERE state = ? ORDER BY app", (LIVE,)).fetchall()
        return [Version.of(row) for row in rows]

    def go_live(self, app: str, version: int) -> None:
        """`version` (checked) takes new calls; the version that was live is retired."""
        with connect(self.db, f"make version {version} of app {app!r} live") as conn:
            moved = conn.execute("UPDATE app_versions SET state = ? WHERE app = ? AND version = ? AND state = ?",
                                 (LIVE, app, version, CHECKING)).rowcount
            if not moved:
                raise VersionError(f"version {version} of app {app!r} is not being checked, so it cannot go live")
            conn.execute("UPDATE app_versions SET state = ? WHERE app = ? AND version != ? AND state = ?",
                         (RETIRED, app, version, LIVE))

    def fail(self, app: str, version: int, error: str) -> None:
        with connect(self.db, f"record that version {version} of app {app!r} failed") as conn:
            moved = conn.execute("UPDATE app_versions SET state = ?, error = ? WHERE app = ? AND version = ? "
                                 "AND state = ?", (FAILED, error, app, version, CHECKING)).rowcount
        if not moved:
            raise VersionError(f"version {version} of app {app!r} is not being checked, so it cannot fail")

    def rollback_target(self, app: str, to: int | None) -> Version:
        """The version a rollback of `app` goes back to: `to`, else the newest that served before the live one."""
        versions = self.history(app)
        if not versions:
            raise VersionError(f"no app named {app!r} was ever deployed; `ember apps list` lists the apps")
        live = next((v for v in versions if v.state == LIVE), None)
        if to is not None:
            target = next((v for v in versions if v.version == to), None)
            if target is None:
                raise VersionError(f"app {app!r} has no version {to}; `ember apps history {app}` lists them")
            if target.state == FAILED:
                raise VersionError(f"version {to} of app {app!r} failed its check ({target.error}); pick one that "
                                   f"served from `ember apps history {app}`")
        else:
            older = [v for v in versions if v.state == RETIRED and (live is None or v.version < live.version)]
            if not older:
                raise VersionError(f"app {app!r} has no earlier version that served; `ember apps history {app}`")
            target = older[0]
        if live is not None and target.digest == live.digest:
            raise VersionError(f"version {target.version} of app {app!r} is the code already live (version "
                               f"{live.version})")
        if not Path(target.package).is_file():
            raise VersionError(f"the package of version {target.version} of app {app!r} ({target.package}) is gone; "
                               "deploy that code again with `ember deploy APP.py`")
        return target
