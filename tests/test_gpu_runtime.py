"""The GPU runtime on a real device: buffer lifetimes, pooling, budget backpressure, fences, warmup."""

from __future__ import annotations

import random
import gc
import sys
import threading
import time
from typing import Any

import anyio
import numpy as np
import pytest

import hetero
from hetero import StageError, Tensor
from hetero._bridge import loop_caller

pytestmark = pytest.mark.anyio

MiB = 1 << 20

SCALE = """
@group(0) @binding(0) var<storage, read> src: array<f32>;
@group(0) @binding(1) var<storage, read_write> dst: array<f32>;
struct P { k: f32, n: u32 }
@group(0) @binding(2) var<uniform> p: P;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x + gid.y * 65535u * 64u;
    if (i < p.n) { dst[i] = src[i] * p.k; }
}
"""


def params(k: float, n: int) -> np.ndarray:
    return np.array([(k, n)], dtype=[("k", "<f4"), ("n", "<u4")])


def scale(gpu: hetero.GPUContext, src: Tensor, k: float = 2.0) -> Tensor:
    out = gpu.empty(src.shape, np.float32)
    groups = (src.size + 63) // 64
    gpu.dispatch(SCALE, (min(groups, 65535), (groups + 65534) // 65535), src, out, params(k, src.size))
    return out


def chain(n: int, name: str = "chain") -> hetero.Graph:
    """
    ::

        x -> s0 -> s1 -> ... -> s{n-1}     (every stage doubles its input)
    """
    g = hetero.Graph(name)
    v = g.input("x")
    for i in range(n):
        v = g.gpu(scale, v, name=f"s{i}")
    g.output(v)
    return g


async def test_long_chain_peaks_at_a_few_intermediates_and_reuses_memory() -> None:
    x = np.ones(MiB, np.float32)  # 4 MiB
    g = chain(24)
    async with hetero.Runtime() as rt:
        out = await rt.run(g, x=x)
        np.testing.assert_array_equal(out, np.full(MiB, 2.0**24, np.float32))
        first = rt.memory_stats()
        assert first.in_use_bytes == 0
        # Input upload, one stage's input and its output: never all 24 intermediates.
        assert first.peak_bytes <= 3 * 4 * MiB
        for _ in range(3):
            await rt.run(g, x=x)
        again = rt.memory_stats()
        assert again.allocations == first.allocations  # repeated runs allocate nothing new
        assert again.reuses > first.reuses
        assert again.in_use_bytes == 0
        freed = rt.trim()
        assert freed >= first.pooled_bytes and rt.memory_stats().pooled_bytes == 0


async def test_no_leak_over_many_failed_and_cancelled_runs() -> None:
    """
    ::

        x -> s0 (gpu) -> maybe_fail (gpu) -> s1 (gpu) -> read (cpu)
    """
    def maybe_fail(gpu: hetero.GPUContext, t: Tensor, mode: int) -> Tensor:
        tmp = gpu.empty(t.shape)  # a temporary taken before failing
        if mode == 1:
            raise ValueError("planned failure")
        gpu.dispatch(SCALE, (t.size + 63) // 64, t, tmp, params(1.0, t.size))
        return tmp

    g = hetero.Graph("leaky")
    x, mode = g.input("x"), g.input("mode")
    a = g.gpu(scale, x, name="s0")
    b = g.gpu(maybe_fail, a, mode)
    c = g.gpu(scale, b, name="s1")
    g.output(g.cpu(lambda v: float(v.sum()), c, name="read"))
    rng = random.Random(7)
    counts = {"ok": 0, "failed": 0, "cancelled": 0}
    async with hetero.Runtime() as rt:
        for _ in range(1000):
            m = rng.choice([0, 1, 2])
            xv = np.ones(rng.randint(1, 300), np.float32)
            if m == 2:
                with anyio.move_on_after(rng.choice([0, 0.0001, 0.001])):
                    await rt.run(g, x=xv, mode=0)
                    counts["ok"] += 1
                    continue
                counts["cancelled"] += 1
                continue
            try:
                assert await rt.run(g, x=xv, mode=m) == 4.0 * xv.size
                counts["ok"] += 1
            except StageError as e:
                assert e.stage == "maybe_fail"
                counts["failed"] += 1
        # Cancelled runs return their buffers once the stage being recorded finishes.
        with anyio.fail_after(10):
            while rt.memory_stats().in_use_bytes:
                await anyio.sleep(0.01)
        s = rt.memory_stats()
        assert s.in_use_bytes == 0 and s.blocks_in_use == 0
        assert s.allocations < 100  # buffers came back and were reused, run after run
    assert counts["failed"] > 200 and counts["cancelled"] > 100 and counts["ok"] > 200


async def test_failed_run_has_returned_its_memory_when_it_raises() -> None:
    def take_and_fail(gpu: hetero.GPUContext, t: Tensor) -> Tensor:
        gpu.empty(1000)
        raise RuntimeError("after allocating")

    g = hetero.Graph("f")
    a = g.gpu(scale, g.input("x"), name="a")
    g.output(g.gpu(take_and_fail, a))
    async with hetero.Runtime() as rt:
        with pytest.raises(StageError, match="'take_and_fail' failed: RuntimeError: after allocating"):
            await rt.run(g, x=np.ones(10, np.float32))
        assert rt.memory_stats().in_use_bytes == 0


async def test_budget_backpressure_between_two_graphs() -> None:
    """Two runs of different graphs whose peaks do not fit the budget together: the younger one waits.

    ::

        hog:    x -> hold (gpu: 3 MiB until the pool reports a wait) -> sum (cpu)
        other:  x -> take (gpu: 3 MiB) -> sum (cpu)
    """
    holding = threading.Event()
    seen_wait = threading.Event()

    def hold(gpu: hetero.GPUContext, t: Tensor) -> Tensor:
        parts = [gpu.empty(MiB // 4) for _ in range(3)]
        holding.set()
        pool = gpu._dev.pool
        deadline = time.monotonic() + 10
        while pool.stats().waits == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        seen_wait.set()
        return scale(gpu, t, 3.0) if parts else t

    def take(gpu: hetero.GPUContext, t: Tensor) -> Tensor:
        holding.wait(10)
        parts = [gpu.empty(MiB // 4) for _ in range(3)]
        return scale(gpu, t, 5.0) if parts else t

    hog = hetero.Graph("hog")
    hog.output(hog.cpu(lambda v: float(v.sum()), hog.gpu(hold, hog.input("x")), name="sum"))
    other = hetero.Graph("other")
    other.output(other.cpu(lambda v: float(v.sum()), other.gpu(take, other.input("x")), name="sum"))

    async with hetero.Runtime(memory_budget=4 * MiB, gpu_threads=2) as rt:
        results: dict[str, float] = {}

        async def go(name: str, graph: hetero.Graph) -> None:
            results[name] = await graph_run(rt, graph)

        async def graph_run(rt: hetero.Runtime, graph: hetero.Graph) -> float:
            return await rt.run(graph, x=np.ones(1000, np.float32))

        async with anyio.create_task_group() as tg:
            tg.start_soon(go, "hog", hog)
            await anyio.to_thread.run_sync(holding.wait, 10)
            tg.start_soon(go, "other", other)
        assert results == {"hog": 3000.0, "other": 5000.0}
        s = rt.memory_stats()
        assert seen_wait.is_set() and s.waits >= 1
        assert s.in_use_bytes == 0


async def test_a_request_larger_than_the_budget_fails_clearly() -> None:
    def big(gpu: hetero.GPUContext) -> Tensor:
        return gpu.empty(2 * MiB)

    g = hetero.Graph("big")
    g.output(g.gpu(big, name="huge_alloc"))
    async with hetero.Runtime(memory_budget=4 * MiB) as rt:
        with pytest.raises(StageError) as e:
            await rt.run(g)
        assert str(e.value) == (
            "gpu stage 'huge_alloc' failed: OutOfMemoryError: stage 'huge_alloc' needs a buffer of 8.0 MiB "
            "(8388608 bytes), more than the memory budget of 4.0 MiB (4194304 bytes); "
            "raise Runtime(memory_budget=...) or split the work"
        )
        assert rt.memory_stats().in_use_bytes == 0


async def test_concurrent_recording_on_several_workers_is_correct() -> None:
    """
    ::

        x -> s0 .. s15 (gpu, independent) -> total (cpu)
    """
    g = hetero.Graph("wide_gpu")
    x = g.input("x")
    parts = [g.gpu(scale, x, float(k), name=f"s{k}") for k in range(16)]
    g.output(g.cpu(lambda *vs: [float(v[0]) for v in vs], *parts, name="total"))
    async with hetero.Runtime(gpu_threads=4) as rt:
        for _ in range(5):
            assert await rt.run(g, x=np.ones(5000, np.float32)) == [float(k) for k in range(16)]


async def test_fences_resolve_in_submission_order(shared_rt: hetero.Runtime) -> None:
    dev = await anyio.to_thread.run_sync(shared_rt.device)
    order: list[int] = []
    done = threading.Event()
    n = 50

    def make(k: int):
        def cb() -> None:
            order.append(k)
            if len(order) == n:
                done.set()
        return cb

    for k in range(n):
        dev.enqueue(dev.device.create_command_encoder().finish(), make(k), flush=True)
    assert await anyio.to_thread.run_sync(done.wait, 10)
    assert order == list(range(n))


BUSY = """
@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    var v = x[gid.x];
    for (var i = 0u; i < 400000u; i = i + 1u) { v = v * 0.999999 + 1.0; }
    x[gid.x] = v;
}
"""


def _record_busy(dev, buf) -> object:
    """A command buffer whose one dispatch keeps the device busy for a while (a loop per thread)."""
    k = dev.kernel(BUSY, label="busy")
    bg = dev.device.create_bind_group(layout=k.layouts[0], entries=[{"binding": 0, "resource": {"buffer": buf}}])
    enc = dev.device.create_command_encoder()
    p = enc.begin_compute_pass()
    p.set_pipeline(k.pipeline)
    p.set_bind_group(0, bg)
    p.dispatch_workgroups(4)
    p.end()
    return enc.finish()


@pytest.mark.parametrize("spin_s", [0.0, 200e-6, 10.0])
async def test_awaited_fence_means_the_work_is_done(shared_rt: hetero.Runtime, spin_s: float) -> None:
    """The loop polls (spin), the fence thread wakes it (no spin), or polling outlasts the work."""
    import wgpu

    dev = await anyio.to_thread.run_sync(shared_rt.device)
    buf = dev.device.create_buffer(size=256 * 4, usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC)
    try:
        dev.enqueue(_record_busy(dev, buf))
        fence = dev.fence()
        # 400000 steps per thread usually still run here, but a loaded host may have let them finish;
        # the work may also finish between two looks, never the other way round.
        shown = repr(fence)
        assert ("done" in shown) != ("pending" in shown)
        assert fence.done() or "pending" in shown
        await fence.wait(spin_s)
        assert fence.done() and "done" in repr(fence)
        # Everything before it is done too; the data is there.
        earlier = hetero.Fence(dev, fence.index - 1)
        assert earlier.done()
        data = np.frombuffer(dev.queue.read_buffer(buf), np.float32)
        assert np.all(data > 1000)
    finally:
        buf.destroy()


async def test_many_fences_resolve_in_order_without_blocking_the_loop(shared_rt: hetero.Runtime) -> None:
    import wgpu

    dev = await anyio.to_thread.run_sync(shared_rt.device)
    buf = dev.device.create_buffer(size=256 * 4, usage=wgpu.BufferUsage.STORAGE)
    ticks = 0
    fences: list[hetero.Fence] = []

    async def ticker() -> None:  # runs only if waiting leaves the loop free
        nonlocal ticks
        while True:
            ticks += not fences[-1].done()  # the loop ran while GPU work was pending
            await anyio.sleep(0)

    try:
        # A loaded host may finish a round's GPU work before the ticker first runs: each round
        # queues twice the work of the one before, until the loop is seen running beside it. A
        # wait that blocked the loop would leave ticks at 0 in every round.
        for rounds in range(6):
            fences.clear()
            for _ in range(3 << rounds):
                dev.enqueue(_record_busy(dev, buf), flush=True)
                fences.append(dev.fence())
            seen: list[list[bool]] = []
            async with anyio.create_task_group() as tg:
                tg.start_soon(ticker)
                for f in fences:
                    await f.wait()
                    seen.append([g.done() for g in fences])
                tg.cancel_scope.cancel()
            # Whenever a fence is done, every earlier one is too.
            for states in seen:
                assert states == sorted(states, reverse=True)
            assert all(seen[-1])
            if ticks:
                break
        assert ticks >= 1
    finally:
        buf.destroy()


async def test_run_returns_after_its_recording_thread_let_go(monkeypatch: pytest.MonkeyPatch) -> None:
    """The last stage's GPU work may finish before its recording thread released that stage's
    inputs; the run still returns with every block back in the pool."""
    from hetero._gpu.context import GPUContext

    release = GPUContext.release_blocks

    def slow_release(self: GPUContext) -> None:
        time.sleep(0.05)  # the fence thread completes the stage meanwhile
        release(self)

    monkeypatch.setattr(GPUContext, "release_blocks", slow_release)
    g, x = chain(2, "slow-release"), np.ones(1024, np.float32)
    async with hetero.Runtime() as rt:
        for _ in range(3):
            np.testing.assert_array_equal(await rt.run(g, x=x), x * 4)
            assert rt.memory_stats().in_use_bytes == 0


async def test_spinning_fence_thread_reports_short_and_long_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fence thread polls without blocking first: tiny submissions and work outlasting the spin."""
    import wgpu

    monkeypatch.setenv("HETERO_FENCE_SPIN_US", "300")
    async with hetero.Runtime() as rt:
        dev = await anyio.to_thread.run_sync(rt.device)
        for _ in range(50):  # reported by the fence thread's non-blocking polls
            dev.enqueue(dev.device.create_command_encoder().finish(), flush=True)
            fence = dev.fence()
            await fence.wait()
            assert fence.done() and dev.submission._completed >= fence.index
        buf = dev.device.create_buffer(size=256 * 4, usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC)
        try:
            dev.enqueue(_record_busy(dev, buf), flush=True)  # usually runs far longer than the 300 µs spin
            fence = dev.fence()
            # The fence thread stops polling once it saw the work finish: read on that thread, in a
            # callback of the submission (the waiter can be woken earlier, inside that poll).
            polling: list[bool] = []
            seen, call = anyio.Event(), loop_caller()
            dev.on_done(fence.index, lambda: (polling.append(dev.submission._fence_polling), call(seen.set)))
            await fence.wait()
            await seen.wait()
            assert fence.done() and polling == [False]
            assert np.all(np.frombuffer(dev.queue.read_buffer(buf), np.float32) > 1000)
        finally:
            buf.destroy()


def test_completion_is_learnt_without_the_fence_thread(shared_rt: hetero.Runtime) -> None:
    """A submission the fence thread never hears of still completes: its work-done callback fires in a poll."""
    dev = shared_rt.device()
    index = dev.submit([dev.device.create_command_encoder().finish()])
    fence = hetero.Fence(dev, index)
    deadline = time.monotonic() + 10
    while not fence.done():
        assert time.monotonic() < deadline, "the work-done callback never marked the submission complete"
        time.sleep(0.001)
    assert dev.submission._completed >= index


def test_fence_on_a_lost_device_raises() -> None:
    with hetero.Runtime() as rt:
        dev = rt.device()
        dev.enqueue(dev.device.create_command_encoder().finish())
        fence = dev.fence()
        fence.wait_sync()
        assert fence.done()
        dev.loss.lost = "test"
        later = hetero.Fence(dev, fence.index + 1)
        with pytest.raises(hetero.DeviceLostError, match="the GPU device was lost"):
            later.done()
        with pytest.raises(hetero.DeviceLostError):
            anyio.run(later.wait)
        dev.loss.lost = None


async def test_work_enqueued_while_the_gpu_is_busy_shares_one_submission(shared_rt: hetero.Runtime) -> None:
    """While a submission of ours is in flight, later command buffers are collected and sent together."""
    dev = await anyio.to_thread.run_sync(shared_rt.device)
    order: list[int] = []
    all_done = threading.Event()

    def mark(k: int):
        def cb() -> None:
            order.append(k)
            if len(order) == 20:
                all_done.set()
        return cb

    before = dev.submissions
    with dev.submission._submit_lock:
        dev.submission._inflight += 1  # as if a long submission were running
    try:
        for k in range(20):
            dev.enqueue(dev.device.create_command_encoder().finish(), mark(k))
        assert dev.submissions == before  # collected, not submitted
    finally:
        with dev.submission._submit_lock:
            dev.submission._inflight -= 1
    dev.flush()  # what the fence thread does when the running submission completes
    assert dev.submissions == before + 1
    assert await anyio.to_thread.run_sync(all_done.wait, 30)
    assert order == list(range(20))


async def test_chain_of_small_stages(shared_rt: hetero.Runtime) -> None:
    out = await shared_rt.run(chain(40, "coalesce"), x=np.ones(8, np.float32))
    np.testing.assert_array_equal(out, np.full(8, 2.0**40, np.float32))


async def test_warmup_compiles_declared_kernels() -> None:
    def declared(gpu: hetero.GPUContext, t: Tensor) -> Tensor:
        return scale(gpu, t)

    g = hetero.Graph("warm")
    g.output(g.gpu(declared, g.input("x"), kernels=[SCALE, (SCALE, "main")]))
    async with hetero.Runtime() as rt:
        assert await rt.warmup(g) == 2
        dev = rt.device()
        assert len(dev._kernels) == 1  # both name the same pipeline
        np.testing.assert_array_equal(await rt.run(g, x=np.ones(3, np.float32)), [2, 2, 2])
        assert len(dev._kernels) == 1  # the run found it compiled


def test_bad_kernel_declaration() -> None:
    g = hetero.Graph("k")
    with pytest.raises(hetero.GraphError, match=r"stage 'scale': kernels must be WGSL strings or \(wgsl, entry_point\)"):
        g.gpu(scale, 1, kernels=[42])


async def test_binding_smaller_than_the_shader_struct(shared_rt: hetero.Runtime) -> None:
    fixed = """
    struct Big { a: vec4<f32>, b: array<f32, 64> }
    @group(0) @binding(0) var<storage, read_write> x: Big;
    @compute @workgroup_size(1) fn main() { x.b[3] = 1.0; }
    """

    def small(gpu: hetero.GPUContext, t: Tensor) -> Tensor:
        gpu.dispatch(fixed, 1, t)
        return t

    g = hetero.Graph("small")
    g.output(g.gpu(small, g.input("x"), name="small"))
    with pytest.raises(StageError) as e:
        await shared_rt.run(g, x=np.zeros(4, np.float32))
    assert str(e.value) == (
        "gpu stage 'small' failed: ValueError: kernel 'main': binding 0 is 16 bytes, smaller than the 272 bytes "
        "the shader declares for it; pass a larger tensor or fix the WGSL struct"
    )


async def test_tensor_bound_as_uniform(shared_rt: hetero.Runtime) -> None:
    def wrong(gpu: hetero.GPUContext, t: Tensor) -> Tensor:
        out = gpu.empty(t.shape)
        gpu.dispatch(SCALE, 1, t, out, t)
        return out

    g = hetero.Graph("uni")
    g.output(g.gpu(wrong, g.input("x"), name="wrong"))
    with pytest.raises(StageError) as e:
        await shared_rt.run(g, x=np.zeros(4, np.float32))
    assert str(e.value) == ("gpu stage 'wrong' failed: TypeError: kernel 'main' binding 2 (p): got a Tensor "
                            "(float32, shape (4,)) where the shader declares var<uniform>; pass a numpy array or "
                            "bytes for a uniform")
    assert shared_rt.memory_stats().in_use_bytes == 0


async def test_memory_stats_before_the_device_exists() -> None:
    async with hetero.Runtime(memory_budget=123 * MiB) as rt:
        s = rt.memory_stats()
        assert (s.in_use_bytes, s.allocations, s.budget_bytes) == (0, 0, 123 * MiB)
        assert rt.trim() == 0


async def test_device_loss_fails_runs_fast_instead_of_aborting() -> None:
    g = chain(2, "lost")
    async with hetero.Runtime() as rt:
        np.testing.assert_array_equal(await rt.run(g, x=np.ones(4, np.float32)), [4, 4, 4, 4])
        dev = rt.device()
        dev.device.destroy()  # what a driver reset looks like to the runtime
        # The first run finds out (wgpu reports the loss on the next call), the next fails at once.
        for _ in range(2):
            with pytest.raises(hetero.DeviceLostError, match="the GPU device was lost .*; create a new Runtime"):
                await rt.run(g, x=np.ones(4, np.float32))
        assert dev.lost is not None
        cpu_only = hetero.Graph("cpu")
        cpu_only.output(cpu_only.cpu(len, "abc", name="len"))
        assert await rt.run(cpu_only) == 3  # CPU graphs still run


async def test_a_loss_found_by_the_fence_thread_runs_the_loss_callbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Waiting for a submission fails (how wgpu-native reports a loss there): the device is lost,
    its loss callbacks run once with the reason, and runs fail with DeviceLostError."""
    g = chain(2, "fence_lost")
    async with hetero.Runtime() as rt:
        np.testing.assert_array_equal(await rt.run(g, x=np.ones(4, np.float32)), [4, 4, 4, 4])
        dev = rt.device()
        reasons: list[str] = []
        told = threading.Event()
        dev.on_lost(lambda reason: (reasons.append(reason), told.set()))

        def fails(index: int) -> None:
            raise RuntimeError("Parent device is lost")

        monkeypatch.setattr(dev.submission, "_await_completion", fails)
        with pytest.raises(hetero.DeviceLostError, match="Parent device is lost"):
            await rt.run(g, x=np.ones(4, np.float32))
        assert await anyio.to_thread.run_sync(told.wait, 60)  # the callbacks run on the fence thread
        assert reasons == ["RuntimeError('Parent device is lost')"]
        with pytest.raises(hetero.DeviceLostError):
            await rt.run(g, x=np.ones(4, np.float32))
        assert reasons == ["RuntimeError('Parent device is lost')"]


async def test_one_buffer_bound_for_reading_and_writing_is_refused(shared_rt: hetero.Runtime) -> None:
    def alias(gpu: hetero.GPUContext, t: Tensor) -> Tensor:
        gpu.dispatch(SCALE, 1, t, t, params(1.0, t.size))
        return t

    g = hetero.Graph("alias")
    g.output(g.gpu(alias, g.input("x"), name="alias"))
    with pytest.raises(StageError) as e:
        await shared_rt.run(g, x=np.ones(4, np.float32))
    assert str(e.value) == (
        "gpu stage 'alias' failed: ValueError: kernel 'main': bindings 0 and 1 are the same buffer and binding 1 "
        "is read_write; WebGPU forbids a dispatch to write a buffer it also binds elsewhere: pass a separate "
        "output tensor"
    )
    # Nothing poisoned the shared encoder: the next runs work.
    np.testing.assert_array_equal(await shared_rt.run(chain(3, "after_alias"), x=np.ones(2, np.float32)), [8, 8])


async def test_shared_and_per_stage_recording_agree() -> None:
    x = np.arange(10, dtype=np.float32)
    outs = []
    for threads in (1, 3):
        async with hetero.Runtime(gpu_threads=threads) as rt:
            outs.append(await rt.run(chain(12, f"rec{threads}"), x=x))
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], x * 2.0**12)


async def test_cpu_value_read_by_several_gpu_stages_is_uploaded_once(rt: hetero.Runtime,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """
    ::

        x -> make (cpu) -+-> s1 (gpu) -+
                         +-> s2 (gpu) -+-> total (gpu) -> out
                         +-> s3 (gpu) -+      ^
                         +--------------------+
    """
    uploads: list[tuple[int, ...]] = []
    real = hetero.GPUContext._upload_many  # how the scheduler uploads a stage's argument arrays

    def counting(self: hetero.GPUContext, arrays: list[np.ndarray], prefer: Any = None) -> list[Tensor]:
        uploads.extend(a.shape for a in arrays)
        return real(self, arrays, prefer)

    monkeypatch.setattr(hetero.GPUContext, "_upload_many", counting)

    def total(gpu: hetero.GPUContext, m: Tensor, a: Tensor, b: Tensor, c: Tensor, fail: bool) -> Tensor:
        if fail:
            raise RuntimeError("boom")
        return scale(gpu, scale(gpu, m, 0.5), 1.0)

    g = hetero.Graph("shared-upload")
    made = g.cpu(lambda x: x * 2, g.input("x"), name="make")
    parts = [g.gpu(scale, made, float(k), name=f"s{k}") for k in (1, 2, 3)]
    g.output(g.gpu(total, made, *parts, g.input("fail"), name="total"), *parts)
    x = np.arange(1000, dtype=np.float32)
    out, p1, p2, p3 = await rt.run(g, x=x, fail=False)
    np.testing.assert_array_equal(out, x)
    for k, p in zip((1, 2, 3), (p1, p2, p3)):
        np.testing.assert_array_equal(p, x * 2 * k)
    assert uploads == [(1000,)]  # one upload for four GPU readers
    assert rt.memory_stats().in_use_bytes == 0
    # a failing reader: the shared upload goes back to the pool all the same
    for _ in range(3):
        with pytest.raises(StageError, match="stage 'total'"):
            await rt.run(g, x=x, fail=True)
        assert rt.memory_stats().in_use_bytes == 0


def test_idle_gpu_flushes_committed_stages_unless_one_is_recording(shared_rt: hetero.Runtime) -> None:
    """The fence thread, when the GPU goes idle, submits what waits in a shared encoder, but never
    finishes an encoder a stage is still recording into."""
    from hetero._gpu.recorder import SharedRecorder

    dev = shared_rt.device()
    rec = SharedRecorder(dev, max_stages=32)
    x = np.arange(64, dtype=np.float32)
    done = threading.Event()

    def record() -> hetero.GPUContext:
        ctx = hetero.GPUContext(dev, "idle-flush", recorder=rec)
        t = ctx.upload(x)
        scale(ctx, t, 3.0)
        return ctx

    with rec.lock:  # a stage is being recorded: the hook must leave the encoder alone
        ctx = record()
        before = dev.submissions
        worker = threading.Thread(target=rec.flush_if_free)
        worker.start()
        worker.join(timeout=5)
        assert not worker.is_alive() and dev.submissions == before
        rec.commit(done.set, lambda err: None, flush=False)
    assert dev.submissions == before and not done.is_set()  # committed, still in the open encoder
    rec.flush_if_free()
    assert dev.submissions == before + 1
    assert done.wait(5)
    ctx.settle(ran=True)
    ctx.release_blocks()
    rec.flush_if_free()  # nothing open: a no-op
    assert dev.submissions == before + 1


class _EndFails:
    """A compute pass whose end() fails (as a validation error of the pass would)."""

    def __init__(self, compute_pass: Any) -> None:
        self._pass = compute_pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pass, name)

    def end(self) -> None:
        self._pass.end()
        raise RuntimeError("boom")


def test_idle_flush_of_an_encoder_that_fails_lets_the_recorder_go(shared_rt: hetero.Runtime) -> None:
    """Whatever fails while the idle flush finishes the shared encoder (here: ending its pass), the
    recorder is let go, and every stage recorded into that encoder fails with the error and is settled."""
    from hetero._gpu.recorder import SharedRecorder

    dev = shared_rt.device()
    rec = SharedRecorder(dev, max_stages=32)
    done, errors = threading.Event(), []
    with rec.lock:
        ctx = hetero.GPUContext(dev, "fails", recorder=rec)
        scale(ctx, ctx.upload(np.arange(64, dtype=np.float32)), 3.0)
        rec.commit(done.set, errors.append, flush=False)
    assert rec._pass is not None
    rec._pass = _EndFails(rec._pass)
    before = dev.submissions
    rec.flush_if_free()
    free: list[bool] = []

    def take() -> None:  # from another thread: the recorder's lock is reentrant
        free.append(rec.lock.acquire(timeout=5))
        if free[0]:
            rec.lock.release()

    other = threading.Thread(target=take)
    other.start()
    other.join(timeout=10)
    assert free == [True]
    assert len(errors) == 1 and "shared by 1 stage(s) failed: RuntimeError: boom" in str(errors[0])
    assert done.is_set() and dev.submissions == before
    ctx.settle(ran=False)
    ctx.release_blocks()


def test_idle_flush_lets_the_recorder_go_before_it_submits(shared_rt: hetero.Runtime,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The fence thread's idle flush holds the recorder only to finish the encoder: the next stage
    records while it submits, and is submitted after it."""
    from hetero._gpu.recorder import SharedRecorder

    dev = shared_rt.device()
    rec = SharedRecorder(dev, max_stages=32)
    sub = dev.submission
    x = np.arange(64, dtype=np.float32)
    submitting, go = threading.Event(), threading.Event()
    order: list[str] = []
    real_submit = sub._submit_now

    def slow_submit(command_buffers: list[Any]) -> int:
        if not order:
            submitting.set()
            assert go.wait(10)
        order.append("first" if not order else "second")
        return real_submit(command_buffers)

    monkeypatch.setattr(sub, "_submit_now", slow_submit)
    contexts: list[hetero.GPUContext] = []
    done = [threading.Event(), threading.Event()]

    def stage(i: int, flush: bool) -> None:
        with rec.lock:
            ctx = hetero.GPUContext(dev, f"handoff-{i}", recorder=rec)
            out = scale(ctx, ctx.upload(x), float(i + 2))
            ctx.stage_download(out, False)
            contexts.append(ctx)
            rec.commit(done[i].set, lambda err: None, flush=flush)

    stage(0, flush=False)
    flusher = threading.Thread(target=rec.flush_if_free)
    flusher.start()
    assert submitting.wait(10)
    assert rec.lock.acquire(timeout=10)  # the recorder is free while the first encoder is submitted
    rec.lock.release()
    second = threading.Thread(target=stage, args=(1, True))
    second.start()
    second.join(timeout=0.2)
    assert second.is_alive()  # recorded, and waiting to be submitted after the first
    go.set()
    flusher.join(timeout=10)
    second.join(timeout=10)
    assert not flusher.is_alive() and not second.is_alive()
    assert done[0].wait(10) and done[1].wait(10)
    assert order == ["first", "second"]
    for i, ctx in enumerate(contexts):
        np.testing.assert_allclose(ctx.read_downloads()[id(ctx.downloads[0][1])], x * (i + 2))
        ctx.settle(ran=True)
        ctx.release_blocks()


def test_fence_spin_setting(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from hetero._gpu import submission

    monkeypatch.setattr(submission.os, "cpu_count", lambda: 16)
    monkeypatch.delenv("HETERO_FENCE_SPIN_US", raising=False)
    assert submission._fence_spin_s() == pytest.approx(submission.FENCE_SPIN_US / 1e6)
    monkeypatch.setattr(submission.os, "cpu_count", lambda: 2)
    assert submission._fence_spin_s() == 0.0  # few cores: the spinner would take the CPU others need
    for raw, want in (("250", 250e-6), ("0", 0.0), ("-5", 0.0)):
        monkeypatch.setenv("HETERO_FENCE_SPIN_US", raw)
        assert submission._fence_spin_s() == pytest.approx(want)
    monkeypatch.setenv("HETERO_FENCE_SPIN_US", "fast")
    assert submission._fence_spin_s() == 0.0
    assert "ignoring HETERO_FENCE_SPIN_US='fast'" in caplog.text


async def test_spinning_fence_thread_runs_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HETERO_FENCE_SPIN_US", "300")
    g, x = chain(5, "spin-chain"), np.ones(256, np.float32)
    async with hetero.Runtime(cpu_threads=2) as rt:
        assert rt.device().submission.fence_spin_s == pytest.approx(300e-6)
        for _ in range(5):
            np.testing.assert_array_equal(await rt.run(g, x=x), x * 32)
        results = [r async for r in rt.map(g, ({"x": x * k} for k in range(6)), max_in_flight=3)]
        for k, r in enumerate(results):
            np.testing.assert_array_equal(r, x * k * 32)


async def test_fence_spin_pauses_while_a_stage_records(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each stage is marked as recording while it records (and commits); the spin's turns sleep
    FENCE_SPIN_PAUSE_S then, and not at all otherwise."""
    from hetero._gpu import submission

    monkeypatch.setenv("HETERO_FENCE_SPIN_US", "300")
    marks: list[int] = []

    def probe(gpu: hetero.GPUContext, src: Tensor) -> Tensor:
        marks.append(len(gpu._dev.submission._recording))
        return scale(gpu, src)

    g = hetero.Graph("spin-pause")
    g.output(g.gpu(probe, g.gpu(probe, g.input("x"), name="a"), name="b"))
    x = np.ones(256, np.float32)
    async with hetero.Runtime() as rt:
        np.testing.assert_array_equal(await rt.run(g, x=x), x * 4)
        sub = rt.device().submission
        assert marks == [1, 1] and sub._recording == []  # marked during each stage, cleared after
        slept: list[float] = []
        monkeypatch.setattr(submission.time, "sleep", slept.append)
        sub._spin_pause()
        with sub.recording():
            sub._spin_pause()
            with sub.recording():  # stages on two recording threads
                sub._spin_pause()
            sub._spin_pause()
        sub._spin_pause()
        monkeypatch.undo()
        assert slept == [0, submission.FENCE_SPIN_PAUSE_S, submission.FENCE_SPIN_PAUSE_S,
                         submission.FENCE_SPIN_PAUSE_S, 0]
        np.testing.assert_array_equal(await rt.run(g, x=x), x * 4)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timer slack is a Linux setting")
def test_fence_thread_sleeps_precisely() -> None:
    """The fence thread's timer slack is 1 us (its spin's pauses end on time), other threads keep theirs."""
    import ctypes

    from hetero._gpu import submission

    libc = ctypes.CDLL(None)
    slack: list[int] = []

    def probe() -> None:
        submission._precise_sleeps()
        slack.append(libc.prctl(30, 0, 0, 0, 0))  # PR_GET_TIMERSLACK, in ns

    before = libc.prctl(30, 0, 0, 0, 0)
    t = threading.Thread(target=probe)
    t.start()
    t.join()
    assert slack == [1000] and libc.prctl(30, 0, 0, 0, 0) == before


def _mapped_view(a: np.ndarray) -> bool:
    while isinstance(a, np.ndarray):
        a = a.base
    return type(a).__name__ == "_MappedMemory"


@pytest.mark.parametrize("zero_copy_outputs", [True, False])
async def test_large_outputs_reuse_staging_memory(zero_copy_outputs: bool) -> None:
    """A 16 MiB output: copied the first time, then on pooled staging memory while results are dropped."""
    x = np.arange(4 * MiB, dtype=np.float32)
    want = 2 * x
    g = chain(1)
    async with hetero.Runtime(zero_copy_outputs=zero_copy_outputs) as rt:
        y1 = await rt.run(g, x=x)
        y2 = await rt.run(g, x=x)
        y3 = await rt.run(g, x=x)  # y2 still held: copied
        del y2
        y4 = await rt.run(g, x=x)
        views = [_mapped_view(y) for y in (y1, y3, y4)]
        assert views == ([False, False, True] if zero_copy_outputs else [False, False, False])
        for y in (y1, y3, y4):
            np.testing.assert_array_equal(y, want)
        y4 += 1  # writable
        ring = rt.device().ring.stats()
        assert ring["zero_copy_bytes"] == (16 * MiB if zero_copy_outputs else 0)
    np.testing.assert_array_equal(y4, want + 1)  # still valid after the runtime closed
    del y4


async def test_a_lone_run_submits_enough_recorded_work_while_the_gpu_is_idle() -> None:
    """A stage that brings the shared encoder to EARLY_SUBMIT_DISPATCHES goes out when it
    finds the GPU idle and no other run active: in a submission of its own (handed to the
    submit thread, so the next stage records meanwhile), before the next stage's."""
    from hetero._scheduler import EARLY_SUBMIT_DISPATCHES

    def many(gpu: hetero.GPUContext, x: Tensor) -> Tensor:
        for _ in range(EARLY_SUBMIT_DISPATCHES):
            x = scale(gpu, x, 1.0)
        return x

    g = hetero.Graph("early")
    a = g.gpu(many, g.input("x"), name="a")
    g.output(g.gpu(scale, a, 3.0, name="b"))
    x = np.arange(1000, dtype=np.float32)
    async with hetero.Runtime(cpu_threads=2, gpu_budget_ms=60_000) as rt:  # no submission ends for the budget
        np.testing.assert_allclose(await rt.run(g, x=x), 3.0 * x)  # compiles; the GPU is idle again after it
        before = rt.device().submissions
        np.testing.assert_allclose(await rt.run(g, x=x), 3.0 * x)
        st = rt.stats()
        submissions = rt.device().submissions - before
    sa, sb = st.stage("a"), st.stage("b")
    assert sa.submitted is not None and sb.started is not None and sb.submitted is not None
    assert sa.submitted < sb.submitted and sb.started < sb.submitted  # a went out on its own, first
    assert submissions == 2


@pytest.mark.parametrize("gpu_threads", [1, 2])  # one shared encoder; an encoder per stage
async def test_the_fence_thread_lets_go_of_submitted_encoders(monkeypatch: pytest.MonkeyPatch,
                                                              gpu_threads: int) -> None:
    """The recorders' command encoders, passes and command buffers are released (a call into
    wgpu-native that lets the GIL go) in the fence thread's housekeeping, not on a recording thread."""
    from wgpu.backends.wgpu_native import _api

    threads: dict[str, set[str]] = {}
    real = _api.GPUObjectBase._release

    def spy(self: Any) -> None:
        if self._internal is not None:
            threads.setdefault(type(self).__name__, set()).add(threading.current_thread().name)
        real(self)

    monkeypatch.setattr(_api.GPUObjectBase, "_release", spy)
    x = np.arange(1000, dtype=np.float32)
    async with hetero.Runtime(gpu_threads=gpu_threads) as rt:
        np.testing.assert_allclose(await rt.run(chain(3), x=x), 8.0 * x)
        gc.collect()
        threads.clear()  # opening the device submits work of its own (the timer's clock alignment)
        for _ in range(3):
            np.testing.assert_allclose(await rt.run(chain(3), x=x), 8.0 * x)
        gc.collect()
    for kind in ("GPUCommandEncoder", "GPUComputePassEncoder", "GPUCommandBuffer"):
        assert threads.get(kind), kind
        assert not any(t.startswith("hetero-gpu") for t in threads[kind]), (kind, threads[kind])
    assert "hetero-fence" in threads["GPUCommandEncoder"]


async def test_a_failed_submission_fails_its_stages(monkeypatch: pytest.MonkeyPatch) -> None:
    """The recording thread submits its own flushes: one that fails fails the stages recorded into
    it (not the process, not the next runs), and memory is given back."""
    x = np.arange(1000, dtype=np.float32)
    g = chain(3)
    async with hetero.Runtime() as rt:
        np.testing.assert_allclose(await rt.run(g, x=x), 8.0 * x)
        sub = rt.device().submission
        real = sub._submit_now
        calls: list[str] = []

        def failing(command_buffers: list[Any]) -> int:
            if threading.current_thread().name.startswith("hetero-gpu") and not calls:
                calls.append("failed")
                raise RuntimeError("injected submission failure")
            return real(command_buffers)

        monkeypatch.setattr(sub, "_submit_now", failing)
        with pytest.raises(StageError, match="injected submission failure"):
            await rt.run(g, x=x)
        assert calls == ["failed"]
        np.testing.assert_allclose(await rt.run(g, x=x), 8.0 * x)
        assert rt.memory_stats().in_use_bytes == 0
    assert not any(t.name == "hetero-submit" for t in threading.enumerate())


def test_deferred_fence_callbacks_run_after_the_waiting_ones(shared_rt: hetero.Runtime) -> None:
    """Device.defer from a fence callback runs once no completed fence waits; elsewhere at once."""
    dev = shared_rt.device()
    order: list[str] = []
    ran = threading.Event()
    gate = threading.Event()
    dev.defer(lambda: order.append("off the fence thread"))
    assert order == ["off the fence thread"]
    order.clear()
    dev.enqueue(dev.device.create_command_encoder().finish(), lambda: gate.wait(10), flush=True)
    index = dev.fence().index  # the fence thread is held by the gate meanwhile

    def first() -> None:
        order.append("first")
        dev.defer(lambda: (order.append("deferred"), ran.set()))

    dev.on_done(index, first)
    dev.on_done(index, lambda: order.append("second"))
    gate.set()
    assert ran.wait(10)
    assert order == ["first", "second", "deferred"]


def test_a_loss_callback_runs_exactly_once_whenever_it_is_registered() -> None:
    """Registered before the loss, while the loss callbacks run, or after: each runs once."""
    import threading

    import wgpu

    from hetero._gpu.lost import LossWatch

    device = wgpu.gpu.request_adapter_sync().request_device_sync()
    watch = LossWatch(device, "test device")
    calls: dict[str, list[str]] = {"before": [], "during": [], "after": []}

    def before(reason: str) -> None:
        calls["before"].append(reason)
        watch.on_lost(calls["during"].append)  # the device is lost by now: runs at once, and only then

    watch.on_lost(before)
    device.destroy()
    watch.probe()
    for t in threading.enumerate():  # the log watcher may have probed first, on a thread of its own
        if t.name == "hetero-lost-probe":
            t.join()
    watch.on_lost(calls["after"].append)
    reason = "reported by the driver"
    assert calls == {"before": [reason], "during": [reason], "after": [reason]}
    with pytest.raises(hetero.DeviceLostError, match="the GPU device was lost"):
        watch.check_alive()


@pytest.mark.anyio
async def test_an_array_held_by_several_arguments_is_uploaded_once(shared_rt: hetero.Runtime) -> None:
    seen: list[bool] = []

    def stage(gpu: hetero.GPUContext, pair: tuple[hetero.Tensor, hetero.Tensor], again: hetero.Tensor,
              other: hetero.Tensor) -> hetero.Tensor:
        seen.append(pair[0] is again and pair[1] is not again and other is not again)
        return hetero.ops.add(gpu, again, other)

    def make(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return x, x * 2

    g = hetero.Graph("dedupe")
    pair = g.cpu(make, g.input("x"), name="pair")
    first = g.cpu(lambda p: p[0], pair, name="first")
    g.output(g.gpu(stage, pair, first, g.input("y"), name="stage"))
    x = np.arange(4, dtype=np.float32)
    np.testing.assert_array_equal(await shared_rt.run(g, x=x, y=x.copy()), 2 * x)
    assert seen == [True]


async def test_the_fence_thread_may_poll_without_blocking(monkeypatch: pytest.MonkeyPatch) -> None:
    """HETERO_FENCE_POLL_US: the fence thread polls every so often instead of one blocking poll;
    fences still resolve in order, after the work, and runs give the same results."""
    import wgpu

    monkeypatch.setenv("HETERO_FENCE_POLL_US", "20")
    monkeypatch.setenv("HETERO_FENCE_SPIN_US", "0")
    async with hetero.Runtime(cpu_threads=2) as rt:
        dev = await anyio.to_thread.run_sync(rt.device)
        assert dev.submission.fence_poll_s == 20e-6
        buf = dev.device.create_buffer(size=256 * 4, usage=wgpu.BufferUsage.STORAGE)
        order: list[int] = []
        done = threading.Event()
        for k in range(6):
            dev.enqueue(_record_busy(dev, buf), lambda k=k: order.append(k), flush=True)
        dev.enqueue(dev.device.create_command_encoder().finish(), done.set, flush=True)
        assert await anyio.to_thread.run_sync(done.wait, 60)
        assert order == list(range(6))
        index = dev.submit([_record_busy(dev, buf)])
        await anyio.to_thread.run_sync(dev.wait, index)  # a blocking wait polls the same way
        assert dev.completed(index)
        x = np.arange(16, dtype=np.float32)
        np.testing.assert_array_equal(await rt.run(chain(3), x=x), x * 8)
    from hetero._gpu import submission

    monkeypatch.setenv("HETERO_FENCE_POLL_US", "not a number")  # warned and ignored: the default
    for cores in (2, 16):  # one blocking poll, whatever the host
        monkeypatch.setattr(submission.os, "cpu_count", lambda cores=cores: cores)
        assert submission._fence_poll_s() == 0.0


def test_wgpu_promise_poller_polls_without_blocking(monkeypatch: pytest.MonkeyPatch) -> None:
    """wgpu-py's promise thread would wait in a blocking poll, holding up every submission
    (wgpu-native 29); with HETERO_PROMISE_POLL_US set the runtime's devices get a non-blocking one
    (unset or 0: wgpu-py's own)."""
    import wgpu

    from hetero._gpu.device import Device

    usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC
    for env, ours in (("50", True), ("", False), ("0", False)):
        monkeypatch.setenv("HETERO_PROMISE_POLL_US", env)
        dev = Device()
        try:
            func = dev.device._poller._poll_func
            assert ("_poll_promises_without_blocking" in func.__qualname__) == ours
            data = np.arange(64, dtype=np.float32)
            np.testing.assert_array_equal(np.frombuffer(dev.queue.read_buffer(  # a map, resolved by that thread
                dev.device.create_buffer_with_data(data=data, usage=usage)), np.float32), data)
        finally:
            dev.close()


def test_a_failing_fence_callback_does_not_keep_the_next_from_running(caplog: pytest.LogCaptureFixture) -> None:
    """A recorder's chained fence callbacks (calibration, timestamp reads, the stages' own) each
    run whatever an earlier one raised: a stage's completion must never be skipped."""
    from hetero._gpu.recorder import _chain

    ran: list[str] = []

    def boom() -> None:
        ran.append("boom")
        raise RuntimeError("timestamp read failed")

    chained = _chain([boom, lambda: ran.append("done"), lambda: ran.append("drop")])
    assert chained is not None
    with caplog.at_level("ERROR", logger="hetero"):
        chained()
    assert ran == ["boom", "done", "drop"]
    assert "fence callback failed" in caplog.text
