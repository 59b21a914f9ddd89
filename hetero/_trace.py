"""A thread-safe recorder of Chrome / Perfetto trace events, and its JSON writer.

The output is the Trace Event Format (the JSON that ``chrome://tracing`` and
https://ui.perfetto.dev open)::

    {"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}

Timestamps
    Every method takes host times from :func:`time.perf_counter_ns` (the clock the
    scheduler reads, and the one :mod:`hetero._gpu.timing` aligns GPU timestamps to).
    They are written as microseconds (floats) relative to the tracer's origin, the
    ``perf_counter_ns()`` at its creation; ``otherData`` records the origin and the
    wall-clock time it corresponds to.

Tracks
    One process, ``hetero`` (pid 1). Each thread that records gets its own thread
    track, with a small tid (1, 2, ...) and a ``thread_name`` metadata event carrying
    the thread's name (``hetero-cpu-0``, ``hetero-gpu-0``, ``hetero-fence``, ...;
    :meth:`Tracer.name_thread` renames, e.g. to ``event loop``). Tids are taken from
    a ``threading.local``, so a new thread never inherits a dead thread's track even
    when the OS reuses its ident. Named tracks that are not threads (``GPU queue``)
    get synthetic tids from the same counter and their own ``thread_name``, so
    Perfetto draws them as separate tracks. ``thread_sort_index`` orders the tracks:
    event loop, CPU workers, process workers (``hetero-proc-N``: named tracks carrying
    the spans process stages ran in a worker process, timed there), GPU recording
    workers, the fence thread, then GPU queues.

Events
    :meth:`~Tracer.span` (``ph: "X"``, a complete event with ``dur >= 0``),
    :meth:`~Tracer.cpu_span` (the same as a context manager),
    :meth:`~Tracer.gpu_span` (on a GPU queue track, times already on the host clock),
    :meth:`~Tracer.instant` (``ph: "i"``), :meth:`~Tracer.counter` (``ph: "C"``,
    e.g. the buffer pool's bytes in use and pooled), and flow arrows (``ph: "s"`` /
    ``"f"``) from a span on one track to a span on another (a stage's submission to
    its GPU span): pass the same id, from :meth:`~Tracer.new_flow`, as ``flow_out``
    of the first and ``flow_in`` of the second.

Files
    One tracer, so one file, per Runtime. Events accumulate in memory for the
    tracer's whole life (up to ``max_events``; later ones are counted as dropped, and
    the count is written to ``otherData``). :meth:`~Tracer.write` rewrites the whole
    file with everything recorded so far, atomically (a temporary file, then
    ``os.replace``), so a reader never sees half a file and writing again after more
    runs yields one valid file holding all of them. The intended calls are
    :meth:`~Tracer.maybe_write` at the end of each run (rewrites at most once per
    ``min_interval`` seconds, so a long ``map`` does not rewrite a growing file per
    input) and :meth:`~Tracer.close` when the Runtime closes (a final write).

Cost
    Recording appends a tuple to a list under a lock (about a microsecond); the dicts
    and JSON are built only in :meth:`~Tracer.write`. Nothing here raises from the
    recording methods: a failure is counted in ``errors`` and logged once. With
    tracing off the scheduler holds ``tracer = None`` and pays one ``is None`` test.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from ._files import atomic_write_text

__all__ = ["GPU_DISPATCHES", "GPU_QUEUE", "Tracer"]

log = logging.getLogger("hetero")

PID = 1
GPU_QUEUE = "GPU queue"  # a span per GPU stage
GPU_DISPATCHES = "GPU dispatches"  # a span per timed dispatch
DEFAULT_MAX_EVENTS = 2_000_000

# Event tuples, as stored (cheap to build on a hot path); turned into dicts at write time.
#   ("X", name, cat, tid, ts_ns, dur_ns, args)
#   ("i", name, cat, tid, ts_ns, 0, args)
#   ("C", name, "", tid, ts_ns, 0, values)
#   ("s" | "f", "flow", "flow", tid, ts_ns, flow_id, None)
_Event = tuple[str, str, str, int, int, int, Any]


def _sort_index(name: str) -> int:
    """Where a track goes in Perfetto's list: loop, CPU, processes, GPU recording, fence, GPU queues, others."""
    n = name.casefold()
    if n in ("event loop", "mainthread"):
        return 0
    if n.startswith("hetero-cpu"):
        return 100
    if n.startswith("hetero-proc"):
        return 150
    if n.startswith("hetero-gpu"):
        return 200
    if "fence" in n:
        return 300
    if n.startswith("gpu queue") or n.startswith("gpu"):
        return 400
    return 500


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), default=repr)  # the C encoder


class Tracer:
    """Collects trace events from any thread; :meth:`write` dumps them as one JSON file."""

    def __init__(self, path: str | os.PathLike[str], *, process_name: str = "hetero",
                 max_events: int = DEFAULT_MAX_EVENTS, other_data: Mapping[str, Any] | None = None) -> None:
        self.path = os.fspath(path)
        self.process_name = process_name
        self.max_events = max_events
        self.origin_ns = time.perf_counter_ns()
        self._origin_wall = time.time()
        self.other_data: dict[str, Any] = dict(other_data or {})
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._events: list[_Event] = []
        self._tracks: dict[int, tuple[str, int]] = {}  # tid -> (name, sort index)
        self._named: dict[str, int] = {}  # synthetic track name -> tid
        self._tids = itertools.count(1)
        self._flows = itertools.count(1)
        self._local = threading.local()
        self.dropped = 0
        self.errors = 0
        self.closed = False
        self.writes = 0
        self.write_error: OSError | None = None  # why the last write failed; None once one succeeds
        self._last_write = 0.0
        self._encoded: list[str] = []  # JSON of the first _encoded_count events, a run of them per write
        self._encoded_count = 0

    # -- tracks ---------------------------------------------------------------------------
    def _thread_tid(self) -> int:
        tid: int | None = getattr(self._local, "tid", None)
        if tid is None:
            name = threading.current_thread().name
            with self._lock:
                tid = next(self._tids)
                self._tracks[tid] = (name, _sort_index(name))
            self._local.tid = tid
        return tid

    def _track_tid(self, track: str | None) -> int:
        if track is None:
            return self._thread_tid()
        tid = self._named.get(track)
        if tid is None:
            with self._lock:
                tid = self._named.get(track)
                if tid is None:
                    tid = next(self._tids)
                    self._tracks[tid] = (track, _sort_index(track))
                    self._named[track] = tid
        return tid

    def name_thread(self, name: str, *, sort_index: int | None = None) -> None:
        """Name the calling thread's track (e.g. ``"event loop"``), replacing its thread name."""
        try:
            tid = self._thread_tid()
            with self._lock:
                self._tracks[tid] = (name, _sort_index(name) if sort_index is None else sort_index)
        except Exception:  # noqa: BLE001 - tracing never breaks the traced code
            self._failed()

    def track(self, name: str) -> int:
        """The tid of the named (non-thread) track ``name``, created on first use."""
        return self._track_tid(name)

    # -- recording ------------------------------------------------------------------------
    def _add(self, ev: _Event) -> None:
        self._add_many((ev,))

    def _add_many(self, events: Sequence[_Event]) -> None:
        """Record ``events`` in order, as many as the cap leaves room for (the rest counted dropped)."""
        with self._lock:
            if self.closed:
                return
            room = max(0, self.max_events - len(self._events))
            if room < len(events):
                self.dropped += len(events) - room
                events = events[:room]
            self._events.extend(events)

    def _failed(self) -> None:
        self.errors += 1
        if self.errors == 1:
            log.warning("hetero: the tracer failed to record an event", exc_info=True)

    def span(self, name: str, cat: str, start_ns: int, end_ns: int, *, track: str | None = None,
             args: Mapping[str, Any] | None = None, flow_out: int | None = None,
             flow_in: int | None = None) -> None:
        """A complete event (``ph: "X"``) from ``start_ns`` to ``end_ns`` (``perf_counter_ns``).

        ``track``: None for the calling thread's track, or a named track (``"GPU queue"``).
        An end before the start is clamped to a zero duration. ``flow_out`` / ``flow_in``
        start / end a flow arrow (an id from :meth:`new_flow`) bound to this span.
        """
        try:
            tid = self._track_tid(track)
            dur = end_ns - start_ns
            if dur < 0:
                dur = 0
            a = dict(args) if args else None
            self._add(("X", name, cat, tid, start_ns, dur, a))
            if flow_out is not None or flow_in is not None:
                mid = start_ns + dur // 2  # strictly inside the span, so the arrow binds to it
                # Perfetto pairs v1 flow events by (id, cat, name): both ends use the same cat and name.
                if flow_in is not None:
                    self._add(("f", "flow", "flow", tid, mid, flow_in, None))
                if flow_out is not None:
                    self._add(("s", "flow", "flow", tid, mid, flow_out, None))
        except Exception:  # noqa: BLE001
            self._failed()

    def gpu_span(self, name: str, start_ns: int, end_ns: int, args: Mapping[str, Any] | None = None, *,
                 queue: str = GPU_QUEUE, cat: str = "gpu", flow_in: int | None = None) -> None:
        """A span on a GPU queue track; times already converted to the host clock (``perf_counter_ns``)."""
        self.span(name, cat, start_ns, end_ns, track=queue, args=args, flow_in=flow_in)

    def gpu_spans(self, spans: Iterable[tuple[str, int, int, dict[str, Any] | None, str]], cat: str = "gpu") -> None:
        """Many :meth:`gpu_span` at once: ``(name, start_ns, end_ns, args, queue)`` each, under
        one lock (the GPU timestamps of a submission, a span per dispatch). The ``args`` dicts
        are taken over, not copied: the caller makes a fresh one per span."""
        try:
            tids: dict[str, int] = {}
            events: list[_Event] = []
            for name, start_ns, end_ns, args, queue in spans:
                tid = tids.get(queue)
                if tid is None:
                    tid = tids[queue] = self._track_tid(queue)
                events.append(("X", name, cat, tid, start_ns, max(0, end_ns - start_ns), args or None))
            self._add_many(events)
        except Exception:  # noqa: BLE001
            self._failed()

    @contextmanager
    def cpu_span(self, name: str, cat: str = "cpu", args: Mapping[str, Any] | None = None, *,
                 track: str | None = None, flow_out: int | None = None) -> Iterator[dict[str, Any]]:
        """Time the ``with`` block as a span on the calling thread's track.

        Yields a dict of args the block may add to; an exception leaving the block is
        noted in the span's args (and propagates).
        """
        extra: dict[str, Any] = dict(args) if args else {}
        start = time.perf_counter_ns()
        try:
            yield extra
        except BaseException as e:
            extra["error"] = f"{type(e).__name__}: {e}"
            raise
        finally:
            self.span(name, cat, start, time.perf_counter_ns(), track=track, args=extra or None, flow_out=flow_out)

    def instant(self, name: str, cat: str = "", ts_ns: int | None = None, *, track: str | None = None,
                args: Mapping[str, Any] | None = None) -> None:
        """An instant event (``ph: "i"``, thread scope) at ``ts_ns`` (default: now)."""
        try:
            ts = time.perf_counter_ns() if ts_ns is None else ts_ns
            self._add(("i", name, cat, self._track_tid(track), ts, 0, dict(args) if args else None))
        except Exception:  # noqa: BLE001
            self._failed()

    def counter(self, name: str, ts_ns: int | None, values: Mapping[str, float]) -> None:
        """A counter sample (``ph: "C"``): one Perfetto counter track per key of ``values``.

        E.g. ``counter("buffer pool", None, {"in_use": 4096, "pooled": 65536})`` (bytes).
        """
        try:
            ts = time.perf_counter_ns() if ts_ns is None else ts_ns
            vals = {str(k): float(v) for k, v in values.items()}
            self._add(("C", name, "", self._thread_tid(), ts, 0, vals))
        except Exception:  # noqa: BLE001
            self._failed()

    def new_flow(self) -> int:
        """A fresh id for a flow arrow (``flow_out`` of one span, ``flow_in`` of another)."""
        return next(self._flows)

    # -- output ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._events)

    def events(self) -> list[dict[str, Any]]:
        """Everything recorded so far as trace-event dicts, metadata first."""
        with self._lock:
            events = list(self._events)
            tracks = dict(self._tracks)
        return self._metadata(tracks) + [self._event(e) for e in events]

    def _metadata(self, tracks: Mapping[int, tuple[str, int]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": PID, "tid": 0, "ts": 0,
             "args": {"name": self.process_name}},
        ]
        for tid, (name, order) in sorted(tracks.items()):
            out.append({"ph": "M", "name": "thread_name", "pid": PID, "tid": tid, "ts": 0, "args": {"name": name}})
            out.append({"ph": "M", "name": "thread_sort_index", "pid": PID, "tid": tid, "ts": 0,
                        "args": {"sort_index": order * 1000 + tid}})
        return out

    def _event(self, e: _Event) -> dict[str, Any]:
        ph, name, cat, tid, ts_ns, x, args = e
        ev: dict[str, Any] = {"ph": ph, "name": name, "pid": PID, "tid": tid, "ts": (ts_ns - self.origin_ns) / 1000.0}
        if cat:
            ev["cat"] = cat
        if ph == "X":
            ev["dur"] = x / 1000.0
        elif ph == "i":
            ev["s"] = "t"
        elif ph in ("s", "f"):
            ev["id"] = x
            if ph == "f":
                ev["bp"] = "e"  # bind to the enclosing slice (the GPU span), not the next one
        if args:
            ev["args"] = args
        return ev

    def _other(self) -> dict[str, Any]:
        return {
            "clock": "time.perf_counter_ns, microseconds from origin",
            "origin_perf_counter_ns": self.origin_ns,
            "origin_unix_time": self._origin_wall,
            "dropped_events": self.dropped,
            "recording_errors": self.errors,
            **self.other_data,
        }

    def to_json(self) -> dict[str, Any]:
        return {"traceEvents": self.events(), "displayTimeUnit": "ms", "otherData": self._other()}

    def write(self) -> str:
        """Rewrite the trace file with every event so far (atomically); return its path.

        Events are encoded once: each write encodes those recorded since the last one and
        joins them to the text kept from before (the whole file re-encoded at every write
        held the interpreter for most of 0.2 s once a pass of MiniLM batches was in it).
        Unlike the recording methods this raises (``OSError``) when the file cannot be written.
        """
        with self._write_lock:
            with self._lock:
                new = self._events[self._encoded_count:]
                tracks = dict(self._tracks)
            if new:
                self._encoded.append(_dumps([self._event(e) for e in new])[1:-1])
                self._encoded_count += len(new)
            body = ",".join([_dumps(self._metadata(tracks))[1:-1], *self._encoded])
            atomic_write_text(self.path, '{"traceEvents":[' + body + '],"displayTimeUnit":"ms","otherData":'
                              + _dumps(self._other()) + "}")
            self.writes += 1
            self.write_error = None
            self._last_write = time.monotonic()
        return self.path

    def maybe_write(self, min_interval: float = 1.0) -> bool:
        """:meth:`write` unless the last write was less than ``min_interval`` s ago (for run ends).

        Never raises: a file that cannot be written keeps its reason in ``write_error``
        (the final write at :meth:`close` reports it); another failure is logged and counted.
        """
        if self.writes and time.monotonic() - self._last_write < min_interval:
            return False
        try:
            self.write()
            return True
        except OSError as e:
            self.write_error = e
            return False
        except Exception:  # noqa: BLE001
            self._failed()
            return False

    def close(self) -> bool:
        """Stop recording and write the file a last time; True if written. Idempotent, never raises.

        When the file cannot be written, ``write_error`` says why (the caller reports it).
        """
        with self._lock:
            if self.closed:
                return False
            self.closed = True
        try:
            self.write()
            return True
        except OSError as e:
            self.write_error = e
            return False
        except Exception:  # noqa: BLE001 - a defect in the tracer must not fail the close
            log.warning("hetero: could not write the trace file %s", self.path, exc_info=True)
            return False
