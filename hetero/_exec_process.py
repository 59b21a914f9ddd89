"""The process executor: process stages (``g.cpu(..., process=True)``) on the worker-process pool.

Policy
------
* A process stage is handed to the runtime's process pool (:mod:`hetero._process`)
  by a CPU worker, which pickles its arguments and then moves on: no thread waits
  for it. The pool's dispatcher thread completes it (stores its value, releases its
  consumers and hands them to the scheduler).
* When its run stops, a process stage still queued is dropped and one still running
  has its worker killed (and replaced).
* A retried attempt waits its backoff on a timer, never on the dispatcher thread.

State
-----
The pool, started on the first process stage (or by ``Runtime.warmup``). The jobs of
a run are the run's (``Run.add_job``/``Run.job_done``), so a stopping run cancels them.
"""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING, Any

from ._process import Job, ProcessPool

if TYPE_CHECKING:
    from ._plan import StagePlan
    from ._run import Run
    from ._scheduler import Scheduler

__all__ = ["ProcessExecutor"]


class ProcessExecutor:
    """Hands process stages to the process pool; completes them on its dispatcher thread."""

    def __init__(self, sched: Scheduler, processes: int | None) -> None:
        self._dispatch = sched.dispatch
        self.tracer = sched.tracer
        self.processes = processes or max(1, (os.cpu_count() or 2) - 1)
        self.started: ProcessPool | None = None  # the pool, once something needed it
        self._lock = threading.Lock()

    def pool(self) -> ProcessPool:
        """The process pool, started on first use."""
        if self.started is None:
            with self._lock:
                if self.started is None:
                    self.started = ProcessPool(self.processes)
        return self.started

    def cancel(self, jobs: list[Job]) -> None:
        """A run stopped: its queued jobs never run, running ones lose their worker."""
        pool = self.pool()
        for job in jobs:
            pool.cancel(job)

    def run(self, run: Run, i: int, attempt: int = 1) -> None:
        """Hand process stage ``i`` to the process pool (pickling its arguments here) and return."""
        if run.stopped:
            return
        st = run.plan.stages[i]
        if attempt == 1:
            run.tl.started[i] = time.perf_counter_ns()
            if not st.simple:
                run.begin_timed(st)

        def done(ok: bool, value: Any, worker: int, t0: int, t1: int) -> None:
            self._done(run, st, attempt, ok, value, worker, t0, t1)

        pool = self.pool()
        try:
            got = run.stage_args(st)
            if got is None:
                return  # stopped, and its caller is gone
            job = pool.job((run.seq, -st.priority), st.fn, got[0], got[1], done)
            if not run.add_job(i, job):
                pool.cancel(job)
                return
            pool.submit(job)
        except BaseException as e:  # noqa: BLE001 - e.g. an argument that does not pickle
            run.fail_stage(st, e, attempt)

    def _done(self, run: Run, st: StagePlan, attempt: int, ok: bool, value: Any, worker: int,
              t0: int, t1: int) -> None:
        """On the process pool's dispatcher thread: process stage ``st`` returned, raised or crashed."""
        i = st.index
        run.job_done(i)
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
                    self.run(run, i, attempt + 1)
                else:  # the backoff must not hold up the dispatcher thread
                    timer = threading.Timer(delay, self.run, (run, i, attempt + 1))
                    timer.daemon = True
                    timer.start()
                return
            run.fail_stage(st, value, attempt)
            return
        tl.recorded[i] = tl.completed[i] = time.perf_counter_ns()
        if not st.simple and not run.end_timed(st):
            return
        ready, ready_cpu = run.complete(i, value, st.gpu_consumers, st.cpu_consumers)
        if ready or ready_cpu:
            self._dispatch(run, ready + ready_cpu)

    def close(self) -> None:
        if self.started is not None:
            self.started.close()
