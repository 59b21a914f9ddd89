"""Captured GPU stages: one call of the stage function per signature, then replays."""

from __future__ import annotations

import collections
import json
import math
import threading
import warnings
from typing import Any

import anyio
import numpy as np
import pytest

import hetero
from hetero import ops
from hetero._gpu import capture as capture_mod

pytestmark = pytest.mark.anyio

SCALE = """
struct P { a: f32, n: u32, pad0: u32, pad1: u32 }
@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@group(0) @binding(2) var<uniform> p: P;
@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = hetero_workgroup_id(wid).x * 64u + lid.x;
    if (i < p.n) { y[i] = p.a * x[i] + 1.0; }
}
"""


FILL = """
@group(0) @binding(0) var<storage, read_write> y: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = hetero_workgroup_id(wid).x * 64u + lid.x;
    if (i < arrayLength(&y)) { y[i] = 1.0; }
}
"""


class Counter:
    def __init__(self) -> None:
        self.n = 0
        self.lock = threading.Lock()

    def __call__(self) -> None:
        with self.lock:
            self.n += 1


def block_ops(gpu: hetero.GPUContext, x: hetero.Tensor, w: hetero.Tensor, scale: float) -> tuple[Any, ...]:
    """Several ops, a temporary, an upload made here, a split kernel and a uniform by value."""
    y = ops.matmul(gpu, x, w)
    z = ops.gelu(gpu, y)
    gamma = gpu.upload(np.linspace(0.5, 1.5, w.shape[1], dtype=np.float32))
    ln = ops.layernorm(gpu, z, gamma, gpu.upload(np.zeros(w.shape[1], np.float32)))
    out = gpu.empty(ln.shape, np.float32)
    gpu.dispatch(SCALE, -(-ln.size // 64), ln, out, _params(scale, ln.size))
    return out, ops.sum(gpu, x, axis=1), "tag"


def _params(a: float, n: int) -> bytes:
    return np.array([a], np.float32).tobytes() + np.array([n, 0, 0], np.uint32).tobytes()


def graph(fn: Any, capture: bool, scale: float = 2.0) -> hetero.Graph:
    g = hetero.Graph("cap")
    g.output(g.gpu(fn, g.input("x"), g.input("w"), scale, capture=capture, name="block"))
    return g


@pytest.mark.parametrize("budget_ms", [0.01, 100.0])
async def test_results_equal_with_and_without_capture_over_random_shapes(budget_ms: float) -> None:
    rng = np.random.default_rng(7)
    calls = Counter()

    def fn(gpu: hetero.GPUContext, x: hetero.Tensor, w: hetero.Tensor, scale: float) -> tuple[Any, ...]:
        calls()
        return block_ops(gpu, x, w, scale)

    shapes = [(int(rng.integers(1, 9)), int(rng.integers(1, 40)), int(rng.integers(1, 40))) for _ in range(4)]
    # A tiny GPU-time budget splits the grid kernel into many sub-dispatches, on replay too; the
    # default one issues each replay in one loop.
    with hetero.Runtime(cpu_threads=2, gpu_budget_ms=budget_ms) as rt:
        for m, k, n in shapes * 3:  # the first replay of a grid kernel makes its whole-grid bind group
            x = rng.standard_normal((m, k), dtype=np.float32)
            w = rng.standard_normal((k, n), dtype=np.float32)
            got = await rt.run(graph(fn, True), x=x, w=w)
            want = await rt.run(graph(block_ops, False), x=x, w=w)
            assert got[2] == want[2] == "tag"
            np.testing.assert_array_equal(got[0], want[0])
            np.testing.assert_array_equal(got[1], want[1])
        assert calls.n == len(set(shapes))
        assert rt.device().captures.stats()["replays"] == 3 * len(shapes) - len(set(shapes))
        caps = _captures(rt)
        assert caps and all(_no_dispatch_binds_one_block_twice(c) for c in caps)


async def test_fn_runs_once_per_signature_and_a_new_shape_captures_anew(shared_rt: hetero.Runtime) -> None:
    calls = Counter()

    def fn(gpu: hetero.GPUContext, x: hetero.Tensor, w: hetero.Tensor, scale: float) -> tuple[Any, ...]:
        calls()
        return block_ops(gpu, x, w, scale)

    rng = np.random.default_rng(1)
    w = rng.standard_normal((8, 4), dtype=np.float32)
    seen = []
    for m, scale in [(2, 2.0), (2, 2.0), (3, 2.0), (2, 2.0), (2, 3.0), (3, 2.0)]:
        x = rng.standard_normal((m, 8), dtype=np.float32)
        out = await shared_rt.run(graph(fn, True, scale), x=x, w=w)
        seen.append((calls.n, shared_rt.stats().stage("block").capture))
        ref = await shared_rt.run(graph(block_ops, False, scale), x=x, w=w)
        np.testing.assert_array_equal(out[0], ref[0])
    assert seen == [(1, "captured"), (1, "replayed"), (2, "captured"), (2, "replayed"), (3, "captured"),
                    (3, "replayed")]


def _captures(rt: hetero.Runtime) -> list[Any]:
    from hetero._gpu.capture import Capture

    return [c for c in rt.device().captures._entries.values() if isinstance(c, Capture)]


def _no_dispatch_binds_one_block_twice(cap: Any) -> bool:
    from hetero._gpu.capture import TEMP

    for op in cap.ops:
        blocks = [cap.block_of[ref] for kind, ref, _, _ in op.slots if kind == TEMP]
        if len(set(blocks)) != len(blocks):
            return False
    return True


async def test_temporaries_whose_lifetimes_do_not_overlap_share_a_block() -> None:
    """A chain of six temporaries replays in three blocks (one for the odd links, one for the even
    ones, one for the result), with the results of plain recording, and memory back at the end."""
    calls = Counter()

    def chain6(gpu: hetero.GPUContext, x: hetero.Tensor) -> hetero.Tensor:
        calls()
        t = x
        for i in range(6):
            nxt = gpu.empty(x.shape, np.float32)
            gpu.dispatch(SCALE, -(-x.size // 64), t, nxt, _params(1.0 + i, x.size))
            t = nxt
        return t

    def graph6(capture: bool) -> hetero.Graph:
        g = hetero.Graph("chain6")
        g.output(g.gpu(chain6, g.input("x"), capture=capture, name="chain"))
        return g

    x = np.linspace(-1, 1, 1000, dtype=np.float32)
    want = x
    for i in range(6):
        want = (1.0 + i) * want + 1.0
    async with hetero.Runtime(cpu_threads=1) as rt:
        for _ in range(3):
            np.testing.assert_allclose(await rt.run(graph6(True), x=x), want, rtol=1e-6)
        np.testing.assert_array_equal(await rt.run(graph6(True), x=x), await rt.run(graph6(False), x=x))
        assert calls.n == 2  # one capture, and the plain run
        (cap,) = _captures(rt)
        assert len(cap.temps) == 6 and len(cap.block_bytes) == 3
        assert cap.block_of == [0, 1, 0, 1, 0, 2] and _no_dispatch_binds_one_block_twice(cap)
        assert rt.memory_stats().in_use_bytes == 0


def test_block_sharing_rules() -> None:
    """Lifetimes: an upload from the stage's start; overlapping lives never share; a free block that
    holds the temporary is preferred, else the largest free one grows; a result has its own block."""
    from hetero._gpu.capture import ARG, TEMP, _Op, _Ref, share_blocks

    def op(*temps: int) -> _Op:
        return _Op(None, 0, (1, 1, 1), 1, tuple((TEMP, j, 0, 4) for j in temps) + ((ARG, 0, 0, 4),), None, None)

    def temp(nbytes: int, data: Any = None) -> tuple[int, Any]:
        return (nbytes, data)

    # t0 (made first, used by ops 0-1), t1 (an upload, used by op 3), t2 (made after op 1, op 2),
    # t3 (made after op 2, the result)
    ops_ = [op(0), op(0), op(2), op(1, 3)]
    temps = [temp(64), temp(16, np.zeros(4, np.float32)), temp(256), temp(32)]
    result = _Ref(TEMP, 3, 0, (8,), np.dtype(np.float32))
    block_of, sizes = share_blocks(ops_, temps, result, created=[0, 0, 2, 3])
    # t1 lives from the start (an upload) to op 3: its own block; t2 takes t0's block (free from op 2)
    # and grows it; t3, the result, gets a block of its own size though t0's is free again
    assert block_of == [0, 1, 0, 2] and sizes == [256, 16, 32]
    # without the result: t3 takes the free block that holds it (t0's, grown by t2)
    block_of, sizes = share_blocks(ops_, temps, None, created=[0, 0, 2, 3])
    assert block_of == [0, 1, 0, 0] and sizes == [256, 16]
    # a result made first: nothing made after it shares its block
    block_of, sizes = share_blocks([op(0), op(1)], [temp(8), temp(8)], _Ref(TEMP, 0, 0, (2,), np.dtype(np.float32)),
                                 created=[0, 1])
    assert block_of == [0, 1]


async def test_int_dtype_and_aliasing_are_part_of_the_signature(shared_rt: hetero.Runtime) -> None:
    calls = Counter()

    def fn(gpu: hetero.GPUContext, a: hetero.Tensor, b: hetero.Tensor) -> hetero.Tensor:
        calls()
        return ops.add(gpu, a, b)

    g = hetero.Graph("alias")
    x = g.input("x")
    g.output(g.gpu(fn, x, g.input("y"), capture=True, name="add"))
    g2 = hetero.Graph("alias2")
    x2 = g2.gpu(lambda gpu, v: v, g2.input("x"), name="same")  # one tensor passed twice
    g2.output(g2.gpu(fn, x2, x2, capture=True, name="add"))
    a = np.arange(6, dtype=np.float32)
    np.testing.assert_array_equal(await shared_rt.run(g, x=a, y=a + 1), 2 * a + 1)
    np.testing.assert_array_equal(await shared_rt.run(g2, x=a), 2 * a)
    np.testing.assert_array_equal(await shared_rt.run(g, x=a, y=a * 3), 4 * a)
    np.testing.assert_array_equal(await shared_rt.run(g2, x=a + 1), 2 * a + 2)
    assert calls.n == 2


async def test_replays_with_several_recording_threads() -> None:
    calls = Counter()

    def fn(gpu: hetero.GPUContext, x: hetero.Tensor, w: hetero.Tensor, scale: float) -> tuple[Any, ...]:
        calls()
        return block_ops(gpu, x, w, scale)

    rng = np.random.default_rng(5)
    w = rng.standard_normal((12, 6), dtype=np.float32)
    xs = [rng.standard_normal((3, 12), dtype=np.float32) for _ in range(6)]
    with hetero.Runtime(cpu_threads=2, gpu_threads=2) as rt:
        got = [r async for r in rt.map(graph(fn, True), ({"x": x, "w": w} for x in xs))]
        want = [r async for r in rt.map(graph(block_ops, False), ({"x": x, "w": w} for x in xs))]
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a[0], b[0])
    assert 1 <= calls.n <= 2  # two threads may capture the first signature at once


async def test_memory_returns_to_its_baseline(rt: hetero.Runtime) -> None:
    rng = np.random.default_rng(3)
    w = rng.standard_normal((16, 8), dtype=np.float32)
    x = rng.standard_normal((4, 16), dtype=np.float32)
    g = graph(block_ops, True)
    await rt.run(g, x=x, w=w)
    base = rt.memory_stats()
    for _ in range(5):
        await rt.run(g, x=x, w=w)
        assert rt.stats().stage("block").replayed
    after = rt.memory_stats()
    assert after.in_use_bytes == base.in_use_bytes == 0
    assert after.pooled_bytes == base.pooled_bytes  # the pool handed back the same buffers


async def test_cancellation_during_replays_then_reuse(rt: hetero.Runtime) -> None:
    """
    ::

        x -> s0 -> s1 -> ... -> s39 -> out      (captured GPU stages)
        cancel (cpu): cancels the run as soon as it starts, and holds it until then
    """
    calls = Counter()
    started = threading.Event()
    release = threading.Event()
    release.set()

    def hold() -> None:
        started.set()
        release.wait(10)  # the run cannot complete before it is cancelled

    def step(gpu: hetero.GPUContext, t: hetero.Tensor) -> hetero.Tensor:
        calls()
        return ops.add(gpu, t, t)

    g = hetero.Graph("chain")
    v = g.input("x")
    for i in range(40):
        v = g.gpu(step, v, capture=True, name=f"s{i}")
    side = g.cpu(hold, name="cancel")
    g.output(v, side)
    x = np.ones(64, np.float32)
    first = await rt.run(g, x=x)
    np.testing.assert_array_equal(first[0], x * 2.0**40)
    assert calls.n == 1  # one signature: every stage replays the first one's capture
    started.clear()
    release.clear()
    try:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                async def cancel_when_started() -> None:
                    await anyio.to_thread.run_sync(started.wait, 10)
                    scope.cancel()

                tg.start_soon(cancel_when_started)
                await rt.run(g, x=x)
    finally:
        release.set()
    assert scope.cancelled_caught
    for _ in range(100):
        if rt.memory_stats().in_use_bytes == 0:
            break
        await anyio.sleep(0.02)
    assert rt.memory_stats().in_use_bytes == 0
    again = await rt.run(g, x=x)
    np.testing.assert_array_equal(again[0], x * 2.0**40)
    assert all(rt.stats().stage(f"s{i}").replayed for i in range(40))
    assert calls.n == 1


async def test_cancelling_a_replay_that_waits_for_memory() -> None:
    """
    ::

        x -> big (gpu, captured) -------> use (gpu) -> out
             slow (cpu, waits) ----------^

    Run A holds big's output until slow returns; run B's replay of big needs as much
    again, past the budget, and waits for memory inside the replay (its input is tiny);
    B is cancelled there.
    """
    n = 1 << 18  # floats: 1 MiB per tensor
    gate = threading.Event()
    calls = Counter()

    def big(gpu: hetero.GPUContext, x: hetero.Tensor) -> hetero.Tensor:
        calls()
        ops.gelu(gpu, x)
        ones = gpu.empty((n,), np.float32)  # a temporary
        gpu.dispatch(FILL, n // 64, ones)
        out = gpu.empty((n,), np.float32)
        gpu.dispatch(SCALE, n // 64, ones, out, _params(1.0, n))
        return out

    def use(gpu: hetero.GPUContext, t: hetero.Tensor, _: Any) -> hetero.Tensor:
        return ops.sum(gpu, t)

    g = hetero.Graph("wait")
    b = g.gpu(big, g.input("x"), capture=True, name="big")
    g.output(g.gpu(use, b, g.cpu(lambda: gate.wait(10), name="slow"), name="use"))
    x = np.zeros(16, np.float32)
    with hetero.Runtime(cpu_threads=2, memory_budget=3 << 20) as rt:
        gate.set()
        assert await rt.run(g, x=x) == 2 * n  # captures
        gate.clear()
        waits = rt.memory_stats().waits
        async with anyio.create_task_group() as tg:
            async def run_a() -> None:
                assert await rt.run(g, x=x) == 2 * n

            tg.start_soon(run_a)
            await anyio.sleep(0.05)
            with anyio.CancelScope() as scope:
                async def cancel_when_waiting() -> None:
                    with anyio.fail_after(10):
                        while rt.memory_stats().waits == waits:
                            await anyio.sleep(0.005)
                    scope.cancel()

                async with anyio.create_task_group() as inner:
                    inner.start_soon(cancel_when_waiting)
                    await rt.run(g, x=x)
            assert scope.cancelled_caught
            gate.set()
        for _ in range(100):
            if rt.memory_stats().in_use_bytes == 0:
                break
            await anyio.sleep(0.02)
        assert rt.memory_stats().in_use_bytes == 0
        assert await rt.run(g, x=x) == 2 * n
        assert rt.stats().stage("big").replayed
    assert calls.n == 1


def raw_encoder_stage(gpu: hetero.GPUContext, x: hetero.Tensor) -> hetero.Tensor:
    out = gpu.empty(x.shape, x.dtype)
    gpu.encoder.copy_buffer_to_buffer(x.buffer, x.offset, out.buffer, out.offset, x.nbytes)
    return out


async def test_a_stage_that_cannot_be_replayed_falls_back_with_one_warning(shared_rt: hetero.Runtime) -> None:
    calls = Counter()

    def fn(gpu: hetero.GPUContext, x: hetero.Tensor) -> hetero.Tensor:
        calls()
        return raw_encoder_stage(gpu, x)

    g = hetero.Graph("raw")
    g.output(g.gpu(fn, g.input("x"), capture=True, name="raw"))
    x = np.arange(8, dtype=np.float32)
    with pytest.warns(RuntimeWarning, match=r"stage 'raw' cannot be captured \(it records on gpu.encoder directly\)"):
        np.testing.assert_array_equal(await shared_rt.run(g, x=x), x)
    assert shared_rt.stats().stage("raw").capture == "fallback"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(3):
            np.testing.assert_array_equal(await shared_rt.run(g, x=x + i), x + i)
            assert shared_rt.stats().stage("raw").capture == "fallback"
    assert calls.n == 4  # recorded normally every run


async def test_a_pooled_tensor_from_outside_the_arguments_is_not_replayed(shared_rt: hetero.Runtime) -> None:
    """
    ::

        x -> double -> use (captured; also reads tripled's value through a closure)
        x -> triple ----^ (after)
    """
    kept: list[hetero.Tensor] = []

    def triple(gpu: hetero.GPUContext, x: hetero.Tensor) -> hetero.Tensor:
        kept.append(ops.add(gpu, ops.add(gpu, x, x), x))
        return kept[-1]

    def use(gpu: hetero.GPUContext, y: hetero.Tensor) -> hetero.Tensor:
        return ops.add(gpu, y, kept[-1])

    g = hetero.Graph("closure")
    x = g.input("x")
    t = g.gpu(triple, x, name="triple")
    g.output(g.gpu(use, g.gpu(lambda gpu, v: ops.add(gpu, v, v), x, name="double"), capture=True, name="use",
                   after=[t]))
    with pytest.warns(RuntimeWarning, match="it binds a pooled tensor .* that is neither its argument nor made by it"):
        np.testing.assert_array_equal(await shared_rt.run(g, x=np.ones(4, np.float32)), np.full(4, 5.0))
    np.testing.assert_array_equal(await shared_rt.run(g, x=np.full(4, 3.0, np.float32)), np.full(4, 15.0))
    assert shared_rt.stats().stage("use").capture == "fallback"


async def test_an_error_while_capturing_is_a_stage_error_and_nothing_is_kept(rt: hetero.Runtime) -> None:
    calls = Counter()
    fail = [True]

    def fn(gpu: hetero.GPUContext, x: hetero.Tensor) -> hetero.Tensor:
        calls()
        y = ops.gelu(gpu, x)
        if fail[0]:
            raise ValueError("boom")
        return y

    g = hetero.Graph("err")
    g.output(g.gpu(fn, g.input("x"), capture=True, name="f"))
    x = np.linspace(-1, 1, 16, dtype=np.float32)
    with pytest.raises(hetero.StageError, match=r"gpu stage 'f' failed: ValueError: boom") as e:
        await rt.run(g, x=x)
    assert e.value.stage == "f"
    assert len(rt.device().captures) == 0
    assert rt.memory_stats().in_use_bytes == 0
    fail[0] = False
    a = await rt.run(g, x=x)
    assert rt.stats().stage("f").capture == "captured"
    b = await rt.run(g, x=x)
    assert rt.stats().stage("f").capture == "replayed"
    np.testing.assert_array_equal(a, b)
    assert calls.n == 2


async def test_an_unhashable_argument_is_a_stage_error(shared_rt: hetero.Runtime) -> None:
    def fn(gpu: hetero.GPUContext, x: hetero.Tensor, opts: Any) -> hetero.Tensor:
        return x

    g = hetero.Graph("unhashable")
    g.output(g.gpu(fn, g.input("x"), {"a": {1, 2}}, capture=True, name="f"))
    with pytest.raises(hetero.StageError, match=r"stage 'f' is declared with capture=True, but its argument "
                                                 r"1\['a'\] \(set\) is not hashable"):
        await shared_rt.run(g, x=np.ones(2, np.float32))


async def test_the_capture_cache_is_lru_bounded() -> None:
    calls: dict[int, int] = {}

    def fn(gpu: hetero.GPUContext, x: hetero.Tensor) -> hetero.Tensor:
        calls[x.shape[0]] = calls.get(x.shape[0], 0) + 1
        return ops.gelu(gpu, x)

    g = hetero.Graph("lru")
    g.output(g.gpu(fn, g.input("x"), capture=True, name="f"))
    with hetero.Runtime(cpu_threads=2, capture_cache=2) as rt:
        for n in (1, 2, 1, 3, 1, 2):  # 2 is evicted by 3 (1 was used more recently)
            await rt.run(g, x=np.ones(n, np.float32))
        assert calls == {1: 1, 2: 2, 3: 1}
        assert rt.device().captures.stats()["evictions"] == 2
        assert len(rt.device().captures) == 2


async def test_runtime_capture_false_calls_every_stage(shared_rt: hetero.Runtime) -> None:
    calls = Counter()

    def fn(gpu: hetero.GPUContext, x: hetero.Tensor) -> hetero.Tensor:
        calls()
        return ops.gelu(gpu, x)

    g = hetero.Graph("off")
    g.output(g.gpu(fn, g.input("x"), capture=True, name="f"))
    with hetero.Runtime(cpu_threads=2, capture=False) as rt:
        for _ in range(3):
            await rt.run(g, x=np.ones(4, np.float32))
            assert rt.stats().stage("f").capture is None
    assert calls.n == 3
    with pytest.raises(ValueError, match="capture_cache must be an integer >= 1, got 0"):
        hetero.Runtime(capture_cache=0)
    with pytest.raises(hetero.GraphError, match="capture must be True or False, got 'yes'"):
        g.gpu(fn, 1, capture="yes", name="bad")  # type: ignore[arg-type]


async def test_traces_show_replayed_dispatches(tmp_path: Any) -> None:
    path = tmp_path / "trace.json"
    g = hetero.Graph("traced")
    g.output(g.gpu(lambda gpu, x: ops.gelu(gpu, ops.add(gpu, x, x)), g.input("x"), capture=True, name="f"))
    with hetero.Runtime(cpu_threads=2, trace=path) as rt:
        for _ in range(2):
            await rt.run(g, x=np.ones(8, np.float32))
    events = json.loads(path.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    records = [e for e in events if e.get("name") == "f" and e.get("cat") == "gpu-record"]
    assert [e["args"]["capture"] for e in records] == ["captured", "replayed"]
    dispatches = [e for e in events if e.get("args", {}).get("workgroups") is not None]
    if dispatches:  # the adapter writes timestamps inside passes
        replayed = [e for e in dispatches if e["args"].get("replayed")]
        assert len(replayed) == 2
        assert sum(1 for e in dispatches if not e["args"].get("replayed")) == 2
        # The replayed spans (written straight into the pass) are the replay's dispatches, in
        # order, inside the replayed stage's GPU span.
        stage = [e for e in events if e.get("name") == "f" and e.get("ph") == "X" and e.get("cat") != "gpu-record"]
        last = max(stage, key=lambda e: e["ts"])
        add, gelu = sorted(replayed, key=lambda e: e["ts"])
        assert [add["name"], gelu["name"]] == [e["name"] for e in sorted(dispatches, key=lambda e: e["ts"])[:2]]
        assert last["ts"] <= add["ts"] <= add["ts"] + add["dur"] <= gelu["ts"] + gelu["dur"] <= last["ts"] + last["dur"]


async def test_a_trace_of_stages_only_times_no_dispatch(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``trace_dispatches=False``: recorded and replayed stages keep their GPU spans, their
    dispatches get none (the default trace times both). The cost model's own samples are
    left out here: they are timed whatever the trace."""
    from hetero._gpu.grid import CostModel

    monkeypatch.setattr(CostModel, "should_time", lambda self, key: False)
    g = hetero.Graph("traced-stages")
    g.output(g.gpu(lambda gpu, x: ops.gelu(gpu, ops.add(gpu, x, x)), g.input("x"), capture=True, name="f"))
    spans, got = {}, {}
    for each in (True, False):
        path = tmp_path / f"trace-{each}.json"
        with hetero.Runtime(cpu_threads=2, trace=path, trace_dispatches=each) as rt:
            if rt.device().timer.strategy != "inside-passes":
                pytest.skip("the adapter cannot write timestamps inside passes")
            got[each] = [await rt.run(g, x=np.ones(8, np.float32)) for _ in range(2)]
        events = json.loads(path.read_text())["traceEvents"]
        tracks = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
        spans[each] = collections.Counter(tracks.get(e.get("tid")) for e in events
                                          if e.get("ph") == "X" and e.get("name") in ("f", "add", "gelu")
                                          or e.get("args", {}).get("workgroups") is not None)
    assert spans[True]["GPU dispatches"] == 4 and spans[True]["GPU queue"] == 2
    assert spans[False]["GPU dispatches"] == 0 and spans[False]["GPU queue"] == 2
    np.testing.assert_array_equal(np.stack(got[True]), np.stack(got[False]))
    with pytest.raises(ValueError, match="trace_dispatches must be True or False"):
        hetero.Runtime(trace_dispatches="no")  # type: ignore[arg-type]


@pytest.mark.parametrize("sets", [2, capture_mod._MEMOS + 2])
async def test_replays_over_buffers_seen_before_reuse_their_bind_groups(rt: hetero.Runtime, sets: int,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Inputs taking turns (as overlapping runs take turns with their buffers) miss the last
    replay's bind groups. Up to ``_MEMOS`` sets of buffers each find a recent replay's groups
    whole (no walk over the ops, which first checks that the buffers are hetero's); more sets
    walk the ops, each of which keeps the groups of the buffers it bound before. Either way no
    bind-cache lookup, and the results stay right."""
    inputs: dict[int, hetero.Tensor] = {}
    data = {k: np.arange(256, dtype=np.float32) * (k + 1) for k in range(sets)}

    def pick(gpu: hetero.GPUContext, k: int) -> hetero.Tensor:
        if k not in inputs:
            inputs[k] = gpu.resident(data[k])  # a buffer of its own per input, the same every run
        return inputs[k]

    def twice(gpu: hetero.GPUContext, x: hetero.Tensor) -> hetero.Tensor:
        y = gpu.empty(x.shape, np.float32)
        gpu.dispatch(SCALE, -(-x.size // 64), x, y, _params(2.0, x.size))
        z = gpu.empty(x.shape, np.float32)
        gpu.dispatch(SCALE, -(-x.size // 64), y, z, _params(3.0, x.size))
        return z

    g = hetero.Graph("alternate")
    g.output(g.gpu(twice, g.gpu(pick, g.input("k"), name="pick"), name="twice", capture=True))
    binds = rt.device().binds
    for k in [*range(sets), *range(sets)]:  # capture, then one replay over each input's buffers
        np.testing.assert_allclose(await rt.run(g, k=k), 3.0 * (2.0 * data[k] + 1.0) + 1.0)
    lookups = binds.hits + binds.misses
    walks = 0
    is_stable = binds.is_stable

    def counted(buffer: Any) -> bool:
        nonlocal walks
        walks += 1
        return is_stable(buffer)

    monkeypatch.setattr(binds, "is_stable", counted)
    for k in [*range(sets), *range(sets), 0]:
        np.testing.assert_allclose(await rt.run(g, k=k), 3.0 * (2.0 * data[k] + 1.0) + 1.0)
        assert rt.stats().stage("twice").capture == "replayed"
    assert binds.hits + binds.misses == lookups
    assert (walks == 0) == (sets <= capture_mod._MEMOS)


async def test_float_arguments_match_captures_by_bit_pattern(shared_rt: hetero.Runtime) -> None:
    """NaN != NaN, yet a NaN argument made afresh each run replays its capture (and the cache does
    not grow); 0.0 == -0.0, yet they put different bytes in the uniform, so each has its own capture."""
    calls = Counter()

    def fn(gpu: hetero.GPUContext, x: hetero.Tensor, a: Any) -> hetero.Tensor:
        calls()
        out = gpu.empty(x.shape, np.float32)
        gpu.dispatch(SCALE, -(-x.size // 64), x, out, _params(float(a), x.size))
        return out

    def make(kind: str, text: str) -> Any:  # a new object every run, as an upstream stage's result is
        return np.float32(text) if kind == "f32" else float(text)

    x = np.array([1.0, -2.0, np.inf], np.float32)
    for kind in ("float", "f32"):
        g = hetero.Graph(f"bits-{kind}")
        g.output(g.gpu(fn, g.input("x"), g.cpu(make, kind, g.input("a"), name="a"), capture=True, name="scale"))
        before, entries = calls.n, len(shared_rt.device().captures)
        seen = []
        for _ in range(3):
            out = await shared_rt.run(g, x=x, a="nan")
            assert np.isnan(out).all()
            seen.append(shared_rt.stats().stage("scale").capture)
        assert seen == ["captured", "replayed", "replayed"] and calls.n == before + 1
        assert len(shared_rt.device().captures) == entries + 1
        np.testing.assert_array_equal(await shared_rt.run(g, x=x, a="0.0"), [1, 1, np.nan])
        neg = await shared_rt.run(g, x=x, a="-0.0")
        assert shared_rt.stats().stage("scale").capture == "captured" and calls.n == before + 3
        np.testing.assert_array_equal(neg, [1, 1, np.nan])
        await shared_rt.run(g, x=x, a="-0.0")
        assert shared_rt.stats().stage("scale").capture == "replayed" and calls.n == before + 3


async def test_a_split_k_matmul_replays_its_partials_and_summing_pass(rt: hetero.Runtime) -> None:
    """A K split's float32 partials (a pooled temporary) and its second pass replay against
    each run's buffers: same results as without capture, the pool back to its baseline."""
    from hetero.kernels.matmul import small_output_config

    calls = Counter()

    def linear_gelu(gpu: hetero.GPUContext, x: hetero.Tensor, w: hetero.Tensor, b: hetero.Tensor) -> hetero.Tensor:
        calls()
        c = small_output_config(x.shape[0], w.shape[0], x.shape[1])  # depends on the shapes only
        assert c is not None and c.split_k > 1
        return ops.gelu(gpu, ops.matmul(gpu, x, w, transpose_b=True, bias=b, config=c))

    def lin_graph(capture: bool) -> hetero.Graph:
        g = hetero.Graph("split-linear")
        g.output(g.gpu(linear_gelu, g.input("x"), g.input("w"), g.input("b"), capture=capture, name="linear"))
        return g

    rng = np.random.default_rng(11)
    w = rng.standard_normal((384, 1536), dtype=np.float32)
    b = rng.standard_normal(384, dtype=np.float32)
    captured, plain = lin_graph(True), lin_graph(False)
    base = None
    for i, m in enumerate([20, 20, 20, 7, 20, 7]):
        x = rng.standard_normal((m, 1536), dtype=np.float32)
        got = await rt.run(captured, x=x, w=w, b=b)
        assert rt.stats().stage("linear").capture == ("captured" if i in (0, 3) else "replayed")
        want = await rt.run(plain, x=x, w=w, b=b)
        np.testing.assert_array_equal(got, want)
        lin = x.astype(np.float64) @ w.T.astype(np.float64) + b
        ref = 0.5 * lin * (1.0 + np.vectorize(math.erf)(lin / math.sqrt(2.0)))
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * float(np.abs(ref).max()))
        if i == 0:
            base = rt.memory_stats()
    assert calls.n == 2 + 6  # one capture per shape, and every uncaptured run
    after = rt.memory_stats()
    assert base is not None and after.in_use_bytes == base.in_use_bytes == 0


async def test_steady_replays_take_back_their_buffers_and_find_their_bind_groups(rt: hetero.Runtime) -> None:
    """A CPU stage's arrays are uploaded together (odd sizes, strides, an empty one), and runs of
    two alternating shapes settle on the same buffers per shape: replays then bind what the
    previous replay of their shape bound, with no bind-cache lookup, and the results stay right."""

    def make(n: int) -> tuple[np.ndarray, ...]:
        x = np.arange(2 * n, dtype=np.float32)[::2] * n
        return x, np.arange(n, dtype=np.int32) - 3, np.arange(3, dtype=np.uint8) + n, np.zeros(0, np.float32)

    def stage(gpu: hetero.GPUContext, arrays: tuple[hetero.Tensor, ...]) -> tuple[hetero.Tensor, ...]:
        x, ints, small, empty = arrays
        y = gpu.empty(x.shape, np.float32)
        gpu.dispatch(SCALE, -(-x.size // 64), x, y, _params(2.0, x.size))
        z = gpu.empty(x.shape, np.float32)
        gpu.dispatch(SCALE, -(-x.size // 64), gpu.upload(np.full(x.shape, 5.0, np.float32)), z, _params(3.0, x.size))
        return y, z, ints, small, empty

    seen: list[tuple[int, ...]] = []

    def note(gpu: hetero.GPUContext, out: tuple[hetero.Tensor, ...]) -> tuple[hetero.Tensor, ...]:
        seen.append(tuple(id(t.buffer) for t in out[:4]))  # the temporaries and two uploads
        return out

    g = hetero.Graph("settle")
    g.output(g.gpu(note, g.gpu(stage, g.cpu(make, g.input("n"), name="make"), name="stage", capture=True),
                   name="note"))
    binds = rt.device().binds

    async def check(n: int) -> None:
        y, z, ints, small, empty = await rt.run(g, n=n)
        x = np.arange(n, dtype=np.float32) * 2 * n
        np.testing.assert_array_equal(y, 2.0 * x + 1.0)
        np.testing.assert_array_equal(z, np.full(n, 16.0, np.float32))
        np.testing.assert_array_equal(ints, np.arange(n, dtype=np.int32) - 3)
        np.testing.assert_array_equal(small, np.arange(3, dtype=np.uint8) + n)
        assert empty.shape == (0,)

    for n in (70, 200, 70, 200, 70, 200):  # capture each shape, then replays settle
        await check(n)
    lookups = binds.hits + binds.misses
    del seen[:]
    for n in (70, 200, 70, 200):
        await check(n)
        assert rt.stats().stage("stage").capture == "replayed"
    assert binds.hits + binds.misses == lookups
    assert seen[0] == seen[2] and seen[1] == seen[3]  # each shape's replays bound the same buffers
