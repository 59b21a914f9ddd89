"""The ``gpu`` context a GPU stage receives: allocate, upload, compile, dispatch.

Each execution of a GPU stage gets its own context with its own command encoder,
so stages can be recorded on several threads at once. Work is recorded, not run:
the scheduler submits the stage's command buffer after the function returns.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable

import numpy as np
import wgpu

from .capture import Capturing
from .device import Device, Kernel
from .pool import Block, MemoryWait
from .recorder import StageRecorder
from .staging import pad4
from .grid import DispatchInfo, grid_entry
from .tensor import Tensor, tensor_of
from .wgsl import Binding, dtype_mismatch

__all__ = ["GPUContext"]

_STORAGE = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
# Downloads this large that only CPU stages read are handed over as views of the mapped
# staging memory: copying out to fresh pages costs more than the GPU copy. Graph outputs
# use zero_copy="auto" when the runtime's zero_copy_outputs is on (the default): views only
# where that reuses pooled staging, so a caller keeping every result gets copies and pins
# no more than the pool's cap (see transfer).
ZERO_COPY_MIN = 1 << 20
# Uploads of at most this many bytes together are written through the queue when the
# recorder allows it (SharedRecorder.write_now): the recording thread copies them itself,
# holding the GIL, so the bound keeps that copy short.
QUEUE_WRITE_MAX = 256 << 10


class _Park(BaseException):
    """The stage must wait for memory: unwinds the stage function (which must not catch it)."""

    def __init__(self, wait: MemoryWait) -> None:
        super().__init__(wait)
        self.wait = wait


def _check_uploadable(a: np.ndarray) -> None:
    if a.dtype.hasobject:
        raise TypeError(f"gpu.upload: cannot upload an array of Python objects (shape {a.shape})")


def native(a: np.ndarray) -> np.ndarray:
    """``a`` in the machine's byte order: a big-endian array (``'>f4'``) is converted with a copy.

    Shaders read the GPU's byte order (little-endian everywhere WebGPU runs), which is the
    host's; a non-native array uploaded as it is would be read as other numbers.
    """
    dt = a.dtype
    if dt.isnative or dt.hasobject:
        return a
    return a.astype(dt.newbyteorder("="))


class GPUContext:
    """What a GPU stage function receives as its first argument.

    Tensors made here come from the runtime's buffer pool. The ones the stage
    returns live until their last consumer was submitted (or they were downloaded);
    the others are temporaries, back in the pool as soon as the stage is submitted.
    """

    def __init__(self, device: Device, stage: str, *, overcommit: bool = False, recorder: Any = None) -> None:
        self._dev = device
        self.stage = stage
        self.device = device.device  # the wgpu.GPUDevice, for work hetero does not wrap
        self.limits = device.limits
        self.features = device.features
        self._recorder = recorder if recorder is not None else StageRecorder(device)
        self._overcommit = overcommit
        self.workgroups = 0  # dispatched so far (decides whether the stage is coalesced)
        self.blocks: list[Block] = []  # pool blocks this context acquired (one reference each)
        self.uploads: list[Any] = []  # staging tickets of this stage's uploads
        self.downloads: list[tuple[Any, Tensor]] = []  # (staging ticket or None if empty, tensor) to the host
        self._capture: Capturing | None = None  # set while a capturing stage function runs (see capture)

    @property
    def runtime_device(self) -> Device:
        """The hetero :class:`Device` this context records on (``device`` is its ``wgpu.GPUDevice``)."""
        return self._dev

    # -- memory ---------------------------------------------------------------------
    def empty(self, shape: int | tuple[int, ...], dtype: Any = np.float32) -> Tensor:
        """A new uninitialised Tensor from the pool.

        Raises where the shape is not a tuple of non-negative ints, the dtype holds
        Python objects, or the size exceeds the adapter's max-buffer-size (sizes are
        computed in Python ints: a shape whose bytes would overflow 64 bits is refused).
        """
        shape, dt, nbytes = _sized("gpu.empty", shape, dtype, self.limits["max-buffer-size"])
        try:
            block = self._dev.pool.acquire(nbytes, _STORAGE, stage=self.stage, overcommit=self._overcommit)
        except MemoryWait as w:
            raise _Park(w) from None
        self.blocks.append(block)
        t = Tensor(block.buffer, shape, dt, offset=block.offset, block=block)
        if self._capture is not None:
            self._capture.on_empty(t)
        return t

    def upload(self, array: Any) -> Tensor:
        """Copy a host array to a new Tensor (through the staging ring, ordered before this stage's work)."""
        a = native(np.asarray(array))
        _check_uploadable(a)
        t = self.empty(a.shape, a.dtype)
        if a.nbytes:
            self.write_uploads([(a, t.buffer, t.offset)])
        if self._capture is not None:
            self._capture.on_upload(t, a)
        return t

    def _upload_many(self, arrays: list[np.ndarray], prefer: list[Any] | None = None) -> list[Tensor]:
        """:meth:`upload` for several arrays, each to its own Tensor: small ones share one staging buffer.

        One host fill, one staging ticket and one pool lock instead of one each (a stage's
        arguments are often a few small arrays: token ids, positions, a mask). ``prefer[i]``:
        a buffer array ``i`` takes if it is free (the scheduler asks for the buffers of the
        stage's previous run, so that a replay finds its bind groups).
        """
        ring = self._dev.ring
        total = 0
        arrays = [native(a) for a in arrays]
        for a in arrays:
            _check_uploadable(a)
            total += pad4(a.nbytes)
        if total > ring.chunk_bytes:
            return [self.upload(a) for a in arrays]
        blocks = self.take_blocks(self.block_requests([a.nbytes for a in arrays]), prefer)
        out: list[Tensor] = []
        items: list[tuple[np.ndarray, Any, int]] = []
        for a, b in zip(arrays, blocks):
            t = tensor_of(b.buffer, a.shape, a.dtype, b.offset, b, a.size, a.nbytes)
            out.append(t)
            if a.nbytes:
                items.append((a, b.buffer, b.offset))
            if self._capture is not None:
                self._capture.on_empty(t)
                self._capture.on_upload(t, a)
        if items:
            self.write_uploads(items, total)
        return out

    def resident(self, array: Any) -> Tensor:
        """A Tensor holding ``array`` for as long as the device lives (model weights, tables).

        Uploaded at once with its own buffer: never pooled, never released by the
        scheduler and not counted in ``memory_stats()``, so keep the Tensor (e.g. in a
        per-device cache) and reuse it in later stages and runs. hetero caches bind
        groups against it: never ``destroy()`` its buffer yourself (a cached bind group
        over a destroyed buffer would fail at submission); it goes with the device.
        """
        a = native(np.ascontiguousarray(array))
        if a.dtype == object:
            raise TypeError(f"gpu.resident: cannot upload an array of Python objects (shape {a.shape})")
        _sized("gpu.resident", a.shape, a.dtype, self.limits["max-buffer-size"])
        data = a.reshape(-1).view(np.uint8)
        if data.nbytes % 4:
            data = np.concatenate([data, np.zeros(4 - data.nbytes % 4, np.uint8)])
        buf = self.device.create_buffer_with_data(data=data if data.nbytes else np.zeros(4, np.uint8), usage=_STORAGE)
        self._dev.binds.keep(buf)
        return Tensor(buf, a.shape, a.dtype)

    def discard(self) -> None:
        """The stage will not run and nothing of it was submitted: give back everything it took."""
        self.settle(ran=False)
        self.release_blocks()

    def settle(self, ran: bool) -> None:
        """Settle staging tickets: after the stage's commands ran (``ran``), or when they never will."""
        uploads, downloads = self.uploads, self.downloads
        self.uploads, self.downloads = [], []
        for ticket in uploads:
            ticket.complete() if ran else ticket.discard()
        for ticket, _ in downloads:
            if ticket is not None:
                ticket.discard()

    def release_blocks(self) -> None:
        """Drop this context's references to its blocks (after submission, or when discarded)."""
        blocks, self.blocks = self.blocks, []
        if blocks:
            self._dev.pool.release_many(blocks)

    # -- kernels ----------------------------------------------------------------------
    def kernel(self, wgsl: str, entry_point: str = "main", label: str = "",
               constants: dict[str, float | int | bool] | None = None) -> Kernel:
        """Compile (once per device, then cached) a WGSL compute entry point.

        ``constants`` set WGSL ``override`` declarations; each combination is its own pipeline.
        """
        return self._dev.kernel(wgsl, entry_point, label, constants)

    def dispatch(self, kernel: Kernel | str, workgroups: int | tuple[int, ...], *bindings: Any) -> DispatchInfo:
        """Record one dispatch of ``kernel`` over ``workgroups`` (x, y, z); say how it was carried out.

        ``bindings`` follow the ``@binding`` order of ``@group(0)``: a Tensor binds as a
        storage buffer; a numpy array or bytes is uploaded as a uniform buffer.

        Kernels that use hetero's grid helpers (``hetero_workgroup_id``; see "Large grids
        and long kernels" in docs/gpu.md) may have any number of workgroups along x: the dispatch is
        split into sub-dispatches and, past the GPU-time budget, into several
        submissions. Other kernels get at most the adapter's per-dimension limit.
        """
        k = self.kernel(kernel) if isinstance(kernel, str) else kernel
        limit = self.limits["max-compute-workgroups-per-dimension"]
        groups = _workgroups(workgroups, limit, k.label, split_x=k.grid)
        if len(bindings) != k.n_bindings:
            raise ValueError(
                f"kernel {k.label!r} declares {k.n_bindings} binding(s) in @group(0), "
                f"dispatch got {len(bindings)}"
            )
        _check_bindings(k, bindings, self.limits)
        _check_aliasing(k, bindings)
        binds = self._dev.binds
        resources = [self._resource(b) for b in bindings]
        # A grid kernel's group 0 ends with the grid uniform (see grid): the whole grid's here.
        whole = [grid_entry(binds, 0, groups)] if k.grid else []
        try:
            layout = k.layouts[0] if k.layouts and k.layouts[0] is not None else k.pipeline.get_bind_group_layout(0)
            bind_group = binds.bind_group((k.key, 0), layout, resources + whole)
        except Exception as e:
            raise ValueError(_explain_bind_error(k.label, bindings, e)) from e
        total = groups[0] * groups[1] * groups[2]
        cost, rec = self._dev.cost, self._recorder
        if total == 0:
            return DispatchInfo(k.label, groups, 0, 0, 0, 0.0)  # nothing to do; the bindings were checked
        if self._capture is not None:
            self._capture.on_dispatch(k, groups, bindings, resources + whole, bind_group, layout)
        self.workgroups += total
        if not k.grid:
            est = cost.estimate_ns(k.key, total)
            ended = rec.reserve(est)
            cpass = rec.compute_pass()
            cpass.set_pipeline(k.pipeline)
            cpass.set_bind_group(0, bind_group)
            # A trace shows (and the cost model learns from) every dispatch, unless it times stages only.
            self._record(cpass, k, groups, total, timed=self._dev.dispatch_timing)
            rec.note(k.key, total, est)
            return DispatchInfo(k.label, groups, 1, groups[0], ended, est / 1e6)
        per_x = groups[1] * groups[2]
        chunk = cost.chunk(k.key, self._dev.cost.budget_ns, per_x, limit)
        ended = n = 0
        for x0 in range(0, groups[0], chunk):
            w = min(chunk, groups[0] - x0)
            est = cost.estimate_ns(k.key, w * per_x)
            ended += rec.reserve(est)
            if w == groups[0]:
                group = bind_group
            else:
                group = binds.bind_group((k.key, 0), layout, [*resources, grid_entry(binds, x0, groups)])
            cpass = rec.compute_pass()
            cpass.set_pipeline(k.pipeline)
            cpass.set_bind_group(0, group)
            # Splittable kernels calibrate the cost model that sizes their chunks.
            self._record(cpass, k, (w, groups[1], groups[2]), w * per_x,
                         timed=self._dev.dispatch_timing or cost.should_time(k.key))
            rec.note(k.key, w * per_x, est)
            n += 1
        return DispatchInfo(k.label, groups, n, chunk, ended, cost.estimate_ns(k.key, total) / 1e6)

    def _record(self, cpass: Any, k: Kernel, groups: tuple[int, int, int], workgroups: int, *, timed: bool) -> None:
        """One ``dispatch_workgroups``, inside a GPU timestamp span when ``timed``."""
        if not timed:
            cpass.dispatch_workgroups(*groups)
            return
        rec = self._recorder
        span = rec.begin_span(k.label, ("dispatch", k.key, workgroups))
        cpass.dispatch_workgroups(*groups)
        rec.end_span(span)

    def _resource(self, b: Any) -> tuple[Any, int, int]:
        """``(buffer, offset, size)`` of a binding: a Tensor's range, or a uniform holding the bytes."""
        if isinstance(b, Tensor):
            return (b.buffer, b.offset, b.binding_size)
        data = bytes(b) if isinstance(b, (bytes, bytearray, memoryview)) else \
            np.ascontiguousarray(native(np.asarray(b))).tobytes()
        size = _uniform_size(len(data))
        return (self._dev.binds.uniform(data.ljust(size, b"\0")), 0, size)

    # -- recording ------------------------------------------------------------------
    @property
    def encoder(self) -> Any:
        """The command encoder this stage records into (for work hetero does not wrap).

        With one GPU recording thread (the default) it is shared with neighbouring
        stages: end every pass you begin, and do not finish it. A capturing stage that
        uses it cannot be replayed (see ``hetero._gpu.capture``).
        """
        if self._capture is not None:
            self._capture.refuse("it records on gpu.encoder directly")
        return self._recorder.encoder

    def stage_download(self, t: Tensor, zero_copy: bool | str = False) -> Tensor:
        """Record a copy of ``t`` into host-readable staging memory (read after the fence).

        ``zero_copy``: the host array will be a view of the mapped staging memory
        (no copy out; the staging buffer is recycled when the array is gone); ``"auto"``:
        only where that reuses pooled memory (``StagingRing.download``).
        """
        if self._capture is not None:
            self._capture.refuse("it calls gpu.stage_download")
        ticket = None
        if t.nbytes:
            if zero_copy is True and t.nbytes < ZERO_COPY_MIN:
                zero_copy = False
            ticket = self._dev.ring.download(self.encoder, t.buffer, t.offset, t.nbytes, zero_copy=zero_copy)
        self.downloads.append((ticket, t))  # a zero-size tensor needs no copy, still arrives as an array
        return t

    def read_downloads(self) -> dict[int, np.ndarray]:
        """After the fence: the host copies of the staged tensors, by ``id(tensor)``."""
        out: dict[int, np.ndarray] = {}
        for ticket, t in self.downloads:
            out[id(t)] = ticket.read(t.shape, t.dtype) if ticket is not None else np.empty(t.shape, t.dtype)
        return out

    # -- the capture interface ----------------------------------------------------------
    # What hetero._gpu.capture uses to capture a stage into this context and to replay one
    # (its CaptureTarget protocol): with runtime_device, stage, limits and workgroups, nothing else
    # of the context is reached from there. Stage functions have no need of these.
    @property
    def recorder(self) -> Any:
        """The recorder this context's commands go into (its own, or one shared with neighbouring
        stages): a replay reserves GPU time and issues its dispatches into its open compute pass."""
        return self._recorder

    @contextmanager
    def noting(self, capturing: Capturing) -> Iterator[None]:
        """While the block runs, every ``empty``, ``upload`` and ``dispatch`` is also noted to ``capturing``."""
        self._capture = capturing
        try:
            yield
        finally:
            self._capture = None

    def block_requests(self, sizes: list[int]) -> list[tuple[int, int, bool]]:
        """What :meth:`take_blocks` asks the pool for tensors of ``sizes`` bytes (each checked here)."""
        placement = self._dev.pool.placement
        return [(n, *placement(n, _STORAGE)) for n in sizes]

    def take_blocks(self, requests: list[tuple[int, int, bool]], prefer: list[Any] | None) -> list[Block]:
        """Blocks for a replay's temporaries in one step (``BufferPool.acquire_many``); appended to ``blocks``."""
        start = len(self.blocks)
        try:
            self._dev.pool.acquire_many(requests, _STORAGE, self.blocks, prefer=prefer, stage=self.stage,
                                        overcommit=self._overcommit)
        except MemoryWait as w:
            raise _Park(w) from None
        return self.blocks[start:]

    def write_uploads(self, items: list[tuple[np.ndarray, Any, int]], staged: int | None = None) -> None:
        """Record uploads of ``(array, buffer, offset)``: written through the queue where they are
        small and the recorder allows it (:meth:`SharedRecorder.write_now`), else through one
        staging buffer where they fit one (``staged``: their bytes, each rounded up to 4, where
        the caller counted them), else a staging upload each."""
        ring = self._dev.ring
        t0 = time.perf_counter_ns()
        if staged is None:
            staged = sum(pad4(a.nbytes) for a, _, _ in items)
        if staged > QUEUE_WRITE_MAX or not self._recorder.write_now(items):
            if len(items) == 1 or staged > ring.chunk_bytes:
                for a, buffer, offset in items:
                    self.uploads.append(ring.upload(self._recorder.encoder, a, buffer, offset))
            else:
                self.uploads.append(ring.upload_many(self._recorder.encoder, items))
        tracer = self._dev.tracer
        if tracer is not None:
            tracer.span("upload", "transfer", t0, time.perf_counter_ns(),
                        args={"bytes": sum(a.nbytes for a, _, _ in items), "arrays": len(items)})


_UNIFORM_DATA = (np.ndarray, np.generic, bytes, bytearray, memoryview)


def _check_bindings(k: Kernel, bindings: tuple[Any, ...], limits: dict[str, int]) -> None:
    """Refuse, naming the binding, what the shader's declaration or the adapter's limits cannot take.

    A Tensor binds as storage, a numpy array or bytes as a uniform; the dtype of a Tensor
    or of a uniform's array must fit the declared element type (the rule is in
    ``hetero._gpu.wgsl``; bytes are not checked).
    """
    decls = k.bindings
    for i, b in enumerate(bindings):
        d = decls[i] if i < len(decls) else None
        if isinstance(b, Tensor):
            if d is not None and d.space != "storage":
                raise TypeError(f"{_where(k, i)}: got a Tensor ({b.dtype.name}, shape {b.shape}) where the shader "
                                f"declares {d.declared}; " + ("pass a numpy array or bytes for a uniform"
                                                              if d.space == "uniform" else _HANDLE_HINT))
            if d is not None and d.scalar is not None:
                _check_dtype(k, i, d, b.dtype, "Tensor", ".astype(np.{want}) in a CPU stage")
            limit = limits["max-storage-buffer-binding-size"]
            if b.binding_size > limit:
                raise ValueError(f"{_where(k, i)}: a Tensor of {b.nbytes} bytes exceeds the adapter's "
                                 f"max-storage-buffer-binding-size of {limit} bytes; "
                                 "split the work into smaller tensors")
        elif isinstance(b, _UNIFORM_DATA):
            if d is not None and d.space != "uniform":
                raise TypeError(f"{_where(k, i)}: got {_describe(b)}, which binds as a uniform, where the shader "
                                f"declares {d.declared}; " + ("pass a Tensor (gpu.upload(array) or gpu.empty(...))"
                                                              if d.space == "storage" else _HANDLE_HINT))
            if d is not None and d.scalar is not None and isinstance(b, (np.ndarray, np.generic)):
                _check_dtype(k, i, d, b.dtype, "array", "np.array([...], np.{want})")
            nbytes = b.nbytes if isinstance(b, (np.ndarray, np.generic, memoryview)) else len(b)
            limit = limits["max-uniform-buffer-binding-size"]
            if nbytes > limit:
                raise ValueError(f"{_where(k, i)}: a uniform of {nbytes} bytes exceeds the adapter's "
                                 f"max-uniform-buffer-binding-size of {limit} bytes; pass it as a Tensor and "
                                 "declare var<storage, read>")
        else:
            raise TypeError(f"{_where(k, i)}: expected a Tensor (storage) or a numpy array/bytes (uniform), "
                            f"got {type(b).__name__}")


def _check_dtype(k: Kernel, i: int, d: Binding, dtype: np.dtype[Any], what: str, example: str) -> None:
    """A TypeError when binding ``i``'s data (a ``what`` of ``dtype``) is not what the shader reads there."""
    want = dtype_mismatch(d, dtype if dtype.isnative else dtype.newbyteorder("="))  # converted when uploaded
    if want is not None:
        raise TypeError(f"kernel {k.label!r} binding {i} ({d.name}: {d.type}): got {_article(dtype.name)} "
                        f"{dtype.name} {what} where the shader reads {want}; pass {want} data "
                        f"(e.g. {example.format(want=want)})")


def _where(k: Kernel, i: int) -> str:
    """``kernel 'label' binding i (name)``: where a binding error is."""
    d = k.bindings[i] if i < len(k.bindings) else None
    return f"kernel {k.label!r} binding {i}" + (f" ({d.name})" if d is not None else "")


_HANDLE_HINT = "hetero binds buffers only: bind textures and samplers through gpu.device and gpu.encoder"


def _describe(b: Any) -> str:
    """What a uniform binding was given, in a few words."""
    if isinstance(b, (np.ndarray, np.generic)):
        a = np.asarray(b)
        return f"a numpy array ({a.dtype.name}, shape {a.shape})"
    return f"{type(b).__name__} ({memoryview(b).nbytes} bytes)"


def _article(word: str) -> str:
    return "an" if word[:1] in "aeio" else "a"


def _sized(what: str, shape: Any, dtype: Any, limit: int) -> tuple[tuple[int, ...], np.dtype[Any], int]:
    """``(shape, dtype, nbytes)`` of a new tensor, checked: ints, non-negative, within ``limit`` bytes."""
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, (bool, np.bool_)):
        dims: tuple[Any, ...] = (shape,)
    elif isinstance(shape, (tuple, list, np.ndarray)):
        dims = tuple(shape)
    else:
        raise TypeError(f"{what}: shape must be an int or a tuple of ints, got {type(shape).__name__} {shape!r}")
    for s in dims:
        if isinstance(s, (bool, np.bool_)) or not isinstance(s, (int, np.integer)):
            raise TypeError(f"{what}: shape {dims} must hold ints, got {type(s).__name__} {s!r}")
    dims = tuple(int(s) for s in dims)
    if any(s < 0 for s in dims):
        raise ValueError(f"{what}: shape {dims} has a negative dimension")
    dt = np.dtype(dtype)
    if dt.hasobject:
        raise TypeError(f"{what}: dtype {dt.name} holds Python objects, which cannot live on the GPU")
    nbytes = math.prod(dims) * dt.itemsize  # Python ints: no overflow
    if nbytes > limit:
        raise ValueError(f"{what}: shape {dims} of {dt.name} is {nbytes} bytes, more than the adapter's "
                         f"max-buffer-size of {limit} bytes; split the work into smaller tensors")
    return dims, dt, nbytes


def _check_aliasing(k: Kernel, bindings: tuple[Any, ...]) -> None:
    """Refuse one buffer bound twice in a dispatch that writes it (a deferred WebGPU error)."""
    seen: dict[int, int] = {}
    for i, b in enumerate(bindings):
        if not isinstance(b, Tensor):
            continue
        j = seen.setdefault(id(b.buffer), i)
        if j != i and (k.writes(i) or k.writes(j)):
            w = i if k.writes(i) else j
            raise ValueError(
                f"kernel {k.label!r}: bindings {j} and {i} are the same buffer and binding {w} is "
                "read_write; WebGPU forbids a dispatch to write a buffer it also binds elsewhere: "
                "pass a separate output tensor"
            )


def _explain_bind_error(label: str, bindings: tuple[Any, ...], err: Exception) -> str:
    """Say in one line which binding is wrong and why (wgpu's message is long and unnamed)."""
    import re

    text = str(err)
    m = re.search(r"Binding size (\d+) .* less than minimum (\d+)", text)
    if m:
        got, need = int(m.group(1)), int(m.group(2))
        which = [i for i, b in enumerate(bindings) if _binding_bytes(b) == got]
        where = "binding " + " or ".join(map(str, which)) if which else "a binding"
        return (f"kernel {label!r}: {where} is {got} bytes, smaller than the {need} bytes the shader "
                "declares for it; pass a larger tensor or fix the WGSL struct")
    # wgpu: "Usage flags BufferUsages(GIVEN) of Buffer ... do not contain required usage flags BufferUsages(NEEDED)"
    m = re.search(r"required usage flags BufferUsages\((\w+)\)", text)
    if m and m.group(1) == "UNIFORM":
        which = [i for i, b in enumerate(bindings) if isinstance(b, Tensor)]
        return (f"kernel {label!r}: a Tensor (binding {' or '.join(map(str, which))}) was bound where the shader "
                "declares var<uniform>; pass a numpy array or bytes for uniform bindings")
    if m and m.group(1) == "STORAGE":
        which = [i for i, b in enumerate(bindings) if not isinstance(b, Tensor)]
        return (f"kernel {label!r}: a numpy array or bytes (binding {' or '.join(map(str, which))}), which binds as "
                "a uniform, was bound where the shader declares var<storage>; pass a Tensor")
    first = next((ln.strip() for ln in reversed(text.splitlines()) if ln.strip()), text)
    return f"kernel {label!r}: the bindings do not match the shader: {first}"


def _binding_bytes(b: Any) -> int:
    if isinstance(b, Tensor):
        return b.binding_size
    try:
        return _uniform_size(memoryview(b).nbytes)
    except TypeError:
        return -1


def _uniform_size(nbytes: int) -> int:
    return max(16, (nbytes + 15) & ~15)  # uniform structs are 16-byte aligned


def _workgroups(workgroups: Any, limit: int, label: str, *, split_x: bool = False) -> tuple[int, int, int]:
    groups = (workgroups,) if isinstance(workgroups, (int, np.integer)) else tuple(workgroups)
    if not 1 <= len(groups) <= 3 or not all(isinstance(g, (int, np.integer)) for g in groups):
        raise ValueError(f"kernel {label!r}: workgroups must be an int or 1 to 3 ints, got {workgroups!r}")
    for axis, g in zip("xyz", groups):
        if g < 0:
            raise ValueError(f"kernel {label!r}: workgroup count {g} in {axis} is negative")
        if g > limit and not (split_x and axis == "x"):
            hint = ("use hetero_workgroup_id() in the kernel so that hetero can split x (see hetero._gpu.grid)"
                    if not split_x else "only x is split: keep y and z within the limit")
            raise ValueError(
                f"kernel {label!r}: {g} workgroups in {axis} exceed the adapter's limit of {limit} "
                f"per dimension; {hint}"
            )
    padded = [int(g) for g in groups] + [1] * (3 - len(groups))
    return padded[0], padded[1], padded[2]
