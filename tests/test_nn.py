"""BERT's non-matmul kernels (``hetero.kernels.nn``) against numpy on a real device (lavapipe in CI)."""

from __future__ import annotations

import math
import re
import warnings
from typing import Any, Callable, Sequence

import numpy as np
import pytest

import hetero
import hetero.kernels.nn as nn
from hetero import StageError, Tensor, ops

pytestmark = pytest.mark.anyio

ASYNCIO_ONLY = pytest.mark.parametrize("anyio_backend", ["asyncio"])  # heavy: once is enough
F32_MIN = float(np.finfo(np.float32).min)
NAN, INF = float("nan"), float("inf")


def rand(shape: Any, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def op_graph(fn: Callable[..., Any], n_inputs: int, **kw: Any) -> hetero.Graph:
    """
    ::

        a0, a1, ... -> <op> (gpu) -> (numpy result)

    Keyword arguments that are strings ``"@ai"`` name graph inputs; the rest are constants.
    """
    g = hetero.Graph(f"nn-{fn.__name__}")
    inputs = [g.input(f"a{i}") for i in range(n_inputs)]
    named: dict[str, Any] = {k: inputs[int(v[2:])] if isinstance(v, str) and v.startswith("@a") else v
                             for k, v in kw.items()}
    used = {int(v[2:]) for v in kw.values() if isinstance(v, str) and v.startswith("@a")}
    args = [a for i, a in enumerate(inputs) if i not in used]
    g.output(g.gpu(fn, *args, name=fn.__name__, **named))
    return g


async def run_many(rt: hetero.Runtime, g: hetero.Graph, cases: Sequence[tuple[np.ndarray, ...]]) -> list[Any]:
    return [r async for r in rt.map(g, ({f"a{i}": a for i, a in enumerate(c)} for c in cases), max_in_flight=4)]


class Spy:
    """A GPUContext stand-in that keeps every dispatch's kernel label and DispatchInfo."""

    def __init__(self, gpu: hetero.GPUContext) -> None:
        self._gpu = gpu
        self.infos: list[hetero.DispatchInfo] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._gpu, name)

    def dispatch(self, kernel: Any, workgroups: Any, *bindings: Any) -> Any:
        info = self._gpu.dispatch(kernel, workgroups, *bindings)
        self.infos.append(info)
        return info


# -- numpy references (float64) ---------------------------------------------------------------
def softmax_ref(x: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    v = x.astype(np.float64)
    if mask is not None:
        m = mask.astype(np.float64)
        m = m.reshape(m.shape[:-1] + (1,) * (v.ndim - m.ndim) + m.shape[-1:]) if m.ndim < v.ndim else m
        v = v + m
    with np.errstate(all="ignore"):
        e = np.exp(v - v.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)


def layernorm_ref(x: np.ndarray, g: np.ndarray, b: np.ndarray, eps: float,
                  res: np.ndarray | None = None) -> np.ndarray:
    v = x.astype(np.float64) + (0.0 if res is None else res.astype(np.float64))
    mu = v.mean(axis=-1, keepdims=True)
    return (v - mu) / np.sqrt(((v - mu) ** 2).mean(axis=-1, keepdims=True) + eps) * g + b


def gelu_ref(x: np.ndarray) -> np.ndarray:
    return np.array([0.5 * v * math.erfc(-v / math.sqrt(2.0)) if math.isfinite(v) else
                     (v if v != -INF else 0.0) for v in x.astype(np.float64).ravel()]).reshape(x.shape)


def attention_ref(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None = None,
                  scale: float | None = None) -> np.ndarray:
    """HF BERT: scores + (1 - mask) * finfo(float32).min, softmax, @ v."""
    s = q.astype(np.float64) @ np.swapaxes(k.astype(np.float64), -1, -2)
    s *= 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if mask is not None:
        s = s + ((1.0 - (mask.reshape(mask.shape[0], -1) != 0)) * F32_MIN)[:, None, None, :]
    return softmax_ref(s) @ v.astype(np.float64)


# -- softmax ------------------------------------------------------------------------------------
SOFTMAX_SHAPES = [(1,), (7,), (3, 1), (5, 7), (4, 128), (2, 3, 33), (2, 384), (3, 1536), (2, 4100), (1, 2, 3, 5)]


async def test_softmax_matches_numpy(shared_rt: hetero.Runtime) -> None:
    arrays = [rand(s, seed=i, scale=4.0) for i, s in enumerate(SOFTMAX_SHAPES)]
    for a, got in zip(arrays, await run_many(shared_rt, op_graph(nn.softmax, 1), [(a,) for a in arrays])):
        assert got.shape == a.shape and got.dtype == np.float32
        np.testing.assert_allclose(got, softmax_ref(a), rtol=2e-6, atol=1e-7, err_msg=str(a.shape))
    for shape in ((0, 5), (3, 0)):
        got = await shared_rt.run(op_graph(nn.softmax, 1), a0=np.zeros(shape, np.float32))
        assert got.shape == shape


@pytest.mark.parametrize("cache_max", [16, 1])  # 1: rows longer than 256 loop over memory
async def test_softmax_large_values_infinities_and_nan_like_numpy(shared_rt: hetero.Runtime, cache_max: int,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nn, "ROW_CACHE_MAX", cache_max)
    x = rand((8, 300), seed=1, scale=3.0)
    x[0, 7] = 1e4                      # one huge score: ~one-hot
    x[1, :] += 1e4                     # large offset: only differences matter
    x[2, ::3] = -1e4                   # masked entries the -10000 way
    x[3, ::2] = -INF                   # masked with -inf: exactly 0
    x[4, :] = -INF                     # nothing but -inf: NaN (numpy: -inf - -inf)
    x[5, 11] = INF                     # +inf: NaN row (inf - inf)
    x[6, 299] = NAN                    # NaN: NaN row
    x[7, :] = F32_MIN                  # finfo.min everywhere: uniform
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        want = softmax_ref(x)
    got = await shared_rt.run(op_graph(nn.softmax, 1), a0=x)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7, equal_nan=True)
    assert np.isnan(got[4:7]).all() and not np.isnan(got[[0, 1, 2, 3, 7]]).any()
    assert (got[3, ::2] == 0).all() and got[0, 7] == pytest.approx(1.0)


async def test_softmax_mask_broadcasts_per_row_group(shared_rt: hetero.Runtime) -> None:
    b, h, s, n = 2, 3, 5, 7
    x = rand((b, h, s, n), seed=2)
    pad = np.zeros((b, n), np.float32)
    pad[1, 4:] = F32_MIN
    masks = [pad, pad.reshape(b, 1, 1, n), np.where(np.arange(n) < 5, 0.0, -1e4).astype(np.float32),
             rand((b, h, n), seed=3), rand((b, h, s, n), seed=4), np.where(rand((b, h, 1, n), 5) > 0, 0.0, -INF)]
    masks[-1][..., 0] = 0.0  # keep one entry per row
    g = op_graph(nn.softmax, 2, mask="@a1")
    for m, got in zip(masks, await run_many(shared_rt, g, [(x, m.astype(np.float32)) for m in masks])):
        np.testing.assert_allclose(got, softmax_ref(x, m), rtol=2e-6, atol=1e-7, err_msg=f"mask {m.shape}")
    got = await shared_rt.run(g, a0=x, a1=pad)
    assert (got[1, ..., 4:] == 0).all()


# -- layernorm ----------------------------------------------------------------------------------
@pytest.mark.parametrize("cache_max", [16, 1])
async def test_layernorm_matches_float64(shared_rt: hetero.Runtime, cache_max: int,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nn, "ROW_CACHE_MAX", cache_max)
    cases = []
    for i, shape in enumerate([(1,), (3, 1), (5, 7), (2, 3, 384), (3, 1000), (2, 4100)]):
        n = shape[-1]
        cases.append((rand(shape, seed=i), rand(n, seed=10 + i), rand(n, seed=20 + i)))
    # A large common offset: E[x^2] - E[x]^2 would cancel to nothing, and a plain float32 mean
    # would be off by ~1e-3; shifting by the row's first value keeps full accuracy.
    cases.append((rand((4, 384), seed=9) + np.float32(1e4), rand(384, seed=8), rand(384, seed=7)))
    g = op_graph(nn.layernorm, 3, eps=1e-12)
    for (x, ga, be), got in zip(cases, await run_many(shared_rt, g, cases)):
        assert got.shape == x.shape and got.dtype == np.float32
        want = layernorm_ref(x, ga, be, 1e-12)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5,
                                   err_msg=str(x.shape))


async def test_layernorm_residual_is_add_and_norm(shared_rt: hetero.Runtime) -> None:
    """
    ::

        x, residual, gamma, beta -> layernorm(x + residual) (gpu)
    """
    g = op_graph(nn.layernorm, 4, residual="@a1", eps=1e-5)
    cases = [(rand(s, 1), rand(s, 2), rand(s[-1], 3), rand(s[-1], 4)) for s in [(7,), (3, 5, 384), (2, 33)]]
    for (x, r, ga, be), got in zip(cases, await run_many(shared_rt, g, cases)):
        np.testing.assert_allclose(got, layernorm_ref(x, ga, be, 1e-5, r), rtol=1e-5, atol=2e-5)
    const = np.full((2, 16), 3.0, np.float32)  # zero variance: (x - mean) = 0, output beta
    got = await shared_rt.run(g, a0=const, a1=const, a2=rand(16, 5), a3=rand(16, 6))
    np.testing.assert_allclose(got, np.broadcast_to(rand(16, 6), (2, 16)), atol=1e-6)


# -- gelu, erf, add, add_bias ------------------------------------------------------------------------
async def test_gelu_is_float32_accurate_everywhere(shared_rt: hetero.Runtime) -> None:
    x = np.concatenate([np.linspace(-14, 14, 40001, dtype=np.float32),
                        np.array([0.0, -0.0, 1e-30, -1e-30, 1e-7, -1e-7, -13.9, -20.0, -1e30, 1e30], np.float32)])
    got = await shared_rt.run(op_graph(nn.gelu, 1), a0=x)
    want = gelu_ref(x)
    big = np.abs(want) > 1e-37  # below: GPUs flush denormals
    rel = np.abs(got[big] - want[big]) / np.abs(want[big])
    assert rel.max() < 1e-6, f"gelu relative error {rel.max():.3g} at x={x[big][rel.argmax()]}"
    assert np.abs(got[~big]).max() < 1e-37
    special = await shared_rt.run(op_graph(nn.gelu, 1), a0=np.array([NAN, INF, -INF, 3.0, -3.0], np.float32))
    assert np.isnan(special[0]) and special[1] == INF and special[2] == 0.0
    odd = rand((3, 5), seed=3, scale=3.0)  # scalar path (15 elements), 2-D
    np.testing.assert_allclose(await shared_rt.run(op_graph(nn.gelu, 1), a0=odd), gelu_ref(odd), rtol=1e-6)


async def test_erf_against_math_erf(shared_rt: hetero.Runtime) -> None:
    z = np.concatenate([np.linspace(-6, 6, 24001, dtype=np.float32),
                        np.array([0.0, 1e-20, -1e-20, 0.99999, 1.0], np.float32)])
    got = await shared_rt.run(op_graph(nn.erf, 1), a0=z)
    want = np.array([math.erf(v) for v in z.astype(np.float64)])
    assert np.abs(got - want).max() < 2e-7
    nz = want != 0
    assert (np.abs(got[nz] - want[nz]) / np.abs(want[nz])).max() < 4e-7  # relative, near 0 too


async def test_add_add_bias_and_fused_gelu_bias(shared_rt: hetero.Runtime) -> None:
    """
    ::

        x, y, b -> add (gpu)       -> +
                -> add_bias (gpu)  -> +--> outputs
                -> gelu(bias) (gpu) -> +
    """
    g = hetero.Graph("elementwise")
    x, y, b = g.input("x"), g.input("y"), g.input("b")
    g.output(g.gpu(nn.add, x, y), g.gpu(nn.add_bias, x, b), g.gpu(nn.gelu, x, name="gelu_bias", bias=b))
    for shape in [(1,), (5,), (3, 7), (4, 8), (2, 3, 384), (1, 1537)]:
        xs, ys, bs = rand(shape, 1), rand(shape, 2), rand(shape[-1], 3)
        s, sb, gb = await shared_rt.run(g, x=xs, y=ys, b=bs)
        np.testing.assert_array_equal(s, xs + ys)
        np.testing.assert_array_equal(sb, xs + bs)
        np.testing.assert_allclose(gb, gelu_ref(xs + bs), rtol=1e-6, atol=1e-30)


# -- transpose and embedding ---------------------------------------------------------------------------
async def test_transpose_permutations(shared_rt: hetero.Runtime) -> None:
    x = rand((2, 3, 4, 8), seed=1)
    perms = [(0, 2, 1, 3), (3, 2, 1, 0), (1, 0, 2, 3), (0, 1, 2, 3), (0, 1, 3, 2), (2, 0, 3, 1), (-4, -2, -3, -1)]
    g = hetero.Graph("transpose")
    xi = g.input("x")
    g.output(*[g.gpu(nn.transpose, xi, p, name=f"t{i}") for i, p in enumerate(perms)])
    for odd in (x, rand((2, 3, 5, 7), seed=2), np.arange(2 * 3 * 4 * 8, dtype=np.int32).reshape(2, 3, 4, 8)):
        for perm, got in zip(perms, await shared_rt.run(g, x=odd)):
            want = np.transpose(odd, perm)
            assert got.dtype == odd.dtype and got.shape == want.shape
            np.testing.assert_array_equal(got, want, err_msg=f"{odd.shape} by {perm}")
    # higher ranks that reduce to <= 4 axes; size-1 axes; 0-d; uint32
    cases: list[tuple[np.ndarray, tuple[int, ...]]] = [
        (rand((2, 1, 3, 4, 5, 6), 3), (0, 1, 4, 5, 2, 3)), (rand((1, 5, 1, 3), 4), (3, 2, 1, 0)),
        (np.array(2.5, np.float32), ()), (np.arange(12, dtype=np.uint32).reshape(3, 4), (1, 0))]
    for a, p in cases:
        got = await shared_rt.run(op_graph(nn.transpose, 1, axes=p), a0=a)
        np.testing.assert_array_equal(got, np.transpose(a, p))


async def test_embedding_gathers_rows(shared_rt: hetero.Runtime) -> None:
    g = op_graph(nn.embedding, 2)
    for hidden in (6, 7, 384):
        table = rand((50, hidden), seed=hidden)
        for ids in (np.array([3], np.int32), np.array([[1, 49, 0], [7, 7, 2]], np.int32),
                    np.arange(50, dtype=np.uint32)[::-1].copy(), np.zeros((2, 0), np.int32)):
            got = await shared_rt.run(g, a0=table, a1=ids)
            assert got.shape == ids.shape + (hidden,)
            np.testing.assert_array_equal(got, table[ids])
    # ids that reach the GPU stage as a Tensor cannot be checked: out of range gives zero rows
    table = rand((10, 8), seed=1)
    got = await shared_rt.run(g, a0=table, a1=np.array([2, -1, 10, 9, 2**31 - 1], np.int32))
    np.testing.assert_array_equal(got, np.stack([table[2], np.zeros(8), np.zeros(8), table[9], np.zeros(8)]))
    got = await shared_rt.run(g, a0=np.arange(12, dtype=np.int32).reshape(4, 3), a1=np.array([3, 0], np.int32))
    np.testing.assert_array_equal(got, [[9, 10, 11], [0, 1, 2]])


# -- attention -------------------------------------------------------------------------------------
def qkv(b: int, h: int, s: int, d: int, seed: int = 0, sk: int | None = None) -> tuple[np.ndarray, ...]:
    sk = s if sk is None else sk
    return rand((b, h, s, d), seed, 1.5), rand((b, h, sk, d), seed + 1, 1.5), rand((b, h, sk, d), seed + 2)


def padding(b: int, s: int) -> np.ndarray:
    """Batch 0 full, batch 1 padded after about half, batch 2 (if any) all padding."""
    m = np.ones((b, s), np.float32)
    if b > 1:
        m[1, s // 2 + 1:] = 0
    if b > 2:
        m[2, :] = 0
    return m


@ASYNCIO_ONLY
@pytest.mark.parametrize("d", [32, 64])
async def test_attention_matches_numpy(shared_rt: hetero.Runtime, d: int) -> None:
    g, gm = op_graph(nn.attention, 3), op_graph(nn.attention, 4, mask="@a3")
    for s in (1, 7, 64, 130):
        q, k, v = qkv(3, 2, s, d, seed=s)
        got = await shared_rt.run(g, a0=q, a1=k, a2=v)
        assert got.shape == q.shape and got.dtype == np.float32
        np.testing.assert_allclose(got, attention_ref(q, k, v), rtol=1e-5, atol=2e-6, err_msg=f"S={s} D={d}")
        m = padding(3, s)
        got = await shared_rt.run(gm, a0=q, a1=k, a2=v, a3=m)
        assert not np.isnan(got).any()
        np.testing.assert_allclose(got, attention_ref(q, k, v, m), rtol=1e-5, atol=2e-6,
                                   err_msg=f"S={s} D={d} padded")
        # all padding (batch 2): equal weights over all keys, as HF's finfo.min mask gives
        np.testing.assert_allclose(got[2], np.broadcast_to(v[2].mean(axis=1, keepdims=True), got[2].shape),
                                   rtol=1e-5, atol=2e-6)


@ASYNCIO_ONLY
async def test_attention_options_tiles_layouts_and_masks(shared_rt: hetero.Runtime,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # bshd layout ([B, S, H, D] in and out), a custom scale, Sq != Sk, odd D (scalar loads)
    q, k, v = qkv(2, 3, 9, 5, seed=7, sk=20)
    m = padding(2, 20)
    g = op_graph(nn.attention, 4, mask="@a3", scale=0.3, layout="bshd")
    t = (lambda a: np.ascontiguousarray(a.transpose(0, 2, 1, 3)))
    got = await shared_rt.run(g, a0=t(q), a1=t(k), a2=t(v), a3=m)
    np.testing.assert_allclose(got, t(attention_ref(q, k, v, m, 0.3)), rtol=1e-5, atol=2e-6)
    # masks as int32 or uint32 Tensors, [B, 1, 1, Sk], and nonzero values other than 1
    for mm in (m.astype(np.int32), (m * 7).astype(np.uint32).reshape(2, 1, 1, 20), m * np.float32(-2.5)):
        got = await shared_rt.run(op_graph(nn.attention, 4, mask="@a3", scale=0.3), a0=q, a1=k, a2=v, a3=mm)
        np.testing.assert_allclose(got, attention_ref(q, k, v, m, 0.3), rtol=1e-5, atol=2e-6)
    # many small tiles and query blocks: tile and block edges everywhere
    monkeypatch.setattr(nn, "ATTN_BK", 3)
    monkeypatch.setattr(nn, "ATTN_BQ", 16)
    q, k, v = qkv(2, 2, 37, 32, seed=11)
    m = padding(2, 37)
    got = await shared_rt.run(op_graph(nn.attention, 4, mask="@a3"), a0=q, a1=k, a2=v, a3=m)
    np.testing.assert_allclose(got, attention_ref(q, k, v, m), rtol=1e-5, atol=2e-6)
    # large scores: the online softmax rescales without overflow
    got = await shared_rt.run(op_graph(nn.attention, 3, scale=30.0), a0=q, a1=k, a2=v)
    np.testing.assert_allclose(got, attention_ref(q, k, v, scale=30.0), rtol=1e-4, atol=2e-5)


@ASYNCIO_ONLY
@pytest.mark.parametrize("impl", ["fused", "matmul"])
@pytest.mark.parametrize("d", [32, 64])
async def test_attention_impls_match_numpy(shared_rt: hetero.Runtime, impl: str, d: int) -> None:
    t = (lambda a: np.ascontiguousarray(a.transpose(0, 2, 1, 3)))
    for layout in ("bhsd", "bshd"):
        f = t if layout == "bshd" else (lambda a: a)
        g = op_graph(nn.attention, 3, layout=layout, impl=impl)
        gm = op_graph(nn.attention, 4, mask="@a3", layout=layout, impl=impl)
        for s in (1, 7, 64, 130):
            q, k, v = qkv(3, 2, s, d, seed=s)
            what = f"impl={impl} layout={layout} S={s} D={d}"
            got = await shared_rt.run(g, a0=f(q), a1=f(k), a2=f(v))
            assert got.shape == f(q).shape and got.dtype == np.float32
            np.testing.assert_allclose(got, f(attention_ref(q, k, v)), rtol=1e-5, atol=2e-6, err_msg=what)
            m = padding(3, s)  # batch 2 is all padding
            got = await shared_rt.run(gm, a0=f(q), a1=f(k), a2=f(v), a3=m)
            assert not np.isnan(got).any(), what
            np.testing.assert_allclose(got, f(attention_ref(q, k, v, m)), rtol=1e-5, atol=2e-6,
                                       err_msg=what + " padded")
            mean = np.broadcast_to(v[2].mean(axis=1, keepdims=True), v[2].shape[:1] + (s, d))
            np.testing.assert_allclose(got[2], f(mean[None])[0], rtol=1e-5, atol=2e-6, err_msg=what + " all padding")


@ASYNCIO_ONLY
async def test_attention_matmul_options_and_auto(shared_rt: hetero.Runtime) -> None:
    # odd D, Sq != Sk, a custom scale, both layouts, masks of every dtype and shape
    q, k, v = qkv(2, 3, 9, 5, seed=7, sk=20)
    m = padding(2, 20)
    t = (lambda a: np.ascontiguousarray(a.transpose(0, 2, 1, 3)))
    want = attention_ref(q, k, v, m, 0.3)
    g = op_graph(nn.attention, 4, mask="@a3", scale=0.3, layout="bshd", impl="matmul")
    got = await shared_rt.run(g, a0=t(q), a1=t(k), a2=t(v), a3=m)
    np.testing.assert_allclose(got, t(want), rtol=1e-5, atol=2e-6)
    for mm in (m.astype(np.int32), (m * 7).astype(np.uint32).reshape(2, 1, 1, 20), m * np.float32(-2.5),
               np.where(m != 0, 1.0, -0.0).astype(np.float32)):
        got = await shared_rt.run(op_graph(nn.attention, 4, mask="@a3", scale=0.3, impl="matmul"),
                                  a0=q, a1=k, a2=v, a3=mm)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)
    # large scores: the softmax subtracts the row maximum (scores of ~600: float32 rounding
    # of the unscaled q @ k^T, times 30, moves the weights by ~1e-5 relative; measured 2.7e-5)
    q, k, v = qkv(2, 2, 37, 32, seed=11)
    got = await shared_rt.run(op_graph(nn.attention, 3, scale=30.0, impl="matmul"), a0=q, a1=k, a2=v)
    np.testing.assert_allclose(got, attention_ref(q, k, v, scale=30.0), rtol=1e-4, atol=1e-4)
    # "auto" is accepted (and the default), whatever it picks here
    for kw in ({"impl": "auto"}, {}):
        got = await shared_rt.run(op_graph(nn.attention, 4, mask="@a3", **kw), a0=q, a1=k, a2=v, a3=padding(2, 37))
        np.testing.assert_allclose(got, attention_ref(q, k, v, padding(2, 37)), rtol=1e-5, atol=2e-6)
    # the matmul path's temporaries come from the stage and the result has q's shape (Spy sees 3 dispatches)
    labels: list[str] = []

    def stage(gpu: hetero.GPUContext, a: Tensor, b: Tensor, c: Tensor) -> Tensor:
        spy = Spy(gpu)
        out = nn.attention(spy, a, b, c, impl="matmul")
        labels.extend(i.kernel for i in spy.infos)
        return out

    g2 = hetero.Graph("attn-matmul")
    g2.output(g2.gpu(stage, g2.input("a"), g2.input("b"), g2.input("c")))
    got = await shared_rt.run(g2, a=q, b=k, c=v)
    np.testing.assert_allclose(got, attention_ref(q, k, v), rtol=1e-5, atol=2e-6)
    assert len(labels) == 3 and "softmax" in labels[1], labels


@ASYNCIO_ONLY
async def test_attention_packed_matches_numpy(shared_rt: hetero.Runtime) -> None:
    """One fused [B, S, 3*H*D] projection (q | k | v along features) -> [B, S, H*D]."""
    def packed(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:  # [B, H, S, D] each
        b, h, s, d = q.shape
        return np.concatenate([x.transpose(0, 2, 1, 3).reshape(b, s, h * d) for x in (q, k, v)], axis=2)

    def unpack(o: np.ndarray) -> np.ndarray:  # [B, H, S, D] -> [B, S, H*D]
        b, h, s, d = o.shape
        return o.transpose(0, 2, 1, 3).reshape(b, s, h * d)

    # D = 32 (vector loads), D = 5 (scalar loads: q, k, v start at odd elements), one token, long rows
    for b, h, s, d in ((3, 2, 7, 32), (2, 3, 9, 5), (1, 1, 1, 4), (2, 12, 70, 32)):
        q, k, v = qkv(b, h, s, d, seed=s + d)
        m = padding(b, s)
        got = await shared_rt.run(op_graph(nn.attention_packed, 2, heads=h, mask="@a1"), a0=packed(q, k, v), a1=m)
        assert got.shape == (b, s, h * d) and got.dtype == np.float32
        np.testing.assert_allclose(got, unpack(attention_ref(q, k, v, m)), rtol=1e-5, atol=2e-6,
                                   err_msg=f"B={b} H={h} S={s} D={d}")
    q, k, v = qkv(2, 3, 9, 5, seed=3)
    got = await shared_rt.run(op_graph(nn.attention_packed, 1, heads=3, scale=0.3), a0=packed(q, k, v))
    np.testing.assert_allclose(got, unpack(attention_ref(q, k, v, scale=0.3)), rtol=1e-5, atol=2e-6)
    # shapes that do not split into q, k, v of H heads
    shape_rule = "qkv must be [B, S, 3*H*D] (or [P, B, S, 3*H*D]) with H = {} heads, got shape {}"
    for shape, heads, msg in (((2, 4, 10), 2, shape_rule.format(2, (2, 4, 10))),
                              ((2, 4, 12), 0, "heads must be an integer >= 1, got 0"),
                              ((2, 4), 1, shape_rule.format(1, (2, 4))),
                              ((2, 2, 4, 10), 2, shape_rule.format(2, (2, 2, 4, 10)))):
        with pytest.raises(StageError) as ei:
            await shared_rt.run(op_graph(nn.attention_packed, 1, heads=heads), a0=np.zeros(shape, np.float32))
        assert str(ei.value.__cause__) == "attention_packed: " + msg
    with pytest.raises(StageError) as ei:
        await shared_rt.run(op_graph(nn.attention_packed, 2, heads=1, mask="@a1"),
                            a0=np.zeros((2, 4, 6), np.float32), a1=np.ones((2, 5), np.float32))
    assert "mask of shape (2, 5) does not fit qkv of shape (2, 4, 6)" in str(ei.value.__cause__)


def spans_of(lens: list[int], total: int) -> np.ndarray:
    """Each token's [start, end): sequences of ``lens`` one after another, then padding up to ``total``."""
    out, o = [], 0
    for n in lens + [total - sum(lens)]:
        out += [(o, o + n)] * n
        o += n
    return np.array(out, np.int32).reshape(-1, 2)


@pytest.mark.anyio
async def test_attention_varlen_equals_each_sequence_alone(shared_rt: hetero.Runtime) -> None:
    """Packed sequences: each token attends to its own sequence's keys, as if run alone unpadded."""
    rng = np.random.default_rng(5)
    # D = 32 (vector loads), D = 5 (scalar loads); one-token sequences; a sequence longer than a tile; padding
    for heads, d, lens, total in ((2, 32, [5, 1, 17, 3, 40, 2], 75), (3, 5, [9, 1, 4], 14), (1, 4, [1], 1),
                                  (12, 32, [70, 7, 33], 110)):
        x = rng.standard_normal((total, 3 * heads * d)).astype(np.float32)
        sp = spans_of(lens, total)
        got = await shared_rt.run(op_graph(nn.attention_varlen, 1, heads=heads, spans=sp), a0=x)
        assert got.shape == (total, heads * d) and got.dtype == np.float32
        want = np.concatenate([ops.cpu.attention_packed(x[None, a:b], heads)[0]
                               for a, b in dict.fromkeys(map(tuple, sp.tolist()))])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6, err_msg=f"H={heads} D={d} lens={lens}")
        np.testing.assert_allclose(ops.cpu.attention_varlen(x, heads, sp), want, rtol=1e-6, atol=1e-7)
    # wrong shapes; ranges that break the rules (checked where the spans are on the host)
    x = np.zeros((4, 6), np.float32)
    with pytest.raises(StageError) as ei:
        await shared_rt.run(op_graph(nn.attention_varlen, 1, heads=1, spans=np.zeros((3, 2), np.int32)), a0=x)
    assert "spans must be [T, 2] = (4, 2) (each token's [start, end)), got shape (3, 2)" in str(ei.value.__cause__)
    for spans, msg in (([[0, 2], [0, 2], [2, 4], [0, 3]], "spans[3] = [0, 3] does not hold token 3"),
                       ([[0, 4], [0, 4], [1, 4], [0, 4]], "spans[3] starts at 0, before spans[2] (1)")):
        with pytest.raises(ValueError, match=re.escape(msg)):
            ops.cpu.attention_varlen(x, 1, np.array(spans, np.int32))
    with pytest.raises(StageError) as ei:
        await shared_rt.run(op_graph(nn.attention_varlen, 1, heads=4, spans=spans_of([4], 4)), a0=x)
    assert "qkv must be [T, 3*H*D] (or [P, T, 3*H*D]) with H = 4 heads and D >= 1, got shape (4, 6)" in str(ei.value.__cause__)


def test_attention_auto_choice() -> None:
    big = 1 << 30
    assert nn._attention_auto("DiscreteGPU", 128, 128, 4 << 20, big) == "matmul"
    assert nn._attention_auto("IntegratedGPU", 128, 128, 4 << 20, big) == "matmul"
    assert nn._attention_auto("DiscreteGPU", 127, 127, 4 << 20, big) == "fused"      # short sequences
    assert nn._attention_auto("CPU", 512, 512, 4 << 20, big) == "fused"              # lavapipe and co.
    assert nn._attention_auto("", 512, 512, 4 << 20, big) == "fused"                 # unknown adapter
    assert nn._attention_auto("DiscreteGPU", 512, 512, big + 4, big) == "fused"      # scores too big to bind


async def test_softmax_scale(shared_rt: hetero.Runtime) -> None:
    x = rand((2, 3, 4, 33), seed=5)
    m = np.where(rand((2, 33), seed=6) > 0.5, 0.0, F32_MIN).astype(np.float32)
    got = await shared_rt.run(op_graph(nn.softmax, 2, mask="@a1", scale=0.125), a0=x, a1=m)
    np.testing.assert_allclose(got, softmax_ref(x * np.float32(0.125), m), rtol=2e-6, atol=1e-7)


# -- composition and large grids ----------------------------------------------------------------------
async def test_bert_block_through_a_graph(shared_rt: hetero.Runtime) -> None:
    """
    ::

        ids, table -> embedding (gpu) -> layernorm (gpu) --+--> attention, bshd (gpu) -> add & norm (gpu)
        mask --------------------------------------------------/                        -> gelu (gpu) -> (cpu)

    q = k = v = the normalised embeddings viewed as [B, S, H, D]: no matmul needed.
    """
    b, s, h, d, vocab = 2, 9, 3, 8, 30
    rng = np.random.default_rng(5)
    ids = rng.integers(0, vocab, (b, s)).astype(np.int32)
    table = rand((vocab, h * d), 1)
    gamma, beta = rand(h * d, 2), rand(h * d, 3)
    mask = padding(b, s)

    def attend(gpu: hetero.GPUContext, t: Tensor, m: Tensor) -> Tensor:
        heads = Tensor(t.buffer, (b, s, h, d), t.dtype, t.offset)  # a view: [B, S, H*D] is [B, S, H, D]
        a = nn.attention(gpu, heads, heads, heads, mask=m, layout="bshd")
        return Tensor(a.buffer, (b, s, h * d), a.dtype, a.offset, a.block)

    g = hetero.Graph("bert-block")
    gi, bi = g.input("gamma"), g.input("beta")
    e = g.gpu(nn.embedding, g.input("table"), g.input("ids"))
    x = g.gpu(nn.layernorm, e, gi, bi, eps=1e-12)
    a = g.gpu(attend, x, g.input("mask"))
    y = g.gpu(nn.layernorm, a, gi, bi, name="add_norm", residual=x, eps=1e-12)
    z = g.gpu(nn.gelu, y)
    g.output(g.cpu(lambda v: v.reshape(b, s, h * d), z, name="read"))
    got = await shared_rt.run(g, ids=ids, table=table, gamma=gamma, beta=beta, mask=mask)

    x_ref = layernorm_ref(table[ids], gamma, beta, 1e-12)
    qh = x_ref.reshape(b, s, h, d).transpose(0, 2, 1, 3)
    a_ref = attention_ref(qh, qh, qh, mask).transpose(0, 2, 1, 3).reshape(b, s, h * d)
    want = gelu_ref(layernorm_ref(a_ref, gamma, beta, 1e-12, x_ref))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


async def test_grids_split_into_sub_dispatches_give_the_same_results(shared_rt: hetero.Runtime,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny GPU-time budget makes hetero split every grid: each kernel must use hetero_workgroup_id."""
    dev = shared_rt.device()
    monkeypatch.setattr(dev.cost, "budget_ns", 1.0)  # one workgroup per sub-dispatch
    seen: list[hetero.DispatchInfo] = []

    def stage(gpu: hetero.GPUContext, x: Tensor, ids: Tensor, g_: Tensor, b_: Tensor) -> tuple[Tensor, ...]:
        spy = Spy(gpu)
        q = nn.transpose(spy, x, (0, 2, 1, 3))  # [2, 3, 100, 4] (+ one more transposed copy below)
        out = (nn.gelu(spy, x), nn.softmax(spy, x), nn.layernorm(spy, x, g_, b_), q,
               nn.embedding(spy, Tensor(x.buffer, (2 * 100 * 3, 4), x.dtype, x.offset), ids),
               nn.attention(spy, q, q, q))
        seen.extend(spy.infos)
        return out

    x = rand((2, 100, 3, 4), seed=3)
    ids = np.arange(599, -1, -1, dtype=np.int32)
    g = hetero.Graph("split")
    g.output(g.gpu(stage, g.input("x"), g.input("ids"), g.input("g"), g.input("b")))
    gel, sm, ln, tr, emb, att = await shared_rt.run(g, x=x, ids=ids, g=rand(4, 1), b=rand(4, 2))
    assert all(info.sub_dispatches > 1 for info in seen), [(i.kernel, i.sub_dispatches) for i in seen]
    np.testing.assert_allclose(gel, gelu_ref(x), rtol=1e-6)
    np.testing.assert_allclose(sm, softmax_ref(x), rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(ln, layernorm_ref(x, rand(4, 1), rand(4, 2), 1e-5), rtol=1e-5, atol=2e-5)
    qh = x.transpose(0, 2, 1, 3)
    np.testing.assert_array_equal(tr, qh)
    np.testing.assert_array_equal(emb, x.reshape(-1, 4)[ids])
    np.testing.assert_allclose(att, attention_ref(qh, qh, qh), rtol=1e-5, atol=2e-6)


# -- errors ------------------------------------------------------------------------------------------------
async def test_errors_name_the_op_the_shapes_and_the_rule(shared_rt: hetero.Runtime) -> None:
    with pytest.raises(StageError) as e:
        await shared_rt.run(op_graph(nn.add, 2), a0=np.zeros((2, 3), np.float32), a1=np.zeros((3, 2), np.float32))
    assert str(e.value) == ("gpu stage 'add' failed: ValueError: add: x of shape (2, 3) and y of shape (3, 2) "
                            "differ; add needs equal shapes (use add_bias to broadcast a vector along the last axis)")
    assert isinstance(e.value.__cause__, ValueError)

    gpu = hetero.GPUContext(shared_rt.device(), "direct")  # the ops check before they record: call directly
    f = np.zeros
    x4 = f((2, 3, 5, 8), np.float32)
    cases: list[tuple[Callable[[], Any], type[Exception], str]] = [
        (lambda: nn.softmax(gpu, f((2, 3), np.float64)), TypeError,
         "softmax: x must be float32, got float64 (shape (2, 3)); cast with .astype(np.float32)"),
        (lambda: nn.softmax(gpu, [1.0, 2.0]), TypeError,  # type: ignore[arg-type,unused-ignore]
         "softmax: x must be a hetero.Tensor (or a numpy array), got list"),
        (lambda: nn.softmax(gpu, x4, mask=f((3, 8), np.float32)), ValueError,
         "softmax: mask of shape (3, 8) does not broadcast per row group over x of shape (2, 3, 5, 8); the mask "
         "must be x.shape[:k] + (8,) for some k, or that with ones up to x's rank, "
         "e.g. (8,) or (2, 8) or (2, 1, 1, 8)"),
        (lambda: nn.softmax(gpu, f(5, np.float32), mask=f((1, 5), np.float32)), ValueError,
         "softmax: mask of shape (1, 5) does not broadcast per row group over x of shape (5,); the mask must be "
         "x.shape[:k] + (5,) for some k, or that with ones up to x's rank, e.g. (5,)"),
        (lambda: nn.layernorm(gpu, f((4, 6), np.float32), f(5, np.float32), f(6, np.float32)), ValueError,
         "layernorm: gamma of shape (5,) does not match the last axis of x of shape (4, 6); "
         "gamma and beta must have shape (6,)"),
        (lambda: nn.layernorm(gpu, f((4, 6), np.float32), f(6, np.float32), f(6, np.float32),
                              residual=f((6, 4), np.float32)), ValueError,
         "layernorm: residual of shape (6, 4) differs from x of shape (4, 6); they must be equal"),
        (lambda: nn.layernorm(gpu, f((4, 6), np.float32), f(6, np.float32), f(6, np.float32), eps=-1.0),
         ValueError, "layernorm: eps must be a finite number >= 0, got -1.0"),
        (lambda: nn.add_bias(gpu, f((4, 6), np.float32), f(4, np.float32)), ValueError,
         "add_bias: bias of shape (4,) does not match the last axis of x of shape (4, 6); bias must have shape (6,)"),
        (lambda: nn.transpose(gpu, x4, (0, 2, 1)), ValueError,
         "transpose: axes (0, 2, 1) are not a permutation of the 4 axes of x of shape (2, 3, 5, 8)"),
        (lambda: nn.transpose(gpu, f((2, 3, 2, 3, 2), np.float32), (4, 3, 2, 1, 0)), ValueError,
         "transpose: axes (4, 3, 2, 1, 0) of x of shape (2, 3, 2, 3, 2) reduce to a 5-axis permutation (after "
         "dropping size-1 axes and merging axes that stay adjacent); at most 4 are supported"),
        (lambda: nn.embedding(gpu, f((10, 4), np.float32), np.array([[1, 2], [10, 3]])), ValueError,
         "embedding: id 10 at index (1, 0) of ids of shape (2, 2) is out of range for a table of 10 rows; "
         "ids must lie in [0, 10)"),
        (lambda: nn.embedding(gpu, f((10, 4), np.float32), np.array([-1])), ValueError,
         "embedding: id -1 at index (0,) of ids of shape (1,) is out of range for a table of 10 rows; "
         "ids must lie in [0, 10)"),
        (lambda: nn.embedding(gpu, f(10, np.float32), np.array([1])), ValueError,
         "embedding: table must be 2-D [vocab, hidden], got shape (10,)"),
        (lambda: nn.attention(gpu, x4, x4, f((2, 3, 5, 4), np.float32)), ValueError,
         "attention: k of shape (2, 3, 5, 8) and v of shape (2, 3, 5, 4) differ; they must be equal"),
        (lambda: nn.attention(gpu, x4, f((2, 4, 5, 8), np.float32), f((2, 4, 5, 8), np.float32)), ValueError,
         "attention: q of shape (2, 3, 5, 8) and k of shape (2, 4, 5, 8) disagree on batch, heads or head "
         "dimension; with layout 'bhsd' both are [B, H, S, D]"),
        (lambda: nn.attention(gpu, x4, x4, x4, mask=np.ones((2, 8))), ValueError,
         "attention: mask of shape (2, 8) does not fit keys of shape (2, 3, 5, 8); a padding mask is "
         "[B, Sk] = (2, 5) or [B, 1, 1, Sk] = (2, 1, 1, 5)"),
        (lambda: nn.attention(gpu, x4, x4, x4, layout="bhds"), ValueError,
         "attention: layout must be 'bhsd' ([B, H, S, D]) or 'bshd' ([B, S, H, D]), got 'bhds'"),
        (lambda: nn.attention(gpu, f((2, 5, 8), np.float32), x4, x4), ValueError,
         "attention: q must be 4-D [B, H, S, D], got shape (2, 5, 8)"),
        (lambda: nn.attention(gpu, x4, x4, x4, impl="flash"), ValueError,
         "attention: impl must be 'fused', 'matmul' or 'auto', got 'flash'"),
        (lambda: nn.attention(gpu, x4, x4, x4, impl=None), ValueError,  # type: ignore[arg-type]
         "attention: impl must be 'fused', 'matmul' or 'auto', got None"),
        (lambda: nn.softmax(gpu, x4, scale=float("nan")), ValueError,
         "softmax: scale must be a finite number, got nan"),
    ]
    for call, exc, msg in cases:
        with pytest.raises(exc) as info:
            call()
        assert str(info.value) == msg
    assert gpu.blocks == [] and gpu.workgroups == 0  # nothing allocated, nothing recorded


async def test_ops_take_numpy_arrays_directly(shared_rt: hetero.Runtime) -> None:
    """Inside a stage, host arrays (e.g. weights closed over) are uploaded by the op."""
    gamma, beta = rand(16, 1), rand(16, 2)
    ids = np.array([[3, 1], [0, 2]], np.int64)  # int64 from a tokenizer: checked and converted on the host
    table = rand((4, 16), 3)

    def stage(gpu: hetero.GPUContext) -> Tensor:
        return nn.layernorm(gpu, nn.embedding(gpu, table, ids), gamma, beta)

    g = hetero.Graph("host-arrays")
    g.output(g.gpu(stage))
    got = await shared_rt.run(g)
    np.testing.assert_allclose(got, layernorm_ref(table[ids], gamma, beta, 1e-5), rtol=1e-5, atol=2e-5)


# -- fused layernorms: matmul_layernorm, embedding_layernorm ----------------------------------------
def _split3() -> Any:
    """A K split into (at most) three parts of at least 64, on any adapter."""
    from hetero.kernels.matmul import MatmulConfig
    return MatmulConfig(32, 32, 8, 4, 4, split_k=3, split_min=64)


@pytest.mark.parametrize("split", [True, False])
async def test_matmul_layernorm_equals_the_separate_ops(shared_rt: hetero.Runtime, split: bool) -> None:
    """With a K split, the layernorm sums the partials, bias and residual itself: the summing
    pass is gone, and the result is the separate ops' (the same sums in the same order)."""
    from hetero.kernels.matmul import matmul_partials, split_k_parts
    config = _split3() if split else None
    labels: list[str] = []

    def fused(gpu: hetero.GPUContext, a: Tensor, w: Tensor, bias: Tensor, res: Tensor, ga: Tensor,
              be: Tensor) -> Tensor:
        spy = Spy(gpu)
        out = nn.matmul_layernorm(spy, a, w, ga, be, transpose_b=True, bias=bias, residual=res, eps=1e-12,
                                  config=config)
        labels.extend(i.kernel for i in spy.infos)
        return out

    def separate(gpu: hetero.GPUContext, a: Tensor, w: Tensor, bias: Tensor, res: Tensor, ga: Tensor,
                 be: Tensor) -> Tensor:
        y = ops.matmul(gpu, a, w, transpose_b=True, bias=bias, config=config)
        return nn.layernorm(gpu, y, ga, be, eps=1e-12, residual=res)

    graphs = []
    for fn in (fused, separate):
        g = hetero.Graph(f"mm-ln-{fn.__name__}")
        g.output(g.gpu(fn, *[g.input(n) for n in ("a", "w", "bias", "res", "ga", "be")]))
        graphs.append(g)
    splits = []
    for m, k, n in [(5, 96, 32), (20, 256, 384), (3, 300, 33), (3, 70, 33)]:
        inputs = dict(a=rand((m, k), 1), w=rand((n, k), 2, 0.1), bias=rand(n, 3), res=rand((m, n), 4),
                      ga=rand(n, 5), be=rand(n, 6))
        labels.clear()
        got = await shared_rt.run(graphs[0], **inputs)
        want = await shared_rt.run(graphs[1], **inputs)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        lin = inputs["a"].astype(np.float64) @ inputs["w"].T.astype(np.float64) + inputs["bias"]
        np.testing.assert_allclose(got, layernorm_ref(lin.astype(np.float32), inputs["ga"], inputs["be"], 1e-12,
                                                      inputs["res"]), rtol=1e-4, atol=1e-4)
        twin = ops.cpu.matmul_layernorm(inputs["a"], inputs["w"], inputs["ga"], inputs["be"], transpose_b=True,
                                        bias=inputs["bias"], residual=inputs["res"], eps=1e-12)
        np.testing.assert_allclose(twin, got, rtol=1e-4, atol=1e-4)
        parts = split_k_parts(hetero.GPUContext(shared_rt.device(), "direct"), inputs["a"], inputs["w"],
                              transpose_b=True, config=config)
        splits.append(parts)
        assert len(labels) == 2, labels  # the product, then one layernorm
        assert ("parts" in labels[1]) == (parts > 1) and not any("sum" in lb for lb in labels), labels
    assert splits == ([1, 3, 3, 1] if split else [1, 1, 1, 1])

    # The partials themselves: their sum plus the bias is the product.
    def partials(gpu: hetero.GPUContext, a: Tensor, w: Tensor) -> Tensor:
        t, parts = matmul_partials(gpu, a, w, transpose_b=True, config=config)
        assert parts == (3 if split else 1) and t.shape == ((3, 20, 384) if split else (20, 384))
        return t

    g = hetero.Graph("partials")
    g.output(g.gpu(partials, g.input("a"), g.input("w")))
    a, w = rand((20, 256), 7), rand((384, 256), 8)
    t = await shared_rt.run(g, a=a, w=w)
    np.testing.assert_allclose(t.sum(0) if split else t, a @ w.T, rtol=1e-4, atol=1e-4)


async def test_split_k_parts_says_what_matmul_does(shared_rt: hetero.Runtime) -> None:
    from hetero.kernels.matmul import MatmulConfig, split_k_parts
    gpu = hetero.GPUContext(shared_rt.device(), "direct")
    a, w = np.zeros((20, 256), np.float32), np.zeros((384, 256), np.float32)
    assert split_k_parts(gpu, a, w, transpose_b=True, config=_split3()) == 3
    assert split_k_parts(gpu, a, w, transpose_b=True, config=MatmulConfig(32, 32, 8, 4, 4)) == 1
    assert split_k_parts(gpu, a, w, transpose_b=True, config=MatmulConfig(32, 32, 8, 4, 4, split_k=16, split_min=64)) == 4
    assert split_k_parts(gpu, np.zeros((0, 256), np.float32), w, transpose_b=True, config=_split3()) == 1
    with pytest.raises(ValueError, match="inner dimensions 256 and 384 differ"):
        split_k_parts(gpu, a, w, config=_split3())
    assert gpu.blocks == [] and gpu.workgroups == 0  # nothing allocated, nothing recorded


@pytest.mark.parametrize("storage_limit", [None, 8])  # 8: too few bindings for three tables: separate ops
async def test_embedding_layernorm_equals_the_separate_ops(shared_rt: hetero.Runtime, storage_limit: int | None,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    if storage_limit is not None:
        monkeypatch.setitem(shared_rt.device().limits, "max-storage-buffers-per-shader-stage", storage_limit)
    labels: list[str] = []
    word, pos, typ = rand((50, 384), 1), rand((40, 384), 2), rand((2, 384), 3)
    ga, be = rand(384, 4), rand(384, 5)

    def fused(gpu: hetero.GPUContext, ids: Tensor, p: Tensor, t: Tensor) -> Tensor:
        spy = Spy(gpu)
        out = nn.embedding_layernorm(spy, [word, pos, typ], [ids, p, t], ga, be, eps=1e-12)
        labels.extend(i.kernel for i in spy.infos)
        return out

    g = hetero.Graph("emb-ln")
    g.output(g.gpu(fused, g.input("ids"), g.input("p"), g.input("t")))
    ids = np.array([[1, 49, 0, 7], [3, 3, 2, 60]], np.int32)  # 60: out of range, picks zeros as embedding does
    p = np.tile(np.arange(4, dtype=np.int32), (2, 1))
    t = np.array([[0, 0, 1, 1], [0, 1, 0, -1]], np.int32)
    got = await shared_rt.run(g, ids=ids, p=p, t=t)
    assert got.shape == (2, 4, 384)

    def pick(table: np.ndarray, i: np.ndarray) -> np.ndarray:
        ok = (i >= 0) & (i < len(table))
        return np.where(ok[..., None], table[np.where(ok, i, 0)], np.float32(0))

    v = (pick(word, ids) + pick(pos, p)) + pick(typ, t)
    np.testing.assert_allclose(got, layernorm_ref(v, ga, be, 1e-12), rtol=1e-5, atol=2e-5)
    ok = ids < 50  # the CPU twin refuses ids out of range, as ops.cpu.embedding does
    twin = ops.cpu.embedding_layernorm([word, pos, typ], [np.where(ok, ids, 0), p, np.maximum(t, 0)], ga, be,
                                       eps=1e-12)
    fine = ok & (t >= 0)
    np.testing.assert_allclose(twin[fine], got[fine], rtol=1e-5, atol=2e-5)
    assert labels == (["nn.embedding_layernorm3.tpr128.k3"] if storage_limit is None else
                      ["nn.embedding.vec4", "nn.embedding.vec4", "nn.add.vec4", "nn.embedding.vec4",
                       "nn.layernorm.residual.tpr128.k3"])

    # One table, and two, through numpy ids (checked on the host, uploaded by the op).
    def two(gpu: hetero.GPUContext) -> tuple[Tensor, Tensor]:
        return (nn.embedding_layernorm(gpu, [word], [ids[:, :3]], ga, be),
                nn.embedding_layernorm(gpu, [word, pos], [ids[:, :3], p[:, :3]], ga, be))

    g2 = hetero.Graph("emb-ln-few")
    g2.output(g2.gpu(two))
    one_t, two_t = await shared_rt.run(g2)
    np.testing.assert_allclose(one_t, layernorm_ref(word[ids[:, :3]], ga, be, 1e-5), rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(two_t, layernorm_ref(word[ids[:, :3]] + pos[p[:, :3]], ga, be, 1e-5),
                               rtol=1e-5, atol=2e-5)


async def test_fused_layernorm_errors_name_the_op_and_the_rule(shared_rt: hetero.Runtime) -> None:
    gpu = hetero.GPUContext(shared_rt.device(), "direct")
    f = np.zeros
    t, i = f((10, 8), np.float32), np.array([[1, 2]], np.int32)
    g8 = f(8, np.float32)
    cases: list[tuple[Callable[[], Any], type[Exception], str]] = [
        (lambda: nn.embedding_layernorm(gpu, [t, t], [i], g8, g8), ValueError,
         "embedding_layernorm: takes 1 to 4 tables, each with its ids; got 2 tables and 1 ids arrays"),
        (lambda: nn.embedding_layernorm(gpu, [t] * 5, [i] * 5, g8, g8), ValueError,
         "embedding_layernorm: takes 1 to 4 tables, each with its ids; got 5 tables and 5 ids arrays"),
        (lambda: nn.embedding_layernorm(gpu, t, i, g8, g8), TypeError,  # type: ignore[arg-type]
         "embedding_layernorm: tables and ids must be lists (or tuples) of the same length, got ndarray and ndarray"),
        (lambda: nn.embedding_layernorm(gpu, [t, f((4, 6), np.float32)], [i, i], g8, g8), ValueError,
         "embedding_layernorm: tables[1] is [4, 6] but tables[0] is [10, 8]: the tables must have the same width"),
        (lambda: nn.embedding_layernorm(gpu, [t, t], [i, np.array([1, 2], np.int32)], g8, g8), ValueError,
         "embedding_layernorm: ids[1] has shape (2,) but ids[0] has (1, 2): every ids array must have the same "
         "shape"),
        (lambda: nn.embedding_layernorm(gpu, [t, t], [i, np.array([[1, 10]])], g8, g8), ValueError,
         "embedding_layernorm: id 10 at index (0, 1) of ids[1] of shape (1, 2) is out of range for a table of 10 "
         "rows; ids must lie in [0, 10)"),
        (lambda: nn.embedding_layernorm(gpu, [t.astype(np.int32)], [i], g8, g8), TypeError,
         "embedding_layernorm: tables[0] must be float32, got int32 (shape (10, 8)); cast with .astype(np.float32)"),
        (lambda: nn.embedding_layernorm(gpu, [t], [i], f(7, np.float32), g8), ValueError,
         "embedding_layernorm: gamma of shape (7,) does not match the last axis of x of shape (1, 2, 8); "
         "gamma and beta must have shape (8,)"),
        (lambda: nn.matmul_layernorm(gpu, f((4, 6), np.float32), f((6, 8), np.float32), g8, g8,
                                     residual=f((4, 6), np.float32)), ValueError,
         "matmul_layernorm: residual of shape (4, 6) differs from x of shape (4, 8); they must be equal"),
        (lambda: nn.matmul_layernorm(gpu, f((4, 6), np.float32), f((7, 8), np.float32), g8, g8), ValueError,
         "matmul: a is [4, 6] and b is [7, 8]: inner dimensions 6 and 7 differ"),
        (lambda: nn.matmul_layernorm(gpu, f((4, 6), np.float16), f((6, 8), np.float16), g8, g8), TypeError,
         "matmul_layernorm: a and b must be float32, got float16"),
        (lambda: nn.matmul_layernorm(gpu, f((4, 6), np.float32), f((6, 8), np.float32), g8, g8, eps=float("nan")),
         ValueError, "matmul_layernorm: eps must be a finite number >= 0, got nan"),
    ]
    for call, exc, msg in cases:
        with pytest.raises(exc) as info:
            call()
        assert str(info.value) == msg
    assert gpu.blocks == [] and gpu.workgroups == 0  # nothing allocated, nothing recorded


@pytest.mark.parametrize("d", [8, 5])  # 5: the kernel's scalar loads
async def test_attention_reads_partial_products_and_a_bias(shared_rt: hetero.Runtime, d: int) -> None:
    """[P, B, S, 3*H*D] (and [P, T, 3*H*D]) partial products plus a bias: the same attention as
    over their sum, which the K split's summing pass would have written (same sums, same order)."""
    h, b, s, parts = 2, 2, 7, 3
    width = 3 * h * d
    rng = np.random.default_rng(d)
    planes = rng.standard_normal((parts, b, s, width), dtype=np.float32)
    bias = rng.standard_normal(width, dtype=np.float32)
    summed = planes[0].copy()
    for j in range(1, parts):
        summed = summed + planes[j]  # the summing pass's order, then the bias
    summed = summed + bias
    mask = np.ones((b, s), np.float32)
    mask[1, 5:] = 0
    got = await shared_rt.run(op_graph(nn.attention_packed, 3, heads=h, mask="@a1", bias="@a2"), a0=planes,
                              a1=mask, a2=bias)
    want = await shared_rt.run(op_graph(nn.attention_packed, 2, heads=h, mask="@a1"), a0=summed, a1=mask)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # one plane and a bias: the bias alone
    one = await shared_rt.run(op_graph(nn.attention_packed, 3, heads=h, mask="@a1", bias="@a2"), a0=planes[0],
                              a1=mask, a2=bias)
    np.testing.assert_allclose(one, await shared_rt.run(op_graph(nn.attention_packed, 2, heads=h, mask="@a1"),
                                                        a0=planes[0] + bias, a1=mask), rtol=1e-6, atol=1e-6)
    # packed sequences: [P, T, 3*H*D]
    spans = spans_of([4, 3], 7)
    got_v = await shared_rt.run(op_graph(nn.attention_varlen, 3, heads=h, spans="@a1", bias="@a2"),
                                a0=planes[:, 0], a1=spans, a2=bias)
    want_v = await shared_rt.run(op_graph(nn.attention_varlen, 2, heads=h, spans="@a1"), a0=summed[0], a1=spans)
    np.testing.assert_allclose(got_v, want_v, rtol=1e-6, atol=1e-6)
    # the CPU twins take the same arguments
    np.testing.assert_allclose(ops.cpu.attention_packed(planes, h, mask=mask, bias=bias), got, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ops.cpu.attention_varlen(planes[:, 0], h, spans, bias=bias), got_v, rtol=1e-4,
                               atol=1e-5)
    with pytest.raises(StageError) as ei:
        await shared_rt.run(op_graph(nn.attention_packed, 2, heads=h, bias="@a1"), a0=planes,
                            a1=np.zeros(width - 1, np.float32))
    assert str(ei.value.__cause__) == (f"attention_packed: bias of shape ({width - 1},) does not match qkv's last axis "
                                       f"of {width}; bias must have shape ({width},)")
