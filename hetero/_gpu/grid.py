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

When the entry point reaches ``hetero_workgroup_id``, ``hetero_num_workgroups`` or
``hetero_grid``, the prelude below is inserted; it declares the grid uniform in the
kernel's own group, at ``@group(0) @binding(n)``, where the kernel declares bindings
``0 .. n-1`` (hetero binds it after the dispatch's own). One bind group a dispatch, not
two: on the CPU machine a second group cost ~0.4 µs of recording and ~0.3 µs of
``encoder.finish()`` a dispatch (BENCHMARKS.md, twenty-ninth session), and a decode step
is ~150 such dispatches. Kernels that do not opt in are dispatched whole: a grid over
the limit is refused with a message that points here, and a long one gets a submission
of its own.

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

__all__ = ["CostModel", "DispatchInfo", "GRID_NAMES", "entry_uses_grid", "grid_entry", "grid_uniform", "prelude",
           "wants_grid", "with_prelude"]

_PRELUDE = """
struct HeteroGrid { base: vec3<u32>, total: vec3<u32> }
@group(0) @binding(%d) var<uniform> hetero_grid: HeteroGrid;
fn hetero_workgroup_id(wid: vec3<u32>) -> vec3<u32> { return wid + hetero_grid.base; }
fn hetero_num_workgroups() -> vec3<u32> { return hetero_grid.total; }
"""
GRID_NAMES = ("hetero_workgroup_id", "hetero_num_workgroups", "hetero_grid")
_FN = re.compile(r"\bfn\s+(\w+)\s*\(")
_CALL = re.compile(r"\b(\w+)\s*\(")
_GRID_USE = re.compile(r"\b(?:%s)\b" % "|".join(GRID_NAMES))


def prelude(binding: int) -> str:
    """The grid declarations, the uniform at ``@group(0) @binding(binding)``."""
    return _PRELUDE % binding

# Until a kernel was measured, assume 2 µs of GPU time per workgroup: heavier than most
# kernels, so the first submissions are smaller than needed rather than too long.
DEFAULT_NS_PER_WORKGROUP = 2000.0
# A calibrated kernel is timed again at most once per this many seconds (CostModel.should_time).
RESAMPLE_S = 1.0


def with_prelude(wgsl: str, binding: int) -> str:
    """The WGSL with the grid prelude (its uniform at ``binding`` of group 0) inserted after its
    ``enable``/``requires`` directives (WGSL wants directives before any declaration); comments
    are skipped over."""
    lines = wgsl.splitlines(keepends=True)
    code = strip_comments(wgsl).splitlines(keepends=True)  # same lines, comments blanked
    cut = 0
    for n, line in enumerate(code):
        text = line.strip()
        if text.startswith(("enable ", "requires ", "diagnostic(")) and text.endswith(";"):
            cut = n + 1
        elif text:
            break
    return "".join(lines[:cut]) + prelude(binding) + "".join(lines[cut:])


def wants_grid(wgsl: str) -> bool:
    """Does this WGSL use the grid helpers (and not declare them itself)? Comments do not count."""
    code = strip_comments(wgsl)
    uses = any(re.search(rf"\b{name}\b", code) for name in GRID_NAMES)
    return uses and not re.search(r"\bstruct\s+HeteroGrid\b", code)


def entry_uses_grid(wgsl: str, entry_point: str) -> bool:
    """Does ``entry_point``, or a function it calls (at any depth), name a grid helper?

    wgpu's automatic layout holds the globals an entry point's functions name, so this says
    whether the grid uniform is in the entry point's layout: a module of several entry points
    may use the helpers in one of them only. An entry point not found answers True (wgpu then
    says what is wrong when it compiles)."""
    code = strip_comments(wgsl)
    bodies: dict[str, str] = {}
    for m in _FN.finditer(code):
        start = code.find("{", m.end())
        if start < 0:
            continue
        depth, i = 0, start
        while i < len(code):
            c = code[i]
            depth += c == "{"
            depth -= c == "}"
            if depth == 0:
                break
            i += 1
        bodies[m.group(1)] = code[start:i + 1]
    if entry_point not in bodies:
        return True
    seen, todo = {entry_point}, [entry_point]
    while todo:
        body = bodies[todo.pop()]
        if _GRID_USE.search(body):
            return True
        for call in _CALL.findall(body):
            if call in bodies and call not in seen:
                seen.add(call)
                todo.append(call)
    return False


def grid_uniform(base: tuple[int, int, int], total: tuple[int, int, int]) -> bytes:
    """The 32 bytes of a ``HeteroGrid`` uniform (two vec3<u32>, each 16-byte aligned)."""
    return struct.pack("<8I", *base, 0, *total, 0)


def grid_entry(binds: Any, x0: int, total: tuple[int, int, int]) -> tuple[Any, int, int]:
    """The ``(buffer, offset, size)`` a grid kernel binds last: the uniform of a (sub-)dispatch from
    workgroup ``x0`` along x of a grid of ``total``, shared by content through ``binds`` (a BindCache)."""
    return (binds.uniform(grid_uniform((x0, 0, 0), total)), 0, 32)


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

    def quiet_until(self, keys: Any) -> float:
        """The clock time before which :meth:`should_time` answers False for every one of ``keys``
        (0.0: one of them is still among its first 8). A replay that checks the clock against it
        once skips asking per dispatch: ~0.3 µs a dispatch on the CPU machine."""
        timed, nxt = self._timed, self._next_sample
        until = float("inf")
        for key in keys:
            if timed.get(key, 0) < 8:
                return 0.0
            until = min(until, nxt.get(key, 0.0))
        return until

    def now(self) -> float:
        """The clock :meth:`should_time` and :meth:`quiet_until` read."""
        return self._clock()

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
