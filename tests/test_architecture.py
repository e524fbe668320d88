"""The layout rules the code keeps: no import cycles among our modules, no module over 800 lines
in kvstore/, connectors/ and router/ (generated code excluded).

The import graph is read from the source with `ast` (nothing is imported): an edge for every
import a module runs when it is loaded, i.e. at its top level, inside `try` and `if` blocks too,
but not under `if TYPE_CHECKING:` nor inside functions (a deferred import runs later, once every
module is loaded: it cannot be caught half-initialised).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("kvstore", "router", "connectors", "deploy", "benchmarks")
SIZE_CHECKED = ("kvstore", "connectors", "router")
# What one role needs (issue 20): a tight cap split single concepts over sibling files.
MAX_LINES = 800
GENERATED = REPO / "kvstore" / "_proto"


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def our_modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in (REPO / package).rglob("*.py")
            if ".venv" not in p.parts}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def load_time_imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements that run when the module is loaded."""
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                pending.extend(node.body)
            pending.extend(node.orelse)
        elif isinstance(node, ast.Try):
            pending.extend([*node.body, *node.orelse, *node.finalbody])
            for handler in node.handlers:
                pending.extend(handler.body)
        elif isinstance(node, ast.With):
            pending.extend(node.body)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules of ours it imports at load time (`from a import b` is an edge to
    a.b when b is a module, else to a)."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        for node in load_time_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                source = _resolve(name, path.name == "__init__.py", node)
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source
                           for a in node.names]
            edges.update(t for t in targets if t in modules and t != name)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(start: str) -> None:
        # Iterative, so a deep graph cannot exhaust the recursion limit.
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_cycle_and_only_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_imports_under_type_checking_and_in_functions_do_not_count() -> None:
    tree = ast.parse("import x\nif TYPE_CHECKING:\n    import y\ntry:\n    import z\n"
                     "except ImportError:\n    pass\ndef f():\n    import w\n")
    names = {alias.name for node in load_time_imports(tree) for alias in node.names}
    assert names == {"x", "z"}


def test_relative_imports_resolve_against_the_package() -> None:
    node = ast.parse("from .b import c").body[0]
    assert isinstance(node, ast.ImportFrom)
    assert _resolve("pkg.a", False, node) == "pkg.b"
    assert _resolve("pkg", True, node) == "pkg.b"


def test_the_graph_sees_our_imports() -> None:
    graph = import_graph(our_modules())
    # A known edge each way a module is named: `from x import y` and `from x.y import z`.
    assert "kvstore.tiers.remote.peers" in graph["kvstore.tiers.remote.tier"]
    assert "kvstore.errors" in graph["kvstore.tiers.remote.config"]


def test_no_import_cycles_among_our_modules() -> None:
    found = cycles(import_graph(our_modules()))
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize("package", SIZE_CHECKED)
def test_no_module_is_over_the_line_cap(package: str) -> None:
    sizes = {str(p.relative_to(REPO)): len(p.read_text().splitlines())
             for p in (REPO / package).rglob("*.py") if GENERATED not in p.parents}
    assert sizes, f"no modules found under {package}/"
    over = {path: n for path, n in sizes.items() if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines: {over}"


def test_nothing_outside_tests_imports_tests() -> None:
    # Benchmarks and deploy tools run from a checkout without the test suite's helpers; what
    # both need (services, daemons) lives in deploy/local. Deferred imports count here too.
    offenders = sorted(
        f"{name} -> {target}"
        for name, path in our_modules().items()
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Import | ast.ImportFrom)
        for target in ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [node.module or ""])
        if target == "tests" or target.startswith("tests."))
    assert not offenders, "modules importing tests/:\n" + "\n".join(offenders)


def test_installed_packages_import_only_installed_packages() -> None:
    # pyproject installs some top-level folders only; the rest (benchmarks, tests, proto/) run
    # from a checkout, so a console script that reached them would fail on an installed tree.
    import tomllib

    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    installed = {p.rstrip("*") for p in config["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert installed == {"kvstore", "connectors", "router", "deploy"}
    ours = {*PACKAGES, "tests", "proto"}
    offenders = sorted(
        f"{name} -> {target}"
        for name, path in our_modules().items() if name.split(".")[0] in installed
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Import | ast.ImportFrom) and not getattr(node, "level", 0)
        for target in ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [node.module or ""])
        if target.split(".")[0] in ours - installed)
    assert not offenders, "installed modules importing uninstalled ones:\n" + "\n".join(offenders)
