"""Uniform buffers and bind groups reused across dispatches (``hetero._gpu.bindcache``), on a real device."""

from __future__ import annotations

import numpy as np
import pytest
import wgpu

import hetero
from hetero import Tensor
from hetero._gpu.bindcache import BindCache
from hetero._gpu.grid import CostModel

pytestmark = pytest.mark.anyio

ADD = """
@group(0) @binding(0) var<storage, read> a: array<f32>;
@group(0) @binding(1) var<storage, read_write> out: array<f32>;
struct P { k: f32, n: u32 }
@group(0) @binding(2) var<uniform> p: P;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (gid.x < p.n) { out[gid.x] = a[gid.x] + p.k; }
}
"""


def add(gpu: hetero.GPUContext, a: Tensor, k: float = 1.0) -> Tensor:
    out = gpu.empty(a.shape, np.float32)
    gpu.dispatch(ADD, (a.size + 63) // 64, a, out, np.array([(k, a.size)], dtype=[("k", "<f4"), ("n", "<u4")]))
    return out


def chain(n: int) -> hetero.Graph:
    """
    ::

        x -> add0 -> add1 -> ... -> add{n-1}     (each adds 1)
    """
    g = hetero.Graph(f"bind-chain-{n}")
    v = g.input("x")
    for i in range(n):
        v = g.gpu(add, v, name=f"add{i}")
    g.output(v)
    return g


async def test_repeated_runs_reuse_uniforms_and_bind_groups(rt: hetero.Runtime) -> None:
    g, x = chain(6), np.arange(100, dtype=np.float32)
    np.testing.assert_array_equal(await rt.run(g, x=x), x + 6)
    binds = rt.device().binds
    first = binds.stats()
    assert first["uniforms"] == 1  # six dispatches, one parameter block: one uniform buffer
    for _ in range(3):
        np.testing.assert_array_equal(await rt.run(g, x=x), x + 6)
    again = binds.stats()
    assert again["misses"] == first["misses"]  # same pooled buffers, same parameters: all hits
    assert again["hits"] >= first["hits"] + 18
    assert again["bind_groups"] == first["bind_groups"] and again["uniforms"] == 1


async def test_trimmed_buffers_drop_their_bind_groups(rt: hetero.Runtime) -> None:
    """A cached group over a destroyed buffer would abort the process at submit: trim forgets them."""
    g, x = chain(4), np.ones(1000, np.float32)
    np.testing.assert_array_equal(await rt.run(g, x=x), x + 4)
    binds = rt.device().binds
    assert binds.stats()["bind_groups"] > 0
    assert rt.trim() > 0
    assert binds.stats()["bind_groups"] == 0  # every cached group bound a pooled buffer
    for _ in range(2):  # fresh buffers, fresh groups, right answers
        np.testing.assert_array_equal(await rt.run(g, x=x), x + 4)
    assert rt.memory_stats().in_use_bytes == 0


async def test_buffers_hetero_does_not_own_are_never_cached(rt: hetero.Runtime) -> None:
    dev = rt.device()
    own = dev.device.create_buffer_with_data(data=np.full(64, 5, np.float32), usage=wgpu.BufferUsage.STORAGE)
    foreign = Tensor(own, (64,), np.float32)

    def stage(gpu: hetero.GPUContext) -> Tensor:
        return add(gpu, foreign, 2.0)

    g = hetero.Graph("foreign")
    g.output(g.gpu(stage, name="stage"))
    before = dev.binds.stats()["misses"]
    for _ in range(3):
        np.testing.assert_array_equal(await rt.run(g), np.full(64, 7, np.float32))
    assert dev.binds.stats()["misses"] == before + 3  # a fresh (validated) group every time
    own.destroy()
    with pytest.raises(hetero.StageError, match="stage 'stage'"):
        await rt.run(g)  # wgpu refuses the destroyed buffer when the group is made: no abort
    assert rt.memory_stats().in_use_bytes == 0

    # the same data as a resident constant is cached against
    def resident_stage(gpu: hetero.GPUContext) -> Tensor:
        t = cache.get("t")
        if t is None:
            t = cache["t"] = gpu.resident(np.full(64, 5, np.float32))
        return add(gpu, t, 2.0)

    cache: dict[str, Tensor] = {}
    g2 = hetero.Graph("resident")
    g2.output(g2.gpu(resident_stage, name="stage"))
    np.testing.assert_array_equal(await rt.run(g2), np.full(64, 7, np.float32))
    misses = dev.binds.stats()["misses"]
    np.testing.assert_array_equal(await rt.run(g2), np.full(64, 7, np.float32))
    assert dev.binds.stats()["misses"] == misses


async def test_ever_new_sizes_keep_the_caches_within_their_bounds(rt: hetero.Runtime) -> None:
    """Every new tensor size brings new buffers and parameters, so new bind groups and uniforms:
    the LRU bounds hold both tables (evicting a uniform drops the groups that bind it), and
    answers stay right over groups made again after eviction."""
    g = chain(3)
    binds = rt.device().binds
    binds.max_groups, binds.max_uniforms = 8, 16
    sizes = [int(n) for n in np.random.default_rng(5).permutation(np.arange(1, 400, 7))]
    for n in sizes + sizes[:10]:  # the first sizes again, after their entries were evicted
        x = np.arange(n, dtype=np.float32)
        np.testing.assert_array_equal(await rt.run(g, x=x), x + 3)
        s = binds.stats()
        assert s["bind_groups"] <= 8 and s["uniforms"] <= 16, (n, s)
    assert binds.stats()["misses"] >= len(sizes)  # every size made groups of its own
    assert rt.memory_stats().in_use_bytes == 0


def test_lru_bounds_and_forget(shared_rt: hetero.Runtime) -> None:
    dev = shared_rt.device()
    cache = BindCache(dev.device, max_uniforms=2, max_groups=2)
    k = dev.kernel(ADD, label="bind-lru")
    bufs = [dev.device.create_buffer(size=256, usage=wgpu.BufferUsage.STORAGE) for _ in range(4)]
    for b in bufs:
        cache.keep(b)
    u = cache.uniform(bytes(16))
    assert cache.uniform(bytes(16)) is u and cache.stats()["uniforms"] == 1
    for i in range(3):
        cache.bind_group("k", k.layouts[0], [(bufs[i], 0, 256), (bufs[3], 0, 256), (u, 0, 16)])
    assert cache.stats()["bind_groups"] == 2  # the oldest was evicted
    g = cache.bind_group("k", k.layouts[0], [(bufs[2], 0, 256), (bufs[3], 0, 256), (u, 0, 16)])
    assert cache.bind_group("k", k.layouts[0], [(bufs[2], 0, 256), (bufs[3], 0, 256), (u, 0, 16)]) is g
    cache.forget([bufs[3]])  # binds every cached group
    assert cache.stats()["bind_groups"] == 0
    # a forgotten buffer is no longer cached against
    a = cache.bind_group("k", k.layouts[0], [(bufs[0], 0, 256), (bufs[3], 0, 256), (u, 0, 16)])
    assert cache.bind_group("k", k.layouts[0], [(bufs[0], 0, 256), (bufs[3], 0, 256), (u, 0, 16)]) is not a
    # evicting a uniform drops the groups that bind it
    cache.bind_group("k", k.layouts[0], [(bufs[0], 0, 256), (bufs[1], 0, 256), (u, 0, 16)])
    assert cache.stats()["bind_groups"] == 1
    cache.uniform(bytes(range(16)))
    cache.uniform(bytes(range(1, 17)))
    assert cache.stats() == {**cache.stats(), "uniforms": 2, "bind_groups": 0}
    for b in bufs:
        b.destroy()


def test_calibration_timestamps_are_sampled() -> None:
    now = [100.0]
    cost = CostModel(clock=lambda: now[0])
    timed = [cost.should_time("k") for _ in range(200)]
    assert timed[:9] == [True] * 9 and sum(timed) == 9  # the first 8, then the first after them
    now[0] += 0.5
    assert not cost.should_time("k")  # within a second of the last sample
    now[0] += 0.6
    assert cost.should_time("k") and not cost.should_time("k")  # a second on: one more sample
    assert cost.should_time("other")  # per kernel


def test_bind_groups_made_straight_through_wgpu_native_bind_ranges_and_raise_on_bad_input(
        shared_rt: hetero.Runtime) -> None:
    """create_bind_group (wgpuDeviceCreateBindGroup, not wgpu-py's struct building) binds each
    range at its offset and size, and a bind group wgpu refuses raises as wgpu-py's method does."""
    from hetero._gpu.bindcache import create_bind_group

    dev = shared_rt.device()
    k = dev.kernel(ADD)
    d = dev.device
    usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
    a = d.create_buffer_with_data(data=np.arange(128, dtype=np.float32).tobytes(), usage=usage)
    out = d.create_buffer(size=1024, usage=usage)
    p = d.create_buffer_with_data(data=np.array([(10.0, 64)], dtype=[("k", "<f4"), ("n", "<u4")]).tobytes()
                                  .ljust(16, b"\0"), usage=wgpu.BufferUsage.UNIFORM)
    group = create_bind_group(d, k.layouts[0], [(a, 256, 256), (out, 512, 256), (p, 0, 16)])
    enc = d.create_command_encoder()
    cp = enc.begin_compute_pass()
    cp.set_pipeline(k.pipeline)
    cp.set_bind_group(0, group)
    cp.dispatch_workgroups(1)
    cp.end()
    d.queue.submit([enc.finish()])
    got = np.frombuffer(d.queue.read_buffer(out), np.float32)
    np.testing.assert_array_equal(got[128:192], np.arange(64, 128, dtype=np.float32) + 10)  # a[64:] + k
    assert not got[:128].any() and not got[192:].any()
    wrong = d.create_buffer(size=256, usage=wgpu.BufferUsage.UNIFORM)  # bound as storage: refused
    with pytest.raises(Exception, match="(?i)usage"):
        create_bind_group(d, k.layouts[0], [(wrong, 0, 256), (out, 0, 256), (p, 0, 16)])
