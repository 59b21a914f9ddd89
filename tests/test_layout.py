"""The import layout, read from the source with ``ast`` (nothing is imported or run).

The rules:

* ``kernels/`` and ``pipelines/`` build on hetero's public names only: no import of a
  ``hetero._x`` module or of a ``_name`` from any hetero module (their own included), and
  no ``obj._attr`` reach into another object (``self``/``cls`` excepted). What they need
  from the runtime is in :mod:`hetero.lowlevel`. The programs in ``bench/`` import no
  private hetero module either (one profiling hook excepted, with its reason).
* No private reaches across rooms anywhere: a module uses the ``_names`` of other modules'
  classes and functions through no object (``ctx._dev``, ``graph._changed()``); what one
  room offers another has a public name (the GPU context's capture interface, for one).
* A ``pipelines/`` module holds one concern: at most :data:`MAX_PIPELINE_LINES` lines, the
  few longer ones listed with their reason.
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
BENCH = ROOT / "bench"
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
SHARED = {"hetero.errors", "hetero._trace", "hetero._bridge", "hetero._files", "hetero._argtypes"}


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


# A pipelines/ module past this many lines holds more than one concern: split it by concern.
MAX_PIPELINE_LINES = 800
# The longer ones, each with its reason.
LONG_PIPELINES = {
    "pipelines/llm_model.py": "the decoder model's loaders (GGUF, safetensors, the tokenizer) with the text "
                              "generation pipeline they serve, which is still taking shape",
}


def test_pipeline_modules_hold_one_concern_each() -> None:
    long = {str(path.relative_to(ROOT)): len(path.read_text().splitlines())
            for name, path in MODULES.items() if name.startswith("hetero.pipelines")}
    bad = [f"{where}: {n} lines" for where, n in sorted(long.items())
           if n > MAX_PIPELINE_LINES and where not in LONG_PIPELINES]
    assert not bad, (f"pipelines/ modules over {MAX_PIPELINE_LINES} lines (split by concern, or list the module "
                     "with its reason in LONG_PIPELINES):\n" + "\n".join(bad))


# bench/ files that may import a private hetero module, each with its reason.
BENCH_PRIVATE = {
    "bench/replay_cost.py": "--profile wraps the scheduler's GPU-stage method in cProfile, to profile exactly "
                            "the recording thread's part of a replayed run; no public API should offer that hook",
    "bench/decode_host.py": "counts a step's replayed dispatches by wrapping the capture's dispatch command, in a "
                            "call apart from the timed ones; no public API should offer that hook",
}


def test_bench_imports_no_private_module() -> None:
    bad: list[str] = []
    for path in sorted(BENCH.glob("*.py")):
        where = str(path.relative_to(ROOT))
        if where in BENCH_PRIVATE:
            continue
        tree = ast.parse(path.read_text(), where)
        for node in _imports(tree, type_checking=True):
            for module, imported in _targets(f"bench.{path.stem}", path, node):
                if module != "hetero" and not module.startswith("hetero."):
                    continue
                full = f"{module}.{imported}" if imported is not None else module
                if any(p.startswith("_") and not p.startswith("__") for p in module.split(".")):
                    bad.append(f"{where}:{node.lineno}: imports private module {module}")
                elif f"{module}.{imported}" in MODULES and imported is not None and imported.startswith("_"):
                    bad.append(f"{where}:{node.lineno}: imports private module {full}")
    assert not bad, "bench/ uses hetero's public names (hetero, hetero.lowlevel, hetero.pipelines...):\n" + \
        "\n".join(bad)


def _private_names(tree: ast.Module) -> set[str]:
    """The ``_names`` a module defines: its own functions, classes and globals, and its classes'
    methods, class attributes and ``self._x`` attributes."""
    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__")

    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and private(node.name):
            names.add(node.name)
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        names.update(t.id for t in targets if isinstance(t, ast.Name) and private(t.id))
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in ast.walk(cls):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and private(node.name):
                names.add(node.name)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and private(node.attr)
                  and isinstance(node.value, ast.Name) and node.value.id == "self"):
                names.add(node.attr)
        for node in cls.body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, ast.AnnAssign) else []
            names.update(t.id for t in targets if isinstance(t, ast.Name) and private(t.id))
    return names


# Reaches across rooms tolerated for now, as (module, attribute): a new one fails the test below.
KNOWN_REACHES = {
    ("hetero._batcher", "_check_open"), ("hetero._exec_gpu", "_upload_many"), ("hetero._exec_gpu", "_gpu_completed"),
    ("hetero._nodes", "_changed"), ("hetero._nodes", "_check_own"), ("hetero._runtime", "_procs"),
}


def test_no_private_reaches_across_rooms() -> None:
    trees = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}
    defined = {name: _private_names(tree) for name, tree in trees.items()}
    bad: list[str] = []
    for name, tree in trees.items():
        others = {n: d for n, d in defined.items() if n != name}
        for node in ast.walk(tree):
            if (not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__")
                    or (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
                    or node.attr in defined[name] or (name, node.attr) in KNOWN_REACHES):
                continue
            owners = sorted(n for n, d in others.items() if node.attr in d)
            if owners:
                bad.append(f"{MODULES[name].relative_to(ROOT)}:{node.lineno}: .{node.attr} belongs to "
                           + ", ".join(owners))
    assert not bad, "private reaches across rooms (give what one room offers another a public name):\n" + \
        "\n".join(bad)


def test_the_reach_finder_finds_reaches() -> None:
    tree = ast.parse("class A:\n    _k = 1\n    def __init__(self):\n        self._dev = 0\n    def _go(self): pass\n"
                     "def _helper(): pass\n_CACHE = {}\n")
    assert _private_names(tree) == {"_k", "_dev", "_go", "_helper", "_CACHE"}
