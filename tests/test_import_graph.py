"""kvtier's import graph: no cycles, and no import from a lower layer into a higher one.

The layers are those of docs/architecture.md ("Layers"). Every import counts: at module level,
inside functions (a lazy import hides a cycle, it does not remove it) and under
``TYPE_CHECKING``. The graph is read from the source with :mod:`ast`, nothing is imported.

To extend: a new module or subpackage gets a line in :data:`LAYERS` (the longest matching
prefix decides a module's layer; a module with no layer fails the test).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "kvtier"

LAYERS: dict[str, int] = {
    # 0: the vocabulary: types, keys, configuration, boundary checks; the compute kernels
    "kvtier.types": 0, "kvtier.hashing": 0, "kvtier.config": 0, "kvtier.checks": 0, "kvtier.kernels": 0,
    "kvtier.model_keys": 0, "kvtier.media": 0,
    # 1: the bytes and where they live: block records, wire formats, tiers
    "kvtier.records": 1, "kvtier.wire": 1, "kvtier.auth": 1, "kvtier.tiers": 1,
    # 2: moving blocks between tiers, the store; the package's facade (kvtier/__init__.py)
    "kvtier.transfer": 2, "kvtier.store": 2, "kvtier": 2,
    # 3: faces of a store in one process: engine connectors, metrics and dashboard, test doubles
    "kvtier.connectors": 3, "kvtier.metrics": 3, "kvtier.dashboard": 3, "kvtier.testing": 3,
    # 4: the daemon (many stores, HTTP)
    "kvtier.server": 4,
    # 5: the application: command line, demo, models and datasets, plots
    "kvtier.app": 5, "kvtier.__main__": 5,
}

KNOWN_CYCLES: list[frozenset[str]] = []
"""Cycles tolerated until the change that removes them lands. An entry that no longer
matches a cycle fails the test: delete it."""


# -- the graph -----------------------------------------------------------------------------------
def modules(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``package_dir``."""
    found = {}
    for path in package_dir.rglob("*.py"):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imported_names(node: ast.AST, module: str, is_package: bool) -> Iterator[str]:
    """Dotted names an ``import`` / ``from ... import`` node may bind, most specific first
    (``from a import b`` -> ``a.b`` then ``a``)."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative: from the module's package, one level up per extra dot
            package = module.split(".") if is_package else module.split(".")[:-1]
            package = package[: len(package) - (node.level - 1)]
            base = ".".join(package + ([base] if base else []))
        for alias in node.names:
            yield f"{base}.{alias.name}"
        yield base


def imports(package_dir: Path) -> dict[tuple[str, str], str]:
    """Edges ``(importer, imported) -> "file:line"`` between the package's modules, for every
    import statement anywhere in a module (functions and ``TYPE_CHECKING`` blocks too). An
    import of a name that is not a module of the package binds to the nearest enclosing one
    that is, or to the longest :data:`LAYERS` prefix (a package found elsewhere on disk)."""
    mods = modules(package_dir)
    root = package_dir.name
    edges: dict[tuple[str, str], str] = {}
    for module, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            names = list(_imported_names(node, module, path.name == "__init__.py"))
            for target in _resolve(names, mods, root, isinstance(node, ast.ImportFrom)):
                if target != module:
                    edges.setdefault((module, target), f"{path.relative_to(package_dir.parent)}:{node.lineno}")
    return edges


def _resolve(names: list[str], mods: dict[str, Path], root: str, is_from: bool) -> set[str]:
    if not any(n == root or n.startswith(root + ".") for n in names):
        return set()  # outside the package
    if is_from:  # ``from a import b, c``: the submodules imported, else ``a`` itself
        subs = {n for n in names[:-1] if n in mods}
        return subs or {_nearest(names[-1], mods)}
    return {_nearest(n, mods) for n in names}


def _nearest(name: str, mods: dict[str, Path]) -> str:
    prefix = _longest(name, LAYERS)
    while name not in mods and name.count("."):
        if prefix is not None and name == prefix:
            return name  # a layer's package that is not under kvtier/ (kernels/)
        name = name.rpartition(".")[0]
    return name


def _longest(name: str, prefixes) -> str | None:
    matches = [p for p in prefixes if name == p or (name.startswith(p + ".") and p.count("."))]
    return max(matches, key=len, default=None)


def layer_of(module: str) -> int | None:
    prefix = _longest(module, LAYERS)
    return None if prefix is None else LAYERS[prefix]


def cycles(edges) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph: dict[str, list[str]] = {}
    for a, b in edges:
        graph.setdefault(a, []).append(b)
        graph.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _explain(component: set[str], edges) -> str:
    inner = sorted(f"  {a} -> {b} ({where})" for (a, b), where in edges.items() if a in component and b in component)
    return "cycle " + " <-> ".join(sorted(component)) + ":\n" + "\n".join(inner)


# -- the tests -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def edges():
    return imports(PACKAGE_DIR)


def test_every_module_has_a_layer(edges):
    missing = sorted(m for m in modules(PACKAGE_DIR) if layer_of(m) is None)
    assert not missing, f"add these modules to LAYERS in {__file__} and to docs/architecture.md: {missing}"


def test_kvtier_has_no_import_cycle(edges):
    found = cycles(edges)
    unknown = [c for c in found if frozenset(c) not in KNOWN_CYCLES]
    assert not unknown, "\n".join(_explain(c, edges) for c in unknown)
    stale = [sorted(c) for c in KNOWN_CYCLES if c not in {frozenset(f) for f in found}]
    assert not stale, f"these cycles are gone: delete them from KNOWN_CYCLES: {stale}"


def test_no_module_imports_from_a_higher_layer(edges):
    upward = sorted(
        f"{a} (layer {layer_of(a)}) -> {b} (layer {layer_of(b)}) at {where}"
        for (a, b), where in edges.items()
        if layer_of(a) is not None and layer_of(b) is not None and layer_of(b) > layer_of(a)
    )
    assert not upward, "imports against the layers of docs/architecture.md:\n" + "\n".join(upward)


def test_the_tiers_and_the_wire_format_never_import_the_daemon(edges):
    """The daemon's client (tiers/remote.py) reads the wire format from below (kvtier.wire)."""
    below = ("kvtier.tiers", "kvtier.wire", "kvtier.records", "kvtier.checks")
    wrong = [(a, b, where) for (a, b), where in edges.items()
             if a.startswith(below) and (b == "kvtier.server" or b.startswith("kvtier.server."))]
    assert not wrong
    assert ("kvtier.tiers.remote", "kvtier.wire") in edges  # the walker sees the real import


def test_the_walker_finds_lazy_and_type_checking_imports(tmp_path):
    """The checks above can fail: a cycle hidden in a function, a relative import and a
    TYPE_CHECKING import are all edges."""
    pkg = tmp_path / "kvtier"
    (pkg / "server").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "server" / "__init__.py").write_text("")
    (pkg / "server" / "app.py").write_text("from . import frames\n")
    (pkg / "server" / "frames.py").write_text("def f():\n    from kvtier.server.app import error\n")
    (pkg / "types.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvtier.server.app import X\n")
    (pkg / "tiers.py").write_text("import kvtier.types\nfrom kvtier import server\n")
    found = imports(pkg)
    assert ("kvtier.server.app", "kvtier.server.frames") in found
    assert found[("kvtier.server.frames", "kvtier.server.app")] == "kvtier/server/frames.py:2"
    assert ("kvtier.types", "kvtier.server.app") in found
    assert {("kvtier.tiers", "kvtier.types"), ("kvtier.tiers", "kvtier.server")} <= set(found)
    assert cycles(found) == [{"kvtier.server.app", "kvtier.server.frames"}]
    assert layer_of("kvtier.types") == 0 and layer_of("kvtier.server.app") == 4
    assert layer_of("kvtier.app.demo") == 5 and layer_of("kvtier.connectors.vllm.worker") == 3
    assert layer_of("kvtier.nothing") is None


def documented_layers(doc: str) -> dict[str, int]:
    """Module prefix -> layer, from the table of the "## Layers" section of ``doc``: rows
    ``| <layer> <name> | `kvtier.x`, `kvtier.y` (...) | ... |``, prefixes in backquotes."""
    section = doc.split("\n## Layers", 1)[1].split("\n## ", 1)[0]
    found: dict[str, int] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0][:1].isdigit():
            for prefix in re.findall(r"`(kvtier(?:\.[\w.]+)?)`", cells[1]):
                found[prefix] = int(cells[0].split()[0])
    return found


def test_the_layers_of_docs_architecture_md_are_these():
    doc = (PACKAGE_DIR.parent / "docs" / "architecture.md").read_text()
    assert documented_layers(doc) == LAYERS, "docs/architecture.md (Layers) and LAYERS disagree"


def test_documented_layers_reads_the_table():
    doc = "# x\n## Layers (t)\n| layer | modules |\n|---|---|\n| 0 a | `kvtier.types`, `kvtier` (the facade) |\n" \
          "| 4 b | `kvtier.server` |\n## Next\n| 1 c | `kvtier.wire` |\n"
    assert documented_layers(doc) == {"kvtier.types": 0, "kvtier": 0, "kvtier.server": 4}
