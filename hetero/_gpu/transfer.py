"""Host<->device transfers through pooled, mapped staging buffers (the staging ring).

Why. ``queue.write_buffer`` copies through wgpu-native's own staging on the calling
thread and ``queue.read_buffer`` maps a fresh buffer and copies out on one thread.
Staging buffers that are reused and kept mapped, and filled or drained by several threads
at once, take buffer creation, first-touch page faults and the single-core ``memcpy`` off
the path (bench/transfer.py measures both against torch's pinned copies; BENCHMARKS.md has
the figures). Below a few MiB ``queue.write_buffer`` and ``read_buffer`` cost less than
the ring's fixed cost; creating a staging buffer costs more than using it, hence the pool.

Parts: :mod:`~hetero._gpu.staging` (the pool of staging buffers and their maps),
:mod:`~hetero._gpu.hostcopy` (host copies into and out of mapped memory on the copy
threads), and here the tickets and the ring that records transfers with both.

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
  creating a staging buffer costs more than copying through it.
- Host copies go straight into or out of mapped memory: the pointer of
  ``wgpuBufferGetMappedRange`` wrapped as a numpy array. ``np.copyto`` releases the GIL,
  so a large transfer is cut into pieces of 2 MiB or more that the ring's own
  ``ThreadPoolExecutor`` copies in parallel (the calling thread copies one piece itself).
- Free upload buffers stay mapped: when an upload ticket completes (its submission
  finished) the ring re-maps its buffers for writing at once, off the caller's critical
  path, and the next ``upload()`` finds them ready. Free download buffers are unmapped;
  ``complete()`` on a download ticket starts mapping them, so ``read()`` finds them mapped.
- Maps are requested only for buffers whose submission finished, and followed by one
  non-blocking device poll on the same thread, which resolves them at once. They are
  wgpu-native's own (:mod:`~hetero._gpu.bufmap`): a map through wgpu-py wakes its poll
  thread into blocking polls, which hold up every submission until the GPU drained.
- A copied download of ``PREFAULT_MIN`` (16 MiB) or more allocates the array that
  ``read()`` returns when it is recorded, and the copy threads touch its pages while
  the GPU copies: a fresh array's page faults otherwise cost as much as the copy-out.
- ``download(..., zero_copy=True)`` uses one staging buffer and ``read()`` returns an
  array *on the mapped staging memory* instead of copying out; the buffer is unmapped
  and goes back to the pool when that array and every view of it are gone: the copy-out
  (and page faults of a new array) cost more than the device copy itself.
- ``download(..., zero_copy="auto")`` is for results a caller may keep for long (graph
  outputs): zero-copy only where that reuses memory, copied otherwise. Zero-copy when a
  free buffer of the size class is pooled (an earlier array on one was dropped), or when
  the class came before (not the first download of that size) and every buffer created
  so far for it came back at least once; never for less than ``AUTO_ZERO_COPY_MIN``, nor
  past ``max_pooled_bytes`` of live zero-copy arrays. A stream that drops its arrays thus
  runs at zero-copy speed from its third download on, and a caller that keeps every
  array costs one buffer creation, then gets copies.

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
the pool has one lock and each ticket its own. Maps go through
:func:`~hetero._gpu.bufmap.request_map`, bound to no thread or event loop: whichever
thread polls the device resolves them.
"""

from __future__ import annotations

import math
import os
import threading
import weakref
from typing import Any, Callable, Sequence

import numpy as np
import wgpu

from .hostcopy import HostCopies, Prefaulted, PREFAULT_MIN
from .passcmd import copy_buffer_to_buffer as _copy
from .bufmap import request_map
from .staging import AUTO_ZERO_COPY_MIN, DEFAULT_POOLED_BYTES, Staging, StagingPool, pad4
from ..errors import GPUError

__all__ = ["AUTO_ZERO_COPY_MIN", "DEFAULT_POOLED_BYTES", "PREFAULT_MIN", "StagingRing", "Ticket"]


def _check_plain(a: np.ndarray) -> None:
    """Only arrays of plain values have bytes to upload."""
    if a.dtype.hasobject:
        raise TypeError(f"upload: cannot upload an array of Python objects (dtype {a.dtype}, shape {a.shape})")


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

    def __init__(self, ring: StagingRing, direction: str, nbytes: int, chunks: list[tuple[Staging, int]],
                 zero_copy: bool = False, host: Prefaulted | None = None) -> None:
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
            self._finalizer = weakref.finalize(self, ring.pool.forget, [s for s, _ in chunks])
            self._finalizer.atexit = False

    @property
    def buffers(self) -> tuple[Any, ...]:
        """The staging ``wgpu.GPUBuffer``s of this ticket (for inspection and tests)."""
        return tuple(s.buffer for s, _ in self._chunks)

    @property
    def released(self) -> bool:
        """True once the buffers left the ticket (completed upload, read, discarded)."""
        return self._state == "released"

    def _detach(self) -> list[Staging]:
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
                self._ring.pool.recycle(self._detach(), remap=True)
                return
            self._state = "completed"
            for s, n in self._chunks:
                s.map = request_map(s.buffer, "READ", 0, pad4(n))
            self._ring.pool.poll()

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
            ok, bad = self._ring.pool.settle(self._detach())
            self._ring.pool.forget(bad)
            self._ring.pool.recycle(ok, remap=False)


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
        self.device = device
        self.chunk_bytes = chunk_bytes
        self.copies = HostCopies(copy_threads=copy_threads, chunk_bytes=chunk_bytes)
        self.pool = StagingPool(device, chunk_bytes=chunk_bytes, max_pooled_bytes=max_pooled_bytes)
        from wgpu.backends.wgpu_native import _api  # wgpu-native's cffi binding (raw mapped pointers)

        self._ffi: Any = _api.ffi
        self._lib: Any = _api.libf

    @property
    def copy_threads(self) -> int:
        return self.copies.copy_threads

    @property
    def max_pooled_bytes(self) -> int:
        return self.pool.max_pooled_bytes


    def upload(self, encoder: Any, array: np.ndarray, dst_buffer: Any, dst_offset: int = 0) -> Ticket:
        """Copy ``array``'s bytes (C order) to ``dst_buffer`` at ``dst_offset``, recorded in ``encoder``.

        The host copy happens now, the device copy when the caller submits ``encoder``'s
        command buffer. The copy moves the size rounded up to 4 bytes (the pad is zeros),
        so ``dst_buffer`` needs room for that. Nothing is mapped when this returns.
        """
        a = np.asarray(array)
        _check_plain(a)
        n = a.nbytes
        self._check_range("upload", "dst", dst_buffer, dst_offset, pad4(n))
        if n == 0:
            return Ticket(self, "up", 0, [])
        self.pool.grow_cap(pad4(n))
        chunks = self._chunks(n)
        if len(chunks) > 1 and not a.flags.c_contiguous:
            a = np.ascontiguousarray(a)  # a strided source spread over several buffers: compact it first
        stagings = self._stage_up([pad4(length) for _, length in chunks],
                                  lambda stagings: self.copies.fill(stagings, chunks, a))
        try:
            for s, (offset, length) in zip(stagings, chunks):
                _copy(encoder, s.buffer, 0, dst_buffer, dst_offset + offset, pad4(length))
        except BaseException:
            self.pool.forget(stagings)  # the encoder may hold them: drop, never reuse
            raise
        return Ticket(self, "up", n, [(s, length) for s, (_, length) in zip(stagings, chunks)])

    def upload_many(self, encoder: Any, items: Sequence[tuple[np.ndarray, Any, int]]) -> Ticket:
        """Several small uploads through one staging buffer: one host fill, one ticket, a copy each.

        ``items`` hold ``(array, dst_buffer, dst_offset)``; each array's bytes (C order) go
        where :meth:`upload` would put them. Together, each rounded up to 4 bytes, they must
        fit one staging buffer (``chunk_bytes``).
        """
        starts: list[int] = []
        total = nbytes = 0
        for a, buf, off in items:
            _check_plain(a)
            self._check_range("upload", "dst", buf, off, pad4(a.nbytes))
            starts.append(total)
            total += pad4(a.nbytes)
            nbytes += a.nbytes
        if total > self.chunk_bytes:
            raise ValueError(f"upload_many: {total} bytes exceed one staging buffer of {self.chunk_bytes} bytes; "
                             "upload them one by one")
        if total == 0:
            return Ticket(self, "up", 0, [])
        self.pool.grow_cap(total)

        def fill(stagings: list[Staging]) -> None:
            view = self.copies.mapped(stagings[0], total)
            try:
                for (a, _, _), start in zip(items, starts):
                    n = a.nbytes
                    if n:
                        np.copyto(view[start:start + n].view(a.dtype).reshape(a.shape), a)
                        view[start + n:start + pad4(n)] = 0  # the pad: zeros, not a previous transfer's bytes
            finally:
                del view

        s, = self._stage_up([total], fill)
        try:
            for (a, buf, off), start in zip(items, starts):
                if a.nbytes:
                    _copy(encoder, s.buffer, start, buf, off, pad4(a.nbytes))
        except BaseException:
            self.pool.forget([s])  # the encoder may hold it: drop, never reuse
            raise
        return Ticket(self, "up", nbytes, [(s, total)])

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
        self._check_range("download", "src", src_buffer, src_offset, pad4(nbytes))
        if nbytes == 0:
            return Ticket(self, "down", 0, [])
        self.pool.grow_cap(pad4(nbytes))
        auto = zero_copy == "auto"
        reused = self.pool.acquire_auto(pad4(nbytes)) if auto else None
        zero_copy = reused is not None or (not auto and bool(zero_copy)
                                           and self.pool.size_class(pad4(nbytes)) <= self.max_buffer_size)
        chunks = [(0, nbytes)] if zero_copy else self._chunks(nbytes)
        stagings = [reused] if reused is not None else [self.pool.acquire("down", pad4(length)) for _, length in chunks]
        try:
            for s in stagings:
                if not s.idle:  # pragma: no cover - free download buffers are unmapped
                    raise GPUError(f"download: staging buffer is {s.buffer.map_state}; refusing to record it")
        except BaseException:
            self.pool.recycle(stagings, remap=False)
            raise
        try:
            for s, (offset, length) in zip(stagings, chunks):
                _copy(encoder, src_buffer, src_offset + offset, s.buffer, 0, pad4(length))
        except BaseException:
            self.pool.forget(stagings)
            raise
        host = self.copies.prefault(nbytes) if prefault and not zero_copy and nbytes >= PREFAULT_MIN else None
        return Ticket(self, "down", nbytes, [(s, length) for s, (_, length) in zip(stagings, chunks)], zero_copy,
                      host)

    def completed(self, tickets: Sequence[Ticket]) -> None:
        """``complete()`` every ticket of a finished submission."""
        for t in tickets:
            t.complete()

    def trim(self) -> int:
        """Destroy every free staging buffer; returns the bytes freed."""
        return self.pool.trim()

    def close(self) -> None:
        """Destroy the free buffers and stop the copy threads; buffers in use die when returned."""
        with self.pool.lock:
            self.pool.closed = True  # first: nothing joins the pool or asks the copy threads for a map now
            executor = self.copies.stop()
        self.pool.close()
        if executor is not None:
            executor.shutdown(wait=True)

    def stats(self) -> dict[str, int]:
        """Counters: live, pooled and zero-copy staging bytes; buffers created, reused, destroyed."""
        return {**self.pool.stats(), "copy_threads": self.copy_threads, "chunk_bytes": self.chunk_bytes}

    def __enter__(self) -> StagingRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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

    def _stage_up(self, sizes: list[int], fill: Callable[[list[Staging]], None]) -> list[Staging]:
        """Upload buffers of ``sizes`` bytes, filled by ``fill`` while mapped, then unmapped and so ready to record."""
        stagings: list[Staging] = []
        try:
            for size in sizes:
                stagings.append(self.pool.acquire("up", size))
            fill(stagings)
            # The safety rule: unmap everything before any copy reaches an encoder.
            for s in stagings:
                s.buffer.unmap()
            for s in stagings:
                if not s.idle:  # pragma: no cover - never record a mapped buffer
                    raise GPUError(f"upload: staging buffer is {s.buffer.map_state} after unmap; refusing to record it")
        except BaseException:
            self.pool.recycle(stagings, remap=False)  # never recorded: mapped or not, the pool takes them
            raise
        return stagings

    def _map_for_read(self, chunks: list[tuple[Staging, int]]) -> None:
        """Map download buffers (finishing what complete() requested); on failure drop them and raise."""
        requested = False
        for s, n in chunks:
            if s.map is None and s.buffer.map_state == "unmapped":
                s.map = request_map(s.buffer, "READ", 0, pad4(n))
                requested = True
        if requested:
            self.pool.poll()
        failed: BaseException | None = None
        for s, _ in chunks:
            request, s.map = s.map, None
            try:
                if request is not None:
                    request.wait()
            except Exception as e:
                failed = failed or e
        if failed is not None:
            for s, _ in chunks:
                if s.buffer.map_state == "mapped":
                    s.buffer.unmap()
            self.pool.forget([s for s, _ in chunks])
            raise GPUError(f"could not map a staging buffer for reading: {failed}") from failed

    def _read_into(self, chunks: list[tuple[Staging, int]], out: np.ndarray) -> None:
        """Map ``chunks``, copy them into ``out`` (flat uint8), unmap and recycle."""
        self._map_for_read(chunks)
        stagings = [s for s, _ in chunks]
        try:
            pairs = []
            off = 0
            for s, n in chunks:
                pairs.append((out[off:off + n], self.copies.mapped(s, pad4(n))[:n]))
                off += n
            self.copies.run(self.copies.split(pairs, off))
            del pairs
        finally:
            # The submission finished and nothing refers to the mapped memory any more:
            # unmapped, the buffers are safe to reuse even if a copy failed.
            for s in stagings:
                s.buffer.unmap()
            self.pool.recycle(stagings, remap=False)

    def _map_array(self, s: Staging, nbytes: int) -> np.ndarray:
        """The first ``nbytes`` of download buffer ``s``, mapped, as a uint8 array that owns the mapping."""
        self._map_for_read([(s, nbytes)])
        try:
            ptr = self._lib.wgpuBufferGetMappedRange(s.buffer._internal, 0, pad4(nbytes))
            if ptr == self._ffi.NULL:
                raise GPUError(f"wgpuBufferGetMappedRange returned NULL for a {s.size}-byte staging buffer")
            owner = _MappedMemory(int(self._ffi.cast("uintptr_t", ptr)), nbytes)
            array = np.asarray(owner)
        except BaseException:
            s.buffer.unmap()
            self.pool.recycle([s], remap=False)
            raise
        with self.pool.lock:
            self.pool.zero_copy_bytes += s.size
        # When the last array on this memory is gone, the buffer is unmapped and reused.
        weakref.finalize(owner, self.pool.release_mapped, s).atexit = False
        return array
