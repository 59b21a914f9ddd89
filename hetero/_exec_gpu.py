"""The GPU executor: GPU stages recorded on worker threads, committed to the queue, completed by fences.

Policy
------
* A GPU stage is ready as soon as the GPU work producing its inputs was *submitted*
  (the queue runs submissions in order, so a GPU consumer never waits for a fence).
* GPU stages are recorded on GPU worker threads (into one shared command encoder
  with one thread, else an encoder per stage), submitted with a submission index,
  and completed by the device's fence thread, which downloads values a CPU stage
  or the caller needs. A large stage (more than ``LARGE_STAGE_WORKGROUPS``
  workgroups, or, while a single run is active, a stage that brings the shared
  encoder to ``EARLY_SUBMIT_DISPATCHES`` dispatches) is submitted at once only while
  the GPU is idle; while it is busy the shared encoder keeps growing (a command
  buffer costs ~0.3 ms of host time on the H200).
* A CPU value that several GPU stages read is uploaded by the first of them and
  held (like a GPU value, one hold per reader) for the others, when one thread
  records (so the upload is queued before every reader).
* A stage that finds no memory within the budget is parked by the scheduler and
  recorded again once memory is freed (its timeout runs from its first start).
* Device loss is recognised by :func:`hetero._gpu.lost.reports_loss`; a stage that
  finds the device lost fails its run with :class:`~hetero.DeviceLostError`.

Recording one stage (:meth:`GpuExecutor.run`) goes through named steps:

1. ``_open``: the device, alive;
2. ``_call``: the stage function's attempts, its arguments uploaded (``device_args``),
   replayed where captured, its downloads staged (or it parks, or fails);
3. ``_hold_result``: the result's blocks held for its consumers, the span traced;
4. ``_commit``: its commands to the queue, with the fence callback (``_on_done``);
5. ``_keep_uploads``: shared uploads kept for their other readers;
6. ``_recorded``: its inputs let go, its value stored, its GPU consumers routed;
   a stage nobody waits on the host for is done here.

On the fence thread, :meth:`GpuExecutor.completed` brings the value to the host,
recycles staging and routes the CPU consumers.

State
-----
The GPU worker pool, the shared recorder (one recording thread), the upload hints
(buffers a stage's uploads had last time, so a replay finds its bind groups), and
the instants that share a submission's GPU time among its stages (placement).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ._gpu.capture import run_captured
from ._gpu.context import GPUContext, _Park
from ._gpu.recorder import SharedRecorder, StageRecorder
from ._gpu.tensor import Tensor, map_values
from ._plan import ARG_CONST, ARG_NODE, StagePlan
from ._workers import WorkerPool

if TYPE_CHECKING:
    from ._gpu.device import Device
    from ._run import Run
    from ._scheduler import Scheduler

__all__ = ["EARLY_SUBMIT_DISPATCHES", "GpuExecutor", "LARGE_STAGE_WORKGROUPS"]

log = logging.getLogger("hetero")
Recorder = SharedRecorder | StageRecorder

# A stage dispatching more workgroups than this is submitted on its own rather than
# coalesced with its neighbours: its GPU time dwarfs the cost of a submission.
LARGE_STAGE_WORKGROUPS = 1 << 14
# The only active run's stage whose commit finds the GPU idle is submitted at once, with
# the stages before it in the shared encoder, when that encoder holds at least this many
# dispatches: the GPU runs them while the run's next stages are recorded, instead of idling
# until its fence. With several runs in flight the recording thread is the bottleneck and
# every submission costs it ~0.3 ms on the H200, so their stages are not submitted early.
EARLY_SUBMIT_DISPATCHES = 8
# Stages (and shapes) whose upload buffers are remembered (see device_args); past it the memory starts afresh.
_UPLOAD_HINTS = 256


class GpuExecutor:
    """Records GPU stages on its worker pool (``hetero-gpu-N`` threads) and completes them."""

    def __init__(self, sched: Scheduler, threads: int, device: Callable[[], Device],
                 device_if_open: Callable[[], Device | None], submit_batch: int, capture: bool,
                 zero_copy_outputs: bool) -> None:
        self._sched = sched
        self._dispatch = sched.dispatch
        self.tracer = sched.tracer
        self.pool = WorkerPool("hetero-gpu", threads, on_idle=self._idle)
        self._device = device
        self._device_if_open = device_if_open
        self.submit_batch = submit_batch
        self.capture = capture  # honour stages declared with capture=True (see hetero._gpu.capture)
        # Graph outputs: zero-copy where the staging ring can reuse memory ("auto"), else copied.
        self._output_zero_copy: bool | str = "auto" if zero_copy_outputs else False
        self._shared: SharedRecorder | None = None
        self._shared_dev: Device | None = None
        self._upload_hints: dict[Any, tuple[StagePlan, list[Any]]] = {}  # see device_args
        # GPU service times (placement): stages submitted together share their submission's
        # time equally; it runs from the later of its submission and the previous one's end.
        self._last_gpu_done = 0  # completion instant of the latest GPU stage
        self._sub_stages: dict[int, int] = {}  # submission instant -> stages it holds
        self._sub_start = (0, 0)  # (submission instant, when its GPU work began) of the latest completing

    def run(self, run: Run, i: int) -> None:
        """A GPU worker's job: record stage ``i`` of ``run`` and commit it to the queue."""
        if not run.begin_recording():
            return
        st = run.stages[i]
        try:
            self._record(run, st)
        except BaseException as e:  # noqa: BLE001 - a defect here must fail the run, not end the thread
            log.exception("recording GPU stage %r failed outside the stage function", st.name)
            run.fail(st, e)
        finally:
            run.recording_done()

    def _record(self, run: Run, st: StagePlan) -> None:
        """The steps of recording one stage (see the module docstring); each returns early,
        having failed, parked or dropped the stage, by returning None or False."""
        i = st.index
        run.tl.started[i] = time.perf_counter_ns()
        if not st.simple:
            run.begin_timed(st)  # again after waiting for memory: it keeps its first start
        dev = self._open(run, st)
        if dev is None:
            return
        rec = self._recorder(dev)
        # One recording thread records in queue order, so an upload recorded for one
        # reader is in place for every later one; several threads could reorder them.
        share = run.plan.shared_uploads if rec.shared and not st.mixed else {}
        with rec.lock, dev.submission.recording():
            called = self._call(run, st, dev, rec, share)
            if called is None:
                return
            result, ctx, fresh, attempt = called
            if not self._hold_result(run, st, result, rec, ctx):
                return
            if not self._commit(run, st, dev, result, rec, ctx, attempt):
                return
            if fresh:
                _keep_uploads(run, fresh)
            ctx.release_blocks()
        self._recorded(run, st, result, bool(share))

    def _open(self, run: Run, st: StagePlan) -> Device | None:
        """Step 1: the device, alive; None (the run failed) when there is none or it was lost."""
        try:
            dev = self._device()
            dev.check_alive()
        except BaseException as e:  # noqa: BLE001 - e.g. no adapter
            run.fail(st, e)
            return None
        return dev

    def _call(self, run: Run, st: StagePlan, dev: Device, rec: Recorder, share: dict[int, int]
              ) -> tuple[Any, GPUContext, dict[int, Any], int] | None:
        """Step 2: call the stage function (replay its capture) until an attempt succeeds.

        Returns its result, its context, the shared uploads it made (``fresh``) and the
        attempt; None when the stage parked (waiting for memory) or failed the run.
        """
        i = st.index
        tl = run.tl
        attempt = 0
        while True:
            attempt += 1
            ctx = GPUContext(dev, st.name, overcommit=self._sched.is_oldest(run), recorder=rec)
            span = rec.begin_stage_span(st.name, ("stage", tl, i, run.seq))
            fresh: dict[int, Any] = {}
            try:
                args, kwargs = device_args(run, st, ctx, share, fresh, self._upload_hints)
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
                return result, ctx, fresh, attempt
            except _Park as park:
                rec.end_span(span)
                _abandon(rec, ctx)
                self._sched.park(run, i, park.wait.generation)
                return None
            except BaseException as e:  # noqa: BLE001 - nothing a stage raises may kill a worker
                rec.end_span(span)
                _abandon(rec, ctx)
                if _failed_by_loss(run, st, dev, e):
                    return None
                if not run.retry(st, e, attempt):
                    run.fail_stage(st, e, attempt)
                    return None

    def _hold_result(self, run: Run, st: StagePlan, result: Any, rec: Recorder, ctx: GPUContext) -> bool:
        """Step 3: the value keeps the blocks of the tensors it holds until its last consumer is
        recorded (and its download, if any, is done); False (the stage dropped) once the run stopped.

        Everything else the stage took goes back to the pool at step 5: whatever reuses it is
        recorded later, so runs later.
        """
        i = st.index
        tl = run.tl
        blocks = {id(b): b for b in _blocks_of(result)}
        if not run.hold(i, list(blocks.values())):
            _abandon(rec, ctx)  # the run stopped meanwhile
            return False
        tl.recorded[i] = time.perf_counter_ns()
        if self.tracer is not None:
            targs = run.span_args(i)
            if tl.capture[i] is not None:
                targs["capture"] = tl.capture[i]
            self.tracer.span(st.name, "gpu-record", tl.started[i], tl.recorded[i], args=targs)
        return True

    def _commit(self, run: Run, st: StagePlan, dev: Device, result: Any, rec: Recorder, ctx: GPUContext,
                attempt: int) -> bool:
        """Step 4: hand the stage's commands to the queue; False (the run failed) when the
        stage's own encoder failed or the device was lost."""
        on_done = self._on_done(run, st, dev, result, ctx)
        tl = run.tl
        i = st.index
        sub_stages = self._sub_stages

        def on_submit(t_ns: int) -> None:
            tl.submitted[i] = t_ns
            sub_stages[t_ns] = sub_stages.get(t_ns, 0) + 1

        def on_error(err: BaseException) -> None:
            if not _failed_by_loss(run, st, dev, err):
                run.fail(st, err)

        try:
            # A large stage (or enough of a lone run, see EARLY_SUBMIT_DISPATCHES) goes out at
            # once only while the GPU has nothing to do; while it is busy the encoder keeps
            # growing (a command buffer costs ~0.3 ms of host time on the H200) and goes out
            # with the next such stage that finds it idle.
            early = ctx.workgroups > LARGE_STAGE_WORKGROUPS or (rec.dispatches >= EARLY_SUBMIT_DISPATCHES
                                                                and self._sched.active_runs() == 1)
            rec.commit(on_done, on_error, flush=st.fence or (early and dev.idle), on_submit=on_submit)
        except BaseException as e:  # noqa: BLE001 - the stage's own encoder failed, or the device was lost
            if not _failed_by_loss(run, st, dev, e):
                run.fail(st, e, attempt)
            ctx.discard()
            return False
        return True

    def _on_done(self, run: Run, st: StagePlan, dev: Device, result: Any, ctx: GPUContext) -> Callable[[], None]:
        """The fence callback of a committed stage: its GPU time measured, then (when something
        waits for it on the host, or its staging is to recycle) its completion."""
        tl = run.tl
        i = st.index
        uploads = ctx.uploads
        sched = self._sched

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
                sched.placement_done(run, i, (tl.recorded[i] - tl.started[i] + max(service, 0)) / 1e9)
            if st.fence or uploads:
                try:
                    sched._gpu_completed(run, st, dev, result, ctx, uploads)
                except BaseException as e:  # noqa: BLE001 - the run fails rather than never ending
                    log.exception("completing GPU stage %r failed", st.name)
                    run.fail(st, e)

        return on_done

    def _recorded(self, run: Run, st: StagePlan, result: Any, shared: bool) -> None:
        """Step 6: let go of the inputs, store the value, route the GPU consumers; a stage no
        CPU stage or caller waits for is done here (else on the fence thread)."""
        i = st.index
        for d in st.gpu_deps:
            run.drop_hold(d)
        for d in run.plan.shared_reads.get(i, ()) if shared else ():
            run.drop_hold(d)
        if st.fence:
            run.set_value(i, dev=result)  # the host side arrives with the download
        else:
            run.set_value(i, host=result, dev=result)
        run.drop_hold(i)  # the recording hold: from here only consumers and the download keep it
        if st.gpu_consumers:
            ready = run.release(st.gpu_consumers)
            if ready:
                self._dispatch(run, ready)
        if not st.fence:
            if not st.simple and not run.end_timed(st):
                return
            run.stage_done()

    def completed(self, run: Run, st: StagePlan, dev: Device, result: Any, ctx: GPUContext,
                  uploads: list[Any]) -> None:
        """On the fence thread: the stage's GPU work finished; bring values to the host, recycle
        staging, route the CPU consumers."""
        if uploads:
            def recycle() -> None:
                for ticket in uploads:
                    ticket.complete()

            dev.defer(recycle)  # the staging goes back once this fence's results are delivered
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
                    stats = dev.pool.stats()
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
                self._dispatch(run, ready)
        run.stage_done()

    def _recorder(self, dev: Device) -> Recorder:
        """The shared encoder with one recording thread; an encoder per stage with several."""
        if self.pool.size > 1:
            return StageRecorder(dev)
        if self._shared is None or self._shared_dev is not dev:
            self._shared = SharedRecorder(dev, self.submit_batch)
            self._shared_dev = dev
            dev.share_encoders(self._shared)
        return self._shared

    def _idle(self) -> None:
        """The last busy GPU worker found the queue empty: what is recorded goes out."""
        dev = self._device_if_open()
        if dev is not None:
            dev.flush()

    def close(self) -> None:
        self.pool.close()


def _abandon(rec: Recorder, ctx: GPUContext) -> None:
    """A stage failed or parked: its blocks go back; its tickets settle once its commands ran."""
    ctx.release_blocks()
    rec.abandon(lambda: ctx.settle(ran=rec.shared))


def _keep_uploads(run: Run, fresh: dict[int, Any]) -> None:
    """Step 5: the CPU values this stage uploaded for every reader are kept for the others."""
    for d, up in fresh.items():
        run.keep_upload(d, up, list({id(b): b for b in _blocks_of(up)}.values()))


def _failed_by_loss(run: Run, st: StagePlan, dev: Device, e: BaseException) -> bool:
    """Fail ``run`` with DeviceLostError if the device was lost (probed first when ``e``
    reports a loss: that fails every active run); False, nothing done, while it is not."""
    reason = dev.lost_after(e)
    if reason is None:
        return False
    run.fail_lost(st, reason, e)  # whichever thread noticed first, this run fails the same way
    return True


def device_args(run: Run, st: StagePlan, ctx: GPUContext, share: dict[int, int], fresh: dict[int, Any],
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
    """Where an argument array goes until it is uploaded (``device_args``)."""

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
