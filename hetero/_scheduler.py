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
* GPU stages are recorded on GPU worker threads (each stage with its own command
  encoder), submitted with a submission index, and completed by the device's
  fence thread, which downloads values a CPU stage or the caller needs.
* The first failure (after the stage's retries) stops the run: no further stage
  of it starts, the waiter wakes and raises :class:`~hetero.StageError`. A stage
  already running when its run stops finishes, and its result is dropped
  (Python threads cannot be interrupted).
* A stage's ``timeout`` covers all its attempts. The waiter on the event loop
  watches started timed stages; a worker also checks on completion, so a run
  never completes past a stage's timeout.

State
-----
Per run (:class:`Run`): host values, device values, remaining-dependency counts,
the number of unfinished stages, start times of timed stages, and the first
error. Counts are changed under the run's lock; the plan is shared, read-only.
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
from ._gpu import GPUContext, map_values, read_staging
from ._plan import ARG_CONST, ARG_INPUT, ARG_NODE, Plan, StagePlan
from ._tensor import Tensor
from .errors import StageError

if TYPE_CHECKING:
    from ._device import Device

__all__ = ["Run", "Scheduler", "WorkerPool"]

log = logging.getLogger("hetero")
# A stage dispatching more workgroups than this is submitted on its own rather than
# coalesced with its neighbours: its GPU time dwarfs the cost of a submission.
LARGE_STAGE_WORKGROUPS = 1 << 14


class WorkerPool:
    """A fixed set of daemon threads serving a priority queue of jobs."""

    def __init__(self, name: str, threads: int, on_idle: Callable[[], None] | None = None) -> None:
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"{name} needs at least 1 thread, got {threads!r}")
        self.name = name
        self.size = threads
        self._on_idle = on_idle  # called when the last busy worker finds the queue empty
        self._busy = 0
        self._heap: list[tuple[Any, int, Callable[[], None]]] = []
        self._cv = threading.Condition(threading.Lock())
        self._arrival = itertools.count()
        self._closed = False
        self._threads: list[threading.Thread] = []

    def _start(self) -> None:
        for n in range(self.size):
            t = threading.Thread(target=self._work, name=f"{self.name}-{n}", daemon=True)
            t.start()
            self._threads.append(t)

    def submit(self, key: Any, job: Callable[[], None]) -> None:
        with self._cv:
            if not self._threads:
                self._start()
            heapq.heappush(self._heap, (key, next(self._arrival), job))
            self._cv.notify()

    def submit_many(self, items: list[tuple[Any, Callable[[], None]]]) -> None:
        with self._cv:
            if not self._threads:
                self._start()
            for key, job in items:
                heapq.heappush(self._heap, (key, next(self._arrival), job))
            self._cv.notify(len(items))

    def _work(self) -> None:
        heap, cv, on_idle = self._heap, self._cv, self._on_idle
        while True:
            with cv:
                while not heap:
                    if self._closed:
                        return
                    cv.wait()
                job = heapq.heappop(heap)[2]
                self._busy += 1
            job()  # jobs catch their own errors
            with cv:
                self._busy -= 1
                idle = not self._busy and not heap
            if idle and on_idle is not None:
                try:
                    on_idle()
                except BaseException:  # pragma: no cover - the hook must not kill the worker
                    log.exception("%s: idle hook failed", self.name)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout=5)


class Run:
    """One execution of a plan: its state, and the code workers run for its stages."""

    def __init__(self, sched: Scheduler, plan: Plan, inputs: dict[str, Any], seq: int) -> None:
        self.sched = sched
        self.plan = plan
        self.inputs = inputs
        self.seq = seq
        n = len(plan.stages)
        self.values: list[Any] = [None] * n  # host-side values (what CPU stages and the caller see)
        self.dev_values: list[Any] = [None] * n  # what GPU stages see (Tensors stay Tensors)
        self.remaining = [s.n_deps for s in plan.stages]
        self.unfinished = n
        self.lock = threading.Lock()
        self.error: BaseException | None = None
        self.stopped = False  # failed, cancelled or done: start nothing more
        self.done = False
        self.timed_started: dict[int, float] = {}  # timed stages now running -> start time
        self.finished_at = 0.0
        self._event: anyio.Event | None = None
        self._call: Callable[[Callable[[], Any]], None] | None = None

    # -- loop side ------------------------------------------------------------------
    def start(self) -> None:
        """Bind to the current event loop and queue the root stages."""
        self._call = loop_caller()
        self._event = anyio.Event()
        if not self.plan.stages:
            self._finish()
            return
        self.sched.dispatch(self, list(self.plan.roots))

    async def wait(self) -> Any:
        """Wait for the run to end; return its outputs or raise its error."""
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
        if self.error is not None:
            raise self.error
        return self.outputs()

    def _check_timeouts(self) -> float:
        """Fail the run if a running timed stage is overdue; return seconds until the next deadline."""
        now = time.monotonic()
        nearest = math.inf
        for i, t0 in list(self.timed_started.items()):
            st = self.plan.stages[i]
            assert st.timeout is not None
            left = t0 + st.timeout - now
            if left <= 0:
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

    def stop(self) -> None:
        with self.lock:
            self.stopped = True

    def outputs(self) -> Any:
        outs = []
        for kind, ref in self.plan.outputs:
            outs.append(self.inputs[ref] if kind == ARG_INPUT else self.values[ref])
        return outs[0] if self.plan.single_output else tuple(outs)

    # -- worker side ----------------------------------------------------------------
    def fail(self, st: StagePlan, exc: BaseException, attempts: int = 1) -> None:
        tries = f" after {attempts} attempts" if attempts > 1 else ""
        err = StageError(f"{st.kind} stage {st.name!r} failed{tries}: {type(exc).__name__}: {exc}", st.name)
        err.__cause__ = exc
        self._set_error(err)

    def fail_timeout(self, st: StagePlan) -> None:
        exc = TimeoutError(f"stage {st.name!r} ran longer than its timeout of {st.timeout:g} s")
        err = StageError(f"{st.kind} stage {st.name!r} timed out after {st.timeout:g} s", st.name)
        err.__cause__ = exc
        self._set_error(err)

    def _set_error(self, err: BaseException) -> None:
        with self.lock:
            if self.stopped:
                return
            self.stopped = True
            self.error = err
        self._wake()

    def _finish(self) -> None:
        with self.lock:
            if self.stopped:
                return
            self.stopped = True
            self.done = True
        self.finished_at = time.monotonic()
        self._wake()

    def args_for(self, st: StagePlan, values: list[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        inputs = self.inputs
        args = tuple(
            values[ref] if kind == ARG_NODE else (ref if kind == ARG_CONST else inputs[ref]) for kind, ref in st.args
        )
        if not st.kwargs:
            return args, {}
        kwargs = {
            k: values[ref] if kind == ARG_NODE else (ref if kind == ARG_CONST else inputs[ref])
            for k, (kind, ref) in st.kwargs
        }
        return args, kwargs

    def release(self, consumers: tuple[int, ...]) -> list[int]:
        """One dependency of each consumer completed; return those now ready."""
        ready = []
        remaining = self.remaining
        with self.lock:
            for c in consumers:
                remaining[c] -= 1
                if remaining[c] == 0:
                    ready.append(c)
        return ready

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
                 device_if_open: Callable[[], Device | None]) -> None:
        self.cpu = WorkerPool("hetero-cpu", cpu_threads or os.cpu_count() or 1)
        self.gpu = WorkerPool("hetero-gpu", gpu_threads, on_idle=self._gpu_idle)
        self._device = device
        self._device_if_open = device_if_open
        self._seq = itertools.count()

    def new_run(self, plan: Plan, inputs: dict[str, Any]) -> Run:
        return Run(self, plan, inputs, next(self._seq))

    def dispatch(self, run: Run, ready: list[int]) -> None:
        """Queue ready stages on the pool of their kind."""
        stages = run.plan.stages
        cpu_jobs, gpu_jobs = [], []
        for i in ready:
            st = stages[i]
            key = (run.seq, -st.priority)
            if st.kind == "cpu":
                cpu_jobs.append((key, _bind(self.run_cpu, run, i)))
            else:
                gpu_jobs.append((key, _bind(self.run_gpu, run, i)))
        if cpu_jobs:
            self.cpu.submit_many(cpu_jobs)
        if gpu_jobs:
            self.gpu.submit_many(gpu_jobs)

    # -- CPU stages -----------------------------------------------------------------
    def run_cpu(self, run: Run, i: int) -> None:
        """Run CPU stage ``i``, then keep running the most urgent CPU stage it made ready."""
        stages = run.plan.stages
        values = run.values
        while True:
            if run.stopped:
                return
            st = stages[i]
            value = _NO_VALUE
            attempt = 0
            if not st.simple:
                run.begin_timed(st)
            while True:
                attempt += 1
                try:
                    args, kwargs = run.args_for(st, values)
                    value = st.fn(*args, **kwargs)
                    break
                except BaseException as e:  # noqa: BLE001 - nothing a stage raises may kill a worker
                    if attempt > st.retries or run.stopped:
                        if not st.simple:
                            run.timed_started.pop(i, None)
                        run.fail(st, e, attempt)
                        return
            if not st.simple and not run.end_timed(st):
                return
            values[i] = value
            run.dev_values[i] = value
            ready = run.release(st.gpu_consumers) if st.gpu_consumers else []
            ready_cpu = run.release(st.cpu_consumers) if st.cpu_consumers else []
            if ready:
                self.dispatch(run, ready)
            run.stage_done()
            if not ready_cpu:
                return
            # Consumers come sorted by priority: continue with the first on this thread.
            i = ready_cpu[0]
            if len(ready_cpu) > 1:
                self.dispatch(run, ready_cpu[1:])

    # -- GPU stages -----------------------------------------------------------------
    def run_gpu(self, run: Run, i: int) -> None:
        """Record GPU stage ``i`` on this thread with its own encoder and submit it."""
        if run.stopped:
            return
        st = run.plan.stages[i]
        if not st.simple:
            run.begin_timed(st)
        attempt = 0
        while True:
            attempt += 1
            try:
                dev = self._device()
                dev.check_alive()
                ctx = GPUContext(dev, st.name)
                args, kwargs = run.args_for(st, run.dev_values)
                args = tuple(map_values(a, ctx.upload, np.ndarray) for a in args)
                kwargs = {k: map_values(v, ctx.upload, np.ndarray) for k, v in kwargs.items()}
                result = st.fn(ctx, *args, **kwargs)
                staged: list[tuple[Any, Tensor]] = []
                if st.download:
                    def stage(t: Tensor) -> Tensor:
                        staged.append((ctx.stage_download(t), t))
                        return t

                    map_values(result, stage, Tensor)
                command_buffer = ctx.finish()
                break
            except BaseException as e:  # noqa: BLE001
                if attempt > st.retries or run.stopped:
                    if not st.simple:
                        run.timed_started.pop(i, None)
                    run.fail(st, e, attempt)
                    return
        if run.stopped:
            return
        try:
            # Small stages are coalesced into one submission (flushed when the GPU
            # workers go idle, when someone waits on a fence, or when the batch is full).
            on_done = (lambda: self._gpu_completed(run, st, result, staged)) if st.fence else None
            dev.enqueue(command_buffer, on_done, flush=ctx.workgroups > LARGE_STAGE_WORKGROUPS)
        except BaseException as e:  # noqa: BLE001
            run.fail(st, e, attempt)
            return
        run.dev_values[i] = result
        if st.gpu_consumers:
            ready = run.release(st.gpu_consumers)
            if ready:
                self.dispatch(run, ready)
        if not st.fence:
            run.values[i] = result
            if not st.simple and not run.end_timed(st):
                return
            run.stage_done()

    def _gpu_completed(self, run: Run, st: StagePlan, result: Any, staged: list[tuple[Any, Tensor]]) -> None:
        """On the fence thread: the stage's GPU work finished; bring its value to the host."""
        if run.stopped:
            return
        try:
            host = {id(t): read_staging(buf, t) for buf, t in staged}
            run.values[st.index] = map_values(result, lambda t: host[id(t)], Tensor) if staged else result
        except BaseException as e:  # noqa: BLE001
            run.fail(st, e)
            return
        if not st.simple and not run.end_timed(st):
            return
        if st.cpu_consumers:
            ready = run.release(st.cpu_consumers)
            if ready:
                self.dispatch(run, ready)
        run.stage_done()

    def _gpu_idle(self) -> None:
        dev = self._device_if_open()
        if dev is not None:
            dev.flush()

    def close(self) -> None:
        self.cpu.close()
        self.gpu.close()


_NO_VALUE = object()


def _bind(fn: Callable[[Run, int], None], run: Run, i: int) -> Callable[[], None]:
    return lambda: fn(run, i)
