"""The staging ring: round trips, reuse, discard, threads, and the never-mapped-at-submit rule."""

from __future__ import annotations

import asyncio
import gc
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import wgpu

import hetero
from hetero._gpu.device import Device
from hetero._gpu.transfer import StagingRing, Ticket
from hetero.errors import RuntimeClosedError

STORAGE = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
CHUNK = 64 << 10  # small chunks: multi-buffer transfers stay cheap on lavapipe


@pytest.fixture(scope="module")
def dev() -> Iterator[Device]:
    d = Device()
    yield d
    d.close()


@pytest.fixture
def ring(dev: Device) -> Iterator[StagingRing]:
    r = StagingRing(dev.device, copy_threads=4, chunk_bytes=CHUNK)
    yield r
    r.close()


def pad4(n: int) -> int:
    return (n + 3) & ~3


def new_buffer(dev: Device, nbytes: int) -> Any:
    return dev.device.create_buffer(size=max(4, pad4(nbytes)), usage=STORAGE)


def assert_unmapped(ticket: Ticket) -> None:
    """What upload()/download() hand back must be submittable: no staging buffer mapped."""
    states = [b.map_state for b in ticket.buffers]
    assert states == ["unmapped"] * len(states)


def submit_wait(dev: Device, encoder: Any) -> None:
    dev.wait(dev.submit([encoder.finish()]))


def upload(dev: Device, ring: StagingRing, a: Any, buf: Any, offset: int = 0) -> Ticket:
    enc = dev.device.create_command_encoder()
    t = ring.upload(enc, a, buf, offset)
    assert_unmapped(t)
    submit_wait(dev, enc)
    t.complete()
    return t


def download(dev: Device, ring: StagingRing, buf: Any, offset: int, shape: Any, dtype: Any) -> np.ndarray:
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    enc = dev.device.create_command_encoder()
    t = ring.download(enc, buf, offset, nbytes)
    assert_unmapped(t)
    submit_wait(dev, enc)
    t.complete()
    return t.read(shape, dtype)


def round_trip(dev: Device, ring: StagingRing, a: np.ndarray, offset: int = 0) -> np.ndarray:
    buf = new_buffer(dev, offset + a.nbytes)
    upload(dev, ring, a, buf, offset)
    return download(dev, ring, buf, offset, a.shape, a.dtype)


def data(shape: Any, dtype: Any, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape, dtype=np.int64))
    return rng.integers(0, 256, n * np.dtype(dtype).itemsize, dtype=np.uint8).view(dtype).reshape(shape)


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((0,), np.uint8),
        ((1,), np.uint8),
        ((3,), np.float16),
        ((), np.float64),
        ((7,), np.int32),
        ((5, 3), np.float64),
        ((1001,), np.uint8),
        ((2, 0, 3), np.float32),
        ((9,), np.complex64),
        ((CHUNK // 4,), np.float32),  # exactly one chunk
        ((CHUNK + 1,), np.uint8),  # one chunk and one byte
        ((3, 50_001), np.float32),  # ten chunks, odd size
        (((5 << 20) + 5,), np.uint8),  # large enough for the copy threads
    ],
)
def test_round_trip(dev: Device, ring: StagingRing, shape: tuple[int, ...], dtype: Any) -> None:
    a = data(shape, dtype)
    b = round_trip(dev, ring, a)
    assert b.shape == a.shape and b.dtype == a.dtype
    assert a.tobytes() == b.tobytes()
    assert ring.stats()["in_use_bytes"] == 0


@pytest.mark.parametrize("copy_threads", [1, 2, 8])
def test_round_trip_copy_threads(dev: Device, copy_threads: int) -> None:
    with StagingRing(dev.device, copy_threads=copy_threads, chunk_bytes=1 << 20) as ring:
        a = data((5 << 20) // 4 + 3, np.float32, seed=copy_threads)
        assert a.tobytes() == round_trip(dev, ring, a).tobytes()


@pytest.mark.parametrize("copy_threads", [1, 4])
def test_large_download_into_a_prefaulted_array(dev: Device, copy_threads: int) -> None:
    """From PREFAULT_MIN bytes the array is allocated at record time and touched meanwhile; the data is exact."""
    from hetero._gpu.transfer import PREFAULT_MIN

    with StagingRing(dev.device, copy_threads=copy_threads, chunk_bytes=1 << 20) as ring:
        a = data((PREFAULT_MIN // 8 + 3, 2), np.float32, seed=7)
        buf = new_buffer(dev, a.nbytes)
        upload(dev, ring, a, buf, 0)
        for kw, out in (({}, None), ({"prefault": False}, None), ({"prefault": False}, np.empty_like(a))):
            enc = dev.device.create_command_encoder()
            t = ring.download(enc, buf, 0, a.nbytes, **kw)
            assert (t._host is not None) == (copy_threads > 1 and not kw)
            submit_wait(dev, enc)
            t.complete()
            b = t.read(a.shape, a.dtype, out=out)
            assert b.shape == a.shape and b.dtype == a.dtype and b.flags.writeable
            assert out is None or b is out
            np.testing.assert_array_equal(a, b)
        # Discarded before reading: the array is dropped and the buffers go back.
        enc = dev.device.create_command_encoder()
        t = ring.download(enc, buf, 0, a.nbytes)
        t.discard()
        assert t._host is None and ring.stats()["in_use_bytes"] == 0


@pytest.mark.parametrize(
    "make",
    [
        lambda: data((64, 64), np.float32)[::2, 1::3],  # strided, fits one chunk
        lambda: data((40, 30), np.int16).T,  # transposed
        lambda: np.asfortranarray(data((33, 17), np.float64)),
        lambda: data((300, 700), np.float32)[:, ::2],  # strided across several chunks
        lambda: data((1000,), np.uint8)[::-1],  # negative stride
    ],
)
def test_non_contiguous_input(dev: Device, ring: StagingRing, make: Any) -> None:
    a = make()
    assert not a.flags.c_contiguous
    b = round_trip(dev, ring, a)
    np.testing.assert_array_equal(b, a)


@pytest.mark.parametrize("offset", [4, 256, CHUNK + 12])
def test_destination_offset(dev: Device, ring: StagingRing, offset: int) -> None:
    a = data((CHUNK + 777,), np.uint8, seed=offset)  # two chunks, padded to 4
    total = offset + pad4(a.nbytes) + 16
    buf = new_buffer(dev, total)
    sentinel = np.full(total, 0xAB, np.uint8)
    dev.queue.write_buffer(buf, 0, sentinel)
    upload(dev, ring, a, buf, offset)
    whole = download(dev, ring, buf, 0, (total,), np.uint8)
    assert (whole[:offset] == 0xAB).all()  # before the destination: untouched
    np.testing.assert_array_equal(whole[offset:offset + a.nbytes], a)
    assert (whole[offset + a.nbytes:offset + pad4(a.nbytes)] == 0).all()  # the pad is zeros
    assert (whole[offset + pad4(a.nbytes):] == 0xAB).all()  # after the padded copy: untouched
    np.testing.assert_array_equal(download(dev, ring, buf, offset, a.shape, a.dtype), a)


def test_copies_go_straight_into_the_encoder(dev: Device) -> None:
    """passcmd.copy_buffer_to_buffer (the ring's copies): the bytes arrive; misaligned arguments
    are refused at once; a range past a buffer fails the encoder when it is finished."""
    from hetero._gpu import passcmd

    src, dst = new_buffer(dev, 256), new_buffer(dev, 256)
    data = np.arange(64, dtype=np.uint32)
    dev.device.queue.write_buffer(src, 0, data)
    enc = dev.device.create_command_encoder()
    passcmd.copy_buffer_to_buffer(enc, src, 16, dst, 128, 64)
    submit_wait(dev, enc)
    got = np.frombuffer(dev.device.queue.read_buffer(dst), np.uint32)
    np.testing.assert_array_equal(got[32:48], data[4:20])
    assert not got[:32].any() and not got[48:].any()
    enc = dev.device.create_command_encoder()
    with pytest.raises(ValueError, match="multiples of 4"):
        passcmd.copy_buffer_to_buffer(enc, src, 2, dst, 0, 4)
    passcmd.copy_buffer_to_buffer(enc, src, 0, dst, 0, 512)  # past both buffers
    with pytest.raises(wgpu.GPUValidationError, match="overrunning the bounds"):
        enc.finish()


def test_bad_ranges(dev: Device, ring: StagingRing) -> None:
    buf = new_buffer(dev, 64)
    enc = dev.device.create_command_encoder()
    with pytest.raises(ValueError, match="dst_offset must be a non-negative multiple of 4, got 2"):
        ring.upload(enc, np.zeros(4, np.uint8), buf, 2)
    with pytest.raises(ValueError, match="upload: 68 bytes at dst_offset 0 overrun the 64-byte dst buffer"):
        ring.upload(enc, np.zeros(65, np.uint8), buf)
    with pytest.raises(ValueError, match="download: 64 bytes at src_offset 4 overrun the 64-byte src buffer"):
        ring.download(enc, buf, 4, 61)
    with pytest.raises(TypeError, match="objects"):
        ring.upload(enc, np.array([object()]), buf)
    assert ring.stats()["in_use_bytes"] == 0


def test_reuse_without_growth(dev: Device, ring: StagingRing) -> None:
    a = data((3 * CHUNK + 100,), np.uint8)  # four staging buffers each way
    buf = new_buffer(dev, a.nbytes)
    for _ in range(2):
        upload(dev, ring, a, buf)
        download(dev, ring, buf, 0, a.shape, a.dtype)
    before = ring.stats()
    for i in range(5):
        b = data(a.shape, a.dtype, seed=i)
        upload(dev, ring, b, buf)
        np.testing.assert_array_equal(download(dev, ring, buf, 0, a.shape, a.dtype), b)
    after = ring.stats()
    assert after["staging_allocations"] == before["staging_allocations"]
    assert after["staging_bytes"] == before["staging_bytes"]
    assert after["staging_reuses"] == before["staging_reuses"] + 5 * 8
    assert after["in_use_bytes"] == 0


def test_free_upload_buffers_stay_mapped(dev: Device, ring: StagingRing) -> None:
    """complete() re-maps upload staging for the next writer; the ring's pool holds them mapped."""
    a = data((1000,), np.float32)
    buf = new_buffer(dev, a.nbytes)
    t = upload(dev, ring, a, buf)
    (staging,) = t.buffers
    assert staging.map_state in ("mapped", "pending")  # pending until the next acquire waits for it
    enc = dev.device.create_command_encoder()
    t2 = ring.upload(enc, a, buf)
    assert t2.buffers == (staging,)
    assert_unmapped(t2)
    t2.discard()


def test_discard(dev: Device, ring: StagingRing) -> None:
    a = data((2 * CHUNK + 8,), np.uint8)
    buf = new_buffer(dev, a.nbytes)
    # A stage failed after recording: the encoder is dropped, never submitted.
    enc = dev.device.create_command_encoder()
    up = ring.upload(enc, a, buf)
    down = ring.download(enc, buf, 0, a.nbytes)
    assert_unmapped(up)
    assert_unmapped(down)
    assert ring.stats()["in_use_bytes"] > 0
    up.discard()
    down.discard()
    down.discard()  # twice is harmless
    del enc
    stats = ring.stats()
    assert stats["in_use_bytes"] == 0 and stats["free_buffers"] == 6
    with pytest.raises(RuntimeError, match="already read or discarded"):
        down.read(a.shape, a.dtype)
    # The discarded buffers serve the next transfers (upload ones are mapped again on demand).
    b = round_trip(dev, ring, a)
    np.testing.assert_array_equal(b, a)
    assert ring.stats()["staging_allocations"] == stats["staging_allocations"]


def test_discard_after_complete(dev: Device, ring: StagingRing) -> None:
    """A download whose result nobody wants: complete() started mapping; discard() unmaps."""
    a = data((CHUNK + 4,), np.uint8)
    buf = new_buffer(dev, a.nbytes)
    upload(dev, ring, a, buf)
    enc = dev.device.create_command_encoder()
    t = ring.download(enc, buf, 0, a.nbytes)
    submit_wait(dev, enc)
    t.complete()
    t.discard()
    assert all(b.map_state == "unmapped" for b in t.buffers)
    assert ring.stats()["in_use_bytes"] == 0
    np.testing.assert_array_equal(download(dev, ring, buf, 0, a.shape, a.dtype), a)


def test_read_checks(dev: Device, ring: StagingRing) -> None:
    a = data((10, 10), np.float32)
    buf = new_buffer(dev, a.nbytes)
    up = upload(dev, ring, a, buf)
    with pytest.raises(RuntimeError, match="read\\(\\) is for download tickets"):
        up.read(a.shape, a.dtype)
    enc = dev.device.create_command_encoder()
    t = ring.download(enc, buf, 0, a.nbytes)
    submit_wait(dev, enc)
    with pytest.raises(ValueError, match=r"read: shape \(3,\) of float32 is 12 bytes, the download has 400 bytes"):
        t.read(3, np.float32)
    with pytest.raises(ValueError, match="out must be a writeable C-contiguous array of 400 bytes"):
        t.read(a.shape, a.dtype, out=np.empty((10, 20), np.float32)[:, ::2])
    out = np.empty((100,), np.float32)
    assert t.read(100, np.float32, out=out) is out  # read without complete(): maps on demand
    np.testing.assert_array_equal(out, a.reshape(-1))
    with pytest.raises(RuntimeError, match="already read or discarded"):
        t.read(100, np.float32)


def test_complete_on_fence_thread(dev: Device, ring: StagingRing) -> None:
    """The runtime's pattern: completion runs on the device's fence thread, read on a worker."""
    a = data((5 * CHUNK // 8 + 1,), np.float64)
    buf = new_buffer(dev, a.nbytes)
    enc = dev.device.create_command_encoder()
    up = ring.upload(enc, a, buf)
    down = ring.download(enc, buf, 0, a.nbytes)
    done = threading.Event()

    def on_done() -> None:
        ring.completed([up, down])
        done.set()

    dev.on_done(dev.submit([enc.finish()]), on_done)
    assert done.wait(30)
    assert up.released
    np.testing.assert_array_equal(down.read(a.shape, a.dtype), a)


def test_complete_on_event_loop_thread(dev: Device, ring: StagingRing) -> None:
    """On a thread with a running loop the re-map goes through the copy threads (no loop-bound promise)."""
    a = data((2 * CHUNK,), np.uint8)
    buf = new_buffer(dev, a.nbytes)

    async def main() -> np.ndarray:
        for i in range(3):
            b = data(a.shape, a.dtype, seed=i)
            upload(dev, ring, b, buf)  # complete() runs here, on the loop thread
            out = download(dev, ring, buf, 0, a.shape, a.dtype)
            np.testing.assert_array_equal(out, b)
        return out

    asyncio.run(main())
    assert ring.stats()["staging_reuses"] >= 8


def test_concurrent_threads(dev: Device, ring: StagingRing) -> None:
    errors: list[BaseException] = []
    sizes = [1, 3, 1000, CHUNK, 3 * CHUNK + 5, (4 << 20) + 1]

    def worker(k: int) -> None:
        try:
            for i, n in enumerate(sizes * 2):
                a = data((n,), np.uint8, seed=100 * k + i)
                buf = new_buffer(dev, n)
                enc = dev.device.create_command_encoder()  # one encoder per thread and transfer
                t = ring.upload(enc, a, buf)
                assert_unmapped(t)
                submit_wait(dev, enc)
                t.complete()
                enc = dev.device.create_command_encoder()
                t = ring.download(enc, buf, 0, n)
                assert_unmapped(t)
                submit_wait(dev, enc)
                t.complete()
                np.testing.assert_array_equal(t.read(n, np.uint8), a)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors, errors
    stats = ring.stats()
    assert stats["in_use_bytes"] == 0
    assert stats["staging_reuses"] > 0


def test_pool_cap_trim_close(dev: Device) -> None:
    ring = StagingRing(dev.device, copy_threads=2, chunk_bytes=CHUNK, max_pooled_bytes=2 * CHUNK)
    a = data((4 * CHUNK,), np.uint8)
    np.testing.assert_array_equal(round_trip(dev, ring, a), a)
    stats = ring.stats()
    assert stats["pooled_bytes"] <= 2 * CHUNK
    assert stats["staging_destroyed"] == 6  # 8 buffers used, room for 2
    assert stats["staging_bytes"] == stats["pooled_bytes"]
    assert ring.trim() == 2 * CHUNK
    assert ring.stats()["staging_bytes"] == 0
    # close() with a ticket in flight: its buffers are destroyed when it completes.
    buf = new_buffer(dev, a.nbytes)
    enc = dev.device.create_command_encoder()
    t = ring.upload(enc, a[:100], buf)
    submit_wait(dev, enc)
    ring.close()
    t.complete()
    assert ring.stats()["staging_bytes"] == 0
    with pytest.raises(RuntimeClosedError, match="staging ring was used after close"):
        ring.upload(dev.device.create_command_encoder(), a, buf)


def test_bad_arguments(dev: Device) -> None:
    with pytest.raises(ValueError, match="chunk_bytes must be a positive multiple of 4096, got 1000"):
        StagingRing(dev.device, chunk_bytes=1000)
    too_big = (dev.limits["max-buffer-size"] // 4096 + 1) * 4096
    with pytest.raises(ValueError, match=f"chunk_bytes {too_big} is above the adapter's max-buffer-size"):
        StagingRing(dev.device, chunk_bytes=too_big)
    with pytest.raises(ValueError, match="copy_threads must be at least 1, got 0"):
        StagingRing(dev.device, copy_threads=0)


@pytest.mark.parametrize(("shape", "dtype"), [((0,), np.uint8), ((3,), np.float16), ((7, 5), np.int32),
                                              ((3, 50_001), np.float32)])
def test_zero_copy_read(dev: Device, ring: StagingRing, shape: tuple[int, ...], dtype: Any) -> None:
    """The array lives on the mapped staging buffer until it (and its views) are gone."""
    a = data(shape, dtype)
    buf = new_buffer(dev, a.nbytes)
    upload(dev, ring, a, buf)
    for i in range(2):
        enc = dev.device.create_command_encoder()
        t = ring.download(enc, buf, 0, a.nbytes, zero_copy=True)
        assert_unmapped(t)
        assert len(t.buffers) == (1 if a.nbytes else 0)  # one buffer even above chunk_bytes
        submit_wait(dev, enc)
        t.complete()
        b = t.read(shape, dtype)
        np.testing.assert_array_equal(b, a)
        if not a.nbytes:
            return
        assert b.flags.writeable
        (staging,) = t.buffers
        assert staging.map_state == "mapped" and ring.stats()["zero_copy_bytes"] == staging.size
        view = b.reshape(-1)[1:]
        del b
        gc.collect()
        ring.stats()
        assert staging.map_state == "mapped"  # the view keeps the mapping
        np.testing.assert_array_equal(view, a.reshape(-1)[1:])
        del view
        gc.collect()
        stats = ring.stats()  # the ring takes dead arrays' buffers back at its next call
        assert staging.map_state == "unmapped"
        assert stats["zero_copy_bytes"] == 0 and stats["in_use_bytes"] == 0
        if i == 1:
            assert stats["staging_reuses"] >= 1  # the second read reused the first one's buffer


def test_zero_copy_array_outlives_ring(dev: Device) -> None:
    ring = StagingRing(dev.device, copy_threads=2, chunk_bytes=CHUNK)
    a = data((5000,), np.int64)
    buf = new_buffer(dev, a.nbytes)
    upload(dev, ring, a, buf)
    enc = dev.device.create_command_encoder()
    t = ring.download(enc, buf, 0, a.nbytes, zero_copy=True)
    submit_wait(dev, enc)
    b = t.read(a.shape, a.dtype)
    ring.close()
    np.testing.assert_array_equal(b, a)  # still readable: the mapping lives with the array
    (staging,) = t.buffers
    del b
    gc.collect()
    assert staging.map_state == "unmapped"  # after close() the buffer is destroyed at once
    assert ring.stats()["staging_bytes"] == 0


def test_zero_copy_into_out_copies(dev: Device, ring: StagingRing) -> None:
    a = data((1000,), np.float32)
    buf = new_buffer(dev, a.nbytes)
    upload(dev, ring, a, buf)
    enc = dev.device.create_command_encoder()
    t = ring.download(enc, buf, 0, a.nbytes, zero_copy=True)
    submit_wait(dev, enc)
    out = np.empty_like(a)
    assert t.read(a.shape, a.dtype, out=out) is out  # with out= the data is copied after all
    np.testing.assert_array_equal(out, a)
    assert all(b.map_state == "unmapped" for b in t.buffers) and ring.stats()["in_use_bytes"] == 0


# -- zero_copy="auto": zero-copy only where it reuses memory ----------------------------------
AUTO_N = 300 << 10  # a 320 KiB size class (five 64 KiB chunks when copied)


def is_mapped_view(a: np.ndarray) -> bool:
    """Whether ``a`` lives on mapped staging memory (its base chain ends in the ring's owner)."""
    while isinstance(a, np.ndarray):
        a = a.base
    return type(a).__name__ == "_MappedMemory"


def auto_download(dev: Device, ring: StagingRing, buf: Any, n: int = AUTO_N) -> tuple[Ticket, np.ndarray]:
    enc = dev.device.create_command_encoder()
    t = ring.download(enc, buf, 0, n, zero_copy="auto")
    assert_unmapped(t)
    submit_wait(dev, enc)
    t.complete()
    b = t.read((n,), np.uint8)
    assert t.zero_copy == is_mapped_view(b)
    return t, b


@pytest.fixture
def auto_min(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("hetero._gpu.staging.AUTO_ZERO_COPY_MIN", 128 << 10)  # lavapipe-sized


def test_auto_zero_copy_reuses_dropped_arrays(dev: Device, ring: StagingRing, auto_min: None) -> None:
    a = data((AUTO_N,), np.uint8)
    buf = new_buffer(dev, AUTO_N)
    upload(dev, ring, a, buf)
    t1, b1 = auto_download(dev, ring, buf)
    assert not t1.zero_copy  # the first download of a size is copied: it may never come again
    t2, b2 = auto_download(dev, ring, buf)
    assert t2.zero_copy and len(t2.buffers) == 1  # it came again: one whole buffer, handed out
    t3, b3 = auto_download(dev, ring, buf)
    assert not t3.zero_copy  # b2 is still held and none came back yet: no second buffer
    allocations = ring.stats()["staging_allocations"]
    del b2
    gc.collect()
    t4, b4 = auto_download(dev, ring, buf)
    assert t4.zero_copy and t4.buffers == t2.buffers  # b2's buffer, reused
    assert ring.stats()["staging_allocations"] == allocations
    t5, b5 = auto_download(dev, ring, buf)
    assert t5.zero_copy and t5.buffers != t4.buffers  # buffers came back: a second one may be made
    t6, b6 = auto_download(dev, ring, buf)
    assert not t6.zero_copy  # both held, only one ever came back: copies again
    for b in (b1, b3, b4, b5, b6):
        np.testing.assert_array_equal(b, a)
    b4[:] = 7  # an ordinary writable array
    assert (b4 == 7).all() and not np.shares_memory(b4, b5)
    del b4, b5
    gc.collect()
    stats = ring.stats()
    assert stats["zero_copy_bytes"] == 0 and stats["in_use_bytes"] == 0


def test_auto_zero_copy_limits(dev: Device, auto_min: None) -> None:
    a = data((AUTO_N,), np.uint8)
    buf = new_buffer(dev, AUTO_N)
    with StagingRing(dev.device, copy_threads=2, chunk_bytes=CHUNK) as ring:
        upload(dev, ring, a, buf)
        small = [auto_download(dev, ring, buf, 100 << 10)[0] for _ in range(3)]
        assert not any(t.zero_copy for t in small)  # below AUTO_ZERO_COPY_MIN: always copied
    # max_pooled_bytes bounds live zero-copy arrays too: a class above it is always copied.
    with StagingRing(dev.device, copy_threads=2, chunk_bytes=CHUNK, max_pooled_bytes=256 << 10) as ring:
        upload(dev, ring, a, buf)
        held = [auto_download(dev, ring, buf) for _ in range(3)]
        assert not any(t.zero_copy for t, _ in held)
        with pytest.raises(ValueError, match="zero_copy must be True, False or 'auto', got 'yes'"):
            ring.download(dev.device.create_command_encoder(), buf, 0, 4, zero_copy="yes")


def test_auto_zero_copy_buffer_evicts_free_chunks(dev: Device, auto_min: None) -> None:
    """A dropped result's buffer takes the place of the copied path's free chunk buffers."""
    a = data((AUTO_N,), np.uint8)
    buf = new_buffer(dev, AUTO_N)
    with StagingRing(dev.device, copy_threads=2, chunk_bytes=CHUNK, max_pooled_bytes=640 << 10) as ring:
        upload(dev, ring, a, buf)  # 320 KiB of free upload chunks
        auto_download(dev, ring, buf)  # copied: 320 KiB of free download chunks, the pool is full
        assert ring.stats()["pooled_bytes"] == 640 << 10
        t2, b2 = auto_download(dev, ring, buf)
        assert t2.zero_copy
        del b2
        gc.collect()
        stats = ring.stats()
        assert stats["staging_destroyed"] == 5 and stats["pooled_bytes"] == 640 << 10  # chunks out, it in
        t3, b3 = auto_download(dev, ring, buf)
        assert t3.zero_copy and t3.buffers == t2.buffers
        np.testing.assert_array_equal(b3, a)
        del b3


def test_default_pool_cap_grows_to_the_largest_transfer(dev: Device, monkeypatch: pytest.MonkeyPatch) -> None:
    """A round trip larger than the default cap still reuses its staging on the next round."""
    monkeypatch.setattr("hetero._gpu.staging.DEFAULT_POOLED_BYTES", 128 << 10)
    a = data((AUTO_N,), np.uint8)  # five chunks each way: 640 KiB of staging
    for cap, grows in ((None, True), (128 << 10, False)):
        with StagingRing(dev.device, copy_threads=2, chunk_bytes=CHUNK, max_pooled_bytes=cap) as ring:
            assert ring.max_pooled_bytes == 128 << 10
            counts = []
            for _ in range(3):
                np.testing.assert_array_equal(round_trip(dev, ring, a), a)
                counts.append(ring.stats()["staging_allocations"])
            assert ring.max_pooled_bytes == (640 << 10 if grows else 128 << 10)
            assert (counts[2] == counts[0]) == grows  # a fixed cap too small recreates chunks every time


def test_staging_maps_are_bound_to_no_event_loop(shared_rt: hetero.Runtime) -> None:
    """A map requested on an event loop's thread and resolved by a device poll after that
    loop ended must not call into it (trio raised RunFinishedError inside the poll when
    maps went through wgpu-py's promises); every map of hetero's is its own."""
    import trio

    from hetero._gpu.bufmap import request_map

    dev = shared_rt.device()
    buf = dev.device.create_buffer(size=256, usage=wgpu.BufferUsage.MAP_WRITE | wgpu.BufferUsage.COPY_SRC)

    async def make() -> object:
        return request_map(buf, "WRITE")

    request = trio.run(make)
    request.wait()  # type: ignore[attr-defined]
    assert buf.map_state == "mapped"
    buf.unmap()
    buf.destroy()
    hetero_dir = Path(hetero.__file__).parent
    direct = [f"{p.relative_to(hetero_dir)}:{i}" for p in sorted(hetero_dir.rglob("*.py"))
              for i, line in enumerate(p.read_text().splitlines(), 1)
              if (".map_async(" in line or (".map_sync(" in line and p.parent.name == "_gpu"))
              and not line.lstrip().startswith("#")]
    assert direct == []  # every map of hetero's goes through request_map


def test_upload_many_shares_one_staging_buffer(dev: Device, ring: StagingRing) -> None:
    """Several small arrays through one staging buffer: each lands at its destination, pads are zeros."""
    arrays = [data((3,), np.uint8, 1), data((5, 3), np.float64, 2)[:, ::2], data((0,), np.int32),
              data((7,), np.int32, 3), np.asfortranarray(data((4, 3), np.float32, 4))]
    bufs = [new_buffer(dev, a.nbytes + 8) for a in arrays]
    for b in bufs:  # a previous transfer's bytes where the pads go
        upload(dev, ring, np.full(b.size, 0xAB, np.uint8), b)
    enc = dev.device.create_command_encoder()
    t = ring.upload_many(enc, [(a, b, 4) for a, b in zip(arrays, bufs)])
    assert_unmapped(t)
    assert len(t.buffers) == 1 and t.nbytes == sum(a.nbytes for a in arrays)
    submit_wait(dev, enc)
    t.complete()
    for a, b in zip(arrays, bufs):
        got = download(dev, ring, b, 4, (pad4(a.nbytes),), np.uint8)
        assert got[:a.nbytes].tobytes() == np.ascontiguousarray(a).tobytes()
        assert not got[a.nbytes:].any()
    with pytest.raises(ValueError, match="one staging buffer"):
        ring.upload_many(dev.device.create_command_encoder(), [(np.zeros(CHUNK, np.uint8), new_buffer(dev, CHUNK), 0),
                                                                (np.zeros(4, np.uint8), bufs[0], 0)])


# -- small uploads through the queue ------------------------------------------------------------------------
_SCALE = """
@group(0) @binding(0) var<storage, read> src: array<f32>;
@group(0) @binding(1) var<storage, read_write> dst: array<f32>;
@group(0) @binding(2) var<uniform> k: vec4<f32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) { dst[gid.x] = src[gid.x] * k.x; }
"""


def _scaled(gpu: hetero.GPUContext, src: hetero.Tensor, k: float) -> hetero.Tensor:
    out = gpu.empty((64,), np.float32)
    gpu.dispatch(_SCALE, 1, src, out, np.array([k, 0, 0, 0], np.float32))
    return out


@pytest.mark.anyio
async def test_small_uploads_are_queue_writes_only_while_nothing_recorded_waits(monkeypatch: pytest.MonkeyPatch
                                                                             ) -> None:
    """A stage's small uploads are queue writes (no staging buffer) when the shared encoder is
    empty and no command buffer waits to be submitted. Otherwise they are staging copies ordered
    after the commands before them in the encoder: here the second stage's upload lands in the
    block that the first stage used as a temporary and released when it committed (a queue
    write would land before the first stage's commands and be overwritten by them)."""
    from hetero._gpu.recorder import SharedRecorder

    taken: list[bool] = []
    real = SharedRecorder.write_now

    def spy(self: SharedRecorder, items: list[Any]) -> bool:
        taken.append(real(self, items))
        return taken[-1]

    monkeypatch.setattr(SharedRecorder, "write_now", spy)
    places: list[tuple[Any, int]] = []

    def first(gpu: hetero.GPUContext, x: hetero.Tensor) -> hetero.Tensor:
        t = _scaled(gpu, x, 3.0)  # a temporary: back in the pool when this stage commits
        places.append((t.buffer, t.offset))
        return _scaled(gpu, t, 1.0)

    def second(gpu: hetero.GPUContext, y: hetero.Tensor, z: hetero.Tensor) -> tuple[hetero.Tensor, hetero.Tensor]:
        places.append((z.buffer, z.offset))
        return _scaled(gpu, y, 1.0), _scaled(gpu, z, 1.0)

    g = hetero.Graph("queue-writes")
    g.output(g.gpu(second, g.gpu(first, g.input("x"), name="first"), g.input("z"), name="second"))
    x, z = np.arange(64, dtype=np.float32), np.full(64, 7.0, np.float32)
    async with hetero.Runtime(gpu_threads=1) as rt:
        for _ in range(3):
            taken.clear()
            y_out, z_out = await rt.run(g, x=x, z=z)
            np.testing.assert_array_equal(y_out, 3 * x)
            np.testing.assert_array_equal(z_out, z)
            assert taken == [True, False]  # x: nothing recorded yet; z: the first stage's commands wait
    # In the first run (the pool hands out the block freed last) z took the temporary's block:
    # the hazard the rule guards against was there. Later runs' uploads prefer their earlier blocks.
    assert places[1] == places[0]


@pytest.mark.anyio
async def test_queue_writes_of_any_dtype_and_size_round_trip(shared_rt: hetero.Runtime,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A queue write moves whole 4-byte words: arrays of other sizes are padded with zeros on
    the host; strided arrays are compacted first."""
    from hetero._gpu.recorder import SharedRecorder

    taken: list[bool] = []
    real = SharedRecorder.write_now
    monkeypatch.setattr(SharedRecorder, "write_now",
                        lambda self, items: taken.append(real(self, items)) or taken[-1])

    def same(gpu: hetero.GPUContext, a: hetero.Tensor) -> hetero.Tensor:
        return a

    g = hetero.Graph("round-trip")
    g.output(g.gpu(same, g.input("a"), name="same"))
    cases = [np.arange(5, dtype=np.uint8), np.arange(3, dtype=np.int16) - 7, np.arange(12.0)[::3],
             np.arange(30, dtype=np.float32).reshape(5, 6)[:, 1:4], np.array([True, False, True])]
    for a in cases:
        got = await shared_rt.run(g, a=a)
        assert got.dtype == a.dtype and got.shape == a.shape
        np.testing.assert_array_equal(got, a)
    assert taken and all(taken)
