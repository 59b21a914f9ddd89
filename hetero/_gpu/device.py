"""Adapter selection, the device, pipeline cache, submission and fences.

Fence design. ``queue.on_submitted_work_done`` raises ``TypeError`` in wgpu 0.32.0,
so hetero does not use it. Each submission goes through wgpu-native's
``wgpuQueueSubmitForIndex``, which returns a submission index, and one fence
thread per device blocks in ``wgpuDevicePoll(wait=True, index)`` for the oldest
pending index, then runs that submission's completion callback (downloads, waking
consumers). The event loop never blocks; submissions resolve in submission order.
Each submission also registers a work-done callback, which marks it complete from
whichever device poll sees it finish first. A coroutine awaiting one submission
(``Device.fence()``, see ``_fence``) polls from the loop first and is woken by the
fence thread only after that.
This reaches below wgpu-py's Python API into its cffi binding, which is why
pyproject.toml pins wgpu to the tested version.

Closing. A submission that names a destroyed buffer aborts the process inside
``wgpuQueueSubmit``, so teardown and submission exclude each other: every
submission happens under ``_queue_lock`` and checks ``_closed``; ``close()``
submits what is batched, sets ``_closed`` under that lock, drains the fence thread
and only then destroys memory. A recording thread still busy after that gets
:class:`~hetero.errors.RuntimeClosedError` from ``enqueue``/``submit`` and nothing
reaches the queue.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import queue
import threading
import time
import weakref
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any, Callable

import wgpu
from wgpu.backends.wgpu_native._ffi import lib as _raw_lib

# Imported here, not where the device is created: that is a worker thread, and CPython
# before 3.11.8 could fail an import compiled in another thread at the same time.
from .bindcache import BindCache
from .capture import CaptureCache
from .fence import Fence
from .pool import BufferPool
from .grid import CostModel, wants_grid, with_prelude
from .timing import GPUTimer
from .._trace import Tracer
from .transfer import StagingRing
from .wgsl import Binding, group_bindings
from ..errors import DeviceLostError, NoAdapterError, RuntimeClosedError

__all__ = ["Device", "Kernel", "adapter_index", "adapter_labels", "adapter_summary", "list_adapters", "select_adapter"]

log = logging.getLogger("hetero")

INSTALL_HINT = (
    "on Debian or Ubuntu install Mesa's software Vulkan driver with "
    "'apt-get install -y mesa-vulkan-drivers', or install your GPU's Vulkan driver"
)
# Optional features hetero asks for when the adapter has them.
WANTED_FEATURES = ("timestamp-query", "timestamp-query-inside-encoders", "timestamp-query-inside-passes",
                   "subgroup", "shader-f16")
# How long close() waits for the fence thread to see the last submission complete.
CLOSE_WAIT_S = 10.0
# Deferred fence callbacks (Device.defer) pending at most: past this they run at once.
MAX_DEFERRED = 64


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
    grid: bool = False  # uses hetero's grid helpers: may be split into sub-dispatches (see _split)
    key: Any = None  # the cache key, also the cost model's key
    layouts: tuple[Any, ...] = ()  # bind group layouts of groups 0 (and 1 for grid kernels), fetched once
    # The @group(0) declarations (see _wgsl): entry i declares @binding(i), the binding a
    # dispatch's i-th argument fills; None where the WGSL declares no such binding.
    bindings: tuple[Binding | None, ...] = ()

    def writes(self, binding: int) -> bool:
        return binding in self.read_write


class Device:
    """One WebGPU device: its queue, its pipeline cache and its fence thread."""

    def __init__(self, adapter: Any | None = None, *, max_batch: int = 32, memory_budget: int | None = None,
                 gpu_budget_ms: float = 100.0, tracer: Tracer | None = None, gpu_timing: bool = False) -> None:
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
        self._by_source: dict[tuple[str, str, tuple[tuple[str, Any], ...]], Kernel] = {}
        self._kernel_lock = threading.Lock()
        # How long the fence thread looks for the next fence before it sleeps (see _next_fence).
        self.fence_spin_s = _fence_spin_s()
        # A SimpleQueue (C-implemented) wakes the fence thread faster than a Condition.
        self._fences: queue.SimpleQueue[tuple[int, Callable[[], None]] | None] = queue.SimpleQueue()
        self._deferred: list[Callable[[], None]] = []  # housekeeping for when no fence waits (fence thread only)
        self._closed = False  # set under _submit_lock and _queue_lock: nothing is submitted after it
        self._queue_lock = threading.Lock()  # held around every queue submission (after _submit_lock)
        # Command buffers recorded but not yet submitted, in dependency order.
        self.max_batch = max_batch
        self._batch: list[Any] = []
        self._batch_callbacks: list[Callable[[], None]] = []
        self._batch_submitted: list[Callable[[int], None]] = []
        self._submit_lock = threading.Lock()
        self._inflight = 0  # our submissions not yet completed
        self._fence_polling = False  # the fence thread is polling for a submission (see completed())
        # Submission indices: the newest submitted, and the newest known to be complete
        # (advanced by the fence thread and by non-blocking polls; see completed()).
        self._submitted = -1
        self._completed = -1
        self._index_lock = threading.Lock()
        self._sleepers: list[tuple[int, threading.Lock]] = []  # Fence.wait between polls
        self.before_flush: list[Callable[[], None]] = []  # recorders holding open encoders
        # Called on the fence thread when the GPU has nothing of ours left: a recorder
        # holding finished stages in an open encoder sends them now rather than at its
        # next stage (the GPU would idle for a stage's recording time).
        self.on_idle: list[Callable[[], None]] = []
        self.submissions = 0
        self.lost: str | None = None
        self._lost_callbacks: list[Callable[[str], None]] = []
        self._lost_lock = threading.Lock()
        _LostWatcher.register(self)
        self._fence_thread = threading.Thread(target=self._fence_loop, name="hetero-fence", daemon=True)
        self._fence_thread.start()
        # wgpu-py's cffi module: submission indices and blocking polls.
        from wgpu.backends.wgpu_native import _api

        self._ffi, self._lib, self._new_array = _api.ffi, _api.libf, _api.new_array
        self._work_done = _work_done_callback(self._ffi)
        self._key = next(_device_keys)
        _DEVICES[self._key] = self

        self.budget_ns = gpu_budget_ms * 1e6  # GPU time one submission may hold (see _split)
        self.cost = CostModel()
        # GPU timestamps: per stage (and per dispatch of splittable kernels) where the
        # device can write them inside passes; the clock is aligned to the host once.
        self.timer = GPUTimer(self.device)
        # Timestamps around every stage cost a resolve and a readback per submission (a
        # third more host time for tiny stages on the H200): on when asked or tracing.
        self.stage_timing = (gpu_timing or tracer is not None) and self.timer.strategy == "inside-passes"
        if self.timer.strategy == "inside-passes":
            self.timer.align(submit=self.submit)
        # Uniforms by content and bind groups by what they bind (see _bindcache); the pool
        # says which buffers it creates and which it is about to destroy.
        self.binds = BindCache(self.device)
        self.pool = BufferPool(self.device, budget_bytes=memory_budget, before_destroy=self.flush,
                               on_create=self.binds.track, on_destroy=self.binds.forget)
        self.ring = StagingRing(self.device)
        # Captured GPU stages by function and signature (see _capture); the runtime sizes it.
        self.captures = CaptureCache()

    # -- pipelines -------------------------------------------------------------------
    def kernel(self, wgsl: str, entry_point: str = "main", label: str = "",
               constants: Mapping[str, float | int | bool] | None = None) -> Kernel:
        """Compile ``wgsl`` once per device; later calls return the cached pipeline.

        The cache is keyed by the WGSL's hash, the entry point and the override
        ``constants``; it is thread-safe, and compilation never runs on the event loop
        (GPU stages record on worker threads; ``Runtime.warmup`` compiles on one too).
        """
        consts = tuple(sorted(constants.items())) if constants else ()
        # Fast path by the source text itself: a str caches its hash, and kernel
        # generators return the same (memoised) str object, so a hit costs no sha256.
        source_key = (wgsl, entry_point, consts)
        k = self._by_source.get(source_key)
        if k is None:
            k = self._compiled(wgsl, entry_point, label, consts)
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
                grid = wants_grid(wgsl)
                module = self.device.create_shader_module(label=label, code=with_prelude(wgsl) if grid else wgsl)
                compute: dict[str, Any] = {"module": module, "entry_point": entry_point}
                if consts:
                    compute["constants"] = dict(consts)
                pipeline = self.device.create_compute_pipeline(label=label, layout="auto", compute=compute)
                layouts: list[Any] = []
                decls = group_bindings(wgsl, 0)
                n_bindings = len(decls)
                layouts.append(_layout(pipeline, 0) if n_bindings else None)
                if grid:
                    try:
                        layouts.append(pipeline.get_bind_group_layout(1))
                    except Exception:
                        grid = False  # the helpers are named but never used by the entry point
                read_write = frozenset(n for n, b in decls.items() if b.access == "read_write")
                k = Kernel(pipeline, entry_point, label, n_bindings, read_write, grid, key, tuple(layouts),
                           tuple(decls.get(n) for n in range(n_bindings)))
                self._kernels[key] = k
        return k

    # -- submission and fences ------------------------------------------------------
    def check_alive(self) -> None:
        if self.lost is not None:
            raise DeviceLostError(f"the GPU device was lost ({self.lost}); create a new Runtime")

    def on_lost(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` once if the device is lost (at once if it already is)."""
        self._lost_callbacks.append(callback)
        if self.lost is not None:
            callback(self.lost)

    def _probe_lost(self) -> None:
        """wgpu reported that *a* device was lost: find out whether it was this one."""
        with self._lost_lock:
            if self.lost is not None or self._closed:
                return
            try:
                self.device.create_command_encoder().finish()
                return
            except Exception as e:  # "Parent device is lost"
                if "lost" not in str(e).lower():
                    return
            self.lost = "reported by the driver"
        log.error("hetero: the GPU device %s was lost", self.summary["summary"])
        for cb in self._lost_callbacks:
            try:
                cb(self.lost)
            except Exception:  # pragma: no cover
                log.exception("device-lost callback failed")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeClosedError("the GPU device of this Runtime is closed: nothing more can be submitted; "
                                     "create a new Runtime")

    def submit(self, command_buffers: list[Any]) -> int:
        """Submit in one call and return the submission index (refused once the device is closed)."""
        handles = self._new_array("WGPUCommandBuffer[]", [cb._internal for cb in command_buffers])
        with self._queue_lock:
            self._check_open()
            self.check_alive()
            index = int(self._lib.wgpuQueueSubmitForIndex(self.queue._internal, len(command_buffers), handles))
        with self._index_lock:
            if index > self._submitted:
                self._submitted = index
        self._register_work_done(index)
        return index

    def fence(self) -> Fence:
        """Submit everything recorded so far and return the ``Fence`` of the newest submission."""
        self.flush()
        return Fence(self, self._submitted)

    def completed(self, index: int) -> bool:
        """Whether submission ``index`` completed, without blocking (safe on the event loop).

        Completion is learnt from the fence thread's waits and from the work-done
        callback registered with each submission, which fires inside whichever device
        poll sees the work finished: a non-blocking one made here included (unless the
        fence thread is polling, which then reports it). Monotonic: once an index is
        complete, every earlier one is too.
        """
        if index <= self._completed:
            return True
        self.check_alive()
        # While the fence thread polls, leave the report to it: a non-blocking poll waits
        # for a blocking one on another thread to return (measured on the H200 and on
        # lavapipe), and two threads polling at once contend for the device.
        if not self._fence_polling:
            self._lib.wgpuDevicePoll(self.device._internal, False, self._ffi.NULL)
        return index <= self._completed

    def _advance(self, index: int) -> None:
        """Submission ``index`` (and so every earlier one) completed: wake who sleeps on it."""
        with self._index_lock:
            if index <= self._completed:
                return
            self._completed = index
            ready = [lock for i, lock in self._sleepers if i <= index]
            if ready:
                self._sleepers = [(i, lock) for i, lock in self._sleepers if i > index]
        for lock in ready:
            lock.release()

    def _sleeper(self, index: int) -> threading.Lock | None:
        """A held lock that ``_advance`` releases once ``index`` completed (None: it already has)."""
        lock = threading.Lock()
        lock.acquire()
        with self._index_lock:
            if index <= self._completed:
                return None
            self._sleepers.append((index, lock))
        return lock

    def _drop_sleeper(self, lock: threading.Lock) -> None:
        with self._index_lock:
            self._sleepers = [(i, other) for i, other in self._sleepers if other is not lock]

    def _register_work_done(self, index: int) -> None:
        """Ask wgpu-native to call back once everything submitted so far completed."""
        info = self._ffi.new("WGPUQueueWorkDoneCallbackInfo *")
        info.mode = _raw_lib.WGPUCallbackMode_AllowSpontaneous
        info.callback = self._work_done
        info.userdata1 = self._ffi.cast("void *", index)
        info.userdata2 = self._ffi.cast("void *", self._key)
        self._lib.wgpuQueueOnSubmittedWorkDone(self.queue._internal, info[0])

    def enqueue(self, command_buffer: Any, on_done: Callable[[], None] | None = None, *,
                flush: bool = False, on_submit: Callable[[int], None] | None = None) -> None:
        """Append a command buffer to the ordered batch; submit when it pays.

        Everything enqueued runs in enqueue order, so a stage's consumers may be
        enqueued (and buffers it released reused) as soon as this returns.
        ``on_done`` runs on the fence thread once the batch holding this command
        buffer completed; pass ``flush=True`` when someone waits for it now.
        ``on_submit(t_ns)`` runs right after the batch holding it was submitted.

        Coalescing policy: while the GPU has nothing of ours in flight, submit at once
        (it would idle otherwise); while a submission runs, collect command buffers
        and submit them together when it completes, when ``max_batch`` are waiting,
        when a fence is awaited, or when the recording workers go idle.
        """
        with self._submit_lock:
            self._check_open()
            self.check_alive()
            self._batch.append(command_buffer)
            if on_done is not None:
                self._batch_callbacks.append(on_done)
            if on_submit is not None:
                self._batch_submitted.append(on_submit)
            if flush or self._inflight == 0 or len(self._batch) >= self.max_batch:
                self._flush_locked()

    @property
    def idle(self) -> bool:
        """Nothing of ours is running on the GPU or waiting to be submitted (a hint: not locked)."""
        return self._inflight == 0 and not self._batch

    def flush(self) -> None:
        """Finish open shared encoders, then submit whatever is batched (nothing once closed)."""
        if self._closed:
            return
        for hook in self.before_flush:
            hook()
        with self._submit_lock:
            if self._batch and not self._closed:
                self._flush_locked()

    def _flush_locked(self) -> None:
        batch, callbacks, submitted = self._batch, self._batch_callbacks, self._batch_submitted
        self._batch, self._batch_callbacks, self._batch_submitted = [], [], []
        if self.lost is not None:
            return  # submitting on a lost device aborts the process; runs were failed already
        index = self.submit(batch)
        if submitted:
            now = time.perf_counter_ns()
            for on_submit in submitted:
                on_submit(now)
        self.submissions += 1
        self._inflight += 1
        self.on_done(index, self._retired)  # first: the next batch goes out before downloads run
        for cb in callbacks:
            self.on_done(index, cb)

    def _retired(self) -> None:
        """On the fence thread: a submission completed; send what was collected meanwhile."""
        with self._submit_lock:
            self._inflight -= 1
            if self._batch and self._inflight == 0 and not self._closed:
                self._flush_locked()
            idle = self.idle and not self._closed
        if idle:
            for hook in self.on_idle:
                hook()

    def wait(self, index: int) -> None:
        """Block the calling thread until submission ``index`` completed (never call on the loop)."""
        self._lib.wgpuDevicePoll(self.device._internal, True, self._ffi.new("WGPUSubmissionIndex *", index))

    def on_done(self, index: int, callback: Callable[[], None]) -> None:
        """Run ``callback()`` on the fence thread once submission ``index`` completed."""
        self._fences.put((index, callback))

    def defer(self, callback: Callable[[], None]) -> None:
        """From a fence callback: run ``callback()`` later on the fence thread, once no
        completed fence waits (or :data:`MAX_DEFERRED` are pending, or at close).

        For housekeeping nobody waits for (recycling upload staging, reading sampled
        timestamps), so that the callbacks that deliver results and wake waiters of the
        same submission run first.
        """
        if threading.current_thread() is not self._fence_thread:
            callback()  # e.g. a shared encoder that failed settles its stages on the recording thread
            return
        self._deferred.append(callback)
        if len(self._deferred) >= MAX_DEFERRED:
            self._run_deferred()

    def _run_deferred(self) -> None:
        while self._deferred:
            pending, self._deferred = self._deferred, []
            for cb in pending:
                try:
                    cb()
                except BaseException:  # pragma: no cover - callbacks handle their own errors
                    log.exception("deferred fence callback failed")

    def _next_fence(self) -> tuple[int, Callable[[], None]] | None:
        """The next fence to wait for: spin briefly (releasing the GIL) before blocking.

        A fence thread asleep in ``get()`` takes a futex wake-up (~10 µs on the H200's
        host) for each new submission; right after a fence, the next one usually follows
        within microseconds (streams, chains of small stages), so look again for up to
        ``fence_spin_s`` first. ``sleep(0)`` gives the GIL away on every turn.
        """
        fences = self._fences
        try:
            return fences.get_nowait()
        except queue.Empty:
            pass
        if self._deferred:
            self._run_deferred()
            try:
                return fences.get_nowait()
            except queue.Empty:
                pass
        if self.fence_spin_s > 0:
            deadline = time.perf_counter() + self.fence_spin_s
            while time.perf_counter() < deadline:
                time.sleep(0)
                try:
                    return fences.get_nowait()
                except queue.Empty:
                    pass
        return fences.get()

    def _fence_loop(self) -> None:
        while True:
            item = self._next_fence()
            if item is None:
                self._run_deferred()
                return  # closed, and everything before the sentinel was completed
            index, callback = item
            try:
                if self.tracer is not None:
                    t0 = time.perf_counter_ns()
                    self._await_completion(index)
                    self.tracer.span(f"fence #{index}", "fence", t0, time.perf_counter_ns())
                else:
                    self._await_completion(index)
            except Exception as e:  # pragma: no cover - wgpu-native reports loss this way
                self.lost = repr(e)
            else:
                self._advance(index)
            try:
                callback()
            except BaseException:  # pragma: no cover - callbacks handle their own errors
                log.exception("fence callback failed")

    def _await_completion(self, index: int) -> None:
        """On the fence thread: return once submission ``index`` completed.

        With the fence spin on, poll without blocking for up to ``fence_spin_s`` first
        (the work-done callbacks report what finished): small submissions complete
        within tens of microseconds, and a thread inside a blocking poll holds up every
        other thread's non-blocking one until it returns, the event loop's included.
        Then block; meanwhile ``completed()`` leaves the polling to this thread.
        """
        if index <= self._completed:
            return
        self._fence_polling = True
        try:
            if self.fence_spin_s > 0:
                deadline = time.perf_counter() + self.fence_spin_s
                while True:
                    self._lib.wgpuDevicePoll(self.device._internal, False, self._ffi.NULL)
                    if index <= self._completed or time.perf_counter() >= deadline:
                        break
                    time.sleep(0)  # the GIL goes to the loop between polls
                if index <= self._completed:
                    return
            self.wait(index)
        finally:
            self._fence_polling = False

    def close(self) -> None:
        """Submit what is batched, refuse submissions from now on, let the fence thread drain,
        then destroy pooled memory. Idempotent."""
        if self._closed:
            return
        try:
            self.flush()
        except Exception:  # noqa: BLE001 - e.g. the device was lost: closing goes on
            log.debug("hetero: final flush failed", exc_info=True)
        with self._submit_lock:
            try:
                if self._batch:
                    self._flush_locked()
            except Exception:  # noqa: BLE001
                log.debug("hetero: final submission failed", exc_info=True)
            finally:
                with self._queue_lock:
                    self._closed = True
                self._batch, self._batch_callbacks, self._batch_submitted = [], [], []
        # Everything submitted registered its fence before the sentinel: the fence thread
        # returns once all of it completed (and its callbacks, which submit nothing now, ran).
        self._fences.put(None)
        self._fence_thread.join(timeout=CLOSE_WAIT_S)
        self.ring.close()
        self.timer.close()
        self.pool.close()
        self.captures.clear()
        self.binds.clear()
        self._kernels.clear()
        self._by_source.clear()


class _LostWatcher(logging.Handler):
    """wgpu 0.32 hides ``device.lost``; its device-lost callback only logs. Watch that log.

    On a "device was lost" record every live Device probes itself (a lost device
    fails ``encoder.finish()`` with "Parent device is lost") and, if lost, fails its
    runs with :class:`DeviceLostError` and refuses further submissions, which would
    otherwise abort the process.
    """

    _installed: _LostWatcher | None = None
    _devices: weakref.WeakSet[Device] = weakref.WeakSet()

    @classmethod
    def register(cls, device: Device) -> None:
        if cls._installed is None:
            cls._installed = cls(level=logging.ERROR)
            logging.getLogger("wgpu").addHandler(cls._installed)
        cls._devices.add(device)

    def emit(self, record: logging.LogRecord) -> None:
        if "device was lost" not in record.getMessage():
            return
        devices = list(self._devices)

        def probe() -> None:
            for d in devices:
                d._probe_lost()

        # Probe off the thread that logged (it may be inside a wgpu call).
        threading.Thread(target=probe, name="hetero-lost-probe", daemon=True).start()


# The fence thread's spin, on hosts with at least FENCE_SPIN_MIN_CPUS cores: for a new
# submission before it sleeps (``_next_fence``), and polling a fresh one without blocking
# before a blocking poll (``_await_completion``). Measured with ``python -m
# bench.gpu_runtime`` (submit -> coroutine resumed), for the first: H200 host (16
# cores) 95 µs without, 71 µs with a 100 µs spin; a 2-core machine running lavapipe
# 94 µs without, 144 µs with (the spinner takes CPU the software GPU needs). The second
# took the H200 figure from 80-97 µs to 47-49 µs.
FENCE_SPIN_US = 100.0
FENCE_SPIN_MIN_CPUS = 8


# The one work-done callback of every device's submissions. userdata1 carries the
# submission index, userdata2 the device's key here; the callback lives as long as the
# process (wgpu-native may still hold it for a device Python has already collected).
_DEVICES: weakref.WeakValueDictionary[int, Device] = weakref.WeakValueDictionary()
_device_keys = itertools.count(1)
_work_done: Any = None
_work_done_lock = threading.Lock()


def _work_done_callback(ffi: Any) -> Any:
    """The work-done callback: marks the submission complete on its device, if that still lives.

    It fires on whichever thread's device poll sees the work finished (wgpu-native fires
    it spontaneously whatever the requested callback mode).
    """
    global _work_done
    with _work_done_lock:
        if _work_done is None:
            success = _raw_lib.WGPUQueueWorkDoneStatus_Success

            @ffi.callback("void(WGPUQueueWorkDoneStatus, WGPUStringView, void *, void *)")
            def on_work_done(status: int, message: Any, userdata1: Any, userdata2: Any) -> None:
                dev = _DEVICES.get(int(ffi.cast("uintptr_t", userdata2)))
                if dev is not None and status == success:
                    dev._advance(int(ffi.cast("uintptr_t", userdata1)))

            _work_done = on_work_done
        return _work_done


def _fence_spin_s() -> float:
    """``HETERO_FENCE_SPIN_US`` if set (0 turns the spin off), else the default for this host; in seconds."""
    default = FENCE_SPIN_US if (os.cpu_count() or 1) >= FENCE_SPIN_MIN_CPUS else 0.0
    raw = os.environ.get("HETERO_FENCE_SPIN_US", "")
    try:
        us = float(raw) if raw.strip() else default
    except ValueError:
        log.warning("hetero: ignoring HETERO_FENCE_SPIN_US=%r (not a number of microseconds)", raw)
        us = default
    return max(0.0, us) / 1e6


def _layout(pipeline: Any, group: int) -> Any:
    """The pipeline's bind group layout for ``group``, or None where the entry point uses none."""
    try:
        return pipeline.get_bind_group_layout(group)
    except Exception:
        return None

