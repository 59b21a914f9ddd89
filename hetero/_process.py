"""Process stages: a pool of worker processes, and shared memory for large numpy arrays.

``g.cpu(fn, ..., process=True)`` runs ``fn`` in a worker process, so a pure-Python
stage that holds the GIL does not stall the threads recording GPU work.

The pool
--------
A small pool of our own rather than :class:`concurrent.futures.ProcessPoolExecutor`:
a cancelled or timed-out stage must end its worker while the other workers carry on.
The executor cannot cancel a running call; its only way out is to break (and
recreate) the whole pool, which throws away every other stage in flight. Here each
worker has its own pipe and sentinel, so one worker is killed and replaced, and a
crashed worker (``os._exit``, a segfault) fails only the stage it was running.

* Workers start on first use (``Runtime(cpu_processes=N)``, default cores - 1) with
  the ``forkserver`` start method where the platform has it, else ``spawn``. Never
  ``fork``: the parent runs wgpu, a fence thread and worker threads, and a forked
  child inherits their locks in whatever state they were (a deadlock waiting to
  happen). The fork server is a fresh process that only imported hetero (no device,
  no scheduler threads), so replacing a killed worker costs a fork, not a fresh
  interpreter and its imports.
* The thread that submits a job pickles it and, when a worker is idle, sends it
  right away; otherwise the job waits in a priority queue (same keys as the thread
  pools). One dispatcher thread (``hetero-proc``) waits on every worker's pipe and
  sentinel at once, receives results, hands the next queued job to the freed worker
  and calls the job's completion. No thread sits blocked for a running stage.
* Workers ignore SIGINT: on Ctrl-C the parent decides what ends, and cleans up.

Shared memory
-------------
Arguments and results are pickled with protocol 5. Each contiguous buffer of at
least ``threshold`` bytes (numpy arrays among them) goes out of band into a
shared-memory segment instead of into the pickle; the other side unpickles arrays
that are views of the segment (one copy in, none out).

Segments are reused: writing into fresh pages costs a page fault (and zeroing) per
page, several times the copy itself, so a segment stays mapped in both processes
and carries message after message.

* A segment is a shared-memory file without a name (``memfd_create``; elsewhere a
  POSIX segment unlinked as soon as it is open). It travels once per process, as a
  file descriptor after the message that first uses it; then only its id does.
  Nothing is ever listed in /dev/shm, so nothing can be left there: its memory goes
  with the last process that maps it, crashed, killed or closed.
* Sizes come in classes (8 per doubling); a cache keeps free segments up to twice
  the largest message so far (at least 64 MiB; the pool's argument cache also as
  much as was ever in use at once) and drops the oldest beyond that.
  ``rt.trim()`` drops the pool's free argument segments.
* Argument segments belong to the pool. The submitting thread copies into a free
  one (numpy copies without the GIL); the job returns it when it ends. A worker that
  still holds views of its arguments once the call returned (the function stored
  them) says so, and the parent drops that segment instead of reusing it.
* Result segments belong to their worker. The parent decodes each message as views
  of a per-message lease (an ndarray subclass, so views keep it alive); when the
  last view dies its finalizer (any thread) queues the segment's id, which goes to
  the worker with its next job, and only then may the worker write it again. A
  result the caller keeps is never overwritten.
* Segments named in /dev/shm (platforms without ``memfd_create``) carry the parent's
  pid (``/hetero<pid>_...``); closing the pool sweeps this process's, a new pool
  those of dead parents. Where neither is available (Windows) everything travels in
  the pickle.
"""

from __future__ import annotations

import atexit
import collections
import functools
import heapq
import itertools
import logging
import mmap
import multiprocessing as mp
import selectors
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
import weakref
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable

import numpy as np

from ._argtypes import check_positive_int

try:
    import _posixshmem
except ImportError:  # pragma: no cover - Windows
    _posixshmem = None

__all__ = ["Job", "ProcessPool", "SHM_THRESHOLD", "check_unpicklable", "shm_segments"]

log = logging.getLogger("hetero")

# Buffers (numpy arrays) of at least this many bytes travel through shared memory.
SHM_THRESHOLD = 1 << 16
_ALIGN = 64
_CACHE_MIN = 64 << 20  # a cache of free segments keeps at least this many bytes (see _cache_limit)
_PREFIX = "hetero"  # then the parent pid, "_", and more (short: macOS allows 31 characters)
_SHM_DIR = "/dev/shm"  # where Linux lists POSIX shared memory (for sweeping)
_MEMFD = hasattr(os, "memfd_create")  # Linux: shared-memory files without a name
# Segments travel as file descriptors over the worker's socket.
_SHM = (_MEMFD or _posixshmem is not None) and hasattr(socket, "send_fds")


# -- shared-memory segments ----------------------------------------------------------
def _map(fd: int, size: int) -> mmap.mmap:
    # No MAP_POPULATE: it maps a tmpfs file page by page, where faults map 16 pages at a
    # time (fault-around); populating 64 MiB took twice as long as touching every page.
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _new_fd(size: int, tag: str) -> int:
    """A new shared-memory file of ``size`` bytes that has no name (nothing to leave behind)."""
    if _MEMFD:
        fd = os.memfd_create(f"{_PREFIX}{os.getpid()}_{tag}", os.MFD_CLOEXEC)
    else:  # pragma: no cover - macOS: named for an instant, swept if we die in it
        name = f"/{_PREFIX}{os.getpid()}_{tag}"
        fd = _posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        _unlink(name)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _size_class(n: int) -> int:
    """Segment size for ``n`` bytes: 8 classes per doubling (at most 12.5% unused)."""
    n = max(n, SHM_THRESHOLD)
    step = 1 << max(0, (n - 1).bit_length() - 3)
    return (n + step - 1) // step * step


class _Lease(np.ndarray):
    """One message's view of a segment: arrays unpickled from the message are views of it,
    so it dies with the last of them, and its finalizer frees the segment for reuse."""


class Segment:
    """A shared-memory file mapped in this process, reused from message to message."""

    __slots__ = ("id", "size", "fd", "arr", "__weakref__")

    def __init__(self, id: int, size: int, fd: int, keep_fd: bool = True) -> None:
        """Map ``fd`` (the mapping holds a descriptor of its own); keep ``fd`` to send it on."""
        self.id = id
        self.size = size
        self.fd = fd if keep_fd else -1
        try:
            self.arr: np.ndarray | None = np.frombuffer(_map(fd, size), np.uint8)
        except BaseException:
            os.close(fd)
            raise
        if not keep_fd:
            os.close(fd)

    @classmethod
    def new(cls, id: int, size: int, tag: str) -> Segment:
        return cls(id, size, _new_fd(size, tag))

    def lease(self, on_free: Callable[[], None] | None) -> np.ndarray:
        assert self.arr is not None
        view = self.arr.view(_Lease)
        if on_free is not None:
            weakref.finalize(view, on_free).atexit = False
        return view

    def close(self) -> None:
        """Drop this process's handle; the mapping goes with the last array on it."""
        if self.arr is not None:
            self.arr = None
            if self.fd >= 0:
                os.close(self.fd)


def _unlink(name: str) -> None:
    try:
        _posixshmem.shm_unlink(name)
    except FileNotFoundError:
        pass


def shm_segments(pid: int | None = None) -> list[str]:
    """Names of this process's (or ``pid``'s) segments listed in /dev/shm; [] where it cannot be listed."""
    prefix = f"{_PREFIX}{os.getpid() if pid is None else pid}_"
    try:
        return sorted(n for n in os.listdir(_SHM_DIR) if n.startswith(prefix))
    except OSError:
        return []


def open_segments(pid: int | None = None) -> int:
    """How many shared-memory files process ``pid`` (default this one) holds open; 0 where unknown."""
    d = f"/proc/{os.getpid() if pid is None else pid}/fd"
    n = 0
    try:
        fds = os.listdir(d)
    except OSError:
        return 0
    for f in fds:
        try:
            if os.readlink(f"{d}/{f}").startswith(f"/memfd:{_PREFIX}"):
                n += 1
        except OSError:
            pass
    return n


def _sweep(prefix: str) -> None:
    """Unlink every segment whose name starts with ``prefix``."""
    try:
        names = os.listdir(_SHM_DIR)
    except OSError:
        return
    for n in names:
        if n.startswith(prefix):
            _unlink("/" + n)


def _sweep_dead_parents() -> None:
    """Unlink named segments left by processes that no longer exist (killed with SIGKILL, say)."""
    try:
        names = os.listdir(_SHM_DIR)
    except OSError:
        return
    dead: dict[int, bool] = {}
    for n in names:
        if not n.startswith(_PREFIX):
            continue
        head = n[len(_PREFIX):].split("_", 1)[0]
        if not head.isdigit():
            continue
        pid = int(head)
        if pid not in dead:
            try:
                os.kill(pid, 0)
                dead[pid] = False
            except ProcessLookupError:
                dead[pid] = True
            except OSError:
                dead[pid] = False
        if dead[pid]:
            _unlink("/" + n)


def _copy_in(dst: np.ndarray, src: pickle.PickleBuffer) -> None:
    # numpy copies without the GIL (a memoryview assignment would hold it).
    with src.raw() as raw:
        np.copyto(dst, np.frombuffer(raw, np.uint8))


def encode(obj: Any, threshold: int, acquire: Callable[[int], Segment] | None
           ) -> tuple[bytes, Segment | None, tuple[tuple[int, int], ...]]:
    """Pickle ``obj``; buffers of ``threshold`` bytes or more are copied into one segment from
    ``acquire(size)`` (no segment without ``acquire``: everything in the pickle)."""
    big: list[pickle.PickleBuffer] = []

    def out_of_band(buf: pickle.PickleBuffer) -> bool:
        try:
            n = buf.raw().nbytes
        except BufferError:  # not contiguous: let pickle copy it
            return True
        if n < threshold:
            return True
        big.append(buf)
        return False

    data = pickle.dumps(obj, protocol=5, buffer_callback=out_of_band if acquire is not None else None)
    if not big or acquire is None:
        return data, None, ()
    layout = []
    off = 0
    for b in big:
        n = b.raw().nbytes
        layout.append((off, n))
        off += (n + _ALIGN - 1) // _ALIGN * _ALIGN
    seg = acquire(off)
    assert seg.arr is not None
    try:
        for b, (o, n) in zip(big, layout):
            _copy_in(seg.arr[o:o + n], b)
    except BaseException:
        seg.close()
        raise
    return data, seg, tuple(layout)


def decode(data: bytes, seg: Segment | None, layout: tuple[tuple[int, int], ...],
           on_free: Callable[[], None] | None = None) -> Any:
    """Unpickle; large buffers become views of ``seg``. ``on_free`` runs once none is left."""
    if seg is None:
        return pickle.loads(data)
    lease = seg.lease(on_free)
    return pickle.loads(data, buffers=[lease[o:o + n] for o, n in layout])


def check_unpicklable(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], skip: tuple[type, ...]) -> str | None:
    """Why ``fn`` or a constant argument cannot be pickled, or None (values of ``skip`` types are
    graph references, checked when they arrive). Buffers are not copied while checking."""

    def why(obj: Any) -> str | None:
        try:
            pickle.dumps(obj, protocol=5, buffer_callback=lambda b: False)
        except Exception as e:  # noqa: BLE001 - any failure to pickle is reported
            return f"{type(e).__name__}: {e}"
        return None

    w = why(fn)
    if w is not None:
        return f"its function {fn!r} cannot be pickled ({w})"
    named = [(f"argument {i}", a) for i, a in enumerate(args)] + [(f"keyword argument {k!r}", v)
                                                                   for k, v in kwargs.items()]
    for where, a in named:
        if not isinstance(a, skip):
            w = why(a)
            if w is not None:
                return f"its {where} ({type(a).__name__}) cannot be pickled ({w})"
    return None


# -- the worker process --------------------------------------------------------------
class _RemoteTraceback(Exception):
    """The worker's traceback, as text: chained under the exception it belongs to."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return "\n\nworker traceback:\n" + self.tb


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives a pickle round trip, else a RuntimeError that says what it was."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception as e:  # noqa: BLE001
        return RuntimeError(f"{type(exc).__qualname__}: {exc} (the exception itself could not be pickled: "
                            f"{type(e).__name__}: {e})")


def _cache_limit(largest: int) -> int:
    """Bytes of free segments a cache keeps: twice the largest message so far, at least _CACHE_MIN."""
    return max(_CACHE_MIN, 2 * largest)


def _take(free: list[Segment], size: int) -> Segment | None:
    """The most recently freed segment of exactly ``size`` bytes, removed from ``free``."""
    for k in range(len(free) - 1, -1, -1):
        if free[k].size == size:
            return free.pop(k)
    return None


def _clear_tracebacks(exc: BaseException | None) -> None:
    """Let go of the frames (and so the arguments) an exception's chain refers to; its text is kept."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc.__traceback__ = None
        exc = exc.__cause__ or exc.__context__


def _worker_main(conn: Any, parent: int, threshold: int) -> None:
    """Receive ``(job id, pickle, argument segment, layout, released, forget)``, run it, send
    ``(job id, ok, payload, t0, t1, argument kept, dropped)`` back; stop at EOF or None.

    A segment new to the other side follows its message as a file descriptor. ``released``:
    result segments the parent no longer reads; ``forget``: argument segments it dropped;
    ``dropped``: result segments this worker let go; ``argument kept``: the call kept a view of
    its argument segment (the function stored it), so the parent must not reuse that segment.

    Messages are plain protocol-5 pickles through ``send_bytes``: ``Connection.send`` builds a
    ForkingPickler per message (copying the copyreg table), ~10 µs more of GIL time each.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    args: dict[int, Segment] = {}  # the parent's argument segments, mapped here
    results: dict[int, Segment] = {}  # result segments made here (lent to the parent or free)
    free: list[Segment] = []
    largest = 0
    ids = itertools.count()

    while True:
        try:
            job = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        if job is None:
            return
        job_id, data, arg, layout, released, forget = job
        del job
        for i in forget:
            seg = args.pop(i, None)
            if seg is not None:
                seg.close()
        for i in released:
            if i in results:
                free.append(results[i])
        dropped = []
        while free and sum(s.size for s in free) > _cache_limit(largest):
            seg = free.pop(0)
            del results[seg.id]
            seg.close()
            dropped.append(seg.id)
        seg = None
        if arg is not None:
            sid, size, new = arg
            try:
                if new:
                    _, fds, _, _ = socket.recv_fds(sock, 1, 1)
                    args[sid] = Segment(sid, size, fds[0], keep_fd=False)
                seg = args[sid]
            except (OSError, IndexError, KeyError):
                return  # the parent is gone or out of step: nothing sensible is left to do
        made: list[Segment] = []
        taken: list[Segment] = []

        def acquire(n: int) -> Segment:
            nonlocal largest
            size = _size_class(n)
            largest = max(largest, size)
            s = _take(free, size)
            if s is None:
                k = next(ids)
                s = Segment.new(k, size, f"r{k}")
                results[s.id] = s
                made.append(s)
            taken.append(s)
            return s

        freed: list[bool] = []
        hold: list[Any] = []
        reply = _run_job(job_id, data, seg, layout, lambda: freed.append(True), acquire, threshold, hold)
        del data
        if seg is not None and not freed:
            hold.clear()  # the value may be (a view of) an argument
        kept = seg is not None and not freed
        if kept:
            assert seg is not None
            args.pop(seg.id).close()
        del seg
        send_fd = None
        if reply[1] and reply[2][1] is not None:
            rid, rsize = reply[2][1]
            new = any(s.id == rid for s in made)
            if new:
                send_fd = results[rid].fd
            reply = (reply[0], True, (reply[2][0], (rid, rsize, new), reply[2][2]), reply[3], reply[4])
            free.extend(s for s in taken if s.id != rid)  # acquired but not sent (cannot happen twice)
        else:
            free.extend(taken)
        try:
            conn.send_bytes(pickle.dumps((*reply, kept, tuple(dropped)), protocol=5))
            if send_fd is not None:
                socket.send_fds(sock, [b"F"], [send_fd])
        except (OSError, ValueError):  # the parent is gone
            return
        # Only now let go of the value: freeing a large one takes a while.
        del hold, reply


def _run_job(job_id: int, data: bytes, seg: Segment | None, layout: tuple[tuple[int, int], ...],
             on_free: Callable[[], None], acquire: Callable[[int], Segment], threshold: int,
             hold: list[Any]) -> tuple[Any, ...]:
    """Run one call; its value goes into ``hold``. ``on_free`` runs once no argument view is left."""
    t0 = time.perf_counter_ns()
    try:
        fn, args, kwargs = decode(data, seg, layout, on_free)
        value = fn(*args, **kwargs)
        del args, kwargs
        hold.append(value)
        t1 = time.perf_counter_ns()
        try:
            body, res, res_layout = encode(value, threshold, acquire if _SHM else None)
        except Exception as e:
            raise TypeError(f"the stage's result cannot be pickled ({type(e).__name__}: {e})") from e
        del value
        out = None if res is None else (res.id, res.size)
        return (job_id, True, (body, out, res_layout), t0, t1)
    except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
        t1 = time.perf_counter_ns()
        tb = traceback.format_exc()
        _clear_tracebacks(e)
        return (job_id, False, (_portable(e), tb), t0, t1)


# -- the parent side -----------------------------------------------------------------
class _NoSharedMemory(MemoryError):
    """A shared-memory segment for a job's arguments could not be made."""


# on_done(ok, value or exception, worker index, t0 ns, t1 ns) runs on the dispatcher thread.
Done = Callable[[bool, Any, int, int, int], None]


class Job:
    """One call of a process stage: queued, then running on one worker, then done."""

    __slots__ = ("key", "data", "seg", "layout", "on_done", "state", "worker", "arrival")

    def __init__(self, key: Any, data: bytes, seg: Segment | None, layout: tuple[tuple[int, int], ...],
                 on_done: Done, arrival: int) -> None:
        self.key = key
        self.data = data
        self.seg = seg  # the arguments' segment, the pool's again once the job ends
        self.layout = layout
        self.on_done = on_done
        self.state = "queued"  # queued | running | done | cancelled
        self.worker: _Worker | None = None
        self.arrival = arrival

    def __lt__(self, other: Job) -> bool:
        return (self.key, self.arrival) < (other.key, other.arrival)


class _Worker:
    __slots__ = ("index", "proc", "conn", "sock", "job", "known", "forget", "results", "released")

    def __init__(self, index: int, proc: Any, conn: Any) -> None:
        self.index = index
        self.proc = proc
        self.conn = conn
        # The same socket, for file descriptors (a segment new to the other side).
        self.sock = socket.socket(fileno=os.dup(conn.fileno())) if _SHM else None
        self.job: Job | None = None
        self.known: set[int] = set()  # argument segments it has mapped
        self.forget: collections.deque[int] = collections.deque()  # ... that it should drop
        self.results: dict[int, Segment] = {}  # its result segments, mapped here
        # Result segments whose arrays all died here (appended by finalizers, on any thread).
        self.released: collections.deque[int] = collections.deque()

    def drop(self) -> None:
        """The worker is gone: let go of its sockets and result segments (arrays keep their memory)."""
        for seg in self.results.values():
            seg.close()
        self.results.clear()
        for c in (self.conn, self.sock):
            try:
                if c is not None:
                    c.close()
            except OSError:  # pragma: no cover
                pass


def _releaser(w: _Worker, rid: int) -> Callable[[], None]:
    """Run when the last array on result segment ``rid`` died: the worker may write it again."""
    return functools.partial(w.released.append, rid)


_live_pools: weakref.WeakSet[ProcessPool] = weakref.WeakSet()


def _close_all() -> None:
    for pool in list(_live_pools):
        pool.close()


atexit.register(_close_all)


def _context() -> Any:
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # The fork server imports hetero (and numpy) once, so a worker replacing a killed or
    # crashed one starts in a fork's time instead of an import's. Added to whatever is
    # preloaded already; no effect once the server runs.
    from multiprocessing import forkserver

    have = list(getattr(forkserver._forkserver, "_preload_modules", ["__main__"]))
    if __name__ not in have:
        ctx.set_forkserver_preload([*have, __name__])
    return ctx


class ProcessPool:
    """``size`` worker processes, started on first submit, fed from a priority queue."""

    def __init__(self, size: int, threshold: int = SHM_THRESHOLD) -> None:
        self.size = check_positive_int("cpu_processes", size)
        self.threshold = threshold
        self._ctx = _context()
        self._lock = threading.Lock()
        self._workers: list[_Worker | None] = [None] * size
        self._idle: list[_Worker] = []
        self._queue: list[Job] = []
        self._arrival = itertools.count()
        self._seg_ids = itertools.count()
        self._free: list[Segment] = []  # argument segments not in use (any worker may have mapped them)
        self._largest = 0
        self._in_use = 0  # bytes of argument segments held by jobs
        self._peak = 0  # ... at most, so far: the free ones kept cover a burst that large
        self.segments_made = 0
        self._started = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = mp.Pipe(duplex=False)
        # What the dispatcher waits on, registered once per worker (not rebuilt per wake-up).
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._wake_r, selectors.EVENT_READ, ("wake", None))
        self.calls = 0
        self.crashes = 0
        self.killed = 0

    @property
    def pids(self) -> list[int]:
        with self._lock:
            return [w.proc.pid for w in self._workers if w is not None]

    # -- submitting ---------------------------------------------------------------------
    def _acquire(self, n: int) -> Segment:
        """A free argument segment for ``n`` bytes, or a new one."""
        size = _size_class(n)
        with self._lock:
            self._largest = max(self._largest, size)
            self._in_use += size
            self._peak = max(self._peak, self._in_use)
            seg = _take(self._free, size)
            if seg is not None:
                return seg
            self.segments_made += 1
            k = next(self._seg_ids)
        try:
            return Segment.new(k, size, f"a{k}")
        except OSError as e:
            with self._lock:
                self._in_use -= size
            raise _NoSharedMemory(f"no shared memory for the stage's arguments: a segment of {size} bytes "
                                  f"could not be made ({e}); free memory or pass smaller arrays") from e

    def job(self, key: Any, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
            on_done: Done) -> Job:
        """Pickle ``fn(*args, **kwargs)`` into a job for :meth:`submit`. Raises if it cannot be pickled
        or its shared memory cannot be made; nothing is held then."""
        taken: list[Segment] = []

        def acquire(n: int) -> Segment:
            seg = self._acquire(n)
            taken.append(seg)
            return seg

        try:
            data, seg, layout = encode((fn, args, kwargs), self.threshold, acquire if _SHM else None)
        except Exception as e:
            with self._lock:
                for s in taken:  # closed by encode: no longer in use
                    self._in_use -= s.size
            if isinstance(e, _NoSharedMemory):
                raise
            raise TypeError(f"the stage's arguments cannot be pickled ({type(e).__name__}: {e})") from e
        return Job(key, data, seg, layout, on_done, next(self._arrival))

    def submit(self, job: Job) -> None:
        """Run ``job`` on an idle worker now, or queue it; ``job.on_done`` gets its result."""
        try:
            with self._lock:
                if self._closed:
                    raise RuntimeError("the process pool is closed")
                if job.state != "queued":  # cancelled before it was submitted
                    return
                if not self._started:
                    self._start()
                self.calls += 1
                if not self._idle:
                    heapq.heappush(self._queue, job)
                    return
                w = self._idle.pop()
                self._give(w, job)
        except BaseException:
            self._release(job)
            raise
        self._send(w, job)

    @staticmethod
    def _give(w: _Worker, job: Job) -> None:
        """Assign ``job`` to idle worker ``w`` (with the lock held; then :meth:`_send` without it)."""
        job.state = "running"
        job.worker = w
        w.job = job

    @staticmethod
    def _send(w: _Worker, job: Job) -> None:
        seg = job.seg
        arg = None
        if seg is not None:
            arg = (seg.id, seg.size, seg.id not in w.known)
            w.known.add(seg.id)
        released = [w.released.popleft() for _ in range(len(w.released))]
        forget = [w.forget.popleft() for _ in range(len(w.forget))]
        try:
            w.conn.send_bytes(pickle.dumps((job.arrival, job.data, arg, job.layout, released, forget), protocol=5))
            if arg is not None and arg[2]:
                assert seg is not None and w.sock is not None
                socket.send_fds(w.sock, [b"F"], [seg.fd])
        except (OSError, ValueError):  # the worker died (or was killed): the dispatcher sees its sentinel
            pass

    def cancel(self, job: Job) -> None:
        """Forget ``job``: a queued one never runs; a running one's worker is killed (and replaced)."""
        with self._lock:
            if job.state == "queued":
                job.state = "cancelled"
                if job in self._queue:
                    self._queue.remove(job)
                    heapq.heapify(self._queue)
            elif job.state == "running":
                job.state = "cancelled"
                w = job.worker
                if w is not None and w.job is job:  # not yet answered: end the worker
                    self.killed += 1
                    try:
                        w.proc.kill()
                    except Exception:  # noqa: BLE001 - already gone
                        pass
                return  # its segment is free once the dispatcher saw the worker end
            else:
                return
        self._release(job)

    def _release(self, job: Job, kept: bool = False) -> None:
        """The job ended: its argument segment is free again, or dropped when ``kept`` (a worker
        still has views of it) or beyond the cache's limit."""
        seg, job.seg = job.seg, None
        if seg is None:
            return
        drop = [seg] if kept or self._closed else []
        with self._lock:
            self._in_use -= seg.size
            if not drop:
                self._free.append(seg)
                limit = max(_cache_limit(self._largest), self._peak)
                while sum(s.size for s in self._free) > limit:
                    drop.append(self._free.pop(0))
            self._forget(drop, job.worker if kept else None)
        for s in drop:
            s.close()

    def _forget(self, drop: list[Segment], holder: _Worker | None) -> None:
        """Tell the workers that mapped ``drop`` to let go of it (with the lock held); ``holder``
        dropped it already."""
        for s in drop:
            for w in self._workers:
                if w is not None and s.id in w.known:
                    w.known.discard(s.id)
                    if w is not holder:
                        w.forget.append(s.id)

    def trim(self) -> int:
        """Drop the free argument segments (workers let go of them with their next job); returns bytes."""
        with self._lock:
            drop, self._free = self._free, []
            self._peak = self._in_use
            self._forget(drop, None)
        for s in drop:
            s.close()
        return sum(s.size for s in drop)

    # -- workers --------------------------------------------------------------------------
    def start(self) -> None:
        """Start the workers now rather than with the first job (e.g. at warm-up)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the process pool is closed")
            if not self._started:
                self._start()

    def _start(self) -> None:
        _sweep_dead_parents()
        self._started = True
        for i in range(self.size):
            self._spawn(i)
        _live_pools.add(self)
        self._thread = threading.Thread(target=self._dispatch, name="hetero-proc", daemon=True)
        self._thread.start()

    def _spawn(self, index: int) -> None:
        """Start worker ``index`` (called with the lock held)."""
        mine, theirs = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(target=_worker_main, args=(theirs, os.getpid(), self.threshold),
                                 name=f"hetero-proc-{index}", daemon=True)
        proc.start()
        theirs.close()
        w = _Worker(index, proc, mine)
        self._workers[index] = w
        self._idle.append(w)
        self._sel.register(mine, selectors.EVENT_READ, ("conn", w))
        self._sel.register(proc.sentinel, selectors.EVENT_READ, ("dead", w))

    def _dispatch(self) -> None:
        while True:
            if self._closed:
                return
            for key, _ in self._sel.select():
                what, w = key.data
                if what == "wake":
                    while self._wake_r.poll():
                        self._wake_r.recv_bytes()
                    continue
                if self._workers[w.index] is not w:
                    continue  # already handled through its other handle
                try:
                    if what == "conn":
                        try:
                            reply = pickle.loads(w.conn.recv_bytes())
                            seg = self._result_segment(w, reply)
                        except (EOFError, OSError, IndexError, KeyError):
                            self._worker_died(w)
                            continue
                        self._finished(w, reply, seg)
                    else:
                        self._worker_died(w)
                except Exception:  # pragma: no cover - the dispatcher must keep serving the others
                    log.exception("hetero: the process pool failed to handle worker %d", w.index)

    @staticmethod
    def _result_segment(w: _Worker, reply: tuple[Any, ...]) -> Segment | None:
        """The segment holding the reply's large buffers (its descriptor follows if it is new);
        drops those the worker let go."""
        for i in reply[6]:
            seg = w.results.pop(i, None)
            if seg is not None:
                seg.close()
        if not reply[1] or reply[2][1] is None:
            return None
        rid, size, new = reply[2][1]
        if new:
            assert w.sock is not None
            _, fds, _, _ = socket.recv_fds(w.sock, 1, 1)
            w.results[rid] = Segment(rid, size, fds[0], keep_fd=False)
        return w.results[rid]

    def _finished(self, w: _Worker, reply: tuple[Any, ...], seg: Segment | None) -> None:
        job_id, ok, payload, t0, t1, kept, _ = reply
        with self._lock:
            job = w.job
            w.job = None
            # A worker whose job was cancelled is being killed: it gets nothing more.
            usable = not self._closed and (job is None or job.state != "cancelled")
            nxt = heapq.heappop(self._queue) if self._queue and usable else None
            if nxt is not None:
                self._give(w, nxt)
            elif usable:
                self._idle.append(w)
        if nxt is not None:
            self._send(w, nxt)
        if job is None or job.arrival != job_id:  # pragma: no cover - replies come in order
            log.error("hetero: process worker %d answered job %s it was not given", w.index, job_id)
            return
        self._release(job, kept)
        if job.state == "cancelled":  # nobody wants the result: its segment is free again
            if seg is not None:
                w.released.append(seg.id)
            return
        if ok:
            try:
                value = decode(payload[0], seg, payload[2], None if seg is None else _releaser(w, seg.id))
            except BaseException as e:  # noqa: BLE001
                ok, value = False, e
        else:
            exc, tb = payload
            exc.__cause__ = _RemoteTraceback(tb)
            value = exc
        if job.state == "cancelled":
            return
        job.state = "done"
        self._call(job, ok, value, w.index, t0, t1)

    def _worker_died(self, w: _Worker) -> None:
        w.proc.join(timeout=5)
        code = w.proc.exitcode
        for handle in (w.conn, w.proc.sentinel):
            try:
                self._sel.unregister(handle)
            except (KeyError, ValueError):  # pragma: no cover
                pass
        w.drop()
        nxt = nw = None
        with self._lock:
            job = w.job
            w.job = None
            if w in self._idle:
                self._idle.remove(w)
            self._workers[w.index] = None
            if not self._closed:
                self._spawn(w.index)
                nxt = heapq.heappop(self._queue) if self._queue else None
                if nxt is not None:
                    nw = self._idle.pop()
                    self._give(nw, nxt)
        if nw is not None and nxt is not None:
            self._send(nw, nxt)
        if job is None:
            return
        self._release(job)
        if job.state == "cancelled":
            return
        self.crashes += 1
        job.state = "done"
        how = f"was killed by signal {signal.Signals(-code).name}" if code is not None and code < 0 else \
            f"exited with code {code}"
        err = BrokenProcessPool(f"the worker process (pid {w.proc.pid}) running it {how}")
        self._call(job, False, err, w.index, 0, 0)

    @staticmethod
    def _call(job: Job, ok: bool, value: Any, index: int, t0: int, t1: int) -> None:
        try:
            job.on_done(ok, value, index, t0, t1)
        except BaseException:  # pragma: no cover - a completion must not kill the dispatcher
            log.exception("hetero: a process stage's completion failed")

    # -- closing --------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the workers (idle ones finish, busy ones are killed); queued jobs fail. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            workers = [w for w in self._workers if w is not None]
            queued, self._queue = self._queue, []
            self._idle = []
        for job in queued:
            self._release(job)
        for w in workers:
            try:
                if w.job is None:
                    w.conn.send_bytes(pickle.dumps(None))
                else:
                    w.proc.kill()
            except Exception:  # noqa: BLE001 - already gone
                pass
        if self._started:
            try:
                self._wake_w.send_bytes(b"c")
            except OSError:  # pragma: no cover
                pass
        for w in workers:
            w.proc.join(timeout=2)
            if w.proc.exitcode is None:
                w.proc.kill()
                w.proc.join(timeout=2)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if self._thread is None or not self._thread.is_alive():
            self._sel.close()
            self._wake_r.close()
            self._wake_w.close()
        for w in workers:
            if w.job is not None:
                self._release(w.job)
            w.drop()
        with self._lock:
            free, self._free = self._free, []
        for seg in free:
            seg.close()
        _sweep(f"{_PREFIX}{os.getpid()}_")
        for job in queued + [w.job for w in workers if w.job is not None]:
            if job.state in ("queued", "running"):
                job.state = "done"
                self._call(job, False, RuntimeError("the runtime was closed while the stage waited or ran"),
                           -1, 0, 0)
        _live_pools.discard(self)
