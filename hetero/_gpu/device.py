"""Adapter selection, the device and its pipeline cache.

Submission and fences live in :mod:`hetero._gpu.submission`, watching for device loss
in :mod:`hetero._gpu.lost`; a :class:`Device` holds one of each.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from dataclasses import dataclass, replace
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable

import wgpu

# Imported here, not where the device is created: that is a worker thread, and CPython
# before 3.11.8 could fail an import compiled in another thread at the same time.
from .bindcache import BindCache
from .capture import CaptureCache
from .lost import LossWatch
from .pool import BufferPool
from .grid import CostModel, entry_uses_grid, wants_grid, with_prelude
from .timing import GPUTimer
from .._trace import Tracer
from .submission import OpenEncoder, Submission
from .transfer import StagingRing
from .wgsl import Binding, group_bindings
from ..errors import NoAdapterError

if TYPE_CHECKING:
    from .fence import Fence

__all__ = ["Device", "Kernel", "adapter_index", "adapter_labels", "adapter_position", "adapter_summary", "list_adapters",
           "select_adapter"]

log = logging.getLogger("hetero")

INSTALL_HINT = (
    "on Debian or Ubuntu install Mesa's software Vulkan driver with "
    "'apt-get install -y mesa-vulkan-drivers', or install your GPU's Vulkan driver"
)
# Optional features hetero asks for when the adapter has them.
WANTED_FEATURES = ("timestamp-query", "timestamp-query-inside-encoders", "timestamp-query-inside-passes",
                   "subgroup", "shader-f16")


def _quiet_loader() -> None:
    # The Vulkan loader complains on stderr when XDG_RUNTIME_DIR is unset (headless
    # machines); compute needs no display, so give it a private directory.
    if os.name == "posix" and not os.environ.get("XDG_RUNTIME_DIR"):
        import tempfile

        os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="hetero-xdg-")


def adapter_summary(adapter: Any) -> dict[str, str]:
    info = adapter.info
    return {
        "name": info.get("device", "") or "unknown",
        "backend": info.get("backend_type", ""),
        "type": info.get("adapter_type", ""),
        "summary": adapter.summary,
    }


# Adapters are looked up once per process, under _adapters_lock, and live as long as the
# process. wgpu-native's OpenGL adapters share one EGL context: enumerating adapters,
# requesting one (which drops those it does not pick) and releasing an OpenGL adapter each
# make that context current, and when two threads do so at once wgpu-hal panics
# (EGL_BAD_ACCESS) inside a C call, which aborts the process. Python releases an adapter
# when the last reference goes, or when the garbage collector finds it on whichever thread
# it runs on, so a fresh enumeration per call would race with the release of an earlier one.
_adapters_lock = threading.Lock()
_adapters: list[Any] | None = None
_preferred: Any = None


def list_adapters() -> list[Any]:
    """Every adapter wgpu can see, on every backend (enumerated once per process)."""
    global _adapters
    with _adapters_lock:
        if _adapters is None:
            _quiet_loader()
            _adapters = list(wgpu.gpu.enumerate_adapters_sync())
        return list(_adapters)


def _preferred_adapter() -> Any:
    """wgpu's high-performance adapter (requested once per process; None: there is none)."""
    global _preferred
    with _adapters_lock:
        if _preferred is None:
            _quiet_loader()
            _preferred = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
        return _preferred


def adapter_labels(adapters: list[Any]) -> list[str]:
    """For each adapter, a ``HETERO_ADAPTER`` value that selects exactly it: ``backend#k``.

    ``k`` counts the adapters before it whose summary also contains that backend's name,
    in wgpu's enumeration order, which is how :func:`select_adapter` reads ``pattern#k``.
    """
    labels = []
    for i, a in enumerate(adapters):
        backend = str(a.info.get("backend_type", "") or "").casefold()
        k = sum(1 for b in adapters[:i] if backend in b.summary.casefold())
        labels.append(f"{backend}#{k}" if backend else f"#{i}")
    return labels


def adapter_position(adapter: Any, adapters: list[Any]) -> int | None:
    """Where ``adapter`` is in ``adapters``: the same object, else the only one with its summary.

    :func:`select_adapter` returns an object of :func:`list_adapters` when a pattern chose
    it, and wgpu's own high-performance adapter otherwise; that one is found by its
    summary, which identical GPUs share (None then: the index cannot be told).
    """
    for i, a in enumerate(adapters):
        if a is adapter:
            return i
    same = [i for i, a in enumerate(adapters) if a.summary == adapter.summary]
    return same[0] if len(same) == 1 else None


def adapter_index(adapters: list[Any], pattern: str | int | None) -> int | None:
    """The position in ``adapters`` that ``pattern`` selects (None: no pattern, wgpu chooses).

    ``pattern`` is a case-insensitive substring of an adapter's summary (name, backend,
    type), optionally followed by ``#k``: the ``k``-th matching adapter, counted from 0
    in enumeration order (``vulkan#1``: the second Vulkan adapter; ``#2``: the third of
    all). An int ``k`` means ``#k``. Identical GPUs have identical names: the index is
    what tells them apart.
    """
    if pattern is None or pattern == "":
        return None
    if isinstance(pattern, bool) or not isinstance(pattern, (str, int)):
        raise NoAdapterError(f"an adapter is chosen by a name pattern or an index, got {pattern!r}")
    if isinstance(pattern, int):
        needle, k = "", pattern
    else:
        needle, sep, index = pattern.rpartition("#")
        if not sep:
            needle, k = pattern, 0
        elif index.isdigit():
            k = int(index)
        else:
            raise NoAdapterError(f"adapter {pattern!r}: the part after '#' must be an index (0, 1, ...), "
                                 f"got {index!r}; e.g. 'vulkan#1' is the second Vulkan adapter")
    needle = needle.casefold()
    matches = [i for i, a in enumerate(adapters) if needle in a.summary.casefold()]
    if k < 0 or k >= len(matches):
        have = "; ".join(f"{label}: {a.summary}" for label, a in zip(adapter_labels(adapters), adapters))
        what = f"no adapter matches HETERO_ADAPTER={pattern!r}" if not matches else (
            f"HETERO_ADAPTER={pattern!r} asks for adapter #{k} of the {len(matches)} that match")
        raise NoAdapterError(f"{what}; available: {have}. "
                             "Set it to part of one of these names or backends (with '#k' for the k-th), or unset it")
    return matches[k]


def select_adapter(pattern: str | int | None = None) -> Any:
    """The adapter to use: the one ``pattern`` (or ``$HETERO_ADAPTER``) selects, else high-performance.

    ``pattern`` is a case-insensitive substring of the adapter's name, backend or type,
    optionally with ``#k`` for the ``k``-th match (see :func:`adapter_index`).
    """
    if pattern is None:
        pattern = os.environ.get("HETERO_ADAPTER") or None
    adapters = list_adapters()
    if not adapters:
        raise NoAdapterError(f"no WebGPU adapter found; {INSTALL_HINT}")
    index = adapter_index(adapters, pattern)
    if index is not None:
        return adapters[index]
    adapter = _preferred_adapter()
    if adapter is None:
        raise NoAdapterError(f"no WebGPU adapter found; {INSTALL_HINT}")
    return adapter


@dataclass(frozen=True)
class Kernel:
    """A compiled compute pipeline (cached per device by WGSL hash and entry point)."""

    pipeline: Any
    entry_point: str
    label: str
    n_bindings: int
    read_write: frozenset[int] = frozenset()  # @group(0) bindings declared var<storage, read_write>
    # Uses hetero's grid helpers: may be split into sub-dispatches, and its @group(0) holds the grid
    # uniform at @binding(n_bindings), after the dispatch's own (see grid).
    grid: bool = False
    key: Any = None  # the cache key, also the cost model's key
    layouts: tuple[Any, ...] = ()  # the bind group layout of group 0 (None: it binds nothing), fetched once
    # The @group(0) declarations (see wgsl): entry i declares @binding(i), the binding a
    # dispatch's i-th argument fills; None where the WGSL declares no such binding.
    bindings: tuple[Binding | None, ...] = ()

    def writes(self, binding: int) -> bool:
        return binding in self.read_write


class Device:
    """One WebGPU device: its pipeline cache and the resources recorded work uses.

    Submission and fences are :class:`~hetero._gpu.submission.Submission` (``submission``),
    device loss is :class:`~hetero._gpu.lost.LossWatch` (``loss``); the methods below that
    submit or wait hand over to them.
    """

    def __init__(self, adapter: Any | None = None, *, max_batch: int = 32, memory_budget: int | None = None,
                 gpu_budget_ms: float = 100.0, tracer: Tracer | None = None, gpu_timing: bool = False,
                 trace_dispatches: bool = True) -> None:
        self.tracer = tracer
        # A name pattern or an index ("vulkan#1", 1) selects among the adapters; an adapter object is used as is.
        self.adapter = adapter if adapter is not None and not isinstance(adapter, (str, int)) else select_adapter(adapter)
        features = [f for f in WANTED_FEATURES if f in self.adapter.features]
        limits = {k: v for k, v in self.adapter.limits.items()}
        self.device = self.adapter.request_device_sync(
            label="hetero", required_features=features, required_limits=limits
        )
        self.queue = self.device.queue
        self.limits: dict[str, int] = dict(self.device.limits)
        self.features: frozenset[str] = frozenset(self.device.features)
        self.summary = adapter_summary(self.adapter)
        self._kernels: dict[tuple[str, str, tuple[tuple[str, Any], ...]], Kernel] = {}
        self._by_source: dict[tuple[str, str, tuple[tuple[str, Any], ...], str], Kernel] = {}
        self._kernel_lock = threading.Lock()
        self.loss = LossWatch(self.device, self.summary["summary"])
        self.submission = Submission(self.device, self.loss, max_batch=max_batch, tracer=tracer)

        # Kernel costs, and the GPU time one submission may hold (see grid).
        self.cost = CostModel(budget_ns=gpu_budget_ms * 1e6)
        # GPU timestamps: per stage (and per dispatch of splittable kernels) where the
        # device can write them inside passes; the clock is aligned to the host once.
        self.timer = GPUTimer(self.device)
        # Timestamps around every stage cost a resolve and a readback per submission: on
        # when asked or tracing.
        self.stage_timing = (gpu_timing or tracer is not None) and self.timer.strategy == "inside-passes"
        # A trace times every dispatch too, unless told not to (Runtime(trace_dispatches=False)).
        self.dispatch_timing = tracer is not None and trace_dispatches
        if self.timer.strategy == "inside-passes":
            self.timer.align(submit=self.submit)
        # Uniforms by content and bind groups by what they bind (see bindcache); the pool
        # says which buffers it creates and which it is about to destroy.
        self.binds = BindCache(self.device)
        self.pool = BufferPool(self.device, budget_bytes=memory_budget, before_destroy=self.flush,
                               on_create=self.binds.track, on_destroy=self.binds.forget)
        self.ring = StagingRing(self.device)
        # Captured GPU stages by function and signature (see capture); the runtime sizes it.
        self.captures = CaptureCache()

    # -- pipelines -------------------------------------------------------------------
    def kernel(self, wgsl: str, entry_point: str = "main", label: str = "",
               constants: Mapping[str, float | int | bool] | None = None) -> Kernel:
        """Compile ``wgsl`` once per device; later calls return the cached pipeline.

        The cache is keyed by the WGSL's hash, the entry point and the override
        ``constants``; it is thread-safe, and compilation never runs on the event loop
        (GPU stages record on worker threads; ``Runtime.warmup`` compiles on one too).
        Kernels of one source asked for under different labels share the pipeline and keep
        their own label (what traces and errors name).
        """
        consts = tuple(sorted(constants.items())) if constants else ()
        # Fast path by the source text itself: a str caches its hash, and kernel
        # generators return the same (memoised) str object, so a hit costs no sha256.
        source_key = (wgsl, entry_point, consts, label)
        k = self._by_source.get(source_key)
        if k is None:
            k = self._compiled(wgsl, entry_point, label, consts)
            if label and k.label != label:
                k = replace(k, label=label)
            if len(self._by_source) < 4096:
                self._by_source[source_key] = k
        return k

    def _compiled(self, wgsl: str, entry_point: str, label: str, consts: tuple[tuple[str, Any], ...]) -> Kernel:
        """The kernel cached under the WGSL's hash, compiled first if it is not there."""
        key = (hashlib.sha256(wgsl.encode()).hexdigest(), entry_point, consts)
        k = self._kernels.get(key)
        if k is not None:
            return k
        with self._kernel_lock:
            k = self._kernels.get(key)
            if k is None:
                label = label or entry_point
                decls = group_bindings(wgsl, 0)
                n_bindings = len(decls)
                # The grid uniform goes after the kernel's own bindings (see grid), where its entry
                # point reaches the helpers; a module of several entry points may use them in one only.
                named = wants_grid(wgsl)
                grid = named and entry_uses_grid(wgsl, entry_point)
                after = max(decls, default=-1) + 1  # the grid uniform's binding, clear of the kernel's
                if grid and after != n_bindings:
                    raise ValueError(
                        f"kernel {label!r} uses hetero's grid helpers, so its @group(0) bindings must be numbered "
                        f"0..{n_bindings - 1} (hetero adds the grid uniform at @binding({n_bindings})); it declares "
                        f"@binding({', '.join(map(str, sorted(decls)))}). Number them from 0 without gaps")
                code = with_prelude(wgsl, after) if named else wgsl
                module = self.device.create_shader_module(label=label, code=code)
                compute: dict[str, Any] = {"module": module, "entry_point": entry_point}
                if consts:
                    compute["constants"] = dict(consts)
                pipeline = self.device.create_compute_pipeline(label=label, layout="auto", compute=compute)
                layouts = (_layout(pipeline, 0) if n_bindings or grid else None,)
                read_write = frozenset(n for n, b in decls.items() if b.access == "read_write")
                k = Kernel(pipeline, entry_point, label, n_bindings, read_write, grid, key, layouts,
                           tuple(decls.get(n) for n in range(n_bindings)))
                self._kernels[key] = k
        return k

    # -- submission, fences and loss (see submission, lost) -------------------------
    @property
    def lost(self) -> str | None:
        """Why the device was lost, or None while it is not."""
        return self.loss.lost

    @property
    def submissions(self) -> int:
        return self.submission.submissions

    @property
    def idle(self) -> bool:
        """Nothing of ours is running on the GPU or waiting to be submitted (a hint: not locked)."""
        return self.submission.idle

    def check_alive(self) -> None:
        self.loss.check_alive()

    def on_lost(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` once if the device is lost (at once if it already is)."""
        self.loss.on_lost(callback)

    def lost_after(self, exc: BaseException) -> str | None:
        """See :meth:`LossWatch.lost_after`."""
        return self.loss.lost_after(exc)

    def share_encoders(self, recorder: OpenEncoder) -> None:
        """See :meth:`Submission.share_encoders`."""
        self.submission.share_encoders(recorder)

    def submit(self, command_buffers: list[Any]) -> int:
        """Submit in one call and return the submission index (refused once the device is closed)."""
        return self.submission.submit(command_buffers)

    def enqueue(self, command_buffer: Any, on_done: Callable[[], None] | None = None, *,
                flush: bool = False, on_submit: Callable[[int], None] | None = None, locked: bool = False) -> None:
        """Append a command buffer to the ordered batch (see :meth:`Submission.enqueue`)."""
        self.submission.enqueue(command_buffer, on_done, flush=flush, on_submit=on_submit, locked=locked)

    def flush(self) -> None:
        """Finish open shared encoders, then submit whatever is batched (nothing once closed)."""
        self.submission.flush()

    def fence(self) -> Fence:
        """Submit everything recorded so far and return the ``Fence`` of the newest submission."""
        return self.submission.fence()

    def completed(self, index: int) -> bool:
        """Whether submission ``index`` completed, without blocking (safe on the event loop)."""
        return self.submission.completed(index)

    def wait(self, index: int) -> None:
        """Block the calling thread until submission ``index`` completed (never call on the loop)."""
        self.submission.wait(index)

    def on_done(self, index: int, callback: Callable[[], None]) -> None:
        """Run ``callback()`` on the fence thread once submission ``index`` completed."""
        self.submission.on_done(index, callback)

    def defer(self, callback: Callable[[], None]) -> None:
        """From a fence callback: run ``callback()`` later on the fence thread (see :meth:`Submission.defer`)."""
        self.submission.defer(callback)

    def close(self) -> None:
        """Submit what is batched, refuse submissions from now on, let the fence thread drain,
        then destroy pooled memory. Idempotent."""
        if self.submission.closed:
            return
        self.submission.close()
        self.ring.close()
        self.timer.close()
        self.pool.close()
        self.captures.clear()
        self.binds.clear()
        self._kernels.clear()
        self._by_source.clear()


def _layout(pipeline: Any, group: int) -> Any:
    """The pipeline's bind group layout for ``group``, or None where the entry point uses none."""
    try:
        return pipeline.get_bind_group_layout(group)
    except Exception:
        return None

