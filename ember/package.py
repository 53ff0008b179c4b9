"""An app shipped to replicas: cloudpickle of the App plus the user's source, content-hashed.

A package is a zip at EMBER_HOME/packages/<sha256>.pkg holding manifest.json (routing and
scaling settings, readable without user code), app.pkl and the source file.
"""
import hashlib
import importlib.util
import io
import json
import linecache
import sys
import zipfile
from pathlib import Path

import cloudpickle

from ember.app import App
from ember.home import Home


def load_app(path: str | Path, name: str | None = None) -> App:
    """Import APP.py and return its App (the one named `name` when the file has several)."""
    path = Path(path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"no app file at {path}")
    module_name = f"ember_user_{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    apps = [value for value in vars(module).values() if isinstance(value, App)]
    if name is not None:
        apps = [app for app in apps if app.name == name]
    if len(apps) != 1:
        found = ", ".join(a.name for a in apps) or "none"
        raise ValueError(f"{path} must define exactly one ember.App{f' named {name!r}' if name else ''} (found: {found})")
    return apps[0]


def build(app: App, home: Home) -> Path:
    """Write the package for `app` (whose module was loaded by load_app) and return its path."""
    module = sys.modules[_module_of(app)]
    source_path = Path(module.__file__)
    _pin_class_ids(app, module, source_path.read_bytes())
    # By value: a replica has the package, not the user's module on its import path.
    cloudpickle.register_pickle_by_value(module)
    try:
        pickled = cloudpickle.dumps(app)
    finally:
        cloudpickle.unregister_pickle_by_value(module)
    manifest = json.dumps(app.manifest() | {"source": source_path.name}).encode()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for name, data in (("manifest.json", manifest), ("app.pkl", pickled), (f"source/{source_path.name}", source_path.read_bytes())):
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))  # fixed time: same app, same hash
            zf.writestr(info, data)
    data = buffer.getvalue()
    target = home.packages / f"{hashlib.sha256(data).hexdigest()}.pkg"
    if not target.exists():
        tmp = target.with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.replace(target)
    return target


def _pin_class_ids(app: App, module, source: bytes) -> None:
    """cloudpickle tags each class it pickles by value with a random id; derive the id from the source
    instead, so one app file always packs to the same bytes and so the same hash."""
    internals = cloudpickle.cloudpickle
    by_class = getattr(internals, "_DYNAMIC_CLASS_TRACKER_BY_CLASS", None)
    by_id = getattr(internals, "_DYNAMIC_CLASS_TRACKER_BY_ID", None)
    if by_class is None or by_id is None:  # another cloudpickle: packages still work, hashes vary
        return
    classes = {v for v in vars(module).values() if isinstance(v, type) and v.__module__ == module.__name__}
    classes |= {unit.user_cls for unit in app.units.values() if hasattr(unit, "user_cls")}
    with internals._DYNAMIC_CLASS_TRACKER_LOCK:
        for cls in classes:
            if cls not in by_class:
                tracker_id = hashlib.sha256(source + b"\0" + cls.__qualname__.encode()).hexdigest()[:32]
                by_class[cls], by_id[tracker_id] = tracker_id, cls


def _module_of(app: App) -> str:
    for unit in app.units.values():
        owner = getattr(unit, "fn", None) or unit.user_cls
        return owner.__module__
    raise ValueError(f"app {app.name!r} declares no functions or classes")


class PackageError(ValueError):
    """The file is not an Ember package (not a zip, or no readable manifest)."""


def read_manifest(package: str | Path) -> dict:
    try:
        with zipfile.ZipFile(package) as zf:
            return json.loads(zf.read("manifest.json"))
    except (zipfile.BadZipFile, KeyError, ValueError) as exc:
        raise PackageError(f"{package} is not an Ember package ({type(exc).__name__}: {exc}); "
                           "build one with `ember deploy APP.py`") from None


def unpack(package: str | Path) -> App:
    """Load the App from a package alone (what a replica does)."""
    with zipfile.ZipFile(package) as zf:
        source = zf.read(f"source/{json.loads(zf.read('manifest.json'))['source']}").decode()
        app = cloudpickle.loads(zf.read("app.pkl"))
    # cloudpickle names by-value code "<dynamic-code>"; it all comes from the one source file shipped
    # here, so tracebacks in a replica can show the user's lines.
    linecache.cache["<dynamic-code>"] = (len(source), None, source.splitlines(keepends=True), "<dynamic-code>")
    return app
