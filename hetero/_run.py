"""Runs: one execution of a plan, as a state machine driven by the executors.

Policy
------
* The first failure (after the stage's retries) stops the run: no further stage
  of it starts, the waiter wakes and raises :class:`~hetero.StageError`. A stage
  already running when its run stops finishes, and its result is dropped
  (Python threads cannot be interrupted).
* A stage's ``timeout`` covers all its attempts. The waiter on the event loop
  watches started timed stages; a worker also checks on completion, so a run
  never completes past a stage's timeout. Whoever takes a timed CPU thread
  stage's worker from the run, the finishing worker, the timeout or the run stopping
  (failed for another reason, or cancelled), decides whether that worker is abandoned
  (:mod:`hetero._exec_cpu`): a timed stage may hang, so one still in its function
  when its run stops is given up on as a timed-out one is, and does not keep a worker.
* Once the run's caller has its outputs (or its error, or was cancelled) the run
  forgets its values: stages of it that complete later store nothing, and the Run
  kept for ``Runtime.stats()`` holds only timings.
* A stopped run returns to its caller only once no stage of it is being recorded
  and every device block it held is back in the pool (``settled``).

State
-----
Per run (:class:`Run`): host values, device values, remaining-dependency counts,
the number of unfinished stages, start times of timed stages (and, for CPU thread
stages, the worker running each), held device blocks (GPU values and shared
uploads), process stages handed to the process pool, the GPU stages being recorded,
placement decisions still open, and the first error. The plan is shared, read-only.

Transitions
-----------
Only a Run changes its state, and every change that needs the run's lock takes it
inside the transition (nobody else takes ``Run.lock``). The executors call them:

===========================================  ========================================================
``place`` / ``end_placement``                a mixed stage is placed / its placed run ended
``begin_timed`` / ``end_timed``              a timed stage starts / its function returned
``begin_recording`` / ``recording_done``     a GPU stage's recording starts / ends
``add_job`` / ``job_done``                   a process stage was handed off / came back
``hold`` / ``drop_hold`` / ``keep_upload``   device blocks kept for a value / let go
``set_value``                                a value arrives (host side, device side)
``release``                                  consumers lose a dependency: those now ready
``complete``                                 a stage's value stored, consumers released, counted done
``stage_done``                               a stage counted done (its value stored before)
``fail_stage``                               a stage raised: stop watching it, fail the run
``fail`` / ``fail_timeout`` / ``fail_lost``  the run fails naming a stage
``fail_with``                                the run fails with an error made elsewhere
``stop`` / ``forget_values``                 the caller is gone / has what it needs
===========================================  ========================================================

A transition returns what its caller routes (the stages now ready); the few effects a
run has outside itself go through its :class:`RunHost` (the scheduler): routing its
root stages, leaving the registry, closing placements, abandoning a worker, cancelling
process jobs. A run built on a host of its own (tests/test_run_state.py) runs its
transitions without threads, a loop or a device.

Its :class:`~hetero._stats.Timeline` is a record the executors stamp as stages move;
no transition reads it.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Protocol

import anyio

from ._bridge import loop_caller
from ._plan import ARG_CONST, ARG_INPUT, ARG_NODE, Plan, StagePlan
from ._stats import RunStats, Timeline
from .errors import DeviceLostError, StageError

if TYPE_CHECKING:
    from ._placement import Placement
    from ._process import Job
    from ._trace import Tracer
    from ._workers import Worker

__all__ = ["Run", "RunHost", "stage_kind"]

log = logging.getLogger("hetero")
_KEEP: Any = object()  # Run.set_value: leave that side's value as it is


class RunHost(Protocol):
    """What a run asks of the scheduler that runs it."""

    tracer: Tracer | None

    @property
    def cleanup_wait(self) -> float:
        """Seconds a stopped run waits for stages being recorded before returning anyway."""

    def dispatch(self, run: Run, ready: list[int]) -> None:
        """Route ready stages of ``run`` to their executors."""

    def run_started(self, run: Run) -> None: ...

    def run_ended(self, run: Run) -> None:
        """``run`` stopped and holds no device memory any more."""

    def placement_done(self, run: Run, i: int, seconds: float | None) -> None:
        """A placed execution of stage ``i`` ended (None: it failed or was dropped)."""

    def abandon_worker(self, st: StagePlan, worker: Worker) -> None:
        """Timed CPU thread stage ``st`` overran while its function still runs on ``worker``."""

    def cancel_jobs(self, jobs: list[Job]) -> None:
        """Drop queued process jobs, kill the workers of running ones."""


def stage_kind(st: StagePlan) -> str:
    """How a stage is named in errors and stats: cpu, process or gpu."""
    return "process" if st.process else st.kind


class Run:
    """One execution of a plan: its state and the transitions that change it."""

    def __init__(self, host: RunHost, plan: Plan, inputs: dict[str, Any], seq: int) -> None:
        self.host = host
        self.plan = plan
        self.inputs = inputs
        self.seq = seq
        n = len(plan.stages)
        # The stages as this run executes them: a mixed stage becomes one of its variants
        # when placed (place()).
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
        self.timed_workers: dict[int, Worker] = {}
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
        self._loop_thread = 0  # the event loop's thread (start)
        self.on_wake: Callable[[], None] | None = None  # also called on the loop whenever the run wakes its waiter

    # -- loop side ------------------------------------------------------------------
    def start(self) -> None:
        """Bind to the current event loop and route the root stages."""
        self._call = loop_caller()
        self._loop_thread = threading.get_ident()
        self._event = anyio.Event()
        self.host.run_started(self)
        tracer = self.host.tracer
        if tracer is not None:
            tracer.name_thread("event loop")
            tracer.instant(f"run {self.seq} of {self.plan.name!r} starts", "run")
        if not self.plan.stages:
            self._end(None)  # nothing to run: completed
            return
        self.host.dispatch(self, list(self.plan.roots))

    async def wait(self) -> Any:
        """Wait for the run to end; return its outputs or raise its error.

        Whether it completed, failed or was cancelled, the run returns (or raises) only
        once no stage of it is being recorded and every block it held is back in the pool.
        """
        waited = False
        try:
            while True:
                event = self._event = anyio.Event()
                if self.stopped:
                    break
                delay = self._check_timeouts()
                if self.stopped:
                    break
                with anyio.move_on_after(delay):
                    waited = True
                    await event.wait()
            if not waited:  # ended inside start (inline stages): still let the loop's other tasks run
                await anyio.lowlevel.checkpoint()
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
        run's blocks are back in the pool (at most the host's ``cleanup_wait`` seconds).

        Stages being recorded when the run stopped finish recording first (recording is
        short; a stage's GPU work is not awaited). Even a run that succeeded can wait here:
        its last stage's GPU work may complete on the fence thread while the recording
        thread is still letting go of that stage's inputs.
        """
        if self.cleaned:
            return
        stray: BaseException | None = None
        limit = self.host.cleanup_wait
        with anyio.CancelScope(shield=True), anyio.move_on_after(limit) as timeout:
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
                        "returning with its device memory in use", self.seq, self.plan.name, limit)

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

    def _check_timeouts(self) -> float:
        """Fail the run if a running timed stage is overdue; return seconds until the next deadline."""
        now = time.monotonic()
        nearest = math.inf
        for i, t0 in list(self.timed_started.items()):
            st = self.plan.stages[i]
            assert st.timeout is not None
            left = t0 + st.timeout - now
            if left <= 0:
                self.fail_timeout(st)  # its worker, still in its function, is abandoned as the run ends
                return 0.0
            nearest = min(nearest, left)
        return nearest

    def _wake(self) -> None:
        """Wake the waiter: at once on the loop's own thread (a run whose stages are inline ends
        inside ``start``, and a callback posted there would wait, holding the run, until the
        caller next yields to the loop), else through the loop."""
        call = self._call
        if call is None:
            return
        if threading.get_ident() == self._loop_thread:
            try:
                self._set_event()
            except RuntimeError:  # the loop is closed: nobody waits any more (as loop_caller's calls)
                pass
        else:
            call(self._set_event)

    def _set_event(self) -> None:
        if self._event is not None:
            self._event.set()
        if self.on_wake is not None:
            self.on_wake()

    def stop(self) -> None:
        """The caller is gone (cancelled, or a map behind a failure): start nothing more."""
        with self.lock:
            self.stopped = True
            clean = self.recording == 0
            hung = self._take_timed_workers()
        self._abandon(hung)
        self._cancel_processes()
        if clean:
            self.cleanup()

    def _take_timed_workers(self) -> list[tuple[int, Worker]]:
        """The run stops (the lock held): the workers of its timed CPU thread stages still in
        their function, taken from the run, so that a stage returning later stores nothing."""
        if not self.timed_workers:
            return []
        hung, self.timed_workers = list(self.timed_workers.items()), {}
        return hung

    def _abandon(self, hung: list[tuple[int, Worker]]) -> None:
        """Timed stages still running as the run stops are given up on as a timed-out one is:
        the function may hang, and its thread must not be lost to the pool."""
        for i, worker in hung:
            self.host.abandon_worker(self.stages[i], worker)

    def _cancel_processes(self) -> None:
        """The run stopped: its queued process stages never run, running ones lose their worker."""
        with self.lock:
            if not self.proc_jobs:
                return
            jobs, self.proc_jobs = list(self.proc_jobs.values()), {}
        self.host.cancel_jobs(jobs)

    # -- reading ----------------------------------------------------------------------
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

    def device_values(self) -> list[Any] | None:
        """The values as GPU stages see them (Tensors stay Tensors); None once the caller is gone."""
        with self.lock:
            return None if self.forgotten else self.dev_values

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

    def span_args(self, i: int) -> dict[str, Any]:
        """Stage ``i``'s trace arguments: the run, and for a placed stage the decision and its estimates."""
        p = self.placements[i]
        return {"run": self.seq} if p is None else {"run": self.seq, "placement": p.as_dict()}

    def stats(self) -> RunStats:
        stages = self.stages
        return self.tl.snapshot(self.plan.name, [st.name for st in stages], [stage_kind(st) for st in stages],
                                ok=self.done and self.error is None, placements=self.placements)

    def outputs(self) -> Any:
        outs = []
        for kind, ref in self.plan.outputs:
            outs.append(self.inputs[ref] if kind == ARG_INPUT else self.values[ref])
        return outs[0] if self.plan.single_output else tuple(outs)

    def retry(self, st: StagePlan, exc: BaseException, attempt: int) -> bool:
        """Whether stage ``st`` runs again after failing with ``exc`` on ``attempt``; waits its
        backoff first, on the calling worker.

        Only instances of the stage's ``retry_on`` are retried, up to ``retries`` times. The
        wait is cut short when the run stops meanwhile (then False).
        """
        opts = st.options
        if attempt > opts.retries or self.stopped or not isinstance(exc, opts.retry_on):
            return False
        deadline = time.monotonic() + opts.retry_delay_s(attempt)
        while not self.stopped:
            left = deadline - time.monotonic()
            if left <= 0:
                return True
            time.sleep(min(left, 0.05))
        return False

    # -- placement --------------------------------------------------------------------
    def place(self, i: int, placement: Placement, variant: StagePlan) -> None:
        """Mixed stage ``i`` runs as ``variant`` (its CPU or its GPU form) this time."""
        self.placements[i] = placement
        self.open_placements[i] = placement
        self.stages[i] = variant

    def end_placement(self, i: int) -> Placement | None:
        """Stage ``i``'s placed execution ended: its decision, if still open (else None)."""
        return self.open_placements.pop(i, None)

    # -- timed stages -----------------------------------------------------------------
    def begin_timed(self, st: StagePlan, worker: Worker | None = None) -> bool:
        """Timed stage ``st`` starts (a CPU thread stage: on ``worker``, which the run abandons
        should the stage overrun, or still run when the run stops). A stage started again
        (after waiting for memory, or a retry) keeps its first start: its timeout covers all
        its attempts. False (nothing watched) once the run stopped: start nothing."""
        i = st.index
        with self.lock:
            if self.stopped:
                return False
            if worker is not None:
                self.timed_workers[i] = worker
            first = i not in self.timed_started
            if first:
                self.timed_started[i] = time.monotonic()
        if first:
            self._wake()  # the waiter arms a deadline for it
        return True

    def end_timed(self, st: StagePlan, worker: bool = False) -> bool:
        """Timed stage ``st`` finished: stop watching it. False (and the run failed) when it
        overran its timeout, or (``worker``: it began on one) the timeout took its worker."""
        i = st.index
        if worker and not self._keep_worker(i):
            return False  # timed out meanwhile, and its thread was abandoned
        t0 = self.timed_started.pop(i)
        assert st.timeout is not None
        if time.monotonic() - t0 > st.timeout:
            self.fail_timeout(st)
            return False
        return True

    def _keep_worker(self, i: int) -> bool:
        """Timed CPU thread stage ``i``'s function returned: False when its worker was abandoned meanwhile."""
        with self.lock:
            return self.timed_workers.pop(i, None) is not None

    # -- GPU recording and process jobs -------------------------------------------------
    def begin_recording(self) -> bool:
        """A GPU stage of this run starts recording; False (nothing counted) once the run stopped."""
        with self.lock:
            if self.stopped:
                return False
            self.recording += 1
            return True

    def recording_done(self) -> None:
        with self.lock:
            self.recording -= 1
            clean = self.stopped and self.recording == 0
        if clean:
            self.cleanup()

    def add_job(self, i: int, job: Job) -> bool:
        """Process stage ``i`` goes to the pool as ``job``; False (not kept: cancel it) once the
        run stopped. Known to the run before it can complete, or the run stop and cancel it."""
        with self.lock:
            if self.stopped:
                return False
            self.proc_jobs[i] = job
            return True

    def job_done(self, i: int) -> None:
        """Process stage ``i``'s job came back (returned, raised or crashed)."""
        with self.lock:
            self.proc_jobs.pop(i, None)

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

    def keep_upload(self, i: int, value: Any, blocks: list[Any]) -> None:
        """CPU value ``i``, uploaded as ``value`` (on ``blocks``) by its first GPU reader: kept
        for its other readers (plan.shared_uploads), unless the run stopped."""
        if self.hold(i, blocks):
            self.uploaded[i] = value

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
            self.host.placement_done(self, i, None)
        self.host.run_ended(self)
        self._wake()

    # -- values and counts ------------------------------------------------------------
    def set_value(self, i: int, *, host: Any = _KEEP, dev: Any = _KEEP) -> None:
        """Store stage ``i``'s value: on the host side (what CPU stages and the caller see)
        and what GPU stages see, unless the run's caller is gone."""
        with self.lock:
            if not self.forgotten:
                if host is not _KEEP:
                    self.values[i] = host
                if dev is not _KEEP:
                    self.dev_values[i] = dev

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
            self._end(None)  # the last stage: the run completed
        return ready_gpu, ready_cpu

    def stage_done(self) -> None:
        with self.lock:
            self.unfinished -= 1
            last = self.unfinished == 0
        if last:
            self._end(None)  # the last stage: the run completed

    # -- failures -----------------------------------------------------------------------
    def fail_stage(self, st: StagePlan, exc: BaseException, attempts: int = 1, worker: bool = False) -> None:
        """Stage ``st`` raised ``exc`` (on its last attempt): stop watching its timeout and fail
        the run, unless (``worker``: it began on one) the timeout took its worker meanwhile:
        then the run failed already, with the timeout."""
        if not st.simple:
            i = st.index
            self.timed_started.pop(i, None)
            if worker and not self._keep_worker(i):
                return
        self.fail(st, exc, attempts)

    def fail(self, st: StagePlan, exc: BaseException, attempts: int = 1) -> None:
        tries = f" after {attempts} attempts" if attempts > 1 else ""
        err = StageError(f"{stage_kind(st)} stage {st.name!r} failed{tries}: {type(exc).__name__}: {exc}", st.name)
        err.__cause__ = exc
        self.fail_with(err)

    def fail_timeout(self, st: StagePlan) -> None:
        exc = TimeoutError(f"stage {st.name!r} ran longer than its timeout of {st.timeout:g} s")
        err = StageError(f"{stage_kind(st)} stage {st.name!r} timed out after {st.timeout:g} s", st.name)
        err.__cause__ = exc
        self.fail_with(err)

    def fail_lost(self, st: StagePlan, reason: str, cause: BaseException) -> None:
        """The device was lost (``reason``) while GPU stage ``st`` was recorded or submitted."""
        lost = DeviceLostError(f"the GPU device was lost ({reason}) while stage {st.name!r} was recorded or "
                               "submitted; create a new Runtime")
        lost.__cause__ = cause
        self.fail_with(lost)

    def fail_with(self, err: BaseException) -> None:
        """Stop the run with ``err`` as its error (the first error wins; later ones are dropped)."""
        self._end(err)

    def _end(self, err: BaseException | None) -> None:
        """The run ends: completed (``err`` None) or failed with ``err``, unless it stopped before.

        A failed run gives up on its timed CPU thread stages still running (a completed one has
        none), and on its process jobs.
        """
        with self.lock:
            if self.stopped:
                return
            self.stopped = True
            self.done = err is None
            self.error = err
            clean = self.recording == 0
            hung = self._take_timed_workers()
        if err is None:
            self.tl.end = time.perf_counter_ns()
        else:
            self._cancel_processes()
        self._abandon(hung)
        if clean:
            self.cleanup()  # wakes the waiter
        else:
            self._wake()
