"""``hetero graph``: a picture of a ready-made pipeline's graph (DOT text, or rendered by Graphviz).

Wiring (in ``hetero._cli``)::

    from hetero.pipelines import picture
    picture.add_parser(sub)            # registers 'graph' with func=picture.run
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any, TextIO

import hetero

__all__ = ["PIPELINES", "add_parser", "pipeline_graph", "run"]


def _embed_graph(args: argparse.Namespace) -> hetero.Graph:
    """The graph ``hetero embed`` runs with these options: the CPU twins only where offered."""
    from .embed import embedding_graph, get_model, offers_cpu

    model = get_model(args.model)
    int8 = bool(args.int8)
    if int8:
        return embedding_graph(model, int8=True)  # GPU stages only, wherever it runs
    # The runtime `hetero embed --placement` makes; under auto, its adapter decides (offers_cpu).
    with hetero.Runtime(placement=getattr(args, "placement", "auto")) as rt:
        cpu = offers_cpu(rt)
    return embedding_graph(model, cpu=cpu)


# name -> builds the pipeline's graph from the parsed arguments
PIPELINES: dict[str, Callable[[argparse.Namespace], hetero.Graph]] = {"embed": _embed_graph}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``graph`` command to an ``argparse`` subparsers object; its ``func`` is :func:`run`."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "graph",
        help="draw a pipeline's graph (DOT text, or SVG/PNG/PDF through Graphviz)",
        description="Draw the graph of a ready-made pipeline: inputs, CPU and GPU stages, outputs, and the "
        "uploads and downloads the plan inserts. Without -o, print the DOT text; with -o, the suffix picks "
        "the format (.dot and .gv: DOT text; .svg, .png, .pdf: rendered by Graphviz's dot program).",
    )
    p.add_argument("--pipeline", required=True, choices=sorted(PIPELINES), help="which pipeline to draw")
    p.add_argument("--model", default="minilm", metavar="DIR|minilm",
                   help="the embed pipeline's model: a directory or 'minilm' (default: %(default)s)")
    p.add_argument("--int8", action="store_true", help="the embed pipeline with int8 linear layers")
    p.add_argument("--placement", choices=("auto", "cpu", "gpu"), default="auto",
                   help="the embed pipeline as 'hetero embed --placement' runs it: with CPU twins of its stages "
                   "under cpu, or under auto where the adapter (HETERO_ADAPTER, else the one hetero picks) is "
                   "CPU-emulated or missing; GPU stages only otherwise (default: %(default)s)")
    p.add_argument("--rankdir", default="LR", choices=("LR", "TB", "RL", "BT"),
                   help="layout direction (default: %(default)s)")
    p.add_argument("-o", "--output", default=None, metavar="OUT.svg",
                   help="where to write the picture (default: DOT text on stdout)")
    p.set_defaults(func=run)
    return p


def pipeline_graph(args: argparse.Namespace) -> hetero.Graph:
    """The graph of ``args.pipeline``, built from ``args``."""
    return PIPELINES[args.pipeline](args)


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run ``hetero graph`` with parsed ``args``; return the exit status."""
    out = out if out is not None else sys.stdout
    g = pipeline_graph(args)
    if args.output is None or args.output == "-":
        out.write(g.to_dot(rankdir=args.rankdir))
        return 0
    path = g.visualize(args.output, rankdir=args.rankdir)
    print(f"graph {g.name!r} ({len(g.nodes)} stages) -> {path}", file=out)
    return 0
