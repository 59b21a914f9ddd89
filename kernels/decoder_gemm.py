"""WGSL of the decoder's GEMMs: ``linear`` for many rows (prefill, many streams).

Two kernels: the register-blocked float one (:func:`linear_blocked`), whose rules follow, and
the dp4a one for integer weight blocks (:func:`quantize_rows` then :func:`linear_dp4a`), whose
rules head its section below. ``TILED_IMPL = "auto"`` (the default, in
:mod:`hetero.kernels.decoder`) takes dp4a for large Q8_0 / Q4 weights, the blocked one otherwise.

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

__all__ = ["DP4A_KINDS", "DP4A_SLICE_BLOCKS", "DP4A_THREAD_TILE", "QUANT_BLOCKS", "SLICE_UNITS", "THREAD_BLOCK", "Blocking", "blocking", "dp4a_blocking", "linear_blocked",
           "dp4a_slice_blocks", "linear_dp4a", "quantize_rows", "swiglu_epilogue_quantized"]

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


def _tile_lines(add: Callable[[str], None], bm: int, bn: int, tx_n: int, m0: str, n0: str) -> None:
    """A GEMM workgroup's tile (``tile``: x columns, y rows, z the split), its first row ``m0`` and
    column ``n0``, and the thread's place ``(tx, ty)`` in it, ``tx_n`` threads a row of threads."""
    add("    let tile = hetero_workgroup_id(wid);")
    add(f"    let {m0} = tile.y * {bm}u;")
    add(f"    let {n0} = tile.x * {bn}u;")
    add(f"    let tx = li % {tx_n}u;")
    add(f"    let ty = li / {tx_n}u;")


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
                   shape: Blocking, f16: bool = False) -> str:
    """The kernel's WGSL (see the module's rules); bindings and params as
    :func:`~hetero.kernels.decoder_wgsl.linear_tiled`'s, its grid ``(ceil(N / bn), ceil(M / bm), splits)``.

    ``f16`` (the device's ``shader-f16``): the tiles are stored in f16 and a slice's products are
    summed in f16 accumulators (vec4<f16>: twice the float32 rate where the GPU packs them), then
    added to the float32 ones, so an output's f16 rounding comes from its inputs and one slice's
    sums (:data:`SLICE_UNITS` x 8 terms), not from K's. The norm's sum of squares stays float32."""
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
    _tile_lines(add, bm, bn, tx_n, "m0", "n0")
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
        add(f"            As[(at + {c}u) * {bm // 4}u + rr / 4u][rr % 4u] = {'f16' if f16 else ''}(v.{_XYZW[c]});")
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
    cast = "f16" if f16 else ""  # what a tile's element is stored as (f16(v) rounds to nearest)
    for w in range(nw):
        for c in range(4):
            add(f"            Bs{w}[(j * 8u + {c}u) * {bn // 4}u + rr / 4u][rr % 4u] = {cast}(q{w}.lo.{_XYZW[c]});")
            add(f"            Bs{w}[(j * 8u + {4 + c}u) * {bn // 4}u + rr / 4u][rr % 4u] = "
                f"{cast}(q{w}.hi.{_XYZW[c]});")
    add("        }")
    add("        workgroupBarrier();")
    acc, ft = ("h", "f16") if f16 else ("c", "f32")  # the slice's accumulators
    if f16:
        for w in range(nw):
            for r in range(tm):
                for h in range(gn):
                    add(f"        var h{w}_{r}_{h} = vec4<f16>(0.0h);")
    add(f"        for (var kk = 0u; kk < {bk}u; kk++) {{")
    for g in range(gm):
        add(f"            let a{g} = As[kk * {bm // 4}u + {g * ty_n}u + ty];")
        if norm:
            av = f"vec4<f32>(a{g})" if f16 else f"a{g}"
            add(f"            ss{g} = fma({av}, {av}, ss{g});")
    for w in range(nw):
        for h in range(gn):
            add(f"            let b{w}_{h} = Bs{w}[kk * {bn // 4}u + {h * tx_n}u + tx];")
    for g in range(gm):
        for i in range(4):
            r = g * 4 + i
            add(f"            let s{r} = vec4<{ft}>(a{g}.{_XYZW[i]});")
            for w in range(nw):
                for h in range(gn):
                    add(f"            {acc}{w}_{r}_{h} = fma(s{r}, b{w}_{h}, {acc}{w}_{r}_{h});")
    add("        }")
    if f16:
        for w in range(nw):
            for r in range(tm):
                for h in range(gn):
                    add(f"        c{w}_{r}_{h} += vec4<f32>(h{w}_{r}_{h});")
    add("        workgroupBarrier();")
    add("    }")
    _store_lines(add, shape, nw, swiglu, partial, norm, "m0", "n0")
    body = "\n".join(L)
    et = "f16" if f16 else "f32"
    shared = f"var<workgroup> As: array<vec4<{et}>, {bk * bm // 4}>;\n" + "".join(
        f"var<workgroup> Bs{w}: array<vec4<{et}>, {bk * bn // 4}>;\n" for w in range(nw))
    return (("enable f16;\n" if f16 else "")
            + W.tiled_prelude(kind, vec, swiglu, norm, bias, residual, partial) + "\n" + shared + f"""
@compute @workgroup_size({threads})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {{
{body}
}}
""")


# -- dp4a: activations quantized per block of 32, integer dot products -------------------------
# The rules of the dp4a GEMM (Q8_0 and Q4 weights only):
#
# * A first pass (:func:`quantize_rows`, 8 threads a block) scales x by the RMSNorm weight and
#   the row's RMS scale where the product folds the norm, then quantizes each block of 32 as
#   llama.cpp's Q8_1 does: d = max |v| / 127, q = round(v / d) in [-127, 127] packed four a
#   word (``xq`` [M, K / 4]), ``xd`` = d and ``xs`` = d * sum(q) a block ([M, K / 32]).
# * The GEMM walks K in slices of up to DP4A_SLICE_BLOCKS blocks (8 words each), a slice's loads
#   all issued before its stores into workgroup memory; a block past the split's end reads as
#   zeros. Per block, each output adds
#   ``xd * wd * sum(xq * wq)`` (``dot4I8Packed``, exact in i32), plus ``xs * wm`` where the
#   weight has an offset (Q4_1: its m; Q4_0: -8 d). Q4's nibbles, low then high, are the
#   block's elements 0-15 then 16-31, as x's words 0-3 then 4-7.
# * A thread's outputs (DP4A_THREAD_TILE) lie as the blocked kernel's do (rows g*4*TY + 4*ty + i,
#   columns h*4*TX + 4*tx + j); each output adds its blocks in K's order whatever the tile, so
#   every tile gives the same outputs, bit for bit.
# * The error against float activations is x's rounding: at most d / 2 an element of a block.

QUANT_BLOCKS = 8
"""Blocks of 32 a workgroup of the quantize pass takes (8 threads a block, 4 values a thread)."""


@lru_cache(maxsize=None)
def quantize_rows(norm: bool) -> str:
    """WGSL of the first pass: bindings x (f32), [g (f32)], xq (u32), xd, xs (f32), params
    (the linear ``Params``); the grid ``(ceil(blocks / QUANT_BLOCKS), M)`` workgroups of 64
    threads, a thread four consecutive values (one word of xq); K a multiple of 32.

    Every load is issued at once (a block's max and sum meet in workgroup memory), so the pass
    costs a few memory latencies, not a serial walk of a block a thread. With the norm, each
    workgroup sums its row's squares itself (the row is read once more, from cache)."""
    if QUANT_BLOCKS * 8 != 64:
        raise ValueError(f"quantize_rows: its workgroup is 64 threads, 8 a block: QUANT_BLOCKS must be 8, "
                         f"got {QUANT_BLOCKS}")
    decls, _ = W.buffer_decls(0, [("x", "vec4<f32>", False), ("g", "vec4<f32>", False) if norm else None,
                                  ("xq", "u32", True), ("xd", "f32", True), ("xs", "f32", True)])
    scale = "    let rms = 1.0;\n"
    if norm:
        scale = """    var s = 0.0;
    var kn = li;
    while (kn + 192u < p.k / 4u) {  // four loads in flight, then their squares
        let v0 = x[base + kn]; let v1 = x[base + kn + 64u]; let v2 = x[base + kn + 128u]; let v3 = x[base + kn + 192u];
        s += (dot(v0, v0) + dot(v1, v1)) + (dot(v2, v2) + dot(v3, v3));
        kn += 256u;
    }
    while (kn < p.k / 4u) { let v = x[base + kn]; s += dot(v, v); kn += 64u; }
    red[li] = s;
    workgroupBarrier();
    for (var h = 32u; h > 0u; h >>= 1u) {
        if (li < h) { red[li] += red[li + h]; }
        workgroupBarrier();
    }
    let rms = inverseSqrt(red[0] / f32(p.k) + p.eps);
"""
    value = "x[base + k4] * g[k4] * rms" if norm else "x[base + k4]"
    return (W.LINEAR_PARAMS + decls + "var<workgroup> red: array<f32, 64>;\n"
            + _quantized_rows_main(f"""    let base = row * (p.k / 4u);
{scale}    var v = vec4<f32>(0.0);
    if (inside) {{ v = {value}; }}"""))


def _quantized_rows_main(values: str) -> str:
    """The quantize pass's entry point around ``values``, WGSL setting ``var v`` (vec4) to this
    thread's four values of the row (``row``, block ``blk``, word ``w`` of it, ``k4 = blk * 8 + w``;
    ``inside``: the block is in the row): their Q8_1 word, and the block's d and d * sum(q), to xq,
    xd and xs (see :func:`quantize_rows`)."""
    return f"""var<workgroup> amx: array<f32, 64>;
var<workgroup> qsum: array<i32, 64>;
@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {{
    let g3 = hetero_workgroup_id(wid);
    let row = g3.y;
    let blk = g3.x * {QUANT_BLOCKS}u + li / 8u;
    let w = li % 8u;
    let inside = blk < p.blocks;
    let k4 = blk * 8u + w;
{values}
    let a = abs(v);
    amx[li] = max(max(a.x, a.y), max(a.z, a.w));
    workgroupBarrier();
    let first = li & ~7u;
    var amax = 0.0;
    for (var j = 0u; j < 8u; j++) {{ amax = max(amax, amx[first + j]); }}
    let inv = select(0.0, 127.0 / amax, amax > 0.0);
    let q = vec4<i32>(clamp(round(v * inv), vec4<f32>(-127.0), vec4<f32>(127.0)));
    qsum[li] = q.x + q.y + q.z + q.w;
    if (inside) {{ xq[(row * p.blocks + blk) * 8u + w] = pack4xI8(q); }}
    workgroupBarrier();
    if (inside && w == 0u) {{
        var sum = 0;
        for (var j = 0u; j < 8u; j++) {{ sum += qsum[li + j]; }}
        let d = amax / 127.0;
        xd[row * p.blocks + blk] = d;
        xs[row * p.blocks + blk] = d * f32(sum);
    }}
}}
"""


@lru_cache(maxsize=None)
def swiglu_epilogue_quantized(norm: bool) -> str:
    """A split-K SwiGLU product's epilogue that quantizes its output for the next product's dp4a GEMM:
    bindings part ([splits, 2, M, N] partial sums), [pss], xq, xd, xs, params (the linear ``Params``:
    ``p.ks`` the splits, ``p.k`` the product's K, ``p.n`` its N and ``p.blocks`` N / 32); the grid
    ``(ceil(blocks / QUANT_BLOCKS), M)``. Each output is :func:`~hetero.kernels.decoder_wgsl.linear_epilogue`'s
    (the same sums in the same order), and its blocks are what :func:`quantize_rows` makes of them, so
    the next product computes what it would from the float32 output, bit for bit; the output itself is
    never written. N a multiple of 32."""
    decls, _ = W.buffer_decls(0, [("part", "f32", False), ("pss", "f32", False) if norm else None,
                                  ("xq", "u32", True), ("xd", "f32", True), ("xs", "f32", True)])
    sums = []
    for c in range(4):
        col = f"(k4 * 4u + {c}u)"
        sums.append((f"a0_{c}", f"part[(({{s}} * 2u) * p.m + row) * p.n + {col}]"))
        sums.append((f"a1_{c}", f"part[(({{s}} * 2u + 1u) * p.m + row) * p.n + {col}]"))
    if norm:
        sums.append(("ss", "pss[{s} * p.m + row]"))
    acc = "\n".join(f"    var a0_{c} = 0.0;\n    var a1_{c} = 0.0;" for c in range(4)) + "\n    var ss = 0.0;"
    scale = "let scale = inverseSqrt(ss / f32(p.k) + p.eps);" if norm else "let scale = 1.0;"
    value = ", ".join(f"silu(a0_{c} * scale) * (a1_{c} * scale)" for c in range(4))
    return (W.COMMON + W.LINEAR_PARAMS + decls + _quantized_rows_main(f"""{acc}
    var v = vec4<f32>(0.0);
    if (inside) {{
{W.split_sums(sums, indent="        ")}
        {scale}
        v = vec4<f32>({value});
    }}"""))


DP4A_THREAD_TILE = (4, 4)
"""Outputs a thread of the dp4a GEMM computes: (rows, columns), each 4 or 8. Every word of x and of the
weight a thread reads from workgroup memory serves ``columns`` (``rows``) dot products, so 4 x 4
reads 2 bytes of workgroup memory a ``dot4I8Packed`` (about what an SM's workgroup memory serves at
its integer rate) and 8 x 8 one, for twice the accumulators (two sets: integer, float). Not yet
timed on a GPU past 4 x 4."""


def dp4a_blocking(m: int, swiglu: bool) -> Blocking:
    """The dp4a GEMM's tile: 64 rows (32 at m <= 32), 64 columns (32 with SwiGLU),
    :data:`DP4A_THREAD_TILE` outputs a thread (at most the tile's side)."""
    bm, bn = 32 if m <= 32 else 64, 32 if swiglu else 64
    tm, tn = (int(v) for v in DP4A_THREAD_TILE)
    if tm not in (4, 8) or tn not in (4, 8):
        raise ValueError(f"DP4A_THREAD_TILE must be (rows, columns) of 4 or 8 each, got {DP4A_THREAD_TILE!r}")
    return Blocking(bm, bn, min(tm, bm), min(tn, bn))


DP4A_SLICE_BLOCKS = 4
"""Blocks of 32 along K a slice of the dp4a GEMM loads between two barriers (fewer where the
adapter's workgroup memory is smaller, see :func:`dp4a_slice_blocks`); the loads of a slice are
in flight together. On the H200 slices of 4 took the same GPU time as slices of 1 (BENCHMARKS.md,
twenty-seventh session): the kernel is not bound by a slice's memory latency there."""


def _dp4a_block_bytes(shape: Blocking, kind: str, swiglu: bool) -> int:
    """Workgroup memory a block of 32 along K takes in the dp4a GEMM: x's words and two scales a
    row, each weight's words and one scale a row (two with an offset)."""
    nw = 2 if swiglu else 1
    scales = 2 if kind != "q8_0" else 1
    return shape.bm * (32 + 8) + nw * shape.bn * (32 + 4 * scales)


def dp4a_slice_blocks(shape: Blocking, kind: str, swiglu: bool, limit: int) -> int:
    """Blocks a slice: :data:`DP4A_SLICE_BLOCKS`, fewer where ``limit`` (the adapter's
    max-compute-workgroup-storage-size) holds fewer, at least 1."""
    return max(1, min(int(DP4A_SLICE_BLOCKS), limit // _dp4a_block_bytes(shape, kind, swiglu)))


def _unrolled(count: int, threads: int, tag: str,
              body: Callable[[str, str], tuple[list[str], list[str]]]) -> tuple[list[str], list[str]]:
    """``body(e, live)`` for e = li, li + threads, ... < count, unrolled: (its loads, its stores);
    ``live`` is the WGSL condition that e is in range (a load selects zero past it)."""
    loads: list[str] = []
    stores: list[str] = []
    for i in range(-(-count // threads)):
        e = f"{tag}{i}"
        partial = bool(count % threads) and (i + 1) * threads > count
        live = f"({e} < {count}u)" if partial else "true"
        ld, st = body(e, live)
        loads += [f"        let {e} = li + {i * threads}u;", *ld]
        stores += [f"        if {live} {{", *("    " + x for x in st), "        }"] if partial else st
    return loads, stores


@lru_cache(maxsize=None)
def linear_dp4a(kind: str, swiglu: bool, bias: bool, residual: bool, partial: bool, shape: Blocking,
                slice_blocks: int = 1) -> str:
    """WGSL of the dp4a GEMM (see the rules above): bindings xq, xd, xs, the weight(s), [bias],
    [residual], y (``partial``: ``part``), params; the grid ``(ceil(N / bn), ceil(M / bm), splits)``,
    a split ``p.ks`` units (a multiple of 4: whole blocks), walked ``slice_blocks`` blocks a slice
    (a block past the split's end reads as zeros)."""
    if kind not in ("q8_0", "q4_0", "q4_1"):
        raise ValueError(f"linear_dp4a: weights of kind {kind!r} are not integer blocks (q8_0, q4_0, q4_1)")
    bm, bn, tm, tn = shape.bm, shape.bn, shape.tm, shape.tn
    if tm not in (4, 8) or tn not in (4, 8) or bm % tm or bn % tn:
        raise ValueError(f"linear_dp4a: takes 4 or 8 outputs a thread each way and tiles of multiples of them, "
                         f"got {shape}")
    nb = int(slice_blocks)
    if nb < 1:
        raise ValueError(f"linear_dp4a: slice_blocks must be >= 1, got {slice_blocks}")
    nw = 2 if swiglu else 1
    gm, gn = tm // 4, tn // 4  # a thread's vec4 groups of rows and of columns
    ty_n, tx_n = bm // tm, bn // tn
    threads = ty_n * tx_n
    offset = kind != "q8_0"
    q8 = kind == "q8_0"
    # x's words and a Q8_0 block's as two vec4 a row and block, a Q4 block's as one
    inputs, b = W.buffer_decls(0, [("xq", "vec4<u32>", False), ("xd", "f32", False), ("xs", "f32", False)],
                               params=False)
    wdecl = ""
    for w in range(nw):
        wdecl += f"@group(0) @binding({b}) var<storage, read> qs{w}: array<vec4<u32>>;\n"
        wdecl += f"@group(0) @binding({b + 1}) var<storage, read> d{w}: array<f32>;\n"
        b += 2
        if kind == "q4_1":
            wdecl += f"@group(0) @binding({b}) var<storage, read> m{w}: array<f32>;\n"
            b += 1
    outs = [("part", "f32", True)] if partial else [("bias", "f32", False) if bias else None,
                                                    ("res", "f32", False) if residual else None, ("y", "f32", True)]
    rest, _ = W.buffer_decls(b, outs)
    decls = inputs + wdecl + rest
    tail = "" if partial else W.store_fn(swiglu, bias, residual)
    L: list[str] = []
    add = L.append
    _tile_lines(add, bm, bn, tx_n, "mbase", "nbase")
    rows = [(g, i, g * 4 + i) for g in range(gm) for i in range(4)]  # (group, lane, accumulator row)
    for w in range(nw):
        for _, _, r in rows:
            for h in range(gn):
                add(f"    var c{w}_{r}_{h} = vec4<f32>(0.0);")
    add("    let kb0 = tile.z * p.ks;")
    add("    let kb1 = min(p.units, kb0 + p.ks);")
    add(f"    for (var kb = kb0; kb < kb1; kb += {4 * nb}u) {{")
    add("        let blk = kb / 4u;")

    def x_words(e: str, live: str) -> tuple[list[str], list[str]]:  # block s, row rr, half h: 4 words of x
        ld = [f"        let s_{e} = {e} / {2 * bm}u;", f"        let rr_{e} = ({e} / 2u) % {bm}u;",
              f"        let h_{e} = {e} % 2u;", f"        let mm_{e} = mbase + rr_{e};",
              f"        let v_{e} = select(vec4<u32>(0u), xq[(mm_{e} * p.blocks + blk + s_{e}) * 2u + h_{e}], "
              f"{live} && mm_{e} < p.m && kb + 4u * s_{e} < kb1);"]
        st = [f"        Aw[(s_{e} * 8u + h_{e} * 4u + {c}u) * {bm // 4}u + rr_{e} / 4u][rr_{e} % 4u] = v_{e}.{_XYZW[c]};"
              for c in range(4)]
        return ld, st

    def x_scales(e: str, live: str) -> tuple[list[str], list[str]]:
        ld = [f"        let s_{e} = {e} / {bm}u;", f"        let rr_{e} = {e} % {bm}u;",
              f"        let ok_{e} = {live} && mbase + rr_{e} < p.m && kb + 4u * s_{e} < kb1;",
              f"        let i_{e} = (mbase + rr_{e}) * p.blocks + blk + s_{e};",
              f"        let dd_{e} = select(0.0, xd[i_{e}], ok_{e});", f"        let ss_{e} = select(0.0, xs[i_{e}], ok_{e});"]
        st = [f"        Ad[s_{e} * {bm // 4}u + rr_{e} / 4u][rr_{e} % 4u] = dd_{e};",
              f"        As[s_{e} * {bm // 4}u + rr_{e} / 4u][rr_{e} % 4u] = ss_{e};"]
        return ld, st

    def w_words(e: str, live: str) -> tuple[list[str], list[str]]:  # weight row rr of block s: Q4 one vec4, Q8_0 two
        per = 2 if q8 else 1
        ld = [f"        let s_{e} = {e} / {per * bn}u;", f"        let rr_{e} = ({e} / {per}u) % {bn}u;",
              f"        let nn_{e} = nbase + rr_{e};", f"        let ok_{e} = {live} && nn_{e} < p.n && kb + 4u * s_{e} < kb1;"]
        st = [f"        let at_{e} = (s_{e} * 8u) * {bn // 4}u + rr_{e} / 4u;", f"        let ln_{e} = rr_{e} % 4u;"]
        if q8:
            ld.append(f"        let h_{e} = {e} % 2u;")
        for w in range(nw):
            idx = (f"(nn_{e} * p.units + kb + 4u * s_{e}) / 2u + h_{e}" if q8
                   else f"(nn_{e} * p.units + kb + 4u * s_{e}) / 4u")
            ld.append(f"        let q{w}_{e} = select(vec4<u32>(0u), qs{w}[{idx}], ok_{e});")
            for c in range(4):
                v = f"q{w}_{e}.{_XYZW[c]}"
                if q8:  # word c of the half: element group h * 4 + c
                    st.append(f"        Bw{w}[at_{e} + (h_{e} * 4u + {c}u) * {bn // 4}u][ln_{e}] = {v};")
                else:  # low nibbles: elements 4c..4c+3 (word c of x), high: 16+4c.. (word 4 + c)
                    st.append(f"        Bw{w}[at_{e} + {c}u * {bn // 4}u][ln_{e}] = {v} & 0x0F0F0F0Fu;")
                    st.append(f"        Bw{w}[at_{e} + {4 + c}u * {bn // 4}u][ln_{e}] = ({v} >> 4u) & 0x0F0F0F0Fu;")
        return ld, st

    def w_scales(e: str, live: str) -> tuple[list[str], list[str]]:
        ld = [f"        let s_{e} = {e} / {bn}u;", f"        let rr_{e} = {e} % {bn}u;",
              f"        let ok_{e} = {live} && nbase + rr_{e} < p.n && kb + 4u * s_{e} < kb1;",
              f"        let i_{e} = (nbase + rr_{e}) * p.blocks + blk + s_{e};"]
        st = [f"        let at_{e} = s_{e} * {bn // 4}u + rr_{e} / 4u;"]
        for w in range(nw):
            ld.append(f"        let d{w}_{e} = select(0.0, d{w}[i_{e}], ok_{e});")
            if kind == "q4_1":
                ld.append(f"        let m{w}_{e} = select(0.0, m{w}[i_{e}], ok_{e});")
            elif kind == "q4_0":
                ld.append(f"        let m{w}_{e} = -8.0 * d{w}_{e};")
            st.append(f"        Bd{w}[at_{e}][rr_{e} % 4u] = d{w}_{e};")
            if offset:
                st.append(f"        Bm{w}[at_{e}][rr_{e} % 4u] = m{w}_{e};")
        return ld, st

    loads: list[str] = []
    stores: list[str] = []
    for tag, count, body in (("ex", nb * bm * 2, x_words), ("ed", nb * bm, x_scales),
                             ("ew", nb * bn * (2 if q8 else 1), w_words), ("es", nb * bn, w_scales)):
        ld, st = _unrolled(count, threads, tag, body)
        loads += ld
        stores += st
    L += loads + stores  # a slice's loads all issued before its first store
    add("        workgroupBarrier();")
    # thread (tx, ty)'s rows are mbase + g*4*TY + 4*ty + i, its columns nbase + h*4*TX + 4*tx + j (as
    # the blocked kernel's): its reads of workgroup memory are vec4 g*TY + ty and h*TX + tx of a word
    add(f"        for (var s = 0u; s < {nb}u; s++) {{")
    for w in range(nw):
        for _, _, r in rows:
            for h in range(gn):
                add(f"            var s{w}_{r}_{h} = vec4<i32>(0);")
    add("            for (var j = 0u; j < 8u; j++) {")
    for g in range(gm):
        add(f"                let a{g} = Aw[(s * 8u + j) * {bm // 4}u + {g * ty_n}u + ty];")
    for w in range(nw):
        for h in range(gn):
            add(f"                let b{w}_{h} = Bw{w}[(s * 8u + j) * {bn // 4}u + {h * tx_n}u + tx];")
            for g, i, r in rows:
                ai = f"a{g}.{_XYZW[i]}"
                dots = ", ".join(f"dot4I8Packed({ai}, b{w}_{h}.{_XYZW[c]})" for c in range(4))
                add(f"                s{w}_{r}_{h} += vec4<i32>({dots});")
    add("            }")
    for g in range(gm):
        add(f"            let ad{g} = Ad[s * {bm // 4}u + {g * ty_n}u + ty];")
        if offset:
            add(f"            let as{g} = As[s * {bm // 4}u + {g * ty_n}u + ty];")
    for w in range(nw):
        for h in range(gn):
            add(f"            let bd{w}_{h} = Bd{w}[s * {bn // 4}u + {h * tx_n}u + tx];")
            if offset:
                add(f"            let bm{w}_{h} = Bm{w}[s * {bn // 4}u + {h * tx_n}u + tx];")
            for g, i, r in rows:
                xi = _XYZW[i]
                term = f"vec4<f32>(s{w}_{r}_{h}) * (ad{g}.{xi} * bd{w}_{h})"
                if offset:
                    term += f" + as{g}.{xi} * bm{w}_{h}"
                add(f"            c{w}_{r}_{h} += {term};")
    add("        }")
    add("        workgroupBarrier();")
    add("    }")
    _store_lines(add, shape, nw, swiglu, partial, False, "mbase", "nbase")
    shared = (f"var<workgroup> Aw: array<vec4<u32>, {nb * 8 * bm // 4}>;\n"
              f"var<workgroup> Ad: array<vec4<f32>, {nb * bm // 4}>;\n"
              f"var<workgroup> As: array<vec4<f32>, {nb * bm // 4}>;\n")
    for w in range(nw):
        shared += (f"var<workgroup> Bw{w}: array<vec4<u32>, {nb * 8 * bn // 4}>;\n"
                   f"var<workgroup> Bd{w}: array<vec4<f32>, {nb * bn // 4}>;\n")
        if offset:
            shared += f"var<workgroup> Bm{w}: array<vec4<f32>, {nb * bn // 4}>;\n"
    return (W.COMMON + W.LINEAR_PARAMS + decls + tail + shared + f"""
@compute @workgroup_size({threads})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {{
{chr(10).join(L)}
}}
""")
