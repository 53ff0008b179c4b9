"""An app shipped to replicas: cloudpickle of the App plus the user's source, content-hashed.

A package is a zip at EMBER_HOME/packages/<sha256>.pkg holding manifest.json (routing and
scaling settings, readable without user code), app.pkl and the source file. The app file's local imports (modules
under its folder that loading it imported) are pickled by value with it: a replica has no copy of that folder.
"""
import collections
import hashlib
import importlib.util
import io
import json
import linecache
import pickle
import sys
import traceback
import types
import zipfile
from pathlib import Path
from types import ModuleType
from typing import Any

import cloudpickle

from ember.app import App, Cls, Function
from ember.home import Home
from ember.spec import SpecError

LOCAL_IMPORTS: dict[str, list[str]] = {}  # app module name -> the local modules loading it imported


class AppLoadError(RuntimeError):
    """The app file could not be imported. The message holds the user's own frames of the traceback (not the import
    machinery's or Ember's), which is what a CLI prints; the exception itself is the `__cause__`."""


def _users_traceback(exc: BaseException) -> str:
    """`exc` as Python prints it, without the frames of importlib and of this module."""
    shown = traceback.TracebackException.from_exception(exc)
    shown.stack = traceback.StackSummary.from_list(
        [f for f in shown.stack if not f.filename.startswith("<frozen ") and f.filename != __file__])
    lines = list(shown.format())
    return "".join(lines[1:] if lines[0].startswith("Traceback") else lines).rstrip()  # a report, not a crash


def _raised_by_ember(exc: BaseException) -> bool:
    """A ValueError or TypeError raised in Ember's own code: its validation of what the app file declares."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    module = tb.tb_frame.f_globals.get("__name__", "") if tb is not None else ""
    return isinstance(exc, (ValueError, TypeError)) and module.startswith("ember.")


def load_app(path: str | Path, name: str | None = None) -> App:
    """Import APP.py and return its App (the one named `name` when the file has several)."""
    path = Path(path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"no app file at {path}")
    module_name = f"ember_user_{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise AppLoadError(f"{path} is not a Python file: give the .py file that defines the ember.App")
    module = importlib.util.module_from_spec(spec)
    before = set(sys.modules)
    sys.modules[module_name] = module
    sys.path.insert(0, str(path.parent))  # as `python APP.py` would: its folder's modules import by name
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        if _raised_by_ember(exc):  # a check of the app's own definition (a bad name, a misspelt setting) says what
            if isinstance(exc, TypeError):  # to fix in its message (a decorator's misuse: a SpecError, printed so)
                raise SpecError(str(exc)) from exc
            raise
        raise AppLoadError(f"importing {path} failed:\n{_users_traceback(exc)}") from exc
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    finally:
        sys.path.remove(str(path.parent))
    LOCAL_IMPORTS[module_name] = [m for m in set(sys.modules) - before - {module_name}
                                  if _is_local(sys.modules[m], path.parent)]
    apps = [value for value in vars(module).values() if isinstance(value, App)]
    if name is not None:
        apps = [app for app in apps if app.name == name]
    if len(apps) != 1:
        found = ", ".join(a.name for a in apps) or "none"
        raise ValueError(
            f"{path} must define exactly one ember.App{f' named {name!r}' if name else ''} (found: {found})"
        )
    return apps[0]


def _is_local(module: ModuleType | None, folder: Path) -> bool:
    """A module from a file under `folder` that is not an installed package (a virtualenv may live there too)."""
    file = getattr(module, "__file__", None)
    if not file:
        return False
    path = Path(file).resolve()
    return path.is_relative_to(folder) and not {"site-packages", "dist-packages"} & set(path.parts)


def _found_in(module: ModuleType, folder: Path) -> bool:
    """Whether `module` imports from `folder` itself (which the app's loading put first on sys.path)."""
    top = module.__name__.split(".")[0]
    return (folder / f"{top}.py").is_file() or (folder / top).is_dir()


def local_modules(app: App) -> list[ModuleType]:
    """The app file's module and the local modules loading it imported: what `ember serve` watches for edits."""
    name = _module_of(app)
    return [sys.modules[name]] + [sys.modules[m] for m in LOCAL_IMPORTS.get(name, []) if m in sys.modules]


def build(app: App, home: Home) -> Path:
    """Write the package for `app` (whose module was loaded by load_app) and return its path."""
    module = sys.modules[_module_of(app)]
    if module.__file__ is None:
        raise ValueError(f"app {app.name!r} comes from module {module.__name__}, which has no file to package")
    source_path = Path(module.__file__)
    # By value: a replica has the package, not the user's modules on its import path. A local module that imports
    # by a name from elsewhere (a package above the app's folder, as `tests.x.y`) stays by reference.
    folder = source_path.resolve().parent
    by_value = [m for m in local_modules(app) if m is module or _found_in(m, folder)]
    _pin_class_ids(app, by_value)
    for each in by_value:
        cloudpickle.register_pickle_by_value(each)
    try:
        pickled = _dumps(app)
    except (pickle.PicklingError, TypeError, AttributeError, RecursionError) as exc:
        raise ValueError(f"app {app.name!r} cannot be packaged: {_unpicklable(by_value) or ''}{exc}. What its "
                         "functions use from the module is shipped to replicas by value: make such an object in an "
                         "@ember.enter() hook (or inside the function) instead of at module level") from None
    finally:
        for each in by_value:
            cloudpickle.unregister_pickle_by_value(each)
    manifest = json.dumps(app.manifest() | {"source": source_path.name}).encode()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for name, data in (
            ("manifest.json", manifest),
            ("app.pkl", pickled),
            (f"source/{source_path.name}", source_path.read_bytes()),
        ):
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))  # fixed time: same app, same hash
            zf.writestr(info, data)
    data = buffer.getvalue()
    target = home.packages / f"{hashlib.sha256(data).hexdigest()}.pkg"
    if not target.exists():
        tmp = target.with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.replace(target)
    return target


def _dumps(app: Any) -> bytes:
    """cloudpickle's bytes of `app` (or any value), with reductions for objects a module-level web app holds that
    pickle but do not unpickle: Starlette's `State` (in every FastAPI app) answers any attribute from its dict, so
    rebuilding one looked for `_state` in `_state` until the stack ran out (RecursionError in the replica)."""
    reducers = {}
    if (starlette := sys.modules.get("starlette.datastructures")) is not None:
        reducers[starlette.State] = _reduce_state
    # The pickler reads its dispatch table when it is made: a subclass carries the extra reductions.
    table = collections.ChainMap(reducers, cloudpickle.CloudPickler.dispatch_table)
    pickler = type("AppPickler", (cloudpickle.CloudPickler,), {"dispatch_table": table})
    buffer = io.BytesIO()
    pickler(buffer, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(app)
    return buffer.getvalue()


def _unpicklable(modules: list[ModuleType]) -> str | None:
    """'module.name: ' of the first module-level value of `modules` that does not pickle (what a failed build names)."""
    for module in modules:
        for name, value in vars(module).items():
            if name.startswith("__") or isinstance(value, (ModuleType, type, types.FunctionType)):
                continue
            try:
                _dumps(value)
            except Exception:  # noqa: BLE001 - whatever stops it pickling is what the message names
                return f"{module.__name__.removeprefix('ember_user_')}.{name}: "
    return None


def _reduce_state(state: Any) -> tuple:
    return type(state), (dict(state._state),)


def _pin_class_ids(app: App, modules: list[ModuleType]) -> None:
    """cloudpickle tags each class it pickles by value with a random id; derive the id from its module's source
    instead, so one app file always packs to the same bytes and so the same hash."""
    internals = cloudpickle.cloudpickle
    by_class = getattr(internals, "_DYNAMIC_CLASS_TRACKER_BY_CLASS", None)
    by_id = getattr(internals, "_DYNAMIC_CLASS_TRACKER_BY_ID", None)
    if by_class is None or by_id is None:  # another cloudpickle: packages still work, hashes vary
        return
    sources = {m.__name__: Path(file).read_bytes() for m in modules if (file := m.__file__)}
    classes = {v for m in modules for v in vars(m).values() if isinstance(v, type) and v.__module__ in sources}
    classes |= {unit.user_cls for unit in app.units.values() if hasattr(unit, "user_cls")}
    with internals._DYNAMIC_CLASS_TRACKER_LOCK:
        for cls in classes:
            if cls not in by_class and cls.__module__ in sources:
                pinned = sources[cls.__module__] + b"\0" + cls.__qualname__.encode()
                tracker_id = hashlib.sha256(pinned).hexdigest()[:32]
                by_class[cls], by_id[tracker_id] = tracker_id, cls


def _owner(unit: Function | Cls) -> Any:
    """The user's function or class behind a unit."""
    return unit.fn if isinstance(unit, Function) else unit.user_cls


def _module_of(app: App) -> str:
    for unit in app.units.values():
        return _owner(unit).__module__
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
    return _with_user_filenames(app, source)


DYNAMIC = "<dynamic-code>"  # the file name cloudpickle gives all code it pickles by value


def _renamed(code: types.CodeType, filename: str) -> types.CodeType:
    consts = tuple(_renamed(c, filename) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


def _with_user_filenames(app: App, main_source: str) -> App:
    """Give the user's by-value code back its file name (cloudpickle calls it all "<dynamic-code>"), so a traceback in
    a replica reads `File "/path/app.py", line 12, in fn`: each function's module keeps `__file__` in the globals
    cloudpickle rebuilt. The app file's source rides in the package, so its lines show even where the path does not
    exist (another machine)."""
    seen: set[int] = set()
    todo: list = [_owner(unit) for unit in app.units.values()]
    while todo:
        item = todo.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, type):
            todo += list(vars(item).values())
        elif isinstance(item, (staticmethod, classmethod)):
            todo.append(item.__func__)
        elif isinstance(item, property):
            todo += [f for f in (item.fget, item.fset, item.fdel) if f]
        elif isinstance(item, types.FunctionType) and item.__code__.co_filename == DYNAMIC:
            filename = item.__globals__.get("__file__")
            if filename:
                item.__code__ = _renamed(item.__code__, filename)
            # The helpers and classes it calls were pickled by value with it; a closure's cells too.
            todo += [v for v in item.__globals__.values() if isinstance(v, (type, types.FunctionType))]
            todo += [c.cell_contents for c in item.__closure__ or () if c.cell_contents is not None]
    first = next(iter(app.units.values()))
    owner = first.fn if isinstance(first, Function) else next(
        (f for f in vars(first.user_cls).values() if isinstance(f, types.FunctionType)), None)
    main_file = owner.__globals__.get("__file__") if owner is not None else None
    if main_file and not Path(main_file).exists():  # built on another machine: its lines from the package
        linecache.cache[main_file] = (len(main_source), None, main_source.splitlines(keepends=True), main_file)
    return app
