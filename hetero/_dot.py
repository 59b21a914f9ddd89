"""Pictures of a graph: Graphviz DOT text, a networkx DiGraph, and rendered files.

The DOT text is written here rather than through networkx/pydot: pydot reads an
unquoted ``a:b`` as node ``a`` at port ``b``, so a stage named ``load:v2`` would be
cut at the ``:``. Every id and label here is quoted, with ``\\`` and ``"`` escaped.

What a picture shows:

* graph inputs (ovals) and outputs (double ovals, ``output`` or ``output N``);
* CPU stages (rounded boxes, blue; violet for ``process=True`` stages, run in a worker
  process) and GPU stages (boxes, green), each labelled with its name and kind
  (``gpu, captured`` for ``capture=True`` stages) and, given a run's
  :class:`~hetero.RunStats`, its wall time (``wall 1.2 ms``) and GPU time where measured
  (``gpu 0.8 ms``); stages with a CPU and a GPU implementation (``g.stage``: dashed
  boxes, ``cpu | gpu``), given a run's stats, say where that run placed them (``ran on cpu``);
* value edges; those that cross between host and device carry the transfer the plan
  inserts: ``upload`` (an input or a CPU value read by a GPU stage) and ``download``
  (a GPU value read by a CPU stage or returned as an output); around a two-implementation
  stage they depend on its placement: ``upload if on gpu``, ``download if on gpu`` (its
  value read on the host) and ``download if on cpu`` (a GPU value it reads);
* ``after=`` edges, dashed, labelled ``after``, where no value edge already joins the
  two stages.

Ids are the stage names, ``input NAME`` for inputs and ``output N`` for outputs:
names hold no blanks, so these never collide.

This module reads a graph through its public attributes only, by identity, so that
``hetero._graph`` may call it without an import cycle.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._files import atomic_write
from .errors import GraphError, GraphvizError

if TYPE_CHECKING:
    import networkx as nx

    from ._graph import Graph
    from ._stats import RunStats

__all__ = ["INSTALL_GRAPHVIZ", "RANKDIRS", "picture", "to_dot", "to_networkx", "visualize"]

RANKDIRS = ("LR", "TB", "RL", "BT")
INSTALL_GRAPHVIZ = ("install Graphviz: 'apt-get install graphviz' (Debian, Ubuntu), 'brew install graphviz' "
                    "(macOS) or 'conda install graphviz'")
# Formats handed to ``dot -T``; ``.dot`` and ``.gv`` files get the DOT text itself.
RENDER_FORMATS = ("svg", "png", "pdf", "jpg", "jpeg", "gif", "ps", "eps", "json", "plain")
TEXT_SUFFIXES = (".dot", ".gv")

_STYLE = {
    "input": 'shape=oval, style=filled, fillcolor="#f2f2f2"',
    "cpu": 'shape=box, style="rounded,filled", fillcolor="#dbe8f7"',
    "process": 'shape=box, style="rounded,filled", fillcolor="#e6dcf5"',
    "gpu": 'shape=box, style="filled,bold", fillcolor="#d5f0d0"',
    "mixed": 'shape=box, style="filled,dashed", fillcolor="#e3f0ea"',
    "output": 'shape=oval, peripheries=2, style=filled, fillcolor="#f2f2f2"',
}
_EDGE_STYLE = {
    "upload": 'label="upload", color="#2e7d32", fontcolor="#2e7d32"',
    "download": 'label="download", color="#1565c0", fontcolor="#1565c0"',
    "after": 'label="after", style=dashed, color="#757575", fontcolor="#757575"',
    "upload if on gpu": 'label="upload if on gpu", style=dashed, color="#2e7d32", fontcolor="#2e7d32"',
    "download if on gpu": 'label="download if on gpu", style=dashed, color="#1565c0", fontcolor="#1565c0"',
    "download if on cpu": 'label="download if on cpu", style=dashed, color="#1565c0", fontcolor="#1565c0"',
}


@dataclass(frozen=True)
class PictureNode:
    id: str
    kind: str  # "input" | "cpu" | "process" | "gpu" | "mixed" | "output"
    name: str  # the stage or input name; for outputs, what they return
    captured: bool = False  # a GPU stage declared with capture=True (replayed per signature)


@dataclass(frozen=True)
class PictureEdge:
    tail: str
    head: str
    kind: str  # "value" | "upload" | "download" | "after" | "upload if on gpu" | "download if on gpu" | ...


def quote(text: str) -> str:
    """``text`` as a DOT quoted string: backslashes and double quotes escaped."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def picture(graph: Graph) -> tuple[list[PictureNode], list[PictureEdge]]:
    """The nodes and edges a picture of ``graph`` shows, in declaration order."""
    stage_ids = {id(n): n for n in graph.nodes}
    input_ids = {id(i): i for i in graph.inputs.values()}

    def kind(n: Any) -> str:
        return "process" if getattr(n.options, "process", False) else str(n.kind)

    def ref(v: Any) -> tuple[str, str] | None:
        """(picture id, "input" | "cpu" | "process" | "gpu") of a stage or input of this graph, else None."""
        n = stage_ids.get(id(v))
        if n is not None:
            return n.name, kind(n)
        i = input_ids.get(id(v))
        if i is not None:
            return f"input {i.name}", "input"
        return None

    nodes = [PictureNode(f"input {name}", "input", name) for name in graph.inputs]
    nodes += [PictureNode(n.name, kind(n), n.name, bool(getattr(n, "capture", False))) for n in graph.nodes]
    edges: list[PictureEdge] = []
    for n in graph.nodes:
        seen: set[str] = set()
        for v in (*n.args, *n.kwargs.values()):  # the plan reads stages and inputs at the top level only
            r = ref(v)
            if r is None or r[0] in seen:
                continue
            seen.add(r[0])
            edges.append(PictureEdge(r[0], n.name, _transfer(r[1], kind(n))))
        for d in n.extra_deps:
            r = ref(d)
            if r is not None and r[0] not in seen:
                seen.add(r[0])
                edges.append(PictureEdge(r[0], n.name, "after"))
    for k, v in enumerate(graph.outputs or ()):
        r = ref(v)
        if r is None:
            continue
        oid = "output" if len(graph.outputs or ()) == 1 else f"output {k}"
        nodes.append(PictureNode(oid, "output", v.name))
        edges.append(PictureEdge(r[0], oid, {"gpu": "download", "mixed": "download if on gpu"}.get(r[1], "value")))
    return nodes, edges


def _transfer(src: str, dst: str) -> str:
    host = ("input", "cpu", "process")
    if dst == "gpu" and src in host:
        return "upload"
    if dst in ("cpu", "process") and src == "gpu":
        return "download"
    if dst == "mixed" and src in host:
        return "upload if on gpu"
    if dst == "mixed" and src == "gpu":
        return "download if on cpu"
    if src == "mixed" and dst in ("cpu", "process"):
        return "download if on gpu"
    return "value"  # between two-implementation stages: whatever their placements need


def _stage_times(graph: Graph, stats: RunStats | None) -> dict[str, str]:
    if stats is None:
        return {}
    if not hasattr(stats, "stages") or not hasattr(stats, "graph"):
        raise GraphError(f"graph {graph.name!r}: stats must be a hetero.RunStats (rt.stats()), got {stats!r}")
    if stats.graph != graph.name:
        raise GraphError(f"graph {graph.name!r}: stats describe a run of graph {stats.graph!r}; "
                         "pass rt.stats() of a run of this graph")
    out: dict[str, str] = {}
    for s in stats.stages:
        parts = []
        if s.wall_ms is not None:
            parts.append(f"wall {s.wall_ms:.3g} ms")
        if s.gpu_ms is not None:
            parts.append(f"gpu {s.gpu_ms:.3g} ms")
        if getattr(s, "placement", None) is not None:
            parts.append(f"ran on {s.kind}")
        if parts:
            out[s.name] = ", ".join(parts)
    return out


def to_dot(graph: Graph, rankdir: str = "LR", stats: RunStats | None = None) -> str:
    """Graphviz DOT text of ``graph`` (see the module doc for what it shows)."""
    if rankdir not in RANKDIRS:
        raise GraphError(f"graph {graph.name!r}: rankdir must be one of {', '.join(RANKDIRS)}, got {rankdir!r}")
    times = _stage_times(graph, stats)
    nodes, edges = picture(graph)
    lines = [
        f"digraph {quote(graph.name)} {{",
        f"  graph [rankdir={quote(rankdir)}, label={quote(graph.name)}, labelloc=t, fontname=Helvetica];",
        "  node [fontname=Helvetica, fontsize=11];",
        "  edge [fontname=Helvetica, fontsize=9];",
    ]
    for p in nodes:
        if p.kind in ("cpu", "process", "gpu", "mixed"):
            shown = "cpu | gpu" if p.kind == "mixed" else p.kind
            what = f"{shown}, captured" if p.captured else shown
            label = quote(p.name)[:-1] + f"\\n{what}" + (f"\\n{times[p.name]}" if p.name in times else "") + '"'
        elif p.kind == "output":
            label = quote(p.id)
        else:
            label = quote(p.name)
        lines.append(f"  {quote(p.id)} [label={label}, {_STYLE[p.kind]}];")
    for e in edges:
        style = _EDGE_STYLE.get(e.kind)
        lines.append(f"  {quote(e.tail)} -> {quote(e.head)}" + (f" [{style}]" if style else "") + ";")
    lines.append("}")
    return "\n".join(lines) + "\n"


def to_networkx(graph: Graph) -> nx.DiGraph:
    """``graph`` as a networkx DiGraph keyed by the picture ids (stage names, ``input X``, ``output N``).

    Node attributes: ``kind`` (``input``, ``cpu``, ``process``, ``gpu``, ``mixed``, ``output``) and ``name``;
    edge attributes: ``kind`` (``value``, ``upload``, ``download``, ``after``, and around
    two-implementation stages ``upload if on gpu``, ``download if on gpu``, ``download if on cpu``).
    """
    import networkx as nx

    nodes, edges = picture(graph)
    g = nx.DiGraph(name=graph.name)
    for p in nodes:
        g.add_node(p.id, kind=p.kind, name=p.name)
    for e in edges:
        g.add_edge(e.tail, e.head, kind=e.kind)
    return g


def visualize(graph: Graph, path: str | os.PathLike[str], *, rankdir: str = "LR",
              stats: RunStats | None = None) -> Path:
    """Write a picture of ``graph`` to ``path``; its suffix picks the format (``.svg``, ``.png``, ``.pdf``, ``.dot``).

    ``.dot`` and ``.gv`` get the DOT text; other formats are rendered by Graphviz's
    ``dot`` program, and raise :class:`~hetero.errors.GraphvizError` saying how to
    install it when it is missing.
    """
    dest = Path(path)
    suffix = dest.suffix.lower()
    text = to_dot(graph, rankdir=rankdir, stats=stats)
    if not dest.parent.is_dir():
        raise GraphvizError(f"graph {graph.name!r}: cannot write {str(dest)!r}: directory "
                            f"{str(dest.parent)!r} does not exist")
    if suffix in TEXT_SUFFIXES:
        _write(graph, dest, text.encode("utf-8"))
        return dest
    fmt = suffix[1:]
    if fmt not in RENDER_FORMATS:
        raise GraphvizError(f"graph {graph.name!r}: cannot tell the picture format of {str(dest)!r}; end the path "
                            f"in one of {', '.join('.' + f for f in RENDER_FORMATS)}, .dot or .gv")
    exe = shutil.which("dot")
    if exe is None:
        raise GraphvizError(f"graph {graph.name!r}: rendering {str(dest)!r} needs Graphviz's 'dot' program, "
                            f"which is not on PATH; {INSTALL_GRAPHVIZ}, or write the DOT text with a .dot path")
    try:
        done = subprocess.run([exe, f"-T{fmt}"], input=text.encode("utf-8"),
                              capture_output=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise GraphvizError(f"graph {graph.name!r}: running {exe!r} failed: {e}") from e
    if done.returncode != 0:
        err = done.stderr.decode("utf-8", "replace").strip()
        raise GraphvizError(f"graph {graph.name!r}: 'dot -T{fmt}' failed (exit status {done.returncode}): {err}")
    _write(graph, dest, done.stdout)
    return dest


def _write(graph: Graph, dest: Path, data: bytes) -> None:
    """Write the picture atomically: a failed write (a full disk) leaves no partial file and says why."""
    try:
        atomic_write(dest, lambda f: f.write(data))
    except OSError as e:
        raise GraphvizError(f"graph {graph.name!r}: cannot write {str(dest)!r}: {e.strerror or e}") from e
