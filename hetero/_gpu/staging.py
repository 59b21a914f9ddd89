"""The staging pool: mapped staging buffers, pooled per direction and size class.

Rules (the notes of :mod:`hetero._gpu.transfer` say why):

- Size classes are powers of two from ``MIN_CLASS`` up to ``chunk_bytes``, multiples of
  ``chunk_bytes`` above. ``acquire`` hands out the buffer of the class freed longest ago,
  mapped for writing (upload) or unmapped (download), and creates one when none is free.
- Past ``max_pooled_bytes`` of free staging, recycled buffers are destroyed, except that
  the buffer of a dropped zero-copy array first evicts free download buffers of other
  classes. The default cap grows to room for an upload and a download of the largest
  transfer so far (``grow_cap``).
- Free upload buffers are mapped again for writing when they come back (``recycle`` with
  ``remap``), off the caller's critical path; free download buffers stay unmapped.
- A buffer that an encoder may still hold is never reused or destroyed: ``forget`` only
  stops counting it.
- A dead zero-copy array's buffer is only queued (``release_mapped`` runs in a finalizer);
  the next call into the pool unmaps and pools it.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any

import wgpu
from wgpu.backends.wgpu_native import _api  # wgpu-native's cffi binding (non-blocking polls)

from ..errors import GPUError, RuntimeClosedError
from .bufmap import MapRequest, request_map

__all__ = ["AUTO_ZERO_COPY_MIN", "DEFAULT_POOLED_BYTES", "MIN_CLASS", "Staging", "StagingPool", "pad4"]


log = logging.getLogger("hetero")

_UP_USAGE = wgpu.BufferUsage.MAP_WRITE | wgpu.BufferUsage.COPY_SRC
_DOWN_USAGE = wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST
MIN_CLASS = 64 << 10  # smallest staging buffer
DEFAULT_POOLED_BYTES = 512 << 20  # free staging kept, unless larger transfers need more
AUTO_ZERO_COPY_MIN = 16 << 20  # zero_copy="auto" copies anything smaller (cheap, and no class rounding)


def pad4(nbytes: int) -> int:
    return (nbytes + 3) & ~3


class Staging:
    """One pooled staging buffer and the map it may have pending."""

    __slots__ = ("buffer", "direction", "map", "size")

    def __init__(self, buffer: Any, direction: str, size: int) -> None:
        self.buffer = buffer
        self.direction = direction  # "up" or "down"
        self.size = size
        self.map: MapRequest | None = None  # a map requested and not yet waited for

    @property
    def idle(self) -> bool:
        """Unmapped with no map pending: the only state allowed in a submission."""
        return self.map is None and self.buffer.map_state == "unmapped"



class StagingPool:
    """Free staging buffers of one ``wgpu.GPUDevice``, and the counts of all it made."""

    def __init__(self, device: wgpu.GPUDevice, *, chunk_bytes: int, max_pooled_bytes: int | None) -> None:
        self._cap_grows = max_pooled_bytes is None
        if max_pooled_bytes is None:
            max_pooled_bytes = DEFAULT_POOLED_BYTES
        if max_pooled_bytes < 0:
            raise ValueError(f"max_pooled_bytes must not be negative, got {max_pooled_bytes}")
        self.device = device
        self.max_buffer_size = int(device.limits["max-buffer-size"])
        self.chunk_bytes = chunk_bytes
        self.max_pooled_bytes = max_pooled_bytes
        # Re-entrant: a finalizer (garbage collection) may run while this thread holds it.
        self.lock = threading.RLock()
        self._free: dict[tuple[str, int], collections.deque[Staging]] = {}
        self.closed = False
        self._live_bytes = 0
        self._pooled_bytes = 0
        self.zero_copy_bytes = 0
        self._returned: collections.deque[Staging] = collections.deque()  # from dead zero-copy arrays
        # zero_copy="auto", per download size class: downloads seen, buffers created for
        # it, zero-copy buffers given back (arrays dropped).
        self._auto_seen: collections.Counter[int] = collections.Counter()
        self._auto_created: collections.Counter[int] = collections.Counter()
        self._auto_returned: collections.Counter[int] = collections.Counter()
        self._allocations = 0
        self._reuses = 0
        self._destroyed = 0

    def close(self) -> None:
        """Refuse new buffers and destroy the free ones; buffers in use die when they come back."""
        with self.lock:
            self.closed = True
        self.trim()

    def stats(self) -> dict[str, int]:
        """Counters: live, pooled and zero-copy staging bytes; buffers created, reused, destroyed."""
        self.drain_returned()
        with self.lock:
            return {
                "staging_bytes": self._live_bytes,
                "pooled_bytes": self._pooled_bytes,
                "in_use_bytes": self._live_bytes - self._pooled_bytes,
                "zero_copy_bytes": self.zero_copy_bytes,
                "staging_allocations": self._allocations,
                "staging_reuses": self._reuses,
                "staging_destroyed": self._destroyed,
                "free_buffers": sum(len(v) for v in self._free.values()),
            }

    def size_class(self, nbytes: int) -> int:
        """The pool's size class for ``nbytes``: a power of two up to chunk_bytes, then its multiples."""
        if nbytes <= self.chunk_bytes:
            return max(MIN_CLASS, 1 << max(0, nbytes - 1).bit_length())
        return -(-nbytes // self.chunk_bytes) * self.chunk_bytes

    def grow_cap(self, nbytes: int) -> None:
        """Default cap: room for an upload and a download of the largest transfer so far."""
        if self._cap_grows:
            need = 2 * self.size_class(nbytes)
            if need > self.max_pooled_bytes:
                with self.lock:
                    self.max_pooled_bytes = max(self.max_pooled_bytes, need)

    def acquire(self, direction: str, nbytes: int) -> Staging:
        """A staging buffer of at least ``nbytes``: mapped for writing (up) or unmapped (down)."""
        size = self.size_class(nbytes)
        self.drain_returned()
        with self.lock:
            if self.closed:
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
            s = Staging(buf, direction, size)
            with self.lock:
                self._live_bytes += size
                self._allocations += 1
            return s
        if direction == "up":
            try:
                self.wait_mapped(s)
            except BaseException:
                self.forget([s])
                raise
        return s

    def acquire_auto(self, nbytes: int) -> Staging | None:
        """The buffer of a ``zero_copy="auto"`` download, or None for a copied one (module notes)."""
        size = self.size_class(nbytes)
        if nbytes < AUTO_ZERO_COPY_MIN or size > self.max_buffer_size:
            return None
        self.drain_returned()
        with self.lock:
            if self.closed:
                raise RuntimeClosedError("the staging ring was used after close()")
            seen = self._auto_seen[size]
            self._auto_seen[size] = seen + 1
            if self._free.get(("down", size)):
                pass  # a dropped array's buffer (or a copied download's): _acquire takes it
            elif (seen == 0 or self._auto_created[size] > self._auto_returned[size]
                  or self.zero_copy_bytes + size > self.max_pooled_bytes):
                return None
            else:
                self._auto_created[size] += 1
        return self.acquire("down", nbytes)

    def wait_mapped(self, s: Staging) -> None:
        """Make a free upload buffer mapped for writing (finishing the map complete() requested)."""
        if s.map is None and s.buffer.map_state == "unmapped":  # after discard()
            s.map = request_map(s.buffer, "WRITE")
        if s.map is not None:  # wait() polls until it resolves
            request, s.map = s.map, None
            try:
                request.wait()
            except Exception as e:
                raise GPUError(f"could not map a {s.size}-byte staging buffer for writing: {e}") from e

    def recycle(self, stagings: list[Staging], *, remap: bool, evict: bool = False) -> list[Staging]:
        """Return buffers (owned by the caller) to the pool; upload ones are mapped again if ``remap``.

        ``evict``: make room by destroying free download buffers of other size classes,
        oldest first, rather than destroying these. Returns the buffers the pool kept.
        """
        keep: list[Staging] = []
        drop: list[Staging] = []
        with self.lock:
            for s in stagings:
                if evict and not self.closed and s.size <= self.max_pooled_bytes:
                    drop += self._evict_down(self._pooled_bytes + s.size - self.max_pooled_bytes, s.size)
                if not self.closed and self._pooled_bytes + s.size <= self.max_pooled_bytes:
                    self._pooled_bytes += s.size  # room reserved now; the buffer joins the pool below
                    keep.append(s)
                else:
                    drop.append(s)
        for s in drop:
            self.destroy(s)
        if not keep:
            return keep
        remaps = [s for s in keep if remap and s.direction == "up" and s.buffer.map_state == "unmapped"]
        for s in remaps:
            try:
                s.map = request_map(s.buffer, "WRITE")
            except Exception:  # noqa: BLE001 - e.g. the device is gone: wait_mapped() asks again
                log.debug("staging pool: could not request a write map", exc_info=True)
        if remaps:
            self.poll()
        with self.lock:
            closed = self.closed
            if not closed:
                for s in keep:
                    self._free.setdefault((s.direction, s.size), collections.deque()).append(s)
            else:
                self._pooled_bytes -= sum(s.size for s in keep)
        if closed:  # close() ran meanwhile: these would outlive its trim()
            for s in keep:
                self.destroy(s)
            return []
        return keep

    def _evict_down(self, excess: int, spare: int) -> list[Staging]:
        """Under the lock: take free download buffers not of class ``spare`` out of the pool
        (oldest first in each class) until ``excess`` bytes are gone; the caller destroys them."""
        out: list[Staging] = []
        for (direction, size), lst in self._free.items():
            while excess > 0 and lst and direction == "down" and size != spare:
                s = lst.popleft()
                self._pooled_bytes -= s.size
                excess -= s.size
                out.append(s)
        return out

    def settle(self, stagings: list[Staging]) -> tuple[list[Staging], list[Staging]]:
        """Finish pending maps and unmap: (now unmapped, failed to map and so unusable)."""
        ok: list[Staging] = []
        bad: list[Staging] = []
        for s in stagings:
            try:
                if s.map is not None:
                    s.map.wait()
                if s.buffer.map_state == "mapped":
                    s.buffer.unmap()
                ok.append(s)
            except Exception:  # pragma: no cover - a failed map (device lost)
                bad.append(s)
            s.map = None
        return ok, bad

    def destroy(self, s: Staging) -> None:
        self.settle([s])  # unmap first: wgpu-py's wrapper would otherwise still say "mapped"
        s.buffer.destroy()
        with self.lock:
            self._live_bytes -= s.size
            self._destroyed += 1

    def forget(self, stagings: list[Staging]) -> None:
        """Stop counting buffers that an encoder may still hold; never destroy them."""
        with self.lock:
            self._live_bytes -= sum(s.size for s in stagings)

    def poll(self) -> None:
        """One non-blocking device poll on this thread: resolves the maps of buffers whose work finished."""
        _api.libf.wgpuDevicePoll(self.device._internal, False, _api.ffi.NULL)

    def release_mapped(self, s: Staging) -> None:
        # A finalizer: it runs on whichever thread dropped the last array, possibly in the
        # middle of this ring's own code (garbage collection), so it only queues the buffer
        # (deque.append is atomic); the next ring call unmaps and pools it.
        self._returned.append(s)
        if self.closed:
            self.drain_returned()

    def drain_returned(self) -> None:
        """Unmap and pool the buffers of zero-copy arrays that are gone."""
        while True:
            try:
                s = self._returned.popleft()
            except IndexError:
                return
            with self.lock:
                self.zero_copy_bytes -= s.size
            try:
                s.buffer.unmap()
                # A whole result's buffer outranks free chunk buffers (copied downloads of
                # that size are what it replaces); it counts as given back only if pooled.
                if self.recycle([s], remap=False, evict=True):
                    with self.lock:
                        self._auto_returned[s.size] += 1
            except Exception:  # pragma: no cover - device gone: nothing to give back
                log.debug("staging pool: could not recycle a zero-copy buffer", exc_info=True)
                self.forget([s])

    def trim(self) -> int:
        """Destroy every free staging buffer; returns the bytes freed."""
        self.drain_returned()
        with self.lock:
            free = [s for lst in self._free.values() for s in lst]
            self._free.clear()
            self._pooled_bytes = 0
        for s in free:
            self.destroy(s)
        return sum(s.size for s in free)
