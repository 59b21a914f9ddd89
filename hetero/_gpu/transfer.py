"""Host<->device transfers through pooled, mapped staging buffers (the staging ring).

Why. ``queue.write_buffer`` copies through wgpu-native's own staging on the calling
thread and ``queue.read_buffer`` maps a fresh buffer and copies out on one thread: on
an H200 through Vulkan that is about 4 GB/s up and 1 GB/s down for 256 MiB. Staging
buffers that are reused and kept mapped, and filled or drained by several threads at
once, take buffer creation, first-touch page faults and the single-core ``memcpy`` off
the path (bench/transfer.py measures both against torch's pinned copies).

Design.

- A staging buffer is a ``MAP_WRITE|COPY_SRC`` (upload) or ``MAP_READ|COPY_DST``
  (download) ``wgpu.GPUBuffer``, pooled per direction and size class: powers of two from
  64 KiB up to ``chunk_bytes``, multiples of ``chunk_bytes`` above (only zero-copy
  downloads use those). A transfer larger than ``chunk_bytes`` uses one buffer per chunk
  and one ``copy_buffer_to_buffer`` per chunk in the caller's encoder. The pool hands
  out the buffer freed longest ago; past ``max_pooled_bytes`` of free staging, recycled
  buffers are destroyed (except that the buffer of a dropped zero-copy array first
  evicts free download buffers of other sizes). By default that cap is 512 MiB, raised
  to twice the staging of the largest transfer so far (an upload and a download of that
  size): a pool that cannot hold one transfer's chunks recreates them every time, and
  creating a staging buffer costs more than copying through it (at 1 GiB the 512 MiB
  cap made whole-graph downloads ~4 GB/s on an H200).
- Host copies go straight into or out of mapped memory: the pointer of
  ``wgpuBufferGetMappedRange`` wrapped as a numpy array. ``np.copyto`` releases the GIL,
  so a large transfer is cut into pieces of 2 MiB or more that the ring's own
  ``ThreadPoolExecutor`` copies in parallel (the calling thread copies one piece itself).
- Free upload buffers stay mapped: when an upload ticket completes (its submission
  finished) the ring re-maps its buffers for writing at once, off the caller's critical
  path, and the next ``upload()`` finds them ready. Free download buffers are unmapped;
  ``complete()`` on a download ticket starts mapping them, so ``read()`` finds them mapped.
- Maps are requested only for buffers whose submission finished, and followed by one
  non-blocking device poll on the same thread, which resolves them at once. (A map
  requested while the copy still runs is left to wgpu-py's poll thread, which blocks
  until the *newest* submission finished; an earlier version that did so stalled
  ~10 ms per transfer at times on an H200.)
- A copied download of ``PREFAULT_MIN`` (16 MiB) or more allocates the array that
  ``read()`` returns when it is recorded, and the copy threads touch its pages while
  the GPU copies: a fresh array's page faults otherwise cost as much as the copy-out.
- ``download(..., zero_copy=True)`` uses one staging buffer and ``read()`` returns an
  array *on the mapped staging memory* instead of copying out; the buffer is unmapped
  and goes back to the pool when that array and every view of it are gone. On an H200
  the copy-out (and page faults of a new array) cost more than the device copy itself.
- ``download(..., zero_copy="auto")`` is for results a caller may keep for long (graph
  outputs): zero-copy only where that reuses memory, copied otherwise. Zero-copy when a
  free buffer of the size class is pooled (an earlier array on one was dropped), or when
  the class came before (not the first download of that size) and every buffer created
  so far for it came back at least once; never for less than ``AUTO_ZERO_COPY_MIN``, nor
  past ``max_pooled_bytes`` of live zero-copy arrays. A stream that drops its arrays thus
  runs at zero-copy speed from its third download on, and a caller that keeps every
  array costs one buffer creation, then gets copies.

Measured on an H200 through Vulkan, 256 MiB, 16 copy threads (bench/transfer.py): the
driver puts ``MAP_WRITE`` staging in device memory that the host writes through the PCIe
BAR, so an upload is the host's write into the mapped buffers (9 ms) and a 1 ms device
copy: 26.6 GB/s. ``MAP_READ`` staging is cached host memory the device writes at
~46 GB/s (5.8 ms); copying out takes another 6.7 ms into an existing array, 12 ms into a
new one (first-touch page faults): 21.6 and 14.9 GB/s; zero-copy: 48 GB/s. Torch's pinned
copies run at 55 GB/s both ways. Below a few MiB ``queue.write_buffer`` and
``read_buffer`` cost less than the ring's fixed ~0.2 ms; creating a staging buffer costs
more than using it (~250 ms for 1 GiB), hence the pool.

Safety rule. A buffer that is mapped (or has a map pending) must never be part of a
submission: wgpu 0.32 aborts the whole process on it. Therefore

1. ``upload()`` unmaps every staging buffer it filled *before* it records any copy, and
   ``download()`` records only unmapped buffers; both check ``map_state`` before
   recording and raise instead. When ``upload()``/``download()`` return, nothing of
   the ticket is mapped, so the caller's encoder can be finished and submitted.
2. A ticket's buffers are mapped again only by ``complete()``/``read()``, which the
   caller calls after the submission holding the copies finished, or after
   ``discard()``, which the caller calls only for an encoder that will never be
   submitted. If ``complete()`` comes early anyway, wgpu delays the map until the GPU is
   done with the buffer: slow but safe. Submitting after ``discard()`` is the one misuse
   the ring cannot catch.
3. After a failure once copies may have been recorded, the buffers are never reused:
   they are dropped (released, not destroyed), which is safe whatever the encoder's fate.

Threading. ``upload``, ``download``, ``complete``, ``read`` and ``discard`` may be called
from any thread. A staging buffer belongs to one ticket, one zero-copy array or the free
pool at a time, and only its holder touches its wgpu-py wrapper (which has no locks; a
dead zero-copy array's buffer is only queued, and the ring's next call unmaps it);
the pool has one lock and each ticket its own. wgpu-py resolves a map promise on the
event loop of the thread that *created* it when that thread runs one, which could race
with another thread's ``sync_wait``; so maps that are not waited for at once are
requested from threads without an event loop, or handed to the ring's executor.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import math
import os
import sys
import threading
import weakref
from typing import Any, Sequence

import numpy as np
import wgpu

from ..errors import GPUError, RuntimeClosedError

__all__ = ["StagingRing", "Ticket"]

log = logging.getLogger("hetero")

_UP_USAGE = wgpu.BufferUsage.MAP_WRITE | wgpu.BufferUsage.COPY_SRC
_DOWN_USAGE = wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST
MIN_CLASS = 64 << 10  # smallest staging buffer
MIN_PIECE = 2 << 20  # smallest piece one copy thread handles (smaller ones cost more than they save)
PIECE_ALIGN = 64 << 10


def _pad4(nbytes: int) -> int:
    return (nbytes + 3) & ~3


def _loop_on_this_thread() -> bool:
    # wgpu-py binds a promise to the event loop of the thread that creates it (found
    # through the thread's async-generator hooks); such promises resolve on that loop.
    return sys.get_asyncgen_hooks()[0] is not None


def _out_array(what: str, shape: int | Sequence[int], dtype: Any, nbytes: int,
               out: np.ndarray | None) -> tuple[tuple[int, ...], np.dtype[Any], np.ndarray | None]:
    """Checked ``shape``/``dtype`` of ``nbytes`` of data, and ``out`` checked to hold them."""
    dt = np.dtype(dtype)
    shp = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
    want = math.prod(shp) * dt.itemsize
    if want != nbytes:
        raise ValueError(f"{what}: shape {shp} of {dt.name} is {want} bytes, the download has {nbytes} bytes")
    if out is not None and (out.nbytes != want or not out.flags.c_contiguous or not out.flags.writeable):
        raise ValueError(
            f"{what}: out must be a writeable C-contiguous array of {want} bytes, "
            f"got {out.nbytes} bytes (contiguous={out.flags.c_contiguous}, writeable={out.flags.writeable})"
        )
    return shp, dt, out


PREFAULT_MIN = 16 << 20  # copied downloads from this size get their array touched during the GPU copy
DEFAULT_POOLED_BYTES = 512 << 20  # free staging kept, unless larger transfers need more
AUTO_ZERO_COPY_MIN = PREFAULT_MIN  # zero_copy="auto" copies anything smaller (cheap, and no class rounding)
_PAGE = 4096


def _touch(a: np.ndarray) -> None:
    a[::_PAGE] = 0  # one write per page: the kernel maps (and zeroes) each page now


class _Prefaulted:
    """A fresh host array and the copy-thread tasks touching its pages."""

    __slots__ = ("array", "futures")

    def __init__(self, array: np.ndarray, futures: list[concurrent.futures.Future[None]]) -> None:
        self.array = array
        self.futures = futures

    def take(self) -> np.ndarray:
        concurrent.futures.wait(self.futures)
        return self.array


class _Staging:
    """One pooled staging buffer and the map it may have pending."""

    __slots__ = ("buffer", "direction", "future", "promise", "size")

    def __init__(self, buffer: Any, direction: str, size: int) -> None:
        self.buffer = buffer
        self.direction = direction  # "up" or "down"
        self.size = size
        self.promise: Any = None  # a pending map_async promise
        self.future: concurrent.futures.Future[None] | None = None  # a map requested on the executor

    @property
    def idle(self) -> bool:
        """Unmapped with no map pending: the only state allowed in a submission."""
        return self.promise is None and self.future is None and self.buffer.map_state == "unmapped"


class _MappedMemory:
    """Owner of a zero-copy result: numpy arrays on it keep it (and the mapping) alive."""

    __slots__ = ("__array_interface__", "__weakref__")

    def __init__(self, address: int, nbytes: int) -> None:
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False), "version": 3}


class Ticket:
    """One upload or download recorded into an encoder, and its staging buffers.

    After the submission holding the copies completed: an upload ticket needs
    ``complete()`` (recycles its buffers); a download ticket needs ``read()`` (and may
    get ``complete()`` first, which starts mapping early). ``discard()`` gives the
    buffers back for an encoder that will never be submitted.
    """

    __slots__ = ("__weakref__", "_chunks", "_finalizer", "_host", "_lock", "_ring", "_state", "direction",
                 "nbytes", "zero_copy")

    def __init__(self, ring: StagingRing, direction: str, nbytes: int, chunks: list[tuple[_Staging, int]],
                 zero_copy: bool = False, host: _Prefaulted | None = None) -> None:
        self._ring = ring
        self._host = host  # download: the array read() fills, being touched while the GPU copies
        self.direction = direction
        self.nbytes = nbytes  # bytes of data (the copies move that rounded up to 4)
        self.zero_copy = zero_copy
        self._chunks = chunks  # (staging, bytes of data in it), in order
        self._lock = threading.Lock()
        self._state = "recorded"  # -> "completed" (download: maps requested) -> "released"
        self._finalizer: weakref.finalize | None = None
        if chunks:
            # Dropped without complete()/read()/discard(), the buffers are lost to the
            # pool (never reused: the encoder may still be submitted); keep the count right.
            self._finalizer = weakref.finalize(self, ring._forget, [s for s, _ in chunks])
            self._finalizer.atexit = False

    @property
    def buffers(self) -> tuple[Any, ...]:
        """The staging ``wgpu.GPUBuffer``s of this ticket (for inspection and tests)."""
        return tuple(s.buffer for s, _ in self._chunks)

    @property
    def released(self) -> bool:
        """True once the buffers left the ticket (completed upload, read, discarded)."""
        return self._state == "released"

    def _detach(self) -> list[_Staging]:
        self._state = "released"
        if self._finalizer is not None:
            self._finalizer.detach()
        return [s for s, _ in self._chunks]

    def complete(self) -> None:
        """The submission holding this ticket's copies finished (call after its fence).

        Upload: the staging buffers are mapped for writing again and go back to the pool.
        Download: mapping starts, so that ``read()`` finds the data ready. Calling it
        again, or after ``read()``, does nothing.
        """
        with self._lock:
            if self._state != "recorded":
                return
            if self.direction == "up":
                self._ring._recycle(self._detach(), remap=True)
                return
            self._state = "completed"
            if not _loop_on_this_thread():  # else read() maps, on the thread that waits
                for s, n in self._chunks:
                    s.promise = s.buffer.map_async("READ_NOSYNC", 0, _pad4(n))
                self._ring._poll()

    def read(self, shape: int | Sequence[int], dtype: Any, *, out: np.ndarray | None = None) -> np.ndarray:
        """The downloaded bytes as an array of ``shape`` and ``dtype``.

        Call after the submission holding the copy completed. The data is copied into a
        new array (several threads for large ones), or into ``out``; then the buffers go
        back to the ring. A ``zero_copy`` download without ``out`` returns an array on the
        mapped staging buffer instead, which returns to the ring when the array (with
        every view of it) is gone.
        """
        if self.direction != "down":
            raise RuntimeError("read() is for download tickets; an upload ticket only needs complete()")
        shp, dt, out = _out_array("read", shape, dtype, self.nbytes, out)
        with self._lock:
            if self._state == "released":
                raise RuntimeError("read: this download ticket was already read or discarded")
            self._detach()
            if not self._chunks:
                return out if out is not None else np.empty(shp, dt)
            if self.zero_copy and out is None:
                return self._ring._map_array(self._chunks[0][0], self.nbytes).view(dt).reshape(shp)
            host, self._host = self._host, None
            if out is None:
                out = host.take().view(dt).reshape(shp) if host is not None else np.empty(shp, dt)
            self._ring._read_into(self._chunks, out.reshape(-1).view(np.uint8))
        return out

    def discard(self) -> None:
        """Give the buffers back for an encoder that will never be submitted.

        For a stage that failed between ``upload()``/``download()`` and its submit. The
        buffers go back unmapped; submitting that encoder afterwards is a use-after-free.
        """
        with self._lock:
            if self._state == "released":
                return
            self._host = None
            # complete() may have started mapping a download: finish and undo that first,
            # since free download buffers must be unmapped.
            ok, bad = self._ring._settle(self._detach())
            self._ring._forget(bad)
            self._ring._recycle(ok, remap=False)


class StagingRing:
    """Pooled mapped staging buffers for uploads and downloads on one ``wgpu.GPUDevice``.

    ``copy_threads``: threads that copy into and out of mapped memory (default: one per
    core, at most 16; 1 copies on the calling thread). ``chunk_bytes``: the largest
    staging buffer of a chunked transfer. ``max_pooled_bytes``: free staging kept for
    reuse; recycled buffers beyond it are destroyed (default: ``DEFAULT_POOLED_BYTES``,
    raised to twice the staging of the largest transfer so far; an int fixes it).
    """

    def __init__(self, device: wgpu.GPUDevice, *, copy_threads: int | None = None, chunk_bytes: int = 8 << 20,
                 max_pooled_bytes: int | None = None) -> None:
        if chunk_bytes < 4096 or chunk_bytes % 4096:
            raise ValueError(f"chunk_bytes must be a positive multiple of 4096, got {chunk_bytes}")
        self.max_buffer_size = int(device.limits["max-buffer-size"])
        if chunk_bytes > self.max_buffer_size:
            raise ValueError(
                f"chunk_bytes {chunk_bytes} is above the adapter's max-buffer-size of {self.max_buffer_size}"
            )
        if copy_threads is None:
            copy_threads = min(16, os.cpu_count() or 1)
        if copy_threads < 1:
            raise ValueError(f"copy_threads must be at least 1, got {copy_threads}")
        self._cap_grows = max_pooled_bytes is None
        if max_pooled_bytes is None:
            max_pooled_bytes = DEFAULT_POOLED_BYTES
        if max_pooled_bytes < 0:
            raise ValueError(f"max_pooled_bytes must not be negative, got {max_pooled_bytes}")
        self.device = device
        self.copy_threads = copy_threads
        self.chunk_bytes = chunk_bytes
        self.max_pooled_bytes = max_pooled_bytes
        from wgpu.backends.wgpu_native import _api  # wgpu-native's cffi binding (raw mapped pointers)

        self._ffi: Any = _api.ffi
        self._lib: Any = _api.libf
        # Re-entrant: a finalizer (garbage collection) may run while this thread holds it.
        self._lock = threading.RLock()
        self._free: dict[tuple[str, int], collections.deque[_Staging]] = {}
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False
        self._live_bytes = 0
        self._pooled_bytes = 0
        self._zero_copy_bytes = 0
        self._returned: collections.deque[_Staging] = collections.deque()  # from dead zero-copy arrays
        # zero_copy="auto", per download size class: downloads seen, buffers created for
        # it, zero-copy buffers given back (arrays dropped).
        self._auto_seen: collections.Counter[int] = collections.Counter()
        self._auto_created: collections.Counter[int] = collections.Counter()
        self._auto_returned: collections.Counter[int] = collections.Counter()
        self._allocations = 0
        self._reuses = 0
        self._destroyed = 0

    # -- public ------------------------------------------------------------------------
    def upload(self, encoder: Any, array: np.ndarray, dst_buffer: Any, dst_offset: int = 0) -> Ticket:
        """Copy ``array``'s bytes (C order) to ``dst_buffer`` at ``dst_offset``, recorded in ``encoder``.

        The host copy happens now, the device copy when the caller submits ``encoder``'s
        command buffer. The copy moves the size rounded up to 4 bytes (the pad is zeros),
        so ``dst_buffer`` needs room for that. Nothing is mapped when this returns.
        """
        a = np.asarray(array)
        if a.dtype.hasobject:
            raise TypeError(f"upload: cannot upload an array of Python objects (dtype {a.dtype})")
        n = a.nbytes
        self._check_range("upload", "dst", dst_buffer, dst_offset, _pad4(n))
        if n == 0:
            return Ticket(self, "up", 0, [])
        self._grow_cap(_pad4(n))
        chunks = self._chunks(n)
        if len(chunks) > 1 and not a.flags.c_contiguous:
            a = np.ascontiguousarray(a)  # a strided source spread over several buffers: compact it first
        stagings = self._stage_up(a, chunks)
        try:
            for s, (offset, length) in zip(stagings, chunks):
                encoder.copy_buffer_to_buffer(s.buffer, 0, dst_buffer, dst_offset + offset, _pad4(length))
        except BaseException:
            self._forget(stagings)  # the encoder may hold them: drop, never reuse
            raise
        return Ticket(self, "up", n, [(s, length) for s, (_, length) in zip(stagings, chunks)])

    def download(self, encoder: Any, src_buffer: Any, src_offset: int, nbytes: int, *,
                 zero_copy: bool | str = False, prefault: bool = True) -> Ticket:
        """Record a copy of ``nbytes`` of ``src_buffer`` from ``src_offset`` into staging buffers.

        ``ticket.read(shape, dtype)`` returns the data once the submission completed. The
        copy moves ``nbytes`` rounded up to 4, so ``src_buffer`` needs that many bytes.
        ``zero_copy``: stage into one buffer, which ``read()`` returns as the array itself;
        ``"auto"``: do so only where it reuses pooled memory (see the module's notes).
        ``prefault``: for a copied download of ``PREFAULT_MIN`` bytes or more, allocate the
        array ``read()`` will return now and let the copy threads touch its pages while the
        GPU copies (a fresh array's page faults cost about as much as the copy-out into
        it); pass False when ``read()`` will be given ``out``.
        """
        nbytes = int(nbytes)
        if nbytes < 0:
            raise ValueError(f"download: nbytes must not be negative, got {nbytes}")
        if zero_copy not in (True, False, "auto"):
            raise ValueError(f"download: zero_copy must be True, False or 'auto', got {zero_copy!r}")
        self._check_range("download", "src", src_buffer, src_offset, _pad4(nbytes))
        if nbytes == 0:
            return Ticket(self, "down", 0, [])
        self._grow_cap(_pad4(nbytes))
        auto = zero_copy == "auto"
        reused = self._acquire_auto(_pad4(nbytes)) if auto else None
        zero_copy = reused is not None or (not auto and bool(zero_copy)
                                           and self._class(_pad4(nbytes)) <= self.max_buffer_size)
        chunks = [(0, nbytes)] if zero_copy else self._chunks(nbytes)
        stagings = [reused] if reused is not None else [self._acquire("down", _pad4(length)) for _, length in chunks]
        try:
            for s in stagings:
                if not s.idle:  # pragma: no cover - free download buffers are unmapped
                    raise GPUError(f"download: staging buffer is {s.buffer.map_state}; refusing to record it")
        except BaseException:
            self._recycle(stagings, remap=False)
            raise
        try:
            for s, (offset, length) in zip(stagings, chunks):
                encoder.copy_buffer_to_buffer(src_buffer, src_offset + offset, s.buffer, 0, _pad4(length))
        except BaseException:
            self._forget(stagings)
            raise
        host = self._prefault(nbytes) if prefault and not zero_copy and nbytes >= PREFAULT_MIN else None
        return Ticket(self, "down", nbytes, [(s, length) for s, (_, length) in zip(stagings, chunks)], zero_copy,
                      host)

    def completed(self, tickets: Sequence[Ticket]) -> None:
        """``complete()`` every ticket of a finished submission."""
        for t in tickets:
            t.complete()

    def trim(self) -> int:
        """Destroy every free staging buffer; returns the bytes freed."""
        self._drain_returned()
        with self._lock:
            free = [s for lst in self._free.values() for s in lst]
            self._free.clear()
            self._pooled_bytes = 0
        for s in free:
            self._destroy(s)
        return sum(s.size for s in free)

    def close(self) -> None:
        """Destroy the free buffers and stop the copy threads; buffers in use die when returned."""
        with self._lock:
            self._closed = True
            executor, self._executor = self._executor, None
        self.trim()
        if executor is not None:
            executor.shutdown(wait=True)

    def stats(self) -> dict[str, int]:
        """Counters: live, pooled and zero-copy staging bytes; buffers created, reused, destroyed."""
        self._drain_returned()
        with self._lock:
            return {
                "staging_bytes": self._live_bytes,
                "pooled_bytes": self._pooled_bytes,
                "in_use_bytes": self._live_bytes - self._pooled_bytes,
                "zero_copy_bytes": self._zero_copy_bytes,
                "staging_allocations": self._allocations,
                "staging_reuses": self._reuses,
                "staging_destroyed": self._destroyed,
                "free_buffers": sum(len(v) for v in self._free.values()),
                "copy_threads": self.copy_threads,
                "chunk_bytes": self.chunk_bytes,
            }

    def __enter__(self) -> StagingRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- pool --------------------------------------------------------------------------
    def _class(self, nbytes: int) -> int:
        """The pool's size class for ``nbytes``: a power of two up to chunk_bytes, then its multiples."""
        if nbytes <= self.chunk_bytes:
            return max(MIN_CLASS, 1 << max(0, nbytes - 1).bit_length())
        return -(-nbytes // self.chunk_bytes) * self.chunk_bytes

    def _grow_cap(self, nbytes: int) -> None:
        """Default cap: room for an upload and a download of the largest transfer so far."""
        if self._cap_grows:
            need = 2 * self._class(nbytes)
            if need > self.max_pooled_bytes:
                with self._lock:
                    self.max_pooled_bytes = max(self.max_pooled_bytes, need)

    def _chunks(self, nbytes: int) -> list[tuple[int, int]]:
        """(offset, bytes of data) per staging buffer; offsets are multiples of chunk_bytes."""
        c = self.chunk_bytes
        return [(off, min(c, nbytes - off)) for off in range(0, nbytes, c)]

    def _check_range(self, what: str, side: str, buffer: Any, offset: int, n4: int) -> None:
        offset = int(offset)
        if offset < 0 or offset % 4:
            raise ValueError(f"{what}: {side}_offset must be a non-negative multiple of 4, got {offset}")
        if offset + n4 > buffer.size:
            raise ValueError(
                f"{what}: {n4} bytes at {side}_offset {offset} overrun the {buffer.size}-byte {side} buffer"
            )

    def _acquire(self, direction: str, nbytes: int) -> _Staging:
        """A staging buffer of at least ``nbytes``: mapped for writing (up) or unmapped (down)."""
        size = self._class(nbytes)
        self._drain_returned()
        with self._lock:
            if self._closed:
                raise RuntimeClosedError("the staging ring was used after close()")
            lst = self._free.get((direction, size))
            s = lst.popleft() if lst else None  # FIFO: the one freed longest ago
            if s is not None:
                self._pooled_bytes -= size
                self._reuses += 1
        if s is None:
            usage = _UP_USAGE if direction == "up" else _DOWN_USAGE
            buf = self.device.create_buffer(
                label=f"hetero-staging-{direction}", size=size, usage=usage, mapped_at_creation=direction == "up"
            )
            s = _Staging(buf, direction, size)
            with self._lock:
                self._live_bytes += size
                self._allocations += 1
            return s
        if direction == "up":
            try:
                self._wait_mapped(s)
            except BaseException:
                self._forget([s])
                raise
        return s

    def _acquire_auto(self, nbytes: int) -> _Staging | None:
        """The buffer of a ``zero_copy="auto"`` download, or None for a copied one (module notes)."""
        size = self._class(nbytes)
        if nbytes < AUTO_ZERO_COPY_MIN or size > self.max_buffer_size:
            return None
        self._drain_returned()
        with self._lock:
            if self._closed:
                raise RuntimeClosedError("the staging ring was used after close()")
            seen = self._auto_seen[size]
            self._auto_seen[size] = seen + 1
            if self._free.get(("down", size)):
                pass  # a dropped array's buffer (or a copied download's): _acquire takes it
            elif (seen == 0 or self._auto_created[size] > self._auto_returned[size]
                  or self._zero_copy_bytes + size > self.max_pooled_bytes):
                return None
            else:
                self._auto_created[size] += 1
        return self._acquire("down", nbytes)

    def _wait_mapped(self, s: _Staging) -> None:
        """Make a free upload buffer mapped for writing (finishing the map complete() requested)."""
        if s.future is not None:
            s.future.result()
            s.future = None
        if s.promise is None and s.buffer.map_state == "unmapped":  # after discard()
            s.promise = s.buffer.map_async("WRITE")
            self._poll()
        if s.promise is not None:
            promise, s.promise = s.promise, None
            try:
                promise.sync_wait()
            except Exception as e:
                raise GPUError(f"could not map a {s.size}-byte staging buffer for writing: {e}") from e

    def _stage_up(self, a: np.ndarray, chunks: list[tuple[int, int]]) -> list[_Staging]:
        """Upload buffers holding ``chunks`` of ``a``'s bytes, unmapped and so ready to record."""
        stagings: list[_Staging] = []
        try:
            for _, length in chunks:
                stagings.append(self._acquire("up", _pad4(length)))
            self._fill(stagings, chunks, a)
            # The safety rule: unmap everything before any copy reaches an encoder.
            for s in stagings:
                s.buffer.unmap()
            for s in stagings:
                if not s.idle:  # pragma: no cover - never record a mapped buffer
                    raise GPUError(f"upload: staging buffer is {s.buffer.map_state} after unmap; refusing to record it")
        except BaseException:
            self._recycle(stagings, remap=False)  # never recorded: mapped or not, the pool takes them
            raise
        return stagings

    def _recycle(self, stagings: list[_Staging], *, remap: bool, evict: bool = False) -> list[_Staging]:
        """Return buffers (owned by the caller) to the pool; upload ones are mapped again if ``remap``.

        ``evict``: make room by destroying free download buffers of other size classes,
        oldest first, rather than destroying these. Returns the buffers the pool kept.
        """
        keep: list[_Staging] = []
        drop: list[_Staging] = []
        with self._lock:
            for s in stagings:
                if evict and not self._closed and s.size <= self.max_pooled_bytes:
                    drop += self._evict_down(self._pooled_bytes + s.size - self.max_pooled_bytes, s.size)
                if not self._closed and self._pooled_bytes + s.size <= self.max_pooled_bytes:
                    self._pooled_bytes += s.size  # room reserved now; the buffer joins the pool below
                    keep.append(s)
                else:
                    drop.append(s)
        for s in drop:
            self._destroy(s)
        if not keep:
            return keep
        remaps = [s for s in keep if remap and s.direction == "up" and s.buffer.map_state == "unmapped"]
        if remaps and not _loop_on_this_thread():
            for s in remaps:
                s.promise = s.buffer.map_async("WRITE")
            self._poll()
        elif remaps:
            # Requested here, the maps would resolve on this thread's event loop: request
            # them on a copy thread (or, with the ring closing, let _acquire map lazily).
            try:
                executor = self._get_executor()
                for s in remaps:
                    s.future = executor.submit(self._request_write_map, s)
            except RuntimeError:
                pass
        with self._lock:
            closed = self._closed
            if not closed:
                for s in keep:
                    self._free.setdefault((s.direction, s.size), collections.deque()).append(s)
            else:
                self._pooled_bytes -= sum(s.size for s in keep)
        if closed:  # close() ran meanwhile: these would outlive its trim()
            for s in keep:
                self._destroy(s)
            return []
        return keep

    def _evict_down(self, excess: int, spare: int) -> list[_Staging]:
        """Under the lock: take free download buffers not of class ``spare`` out of the pool
        (oldest first in each class) until ``excess`` bytes are gone; the caller destroys them."""
        out: list[_Staging] = []
        for (direction, size), lst in self._free.items():
            while excess > 0 and lst and direction == "down" and size != spare:
                s = lst.popleft()
                self._pooled_bytes -= s.size
                excess -= s.size
                out.append(s)
        return out

    def _request_write_map(self, s: _Staging) -> None:
        s.promise = s.buffer.map_async("WRITE")
        self._poll()

    def _settle(self, stagings: list[_Staging]) -> tuple[list[_Staging], list[_Staging]]:
        """Finish pending maps and unmap: (now unmapped, failed to map and so unusable)."""
        ok: list[_Staging] = []
        bad: list[_Staging] = []
        for s in stagings:
            try:
                if s.future is not None:
                    s.future.result()
                if s.promise is not None:
                    s.promise.sync_wait()
                if s.buffer.map_state == "mapped":
                    s.buffer.unmap()
                ok.append(s)
            except Exception:  # pragma: no cover - a failed map (device lost)
                bad.append(s)
            s.future = s.promise = None
        return ok, bad

    def _destroy(self, s: _Staging) -> None:
        self._settle([s])  # unmap first: wgpu-py's wrapper would otherwise still say "mapped"
        s.buffer.destroy()
        with self._lock:
            self._live_bytes -= s.size
            self._destroyed += 1

    def _forget(self, stagings: list[_Staging]) -> None:
        """Stop counting buffers that an encoder may still hold; never destroy them."""
        with self._lock:
            self._live_bytes -= sum(s.size for s in stagings)

    def _poll(self) -> None:
        # Resolve the maps of buffers whose work already finished now, on this thread,
        # rather than whenever wgpu-py's poll thread returns from its blocking poll.
        self._lib.wgpuDevicePoll(self.device._internal, False, self._ffi.NULL)

    def _get_executor(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                if self._closed:
                    raise RuntimeClosedError("the staging ring was used after close()")
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self.copy_threads, thread_name_prefix="hetero-staging"
                )
            return self._executor

    # -- host copies -------------------------------------------------------------------
    def _prefault(self, nbytes: int) -> _Prefaulted | None:
        """A new ``nbytes`` array whose pages the copy threads are touching (None with one thread)."""
        if self.copy_threads == 1:
            return None
        try:
            host = np.empty(nbytes, np.uint8)
            executor = self._get_executor()
        except (MemoryError, RuntimeClosedError):
            return None
        step = -(-nbytes // self.copy_threads)
        step = -(-step // _PAGE) * _PAGE
        return _Prefaulted(host, [executor.submit(_touch, host[a:a + step]) for a in range(0, nbytes, step)])

    def _mapped(self, s: _Staging, nbytes: int) -> np.ndarray:
        """A uint8 array over the first ``nbytes`` of mapped ``s`` (invalid after unmap)."""
        ptr = self._lib.wgpuBufferGetMappedRange(s.buffer._internal, 0, nbytes)
        if ptr == self._ffi.NULL:
            raise GPUError(f"wgpuBufferGetMappedRange returned NULL for a {s.size}-byte staging buffer")
        return np.frombuffer(self._ffi.buffer(ptr, nbytes), np.uint8)

    def _pieces(self, total: int) -> int:
        per = -(-total // (2 * self.copy_threads))
        per = -(-per // PIECE_ALIGN) * PIECE_ALIGN
        return min(self.chunk_bytes, max(MIN_PIECE, per))

    def _run(self, tasks: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """``np.copyto(dst, src)`` for every task, spread over the copy threads."""
        if len(tasks) <= 1 or self.copy_threads == 1:
            for dst, src in tasks:
                np.copyto(dst, src)
            return
        executor = self._get_executor()
        futures = [executor.submit(np.copyto, dst, src) for dst, src in tasks[1:]]
        try:
            np.copyto(tasks[0][0], tasks[0][1])
        finally:
            # Every copy must be over before the caller unmaps (a late one would touch unmapped memory).
            concurrent.futures.wait(futures)
        for f in futures:
            f.result()

    def _split(self, pairs: list[tuple[np.ndarray, np.ndarray]], total: int) -> list[tuple[np.ndarray, np.ndarray]]:
        piece = self._pieces(total) if total >= 2 * MIN_PIECE else max(total, 1)
        tasks = []
        for dst, src in pairs:
            for a in range(0, dst.nbytes, piece):
                tasks.append((dst[a:a + piece], src[a:a + piece]))
        return tasks

    def _fill(self, stagings: list[_Staging], chunks: list[tuple[int, int]], a: np.ndarray) -> None:
        """Copy ``chunks`` (offset, length in ``a``'s C-order bytes) into the mapped ``stagings``."""
        views = [self._mapped(s, _pad4(length)) for s, (_, length) in zip(stagings, chunks)]
        try:
            views[-1][chunks[-1][1]:] = 0  # the pad up to 4 bytes: zeros, not a previous transfer's bytes
            if not a.flags.c_contiguous:  # one buffer (several were compacted): copy with strides
                np.copyto(views[0][:a.nbytes].view(a.dtype).reshape(a.shape), a)
                return
            flat = a.reshape(-1).view(np.uint8)
            pairs = [(v[:length], flat[off:off + length]) for v, (off, length) in zip(views, chunks)]
            self._run(self._split(pairs, sum(length for _, length in chunks)))
        finally:
            del views

    def _map_for_read(self, chunks: list[tuple[_Staging, int]]) -> None:
        """Map download buffers (finishing what complete() requested); on failure drop them and raise."""
        requested = False
        for s, n in chunks:
            if s.promise is None and s.buffer.map_state == "unmapped":
                s.promise = s.buffer.map_async("READ_NOSYNC", 0, _pad4(n))
                requested = True
        if requested:
            self._poll()
        failed: BaseException | None = None
        for s, _ in chunks:
            promise, s.promise = s.promise, None
            try:
                if promise is not None:
                    promise.sync_wait()
            except Exception as e:
                failed = failed or e
        if failed is not None:
            for s, _ in chunks:
                if s.buffer.map_state == "mapped":
                    s.buffer.unmap()
            self._forget([s for s, _ in chunks])
            raise GPUError(f"could not map a staging buffer for reading: {failed}") from failed

    def _read_into(self, chunks: list[tuple[_Staging, int]], out: np.ndarray) -> None:
        """Map ``chunks``, copy them into ``out`` (flat uint8), unmap and recycle."""
        self._map_for_read(chunks)
        stagings = [s for s, _ in chunks]
        try:
            pairs = []
            off = 0
            for s, n in chunks:
                pairs.append((out[off:off + n], self._mapped(s, _pad4(n))[:n]))
                off += n
            self._run(self._split(pairs, off))
            del pairs
        finally:
            # The submission finished and nothing refers to the mapped memory any more:
            # unmapped, the buffers are safe to reuse even if a copy failed.
            for s in stagings:
                s.buffer.unmap()
            self._recycle(stagings, remap=False)

    def _map_array(self, s: _Staging, nbytes: int) -> np.ndarray:
        """The first ``nbytes`` of download buffer ``s``, mapped, as a uint8 array that owns the mapping."""
        self._map_for_read([(s, nbytes)])
        try:
            ptr = self._lib.wgpuBufferGetMappedRange(s.buffer._internal, 0, _pad4(nbytes))
            if ptr == self._ffi.NULL:
                raise GPUError(f"wgpuBufferGetMappedRange returned NULL for a {s.size}-byte staging buffer")
            owner = _MappedMemory(int(self._ffi.cast("uintptr_t", ptr)), nbytes)
            array = np.asarray(owner)
        except BaseException:
            s.buffer.unmap()
            self._recycle([s], remap=False)
            raise
        with self._lock:
            self._zero_copy_bytes += s.size
        # When the last array on this memory is gone, the buffer is unmapped and reused.
        weakref.finalize(owner, self._release_mapped, s).atexit = False
        return array

    def _release_mapped(self, s: _Staging) -> None:
        # A finalizer: it runs on whichever thread dropped the last array, possibly in the
        # middle of this ring's own code (garbage collection), so it only queues the buffer
        # (deque.append is atomic); the next ring call unmaps and pools it.
        self._returned.append(s)
        if self._closed:
            self._drain_returned()

    def _drain_returned(self) -> None:
        """Unmap and pool the buffers of zero-copy arrays that are gone."""
        while True:
            try:
                s = self._returned.popleft()
            except IndexError:
                return
            with self._lock:
                self._zero_copy_bytes -= s.size
            try:
                s.buffer.unmap()
                # A whole result's buffer outranks free chunk buffers (copied downloads of
                # that size are what it replaces); it counts as given back only if pooled.
                if self._recycle([s], remap=False, evict=True):
                    with self._lock:
                        self._auto_returned[s.size] += 1
            except Exception:  # pragma: no cover - device gone: nothing to give back
                log.debug("staging ring: could not recycle a zero-copy buffer", exc_info=True)
                self._forget([s])
