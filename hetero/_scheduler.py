"""The scheduler: executes a graph's Plan over worker threads, driven from an event loop.

Policy
------
* A stage runs as soon as every stage it depends on has completed: a CPU stage
  when its inputs are on the host, a GPU stage as soon as the GPU work producing
  its inputs was *submitted* (the queue runs submissions in order, so a GPU
  consumer never waits for a fence).
* Ready stages wait in a priority queue per kind of worker. The key is
  ``(run sequence, -critical-path length, arrival)``: older runs first (so
  ``map`` finishes inputs in order and overlaps the next ones), then the stage
  with the longest path still ahead of it.
* Workers walk the graph themselves. A CPU worker that completes a stage releases
  its consumers; it keeps the most urgent newly ready CPU stage and runs it next
  on the same thread (no hand-off at all for chains), and queues the rest. The
  event loop is only woken when a run ends or a stage with a ``timeout`` starts:
  trivially short stages never pay for a hop through the loop.
* GPU stages are recorded on GPU worker threads (into one shared command encoder
  with one thread, else an encoder per stage), submitted with a submission index,
  and completed by the device's fence thread, which downloads values a CPU stage
  or the caller needs. A large stage (or, while a single run is active, a stage
  that brings the shared encoder to ``EARLY_SUBMIT_DISPATCHES`` dispatches) is
  submitted at once only while the GPU is idle; while it is busy the shared encoder
  keeps growing (a command buffer costs ~0.3 ms of host time on the H200).
* A CPU value that several GPU stages read is uploaded by the first of them and
  held (like a GPU value, one hold per reader) for the others, when one thread
  records (so the upload is queued before every reader).
* The first failure (after the stage's retries) stops the run: no further stage
  of it starts, the waiter wakes and raises :class:`~hetero.StageError`. A stage
  already running when its run stops finishes, and its result is dropped
  (Python threads cannot be interrupted).
* A process stage (``g.cpu(..., process=True)``) is handed to the runtime's process
  pool (:mod:`hetero._process`) by a CPU worker, which then moves on: no thread waits
  for it. The pool's dispatcher thread completes it (releases its consumers, queues
  them on the pools). When its run stops, a process stage still queued is dropped and
  one still running has its worker killed (and replaced).
* A stage's ``timeout`` covers all its attempts. The waiter on the event loop
  watches started timed stages; a worker also checks on completion, so a run
  never completes past a stage's timeout.
* A thread cannot be killed. When a CPU thread stage times out, the pool gives up
  on the worker running it (*abandons* it) and starts a replacement, so
  ``cpu_threads`` workers keep serving the queue; the abandoned thread ends once its
  function returns. While ``ABANDONED_PER_THREAD`` x ``cpu_threads`` abandoned threads
  are still running, a timed CPU thread stage fails at once instead of starting: each
  such stage could hang and cost another thread. Process stages are the remedy for
  code that may hang: their worker is killed.

State
-----
Per run (:class:`Run`): host values, device values, remaining-dependency counts,
the number of unfinished stages, start times of timed stages (and, for CPU thread
stages, the worker running each: whoever takes it from the run, the finishing worker
or the timeout, decides whether that worker is abandoned), held device blocks (GPU
values and shared uploads), and the first error. Counts are changed under the
run's lock; the plan is shared, read-only. Once the run's caller has its outputs (or
its error, or was cancelled) the run forgets its values: stages of it that complete
later store nothing, and the Run kept for ``Runtime.stats()`` holds only timings.
Per CPU pool: its live workers, and the count of abandoned ones still running.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

import anyio
import numpy as np

from ._bridge import loop_caller
from ._gpu.capture import run_captured
from ._gpu.context import GPUContext, _Park
from ._gpu.tensor import map_values
from ._gpu.recorder import SharedRecorder, StageRecorder
from ._placement import PerfModel, Placement, Placer, input_bytes
from ._plan import ARG_CONST, ARG_INPUT, ARG_NODE, Plan, StagePlan
from ._process import Job, ProcessPool
from ._stats import RunStats, Timeline
from ._gpu.tensor import Tensor
from .errors import DeviceLostError, StageError

if TYPE_CHECKING:
    from ._gpu.device import Device
    from ._trace import Tracer

__all__ = ["Run", "Scheduler", "WorkerPool"]

log = logging.getLogger("hetero")
# A stage dispatching more workgroups than this is submitted on its own rather than
# coalesced with its neighbours: its GPU time dwarfs the cost of a submission.
LARGE_STAGE_WORKGROUPS = 1 << 14
_KEEP: Any = object()  # Run.set_value: leave the device-side value as it is

# The only active run's stage whose commit finds the GPU idle is submitted at once, with
# the stages before it in the shared encoder, when that encoder holds at least this many
# dispatches: the GPU runs them while the run's next stages are recorded, instead of idling
# until its fence. With several runs in flight the recording thread is the bottleneck and
# every submission costs it ~0.3 ms on the H200, so their stages are not submitted early.
EARLY_SUBMIT_DISPATCHES = 8
# Stages (and shapes) whose upload buffers are remembered (see _device_args); past it the memory starts afresh.
_UPLOAD_HINTS = 256
# How long a stopped (failed or cancelled) run waits for its GPU stages being recorded
# before returning anyway (a stage function that never returns must not hang the caller).
_CLEANUP_WAIT = 5.0


# While this many abandoned threads per CPU worker are still running, timed CPU thread
# stages fail at once (see the module docstring): hung threads must not pile up unbounded.
ABANDONED_PER_THREAD = 4


class _Worker:
    """One worker thread of a pool; ``abandoned`` once the pool gave up on it."""

    __slots__ = ("abandoned", "thread")

    def __init__(self) -> None:
        self.abandoned = False
        self.thread: threading.Thread | None = None


class WorkerPool:
    """A fixed number of live daemon threads serving a priority queue of jobs.

    A worker stuck in a job can be abandoned (:meth:`abandon`): a new thread takes its
    place at once, and the stuck one ends when its job returns.
    """

    def __init__(self, name: str, threads: int, on_idle: Callable[[], None] | None = None,
                 on_start: Callable[[], None] | None = None) -> None:
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"{name} needs at least 1 thread, got {threads!r}")
        self.name = name
        self.size = threads
        self._on_idle = on_idle  # called when the last busy worker finds the queue empty
        self._on_start = on_start  # called once, before the threads start
        self._busy = 0
        self._heap: list[tuple[Any, int, Callable[[], None]]] = []
        # Held directly (``with self._lock``) where nothing waits: the same as holding the
        # condition, without its Python-level __enter__ and __exit__.
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._arrival = itertools.count()
        self._closed = False
        self._threads: list[threading.Thread] = []  # the live workers (abandoned ones leave it)
        self._numbers = itertools.count()
        self._local = threading.local()  # .worker: the _Worker of a pool thread
        self._abandoned = 0  # abandoned workers whose job has not returned yet

    def _start(self) -> None:
        if self._on_start is not None:
            self._on_start()
        for _ in range(self.size):
            self._spawn()

    def _spawn(self) -> None:
        """Start one worker (the lock held, or before any worker runs)."""
        w = _Worker()
        t = w.thread = threading.Thread(target=self._work, args=(w,), name=f"{self.name}-{next(self._numbers)}",
                                        daemon=True)
        self._threads.append(t)
        t.start()

    @property
    def abandoned(self) -> int:
        """Abandoned workers still running their job."""
        return self._abandoned

    def current(self) -> _Worker | None:
        """The worker of this pool running the calling thread, or None."""
        return getattr(self._local, "worker", None)

    def abandon(self, worker: _Worker) -> int:
        """Give up on ``worker`` (stuck in its job): a new worker replaces it; returns the abandoned count."""
        with self._lock:
            if not worker.abandoned:
                worker.abandoned = True
                self._abandoned += 1
                self._busy -= 1
                if worker.thread in self._threads:
                    self._threads.remove(worker.thread)
                if not self._closed:
                    self._spawn()
            return self._abandoned

    def submit(self, key: Any, job: Callable[[], None]) -> None:
        with self._lock:
            if not self._threads:
                self._start()
            heapq.heappush(self._heap, (key, next(self._arrival), job))
            self._cv.notify()

    def submit_many(self, items: list[tuple[Any, Callable[[], None]]]) -> None:
        with self._lock:
            if not self._threads:
                self._start()
            for key, job in items:
                heapq.heappush(self._heap, (key, next(self._arrival), job))
            self._cv.notify(len(items))

    def _work(self, worker: _Worker) -> None:
        self._local.worker = worker
        heap, lock, cv, on_idle = self._heap, self._lock, self._cv, self._on_idle
        heappop = heapq.heappop
        while True:
            with lock:
                while not heap:
                    if self._closed:
                        return
                    cv.wait()
                job = heappop(heap)[2]
                self._busy += 1
            try:
                job()  # jobs catch their own errors
            except BaseException:  # pragma: no cover - a defect: keep the thread serving the queue
                log.exception("%s: a job failed", self.name)
            with lock:
                if worker.abandoned:  # a replacement serves the queue: this thread ends
                    self._abandoned -= 1
                    return
                self._busy -= 1
                idle = not self._busy and not heap
            if idle and on_idle is not None:
                try:
                    on_idle()
                except BaseException:  # pragma: no cover - the hook must not kill the worker
                    log.exception("%s: idle hook failed", self.name)

    def close(self) -> None:
        """Stop the workers and join the live ones (abandoned threads are not waited for)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            threads = list(self._threads)
        for t in threads:
            t.join(timeout=5)


class Run:
    """One execution of a plan: its state, and the code workers run for its stages."""

    def __init__(self, sched: Scheduler, plan: Plan, inputs: dict[str, Any], seq: int) -> None:
        self.sched = sched
        self.plan = plan
        self.inputs = inputs
        self.seq = seq
        n = len(plan.stages)
        # The stages as this run executes them: a mixed stage becomes one of its variants
        # when placed (Scheduler.dispatch).
        self.stages: list[StagePlan] = list(plan.stages)
        self.placements: list[Placement | None] = [None] * n
        self.open_placements: dict[int, Placement] = {}  # placed and not finished: their queue-wait charge
        self.values: list[Any] = [None] * n  # host-side values (what CPU stages and the caller see)
        self.dev_values: list[Any] = [None] * n  # what GPU stages see (Tensors stay Tensors)
        self.remaining = list(plan.n_deps)
        self.unfinished = n
        self.lock = threading.Lock()
        self.error: BaseException | None = None
        self.stopped = False  # failed, cancelled or done: start nothing more
        self.done = False
        self.timed_started: dict[int, float] = {}  # timed stages now running -> start time
        # Timed CPU thread stages now running -> their worker; taken (under the lock) either by
        # the worker when the function returns or by the timeout, which then abandons it.
        self.timed_workers: dict[int, _Worker] = {}
        # Device memory: a GPU value's blocks are held while holds[i] > 0 (see Plan.holds).
        self.holds = list(plan.holds)
        # CPU values uploaded once for all their GPU readers (plan.shared_uploads): the
        # device-side structure, held (holds[i], one per reader) like a GPU value.
        self.uploaded: dict[int, Any] = {}
        self.held: dict[int, list[Any]] = {}
        self.proc_jobs: dict[int, Job] = {}  # process stages handed to the process pool, not done
        self.recording = 0  # GPU stages of this run being recorded right now
        self.tl = Timeline(n)
        self.cleaned = False
        self.forgotten = False  # the caller has what it needs: values are no longer stored
        self._event: anyio.Event | None = None
        self._call: Callable[[Callable[[], Any]], None] | None = None
        self.on_wake: Callable[[], None] | None = None  # also called on the loop whenever the run wakes its waiter

    # -- loop side ------------------------------------------------------------------
    def start(self) -> None:
        """Bind to the current event loop and queue the root stages."""
        self._call = loop_caller()
        self._event = anyio.Event()
        self.sched.run_started(self)
        tracer = self.sched.tracer
        if tracer is not None:
            tracer.name_thread("event loop")
            tracer.instant(f"run {self.seq} of {self.plan.name!r} starts", "run")
        if not self.plan.stages:
            self._finish()
            return
        self.sched.dispatch(self, list(self.plan.roots))

    async def wait(self) -> Any:
        """Wait for the run to end; return its outputs or raise its error.

        Whether it completed, failed or was cancelled, the run returns (or raises) only
        once no stage of it is being recorded and every block it held is back in the pool.
        """
        try:
            while True:
                event = self._event = anyio.Event()
                if self.stopped:
                    break
                delay = self._check_timeouts()
                if self.stopped:
                    break
                with anyio.move_on_after(delay):
                    await event.wait()
        finally:
            if not self.stopped:  # cancelled by the caller
                self.stop()
            await self.settled()
            outputs = self.outputs() if self.error is None else None
            self.forget_values()
        if self.error is not None:
            raise self.error
        return outputs

    def check_timeouts(self) -> float:
        """Fail the run if a running timed stage is overdue; return seconds until the next deadline."""
        return self._check_timeouts()

    async def settled(self) -> None:
        """Wait, shielded from cancellation and without blocking the loop, until the stopped
        run's blocks are back in the pool (at most ``_CLEANUP_WAIT`` seconds).

        Stages being recorded when the run stopped finish recording first (recording is
        short; a stage's GPU work is not awaited). Even a run that succeeded can wait here:
        its last stage's GPU work may complete on the fence thread while the recording
        thread is still letting go of that stage's inputs.
        """
        if self.cleaned:
            return
        stray: BaseException | None = None
        with anyio.CancelScope(shield=True), anyio.move_on_after(_CLEANUP_WAIT) as timeout:
            while not self.cleaned:
                event = self._event = anyio.Event()
                if self.cleaned:
                    break
                try:
                    await event.wait()
                except anyio.get_cancelled_exc_class() as e:
                    if timeout.cancel_called:
                        raise
                    # Under asyncio a cancellation requested just before the shield took effect
                    # still arrives inside it: wait on, and raise it once the blocks are back.
                    stray = e
        if stray is not None:
            raise stray
        if not self.cleaned:
            log.warning("run %d of %r: a GPU stage is still being recorded %g s after the run stopped; "
                        "returning with its device memory in use", self.seq, self.plan.name, _CLEANUP_WAIT)

    def forget_values(self) -> None:
        """The run is over for its caller: drop every value it computed.

        The Run outlives its return (``Runtime.stats()`` describes the last one), and its
        values would keep large intermediates, and downloads on staging memory, alive.
        A stage of a stopped run that completes later stores nothing.
        """
        n = len(self.plan.stages)
        with self.lock:
            self.forgotten = True  # first: stage_args reads the lists without the lock
            self.values, self.dev_values, self.uploaded = [None] * n, [None] * n, {}

    def set_value(self, i: int, *, host: Any = _KEEP, dev: Any = _KEEP) -> None:
        """Store stage ``i``'s value: on the host side (what CPU stages and the caller see)
        and what GPU stages see, unless the run's caller is gone."""
        with self.lock:
            if not self.forgotten:
                if host is not _KEEP:
                    self.values[i] = host
                if dev is not _KEEP:
                    self.dev_values[i] = dev

    def stage_args(self, st: StagePlan) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """A CPU stage's arguments; None once the run's caller is gone.

        Reads without the lock: the list is read before ``forgotten``, which
        ``forget_values`` sets before it swaps the lists, so a list read while the
        flag is still clear is the run's own.
        """
        values = self.values
        if self.forgotten:
            return None
        return self.args_for(st, values)

    def _check_timeouts(self) -> float:
        """Fail the run if a running timed stage is overdue; return seconds until the next deadline."""
        now = time.monotonic()
        nearest = math.inf
        for i, t0 in list(self.timed_started.items()):
            st = self.plan.stages[i]
            assert st.timeout is not None
            left = t0 + st.timeout - now
            if left <= 0:
                with self.lock:
                    worker = self.timed_workers.pop(i, None)
                if worker is not None:  # still in its function: its thread is lost to the pool
                    self.sched.abandon_worker(st, worker)
                self.fail_timeout(st)
                return 0.0
            nearest = min(nearest, left)
        return nearest

    def _wake(self) -> None:
        call = self._call
        if call is not None:
            call(self._set_event)

    def _set_event(self) -> None:
        if self._event is not None:
            self._event.set()
        if self.on_wake is not None:
            self.on_wake()

    def stop(self) -> None:
        with self.lock:
            self.stopped = True
            clean = self.recording == 0
        self._cancel_processes()
        if clean:
            self.cleanup()

    def _cancel_processes(self) -> None:
        """The run stopped: its queued process stages never run, running ones lose their worker."""
        with self.lock:
            if not self.proc_jobs:
                return
            jobs, self.proc_jobs = list(self.proc_jobs.values()), {}
        pool = self.sched.procs()
        for job in jobs:
            pool.cancel(job)

    # -- device memory ----------------------------------------------------------------
    def hold(self, i: int, blocks: list[Any]) -> bool:
        """Keep ``blocks`` for value ``i``; False (nothing kept) if the run stopped."""
        pool = None
        with self.lock:
            if self.stopped:
                return False
            if blocks:
                pool = blocks[0].pool
                self.held[i] = blocks
        if pool is not None:
            for b in blocks:
                pool.retain(b)
        return True

    def drop_hold(self, i: int) -> None:
        with self.lock:
            self.holds[i] -= 1
            blocks = self.held.pop(i, None) if self.holds[i] <= 0 else None
        if blocks:
            blocks[0].pool.release_many(blocks)  # one pool: see hold()

    def recording_done(self) -> None:
        with self.lock:
            self.recording -= 1
            clean = self.stopped and self.recording == 0
        if clean:
            self.cleanup()

    def cleanup(self) -> None:
        """The run stopped and nothing of it is being recorded: return every block it holds."""
        with self.lock:
            if self.cleaned:
                return
            self.cleaned = True
            held, self.held = self.held, {}
        blocks = [b for value in held.values() for b in value]
        if blocks:
            blocks[0].pool.release_many(blocks)  # a run's blocks are its device's
        for i in list(self.open_placements):
            self.sched.placement_done(self, i, None)
        self.sched.run_ended(self)
        self._wake()

    def stats(self) -> RunStats:
        stages = self.stages
        return self.tl.snapshot(self.plan.name, [st.name for st in stages], [_kind(st) for st in stages],
                                ok=self.done and self.error is None, placements=self.placements)

    def outputs(self) -> Any:
        outs = []
        for kind, ref in self.plan.outputs:
            outs.append(self.inputs[ref] if kind == ARG_INPUT else self.values[ref])
        return outs[0] if self.plan.single_output else tuple(outs)

    # -- worker side ----------------------------------------------------------------
    def fail(self, st: StagePlan, exc: BaseException, attempts: int = 1) -> None:
        tries = f" after {attempts} attempts" if attempts > 1 else ""
        err = StageError(f"{_kind(st)} stage {st.name!r} failed{tries}: {type(exc).__name__}: {exc}", st.name)
        err.__cause__ = exc
        self._set_error(err)

    def fail_timeout(self, st: StagePlan) -> None:
        exc = TimeoutError(f"stage {st.name!r} ran longer than its timeout of {st.timeout:g} s")
        err = StageError(f"{_kind(st)} stage {st.name!r} timed out after {st.timeout:g} s", st.name)
        err.__cause__ = exc
        self._set_error(err)

    def fail_abandoned_cap(self, st: StagePlan, abandoned: int, cap: int) -> None:
        self._set_error(StageError(
            f"cpu stage {st.name!r} with a timeout cannot start: {abandoned} threads abandoned by timed-out "
            f"stages are still running, the cap is {cap} ({ABANDONED_PER_THREAD} x cpu_threads); a thread "
            "cannot be killed: run code that may hang as a process stage (g.cpu(fn, ..., process=True)), "
            "whose worker is killed on timeout", st.name))

    def keep_worker(self, i: int) -> bool:
        """Timed CPU thread stage ``i``'s function returned: False when its worker was abandoned meanwhile."""
        with self.lock:
            return self.timed_workers.pop(i, None) is not None

    def _set_error(self, err: BaseException) -> None:
        with self.lock:
            if self.stopped:
                return
            self.stopped = True
            self.error = err
            clean = self.recording == 0
        self._cancel_processes()
        if clean:
            self.cleanup()  # wakes the waiter
        else:
            self._wake()

    def _finish(self) -> None:
        with self.lock:
            if self.stopped:
                return
            self.stopped = True
            self.done = True
            clean = self.recording == 0
        self.tl.end = time.perf_counter_ns()
        if clean:
            self.cleanup()  # wakes the waiter
        else:
            self._wake()

    def args_for(self, st: StagePlan, values: list[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        inputs = self.inputs
        filled = [*st.arg_consts]
        for p, ref in st.arg_nodes:
            filled[p] = values[ref]
        for p, name in st.arg_inputs:
            filled[p] = inputs[name]
        args = tuple(filled)
        if not st.kwargs:
            return args, {}
        kwargs = {
            k: values[ref] if kind == ARG_NODE else (ref if kind == ARG_CONST else inputs[ref])
            for k, (kind, ref) in st.kwargs
        }
        return args, kwargs

    def release(self, consumers: tuple[int, ...]) -> list[int]:
        """One dependency of each consumer completed; return those now ready."""
        with self.lock:
            return self._count_down(consumers)

    def _count_down(self, consumers: tuple[int, ...]) -> list[int]:
        """One dependency of each consumer completed (the lock held); those now ready."""
        remaining = self.remaining
        ready = []
        for c in consumers:
            remaining[c] -= 1
            if remaining[c] == 0:
                ready.append(c)
        return ready

    def complete(self, i: int, value: Any, gpu_consumers: tuple[int, ...],
                 cpu_consumers: tuple[int, ...]) -> tuple[list[int], list[int]]:
        """Stage ``i`` computed ``value`` on the host: store it (both sides), release its
        consumers and count it done, under one lock; return the GPU and CPU consumers now
        ready. The run finishes here when this was its last stage, which it cannot be while
        a consumer is ready."""
        with self.lock:
            if not self.forgotten:
                self.values[i] = value
                self.dev_values[i] = value
            ready_gpu = self._count_down(gpu_consumers) if gpu_consumers else []
            ready_cpu = self._count_down(cpu_consumers) if cpu_consumers else []
            self.unfinished -= 1
            last = self.unfinished == 0
        if last:
            self._finish()
        return ready_gpu, ready_cpu

    def stage_done(self) -> None:
        with self.lock:
            self.unfinished -= 1
            last = self.unfinished == 0
        if last:
            self._finish()

    def begin_timed(self, st: StagePlan) -> None:
        self.timed_started[st.index] = time.monotonic()
        self._wake()  # the waiter arms a deadline for it

    def end_timed(self, st: StagePlan) -> bool:
        """Stop watching ``st``; False (and the run failed) when it overran its timeout."""
        t0 = self.timed_started.pop(st.index)
        assert st.timeout is not None
        if time.monotonic() - t0 > st.timeout:
            self.fail_timeout(st)
            return False
        return True


class Scheduler:
    """Owns the CPU pool and the GPU recording pool; routes ready stages to them."""

    def __init__(self, cpu_threads: int | None, gpu_threads: int, device: Callable[[], Device],
                 device_if_open: Callable[[], Device | None], submit_batch: int = 32,
                 tracer: Tracer | None = None, zero_copy_outputs: bool = True,
                 cpu_processes: int | None = None, capture: bool = True, placement: str = "auto",
                 perf_model: PerfModel | None = None, blas_threads: int | None = None) -> None:
        self._blas_threads = blas_threads
        self.cpu = WorkerPool("hetero-cpu", cpu_threads or os.cpu_count() or 1, on_start=self._limit_blas)
        self.cpu_processes = cpu_processes or max(1, (os.cpu_count() or 2) - 1)
        self._procs: ProcessPool | None = None  # created on the first process stage
        self._procs_lock = threading.Lock()
        self.placer = Placer(placement, perf_model if perf_model is not None else PerfModel(), self.cpu.size)
        self._no_gpu = False  # the device could not be opened: mixed stages run on the CPU
        # GPU service times (placement): stages submitted together share their submission's
        # time equally; it runs from the later of its submission and the previous one's end.
        self._last_gpu_done = 0  # completion instant of the latest GPU stage
        self._sub_stages: dict[int, int] = {}  # submission instant -> stages it holds
        self._sub_start = (0, 0)  # (submission instant, when its GPU work began) of the latest completing
        self.gpu = WorkerPool("hetero-gpu", gpu_threads, on_idle=self._gpu_idle)
        self._device = device
        self._device_if_open = device_if_open
        self.submit_batch = submit_batch
        self.tracer = tracer
        self.capture = capture  # honour stages declared with capture=True (see hetero._gpu.capture)
        # Graph outputs: zero-copy where the staging ring can reuse memory ("auto"), else copied.
        self._output_zero_copy: bool | str = "auto" if zero_copy_outputs else False
        self._shared: SharedRecorder | None = None
        self._shared_dev: Device | None = None
        self._runs_lock = threading.Lock()
        self._active: dict[int, Run] = {}  # runs started and not ended, by sequence
        self._parked: dict[int, tuple[Run, int]] = {}  # stages waiting for memory
        self._seq = itertools.count()
        self._upload_hints: dict[Any, tuple[StagePlan, list[Any]]] = {}  # see _device_args

    def new_run(self, plan: Plan, inputs: dict[str, Any]) -> Run:
        return Run(self, plan, inputs, next(self._seq))

    def dispatch(self, run: Run, ready: list[int]) -> None:
        """Queue ready stages on the pool of their kind (a mixed stage: where it is placed now)."""
        stages, seq, run_cpu = run.stages, run.seq, self.run_cpu
        cpu_jobs, gpu_jobs, inline = [], [], []
        queued, now = run.tl.queued, time.perf_counter_ns()
        for i in ready:
            queued[i] = now
            st = stages[i]
            key = (seq, -st.priority)
            if st.plain:
                if st.inline:
                    inline.append(i)
                else:
                    cpu_jobs.append((key, _bind(run_cpu, run, i)))
                continue
            if st.kind == "mixed":
                placed = self._place(run, st)
                if placed is None:  # the device is not open yet: a GPU worker opens it, then places
                    gpu_jobs.append((key, _bind(self._open_then_place, run, i)))
                    continue
                st = placed
            if st.process:
                cpu_jobs.append((key, _bind(self.run_process, run, i)))
            elif st.kind == "cpu":
                cpu_jobs.append((key, _bind(run_cpu, run, i)))
            else:
                gpu_jobs.append((key, _bind(self.run_gpu, run, i)))
        if cpu_jobs:
            self.cpu.submit_many(cpu_jobs)
        if gpu_jobs:
            self.gpu.submit_many(gpu_jobs)
        for i in inline:  # after the others are queued: they need not wait for these
            run_cpu(run, i, inline=True)

    def abandon_worker(self, st: StagePlan, worker: _Worker) -> None:
        """Timed CPU thread stage ``st`` overran while its function still runs: replace its worker."""
        n = self.cpu.abandon(worker)
        log.warning("cpu stage %r timed out after %g s and its thread cannot be killed: the thread is abandoned "
                    "and a new worker replaces it (%d abandoned threads still running)", st.name, st.timeout, n)

    def _limit_blas(self) -> None:
        """Before the CPU workers start: numpy's BLAS gets ``cpu_count // workers`` threads per call.

        CPU stages run concurrently, one per worker; a BLAS call taking every core in each
        of them oversubscribes the machine (OpenBLAS then spins: three times slower
        encoder layers on two cores). Process-wide (BLAS has one setting);
        ``Runtime(blas_threads=...)`` chooses the count, 0 leaves BLAS alone.
        """
        n = self._blas_threads
        if n is None:
            n = max(1, (os.cpu_count() or 1) // self.cpu.size)
        if n <= 0:
            return
        try:
            from threadpoolctl import threadpool_limits

            threadpool_limits(limits=n, user_api="blas")
        except Exception as e:  # noqa: BLE001 - no threadpoolctl, or a BLAS it cannot drive: leave BLAS as it is
            log.debug("BLAS threads left as they are: %s", e)

    # -- placement ------------------------------------------------------------------
    def _place(self, run: Run, st: StagePlan) -> StagePlan | None:
        """Decide where mixed stage ``st`` runs this time; its variant, or None until the device is open."""
        placer = self.placer
        gpu, adapter_type = not self._no_gpu, ""
        if placer.mode == "auto" and gpu:
            dev = self._device_if_open()
            if dev is None:
                return None
            adapter_type = dev.summary["type"]
        args, kwargs = run.args_for(st, run.dev_values)
        host, on_dev = input_bytes(args, kwargs)
        p = placer.decide(st.name, host, on_dev, gpu, adapter_type)
        i = st.index
        run.placements[i] = p
        run.open_placements[i] = p
        placed = run.plan.variants[i][0 if p.device == "cpu" else 1]
        run.stages[i] = placed
        if self.tracer is not None:
            self.tracer.instant(f"place {st.name} on {p.device}", "placement", args={"run": run.seq, **p.as_dict()})
        return placed

    def _open_then_place(self, run: Run, i: int) -> None:
        """On a GPU worker: open the device (or learn there is none), then place stage ``i``."""
        try:
            self._device()
        except BaseException as e:  # noqa: BLE001 - no adapter, or it failed: the CPU implementations run
            if not self._no_gpu:
                log.warning("no GPU device (%s: %s): stages with a CPU implementation run on the CPU",
                            type(e).__name__, e)
            self._no_gpu = True
        if not run.stopped:
            self.dispatch(run, [i])

    def placement_done(self, run: Run, i: int, seconds: float | None) -> None:
        """A placed execution ended (``seconds``: its measured time; None: it failed or was dropped)."""
        p = run.open_placements.pop(i, None)
        if p is not None:
            self.placer.finished(run.plan.stages[i].name, p, seconds)

    def _host_args(self, run: Run, st: StagePlan) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """A CPU-placed mixed stage's arguments, device tensors downloaded (after the work producing them).

        None once the run's caller is gone.
        """
        with run.lock:
            if run.forgotten:
                return None
            dev_values = run.dev_values
        args, kwargs = run.args_for(st, dev_values)
        tensors: dict[int, Tensor] = {}

        def visit(t: Tensor) -> Tensor:
            tensors[id(t)] = t
            return t

        for a in (*args, *kwargs.values()):
            map_values(a, visit, Tensor)
        if not tensors:
            return args, kwargs
        host = self._download(st.name, list(tensors.values()))
        args = tuple(map_values(a, lambda t: host[id(t)], Tensor) for a in args)
        return args, {k: map_values(v, lambda t: host[id(t)], Tensor) for k, v in kwargs.items()}

    def _download(self, stage: str, tensors: list[Tensor]) -> dict[int, np.ndarray]:
        """Bring ``tensors`` to the host now: submit what is recorded, copy them out, wait (on this worker)."""
        dev = self._device()
        t0 = time.perf_counter_ns()
        dev.flush()  # the work producing them goes out first; the queue runs submissions in order
        ctx = GPUContext(dev, stage)
        try:
            for t in tensors:
                ctx.stage_download(t)
            dev.wait(dev.submit([ctx.encoder.finish()]))
            host = ctx.read_downloads()
        finally:
            for ticket, _ in ctx.downloads:
                if ticket is not None:
                    ticket.discard()  # no-op for tickets already read
            ctx.downloads = []
        if self.tracer is not None:
            self.tracer.span("download", "transfer", t0, time.perf_counter_ns(),
                             args={"bytes": sum(t.nbytes for t in tensors), "stage": stage})
        return host

    # -- CPU stages -----------------------------------------------------------------
    def run_cpu(self, run: Run, i: int, inline: bool = False) -> None:
        """Run CPU stage ``i``, then keep running the most urgent CPU stage it made ready
        (``inline``: this is not a CPU worker, so only an inline one; the rest are queued)."""
        stages = run.stages
        tl = run.tl
        queued, started, recorded, completed = tl.queued, tl.started, tl.recorded, tl.completed
        perf_ns = time.perf_counter_ns
        value: Any = None
        try:
            while True:
                if run.stopped:
                    return
                st = stages[i]
                plain = st.plain  # nothing below but the function, its retries and the timeline
                if not plain and st.process:
                    self.run_process(run, i)
                    return
                attempt = 0
                started[i] = perf_ns()
                host_args = None
                t_fn = 0
                worker = None
                if not plain:
                    if not st.simple:
                        worker = self.cpu.current()
                        if worker is not None:
                            abandoned, cap = self.cpu.abandoned, ABANDONED_PER_THREAD * self.cpu.size
                            if abandoned >= cap:
                                run.fail_abandoned_cap(st, abandoned, cap)
                                return
                            run.timed_workers[i] = worker
                        run.begin_timed(st)
                    if st.mixed:  # placed on the CPU: device values come to the host first
                        try:
                            host_args = self._host_args(run, st)
                        except BaseException as e:  # noqa: BLE001 - e.g. the device was lost
                            if not st.simple:
                                run.timed_started.pop(i, None)
                                if worker is not None and not run.keep_worker(i):
                                    return  # timed out meanwhile, and its thread was abandoned
                            run.fail(st, e)
                            return
                        if host_args is None:
                            return  # stopped, and its caller is gone
                while True:
                    attempt += 1
                    try:
                        # Locals here outlive a failure (in the traceback of the error the caller
                        # gets): they hold the stage's own arguments, never the run's other values.
                        if host_args is None:
                            got = run.stage_args(st)
                            if got is None:
                                return  # stopped, and its caller is gone
                        else:
                            got = host_args
                            t_fn = perf_ns()  # a placed stage is charged its function's time
                        value = st.fn(*got[0], **got[1])
                        break
                    except BaseException as e:  # noqa: BLE001 - nothing a stage raises may kill a worker
                        if not _retry(run, st, e, attempt):
                            if not st.simple:
                                run.timed_started.pop(i, None)
                                if worker is not None and not run.keep_worker(i):
                                    return  # timed out meanwhile, and its thread was abandoned
                            run.fail(st, e, attempt)
                            return
                got = host_args = None
                done = recorded[i] = completed[i] = perf_ns()
                if not plain and st.mixed:
                    for d in st.gpu_deps:  # downloaded: the device values may go
                        run.drop_hold(d)
                    self.placement_done(run, i, (done - t_fn) / 1e9)
                if self.tracer is not None:
                    self.tracer.span(st.name, "cpu", started[i], done, args=_span_args(run, i))
                if not plain and not st.simple:
                    if worker is not None and not run.keep_worker(i):
                        return  # timed out meanwhile, and its thread was abandoned
                    if not run.end_timed(st):
                        return
                ready, ready_cpu = run.complete(i, value, st.gpu_consumers, st.cpu_consumers)
                value = None
                if ready:
                    self.dispatch(run, ready)
                if not ready_cpu:
                    return
                # Consumers come sorted by priority: continue with the first on this thread.
                if inline and not stages[ready_cpu[0]].inline:
                    self.dispatch(run, ready_cpu)
                    return
                i = ready_cpu[0]
                queued[i] = done
                if len(ready_cpu) > 1:
                    self.dispatch(run, ready_cpu[1:])
        except BaseException as e:  # noqa: BLE001 - a defect here must fail the run, not hang it
            log.exception("running CPU stage %r failed outside the stage function", stages[i].name)
            run.fail(stages[i], e)

    # -- process stages -------------------------------------------------------------
    def procs(self) -> ProcessPool:
        """The process pool, started on first use."""
        if self._procs is None:
            with self._procs_lock:
                if self._procs is None:
                    self._procs = ProcessPool(self.cpu_processes)
        return self._procs

    def run_process(self, run: Run, i: int, attempt: int = 1) -> None:
        """Hand process stage ``i`` to the process pool (pickling its arguments here) and return."""
        if run.stopped:
            return
        st = run.plan.stages[i]
        if attempt == 1:
            run.tl.started[i] = time.perf_counter_ns()
            if not st.simple:
                run.begin_timed(st)

        def done(ok: bool, value: Any, worker: int, t0: int, t1: int) -> None:
            self._process_done(run, st, attempt, ok, value, worker, t0, t1)

        pool = self.procs()
        try:
            got = run.stage_args(st)
            if got is None:
                return  # stopped, and its caller is gone
            job = pool.job((run.seq, -st.priority), st.fn, got[0], got[1], done)
            # Known to the run before it can complete (or the run stop and cancel it).
            with run.lock:
                stopped = run.stopped
                if not stopped:
                    run.proc_jobs[i] = job
            if stopped:
                pool.cancel(job)
                return
            pool.submit(job)
        except BaseException as e:  # noqa: BLE001 - e.g. an argument that does not pickle
            if not st.simple:
                run.timed_started.pop(i, None)
            run.fail(st, e, attempt)

    def _process_done(self, run: Run, st: StagePlan, attempt: int, ok: bool, value: Any, worker: int,
                      t0: int, t1: int) -> None:
        """On the process pool's dispatcher thread: process stage ``st`` returned, raised or crashed."""
        i = st.index
        with run.lock:
            run.proc_jobs.pop(i, None)
        if run.stopped:
            return
        tl = run.tl
        if self.tracer is not None and t1:
            self.tracer.span(st.name, "process", t0, t1, track=f"hetero-proc-{worker}",
                             args={"run": run.seq, "ok": ok})
        if not ok:
            if attempt <= st.retries and isinstance(value, st.options.retry_on):
                delay = st.options.retry_delay_s(attempt)
                if delay <= 0:
                    self.run_process(run, i, attempt + 1)
                else:  # the backoff must not hold up the dispatcher thread
                    timer = threading.Timer(delay, self.run_process, (run, i, attempt + 1))
                    timer.daemon = True
                    timer.start()
                return
            if not st.simple:
                run.timed_started.pop(i, None)
            run.fail(st, value, attempt)
            return
        tl.recorded[i] = tl.completed[i] = time.perf_counter_ns()
        if not st.simple and not run.end_timed(st):
            return
        ready, ready_cpu = run.complete(i, value, st.gpu_consumers, st.cpu_consumers)
        if ready or ready_cpu:
            self.dispatch(run, ready + ready_cpu)

    # -- GPU stages -----------------------------------------------------------------
    def run_gpu(self, run: Run, i: int) -> None:
        """Record GPU stage ``i`` on this thread with its own encoder and enqueue it."""
        with run.lock:
            if run.stopped:
                return
            run.recording += 1
        st = run.stages[i]
        try:
            self._record_gpu(run, st)
        except BaseException as e:  # noqa: BLE001 - a defect here must fail the run, not end the thread
            log.exception("recording GPU stage %r failed outside the stage function", st.name)
            run.fail(st, e)
        finally:
            run.recording_done()

    def _record_gpu(self, run: Run, st: StagePlan) -> None:
        i = st.index
        tl = run.tl
        tl.started[i] = time.perf_counter_ns()
        if not st.simple and i not in run.timed_started:
            run.begin_timed(st)
        try:
            dev = self._device()
            dev.check_alive()
        except BaseException as e:  # noqa: BLE001 - e.g. no adapter
            run.fail(st, e)
            return
        rec = self._recorder(dev)
        # One recording thread records in queue order, so an upload recorded for one
        # reader is in place for every later one; several threads could reorder them.
        share = run.plan.shared_uploads if rec.shared and not st.mixed else {}
        with rec.lock, dev.submission.recording():
            attempt = 0
            while True:
                attempt += 1
                ctx = GPUContext(dev, st.name, overcommit=self.is_oldest(run), recorder=rec)
                span = rec.begin_stage_span(st.name, ("stage", tl, i, run.seq))
                fresh: dict[int, Any] = {}
                try:
                    args, kwargs = _device_args(run, st, ctx, share, fresh, self._upload_hints)
                    if st.capture and self.capture:
                        result, tl.capture[i] = run_captured(ctx, st.fn, args, kwargs, dev.captures)
                    else:
                        result = st.fn(ctx, *args, **kwargs)
                    _check_returned(result, dev.pool)
                    if st.download:
                        # What only CPU stages read is a view of staging memory for the run.
                        zero_copy = self._output_zero_copy if i in run.plan.output_stages else True
                        c = ctx
                        map_values(result, lambda t: c.stage_download(t, zero_copy), Tensor)
                    rec.end_span(span)
                    break
                except _Park as park:
                    rec.end_span(span)
                    self._abandon(rec, ctx)
                    self._park(run, i, park.wait.generation)
                    return
                except BaseException as e:  # noqa: BLE001 - nothing a stage raises may kill a worker
                    rec.end_span(span)
                    self._abandon(rec, ctx)
                    if _failed_by_loss(run, st, dev, e):
                        return
                    if not _retry(run, st, e, attempt):
                        if not st.simple:
                            run.timed_started.pop(i, None)
                        run.fail(st, e, attempt)
                        return
            # The value keeps the blocks of the tensors it holds until its last consumer is
            # recorded (and its download, if any, is done); everything else the stage took
            # goes back to the pool now: whatever reuses it is recorded later, so runs later.
            blocks = {id(b): b for b in _blocks_of(result)}
            if not run.hold(i, list(blocks.values())):
                self._abandon(rec, ctx)  # the run stopped meanwhile
                return
            tl.recorded[i] = time.perf_counter_ns()
            if self.tracer is not None:
                targs = _span_args(run, i)
                if tl.capture[i] is not None:
                    targs["capture"] = tl.capture[i]
                self.tracer.span(st.name, "gpu-record", tl.started[i], tl.recorded[i], args=targs)
            uploads = ctx.uploads

            def on_done() -> None:
                done = tl.completed[i] = time.perf_counter_ns()
                sub = tl.submitted[i]
                if self._sub_start[0] != sub:  # the first stage of its submission to complete
                    self._sub_stages.pop(self._sub_start[0], None)
                    self._sub_start = (sub, max(sub or tl.recorded[i], self._last_gpu_done))
                self._last_gpu_done = done
                if st.mixed:
                    # Recording (uploads included) plus GPU service time: timestamps where
                    # taken, else an equal share of its submission's time.
                    share = (done - self._sub_start[1]) / max(self._sub_stages.get(sub, 1), 1)
                    service = tl.gpu_ns[i] or share
                    self.placement_done(run, i, (tl.recorded[i] - tl.started[i] + max(service, 0)) / 1e9)
                if st.fence or uploads:
                    try:
                        self._gpu_completed(run, st, result, ctx, uploads)
                    except BaseException as e:  # noqa: BLE001 - the run fails rather than never ending
                        log.exception("completing GPU stage %r failed", st.name)
                        run.fail(st, e)

            def on_submit(t_ns: int) -> None:
                tl.submitted[i] = t_ns
                self._sub_stages[t_ns] = self._sub_stages.get(t_ns, 0) + 1

            try:
                # A large stage (or enough of a lone run, see EARLY_SUBMIT_DISPATCHES) goes out at
                # once only while the GPU has nothing to do; while it is busy the encoder keeps
                # growing (a command buffer costs ~0.3 ms of host time on the H200) and goes out
                # with the next such stage that finds it idle.
                early = ctx.workgroups > LARGE_STAGE_WORKGROUPS or (rec.dispatches >= EARLY_SUBMIT_DISPATCHES
                                                                    and len(self._active) == 1)
                def on_error(err: BaseException) -> None:
                    if not _failed_by_loss(run, st, dev, err):
                        run.fail(st, err)

                rec.commit(on_done, on_error, flush=st.fence or (early and dev.idle), on_submit=on_submit)
            except BaseException as e:  # noqa: BLE001 - the stage's own encoder failed, or the device was lost
                if not _failed_by_loss(run, st, dev, e):
                    run.fail(st, e, attempt)
                ctx.discard()
                return
            for d, up in fresh.items():  # uploaded here for every reader: keep it for the others
                if run.hold(d, list({id(b): b for b in _blocks_of(up)}.values())):
                    run.uploaded[d] = up
            ctx.release_blocks()
        for d in st.gpu_deps:
            run.drop_hold(d)
        for d in run.plan.shared_reads.get(i, ()) if share else ():
            run.drop_hold(d)
        if st.fence:
            run.set_value(i, dev=result)  # the host side arrives with the download
        else:
            run.set_value(i, host=result, dev=result)
        run.drop_hold(i)  # the recording hold: from here only consumers and the download keep it
        if st.gpu_consumers:
            ready = run.release(st.gpu_consumers)
            if ready:
                self.dispatch(run, ready)
        if not st.fence:
            if not st.simple and not run.end_timed(st):
                return
            run.stage_done()

    def _recorder(self, dev: Device) -> SharedRecorder | StageRecorder:
        """The shared encoder with one recording thread; an encoder per stage with several."""
        if self.gpu.size > 1:
            return StageRecorder(dev)
        if self._shared is None or self._shared_dev is not dev:
            self._shared = SharedRecorder(dev, self.submit_batch)
            self._shared_dev = dev
            dev.share_encoders(self._shared)
        return self._shared

    @staticmethod
    def _abandon(rec: SharedRecorder | StageRecorder, ctx: GPUContext) -> None:
        """A stage failed or parked: its blocks go back; its tickets settle once its commands ran."""
        ctx.release_blocks()
        rec.abandon(lambda: ctx.settle(ran=rec.shared))

    def _gpu_completed(self, run: Run, st: StagePlan, result: Any, ctx: GPUContext, uploads: list[Any]) -> None:
        """On the fence thread: the stage's GPU work finished; bring values to the host, recycle staging."""
        if uploads:
            def recycle() -> None:
                for ticket in uploads:
                    ticket.complete()

            ctx._dev.defer(recycle)  # the staging goes back once this fence's results are delivered
        ctx.uploads = []
        if not st.fence:
            return
        try:
            if run.stopped:
                return
            try:
                t0 = time.perf_counter_ns()
                host = ctx.read_downloads()
                tracer = self.tracer
                if tracer is not None:
                    stats = ctx._dev.pool.stats()
                    tracer.span("download", "transfer", t0, time.perf_counter_ns(),
                                args={"bytes": sum(t.nbytes for _, t in ctx.downloads)})
                    tracer.counter("gpu memory", None, {"in_use": stats.in_use_bytes, "pooled": stats.pooled_bytes})
                run.set_value(st.index, host=map_values(result, lambda t: host.get(id(t), t), Tensor) if host else result)
            except BaseException as e:  # noqa: BLE001
                run.fail(st, e)
                return
        finally:
            for ticket, _ in ctx.downloads:
                if ticket is not None:
                    ticket.discard()  # no-op for tickets already read
            run.drop_hold(st.index)
        if not st.simple and not run.end_timed(st):
            return
        if st.cpu_consumers:
            ready = run.release(st.cpu_consumers)
            if ready:
                self.dispatch(run, ready)
        run.stage_done()

    # -- memory backpressure --------------------------------------------------------
    def is_oldest(self, run: Run) -> bool:
        """The oldest active run may exceed the memory budget, so that it always progresses."""
        with self._runs_lock:
            return bool(self._active) and run.seq == min(self._active)

    def _park(self, run: Run, i: int, generation: int) -> None:
        """Stage ``i`` waits for memory: queue it again once memory is freed or a run ends."""
        token = (run, i)
        with self._runs_lock:
            self._parked[id(token)] = token

        def requeue() -> None:
            with self._runs_lock:
                if self._parked.pop(id(token), None) is None:
                    return  # already requeued
            if not run.stopped:
                self.dispatch(run, [i])

        self._device().pool.on_free(requeue, after=generation)

    def fail_gpu_runs(self, exc: BaseException) -> None:
        """Fail every active run with GPU stages (the device was lost): their waiters raise ``exc``."""
        with self._runs_lock:
            runs = [r for r in self._active.values() if r.plan.has_gpu]
        for r in runs:
            r._set_error(exc)

    def run_started(self, run: Run) -> None:
        with self._runs_lock:
            self._active[run.seq] = run

    def run_ended(self, run: Run) -> None:
        """A run finished, failed or was cancelled: parked stages may now fit, or overcommit."""
        with self._runs_lock:
            self._active.pop(run.seq, None)
            parked, self._parked = list(self._parked.values()), {}
        for r, i in parked:
            if not r.stopped:
                self.dispatch(r, [i])

    def _gpu_idle(self) -> None:
        dev = self._device_if_open()
        if dev is not None:
            dev.flush()

    def close(self) -> None:
        self.cpu.close()
        self.gpu.close()
        if self._procs is not None:
            self._procs.close()




def _kind(st: StagePlan) -> str:
    """How a stage is named in errors and stats: cpu, process or gpu."""
    return "process" if st.process else st.kind


def _retry(run: Run, st: StagePlan, exc: BaseException, attempt: int) -> bool:
    """Whether stage ``st`` runs again after failing with ``exc`` on ``attempt``; waits its backoff first.

    Only instances of the stage's ``retry_on`` are retried, up to ``retries`` times. The
    wait is cut short when the run stops meanwhile (then False).
    """
    opts = st.options
    if attempt > opts.retries or run.stopped or not isinstance(exc, opts.retry_on):
        return False
    deadline = time.monotonic() + opts.retry_delay_s(attempt)
    while not run.stopped:
        left = deadline - time.monotonic()
        if left <= 0:
            return True
        time.sleep(min(left, 0.05))
    return False


def _bind(fn: Callable[[Run, int], None], run: Run, i: int) -> Callable[[], None]:
    return lambda: fn(run, i)


def _span_args(run: Run, i: int) -> dict[str, Any]:
    """A stage span's trace arguments: the run, and for a placed stage the decision and its estimates."""
    p = run.placements[i]
    return {"run": run.seq} if p is None else {"run": run.seq, "placement": p.as_dict()}


def _failed_by_loss(run: Run, st: StagePlan, dev: Device, e: BaseException) -> bool:
    """Fail ``run`` with DeviceLostError if the device was lost (probed first when ``e`` says it
    is: that fails every active run); False, nothing done, while the device is not lost."""
    if "device is lost" in str(e).lower():
        dev._probe_lost()
    if dev.lost is None:
        return False
    # whichever thread noticed first, this run fails the same way
    lost = DeviceLostError(f"the GPU device was lost ({dev.lost}) while stage {st.name!r} was recorded or "
                           "submitted; create a new Runtime")
    lost.__cause__ = e
    run._set_error(lost)
    return True


def _device_args(run: Run, st: StagePlan, ctx: GPUContext, share: dict[int, int], fresh: dict[int, Any],
                 hints: dict[Any, tuple[StagePlan, list[Any]]]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Stage ``st``'s arguments as its GPU function sees them: numpy arrays uploaded.

    A CPU value in ``share`` (read by several GPU stages) is uploaded by its first
    reader (recorded in ``fresh``; the caller keeps it after the stage committed) and
    reused by the others from ``run.uploaded``. The arrays to upload go together
    (``GPUContext._upload_many``: one staging buffer for small ones); an array object that
    several arguments hold (a tuple's item passed on its own too) is uploaded once, and
    they all get its Tensor.
    """
    arrays: list[np.ndarray] = []
    seen: dict[int, _Upload] = {}  # one upload per array object, however many arguments hold it

    def collect(a: np.ndarray) -> _Upload:
        u = seen.get(id(a))
        if u is None:
            arrays.append(a)
            u = seen[id(a)] = _Upload(len(arrays) - 1)
        return u

    def one(spec: tuple[int, Any]) -> Any:
        kind, ref = spec
        if kind == ARG_NODE and ref in share:
            hit = run.uploaded.get(ref)
            if hit is None:
                hit = fresh.get(ref)
                if hit is None:
                    hit = fresh[ref] = map_values(run.dev_values[ref], collect, np.ndarray)
            return hit
        v = run.dev_values[ref] if kind == ARG_NODE else (ref if kind == ARG_CONST else run.inputs[ref])
        return map_values(v, collect, np.ndarray)

    args = tuple(one(a) for a in st.args)
    kwargs = {k: one(a) for k, a in st.kwargs}
    if not arrays:
        return args, kwargs
    # The buffers this stage's uploads of these shapes had last time, where they are free: a
    # replay then finds its bind groups (a hint; the entry holds the stage's plan alive, so its
    # id is not another's).
    key = (id(st), *((a.shape, a.dtype.str) for a in arrays))
    hint = hints.get(key)
    tensors = ctx._upload_many(arrays, hint[1] if hint is not None else None)
    if len(hints) >= _UPLOAD_HINTS:
        hints.clear()
    hints[key] = (st, [t.buffer for t in tensors])

    def place(u: _Upload) -> Tensor:
        return tensors[u.index]

    for ref, v in fresh.items():
        fresh[ref] = map_values(v, place, _Upload)
    return (tuple(map_values(a, place, _Upload) for a in args),
            {k: map_values(v, place, _Upload) for k, v in kwargs.items()})


class _Upload:
    """Where an argument array goes until it is uploaded (``_device_args``)."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def _check_returned(result: Any, pool: Any) -> None:
    """Refuse tensors a GPU stage returns whose memory is not live in this device's pool.

    Holding such a block (kept by the stage from an earlier run, or made by another
    Runtime) would corrupt the pool's counts, and a download from a buffer destroyed
    since would abort the process at submission.
    """
    for b in _blocks_of(result):
        if b.pool is not pool:
            raise ValueError("the stage returned a Tensor of another Runtime's device; "
                             "return tensors made in this stage or passed to it")
        if b.refcount <= 0:
            raise ValueError(f"the stage returned a Tensor whose memory ({b.nbytes} bytes) was already "
                             "given back to the pool, e.g. one kept from an earlier run; return tensors "
                             "made in this stage or passed to it, and make tensors that outlive a run "
                             "with gpu.resident()")


def _blocks_of(value: Any) -> list[Any]:
    """Pool blocks of the tensors in a stage result."""
    found: list[Any] = []

    def visit(t: Tensor) -> Tensor:
        if t.block is not None:
            found.append(t.block)
        return t

    map_values(value, visit, Tensor)
    return found
