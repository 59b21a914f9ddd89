"""What a graph is made of: its inputs, its stages (``Node``) and their options.

The graph that holds them is :class:`~hetero._graph.Graph`; the plan reads these types
without importing the graph.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal

from ._argtypes import check_positive_int
from .errors import GraphError

if TYPE_CHECKING:
    from ._graph import Graph

__all__ = ["DEFAULT_BACKOFF_S", "Input", "Kind", "MAX_BACKOFF_S", "Node", "StageOptions"]

Kind = Literal["cpu", "gpu", "mixed"]  # mixed: a CPU and a GPU implementation, placed per execution
_NAME = re.compile(r"^[^\s>]+$")  # no blanks and no '>' so that cycles print unambiguously


def _check_name(what: str, name: object) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise GraphError(f"{what} name must be a non-empty string without blanks or '>', got {name!r}")
    return name


class Input:
    """A named graph input; pass its value to ``run(graph, name=value)``."""

    __slots__ = ("graph", "name")

    def __init__(self, graph: Graph, name: str) -> None:
        self.graph = graph
        self.name = name

    def __repr__(self) -> str:
        return f"<Input {self.name!r} of graph {self.graph.name!r}>"


# Retries wait DEFAULT_BACKOFF_S before the first retry, doubling each time, at most
# MAX_BACKOFF_S (or backoff itself when larger) between two attempts.
DEFAULT_BACKOFF_S = 0.01
MAX_BACKOFF_S = 5.0


@dataclass(frozen=True)
class StageOptions:
    """Per-stage execution options, validated when the stage is declared.

    A failing stage is retried up to ``retries`` times when what it raised is an
    instance of ``retry_on``; before retry ``n`` it waits ``backoff_s * 2**(n-1)``
    seconds, at most :data:`MAX_BACKOFF_S` (or ``backoff_s`` itself, when larger).
    """

    retries: int = 0
    timeout: float | None = None
    process: bool = False  # run in a worker process of the runtime's process pool
    inline: bool = False  # run on the thread that makes it ready, not queued for a CPU worker
    retry_on: tuple[type[BaseException], ...] = (Exception,)
    backoff_s: float = DEFAULT_BACKOFF_S

    def retry_delay_s(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (1 for the first): doubling from ``backoff_s``, capped."""
        if not self.backoff_s:
            return 0.0
        return float(min(self.backoff_s * 2.0 ** min(retry - 1, 64), max(self.backoff_s, MAX_BACKOFF_S)))

    def __post_init__(self) -> None:
        if not isinstance(self.process, bool):
            raise GraphError(f"process must be True or False, got {self.process!r}")
        if not isinstance(self.inline, bool):
            raise GraphError(f"inline must be True or False, got {self.inline!r}")
        if self.inline and (self.process or self.timeout is not None):
            raise GraphError("inline=True runs the stage on the thread that makes it ready; it cannot also take "
                             "process=True or a timeout")
        check_positive_int("retries", self.retries, minimum=0, error=GraphError)
        retry_on = self.retry_on
        if isinstance(retry_on, type):
            retry_on = (retry_on,)
        if (not isinstance(retry_on, tuple) or not retry_on
                or not all(isinstance(t, type) and issubclass(t, BaseException) for t in retry_on)):
            raise GraphError(f"retry_on must be an exception type or a non-empty tuple of them, got {self.retry_on!r}")
        object.__setattr__(self, "retry_on", retry_on)
        b = self.backoff_s
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not (b >= 0 and math.isfinite(b)):
            raise GraphError(f"backoff must be a number of seconds >= 0, got {b!r}")
        if self.timeout is not None:
            if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)):
                raise GraphError(f"timeout must be a number of seconds or None, got {self.timeout!r}")
            if not (self.timeout > 0 and math.isfinite(self.timeout)):
                raise GraphError(f"timeout must be > 0 seconds, got {self.timeout!r}")


@dataclass(eq=False)
class Node:
    """A stage of a graph. Use it as an argument of later stages, or as a graph output."""

    graph: Graph
    name: str
    kind: Kind
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    options: StageOptions
    index: int
    extra_deps: list[Node] = field(default_factory=list)
    kernels: tuple[tuple[str, str], ...] = ()  # (wgsl, entry point) a GPU stage declares, for warmup
    capture: bool = False  # a GPU stage replayed per signature (see hetero._gpu.capture)
    cpu_fn: Callable[..., Any] | None = None  # a mixed stage's CPU implementation (fn is its GPU one)

    def after(self, *nodes: Node) -> Node:
        """Order this stage after ``nodes`` without passing their values. Returns self."""
        for n in nodes:
            if not isinstance(n, Node):
                raise GraphError(f"stage {self.name!r}: after() takes stages, got {n!r}")
            self.graph._check_own(n, self.name)
            self.extra_deps.append(n)
        self.graph._changed()
        return self

    def __repr__(self) -> str:
        return f"<{self.kind.upper()} stage {self.name!r} of graph {self.graph.name!r}>"
