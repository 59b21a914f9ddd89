"""hetero: heterogeneous async task graphs.

Declare a DAG of CPU stages (Python functions on a thread pool) and GPU stages
(WebGPU compute recorded through wgpu-py); run it from sync code, asyncio or trio.
"""

from __future__ import annotations

from ._device import Kernel
from ._gpu import GPUContext
from ._graph import Graph, Input, Node
from ._runtime import Runtime, run
from ._memory import MemoryStats
from ._split import DispatchInfo
from ._stats import RunStats, StageStats
from ._tensor import Tensor
from .errors import (
    DeviceLostError,
    GPUError,
    GraphError,
    HeteroError,
    InputError,
    NoAdapterError,
    OutOfMemoryError,
    RuntimeClosedError,
    StageError,
)

from . import ops  # noqa: E402  (the op namespace: hetero.ops.sum, ...)

__version__ = "0.1.0"

__all__ = [
    "DeviceLostError",
    "DispatchInfo",
    "GPUContext",
    "GPUError",
    "Graph",
    "GraphError",
    "HeteroError",
    "Input",
    "InputError",
    "Kernel",
    "MemoryStats",
    "NoAdapterError",
    "Node",
    "OutOfMemoryError",
    "RunStats",
    "Runtime",
    "RuntimeClosedError",
    "StageError",
    "StageStats",
    "Tensor",
    "run",
]
