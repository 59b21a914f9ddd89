"""Maps through wgpu-native directly (hetero._gpu.bufmap): the wgpu-py wrapper follows them,
wgpu-py's poll thread is never woken, and a failed map raises instead of hanging."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import wgpu

import hetero
from hetero._gpu.bufmap import request_map

U = wgpu.BufferUsage


def _poll_tokens(device: wgpu.GPUDevice) -> int:
    return device._poller._token_count  # type: ignore[attr-defined]


def test_write_then_read_round_trip_through_the_wrapper(shared_rt: hetero.Runtime) -> None:
    """WRITE map, write_mapped, unmap, GPU copy, READ map of a range, read_mapped: the bytes
    arrive, map_state follows every step, and wgpu-py's poll thread got no token."""
    device = shared_rt.device().device
    up = device.create_buffer(size=1024, usage=U.MAP_WRITE | U.COPY_SRC)
    down = device.create_buffer(size=1024, usage=U.MAP_READ | U.COPY_DST)
    tokens = _poll_tokens(device)
    data = np.arange(256, dtype=np.float32)
    w = request_map(up, "WRITE")
    assert up.map_state in ("pending", "mapped")
    w.poll()
    w.wait()
    assert w.done and up.map_state == "mapped"
    up.write_mapped(data, 0)
    up.unmap()
    enc = device.create_command_encoder()
    enc.copy_buffer_to_buffer(up, 0, down, 0, 1024)
    device.queue.submit([enc.finish()])  # the map below waits for this copy
    r = request_map(down, "READ", 256, 512)
    r.wait()
    got = np.frombuffer(down.read_mapped(256, 512), np.float32)
    np.testing.assert_array_equal(got, data[64:192])
    down.unmap()
    assert down.map_state == "unmapped"
    assert _poll_tokens(device) == tokens
    with pytest.raises(RuntimeError, match="unmapped"):
        request_map(request_map(down, "READ").buffer, "READ")  # a second map while one is pending
    down.destroy()
    up.destroy()


def test_a_map_resolves_on_another_threads_poll(shared_rt: hetero.Runtime) -> None:
    """The requester need not poll: a poll on any thread resolves the map (the fence thread's case)."""
    device = shared_rt.device().device
    buf = device.create_buffer(size=256, usage=U.MAP_WRITE | U.COPY_SRC)
    r = request_map(buf, "WRITE")
    t = threading.Thread(target=r.poll)
    t.start()
    t.join()
    assert r.done
    r.wait()
    buf.unmap()
    buf.destroy()


def test_a_failed_map_raises(shared_rt: hetero.Runtime) -> None:
    """A map of a destroyed buffer raises (at the request, as wgpu-native refuses it at once),
    leaves the wrapper unmapped and no request pending."""
    from hetero._gpu import bufmap

    device = shared_rt.device().device
    buf = device.create_buffer(size=256, usage=U.MAP_READ | U.COPY_DST)
    buf.destroy()
    pending = dict(bufmap._pending)
    with pytest.raises(Exception, match="destroyed"):
        request_map(buf, "READ").wait()
    assert buf.map_state == "unmapped"
    assert bufmap._pending == pending


def test_bad_mode() -> None:
    with pytest.raises(ValueError, match="READ' or 'WRITE"):
        request_map(object(), "READ_NOSYNC")


def test_a_refused_remap_leaves_the_buffer_pooled_and_mapped_later(shared_rt: hetero.Runtime,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """If requesting an upload buffer's write map fails when it comes back (e.g. the device is
    going away), recycle() still pools it, and the next acquire() maps it."""
    from hetero._gpu import staging

    pool = staging.StagingPool(shared_rt.device().device, chunk_bytes=1 << 20, max_pooled_bytes=None)
    s = pool.acquire("up", 1000)
    s.buffer.unmap()  # as after an upload was recorded and submitted
    real = staging.request_map

    def refuse(*args: object, **kwargs: object) -> object:
        raise RuntimeError("refused")

    monkeypatch.setattr(staging, "request_map", refuse)
    assert pool.recycle([s], remap=True) == [s]
    assert s.map is None and s.buffer.map_state == "unmapped"
    monkeypatch.setattr(staging, "request_map", real)
    again = pool.acquire("up", 1000)
    assert again is s and s.buffer.map_state == "mapped"
    pool.recycle([s], remap=False)
    pool.close()
