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
least ``threshold`` bytes (numpy arrays among them) goes out of band into one POSIX
shared-memory segment per message instead of into the pickle; the other side maps
the segment and unpickles arrays that are views of it (one copy in, none out).

* Argument segments are created by the parent and unlinked by the worker once it
  mapped them (and by the parent when the stage ends, in case the worker died first);
  the worker unmaps them after sending its answer, so freeing their pages is not on
  the way back.
* Result segments are created by the worker; the parent maps and unlinks each as
  soon as it arrives, so the arrays it receives own the mapping: its memory lives
  exactly as long as they (and their views) do, like any other stage value.
* Segment names carry the parent's pid (``/hetero<pid>_...``) and, for results, the
  worker's. When a worker dies its leftovers are swept; closing the pool (or exit,
  or Ctrl-C through ``Runtime.close``) sweeps every segment of the process; a new
  pool sweeps those of dead parents.

The segments are made with the POSIX calls :mod:`multiprocessing.shared_memory` is
built on (``_posixshmem``), without its resource tracker: the tracker would warn
about, and try to unlink, segments the other process owns. Where ``_posixshmem`` is
missing (Windows) everything travels in the pickle.
"""

from __future__ import annotations

import atexit
import heapq
import itertools
import logging
import mmap
import multiprocessing as mp
import selectors
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import weakref
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable

try:
    import _posixshmem
except ImportError:  # pragma: no cover - Windows
    _posixshmem = None

__all__ = ["Job", "ProcessPool", "SHM_THRESHOLD", "check_unpicklable", "shm_segments"]

log = logging.getLogger("hetero")

# Buffers (numpy arrays) of at least this many bytes travel through shared memory.
SHM_THRESHOLD = 1 << 16
_ALIGN = 64
_PREFIX = "hetero"  # then the parent pid, "_", and more (short: macOS allows 31 characters)
_SHM_DIR = "/dev/shm"  # where Linux lists POSIX shared memory (for sweeping)
_PWRITE = sys.platform.startswith("linux")  # shared memory is a tmpfs file there: pwrite fills it

# (pickle bytes, segment name or None, ((offset, length), ...))
Message = tuple[bytes, str | None, tuple[tuple[int, int], ...]]


# -- shared-memory segments ----------------------------------------------------------
def _map(fd: int, size: int) -> mmap.mmap:
    # No MAP_POPULATE: it maps a tmpfs file page by page, where faults map 16 pages at a
    # time (fault-around); populating 64 MiB took twice as long as touching every page.
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _write(name: str, size: int, parts: list[tuple[pickle.PickleBuffer, int]]) -> None:
    """Create segment ``name`` of ``size`` bytes holding each buffer at its offset.

    On Linux it is written with pwrite rather than through a mapping: the kernel copies
    into fresh pages in one pass, where a mapping would first zero every page and then
    copy. Elsewhere (macOS shared memory cannot be written to) through a mapping.
    """
    fd = _posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    try:
        os.ftruncate(fd, size)
        if _PWRITE:
            for buf, off in parts:
                with buf.raw() as raw:
                    view = raw.cast("B")
                    done = 0
                    while done < len(view):
                        done += os.pwrite(fd, view[done:], off + done)
        else:
            with _map(fd, size) as mm, memoryview(mm) as dst:
                for buf, off in parts:
                    with buf.raw() as raw:
                        dst[off:off + raw.nbytes] = raw.cast("B")
    except BaseException:
        _unlink(name)
        raise
    finally:
        os.close(fd)


def _attach(name: str, size: int) -> mmap.mmap:
    fd = _posixshmem.shm_open(name, os.O_RDWR, mode=0o600)
    try:
        return _map(fd, size)
    finally:
        os.close(fd)


def _unlink(name: str) -> None:
    try:
        _posixshmem.shm_unlink(name)
    except FileNotFoundError:
        pass


def shm_segments(pid: int | None = None) -> list[str]:
    """Names of this process's (or ``pid``'s) segments in /dev/shm; [] where it cannot be listed."""
    prefix = f"{_PREFIX}{os.getpid() if pid is None else pid}_"
    try:
        return sorted(n for n in os.listdir(_SHM_DIR) if n.startswith(prefix))
    except OSError:
        return []


def _sweep(prefix: str) -> None:
    """Unlink every segment whose name starts with ``prefix`` (e.g. a dead worker's)."""
    try:
        names = os.listdir(_SHM_DIR)
    except OSError:
        return
    for n in names:
        if n.startswith(prefix):
            _unlink("/" + n)


def _sweep_dead_parents() -> None:
    """Unlink segments left by processes that no longer exist (killed with SIGKILL, say)."""
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


def encode(obj: Any, new_name: Callable[[], str], threshold: int) -> Message:
    """Pickle ``obj``; buffers of ``threshold`` bytes or more go into one new shared-memory segment."""
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

    data = pickle.dumps(obj, protocol=5, buffer_callback=out_of_band if _posixshmem is not None else None)
    if not big:
        return data, None, ()
    layout = []
    off = 0
    for b in big:
        n = b.raw().nbytes
        layout.append((off, n))
        off += (n + _ALIGN - 1) // _ALIGN * _ALIGN
    name = new_name()
    _write(name, off, [(b, o) for b, (o, _) in zip(big, layout)])
    return data, name, tuple(layout)


def decode(msg: Message) -> Any:
    """Unpickle ``msg``; its large buffers become views of the (mapped) segment."""
    data, name, layout = msg
    if name is None:
        return pickle.loads(data)
    size = max(o + n for o, n in layout)
    mm = _attach(name, size)
    view = memoryview(mm)
    # Each array keeps its slice, the slice keeps the mapping: unmapped when the last array dies.
    return pickle.loads(data, buffers=[view[o:o + n] for o, n in layout])


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


def _worker_main(conn: Any, parent: int, threshold: int) -> None:
    """Receive (job id, message), run it, send (job id, ok, payload, t0, t1) back; stop at EOF or None."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    me = os.getpid()
    seq = itertools.count()

    def new_name() -> str:
        return f"/{_PREFIX}{parent}_{me}_{next(seq)}"

    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        keep: list[Any] = []
        reply = _run_job(job[0], job[1], new_name, threshold, keep)
        del job
        try:
            conn.send(reply)
        except (OSError, ValueError):  # the parent is gone
            if reply[1] and reply[2][1] is not None:
                _unlink(reply[2][1])
            return
        # Only now let go of the call's arguments and value: unmapping the argument
        # segment frees its pages, which takes a while for a large one.
        del keep, reply


def _run_job(job_id: int, msg: Message, new_name: Callable[[], str], threshold: int,
             keep: list[Any]) -> tuple[Any, ...]:
    """Run one call; its arguments (views of their segment) and its value go into ``keep``."""
    t0 = time.perf_counter_ns()
    try:
        call = decode(msg)
        if msg[1] is not None:
            _unlink(msg[1])  # mapped: the name is no longer needed (the parent unlinks it too, if we die first)
        keep.append(call)
        fn, args, kwargs = call
        value = fn(*args, **kwargs)
        keep.append(value)
        t1 = time.perf_counter_ns()
        try:
            return (job_id, True, encode(value, new_name, threshold), t0, t1)
        except Exception as e:
            raise TypeError(f"the stage's result cannot be pickled ({type(e).__name__}: {e})") from e
    except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
        t1 = time.perf_counter_ns()
        return (job_id, False, (_portable(e), traceback.format_exc()), t0, t1)


# -- the parent side -----------------------------------------------------------------
# on_done(ok, value or exception, worker index, t0 ns, t1 ns) runs on the dispatcher thread.
Done = Callable[[bool, Any, int, int, int], None]


class Job:
    """One call of a process stage: queued, then running on one worker, then done."""

    __slots__ = ("key", "msg", "on_done", "state", "worker", "arrival")

    def __init__(self, key: Any, msg: Message, on_done: Done, arrival: int) -> None:
        self.key = key
        self.msg = msg
        self.on_done = on_done
        self.state = "queued"  # queued | running | done | cancelled
        self.worker: _Worker | None = None
        self.arrival = arrival

    def __lt__(self, other: Job) -> bool:
        return (self.key, self.arrival) < (other.key, other.arrival)


class _Worker:
    __slots__ = ("index", "proc", "conn", "job")

    def __init__(self, index: int, proc: Any, conn: Any) -> None:
        self.index = index
        self.proc = proc
        self.conn = conn
        self.job: Job | None = None


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
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"cpu_processes must be an integer >= 1, got {size!r}")
        self.size = size
        self.threshold = threshold
        self._ctx = _context()
        self._lock = threading.Lock()
        self._workers: list[_Worker | None] = [None] * size
        self._idle: list[_Worker] = []
        self._queue: list[Job] = []
        self._arrival = itertools.count()
        self._names = itertools.count()
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
    def _new_name(self) -> str:
        return f"/{_PREFIX}{os.getpid()}_a{next(self._names)}"

    def job(self, key: Any, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
            on_done: Done) -> Job:
        """Pickle ``fn(*args, **kwargs)`` into a job for :meth:`submit`. Raises if it cannot be pickled."""
        try:
            msg = encode((fn, args, kwargs), self._new_name, self.threshold)
        except Exception as e:
            raise TypeError(f"the stage's arguments cannot be pickled ({type(e).__name__}: {e})") from e
        return Job(key, msg, on_done, next(self._arrival))

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
            self._drop_segment(job)
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
        try:
            w.conn.send((job.arrival, job.msg))
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
                return  # its segment goes once the dispatcher saw the worker end
            else:
                return
        self._drop_segment(job)

    @staticmethod
    def _drop_segment(job: Job) -> None:
        name = job.msg[1]
        if name is not None:
            _unlink(name)
            job.msg = (b"", None, ())

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
                            reply = w.conn.recv()
                        except (EOFError, OSError):
                            self._worker_died(w)
                            continue
                        self._finished(w, reply)
                    else:
                        self._worker_died(w)
                except Exception:  # pragma: no cover - the dispatcher must keep serving the others
                    log.exception("hetero: the process pool failed to handle worker %d", w.index)

    def _finished(self, w: _Worker, reply: tuple[Any, ...]) -> None:
        job_id, ok, payload, t0, t1 = reply
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
        self._drop_segment(job)
        if job.state == "cancelled":  # nobody wants the result: only free its segment
            if ok and payload[1] is not None:
                _unlink(payload[1])
            return
        if ok:
            try:
                value = decode(payload)
            except BaseException as e:  # noqa: BLE001
                ok, value = False, e
            finally:
                if payload[1] is not None:
                    _unlink(payload[1])  # mapped (or failed): the name is no longer needed
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
        _sweep(f"{_PREFIX}{os.getpid()}_{w.proc.pid}_")
        for handle in (w.conn, w.proc.sentinel):
            try:
                self._sel.unregister(handle)
            except (KeyError, ValueError):  # pragma: no cover
                pass
        try:
            w.conn.close()
        except OSError:  # pragma: no cover
            pass
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
        self._drop_segment(job)
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
            self._drop_segment(job)
        for w in workers:
            try:
                if w.job is None:
                    w.conn.send(None)
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
                self._drop_segment(w.job)
            try:
                w.conn.close()
            except OSError:  # pragma: no cover
                pass
        _sweep(f"{_PREFIX}{os.getpid()}_")
        for job in queued + [w.job for w in workers if w.job is not None]:
            if job.state in ("queued", "running"):
                job.state = "done"
                self._call(job, False, RuntimeError("the runtime was closed while the stage waited or ran"),
                           -1, 0, 0)
        _live_pools.discard(self)
