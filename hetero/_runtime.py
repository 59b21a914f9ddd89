"""The runtime: worker pools, the GPU device, and the entry points that run graphs."""

from __future__ import annotations

import atexit
import collections
import logging
import os
import threading
from collections.abc import AsyncGenerator, Callable, Iterable, Iterator, Mapping, MutableSequence
from dataclasses import dataclass
from typing import Any

import anyio

from ._argtypes import check_positive_int
from ._batcher import Batcher
from ._bridge import running_loop
from ._gpu.capture import DEFAULT_CACHE_ENTRIES
from ._gpu.device import Device
from ._gpu.pool import MemoryStats
from ._graph import Graph
from ._placement import PLACEMENTS, PerfModel
from ._scheduler import Run, Scheduler
from ._stats import RunStats
from ._trace import Tracer
from ._files import write_error
from .errors import DeviceLostError, GraphError, HeteroError, RuntimeClosedError

__all__ = ["MapResults", "Runtime", "RuntimeOptions", "StartedRun", "run"]

log = logging.getLogger("hetero")


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class RuntimeOptions:
    """A runtime's settings, validated once (see :class:`Runtime` for their meaning)."""

    cpu_threads: int | None = None
    gpu_threads: int = 1
    submit_batch: int = 32
    memory_budget: int | None = None
    gpu_budget_ms: float = 100.0
    gpu_timing: bool = False
    zero_copy_outputs: bool = True
    cpu_processes: int | None = None
    capture: bool = True
    capture_cache: int = DEFAULT_CACHE_ENTRIES
    placement: str = "auto"
    blas_threads: int | None = None
    trace_dispatches: bool = True

    def __post_init__(self) -> None:
        if self.cpu_threads is not None:
            check_positive_int("cpu_threads", self.cpu_threads)
        if self.cpu_processes is not None:
            check_positive_int("cpu_processes", self.cpu_processes)
        check_positive_int("gpu_threads", self.gpu_threads)
        check_positive_int("submit_batch", self.submit_batch)
        check_positive_int("capture_cache", self.capture_cache)
        for name in ("capture", "trace_dispatches"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        budget = self.memory_budget
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget <= 0):
            raise ValueError(f"memory_budget must be a positive number of bytes, got {self.memory_budget!r}")
        b = self.blas_threads
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 0):
            raise ValueError(f"blas_threads must be an integer >= 0 or None, got {b!r}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {', '.join(map(repr, PLACEMENTS))}, got {self.placement!r}")
        if not _is_number(self.gpu_budget_ms) or not self.gpu_budget_ms > 0:
            raise ValueError(f"gpu_budget_ms must be a positive number of milliseconds, got {self.gpu_budget_ms!r}")


class Runtime:
    """Runs graphs. Use ``async with Runtime() as rt`` (or ``with``), then ``await rt.run(...)``.

    ``cpu_threads`` bounds the CPU stage pool (default: ``os.cpu_count()``);
    ``gpu_threads`` is the number of threads recording GPU stages; ``submit_batch`` is
    how many small GPU stages may share one queue submission (1 turns coalescing off);
    ``memory_budget`` caps the device memory (bytes) the buffer pool holds: past it,
    younger runs wait for memory while the oldest one proceeds (default: the smaller of
    8 GiB and 4 times the adapter's ``max-buffer-size``); ``gpu_budget_ms`` is the GPU
    time one submission may hold before work is split across submissions (see "Large
    grids and long kernels" in docs/gpu.md; drivers reset a device whose submission runs
    for seconds). ``trace`` is a path: one
    Chrome/Perfetto trace-event JSON file with CPU worker spans, GPU recording spans,
    GPU stage and dispatch spans (timestamps aligned to the wall clock), fence waits,
    transfers and buffer-pool counters, rewritten after each run and at close.
    ``gpu_timing`` writes GPU timestamps around every GPU stage, for ``stats()``'s
    ``gpu_ms`` (on whenever tracing; it costs a readback per submission).
    ``trace_dispatches``: a trace times every dispatch (True, the default) or only every
    GPU stage (False). The two timestamps of each dispatch cost the recording and fence
    threads time (on the H200 a batch-32 MiniLM pass took 172 ms traced per dispatch, 123 ms
    per stage, 122 ms untraced); a trace of a pipeline's stages rather than its kernels does
    without them.
    ``zero_copy_outputs``: a GPU-produced graph output of 16 MiB or more may arrive as
    an array on pooled mapped staging memory instead of a copy, when that reuses memory
    (an earlier such array was dropped; see "Transfers" in docs/memory.md); False always
    copies.
    ``adapter``: a wgpu adapter, or what ``HETERO_ADAPTER`` takes: part of an adapter's
    name, backend or type, optionally with ``#k`` for the k-th match (``"vulkan#1"``), or
    an index into all adapters (``hetero info`` prints each one's selector); default:
    ``$HETERO_ADAPTER``, else wgpu's high-performance adapter.
    ``cpu_processes`` is the size of the process pool that runs ``process=True`` stages
    (default: ``os.cpu_count() - 1``); the pool starts with the first such stage and
    stops at close.
    ``capture``: replay GPU stages declared with ``g.gpu(..., capture=True)`` (see
    "Captured stages" in docs/gpu.md); False calls every stage function every run.
    ``capture_cache`` bounds the captures kept per device (least recently used go first).
    ``placement`` places the stages declared with both a CPU and a GPU implementation
    (``Graph.stage``): ``"auto"`` runs each execution where a calibrated performance
    model expects it to complete first (see ``hetero.PerfModel``; ``perf_model`` passes
    one, seeded or shared), ``"cpu"``/``"gpu"`` force one side. ``stats()`` and the trace
    say where each ran and why. ``blas_threads``: threads of each numpy BLAS call in CPU
    stages, set process-wide when the CPU workers start (default ``os.cpu_count() //
    cpu_threads``: concurrent stages do not oversubscribe the cores; 0 leaves BLAS alone).
    The GPU device is created on first use, so graphs without GPU stages never need an
    adapter.
    """

    def __init__(self, *, cpu_threads: int | None = None, gpu_threads: int = 1, submit_batch: int = 32,
                 memory_budget: int | None = None, gpu_budget_ms: float = 100.0,
                 trace: str | os.PathLike[str] | None = None, gpu_timing: bool = False,
                 adapter: Any = None, zero_copy_outputs: bool = True, cpu_processes: int | None = None,
                 capture: bool = True, capture_cache: int = DEFAULT_CACHE_ENTRIES, placement: str = "auto",
                 perf_model: PerfModel | None = None, blas_threads: int | None = None,
                 trace_dispatches: bool = True) -> None:
        self.options = RuntimeOptions(cpu_threads, gpu_threads, submit_batch, memory_budget,
                                      float(gpu_budget_ms) if _is_number(gpu_budget_ms) else gpu_budget_ms,
                                      bool(gpu_timing), bool(zero_copy_outputs), cpu_processes, capture,
                                      capture_cache, placement, blas_threads, trace_dispatches)
        if perf_model is not None and not isinstance(perf_model, PerfModel):
            raise TypeError(f"perf_model must be a hetero.PerfModel, got {type(perf_model).__name__}")
        self._adapter = adapter
        self._device: Device | None = None
        self._device_lock = threading.Lock()
        self._tracer = Tracer(trace) if trace is not None else None
        o = self.options
        self._sched = Scheduler(o.cpu_threads, o.gpu_threads, self.device, lambda: self._device, o.submit_batch,
                                tracer=self._tracer, zero_copy_outputs=o.zero_copy_outputs,
                                cpu_processes=o.cpu_processes, capture=o.capture, placement=o.placement,
                                perf_model=perf_model, blas_threads=o.blas_threads)
        self._closed = False  # no new runs or device
        self._close_done = False  # workers joined, device and trace closed
        self._last_run: Run | None = None

    # -- lifecycle ------------------------------------------------------------------
    async def __aenter__(self) -> Runtime:
        return self

    async def __aexit__(self, exc_type: object, *exc: object) -> None:
        await anyio.to_thread.run_sync(self._close_after, exc_type is not None)

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self._close_after(exc_type is not None)

    def _close_after(self, failing: bool) -> None:
        """Close; while an exception leaves the block, a trace that cannot be written is only logged."""
        if not failing:
            self.close()
            return
        try:
            self.close()
        except HeteroError as e:  # the trace file: the exception leaving the block is the one to see
            log.warning("%s", e)

    def close(self) -> None:
        """Stop the workers and release the device. Blocks until workers finish their current stage.

        Order matters: no new run starts, the worker threads are stopped and joined, a
        device still being created is waited for, and only then is the device closed
        (which refuses any later submission before it destroys memory). Each step is
        idempotent, so a close that was interrupted (Ctrl-C) can be completed by calling
        it again. Worker processes running a stage are killed; shared memory of process
        stages is unlinked. Last, the trace file is written: when it cannot be (a full
        disk), the close completes and then raises :class:`~hetero.HeteroError` with the
        OS's reason (leaving a ``with`` block on an exception, it is logged instead).
        """
        if self._close_done:
            return
        self._closed = True
        self._sched.close()
        with self._device_lock:  # a device being created on a worker thread is closed too
            dev = self._device
        if dev is not None:
            dev.close()
        tracer = self._tracer
        written = tracer.close() if tracer is not None else True
        self._close_done = True
        if tracer is not None and not written and tracer.write_error is not None:
            raise write_error("trace file", tracer.path, tracer.write_error)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeClosedError("this Runtime is closed; create a new one")

    @property
    def perf_model(self) -> PerfModel:
        """The performance model placing two-implementation stages (measured times per stage and size)."""
        return self._sched.placer.model

    @property
    def cpu_threads(self) -> int:
        return self._sched.cpu.size

    @property
    def abandoned_threads(self) -> int:
        """CPU worker threads given up on when their stage timed out (or its run stopped while the
        stage, which has a ``timeout``, still ran), and still running its function.

        A thread cannot be killed: such a CPU stage's thread is replaced by a new worker
        (the pool keeps ``cpu_threads`` live ones) and ends when its function returns. While
        4 x ``cpu_threads`` of them are still running, a CPU stage with a ``timeout`` fails
        at once; code that may hang belongs in a process stage (``process=True``).
        """
        return self._sched.cpu.abandoned

    @property
    def cpu_processes(self) -> int:
        """Size of the process pool for ``process=True`` stages (started on first use)."""
        return self._sched.cpu_processes

    def device(self) -> Device:
        """The runtime's GPU device, created on first call (blocking: not for the event loop)."""
        if self._device is None:
            with self._device_lock:
                if self._device is None:
                    self._check_open()
                    o = self.options
                    dev = Device(self._adapter, max_batch=o.submit_batch, memory_budget=o.memory_budget,
                                 gpu_budget_ms=o.gpu_budget_ms, tracer=self._tracer, gpu_timing=o.gpu_timing,
                                 trace_dispatches=o.trace_dispatches)
                    dev.captures.max_entries = o.capture_cache
                    dev.on_lost(lambda reason: self._sched.fail_gpu_runs(DeviceLostError(
                        f"the GPU device was lost ({reason}) while this run was in flight; create a new Runtime")))
                    self._device = dev
        return self._device

    # -- memory -----------------------------------------------------------------------
    def memory_stats(self) -> MemoryStats:
        """Device memory of the buffer pool: in use, peak, pooled, allocations, reuses, waits."""
        dev = self._device
        if dev is None:
            return MemoryStats.empty(self.options.memory_budget)
        return dev.pool.stats()

    def trim(self) -> int:
        """Destroy pooled device buffers (and staging buffers) not in use, and the process pool's
        free shared memory; returns bytes freed."""
        procs = self._sched._procs
        freed = procs.trim() if procs is not None else 0
        dev = self._device
        if dev is None:
            return freed
        return freed + dev.pool.trim() + dev.ring.trim()

    async def warmup(self, graph: Graph) -> int:
        """Create the device and compile every kernel ``graph``'s GPU stages declare, off the loop.

        A GPU stage declares its kernels with ``g.gpu(fn, ..., kernels=[wgsl, (wgsl, entry_point), ...])``
        or a ``kernels`` attribute on ``fn``. Returns how many pipelines were compiled or found cached.
        A graph with process stages also gets its process pool started.
        """
        self._check_open()
        plan = graph.plan()
        specs = [k for st in plan.stages for k in st.kernels]

        def compile_all() -> int:
            if plan.has_process:
                self._sched.procs().start()
            dev = self.device()
            for wgsl, entry in specs:
                dev.kernel(wgsl, entry)
            return len(specs)

        return await anyio.to_thread.run_sync(compile_all)

    # -- running --------------------------------------------------------------------
    def _start(self, graph: Graph, inputs: Mapping[str, Any]) -> Run:
        self._check_open()
        if not isinstance(graph, Graph):
            raise GraphError(f"run() expects a hetero.Graph, got {type(graph).__name__}")
        plan = graph.plan()
        plan.check_inputs(inputs)
        if plan.has_gpu and self._device is not None:
            self._device.check_alive()  # fail fast: nothing can run on a lost device
        run = self._sched.new_run(plan, dict(inputs))
        run.start()
        self._last_run = run
        return run

    async def run(self, graph: Graph, /, **inputs: Any) -> Any:
        """Run ``graph`` once with the given inputs; return its output (a tuple for several)."""
        return await self.start(graph, **inputs).result()

    def start(self, graph: Graph, /, **inputs: Any) -> StartedRun:
        """Start a run of ``graph`` now and return at once; ``await started.result()`` for its output.

        Call it on an event loop's thread (the run belongs to that loop). Its stages are
        routed before ``start`` returns, so runs started one after another from one thread
        are recorded in that order: with one GPU recording thread (``gpu_threads=1``, the
        default) the GPU runs their work in that order too, and a later run may read what an
        earlier one wrote to a resident tensor. Await or :meth:`~StartedRun.cancel` every
        started run: until then it holds its outputs. Bad inputs raise here, as ``run``'s do.
        """
        return StartedRun(self, self._start(graph, inputs))

    async def _after_run(self) -> None:
        if self._tracer is not None:
            tracer = self._tracer
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(tracer.maybe_write)

    def batcher(self, graph: Graph, /, *, max_batch_size: int = 64, max_wait: float = 0.0,
                cost: Callable[[Mapping[str, Any]], int] | None = None, max_cost: int | None = None,
                max_queued: int = 4096, max_in_flight: int = 2,
                split: Callable[[list[int]], list[list[int]]] | None = None,
                on_batch: Callable[[int, int], None] | None = None,
                on_batch_done: Callable[[int, float, float], None] | None = None) -> Batcher:
        """An async callable gathering concurrent ``await b(**inputs)`` calls into batched runs of ``graph``.

        Each graph input receives the list of the batch's items' values (arrival order); each
        output must have one entry per item along its first axis, and each caller gets its
        own. A batch forms when fewer than ``max_in_flight`` of its batches run (no timer;
        ``max_wait`` seconds > 0 waits for more items), FIFO, up to ``max_batch_size`` items
        and ``max_cost`` (item count times the largest ``cost(inputs)``: padded cost). A full
        queue (``max_queued``) raises :class:`~hetero.OverloadedError` at once. ``split``
        runs a batch as several concurrent runs; ``on_batch(items, cost)`` observes each
        batch formed, ``on_batch_done(items, waited, ran)`` each batch ended (its items' mean
        queue wait and its run, in seconds). See :class:`~hetero.Batcher` for the rules (cancellation, errors, loops).
        """
        self._check_open()
        return Batcher(self, graph, max_batch_size=max_batch_size, max_wait=max_wait, cost=cost, max_cost=max_cost,
                       max_queued=max_queued, max_in_flight=max_in_flight, split=split, on_batch=on_batch,
                       on_batch_done=on_batch_done)

    def stats(self) -> RunStats:
        """Per-stage timings of the last run started (wall instants; GPU time where measured)."""
        if self._last_run is None:
            raise HeteroError("no run yet: stats() describes the last run of this Runtime")
        return self._last_run.stats()

    def map(self, graph: Graph, inputs: Iterable[Mapping[str, Any]], *,
            max_in_flight: int = 4, ordered: bool = True) -> MapResults:
        """Run ``graph`` over many inputs, at most ``max_in_flight`` at once; yield the results.

        ``ordered=True`` yields in input order; ``ordered=False`` yields each result as
        its run completes. A result counts as in flight until it is yielded, so a slow
        consumer holds the producer back (backpressure). The first failure is raised (in
        input order when ordered, else as soon as it happens) and stops the runs still in
        flight. Use it as ``async for r in rt.map(...)``, and to stop the runs in flight
        at once when leaving the loop early, as ``async with rt.map(...) as results:``
        (or ``contextlib.aclosing``), as trio advises for async generators.
        """
        check_positive_int("max_in_flight", max_in_flight)
        gen = self._map_ordered(graph, inputs, max_in_flight) if ordered else \
            self._map_unordered(graph, inputs, max_in_flight)
        return MapResults(gen)

    def _start_item(self, graph: Graph, item: object) -> Run:
        if not isinstance(item, Mapping):
            raise HeteroError(f"map() inputs must be dicts of graph inputs, got {type(item).__name__}")
        return self._start(graph, item)

    def _feed(self, graph: Graph, source: Iterator[Any], pending: MutableSequence[Any], max_in_flight: int, *,
              errors_in_order: bool, on_wake: Callable[[], None] | None = None) -> bool:
        """Start runs of ``source``'s next items until ``pending`` holds ``max_in_flight``.

        Returns True once ``source`` is exhausted (it is not read again). An item that
        cannot start (a HeteroError) takes its place in ``pending`` with
        ``errors_in_order``, else is raised at once. ``on_wake`` becomes each run's.
        """
        while len(pending) < max_in_flight:
            try:
                item = next(source)
            except StopIteration:
                return True
            try:
                run = self._start_item(graph, item)
            except HeteroError as e:
                if not errors_in_order:
                    raise
                pending.append(e)
                continue
            if on_wake is not None:
                run.on_wake = on_wake
            pending.append(run)
        return False

    async def _map_ordered(self, graph: Graph, inputs: Iterable[Mapping[str, Any]],
                           max_in_flight: int) -> AsyncGenerator[Any, None]:
        pending: collections.deque[Run | BaseException] = collections.deque()
        source = iter(inputs)
        exhausted = False
        try:
            while True:
                if not exhausted:
                    exhausted = self._feed(graph, source, pending, max_in_flight, errors_in_order=True)
                if not pending:
                    return
                head = pending.popleft()
                if isinstance(head, BaseException):
                    raise head
                yield await head.wait()
        finally:
            # The runs behind a failure or a cancellation stop, and give their memory back
            # before map() raises (shielded; the loop keeps running meanwhile).
            runs = [r for r in pending if isinstance(r, Run)]
            for r in runs:
                r.stop()
            for r in runs:
                await r.settled()
                r.forget_values()

    async def _map_unordered(self, graph: Graph, inputs: Iterable[Mapping[str, Any]],
                             max_in_flight: int) -> AsyncGenerator[Any, None]:
        pending: list[Run] = []
        source = iter(inputs)
        exhausted = False
        wake = anyio.Event()

        def woken() -> None:  # on the loop: some run of ours stopped or has a deadline to check
            wake.set()

        try:
            while True:
                if not exhausted:
                    exhausted = self._feed(graph, source, pending, max_in_flight, errors_in_order=False,
                                           on_wake=woken)
                if not pending:
                    return
                # A fresh event before looking: a run that stops after the look wakes it.
                wake = anyio.Event()
                done = next((r for r in pending if r.stopped), None)
                if done is None:
                    delay = min(r.check_timeouts() for r in pending)  # fails overdue runs
                    done = next((r for r in pending if r.stopped), None)
                    if done is None:
                        with anyio.move_on_after(delay):
                            await wake.wait()
                        continue
                pending.remove(done)
                yield await done.wait()
        finally:
            for r in pending:  # as in the ordered map: stopped, and their memory back
                r.stop()
            for r in pending:
                await r.settled()
                r.forget_values()


class StartedRun:
    """A run begun by :meth:`Runtime.start`: ``await result()`` once for its output or error."""

    def __init__(self, runtime: Runtime, run: Run) -> None:
        self._runtime = runtime
        self._run = run
        self._taken = False

    @property
    def done(self) -> bool:
        """True once the run has completed, failed or been cancelled."""
        return bool(self._run.stopped)

    async def result(self) -> Any:
        """Wait for the run to end; its output (a tuple for several), or raise its error.

        Cancelling the wait stops the run. A second call raises :class:`~hetero.HeteroError`:
        the run's values are let go once they are returned.
        """
        if self._taken:
            raise HeteroError(f"run {self._run.seq} of {self._run.plan.name!r}: its result was already taken; "
                              "result() returns once")
        self._taken = True
        try:
            return await self._run.wait()
        finally:
            await self._runtime._after_run()

    async def cancel(self) -> None:
        """Stop the run (if it has not ended) and wait until its memory is back; its result is dropped."""
        if self._taken:
            return
        self._taken = True
        self._run.stop()
        await self._run.settled()
        self._run.forget_values()

    def __repr__(self) -> str:
        state = "done" if self.done else "running"
        return f"<StartedRun {self._run.seq} of {self._run.plan.name!r}: {state}>"


class MapResults:
    """The results of :meth:`Runtime.map`: an async iterator and an async context manager.

    ``aclose()`` (or leaving ``async with``) stops the runs still in flight.
    """

    def __init__(self, gen: AsyncGenerator[Any, None]) -> None:
        self._gen = gen

    def __aiter__(self) -> MapResults:
        return self

    async def __anext__(self) -> Any:
        return await self._gen.__anext__()

    async def aclose(self) -> None:
        """Stop the runs still in flight; later iteration ends at once."""
        await self._gen.aclose()

    async def __aenter__(self) -> MapResults:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


_default: Runtime | None = None
_default_lock = threading.Lock()


def _default_runtime() -> Runtime:
    global _default
    with _default_lock:
        if _default is None or _default._closed:
            _default = Runtime()
            atexit.register(_default._close_after, True)  # at exit nothing can catch: log
        return _default


def run(graph: Graph, /, **inputs: Any) -> Any:
    """Run ``graph`` once from synchronous code, on a shared default runtime."""
    lib = running_loop()
    if lib is not None:
        raise HeteroError(
            f"hetero.run() cannot be called inside a running {lib} event loop; "
            "use 'async with hetero.Runtime() as rt: await rt.run(graph, ...)'"
        )
    rt = _default_runtime()
    return anyio.run(lambda: rt.run(graph, **inputs))
