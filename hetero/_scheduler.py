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
Per run: see :mod:`hetero._run` (a :class:`~hetero._run.Run` changes its own state, under
its own lock, through named transitions; the plan is shared, read-only).
Per CPU pool: its live workers, and the count of abandoned ones still running.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ._gpu.capture import run_captured
from ._gpu.context import GPUContext, _Park
from ._gpu.tensor import map_values
from ._gpu.recorder import SharedRecorder, StageRecorder
from ._placement import PerfModel, Placer, input_bytes
from ._plan import ARG_CONST, ARG_NODE, Plan, StagePlan
from ._process import Job, ProcessPool
from ._run import Run
from ._gpu.tensor import Tensor
from ._workers import Worker, WorkerPool
from .errors import StageError

if TYPE_CHECKING:
    from ._gpu.device import Device
    from ._trace import Tracer

__all__ = ["Run", "Scheduler", "WorkerPool"]

log = logging.getLogger("hetero")
# A stage dispatching more workgroups than this is submitted on its own rather than
# coalesced with its neighbours: its GPU time dwarfs the cost of a submission.
LARGE_STAGE_WORKGROUPS = 1 << 14

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

    @property
    def cleanup_wait(self) -> float:
        """Seconds a stopped run waits for its stages being recorded before returning anyway."""
        return _CLEANUP_WAIT

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

    def abandon_worker(self, st: StagePlan, worker: Worker) -> None:
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
                                run.fail_with(_abandoned_cap(st, abandoned, cap))
                                return
                        run.begin_timed(st, worker)
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
                    self.placement_done(run, i, (done - t_fn) / 1e9)
                if self.tracer is not None:
                    self.tracer.span(st.name, "cpu", started[i], done, args=run.span_args(i))
                if not plain and not st.simple and not run.end_timed(st, worker is not None):
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

    def cancel_jobs(self, jobs: list[Job]) -> None:
        """A run stopped: its queued process jobs never run, running ones lose their worker."""
        pool = self.procs()
        for job in jobs:
            pool.cancel(job)

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
            if not run.add_job(i, job):
                pool.cancel(job)
                return
            pool.submit(job)
        except BaseException as e:  # noqa: BLE001 - e.g. an argument that does not pickle
            run.fail_stage(st, e, attempt)

    def _process_done(self, run: Run, st: StagePlan, attempt: int, ok: bool, value: Any, worker: int,
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
                    self.run_process(run, i, attempt + 1)
                else:  # the backoff must not hold up the dispatcher thread
                    timer = threading.Timer(delay, self.run_process, (run, i, attempt + 1))
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
            self.dispatch(run, ready + ready_cpu)

    # -- GPU stages -----------------------------------------------------------------
    def run_gpu(self, run: Run, i: int) -> None:
        """Record GPU stage ``i`` on this thread with its own encoder and enqueue it."""
        if not run.begin_recording():
            return
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
        if not st.simple:
            run.begin_timed(st)  # again after waiting for memory: it keeps its first start
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
                    if not run.retry(st, e, attempt):
                        run.fail_stage(st, e, attempt)
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
                targs = run.span_args(i)
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
                run.keep_upload(d, up, list({id(b): b for b in _blocks_of(up)}.values()))
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
            r.fail_with(exc)

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




def _abandoned_cap(st: StagePlan, abandoned: int, cap: int) -> StageError:
    return StageError(
        f"cpu stage {st.name!r} with a timeout cannot start: {abandoned} threads abandoned by timed-out "
        f"stages are still running, the cap is {cap} ({ABANDONED_PER_THREAD} x cpu_threads); a thread "
        "cannot be killed: run code that may hang as a process stage (g.cpu(fn, ..., process=True)), "
        "whose worker is killed on timeout", st.name)


def _bind(fn: Callable[[Run, int], None], run: Run, i: int) -> Callable[[], None]:
    return lambda: fn(run, i)


def _failed_by_loss(run: Run, st: StagePlan, dev: Device, e: BaseException) -> bool:
    """Fail ``run`` with DeviceLostError if the device was lost (probed first when ``e`` says it
    is: that fails every active run); False, nothing done, while the device is not lost."""
    if "device is lost" in str(e).lower():
        dev._probe_lost()
    if dev.lost is None:
        return False
    run.fail_lost(st, dev.lost, e)  # whichever thread noticed first, this run fails the same way
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
