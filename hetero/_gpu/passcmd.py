"""Recording commands called straight into wgpu-native: compute-pass commands for loops that
issue many of them, and buffer copies.

Rules:

- These are the raw C functions, called through ``ctypes.PyDLL``, which keeps the GIL. Each
  only appends a command to an open compute pass, or (a copy) to a command encoder with no
  pass open (well under a microsecond). A call through cffi (wgpu-py's methods) releases
  the GIL, and waits to get it back whenever another Python thread runs meanwhile: on the
  CPU machine a replayed dispatch took 0.75 us alone and 67-102 us beside a busy Python
  thread through cffi, 1.2 us either way through PyDLL.
- No per-call error capture: a command's error invalidates its encoder, which reports it
  when the pass ends or the encoder is finished (failing every stage recorded into it), and
  the callers only issue what was validated before (a captured stage's commands,
  timestamps into the timer's own query set, copies whose ranges the transfer ring
  checked). An error callback wgpu-native made from one of them would run on the calling
  thread, which holds the GIL.
- Handles are integer addresses (:func:`addr`), or for the undeclared commands below
  :class:`Handle` objects (:func:`handle`), taken once per object; the object must stay
  alive while its handle is in use.
- The three pass commands a replay issues per dispatch (:data:`set_pipeline`,
  :data:`set_bind_group`, :data:`dispatch`) are declared without argument types: ctypes'
  conversion of declared arguments costs more than the call itself (a replayed stage of 25
  dispatches issued its commands in 57-74 us against 137 us on the CPU machine). So their
  callers pass every handle as a :class:`Handle` made once per object (:func:`handle`), the
  dynamic offsets as ``NO_OFFSETS, None``, and every other argument (a group index, a
  workgroup count) as a Python int below 2**31, which ctypes passes as a C int.
- :func:`write_buffer` is the queue's write (``wgpuQueueWriteBuffer``): wgpu-native copies
  the bytes at once and writes them on the GPU at the start of the next queue submission,
  before its command buffers. Only for a destination that no recorded but unsubmitted
  command uses (see ``SharedRecorder.write_now``).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from wgpu.backends.wgpu_native._ffi import ffi as _ffi, lib_path as _lib_path

__all__ = ["Handle", "NO_OFFSETS", "addr", "copy_buffer_to_buffer", "dispatch", "handle", "set_bind_group",
           "set_pipeline", "write_buffer", "write_timestamp"]

# A native handle as the undeclared pass commands take it (see the rules above).
Handle = ctypes.c_void_p
# set_bind_group's count of dynamic offsets (none; the pointer to them is None).
NO_OFFSETS = ctypes.c_size_t(0)


def _functions() -> tuple[Any, Any, Any, Any, Any, Any]:
    dll = ctypes.PyDLL(_lib_path)
    vp, u32, u64 = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint64
    # (pass, pipeline), (pass, index, group, NO_OFFSETS, None), (pass, x, y, z): undeclared.
    set_pipeline = dll.wgpuComputePassEncoderSetPipeline
    set_bind_group = dll.wgpuComputePassEncoderSetBindGroup
    dispatch = dll.wgpuComputePassEncoderDispatchWorkgroups
    for f in (set_pipeline, set_bind_group, dispatch):
        f.restype = None
    write_timestamp = dll.wgpuComputePassEncoderWriteTimestamp  # needs timestamp-query-inside-passes
    write_timestamp.argtypes, write_timestamp.restype = [vp, vp, u32], None
    copy = dll.wgpuCommandEncoderCopyBufferToBuffer
    copy.argtypes, copy.restype = [vp, vp, u64, vp, u64, u64], None
    write = dll.wgpuQueueWriteBuffer
    write.argtypes, write.restype = [vp, vp, u64, vp, ctypes.c_size_t], None
    return set_pipeline, set_bind_group, dispatch, write_timestamp, copy, write


set_pipeline, set_bind_group, dispatch, write_timestamp, _copy, _write = _functions()


def copy_buffer_to_buffer(encoder: Any, source: Any, source_offset: int, destination: Any, destination_offset: int,
                          size: int) -> None:
    """``encoder.copy_buffer_to_buffer(...)`` of wgpu-py objects, keeping the GIL (see the rules above)."""
    if (source_offset | destination_offset | size) & 3:
        raise ValueError(f"copy_buffer_to_buffer: offsets and size must be multiples of 4, got {source_offset}, "
                         f"{destination_offset}, {size}")
    _copy(addr(encoder), addr(source), source_offset, addr(destination), destination_offset, size)


def write_buffer(queue: int, buffer: Any, offset: int, data: np.ndarray) -> None:
    """Write ``data``'s bytes in C order to ``buffer`` at ``offset`` (a multiple of 4) through the
    queue at address ``queue``, keeping the GIL (see the rules above). A queue write moves whole
    words: a size that is not a multiple of 4 is padded with zeros, as the staging ring pads."""
    if offset & 3:
        raise ValueError(f"write_buffer: the offset must be a multiple of 4, got {offset}")
    words = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if words.size % 4:
        words = np.concatenate([words, np.zeros(4 - words.size % 4, np.uint8)])
    _write(queue, addr(buffer), offset, words.ctypes.data, words.nbytes)


def addr(obj: Any) -> int:
    """The address of a wgpu-py object's native handle (valid while the object lives)."""
    return int(_ffi.cast("uintptr_t", obj._internal))


def handle(obj: Any) -> Handle:
    """A wgpu-py object's native handle as the pass commands take it (valid while the object lives)."""
    return Handle(addr(obj))
