"""Device-resident arrays handed to GPU stages."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

if TYPE_CHECKING:
    import wgpu

__all__ = ["Tensor", "buffer_size", "map_values", "tensor_of"]


def buffer_size(nbytes: int) -> int:
    """Bytes to allocate for ``nbytes`` of data: WebGPU copies move multiples of 4 bytes."""
    return max(4, (nbytes + 3) & ~3)


class Tensor:
    """An array living in GPU memory.

    GPU stages receive Tensors for numpy arrays that reach them and create new ones with
    ``gpu.empty`` or ``gpu.upload``. A Tensor that flows to a CPU stage or out of the graph
    arrives there as a numpy array. ``buffer`` is the underlying ``wgpu.GPUBuffer``.
    """

    __slots__ = ("block", "buffer", "dtype", "nbytes", "offset", "shape", "size", "__weakref__")

    def __init__(self, buffer: wgpu.GPUBuffer, shape: tuple[int, ...], dtype: Any, offset: int = 0,
                 block: Any = None) -> None:
        self.buffer = buffer
        self.offset = int(offset)  # byte offset of the data in ``buffer`` (pooled small tensors share slabs)
        self.block = block  # the pool allocation this tensor lives in, if pooled
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.size = math.prod(self.shape)  # number of elements
        self.nbytes = self.size * self.dtype.itemsize  # bytes of data (the buffer may be a few bytes larger)

    @property
    def binding_size(self) -> int:
        """Bytes a binding of this tensor covers (data rounded up to 4)."""
        return buffer_size(self.nbytes)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        return f"<Tensor shape={self.shape} dtype={self.dtype.name}>"


def tensor_of(buffer: Any, shape: tuple[int, ...], dtype: np.dtype[Any], offset: int, block: Any, size: int,
              nbytes: int) -> Tensor:
    """A Tensor from fields already checked and computed (``shape`` a tuple of ints, ``dtype`` a
    numpy dtype, ``size`` and ``nbytes`` its own): for replays, which rebuild known tensors."""
    t = Tensor.__new__(Tensor)
    t.buffer, t.shape, t.dtype, t.offset, t.block, t.size, t.nbytes = buffer, shape, dtype, offset, block, size, nbytes
    return t


def map_values(value: Any, fn: Callable[[Any], Any], kind: type | tuple[type, ...]) -> Any:
    """Apply ``fn`` to every instance of ``kind`` in ``value`` and in its tuples, lists and dicts."""
    if isinstance(value, kind):
        return fn(value)
    if type(value) in (tuple, list):
        return type(value)(map_values(v, fn, kind) for v in value)
    if type(value) is dict:
        return {k: map_values(v, fn, kind) for k, v in value.items()}
    return value
