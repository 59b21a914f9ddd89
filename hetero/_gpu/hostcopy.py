"""Host copies: numpy data into and out of mapped staging memory, spread over copy threads.

Rules (the notes of :mod:`hetero._gpu.transfer` say why):

- The host side reads or writes mapped memory directly: the pointer of
  ``wgpuBufferGetMappedRange`` wrapped as a numpy array (``mapped``), valid until unmap.
- ``np.copyto`` releases the GIL, so a large copy is cut into pieces of ``MIN_PIECE`` or
  more (aligned to ``PIECE_ALIGN``) that the copy threads run in parallel; the calling
  thread copies one piece itself, and every piece is done before ``run`` returns (a late
  one would touch unmapped memory).
- A copied download of ``PREFAULT_MIN`` or more gets its array allocated when it is
  recorded, and the copy threads touch its pages while the GPU copies (``prefault``).
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any

import numpy as np

from .staging import Staging, pad4
from ..errors import GPUError, RuntimeClosedError

__all__ = ["HostCopies", "PREFAULT_MIN", "Prefaulted"]

MIN_PIECE = 2 << 20  # smallest piece one copy thread handles (smaller ones cost more than they save)
PIECE_ALIGN = 64 << 10
PREFAULT_MIN = 16 << 20  # copied downloads from this size get their array touched during the GPU copy
_PAGE = 4096


def _touch(a: np.ndarray) -> None:
    a[::_PAGE] = 0  # one write per page: the kernel maps (and zeroes) each page now


class Prefaulted:
    """A fresh host array and the copy-thread tasks touching its pages."""

    __slots__ = ("array", "futures")

    def __init__(self, array: np.ndarray, futures: list[concurrent.futures.Future[None]]) -> None:
        self.array = array
        self.futures = futures

    def take(self) -> np.ndarray:
        concurrent.futures.wait(self.futures)
        return self.array



class HostCopies:
    """The copy threads (``copy_threads``; 1 copies on the calling thread) and the copies they run."""

    def __init__(self, *, copy_threads: int, chunk_bytes: int) -> None:
        if copy_threads < 1:
            raise ValueError(f"copy_threads must be at least 1, got {copy_threads}")
        self.copy_threads = copy_threads
        self.chunk_bytes = chunk_bytes  # the largest piece
        from wgpu.backends.wgpu_native import _api  # wgpu-native's cffi binding (raw mapped pointers)

        self._ffi: Any = _api.ffi
        self._lib: Any = _api.libf
        self._lock = threading.Lock()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False

    def executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """The copy threads, started on first use (``RuntimeClosedError`` once stopped)."""
        with self._lock:
            if self._executor is None:
                if self._closed:
                    raise RuntimeClosedError("the staging ring was used after close()")
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self.copy_threads, thread_name_prefix="hetero-staging"
                )
            return self._executor

    def stop(self) -> concurrent.futures.ThreadPoolExecutor | None:
        """Start no more threads; returns the executor for the caller to shut down (None if never started)."""
        with self._lock:
            self._closed = True
            executor, self._executor = self._executor, None
        return executor

    def prefault(self, nbytes: int) -> Prefaulted | None:
        """A new ``nbytes`` array whose pages the copy threads are touching (None with one thread)."""
        if self.copy_threads == 1:
            return None
        try:
            host = np.empty(nbytes, np.uint8)
            executor = self.executor()
        except (MemoryError, RuntimeClosedError):
            return None
        step = -(-nbytes // self.copy_threads)
        step = -(-step // _PAGE) * _PAGE
        return Prefaulted(host, [executor.submit(_touch, host[a:a + step]) for a in range(0, nbytes, step)])

    def mapped(self, s: Staging, nbytes: int) -> np.ndarray:
        """A uint8 array over the first ``nbytes`` of mapped ``s`` (invalid after unmap)."""
        ptr = self._lib.wgpuBufferGetMappedRange(s.buffer._internal, 0, nbytes)
        if ptr == self._ffi.NULL:
            raise GPUError(f"wgpuBufferGetMappedRange returned NULL for a {s.size}-byte staging buffer")
        return np.frombuffer(self._ffi.buffer(ptr, nbytes), np.uint8)

    def _pieces(self, total: int) -> int:
        per = -(-total // (2 * self.copy_threads))
        per = -(-per // PIECE_ALIGN) * PIECE_ALIGN
        return min(self.chunk_bytes, max(MIN_PIECE, per))

    def run(self, tasks: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """``np.copyto(dst, src)`` for every task, spread over the copy threads."""
        if len(tasks) <= 1 or self.copy_threads == 1:
            for dst, src in tasks:
                np.copyto(dst, src)
            return
        executor = self.executor()
        futures = [executor.submit(np.copyto, dst, src) for dst, src in tasks[1:]]
        try:
            np.copyto(tasks[0][0], tasks[0][1])
        finally:
            # Every copy must be over before the caller unmaps (a late one would touch unmapped memory).
            concurrent.futures.wait(futures)
        for f in futures:
            f.result()

    def split(self, pairs: list[tuple[np.ndarray, np.ndarray]], total: int) -> list[tuple[np.ndarray, np.ndarray]]:
        piece = self._pieces(total) if total >= 2 * MIN_PIECE else max(total, 1)
        tasks = []
        for dst, src in pairs:
            for a in range(0, dst.nbytes, piece):
                tasks.append((dst[a:a + piece], src[a:a + piece]))
        return tasks

    def fill(self, stagings: list[Staging], chunks: list[tuple[int, int]], a: np.ndarray) -> None:
        """Copy ``chunks`` (offset, length in ``a``'s C-order bytes) into the mapped ``stagings``."""
        views = [self.mapped(s, pad4(length)) for s, (_, length) in zip(stagings, chunks)]
        try:
            views[-1][chunks[-1][1]:] = 0  # the pad up to 4 bytes: zeros, not a previous transfer's bytes
            if not a.flags.c_contiguous:  # one buffer (several were compacted): copy with strides
                np.copyto(views[0][:a.nbytes].view(a.dtype).reshape(a.shape), a)
                return
            flat = a.reshape(-1).view(np.uint8)
            pairs = [(v[:length], flat[off:off + length]) for v, (off, length) in zip(views, chunks)]
            self.run(self.split(pairs, sum(length for _, length in chunks)))
        finally:
            del views
