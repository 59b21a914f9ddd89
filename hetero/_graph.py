"""Declaring a graph: inputs, CPU and GPU stages, outputs.

A :class:`Graph` is declaration only. Every stage names the values it reads (other
stages, graph inputs, or constants); nothing runs until a runtime executes the
graph's :class:`~hetero._plan.Plan`, which is derived once and cached on the graph.

A graph whose stage functions and constants pickle (module-level functions, not
lambdas or closures) pickles too, so it can be sent to another process; the cached
plan stays behind and is derived again there.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Callable

# Re-exported: the declaration types live in _nodes, which the plan reads without this module.
from ._nodes import DEFAULT_BACKOFF_S, MAX_BACKOFF_S, Input, Kind, Node, StageOptions, _check_name  # noqa: F401
from .errors import GraphError

if TYPE_CHECKING:
    import networkx as nx
    from pathlib import Path

    from ._plan import Plan
    from ._stats import RunStats

__all__ = ["Graph", "Input", "Node"]

class Graph:
    """A DAG of CPU and GPU stages.

    >>> g = Graph("demo")
    >>> x = g.input("x")
    >>> y = g.cpu(lambda v: v + 1, x, name="inc")
    >>> g.output(y)
    """

    def __init__(self, name: str = "graph") -> None:
        self.name = _check_name("graph", name)
        self.inputs: dict[str, Input] = {}
        self.nodes: list[Node] = []
        self.outputs: tuple[Node | Input, ...] | None = None
        self._names: set[str] = set()
        self._plan: Plan | None = None
        self.version = 0  # bumped on every change; a plan remembers the version it was made from

    # -- declaration ------------------------------------------------------------------
    def input(self, name: str) -> Input:
        """Declare a named graph input."""
        _check_name("input", name)
        if name in self.inputs:
            raise GraphError(f"graph {self.name!r} already has an input named {name!r}")
        inp = Input(self, name)
        self.inputs[name] = inp
        self._changed()
        return inp

    def cpu(self, fn: Callable[..., Any], *args: Any, name: str | None = None,
            retries: int = 0, timeout: float | None = None, after: tuple[Node, ...] | list[Node] = (),
            process: bool = False, inline: bool = False,
            retry_on: type[BaseException] | tuple[type[BaseException], ...] = (Exception,),
            backoff: float = DEFAULT_BACKOFF_S, **kwargs: Any) -> Node:
        """Declare a CPU stage: ``fn(*args, **kwargs)`` runs on the runtime's thread pool.

        Arguments may be stages, graph inputs or constants. ``name`` defaults to the
        function's name; ``retries`` re-runs a failing stage when what it raised is an
        instance of ``retry_on`` (an exception type or a tuple of them; default
        ``Exception``), waiting ``backoff`` seconds before the first retry and twice as
        long before each next one (see :class:`StageOptions`); ``timeout`` (seconds)
        fails the run when the stage runs longer, over all attempts; ``after`` adds
        ordering-only dependencies; ``process=True`` runs it in a worker process of the
        runtime's process pool (``fn`` and its arguments must pickle; checked here for
        ``fn`` and constants). ``inline=True`` runs it on the thread that makes it ready
        (a CPU worker, the GPU recording thread, the thread that brings a GPU stage's
        value to the host, or the event loop's thread when the run starts) instead of
        handing it to a CPU worker: for cheap functions (a view, a slice, picking an item)
        whose hand-off costs more than they do; never for anything that blocks or takes
        long (it holds up that thread). Not with ``process=True`` or ``timeout``. These
        keywords are reserved; others go to ``fn``.
        """
        return self._add("cpu", fn, args, kwargs, name, retries, timeout, after, process, retry_on=retry_on,
                         backoff=backoff, inline=inline)

    def gpu(self, fn: Callable[..., Any], *args: Any, name: str | None = None,
            retries: int = 0, timeout: float | None = None, after: tuple[Node, ...] | list[Node] = (),
            kernels: Iterable[str | tuple[str, str]] = (), capture: bool = False,
            retry_on: type[BaseException] | tuple[type[BaseException], ...] = (Exception,),
            backoff: float = DEFAULT_BACKOFF_S, **kwargs: Any) -> Node:
        """Declare a GPU stage: ``fn(gpu, *args, **kwargs)`` records GPU work.

        numpy arrays reaching it are uploaded and arrive as :class:`hetero.Tensor`.
        Same options as :meth:`cpu`, plus ``kernels``: the WGSL sources (or
        ``(wgsl, entry_point)`` pairs) the stage uses, for ``Runtime.warmup``; a
        ``kernels`` attribute on ``fn`` is read too; and ``capture``: the promise that
        the work ``fn`` records depends only on the shapes and dtypes of its Tensor
        arguments and the values of the others, so that hetero calls it once per such
        signature and replays the captured dispatches afterwards (see ``hetero._gpu.capture``).
        """
        if not isinstance(capture, bool):
            raise GraphError(f"stage {name or getattr(fn, '__name__', '?')!r}: capture must be True or False, "
                             f"got {capture!r}")
        node = self._add("gpu", fn, args, kwargs, name, retries, timeout, after, retry_on=retry_on, backoff=backoff)
        node.kernels = _kernel_specs(node.name, (*getattr(fn, "kernels", ()), *kernels))
        node.capture = capture
        return node

    def stage(self, *args: Any, cpu: Callable[..., Any], gpu: Callable[..., Any], name: str | None = None,
              retries: int = 0, timeout: float | None = None, after: tuple[Node, ...] | list[Node] = (),
              kernels: Iterable[str | tuple[str, str]] = (), capture: bool = False,
              retry_on: type[BaseException] | tuple[type[BaseException], ...] = (Exception,),
              backoff: float = DEFAULT_BACKOFF_S, **kwargs: Any) -> Node:
        """Declare a stage with two implementations; the runtime places each execution.

        ``cpu(*args, **kwargs)`` runs on the thread pool and receives numpy arrays;
        ``gpu(gpu_ctx, *args, **kwargs)`` records GPU work, as for :meth:`gpu`. Both must
        compute the same value. ``Runtime(placement=...)`` decides where each execution
        runs ("auto": a calibrated performance model, see ``hetero.PerfModel``). ``name``
        defaults to the CPU function's name; other options as for :meth:`gpu` (``kernels``
        and ``capture`` concern the GPU implementation).
        """
        if not isinstance(capture, bool):
            raise GraphError(f"stage {name or getattr(cpu, '__name__', '?')!r}: capture must be True or False, "
                             f"got {capture!r}")
        if not callable(cpu) or not callable(gpu):
            bad = cpu if not callable(cpu) else gpu
            raise GraphError(f"graph {self.name!r}: stage {name or '?'!r} needs callable cpu= and gpu= "
                             f"implementations, got {bad!r}")
        if name is None:
            name = getattr(cpu, "__name__", None) or type(cpu).__name__
            if name == "<lambda>":
                raise GraphError(f"graph {self.name!r}: a stage with lambda implementations needs name=")
        node = self._add("mixed", gpu, args, kwargs, name, retries, timeout, after, retry_on=retry_on,
                         backoff=backoff)
        node.cpu_fn = cpu
        node.kernels = _kernel_specs(node.name, (*getattr(gpu, "kernels", ()), *kernels))
        node.capture = capture
        return node

    def output(self, *values: Node | Input) -> None:
        """Declare the graph's outputs; ``run()`` returns one value, or a tuple for several."""
        if self.outputs is not None:
            have = ", ".join(v.name for v in self.outputs)
            raise GraphError(f"graph {self.name!r} already has outputs ({have}); call output() once with all of them")
        if not values:
            raise GraphError(f"graph {self.name!r}: output() needs at least one stage or input")
        for v in values:
            if not isinstance(v, (Node, Input)):
                raise GraphError(f"graph {self.name!r}: outputs must be stages or inputs, got {v!r}")
            self._check_own(v, "output")
        self.outputs = tuple(values)
        self._changed()

    # -- helpers ----------------------------------------------------------------------
    def _add(self, kind: Kind, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
             name: str | None, retries: int, timeout: float | None, after: Any, process: bool = False,
             retry_on: Any = (Exception,), backoff: float = DEFAULT_BACKOFF_S, inline: bool = False) -> Node:
        if not callable(fn):
            raise GraphError(f"graph {self.name!r}: {kind} stage {name or '?'!r} is not callable: got {fn!r}")
        if name is None:
            name = getattr(fn, "__name__", None) or type(fn).__name__
            if name == "<lambda>":
                raise GraphError(f"graph {self.name!r}: a lambda stage needs name=")
        _check_name("stage", name)
        if name in self._names:
            raise GraphError(f"graph {self.name!r} already has a stage named {name!r}; pass a unique name=")
        for a in (*args, *kwargs.values()):
            if isinstance(a, (Node, Input)):
                self._check_own(a, name)
        options = StageOptions(retries=retries, timeout=timeout, process=process, retry_on=retry_on,
                               backoff_s=backoff, inline=inline)
        if process:
            from ._process import check_unpicklable

            why = check_unpicklable(fn, args, kwargs, (Node, Input))
            if why is not None:
                raise GraphError(f"graph {self.name!r}: process stage {name!r}: {why}; process stages need "
                                 "module-level functions and picklable constants")
        node = Node(self, name, kind, fn, tuple(args), dict(kwargs), options, len(self.nodes))
        self.nodes.append(node)
        self._names.add(name)
        if after:
            node.after(*after)
        self._changed()
        return node

    def _check_own(self, value: Node | Input, where: str) -> None:
        if value.graph is not self:
            raise GraphError(
                f"graph {self.name!r}: {where!r} uses {value.name!r} of graph {value.graph.name!r}; "
                "stages can only read values of their own graph"
            )

    def _changed(self) -> None:
        self.version += 1
        self._plan = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_plan"] = None
        return state

    def plan(self) -> Plan:
        """Validate the graph and return its execution plan (computed once, then cached)."""
        if self._plan is None:
            from ._plan import Plan

            self._plan = Plan(self)
        return self._plan

    # -- pictures ---------------------------------------------------------------------
    def to_dot(self, rankdir: str = "LR", stats: RunStats | None = None) -> str:
        """Graphviz DOT text of this graph: inputs, CPU and GPU stages, outputs, ``after=`` edges.

        Edges where the plan moves a value between host and device say ``upload`` or
        ``download``. ``rankdir`` is ``"LR"``, ``"TB"``, ``"RL"`` or ``"BT"``. ``stats``
        (``rt.stats()`` after a run of this graph) adds each stage's wall time and,
        where measured, GPU time. Ids are quoted and escaped, so any stage name works.
        """
        from ._dot import to_dot

        return to_dot(self, rankdir=rankdir, stats=stats)

    def to_networkx(self) -> nx.DiGraph:
        """This graph as a ``networkx.DiGraph``: nodes keyed by stage name, ``input X`` and ``output N``.

        Nodes carry ``kind`` (``input``, ``cpu``, ``process``, ``gpu``, ``mixed``, ``output``) and ``name``;
        edges carry ``kind`` (``value``, ``upload``, ``download``, ``after``, and around two-implementation
        stages ``upload if on gpu``, ``download if on gpu``, ``download if on cpu``).
        """
        from ._dot import to_networkx

        return to_networkx(self)

    def visualize(self, path: str | os.PathLike[str] = "graph.svg", *, rankdir: str = "LR",
                  stats: RunStats | None = None) -> Path:
        """Write a picture of this graph to ``path``; the suffix picks the format; returns the path.

        ``.svg``, ``.png``, ``.pdf`` (and other Graphviz formats) are rendered by Graphviz's
        ``dot`` program; without it this raises :class:`hetero.GraphvizError` giving the
        install command. ``.dot`` and ``.gv`` get the DOT text and need nothing installed.
        """
        from ._dot import visualize

        return visualize(self, path, rankdir=rankdir, stats=stats)

    def __repr__(self) -> str:
        return f"<Graph {self.name!r}: {len(self.inputs)} inputs, {len(self.nodes)} stages>"


def _kernel_specs(stage: str, specs: Iterable[Any]) -> tuple[tuple[str, str], ...]:
    out = []
    for k in specs:
        if isinstance(k, str):
            out.append((k, "main"))
        elif isinstance(k, tuple) and len(k) == 2 and all(isinstance(p, str) for p in k):
            out.append((k[0], k[1]))
        else:
            raise GraphError(f"stage {stage!r}: kernels must be WGSL strings or (wgsl, entry_point) pairs, got {k!r}")
    return tuple(out)
