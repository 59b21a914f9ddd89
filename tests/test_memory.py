"""The device-memory pool (hetero._gpu.pool) on a real wgpu device."""

from __future__ import annotations

import random
import sys
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import wgpu

from hetero._gpu.device import select_adapter
from hetero._gpu.pool import (
    Block,
    BufferPool,
    MemoryWait,
    OutOfMemoryError,
    default_budget,
    size_class,
)
from hetero.errors import GPUError, RuntimeClosedError

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
STORAGE = int(wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST)
UNIFORM = int(wgpu.BufferUsage.UNIFORM | wgpu.BufferUsage.COPY_DST)
READBACK = int(wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST)


@pytest.fixture(scope="module")
def device() -> Any:
    return select_adapter().request_device_sync()


@pytest.fixture
def pool(device: Any) -> Iterator[BufferPool]:
    # Slabs of storage buffers enabled, to exercise the slab allocator (the runtime
    # keeps them off: see test_storage_blocks_get_buffers_of_their_own).
    p = BufferPool(device, slab_storage=True)
    yield p
    p.close()


def test_storage_blocks_get_buffers_of_their_own(device: Any) -> None:
    """WebGPU tracks usage per buffer: two storage blocks of one slab in one dispatch would conflict."""
    pool = BufferPool(device)
    blocks = [pool.acquire(1000, STORAGE) for _ in range(4)]
    assert len({id(b.buffer) for b in blocks}) == 4 and all(b.offset == 0 for b in blocks)
    uniforms = [pool.acquire(100, UNIFORM) for _ in range(4)]
    assert len({id(b.buffer) for b in uniforms}) == 1  # read-only usages still share slabs
    pool.close()


def overlaps(a: Block, b: Block) -> bool:
    return a.buffer is b.buffer and a.offset < b.offset + b.size and b.offset < a.offset + a.size


# -- classes and reuse ---------------------------------------------------------------------
def test_same_size_and_same_class_requests_reuse_memory(pool: BufferPool) -> None:
    a = pool.acquire(1000, STORAGE)
    pool.release(a)
    b = pool.acquire(1000, STORAGE)  # same size
    pool.release(b)
    c = pool.acquire(800, STORAGE)  # same class (1024)
    assert (a.size, c.size) == (1024, 1024)
    assert c.buffer is a.buffer
    pool.release(c)
    big = pool.acquire(300_000, STORAGE)
    pool.release(big)
    big2 = pool.acquire(290_000, STORAGE)  # both in the 320 KiB class
    assert big2.buffer is big.buffer and big2.size == 320 * KiB
    pool.release(big2)
    s = pool.stats()
    assert (s.allocations, s.reuses) == (2, 3)


def test_different_usages_are_never_mixed(pool: BufferPool) -> None:
    a = pool.acquire(512, STORAGE)
    b = pool.acquire(512, UNIFORM)
    assert a.buffer is not b.buffer
    assert (a.usage, b.usage) == (STORAGE, UNIFORM)
    assert a.buffer.usage == STORAGE and b.buffer.usage == UNIFORM
    pool.release(a)
    c = pool.acquire(512, UNIFORM)  # a's slab is free but has the wrong usage
    assert c.buffer is b.buffer and c.buffer is not a.buffer
    assert pool.stats().allocations == 2


def test_small_blocks_are_carved_from_one_slab(pool: BufferPool) -> None:
    blocks = [pool.acquire(1000, STORAGE) for _ in range(64)]
    s = pool.stats()
    assert s.allocations == 1 and s.reuses == 63
    assert len({id(b.buffer) for b in blocks}) == 1
    assert blocks[0].buffer.size == pool.slab_bytes == 1 * MiB
    offsets = [b.offset for b in blocks]
    assert len(set(offsets)) == 64
    assert all(o % 256 == 0 and o % pool.min_class == 0 for o in offsets)
    assert all(b.offset + b.size <= b.buffer.size for b in blocks)
    assert not any(overlaps(x, y) for i, x in enumerate(blocks) for y in blocks[i + 1:])
    assert s.in_use_bytes == 64 * 1024 and s.requested_bytes == 64 * 1000
    assert s.device_bytes == 1 * MiB and s.pooled_bytes == 1 * MiB - 64 * 1024


def test_min_class_follows_the_device_alignment(device: Any) -> None:
    pool = BufferPool(device, limits={"min-storage-buffer-offset-alignment": 512})
    try:
        assert pool.min_class == 512
        blocks = [pool.acquire(4, STORAGE) for _ in range(3)]
        assert [b.size for b in blocks] == [512] * 3
        assert [b.offset % 512 for b in blocks] == [0, 0, 0]
    finally:
        pool.close()
    assert BufferPool(device).min_class == max(256, device.limits["min-storage-buffer-offset-alignment"])


def test_large_classes_bound_waste_by_a_quarter(pool: BufferPool) -> None:
    rng = random.Random(1)
    sizes = [rng.randrange(64 * KiB + 1, 1 * GiB) for _ in range(2000)]
    sizes += [(1 << k) + d for k in range(17, 30) for d in (-1, 0, 1)]
    for n in sizes:
        c = size_class(n)
        assert n <= c < 1.25 * n, n
        assert c % 256 == 0
    assert size_class(1 << 20) == 1 << 20
    assert size_class((1 << 20) + 1) == 1280 * KiB
    assert [size_class(n) for n in (1, 256, 257, 64 * KiB)] == [256, 256, 512, 64 * KiB]
    b = pool.acquire(100_000, STORAGE)  # a large block: its own buffer
    assert (b.offset, b.size, b.buffer.size) == (0, 112 * KiB, 112 * KiB)


def test_request_above_max_buffer_size_is_a_value_error(device: Any) -> None:
    pool = BufferPool(device, limits={"max-buffer-size": 1 * MiB})
    with pytest.raises(ValueError) as e:
        pool.acquire(2 * MiB, STORAGE)
    assert str(e.value) == "a buffer of 2097152 bytes exceeds the adapter's max-buffer-size of 1048576 bytes"
    # A request that fits is capped at the limit, not rounded past it.
    b = pool.acquire(1 * MiB - 1000, STORAGE)
    assert b.size <= 1 * MiB
    pool.close()


# -- reference counts ----------------------------------------------------------------------
def test_refcounts_and_double_release(pool: BufferPool) -> None:
    b = pool.acquire(4096, STORAGE)
    assert b.refcount == 1
    assert pool.retain(b) is b and b.refcount == 2
    pool.release(b)
    assert pool.stats().in_use_bytes == 4096  # one owner left
    pool.release(b)
    assert pool.stats().in_use_bytes == 0
    with pytest.raises(RuntimeError, match=r"cannot release a block that was already released"):
        pool.release(b)
    with pytest.raises(RuntimeError, match=r"cannot retain a block that was already released"):
        pool.retain(b)
    # The failed release did not hand the block out twice.
    x, y = pool.acquire(4096, STORAGE), pool.acquire(4096, STORAGE)
    assert not overlaps(x, y)
    assert pool.stats().in_use_bytes == 8192


def test_release_many_under_one_lock_runs_waiters_once(pool: BufferPool) -> None:
    """release_many: every block released (a retained one keeps its other reference), on_free
    callbacks run once; a list releasing a block more often than it has references, or naming
    a released one, is refused before any block is released."""
    a, b, c = (pool.acquire(4096, STORAGE) for _ in range(3))
    pool.retain(c)
    woken: list[str] = []
    pool.on_free(lambda: woken.append("free"))
    with pytest.raises(RuntimeError, match=r"cannot release a block 2 times with 1 reference"):
        pool.release_many([a, b, a])
    assert (a.refcount, b.refcount) == (1, 1) and pool.stats().in_use_bytes == 3 * 4096 and woken == []
    pool.release_many([a, b, c])
    assert (a.refcount, b.refcount, c.refcount) == (0, 0, 1)
    assert pool.stats().in_use_bytes == 4096 and pool.stats().blocks_in_use == 1 and woken == ["free"]
    with pytest.raises(RuntimeError, match=r"already released"):
        pool.release_many([c, a])
    assert c.refcount == 1
    pool.on_free(lambda: woken.append("again"))
    pool.release_many([c])
    assert pool.stats().in_use_bytes == 0 and woken == ["free", "again"]
    pool.release_many([])  # nothing to do: no callback, no error
    # the released blocks are handed out again, each once
    x, y, z = (pool.acquire(4096, STORAGE) for _ in range(3))
    assert not overlaps(x, y) and not overlaps(y, z) and not overlaps(x, z)


def test_blocks_of_another_pool_are_refused(device: Any, pool: BufferPool) -> None:
    other = BufferPool(device)
    b = other.acquire(10, STORAGE)
    with pytest.raises(RuntimeError, match="another buffer pool"):
        pool.release(b)
    other.release(b)
    other.close()


# -- budget ----------------------------------------------------------------------------------
def test_memory_wait_when_over_budget_then_trim_to_make_room(device: Any) -> None:
    pool = BufferPool(device, budget_bytes=1 * MiB)
    a = pool.acquire(512 * KiB, STORAGE)  # class 512 KiB
    b = pool.acquire(400 * KiB, STORAGE)  # class 448 KiB
    with pytest.raises(MemoryWait) as e:
        pool.acquire(256 * KiB, STORAGE, stage="encode")
    assert (e.value.nbytes, e.value.stage, e.value.needed) == (256 * KiB, "encode", 256 * KiB)
    assert str(e.value) == "stage 'encode' waits for 256.0 KiB of device memory: 960.0 KiB of the 1.0 MiB budget are held"
    s = pool.stats()
    assert (s.waits, s.allocations, s.device_bytes) == (1, 2, 960 * KiB)
    woken: list[str] = []
    pool.on_free(lambda: woken.append("retry"), after=e.value.generation)
    assert woken == []
    pool.release(a)
    assert woken == ["retry"]
    # The retry fits once the free 512 KiB buffer is destroyed to make room.
    c = pool.acquire(256 * KiB, STORAGE, stage="encode")
    s = pool.stats()
    assert (s.allocations, s.device_bytes, s.in_use_bytes, s.pooled_bytes) == (3, 704 * KiB, 704 * KiB, 0)
    assert a.buffer is not c.buffer
    pool.release(b)
    pool.release(c)
    pool.close()


def test_memory_wait_keeps_the_cache_when_trimming_cannot_help(device: Any) -> None:
    pool = BufferPool(device, budget_bytes=1 * MiB)
    a = pool.acquire(768 * KiB, STORAGE)
    small = pool.acquire(100 * KiB, STORAGE)
    pool.release(small)
    with pytest.raises(MemoryWait):
        pool.acquire(300 * KiB, STORAGE)  # 768 + 320 > 1024 even without the free 112
    assert pool.stats().pooled_bytes == 112 * KiB  # nothing was destroyed in vain
    pool.release(a)
    pool.close()


def test_on_free_after_a_release_since_the_refusal_runs_at_once(device: Any) -> None:
    pool = BufferPool(device, budget_bytes=1 * MiB)
    a = pool.acquire(768 * KiB, STORAGE)
    with pytest.raises(MemoryWait) as e:
        pool.acquire(512 * KiB, STORAGE)
    pool.release(a)  # released before the scheduler got to register
    woken: list[int] = []
    pool.on_free(lambda: woken.append(1), after=e.value.generation)
    assert woken == [1]
    pool.close()


def test_overcommit_allocates_past_the_budget(device: Any) -> None:
    pool = BufferPool(device, budget_bytes=1 * MiB)
    a = pool.acquire(768 * KiB, STORAGE)
    spare = pool.acquire(100 * KiB, STORAGE)
    pool.release(spare)
    b = pool.acquire(512 * KiB, STORAGE, stage="oldest", overcommit=True)
    s = pool.stats()
    # The free buffer went first, to keep the overshoot small.
    assert (s.device_bytes, s.pooled_bytes, s.overcommits, s.waits) == (1280 * KiB, 0, 1, 0)
    assert s.device_bytes > s.budget_bytes
    with pytest.raises(MemoryWait):
        pool.acquire(64 * KiB + 1, STORAGE)  # younger runs wait while over budget
    pool.release(a)
    pool.release(b)
    pool.close()


def test_request_larger_than_the_budget_is_out_of_memory(device: Any) -> None:
    pool = BufferPool(device, budget_bytes=2 * GiB, limits={"max-buffer-size": 1 << 40})
    for overcommit in (False, True):
        with pytest.raises(OutOfMemoryError) as e:
            pool.acquire(3 * GiB, STORAGE, stage="encode", overcommit=overcommit)
        assert str(e.value) == (
            "stage 'encode' needs a buffer of 3.0 GiB (3221225472 bytes), more than the memory budget of "
            "2.0 GiB (2147483648 bytes); raise Runtime(memory_budget=...) or split the work"
        )
        assert isinstance(e.value, GPUError)
    with pytest.raises(OutOfMemoryError, match=r"^a request needs a buffer of 2\.5 GiB"):
        pool.acquire(5 * GiB // 2, STORAGE)
    s = pool.stats()
    assert (s.allocations, s.device_bytes, s.waits) == (0, 0, 0)
    pool.close()


def test_budget_default_and_validation(device: Any) -> None:
    pool = BufferPool(device)
    assert pool.stats().budget_bytes == min(8 * GiB, 4 * device.limits["max-buffer-size"])
    assert default_budget({"max-buffer-size": 256 * MiB}) == 1 * GiB
    assert default_budget({"max-buffer-size": 1 << 40}) == 8 * GiB
    with pytest.raises(ValueError, match="the memory budget must be a positive number of bytes, got 0"):
        BufferPool(device, budget_bytes=0)
    with pytest.raises(ValueError, match="non-negative number of bytes, got -1"):
        pool.acquire(-1, STORAGE)
    pool.close()


def test_budget_that_cannot_hold_a_class_gets_an_exact_buffer(device: Any) -> None:
    pool = BufferPool(device, budget_bytes=100 * KiB)
    b = pool.acquire(90 * KiB, STORAGE)  # class 96 KiB fits; 100 KiB budget
    assert b.size == 96 * KiB
    pool.release(b)
    pool.trim()
    c = pool.acquire(99 * KiB, STORAGE)  # class 112 KiB would not fit: the request rounded to 256
    assert c.size == 99 * KiB
    pool.close()


# -- statistics, trim, callbacks ---------------------------------------------------------------
def test_stats_after_release_and_trim(pool: BufferPool) -> None:
    blocks = [pool.acquire(n, STORAGE) for n in (100, 5000, 70_000, 1 * MiB)]
    s = pool.stats()
    assert s.in_use_bytes == 256 + 8 * KiB + 80 * KiB + 1 * MiB == s.peak_bytes
    assert s.blocks_in_use == 4 and s.buffers == 4
    for b in blocks:
        pool.release(b)
    s = pool.stats()
    assert (s.in_use_bytes, s.blocks_in_use, s.requested_bytes) == (0, 0, 0)
    assert s.peak_bytes == 256 + 8 * KiB + 80 * KiB + 1 * MiB
    assert s.pooled_bytes == s.device_bytes == 2 * MiB + 80 * KiB + 1 * MiB
    pool.reset_peak()
    assert pool.stats().peak_bytes == 0
    keep = pool.acquire(100, STORAGE)  # keeps its slab alive through the trim
    assert pool.trim() == 1 * MiB + 80 * KiB + 1 * MiB
    s = pool.stats()
    assert (s.device_bytes, s.buffers, s.in_use_bytes) == (1 * MiB, 1, 256)
    pool.release(keep)
    assert pool.trim() == 1 * MiB
    s = pool.stats()
    assert (s.pooled_bytes, s.device_bytes, s.buffers) == (0, 0, 0)
    assert pool.trim() == 0
    assert pool.stats().allocations == 4


def test_on_free_callbacks_fire_once(pool: BufferPool) -> None:
    calls: list[str] = []
    a, b = pool.acquire(10, STORAGE), pool.acquire(10, STORAGE)
    pool.on_free(lambda: calls.append("first"))

    def broken() -> None:
        raise ValueError("callback bug")

    pool.on_free(broken)  # a failing callback does not stop the others
    pool.on_free(lambda: calls.append("second"))
    pool.retain(a)
    pool.release(a)  # refcount 2 -> 1: nothing returned to the pool yet
    assert calls == []
    pool.release(a)
    assert calls == ["first", "second"]
    pool.release(b)
    assert calls == ["first", "second"]


def test_mappable_usages_get_their_own_buffers(pool: BufferPool) -> None:
    a, b = pool.acquire(64, READBACK), pool.acquire(64, READBACK)
    assert a.buffer is not b.buffer and a.offset == b.offset == 0
    a.buffer.map_sync("READ")
    with pytest.raises(RuntimeError, match="cannot release a block whose buffer is mapped; unmap it first"):
        pool.release(a)
    a.buffer.unmap()
    pool.release(a)
    pool.release(b)
    assert pool.stats().in_use_bytes == 0


def test_close_destroys_everything(device: Any) -> None:
    pool = BufferPool(device)
    live = pool.acquire(10, STORAGE)
    pool.release(pool.acquire(1 * MiB, STORAGE))
    woken: list[int] = []
    pool.on_free(lambda: woken.append(1))
    pool.close()
    assert woken == [1]  # parked stages wake up (and find the pool closed)
    assert pool.stats().device_bytes == 0
    with pytest.raises(RuntimeClosedError, match="the buffer pool is closed"):
        pool.acquire(10, STORAGE)
    pool.release(live)  # late releases at shutdown are harmless
    assert pool.stats().in_use_bytes == 0
    pool.close()  # idempotent


# -- threads ---------------------------------------------------------------------------------
def test_threads_acquire_and_release_concurrently(pool: BufferPool) -> None:
    live: dict[int, list[Block]] = {}  # id(buffer) -> live blocks in it
    book = threading.Lock()
    errors: list[str] = []

    def check_in(b: Block) -> None:
        with book:
            if b.offset % 256 or b.offset + b.size > b.buffer.size or b.nbytes > b.size:
                errors.append(f"bad block {b!r}")
            mates = live.setdefault(id(b.buffer), [])
            errors.extend(f"{b!r} overlaps {m!r}" for m in mates if overlaps(b, m))
            mates.append(b)

    def check_out(b: Block) -> None:
        with book:
            live[id(b.buffer)].remove(b)

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        held: list[Block] = []
        try:
            for _ in range(500):
                if held and (len(held) >= 6 or rng.random() < 0.5):
                    b = held.pop(rng.randrange(len(held)))
                    if b.refcount == 1:
                        check_out(b)
                    pool.release(b)
                    continue
                n = rng.choice((rng.randrange(1, 4 * KiB), rng.randrange(1, 64 * KiB), rng.randrange(1, 300 * KiB)))
                usage = STORAGE if rng.random() < 0.8 else UNIFORM
                b = pool.acquire(n, usage)
                check_in(b)
                held.append(b)
                if rng.random() < 0.1:
                    held.append(pool.retain(b))
            for b in held:
                if b.refcount == 1:
                    check_out(b)
                pool.release(b)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often, to interleave inside acquire and release
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    s = pool.stats()
    assert (s.in_use_bytes, s.blocks_in_use, s.requested_bytes) == (0, 0, 0)
    assert s.pooled_bytes == s.device_bytes
    assert s.reuses > s.allocations
    pool.trim()
    assert pool.stats().device_bytes == 0


# -- on the device ---------------------------------------------------------------------------
DOUBLE_PLUS_ONE = """
@group(0) @binding(0) var<storage, read_write> data: array<u32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) id: vec3<u32>) {
    if (id.x < arrayLength(&data)) {
        data[id.x] = data[id.x] * 2u + 1u;
    }
}
"""


def test_pooled_block_binds_at_its_offset_in_a_dispatch(device: Any, pool: BufferPool) -> None:
    n = 75  # 300 bytes in a 512-byte class: the binding covers the data, not the block
    blocks = [pool.acquire(n * 4, STORAGE) for _ in range(3)]
    slab = blocks[0].buffer
    assert all(b.buffer is slab for b in blocks) and blocks[1].offset > 0
    sentinel = np.full(slab.size // 4, 0xDEADBEEF, np.uint32)
    device.queue.write_buffer(slab, 0, sentinel)
    for i, b in enumerate(blocks):
        device.queue.write_buffer(b.buffer, b.offset, np.arange(n, dtype=np.uint32) + 1000 * i)

    module = device.create_shader_module(code=DOUBLE_PLUS_ONE)
    pipeline = device.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": "main"})
    target = blocks[1]
    assert target.binding == {"buffer": slab, "offset": target.offset, "size": 300}
    bind_group = device.create_bind_group(
        layout=pipeline.get_bind_group_layout(0), entries=[{"binding": 0, "resource": target.binding}]
    )
    encoder = device.create_command_encoder()
    cpass = encoder.begin_compute_pass()
    cpass.set_pipeline(pipeline)
    cpass.set_bind_group(0, bind_group)
    cpass.dispatch_workgroups(2)  # 128 invocations: arrayLength must stop them at 75
    cpass.end()
    device.queue.submit([encoder.finish()])

    out = np.frombuffer(device.queue.read_buffer(slab, 0, 3 * 512), np.uint32).reshape(3, 128)
    base = np.arange(n, dtype=np.uint32)
    np.testing.assert_array_equal(out[0, :n], base)
    np.testing.assert_array_equal(out[1, :n], (base + 1000) * 2 + 1)
    np.testing.assert_array_equal(out[2, :n], base + 2000)
    assert (out[:, n:] == 0xDEADBEEF).all()  # nothing written past any block's data


def test_acquire_many_takes_preferred_buffers_when_free(device: Any) -> None:
    """A replay asks for the buffers of the previous one: it gets each that is free, others as acquire would."""
    pool = BufferPool(device)
    first = [pool.acquire(n, STORAGE) for n in (1000, 1000, 5000)]
    for b in first:
        pool.release(b)
    busy = pool.acquire(1000, STORAGE)  # takes one of the two 1000-byte buffers
    requests = [(n, *pool.placement(n, STORAGE)) for n in (1000, 1000, 5000)]
    out: list[Block] = []
    pool.acquire_many(requests, STORAGE, out, prefer=[b.buffer for b in first])
    assert [b.nbytes for b in out] == [1000, 1000, 5000]
    free_one = next(b.buffer for b in first[:2] if b.buffer is not busy.buffer)
    assert free_one in (out[0].buffer, out[1].buffer)
    assert out[2].buffer is first[2].buffer
    assert len({id(b.buffer) for b in [*out, busy]}) == 4  # the busy one's was not handed out twice
    s = pool.stats()
    assert (s.blocks_in_use, s.in_use_bytes, s.requested_bytes) == (4, 3 * 1024 + 8192, 3000 + 5000)
    for b in [*out, busy]:
        pool.release(b)
    assert pool.stats().blocks_in_use == 0
    pool.close()


def test_acquire_many_refused_by_the_budget_leaves_what_it_took_to_the_caller(device: Any) -> None:
    pool = BufferPool(device, budget_bytes=1 * MiB)
    requests = [(n, *pool.placement(n, STORAGE)) for n in (512 * KiB, 400 * KiB, 256 * KiB)]
    out: list[Block] = []
    with pytest.raises(MemoryWait):
        pool.acquire_many(requests, STORAGE, out, stage="s")
    assert [b.nbytes for b in out] == [512 * KiB, 400 * KiB]
    for b in out:
        pool.release(b)
    assert pool.stats().blocks_in_use == 0
    with pytest.raises(OutOfMemoryError):
        pool.acquire_many([(2 * MiB, *pool.placement(2 * MiB, STORAGE))], STORAGE, out, stage="s")
    pool.close()
