"""Worker threads: a fixed number of live daemon threads serving a priority queue of jobs.

The CPU executor and the GPU executor each own one pool. A thread cannot be killed: a
worker stuck in its job can be abandoned, and a new thread takes its place at once.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
from typing import Any, Callable

__all__ = ["Worker", "WorkerPool"]

log = logging.getLogger("hetero")


class Worker:
    """One worker thread of a pool; ``abandoned`` once the pool gave up on it."""

    __slots__ = ("abandoned", "thread")

    def __init__(self) -> None:
        self.abandoned = False
        self.thread: threading.Thread | None = None


class WorkerPool:
    """A fixed number of live daemon threads serving a priority queue of jobs.

    A worker stuck in a job can be abandoned (:meth:`abandon`): a new thread takes its
    place at once, and the stuck one ends when its job returns.
    """

    def __init__(self, name: str, threads: int, on_idle: Callable[[], None] | None = None,
                 on_start: Callable[[], None] | None = None) -> None:
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"{name} needs at least 1 thread, got {threads!r}")
        self.name = name
        self.size = threads
        self._on_idle = on_idle  # called when the last busy worker finds the queue empty
        self._on_start = on_start  # called once, before the threads start
        self._busy = 0
        self._heap: list[tuple[Any, int, Callable[[], None]]] = []
        # Held directly (``with self._lock``) where nothing waits: the same as holding the
        # condition, without its Python-level __enter__ and __exit__.
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._arrival = itertools.count()
        self._closed = False
        self._threads: list[threading.Thread] = []  # the live workers (abandoned ones leave it)
        self._numbers = itertools.count()
        self._local = threading.local()  # .worker: the Worker of a pool thread
        self._abandoned = 0  # abandoned workers whose job has not returned yet

    def _start(self) -> None:
        if self._on_start is not None:
            self._on_start()
        for _ in range(self.size):
            self._spawn()

    def _spawn(self) -> None:
        """Start one worker (the lock held, or before any worker runs)."""
        w = Worker()
        t = w.thread = threading.Thread(target=self._work, args=(w,), name=f"{self.name}-{next(self._numbers)}",
                                        daemon=True)
        self._threads.append(t)
        t.start()

    @property
    def abandoned(self) -> int:
        """Abandoned workers still running their job."""
        return self._abandoned

    def current(self) -> Worker | None:
        """The worker of this pool running the calling thread, or None."""
        return getattr(self._local, "worker", None)

    def abandon(self, worker: Worker) -> int:
        """Give up on ``worker`` (stuck in its job): a new worker replaces it; returns the abandoned count."""
        with self._lock:
            if not worker.abandoned:
                worker.abandoned = True
                self._abandoned += 1
                self._busy -= 1
                if worker.thread in self._threads:
                    self._threads.remove(worker.thread)
                if not self._closed:
                    self._spawn()
            return self._abandoned

    def submit(self, key: Any, job: Callable[[], None]) -> None:
        with self._lock:
            if not self._threads:
                self._start()
            heapq.heappush(self._heap, (key, next(self._arrival), job))
            self._cv.notify()

    def submit_many(self, items: list[tuple[Any, Callable[[], None]]]) -> None:
        with self._lock:
            if not self._threads:
                self._start()
            for key, job in items:
                heapq.heappush(self._heap, (key, next(self._arrival), job))
            self._cv.notify(len(items))

    def _work(self, worker: Worker) -> None:
        self._local.worker = worker
        heap, lock, cv, on_idle = self._heap, self._lock, self._cv, self._on_idle
        heappop = heapq.heappop
        while True:
            with lock:
                while not heap:
                    if self._closed:
                        return
                    cv.wait()
                job = heappop(heap)[2]
                self._busy += 1
            try:
                job()  # jobs catch their own errors
            except BaseException:  # pragma: no cover - a defect: keep the thread serving the queue
                log.exception("%s: a job failed", self.name)
            with lock:
                if worker.abandoned:  # a replacement serves the queue: this thread ends
                    self._abandoned -= 1
                    return
                self._busy -= 1
                idle = not self._busy and not heap
            if idle and on_idle is not None:
                try:
                    on_idle()
                except BaseException:  # pragma: no cover - the hook must not kill the worker
                    log.exception("%s: idle hook failed", self.name)

    def close(self) -> None:
        """Stop the workers and join the live ones (abandoned threads are not waited for)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            threads = list(self._threads)
        for t in threads:
            t.join(timeout=5)
