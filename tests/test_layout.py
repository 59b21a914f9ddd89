"""The import layout, read from the source with ``ast`` (nothing is imported or run).

Two rules:

* ``kernels/`` and ``pipelines/`` build on hetero's public names only: no import of a
  ``hetero._x`` module or of a ``_name`` from any hetero module (their own included), and
  no ``obj._attr`` reach into another object (``self``/``cls`` excepted). What they need
  from the runtime is in :mod:`hetero.lowlevel`.
* No import cycles among hetero's modules (``hetero/``, ``kernels/`` as ``hetero.kernels``,
  ``pipelines/`` as ``hetero.pipelines``). Every import statement counts, at module level
  or inside a function, except those under ``if TYPE_CHECKING:`` (never executed).
  ``import a.b.c`` and ``from a.b import c`` are an edge to the deepest of hetero's
  modules they name (``a.b.c`` when it is a module, else ``a.b``); the parent packages
  that Python initialises on the way are not edges.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"hetero": ROOT / "hetero", "hetero.kernels": ROOT / "kernels", "hetero.pipelines": ROOT / "pipelines"}
EXTENSIONS = ("hetero.kernels", "hetero.pipelines")

# Cycles tolerated for now (none): a new one fails test_no_import_cycles.
KNOWN_CYCLES: list[frozenset[str]] = []


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package, folder in FOLDERS.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, *, type_checking: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements of ``tree``; those under ``if TYPE_CHECKING:`` only with ``type_checking``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test) and not type_checking:
            for child in node.orelse:
                yield from _imports(ast.Module(body=[child], type_ignores=[]), type_checking=type_checking)
            continue
        yield from _imports(node, type_checking=type_checking)


def _source_module(name: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` reads from (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    parts = name.split(".")
    base = parts if path.name == "__init__.py" else parts[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(name: str, path: Path, node: ast.Import | ast.ImportFrom) -> Iterator[tuple[str, str | None]]:
    """(module, imported name or None) for each thing the statement imports."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name, None
        return
    source = _source_module(name, path, node)
    for alias in node.names:
        yield source, alias.name


def _edges() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in _imports(tree, type_checking=False):
            for module, imported in _targets(name, path, node):
                full = f"{module}.{imported}" if imported is not None else module
                target = full if full in MODULES else module if module in MODULES else None
                if target is not None and target != name:
                    graph[name].add(target)
    return graph


def _components(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component: set[str] = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle through each strongly connected component."""
    return [_one_cycle(graph, c) for c in _components(graph)]


def _one_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A closed path through the component's smallest module (breadth first, so a shortest one)."""
    start = min(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following: list[str] = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in parents:
                    parents[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"no cycle through {start}")


def test_kernels_and_pipelines_import_only_public_names() -> None:
    bad: list[str] = []
    for name, path in MODULES.items():
        if not name.startswith(EXTENSIONS):
            continue
        where = path.relative_to(ROOT)
        tree = ast.parse(path.read_text(), str(path))
        for node in _imports(tree, type_checking=True):
            for module, imported in _targets(name, path, node):
                if module != "hetero" and not module.startswith("hetero."):
                    continue
                private = [p for p in module.split(".") if p.startswith("_") and not p.startswith("__")]
                if private:
                    bad.append(f"{where}:{node.lineno}: imports private module {module}")
                if imported is not None and imported.startswith("_"):
                    bad.append(f"{where}:{node.lineno}: imports private name {imported} from {module}")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                bad.append(f"{where}:{node.lineno}: reaches into private attribute {node.attr}")
    assert not bad, "kernels/ and pipelines/ must use hetero's public names (hetero.lowlevel):\n" + "\n".join(bad)


def test_no_import_cycles() -> None:
    graph = _edges()
    found = [c for c in _components(graph) if frozenset(c) not in KNOWN_CYCLES]
    assert not found, "import cycles:\n" + "\n".join(
        " -> ".join(_one_cycle(graph, c)) + f"  (modules that import each other: {', '.join(sorted(c))})"
        for c in found)


def test_the_cycle_finder_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert _cycles(graph) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_imports_are_resolved_to_hetero_modules() -> None:
    graph = _edges()
    assert "hetero.kernels.matmul" in graph["hetero.ops"]           # from hetero.kernels.matmul import matmul
    assert "hetero.lowlevel" in graph["hetero.kernels.nn"]          # from hetero.lowlevel import ...
    assert "hetero.kernels.nn_wgsl" in graph["hetero.kernels.nn"]   # from hetero.kernels import nn_wgsl
    assert "hetero._scheduler" in graph["hetero._runtime"]          # relative: from ._scheduler import ...
    assert "hetero._gpu.device" not in graph["hetero._gpu.fence"]           # only under TYPE_CHECKING
    assert "hetero.pipelines.embed_cli" in graph["hetero._cli"]     # inside a function


# What the GPU runtime layer (hetero._gpu) may import besides itself: the modules both layers share.
SHARED = {"hetero.errors", "hetero._trace", "hetero._bridge", "hetero._files"}


def test_the_gpu_layer_does_not_import_the_graph_layer() -> None:
    bad: list[str] = []
    for name, targets in _edges().items():
        if name != "hetero._gpu" and not name.startswith("hetero._gpu."):
            continue
        for target in sorted(targets):
            if target.startswith("hetero._gpu.") or target in SHARED:
                continue
            bad.append(f"{name} imports {target}")
    assert not bad, "the GPU runtime layer imports only itself and " + ", ".join(sorted(SHARED)) + ":\n" + "\n".join(bad)
