"""WGSL of the decoder's GEMMs: ``linear`` for many rows (prefill, many streams).

Two kernels: the register-blocked float one (:func:`linear_blocked`, the default), whose rules
follow, and the dp4a one for integer weight blocks (:func:`quantize_rows` then
:func:`linear_dp4a`, ``TILED_IMPL = "dp4a"``), whose rules head its section below.

``y[M, N] = x[M, K] @ W.T`` over the decoder's weight layouts (:mod:`hetero.kernels.quant`:
f32, f16, Q8_0, Q4_0, Q4_1), with the epilogues of :func:`~hetero.kernels.decoder_wgsl.linear_tiled`
(the folded RMSNorm, bias, residual, SwiGLU of two weights; split K into partial sums for
:func:`~hetero.kernels.decoder_wgsl.linear_epilogue`).

The rules of the kernel (:class:`Blocking` names its shape):

* A workgroup computes a ``bm x bn`` tile of y with ``(bm / tm) x (bn / tn)`` threads; a
  thread a ``tm x tn`` block held in vec4 accumulators (named variables, unrolled here).
  Thread ``(tx, ty)``'s rows are ``m0 + g*4*TY + 4*ty + i`` and its columns
  ``n0 + h*4*TX + 4*tx + j`` (``TY = bm / tm``, ``TX = bn / tn``), so each of its reads of
  workgroup memory is one vec4 shared by four outputs.
* K is walked in slices of :data:`SLICE_UNITS` units (8 weights each). A weight unit's 8
  values multiply the activations at ``xoff(u)`` (two runs of four; Q4's nibbles split a
  block in halves), so a slice's k order is the units' order, the same for x and W: slot
  ``8j + c`` of a slice holds unit ``j``'s low run (c < 4) or high run. A dot product
  does not depend on the order its terms are added in beyond float rounding.
* Each slice, the workgroup stores x's tile transposed (``As[k][m]``) and dequantizes W's
  tile (scaled by the RMSNorm weight g with ``norm``: x (g w) = (x g) w) transposed
  (``Bs[k][n]``), once; every thread then reads ``tm / 4 + tn / 4`` vec4 a k for
  ``tm * tn`` multiply-adds (per weight).
* ``norm``: each thread also sums the squares of its rows of x as it reads them; the row's
  RMS scale is applied in the store (or by the epilogue pass, from ``pss``, with split K).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

from hetero.kernels import decoder_wgsl as W

__all__ = ["DP4A_KINDS", "SLICE_UNITS", "THREAD_BLOCK", "Blocking", "blocking", "dp4a_blocking", "linear_blocked",
           "linear_dp4a", "quantize_rows"]

SLICE_UNITS = 2
"""Weight units (8 weights) of K a slice of the blocked kernel takes: 16 k, so that a 64 x 64
tile's two slices of workgroup memory (x and one weight) are 8 KiB, within WebGPU's default 16 KiB."""

DP4A_KINDS = ("q8_0", "q4_0", "q4_1")
"""The weight kinds the dp4a GEMM reads (integer blocks of 32); others take the blocked kernel."""
THREAD_BLOCK = 8
"""Outputs a thread computes along a 64-wide side of the tile (8: 64 threads a 64 x 64 tile; 4: 256)."""

_XYZW = "xyzw"


@dataclass(frozen=True)
class Blocking:
    """A tile of ``bm x bn`` outputs, ``tm x tn`` a thread (multiples of 4)."""

    bm: int
    bn: int
    tm: int
    tn: int

    @property
    def threads(self) -> int:
        return (self.bm // self.tm) * (self.bn // self.tn)


def blocking(m: int, swiglu: bool) -> Blocking:
    """The tile for ``m`` rows: 64 rows (32 for m <= 32, a few dozen streams), 64 columns
    (32 for SwiGLU's two weights: the accumulators of both fit in a thread's registers);
    8 x 8 outputs a thread (8 x 4 with SwiGLU, 4 rows a thread at 32 rows): 64 threads."""
    bm, tm = (32, 4) if m <= 32 else (64, THREAD_BLOCK)
    bn, tn = (32, 4) if swiglu else (64, THREAD_BLOCK)
    return Blocking(bm, bn, tm, tn)


def _store_lines(add: Callable[[str], None], shape: Blocking, nw: int, swiglu: bool, partial: bool, norm: bool,
                 m0: str, n0: str) -> None:
    """The store of a thread's ``tm x tn`` block from accumulators ``c{w}_{r}_{h}`` (vec4 of columns
    ``h``): rows ``m0 + g*4*TY + 4*ty + i`` past ``p.m`` and columns past ``p.n`` skipped; to ``part``
    (and the rows' sums of squares ``ss{g}`` to ``pss``) with ``partial``, else through ``store`` with
    the row's RMS scale (``norm``) or 1."""
    ty_n, tx_n = shape.bm // shape.tm, shape.bn // shape.tn
    for g in range(shape.tm // 4):
        for i in range(4):
            r = g * 4 + i
            add(f"    let row{r} = {m0} + {g * 4 * ty_n + i}u + ty * 4u;")
            add(f"    if (row{r} < p.m) {{")
            ss = f"ss{g}.{_XYZW[i]}"
            if partial:
                if norm:
                    add(f"        if (tx == 0u) {{ pss[tile.z * p.m + row{r}] = {ss}; }}")
            else:
                scale = f"inverseSqrt({ss} / f32(p.k) + p.eps)" if norm else "1.0"
                add(f"        let sc{r} = {scale};")
            for h in range(shape.tn // 4):
                add(f"        let col{r}_{h} = {n0} + {h * 4 * tx_n}u + tx * 4u;")
                for j in range(4):
                    col = f"col{r}_{h} + {j}u"
                    add(f"        if ({col} < p.n) {{")
                    if partial:
                        for w in range(nw):
                            add(f"            part[((tile.z * {nw}u + {w}u) * p.m + row{r}) * p.n + {col}]"
                                f" = c{w}_{r}_{h}.{_XYZW[j]};")
                    else:
                        a1 = f"c1_{r}_{h}.{_XYZW[j]}" if swiglu else "0.0"
                        add(f"            store(row{r}, {col}, c0_{r}_{h}.{_XYZW[j]}, {a1}, sc{r});")
                    add("        }")
            add("    }")


@lru_cache(maxsize=None)
def linear_blocked(kind: str, vec: bool, swiglu: bool, norm: bool, bias: bool, residual: bool, partial: bool,
                   shape: Blocking) -> str:
    """The kernel's WGSL (see the module's rules); bindings and params as
    :func:`~hetero.kernels.decoder_wgsl.linear_tiled`'s, its grid ``(ceil(N / bn), ceil(M / bm), splits)``."""
    bm, bn, tm, tn = shape.bm, shape.bn, shape.tm, shape.tn
    if min(bm, bn, tm, tn) < 4 or any(v % 4 for v in (bm, bn, tm, tn)) or bm % tm or bn % tn:
        raise ValueError(f"linear_blocked: a tile of {bm} x {bn}, {tm} x {tn} a thread: all must be multiples "
                         "of 4, and the tile of the thread's block")
    nw = 2 if swiglu else 1
    ty_n, tx_n = bm // tm, bn // tn
    threads = ty_n * tx_n
    gm, gn = tm // 4, tn // 4
    bk = SLICE_UNITS * 8
    L: list[str] = []
    add = L.append
    add("    let tile = hetero_workgroup_id(wid);")
    add(f"    let m0 = tile.y * {bm}u;")
    add(f"    let n0 = tile.x * {bn}u;")
    add(f"    let tx = li % {tx_n}u;")
    add(f"    let ty = li / {tx_n}u;")
    for w in range(nw):
        for r in range(tm):
            for h in range(gn):
                add(f"    var c{w}_{r}_{h} = vec4<f32>(0.0);")
    if norm:
        for g in range(gm):
            add(f"    var ss{g} = vec4<f32>(0.0);")
    add("    let kb0 = tile.z * p.ks;")
    add("    let kb1 = min(p.units, kb0 + p.ks);")
    add(f"    for (var kb = kb0; kb < kb1; kb += {SLICE_UNITS}u) {{")
    # x: bm rows x SLICE_UNITS units x (lo, hi) runs of 4; consecutive threads take consecutive rows
    add(f"        for (var e = li; e < {bm * SLICE_UNITS * 2}u; e += {threads}u) {{")
    add(f"            let rr = e % {bm}u;")
    add(f"            let part = e / {bm}u;")
    add("            let uu = kb + part / 2u;")
    add("            let mm = m0 + rr;")
    add("            var v = vec4<f32>(0.0);")
    add("            if (mm < p.m && uu < p.units) {")
    add("                let o = xoff(uu);")
    add("                v = xv(mm, select(o.x, o.y, part % 2u == 1u));")
    add("            }")
    add(f"            let at = (part / 2u) * 8u + (part % 2u) * 4u;")
    for c in range(4):
        add(f"            As[(at + {c}u) * {bm // 4}u + rr / 4u][rr % 4u] = v.{_XYZW[c]};")
    add("        }")
    # weights: bn rows x SLICE_UNITS units, dequantized; a row's units go to consecutive threads
    add(f"        for (var e = li; e < {bn * SLICE_UNITS}u; e += {threads}u) {{")
    add(f"            let j = e % {SLICE_UNITS}u;")
    add(f"            let rr = e / {SLICE_UNITS}u;")
    add("            let uu = kb + j;")
    add("            let nn = n0 + rr;")
    for w in range(nw):
        add(f"            var q{w} = Unit(vec4<f32>(0.0), vec4<f32>(0.0));")
    add("            if (nn < p.n && uu < p.units) {")
    if norm:
        add("                let o = xoff(uu);")
        add("                let ga = gv(o.x);")
        add("                let gb = gv(o.y);")
    for w in range(nw):
        add(f"                q{w} = wunit{w}(nn, uu);")
        if norm:
            add(f"                q{w}.lo *= ga; q{w}.hi *= gb;")
    add("            }")
    for w in range(nw):
        for c in range(4):
            add(f"            Bs{w}[(j * 8u + {c}u) * {bn // 4}u + rr / 4u][rr % 4u] = q{w}.lo.{_XYZW[c]};")
            add(f"            Bs{w}[(j * 8u + {4 + c}u) * {bn // 4}u + rr / 4u][rr % 4u] = q{w}.hi.{_XYZW[c]};")
    add("        }")
    add("        workgroupBarrier();")
    add(f"        for (var kk = 0u; kk < {bk}u; kk++) {{")
    for g in range(gm):
        add(f"            let a{g} = As[kk * {bm // 4}u + {g * ty_n}u + ty];")
        if norm:
            add(f"            ss{g} = fma(a{g}, a{g}, ss{g});")
    for w in range(nw):
        for h in range(gn):
            add(f"            let b{w}_{h} = Bs{w}[kk * {bn // 4}u + {h * tx_n}u + tx];")
    for g in range(gm):
        for i in range(4):
            r = g * 4 + i
            add(f"            let s{r} = vec4<f32>(a{g}.{_XYZW[i]});")
            for w in range(nw):
                for h in range(gn):
                    add(f"            c{w}_{r}_{h} = fma(s{r}, b{w}_{h}, c{w}_{r}_{h});")
    add("        }")
    add("        workgroupBarrier();")
    add("    }")
    _store_lines(add, shape, nw, swiglu, partial, norm, "m0", "n0")
    body = "\n".join(L)
    shared = f"var<workgroup> As: array<vec4<f32>, {bk * bm // 4}>;\n" + "".join(
        f"var<workgroup> Bs{w}: array<vec4<f32>, {bk * bn // 4}>;\n" for w in range(nw))
    return (W.tiled_prelude(kind, vec, swiglu, norm, bias, residual, partial) + "\n" + shared + f"""
@compute @workgroup_size({threads})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {{
{body}
}}
""")


# -- dp4a: activations quantized per block of 32, integer dot products -------------------------
# The rules of the dp4a GEMM (``TILED_IMPL = "dp4a"``, quantized weights only):
#
# * A first pass (:func:`quantize_rows`, a workgroup a row) scales x by the RMSNorm weight and
#   the row's RMS scale where the product folds the norm, then quantizes each block of 32 as
#   llama.cpp's Q8_1 does: d = max |v| / 127, q = round(v / d) in [-127, 127] packed four a
#   word (``xq`` [M, K / 4]), ``xd`` = d and ``xs`` = d * sum(q) a block ([M, K / 32]).
# * The GEMM walks K a block (8 words) a slice. Per block, each output adds
#   ``xd * wd * sum(xq * wq)`` (``dot4I8Packed``, exact in i32), plus ``xs * wm`` where the
#   weight has an offset (Q4_1: its m; Q4_0: -8 d). Q4's nibbles, low then high, are the
#   block's elements 0-15 then 16-31, as x's words 0-3 then 4-7.
# * The error against float activations is x's rounding: at most d / 2 an element of a block.

@lru_cache(maxsize=None)
def quantize_rows(norm: bool) -> str:
    """WGSL of the first pass: bindings x (f32), [g (f32)], xq (u32), xd, xs (f32), params
    (the linear ``Params``); the grid M workgroups of 64 threads; K a multiple of 32."""
    decls, _ = W.buffer_decls(0, [("x", "f32", False), ("g", "f32", False) if norm else None, ("xq", "u32", True),
                                  ("xd", "f32", True), ("xs", "f32", True)])
    scale = ""
    if norm:
        scale = """    var s = 0.0;
    for (var k = li; k < p.k; k += 64u) { let v = x[base + k]; s = fma(v, v, s); }
    red[li] = s;
    workgroupBarrier();
    for (var h = 32u; h > 0u; h >>= 1u) {
        if (li < h) { red[li] += red[li + h]; }
        workgroupBarrier();
    }
    let rms = inverseSqrt(red[0] / f32(p.k) + p.eps);
"""
    value = "x[base + k] * g[k] * rms" if norm else "x[base + k]"
    return (W.LINEAR_PARAMS + decls + f"""var<workgroup> red: array<f32, 64>;
fn val(base: u32, k: u32{", rms: f32" if norm else ""}) -> f32 {{ return {value}; }}
@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {{
    let row = hetero_workgroup_id(wid).x;
    let base = row * p.k;
{scale}    for (var blk = li; blk < p.blocks; blk += 64u) {{
        let k0 = blk * 32u;
        var amax = 0.0;
        for (var k = k0; k < k0 + 32u; k++) {{ amax = max(amax, abs(val(base, k{", rms" if norm else ""}))); }}
        let d = amax / 127.0;
        let inv = select(0.0, 127.0 / amax, amax > 0.0);
        var sum = 0;
        for (var w = 0u; w < 8u; w++) {{
            var q = vec4<i32>(0);
            for (var j = 0u; j < 4u; j++) {{
                q[j] = i32(clamp(round(val(base, k0 + 4u * w + j{", rms" if norm else ""}) * inv), -127.0, 127.0));
            }}
            sum += q.x + q.y + q.z + q.w;
            xq[(row * p.blocks + blk) * 8u + w] = pack4xI8(q);
        }}
        xd[row * p.blocks + blk] = d;
        xs[row * p.blocks + blk] = d * f32(sum);
    }}
}}
""")


def dp4a_blocking(m: int, swiglu: bool) -> Blocking:
    """The dp4a GEMM's tile: 64 rows (32 at m <= 32), 64 columns (32 with SwiGLU), 4 x 4 outputs a
    thread (its i32 and float accumulators both in registers)."""
    return Blocking(32 if m <= 32 else 64, 32 if swiglu else 64, 4, 4)


@lru_cache(maxsize=None)
def linear_dp4a(kind: str, swiglu: bool, bias: bool, residual: bool, partial: bool, shape: Blocking) -> str:
    """WGSL of the dp4a GEMM (see the rules above): bindings xq, xd, xs, the weight(s), [bias],
    [residual], y (``partial``: ``part``), params; the grid ``(ceil(N / bn), ceil(M / bm), splits)``,
    a split ``p.ks`` units (a multiple of 4: whole blocks)."""
    if kind not in ("q8_0", "q4_0", "q4_1"):
        raise ValueError(f"linear_dp4a: weights of kind {kind!r} are not integer blocks (q8_0, q4_0, q4_1)")
    bm, bn, tm, tn = shape.bm, shape.bn, shape.tm, shape.tn
    if (tm, tn) != (4, 4) or bm % 4 or bn % 4:
        raise ValueError(f"linear_dp4a: takes 4 x 4 outputs a thread and tiles of multiples of 4, got {shape}")
    nw = 2 if swiglu else 1
    ty_n, tx_n = bm // 4, bn // 4
    threads = ty_n * tx_n
    offset = kind != "q8_0"
    inputs, b = W.buffer_decls(0, [("xq", "u32", False), ("xd", "f32", False), ("xs", "f32", False)], params=False)
    weights, b = W.weights_decls(kind, nw, b)
    outs = [("part", "f32", True)] if partial else [("bias", "f32", False) if bias else None,
                                                    ("res", "f32", False) if residual else None, ("y", "f32", True)]
    rest, _ = W.buffer_decls(b, outs)
    decls = inputs + weights + rest
    tail = "" if partial else W.store_fn(swiglu, bias, residual)
    L: list[str] = []
    add = L.append
    add("    let tile = hetero_workgroup_id(wid);")
    add(f"    let mbase = tile.y * {bm}u;")
    add(f"    let nbase = tile.x * {bn}u;")
    add(f"    let tx = li % {tx_n}u;")
    add(f"    let ty = li / {tx_n}u;")
    for w in range(nw):
        for i in range(4):
            add(f"    var c{w}_{i}_0 = vec4<f32>(0.0);")
    add("    let kb0 = tile.z * p.ks;")
    add("    let kb1 = min(p.units, kb0 + p.ks);")
    add("    for (var kb = kb0; kb < kb1; kb += 4u) {")
    add("        let blk = kb / 4u;")
    # x: bm rows x 8 words, consecutive threads consecutive rows; the rows' scales
    add(f"        for (var e = li; e < {bm * 8}u; e += {threads}u) {{")
    add(f"            let rr = e % {bm}u;")
    add(f"            let j = e / {bm}u;")
    add("            let mm = mbase + rr;")
    add("            var v = 0u;")
    add("            if (mm < p.m) { v = xq[(mm * p.blocks + blk) * 8u + j]; }")
    add(f"            Aw[j * {bm // 4}u + rr / 4u][rr % 4u] = v;")
    add("        }")
    add(f"        for (var e = li; e < {bm}u; e += {threads}u) {{")
    add("            let mm = mbase + e;")
    add("            var dd = 0.0;")
    add("            var ss = 0.0;")
    add("            if (mm < p.m) { dd = xd[mm * p.blocks + blk]; ss = xs[mm * p.blocks + blk]; }")
    add("            Ad[e / 4u][e % 4u] = dd;")
    add("            As[e / 4u][e % 4u] = ss;")
    add("        }")
    # weights: bn rows x 4 units (a block), a row's units on consecutive threads; the rows' scales
    add(f"        for (var e = li; e < {bn * 4}u; e += {threads}u) {{")
    add("            let u = e % 4u;")
    add("            let rr = e / 4u;")
    add("            let nn = nbase + rr;")
    add(f"            let at = rr / 4u;")
    add(f"            let lane = rr % 4u;")
    for w in range(nw):
        if kind == "q8_0":
            add(f"            var q{w} = vec2<u32>(0u);")
            add(f"            if (nn < p.n) {{ q{w} = qs{w}[nn * p.units + kb + u]; }}")
            add(f"            Bw{w}[(2u * u) * {bn // 4}u + at][lane] = q{w}.x;")
            add(f"            Bw{w}[(2u * u + 1u) * {bn // 4}u + at][lane] = q{w}.y;")
        else:
            add(f"            var q{w} = 0u;")
            add(f"            if (nn < p.n) {{ q{w} = qs{w}[nn * p.units + kb + u]; }}")
            add(f"            Bw{w}[u * {bn // 4}u + at][lane] = q{w} & 0x0F0F0F0Fu;")
            add(f"            Bw{w}[(4u + u) * {bn // 4}u + at][lane] = (q{w} >> 4u) & 0x0F0F0F0Fu;")
    add("        }")
    add(f"        for (var e = li; e < {bn}u; e += {threads}u) {{")
    add("            let nn = nbase + e;")
    for w in range(nw):
        add(f"            var d{w}v = 0.0;")
        if offset:
            add(f"            var m{w}v = 0.0;")
        if kind == "q4_1":
            add(f"            if (nn < p.n) {{ d{w}v = d{w}[nn * p.blocks + blk]; "
                f"m{w}v = m{w}[nn * p.blocks + blk]; }}")
        else:
            add(f"            if (nn < p.n) {{ d{w}v = d{w}[nn * p.blocks + blk]; }}")
            if kind == "q4_0":
                add(f"            m{w}v = -8.0 * d{w}v;")
        add(f"            Bd{w}[e / 4u][e % 4u] = d{w}v;")
        if offset:
            add(f"            Bm{w}[e / 4u][e % 4u] = m{w}v;")
    add("        }")
    add("        workgroupBarrier();")
    for w in range(nw):
        for i in range(4):
            add(f"        var s{w}_{i} = vec4<i32>(0);")
    add("        for (var j = 0u; j < 8u; j++) {")
    add(f"            let a = Aw[j * {bm // 4}u + ty];")
    for w in range(nw):
        add(f"            let b{w} = Bw{w}[j * {bn // 4}u + tx];")
        for i in range(4):
            ai = f"a.{_XYZW[i]}"
            dots = ", ".join(f"dot4I8Packed({ai}, b{w}.{_XYZW[c]})" for c in range(4))
            add(f"            s{w}_{i} += vec4<i32>({dots});")
    add("        }")
    add("        let ad = Ad[ty];")
    if offset:
        add("        let as4 = As[ty];")
    for w in range(nw):
        add(f"        let bd{w} = Bd{w}[tx];")
        if offset:
            add(f"            let bm{w} = Bm{w}[tx];")
        for i in range(4):
            xi = _XYZW[i]
            term = f"vec4<f32>(s{w}_{i}) * (ad.{xi} * bd{w})"
            if offset:
                term += f" + as4.{xi} * bm{w}"
            add(f"        c{w}_{i}_0 += {term};")
    add("        workgroupBarrier();")
    add("    }")
    _store_lines(add, shape, nw, swiglu, partial, False, "mbase", "nbase")
    shared = (f"var<workgroup> Aw: array<vec4<u32>, {8 * bm // 4}>;\n"
              f"var<workgroup> Ad: array<vec4<f32>, {bm // 4}>;\n"
              f"var<workgroup> As: array<vec4<f32>, {bm // 4}>;\n")
    for w in range(nw):
        shared += (f"var<workgroup> Bw{w}: array<vec4<u32>, {8 * bn // 4}>;\n"
                   f"var<workgroup> Bd{w}: array<vec4<f32>, {bn // 4}>;\n")
        if offset:
            shared += f"var<workgroup> Bm{w}: array<vec4<f32>, {bn // 4}>;\n"
    return (W.COMMON + W.LINEAR_PARAMS + decls + tail + shared + f"""
@compute @workgroup_size({threads})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {{
{chr(10).join(L)}
}}
""")
