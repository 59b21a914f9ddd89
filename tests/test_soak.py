"""Soak: a thousand runs through ``rt.map``, one in ten failing on purpose; nothing grows.

Measures no time: it counts device allocations of the buffer pool and reads the
process's resident memory, after a warm-up and at the end.
"""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

import hetero
from hetero import StageError, Tensor

pytestmark = pytest.mark.anyio

RUNS = 1000
WARMUP = 200  # runs before the baseline: kernels compiled, pool and caches at their working size
SIZES = (1, 97, 300)
MAX_IN_FLIGHT = 4
# The most device buffers the pool can need: a run holds three at once (input, temporary,
# output), each in its size's class; the runs in flight are MAX_IN_FLIGHT consecutive items,
# of which at most ceil(MAX_IN_FLIGHT / len(SIZES)) share a size. Storage buffers are never
# shared between classes. How close a given soak comes to this depends on timing.
POOL_BOUND = len(SIZES) * -(-MAX_IN_FLIGHT // len(SIZES)) * 3
RSS_SLACK = 4 << 20  # bytes of resident memory the remaining runs may add (allocator noise)

DOUBLE = """
@group(0) @binding(0) var<storage, read> src: array<f32>;
@group(0) @binding(1) var<storage, read_write> dst: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if (i < arrayLength(&dst)) { dst[i] = src[i] * 2.0; }
}
"""


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def double(gpu: hetero.GPUContext, t: Tensor, fail: str) -> Tensor:
    tmp = gpu.empty(t.shape)  # a temporary taken before a planned failure
    gpu.dispatch(DOUBLE, (t.size + 63) // 64, t, tmp)
    if fail == "gpu":
        raise ValueError("planned gpu failure")
    out = gpu.empty(t.shape)
    gpu.dispatch(DOUBLE, (t.size + 63) // 64, tmp, out)
    return out


def total(v: np.ndarray, fail: str) -> float:
    if fail == "cpu":
        raise ValueError("planned cpu failure")
    return float(v.sum())


def soak_graph() -> hetero.Graph:
    """
    ::

        x, fail -> double (gpu) -> total (cpu)
    """
    g = hetero.Graph("soak")
    x, fail = g.input("x"), g.input("fail")
    g.output(g.cpu(total, g.gpu(double, x, fail, name="double"), fail, name="total"))
    return g


def items(n: int) -> list[dict[str, object]]:
    """Run i fails (in its GPU or its CPU stage) when i % 10 == 7; inputs come in three odd sizes."""
    out = []
    for i in range(n):
        fail = ("gpu" if i % 20 == 7 else "cpu") if i % 10 == 7 else ""
        out.append({"x": np.full(SIZES[i % len(SIZES)], i % 5, np.float32), "fail": fail})
    return out


async def soak(rt: hetero.Runtime, g: hetero.Graph, todo: list[dict[str, object]]) -> tuple[int, int]:
    """Run every item through rt.map; after a failure, go on with the items behind it."""
    ok = failed = 0
    while todo:
        done = 0
        try:
            async for got in rt.map(g, todo, max_in_flight=MAX_IN_FLIGHT):
                x = todo[done]["x"]
                assert isinstance(x, np.ndarray) and got == 4.0 * float(x.sum())
                done += 1
                ok += 1
        except StageError as e:
            assert e.stage == ("double" if todo[done]["fail"] == "gpu" else "total")
            done += 1
            failed += 1
        s = rt.memory_stats()
        assert (s.in_use_bytes, s.blocks_in_use) == (0, 0)  # also right after a failure stopped runs
        todo = todo[done:]
    return ok, failed


async def test_a_thousand_runs_with_failures_leave_allocations_and_rss_flat() -> None:
    work = items(RUNS)
    g = soak_graph()
    async with hetero.Runtime(cpu_threads=2) as rt:
        assert await soak(rt, g, work[:WARMUP]) == (WARMUP * 9 // 10, WARMUP // 10)
        gc.collect()
        allocations, rss = rt.memory_stats().allocations, rss_bytes()
        assert await soak(rt, g, work[WARMUP:]) == ((RUNS - WARMUP) * 9 // 10, (RUNS - WARMUP) // 10)
        gc.collect()
        # How many runs overlap depends on timing, so the warm-up need not reach the peak: the
        # pool may still add a buffer after it, never more than the in-flight runs can hold at
        # once. A buffer leaked per failure (80), or one per hundred runs (8 on top of the 11-12
        # the warm-up leaves), goes past it.
        s = rt.memory_stats()
        assert allocations <= s.allocations <= POOL_BOUND, (allocations, s)
        assert s.buffers == s.allocations, "the pool destroyed buffers it should have reused"
        grown = rss_bytes() - rss
        assert grown <= RSS_SLACK, f"resident memory grew by {grown} bytes over {RUNS - WARMUP} runs"
