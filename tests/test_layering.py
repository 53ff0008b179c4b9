"""The dependency rule of docs/architecture.md, read from the source with `ast`: nothing imports ember.gateway except
the CLI, the SDK (ember/, the CLI aside) does not import the runtime or snapshot packages when it is imported,
snapshot/ imports neither runtime/ nor gateway/, and the pure parts (lifecycle, autoscaler policy) import no I/O."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"ember": "ember", "runtime": "ember.runtime", "snapshot": "ember.snapshot", "gateway": "ember.gateway"}
CLI = ROOT / "ember" / "cli"


def module_name(path: Path) -> str:
    folder, *rest = path.relative_to(ROOT).with_suffix("").parts
    parts = [PACKAGES[folder], *rest]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(source: str, module: str, is_package: bool = False) -> list[tuple[str, int, bool]]:
    """(imported module, line, at module level) for every import in `source`, relative ones resolved against
    `module`."""
    package = module if is_package else module.rpartition(".")[0]
    found = []

    def visit(node: ast.AST, top: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno, top) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            # `from ember import gateway` imports ember.gateway: count each name as a possible submodule too
            found.extend(
                [(base, node.lineno, top)] + [(f"{base}.{alias.name}", node.lineno, top) for alias in node.names]
            )
        for child in ast.iter_child_nodes(node):
            visit(child, top and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(source), True)
    return found


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def sources(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def test_the_import_reader_sees_absolute_relative_and_nested_imports():
    source = ("import os\nfrom ember.gateway.replica import Replica\nfrom ..gateway import scaler\n"
              "def f():\n    import ember.snapshot\n")
    found = imports(source, "ember.runtime.node_agent")
    assert ("ember.gateway.replica", 2, True) in found
    assert ("ember.gateway.scaler", 3, True) in found  # `..` from ember.runtime.node_agent is ember
    assert ("ember.snapshot", 5, False) in found
    assert imports("from . import store", "ember.snapshot", is_package=True)[-1][0] == "ember.snapshot.store"


def test_only_the_cli_imports_the_gateway():
    checked, offenders = [], []
    for path in sources("ember", "runtime", "snapshot"):
        if path.is_relative_to(CLI):
            continue
        checked.append(path.relative_to(ROOT).as_posix())
        for name, line, _ in imports(path.read_text(), module_name(path), path.name == "__init__.py"):
            if within(name, "ember.gateway"):
                offenders.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert "runtime/node_agent.py" in checked and "snapshot/store.py" in checked and "ember/app.py" in checked
    assert offenders == [], (
        "docs/design.md: nothing imports ember.gateway except the CLI; move what they share into runtime/:\n"
        + "\n".join(offenders)
    )


def test_the_sdk_imports_neither_runtime_nor_snapshot_when_loaded():
    offenders = []
    for path in sources("ember"):
        if path.is_relative_to(CLI):
            continue
        for name, line, top in imports(path.read_text(), module_name(path), path.name == "__init__.py"):
            if top and (within(name, "ember.runtime") or within(name, "ember.snapshot")):
                offenders.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert offenders == [], "docs/design.md: the SDK knows only specs and the client:\n" + "\n".join(offenders)


def _offenders(paths: list[Path], forbidden) -> list[str]:
    found = []
    for path in paths:
        for name, line, _ in imports(path.read_text(), module_name(path), path.name == "__init__.py"):
            if forbidden(name):
                found.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    return found


def test_snapshot_imports_neither_runtime_nor_gateway():
    offenders = _offenders(sources("snapshot"), lambda n: within(n, "ember.runtime") or within(n, "ember.gateway"))
    assert offenders == [], "docs/architecture.md: snapshot/ stands below runtime/ and gateway/:\n" + "\n".join(
        offenders
    )


PURE = ["gateway/lifecycle.py"] + [f"gateway/autoscaler/{m}.py" for m in
                                    ("policy", "simulator", "admission", "trace", "baselines")]


def test_the_pure_parts_import_no_io_of_the_gateway():
    """The lifecycle imports nothing of Ember; the autoscaler's policy and simulator nothing of the gateway but it."""
    paths = [ROOT / p for p in PURE]
    assert all(p.exists() for p in paths)
    lifecycle = _offenders(paths[:1], lambda n: within(n, "ember"))
    allowed = ("ember.gateway.autoscaler", "ember.gateway.lifecycle")
    autoscaler = _offenders(paths[1:], lambda n: within(n, "ember") and not any(within(n, a) for a in allowed))
    assert lifecycle + autoscaler == [], "docs/architecture.md: pure parts stay pure:\n" + "\n".join(
        lifecycle + autoscaler
    )


def test_the_architecture_document_states_the_rules_checked_here():
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert "tests/test_layering.py" in text and "## The dependency rule" in text
    assert "docs/architecture.md" in (ROOT / "README.md").read_text()
