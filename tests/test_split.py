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


def test_quiet_until_is_when_the_first_of_its_keys_is_due_a_sample() -> None:
    from hetero._gpu.grid import RESAMPLE_S

    clock = [100.0]
    m = CostModel(clock=lambda: clock[0])
    assert m.quiet_until(["a", "b"]) == 0.0
    for _ in range(8):  # the first 8 dispatches of each kernel are timed
        assert m.should_time("a") and m.should_time("b")
    assert m.quiet_until(["a", "b"]) == 0.0  # sampled once a second from now on, not yet
    assert m.should_time("a")
    clock[0] = 100.5
    assert m.should_time("b") and not m.should_time("a")
    assert m.quiet_until(["a", "b"]) == 100.0 + RESAMPLE_S
    assert m.quiet_until(["b"]) == 100.5 + RESAMPLE_S
    assert m.quiet_until([]) == float("inf")
    clock[0] = 100.0 + RESAMPLE_S
    assert m.now() >= m.quiet_until(["a", "b"]) and m.should_time("a")


async def test_replays_time_their_grid_kernels_when_one_is_due(monkeypatch: pytest.MonkeyPatch) -> None:
    """A replay asks the cost model per dispatch only when its quiet time is over: the first 8 of
    each kernel, then about once a second; the samples still come."""
    asked: list[object] = []
    orig = CostModel.should_time

    def counting(self: CostModel, key: object) -> bool:
        asked.append(key)
        return orig(self, key)

    monkeypatch.setattr(CostModel, "should_time", counting)
    n = 4096

    def run(gpu: hetero.GPUContext, x: Tensor) -> Tensor:
        gpu.dispatch(IOTA, -(-n // 64), x, np.array([1, n], np.uint32))
        return x

    g = hetero.Graph("replays")
    x = g.input("x")
    g.output(g.gpu(run, x, capture=True))
    async with hetero.Runtime(cpu_threads=2) as rt:
        rt.device().cost._clock = lambda: 0.0  # the clock stands still: no once-a-second sample
        for _ in range(20):
            await rt.run(g, x=np.zeros(n, np.uint32))
        assert len(asked) == 9  # the first 8 (the capture's included), the first sample a second; then none
        rt.device().cost._clock = lambda: 10.0
        out = await rt.run(g, x=np.zeros(n, np.uint32))
        assert len(asked) == 10  # a second on: sampled again
    np.testing.assert_array_equal(out, np.arange(n, dtype=np.uint32))


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
    from hetero._gpu.grid import prelude, with_prelude

    src = "// header\nenable f16;\nrequires readonly_and_readwrite_storage_textures;\n@compute fn main() {}\n"
    out = with_prelude(src, 3)
    assert out.index("enable f16;") < out.index(prelude(3)) < out.index("@compute")
    assert "@group(0) @binding(3) var<uniform> hetero_grid" in prelude(3)
    assert with_prelude("@compute fn main() {}", 0).startswith(prelude(0))


# Two entry points: `grid` reaches the helpers through a function of its own, `plain` does not.
TWO_ENTRIES = """
@group(0) @binding(0) var<storage, read_write> out: array<u32>;
fn index_of(wid: vec3<u32>, lid: vec3<u32>) -> u32 { return hetero_workgroup_id(wid).x * 64u + lid.x; }
fn plain_index(wid: vec3<u32>, lid: vec3<u32>) -> u32 { return wid.x * 64u + lid.x; }
@compute @workgroup_size(64)
fn grid(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = index_of(wid, lid);
    if (i < arrayLength(&out)) { out[i] = i + 1u; }
}
@compute @workgroup_size(64)
fn plain(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = plain_index(wid, lid);  // hetero_workgroup_id(wid) in a comment does not count
    if (i < arrayLength(&out)) { out[i] = 2u * i; }
}
"""


def test_the_grid_is_found_through_the_functions_an_entry_point_calls() -> None:
    from hetero._gpu.grid import entry_uses_grid

    assert entry_uses_grid(TWO_ENTRIES, "grid")
    assert not entry_uses_grid(TWO_ENTRIES, "plain")
    assert entry_uses_grid(TWO_ENTRIES, "missing")  # wgpu says what is wrong when it compiles
    nested = "fn a() -> u32 { return b(); }\nfn b() -> u32 { return hetero_num_workgroups().x; }\n" \
             "@compute @workgroup_size(1) fn main() { let n = a(); }"
    assert entry_uses_grid(nested, "main")


async def test_grid_kernels_bind_one_group_with_the_grid_uniform_last(shared_rt: hetero.Runtime) -> None:
    n = 1000
    ks = []

    def run(gpu: hetero.GPUContext) -> tuple[Tensor, Tensor]:
        a, b = gpu.empty((n,), np.uint32), gpu.empty((n,), np.uint32)
        for entry, out in (("grid", a), ("plain", b)):
            k = gpu.kernel(TWO_ENTRIES, entry)
            ks.append(k)
            gpu.dispatch(k, -(-n // 64), out)
        return a, b

    g = hetero.Graph("two-entries")
    g.output(g.gpu(run))
    a, b = await shared_rt.run(g)
    np.testing.assert_array_equal(a, np.arange(n, dtype=np.uint32) + 1)
    np.testing.assert_array_equal(b, 2 * np.arange(n, dtype=np.uint32))
    grid, plain = ks
    assert (grid.grid, plain.grid) == (True, False)
    assert grid.n_bindings == plain.n_bindings == 1 and len(grid.layouts) == len(plain.layouts) == 1


async def test_a_grid_kernel_with_a_gap_in_its_bindings_is_refused(shared_rt: hetero.Runtime) -> None:
    src = IOTA.replace("@binding(1) var<uniform> p", "@binding(2) var<uniform> p")

    def run(gpu: hetero.GPUContext) -> int:
        gpu.kernel(src)
        return 0

    g = hetero.Graph("gap")
    g.output(g.gpu(run))
    with pytest.raises(StageError) as e:
        await shared_rt.run(g)
    msg = str(e.value)
    assert "grid helpers" in msg and "0..1" in msg and "@binding(0, 2)" in msg and "without gaps" in msg
