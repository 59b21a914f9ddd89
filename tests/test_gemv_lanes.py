"""The lanes GEMV (``hetero.kernels.decoder.linear`` for M <= GEMV_MAX_M) against numpy, on tiny shapes.

Each weight kind, M = 1, 3 and 8, the epilogues (folded RMSNorm, bias, residual) and the fused
gate/up SwiGLU, with the partial sums meeting by subgroup shuffles (where the adapter has
subgroups) and through workgroup memory (forced by ``USE_SUBGROUPS = False``); the layout
knobs (lanes a row, rows a slot, unroll, threads) at their edges; the earlier ``units`` kernel,
kept for comparison, still right; which kernel each M takes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import hetero
import hetero.kernels.decoder as D
from hetero.kernels.quant import unpack

from tests.test_decoder_kernels import ASYNCIO_ONLY, Spy, call, close, linear_ref, make_weight, rand, subgroup_modes

pytestmark = pytest.mark.anyio


def swiglu_ref(x: np.ndarray, wg: np.ndarray, wu: np.ndarray, g: Any) -> tuple[np.ndarray, np.ndarray]:
    a, sa = linear_ref(x, wg, norm=g)
    b, sb = linear_ref(x, wu, norm=g)
    sig = 1.0 / (1.0 + np.exp(-a))
    return a * sig * b, sa * np.abs(b) + sb * np.abs(a * sig)


@ASYNCIO_ONLY
@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "f16"])
async def test_lanes_gemv_every_m_both_reductions(shared_rt: hetero.Runtime, kind: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """K = 256 (8 blocks, 32 f16 chunks), N = 37 (no multiple of a workgroup's rows); M = 1 with the
    RMSNorm folded in and a bias (QKV), M = 3 with a residual (output projection), M = 8 with the
    norm (the MLP's input). The workgroup-memory reduction runs with 8 lanes a row (a tree of
    three steps), the subgroup one with as many as the smallest subgroup holds."""
    k, n = 256, 37
    pw = make_weight(kind, rand((n, k), 1, scale=0.5))
    dq = unpack(pw)
    g = rand((k,), 2) + 1.0
    bias = rand((n,), 3)
    for sg in subgroup_modes(shared_rt):
        monkeypatch.setattr(D, "USE_SUBGROUPS", sg)
        monkeypatch.setattr(D, "GEMV_LANES", 0 if sg else 8)
        for m, use_norm, use_bias, use_res in [(1, True, True, False), (3, False, False, True),
                                               (8, True, False, False)]:
            x = rand((m, k), 10 + m, scale=2.0)
            res = rand((m, n), 20 + m)
            inputs: dict[str, Any] = {"x": x, "g": g, "b": bias, "r": res}
            spy: list[Spy] = []

            def stage(gpu: Any, x: Any, g: Any, b: Any, r: Any) -> Any:
                spy.append(Spy(gpu))
                return D.linear(spy[-1], x, D.upload_weight(gpu, pw), bias=b if use_bias else None,
                                residual=r if use_res else None, norm=g if use_norm else None, eps=1e-5)
            got = await call(shared_rt, stage, **inputs)
            assert len(spy[0].labels) == 1 and spy[0].labels[0].startswith(f"decoder.linear.lanes.{kind}.m{m}.")
            assert spy[0].labels[0].endswith(".sg") == sg
            want, scale = linear_ref(x, dq, bias if use_bias else None, res if use_res else None,
                                     norm=g if use_norm else None, eps=1e-5)
            close(f"lanes {kind} M={m} subgroups={sg}", got, want, scale)


@ASYNCIO_ONLY
@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "f16"])
async def test_lanes_gemv_swiglu(shared_rt: hetero.Runtime, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gate and up in one dispatch, SiLU-mul in the epilogue, the RMSNorm folded in; M = 1, 3, 8."""
    k, f = 128, 24
    wg, wu = make_weight(kind, rand((f, k), 30, scale=0.5)), make_weight(kind, rand((f, k), 31, scale=0.5))
    g = rand((k,), 32) + 1.0
    for sg in subgroup_modes(shared_rt):
        monkeypatch.setattr(D, "USE_SUBGROUPS", sg)
        monkeypatch.setattr(D, "GEMV_LANES", 0 if sg else 4)
        for m in (1, 3, 8):
            x = rand((m, k), 40 + m)
            got = await call(shared_rt, lambda gpu, x, g: D.linear_swiglu(gpu, x, wg, wu, norm=g), x=x, g=g)
            want, scale = swiglu_ref(x, unpack(wg), unpack(wu), g)
            close(f"lanes swiglu {kind} M={m} subgroups={sg}", got, want, scale)


@ASYNCIO_ONLY
@pytest.mark.parametrize("kind", ["q4_0", "f32"])
async def test_lanes_gemv_other_kinds(shared_rt: hetero.Runtime, kind: str) -> None:
    """Q4_0 (``d * (sum(q x) - 8 sum(x))``) and f32, at K = 37 for f32 (a ragged last chunk of x)."""
    k = 64 if kind == "q4_0" else 37
    pw = make_weight(kind, rand((19, k), 50))
    for m in (1, 3):
        x = rand((m, k), 51 + m)
        got = await call(shared_rt, lambda gpu, x: D.linear(gpu, x, pw), x=x)
        want, scale = linear_ref(x, unpack(pw))
        close(f"lanes {kind} M={m}", got, want, scale)


@ASYNCIO_ONLY
@pytest.mark.parametrize("sg", [True, False])
async def test_lanes_gemv_layouts(shared_rt: hetero.Runtime, sg: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The layout knobs at their edges, M = 1, Q4_1 with the norm and a residual: more lanes than a row has
    chunks (idle lanes), one lane a row (no reduction), unrolls of 1 and 3 (a tail chunk counted for
    nothing), two and four rows a slot (N = 45 leaves a slot half full), 32 and 128 threads."""
    if sg and "subgroup" not in hetero.lowlevel.device_of(shared_rt).features:
        pytest.skip("the adapter has no subgroups")
    monkeypatch.setattr(D, "USE_SUBGROUPS", sg)
    k, n = 160, 45  # 5 blocks a row
    pw = make_weight("q4_1", rand((n, k), 60))
    g, x, res = rand((k,), 61) + 1.0, rand((1, k), 62), rand((1, n), 63)
    want, scale = linear_ref(x, unpack(pw), None, res, norm=g)
    for lanes, unroll, rows, threads in [(16, 2, 1, 64), (1, 1, 1, 64), (2, 3, 2, 32), (4, 1, 4, 128)]:
        for name, v in (("GEMV_LANES", lanes), ("GEMV_UNROLL", unroll), ("GEMV_SLOT_ROWS", rows),
                        ("GEMV_LANES_THREADS", threads)):
            monkeypatch.setattr(D, name, v)
        got = await call(shared_rt, lambda gpu, x, g, r: D.linear(gpu, x, pw, residual=r, norm=g), x=x, g=g, r=res)
        close(f"lanes layout lanes={lanes} unroll={unroll} rows={rows} threads={threads} subgroups={sg}",
              got, want, scale)


def test_lanes_shape_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lanes a row: about GEMV_LANE_CHUNKS chunks a lane, a power of two, capped by the subgroup size (or
    GEMV_MAX_LANES without subgroups) and the workgroup."""
    assert D._lanes_shape(18, 32) == (16, 64, 1)  # SmolLM2's K = 576 in Q4_1: 18 blocks
    assert D._lanes_shape(64, 32) == (32, 64, 1)
    assert D._lanes_shape(64, 4) == (4, 64, 1)  # lanes stay within the smallest subgroup
    assert D._lanes_shape(1000, 0) == (32, 64, 1)
    assert D._lanes_shape(2, 32) == (1, 64, 1)
    monkeypatch.setattr(D, "GEMV_LANES_THREADS", 16)
    assert D._lanes_shape(1000, 0) == (16, 16, 1)
    monkeypatch.setattr(D, "GEMV_LANES_THREADS", 48)
    with pytest.raises(ValueError, match="GEMV_LANES_THREADS must be a power of two, got 48"):
        D._lanes_shape(8, 0)


@ASYNCIO_ONLY
async def test_which_kernel_each_m_takes(shared_rt: hetero.Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    """M <= 8: one lanes dispatch; M = 9 on path "gemv": two (8 rows, then 1); M = 9 (auto): the tiled kernel;
    GEMV_IMPL = "units": the other GEMV, still right; "auto" takes it from GEMV_UNITS_MIN_K weights a row,
    but for GEMV_LANES_MIN_N rows or more only from GEMV_UNITS_WIDE_MIN_K and for no kind in
    GEMV_LANES_WIDE_KINDS; an unknown GEMV_IMPL is refused."""
    k, n = 64, 20
    pw = make_weight("q8_0", rand((n, k), 70))
    seen: list[list[str]] = []
    path = "auto"

    def stage(gpu: Any, x: Any) -> Any:
        spy = Spy(gpu)
        y = D.linear(spy, x, pw, path=path)
        seen.append(spy.labels)
        return y
    for m, path in [(1, "auto"), (8, "auto"), (9, "gemv"), (9, "auto")]:
        x = rand((m, k), 71 + m)
        got = await call(shared_rt, stage, x=x)
        close(f"linear M={m}", got, *linear_ref(x, unpack(pw)))
    assert [[lb.split(".")[2] for lb in labels] for labels in seen] == [["lanes"], ["lanes"], ["lanes", "lanes"],
                                                                         ["tiled"]]
    assert ".m8." in seen[2][0] and ".m1." in seen[2][1]
    monkeypatch.setattr(D, "GEMV_IMPL", "units")
    seen.clear()
    path = "auto"
    for m in (1, 3):
        x = rand((m, k), 80 + m)
        got = await call(shared_rt, stage, x=x)
        close(f"units GEMV M={m}", got, *linear_ref(x, unpack(pw)))
    assert [labels[0].split(".")[2] for labels in seen] == ["gemv", "gemv"]
    monkeypatch.setattr(D, "GEMV_IMPL", "auto")  # by K: rows of GEMV_UNITS_MIN_K weights or more take units
    seen.clear()
    for threshold in (k + 8, k):
        monkeypatch.setattr(D, "GEMV_UNITS_MIN_K", threshold)
        x = rand((1, k), 85)
        close(f"auto GEMV, units from K={threshold}", await call(shared_rt, stage, x=x), *linear_ref(x, unpack(pw)))
    assert [labels[0].split(".")[2] for labels in seen] == ["lanes", "gemv"]
    # wide products of a kind in GEMV_LANES_WIDE_KINDS (an output head) stay on lanes whatever their K
    seen.clear()
    monkeypatch.setattr(D, "GEMV_LANES_MIN_N", n)
    x = rand((1, k), 86)
    close("auto GEMV, a wide Q8_0 product", await call(shared_rt, stage, x=x), *linear_ref(x, unpack(pw)))
    monkeypatch.setattr(D, "GEMV_LANES_WIDE_KINDS", ("q4_1",))
    monkeypatch.setattr(D, "GEMV_UNITS_WIDE_MIN_K", k)
    close("auto GEMV, wide but not of those kinds", await call(shared_rt, stage, x=x), *linear_ref(x, unpack(pw)))
    monkeypatch.setattr(D, "GEMV_UNITS_WIDE_MIN_K", k + 8)
    close("auto GEMV, wide, rows too short for units", await call(shared_rt, stage, x=x), *linear_ref(x, unpack(pw)))
    monkeypatch.setattr(D, "GEMV_LANES_MIN_N", n + 1)
    monkeypatch.setattr(D, "GEMV_LANES_WIDE_KINDS", ("q8_0",))
    close("auto GEMV, one row short of wide", await call(shared_rt, stage, x=x), *linear_ref(x, unpack(pw)))
    assert [labels[0].split(".")[2] for labels in seen] == ["lanes", "gemv", "lanes", "gemv"]
    monkeypatch.setattr(D, "GEMV_IMPL", "fast")
    with pytest.raises(hetero.StageError, match="GEMV_IMPL must be 'auto', 'lanes' or 'units', got 'fast'"):
        await call(shared_rt, stage, x=rand((1, k), 90))


async def fused_against_unfused(rt: hetero.Runtime, w: Any, x: np.ndarray, g: np.ndarray, bias: np.ndarray,
                                pos: np.ndarray, f: np.ndarray, slots: np.ndarray, dims: tuple[int, int, int, int, int],
                                cache: str, what: str) -> tuple[list[str], list[str]]:
    """linear_rope_kv against linear then rope_kv on the same inputs (RMSNorm and biases folded in):
    q and both caches whole compared (f16 caches to one f16 rounding); each run's dispatch labels.
    ``dims``: (heads, kv_heads, head_dim, cache blocks, block size)."""
    hq, hkv, d, nb, bs = dims
    labels: list[list[str]] = []

    def stage(gpu: Any, x: Any, g: Any, b: Any, pos: Any, f: Any, slots: Any) -> Any:
        wt = D.upload_weight(gpu, w)
        outs = []
        for fused in (True, False):
            kc, vc = D.kv_cache(gpu, nb, bs, hkv, d, dtype=cache)
            spy = Spy(gpu)
            if fused:
                q = D.linear_rope_kv(spy, x, wt, pos, f, kc, vc, slots, heads=hq, bias=b, norm=g, eps=1e-5)
            else:
                q = D.rope_kv(spy, D.linear(spy, x, wt, bias=b, norm=g, eps=1e-5), pos, f, kc, vc, slots, heads=hq)
            labels.append(spy.labels)
            outs += [q, kc, vc]
        return tuple(outs)
    got = await call(rt, stage, x=x, g=g, b=bias, pos=pos, f=f, slots=slots)
    for name, a, b in zip(("q", "k_cache", "v_cache"), got[:3], got[3:]):
        a, b = np.asarray(a), np.asarray(b)
        rtol = 1e-5
        if cache == "f16" and name != "q":
            a, b = a.view(np.float16).astype(np.float32), b.view(np.float16).astype(np.float32)
            rtol = 1e-3  # the two paths may round one f16 apart
        assert np.abs(b).max() > 0, f"{what} {name}"
        close(f"{what} {name}", a, b.astype(np.float64), np.abs(b).max(), rtol=rtol)
    return labels[0], labels[1]


@ASYNCIO_ONLY
@pytest.mark.parametrize("impl", ["lanes", "units"])
@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "f16"])
async def test_linear_rope_kv_is_linear_then_rope_kv(shared_rt: hetero.Runtime, kind: str, impl: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused QKV + RoPE + KV write (one dispatch at M <= 8, on either GEMV kernel) against linear then
    rope_kv (two), which the tests of test_decoder_kernels.py hold to numpy: q, and both caches whole, f32
    and f16 caches, M = 1, 3 (8 for f16 weights; rows at scattered positions and slots), the RMSNorm and
    Q/K/V biases folded in, both reductions; M = 9 takes the two ops."""
    from tests.test_decoder_kernels import inv_freq

    monkeypatch.setattr(D, "GEMV_IMPL", impl)

    hq, hkv, d, hidden, nb, bs = 4, 2, 16, 64, 6, 4
    w = make_weight(kind, rand(((hq + 2 * hkv) * d, hidden), 100, scale=0.3))
    g = rand((hidden,), 101) + 1.0
    bias = rand(((hq + 2 * hkv) * d,), 102)
    f = inv_freq(d, 10000.0)
    for sg in subgroup_modes(shared_rt):
        monkeypatch.setattr(D, "USE_SUBGROUPS", sg)
        # M = 8 with the float kind only: quantized variants of 8 rows x 4 a slot compile slowly on lavapipe
        for m, cache in [(1, "f32"), (3, "f16"), (9, "f32")] + ([(8, "f32")] if kind == "f16" else []):
            x = rand((m, hidden), 110 + m)
            pos = np.random.default_rng(m).integers(0, 50, m).astype(np.int32)
            slots = np.random.default_rng(m + 1).permutation(nb * bs)[:m].astype(np.int32)
            fused_labels, _ = await fused_against_unfused(
                shared_rt, w, x, g, bias, pos, f, slots, (hq, hkv, d, nb, bs), cache,
                f"linear_rope_kv {kind} M={m} {cache} subgroups={sg}")
            if m <= 8:
                kernel = "lanes" if impl == "lanes" else "gemv"
                assert len(fused_labels) == 1 and fused_labels[0].startswith(f"decoder.linear_rope_kv.{kernel}.{kind}.m{m}.")
            else:
                assert [lb.split(".")[1] for lb in fused_labels] == ["linear", "rope_kv"]




@ASYNCIO_ONLY
@pytest.mark.parametrize("kind,tiled", [("q4_1", "dp4a"), ("q8_0", "blocked"), ("f16", "blocked")])
async def test_linear_rope_kv_in_the_split_k_epilogue(shared_rt: hetero.Runtime, kind: str, tiled: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Past GEMV_MAX_M rows with K split, the fused op's epilogue adds the splits and does RoPE and the KV
    write (one dispatch instead of the epilogue and rope_kv): against linear then rope_kv, f32 and f16
    caches, the RMSNorm and biases folded in, M = 9 and 40 (a 32- and a 64-row tile)."""
    from tests.test_decoder_kernels import inv_freq

    monkeypatch.setattr(D, "TILED_IMPL", tiled)
    monkeypatch.setattr(D, "TILED_SPLIT_MIN_CHUNKS", 1)  # K of 64: two splits
    hq, hkv, d, hidden, nb, bs = 4, 2, 16, 64, 12, 4
    w = make_weight(kind, rand(((hq + 2 * hkv) * d, hidden), 120, scale=0.3))
    g = rand((hidden,), 121) + 1.0
    bias = rand(((hq + 2 * hkv) * d,), 122)
    f = inv_freq(d, 10000.0)
    for m, cache in [(9, "f32"), (40, "f16")]:
        x = rand((m, hidden), 130 + m)
        pos = np.random.default_rng(m).integers(0, 50, m).astype(np.int32)
        slots = np.random.default_rng(m + 1).permutation(nb * bs)[:m].astype(np.int32)
        fused, unfused = await fused_against_unfused(shared_rt, w, x, g, bias, pos, f, slots, (hq, hkv, d, nb, bs),
                                                     cache, f"split-K rope {kind} {tiled} M={m} {cache}")
        assert fused[-1].startswith("decoder.linear.epilogue.rope") and fused[-1].endswith(f".{cache}")
        assert not any("rope_kv" in lb for lb in fused) and len(fused) == len(unfused) - 1
        assert any(".splitk" in lb for lb in fused) and unfused[-1].startswith("decoder.rope_kv")


@ASYNCIO_ONLY
@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "f16"])
async def test_units_gemv_unrolled(shared_rt: hetero.Runtime, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """GEMV_UNITS_UNROLL 2 and 3: the units GEMV loads a few units a thread before it multiplies them
    (rows past N clamped), then walks the rest one at a time. Against numpy: M = 1, 3, 8; K of 328
    units (five unrolled steps of 64 and a partial one for some threads); N = 22 (the last
    workgroup's rows past N); the RMSNorm, bias and residual folded in, and SwiGLU; and the fused
    QKV + RoPE + KV write against the loop as before (GEMV_UNITS_UNROLL 1)."""
    from tests.test_decoder_kernels import inv_freq

    monkeypatch.setattr(D, "GEMV_IMPL", "units")
    k, n = 328 * 8, 22
    wa, wb = make_weight(kind, rand((n, k), 140)), make_weight(kind, rand((n, k), 141))
    g, bias = rand((k,), 142) + 1.0, rand((n,), 143)
    seen: list[str] = []

    def stage(gpu: Any, x: Any, g: Any, b: Any, r: Any) -> Any:
        spy = Spy(gpu)
        out = (D.linear(spy, x, wa, bias=b, residual=r, norm=g, eps=1e-5), D.linear_swiglu(spy, x, wa, wb, norm=g,
                                                                                        eps=1e-5))
        seen.extend(spy.labels)
        return out
    for unroll in (2, 3):
        monkeypatch.setattr(D, "GEMV_UNITS_UNROLL", unroll)
        for m in (1, 3, 8):
            x, res = rand((m, k), 150 + m), rand((m, n), 151 + m)
            y, z = await call(shared_rt, stage, x=x, g=g, b=bias, r=res)
            close(f"units u{unroll} {kind} M={m}", y, *linear_ref(x, unpack(wa), bias, res, norm=g, eps=1e-5))
            a, sa = linear_ref(x, unpack(wa), norm=g, eps=1e-5)
            b2, sb = linear_ref(x, unpack(wb), norm=g, eps=1e-5)
            sig = 1.0 / (1.0 + np.exp(-a))
            close(f"units u{unroll} swiglu {kind} M={m}", z, a * sig * b2, sa * np.abs(b2) + sb * np.abs(a * sig))
    assert all(f".u{u}." in lb for lb, u in zip(seen, [2] * 6 + [3] * 6))

    hq, hkv, d, nb, bs = 4, 2, 16, 6, 4
    wq = make_weight(kind, rand(((hq + 2 * hkv) * d, k), 160, scale=0.3))
    f = inv_freq(d, 10000.0)
    x = rand((3, k), 161)
    pos, slots = np.array([3, 17, 40], np.int32), np.array([5, 0, 22], np.int32)

    def rope_stage(gpu: Any, x: Any, g: Any, pos: Any, f: Any, slots: Any) -> Any:
        kc, vc = D.kv_cache(gpu, nb, bs, hkv, d)
        return D.linear_rope_kv(gpu, x, wq, pos, f, kc, vc, slots, heads=hq, norm=g, eps=1e-5), kc, vc
    outs = []
    for unroll in (1, 2):
        monkeypatch.setattr(D, "GEMV_UNITS_UNROLL", unroll)
        outs.append([np.asarray(t) for t in await call(shared_rt, rope_stage, x=x, g=g, pos=pos, f=f, slots=slots)])
    for name, a, b in zip(("q", "k_cache", "v_cache"), *outs):
        close(f"linear_rope_kv units u2 {kind} {name}", b, a.astype(np.float64), np.abs(a).max(), rtol=1e-5)
