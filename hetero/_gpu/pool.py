"""The device-memory pool of the GPU runtime: size classes, slabs, a budget, and waiting.

Why a pool
----------
Creating a wgpu buffer costs a driver call and fresh device memory, and GPU stages
allocate the same few shapes over and over (one per value per run). The pool hands
out :class:`Block` s -- a byte range of a wgpu buffer -- and takes them back when
their last user releases them, so a stream of runs settles into reusing the same
device memory with no new allocations at all.

Size classes
------------
A request of ``nbytes`` is rounded up to a *size class*, and only blocks of the
same class and the same usage flags are interchangeable (buffers with different
usage are never mixed: a uniform buffer is not a storage buffer).

* Small requests (``nbytes <= small_max_bytes``, 64 KiB by default) are rounded up
  to a power of two, at least ``min_class`` = max(256, the device's
  min-storage/uniform-buffer-offset-alignment). They are carved out of *slabs*:
  one wgpu buffer (1 MiB by default) split into equal blocks of one class. Block
  offsets are multiples of the class, hence of ``min_class``, so any block can be
  bound at its offset on every adapter. Waste is below 50% of a block, at most
  32 KiB per block.
* Large requests get a buffer of their own, rounded up to one of four steps per
  power of two (2^k, 1.25*2^k, 1.5*2^k, 1.75*2^k), so the waste is below 25% of
  the request, and never more than the device's max-buffer-size (a request above
  it raises :class:`ValueError`). Where the class would exceed max-buffer-size or
  the budget but the request itself fits, the buffer is the request rounded up to
  256 bytes (or to 4, WebGPU's copy granule) instead.
* Usages that can be mapped (MAP_READ, MAP_WRITE) always get a buffer of their
  own: a mapped buffer cannot be used by a submission, so a slab shared by two
  blocks would let mapping one block abort the submission of its neighbour.
* STORAGE usages get a buffer of their own too. WebGPU tracks usage per buffer,
  not per range: a dispatch that reads one block of a slab and writes another
  binds the same buffer as read-only and read-write storage at once, which is a
  validation error ("conflicting usages"). Small storage tensors therefore get
  the smallest class (256 bytes and up, powers of two) in their own buffer, and
  reuse makes the per-buffer cost a one-off.

Budget
------
The budget bounds the device memory the pool holds: blocks in use plus free
blocks kept for reuse (``device_bytes``). wgpu 0.32 does not expose how much
memory an adapter has, so the default is a conservative guess,
``min(8 GiB, 4 * max-buffer-size)``: large enough for the inference graphs
hetero targets, small enough not to exhaust a laptop GPU or, on a software
adapter, host RAM. Pass ``budget_bytes`` (``Runtime(memory_budget=...)``) to set
it. Free slabs shrink with small budgets (at most budget/8) so that a single
small request never needs a large share of it.

An acquire that can be served from free pooled memory never counts against the
budget. One that needs a new device allocation which would push ``device_bytes``
over the budget first destroys free pooled buffers, least recently freed first,
to make room. If that is not enough:

* ``overcommit=False``: the acquire raises :class:`MemoryWait` (and counts a
  ``wait``). The scheduler parks the stage and registers :meth:`BufferPool.on_free`;
  when some block is released it retries the stage. ``MemoryWait.generation``
  closes the race between the refusal and the registration: pass it as
  ``on_free(callback, after=generation)`` and the callback runs at once if memory
  was released in between.
* ``overcommit=True``: it allocates anyway (after destroying every free buffer, to
  keep the overshoot small) and counts an ``overcommit``.

The scheduler lets the oldest active run overcommit and makes younger runs wait.
The oldest run therefore always makes progress, finishes, and releases its
memory, which wakes the younger ones: the budget can delay runs but never
deadlock them. Memory above the budget is given back by ordinary reuse and trims.

A request larger than the whole budget can never be served without overcommit
and raises :class:`OutOfMemoryError` right away, whatever ``overcommit`` says.

Lifetimes
---------
:meth:`BufferPool.acquire` returns a block with reference count 1; ``retain`` adds
one, ``release`` drops one and returns the block to the pool at zero. Release a
block only once every command buffer that uses it was *submitted*: the queue runs
submissions in order, so the next user's work (and ``queue.write_buffer`` before
it) runs after the previous user's, and wgpu-core delays the real freeing of a
destroyed buffer until submitted work that uses it completed. What the pool must
never do -- destroy a buffer that is in use, or hand out a buffer that is mapped --
would abort the process at the next ``queue.submit``, so ``trim`` only destroys
buffers with no block in use, and releasing a mapped block is refused.

Thread safety: one lock guards the books. ``create_buffer`` runs under it (a
quick driver call); ``destroy`` calls of ``trim`` and ``on_free`` callbacks run
outside it.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import wgpu

from .._argtypes import check_positive_int
from ..errors import OutOfMemoryError, RuntimeClosedError

__all__ = [
    "Block",
    "BufferPool",
    "MemoryStats",
    "MemoryWait",
    "default_budget",
    "format_bytes",
    "size_class",
]

log = logging.getLogger("hetero")

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

DEFAULT_SMALL_MAX = 64 * KiB
DEFAULT_SLAB_BYTES = 1 * MiB
MIN_CLASS = 256
BUDGET_CAP = 8 * GiB
_MAPPABLE = int(wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.MAP_WRITE)
_NO_SLAB = _MAPPABLE | int(wgpu.BufferUsage.STORAGE)  # see "Size classes" above


class MemoryWait(Exception):
    """Internal: the budget refused a new allocation now; retry after memory is released.

    ``nbytes`` and ``stage`` describe the request, ``needed`` is the device
    allocation it would have made, ``generation`` is the pool's release count
    when it was refused (pass it to :meth:`BufferPool.on_free` as ``after``).
    """

    def __init__(self, nbytes: int, stage: str, needed: int, device_bytes: int, budget_bytes: int,
                 generation: int) -> None:
        who = f"stage {stage!r}" if stage else "a request"
        super().__init__(
            f"{who} waits for {format_bytes(needed)} of device memory: {format_bytes(device_bytes)} "
            f"of the {format_bytes(budget_bytes)} budget are held"
        )
        self.nbytes = nbytes
        self.stage = stage
        self.needed = needed
        self.generation = generation


@dataclass(frozen=True)
class MemoryStats:
    """A snapshot of a :class:`BufferPool`'s books (all sizes in bytes)."""

    in_use_bytes: int  # size classes of blocks handed out and not yet released
    peak_bytes: int  # max of in_use_bytes since creation or reset_peak()
    pooled_bytes: int  # device memory held free for reuse (device_bytes - in_use_bytes)
    device_bytes: int  # device memory the pool allocated and has not destroyed
    allocations: int  # real device allocations (create_buffer calls) so far
    reuses: int  # acquires served without a new device allocation
    budget_bytes: int
    waits: int  # acquires refused by the budget (MemoryWait)
    overcommits: int  # acquires that allocated past the budget because overcommit=True
    requested_bytes: int  # bytes asked for by blocks in use (<= in_use_bytes; the rest is rounding)
    blocks_in_use: int
    buffers: int  # live wgpu buffers (slabs and dedicated buffers)

    @classmethod
    def empty(cls, budget_bytes: int | None = None) -> MemoryStats:
        """The stats of a runtime that has not created its device yet."""
        return cls(0, 0, 0, 0, 0, 0, budget_bytes or 0, 0, 0, 0, 0, 0)


class Block:
    """One allocation handed out by a :class:`BufferPool`: ``size`` bytes at ``offset`` in ``buffer``.

    ``nbytes`` is what was asked for, ``size`` what was reserved (the size class).
    Blocks are reference counted by the pool that made them.
    """

    __slots__ = ("_home", "_pool", "_refs", "buffer", "nbytes", "offset", "size", "usage")

    def __init__(self, pool: BufferPool, home: _Slab | _Dedicated, buffer: wgpu.GPUBuffer, offset: int,
                 size: int, nbytes: int, usage: int) -> None:
        self.buffer = buffer
        self.offset = offset
        self.size = size
        self.nbytes = nbytes
        self.usage = usage
        self._pool = pool
        self._home = home
        self._refs = 1

    @property
    def pool(self) -> BufferPool:
        return self._pool

    @property
    def refcount(self) -> int:
        return self._refs

    @property
    def binding_size(self) -> int:
        """Bytes a binding of this block covers: ``nbytes`` rounded up to 4 (at least 4)."""
        return max(4, (self.nbytes + 3) & ~3)

    @property
    def binding(self) -> dict[str, Any]:
        """A bind group ``resource`` for this block: its buffer at its offset."""
        return {"buffer": self.buffer, "offset": self.offset, "size": self.binding_size}

    def __repr__(self) -> str:
        return (f"<Block {self.nbytes} B in class {self.size} at offset {self.offset} "
                f"usage={self.usage:#x} refs={self._refs}>")


class _Slab:
    """A buffer split into equal blocks of one class; ``free`` holds the free offsets."""

    __slots__ = ("buffer", "cls", "free", "key", "nblocks", "size", "tick")

    def __init__(self, buffer: wgpu.GPUBuffer, key: tuple[int, int], cls: int, nblocks: int) -> None:
        self.buffer = buffer
        self.key = key
        self.cls = cls
        self.nblocks = nblocks
        self.size = cls * nblocks
        # Popped from the end: low offsets are handed out first.
        self.free = list(range((nblocks - 1) * cls, -1, -cls))
        self.tick = 0  # when it last became wholly free (LRU order for trims)


class _Dedicated:
    """A buffer holding one block."""

    __slots__ = ("buffer", "key", "size", "tick")

    def __init__(self, buffer: wgpu.GPUBuffer, key: tuple[int, int], size: int) -> None:
        self.buffer = buffer
        self.key = key
        self.size = size
        self.tick = 0


def format_bytes(n: int) -> str:
    """``3221225472`` -> ``'3.0 GiB'``; below 1 KiB: ``'512 B'``."""
    if n < KiB:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:.1f} {unit}"


def default_budget(limits: dict[str, Any]) -> int:
    """The budget used when none is given: ``min(8 GiB, 4 * max-buffer-size)``.

    wgpu 0.32 exposes no memory size; see the module docstring for why this guess.
    """
    return int(min(BUDGET_CAP, 4 * int(limits["max-buffer-size"])))


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1) if n > 0 else 0


def size_class(nbytes: int, *, min_class: int = MIN_CLASS, small_max: int = DEFAULT_SMALL_MAX) -> int:
    """The size class of a request (before capping at max-buffer-size or the budget).

    Small requests: the power of two >= ``max(nbytes, min_class)``. Large ones: the
    next of 2^k * (1, 1.25, 1.5, 1.75), rounded up to 256 bytes (waste < 25%).
    """
    if nbytes <= small_max:
        return max(min_class, _pow2_ceil(nbytes))
    base = _pow2_floor(nbytes)
    step = max(1, base // 4)
    cls = base + -(-(nbytes - base) // step) * step
    return max(min_class, (cls + 255) & ~255)


class BufferPool:
    """Hands out :class:`Block` s of device memory and takes them back for reuse.

    ``limits`` overrides the device's limits (``max-buffer-size``,
    ``min-storage-buffer-offset-alignment``, ``min-uniform-buffer-offset-alignment``).
    ``small_max_bytes`` and ``slab_bytes`` tune the slab allocator. See the module
    docstring for size classes, the budget and the waiting policy.
    """

    def __init__(self, device: wgpu.GPUDevice, *, budget_bytes: int | None = None,
                 limits: dict[str, Any] | None = None, small_max_bytes: int = DEFAULT_SMALL_MAX,
                 slab_bytes: int = DEFAULT_SLAB_BYTES, before_destroy: Callable[[], None] | None = None,
                 slab_storage: bool = False, on_create: Callable[[Any], None] | None = None,
                 on_destroy: Callable[[list[Any]], None] | None = None) -> None:
        self.device = device
        # Told about every buffer the pool creates, and about the buffers it is about to
        # destroy (the device's bind-group cache forgets the groups that bind them).
        self._on_create = on_create
        self._on_destroy = on_destroy
        # Called before free buffers are destroyed: a free buffer may still be named by a
        # recorded command buffer that waits in the submission batch, and submitting work
        # that uses a destroyed buffer aborts the process. The runtime flushes the batch here.
        self._before_destroy = before_destroy
        # Slabs of STORAGE buffers are only safe where no dispatch binds two blocks of
        # one slab (see "Size classes"); the runtime never enables them.
        self._no_slab = _MAPPABLE if slab_storage else _NO_SLAB
        lim: dict[str, Any] = dict(device.limits)
        if limits:
            lim.update(limits)
        self.max_buffer_size = int(lim["max-buffer-size"])
        align = max(int(lim.get("min-storage-buffer-offset-alignment", 0) or 0),
                    int(lim.get("min-uniform-buffer-offset-alignment", 0) or 0))
        self.min_class = _pow2_ceil(max(MIN_CLASS, align))
        if budget_bytes is None:
            budget_bytes = default_budget(lim)
        self.budget_bytes = check_positive_int("the memory budget", budget_bytes, rule="a positive number of bytes")
        for name, v in (("small_max_bytes", small_max_bytes), ("slab_bytes", slab_bytes)):
            check_positive_int(name, v, minimum=0, rule="a non-negative number of bytes")
        self.small_max = small_max_bytes
        # A slab never takes more than 1/8 of the budget or more than max-buffer-size.
        self.slab_bytes = min(_pow2_floor(slab_bytes), _pow2_floor(budget_bytes // 8),
                              _pow2_floor(self.max_buffer_size))

        self._lock = threading.Lock()
        self._closed = False
        self._slabs: dict[tuple[int, int], list[_Slab]] = {}  # every slab, by (usage, class)
        self._free_dedicated: dict[tuple[int, int], list[_Dedicated]] = {}
        self._live_dedicated: dict[int, _Dedicated] = {}  # id(unit) -> dedicated buffers in use
        self._callbacks: list[Callable[[], None]] = []
        self._tick = 0
        self._generation = 0  # number of releases that returned memory to the pool
        self._in_use = 0
        self._requested = 0
        self._blocks = 0
        self._peak = 0
        self._device_bytes = 0
        self._buffers = 0
        self._allocations = 0
        self._reuses = 0
        self._waits = 0
        self._overcommits = 0

    # -- classes ----------------------------------------------------------------------
    def _placement(self, nbytes: int, usage: int) -> tuple[int, bool]:
        """(reserved size, carved from a slab?) for a request; raises for impossible ones."""
        need = max(4, (nbytes + 3) & ~3)  # WebGPU copies and bindings move multiples of 4
        if need > self.max_buffer_size:
            raise ValueError(
                f"a buffer of {nbytes} bytes exceeds the adapter's max-buffer-size of "
                f"{self.max_buffer_size} bytes"
            )
        cls = size_class(nbytes, min_class=self.min_class, small_max=self.small_max)
        cap = min(self.max_buffer_size, self.budget_bytes)
        if cls > cap and need <= cap:
            r256 = (nbytes + 255) & ~255
            cls = r256 if r256 <= cap else need
        slab = (nbytes <= self.small_max and not usage & self._no_slab and self.slab_bytes >= 2 * cls)
        return cls, slab

    # -- acquire / retain / release ---------------------------------------------------
    def acquire(self, nbytes: int, usage: int, *, stage: str = "", overcommit: bool = False) -> Block:
        """A block of at least ``nbytes`` bytes of a buffer with ``usage``, with refcount 1.

        Raises :class:`MemoryWait` when a new allocation would exceed the budget (and
        ``overcommit`` is False), :class:`OutOfMemoryError` when ``nbytes`` exceeds the
        whole budget, :class:`ValueError` above the device's max-buffer-size.
        """
        check_positive_int("a buffer size", nbytes, minimum=0, rule="a non-negative number of bytes")
        usage = int(usage)
        cls, use_slab = self._placement(nbytes, usage)
        self._check_budget(nbytes, stage)
        with self._lock:
            if self._closed:
                raise RuntimeClosedError("the buffer pool is closed; create a new Runtime")
            return self._acquire_locked(cls, nbytes, usage, use_slab, stage, overcommit, None)

    def _check_budget(self, nbytes: int, stage: str) -> None:
        if max(4, (nbytes + 3) & ~3) > self.budget_bytes:
            who = f"stage {stage!r}" if stage else "a request"
            raise OutOfMemoryError(
                f"{who} needs a buffer of {format_bytes(nbytes)} ({nbytes} bytes), more than the memory "
                f"budget of {format_bytes(self.budget_bytes)} ({self.budget_bytes} bytes); "
                "raise Runtime(memory_budget=...) or split the work"
            )

    def placement(self, nbytes: int, usage: int) -> tuple[int, bool]:
        """(size class, carved from a slab?) of a request: what :meth:`acquire_many` takes per request."""
        return self._placement(nbytes, int(usage))

    def acquire_many(self, requests: list[tuple[int, int, bool]], usage: int, out: list[Block], *,
                     prefer: list[Any] | None = None, stage: str = "", overcommit: bool = False) -> None:
        """:meth:`acquire` for several requests under one lock, appending each block to ``out``.

        ``requests`` hold ``(nbytes, size class, slab)`` as :meth:`placement` gave them.
        ``prefer[i]``, where given, is a buffer request ``i`` takes if it
        is free (a replay asks for the buffers of the previous one: its bind groups stay
        valid). On :class:`MemoryWait` the blocks taken so far are in ``out``; the caller
        releases them.
        """
        usage = int(usage)
        for nbytes, _, _ in requests:
            self._check_budget(nbytes, stage)
        with self._lock:
            if self._closed:
                raise RuntimeClosedError("the buffer pool is closed; create a new Runtime")
            for i, (nbytes, cls, use_slab) in enumerate(requests):
                out.append(self._acquire_locked(cls, nbytes, usage, use_slab, stage, overcommit,
                                                prefer[i] if prefer is not None else None))

    def _acquire_locked(self, cls: int, nbytes: int, usage: int, use_slab: bool, stage: str, overcommit: bool,
                        want: Any) -> Block:
        """Under the lock: a block of class ``cls`` (buffer ``want`` if it is free), made if none is free."""
        key = (usage, cls)
        block = None
        if want is not None and not use_slab:
            free = self._free_dedicated.get(key)
            if free:
                for j in range(len(free) - 1, -1, -1):
                    unit = free[j]
                    if unit.buffer is want:
                        del free[j]
                        self._live_dedicated[id(unit)] = unit
                        block = Block(self, unit, unit.buffer, 0, cls, nbytes, usage)
                        break
        if block is None:
            block = self._take_free(key, cls, nbytes, usage, use_slab)
        if block is None:
            size = self.slab_bytes // cls * cls if use_slab else cls
            self._make_room(size, nbytes, stage, overcommit)
            buffer = self._create(size, usage, f"hetero-{'slab' if use_slab else 'block'}-{cls}")
            if use_slab:
                slab = _Slab(buffer, key, cls, size // cls)
                self._slabs.setdefault(key, []).append(slab)
                block = Block(self, slab, buffer, slab.free.pop(), cls, nbytes, usage)
            else:
                unit = _Dedicated(buffer, key, cls)
                self._live_dedicated[id(unit)] = unit
                block = Block(self, unit, buffer, 0, cls, nbytes, usage)
        else:
            self._reuses += 1
        self._in_use += cls
        self._requested += nbytes
        self._blocks += 1
        if self._in_use > self._peak:
            self._peak = self._in_use
        return block

    def _take_free(self, key: tuple[int, int], cls: int, nbytes: int, usage: int, use_slab: bool) -> Block | None:
        if use_slab:
            for slab in self._slabs.get(key, ()):
                if slab.free:
                    return Block(self, slab, slab.buffer, slab.free.pop(), cls, nbytes, usage)
            return None
        free = self._free_dedicated.get(key)
        if not free:
            return None
        unit = free.pop()  # the most recently freed: likeliest still in cache
        self._live_dedicated[id(unit)] = unit
        return Block(self, unit, unit.buffer, 0, cls, nbytes, usage)

    def _make_room(self, size: int, nbytes: int, stage: str, overcommit: bool) -> None:
        """Under the lock: destroy free buffers so that ``size`` more bytes fit the budget, or refuse."""
        over = self._device_bytes + size - self.budget_bytes
        if over <= 0:
            return
        victims = self._free_units()
        reclaimable = sum(u.size for u in victims)
        if reclaimable < over and not overcommit:
            # Keep the cache: destroying it would not make room anyway.
            self._waits += 1
            raise MemoryWait(nbytes, stage, size, self._device_bytes, self.budget_bytes, self._generation)
        victims.sort(key=lambda u: u.tick)
        if self._before_destroy is not None:
            self._before_destroy()
        doomed = []
        for u in victims:
            if over <= 0:
                break
            self._forget(u)
            doomed.append(u)
            over -= u.size
        self._destroy([u.buffer for u in doomed])
        if over > 0:
            self._overcommits += 1

    def _create(self, size: int, usage: int, label: str) -> wgpu.GPUBuffer:
        """Under the lock: one real device allocation (retried once after a full trim)."""
        try:
            buffer = self.device.create_buffer(label=label, size=size, usage=usage)
        except Exception as first:
            freed = self._free_units()
            if freed and self._before_destroy is not None:
                self._before_destroy()
            for u in freed:
                self._forget(u)
            self._destroy([u.buffer for u in freed])
            try:
                buffer = self.device.create_buffer(label=label, size=size, usage=usage)
            except Exception as e:
                raise OutOfMemoryError(
                    f"the device could not allocate a buffer of {format_bytes(size)} ({size} bytes) "
                    f"with {format_bytes(self._device_bytes)} held by the pool: {e}"
                ) from first
        self._allocations += 1
        self._buffers += 1
        self._device_bytes += size
        if self._on_create is not None:
            self._on_create(buffer)
        return buffer

    def _destroy(self, buffers: list[Any]) -> None:
        if not buffers:
            return
        if self._on_destroy is not None:
            self._on_destroy(buffers)
        for b in buffers:
            b.destroy()

    def retain(self, block: Block) -> Block:
        """Add a reference to ``block`` (another owner will release it); returns it."""
        with self._lock:
            self._check_owner(block, "retain")
            block._refs += 1
        return block

    def release(self, block: Block) -> None:
        """Drop a reference; at zero the block returns to the pool and on_free callbacks run."""
        self.release_many((block,))

    def release_many(self, blocks: Iterable[Block]) -> None:
        """:meth:`release` for each of ``blocks`` under one lock (a stage's temporaries), on_free
        callbacks run once. A block that cannot be released raises before any is."""
        blocks = list(blocks)
        for block in blocks:
            if block.usage & _MAPPABLE and block._refs == 1 and block.buffer.map_state != "unmapped":
                raise RuntimeError(
                    f"cannot release a block whose buffer is {block.buffer.map_state}; unmap it first "
                    "(a mapped buffer in a submission aborts the process)"
                )
        freed = False
        with self._lock:
            for block in blocks:
                self._check_owner(block, "release")
            if len(blocks) > 1:  # a block listed more often than it has references
                counts: dict[int, int] = {}
                for block in blocks:
                    n = counts[id(block)] = counts.get(id(block), 0) + 1
                    if n > block._refs:
                        raise RuntimeError(f"cannot release a block {n} times with {block._refs} reference(s) "
                                           f"({block!r}); each acquire or retain takes exactly one release")
            for block in blocks:
                block._refs -= 1
                if block._refs:
                    continue
                freed = True
                self._in_use -= block.size
                self._requested -= block.nbytes
                self._blocks -= 1
                self._tick += 1
                home = block._home
                if self._closed:
                    pass  # close() destroyed everything; only the books are kept straight
                elif isinstance(home, _Slab):
                    home.free.append(block.offset)
                    if len(home.free) == home.nblocks:
                        home.tick = self._tick
                else:
                    del self._live_dedicated[id(home)]
                    home.tick = self._tick
                    self._free_dedicated.setdefault(home.key, []).append(home)
            if not freed:
                return
            self._generation += 1
            callbacks, self._callbacks = self._callbacks, []
        self._run(callbacks)

    def _check_owner(self, block: Block, what: str) -> None:
        if block._pool is not self:
            raise RuntimeError(f"cannot {what} a block that another buffer pool handed out")
        if block._refs <= 0:
            raise RuntimeError(f"cannot {what} a block that was already released ({block!r}); "
                               "each acquire or retain takes exactly one release")

    # -- notifications ----------------------------------------------------------------
    def on_free(self, callback: Callable[[], None], *, after: int | None = None) -> None:
        """Call ``callback()`` once, the next time a block returns to the pool (or at close).

        With ``after`` (a :attr:`MemoryWait.generation`), the callback runs at once if
        a block was released since that refusal. Callbacks run outside the pool's lock,
        on the releasing thread; they should only schedule work.
        """
        with self._lock:
            if not self._closed and (after is None or after >= self._generation):
                self._callbacks.append(callback)
                return
        self._run([callback])

    @staticmethod
    def _run(callbacks: list[Callable[[], None]]) -> None:
        for cb in callbacks:
            try:
                cb()
            except Exception:
                log.exception("buffer pool on_free callback failed")

    # -- trimming and shutdown --------------------------------------------------------
    def _free_units(self) -> list[_Slab | _Dedicated]:
        """Under the lock: every buffer with no block in use."""
        units: list[_Slab | _Dedicated] = []
        for slabs in self._slabs.values():
            units.extend(s for s in slabs if len(s.free) == s.nblocks)
        for free in self._free_dedicated.values():
            units.extend(free)
        return units

    def _forget(self, unit: _Slab | _Dedicated) -> None:
        """Under the lock: take a free buffer off the books (the caller destroys it)."""
        if isinstance(unit, _Slab):
            slabs = self._slabs[unit.key]
            slabs.remove(unit)
            if not slabs:
                del self._slabs[unit.key]
        else:
            free = self._free_dedicated[unit.key]
            free.remove(unit)
            if not free:
                del self._free_dedicated[unit.key]
        self._device_bytes -= unit.size
        self._buffers -= 1

    def trim(self) -> int:
        """Destroy every buffer with no block in use (whole free slabs included); returns bytes freed."""
        with self._lock:
            units = self._free_units()
            for u in units:
                self._forget(u)
        if units and self._before_destroy is not None:
            self._before_destroy()
        self._destroy([u.buffer for u in units])
        return sum(u.size for u in units)

    def close(self) -> None:
        """Destroy every buffer, in use or not (runtime shutdown only). Pending on_free callbacks run."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            buffers = [s.buffer for slabs in self._slabs.values() for s in slabs]
            buffers += [u.buffer for free in self._free_dedicated.values() for u in free]
            buffers += [u.buffer for u in self._live_dedicated.values()]
            self._slabs.clear()
            self._free_dedicated.clear()
            self._live_dedicated.clear()
            self._device_bytes = 0
            self._buffers = 0
            callbacks, self._callbacks = self._callbacks, []
        self._destroy(buffers)
        self._run(callbacks)

    # -- statistics -------------------------------------------------------------------
    def stats(self) -> MemoryStats:
        with self._lock:
            return MemoryStats(
                in_use_bytes=self._in_use,
                peak_bytes=self._peak,
                pooled_bytes=max(0, self._device_bytes - self._in_use),
                device_bytes=self._device_bytes,
                allocations=self._allocations,
                reuses=self._reuses,
                budget_bytes=self.budget_bytes,
                waits=self._waits,
                overcommits=self._overcommits,
                requested_bytes=self._requested,
                blocks_in_use=self._blocks,
                buffers=self._buffers,
            )

    def reset_peak(self) -> None:
        """Restart ``peak_bytes`` from the bytes in use now."""
        with self._lock:
            self._peak = self._in_use
