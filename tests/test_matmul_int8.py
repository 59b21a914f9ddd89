"""``hetero.kernels.matmul_int8``: quantization on the host, both kernel strategies on a real device."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import hetero
import hetero.kernels.matmul_int8 as Q8
from hetero import Tensor
from hetero.kernels.matmul import MatmulConfig
from hetero.kernels.matmul_int8 import QuantizedWeight, matmul_int8, quantize_weight

pytestmark = pytest.mark.anyio
ASYNCIO_ONLY = pytest.mark.parametrize("anyio_backend", ["asyncio"])
STRATEGIES = ["dequant", "dp4a", "dp4a-g32", "dp4a-g64"]
# M, N, K: odd and partial tiles, K not a multiple of 4 or 16, N not a multiple of 4
SHAPES = [(1, 1, 1), (5, 7, 3), (33, 65, 17), (64, 64, 64), (70, 130, 131), (3, 4, 1000)]
F32_RTOL = 2e-6  # float32 accumulation, relative to sum_k |x_k| |w_kn|


def rand(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def assert_within(op: str, shape: str, rule: str, got: np.ndarray, want: np.ndarray, tol: np.ndarray) -> None:
    """Every output within its tolerance; else name the op, the shapes, the rule and the worst element."""
    assert got.shape == want.shape, f"{op} {shape}: result is {got.shape}, expected {want.shape}"
    err = np.abs(got.astype(np.float64) - want)
    ratio = err / np.maximum(tol, 1e-300)
    if ratio.size and float(ratio.max()) > 1.0:
        i = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
        raise AssertionError(f"{op} {shape}: rule '{rule}' broken at {tuple(int(j) for j in i)}: "
                             f"got {got[i]!r}, want {want[i]!r}, error {err[i]:.3g} > tolerance {tol[i]:.3g} "
                             f"({int((ratio > 1).sum())} of {ratio.size} outputs)")


def expected(x: np.ndarray, qw: QuantizedWeight, strategy: str,
             bias: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """x' dequant(q) + bias in float64 (x' = x, or its per-row int8 quantization for dp4a) and its tolerance."""
    dq = qw.dequantize().astype(np.float64)
    if strategy.startswith("dp4a"):
        g = Q8.GROUPS.get(strategy, 0)
        xq, rs = Q8.quantize_activations(x, group=g)
        rsk = np.repeat(rs, g, axis=-1)[..., :x.shape[-1]] if g else rs  # the scale of each x_k
        x64 = xq.astype(np.float64) * rsk
        # the GPU may round a tie (or a product one ulp off a tie) the other way: one quantum of x
        slack = rs.astype(np.float64).max(axis=-1, keepdims=True, initial=0.0) * \
            np.abs(dq).max(axis=0, initial=0.0) * 1.01
    else:
        x64, slack = x.astype(np.float64), 0.0
    want = x64 @ dq + (bias.astype(np.float64) if bias is not None else 0.0)
    tol = F32_RTOL * (np.abs(x64) @ np.abs(dq) + (np.abs(bias) if bias is not None else 0.0)) + slack + 1e-30
    return want, tol


def stage_graph(strategy: str, **kw: Any) -> hetero.Graph:
    """
    ::

        x, packed, scales(, bias) --> matmul_int8 (gpu) --> (output)
    """
    def stage(gpu: hetero.GPUContext, x: Tensor, qw: QuantizedWeight, bias: Tensor | None) -> Tensor:
        return matmul_int8(gpu, x, qw, bias=bias, strategy=strategy, **kw)

    g = hetero.Graph(f"int8-{strategy}")
    g.output(g.gpu(stage, g.input("x"), g.input("qw"), g.input("bias"), name="matmul_int8"))
    return g


# -- host side ----------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (17, 9), (64, 33), (131, 130)])
@pytest.mark.parametrize("transpose_b", [False, True])
def test_quantize_weight_layout_and_bound(shape: tuple[int, int], transpose_b: bool) -> None:
    k, n = shape
    w = rand((n, k) if transpose_b else (k, n), k * 1000 + n)
    qw = quantize_weight(w, transpose_b=transpose_b)
    wk = w.T if transpose_b else w
    assert (qw.k, qw.n) == (k, n) and qw.scales.shape == (n,) and qw.scales.dtype == np.float32
    assert qw.packed.dtype == np.uint32 and qw.packed.shape == (-(-k // 16) * 4, -(-n // 4) * 4)
    np.testing.assert_allclose(qw.scales, np.abs(wk).max(axis=0) / 127, rtol=1e-6)
    q = qw.values()
    assert q.shape == (k, n) and int(np.abs(q.astype(np.int32)).max()) <= 127
    # byte j of word [k4, n] is q[4 k4 + j, n]
    words = qw.packed
    for kk, nn in [(0, 0), (k - 1, n - 1), (k // 2, n // 2)]:
        byte = (int(words[kk // 4, nn]) >> (8 * (kk % 4))) & 0xFF
        assert np.int8(np.uint8(byte)) == q[kk, nn]
    assert np.all(words.view(np.uint8).reshape(words.shape[0], -1, 4)[:, n:] == 0)  # padded channels
    err = np.abs(wk.astype(np.float64) - qw.dequantize())
    bound = qw.scales.astype(np.float64)[None, :] / 2 * (1 + 1e-6)
    assert_within("quantize_weight", f"w {list(w.shape)} transpose_b={transpose_b}",
                  "|w - dequant(q)| <= scale_n / 2", qw.dequantize(), wk.astype(np.float64),
                  np.broadcast_to(bound, err.shape))


def test_quantize_weight_zero_column_and_errors() -> None:
    w = rand((8, 3), 1)
    w[:, 1] = 0.0
    qw = quantize_weight(w)
    assert qw.scales[1] == 0 and np.all(qw.values()[:, 1] == 0) and np.all(np.isfinite(qw.dequantize()))
    with pytest.raises(ValueError, match=r"quantize_weight: w is \[2, 3, 4\]"):
        quantize_weight(np.zeros((2, 3, 4), np.float32))
    with pytest.raises(TypeError, match="float"):
        quantize_weight(np.zeros((2, 3), np.int32))
    with pytest.raises(ValueError, match="NaN"):
        quantize_weight(np.full((2, 3), np.nan, np.float32))


@pytest.mark.parametrize("group", [32, 64])
def test_quantize_activations_per_group(group: int) -> None:
    x = rand((3, 2, 150), 5)  # K = 150: the last group is short
    x[..., 7] *= 50.0  # an outlier channel: only its group's scale grows
    q, rs = Q8.quantize_activations(x, group=group)
    ng = -(-150 // group)
    assert q.shape == x.shape and q.dtype == np.int8 and rs.shape == (3, 2, ng) and rs.dtype == np.float32
    for g in range(ng):
        sl = slice(g * group, min(150, (g + 1) * group))
        q1, rs1 = Q8.quantize_activations(x[..., sl])
        np.testing.assert_array_equal(q[..., sl], q1)
        np.testing.assert_array_equal(rs[..., g:g + 1], rs1)
    err_g = np.abs(x - q * np.repeat(rs, group, axis=-1)[..., :150])[..., group:]
    q0, rs0 = Q8.quantize_activations(x)
    err_row = np.abs(x - q0 * rs0)[..., group:]
    assert err_g.max() < err_row.max() / 10  # the groups without the outlier keep their resolution
    w = rand((150, 9), 6)
    qw = quantize_weight(w)
    assert np.all(qw.error_bound(x, f"dp4a-g{group}") < qw.error_bound(x, "dp4a"))


# -- on the device ------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_against_dequantized_and_float_weight(shared_rt: hetero.Runtime, strategy: str) -> None:
    """Tight against x dequant(q) (float64), and against x w within the documented bound."""
    g = stage_graph(strategy)
    inputs = []
    for i, (m, n, k) in enumerate(SHAPES):
        x, w = rand((m, k), i), rand((k, n), 100 + i)
        inputs.append({"x": x, "qw": quantize_weight(w), "bias": rand((n,), 200 + i) if i % 2 else None, "w": w})
    results = [r async for r in shared_rt.map(g, ({k: v for k, v in d.items() if k != "w"} for d in inputs))]
    for (m, n, k), d, got in zip(SHAPES, inputs, results):
        x, qw, bias, w = d["x"], d["qw"], d["bias"], d["w"]
        shape = f"x [{m}, {k}] @ w [{k}, {n}] strategy={strategy} bias={bias is not None}"
        want, tol = expected(x, qw, strategy, bias)
        assert got.dtype == np.float32
        assert_within("matmul_int8", shape, "x' dequant(q) within float32 rounding", got, want, tol)
        exact = x.astype(np.float64) @ w.astype(np.float64) + (bias if bias is not None else 0.0)
        bound = qw.error_bound(x, strategy) * (1 + 1e-5) + F32_RTOL * (np.abs(x) @ np.abs(w).astype(np.float64))
        assert_within("matmul_int8", shape, "|y - x w| <= documented bound", got, exact, bound)


@ASYNCIO_ONLY
@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_random_shapes_batched_and_resident(shared_rt: hetero.Runtime, strategy: str) -> None:
    """[B, S, K] activations, random odd shapes, the weight resident across runs, transpose_b weights."""
    rng = np.random.default_rng(42)
    for i in range(4):
        b, s, k, n = (int(v) for v in (rng.integers(1, 4), rng.integers(1, 40), rng.integers(1, 150),
                                       rng.integers(1, 90)))
        x, w = rand((b, s, k), 300 + i), rand((n, k), 400 + i)
        qw = quantize_weight(w, transpose_b=True)
        gw = Q8.resident(shared_rt, qw)
        try:
            def stage(gpu: hetero.GPUContext, x: Tensor) -> Tensor:
                return matmul_int8(gpu, x, gw, strategy=strategy)

            g = hetero.Graph("resident")
            g.output(g.gpu(stage, g.input("x")))
            for rep in range(2):
                got = await shared_rt.run(g, x=x)
                shape = f"x {[b, s, k]} @ w.T {[n, k]} strategy={strategy} run {rep}"
                assert got.shape == (b, s, n), shape
                want, tol = expected(x.reshape(-1, k), qw, strategy, None)
                assert_within("matmul_int8", shape, "x' dequant(q) within float32 rounding",
                              got.reshape(-1, n), want, tol)
        finally:
            gw.release()


@ASYNCIO_ONLY
@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_configurations(shared_rt: hetero.Runtime, strategy: str) -> None:
    """Single and double buffering, deeper slices, partial thread loads, several tiles."""
    cands = Q8.DP4A_CANDIDATES if strategy.startswith("dp4a") else Q8.DEQUANT_CANDIDATES
    limits = shared_rt.device().limits
    configs = [c for c in cands if Q8._fits(c, strategy, limits) is None] + [
        MatmulConfig(32, 32, 16 if strategy.startswith("dp4a") else 4, 4, 4, double_buffer=False),
        MatmulConfig(64, 32, 32, 8, 4)]
    x, w, bias = rand((37, 150), 1), rand((150, 70), 2), rand((70,), 3)
    qw = quantize_weight(w)
    want, tol = expected(x, qw, strategy, bias)
    for c in configs:
        got = await shared_rt.run(stage_graph(strategy, config=c), x=x, qw=qw, bias=bias)
        assert_within("matmul_int8", f"x [37, 150] @ w [150, 70] strategy={strategy} config={c.name}",
                      "x' dequant(q) within float32 rounding", got, want, tol)


def test_wgsl_and_errors() -> None:
    c = MatmulConfig(64, 64, 8, 8, 8)
    assert "dot4I8Packed" in Q8.wgsl(MatmulConfig(64, 64, 32, 8, 8), "dp4a")
    assert "dot4I8Packed" not in Q8.wgsl(c, "dequant", vec_a=False, vec_c=False, bias=True)
    with pytest.raises(ValueError, match="multiple of 16"):
        Q8.wgsl(c, "dp4a")
    grouped = Q8.wgsl(MatmulConfig(64, 64, 16, 8, 8), "dp4a-g64")  # a group spans 4 slices
    assert "dot4I8Packed" in grouped and "% 4u == 0u" in grouped
    with pytest.raises(ValueError, match="divide or be a multiple of the group 64"):
        Q8.wgsl(MatmulConfig(64, 64, 48, 8, 8), "dp4a-g64")
    with pytest.raises(ValueError, match="unknown strategy"):
        Q8.wgsl(MatmulConfig(64, 64, 32, 8, 8), "dp4a-g16")
    with pytest.raises(ValueError, match="split_k"):
        Q8.wgsl(MatmulConfig(64, 64, 8, 8, 8, split_k=2), "dequant")


@ASYNCIO_ONLY
async def test_shape_errors_name_the_op(shared_rt: hetero.Runtime) -> None:
    qw = quantize_weight(rand((6, 5), 1))
    with pytest.raises(hetero.StageError, match=r"matmul_int8: a is \[3, 7\] and the weight is \[K=6, N=5\]"):
        await shared_rt.run(stage_graph("dequant"), x=rand((3, 7), 2), qw=qw, bias=None)
    with pytest.raises(hetero.StageError, match=r"matmul_int8: bias is \[4\]"):
        await shared_rt.run(stage_graph("dequant"), x=rand((3, 6), 2), qw=qw, bias=rand((4,), 3))
    with pytest.raises(hetero.StageError, match="strategy must be"):
        await shared_rt.run(stage_graph("int4"), x=rand((3, 6), 2), qw=qw, bias=None)


@ASYNCIO_ONLY
async def test_empty_rows(shared_rt: hetero.Runtime) -> None:
    got = await shared_rt.run(stage_graph("dp4a"), x=np.zeros((0, 6), np.float32), qw=quantize_weight(rand((6, 5), 1)),
                              bias=None)
    assert got.shape == (0, 5)
