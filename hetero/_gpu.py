"""The ``gpu`` context a GPU stage receives: allocate, upload, compile, dispatch.

Each execution of a GPU stage gets its own context with its own command encoder,
so stages can be recorded on several threads at once. Work is recorded, not run:
the scheduler submits the stage's command buffer after the function returns.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import wgpu

from ._device import Device, Kernel
from ._tensor import Tensor, buffer_size

__all__ = ["GPUContext", "map_values"]

_STORAGE = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
_READBACK = wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST
_UNIFORM = wgpu.BufferUsage.UNIFORM | wgpu.BufferUsage.COPY_DST


def map_values(value: Any, fn: Callable[[Any], Any], kind: type | tuple[type, ...]) -> Any:
    """Apply ``fn`` to every instance of ``kind`` in ``value`` and in its tuples, lists and dicts."""
    if isinstance(value, kind):
        return fn(value)
    if type(value) in (tuple, list):
        return type(value)(map_values(v, fn, kind) for v in value)
    if type(value) is dict:
        return {k: map_values(v, fn, kind) for k, v in value.items()}
    return value


class GPUContext:
    """What a GPU stage function receives as its first argument."""

    def __init__(self, device: Device, stage: str) -> None:
        self._dev = device
        self.stage = stage
        self.device = device.device  # the wgpu.GPUDevice, for work hetero does not wrap
        self.limits = device.limits
        self.features = device.features
        self._encoder: Any = None
        self.workgroups = 0  # dispatched so far (decides whether the stage is coalesced)

    # -- memory ---------------------------------------------------------------------
    def empty(self, shape: int | tuple[int, ...], dtype: Any = np.float32) -> Tensor:
        """A new uninitialised Tensor."""
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        if any(int(s) < 0 for s in shape):
            raise ValueError(f"gpu.empty: shape {shape} has a negative dimension")
        dt = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        return Tensor(self._buffer(nbytes), shape, dt)

    def upload(self, array: Any) -> Tensor:
        """Copy a host array to a new Tensor (ordered before this stage's work)."""
        a = np.ascontiguousarray(array)
        if a.dtype == object:
            raise TypeError(f"gpu.upload: cannot upload an array of Python objects (shape {a.shape})")
        buf = self._buffer(a.nbytes)
        data = a.reshape(-1).view(np.uint8)
        if data.nbytes % 4:
            data = np.concatenate([data, np.zeros(4 - data.nbytes % 4, np.uint8)])
        if data.nbytes:
            self._dev.queue.write_buffer(buf, 0, data)
        return Tensor(buf, a.shape, a.dtype)

    def _buffer(self, nbytes: int) -> Any:
        limit = self.limits["max-buffer-size"]
        if nbytes > limit:
            raise ValueError(f"a buffer of {nbytes} bytes exceeds the adapter's max-buffer-size of {limit} bytes")
        return self.device.create_buffer(size=buffer_size(nbytes), usage=_STORAGE)

    # -- kernels ----------------------------------------------------------------------
    def kernel(self, wgsl: str, entry_point: str = "main", label: str = "",
               constants: dict[str, float | int | bool] | None = None) -> Kernel:
        """Compile (once per device, then cached) a WGSL compute entry point.

        ``constants`` set WGSL ``override`` declarations; each combination is its own pipeline.
        """
        return self._dev.kernel(wgsl, entry_point, label, constants)

    def dispatch(self, kernel: Kernel | str, workgroups: int | tuple[int, ...], *bindings: Any) -> None:
        """Record one dispatch of ``kernel`` over ``workgroups`` (x, y, z).

        ``bindings`` follow the ``@binding`` order of ``@group(0)``: a Tensor binds as a
        storage buffer; a numpy array or bytes is uploaded as a uniform buffer.
        """
        k = self.kernel(kernel) if isinstance(kernel, str) else kernel
        groups = _workgroups(workgroups, self.limits["max-compute-workgroups-per-dimension"], k.label)
        if len(bindings) != k.n_bindings:
            raise ValueError(
                f"kernel {k.label!r} declares {k.n_bindings} binding(s) in @group(0), "
                f"dispatch got {len(bindings)}"
            )
        entries = [{"binding": i, "resource": self._resource(b, i, k.label)} for i, b in enumerate(bindings)]
        try:
            bind_group = self.device.create_bind_group(layout=k.pipeline.get_bind_group_layout(0), entries=entries)
        except Exception as e:
            raise ValueError(_explain_bind_error(k.label, bindings, e)) from e
        if groups[0] * groups[1] * groups[2] == 0:
            return  # an empty grid does nothing; the bindings were still checked
        self.workgroups += groups[0] * groups[1] * groups[2]
        cpass = self.encoder.begin_compute_pass()
        cpass.set_pipeline(k.pipeline)
        cpass.set_bind_group(0, bind_group)
        cpass.dispatch_workgroups(*groups)
        cpass.end()

    def _resource(self, b: Any, i: int, label: str) -> dict[str, Any]:
        if isinstance(b, Tensor):
            return {"buffer": b.buffer, "offset": 0, "size": b.buffer.size}
        if isinstance(b, (np.ndarray, np.generic, bytes, bytearray, memoryview)):
            data = np.frombuffer(b, np.uint8) if isinstance(b, (bytes, bytearray, memoryview)) \
                else np.ascontiguousarray(b).reshape(-1).view(np.uint8)
            size = _uniform_size(data.nbytes)
            padded = np.zeros(size, np.uint8)
            padded[: data.nbytes] = data
            buf = self.device.create_buffer_with_data(data=padded, usage=_UNIFORM)
            return {"buffer": buf, "offset": 0, "size": size}
        raise TypeError(
            f"kernel {label!r} binding {i}: expected a Tensor (storage) or a numpy array/bytes (uniform), "
            f"got {type(b).__name__}"
        )

    # -- recording ------------------------------------------------------------------
    @property
    def encoder(self) -> Any:
        """This stage's command encoder (for recording work hetero does not wrap)."""
        if self._encoder is None:
            self._encoder = self.device.create_command_encoder(label=self.stage)
        return self._encoder

    def stage_download(self, t: Tensor) -> Any:
        """Record a copy of ``t`` into a new host-readable buffer; returns that buffer."""
        staging = self.device.create_buffer(size=t.buffer.size, usage=_READBACK)
        self.encoder.copy_buffer_to_buffer(t.buffer, 0, staging, 0, t.buffer.size)
        return staging

    def finish(self) -> Any:
        """The recorded command buffer (an empty one flushes pending uploads)."""
        return self.encoder.finish()


def read_staging(staging: Any, t: Tensor) -> np.ndarray:
    """Map a completed staging buffer and copy its data out as ``t``'s shape and dtype."""
    staging.map_sync("READ_NOSYNC")  # the fence already waited for the copy
    try:
        raw = staging.read_mapped(copy=False)
        out = np.frombuffer(raw, np.uint8, count=t.nbytes).view(t.dtype).reshape(t.shape).copy()
    finally:
        staging.unmap()
    return out


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
    if "required usage flags" in text and "UNIFORM" in text:
        return (f"kernel {label!r}: a Tensor was bound where the shader declares var<uniform>; "
                "pass a numpy array or bytes for uniform bindings")
    if "required usage flags" in text and "STORAGE" in text:
        return (f"kernel {label!r}: a uniform (numpy array or bytes) was bound where the shader declares "
                "var<storage>; pass a Tensor")
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


def _workgroups(workgroups: Any, limit: int, label: str) -> tuple[int, int, int]:
    groups = (workgroups,) if isinstance(workgroups, (int, np.integer)) else tuple(workgroups)
    if not 1 <= len(groups) <= 3 or not all(isinstance(g, (int, np.integer)) for g in groups):
        raise ValueError(f"kernel {label!r}: workgroups must be an int or 1 to 3 ints, got {workgroups!r}")
    for axis, g in zip("xyz", groups):
        if g < 0:
            raise ValueError(f"kernel {label!r}: workgroup count {g} in {axis} is negative")
        if g > limit:
            raise ValueError(
                f"kernel {label!r}: {g} workgroups in {axis} exceed the adapter's limit of {limit} "
                "per dimension; spread the grid over y and z"
            )
    return (int(groups[0]), *(int(g) for g in groups[1:]), *([1] * (3 - len(groups))))  # type: ignore[return-value]
