"""TDR-safe dispatches: grids over the per-dimension limit, GPU-time budgets, the cost model."""

from __future__ import annotations

import numpy as np
import pytest

import hetero
from hetero import StageError, Tensor
from hetero._gpu.grid import DEFAULT_NS_PER_WORKGROUP, CostModel, DispatchInfo

pytestmark = pytest.mark.anyio

# Every invocation writes its global index (times k): any workgroup missed or run twice shows.
IOTA = """
@group(0) @binding(0) var<storage, read_write> out: array<u32>;
struct P { k: u32, n: u32 }
@group(0) @binding(1) var<uniform> p: P;
@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = hetero_workgroup_id(wid).x * 64u + lid.x;
    if (i < p.n) { out[i] = out[i] + i * p.k; }
}
"""


def iota_graph(n: int, infos: list[DispatchInfo]) -> hetero.Graph:
    def iota(gpu: hetero.GPUContext) -> Tensor:
        out = gpu.upload(np.zeros(n, np.uint32))
        infos.append(gpu.dispatch(IOTA, -(-n // 64), out, np.array([3, n], np.uint32)))
        return out

    g = hetero.Graph("iota")
    g.output(g.gpu(iota))
    return g


async def test_grid_over_the_per_dimension_limit_is_split() -> None:
    n = 70_000 * 64  # 70000 workgroups along x: more than the 65535 one dispatch may have
    infos: list[DispatchInfo] = []
    async with hetero.Runtime() as rt:
        out = await rt.run(iota_graph(n, infos))
        limit = rt.device().limits["max-compute-workgroups-per-dimension"]
    np.testing.assert_array_equal(out, np.arange(n, dtype=np.uint32) * 3)
    (info,) = infos
    assert info.workgroups == (70_000, 1, 1)
    assert info.sub_dispatches >= 2 and info.chunk <= limit


async def test_small_budget_splits_into_several_submissions_with_the_same_result() -> None:
    n = 20_000 * 64
    infos: list[DispatchInfo] = []
    async with hetero.Runtime(gpu_budget_ms=1.0) as rt:
        dev = rt.device()
        before = dev.submissions
        out = await rt.run(iota_graph(n, infos))
        subs = dev.submissions - before
    np.testing.assert_array_equal(out, np.arange(n, dtype=np.uint32) * 3)
    (info,) = infos
    # 1 ms at the default 2 µs per workgroup: 500 workgroups per sub-dispatch and submission.
    assert info.chunk == int(1e6 / DEFAULT_NS_PER_WORKGROUP)
    assert info.sub_dispatches == -(-20_000 // info.chunk)
    # Each sub-dispatch is estimated at the budget, so submissions end between them; once
    # timestamps of the first ones arrive the estimate may shrink and fewer end.
    assert 1 <= info.submissions <= info.sub_dispatches - 1
    assert subs >= info.submissions + 1


async def test_kernels_without_the_grid_helpers_are_refused_with_a_hint(shared_rt: hetero.Runtime) -> None:
    plain = IOTA.replace("hetero_workgroup_id(wid)", "wid")

    def big(gpu: hetero.GPUContext) -> Tensor:
        out = gpu.empty(4, np.uint32)
        gpu.dispatch(plain, 70_000, out, np.array([1, 4], np.uint32))
        return out

    g = hetero.Graph("plain")
    g.output(g.gpu(big))
    with pytest.raises(StageError, match=r"70000 workgroups in x exceed the adapter's limit of \d+ per dimension; "
                                         r"use hetero_workgroup_id\(\) in the kernel"):
        await shared_rt.run(g)


async def test_unsplit_dispatch_reports_itself(shared_rt: hetero.Runtime) -> None:
    infos: list[DispatchInfo] = []
    out = await shared_rt.run(iota_graph(1000, infos))
    np.testing.assert_array_equal(out, np.arange(1000, dtype=np.uint32) * 3)
    assert infos[0].sub_dispatches == 1 and infos[0].submissions == 0 and infos[0].workgroups == (16, 1, 1)


def test_cost_model_rises_at_once_and_decays_slowly() -> None:
    m = CostModel()
    assert m.ns_per_workgroup("k") == DEFAULT_NS_PER_WORKGROUP and m.source("k") == "default"
    m.observe("k", 1000, 1_000_000, source="wall")  # 1000 ns per workgroup
    assert m.ns_per_workgroup("k") == 1000 and m.source("k") == "wall"
    m.observe("k", 1000, 4_000_000, source="wall")
    assert m.ns_per_workgroup("k") == 4000  # rise at once
    m.observe("k", 1000, 0.0 + 2_000_000, source="wall")
    assert m.ns_per_workgroup("k") == pytest.approx(3500)  # decay slowly
    m.observe("k", 1000, 100_000, source="timestamp")
    assert m.ns_per_workgroup("k") == 100 and m.source("k") == "timestamp"  # a GPU measurement wins
    m.observe("k", 1000, 9_000_000, source="wall")
    assert m.ns_per_workgroup("k") == 100  # and a wall-clock bound never overrides it
    assert m.chunk("k", 1e6, per_x=2, limit=65535) == 5000
    assert m.chunk("k", 1.0, per_x=1, limit=65535) == 1
    assert m.chunk("k", 1e12, per_x=1, limit=65535) == 65535


async def test_long_submissions_calibrate_the_cost_model() -> None:
    heavy = IOTA.replace("out[i] = out[i] + i * p.k;",
                         "var a = i; for (var j = 0u; j < 200u; j++) { a = a * 1664525u + 1013904223u; } "
                         "out[i] = out[i] + i * p.k + (a & 0u);")
    n = 60_000 * 64

    def run(gpu: hetero.GPUContext) -> Tensor:
        out = gpu.upload(np.zeros(n, np.uint32))
        gpu.dispatch(heavy, -(-n // 64), out, np.array([1, n], np.uint32))
        return out

    g = hetero.Graph("heavy")
    g.output(g.gpu(run))
    async with hetero.Runtime() as rt:
        out = await rt.run(g)
        dev = rt.device()
        (k,) = [k for k in dev._kernels.values() if k.grid]
        np.testing.assert_array_equal(out, np.arange(n, dtype=np.uint32))
        # GPU timestamps where the adapter writes them inside passes (lavapipe does), else fence wall time.
        assert dev.cost.source(k.key) == ("timestamp" if dev.timer.strategy == "inside-passes" else "wall")
        assert dev.cost.ns_per_workgroup(k.key) != DEFAULT_NS_PER_WORKGROUP


def test_prelude_goes_after_directives() -> None:
    from hetero._gpu.grid import PRELUDE, with_prelude

    src = "// header\nenable f16;\nrequires readonly_and_readwrite_storage_textures;\n@compute fn main() {}\n"
    out = with_prelude(src)
    assert out.index("enable f16;") < out.index(PRELUDE) < out.index("@compute")
    assert with_prelude("@compute fn main() {}").startswith(PRELUDE)
