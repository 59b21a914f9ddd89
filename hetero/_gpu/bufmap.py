"""Mapping staging buffers through wgpu-native directly: ``request_map`` and ``MapRequest``.

Rules:

- Every map of hetero's goes through :func:`request_map`, never ``GPUBuffer.map_async`` or
  ``map_sync``. Each of wgpu-py's maps wakes wgpu-py's poll thread, which then sits in
  *blocking* device polls until the map resolves; in wgpu-native 29 a blocking poll waits
  for the newest submission and holds up every other thread's submit and poll meanwhile
  (gfx-rs/wgpu#9470). A map of finished work (hetero's case) needs neither.
- One cffi callback, made once per process, serves every request; ``userdata1`` carries
  the request's key. It runs on whichever thread's device poll resolves the map (the
  requester's, the fence thread's), so a request is bound to no thread or event loop.
- Nobody polls for a request unless someone waits: call :meth:`MapRequest.poll` after
  requesting (the map of finished work resolves in that poll), and :meth:`MapRequest.wait`
  polls without blocking, asleep in between, until it resolves.
- A map wgpu-native refuses at once (e.g. of a destroyed buffer) raises from
  :func:`request_map`; one that fails later raises from :meth:`MapRequest.wait`.
- On success the wgpu-py wrapper is told, as its own map callback would: ``map_state`` reads
  "mapped", and ``read_mapped``, ``write_mapped`` and ``unmap`` work on it as usual.
  These are wgpu-py 0.32's private attributes (the version pyproject.toml pins); a test
  checks the round trip.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

from wgpu import enums
from wgpu.backends.wgpu_native import _api

__all__ = ["MapRequest", "request_map"]

_MODES = {"READ": 1, "WRITE": 2}  # WGPUMapMode_Read, WGPUMapMode_Write
# A waiter polls, then sleeps on the request's event for an eighth of the time waited so
# far, within these bounds (a map of finished work resolves in the first poll).
_WAIT_MIN_S = 20e-6
_WAIT_MAX_S = 1e-3

_pending: dict[int, MapRequest] = {}
_keys = itertools.count(1)
_callback: Any = None
_callback_lock = threading.Lock()


class MapRequest:
    """One pending ``wgpuBufferMapAsync`` of a wgpu-py buffer; :meth:`wait` returns once it is mapped."""

    __slots__ = ("buffer", "error", "_device", "_event", "_range", "_mode")

    def __init__(self, buffer: Any, mode: int, offset: int, size: int) -> None:
        self.buffer = buffer
        self.error: str | None = None
        self._device = buffer._device._internal
        self._event = threading.Event()
        self._range = (offset, offset + size)
        self._mode = mode

    @property
    def done(self) -> bool:
        """Resolved (mapped or failed)."""
        return self._event.is_set()

    def poll(self) -> None:
        """One non-blocking device poll on this thread: resolves the map if its buffer's work finished."""
        _api.libf.wgpuDevicePoll(self._device, False, _api.ffi.NULL)

    def wait(self) -> None:
        """Return once mapped; raise RuntimeError if the map failed (e.g. the device was lost)."""
        if not self._event.is_set():
            start = time.perf_counter()
            while True:
                self.poll()
                if self._event.wait(min(max(_WAIT_MIN_S, (time.perf_counter() - start) / 8), _WAIT_MAX_S)):
                    break
        if self.error is not None:
            raise RuntimeError(f"could not map a {self.buffer.size}-byte buffer: {self.error}")

    def _resolve(self, ok: bool, message: str) -> None:
        if ok:
            b = self.buffer
            b._map_state = enums.BufferMapState.mapped
            b._mapped_status = (*self._range, self._mode)
            b._mapped_memoryviews = []
        else:
            self.buffer._map_state = enums.BufferMapState.unmapped
            self.error = message or "map failed"
        self._event.set()


def _the_callback() -> Any:
    global _callback
    with _callback_lock:
        if _callback is None:
            ffi = _api.ffi
            success = _api.lib.WGPUMapAsyncStatus_Success

            @ffi.callback("void(WGPUMapAsyncStatus, WGPUStringView, void *, void *)")
            def on_map(status: int, message: Any, userdata1: Any, userdata2: Any) -> None:
                req = _pending.pop(int(ffi.cast("uintptr_t", userdata1)), None)
                if req is not None:
                    req._resolve(status == success, "" if status == success else
                                 f"status {status}: {_api.from_c_string_view(message)}")

            _callback = on_map
        return _callback


def request_map(buffer: Any, mode: str, offset: int = 0, size: int | None = None) -> MapRequest:
    """Request a map of ``buffer`` (a wgpu-py ``GPUBuffer``) for ``mode`` "READ" or "WRITE".

    ``size`` defaults to the rest of the buffer. The buffer must be unmapped with no map
    pending (RuntimeError otherwise, as wgpu-py would say). Nothing is submitted first.
    """
    if mode not in _MODES:
        raise ValueError(f"request_map: mode must be 'READ' or 'WRITE', got {mode!r}")
    if size is None:
        size = buffer.size - offset
    if buffer._map_state != enums.BufferMapState.unmapped:
        raise RuntimeError(f"can only map a buffer that is unmapped, not {buffer._map_state!r}")
    req = MapRequest(buffer, _MODES[mode], offset, size)
    key = next(_keys)
    ffi = _api.ffi
    info = ffi.new("WGPUBufferMapCallbackInfo *")
    info.mode = _api.lib.WGPUCallbackMode_AllowProcessEvents
    info.callback = _the_callback()
    info.userdata1 = ffi.cast("void *", key)
    _pending[key] = req
    buffer._map_state = enums.BufferMapState.pending
    try:
        _api.libf.wgpuBufferMapAsync(buffer._internal, req._mode, offset, size, info[0])
    except BaseException:  # a validation error, raised here (its callback may have fired too)
        _pending.pop(key, None)
        buffer._map_state = enums.BufferMapState.unmapped
        raise
    return req
