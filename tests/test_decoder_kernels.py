"""Decoder kernels (``hetero.kernels.decoder``) and weight formats (``hetero.kernels.quant``) against numpy.

Tiny shapes on a real device (lavapipe in CI). Quantized kernels are compared against
numpy on the same dequantized weights (float64); float32 kernels against float64 numpy.
Where the adapter has subgroups, the subgroup path and the workgroup-memory fallback
both run (``USE_SUBGROUPS``).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import gguf
import numpy as np
import pytest

import hetero
import hetero.kernels.decoder as D
import hetero.kernels.decoder_gemm as G
import hetero.kernels.decoder_wgsl as W
from hetero.kernels.quant import PackedWeight, concat_rows, pack, quantize_q8_0_blocks, unpack

pytestmark = pytest.mark.anyio
ASYNCIO_ONLY = pytest.mark.parametrize("anyio_backend", ["asyncio"])  # GPU-heavy: one loop is enough
KINDS = ["f32", "f16", "q8_0", "q4_0", "q4_1"]
GGML = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
        "q4_1": gguf.GGMLQuantizationType.Q4_1}


def rand(shape: Any, seed: int, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def make_weight(kind: str, w: np.ndarray) -> PackedWeight:
    """``w`` in ``kind`` as the loader hands it over (GGUF bytes for quantized kinds)."""
    if kind == "f32":
        return pack("f32", w, w.shape)
    if kind == "f16":
        return pack("f16", w.astype(np.float16), w.shape)
    if kind == "bf16":
        return pack("bf16", (w.view(np.uint32) >> 16).astype(np.uint16), w.shape)
    return pack(kind, gguf.quants.quantize(w, GGML[kind]), w.shape)


async def call(rt: hetero.Runtime, fn: Callable[..., Any], **inputs: Any) -> Any:
    """Run ``fn(gpu, **inputs)`` as the one GPU stage of a graph; its result(s) as numpy.

    ::

        inputs... --> fn (gpu) --> (output)
    """
    g = hetero.Graph("decoder-op")
    names = list(inputs)
    g.output(g.gpu(lambda gpu, *a: fn(gpu, **dict(zip(names, a))), *[g.input(n) for n in names], name="op"))
    return await rt.run(g, **inputs)


def subgroup_modes(rt: hetero.Runtime) -> list[bool]:
    return [True, False] if "subgroup" in hetero.lowlevel.device_of(rt).features else [False]


def close(op: str, got: np.ndarray, want: np.ndarray, scale: np.ndarray | float, rtol: float = 1e-5) -> None:
    """|got - want| <= rtol * scale (+ 1e-6), elementwise; the message names the op and the worst element."""
    got = np.asarray(got)
    assert got.shape == want.shape, f"{op}: shape {got.shape}, expected {want.shape}"
    err = np.abs(got.astype(np.float64) - want)
    tol = rtol * np.broadcast_to(scale, want.shape) + 1e-6
    if err.size and float((err / tol).max()) > 1.0:
        i = np.unravel_index(int(np.argmax(err / tol)), err.shape)
        raise AssertionError(f"{op}: at {i} got {got[i]!r}, want {want[i]!r} (error {err[i]:.3g} > {tol[i]:.3g}; "
                             f"{int((err > tol).sum())} of {err.size})")


# -- weight formats -----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "q4_1"])
def test_pack_matches_gguf_dequantize(kind: str) -> None:
    w = rand((7, 96), 1)
    w[2, 32:64] = 0.0  # a block of zeros
    raw = gguf.quants.quantize(w, GGML[kind])
    pw = pack(kind, raw, w.shape)
    assert pw.qs is not None and pw.qs.dtype == np.uint32 and pw.d is not None and pw.d.shape == (7, 3)
    assert pw.qs.shape == ((7, 24) if kind == "q8_0" else (7, 12))
    assert (pw.m is not None) == (kind == "q4_1")
    np.testing.assert_array_equal(unpack(pw), gguf.quants.dequantize(raw, GGML[kind]))
    np.testing.assert_array_equal(unpack(pack(kind, raw.reshape(-1), w.shape)), unpack(pw))  # flat bytes too


def test_float_kinds_and_padding() -> None:
    w = rand((5, 37), 2)  # cols not a multiple of 8: padded with zeros on the GPU side
    f32 = make_weight("f32", w)
    assert f32.w is not None and f32.w.shape == (5, 40) and np.all(f32.w[:, 37:] == 0)
    np.testing.assert_array_equal(unpack(f32), w)
    f16 = make_weight("f16", w)
    assert f16.kind == "f16" and f16.w is not None and f16.w.dtype == np.uint32 and f16.w.shape == (5, 20)
    np.testing.assert_array_equal(unpack(f16), w.astype(np.float16).astype(np.float32))
    bf = make_weight("bf16", w)  # widened exactly to f32
    assert bf.kind == "f32"
    np.testing.assert_array_equal(unpack(bf), (w.view(np.uint32) & 0xFFFF0000).view(np.float32))


def test_quantize_q8_0_blocks_is_llama_cpp() -> None:
    w = rand((6, 128), 3, scale=3.0)
    w[1, :32] = 0.0
    w[2, 5] = 40.0  # an outlier: one block's scale grows
    q = quantize_q8_0_blocks(w)
    assert q.dtype == np.uint8 and q.shape == (6, 4 * 34)
    np.testing.assert_array_equal(q, gguf.quants.quantize(w, GGML["q8_0"]))
    np.testing.assert_array_equal(unpack(pack("q8_0", q, w.shape)), gguf.quants.dequantize(q, GGML["q8_0"]))


def test_pack_errors() -> None:
    with pytest.raises(ValueError, match=r"pack: a q4_1 weight needs cols to be a multiple of 32 .*\[4, 40\]"):
        pack("q4_1", np.zeros(4 * 2 * 20, np.uint8), (4, 40))
    with pytest.raises(ValueError, match=r"pack: q8_0 data of shape \(10,\) \(10 bytes\) does not hold"):
        pack("q8_0", np.zeros(10, np.uint8), (2, 32))
    with pytest.raises(TypeError, match="raw GGUF block bytes as uint8, got float32"):
        pack("q4_0", np.zeros(36, np.float32), (2, 32))
    with pytest.raises(ValueError, match="kind must be one of"):
        pack("q5_k", np.zeros(4, np.uint8), (1, 32))
    with pytest.raises(TypeError, match="bf16 data must be the uint16 bit patterns"):
        pack("bf16", np.zeros(4, np.float32), (2, 2))
    with pytest.raises(ValueError, match="quantize_q8_0_blocks: cols must be a multiple of 32"):
        quantize_q8_0_blocks(np.zeros((2, 33), np.float32))
    with pytest.raises(ValueError, match="PackedWeight: q8_0 weight of shape"):
        PackedWeight("q8_0", (2, 32), qs=np.zeros((2, 4), np.uint32), d=np.zeros((2, 1), np.float32))


def test_concat_rows() -> None:
    ws = [make_weight("q4_1", rand((r, 64), 10 + r)) for r in (3, 2, 2)]
    qkv = concat_rows(ws)
    assert qkv.shape == (7, 64)
    np.testing.assert_array_equal(unpack(qkv), np.concatenate([unpack(w) for w in ws]))
    with pytest.raises(ValueError, match="share their kind and cols"):
        concat_rows([ws[0], make_weight("q8_0", rand((2, 64), 1))])


# -- linear layers --------------------------------------------------------------------------------
def linear_ref(x: np.ndarray, w: np.ndarray, bias: Any = None, residual: Any = None, norm: Any = None,
               eps: float = 1e-6) -> tuple[np.ndarray, np.ndarray]:
    """float64 reference and the scale of its rounding error (sum |x| |w| + |bias| + |residual|)."""
    x64 = x.astype(np.float64)
    if norm is not None:
        x64 = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + eps) * norm
    w64 = w.astype(np.float64)
    y = x64 @ w64.T
    scale = np.abs(x64) @ np.abs(w64).T
    for extra in (bias, residual):
        if extra is not None:
            y = y + extra
            scale = scale + np.abs(extra)
    return y, scale


@ASYNCIO_ONLY
@pytest.mark.parametrize("kind", KINDS)
async def test_linear_every_kind_both_paths(shared_rt: hetero.Runtime, kind: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """M = 1 .. 33 (GEMV, two GEMV dispatches at M = 9, the tiled kernel), N = 70 (not a multiple of the
    workgroup's rows or of the tile), bias and residual; subgroup and workgroup-memory reductions."""
    k, n = 96, 70
    w = rand((n, k), 20)
    pw = make_weight(kind, w)
    dq = unpack(pw)
    for sg in subgroup_modes(shared_rt):
        monkeypatch.setattr(D, "USE_SUBGROUPS", sg)
        for i, (m, path) in enumerate([(1, "gemv"), (3, "gemv"), (8, "gemv"), (9, "gemv"), (1, "tiled"),
                                       (9, "tiled"), (33, "auto")]):
            x = rand((m, k), 100 + i)
            bias = rand((n,), 200 + i) if i % 2 else None
            res = rand((m, n), 300 + i) if i % 3 == 0 else None

            def stage(gpu: Any, x: Any, bias: Any = None, res: Any = None) -> Any:
                return D.linear(gpu, x, D.upload_weight(gpu, pw), bias=bias, residual=res, path=path)
            inputs: dict[str, Any] = {"x": x}
            if bias is not None:
                inputs["bias"] = bias
            if res is not None:
                inputs["res"] = res
            got = await call(shared_rt, stage, **inputs)
            want, scale = linear_ref(x, dq, bias, res)
            close(f"linear {kind} M={m} path={path} subgroups={sg}", got, want, scale)


@ASYNCIO_ONLY
@pytest.mark.parametrize("kind", ["f32", "f16"])
async def test_linear_float_cols_not_a_multiple_of_8(shared_rt: hetero.Runtime, kind: str) -> None:
    k, n = 37, 9
    w = rand((n, k), 21)
    pw = make_weight(kind, w)
    for m, path in [(1, "gemv"), (2, "gemv"), (5, "tiled")]:
        x = rand((m, k), 22 + m)
        got = await call(shared_rt, lambda gpu, x: D.linear(gpu, x, pw, path=path), x=x)
        want, scale = linear_ref(x, unpack(pw))
        close(f"linear {kind} K=37 M={m} {path}", got, want, scale)


@ASYNCIO_ONLY
@pytest.mark.parametrize("kind", ["f32", "q8_0", "q4_1"])
async def test_linear_folds_rmsnorm(shared_rt: hetero.Runtime, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    k, n = 64, 40
    pw = make_weight(kind, rand((n, k), 30))
    g = rand((k,), 31) + 1.0
    for sg in subgroup_modes(shared_rt):
        monkeypatch.setattr(D, "USE_SUBGROUPS", sg)
        for m, path in [(1, "gemv"), (4, "gemv"), (11, "tiled")]:
            x = rand((m, k), 32 + m, scale=3.0)
            got = await call(shared_rt, lambda gpu, x, g: D.linear(gpu, x, pw, norm=g, eps=1e-5, path=path), x=x, g=g)
            want, scale = linear_ref(x, unpack(pw), norm=g, eps=1e-5)
            close(f"linear norm {kind} M={m} {path} subgroups={sg}", got, want, scale)


@ASYNCIO_ONLY
@pytest.mark.parametrize("kind", ["f16", "q8_0", "q4_1"])
async def test_linear_swiglu(shared_rt: hetero.Runtime, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    k, f = 64, 48
    wg, wu = make_weight(kind, rand((f, k), 40)), make_weight(kind, rand((f, k), 41))
    g = rand((k,), 42) + 1.0
    for sg in subgroup_modes(shared_rt):
        monkeypatch.setattr(D, "USE_SUBGROUPS", sg)
        for m, path, norm in [(1, "gemv", True), (3, "gemv", False), (10, "tiled", True)]:
            x = rand((m, k), 43 + m)

            def stage(gpu: Any, x: Any, g: Any) -> Any:
                return D.linear_swiglu(gpu, x, D.upload_weight(gpu, wg), wu, norm=g if norm else None, path=path)
            got = await call(shared_rt, stage, x=x, g=g)
            a, sa = linear_ref(x, unpack(wg), norm=g if norm else None)
            b, sb = linear_ref(x, unpack(wu), norm=g if norm else None)
            sig = 1.0 / (1.0 + np.exp(-a))
            want = a * sig * b
            close(f"linear_swiglu {kind} M={m} {path} norm={norm} subgroups={sg}", got, want,
                  sa * np.abs(b) + sb * np.abs(a * sig))
            plain = await call(shared_rt, lambda gpu, u, v: D.silu_mul(gpu, u, v), u=a.astype(np.float32),
                               v=b.astype(np.float32))
            close("silu_mul", plain, a.astype(np.float32) * sig * b.astype(np.float32), np.abs(want))


@ASYNCIO_ONLY
@pytest.mark.parametrize("impl", ["t32", "blocked"])  # dp4a rounds x: its own test bounds its error
@pytest.mark.parametrize("kind", ["q4_1", "f16"])
async def test_linear_tiled_split_k(shared_rt: hetero.Runtime, kind: str, impl: str,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """K = 160 (5 chunks of 32) split 5, 3 and 1 ways (an uneven last split): partial sums and sums of
    squares added by the epilogue pass, with norm, bias, residual and SwiGLU; each GEMM kernel."""
    monkeypatch.setattr(D, "TILED_IMPL", impl)
    k, n, m = 160, 40, 12
    wa, wb = make_weight(kind, rand((n, k), 90)), make_weight(kind, rand((n, k), 91))
    x, g, bias, res = rand((m, k), 92), rand((k,), 93) + 1.0, rand((n,), 94), rand((m, n), 95)
    for min_chunks, groups in [(1, 10**6), (2, 10**6), (1, 1)]:
        monkeypatch.setattr(D, "TILED_SPLIT_MIN_CHUNKS", min_chunks)
        monkeypatch.setattr(D, "TILED_MIN_GROUPS", groups)
        y, z = await call(shared_rt, lambda gpu, x, g, b, r: (
            D.linear(gpu, x, wa, bias=b, residual=r, norm=g, path="tiled"),
            D.linear_swiglu(gpu, x, wa, wb, norm=g, path="tiled")), x=x, g=g, b=bias, r=res)
        want, scale = linear_ref(x, unpack(wa), bias, res, norm=g)
        close(f"linear split-K {kind} min_chunks={min_chunks} groups={groups}", y, want, scale)
        a, sa = linear_ref(x, unpack(wa), norm=g)
        b2, sb = linear_ref(x, unpack(wb), norm=g)
        sig = 1.0 / (1.0 + np.exp(-a))
        close(f"linear_swiglu split-K {kind}", z, a * sig * b2, sa * np.abs(b2) + sb * np.abs(a * sig))


@ASYNCIO_ONLY
@pytest.mark.parametrize("kind", KINDS)
async def test_linear_gemm_kernels_every_kind_and_tile_edge(shared_rt: hetero.Runtime, kind: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Both GEMM kernels (TILED_IMPL) against numpy: M = 9, 32 (the blocked kernel's 32-row tile),
    33 and 70 (64-row tiles, the last one partial), N = 70 and K = 96 (neither a multiple of a tile
    or of a slice), with the folded RMSNorm, bias, residual, and SwiGLU; on the quantized kinds the
    kernels add K in different orders, so only the tolerance says they agree."""
    k, n = 96, 70
    wa, wb = make_weight(kind, rand((n, k), 60)), make_weight(kind, rand((n, k), 61))
    g, bias = rand((k,), 62) + 1.0, rand((n,), 63)
    for impl in ("t32", "blocked"):
        monkeypatch.setattr(D, "TILED_IMPL", impl)
        for m in (9, 32, 33, 70):
            x, res = rand((m, k), 64 + m, scale=2.0), rand((m, n), 65 + m)
            y, z = await call(shared_rt, lambda gpu, x, g, b, r: (
                D.linear(gpu, x, wa, bias=b, residual=r, norm=g, path="tiled"),
                D.linear_swiglu(gpu, x, wa, wb, path="tiled")), x=x, g=g, b=bias, r=res)
            want, scale = linear_ref(x, unpack(wa), bias, res, norm=g)
            close(f"linear {impl} {kind} M={m}", y, want, scale)
            a, sa = linear_ref(x, unpack(wa))
            b2, sb = linear_ref(x, unpack(wb))
            sig = 1.0 / (1.0 + np.exp(-a))
            close(f"linear_swiglu {impl} {kind} M={m}", z, a * sig * b2, sa * np.abs(b2) + sb * np.abs(a * sig))


F16_RTOL = (2 + 2 * G.SLICE_UNITS * 8) * 2.0 ** -11
"""The f16 blocked GEMM's error bound, relative to sum |x'| |w|: x' and w each rounded to f16 (2^-11
each), and a slice's terms summed in f16 (one rounding an add, of at most the sum of its terms),
with a factor of two to spare for the f16 sum's magnitude."""


@ASYNCIO_ONLY
@pytest.mark.parametrize("kind", ["f32", "q8_0", "q4_1"])
async def test_blocked_gemm_in_f16_within_its_rounding(shared_rt: hetero.Runtime, kind: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """TILED_F16: the blocked GEMM's tiles in f16 and a slice's sums in f16 accumulators, within
    F16_RTOL of sum |x'| |w| (the folded norm, bias, residual; SwiGLU through both products' bounds);
    one split and K split; M 9 and 70, N 70 (partial tiles); its kernels are the f16 ones and its
    outputs are not the float32 kernel's."""
    if "shader-f16" not in hetero.lowlevel.device_of(shared_rt).features:
        pytest.skip("the adapter has no shader-f16")
    monkeypatch.setattr(D, "TILED_IMPL", "blocked")
    n, k = 70, 320
    wa, wb = make_weight(kind, rand((n, k), 70, scale=0.5)), make_weight(kind, rand((n, k), 71, scale=0.5))
    g, bias = rand((k,), 72) + 1.0, rand((n,), 73)
    for groups in (1, 10**6):
        monkeypatch.setattr(D, "TILED_MIN_GROUPS", groups)
        for m in (9, 70):
            x, res = rand((m, k), 74 + m, scale=2.0), rand((m, n), 75 + m)
            got = {}
            for half in (False, True):
                monkeypatch.setattr(D, "TILED_F16", half)
                labels: list[str] = []

                def stage(gpu: Any, x: Any, g: Any, b: Any, r: Any) -> Any:
                    spy = Spy(gpu)
                    out = (D.linear(spy, x, wa, bias=b, residual=r, norm=g, eps=1e-5, path="tiled"),
                           D.linear_swiglu(spy, x, wa, wb, path="tiled"))
                    labels.extend(spy.labels)
                    return out
                got[half] = await call(shared_rt, stage, x=x, g=g, b=bias, r=res)
                products = [x for x in labels if ".blocked." in x]
                assert products and all((".f16math" in x) == half for x in products), labels
            y, z = got[True]
            want, scale = linear_ref(x, unpack(wa), bias, res, norm=g, eps=1e-5)
            close(f"f16 blocked {kind} M={m} splits={groups}", y, want, scale, rtol=F16_RTOL)
            assert not np.array_equal(y, got[False][0])
            a, sa = linear_ref(x, unpack(wa))
            b2, sb = linear_ref(x, unpack(wb))
            ea, eb = F16_RTOL * sa, F16_RTOL * sb
            sig = 1.0 / (1.0 + np.exp(-a))
            tol = 1.1 * np.abs(b2) * ea + (np.abs(a * sig) + 1.1 * ea) * eb
            assert np.all(np.abs(z - a * sig * b2) <= tol + 1e-6), f"f16 blocked swiglu {kind} M={m}"


def x_rounding(x: np.ndarray, norm: np.ndarray | None = None, eps: float = 1e-6) -> np.ndarray:
    """Half the step of the dp4a GEMM's activation quantization, per element: (max |v| of its block
    of 32) / 254, v = x (RMSNorm-scaled by ``norm``)."""
    v = x.astype(np.float64)
    if norm is not None:
        v = v / np.sqrt((v ** 2).mean(-1, keepdims=True) + eps) * norm
    m, k = v.shape
    amax = np.abs(v).reshape(m, k // 32, 32).max(-1)
    return np.repeat(amax / 254.0, 32, axis=1)


@ASYNCIO_ONLY
async def test_tiled_auto_takes_dp4a_for_large_integer_weights(shared_rt: hetero.Runtime,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """TILED_IMPL = "auto" (the default): Q8_0 / Q4 weights of at least TILED_DP4A_MIN_WEIGHTS values take
    the dp4a GEMM (its quantize pass first), smaller ones and float weights the blocked kernel."""
    assert D.TILED_IMPL == "auto"
    k, n, m = 64, 40, 12
    seen: list[list[str]] = []

    def stage(pw: Any) -> Any:
        def f(gpu: Any, x: Any) -> Any:
            spy = Spy(gpu)
            y = D.linear(spy, x, pw, path="tiled")
            seen.append(spy.labels)
            return y
        return f
    x = rand((m, k), 95)
    for kind, floor in (("q4_1", n * k), ("q4_1", n * k + 1), ("q8_0", n * k), ("f16", 1)):
        monkeypatch.setattr(D, "TILED_DP4A_MIN_WEIGHTS", floor)
        pw = make_weight(kind, rand((n, k), 96))
        got = await call(shared_rt, stage(pw), x=x)
        want, scale = linear_ref(x, unpack(pw))
        close(f"auto {kind} floor {floor}", got, want, scale + (x_rounding(x) @ np.abs(unpack(pw)).T) / 1e-5)
    firsts = [labels[0] for labels in seen]
    assert firsts[0] == "decoder.linear.quantize" and ".dp4a." in seen[0][1]
    assert ".blocked." in firsts[1]
    assert firsts[2] == "decoder.linear.quantize" and ".q8_0.dp4a." in seen[2][1]
    assert ".f16.blocked." in firsts[3]
    # wide products (output heads) take dp4a too, unless TILED_DP4A_WIDE is off
    monkeypatch.setattr(D, "TILED_DP4A_MIN_WEIGHTS", 1)
    monkeypatch.setattr(D, "GEMV_LANES_MIN_N", n)
    for wide, taken in ((True, "dp4a"), (False, "blocked")):
        monkeypatch.setattr(D, "TILED_DP4A_WIDE", wide)
        assert D._tiled_impl("linear", "q8_0", n, k) == taken and D._tiled_impl("linear", "q8_0", n - 1, k) == "dp4a"


@ASYNCIO_ONLY
@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "q4_1"])
async def test_linear_dp4a_within_its_activation_rounding(shared_rt: hetero.Runtime, kind: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """TILED_IMPL = "dp4a": x quantized a block of 32, integer dot products. Against float64 on the
    dequantized weight, each output is within sum_k (x's rounding at k) * |w_k| (plus float32's
    rounding), with and without the folded RMSNorm, bias, residual, SwiGLU, split K; M = 9, 33, 70
    (32- and 64-row tiles, the last partial), N = 70, K = 160 (five blocks: part of one quantize
    workgroup) and 320 (ten: two, the second partial), and 1056 (the norm's sum of squares past its
    unrolled loads); slices of 4 blocks along K (the last of a split partial) and of 1."""
    monkeypatch.setattr(D, "TILED_IMPL", "dp4a")
    for k, slice_blocks in ((160, 4), (320, 4), (160, 1), (1056, 4)):
        monkeypatch.setattr(G, "DP4A_SLICE_BLOCKS", slice_blocks)
        await _dp4a_case(shared_rt, kind, k, monkeypatch)


@ASYNCIO_ONLY
@pytest.mark.parametrize("gate_impl", ["blocked", "dp4a"])
async def test_swiglu_quantized_for_down_gives_the_same_outputs(shared_rt: hetero.Runtime, gate_impl: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """linear_swiglu(quantize=True) then linear: down reads the gate/up output as QuantizedRows. Where
    gate/up splits K its epilogue quantizes (no float32 output, no quantize pass for down); otherwise
    the quantize pass runs on the float32 output. Either way down's outputs equal those of the
    float32 path bit for bit (the folded norm, M 9 and 70); QuantizedRows go only to the dp4a GEMM."""
    f, hidden = 96, 64
    wg, wu = make_weight("q4_1", rand((f, hidden), 60)), make_weight("q4_1", rand((f, hidden), 61))
    wd = make_weight("q8_0", rand((hidden, f), 62))
    g = rand((hidden,), 63) + 1.0

    def impl(op: str, kind: str, n: int, k: int) -> str:  # gate/up on gate_impl, down on dp4a
        return "dp4a" if k == f else gate_impl
    monkeypatch.setattr(D, "_tiled_impl", impl)
    for groups in (1, 10**6):  # gate/up in one split, and K split
        monkeypatch.setattr(D, "TILED_MIN_GROUPS", groups)
        monkeypatch.setattr(D, "TILED_SPLIT_MIN_CHUNKS", 1)
        for m in (9, 70):
            x, res = rand((m, hidden), 64 + m), rand((m, hidden), 65 + m)
            got = {}
            for quantize in (False, True):
                labels: list[str] = []

                def stage(gpu: Any, x: Any, g: Any, r: Any) -> Any:
                    spy = Spy(gpu)
                    mlp = D.linear_swiglu(spy, x, wg, wu, norm=g, eps=1e-5, quantize=quantize)
                    assert isinstance(mlp, D.QuantizedRows) == quantize and D.takes_quantized_rows(m, wd)
                    out = D.linear(spy, mlp, wd, residual=r)
                    labels.extend(spy.labels)
                    return out
                got[quantize] = await call(shared_rt, stage, x=x, g=g, r=res)
                fused = [x for x in labels if x.endswith(".q8out")]
                passes = [x for x in labels if x.startswith("decoder.linear.quantize")]
                if quantize and groups > 1:  # the epilogue quantizes: down has no pass of its own
                    assert len(fused) == 1 and ".swiglu" in fused[0] and \
                        len(passes) == (1 if gate_impl == "dp4a" else 0), labels
                else:
                    assert not fused and len(passes) == 1 + (gate_impl == "dp4a"), labels
            np.testing.assert_array_equal(got[True], got[False], err_msg=f"{gate_impl} M={m} splits={groups}")

    def to_gemv(gpu: Any, x: Any) -> Any:
        rows = D.linear_swiglu(gpu, x, wg, wu, quantize=True, path="tiled")
        return D.linear(gpu, rows, wd)  # 2 rows: the GEMV, which cannot take quantized rows
    with pytest.raises(hetero.StageError, match="linear: x is quantized rows, which only the dp4a GEMM takes"):
        await call(shared_rt, to_gemv, x=rand((2, hidden), 66))

    def to_swiglu(gpu: Any, x: Any) -> Any:
        rows = D.linear_swiglu(gpu, x, wg, wu, quantize=True)
        return D.linear_swiglu(gpu, rows, wd, wd)
    with pytest.raises(hetero.StageError, match="linear_swiglu: x is quantized rows"):
        await call(shared_rt, to_swiglu, x=rand((12, hidden), 67))
    odd = make_weight("f32", rand((33, hidden), 68))
    with pytest.raises(hetero.StageError, match="linear_swiglu: quantize needs rows of a multiple of 32 values"):
        await call(shared_rt, lambda gpu, x: D.linear_swiglu(gpu, x, odd, odd, quantize=True), x=rand((12, hidden), 69))


@ASYNCIO_ONLY
@pytest.mark.parametrize("kind", ["q8_0", "q4_1"])
async def test_dp4a_thread_tiles_give_the_same_outputs(shared_rt: hetero.Runtime, kind: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """DP4A_THREAD_TILE 8 x 8, 8 x 4 and 4 x 8 compute each output from the same blocks in the same
    order as 4 x 4: equal outputs, bit for bit (the bias, residual, folded norm, SwiGLU; one split
    and K split; M 9 and 70, N 70: partial tiles both ways); an unknown tile is refused."""
    monkeypatch.setattr(D, "TILED_IMPL", "dp4a")
    n, k = 70, 320
    wa, wb = make_weight(kind, rand((n, k), 90)), make_weight(kind, rand((n, k), 91))
    g, bias = rand((k,), 92) + 1.0, rand((n,), 93)
    got: dict[tuple[int, int], list[np.ndarray]] = {}
    for tile in ((4, 4), (8, 8), (8, 4), (4, 8)):
        monkeypatch.setattr(G, "DP4A_THREAD_TILE", tile)
        outs = got[tile] = []
        for groups in (1, 10**6):
            monkeypatch.setattr(D, "TILED_MIN_GROUPS", groups)
            monkeypatch.setattr(D, "TILED_SPLIT_MIN_CHUNKS", 1)
            for m in (9, 70):
                x, res = rand((m, k), 94 + m, scale=2.0), rand((m, n), 95 + m)
                outs += list(await call(shared_rt, lambda gpu, x, g, b, r: (
                    D.linear(gpu, x, wa, bias=b, residual=r, norm=g, eps=1e-5, path="tiled"),
                    D.linear_swiglu(gpu, x, wa, wb, path="tiled")), x=x, g=g, b=bias, r=res))
    for tile, outs in got.items():
        assert all(np.array_equal(a, b) for a, b in zip(outs, got[(4, 4)])), tile
    assert G.dp4a_blocking(70, False) == G.Blocking(64, 64, 4, 8)  # the last tile set
    monkeypatch.setattr(G, "DP4A_THREAD_TILE", (16, 4))
    with pytest.raises(ValueError, match=r"DP4A_THREAD_TILE must be \(rows, columns\) of 4 or 8 each"):
        G.dp4a_blocking(70, False)


async def _dp4a_case(shared_rt: hetero.Runtime, kind: str, k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    n = 70
    wa, wb = make_weight(kind, rand((n, k), 80)), make_weight(kind, rand((n, k), 81))
    da, db = unpack(wa).astype(np.float64), unpack(wb).astype(np.float64)
    g, bias = rand((k,), 82) + 1.0, rand((n,), 83)
    for groups in (1, 10**6):  # one split, and K split five ways
        monkeypatch.setattr(D, "TILED_MIN_GROUPS", groups)
        monkeypatch.setattr(D, "TILED_SPLIT_MIN_CHUNKS", 1)
        for m in (9, 33, 70):
            x, res = rand((m, k), 84 + m, scale=2.0), rand((m, n), 85 + m)
            y, z = await call(shared_rt, lambda gpu, x, g, b, r: (
                D.linear(gpu, x, wa, bias=b, residual=r, norm=g, eps=1e-5, path="tiled"),
                D.linear_swiglu(gpu, x, wa, wb, path="tiled")), x=x, g=g, b=bias, r=res)
            want, scale = linear_ref(x, unpack(wa), bias, res, norm=g, eps=1e-5)
            bound = x_rounding(x, g, 1e-5) @ np.abs(da).T
            close(f"dp4a {kind} K={k} M={m} splits={groups}", y, want, scale + bound / 1e-5)
            assert not np.array_equal(y, want.astype(np.float32))  # x was rounded: not the float path
            a, sa = linear_ref(x, unpack(wa))
            b2, sb = linear_ref(x, unpack(wb))
            ea, eb = x_rounding(x) @ np.abs(da).T, x_rounding(x) @ np.abs(db).T
            sig = 1.0 / (1.0 + np.exp(-a))
            tol = 1.1 * np.abs(b2) * (ea + 1e-5 * sa) + (np.abs(a * sig) + 1.1 * ea) * (eb + 1e-5 * sb)
            assert np.all(np.abs(z - a * sig * b2) <= tol + 1e-6), f"dp4a swiglu {kind} K={k} M={m}"


async def test_linear_dp4a_takes_float_weights_to_the_blocked_kernel(shared_rt: hetero.Runtime,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(D, "TILED_IMPL", "dp4a")
    pw = make_weight("f16", rand((20, 64), 86))
    x = rand((12, 64), 87)
    got = await call(shared_rt, lambda gpu, x: D.linear(gpu, x, pw), x=x)
    close("dp4a f16", got, *linear_ref(x, unpack(pw)))


async def test_tiled_impl_must_be_known(shared_rt: hetero.Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(D, "TILED_IMPL", "t64")
    pw = make_weight("q8_0", rand((8, 64), 66))
    with pytest.raises(hetero.StageError, match=r"linear: TILED_IMPL must be one of 'auto', 't32', 'blocked', 'dp4a', got 't64'"):
        await call(shared_rt, lambda gpu, x: D.linear(gpu, x, pw), x=rand((9, 64), 67))


async def test_linear_errors(shared_rt: hetero.Runtime) -> None:
    pw = make_weight("q8_0", rand((8, 64), 50))
    with pytest.raises(hetero.StageError, match=r"linear: x of shape \[2, 32\] and w of shape \[8, 64\] do not "
                                                r"chain; y = x @ W.T needs"):
        await call(shared_rt, lambda gpu, x: D.linear(gpu, x, pw), x=rand((2, 32), 1))
    with pytest.raises(hetero.StageError, match=r"linear: residual of shape \(2, 7\) differs from the result's "
                                                r"shape \(2, 8\)"):
        await call(shared_rt, lambda gpu, x, r: D.linear(gpu, x, pw, residual=r), x=rand((2, 64), 1),
                   r=rand((2, 7), 2))
    with pytest.raises(hetero.StageError, match="linear_swiglu: the weights must share their kind and shape"):
        await call(shared_rt, lambda gpu, x: D.linear_swiglu(gpu, x, pw, make_weight("q4_0", rand((8, 64), 3))),
                   x=rand((2, 64), 1))


# -- RMSNorm ------------------------------------------------------------------------------------
async def test_rmsnorm_and_add_rmsnorm(shared_rt: hetero.Runtime) -> None:
    x, r, g = rand((5, 100), 60, scale=4.0), rand((5, 100), 61), rand((100,), 62)

    def ref(v: np.ndarray) -> np.ndarray:
        return v / np.sqrt((v ** 2).mean(-1, keepdims=True) + 1e-5) * g

    got = await call(shared_rt, lambda gpu, x, g: D.rmsnorm(gpu, x, g, 1e-5), x=x, g=g)
    close("rmsnorm", got, ref(x.astype(np.float64)), np.abs(ref(x.astype(np.float64))) + 1e-3)
    h, y = await call(shared_rt, lambda gpu, x, r, g: D.add_rmsnorm(gpu, x, r, g, 1e-5), x=x, r=r, g=g)
    v = x.astype(np.float64) + r
    close("add_rmsnorm h", h, v, np.abs(v))
    close("add_rmsnorm y", y, ref(v), np.abs(ref(v)) + 1e-3)
    with pytest.raises(hetero.StageError, match=r"rmsnorm: weight of shape \(99,\) does not match the last axis"):
        await call(shared_rt, lambda gpu, x, g: D.rmsnorm(gpu, x, g), x=x, g=g[:99])


# -- RoPE, the KV cache and attention ------------------------------------------------------------------
def inv_freq(d: int, theta: float) -> np.ndarray:
    return (1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)).astype(np.float32)


def rope_ref(x: np.ndarray, pos: np.ndarray, f: np.ndarray) -> np.ndarray:
    """transformers' q * cos + rotate_half(q) * sin, the angle rounded to float32 as it computes it."""
    ang = (pos[:, None].astype(np.float32) * f[None, :]).astype(np.float64)
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h].astype(np.float64), x[..., h:].astype(np.float64)
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)


async def test_rope_positions_and_theta(shared_rt: hetero.Runtime) -> None:
    pos = np.array([0, 1, 2, 17, 511, 4095, 8191, 100000], np.int32)
    for d, theta in [(16, 10000.0), (64, 100000.0)]:
        x = rand((len(pos), 3, d), d)
        f = inv_freq(d, theta)
        got = await call(shared_rt, lambda gpu, x, p, f: D.rope(gpu, x, p, f), x=x, p=pos, f=f)
        close(f"rope D={d} theta={theta}", got, rope_ref(x, pos, f), np.abs(x).max(), rtol=2e-6)


class Batch:
    """Sequences of given lengths in a paged cache: random distinct blocks, every token a row."""

    def __init__(self, lens: list[int], bs: int, hq: int, hkv: int, d: int, seed: int, spare: int = 2) -> None:
        rng = np.random.default_rng(seed)
        self.lens, self.bs, self.hq, self.hkv, self.d = lens, bs, hq, hkv, d
        self.maxb = max(-(-n // bs) for n in lens) + 1  # one unused entry per table
        self.nb = sum(-(-n // bs) for n in lens) + spare
        perm = rng.permutation(self.nb)
        self.bt = np.zeros((len(lens), self.maxb), np.int32)
        used = 0
        for s, n in enumerate(lens):
            nblk = -(-n // bs)
            self.bt[s, :nblk] = perm[used:used + nblk]
            used += nblk
        self.rows = [(s, p) for s, n in enumerate(lens) for p in range(n)]
        self.seq = np.array([s for s, _ in self.rows], np.int32)
        self.pos = np.array([p for _, p in self.rows], np.int32)
        self.slots = np.array([self.bt[s, p // bs] * bs + p % bs for s, p in self.rows], np.int32)
        self.qkv = rand((len(self.rows), (hq + 2 * hkv) * d), seed + 1)
        self.f = inv_freq(d, 10000.0)
        t = len(self.rows)
        self.q = rope_ref(self.qkv[:, :hq * d].reshape(t, hq, d), self.pos, self.f)
        self.k = rope_ref(self.qkv[:, hq * d:(hq + hkv) * d].reshape(t, hkv, d), self.pos, self.f)
        self.v = self.qkv[:, (hq + hkv) * d:].reshape(t, hkv, d).astype(np.float64)

    def attention_ref(self, rows: list[int]) -> np.ndarray:
        out = np.zeros((len(rows), self.hq, self.d))
        grp = self.hq // self.hkv
        for i, t in enumerate(rows):
            s, p = self.rows[t]
            keys = [j for j, (s2, p2) in enumerate(self.rows) if s2 == s and p2 <= p]
            for h in range(self.hq):
                sc = self.k[keys, h // grp] @ self.q[t, h] / math.sqrt(self.d)
                e = np.exp(sc - sc.max())
                out[i, h] = (e / e.sum()) @ self.v[keys, h // grp]
        return out


def f16_pairs(words: np.ndarray) -> np.ndarray:
    """An f16 cache's uint32 words [..., D / 2] as float32 [..., D]."""
    return words.view(np.float16).astype(np.float32)


@ASYNCIO_ONLY
@pytest.mark.parametrize("prefetch", [False, True], ids=["loops", "prefetch"])
@pytest.mark.parametrize("cache", ["f32", "f16"])
@pytest.mark.parametrize("heads", [(9, 3, 16, 4), (8, 2, 32, 16), (4, 4, 64, 4)],
                         ids=["gqa3-bs4", "gqa4-bs16", "mha-d64"])
async def test_rope_kv_then_paged_attention_prefill(shared_rt: hetero.Runtime, heads: tuple[int, int, int, int],
                                                    cache: str, prefetch: bool,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """All tokens of three sequences (one spanning several blocks with a partial last one, one of a
    single token) in one batch: rope_kv writes the cache, then each row attends causally. An f16
    cache holds the rows rounded to f16, and attention matches numpy on those rounded rows; with
    and without ATTN_PREFETCH (it applies at every head_dim here)."""
    monkeypatch.setattr(D, "ATTN_PREFETCH", prefetch)
    hq, hkv, d, bs = heads
    assert W.attention_prefetches(d)
    b = Batch([9, 1, 21], bs, hq, hkv, d, seed=hq * 10 + d)
    if cache == "f16":  # the reference attends over the rounded rows
        b.k = b.k.astype(np.float16).astype(np.float64)
        b.v = b.v.astype(np.float16).astype(np.float64)
    want = b.attention_ref(list(range(len(b.rows))))
    for sg in subgroup_modes(shared_rt):
        monkeypatch.setattr(D, "USE_SUBGROUPS", sg)
        for splits in (None, 1, 3):
            def stage(gpu: Any, qkv: Any, pos: Any, f: Any, slots: Any, bt: Any, seq: Any) -> Any:
                kc, vc = D.kv_cache(gpu, b.nb, b.bs, b.hkv, b.d, dtype=cache)
                q = D.rope_kv(gpu, qkv, pos, f, kc, vc, slots, heads=b.hq)
                return q, kc, vc, D.paged_attention(gpu, q, kc, vc, bt, seq, pos, splits=splits)
            q, kc, vc, o = await call(shared_rt, stage, qkv=b.qkv, pos=b.pos, f=b.f, slots=b.slots, bt=b.bt,
                                      seq=b.seq)
            close("rope_kv q", q, b.q, 1.0, rtol=2e-6)
            if cache == "f16":
                assert kc.dtype == np.uint32 and kc.shape == (b.nb, bs, hkv, d // 2)
                kc, vc = f16_pairs(kc), f16_pairs(vc)
            flat_k, flat_v = kc.reshape(-1, hkv, d), vc.reshape(-1, hkv, d)
            if cache == "f32":
                close("rope_kv k in the cache", flat_k[b.slots], b.k, 1.0, rtol=2e-6)
            else:  # the GPU rounds its float32 rotation, numpy the float64 one: an f16 ulp apart at most
                close("rope_kv k in the f16 cache", flat_k[b.slots], b.k, np.abs(b.k), rtol=1e-3)
            np.testing.assert_array_equal(flat_v[b.slots], b.v.astype(np.float32))
            close(f"paged_attention {hq}/{hkv} D={d} bs={bs} splits={splits} subgroups={sg} cache={cache}", o,
                  want, 1.0, rtol=1e-5 if cache == "f32" else 1e-3)


@ASYNCIO_ONLY
@pytest.mark.parametrize("heads", [(6, 1, 80, 4, 8), (9, 3, 16, 16, 2), (8, 2, 128, 16, 2)],
                         ids=["mqa-d80", "gqa3-chunks", "gqa4-d128-chunks"])
async def test_paged_attention_head_chunks_and_odd_head_dims(shared_rt: hetero.Runtime,
                                                             heads: tuple[int, int, int, int, int],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A query-head group served in chunks (ATTN_MAX_HEADS below the group), head_dim 80 (value
    columns not a power of two) and 128; decode rows and a prefill batch. ATTN_PREFETCH is on: it
    applies at head_dim 16; at 80 and 128 the loops run."""
    hq, hkv, d, bs, max_heads = heads
    monkeypatch.setattr(D, "ATTN_MAX_HEADS", max_heads)
    monkeypatch.setattr(D, "ATTN_PREFETCH", True)
    assert W.attention_prefetches(d) == (d <= 64)
    b = Batch([11, 70], bs, hq, hkv, d, seed=d + hq)
    want = b.attention_ref(list(range(len(b.rows))))

    def stage(gpu: Any, qkv: Any, pos: Any, f: Any, slots: Any, bt: Any, seq: Any) -> Any:
        kc, vc = D.kv_cache(gpu, b.nb, b.bs, b.hkv, b.d)
        q = D.rope_kv(gpu, qkv, pos, f, kc, vc, slots, heads=b.hq)
        return D.paged_attention(gpu, q, kc, vc, bt, seq, pos)
    o = await call(shared_rt, stage, qkv=b.qkv, pos=b.pos, f=b.f, slots=b.slots, bt=b.bt, seq=b.seq)
    close(f"paged_attention {hq}/{hkv} D={d} max_heads={max_heads}", o, want, 1.0)


@ASYNCIO_ONLY
async def test_paged_attention_decode_split_along_keys(shared_rt: hetero.Runtime,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode: one query a sequence at its last position over a cache written by kv_write; the
    flash-decoding split (chosen, and forced) agrees with the one-pass kernel; float32 and f16 caches;
    with and without ATTN_PREFETCH."""
    assert "let vv0" in W.attention(3, 16, True, 0, False, True) and "let vv0" not in W.attention(3, 16, True, 0)
    monkeypatch.setattr(D, "ATTN_SPLIT_KEYS", 32)
    b = Batch([70, 5, 130], 16, 9, 3, 16, seed=7)
    last = [max(i for i, (s2, _) in enumerate(b.rows) if s2 == s) for s in range(len(b.lens))]
    k = b.k.astype(np.float32)
    v = b.v.astype(np.float32)
    qd = b.q[last].astype(np.float32)
    for cache in ("f32", "f16"):
        if cache == "f16":  # kv_write rounds the float32 rows to f16 as numpy does
            b.k, b.v = k.astype(np.float16).astype(np.float64), v.astype(np.float16).astype(np.float64)
        want = b.attention_ref(last)
        for splits, prefetch in ((None, False), (1, False), (2, False), (7, False), (1, True), (7, True)):
            monkeypatch.setattr(D, "ATTN_PREFETCH", prefetch)
            def stage(gpu: Any, k: Any, v: Any, slots: Any, q: Any, bt: Any, seq: Any, pos: Any) -> Any:
                kc, vc = D.kv_cache(gpu, b.nb, b.bs, b.hkv, b.d, dtype=cache)
                D.kv_write(gpu, kc, vc, k, v, slots)
                return D.paged_attention(gpu, q, kc, vc, bt, seq, pos, splits=splits)
            o = await call(shared_rt, stage, k=k, v=v, slots=b.slots, q=qd, bt=b.bt,
                           seq=np.arange(len(b.lens), dtype=np.int32), pos=b.pos[last])
            close(f"paged_attention decode splits={splits} prefetch={prefetch} cache={cache}", o, want, 1.0)


@ASYNCIO_ONLY
@pytest.mark.parametrize("kind", ["q4_1", "f16"])
async def test_linear_combines_split_attention_on_load(shared_rt: hetero.Runtime, kind: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """paged_attention(combine=False) then linear: the units GEMV combines the splits as it loads them
    (two dispatches, no combine pass) and agrees with numpy, with and without subgroups, with the
    residual, the bias and the RMSNorm; past ATTN_COMBINE_MAX_SPLITS, on the lanes GEMV, on the tiled
    path or without the workgroup memory, the combine pass runs first and the result is the same."""
    monkeypatch.setattr(D, "ATTN_SPLIT_KEYS", 32)
    hq, hkv, d, n = 8, 2, 16, 48
    b = Batch([70, 5, 130], 16, hq, hkv, d, seed=11)
    last = [max(i for i, (s2, _) in enumerate(b.rows) if s2 == s) for s in range(len(b.lens))]
    att = b.attention_ref(last).reshape(len(last), -1)
    wo = make_weight(kind, rand((n, hq * d), 3, scale=0.3))
    wref = unpack(wo).astype(np.float64)
    res, bias, g = rand((len(last), n), 9), rand((n,), 10), rand((hq * d,), 12) * 0.2 + 1.0
    normed = att / np.sqrt((att ** 2).mean(-1, keepdims=True) + 1e-5) * g
    want = {"res": att @ wref.T + res, "bias-norm": normed @ wref.T + bias}
    feeds = dict(k=b.k.astype(np.float32), v=b.v.astype(np.float32), slots=b.slots, q=b.q[last].astype(np.float32),
                 bt=b.bt, seq=np.arange(len(b.lens), dtype=np.int32), pos=b.pos[last], res=res, bias=bias, g=g)

    async def run(splits: int, flags: str, path: str = "auto", rows: int = 3) -> tuple[np.ndarray, list[str]]:
        spy_labels: list[str] = []

        def stage(gpu: Any, k: Any, v: Any, slots: Any, q: Any, bt: Any, seq: Any, pos: Any, res: Any, bias: Any,
                  g: Any) -> Any:
            spy = Spy(gpu)
            kc, vc = D.kv_cache(gpu, b.nb, b.bs, b.hkv, b.d)
            D.kv_write(gpu, kc, vc, k, v, slots)
            a = D.paged_attention(spy, q, kc, vc, bt, seq, pos, splits=splits, combine=False)
            assert isinstance(a, D.AttentionSplits) and a.shape == (rows, hq, d) and a.splits == splits
            if flags == "res":
                out = D.linear(spy, a, wo, residual=res, path=path)
            else:
                out = D.linear(spy, a, wo, bias=bias, norm=g, eps=1e-5, path=path)
            spy_labels.extend(spy.labels)
            return out
        got = await call(shared_rt, stage, **feeds)
        return got, spy_labels

    monkeypatch.setattr(D, "GEMV_IMPL", "units")
    for sg in subgroup_modes(shared_rt):
        monkeypatch.setattr(D, "USE_SUBGROUPS", sg)
        for splits in (2, 5):
            for flags in ("res", "bias-norm"):
                got, labels = await run(splits, flags)
                assert len(labels) == 2 and labels[1].startswith(f"decoder.linear.gemv.{kind}.m3") \
                    and f".comb{splits}" in labels[1], labels
                close(f"linear of split attention {kind} splits={splits} {flags} subgroups={sg}", got, want[flags],
                      np.abs(want[flags]).max(-1, keepdims=True))
    # the combine pass first: too many splits, the lanes GEMV, the tiled kernel, too little workgroup memory
    monkeypatch.setattr(D, "ATTN_COMBINE_MAX_SPLITS", 4)
    cases: list[tuple[str, str, str, int]] = [("units", "auto", "max-splits", 5), ("lanes", "auto", "lanes", 2),
                                              ("units", "tiled", "tiled", 2)]
    for impl, path, why, splits in cases:
        monkeypatch.setattr(D, "GEMV_IMPL", impl)
        got, labels = await run(splits, "res", path)
        assert labels[1] == "decoder.paged_attention.combine" and not any(".comb" in x for x in labels[2:]), \
            (why, labels)
        close(f"linear after the combine pass ({why})", got, want["res"], np.abs(want["res"]).max(-1, keepdims=True))
    monkeypatch.setattr(D, "GEMV_IMPL", "units")
    monkeypatch.setattr(D, "_GEMV_OWN_BYTES", 1 << 30)
    got, labels = await run(2, "res")
    assert labels[1] == "decoder.paged_attention.combine", labels


@ASYNCIO_ONLY
async def test_combine_attention_is_the_combine_pass(shared_rt: hetero.Runtime) -> None:
    """combine_attention of paged_attention(combine=False) equals paged_attention's own combine;
    with one split, combine=False gives the Tensor at once; bad arguments are refused."""
    b = Batch([40, 90], 16, 4, 2, 8, seed=5)
    last = [max(i for i, (s2, _) in enumerate(b.rows) if s2 == s) for s in range(len(b.lens))]
    want = b.attention_ref(last)

    def stage(gpu: Any, k: Any, v: Any, slots: Any, q: Any, bt: Any, seq: Any, pos: Any) -> Any:
        kc, vc = D.kv_cache(gpu, b.nb, b.bs, b.hkv, b.d)
        D.kv_write(gpu, kc, vc, k, v, slots)
        whole = D.paged_attention(gpu, q, kc, vc, bt, seq, pos, splits=3)
        later = D.combine_attention(gpu, D.paged_attention(gpu, q, kc, vc, bt, seq, pos, splits=3, combine=False))
        one = D.paged_attention(gpu, q, kc, vc, bt, seq, pos, splits=1, combine=False)
        assert isinstance(one, hetero.Tensor)
        return whole, later, one
    whole, later, one = await call(shared_rt, stage, k=b.k.astype(np.float32), v=b.v.astype(np.float32),
                                   slots=b.slots, q=b.q[last].astype(np.float32), bt=b.bt,
                                   seq=np.arange(2, dtype=np.int32), pos=b.pos[last])
    assert np.array_equal(whole, later)
    close("paged_attention, one split", one, want, 1.0)
    close("combine_attention", later, want, 1.0)

    def bad_combine(gpu: Any, x: Any) -> Any:
        return D.combine_attention(gpu, x)
    with pytest.raises(hetero.StageError, match="combine_attention: expected the AttentionSplits"):
        await call(shared_rt, bad_combine, x=rand((2, 4, 8), 1))

    def bad_flag(gpu: Any, q: Any) -> Any:
        kc, vc = D.kv_cache(gpu, 2, 4, 2, 8)
        return D.paged_attention(gpu, q, kc, vc, np.zeros((1, 2), np.int32), np.zeros(1, np.int32),
                                 np.zeros(1, np.int32), combine="no")
    with pytest.raises(hetero.StageError, match="paged_attention: combine must be True or False, got 'no'"):
        await call(shared_rt, bad_flag, q=rand((1, 4, 8), 2))

    def swiglu_of_splits(gpu: Any, q: Any) -> Any:
        kc, vc = D.kv_cache(gpu, 8, 16, 2, 8)
        a = D.paged_attention(gpu, q, kc, vc, np.zeros((1, 8), np.int32), np.zeros(1, np.int32),
                              np.full(1, 100, np.int32), splits=2, combine=False)
        w = make_weight("f32", rand((8, 32), 3))
        return D.linear_swiglu(gpu, a, w, w)
    with pytest.raises(hetero.StageError, match="linear_swiglu: x is a split attention's partial results"):
        await call(shared_rt, swiglu_of_splits, q=rand((1, 4, 8), 2))

    def by_hand(gpu: Any, q: Any) -> Any:  # partial rows of the wrong shape: refused, nothing read
        a = D.AttentionSplits(gpu.upload(np.zeros((1, 4, 2, 10), np.float32)), (1, 4, 8), 2)
        return D.linear(gpu, a, make_weight("f32", rand((8, 32), 3)))
    with pytest.raises(hetero.StageError, match=r"linear: an AttentionSplits of shape \(1, 4, 8\) and 2 splits "
                                                r"holds float32 partial rows \(1, 4, 2, 12\), got float32 "
                                                r"\(1, 4, 2, 10\)"):
        await call(shared_rt, by_hand, q=rand((1, 4, 8), 2))


async def test_attention_and_rope_errors(shared_rt: hetero.Runtime) -> None:
    def stage(gpu: Any, q: Any) -> Any:
        kc, vc = D.kv_cache(gpu, 2, 4, 3, 16)
        return D.paged_attention(gpu, q, kc, vc, np.zeros((1, 2), np.int32), np.zeros(2, np.int32),
                                 np.zeros(2, np.int32))
    with pytest.raises(hetero.StageError, match=r"paged_attention: heads \(8\) must be a multiple of the caches' "
                                                r"kv_heads \(3\)"):
        await call(shared_rt, stage, q=rand((2, 8, 16), 1))

    def stage2(gpu: Any, qkv: Any) -> Any:
        kc, vc = D.kv_cache(gpu, 2, 4, 2, 8)
        return D.rope_kv(gpu, qkv, np.zeros(1, np.int32), inv_freq(8, 1e4), kc, vc, np.array([8], np.int32),
                         heads=4)
    with pytest.raises(hetero.StageError, match=r"rope_kv: slots must be in \[0, 8\)"):
        await call(shared_rt, stage2, qkv=rand((1, 64), 2))
    with pytest.raises(hetero.StageError, match="kv_cache: an f16 cache needs head_dim to be a multiple of 4, got 6"):
        await call(shared_rt, lambda gpu, x: D.kv_cache(gpu, 2, 4, 1, 6, dtype="f16")[0], x=rand((1,), 3))


# -- embedding and the output head -------------------------------------------------------------------
@ASYNCIO_ONLY
async def test_embedding_every_kind_and_tied_head(shared_rt: hetero.Runtime) -> None:
    v, h = 300, 64
    table = rand((v, h), 70)
    ids = np.array([0, 299, 5, 5, 123], np.int32)
    x = rand((2, h), 71)
    g = rand((h,), 72) + 1.0
    for kind in KINDS:
        pw = make_weight(kind, table)

        def stage(gpu: Any, ids: Any, x: Any, g: Any) -> Any:
            t = D.upload_weight(gpu, pw)
            return D.embedding(gpu, t, ids), D.linear(gpu, x, t, norm=g)
        e, logits = await call(shared_rt, stage, ids=ids, x=x, g=g)
        np.testing.assert_array_equal(e, unpack(pw)[ids], err_msg=kind)
        want, scale = linear_ref(x, unpack(pw), norm=g)
        close(f"tied output head {kind}", logits, want, scale)
    pw = make_weight("f32", rand((10, 13), 73))  # a row not a multiple of 8 long
    e = await call(shared_rt, lambda gpu, ids: D.embedding(gpu, pw, ids), ids=np.array([9, 0], np.int32))
    np.testing.assert_array_equal(e, unpack(pw)[[9, 0]])
    # ids that reach the GPU as a Tensor are not checked there: out-of-range ones give rows of zeros
    e = await call(shared_rt, lambda gpu, ids: D.embedding(gpu, pw, ids), ids=np.array([-1, 3, 10], np.int32))
    assert np.all(e[[0, 2]] == 0) and np.array_equal(e[1], unpack(pw)[3])
    with pytest.raises(hetero.StageError, match=r"embedding: ids must be in \[0, 10\)"):
        await call(shared_rt, lambda gpu, x: D.embedding(gpu, pw, np.array([10], np.int32)), x=x)


@ASYNCIO_ONLY
async def test_sampled_ids_kept_on_the_gpu_feed_the_next_runs_embedding(shared_rt: hetero.Runtime) -> None:
    """sample(keep=) in one run, embedding(src=, prev=) in the next, started back to back: the second
    reads what the first wrote (one recording thread runs them in the order started)."""
    v, h = 50, 32
    pw = make_weight("q8_0", rand((v, h), 74))
    kept: dict[str, Any] = {}

    def keeper(gpu: Any) -> Any:
        if "ids" not in kept:
            kept["ids"] = gpu.resident(np.full(8, -7, np.int32))
        return kept["ids"]

    def first(gpu: Any, logits: Any, p: Any) -> Any:
        return D.sample(gpu, logits, p, keep=keeper(gpu))

    def second(gpu: Any, ids: Any, src: Any) -> Any:
        return D.embedding(gpu, D.upload_weight(gpu, pw), ids, src=src, prev=keeper(gpu))

    g1, g2 = hetero.Graph("keep"), hetero.Graph("chain")
    g1.output(g1.gpu(first, g1.input("logits"), g1.input("p"), name="sample"))
    g2.output(g2.gpu(second, g2.input("ids"), g2.input("src"), name="embed"))
    table = unpack(pw)
    for round_ in range(3):
        logits = rand((3, v), 75 + round_)
        ids = np.array([4, 0, 9, 0, 1], np.int32)
        src = np.array([-1, 2, -1, 0, 5], np.int32)  # rows 1 and 3 from the first run; 5: past the 3 kept
        a = shared_rt.start(g1, logits=logits, p=D.sampling_params(0.0, rows=3))
        b = shared_rt.start(g2, ids=ids, src=src)
        toks, e = await a.result(), await b.result()
        np.testing.assert_array_equal(toks, logits.argmax(-1))
        want = table[[4, int(toks[2]), 9, int(toks[0]), 1]]
        np.testing.assert_array_equal(e[[0, 1, 2, 3]], want[[0, 1, 2, 3]])
        assert np.all(e[4] == 0)  # src 5 is past the 3 rows kept there: keep[5] still holds -7, a zero row
    with pytest.raises(hetero.StageError, match="embedding: src and prev go together"):
        await call(shared_rt, lambda gpu, ids: D.embedding(gpu, pw, ids, src=ids), ids=ids)
    with pytest.raises(hetero.StageError, match=r"embedding: src must be < 8 \(prev's length\)"):
        await call(shared_rt, lambda gpu, ids: D.embedding(gpu, pw, ids, src=np.array([0, 8, 0, 0, 0], np.int32),
                                                           prev=keeper(gpu)), ids=ids)
    with pytest.raises(hetero.StageError, match=r"sample: keep holds 8 ids, fewer than the 9 rows"):
        await call(shared_rt, lambda gpu, l: D.sample(gpu, l, D.sampling_params(0.0, rows=9), keep=keeper(gpu)),
                   l=rand((9, v), 79))
    with pytest.raises(hetero.StageError, match="sample: keep must be a resident tensor"):
        await call(shared_rt, lambda gpu, l: D.sample(gpu, l, D.sampling_params(0.0, rows=1),
                                                      keep=np.zeros(4, np.int32)), l=rand((1, v), 80))


# -- sampling -----------------------------------------------------------------------------------------
def _mix32(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.uint64) & 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x735A2D97) & 0xFFFFFFFF
    x ^= x >> 15
    return x


def sample_ref(logits: np.ndarray, prm: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """The sampler in numpy: chosen ids and each row's candidate set (top-k, then top-p, as transformers)."""
    out, sets = [], []
    for row, p in zip(logits.astype(np.float64), prm):
        temp = float(p[0:1].view(np.float32)[0])
        top_k, top_p = int(p[1]), float(p[2:3].view(np.float32)[0])
        if temp == 0:
            out.append(int(np.argmax(row)))
            sets.append(np.array([np.argmax(row)]))
            continue
        order = np.argsort(-row, kind="stable")
        keep = np.ones(len(row), bool)
        if 0 < top_k < len(row):
            keep = row >= row[order[top_k - 1]]
        z = np.where(keep, np.exp((row - row.max()) / temp), 0.0)
        if top_p < 1.0:
            srt = np.sort(z)[::-1]
            above = np.cumsum(srt) - srt  # mass of strictly larger tokens
            n_keep = int(np.sum(above < top_p * z.sum()))
            keep &= z >= srt[n_keep - 1]
        cand = np.flatnonzero(keep)
        seed, step = np.uint64(p[3]), np.uint64(p[4])
        h = _mix32(_mix32(_mix32(np.array([seed ^ 0x9E3779B9])) ^ step) ^ cand.astype(np.uint64))
        u = ((h >> 8).astype(np.float32) + np.float32(0.5)) * np.float32(1.0 / 16777216.0)
        sc = (row[cand] - row.max()) / temp - np.log(-np.log(u.astype(np.float64)))
        out.append(int(cand[np.argmax(sc)]))
        sets.append(cand)
    return np.array(out, np.int32), sets


@ASYNCIO_ONLY
@pytest.mark.parametrize("argmax_pass", [False, True], ids=["one-pass", "chunks"])
async def test_sample_greedy_is_argmax_with_ties_to_the_lowest_id(shared_rt: hetero.Runtime, argmax_pass: bool,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy rows are numpy's argmax (NaN as -inf, ties to the lowest id), with the row walked by its
    workgroup or (SAMPLE_ARGMAX_PASS) from chunks' largest found first: ties inside a chunk and across
    chunks (ARGMAX_CHUNK apart), rows of -inf and NaN only, V not a multiple of 4 and one chunk only."""
    monkeypatch.setattr(D, "SAMPLE_ARGMAX_PASS", argmax_pass)
    labels: list[str] = []

    def stage(gpu: Any, l: Any, p: Any) -> Any:
        spy = Spy(gpu)
        out = D.sample(spy, l, p)
        labels.extend(spy.labels)
        return out
    chunk = W.ARGMAX_CHUNK
    for v in (1000, 2 * chunk + 9, 3 * chunk):
        logits = rand((9, v), 80 + v, scale=2.0)
        logits[1, [17, 400, 999]] = 50.0    # a tie: lowest id
        logits[2, :] = 0.0                  # all equal
        logits[3, v - 1] = 60.0             # the last id (the last chunk's)
        logits[4, 0] = 60.0                 # the first
        logits[5, 7] = np.nan               # NaN never wins
        logits[6, :] = -np.inf              # nothing but -inf: id 0
        logits[7, :] = np.nan               # nothing but NaN: id 0
        logits[8, [v - 1, min(v - 1, chunk), min(v - 1, chunk - 1)]] = 70.0  # the largest at a chunk's edges
        labels.clear()
        ids = await call(shared_rt, stage, l=logits, p=D.sampling_params(0.0, rows=9))
        want = np.nan_to_num(logits, nan=-np.inf).argmax(-1)
        np.testing.assert_array_equal(ids, want, err_msg=f"V={v}")
        assert ids.dtype == np.int32 and ids[1] == 17 and ids[2] == 0 and ids[6] == 0 and ids[7] == 0
        assert (labels[0].startswith("decoder.sample.argmax") and labels[1].endswith(".chunks")
                if argmax_pass else len(labels) == 1), labels
        top1 = await call(shared_rt, stage, l=logits, p=D.sampling_params(0.7, top_k=1, seed=np.arange(9), rows=9))
        np.testing.assert_array_equal(top1[[0, 3, 4]], want[[0, 3, 4]])
        assert top1[1] in (17, 400, 999) and np.isfinite(logits[5, top1[5]])
        assert logits[8, top1[8]] == 70.0  # top-k keeps every token tied at its threshold


@ASYNCIO_ONLY
@pytest.mark.parametrize("argmax_pass", [False, True], ids=["one-pass", "chunks"])
@pytest.mark.parametrize("threads", [256, 1024])
async def test_sample_inside_top_k_top_p_and_reproducible(shared_rt: hetero.Runtime, threads: int, argmax_pass: bool,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Mixed rows in one batch (greedy, top-k, top-p, both, plain temperature): every token is inside
    numpy's candidate set, equals the numpy sampler (same hash), and the same seed and step repeat;
    workgroups of 256 and of 1024 threads (where the adapter allows), histograms summed through
    subgroups and through workgroup memory, rows read as scalars (V = 517), as vec4s from memory
    at every pass and once into registers (V = 520, 2080)."""
    monkeypatch.setattr(D, "SAMPLE_THREADS", threads)
    monkeypatch.setattr(D, "SAMPLE_ARGMAX_PASS", argmax_pass)
    for sg in subgroup_modes(shared_rt):
        monkeypatch.setattr(D, "USE_SUBGROUPS", sg)
        for v, regs in ((517, 16), (520, 0), (520, 16), (2080, 16)):  # 2080: 3 registers at 256 threads
            monkeypatch.setattr(D, "SAMPLE_REGS", regs)
            await _sample_mixed_rows(shared_rt, v)


async def _sample_mixed_rows(shared_rt: hetero.Runtime, v: int) -> None:
    s = 40
    logits = rand((s, v), 81, scale=3.0)
    temp = np.tile([0.0, 1.0, 0.7, 1.3, 0.5], s // 5)
    top_k = np.tile([0, 10, 0, 40, 0], s // 5)
    top_p = np.tile([1.0, 1.0, 0.8, 0.9, 1.0], s // 5)
    prm = D.sampling_params(temp, top_k, top_p, seed=np.arange(s) * 7 + 1, step=3)
    ids = await call(shared_rt, lambda gpu, l, p: D.sample(gpu, l, p), l=logits, p=prm)
    want, sets = sample_ref(logits, prm)
    for r in range(s):
        assert ids[r] in sets[r], f"row {r}: token {ids[r]} outside the candidate set of {len(sets[r])}"
    np.testing.assert_array_equal(ids, want)
    again = await call(shared_rt, lambda gpu, l, p: D.sample(gpu, l, p), l=logits, p=prm)
    np.testing.assert_array_equal(again, ids)
    prm2 = D.sampling_params(temp, top_k, top_p, seed=np.arange(s) * 7 + 1, step=4)
    other = await call(shared_rt, lambda gpu, l, p: D.sample(gpu, l, p), l=logits, p=prm2)
    np.testing.assert_array_equal(other, sample_ref(logits, prm2)[0])


@ASYNCIO_ONLY
async def test_sample_different_seeds_spread(shared_rt: hetero.Runtime) -> None:
    """One flat-ish row repeated: 256 seeds give many tokens, the likeliest the most often."""
    v = 300
    row = np.linspace(0.0, 1.0, v, dtype=np.float32)
    logits = np.tile(row, (256, 1))
    prm = D.sampling_params(1.0, top_k=20, seed=np.arange(256), rows=256)
    ids = await call(shared_rt, lambda gpu, l, p: D.sample(gpu, l, p), l=logits, p=prm)
    assert ids.min() >= v - 20  # inside the top 20
    counts = np.bincount(ids - (v - 20), minlength=20)
    assert (counts > 0).sum() >= 15  # 256 draws over 20 near-equal tokens
    assert counts.max() < 40
    np.testing.assert_array_equal(ids, sample_ref(logits, prm)[0])


def test_sampling_params_errors() -> None:
    p = D.sampling_params([0.0, 0.5], top_k=3, top_p=0.9, seed=[1, 2**32 + 5], step=7)
    assert p.shape == (2, 8) and p.dtype == np.uint32 and p[1, 3] == 5 and p[0, 1] == 3
    with pytest.raises(ValueError, match=r"sampling_params: top_p must be in \(0, 1\]"):
        D.sampling_params(1.0, top_p=0.0)
    with pytest.raises(ValueError, match="sampling_params: temperature must be a scalar or a sequence of 3"):
        D.sampling_params([1.0, 1.0], top_k=[1, 2, 3])
    assert p[1, 0] == np.float32(0.5).view(np.uint32) and p[0, 2] == np.float32(0.9).view(np.uint32)
    assert p[0, 4] == p[1, 4] == 7 and not p[:, 5:].any()
    for bad, msg in [(dict(temperature=-1.0), r"temperature must be finite and >= 0, got \[-1.0\]"),
                     (dict(temperature=0.0, top_p=float("nan")), r"top_p must be finite and >= 0"),
                     (dict(temperature=0.0, top_k=[1, -2]), r"top_k must be >= 0, got \[1, -2\]")]:
        with pytest.raises(ValueError, match=msg):
            D.sampling_params(**bad)


# -- a decoder layer composed of the ops ------------------------------------------------------------
class Spy:
    """A GPUContext stand-in that counts the dispatches recorded through it."""

    def __init__(self, gpu: hetero.GPUContext) -> None:
        self._gpu = gpu
        self.labels: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._gpu, name)

    def dispatch(self, kernel: Any, workgroups: Any, *bindings: Any) -> Any:
        self.labels.append(kernel.label)
        return self._gpu.dispatch(kernel, workgroups, *bindings)


def layer_ref(x: np.ndarray, p: dict[str, np.ndarray], cache: list[tuple[int, int, np.ndarray, np.ndarray]],
              rows: list[tuple[int, int]], hq: int, hkv: int, f: np.ndarray) -> np.ndarray:
    """One Llama / Qwen2 block in float64; appends each row's (seq, pos, k, v) to ``cache``."""
    d = x.shape[1] // hq

    def norm(v: np.ndarray, g: np.ndarray) -> np.ndarray:
        return v / np.sqrt((v ** 2).mean(-1, keepdims=True) + 1e-5) * g

    x = x.astype(np.float64)
    hn = norm(x, p["g1"])
    q = (hn @ p["wq"].T + p["bq"]).reshape(len(rows), hq, d)
    k = (hn @ p["wk"].T + p["bk"]).reshape(len(rows), hkv, d)
    v = (hn @ p["wv"].T + p["bv"]).reshape(len(rows), hkv, d)
    pos = np.array([r[1] for r in rows], np.int32)
    q, k = rope_ref(q, pos, f), rope_ref(k, pos, f)
    cache += [(s, ps, k[i], v[i]) for i, (s, ps) in enumerate(rows)]
    att = np.zeros_like(q)
    for i, (s, ps) in enumerate(rows):
        keys = [(kk, vv) for s2, p2, kk, vv in cache if s2 == s and p2 <= ps]
        kk, vv = np.stack([a for a, _ in keys]), np.stack([b for _, b in keys])
        for h in range(hq):
            sc = kk[:, h // (hq // hkv)] @ q[i, h] / math.sqrt(d)
            e = np.exp(sc - sc.max())
            att[i, h] = (e / e.sum()) @ vv[:, h // (hq // hkv)]
    h1 = x + att.reshape(len(rows), -1) @ p["wo"].T
    h2 = norm(h1, p["g2"])
    a, b = h2 @ p["wg"].T, h2 @ p["wu"].T
    return h1 + (a / (1.0 + np.exp(-a)) * b) @ p["wd"].T


@ASYNCIO_ONLY
@pytest.mark.parametrize("kind", ["q4_1", "f16"])
async def test_decoder_layer_prefill_then_decode_in_six_dispatches(shared_rt: hetero.Runtime, kind: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A Qwen2-style block (Q/K/V biases), GQA 2:1, out of the fused ops: prefill of two sequences
    (13 rows: the tiled kernels), then one decode step for both (the GEMV kernels), against numpy on
    the same dequantized weights. Six dispatches a layer: QKV (RMSNorm folded, biases), RoPE + KV
    write, attention, output projection + residual, gate/up + SwiGLU (RMSNorm folded), down + residual."""
    monkeypatch.setattr(D, "TILED_MIN_GROUPS", 1)  # no split K: one dispatch a product
    hdim, hq, hkv, ffn, bs = 64, 4, 2, 96, 4
    d = hdim // hq
    shapes = {"wq": (hq * d, hdim), "wk": (hkv * d, hdim), "wv": (hkv * d, hdim), "wo": (hdim, hq * d),
              "wg": (ffn, hdim), "wu": (ffn, hdim), "wd": (hdim, ffn)}
    packed = {n: make_weight(kind, rand(s, i, scale=0.3)) for i, (n, s) in enumerate(shapes.items())}
    ref_p = {n: unpack(w).astype(np.float64) for n, w in packed.items()}
    for n, s in (("bq", hq * d), ("bk", hkv * d), ("bv", hkv * d)):
        ref_p[n] = rand((s,), hash(n) % 1000, scale=0.1).astype(np.float64)
    ref_p["g1"], ref_p["g2"] = rand((hdim,), 50) * 0.2 + 1.0, rand((hdim,), 51) * 0.2 + 1.0
    qkv_w = concat_rows([packed["wq"], packed["wk"], packed["wv"]])
    qkv_b = np.concatenate([ref_p["bq"], ref_p["bk"], ref_p["bv"]]).astype(np.float32)
    f = inv_freq(d, 10000.0)
    bt = np.array([[0, 3, 5, 0], [1, 2, 4, 0]], np.int32)  # 7 + 1 and 6 + 1 tokens in blocks of 4
    pre = [(0, p) for p in range(7)] + [(1, p) for p in range(6)]
    dec = [(0, 7), (1, 6)]

    def feed(rows: list[tuple[int, int]]) -> tuple[np.ndarray, ...]:
        seq = np.array([s for s, _ in rows], np.int32)
        pos = np.array([p for _, p in rows], np.int32)
        slots = np.array([bt[s, p // bs] * bs + p % bs for s, p in rows], np.int32)
        return seq, pos, slots

    x_pre, x_dec = rand((len(pre), hdim), 60), rand((len(dec), hdim), 61)
    counts: list[int] = []

    def stage(gpu: Any, x_pre: Any, x_dec: Any, g1: Any, g2: Any, qkv_b: Any, f: Any, bt: Any) -> Any:
        spy = Spy(gpu)
        w = {n: D.upload_weight(gpu, pw) for n, pw in packed.items()}
        wqkv = D.upload_weight(gpu, qkv_w)
        kc, vc = D.kv_cache(gpu, 6, bs, hkv, d)
        outs = []
        for x, rows in ((x_pre, pre), (x_dec, dec)):
            seq, pos, slots = (gpu.upload(a) for a in feed(rows))
            before = len(spy.labels)
            qkv = D.linear(spy, x, wqkv, bias=qkv_b, norm=g1, eps=1e-5)
            q = D.rope_kv(spy, qkv, pos, f, kc, vc, slots, heads=hq)
            att = D.paged_attention(spy, q, kc, vc, bt, seq, pos)
            h1 = D.linear(spy, att, w["wo"], residual=x)
            mlp = D.linear_swiglu(spy, h1, w["wg"], w["wu"], norm=g2, eps=1e-5)
            outs.append(D.linear(spy, mlp, w["wd"], residual=h1))
            counts.append(len(spy.labels) - before)
        return tuple(outs)

    got_pre, got_dec = await call(shared_rt, stage, x_pre=x_pre, x_dec=x_dec, g1=ref_p["g1"].astype(np.float32),
                                  g2=ref_p["g2"].astype(np.float32), qkv_b=qkv_b, f=f, bt=bt)
    assert counts == [6, 6]
    cache: list[tuple[int, int, np.ndarray, np.ndarray]] = []
    want_pre = layer_ref(x_pre, ref_p, cache, pre, hq, hkv, f)
    want_dec = layer_ref(x_dec, ref_p, cache, dec, hq, hkv, f)
    # float32 rounding through six products: relative to each row's largest value
    close(f"layer prefill {kind}", got_pre, want_pre, np.abs(want_pre).max(-1, keepdims=True), rtol=2e-5)
    close(f"layer decode {kind}", got_dec, want_dec, np.abs(want_dec).max(-1, keepdims=True), rtol=2e-5)
