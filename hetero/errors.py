"""The errors hetero raises.

::

    HeteroError                 base of every error the project raises
    ├── GraphError              the graph is malformed (found when declared or planned)
    ├── InputError              run() got missing or unknown graph inputs
    ├── StageError              a stage failed; names the stage, __cause__ is the original error
    ├── GPUError                the GPU side cannot do what was asked
    │   ├── NoAdapterError      no WebGPU adapter matches (says what to install or set)
    │   ├── OutOfMemoryError    a buffer can never fit the memory budget, or the device refused it (also a MemoryError)
    │   └── DeviceLostError     the device was lost; runs fail fast instead of aborting
    ├── RuntimeClosedError      the runtime was used after close()
    ├── OverloadedError         a batcher's queue is full; retry later
    └── GraphvizError           a graph picture cannot be rendered or written (says how to install dot)

Messages are lowercase, name the rule and the values, and say what to do where
that is not obvious. Every error survives a ``pickle`` round trip (process stages
and distributed engines send them between processes) with its message, its
attributes and, where that pickles too, its ``__cause__``.
"""

from __future__ import annotations

import copyreg
import pickle
from typing import Any

__all__ = [
    "DeviceLostError",
    "GPUError",
    "GraphError",
    "GraphvizError",
    "HeteroError",
    "InputError",
    "NoAdapterError",
    "OutOfMemoryError",
    "OverloadedError",
    "RuntimeClosedError",
    "StageError",
]


class HeteroError(Exception):
    """Base class of every error hetero raises."""

    def _init_args(self) -> tuple[Any, ...]:
        """The arguments that rebuild this error (subclasses with other constructors override it)."""
        return self.args

    def __reduce__(self) -> tuple[Any, ...]:
        state = dict(self.__dict__)
        cause = self.__cause__
        if cause is not None:
            try:
                pickle.dumps(cause)
            except Exception:  # noqa: BLE001 - an unpicklable cause is left behind, the error still travels
                pass
            else:
                state["__cause__"] = cause
        return (type(self), self._init_args(), state)


def _own_reducers() -> None:
    """Let every HeteroError class pickle through its own ``__reduce__`` again.

    ``distributed`` (through ``tblib.pickling_support.install()``) registers a reducer in
    ``copyreg`` for every exception class that exists when it is imported; such a reducer
    takes precedence over ``__reduce__`` and fails on a cause that does not pickle. Modules
    that import ``distributed`` call this afterwards.
    """
    stack: list[type] = [HeteroError]
    while stack:
        cls = stack.pop()
        copyreg.dispatch_table.pop(cls, None)
        stack.extend(cls.__subclasses__())


class GraphError(HeteroError):
    """The graph is malformed: duplicate names, a cycle, no outputs, a bad stage."""


class InputError(HeteroError):
    """A run was given missing or unknown graph inputs."""


class StageError(HeteroError):
    """A stage failed. ``stage`` is its name; ``__cause__`` is the original exception."""

    def __init__(self, message: str, stage: str) -> None:
        super().__init__(message)
        self.stage = stage

    def _init_args(self) -> tuple[Any, ...]:
        return (*self.args, self.stage)


class GPUError(HeteroError):
    """The GPU side cannot do what was asked."""


class NoAdapterError(GPUError):
    """No WebGPU adapter was found, or none matches ``HETERO_ADAPTER``."""


class OutOfMemoryError(GPUError, MemoryError):
    """A buffer can never fit in the memory budget (or the device refused to allocate it).

    Also a :class:`MemoryError`: code that handles running out of memory catches it too.
    """


class DeviceLostError(GPUError):
    """The GPU device was lost; create a new Runtime to get a new device."""


class RuntimeClosedError(HeteroError):
    """The runtime was used after it was closed."""


class OverloadedError(HeteroError):
    """A batcher's queue is full (``max_queued`` items wait): the item was refused at once; retry later."""


class GraphvizError(HeteroError):
    """A graph picture cannot be rendered (Graphviz's ``dot`` is missing or failed) or written."""
