"""TDR-safe dispatches: grids larger than the per-dimension limit, and GPU-time budgets.

Two problems, one mechanism.

* A grid may exceed ``max-compute-workgroups-per-dimension`` (65535 on most adapters).
* One submission must not run long enough for a driver watchdog to reset the device
  (Windows' TDR fires at 2 s; hetero's default budget is 100 ms of GPU time).

Both are solved by splitting a dispatch into sub-dispatches along x, each given its
own base offset, and by finishing the submission whenever the estimated GPU time of
what it holds reaches the budget. A kernel opts in by using the grid helpers hetero
injects, which makes every workgroup see its position in the *whole* grid::

    @compute @workgroup_size(256)
    fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
        let w = hetero_workgroup_id(wid);        // workgroup id in the whole grid
        let i = w.x * 256u + lid.x;              // global index along x
        let n = hetero_num_workgroups();         // the whole grid's size, in workgroups
        ...
    }

When the WGSL names ``hetero_workgroup_id``, ``hetero_num_workgroups`` or
``hetero_grid``, the prelude below is prepended; it declares a uniform at
``@group(1) @binding(0)``, so such kernels keep their own bindings in ``@group(0)``.
Kernels that do not opt in are dispatched whole: a grid over the limit is refused
with a message that points here, and a long one gets a submission of its own.

Cost model. The GPU time of a dispatch is estimated as workgroups × ns-per-workgroup
of its kernel. Estimates start conservative (:data:`DEFAULT_NS_PER_WORKGROUP`) and
are refined from measurements: GPU timestamps where the adapter has
``timestamp-query``, otherwise the wall time from submission to fence of submissions
that hold one kernel, an upper bound. Estimates rise at once and decay slowly, so
the budget errs towards more, smaller submissions.
"""

from __future__ import annotations

import re
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .wgsl import strip_comments

__all__ = ["CostModel", "DispatchInfo", "GRID_NAMES", "PRELUDE", "grid_uniform", "wants_grid", "with_prelude"]

PRELUDE = """
struct HeteroGrid { base: vec3<u32>, total: vec3<u32> }
@group(1) @binding(0) var<uniform> hetero_grid: HeteroGrid;
fn hetero_workgroup_id(wid: vec3<u32>) -> vec3<u32> { return wid + hetero_grid.base; }
fn hetero_num_workgroups() -> vec3<u32> { return hetero_grid.total; }
"""
GRID_NAMES = ("hetero_workgroup_id", "hetero_num_workgroups", "hetero_grid")

# Until a kernel was measured, assume 2 µs of GPU time per workgroup: heavier than most
# kernels, so the first submissions are smaller than needed rather than too long.
DEFAULT_NS_PER_WORKGROUP = 2000.0
# A calibrated kernel is timed again at most once per this many seconds (CostModel.should_time).
RESAMPLE_S = 1.0


def with_prelude(wgsl: str) -> str:
    """The WGSL with the grid prelude inserted after its ``enable``/``requires`` directives
    (WGSL wants directives before any declaration); comments are skipped over."""
    lines = wgsl.splitlines(keepends=True)
    code = strip_comments(wgsl).splitlines(keepends=True)  # same lines, comments blanked
    cut = 0
    for n, line in enumerate(code):
        text = line.strip()
        if text.startswith(("enable ", "requires ", "diagnostic(")) and text.endswith(";"):
            cut = n + 1
        elif text:
            break
    return "".join(lines[:cut]) + PRELUDE + "".join(lines[cut:])


def wants_grid(wgsl: str) -> bool:
    """Does this WGSL use the grid helpers (and not declare them itself)? Comments do not count."""
    code = strip_comments(wgsl)
    uses = any(re.search(rf"\b{name}\b", code) for name in GRID_NAMES)
    return uses and not re.search(r"\bstruct\s+HeteroGrid\b", code)


def grid_uniform(base: tuple[int, int, int], total: tuple[int, int, int]) -> bytes:
    """The 32 bytes of a ``HeteroGrid`` uniform (two vec3<u32>, each 16-byte aligned)."""
    return struct.pack("<8I", *base, 0, *total, 0)


@dataclass(frozen=True)
class DispatchInfo:
    """How one ``gpu.dispatch`` was carried out."""

    kernel: str
    workgroups: tuple[int, int, int]
    sub_dispatches: int  # dispatches recorded (1 when not split)
    chunk: int  # workgroups along x per sub-dispatch
    submissions: int  # submissions finished because of the GPU-time budget while recording it
    estimated_ms: float  # estimated GPU time of the whole dispatch


class CostModel:
    """Nanoseconds per workgroup, per kernel, and the GPU time one submission may hold; thread-safe."""

    def __init__(self, budget_ns: float = 100e6, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.budget_ns = budget_ns  # the runtime's gpu_budget_ms: splitting and the recorder keep under it
        self._ns: dict[Any, float] = {}
        self._source: dict[Any, str] = {}
        self._timed: dict[Any, int] = {}  # dispatches of each kernel seen by should_time
        self._next_sample: dict[Any, float] = {}  # when each calibrated kernel is timed again
        self._clock = clock
        self._lock = threading.Lock()

    def should_time(self, key: Any) -> bool:
        """Whether to wrap this dispatch of ``key`` in GPU timestamps: its first 8, then one a second.

        Each timed submission costs a query resolve and a readback after its fence, so a
        calibrated kernel is re-measured only now and then (to follow clock changes), by
        time rather than by count: a graph that dispatches many kernels per run would
        otherwise time one of them in nearly every run.
        """
        n = self._timed.get(key, 0)
        if n < 8:
            self._timed[key] = n + 1  # a lost update under a race only shifts the sampling
            return True
        now = self._clock()
        if now < self._next_sample.get(key, 0.0):
            return False
        self._next_sample[key] = now + RESAMPLE_S
        return True

    def ns_per_workgroup(self, key: Any) -> float:
        return self._ns.get(key, DEFAULT_NS_PER_WORKGROUP)

    def source(self, key: Any) -> str:
        return self._source.get(key, "default")

    def estimate_ns(self, key: Any, workgroups: int) -> float:
        return workgroups * self.ns_per_workgroup(key)

    def observe(self, key: Any, workgroups: int, ns: float, *, source: str) -> None:
        """A measurement: ``workgroups`` of ``key`` took ``ns``. Timestamps beat wall times."""
        if workgroups <= 0 or ns <= 0:
            return
        per = ns / workgroups
        with self._lock:
            old = self._ns.get(key)
            if source == "wall" and self._source.get(key) == "timestamp":
                return  # a wall-clock upper bound never overrides a GPU measurement
            if old is None or self._source.get(key) == "default" or (source == "timestamp"
                                                                        and self._source.get(key) == "wall"):
                new = per
            elif per > old:
                new = per  # rise at once: never plan on an optimistic figure
            else:
                new = 0.75 * old + 0.25 * per  # decay slowly
            self._ns[key] = new
            self._source[key] = source

    def chunk(self, key: Any, budget_ns: float, per_x: int, limit: int) -> int:
        """Workgroups along x per sub-dispatch so that one fits the budget (at least 1)."""
        fit = int(budget_ns / max(self.ns_per_workgroup(key) * per_x, 1e-3))
        return max(1, min(limit, fit))
