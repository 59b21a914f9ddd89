"""Submission and fences: one device's queue, its batch of command buffers, its fence thread.

Fence design. ``queue.on_submitted_work_done`` raises ``TypeError`` in wgpu 0.32.0,
so hetero does not use it. Each submission goes through wgpu-native's
``wgpuQueueSubmitForIndex``, which returns a submission index, and one fence
thread per device blocks in ``wgpuDevicePoll(wait=True, index)`` for the oldest
pending index, then runs that submission's completion callback (downloads, waking
consumers). The event loop never blocks; submissions resolve in submission order.
Each submission also registers a work-done callback, which marks it complete from
whichever device poll sees it finish first. A coroutine awaiting one submission
(``Submission.fence()``, see ``fence``) polls from the loop first and is woken by the
fence thread only after that.
This reaches below wgpu-py's Python API into its cffi binding, which is why
pyproject.toml pins wgpu to the tested version.

Who submits. Whoever flushes: the recording thread submits its own flushes (a fence, a
lone run's early submission, the GPU-time split) in the call, and the fence thread the
batch collected while the GPU was busy. A submission costs a few hundred microseconds of
host time on a large GPU, nearly all of it in C with the GIL released, so handing it to a
thread of its own looks free; it is not: that thread needs the GIL before and after the
call, and the recording thread, replaying the next stage, keeps it. On the H200 a lone
run's first stage reached the GPU 1.5 ms after it was recorded that way, against 0.46 ms
submitted in place (BENCHMARKS.md, eleventh session).

Closing. A submission that names a destroyed buffer aborts the process inside
``wgpuQueueSubmit``, so teardown and submission exclude each other: every
submission happens under ``_queue_lock`` and checks ``closed``; ``close()``
submits what is batched, sets ``closed`` under that lock and drains the fence
thread; only then does the device destroy memory. A recording thread still busy
after that gets :class:`~hetero.errors.RuntimeClosedError` from ``enqueue``/``submit``
and nothing reaches the queue.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import os
import queue
import sys
import threading
import time
import weakref
from typing import Any, Callable, Iterator, Protocol

from wgpu.backends.wgpu_native._ffi import lib as _raw_lib

from .fence import Fence
from .lost import LossWatch
from .._trace import Tracer
from ..errors import RuntimeClosedError

__all__ = ["FENCE_SPIN_US", "OpenEncoder", "Submission", "each"]

log = logging.getLogger("hetero")

# How long close() waits for the fence thread to see the last submission complete.
CLOSE_WAIT_S = 10.0
# Deferred fence callbacks (Submission.defer) pending at most: past this they run at once.
MAX_DEFERRED = 64


class OpenEncoder(Protocol):
    """A recorder that may hold finished stages in an encoder not yet submitted."""

    def flush(self) -> None:
        """Finish the open encoder and enqueue it (before a flush submits the batch)."""

    def flush_if_free(self) -> None:
        """The same, unless a stage is recording into it now (when the GPU went idle)."""


class Submission:
    """One device's queue: the ordered batch of command buffers, submission indices, the fence thread."""

    def __init__(self, device: Any, loss: LossWatch, *, max_batch: int = 32, tracer: Tracer | None = None) -> None:
        self.device = device  # the wgpu device
        self.queue = device.queue
        self.loss = loss
        self.tracer = tracer
        # How long the fence thread looks for the next fence before it sleeps (see _next_fence).
        self.fence_spin_s = _fence_spin_s()
        # How the fence thread waits after that (see _await_completion, HETERO_FENCE_POLL_US).
        self.fence_poll_s = _fence_poll_s()
        # A SimpleQueue (C-implemented) wakes the fence thread faster than a Condition.
        self._fences: queue.SimpleQueue[tuple[int, Callable[[], None]] | None] = queue.SimpleQueue()
        self._deferred: list[Callable[[], None]] = []  # housekeeping for when no fence waits (fence thread only)
        self.closed = False  # set under _submit_lock and _queue_lock: nothing is submitted after it
        self._queue_lock = threading.Lock()  # held around every queue submission (after _submit_lock)
        # Command buffers recorded but not yet submitted, in dependency order.
        self.max_batch = max_batch
        self._batch: list[Any] = []
        self._batch_callbacks: list[Callable[[], None]] = []
        self._batch_submitted: list[Callable[[int], None]] = []
        self._submit_lock = threading.Lock()
        self._inflight = 0  # our submissions not yet completed
        self._fence_polling = False  # the fence thread is polling for a submission (see completed())
        # Submission indices: the newest submitted, and the newest known to be complete
        # (advanced by the fence thread and by non-blocking polls; see completed()).
        self._submitted = -1
        self._completed = -1
        self._index_lock = threading.Lock()
        self._sleepers: list[tuple[int, threading.Lock]] = []  # Fence.wait between polls
        # Recorders holding open encoders (see share_encoders).
        self._open_encoders: list[OpenEncoder] = []
        # One token per stage being recorded now, on any thread (see recording()): list
        # appends and pops are atomic, so no lock is taken on the recording path.
        self._recording: list[None] = []
        self.submissions = 0
        self._fence_thread = threading.Thread(target=self._fence_loop, name="hetero-fence", daemon=True)
        self._fence_thread.start()
        # wgpu-py's cffi module: submission indices and blocking polls.
        from wgpu.backends.wgpu_native import _api

        self._ffi, self._lib, self._new_array = _api.ffi, _api.libf, _api.new_array
        _poll_promises_without_blocking(device, self._lib, self._ffi)
        self._work_done = _work_done_callback(self._ffi)
        self._key = next(_submission_keys)
        _SUBMISSIONS[self._key] = self

    def share_encoders(self, recorder: OpenEncoder) -> None:
        """Let ``recorder`` finish its open encoder before every flush, and send it when the GPU goes idle.

        A recorder holding finished stages in an open encoder sends them when the GPU has
        nothing of ours left, rather than at its next stage (the GPU would idle for a
        stage's recording time).
        """
        self._open_encoders.append(recorder)

    def check_alive(self) -> None:
        self.loss.check_alive()

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeClosedError("the GPU device of this Runtime is closed: nothing more can be submitted; "
                                     "create a new Runtime")

    def submit(self, command_buffers: list[Any]) -> int:
        """Submit in one call and return the submission index (refused once the device is closed)."""
        return self._submit_now(command_buffers)

    def _submit_now(self, command_buffers: list[Any]) -> int:
        t0 = time.perf_counter_ns() if self.tracer is not None else 0
        handles = self._new_array("WGPUCommandBuffer[]", [cb._internal for cb in command_buffers])
        with self._queue_lock:
            self._check_open()
            self.check_alive()
            index = int(self._lib.wgpuQueueSubmitForIndex(self.queue._internal, len(command_buffers), handles))
        if self.tracer is not None:
            self.tracer.span(f"submit #{index}", "submit", t0, time.perf_counter_ns(),
                             args={"command_buffers": len(command_buffers)})
        with self._index_lock:
            if index > self._submitted:
                self._submitted = index
        self._register_work_done(index)
        return index

    def fence(self) -> Fence:
        """Submit everything recorded so far and return the ``Fence`` of the newest submission."""
        self.flush()
        return Fence(self, self._submitted)

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Around a stage's recording: meanwhile the fence thread's spin pauses between its
        turns (see :meth:`_spin_pause`)."""
        self._recording.append(None)
        try:
            yield
        finally:
            self._recording.pop()

    def _spin_pause(self) -> None:
        """One pause of the fence thread's spin while it polls a submission: none while no stage
        is being recorded (a finished submission is seen at once), else :data:`FENCE_SPIN_PAUSE_S`.

        Each turn of the spin takes the interpreter lock, and a stage's recording gives the
        lock up in every wgpu-py call (creating its encoder and pass, finishing, submitting):
        a spinner turning without pause takes the lock at each of those, and the recording
        thread waits to get it back every time. On the H200 the recording thread spent
        about 150 us less CPU per lone call with the pause; 0, 20 and 50 us made no
        difference to a batch-32 pass that the machine's drift did not swamp (BENCHMARKS.md,
        sixteenth session). Short, so that a busy GPU's completions are still seen soon.
        """
        time.sleep(FENCE_SPIN_PAUSE_S if self._recording else 0)

    def completed(self, index: int) -> bool:
        """Whether submission ``index`` completed, without blocking (safe on the event loop).

        Completion is learnt from the fence thread's waits and from the work-done
        callback registered with each submission, which fires inside whichever device
        poll sees the work finished: a non-blocking one made here included (unless the
        fence thread is polling, which then reports it). Monotonic: once an index is
        complete, every earlier one is too.
        """
        if index <= self._completed:
            return True
        self.check_alive()
        # While the fence thread polls, leave the report to it: a non-blocking poll waits
        # for a blocking one on another thread to return, and two threads polling at
        # once contend for the device.
        if not self._fence_polling:
            self._lib.wgpuDevicePoll(self.device._internal, False, self._ffi.NULL)
        return index <= self._completed

    def _advance(self, index: int) -> None:
        """Submission ``index`` (and so every earlier one) completed: wake who sleeps on it."""
        with self._index_lock:
            if index <= self._completed:
                return
            self._completed = index
            ready = [lock for i, lock in self._sleepers if i <= index]
            if ready:
                self._sleepers = [(i, lock) for i, lock in self._sleepers if i > index]
        for lock in ready:
            lock.release()

    def sleeper(self, index: int) -> threading.Lock | None:
        """A held lock that ``_advance`` releases once ``index`` completed (None: it already has)."""
        lock = threading.Lock()
        lock.acquire()
        with self._index_lock:
            if index <= self._completed:
                return None
            self._sleepers.append((index, lock))
        return lock

    def drop_sleeper(self, lock: threading.Lock) -> None:
        with self._index_lock:
            self._sleepers = [(i, other) for i, other in self._sleepers if other is not lock]

    def _register_work_done(self, index: int) -> None:
        """Ask wgpu-native to call back once everything submitted so far completed."""
        info = self._ffi.new("WGPUQueueWorkDoneCallbackInfo *")
        info.mode = _raw_lib.WGPUCallbackMode_AllowSpontaneous
        info.callback = self._work_done
        info.userdata1 = self._ffi.cast("void *", index)
        info.userdata2 = self._ffi.cast("void *", self._key)
        self._lib.wgpuQueueOnSubmittedWorkDone(self.queue._internal, info[0])

    @contextlib.contextmanager
    def ordered(self, release: Any) -> Iterator[None]:
        """Hold the submission's lock, then let ``release`` (a lock held once) go: an encoder
        finished under ``release`` is enqueued, inside this block with ``enqueue(locked=True)``,
        before anything finished after ``release`` was let go, while that is recorded."""
        with self._submit_lock:
            release.release()
            yield

    def enqueue(self, command_buffer: Any, on_done: Callable[[], None] | None = None, *,
                flush: bool = False, on_submit: Callable[[int], None] | None = None, locked: bool = False) -> None:
        """Append a command buffer to the ordered batch; submit when it pays.

        Everything enqueued runs in enqueue order, so a stage's consumers may be
        enqueued (and buffers it released reused) as soon as this returns.
        ``on_done`` runs on the fence thread once the batch holding this command
        buffer completed; pass ``flush=True`` when someone waits for it now.
        ``on_submit(t_ns)`` runs right after the batch holding it was submitted.

        Coalescing policy: while the GPU has nothing of ours in flight, submit at once
        (it would idle otherwise); while a submission runs, collect command buffers
        and submit them together when it completes, when ``max_batch`` are waiting,
        when a fence is awaited, or when the recording workers go idle.
        ``locked``: the caller holds the submission's lock (inside :meth:`ordered`).
        A submission this causes happens in this call (see the module doc, "Who submits").
        """
        with self._submit_lock if not locked else contextlib.nullcontext():
            self._check_open()
            self.check_alive()
            self._batch.append(command_buffer)
            if on_done is not None:
                self._batch_callbacks.append(on_done)
            if on_submit is not None:
                self._batch_submitted.append(on_submit)
            if flush or self._inflight == 0 or len(self._batch) >= self.max_batch:
                self._flush_locked()

    def pending(self) -> bool:
        """Whether command buffers were enqueued and not yet submitted."""
        with self._submit_lock:
            return bool(self._batch)

    @property
    def idle(self) -> bool:
        """Nothing of ours is running on the GPU or waiting to be submitted (a hint: not locked)."""
        return self._inflight == 0 and not self._batch

    def flush(self) -> None:
        """Finish open shared encoders, then submit whatever is batched (nothing once closed)."""
        if self.closed:
            return
        for recorder in self._open_encoders:
            recorder.flush()
        with self._submit_lock:
            if self._batch and not self.closed:
                self._flush_locked()

    def _flush_locked(self) -> None:
        batch, callbacks, submitted = self._batch, self._batch_callbacks, self._batch_submitted
        self._batch, self._batch_callbacks, self._batch_submitted = [], [], []
        if self.loss.lost is not None:
            return  # submitting on a lost device aborts the process; runs were failed already
        index = self._submit_now(batch)
        self._inflight += 1
        if submitted:
            now = time.perf_counter_ns()
            for on_submit in submitted:
                on_submit(now)
        self.submissions += 1
        # One fence per submission (fences are registered in index order, under this lock): first
        # the next batch goes out, before downloads run; then the stages' callbacks, in order;
        # then the batch's command buffers are let go in the fence thread's housekeeping.
        self.on_done(index, each([self._retired, *callbacks, self.drop_later(batch)]))

    def _retired(self) -> None:
        """On the fence thread: a submission completed; send what was collected meanwhile."""
        with self._submit_lock:
            self._inflight -= 1
            if self._batch and self._inflight == 0 and not self.closed:
                self._flush_locked()
            idle = self.idle and not self.closed
        if idle:
            for recorder in self._open_encoders:
                recorder.flush_if_free()

    def wait(self, index: int) -> None:
        """Block the calling thread until submission ``index`` completed (never call on the loop).

        Then ``completed(index)`` is true at once: the work-done callback of that submission
        may still be firing on another thread's poll. With ``fence_poll_s`` it polls without
        blocking (``HETERO_FENCE_POLL_US``), else in one blocking poll."""
        if self.fence_poll_s > 0:
            self._poll_until(index)
        else:
            self._lib.wgpuDevicePoll(self.device._internal, True, self._ffi.new("WGPUSubmissionIndex *", index))
        if self.loss.lost is None:
            self._advance(index)

    def _poll_until(self, index: int) -> None:
        """Poll without blocking until submission ``index`` completed, pausing an eighth of the
        time waited so far between polls (at least ``fence_poll_s``, at most :data:`FENCE_POLL_MAX_S`):
        short waits are seen within about ``fence_poll_s``, long ones cost few polls."""
        poll, dev, null, least = self._lib.wgpuDevicePoll, self.device._internal, self._ffi.NULL, self.fence_poll_s
        start = time.perf_counter()
        while True:
            poll(dev, False, null)
            if index <= self._completed:
                return
            self.check_alive()
            time.sleep(min(max(least, (time.perf_counter() - start) / 8), FENCE_POLL_MAX_S))

    def on_done(self, index: int, callback: Callable[[], None]) -> None:
        """Run ``callback()`` on the fence thread once submission ``index`` completed."""
        self._fences.put((index, callback))

    def defer(self, callback: Callable[[], None]) -> None:
        """From a fence callback: run ``callback()`` later on the fence thread, once no
        completed fence waits (or :data:`MAX_DEFERRED` are pending, or at close).

        For housekeeping nobody waits for (recycling upload staging, reading sampled
        timestamps), so that the callbacks that deliver results and wake waiters of the
        same submission run first.
        """
        if threading.current_thread() is not self._fence_thread:
            callback()  # e.g. a shared encoder that failed settles its stages on the recording thread
            return
        self._deferred.append(callback)
        if len(self._deferred) >= MAX_DEFERRED:
            self._run_deferred()

    def drop_later(self, objects: list[Any]) -> Callable[[], None]:
        """A fence callback after which ``objects`` (wgpu-py objects a submission used: command
        buffers, encoders, passes) are let go in the fence thread's housekeeping.

        Letting one go calls into wgpu-native through cffi, which releases the GIL and, on the
        recording thread, waits to get it back whenever another Python thread runs; a replayed
        run lets go of six. The list is emptied then; until then it keeps them alive.
        """
        def drop() -> None:
            self.defer(objects.clear)

        return drop

    def _run_deferred(self) -> None:
        while self._deferred:
            pending, self._deferred = self._deferred, []
            for cb in pending:
                try:
                    cb()
                except BaseException:  # pragma: no cover - callbacks handle their own errors
                    log.exception("deferred fence callback failed")

    def _next_fence(self) -> tuple[int, Callable[[], None]] | None:
        """The next fence to wait for: wait up to ``fence_spin_s`` for one, then run the deferred
        housekeeping, then block.

        Right after a fence the next one usually follows soon (streams, chains of small
        stages, the next stage of a run), so the housekeeping waits until none came for
        ``fence_spin_s``: the thread a completion just woke (the event loop's, a worker)
        takes the GIL meanwhile, instead of waiting for it behind the housekeeping. The wait
        blocks on the queue with the GIL released: a fence's GPU work outlasts the wake-up,
        and a spin here took the GIL from the next run's tokenizing and recording at every
        turn (it spun while the next call started).
        """
        fences = self._fences
        try:
            return fences.get_nowait()
        except queue.Empty:
            pass
        if self.fence_spin_s > 0:
            try:
                return fences.get(timeout=self.fence_spin_s)
            except queue.Empty:
                pass
        if self._deferred:
            self._run_deferred()
            try:
                return fences.get_nowait()
            except queue.Empty:
                pass
        return fences.get()

    def _fence_loop(self) -> None:
        _precise_sleeps()
        while True:
            item = self._next_fence()
            if item is None:
                self._run_deferred()
                return  # closed, and everything before the sentinel was completed
            index, callback = item
            try:
                if self.tracer is not None:
                    t0 = time.perf_counter_ns()
                    self._await_completion(index)
                    self.tracer.span(f"fence #{index}", "fence", t0, time.perf_counter_ns())
                else:
                    self._await_completion(index)
            except Exception as e:  # wgpu-native reports a loss this way: runs on the device fail
                self.loss.mark_lost(repr(e))
            else:
                self._advance(index)
            try:
                callback()
            except BaseException:  # pragma: no cover - callbacks handle their own errors
                log.exception("fence callback failed")

    def _await_completion(self, index: int) -> None:
        """On the fence thread: return once submission ``index`` completed.

        With the fence spin on, poll without blocking for up to ``fence_spin_s`` first
        (the work-done callbacks report what finished): small submissions complete
        within tens of microseconds, and a thread inside a blocking poll holds up every
        other thread's non-blocking one until it returns, the event loop's included.
        Then poll without blocking every ``fence_poll_s``, asleep in between (a blocking
        poll holds up every submission from another thread until it returns: see
        ``HETERO_FENCE_POLL_US``), or with ``fence_poll_s`` 0 block in one poll; meanwhile
        ``completed()`` leaves the polling to this thread.
        """
        if index <= self._completed:
            return
        self._fence_polling = True
        try:
            if self.fence_spin_s > 0:
                deadline = time.perf_counter() + self.fence_spin_s
                while True:
                    self._lib.wgpuDevicePoll(self.device._internal, False, self._ffi.NULL)
                    if index <= self._completed or time.perf_counter() >= deadline:
                        break
                    self._spin_pause()  # the GIL goes to the loop (and the recording thread) between polls
                if index <= self._completed:
                    return
            self.wait(index)
        finally:
            self._fence_polling = False

    def close(self) -> None:
        """Submit what is batched, refuse submissions from now on and let the fence thread drain. Idempotent."""
        if self.closed:
            return
        try:
            self.flush()
        except Exception:  # noqa: BLE001 - e.g. the device was lost: closing goes on
            log.debug("hetero: final flush failed", exc_info=True)
        with self._submit_lock:
            try:
                if self._batch:
                    self._flush_locked()
            except Exception:  # noqa: BLE001
                log.debug("hetero: final submission failed", exc_info=True)
            finally:
                with self._queue_lock:
                    self.closed = True
                    self.loss.closed = True
                self._batch, self._batch_callbacks, self._batch_submitted = [], [], []
        # Everything submitted registered its fence before the sentinel: the fence thread
        # returns once all of it completed (and its callbacks, which submit nothing now, ran).
        self._fences.put(None)
        self._fence_thread.join(timeout=CLOSE_WAIT_S)


# The fence thread's spin, on hosts with at least FENCE_SPIN_MIN_CPUS cores: polling a fresh
# submission without blocking before a blocking poll (``_await_completion``), and how long it
# waits for a new submission (a blocking wait) before its housekeeping (``_next_fence``).
# Fewer cores: no spin (the spinner would take the CPU a software GPU needs). Long enough to
# cover a small run's GPU work (a lone sentence's encoder is about 1 ms): the thread sees it
# finish without a wake-up, and no blocking poll holds up the next submission meanwhile (see
# FENCE_POLL_MAX_S). On the H200 2 ms against 100 us, three alternated pairs: a lone sentence
# 2.99-3.15 ms against 3.05-3.57, batch 32 11-13% more sentences/s (BENCHMARKS.md, ninth
# session).
FENCE_SPIN_US = 2000.0
FENCE_SPIN_MIN_CPUS = 8
# Between two turns of the spin while a stage is being recorded (see Submission._spin_pause;
# the fence thread's timer slack is 1 us, so that a pause this short ends on time).
FENCE_SPIN_PAUSE_S = 20e-6
# After the spin the fence thread blocks in one poll. HETERO_FENCE_POLL_US=N makes it poll
# without blocking instead, asleep in between for an eighth of the time waited so far (at
# least N us, at most FENCE_POLL_MAX_S). Why one might: in wgpu-native 29 a blocking poll holds
# the queue's fence lock until the submission completes, and every wgpuQueueSubmit from
# another thread waits for it (gfx-rs/wgpu#9470, fixed after 29). Why it is off: on the H200
# neither a lone run nor served batches got faster with it (BENCHMARKS.md, "Wave 2 on the
# H200, seventh session"; again with 256 served clients offered 7,000-11,000 requests/s in
# five alternated pairs, twelfth session, though there the fence thread sat in its blocking
# poll a third of the time), and on a software GPU the poller takes CPU the GPU needs.
FENCE_POLL_MAX_S = 0.001


def each(callbacks: list[Callable[[], None]]) -> Callable[[], None]:
    """One fence callback that runs ``callbacks`` in order, each whatever the others raised
    (as separate fences would): a failing one is logged, the rest still run."""
    def run() -> None:
        for cb in callbacks:
            try:
                cb()
            except BaseException:  # noqa: BLE001 - the others still run
                log.exception("fence callback failed")

    return run


# The one work-done callback of every device's submissions. userdata1 carries the
# submission index, userdata2 the Submission's key here; the callback lives as long as the
# process (wgpu-native may still hold it for a device Python has already collected).
_SUBMISSIONS: weakref.WeakValueDictionary[int, Submission] = weakref.WeakValueDictionary()
_submission_keys = itertools.count(1)
_work_done: Any = None
_work_done_lock = threading.Lock()


def _work_done_callback(ffi: Any) -> Any:
    """The work-done callback: marks the submission complete on its device, if that still lives.

    It fires on whichever thread's device poll sees the work finished (wgpu-native fires
    it spontaneously whatever the requested callback mode).
    """
    global _work_done
    with _work_done_lock:
        if _work_done is None:
            success = _raw_lib.WGPUQueueWorkDoneStatus_Success

            @ffi.callback("void(WGPUQueueWorkDoneStatus, WGPUStringView, void *, void *)")
            def on_work_done(status: int, message: Any, userdata1: Any, userdata2: Any) -> None:
                sub = _SUBMISSIONS.get(int(ffi.cast("uintptr_t", userdata2)))
                if sub is not None and status == success:
                    sub._advance(int(ffi.cast("uintptr_t", userdata1)))

            _work_done = on_work_done
        return _work_done


def _poll_promises_without_blocking(device: Any, lib: Any, ffi: Any) -> None:
    """Make wgpu-py's per-device promise poller poll ``device`` without blocking.

    wgpu-py resolves promises (buffer maps) on a thread of its own, which, while one is
    pending, waits in ``wgpuDevicePoll(wait=True)`` for every submission made so far. In
    wgpu-native 29 a blocking poll holds the queue's fence lock, and every
    ``wgpuQueueSubmit`` from another thread waits for it (gfx-rs/wgpu#9470): one map
    requested while work is in flight (a download of a finished run, a staging buffer
    mapped again) holds the next submission back until the GPU has drained. With
    ``HETERO_PROMISE_POLL_US`` set, that thread polls without blocking, asleep that long in
    between: a map of finished work resolves in its first poll. Off by default, for the same
    measurements as the fence thread's polling (see FENCE_POLL_MAX_S).
    """
    poller = getattr(device, "_poller", None)
    pause = _env_us("HETERO_PROMISE_POLL_US", 0.0)
    if pause <= 0 or poller is None or not hasattr(poller, "_poll_func"):  # off, or not wgpu-py 0.32's poller
        return
    internal, null, poll = device._internal, ffi.NULL, lib.wgpuDevicePoll

    def poll_func(block: bool) -> None:
        poll(internal, False, null)
        if block:
            time.sleep(pause)

    poller._poll_func = poll_func


_PR_SET_TIMERSLACK = 29  # prctl(2)


def _precise_sleeps() -> None:
    """Let the calling thread's short sleeps end on time (Linux: a timer slack of 1 us instead of
    the default 50 us, which stretched each of the spin's pauses to two or three times its length)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_TIMERSLACK, ctypes.c_ulong(1000), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
    except (OSError, AttributeError):  # pragma: no cover - no prctl: the default slack stays
        log.debug("hetero: could not set the fence thread's timer slack", exc_info=True)


def _fence_spin_s() -> float:
    """``HETERO_FENCE_SPIN_US`` if set (0 turns the spin off), else the default for this host; in seconds."""
    return _env_us("HETERO_FENCE_SPIN_US", FENCE_SPIN_US if (os.cpu_count() or 1) >= FENCE_SPIN_MIN_CPUS else 0.0)


def _fence_poll_s() -> float:
    """``HETERO_FENCE_POLL_US`` if set, else 0 (one blocking poll); in seconds."""
    return _env_us("HETERO_FENCE_POLL_US", 0.0)


def _env_us(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    try:
        us = float(raw) if raw.strip() else default
    except ValueError:
        log.warning("hetero: ignoring %s=%r (not a number of microseconds)", name, raw)
        us = default
    return max(0.0, us) / 1e6
