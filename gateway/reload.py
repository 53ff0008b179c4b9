"""`ember serve`'s hot reload: the app file and its local imports are polled for edits; an edit rebuilds the package
and redeploys it, so new calls go to the new version while the old replicas finish theirs and stop. An edit that
does not load (a syntax error, a bad decorator argument) is printed with the user's file and line, and the previous
version keeps serving."""
import asyncio
import importlib
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path

from ember.home import Home
from ember.package import LOCAL_IMPORTS, AppLoadError, build, load_app, local_modules
from ember.runtime import environments

POLL = 0.2  # seconds between looks at the watched files' mtimes
SETTLE = 0.05  # an editor may write a file in several steps: wait this long after the first change

Fingerprint = dict[Path, tuple[int, int] | None]


def fingerprint(paths: list[Path]) -> Fingerprint:
    """(mtime_ns, size) of each file; None for one that is gone (an editor's rename-over-save)."""
    prints: Fingerprint = {}
    for path in paths:
        try:
            stat = path.stat()
        except FileNotFoundError:
            prints[path] = None
        else:
            prints[path] = (stat.st_mtime_ns, stat.st_size)
    return prints


def describe_failure(exc: BaseException, folder: Path) -> str:
    """What went wrong, at the user's file and line: the SyntaxError's own, else the deepest frame under `folder`."""
    if isinstance(exc, AppLoadError) and exc.__cause__ is not None:
        exc = exc.__cause__
    if isinstance(exc, SyntaxError):
        where = f"{exc.filename}:{exc.lineno}"
        text = f"\n    {exc.text.rstrip()}" if exc.text else ""
        return f"{where}: {type(exc).__name__}: {exc.msg}{text}"
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename).resolve().is_relative_to(folder)]
    where = f"{frames[-1].filename}:{frames[-1].lineno}: " if frames else ""
    return f"{where}{type(exc).__name__}: {exc}"


class AppWatcher:
    """Watches one app file and redeploys it through `deploy` on every edit that loads."""

    def __init__(self, app_path: str | Path, package: Path, deploy: Callable[[Path], Awaitable[object]],
                 home: Home, say: Callable[[str], None]):
        self.path = Path(app_path).resolve()
        self.package, self.deploy, self.home, self.say = package, deploy, home, say
        self.watched = [self.path]
        # Python trusts a .pyc whose source has the same whole-second mtime and size: an edit within the second of
        # the last import could load the old code, so none is written for the modules this process reloads.
        sys.dont_write_bytecode = True
        self._drains: set[asyncio.Task] = set()

    def watch_loaded(self, app) -> None:
        """Watch the files `app`'s load read: its module and the local modules it imported."""
        self.watched = [Path(file).resolve() for m in local_modules(app) if (file := m.__file__)]

    async def run(self) -> None:
        seen = fingerprint(self.watched)
        while True:
            await asyncio.sleep(POLL)
            if fingerprint(self.watched) == seen:
                continue
            await asyncio.sleep(SETTLE)
            now = fingerprint(self.watched)
            await self.reload([p.name for p in self.watched if now.get(p) != seen.get(p)])
            fresh = fingerprint(self.watched)  # a reload may watch new local imports
            seen = {p: now[p] if p in now else fresh[p] for p in self.watched}

    async def reload(self, changed: list[str]) -> None:
        began = time.monotonic()
        try:
            app, package = await asyncio.to_thread(self._load)
        except Exception as exc:
            self.say(f"reload failed, still serving the previous version: {describe_failure(exc, self.path.parent)}")
            return
        if package == self.package:
            return
        self.package = package
        # The deploy routes new calls to the new version at once; waiting for the old replicas to drain is its own task.
        drain = asyncio.ensure_future(self.deploy(package))
        self._drains.add(drain)
        drain.add_done_callback(self._drained)
        await asyncio.sleep(0)
        self.say(f"reloaded app {app.name!r} ({', '.join(changed) or self.path.name} changed) in "
                 f"{time.monotonic() - began:.2f} s")

    def _drained(self, drain: asyncio.Task) -> None:
        self._drains.discard(drain)
        if not drain.cancelled() and drain.exception() is not None:
            self.say(f"redeploy failed: {drain.exception()}")

    def _load(self):
        """Import the app file again, its local imports afresh too, and build its package."""
        old = LOCAL_IMPORTS.get(f"ember_user_{self.path.stem}", [])
        for name in old:
            sys.modules.pop(name, None)
        importlib.invalidate_caches()
        app = load_app(self.path)
        self.watch_loaded(app)
        package = build(app, self.home)
        environments.ensure_for_package(package, lambda line: self.say(f"  {line}"), self.home)
        return app, package

