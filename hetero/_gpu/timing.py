"""GPU timestamp queries for shared command encoders, and their alignment to the host clock.

What wgpu-py 0.32 offers (read in ``wgpu/backends/wgpu_native/_api.py`` and checked on
lavapipe):

* ``device.create_query_set(type="timestamp", count=n)``, at most 4096 queries per set.
  The device needs the feature ``"timestamp-query"``.
* ``encoder.begin_compute_pass(timestamp_writes={"query_set": qs,
  "beginning_of_pass_write_index": i, "end_of_pass_write_index": j})`` (core
  ``timestamp-query``; either index may be left out).
* ``wgpu.backends.wgpu_native.extras.write_timestamp(target, qs, i)`` where ``target``
  is a ``GPUCommandEncoder`` (needs the native feature
  ``"timestamp-query-inside-encoders"``) or a ``GPUComputePassEncoder`` (needs
  ``"timestamp-query-inside-passes"``). There is no public ``write_timestamp``
  method; the extras function calls the private ``_write_timestamp``. Without the
  feature the write is a validation error raised by ``encoder.finish()``: it would
  fail every stage sharing the encoder, so :class:`GPUTimer` only writes where the
  device has the feature. Writing on the encoder while a pass is open is also an
  error at ``finish()``: write into the open pass instead.
* ``encoder.resolve_query_set(qs, first, count, dst, dst_offset)``: ``dst`` needs
  ``QUERY_RESOLVE`` usage and ``dst_offset`` must be a multiple of 256. A query not
  written in the same command buffer resolves to 0 the first time, later to a stale
  value from an earlier command buffer, so only written queries are resolved.
* The tick period: no Python method. wgpu-native's ``wgpuQueueGetTimestampPeriod``
  is reachable through wgpu-py's cffi binding (``_api.libf``); it returns 1.0 (ns per
  tick) on lavapipe, and the design guide measured 1 ns ticks on the H200. On
  lavapipe the device clock *is* the host's ``CLOCK_MONOTONIC`` (the clock behind
  ``time.perf_counter_ns`` on Linux): the measured alignment offset is ~0 and the
  slope against the host clock 1.000 (see ``tests/test_timing.py``).

Strategies (:attr:`GPUTimer.strategy`)
    ``"inside-passes"`` (the device has both ``timestamp-query-inside-passes`` and
    ``-inside-encoders``): :meth:`TimerFrame.begin` / :meth:`TimerFrame.end` write a
    timestamp into whatever is open, the shared compute pass or the encoder, so a
    span may cover one dispatch, one stage or several passes without changing how
    the recorder opens passes. On Vulkan wgpu writes these at the bottom of the
    pipe: a begin mark is taken once the work recorded before it completed.
    ``"pass-writes"`` (core ``timestamp-query`` only): the recorder opens each compute
    pass with ``timestamp_writes=frame.pass_writes(label)``; spans are whole passes
    (give a timed dispatch a pass of its own for per-dispatch times).
    ``None``: no timestamps; every method is a cheap no-op returning None / -1.

Slots, frames and tickets
    The timer owns one query set of ``capacity`` slots, handed out in chunks of 32
    (a chunk resolves to a 256-byte-aligned offset). A :class:`TimerFrame` collects
    the spans of one command encoder; the recorder that owns the encoder owns the
    frame (frames are not locked; the timer's chunk allocator is).
    :meth:`TimerFrame.resolve` records the resolve and a copy into a pooled
    ``MAP_READ`` buffer that only this ticket uses, and frees the chunks at once
    (query commands on one queue run in submission order, and wgpu orders the
    reused resolve region between command buffers). After the submission's fence,
    :meth:`GPUTimer.read` maps that buffer and returns the spans in device
    nanoseconds; :meth:`GPUTimer.to_host` moves them to the host clock. A ticket
    whose command buffer will never be submitted must be :meth:`TimerTicket.discard`-ed.
    When every chunk is taken, new spans are skipped and counted in ``dropped``.

Clock alignment
    GPU timestamps count from an arbitrary device epoch. :meth:`GPUTimer.align`
    submits tiny command buffers that only write a timestamp, noting the host time
    ``t0`` just before each submit and ``t1`` once its fence passed: the device time
    ``g`` happened within ``[t0, t1]``, so ``host - device`` lies in
    ``[t0 - g, t1 - g]``. The samples' intervals are intersected; the offset is the
    middle, the error bound half the width (at most half the shortest round trip).
    :meth:`GPUTimer.observe` narrows the interval further with real submissions
    (their spans lie between submit and fence), and starts over from the new
    interval if they disagree (clock drift). Call :meth:`GPUTimer.align` while the
    queue is idle (at device creation or warm-up), and again per run if runs are
    far apart; never on the event loop (it blocks for the round trips).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import wgpu
from wgpu.backends.wgpu_native.extras import write_timestamp

from .._argtypes import check_positive_int
from . import passcmd
from .passcmd import copy_buffer_to_buffer as _copy
from .bufmap import request_map

__all__ = ["ClockAlignment", "GPUSpan", "GPUTimer", "TimerFrame", "TimerTicket", "timestamp_period"]

CHUNK = 32  # slots per chunk: 32 * 8 bytes = the 256-byte alignment resolve_query_set needs
MAX_QUERIES = 4096  # wgpu's limit on a query set's count
_RESOLVE_ALIGN = 256
_NO_SLOT = -1

FEATURE = "timestamp-query"
IN_PASSES = "timestamp-query-inside-passes"
IN_ENCODERS = "timestamp-query-inside-encoders"


class GPUSpan(NamedTuple):
    """One timed interval: a label, its start and end in nanoseconds (device or host clock),
    and whatever ``meta`` the recorder attached (e.g. the run and the flow id of the stage)."""

    label: str
    start_ns: int
    end_ns: int
    meta: Any = None


@dataclass(frozen=True)
class ClockAlignment:
    """``host_ns = device_ns + offset_ns``, known to lie within ``[lo_ns, hi_ns]``."""

    lo_ns: int
    hi_ns: int
    samples: int = 1

    def __post_init__(self) -> None:
        if self.hi_ns < self.lo_ns:
            raise ValueError(f"clock alignment interval is empty: [{self.lo_ns}, {self.hi_ns}]")

    @property
    def offset_ns(self) -> int:
        return (self.lo_ns + self.hi_ns) // 2

    @property
    def error_ns(self) -> int:
        """The most the offset can be off by: half the interval's width."""
        return (self.hi_ns - self.lo_ns + 1) // 2

    def to_host(self, device_ns: int) -> int:
        return device_ns + self.offset_ns

    def refine(self, lo_ns: int, hi_ns: int) -> ClockAlignment:
        """Intersect with another interval; start over from it if the two disagree (drift)."""
        lo, hi = max(self.lo_ns, lo_ns), min(self.hi_ns, hi_ns)
        if lo > hi:
            return ClockAlignment(lo_ns, hi_ns, 1)
        return ClockAlignment(lo, hi, self.samples + 1)


def timestamp_period(device: Any) -> float:
    """Nanoseconds per timestamp tick (wgpu-native's ``wgpuQueueGetTimestampPeriod``); 1.0 if unknown."""
    try:
        from wgpu.backends.wgpu_native import _api

        period = float(_api.libf.wgpuQueueGetTimestampPeriod(device.queue._internal))
    except Exception:  # noqa: BLE001 - another backend, or the symbol moved
        return 1.0
    return period if period > 0 else 1.0


class TimerTicket:
    """The resolved timestamps of one frame, readable after its submission completed."""

    __slots__ = ("_timer", "buffer", "nbytes", "spans", "_done")

    def __init__(self, timer: GPUTimer, buffer: Any, nbytes: int, spans: list[tuple[str, int, int, Any]]) -> None:
        self._timer = timer
        self.buffer = buffer
        self.nbytes = nbytes
        self.spans = spans  # (label, position of the start value, position of the end value, meta)
        self._done = False

    def discard(self) -> None:
        """The command buffer holding the resolve will not be submitted: recycle the buffer."""
        if not self._done:
            self._done = True
            self._timer._give_back(self.buffer)


class TimerFrame:
    """The timestamp spans of one command encoder; owned (and serialised) by its recorder."""

    def __init__(self, timer: GPUTimer) -> None:
        self._timer = timer
        self._chunks: list[int] = []  # chunk indices in the query set, in order of use
        self._counts: list[int] = []  # slots written in each chunk (only those are resolved)
        self._used = CHUNK  # slots taken in the last chunk (CHUNK: take a new chunk first)
        self._spans: list[list[Any]] = []  # [label, start position, end position, meta]
        self._pending = 0  # begun and not ended

    @property
    def empty(self) -> bool:
        return not self._spans

    def _slot(self) -> tuple[int, int]:
        """(query index, position in the readback) of a fresh slot; (-1, -1) if none is free."""
        if self._used == CHUNK:
            chunk = self._timer._take_chunk()
            if chunk < 0:
                return _NO_SLOT, _NO_SLOT
            self._chunks.append(chunk)
            self._counts.append(0)
            self._used = 0
        slot = self._chunks[-1] * CHUNK + self._used
        pos = (len(self._chunks) - 1) * CHUNK + self._used
        self._used += 1
        self._counts[-1] = self._used
        return slot, pos

    def _write(self, target: Any) -> int:
        """Write a timestamp into ``target`` (an open pass or an encoder); its position, or -1."""
        timer = self._timer
        if isinstance(target, wgpu.GPUComputePassEncoder):
            if not timer.in_passes:
                return _NO_SLOT
        elif isinstance(target, wgpu.GPUCommandEncoder):
            if not timer.in_encoders:
                return _NO_SLOT
        else:
            return _NO_SLOT
        slot, pos = self._take_slot()
        if slot >= 0:
            write_timestamp(target, timer.query_set, slot)
        return pos

    def pass_writes(self, label: str, meta: Any = None) -> dict[str, Any] | None:
        """``timestamp_writes`` for ``begin_compute_pass`` timing the whole pass as ``label``.

        Pass the result to the very next ``begin_compute_pass`` (a reserved query that is
        never written would resolve to a stale value). None when timing is off or full.
        """
        if not self._timer.available:
            return None
        if self._used + 2 > CHUNK:
            self._used = CHUNK  # keep the pair in one chunk
        start, pos0 = self._slot()
        if start < 0:
            self._timer.dropped += 1
            return None
        end, pos1 = self._slot()  # same chunk: _used was at most CHUNK - 2
        self._spans.append([label, pos0, pos1, meta])
        return {"query_set": self._timer.query_set, "beginning_of_pass_write_index": start,
                "end_of_pass_write_index": end}

    def _write_in_pass(self, pass_address: Any) -> int:
        """:meth:`_write` into the open compute pass at ``pass_address``, straight into wgpu-native."""
        timer = self._timer
        if not timer.in_passes:
            return _NO_SLOT
        slot, pos = self._take_slot()
        if slot >= 0:
            passcmd.write_timestamp(pass_address, timer.query_set_address, slot)
        return pos

    def _take_slot(self) -> tuple[int, int]:
        """:meth:`_slot` for one timestamp write, counting it as dropped when none is free."""
        slot, pos = self._slot()
        if slot < 0:
            self._timer.dropped += 1
        return slot, pos

    def begin(self, target: Any, label: str, meta: Any = None) -> int:
        """Start a span: a timestamp written into ``target`` (the open pass, else the encoder).

        Returns a handle for :meth:`end`, or -1 when the device cannot write into
        ``target`` or no slot is free (``end(-1)`` is a no-op).
        """
        return self._open(self._write(target), label, meta)

    def begin_in_pass(self, pass_address: Any, label: str, meta: Any = None) -> int:
        """:meth:`begin` in the open compute pass whose native handle is at ``pass_address``,
        for loops that issue their commands through :mod:`hetero._gpu.passcmd`."""
        return self._open(self._write_in_pass(pass_address), label, meta)

    def _open(self, pos: int, label: str, meta: Any) -> int:
        if pos < 0:
            return _NO_SLOT
        self._spans.append([label, pos, _NO_SLOT, meta])
        self._pending += 1
        return len(self._spans) - 1

    def end(self, target: Any, handle: int) -> None:
        """End the span ``handle`` with a timestamp written into ``target``."""
        if handle >= 0:
            self._close(handle, self._write(target))

    def end_in_pass(self, pass_address: Any, handle: int) -> None:
        """:meth:`end` in the open compute pass at ``pass_address`` (see :meth:`begin_in_pass`)."""
        if handle >= 0:
            self._close(handle, self._write_in_pass(pass_address))

    def _close(self, handle: int, pos: int) -> None:
        span = self._spans[handle]
        if span[2] == _NO_SLOT:
            self._pending -= 1
        span[2] = pos if pos >= 0 else span[1]  # no slot left: a zero-length span rather than none

    def mark(self, target: Any, label: str, meta: Any = None) -> int:
        """A single timestamp (read back as a zero-length span); its position, or -1."""
        pos = self._write(target)
        if pos >= 0:
            self._spans.append([label, pos, pos, meta])
        return pos

    @contextmanager
    def time(self, target: Any, label: str, meta: Any = None) -> Iterator[None]:
        """``with frame.time(cpass, "matmul"): cpass.dispatch_workgroups(...)``."""
        handle = self.begin(target, label, meta)
        try:
            yield
        finally:
            self.end(target, handle)

    def resolve(self, encoder: Any) -> TimerTicket | None:
        """Record the resolve and readback copy into ``encoder`` (no pass open); reset the frame.

        Spans begun and not ended are closed on ``encoder`` first (or dropped if they
        cannot be). Returns None when nothing was timed.
        """
        timer = self._timer
        try:
            if self._pending:
                for handle, span in enumerate(self._spans):
                    if span[2] == _NO_SLOT:
                        self.end(encoder, handle)
            if not self._spans or not self._chunks:
                return None
            n_chunks = len(self._chunks)
            buffer = timer._take_buffer(n_chunks)
            try:
                for k, (chunk, used) in enumerate(zip(self._chunks, self._counts)):
                    if used == 0:
                        continue
                    offset = chunk * CHUNK * 8  # a multiple of 256, as resolve_query_set requires
                    encoder.resolve_query_set(timer.query_set, chunk * CHUNK, used, timer.resolve_buffer, offset)
                    _copy(encoder, timer.resolve_buffer, offset, buffer, k * CHUNK * 8, used * 8)
            except BaseException:
                timer._give_back(buffer)
                raise
            spans = [(str(s[0]), s[1], s[2], s[3]) for s in self._spans if s[2] != _NO_SLOT]
            return TimerTicket(timer, buffer, n_chunks * CHUNK * 8, spans)
        finally:
            self.discard()

    def discard(self) -> None:
        """Forget the spans and free the slots (the encoder was dropped, or resolved)."""
        chunks, self._chunks, self._counts = self._chunks, [], []
        self._spans, self._used, self._pending = [], CHUNK, 0
        if chunks:
            self._timer._free_chunks(chunks)


class GPUTimer:
    """GPU timestamps for one device: slot allocation, resolves, reads and clock alignment.

    ``available`` is False (and everything a no-op) without ``timestamp-query``. The
    methods ``pass_writes``, ``begin``, ``end``, ``mark`` and ``resolve`` on the timer
    itself act on one default frame under a lock, for a single recorder; recorders
    that keep several encoders use one :meth:`frame` per encoder.
    """

    def __init__(self, device: Any, capacity: int = MAX_QUERIES) -> None:
        check_positive_int("timer capacity", capacity, minimum=CHUNK, maximum=MAX_QUERIES,
                           rule=f"an int from {CHUNK} to {MAX_QUERIES}")
        self.device = device
        features = frozenset(getattr(device, "features", ()) or ())
        self.available = FEATURE in features
        self.in_passes = self.available and IN_PASSES in features
        self.in_encoders = self.available and IN_ENCODERS in features
        self.strategy: str | None = (
            ("inside-passes" if self.in_passes and self.in_encoders else "pass-writes") if self.available else None
        )
        self.capacity = capacity - capacity % CHUNK
        self.period_ns = timestamp_period(device) if self.available else 1.0
        self.alignment: ClockAlignment | None = None
        self.dropped = 0  # spans skipped because every slot was taken
        self._lock = threading.Lock()
        self._free: list[int] = list(range(self.capacity // CHUNK - 1, -1, -1))  # a stack of chunk indices
        self._buffers: dict[int, list[Any]] = {}  # readback buffers by size in chunks
        self._default = TimerFrame(self)
        self._default_lock = threading.RLock()
        self.query_set: Any = None
        self.query_set_address = 0  # its native handle, for passcmd.write_timestamp
        self.resolve_buffer: Any = None
        if self.available:
            self.query_set = device.create_query_set(label="hetero-timer", type="timestamp", count=self.capacity)
            self.query_set_address = passcmd.addr(self.query_set)
            self.resolve_buffer = device.create_buffer(
                label="hetero-timer-resolve", size=self.capacity * 8,
                usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC,
            )

    # -- frames and slots ---------------------------------------------------------------
    def frame(self) -> TimerFrame:
        """A new frame: the spans of one command encoder."""
        return TimerFrame(self)

    def _take_chunk(self) -> int:
        if not self.available:
            return _NO_SLOT
        with self._lock:
            return self._free.pop() if self._free else _NO_SLOT

    def _free_chunks(self, chunks: Sequence[int]) -> None:
        with self._lock:
            self._free.extend(reversed(chunks))

    @property
    def free_slots(self) -> int:
        return len(self._free) * CHUNK

    def _take_buffer(self, n_chunks: int) -> Any:
        with self._lock:
            pool = self._buffers.get(n_chunks)
            if pool:
                return pool.pop()
        return self.device.create_buffer(label="hetero-timer-read", size=n_chunks * CHUNK * 8,
                                         usage=wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST)

    def _give_back(self, buffer: Any) -> None:
        with self._lock:
            self._buffers.setdefault(buffer.size // (CHUNK * 8), []).append(buffer)

    # -- the default frame (one recorder) ---------------------------------------------------
    def pass_writes(self, label: str, meta: Any = None) -> dict[str, Any] | None:
        with self._default_lock:
            return self._default.pass_writes(label, meta)

    begin_pass_writes = pass_writes

    def begin(self, target: Any, label: str, meta: Any = None) -> int:
        with self._default_lock:
            return self._default.begin(target, label, meta)

    def end(self, target: Any, handle: int) -> None:
        with self._default_lock:
            self._default.end(target, handle)

    def mark(self, target: Any, label: str, meta: Any = None) -> int:
        with self._default_lock:
            return self._default.mark(target, label, meta)

    def resolve(self, encoder: Any) -> TimerTicket | None:
        with self._default_lock:
            return self._default.resolve(encoder)

    # -- results ----------------------------------------------------------------------------
    def read(self, ticket: TimerTicket | None) -> list[GPUSpan]:
        """After the fence: the ticket's spans in device nanoseconds (``end >= start``).

        Maps the ticket's buffer (its submission has completed, so this does not wait for
        other work), then recycles it. Spans with an unwritten query are left out. The map
        (:func:`~hetero._gpu.bufmap.request_map`) submits nothing first and is resolved by a
        poll on this thread.
        """
        if ticket is None or ticket._done:
            return []
        try:
            buf = ticket.buffer
            request_map(buf, "READ").wait()
            try:
                raw = np.frombuffer(buf.read_mapped(0, ticket.nbytes), np.uint64)
            finally:
                buf.unmap()
        finally:
            ticket.discard()
        period = self.period_ns
        out = []
        for label, p0, p1, meta in ticket.spans:
            t0, t1 = int(raw[p0]), int(raw[p1])
            if t0 == 0 or t1 == 0:
                continue
            if period != 1.0:
                t0, t1 = round(t0 * period), round(t1 * period)
            out.append(GPUSpan(label, t0, max(t0, t1), meta))
        return out

    @property
    def offset_ns(self) -> int:
        """What moves a device time to the host clock (``time.perf_counter_ns``); 0 if not aligned."""
        return self.alignment.offset_ns if self.alignment is not None else 0

    def to_host(self, spans: Sequence[GPUSpan]) -> list[GPUSpan]:
        """Spans moved to the host clock (``time.perf_counter_ns``); unchanged if not aligned."""
        off = self.offset_ns
        return [GPUSpan(s.label, s.start_ns + off, s.end_ns + off, s.meta) for s in spans]

    # -- clock alignment --------------------------------------------------------------------
    def _sample(self, frame: TimerFrame, send: Callable[[list[Any]], Any]) -> tuple[int, int, int] | None:
        """One round trip: (host before submit, host after its fence, device time in between)."""
        encoder = self.device.create_command_encoder(label="hetero-timer-align")
        if self.in_encoders:
            frame.mark(encoder, "align")
        else:
            encoder.begin_compute_pass(timestamp_writes=frame.pass_writes("align")).end()
        ticket = frame.resolve(encoder)
        if ticket is None:
            return None  # no free slot
        command_buffer = encoder.finish()
        t0 = time.perf_counter_ns()
        send([command_buffer])
        request_map(ticket.buffer, "READ").wait()  # returns once this submission completed
        t1 = time.perf_counter_ns()
        ticket.buffer.unmap()
        spans = self.read(ticket)  # maps again, without waiting
        return (t0, t1, spans[0].start_ns) if spans else None

    def align(self, samples: int = 5, submit: Callable[[list[Any]], Any] | None = None) -> ClockAlignment | None:
        """Measure the device clock's offset to ``time.perf_counter_ns`` (blocks; see module doc).

        ``submit`` submits a list of command buffers (default ``queue.submit``; pass
        hetero's ``Device.submit``, which refuses a lost device). Returns the new
        :attr:`alignment`, or None without timestamps.
        """
        if not self.available:
            return None
        frame = self.frame()
        send = submit if submit is not None else self.device.queue.submit
        alignment: ClockAlignment | None = None
        for _ in range(max(1, samples)):
            sample = self._sample(frame, send)
            if sample is None:
                continue
            t0, t1, g = sample
            alignment = ClockAlignment(t0 - g, t1 - g) if alignment is None else alignment.refine(t0 - g, t1 - g)
        if alignment is not None:
            self.alignment = alignment
        return self.alignment

    def observe(self, spans: Sequence[GPUSpan], submitted_ns: int, completed_ns: int) -> None:
        """Narrow the alignment with a real submission: its ``spans`` (device ns) ran after
        ``submitted_ns`` (host time taken just before the submit call) and before
        ``completed_ns`` (host time its fence was seen)."""
        if not spans or self.alignment is None:
            return
        first = min(s.start_ns for s in spans)
        last = max(s.end_ns for s in spans)
        if completed_ns - last < submitted_ns - first:
            return  # the spans took longer than the window: not from this submission
        self.alignment = self.alignment.refine(submitted_ns - first, completed_ns - last)

    def measure_period(self, gap: float = 0.05, samples: int = 3,
                       submit: Callable[[list[Any]], Any] | None = None) -> float | None:
        """Host nanoseconds elapsed per device nanosecond, over ``gap`` seconds (1.0 when
        :attr:`period_ns` is right and the clocks do not drift).

        Takes the shortest of ``samples`` round trips before and after sleeping ``gap``;
        the error is about the two round trips divided by the gap. None without timestamps.
        """
        if not self.available:
            return None
        frame = self.frame()
        send = submit if submit is not None else self.device.queue.submit

        def best() -> tuple[int, int, int] | None:
            got = [s for s in (self._sample(frame, send) for _ in range(max(1, samples))) if s is not None]
            return min(got, key=lambda s: s[1] - s[0]) if got else None

        a = best()
        time.sleep(gap)
        b = best()
        if a is None or b is None or b[2] == a[2]:
            return None
        host = (b[0] + b[1]) / 2 - (a[0] + a[1]) / 2
        return host / (b[2] - a[2])

    def close(self) -> None:
        """Drop the query set and buffers (tickets still out must not be read afterwards)."""
        with self._lock:
            self._buffers.clear()
        self.query_set = self.resolve_buffer = None
        self.query_set_address = 0
        self.available = self.in_passes = self.in_encoders = False
        self.strategy = None
