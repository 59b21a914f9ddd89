"""Compute-pass commands called straight into wgpu-native, for loops that issue many of them.

Rules:

- These are the raw C functions, called through ``ctypes.PyDLL``, which keeps the GIL. Each
  only appends a command to an open compute pass (well under a microsecond). A call
  through cffi (wgpu-py's methods) releases the GIL, and waits to get it back whenever
  another Python thread runs meanwhile: on the CPU machine a replayed dispatch took 0.75 us
  alone and 67-102 us beside a busy Python thread through cffi, 1.2 us either way through
  PyDLL.
- No per-call error capture: pass commands are validated when the pass ends, and the
  callers only issue what was validated before (a captured stage's commands, timestamps
  into the timer's own query set). An error callback wgpu-native made from one of them
  would run on the calling thread, which holds the GIL.
- Handles are integer addresses (:func:`addr`), taken once per object; the object must stay
  alive while its address is in use.
"""

from __future__ import annotations

import ctypes
from typing import Any

from wgpu.backends.wgpu_native._ffi import ffi as _ffi, lib_path as _lib_path

__all__ = ["addr", "dispatch", "set_bind_group", "set_pipeline", "write_timestamp"]


def _functions() -> tuple[Any, Any, Any, Any]:
    dll = ctypes.PyDLL(_lib_path)
    vp, u32 = ctypes.c_void_p, ctypes.c_uint32
    set_pipeline = dll.wgpuComputePassEncoderSetPipeline
    set_pipeline.argtypes, set_pipeline.restype = [vp, vp], None
    set_bind_group = dll.wgpuComputePassEncoderSetBindGroup
    set_bind_group.argtypes, set_bind_group.restype = [vp, u32, vp, ctypes.c_size_t, vp], None
    dispatch = dll.wgpuComputePassEncoderDispatchWorkgroups
    dispatch.argtypes, dispatch.restype = [vp, u32, u32, u32], None
    write_timestamp = dll.wgpuComputePassEncoderWriteTimestamp  # needs timestamp-query-inside-passes
    write_timestamp.argtypes, write_timestamp.restype = [vp, vp, u32], None
    return set_pipeline, set_bind_group, dispatch, write_timestamp


set_pipeline, set_bind_group, dispatch, write_timestamp = _functions()


def addr(obj: Any) -> int:
    """The address of a wgpu-py object's native handle (valid while the object lives)."""
    return int(_ffi.cast("uintptr_t", obj._internal))
