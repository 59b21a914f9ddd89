"""GPU reductions (``hetero.ops``: sum, mean, max, min, argmax, argmin) against numpy on a real device."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest

import hetero
import hetero.kernels.reduce as R
import hetero.ops
from hetero import StageError, Tensor

pytestmark = pytest.mark.anyio

OPS = ("sum", "mean", "max", "min", "argmax", "argmin")
ASYNCIO_ONLY = pytest.mark.parametrize("anyio_backend", ["asyncio"])  # heavy: once is enough


def reduce_graph(axis: int | None, ops: tuple[str, ...] = OPS) -> hetero.Graph:
    """
    ::

            +-> sum (gpu) -----+
        x --+-> mean (gpu) ----+--> (one output per op)
            +-> ...  (gpu) ----+
    """
    g = hetero.Graph(f"reduce-{axis}")
    x = g.input("x")
    g.output(*[g.gpu(getattr(hetero.ops, op), x, name=op, axis=axis) for op in ops])
    return g


def numpy_ref(op: str, a: np.ndarray, axis: int | None) -> Any:
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)  # mean of empty
        return getattr(np, op)(a, axis=axis)


def expected_dtype(op: str, dtype: np.dtype) -> np.dtype:
    if op.startswith("arg"):
        return np.dtype(np.int32)
    if op == "sum" and dtype == np.int32:
        return np.dtype(np.int64)
    if op == "mean":
        return np.dtype(np.float32)
    return dtype


def check(op: str, got: Any, a: np.ndarray, axis: int | None) -> None:
    want = numpy_ref(op, a, axis)
    if isinstance(got, Tensor) and got.size == 0:
        # the runtime hands zero-size results out as the (empty) Tensor: nothing to download
        got = np.empty(got.shape, got.dtype)
    got = np.asarray(got)
    assert got.shape == np.shape(want), (op, a.shape, axis)
    assert got.dtype == expected_dtype(op, a.dtype), (op, a.dtype, got.dtype)
    if op in ("sum", "mean") and (a.dtype == np.float32 or op == "mean"):
        # a tree sum's error is a few ulps of sum(|a|), not of the result
        finite = np.where(np.isfinite(a), a, 0).astype(np.float64)
        scale = np.sum(np.abs(finite), axis=axis)
        if op == "mean":
            scale = scale / max(1, a.size if axis is None else a.shape[axis])
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6 * np.max(scale, initial=0.0) + 1e-30,
                                   equal_nan=True, err_msg=f"{op} of shape {a.shape} along axis {axis}")
    else:
        np.testing.assert_array_equal(got, want, err_msg=f"{op} of shape {a.shape} along axis {axis}")


class Spy:
    """A GPUContext stand-in that notes every dispatch: (kernel label, workgroups)."""

    def __init__(self, gpu: hetero.GPUContext) -> None:
        self._gpu = gpu
        self.dispatches: list[tuple[str, Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._gpu, name)

    def dispatch(self, kernel: Any, workgroups: Any, *bindings: Any) -> Any:
        self.dispatches.append((kernel.label, workgroups))
        return self._gpu.dispatch(kernel, workgroups, *bindings)


def spied_graph(op: str, axis: int | None, seen: list[list[tuple[str, Any]]]) -> hetero.Graph:
    """
    ::

        x -> <op> (gpu, through a Spy that records the passes)
    """
    def stage(gpu: hetero.GPUContext, x: Tensor) -> Tensor:
        spy = Spy(gpu)
        out = getattr(hetero.ops, op)(spy, x, axis=axis)
        seen.append(spy.dispatches)
        return out

    g = hetero.Graph(f"spied-{op}")
    g.output(g.gpu(stage, g.input("x"), name=op))
    return g


def random(shape: int | tuple[int, ...], dtype: Any, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if np.dtype(dtype) == np.int32:
        return rng.integers(-(2**31), 2**31, shape, dtype=np.int64).astype(np.int32)
    return rng.standard_normal(shape).astype(np.float32)


# -- values against numpy -------------------------------------------------------------------
SIZES = (1, 2, 3, 4, 5, 7, 8, 255, 256, 257, 1023, 1024, 1025, 2049, 4097, 65537, 262147)


@pytest.mark.parametrize("dtype", [np.float32, np.int32])
async def test_whole_tensor_matches_numpy(shared_rt: hetero.Runtime, dtype: Any) -> None:
    arrays = [random(n, dtype, seed=n) for n in SIZES]
    arrays += [random((4, 5, 6), dtype), random((), dtype), random((3, 1), dtype)]
    g = reduce_graph(None)
    results = [r async for r in shared_rt.map(g, ({"x": a} for a in arrays), max_in_flight=4)]
    for a, got in zip(arrays, results):
        for op, r in zip(OPS, got):
            check(op, r, a, None)


@pytest.mark.parametrize("axis", [0, 1, -1, -2])
async def test_axis_reductions_match_numpy(shared_rt: hetero.Runtime, axis: int) -> None:
    shapes = [(3, 1000), (1000, 3), (1, 7), (7, 1), (257, 513), (64, 64), (2, 4096), (4096, 2), (5, 12)]
    arrays = [random(s, dt, seed=i) for i, s in enumerate(shapes) for dt in (np.float32, np.int32)]
    g = reduce_graph(axis)
    results = [r async for r in shared_rt.map(g, ({"x": a} for a in arrays), max_in_flight=4)]
    for a, got in zip(arrays, results):
        for op, r in zip(OPS, got):
            check(op, r, a, axis)


async def test_1d_axis_is_the_whole_tensor(shared_rt: hetero.Runtime) -> None:
    a = random(1000, np.float32)
    for axis in (0, -1):
        for op, r in zip(OPS, await shared_rt.run(reduce_graph(axis), x=a)):
            assert np.shape(r) == ()
            check(op, r, a, axis)


NAN, INF = np.nan, np.inf
SPECIAL = [
    [1, NAN, 3], [NAN], [INF, 1], [-INF, INF], [INF, INF], [-INF, -INF, 2], [3, NAN, 5, NAN],
    [-0.0, 0.0], [0.0, -0.0], [1, 5, 5, 2], [-1, -5, -5, -2], [7, 7, 7],
    [3.4028235e38, 3.4028235e38],  # the sum overflows to inf, as in numpy
    list(np.r_[np.zeros(10000), NAN, np.zeros(9), NAN, -INF]),
]


async def test_nan_inf_ties_and_signed_zero_like_numpy(shared_rt: hetero.Runtime) -> None:
    arrays = [np.array(v, np.float32) for v in SPECIAL]
    g = reduce_graph(None)
    results = [r async for r in shared_rt.map(g, ({"x": a} for a in arrays), max_in_flight=4)]
    for a, got in zip(arrays, results):
        for op, r in zip(OPS, got):
            check(op, r, a, None)
    # NaN in some rows and columns of a 2-D tensor, on both axes
    m = random((6, 300), np.float32)
    m[1, 17] = m[1, 200] = m[4, 0] = NAN
    m[3, 5] = INF
    m[2, :] = 1.0  # ties: first index
    for axis in (0, 1):
        for op, r in zip(OPS, await shared_rt.run(reduce_graph(axis), x=m)):
            check(op, r, m, axis)


async def test_int32_extremes_and_exact_int64_sums(shared_rt: hetero.Runtime) -> None:
    big = np.full(100_003, 2**31 - 1, np.int32)
    big[::7] = -(2**31)
    arrays = [np.array([-(2**31), 2**31 - 1, -(2**31), 2**31 - 1], np.int32), big,
              np.full(5000, 2**31 - 1, np.int32)]
    g = reduce_graph(None)
    for a in arrays:
        got = await shared_rt.run(g, x=a)
        for op, r in zip(OPS, got):
            check(op, r, a, None)
        assert int(got[0]) == int(a.astype(np.int64).sum())  # exact, no int32 wrap-around


async def test_empty_inputs_follow_numpy(shared_rt: hetero.Runtime) -> None:
    s, m = await shared_rt.run(reduce_graph(None, ("sum", "mean")), x=np.zeros(0, np.float32))
    assert s.shape == () and s == 0.0 and s.dtype == np.float32
    assert m.shape == () and np.isnan(m)
    s, m = await shared_rt.run(reduce_graph(0, ("sum", "mean")), x=np.zeros((0, 3), np.float32))
    np.testing.assert_array_equal(s, np.zeros(3, np.float32))
    assert m.shape == (3,) and np.isnan(m).all()
    # nothing to reduce into: empty results, even for ops without an identity
    for shape, axis in (((3, 0), 0), ((0, 3), 1)):
        for op, r in zip(OPS, await shared_rt.run(reduce_graph(axis), x=np.zeros(shape, np.float32))):
            check(op, r, np.zeros(shape, np.float32), axis)
    s = await shared_rt.run(reduce_graph(None, ("sum",)), x=np.zeros((0, 4), np.int32))
    assert s.dtype == np.int64 and s == 0
    cases = [
        ("max", (0,), None, "max: zero-size tensor of shape (0,): max has no identity (numpy raises too); "
                            "check the size before reducing"),
        ("argmin", (0, 3), 0, "argmin: zero-size tensor of shape (0, 3) along axis 0: argmin of an empty "
                              "sequence has no answer (numpy raises too); check the size before reducing"),
        ("min", (3, 0), -1, "min: zero-size tensor of shape (3, 0) along axis -1: min has no identity "
                            "(numpy raises too); check the size before reducing"),
    ]
    for op, shape, axis, msg in cases:
        with pytest.raises(StageError) as e:
            await shared_rt.run(reduce_graph(axis, (op,)), x=np.zeros(shape, np.float32))
        assert str(e.value) == f"gpu stage '{op}' failed: ValueError: {msg}"
        assert isinstance(e.value.__cause__, ValueError)


async def test_errors_name_the_op_the_shape_and_the_rule(shared_rt: hetero.Runtime) -> None:
    with pytest.raises(StageError) as e:
        await shared_rt.run(reduce_graph(2, ("max",)), x=np.zeros((3, 4), np.float32))
    assert str(e.value) == ("gpu stage 'max' failed: ValueError: max: axis 2 is out of range for a 2-D tensor "
                            "of shape (3, 4); use 0, 1, -1 or -2")
    # The ops check before they upload or record anything: call them directly.
    gpu = hetero.GPUContext(shared_rt.device(), "direct")
    cases: list[tuple[str, Any, Any, type[Exception], str]] = [
        ("sum", np.zeros((2, 3, 4), np.float32), 0, ValueError,
         "sum: axis=0 given for a 3-D tensor of shape (2, 3, 4); axis reductions support 1-D and 2-D tensors "
         "only: reshape to 2-D, or pass axis=None for the whole tensor"),
        ("mean", np.zeros(5, np.float32), 1, ValueError,
         "mean: axis 1 is out of range for a 1-D tensor of shape (5,); use 0 or -1"),
        ("argmax", np.zeros(5, np.float64), None, TypeError,
         "argmax: unsupported dtype float64 (tensor of shape (5,)); supported: float32, int32"),
        ("min", np.zeros(5, np.float32), True, TypeError, "min: axis must be None or an int, got True"),
        ("sum", [1.0, 2.0], None, TypeError, "sum: expected a hetero.Tensor (or a numpy array), got list"),
    ]
    for op, x, axis, exc, msg in cases:
        with pytest.raises(exc) as info:
            getattr(hetero.ops, op)(gpu, x, axis=axis)
        assert str(info.value) == msg
    assert gpu.blocks == [] and gpu.workgroups == 0  # nothing allocated, nothing recorded


# -- how the work is done -------------------------------------------------------------------
async def test_subgroup_and_workgroup_memory_paths_agree(shared_rt: hetero.Runtime,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    if "subgroup" not in shared_rt.device().features:
        pytest.skip("the adapter has no subgroup operations")
    a = random(100_001, np.float32)
    m = random((5, 3000), np.float32)
    for use in (True, False):
        monkeypatch.setattr(R, "USE_SUBGROUPS", use)
        for op in OPS:
            seen: list[list[tuple[str, Any]]] = []
            check(op, await shared_rt.run(spied_graph(op, None, seen), x=a), a, None)
            check(op, await shared_rt.run(spied_graph(op, 1, seen), x=m), m, 1)
            labels = [label for d in seen for label, _ in d]
            # subgroups reduce whole-workgroup rows (tk256); narrower layouts use workgroup memory
            assert [lb.endswith(".subgroups") for lb in labels] == [use and ".tk256." in lb for lb in labels]
            assert any(".tk256." in lb for lb in labels)


async def test_pass_plan_and_scratch_returns_to_the_pool(shared_rt: hetero.Runtime,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(R, "GRID_TARGET", 2048)  # the GPU plan, whatever the adapter
    seen: list[list[tuple[str, Any]]] = []
    a = random(1 << 20, np.float32)
    check("sum", await shared_rt.run(spied_graph("sum", None, seen), x=a), a, None)
    (first, g1), (second, g2) = seen[-1]
    assert first.startswith("reduce.sum.float32.vec4.pass.tk256") and g1 == (512, 1)
    assert second.startswith("reduce.sum.float32.partial.final.tk256") and g2 == (1, 1)
    check("sum", await shared_rt.run(spied_graph("sum", None, seen), x=a[:7]), a[:7], None)
    assert [(lb.split(".")[3:5], g) for lb, g in seen[-1]] == [(["vec4", "final"], (1, 1))]
    # a tiny grid target: each thread loops over many elements
    monkeypatch.setattr(R, "GRID_TARGET", 2)
    b = random(100_000, np.float32)
    for op in OPS:
        check(op, await shared_rt.run(spied_graph(op, None, seen), x=b), b, None)
        assert all(g[0] <= 2 for _, g in seen[-1])
    # one item per thread: a deeper tree of passes
    monkeypatch.setattr(R, "GRID_TARGET", 10**6)
    monkeypatch.setattr(R, "ITEMS_PER_THREAD", 1)
    monkeypatch.setattr(R, "PARTIAL_ITEMS_PER_THREAD", 1)
    c = random(300_001, np.float32)
    for op in OPS:
        check(op, await shared_rt.run(spied_graph(op, None, seen), x=c), c, None)
        assert [g for _, g in seen[-1]] == [(293, 1), (2, 1), (1, 1)]
    assert shared_rt.memory_stats().in_use_bytes == 0


async def test_grids_never_exceed_the_per_dimension_limit(shared_rt: hetero.Runtime,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend the adapter allows 3 workgroups per dimension: rows beyond loop in the kernel."""
    monkeypatch.setattr(R, "MAX_GRID_DIM", 3)
    monkeypatch.setattr(R, "GRID_TARGET", 10**6)
    seen: list[list[tuple[str, Any]]] = []
    for shape, axis in (((257, 513), 1), ((257, 513), 0), ((1000, 3), 1), ((20000,), None)):
        a = random(shape, np.float32)
        for op in ("sum", "argmax"):
            check(op, await shared_rt.run(spied_graph(op, axis, seen), x=a), a, axis)
            assert all(max(g) <= 3 for _, g in seen[-1]), seen[-1]


async def test_windows_when_a_tensor_exceeds_the_binding_limit(shared_rt: hetero.Runtime,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend the adapter binds at most 4 KiB: whole-tensor, row and k-slice windows."""
    monkeypatch.setattr(R, "MAX_BINDING_BYTES", 4096)
    cases = [((5001,), None), ((40, 333), 1), ((3, 3001), 1), ((3, 3000), 1), ((1000, 3), 0)]
    for shape, axis in cases:
        for dt in (np.float32, np.int32):
            a = random(shape, dt, seed=len(shape))
            for op, r in zip(OPS, await shared_rt.run(reduce_graph(axis), x=a)):
                check(op, r, a, axis)
    with pytest.raises(StageError, match=r"sum: tensor of shape \(2, 2000\) along axis 0 gives a result of "
                                         r"8000 bytes, more than the adapter's max-storage-buffer-binding-size"):
        await shared_rt.run(reduce_graph(0, ("sum",)), x=np.zeros((2, 2000), np.float32))


# -- inside real pipelines -----------------------------------------------------------------
CENTER = """
@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read> m: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (gid.x < arrayLength(&y)) { y[gid.x] = x[gid.x] - m[0]; }
}
"""


async def test_results_stay_on_the_gpu_for_the_next_kernel(shared_rt: hetero.Runtime) -> None:
    """
    ::

        x -> peak (gpu: hetero.ops.max) -> shift (gpu: x - peak) -> output
        x ------------------------------------^
        x -> center (gpu: mean and x - mean in one stage) -> output
    """
    def shift(gpu: hetero.GPUContext, x: Tensor, peak: Tensor) -> Tensor:
        assert isinstance(peak, Tensor) and peak.shape == ()
        y = gpu.empty(x.shape, np.float32)
        gpu.dispatch(CENTER, -(-x.size // 64), x, peak, y)
        return y

    def center(gpu: hetero.GPUContext, x: Tensor) -> Tensor:
        return shift(gpu, x, hetero.ops.mean(gpu, x))

    g = hetero.Graph("center")
    x = g.input("x")
    peak = g.gpu(hetero.ops.max, x, name="peak")
    g.output(g.gpu(shift, x, peak, name="shift"), g.gpu(center, x, name="center"))
    a = random(10_000, np.float32)
    shifted, centered = await shared_rt.run(g, x=a)
    np.testing.assert_array_equal(shifted, a - a.max())
    np.testing.assert_allclose(centered, a - a.mean(), atol=1e-5)


async def test_numpy_arrays_are_uploaded(shared_rt: hetero.Runtime) -> None:
    g = hetero.Graph("const")
    g.output(g.gpu(lambda gpu: hetero.ops.sum(gpu, np.arange(10, dtype=np.int32)), name="sum"))
    r = await shared_rt.run(g)
    assert r == 45 and r.dtype == np.int64


@ASYNCIO_ONLY
async def test_accuracy_of_2_24_floats_within_4x_numpy_pairwise(shared_rt: hetero.Runtime,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 sums of 2**24 values (more than 65535 workgroups of 256 threads with one element
    each) against a float64 reference: error at most 4x numpy's pairwise float32 sum, floored at
    one ulp of the result (below that, rounding the result itself decides). Subgroups with the
    adapter's grid, workgroup memory with the GPU grid (2048 workgroups), and a grid of 8
    workgroups (8192 elements per thread; a 2**28-element sum on a GPU has 512)."""
    n = 1 << 24
    rng = np.random.default_rng(24)
    data = {"uniform": rng.random(n, dtype=np.float32), "normal": rng.standard_normal(n, dtype=np.float32)}
    g = reduce_graph(None, ("sum",))
    for dist, a in data.items():
        ref = float(a.sum(dtype=np.float64))
        floor = max(abs(float(np.sum(a)) - ref), float(np.spacing(np.float32(abs(ref)))))
        for use, grid in ((True, None), (False, 2048), (True, 8)):
            monkeypatch.setattr(R, "USE_SUBGROUPS", use)
            monkeypatch.setattr(R, "GRID_TARGET", grid)
            got = float(await shared_rt.run(g, x=a))
            assert abs(got - ref) <= 4 * floor, (dist, use, grid, got, ref, floor)


def test_ops_namespace() -> None:
    public = {n for n in dir(hetero.ops) if not n.startswith("_") and callable(getattr(hetero.ops, n))}
    assert sorted(hetero.ops.__all__) == hetero.ops.__all__
    assert set(hetero.ops.__all__) == public | {"cpu"}  # and the module of CPU implementations
    assert hetero.ops.cpu.sum is not hetero.ops.sum
    assert hetero.ops.sum is R.sum and hetero.ops.argmax is R.argmax
