"""Per-stage timings of a run: wall-clock events, and GPU time where the adapter measures it.

Every name carries its unit: ``*_s`` in seconds, ``*_ms`` in milliseconds. Wall time and
GPU time are never mixed: ``queued_s``, ``started_s``, ``recorded_s``, ``submitted_s`` and
``completed_s`` are host wall-clock instants (seconds from the run's start); ``wall_ms`` is
wall time; ``gpu_ms`` is GPU execution time from timestamp queries, ``None`` unless the
runtime times stages (``Runtime(gpu_timing=True)`` or ``trace=``) on an adapter that
writes timestamps inside passes. The names without a unit (``queued``, ...) still read
the same instants.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._placement import Placement

__all__ = ["RunStats", "StageStats", "Timeline"]


@dataclass(frozen=True)
class StageStats:
    """One stage of the last run. Instants are seconds from the run's start; None if it never got there."""

    name: str
    kind: str  # "cpu" | "process" (a CPU stage run in a worker process) | "gpu": where it ran ("mixed": a
    #   two-implementation stage never placed)
    queued_s: float | None  # became ready
    started_s: float | None  # a worker began it
    recorded_s: float | None  # its function returned (for GPU stages: its commands were recorded)
    submitted_s: float | None  # GPU stages: the submission holding its commands was handed to the queue
    completed_s: float | None  # its value was available where needed (GPU: its submission completed)
    gpu_ms: float | None = None  # GPU execution time from timestamp queries
    # Stages declared with capture=True: "captured" (the function ran and its work was
    # captured), "replayed" (it did not run), "fallback" (it cannot be replayed); else None.
    capture: str | None = None
    placement: Placement | None = None  # a two-implementation stage: where it ran, why, the estimates compared

    @property
    def replayed(self) -> bool:
        """The stage's captured work was replayed (its function did not run)."""
        return self.capture == "replayed"

    @property
    def device(self) -> str:
        """Where the stage ran: "cpu", "process" (a worker process) or "gpu"; "mixed" for a
        two-implementation stage that was never placed (the run stopped first)."""
        return self.kind

    @property
    def wall_ms(self) -> float | None:
        """Wall time from start to completion, in milliseconds."""
        if self.started_s is None or self.completed_s is None:
            return None
        return (self.completed_s - self.started_s) * 1e3

    # The instants under their names without a unit (seconds, as ``*_s``).
    @property
    def queued(self) -> float | None:
        return self.queued_s

    @property
    def started(self) -> float | None:
        return self.started_s

    @property
    def recorded(self) -> float | None:
        return self.recorded_s

    @property
    def submitted(self) -> float | None:
        return self.submitted_s

    @property
    def completed(self) -> float | None:
        return self.completed_s


@dataclass(frozen=True)
class RunStats:
    """The per-stage record of one run (``Runtime.stats()``)."""

    graph: str
    ok: bool
    wall_ms: float  # the run's wall time, in milliseconds
    stages: tuple[StageStats, ...]

    @property
    def devices(self) -> dict[str, str]:
        """Where each stage ran: ``{stage name: "cpu" | "process" | "gpu"}`` (``"mixed"``: never placed)."""
        return {s.name: s.kind for s in self.stages}

    def stage(self, name: str) -> StageStats:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(f"run of graph {self.graph!r} has no stage {name!r}")


class Timeline:
    """Mutable instants (perf_counter_ns, 0 = not yet) filled in by the workers of one run."""

    __slots__ = ("capture", "completed", "end", "gpu_ns", "queued", "recorded", "started", "submitted", "t0")

    def __init__(self, n: int) -> None:
        self.t0 = time.perf_counter_ns()
        self.end = 0
        self.queued = [0] * n
        self.started = [0] * n
        self.recorded = [0] * n
        self.submitted = [0] * n
        self.completed = [0] * n
        self.gpu_ns: list[int | None] = [None] * n
        self.capture: list[str | None] = [None] * n

    def snapshot(self, graph: str, names: list[str], kinds: list[str], ok: bool,
                 placements: Sequence[Placement | None] | None = None) -> RunStats:
        t0 = self.t0

        def rel(ns: int) -> float | None:
            return (ns - t0) / 1e9 if ns else None

        stages = tuple(
            StageStats(names[i], kinds[i], rel(self.queued[i]), rel(self.started[i]), rel(self.recorded[i]),
                       rel(self.submitted[i]), rel(self.completed[i]),
                       None if self.gpu_ns[i] is None else self.gpu_ns[i] / 1e6,  # type: ignore[operator]
                       self.capture[i], placements[i] if placements is not None else None)
            for i in range(len(names))
        )
        end = self.end or time.perf_counter_ns()
        return RunStats(graph, ok, (end - t0) / 1e6, stages)
