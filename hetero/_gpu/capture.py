"""Captured GPU stages: record a stage's dispatches once per signature, then replay them.

``g.gpu(fn, *args, capture=True)`` is the user's promise that the commands ``fn``
records depend only on its *signature*: the shapes and dtypes of its Tensor arguments
(and which of them share a buffer) and the values of its other arguments (compared by
``==``; they must be hashable, as a dict key would be). Floats (Python's and numpy's,
complex too) are compared by type and bit pattern instead: a NaN matches a NaN, and
``0.0`` and ``-0.0``, which put different bytes in a uniform, are two signatures. WebGPU command buffers cannot
be resubmitted, so a replay re-issues the captured dispatches into this run's encoder.

* **Capture.** The first run of a signature calls ``fn`` and records as usual; the
  :class:`GPUContext` also notes every ``gpu.empty`` (a *temporary* of the stage),
  ``gpu.upload`` made inside ``fn`` (its data is kept *by value*), and every dispatch:
  kernel, workgroup counts and, per binding, where the buffer came from -- an argument
  (by position in the flattened arguments, and offset within it), a temporary, or a
  *constant* (uniform bytes, ``gpu.resident`` tensors, any buffer hetero keeps alive).
  The stage's return value is kept as a template over the same slots.
* **Replay.** Later runs of the signature do not call ``fn``. Temporaries are taken
  from the buffer pool all in one step, each pool block in the buffer the previous
  replay had where it is free. Temporaries whose lifetimes (from their creation, or the
  stage's start for an upload, to the last dispatch that binds them) do not overlap
  share a block: no dispatch binds two temporaries of one block, and a stage holds
  fewer blocks (waits for memory and the budget apply to them as to any block); a
  temporary in the stage's result has a block of its own. Uploads are re-issued with
  the captured data (through one staging buffer); bind groups are reused from
  one of the last few replays over the same buffers, if the pool destroyed nothing
  since (the common case once runs settle), else found per op or through the bind
  cache; and the dispatches are issued straight through wgpu-native's C functions
  (``SetPipeline``, ``SetBindGroup``, ``DispatchWorkgroups``, called so that they keep
  the GIL) into the recorder's open compute pass, in one loop when the stage's
  estimated GPU time fits the open submission. Splittable kernels are split as planned
  now (the cost model may have learnt since), within the GPU-time budget; timed
  dispatches (tracing, cost-model sampling) still get GPU timestamps, marked
  ``replayed`` in the trace.
* **What cannot be replayed** is found while capturing: a stage that touches
  ``gpu.encoder`` (it records commands hetero does not see) or binds a pooled tensor
  that is neither its argument nor its own temporary (or a buffer hetero does not
  manage, which the user might destroy). Such a stage falls back to plain recording:
  ``fn`` runs every time, with one warning per stage function, and ``rt.stats()``
  says ``capture="fallback"``.
* **Errors.** An exception while capturing fails the stage (a ``StageError``) and
  nothing is kept: the next run captures again. An argument that cannot be hashed
  fails the stage with a ``TypeError`` naming it.

Captures are kept per device in an LRU of ``Runtime(capture_cache=...)`` entries
(default :data:`DEFAULT_CACHE_ENTRIES`), keyed by the stage function and its
signature. Each holds its constant buffers alive.
"""

from __future__ import annotations

import math
import struct
import threading
import warnings
from collections import OrderedDict
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

import numpy as np

from . import passcmd
from .grid import grid_entry
from .tensor import Tensor, map_values, tensor_of

if TYPE_CHECKING:
    from .device import Device, Kernel

__all__ = ["CaptureCache", "CaptureTarget", "DEFAULT_CACHE_ENTRIES", "run_captured"]

DEFAULT_CACHE_ENTRIES = 1024

# The pass commands of a replay go straight into wgpu-native, keeping the GIL (see passcmd).
_set_pipeline, _set_bind_group, _dispatch = passcmd.set_pipeline, passcmd.set_bind_group, passcmd.dispatch
_handle, _NO_OFFSETS = passcmd.handle, passcmd.NO_OFFSETS

# Where a binding's buffer comes from.
ARG, TEMP, CONST = 0, 1, 2
Slot = tuple[int, Any, int, int]  # (kind, ref, offset, size): ref is an arg/temp index or a buffer
# Bind groups an op keeps for the buffers of recent replays (see Capture._op_groups).
_OP_GROUPS = 32
# Whole replays' bind groups a capture keeps, by the buffers they bound (see Capture._memos): runs
# that overlap (a step started before the previous one returned) take turns with two or three
# sets of buffers, and each set must find its groups without the per-op walk.
_MEMOS = 4


class CaptureTarget(Protocol):
    """What capturing and replaying need of the context a stage records into: the whole interface.

    :class:`~hetero._gpu.context.GPUContext` is the one implementation (its "capture interface"
    section); nothing else of it is reached from here.
    """

    stage: str  # the stage's name, for errors and warnings
    limits: dict[str, int]  # the device's limits
    workgroups: int  # dispatched so far; a replay adds its own

    @property
    def runtime_device(self) -> Device:
        """The hetero Device: its bind cache (``binds``), cost model (``cost``) and ``dispatch_timing``."""
        ...

    @property
    def recorder(self) -> Any:
        """The recorder whose open compute pass a replay issues into."""
        ...

    def noting(self, capturing: Capturing) -> AbstractContextManager[None]:
        """While the block runs, the context's allocations, uploads and dispatches are noted to ``capturing``."""
        ...

    def block_requests(self, sizes: list[int]) -> list[tuple[int, int, bool]]:
        """The pool requests for temporaries of ``sizes`` bytes (made once per capture, then reused)."""
        ...

    def take_blocks(self, requests: list[tuple[int, int, bool]], prefer: list[Any] | None) -> list[Any]:
        """The blocks of ``requests``, in one step, each in the buffer of ``prefer`` where it is free."""
        ...

    def write_uploads(self, items: list[tuple[np.ndarray, Any, int]]) -> None:
        """Record uploads of ``(array, buffer, offset)``, ordered before the dispatches issued next."""
        ...


class _Unreplayable:
    """Cache entry of a signature whose stage records what a replay cannot reproduce."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


@dataclass(eq=False, slots=True)
class _Op:
    """One captured dispatch."""

    kernel: Kernel
    pipeline: passcmd.Handle  # the native handle (the kernel holds the pipeline); one object per pipeline and capture
    groups: tuple[int, int, int]
    total: int
    slots: tuple[Slot, ...]  # one a binding; a grid kernel's last is the whole grid's uniform (see grid)
    layout: Any
    group: Any  # the bind group itself when every binding is constant, else None


@dataclass(frozen=True, slots=True)
class _Ref:
    """A tensor of the stage's result: where it lives, with its own shape and dtype."""

    kind: int
    ref: Any
    offset: int
    shape: tuple[int, ...]
    dtype: np.dtype[Any]


class Capture:
    """A stage's captured work for one signature."""

    __slots__ = ("ops", "temps", "block_of", "block_bytes", "uploads", "result", "workgroups", "work", "consts",
                 "grid_keys", "quiet_until", "_memos", "_op_groups", "_op_gen", "_lock", "_requests", "_prefer")

    def __init__(self, ops: list[_Op], temps: list[tuple[int, np.ndarray | None]], result: Any,
                 consts: list[Any], created: list[int]) -> None:
        self.ops = ops
        self.temps = temps  # (bytes, captured upload or None) of each temporary
        # The pool block of each temporary (an index) and each block's bytes (see share_blocks).
        self.block_of, self.block_bytes = share_blocks(ops, temps, result, created)
        # The captured uploads: (data, block index), written at the start of each replay.
        self.uploads = [(data, k) for (nbytes, data), k in zip(temps, self.block_of) if data is not None and nbytes]
        self.result = result
        self.workgroups = sum(op.total for op in ops)
        self.work: dict[Any, int] = {}  # workgroups per kernel (the recorder's calibration books)
        for op in ops:
            self.work[op.kernel.key] = self.work.get(op.kernel.key, 0) + op.total
        self.consts = consts  # buffers bound as constants: kept alive with the capture
        # The cost-model keys of its grid kernels, and the clock time before which none of them is
        # due a timed sample (CostModel.quiet_until): replays before it skip the per-dispatch check.
        self.grid_keys = frozenset(op.kernel.key for op in ops if op.kernel.grid)
        self.quiet_until = 0.0
        # The bind groups (and their native handles) of the last _MEMOS replays over distinct
        # buffers, by those buffers and offsets, with the bind cache's generation they were made in.
        self._memos: dict[tuple[Any, ...], tuple[int, list[Any], list[passcmd.Handle]]] = {}
        # Per op, bind groups by the (buffer id, offset) of its entries, for replays over other
        # buffers than the last one's; valid while the bind cache's generation is _op_gen.
        self._op_groups: list[dict[tuple[Any, ...], tuple[Any, tuple[Any, ...]]]] = [{} for _ in ops]
        self._op_gen = -1
        self._lock = threading.Lock()
        # The pool requests (nbytes, size class, slab) of the blocks, made on the first replay;
        # and the buffers the last replay got for them, asked for again by the next.
        self._requests: list[tuple[int, int, bool]] | None = None
        self._prefer: list[Any] | None = None


def share_blocks(ops: list[_Op], temps: list[tuple[int, np.ndarray | None]], result: Any,
                 created: list[int]) -> tuple[list[int], list[int]]:
    """Pool blocks for a stage's temporaries, given as ``(bytes, captured upload or None)``:
    ``(block of each temporary, bytes of each block)``.

    A temporary lives from the dispatch after its creation (``created[j]``: dispatches
    captured before it; 0 for an upload, which a replay writes before any dispatch) to the
    last dispatch that binds it, both included. Temporaries whose lives do not overlap may
    share a block (so no dispatch binds two of one block); each takes, among the blocks free
    by its start, the smallest that holds it, else the largest (grown to fit), else a new
    one. A temporary in the stage's result gets a block of its own, of its own size: that
    block is held after the stage, until its consumers are recorded.
    """
    n = len(temps)
    start = [0 if temps[j][1] is not None else created[j] for j in range(n)]
    end = list(start)
    for i, op in enumerate(ops):
        for kind, ref, _, _ in op.slots:
            if kind == TEMP:
                end[ref] = max(end[ref], i)
    returned: set[int] = set()
    map_values(result, lambda r: returned.add(r.ref) if r.kind == TEMP else None, _Ref)
    block_of = [0] * n
    sizes: list[int] = []
    free_from: list[int] = []  # the first dispatch at which each block is free
    never = len(ops) + 1
    for j in sorted(range(n), key=lambda j: (start[j], j)):
        need = temps[j][0]
        if j in returned:
            block_of[j] = len(sizes)
            sizes.append(need)
            free_from.append(never)
            continue
        free = [k for k in range(len(sizes)) if free_from[k] <= start[j]]
        fits = [k for k in free if sizes[k] >= need]
        if fits:
            k = min(fits, key=lambda k: (sizes[k], k))
        elif free:
            k = max(free, key=lambda k: (sizes[k], -k))
            sizes[k] = need
        else:
            k = len(sizes)
            sizes.append(need)
            free_from.append(0)
        block_of[j] = k
        free_from[k] = end[j] + 1
    return block_of, sizes


class CaptureCache:
    """Captures of one device, LRU-bounded; thread-safe."""

    def __init__(self, max_entries: int = DEFAULT_CACHE_ENTRIES) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[Any, Capture | _Unreplayable] = OrderedDict()
        self._lock = threading.Lock()
        self._warned: set[Any] = set()
        self.captures = 0  # signatures captured
        self.replays = 0
        self.evictions = 0

    def get(self, key: Any) -> Capture | _Unreplayable | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def put(self, key: Any, entry: Capture | _Unreplayable) -> None:
        with self._lock:
            self._entries[key] = entry
            self._entries.move_to_end(key)
            if isinstance(entry, Capture):
                self.captures += 1
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
                self.evictions += 1

    def warn_once(self, fn: Any, stage: str, reason: str) -> None:
        with self._lock:
            if fn in self._warned:
                return
            self._warned.add(fn)
        warnings.warn(f"stage {stage!r} cannot be captured ({reason}); it is recorded normally every run. "
                      "Declare it without capture=True to silence this", RuntimeWarning, stacklevel=2)

    def __len__(self) -> int:
        return len(self._entries)

    def newest_dispatches(self) -> int:
        """Dispatches of the most recently used capture (0 if none): for benchmarks and tests."""
        with self._lock:
            for entry in reversed(self._entries.values()):
                if isinstance(entry, Capture):
                    return len(entry.ops)
        return 0

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"entries": len(self._entries), "captures": self.captures, "replays": self.replays,
                    "evictions": self.evictions}

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


# -- signatures -----------------------------------------------------------------------------------
_pack_double = struct.Struct("<d").pack


def signature(args: tuple[Any, ...], kwargs: dict[str, Any], stage: str) -> tuple[Any, list[Tensor]]:
    """The hashable signature of a call, and its Tensor arguments in order (flattened)."""
    flat: list[Tensor] = []
    buffers: dict[int, int] = {}

    def key(v: Any, where: tuple[Any, ...]) -> Any:
        if isinstance(v, Tensor):
            first = buffers.setdefault(id(v.buffer), len(flat))
            flat.append(v)
            return (Tensor, v.shape, v.dtype.str, first if first != len(flat) - 1 else -1)
        t = type(v)
        if t is float:  # by bit pattern: NaN != NaN would never match its capture
            return (t, _pack_double(v))
        if t is tuple or t is list:
            return (t, tuple(key(x, (*where, i)) for i, x in enumerate(v)))
        if t is dict:
            return (t, tuple((k, key(x, (*where, k))) for k, x in v.items()))
        if t is complex:
            return (t, _pack_double(v.real), _pack_double(v.imag))
        if isinstance(v, np.inexact):
            return (t, v.tobytes())
        try:
            hash(v)
        except TypeError:
            path = f"{where[0]}" + "".join(f"[{p!r}]" for p in where[1:])
            raise TypeError(f"stage {stage!r} is declared with capture=True, but its argument {path} "
                            f"({t.__name__}) is not hashable, so runs cannot be matched to a capture; pass a "
                            "hashable value (e.g. a tuple) or declare the stage without capture=True") from None
        return (t, v)

    k = (tuple(key(a, (i,)) for i, a in enumerate(args)),
         tuple((name, key(v, (name,))) for name, v in kwargs.items()))
    return k, flat


# -- capturing ------------------------------------------------------------------------------------
class Capturing:
    """What a :class:`CaptureTarget` notes while a capturing stage function runs (``binds``: the
    device's bind cache, which says which buffers hetero keeps alive)."""

    def __init__(self, binds: Any, flat: list[Tensor]) -> None:
        self._binds = binds
        self._flat = flat
        self._by_buffer: dict[int, list[int]] = {}
        for i, t in enumerate(flat):
            self._by_buffer.setdefault(id(t.buffer), []).append(i)
        self._temps: list[Tensor] = []
        self._temp_data: list[np.ndarray | None] = []
        self._created: list[int] = []  # dispatches captured before each temporary was made
        self._temp_of_block: dict[int, int] = {}
        self._ops: list[_Op] = []
        self._pipelines: dict[int, passcmd.Handle] = {}  # one handle per pipeline (ops compare them by identity)
        self._consts: dict[int, Any] = {}
        self.reason: str | None = None

    def refuse(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason

    def on_empty(self, t: Tensor) -> None:
        self._temp_of_block[id(t.block)] = len(self._temps)
        self._temps.append(t)
        self._temp_data.append(None)
        self._created.append(len(self._ops))

    def on_upload(self, t: Tensor, data: np.ndarray) -> None:
        j = self._temp_of_block[id(t.block)]
        self._temp_data[j] = np.array(data, copy=True)  # by value: the caller may change its array later

    def _locate(self, t: Tensor) -> tuple[int, Any, int] | None:
        """(kind, ref, offset relative to it) of a Tensor's data, or None if it cannot be replayed."""
        if t.block is not None:
            j = self._temp_of_block.get(id(t.block))
            if j is not None:
                return (TEMP, j, t.offset - self._temps[j].offset)
        for i in self._by_buffer.get(id(t.buffer), ()):
            a = self._flat[i]
            if a.offset <= t.offset and t.offset + t.nbytes <= a.offset + max(a.binding_size, a.nbytes):
                return (ARG, i, t.offset - a.offset)
        if t.block is not None:
            self.refuse(f"it binds a pooled tensor {t!r} that is neither its argument nor made by it")
            return None
        if not self._binds.is_stable(t.buffer):
            self.refuse(f"it binds a tensor {t!r} over a buffer hetero does not manage")
            return None
        self._consts[id(t.buffer)] = t.buffer
        return (CONST, t.buffer, t.offset)

    def on_dispatch(self, k: Kernel, groups: tuple[int, int, int], bindings: tuple[Any, ...],
                    resources: list[tuple[Any, int, int]], bind_group: Any, layout: Any) -> None:
        if self.reason is not None:
            return
        slots: list[Slot] = []
        for i, (buf, off, size) in enumerate(resources):  # a grid kernel's last: the whole grid's uniform
            b = bindings[i] if i < len(bindings) else None
            if isinstance(b, Tensor):
                where = self._locate(b)
                if where is None:
                    return
                slots.append((where[0], where[1], where[2], size))
            else:  # a uniform from the bind cache, made from the bytes given
                self._consts[id(buf)] = buf
                slots.append((CONST, buf, off, size))
        constant = all(s[0] == CONST for s in slots)
        pipeline = self._pipelines.get(id(k.pipeline))
        if pipeline is None:
            pipeline = self._pipelines[id(k.pipeline)] = _handle(k.pipeline)
        self._ops.append(_Op(k, pipeline, groups, groups[0] * groups[1] * groups[2], tuple(slots),
                             layout, bind_group if constant else None))

    def finish(self, result: Any) -> Capture | _Unreplayable:
        if self.reason is not None:
            return _Unreplayable(self.reason)

        def ref(t: Tensor) -> Any:
            where = self._locate(t)
            if where is None:
                return t
            return _Ref(where[0], where[1], where[2], t.shape, t.dtype)

        template = map_values(result, ref, Tensor)
        if self.reason is not None:
            return _Unreplayable(self.reason)
        temps = [(t.nbytes, d) for t, d in zip(self._temps, self._temp_data)]
        return Capture(self._ops, temps, template, list(self._consts.values()), self._created)


# -- replaying ------------------------------------------------------------------------------------
def replay(ctx: CaptureTarget, cap: Capture, flat: list[Tensor]) -> Any:
    """Issue ``cap``'s work into ``ctx``'s recorder against this run's buffers; return its result."""
    requests = cap._requests
    if requests is None:
        requests = cap._requests = ctx.block_requests(cap.block_bytes)
    # Every block in one step, each in the buffer the previous replay had where it is free
    # (then the bind groups below are that replay's); the captured uploads are written together.
    blocks = ctx.take_blocks(requests, cap._prefer) if requests else []
    cap._prefer = [b.buffer for b in blocks]
    # A temporary is its block's start (no Tensor is made for it unless the result holds it).
    block_of = cap.block_of
    if cap.uploads:
        ctx.write_uploads([(data, blocks[k].buffer, blocks[k].offset) for data, k in cap.uploads])
    handles, alive = _bind_groups(ctx.runtime_device.binds, cap, flat, blocks)
    _issue(ctx, cap, handles, flat, blocks)
    del alive
    ctx.workgroups += cap.workgroups

    def resolve(r: _Ref) -> Tensor:
        n = math.prod(r.shape)
        if r.kind == TEMP:
            b = blocks[block_of[r.ref]]
            return tensor_of(b.buffer, r.shape, r.dtype, b.offset + r.offset, b, n, n * r.dtype.itemsize)
        if r.kind == ARG:
            t = flat[r.ref]
            return tensor_of(t.buffer, r.shape, r.dtype, t.offset + r.offset, t.block, n, n * r.dtype.itemsize)
        return Tensor(r.ref, r.shape, r.dtype, r.offset)

    return map_values(cap.result, resolve, _Ref)


def _bind_groups(binds: Any, cap: Capture, flat: list[Tensor], blocks: list[Any]) -> tuple[list[passcmd.Handle], list[Any]]:
    """Each op's bind group over this replay's arguments and blocks: their native handles, and the
    groups (to keep referenced while the handles are issued: another replay may swap the memo).

    Those of one of the last few replays over the same buffers (and the bind cache destroyed
    none since); else each op's own, by the buffers it binds now; else through the bind cache.
    """
    key = tuple((t.buffer, t.offset) for t in flat) + tuple((b.buffer, b.offset) for b in blocks)
    gen = binds.generation
    with cap._lock:
        memo = cap._memos.get(key)
        if memo is not None and memo[0] == gen:
            return memo[2], memo[1]
    stable = all(binds.is_stable(t.buffer) for t in flat)
    with cap._lock:
        if cap._op_gen != gen:
            cap._op_groups = [{} for _ in cap.ops]
            cap._op_gen = gen
        caches = cap._op_groups
    block_of = cap.block_of
    groups: list[Any] = []
    for op, cache in zip(cap.ops, caches):
        if op.group is not None:
            groups.append(op.group)
            continue
        resources = _resources(op, flat, blocks, block_of)
        if not stable:  # a buffer hetero does not manage: the bind cache makes a fresh group
            groups.append(binds.bind_group((op.kernel.key, 0), op.layout, resources))
            continue
        rkey = tuple((id(b), o) for b, o, _ in resources)
        hit = cache.get(rkey)
        if hit is None:
            group = binds.bind_group((op.kernel.key, 0), op.layout, resources)
            if len(cache) >= _OP_GROUPS:
                cache.clear()
            cache[rkey] = (group, tuple(b for b, _, _ in resources))  # the buffers: their ids stay theirs
            groups.append(group)
        else:
            groups.append(hit[0])
    handles = [_handle(g) for g in groups]
    if stable:
        with cap._lock:
            memos = cap._memos
            memos.pop(key, None)
            while len(memos) >= _MEMOS:
                del memos[next(iter(memos))]  # the oldest
            memos[key] = (gen, groups, handles)
    return handles, groups


def _resources(op: _Op, flat: list[Tensor], blocks: list[Any], block_of: list[int]) -> list[tuple[Any, int, int]]:
    """``(buffer, offset, size)`` of each of ``op``'s bindings in this replay."""
    resources = []
    for kind, ref, off, size in op.slots:
        if kind == ARG:
            t = flat[ref]
            resources.append((t.buffer, t.offset + off, size))
        elif kind == TEMP:
            b = blocks[block_of[ref]]
            resources.append((b.buffer, b.offset + off, size))
        else:
            resources.append((ref, off, size))
    return resources


def _issue(ctx: CaptureTarget, cap: Capture, groups: list[passcmd.Handle], flat: list[Tensor],
           blocks: list[Any]) -> None:
    """The dispatches, through the C functions, into the recorder's open compute pass.

    The recording thread holds the recorder (its lock, or a recorder of its own), so the
    pass only changes where this loop ends it: a split for the GPU-time budget.
    """
    dev = ctx.runtime_device
    rec = ctx.recorder
    cost = dev.cost
    tracing = dev.dispatch_timing
    budget = dev.cost.budget_ns
    limit = ctx.limits["max-compute-workgroups-per-dimension"]
    if not tracing and _issue_whole(rec, cost, cap, groups, budget, limit):
        return
    estimate, reserve, note, compute_pass = cost.estimate_ns, rec.reserve, rec.note, rec.compute_pass
    begin_span, end_span = rec.begin_pass_span, rec.end_pass_span
    split_groups: list[Any] = []  # bind groups of split dispatches, held until the loop ends
    h: Any = None
    pipeline: Any = None
    for op, bg in zip(cap.ops, groups):
        k = op.kernel
        gx, gy, gz = op.groups
        if not k.grid:
            est = estimate(k.key, op.total)
            if reserve(est) or h is None:
                h, pipeline = _handle(compute_pass()), None
            if op.pipeline is not pipeline:
                pipeline = op.pipeline
                _set_pipeline(h, pipeline)
            _set_bind_group(h, 0, bg, _NO_OFFSETS, None)
            if tracing:
                span = begin_span(h, k.label, ("dispatch", k.key, op.total, "replayed"))
                _dispatch(h, gx, gy, gz)
                end_span(h, span)
            else:
                _dispatch(h, gx, gy, gz)
            note(k.key, op.total, est)
            continue
        per_x = gy * gz
        chunk = cost.chunk(k.key, budget, per_x, limit)
        resources = _resources(op, flat, blocks, cap.block_of)[:-1] if chunk < gx else []
        for x0 in range(0, gx, chunk):
            w = min(chunk, gx - x0)
            est = estimate(k.key, w * per_x)
            if reserve(est) or h is None:
                h, pipeline = _handle(compute_pass()), None
            if w == gx:
                group = bg  # the common case: one dispatch covers the grid, the whole grid's uniform bound
            else:  # the op's own bindings and this sub-dispatch's grid uniform
                split = dev.binds.bind_group((k.key, 0), op.layout,
                                             [*resources, grid_entry(dev.binds, x0, op.groups)])
                split_groups.append(split)  # alive until the pass holds it
                group = _handle(split)
            if op.pipeline is not pipeline:
                pipeline = op.pipeline
                _set_pipeline(h, pipeline)
            _set_bind_group(h, 0, group, _NO_OFFSETS, None)
            if tracing or cost.should_time(k.key):
                span = begin_span(h, k.label, ("dispatch", k.key, w * per_x, "replayed"))
                _dispatch(h, w, gy, gz)
                end_span(h, span)
            else:
                _dispatch(h, w, gy, gz)
            note(k.key, w * per_x, est)


def _issue_whole(rec: Any, cost: Any, cap: Capture, groups: list[passcmd.Handle], budget: float, limit: int) -> bool:
    """:func:`_issue`'s common case in one tight loop: the stage's estimated GPU time fits the open
    submission and every grid kernel fits one dispatch, so no
    dispatch is split and the submission is not ended. False (nothing issued) otherwise."""
    ns = cost.ns_per_workgroup
    est = 0.0
    for op in cap.ops:
        per = ns(op.kernel.key)
        est += op.total * per
        if op.kernel.grid:
            gx, gy, gz = op.groups
            if gx > limit or budget < per * gy * gz * gx:
                return False
    if rec.est_ns + est > budget:
        return False
    h = _handle(rec.compute_pass())
    pipeline = None
    sampling = cost.now() >= cap.quiet_until  # else no grid kernel of the stage is due a timed sample
    for op, bg in zip(cap.ops, groups):
        if op.pipeline is not pipeline:
            pipeline = op.pipeline
            _set_pipeline(h, pipeline)
        _set_bind_group(h, 0, bg, _NO_OFFSETS, None)
        gx, gy, gz = op.groups
        k = op.kernel
        if sampling and k.grid and cost.should_time(k.key):  # cost-model samples of splittable kernels
            span = rec.begin_pass_span(h, k.label, ("dispatch", k.key, op.total, "replayed"))
            _dispatch(h, gx, gy, gz)
            rec.end_pass_span(h, span)
        else:
            _dispatch(h, gx, gy, gz)
    if sampling:
        cap.quiet_until = cost.quiet_until(cap.grid_keys)
    rec.note_many(est, len(cap.ops), cap.work)
    return True


# -- the stage ------------------------------------------------------------------------------------
def run_captured(ctx: CaptureTarget, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                 cache: CaptureCache) -> tuple[Any, str]:
    """Run a capturing stage: replay its capture, or call ``fn`` and capture.

    Returns the stage's result and what happened: ``"replayed"``, ``"captured"`` or
    ``"fallback"`` (the stage cannot be replayed and was recorded normally).
    """
    sig, flat = signature(args, kwargs, ctx.stage)
    key = (fn, sig)
    entry = cache.get(key)
    if isinstance(entry, Capture):
        result = replay(ctx, entry, flat)
        cache.replays += 1  # a counter for stats: a lost update under a race is harmless
        return result, "replayed"
    if isinstance(entry, _Unreplayable):
        return fn(ctx, *args, **kwargs), "fallback"
    capturing = Capturing(ctx.runtime_device.binds, flat)
    with ctx.noting(capturing):
        result = fn(ctx, *args, **kwargs)
        made = capturing.finish(result)
    cache.put(key, made)
    if isinstance(made, _Unreplayable):
        cache.warn_once(fn, ctx.stage, made.reason)
        return result, "fallback"
    return result, "captured"
