"""The CPU thread executor: CPU stages on a pool of worker threads that walk the graph.

Policy
------
* Workers walk the graph themselves. A CPU worker that completes a stage releases
  its consumers; it keeps the most urgent newly ready CPU stage and runs it next
  on the same thread (no hand-off at all for chains), and hands the rest to the
  scheduler. The event loop is only woken when a run ends or a stage with a
  ``timeout`` starts: trivially short stages never pay for a hop through the loop.
* An ``inline`` stage runs on the thread that makes it ready (the loop's, a worker's,
  the fence thread's); what it readies that is not inline goes to a worker.
* A process stage that a chain reaches is handed to the process executor
  (:mod:`hetero._exec_process`) by the worker, which then moves on.
* A mixed stage placed on the CPU downloads the device values it reads first, on its
  worker, after the GPU work producing them (submitted first: the queue runs in order).
* A thread cannot be killed. When a CPU thread stage times out, or its run stops
  (fails for another reason, or is cancelled) while a stage with a ``timeout`` is still
  in its function, the pool gives up on the worker running it (*abandons* it) and
  starts a replacement, so
  ``cpu_threads`` workers keep serving the queue; the abandoned thread ends once its
  function returns. While ``ABANDONED_PER_THREAD`` x ``cpu_threads`` abandoned threads
  are still running, a timed CPU thread stage fails at once instead of starting: each
  such stage could hang and cost another thread. Process stages are the remedy for
  code that may hang: their worker is killed.

State
-----
The worker pool (its live workers, and the count of abandoned ones still running).
Everything a stage changes is its run's, through the run's transitions.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ._gpu.context import GPUContext
from ._gpu.tensor import Tensor, map_values
from ._workers import Worker, WorkerPool
from .errors import StageError

if TYPE_CHECKING:
    from ._gpu.device import Device
    from ._plan import StagePlan
    from ._run import Run
    from ._scheduler import Scheduler

__all__ = ["ABANDONED_PER_THREAD", "CpuExecutor"]

log = logging.getLogger("hetero")

# While this many abandoned threads per CPU worker are still running, timed CPU thread
# stages fail at once (see the module docstring): hung threads must not pile up unbounded.
ABANDONED_PER_THREAD = 4


class CpuExecutor:
    """Runs CPU thread stages on its worker pool (``hetero-cpu-N`` threads)."""

    def __init__(self, sched: Scheduler, threads: int | None, blas_threads: int | None,
                 device: Callable[[], Device]) -> None:
        self._sched = sched
        self._dispatch = sched.dispatch
        self.tracer = sched.tracer
        self._device = device
        self._blas_threads = blas_threads
        self.pool = WorkerPool("hetero-cpu", threads or os.cpu_count() or 1, on_start=self._limit_blas)
        self.size = self.pool.size

    @property
    def abandoned(self) -> int:
        """Abandoned workers still running their stage function."""
        return self.pool.abandoned

    def abandon(self, st: StagePlan, worker: Worker) -> None:
        """Timed CPU thread stage ``st`` is given up on while its function still runs (it timed
        out, or its run stopped): replace its worker."""
        n = self.pool.abandon(worker)
        log.warning("cpu stage %r (timeout %g s) is still running as its run ends, and a thread cannot be killed: "
                    "its thread is abandoned and a new worker replaces it (%d abandoned threads still running)",
                    st.name, st.timeout, n)

    def _limit_blas(self) -> None:
        """Before the CPU workers start: numpy's BLAS gets ``cpu_count // workers`` threads per call.

        CPU stages run concurrently, one per worker; a BLAS call taking every core in each
        of them oversubscribes the machine (OpenBLAS then spins: three times slower
        encoder layers on two cores). Process-wide (BLAS has one setting);
        ``Runtime(blas_threads=...)`` chooses the count, 0 leaves BLAS alone.
        """
        n = self._blas_threads
        if n is None:
            n = max(1, (os.cpu_count() or 1) // self.size)
        if n <= 0:
            return
        try:
            from threadpoolctl import threadpool_limits

            threadpool_limits(limits=n, user_api="blas")
        except Exception as e:  # noqa: BLE001 - no threadpoolctl, or a BLAS it cannot drive: leave BLAS as it is
            log.debug("BLAS threads left as they are: %s", e)

    def run(self, run: Run, i: int, inline: bool = False) -> None:
        """Run CPU stage ``i``, then keep running the most urgent CPU stage it made ready
        (``inline``: this is not a CPU worker, so only an inline one; the rest are routed)."""
        stages = run.stages
        tl = run.tl
        queued, started, recorded, completed = tl.queued, tl.started, tl.recorded, tl.completed
        perf_ns = time.perf_counter_ns
        dispatch = self._dispatch
        value: Any = None
        try:
            while True:
                if run.stopped:
                    return
                st = stages[i]
                plain = st.plain  # nothing below but the function, its retries and the timeline
                if not plain and st.process:
                    self._sched.process.run(run, i)
                    return
                attempt = 0
                started[i] = perf_ns()
                host_args = None
                t_fn = 0
                worker = None
                if not plain:
                    if not st.simple:
                        worker = self.pool.current()
                        if worker is not None:
                            abandoned, cap = self.pool.abandoned, ABANDONED_PER_THREAD * self.size
                            if abandoned >= cap:
                                run.fail_with(_abandoned_cap(st, abandoned, cap))
                                return
                        if not run.begin_timed(st, worker):
                            return  # the run stopped: its worker is not given to a stage of it
                    if st.mixed:  # placed on the CPU: device values come to the host first
                        try:
                            host_args = self._host_args(run, st)
                        except BaseException as e:  # noqa: BLE001 - e.g. the device was lost
                            run.fail_stage(st, e, 1, worker is not None)
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
                        if not run.retry(st, e, attempt):
                            run.fail_stage(st, e, attempt, worker is not None)
                            return
                got = host_args = None
                done = recorded[i] = completed[i] = perf_ns()
                if not plain and st.mixed:
                    for d in st.gpu_deps:  # downloaded: the device values may go
                        run.drop_hold(d)
                    self._sched.placement_done(run, i, (done - t_fn) / 1e9)
                if self.tracer is not None:
                    self.tracer.span(st.name, "cpu", started[i], done, args=run.span_args(i))
                if not plain and not st.simple and not run.end_timed(st, worker is not None):
                    return
                ready, ready_cpu = run.complete(i, value, st.gpu_consumers, st.cpu_consumers)
                value = None
                if ready:
                    dispatch(run, ready)
                if not ready_cpu:
                    return
                # Consumers come sorted by priority: continue with the first on this thread.
                if inline and not stages[ready_cpu[0]].inline:
                    dispatch(run, ready_cpu)
                    return
                i = ready_cpu[0]
                queued[i] = done
                if len(ready_cpu) > 1:
                    dispatch(run, ready_cpu[1:])
        except BaseException as e:  # noqa: BLE001 - a defect here must fail the run, not hang it
            log.exception("running CPU stage %r failed outside the stage function", stages[i].name)
            run.fail(stages[i], e)

    # -- mixed stages placed on the CPU -----------------------------------------------
    def _host_args(self, run: Run, st: StagePlan) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """A CPU-placed mixed stage's arguments, device tensors downloaded (after the work producing them).

        None once the run's caller is gone.
        """
        dev_values = run.device_values()
        if dev_values is None:
            return None
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

    def close(self) -> None:
        self.pool.close()


def _abandoned_cap(st: StagePlan, abandoned: int, cap: int) -> StageError:
    return StageError(
        f"cpu stage {st.name!r} with a timeout cannot start: {abandoned} threads abandoned by timed-out "
        f"stages are still running, the cap is {cap} ({ABANDONED_PER_THREAD} x cpu_threads); a thread "
        "cannot be killed: run code that may hang as a process stage (g.cpu(fn, ..., process=True)), "
        "whose worker is killed on timeout", st.name)
