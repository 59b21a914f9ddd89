"""The scheduler: executes a graph's Plan over worker threads, driven from an event loop.

The scheduler routes; runs and executors do the rest. A :class:`~hetero._run.Run` holds
one execution's state and changes it only through its transitions (:mod:`hetero._run`).
Each kind of stage has an executor: CPU thread stages :mod:`hetero._exec_cpu`, process
stages :mod:`hetero._exec_process`, GPU stages :mod:`hetero._exec_gpu`; their module
docstrings state how each runs its stages.

Policy
------
* A stage runs as soon as every stage it depends on has completed: a CPU stage
  when its inputs are on the host, a GPU stage as soon as the GPU work producing
  its inputs was *submitted* (the queue runs submissions in order, so a GPU
  consumer never waits for a fence).
* Ready stages wait in a priority queue per kind of worker. The key is
  ``(run sequence, -critical-path length, arrival)``: older runs first (so
  ``map`` finishes inputs in order and overlaps the next ones), then the stage
  with the longest path still ahead of it. A CPU thread stage goes to the CPU
  workers (an ``inline`` one runs at once, on the routing thread, after the others
  are queued); a process stage to the CPU workers, which hand it to the process
  pool; a GPU stage to the GPU workers.
* A stage with a CPU and a GPU implementation is placed when it is ready
  (:class:`~hetero._placement.Placer`: calibrated estimates of both), and routed as
  the variant chosen. Until the device is open, a GPU worker opens it first; with no
  device, such stages run on the CPU.
* Executors route what a stage made ready back through :meth:`Scheduler.dispatch`; the
  event loop is only woken when a run ends or a stage with a ``timeout`` starts.
* Memory: a GPU stage that finds no memory within the budget is parked, and routed
  again once memory is freed or a run ends (the end of a run may let it overcommit).
  The oldest active run may exceed the budget, so that it always progresses.
* When the device is lost, every active run with GPU stages fails with
  :class:`~hetero.DeviceLostError`.
* A stopped (failed or cancelled) run returns to its caller once nothing of it is
  being recorded, or after ``_CLEANUP_WAIT`` seconds (a stage function that never
  returns must not hang the caller).

State
-----
The active runs (started and not ended) by sequence, the stages parked for memory,
the placer, and the three executors. Per run: see :mod:`hetero._run` (the plan is
shared, read-only). Per executor: see its module.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from ._exec_cpu import CpuExecutor
from ._exec_gpu import EARLY_SUBMIT_DISPATCHES, LARGE_STAGE_WORKGROUPS, GpuExecutor
from ._exec_process import ProcessExecutor
from ._placement import PerfModel, Placer, input_bytes
from ._plan import Plan, StagePlan
from ._run import Run

if TYPE_CHECKING:
    from ._gpu.context import GPUContext
    from ._gpu.device import Device
    from ._process import Job, ProcessPool
    from ._trace import Tracer
    from ._workers import Worker

__all__ = ["EARLY_SUBMIT_DISPATCHES", "LARGE_STAGE_WORKGROUPS", "Run", "Scheduler"]

log = logging.getLogger("hetero")
# How long a stopped (failed or cancelled) run waits for its GPU stages being recorded
# before returning anyway (a stage function that never returns must not hang the caller).
_CLEANUP_WAIT = 5.0


class Scheduler:
    """Routes ready stages to the executor of their kind; keeps the active runs and the
    stages parked for memory."""

    def __init__(self, cpu_threads: int | None, gpu_threads: int, device: Callable[[], Device],
                 device_if_open: Callable[[], Device | None], submit_batch: int = 32,
                 tracer: Tracer | None = None, zero_copy_outputs: bool = True,
                 cpu_processes: int | None = None, capture: bool = True, placement: str = "auto",
                 perf_model: PerfModel | None = None, blas_threads: int | None = None) -> None:
        self.tracer = tracer
        self._device = device
        self._device_if_open = device_if_open
        self.cpu = CpuExecutor(self, cpu_threads, blas_threads, device)
        self.process = ProcessExecutor(self, cpu_processes)
        self.gpu = GpuExecutor(self, gpu_threads, device, device_if_open, submit_batch, capture, zero_copy_outputs)
        self.placer = Placer(placement, perf_model if perf_model is not None else PerfModel(), self.cpu.size)
        self._no_gpu = False  # the device could not be opened: mixed stages run on the CPU
        self._runs_lock = threading.Lock()
        self._active: dict[int, Run] = {}  # runs started and not ended, by sequence
        self._parked: dict[int, tuple[Run, int]] = {}  # stages waiting for memory
        self._seq = itertools.count()

    # -- routing --------------------------------------------------------------------
    def dispatch(self, run: Run, ready: list[int]) -> None:
        """Queue ready stages on the pool of their kind (a mixed stage: where it is placed now)."""
        stages, seq, run_cpu = run.stages, run.seq, self.cpu.run
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
                cpu_jobs.append((key, _bind(self.process.run, run, i)))
            elif st.kind == "cpu":
                cpu_jobs.append((key, _bind(run_cpu, run, i)))
            else:
                gpu_jobs.append((key, _bind(self.run_gpu, run, i)))
        if cpu_jobs:
            self.cpu.pool.submit_many(cpu_jobs)
        if gpu_jobs:
            self.gpu.pool.submit_many(gpu_jobs)
        for i in inline:  # after the others are queued: they need not wait for these
            run_cpu(run, i, inline=True)

    def run_gpu(self, run: Run, i: int) -> None:
        """A GPU worker's job: the GPU executor records stage ``i`` and commits it."""
        self.gpu.run(run, i)

    def _gpu_completed(self, run: Run, st: StagePlan, dev: Device, result: Any, ctx: GPUContext,
                       uploads: list[Any]) -> None:
        """A fence callback's way into the scheduler: GPU stage ``st``'s work finished (see
        :meth:`GpuExecutor.completed <hetero._exec_gpu.GpuExecutor.completed>`)."""
        self.gpu.completed(run, st, dev, result, ctx, uploads)

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
        placed = run.plan.variants[i][0 if p.device == "cpu" else 1]
        run.place(i, p, placed)
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
        p = run.end_placement(i)
        if p is not None:
            self.placer.finished(run.plan.stages[i].name, p, seconds)

    # -- the run registry -------------------------------------------------------------
    def new_run(self, plan: Plan, inputs: dict[str, Any]) -> Run:
        return Run(self, plan, inputs, next(self._seq))

    @property
    def cleanup_wait(self) -> float:
        """Seconds a stopped run waits for its stages being recorded before returning anyway."""
        return _CLEANUP_WAIT

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

    def active_runs(self) -> int:
        """How many runs are active (a hint: not locked)."""
        return len(self._active)

    def is_oldest(self, run: Run) -> bool:
        """The oldest active run may exceed the memory budget, so that it always progresses."""
        with self._runs_lock:
            return bool(self._active) and run.seq == min(self._active)

    def fail_gpu_runs(self, exc: BaseException) -> None:
        """Fail every active run with GPU stages (the device was lost): their waiters raise ``exc``."""
        with self._runs_lock:
            runs = [r for r in self._active.values() if r.plan.has_gpu]
        for r in runs:
            r.fail_with(exc)

    def abandon_worker(self, st: StagePlan, worker: Worker) -> None:
        """Timed CPU thread stage ``st`` overran while its function still runs: replace its worker."""
        self.cpu.abandon(st, worker)

    def cancel_jobs(self, jobs: list[Job]) -> None:
        """A run stopped: its queued process jobs never run, running ones lose their worker."""
        self.process.cancel(jobs)

    # -- memory parking ---------------------------------------------------------------
    def park(self, run: Run, i: int, generation: int) -> None:
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

    # -- the process pool, for the runtime ------------------------------------------
    @property
    def cpu_processes(self) -> int:
        return self.process.processes

    def procs(self) -> ProcessPool:
        """The process pool, started on first use."""
        return self.process.pool()

    @property
    def _procs(self) -> ProcessPool | None:
        """The process pool, if it was started."""
        return self.process.started

    def close(self) -> None:
        self.cpu.close()
        self.gpu.close()
        self.process.close()


def _bind(fn: Callable[[Run, int], None], run: Run, i: int) -> Callable[[], None]:
    return lambda: fn(run, i)
