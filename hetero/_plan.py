"""The execution plan of a graph: validated once, then reused by every run.

A plan holds everything the scheduler would otherwise re-derive per run: the
stages in topological order, how to build each stage's arguments, dependency
counts, who consumes each value (and whether on the CPU or the GPU), which GPU
values must come back to the host, and critical-path priorities.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable

import networkx as nx

from .errors import GraphError, InputError

from ._nodes import Input, Node, StageOptions

if TYPE_CHECKING:
    from ._graph import Graph

__all__ = ["Plan", "StagePlan"]

# How a stage argument is obtained at run time.
ARG_CONST, ARG_INPUT, ARG_NODE = 0, 1, 2
ArgSpec = tuple[int, Any]


@dataclass(frozen=True, slots=True)
class StagePlan:
    index: int
    name: str
    kind: str  # "cpu" | "gpu"
    fn: Callable[..., Any]
    args: tuple[ArgSpec, ...]
    kwargs: tuple[tuple[str, ArgSpec], ...]
    n_deps: int  # distinct stages this one waits for
    gpu_consumers: tuple[int, ...]  # GPU stages that read this value (or are ordered after it)
    cpu_consumers: tuple[int, ...]  # CPU stages that read this value (or are ordered after it)
    gpu_deps: tuple[int, ...]  # GPU stages whose values (or completion) this stage waits for
    download: bool  # GPU stage whose value a CPU stage or the caller reads: bring it to the host
    fence: bool  # GPU stage whose completion a CPU stage or the caller waits for
    priority: int  # length of the longest path from here to a sink (critical path)
    retries: int
    timeout: float | None
    simple: bool  # no timeout: a worker may run it without the event loop watching
    kernels: tuple[tuple[str, str], ...]  # declared (wgsl, entry point) pairs, compiled by warmup
    options: StageOptions  # retries, retry_on, backoff, timeout as declared
    process: bool = False  # CPU stage run in a worker process (hetero._process)
    capture: bool = False  # GPU stage replayed per signature (see hetero._gpu.capture)
    # A stage with a CPU and a GPU implementation: kind "mixed" until placed, then one of
    # Plan.variants (kind "cpu" or "gpu"). Placed on the GPU it is planned like a GPU stage
    # (mixed consumers count as GPU consumers; a CPU-placed one downloads what it reads).
    mixed: bool = False
    # Derived from the fields above (and again by dataclasses.replace), for the workers:
    # the positional arguments with the constants in place, and where the stage values
    # and graph inputs go.
    arg_consts: tuple[Any, ...] = field(init=False)
    arg_nodes: tuple[tuple[int, int], ...] = field(init=False)
    arg_inputs: tuple[tuple[int, str], ...] = field(init=False)
    # A CPU stage of the thread pool with nothing to watch or place: no timeout, not a
    # process stage, not a placed mixed stage.
    plain: bool = field(init=False)
    # A plain stage run on the thread that makes it ready (Graph.cpu(inline=True)).
    inline: bool = field(init=False)

    def __post_init__(self) -> None:
        init = object.__setattr__
        init(self, "arg_consts", tuple(ref if kind == ARG_CONST else None for kind, ref in self.args))
        init(self, "arg_nodes", tuple((p, ref) for p, (kind, ref) in enumerate(self.args) if kind == ARG_NODE))
        init(self, "arg_inputs", tuple((p, ref) for p, (kind, ref) in enumerate(self.args) if kind == ARG_INPUT))
        init(self, "plain", self.kind == "cpu" and self.simple and not self.process and not self.mixed)
        init(self, "inline", self.plain and self.options.inline)


class Plan:
    """Validated, immutable execution plan of a :class:`~hetero.Graph`."""

    def __init__(self, graph: Graph) -> None:
        if graph.outputs is None:
            raise GraphError(f"graph {graph.name!r} has no outputs; declare them with graph.output(...)")
        self.name = graph.name
        self.input_names = tuple(graph.inputs)
        self._input_set = frozenset(self.input_names)
        nodes = graph.nodes

        dag = nx.DiGraph()
        dag.add_nodes_from(range(len(nodes)))
        deps: list[set[int]] = [set() for _ in nodes]
        for node in nodes:
            for v in (*node.args, *node.kwargs.values(), *node.extra_deps):
                if _is_node(v):
                    deps[node.index].add(v.index)
                    dag.add_edge(v.index, node.index)
        try:
            cycle = nx.find_cycle(dag)
        except nx.NetworkXNoCycle:
            cycle = None
        if cycle:
            names = [nodes[a].name for a, _ in cycle] + [nodes[cycle[0][0]].name]
            raise GraphError(f"graph {graph.name!r} has a cycle: {'->'.join(names)}")

        order = list(nx.lexicographical_topological_sort(dag))
        consumers: list[list[int]] = [[] for _ in nodes]
        for i, ds in enumerate(deps):
            for d in ds:
                consumers[d].append(i)
        priority = [0] * len(nodes)
        for i in reversed(order):
            priority[i] = 1 + max((priority[c] for c in consumers[i]), default=0)

        output_idx = {v.index for v in graph.outputs if isinstance(v, Node)}
        host_readers: list[bool] = [False] * len(nodes)  # a CPU stage reads the value itself
        for node in nodes:
            if node.kind == "cpu":
                for v in (*node.args, *node.kwargs.values()):
                    if _is_node(v):
                        host_readers[v.index] = True

        stages: list[StagePlan] = []
        on_gpu = ("gpu", "mixed")  # a mixed stage may run on the GPU: plan its edges as a GPU stage's
        for node in nodes:
            i = node.index
            cons = sorted(consumers[i], key=lambda c: -priority[c])
            gpu_c = tuple(c for c in cons if nodes[c].kind in on_gpu)
            cpu_c = tuple(c for c in cons if nodes[c].kind == "cpu")
            is_gpu = node.kind in on_gpu
            stages.append(StagePlan(
                index=i, name=node.name, kind=node.kind, fn=node.fn,
                args=tuple(_arg(a) for a in node.args),
                kwargs=tuple((k, _arg(v)) for k, v in node.kwargs.items()),
                n_deps=len(deps[i]), gpu_consumers=gpu_c, cpu_consumers=cpu_c,
                gpu_deps=tuple(sorted(d for d in deps[i] if nodes[d].kind in on_gpu)) if is_gpu else (),
                download=is_gpu and (host_readers[i] or i in output_idx),
                fence=is_gpu and (bool(cpu_c) or i in output_idx),
                priority=priority[i], retries=node.options.retries, timeout=node.options.timeout,
                simple=node.options.timeout is None, kernels=node.kernels, process=node.options.process,
                capture=node.capture,
                options=node.options,
                mixed=node.kind == "mixed",
            ))
        # The two placed forms of each mixed stage: (on the CPU, on the GPU).
        self.variants: dict[int, tuple[StagePlan, StagePlan]] = {}
        for node in nodes:
            if node.kind == "mixed":
                assert node.cpu_fn is not None
                sp = stages[node.index]
                self.variants[node.index] = (replace(sp, kind="cpu", fn=node.cpu_fn, capture=False),
                                             replace(sp, kind="gpu"))
        # CPU values that several GPU stages read: with one recording thread they are
        # uploaded once per run and shared (see Scheduler._device_args).
        gpu_readers: list[set[int]] = [set() for _ in nodes]
        for node in nodes:
            if node.kind == "gpu":
                for v in (*node.args, *node.kwargs.values()):
                    if _is_node(v) and nodes[v.index].kind == "cpu":
                        gpu_readers[v.index].add(node.index)
        self.shared_uploads: dict[int, int] = {i: len(r) for i, r in enumerate(gpu_readers) if len(r) >= 2}
        # For each GPU stage, the shared CPU values it reads (it drops one hold of each).
        reads: dict[int, list[int]] = {}
        for i in self.shared_uploads:
            for reader in gpu_readers[i]:
                reads.setdefault(reader, []).append(i)
        self.shared_reads: dict[int, tuple[int, ...]] = {r: tuple(sorted(v)) for r, v in reads.items()}
        self.stages: tuple[StagePlan, ...] = tuple(stages)
        # What each run starts from (Run copies them): the dependencies each stage waits
        # for, and the holds on each value's device memory (a GPU value: one per GPU
        # consumer still to be enqueued, one for its download, one while it is recorded; a
        # shared upload: one per reader).
        self.n_deps: tuple[int, ...] = tuple(s.n_deps for s in stages)
        self.holds: tuple[int, ...] = tuple(len(s.gpu_consumers) + s.fence + 1 if s.kind != "cpu"
                                            else self.shared_uploads.get(s.index, 0) for s in stages)
        self.order: tuple[int, ...] = tuple(order)
        self.roots: tuple[int, ...] = tuple(sorted((i for i in order if not deps[i]), key=lambda i: -priority[i]))
        self.outputs: tuple[ArgSpec, ...] = tuple(_arg(v) for v in graph.outputs)
        self.single_output = len(graph.outputs) == 1
        self.output_stages: frozenset[int] = frozenset(output_idx)
        self.has_gpu = any(s.kind in on_gpu for s in stages)
        self.has_process = any(s.process for s in stages)
        self.version = graph.version

    def check_inputs(self, given: Mapping[str, Any]) -> None:
        """Raise :class:`InputError` naming missing or unknown inputs."""
        if given.keys() == self._input_set:
            return
        expected = self.input_names
        missing = [n for n in expected if n not in given]
        unknown = sorted(n for n in given if n not in expected)
        want = ", ".join(expected) if expected else "no inputs"
        said = []
        if unknown:
            said.append(f"got unknown input(s): {', '.join(unknown)}")
        if missing:
            said.append(f"is missing input(s): {', '.join(missing)}")
        raise InputError(f"graph {self.name!r} {' and '.join(said)} (expected: {want})")


def _is_node(v: object) -> bool:
    return isinstance(v, Node)


def _arg(v: Any) -> ArgSpec:
    if isinstance(v, Node):
        return (ARG_NODE, v.index)
    if isinstance(v, Input):
        return (ARG_INPUT, v.name)
    return (ARG_CONST, v)

