"""Where GPU stages record their commands: a shared encoder, or one encoder per stage.

A command buffer costs about ten times the host time of a further dispatch in an open
encoder (BENCHMARKS.md, "Where the rules of the GPU runtime come from"), so small GPU
stages share command encoders, and consecutive dispatches share a compute pass. Two
recorders:

* :class:`SharedRecorder` (one GPU recording thread, the default): every stage
  appends its dispatches to one open encoder, into one open compute pass until a
  copy needs the pass closed. The encoder is finished and enqueued
  when a stage needs a fence (a CPU stage or the caller waits for it), when it holds
  ``max_stages`` stages, when a large stage (or, for a lone run, enough dispatches)
  was recorded while the GPU is idle,
  when the GPU goes idle with committed stages waiting (from the fence thread),
  when the recording thread goes idle, and before the buffer pool destroys memory.
  Consumers of a stage may be recorded right after it: the one thread records them
  later, into the same encoder or a later one, so queue order is kept.
* :class:`StageRecorder` (several recording threads): one encoder per stage,
  finished and enqueued when the stage is done. Needed when stages are recorded
  concurrently, since the order of two threads' encoders is not known in advance.

A stage that fails half-way leaves its commands in a shared encoder (a command
encoder cannot drop commands). They still run; they only touch buffers the stage
could reach, and its staging tickets are settled once they did. hetero checks
what it can before recording (bindings, sizes, workgroup counts, buffers bound for
reading and writing at once) so that no deferred validation error poisons an
encoder shared with other stages; if one does, every stage recorded into it fails
with an error that says so.
"""

from __future__ import annotations

import threading
import time
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, Callable

from .._trace import GPU_DISPATCHES, GPU_QUEUE
from .passcmd import addr, write_buffer
from .submission import each

if TYPE_CHECKING:
    import numpy as np

    from .device import Device
    from .timing import TimerFrame

__all__ = ["SharedRecorder", "StageRecorder"]

Callback = Callable[[], None]
ErrorCallback = Callable[[BaseException], None]
SubmitCallback = Callable[[int], None]


class _Budget:
    """Estimated GPU time of the open encoder, what it holds (for calibration), its timestamps."""

    _dev: Device
    _frame: TimerFrame | None
    _pass: Any

    def _init_timing(self) -> None:
        timer = self._dev.timer
        self._frame = timer.frame() if timer.strategy == "inside-passes" else None
        self._epoch = 0  # bumped whenever the frame is resolved: older handles are void

    def begin_stage_span(self, label: str, meta: Any) -> tuple[int, int]:
        """Like :meth:`begin_span`, for a whole stage: only when per-stage GPU timing is on."""
        if not self._dev.stage_timing:
            return (-1, -1)
        return self.begin_span(label, meta)

    def begin_span(self, label: str, meta: Any) -> tuple[int, int]:
        """Start a GPU timestamp span at the current position (a void handle when not timing)."""
        if self._frame is None:
            return (-1, -1)
        return (self._epoch, self._frame.begin(self._target(), label, meta))

    def end_span(self, handle: tuple[int, int]) -> None:
        """End a span; a no-op if its encoder was submitted meanwhile (it was closed there)."""
        epoch, h = handle
        if self._frame is not None and h >= 0 and epoch == self._epoch:
            self._frame.end(self._target(), h)

    def begin_pass_span(self, pass_address: Any, label: str, meta: Any) -> int:
        """:meth:`begin_span` for a loop that issues its commands into the open compute pass at
        ``pass_address`` (:mod:`hetero._gpu.passcmd`); end it with :meth:`end_pass_span` before
        that pass ends."""
        return -1 if self._frame is None else self._frame.begin_in_pass(pass_address, label, meta)

    def end_pass_span(self, pass_address: Any, handle: int) -> None:
        if handle >= 0 and self._frame is not None:
            self._frame.end_in_pass(pass_address, handle)

    @property
    def encoder(self) -> Any:  # pragma: no cover - overridden
        raise NotImplementedError

    def write_now(self, items: list[tuple[np.ndarray, Any, int]]) -> bool:
        """Write small uploads ``(array, buffer, offset)`` through the queue instead of staging
        copies in the encoder, where that is safe; False (nothing written) where it is not."""
        return False

    def _target(self) -> Any:
        """Where a timestamp goes now: the open compute pass, else the encoder."""
        return self._pass if self._pass is not None else self.encoder

    def _resolve_timing(self, encoder: Any) -> Callback | None:
        """Before ``encoder.finish()``: resolve its timestamps; the callback reads them after the fence."""
        if self._frame is None or self._frame.empty:
            return None
        self._epoch += 1
        ticket = self._frame.resolve(encoder)
        if ticket is None:
            return None
        dev = self._dev
        # Only cost-model samples (no stage spans, no trace): read once the results of the
        # submission are delivered.
        late = not dev.stage_timing and dev.tracer is None

        def read() -> None:
            timer, tracer = dev.timer, dev.tracer
            spans = timer.read(ticket)
            for span in spans:
                kind, *rest = span.meta
                if kind == "stage":  # ("stage", timeline, index, run seq)
                    timeline, i = rest[0], rest[1]
                    timeline.gpu_ns[i] = (timeline.gpu_ns[i] or 0) + span.end_ns - span.start_ns
                elif kind == "dispatch":
                    key, workgroups = rest[0], rest[1]
                    dev.cost.observe(key, workgroups, span.end_ns - span.start_ns, source="timestamp")
            if tracer is not None:
                off = timer.offset_ns
                events = []
                for span in spans:
                    meta = span.meta
                    if meta[0] == "stage":
                        events.append((span.label, span.start_ns + off, span.end_ns + off,
                                       {"stage": span.label, "run": meta[3]}, GPU_QUEUE))
                    else:
                        args: dict[str, Any] = {"workgroups": meta[2]}
                        if len(meta) > 3:  # ("dispatch", key, workgroups, "replayed")
                            args["replayed"] = True
                        events.append((span.label, span.start_ns + off, span.end_ns + off, args, GPU_DISPATCHES))
                tracer.gpu_spans(events)

        if late:
            return lambda: dev.defer(read)
        return read

    def _reset_budget(self) -> None:
        self.est_ns = 0.0
        self.dispatches = 0  # recorded into the open encoder (or this stage's) since it was last submitted
        self._work: dict[Any, int] = {}

    def note(self, key: Any, workgroups: int, est_ns: float) -> None:
        """A dispatch of ``workgroups`` of kernel ``key`` was recorded."""
        self.est_ns += est_ns
        self.dispatches += 1
        self._work[key] = self._work.get(key, 0) + workgroups

    def note_many(self, est_ns: float, dispatches: int, work: dict[Any, int]) -> None:
        """:meth:`note` for ``dispatches`` dispatches at once: ``work`` holds workgroups per kernel."""
        self.est_ns += est_ns
        self.dispatches += dispatches
        mine = self._work
        for key, workgroups in work.items():
            mine[key] = mine.get(key, 0) + workgroups

    def reserve(self, est_ns: float) -> int:
        """Before recording ``est_ns`` more: end the submission first if the budget would be
        exceeded (and it holds anything). Returns the number of submissions ended (0 or 1)."""
        if self.est_ns > 0 and self.est_ns + est_ns > self._dev.cost.budget_ns:
            self.split()
            return 1
        return 0

    def split(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def _calibration(self) -> Callback | None:
        """A completion callback that refines the cost model from this submission's wall time."""
        if len(self._work) != 1 or self.est_ns <= 0:
            return None
        (key, workgroups), = self._work.items()
        cost, t0 = self._dev.cost, time.perf_counter_ns()

        def observe() -> None:
            ns = time.perf_counter_ns() - t0 - _FENCE_OVERHEAD_NS
            if ns >= _MIN_CALIBRATION_NS:  # shorter ones are all overhead
                cost.observe(key, workgroups, ns, source="wall")

        return observe


# Submissions shorter than this say nothing about a kernel's cost; the round trip of an
# empty submission (~0.1-0.2 ms) is subtracted from longer ones.
_MIN_CALIBRATION_NS = 2_000_000
_FENCE_OVERHEAD_NS = 200_000


class StageRecorder(_Budget):
    """One command encoder per stage (for concurrent recording threads)."""

    shared = False

    def __init__(self, device: Device) -> None:
        self._dev = device
        self._encoder: Any = None
        self._pass: Any = None
        self._ended: list[Any] = []  # passes ended in the open encoder, let go with it (see _enqueue)
        self.lock: AbstractContextManager[Any] = nullcontext()
        self._reset_budget()
        self._init_timing()

    @property
    def encoder(self) -> Any:
        """The encoder, with no pass open (ready for copies or a pass of the caller's)."""
        if self._pass is not None:
            self._pass.end()
            self._ended.append(self._pass)
            self._pass = None
        if self._encoder is None:
            self._encoder = self._dev.device.create_command_encoder()
        return self._encoder

    def compute_pass(self) -> Any:
        """The open compute pass; consecutive dispatches share it (each dispatch is its own
        usage scope, so WebGPU still orders their storage writes)."""
        if self._pass is None:
            self._pass = self.encoder.begin_compute_pass()
        return self._pass

    def commit(self, on_done: Callback | None, on_error: ErrorCallback, *, flush: bool,
               on_submit: SubmitCallback | None = None) -> None:
        """The stage is recorded: finish its encoder and enqueue it (raises if that fails)."""
        self._enqueue(on_done, flush=flush, on_submit=on_submit)

    def split(self) -> None:
        """The GPU-time budget is reached mid-stage: submit what the stage recorded so far."""
        self._enqueue(None, flush=True)

    def _enqueue(self, on_done: Callback | None, *, flush: bool, on_submit: SubmitCallback | None = None) -> None:
        """Finish the open encoder and enqueue it; it and its passes are let go on the fence
        thread (see Submission.drop_later), as the shared recorder's are."""
        calibrate = self._calibration()
        encoder, self._encoder = self.encoder, None
        ended, self._ended = self._ended, []
        self._reset_budget()
        timing = self._resolve_timing(encoder)
        command_buffer = encoder.finish()
        drop = self._dev.submission.drop_later([encoder, *ended])
        self._dev.enqueue(command_buffer, _chain([c for c in (calibrate, timing, on_done, drop) if c is not None]),
                          flush=flush, on_submit=on_submit)

    def abandon(self, settle: Callback) -> None:
        """The stage failed before commit: nothing of it will run, settle at once."""
        self._encoder = self._pass = None
        self._ended = []
        if self._frame is not None:
            self._frame.discard()
        settle()

    def flush(self) -> None:
        pass


class SharedRecorder(_Budget):
    """One open command encoder shared by consecutive stages of one recording thread."""

    shared = True

    def __init__(self, device: Device, max_stages: int) -> None:
        self._dev = device
        self.max_stages = max_stages
        self.lock = threading.RLock()  # held while a stage records, and to finish the encoder
        self._encoder: Any = None
        self._pass: Any = None
        self._ended: list[Any] = []  # passes ended in the open encoder, let go with it (see _finish)
        self._stages = 0
        self._done: list[Callback] = []
        self._errors: list[ErrorCallback] = []
        self._submitted: list[SubmitCallback] = []
        self._reset_budget()
        self._init_timing()

    @property
    def encoder(self) -> Any:
        """The open encoder, with no pass open (ready for copies or a pass of the caller's)."""
        with self.lock:
            if self._pass is not None:
                self._pass.end()
                self._ended.append(self._pass)
                self._pass = None
            if self._encoder is None:
                self._encoder = self._dev.device.create_command_encoder(label="hetero-shared")
            return self._encoder

    def write_now(self, items: list[tuple[np.ndarray, Any, int]]) -> bool:
        """Write ``(array, buffer, offset)`` items through the queue (``wgpuQueueWriteBuffer``),
        when no recorded command waits to be submitted; False (nothing written) otherwise.

        The rule. A queue write lands at the start of the next submission, before its command
        buffers, whereas blocks go back to the pool when their stage commits (the pool's
        lifetime rule), possibly before the shared encoder holding its commands is submitted.
        A block taken while this encoder or the submission's batch holds commands may be one
        of theirs, so its write must be a copy ordered after them in the encoder. With both
        empty, every command that used any pooled block was submitted, and the write is
        ordered after it by the queue. The check and the writes hold the lock under which
        commands are recorded and finished into the batch.

        Why: a lone run's token ids are a few small arrays, for which writes cost the recording
        thread several times less than a staging buffer, its copies and its map back.
        """
        with self.lock:
            if self._encoder is not None or self._dev.submission.pending():
                return False
            queue = addr(self._dev.queue)
            for a, buffer, offset in items:
                write_buffer(queue, buffer, offset, a)
            return True

    def compute_pass(self) -> Any:
        """The open compute pass, shared by consecutive dispatches of consecutive stages."""
        with self.lock:
            if self._pass is None:
                self._pass = self.encoder.begin_compute_pass()
            return self._pass

    def commit(self, on_done: Callback | None, on_error: ErrorCallback, *, flush: bool,
               on_submit: SubmitCallback | None = None) -> None:
        with self.lock:
            self._stages += 1
            if on_done is not None:
                self._done.append(on_done)
            if on_submit is not None:
                self._submitted.append(on_submit)
            self._errors.append(on_error)
            if flush or self._stages >= self.max_stages:
                self._finish(flush=True)

    def abandon(self, settle: Callback) -> None:
        """A failed stage's commands stay in the encoder: settle its tickets once they ran."""
        with self.lock:
            if self._encoder is None:
                settle()
            else:
                self._done.append(settle)

    def flush(self) -> None:
        """Finish and enqueue the open encoder, if any (and submit)."""
        with self.lock:
            if self._encoder is not None:
                self._finish(flush=True)

    def split(self) -> None:
        """The GPU-time budget is reached (mid-stage, on the recording thread): submit the open encoder now."""
        with self.lock:
            if self._encoder is not None:
                self._finish(flush=True)

    def flush_if_free(self) -> None:
        """The GPU went idle (on the fence thread): submit committed stages, unless a stage is
        being recorded right now. Then they go with that stage if its commit submits (a fence,
        a large stage or a lone run's, see ``hetero._scheduler``), else with the next stage that
        does, or when the recording workers run out of stages.

        The recorder is held only to finish the encoder: the submission's lock is taken
        before the recorder is let go (so whatever is recorded next is enqueued after this),
        and the submission itself (a few hundred microseconds of host time on a large GPU)
        runs while the recording thread records the next stage.
        """
        if not self.lock.acquire(blocking=False):
            return
        if self._encoder is not None and self._stages > 0:
            self._finish(flush=True, handoff=self.lock)  # lets the lock go, whatever happens
        else:
            self.lock.release()

    def _finish(self, *, flush: bool, handoff: Any = None) -> None:
        """Finish the open encoder and enqueue it. ``handoff``: the recorder's lock, held once by
        this thread, which is released in every case: as soon as the submission's lock is held,
        or when nothing is submitted. Ending the pass, resolving timestamps, finishing and the
        submission this causes are one step: if any fails, every stage recorded into the encoder
        fails with that error."""
        compute_pass, encoder, ended = self._pass, self._encoder, self._ended
        done, errors, submitted = self._done, self._errors, self._submitted
        self._pass, self._encoder, self._done, self._errors, self._submitted, self._stages = None, None, [], [], [], 0
        self._ended = []
        calibrate = self._calibration()
        self._reset_budget()
        if encoder is None:
            if handoff is not None:
                handoff.release()
            for cb in done:
                cb()
            return

        def failed(e: BaseException) -> None:
            err = RuntimeError(
                f"the command encoder shared by {len(errors)} stage(s) failed: {type(e).__name__}: {e}"
            )
            err.__cause__ = e
            for on_error in errors:
                on_error(err)
            for cb in done:  # nothing was submitted: settle tickets and holds now
                cb()

        try:
            if compute_pass is not None:
                compute_pass.end()
            timing = self._resolve_timing(encoder)
            if timing is not None:
                calibrate = _chain([c for c in (calibrate, timing) if c is not None])
            command_buffer = encoder.finish()
            # the pass and the encoder are let go on the fence thread (see Submission.drop_later)
            keep = [compute_pass, encoder, *ended]
            callbacks = _chain(([calibrate] if calibrate else []) + done + [self._dev.submission.drop_later(keep)])
            if handoff is None:
                self._dev.enqueue(command_buffer, callbacks, flush=flush, on_submit=_chain_submitted(submitted))
            else:
                with self._dev.submission.ordered(handoff):
                    handoff = None
                    self._dev.enqueue(command_buffer, callbacks, flush=flush, on_submit=_chain_submitted(submitted),
                                      locked=True)
        except BaseException as e:  # noqa: BLE001 - reported to every stage recorded here
            if handoff is not None:
                handoff.release()
            failed(e)


def _chain(callbacks: list[Callback]) -> Callback | None:
    """One fence callback for several (a failing one does not keep the others from running)."""
    if not callbacks:
        return None
    return callbacks[0] if len(callbacks) == 1 else each(callbacks)


def _chain_submitted(callbacks: list[SubmitCallback]) -> SubmitCallback | None:
    if not callbacks:
        return None

    def run_all(t_ns: int) -> None:
        for cb in callbacks:
            cb(t_ns)

    return run_all
