"""Uniform buffers and bind groups reused across dispatches, per device.

Creating a bind group or a small uniform buffer costs about ten times the host time of
recording the dispatch that uses it (BENCHMARKS.md, "Where the rules of the GPU runtime
come from"), so neither is created twice for the same contents:

* **Uniforms by content.** Uniform buffers hetero creates are never written after
  creation, so one buffer serves every dispatch whose parameters have the same bytes
  (the shapes of a BERT layer repeat in every layer and in every batch of the same
  length).
* **Bind groups by what they bind.** A bind group is keyed by its layout (the kernel's
  cache key and the group index) and by ``(buffer, offset, size)`` of every entry.
  Only buffers whose lifetime hetero knows are cached against: pooled buffers (the
  pool calls :meth:`BindCache.forget` before it destroys one), this cache's uniforms,
  and buffers registered with :meth:`BindCache.keep` (resident constants, held until
  the device closes). A binding of any other buffer -- one the user created and might
  destroy -- gets a fresh bind group, validated by wgpu as before: a cached group over
  a destroyed buffer would abort the process at ``queue.submit``.

Entries hold strong references to their buffers, so the ``id()`` in a key cannot be
reused by another buffer while the entry exists. Both tables are LRU-bounded;
dropping an entry only releases our reference (command buffers keep what they use).

Bind groups are created straight through wgpu-native's ``wgpuDeviceCreateBindGroup``
(:func:`create_bind_group`), the entries filled into one cffi array, and wrapped in wgpu-py's
``GPUBindGroup``: wgpu-py's ``device.create_bind_group`` builds and checks a struct per entry
in Python, 34-110 µs for six buffers on the CPU machine against 6 µs this way, and a replay
that misses its bind groups (a new capture, buffers it has not bound before) makes one per
dispatch. The call goes through wgpu-py's error-checking wrapper, so a validation error
raises as it does from ``device.create_bind_group``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import wgpu

__all__ = ["BindCache", "create_bind_group"]

_UNIFORM = wgpu.BufferUsage.UNIFORM | wgpu.BufferUsage.COPY_DST
# (buffer, offset, size) of one entry, in binding order.
Resource = tuple[Any, int, int]

try:  # wgpu-py's cffi binding (wgpu is pinned: see pyproject.toml); the public method where it differs
    from wgpu.backends.wgpu_native import _api as _native
    from wgpu.backends.wgpu_native._ffi import ffi as _ffi

    _create_native = _native.libf.wgpuDeviceCreateBindGroup
    _Group = _native.GPUBindGroup
except (ImportError, AttributeError):  # pragma: no cover - another wgpu-py
    _create_native = None


def create_bind_group(device: Any, layout: Any, resources: Sequence[Resource]) -> Any:
    """A ``GPUBindGroup`` of ``layout`` over buffer ranges, entry ``i`` at ``@binding(i)`` (see the
    module doc). Raises what ``device.create_bind_group`` raises."""
    if _create_native is None:
        return device.create_bind_group(layout=layout, entries=[
            {"binding": i, "resource": {"buffer": b, "offset": o, "size": s}} for i, (b, o, s) in enumerate(resources)])
    n = len(resources)
    entries = _ffi.new("WGPUBindGroupEntry[]", n)  # zeroed: no chain, sampler or texture view
    for i, (b, o, s) in enumerate(resources):
        e = entries[i]
        e.binding = i
        e.buffer = b._internal
        e.offset = o
        e.size = s
    desc = _ffi.new("WGPUBindGroupDescriptor *")
    desc.layout = layout._internal
    desc.entries = entries
    desc.entryCount = n
    return _Group("", _create_native(device._internal, desc), device)


class BindCache:
    """Uniform buffers by content and bind groups by layout and resources (see the module doc)."""

    def __init__(self, device: Any, *, max_uniforms: int = 4096, max_groups: int = 4096) -> None:
        self.device = device
        self.max_uniforms = max_uniforms
        self.max_groups = max_groups
        self._lock = threading.Lock()
        self._uniforms: OrderedDict[bytes, Any] = OrderedDict()
        self._groups: OrderedDict[tuple[Any, ...], tuple[Any, tuple[Any, ...]]] = OrderedDict()
        self._by_buffer: dict[int, set[tuple[Any, ...]]] = {}
        self._stable: set[int] = set()  # ids of buffers groups may be cached against
        self._kept: dict[int, Any] = {}  # keep()-registered buffers (strong references)
        self.hits = 0
        self.misses = 0
        # Bumped whenever a buffer stops being cached against (destroyed by the pool, or an
        # evicted uniform): bind groups remembered elsewhere (captures) are valid while it holds.
        self.generation = 0

    # -- which buffers are safe to cache against ---------------------------------------
    def keep(self, buffer: Any) -> None:
        """Register a buffer that is never destroyed while the device lives (a resident constant)."""
        with self._lock:
            self._kept[id(buffer)] = buffer
            self._stable.add(id(buffer))

    def track(self, buffer: Any) -> None:
        """A pooled buffer: cacheable until :meth:`forget` (which the pool calls before destroying it)."""
        with self._lock:
            self._stable.add(id(buffer))

    def is_stable(self, buffer: Any) -> bool:
        """Whether hetero knows ``buffer``'s lifetime (pooled, a uniform of this cache, or kept)."""
        return id(buffer) in self._stable

    def forget(self, buffers: Iterable[Any]) -> None:
        """Before ``buffers`` are destroyed: drop every bind group that binds one of them."""
        with self._lock:
            for b in buffers:
                self._forget_locked(id(b))

    # -- uniforms --------------------------------------------------------------------------
    def uniform(self, data: bytes) -> Any:
        """A uniform buffer holding ``data`` (already padded to the binding size), shared by content."""
        with self._lock:
            buf = self._uniforms.get(data)
            if buf is not None:
                self._uniforms.move_to_end(data)
                return buf
        buf = self.device.create_buffer_with_data(data=data, usage=_UNIFORM)
        with self._lock:
            old = self._uniforms.get(data)
            if old is not None:
                return old  # another thread made it meanwhile
            self._uniforms[data] = buf
            self._stable.add(id(buf))
            while len(self._uniforms) > self.max_uniforms:
                _, evicted = self._uniforms.popitem(last=False)
                self._forget_locked(id(evicted))
        return buf

    # -- bind groups -----------------------------------------------------------------------
    def bind_group(self, layout_key: Any, layout: Any, resources: Sequence[Resource]) -> Any:
        """A bind group of ``layout`` over ``resources``: cached when every buffer's lifetime is known.

        Raises what ``device.create_bind_group`` raises (the caller explains it).
        """
        cacheable = True
        with self._lock:
            stable = self._stable
            for r in resources:
                if id(r[0]) not in stable:
                    cacheable = False
                    break
            if cacheable:
                key = (layout_key, *((id(b), o, s) for b, o, s in resources))
                hit = self._groups.get(key)
                if hit is not None:
                    self._groups.move_to_end(key)
                    self.hits += 1
                    return hit[0]
            self.misses += 1
        group = create_bind_group(self.device, layout, resources)
        if not cacheable:
            return group
        with self._lock:
            if not all(id(r[0]) in self._stable for r in resources):
                return group  # a buffer was forgotten meanwhile: do not cache against it
            buffers = tuple(r[0] for r in resources)
            self._groups[key] = (group, buffers)
            for b in buffers:
                self._by_buffer.setdefault(id(b), set()).add(key)
            while len(self._groups) > self.max_groups:
                old_key = next(iter(self._groups))
                self._drop_locked(old_key)
        return group

    def _forget_locked(self, buffer_id: int) -> None:
        """The buffer is no longer cached against, and no cached group binds it."""
        self.generation += 1
        self._stable.discard(buffer_id)
        self._kept.pop(buffer_id, None)
        for key in self._by_buffer.pop(buffer_id, ()):
            self._drop_locked(key)

    def _drop_locked(self, key: tuple[Any, ...]) -> None:
        entry = self._groups.pop(key, None)
        if entry is None:
            return
        for b in entry[1]:
            keys = self._by_buffer.get(id(b))
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._by_buffer[id(b)]

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"uniforms": len(self._uniforms), "bind_groups": len(self._groups), "hits": self.hits,
                    "misses": self.misses}

    def clear(self) -> None:
        with self._lock:
            self.generation += 1
            self._uniforms.clear()
            self._groups.clear()
            self._by_buffer.clear()
            self._stable.clear()
            self._kept.clear()
