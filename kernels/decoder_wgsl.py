"""WGSL of the decoder kernels (:mod:`hetero.kernels.decoder`): generators of each kernel variant.

Each generator returns the source of one variant (memoised); the ops in
:mod:`hetero.kernels.decoder` choose the variant, compile it and dispatch it. Every
kernel finds its workgroup with ``hetero_workgroup_id``, so hetero may split its grid.
Loops over registers are unrolled here, in Python (named variables, never private
arrays indexed in loops): drivers keep them in registers.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, Sequence

__all__ = ["COMMON", "LINEAR_PARAMS", "attention", "attention_combine", "buffer_decls", "embedding",
           "linear_epilogue", "linear_gemv", "linear_gemv_lanes", "linear_tiled", "rmsnorm", "rope_kv", "sample",
           "store_fn", "tiled_prelude", "weights_decls"]

# -- weights: bindings and the dequantization of one unit of 8 consecutive-in-memory weights ----
# A unit u of row r holds 8 weights; wunit returns them as two vec4 (lo, hi) and xoff(u) the
# element offsets (along K) of the activations they multiply: (8u, 8u + 4) for f32, f16 and
# q8_0; for q4 the low nibbles of word i of a block are elements 4i..4i+3 and the high
# nibbles 16+4i..16+4i+3.


def weight_decls(kind: str, first: int, tag: str) -> tuple[str, int]:
    """Declarations of a weight's arrays from binding ``first``; (WGSL, bindings used)."""
    if kind == "f32":
        return f"@group(0) @binding({first}) var<storage, read> w{tag}: array<vec4<f32>>;\n", 1
    if kind == "f16":
        return f"@group(0) @binding({first}) var<storage, read> w{tag}: array<vec4<u32>>;\n", 1
    qs = "vec2<u32>" if kind == "q8_0" else "u32"
    src = (f"@group(0) @binding({first}) var<storage, read> qs{tag}: array<{qs}>;\n"
           f"@group(0) @binding({first + 1}) var<storage, read> d{tag}: array<f32>;\n")
    if kind == "q4_1":
        return src + f"@group(0) @binding({first + 2}) var<storage, read> m{tag}: array<f32>;\n", 3
    return src, 2


def weight_fns(kind: str, tag: str) -> str:
    """``wunit{tag}(r, u) -> Unit`` (8 weights of unit u of row r) for a weight of ``kind``.

    Rows are ``p.units`` units long (``p.blocks`` blocks of 32 for quantized kinds).
    """
    if kind == "f32":
        body = f"""let i = (r * p.units + u) * 2u;
    return Unit(w{tag}[i], w{tag}[i + 1u]);"""
    elif kind == "f16":
        body = f"""let v = w{tag}[r * p.units + u];
    return Unit(vec4<f32>(unpack2x16float(v.x), unpack2x16float(v.y)),
                vec4<f32>(unpack2x16float(v.z), unpack2x16float(v.w)));"""
    elif kind == "q8_0":
        body = f"""let v = qs{tag}[r * p.units + u];
    let s = d{tag}[r * p.blocks + u / 4u];
    return Unit(i8x4(v.x) * s, i8x4(v.y) * s);"""
    else:
        off = "- 8.0) * s" if kind == "q4_0" else f") * s + m{tag}[r * p.blocks + u / 4u]"
        body = f"""let v = qs{tag}[r * p.units + u];
    let s = d{tag}[r * p.blocks + u / 4u];
    let lo = vec4<f32>((vec4<u32>(v) >> vec4<u32>(0u, 8u, 16u, 24u)) & vec4<u32>(15u));
    let hi = vec4<f32>((vec4<u32>(v) >> vec4<u32>(4u, 12u, 20u, 28u)) & vec4<u32>(15u));
    return Unit((lo {off}, (hi {off});"""
    return f"fn wunit{tag}(r: u32, u: u32) -> Unit {{\n    {body}\n}}\n"


def _xoff(kind: str) -> str:
    if kind in ("q4_0", "q4_1"):
        return ("fn xoff(u: u32) -> vec2<u32> {\n"
                "    let b = (u / 4u) * 32u + (u % 4u) * 4u;\n    return vec2<u32>(b, b + 16u);\n}\n")
    return "fn xoff(u: u32) -> vec2<u32> { return vec2<u32>(u * 8u, u * 8u + 4u); }\n"


COMMON = """
struct Unit { lo: vec4<f32>, hi: vec4<f32> }
// 4 signed bytes of a word (little-endian) as floats
fn i8x4(v: u32) -> vec4<f32> {
    return vec4<f32>(vec4<i32>(vec4<u32>(v) << vec4<u32>(24u, 16u, 8u, 0u)) >> vec4<u32>(24u));
}
fn silu(v: f32) -> f32 { return v / (1.0 + exp(-v)); }
"""
"""WGSL every linear kernel starts with: the ``Unit`` of 8 weights, ``i8x4``, ``silu``."""

LINEAR_PARAMS = """struct Params { m: u32, n: u32, k: u32, units: u32, blocks: u32, eps: f32, m0: u32, ks: u32 }
"""
"""The linear kernels' uniform (``struct.pack("<5If2I", ...)`` on the host)."""


def _x_reader(vec: bool) -> str:
    """``xv(m, k)``: x[m, k..k+3] (zeros past K); vec: K % 8 == 0, one vec4 load."""
    if vec:
        return "fn xv(m: u32, k: u32) -> vec4<f32> { return x[(m * p.k + k) / 4u]; }\n"
    return """fn xs1(m: u32, k: u32) -> f32 { if (k < p.k) { return x[m * p.k + k]; } return 0.0; }
fn xv(m: u32, k: u32) -> vec4<f32> { return vec4<f32>(xs1(m, k), xs1(m, k + 1u), xs1(m, k + 2u), xs1(m, k + 3u)); }
"""


def _g_reader(vec: bool) -> str:
    if vec:
        return "fn gv(k: u32) -> vec4<f32> { return g[k / 4u]; }\n"
    return """fn gs1(k: u32) -> f32 { if (k < p.k) { return g[k]; } return 0.0; }
fn gv(k: u32) -> vec4<f32> { return vec4<f32>(gs1(k), gs1(k + 1u), gs1(k + 2u), gs1(k + 3u)); }
"""


def buffer_decls(first: int, entries: Sequence[tuple[str, str, bool] | None],
                 params: bool = True) -> tuple[str, int]:
    """Storage arrays ``(name, element type, written)`` at bindings from ``first`` in order (None
    entries skipped), then (``params``) the ``Params`` uniform; (WGSL, the next binding)."""
    src, b = "", first
    for e in entries:
        if e is not None:
            name, elem, written = e
            mode = "read_write" if written else "read"
            src += f"@group(0) @binding({b}) var<storage, {mode}> {name}: array<{elem}>;\n"
            b += 1
    if params:
        src += f"@group(0) @binding({b}) var<uniform> p: Params;\n"
        b += 1
    return src, b


def weights_decls(kind: str, nw: int, first: int,
                  decls: Callable[[str, int, str], tuple[str, int]] = weight_decls) -> tuple[str, int]:
    """Declarations of ``nw`` weights (tags 0, 1) from binding ``first``, as ``decls`` declares one;
    (WGSL, the next binding)."""
    src, b = "", first
    for w in range(nw):
        decl, used = decls(kind, b, str(w))
        src += decl
        b += used
    return src, b


def _io_decls(kind: str, vec: bool, swiglu: bool, norm: bool, bias: bool, residual: bool,
              decls: Callable[[str, int, str], tuple[str, int]] = weight_decls) -> str:
    """Bindings of a linear kernel: x, the weight(s) (as ``decls`` declares them), [g], [bias], [residual],
    y, params."""
    xt = "vec4<f32>" if vec else "f32"
    weights, b = weights_decls(kind, 2 if swiglu else 1, 1, decls)
    rest, _ = buffer_decls(b, [("g", xt, False) if norm else None, ("bias", "f32", False) if bias else None,
                               ("res", "f32", False) if residual else None, ("y", "f32", True)])
    return f"@group(0) @binding(0) var<storage, read> x: array<{xt}>;\n" + weights + rest


def store_fn(swiglu: bool, bias: bool, residual: bool) -> str:
    """WGSL of ``fn store(m, n, a0, a1, scale)``: y[m, n] from the dot product(s) a0 (a1)."""
    if swiglu:
        val = "silu(a0 * scale) * (a1 * scale)"
    else:
        val = "a0 * scale" + (" + bias[n]" if bias else "") + (" + res[m * p.n + n]" if residual else "")
    return f"fn store(m: u32, n: u32, a0: f32, a1: f32, scale: f32) {{ y[m * p.n + n] = {val}; }}\n"


def _combine_lines(mrows: int, heads: int, d: int, splits: int) -> list[str]:
    """The units GEMV's prologue that combines a split attention's partial rows (``x``, rows of D +
    :data:`SPLIT_ROW_PAD` floats a (query row, head, split)) into the activations ``xs`` in workgroup
    memory: each (row, head)'s split weights 2^(m_i - M) / sum_j l_j 2^(m_j - M) first (``cw``), then
    x[row, head * D + c] = sum_i acc_i[c] * w_i, as :func:`attention_combine` computes it."""
    st4, d4, k4 = (d + SPLIT_ROW_PAD) // 4, d // 4, heads * d // 4
    return [
        f"    for (var e = li; e < {mrows * heads}u; e += WG) {{  // the splits' weights of (row, head) e",
        f"        let b = ((p.m0 + e / {heads}u) * {heads}u + e % {heads}u) * {splits}u;",
        f"        var mx = {_NEG};",
        f"        for (var i = 0u; i < {splits}u; i++) {{ mx = max(mx, x[(b + i) * {st4}u + {d4}u].x); }}",
        "        var l = 0.0;",
        f"        for (var i = 0u; i < {splits}u; i++) {{",
        f"            let ml = x[(b + i) * {st4}u + {d4}u];",
        "            let wi = exp2(ml.x - mx);",
        f"            cw[e * {splits}u + i] = wi;",
        "            l += ml.y * wi;",
        "        }",
        f"        for (var i = 0u; i < {splits}u; i++) {{ cw[e * {splits}u + i] = cw[e * {splits}u + i] / l; }}",
        "    }",
        "    workgroupBarrier();",
        f"    for (var e = li; e < {mrows * k4}u; e += WG) {{  // vec4 e of the combined rows",
        f"        let r = e / {k4}u;",
        f"        let h = (e % {k4}u) / {d4}u;",
        f"        let b = ((p.m0 + r) * {heads}u + h) * {splits}u;",
        "        var a = vec4<f32>(0.0);",
        f"        for (var i = 0u; i < {splits}u; i++) {{",
        f"            a += x[(b + i) * {st4}u + e % {d4}u] * cw[(r * {heads}u + h) * {splits}u + i];",
        "        }",
        "        xs[e] = a;",
        "    }",
        "    workgroupBarrier();",
    ]


def combine_bytes(mrows: int, heads: int, d: int, splits: int) -> int:
    """Workgroup memory :func:`linear_gemv`'s ``combine`` prologue takes: the combined rows and the
    splits' weights."""
    return 4 * mrows * (heads * d + heads * splits)


@lru_cache(maxsize=None)
def linear_gemv(kind: str, mrows: int, rows: int, threads: int, vec: bool, swiglu: bool, norm: bool,
                bias: bool, residual: bool, subgroups: int, rope: str = "", unroll: int = 1,
                combine: tuple[int, int, int] | None = None) -> str:
    """y[M, N] = x[M, K] @ W.T for small M: a workgroup of ``threads`` per ``rows`` output rows.

    Thread t takes units t, t + threads, ... of every row of its workgroup (consecutive
    threads read consecutive weight words), dequantizes each in registers and dots it
    with the ``mrows`` activation rows; the partial sums meet through subgroupAdd and
    workgroup memory (``subgroups``: the device's smallest subgroup size, which sizes the
    workgroup memory that the subgroups' sums meet in; 0: none) or a workgroup-memory tree. ``norm``: x is
    RMS-normalised on the fly (x * g, and the dot products scaled by
    1 / sqrt(mean(x^2) + eps), the sum of squares reduced with them).
    ``swiglu``: two weights (gate, up), y = silu(x Wg^T) * (x Wu^T).

    ``unroll``: while ``unroll`` units are left a thread, it loads all their activations and weights
    (rows clamped to the last: a row past N is never stored) before it multiplies them, then walks
    the rest a unit at a time; so a long row costs a memory latency per ``unroll`` units.

    ``rope`` (``"f32"`` or ``"f16"``: the KV cache's type; ``rows`` 4): the fused QKV projection with
    RoPE and the KV-cache write, as :func:`linear_gemv_lanes` has it: workgroup w takes rows ``2j,
    2j + 1, 2j + D/2, 2j + 1 + D/2`` of head w // (D/4) (j = w mod D/4), and its thread 0 rotates
    and writes them for every activation row.

    ``combine`` ``(heads, D, splits)`` (``vec``, no ``rope``): x is a split attention's partial rows
    ([M, heads, splits, D + :data:`SPLIT_ROW_PAD`]), combined into workgroup memory by a prologue
    (:func:`_combine_lines`) and multiplied from there: the attention's combine pass is not a
    dispatch of its own.
    """
    if rope and (rows != 4 or swiglu or residual or rope not in ("f32", "f16")):
        raise ValueError(f"linear_gemv: rope ({rope!r}) takes 4 rows a workgroup, no SwiGLU and no residual")
    if combine and (rope or not vec):
        raise ValueError("linear_gemv: combine needs rows of a multiple of 8 (vec) and no rope")
    nw = 2 if swiglu else 1
    vals = [f"a{w}_{r}_{m}" for w in range(nw) for r in range(rows) for m in range(mrows)]
    if norm:
        vals += [f"ss_{m}" for m in range(mrows)]
    nv = len(vals)
    lines = _combine_lines(mrows, *combine) if combine else []
    if rope:
        lines.append("    let gs = hetero_workgroup_id(wid).x;")
        lines.append("    let head = gs / (p.d / 4u);")
        lines.append("    let i0 = (gs % (p.d / 4u)) * 2u;")
        lines.append("    let half = p.d / 2u;")
        lines.append("    let n0 = head * p.d + i0;")
        row = ["n0", "n0 + 1u", "n0 + half", "n0 + half + 1u"]
    else:
        lines.append("    let n0 = hetero_workgroup_id(wid).x * ROWS;")
        row = [f"n0 + {r}u" for r in range(rows)]
    for v in vals:
        lines.append(f"    var {v} = 0.0;")
    lines.append("    var u = li;")
    if unroll > 1:  # every load of `unroll` units first, then their products
        for r in range(rows):
            lines.append(f"    let rc{r} = min({row[r]}, p.n - 1u);")
        lines.append(f"    while (u + {unroll - 1}u * WG < p.units) {{")
        for t in range(unroll):
            ut = f"u + {t}u * WG" if t else "u"
            lines.append(f"        let o{t} = xoff({ut});")
            for m in range(mrows):
                lines.append(f"        var xa{m}_{t} = xv(p.m0 + {m}u, o{t}.x);")
                lines.append(f"        var xb{m}_{t} = xv(p.m0 + {m}u, o{t}.y);")
            if norm:
                lines.append(f"        let ga{t} = gv(o{t}.x);")
                lines.append(f"        let gb{t} = gv(o{t}.y);")
            for r in range(rows):
                for w in range(nw):
                    lines.append(f"        let w{w}_{r}_{t} = wunit{w}(rc{r}, {ut});")
        for t in range(unroll):
            for m in range(mrows):
                if norm:
                    lines.append(f"        ss_{m} += dot(xa{m}_{t}, xa{m}_{t}) + dot(xb{m}_{t}, xb{m}_{t});")
                    lines.append(f"        xa{m}_{t} *= ga{t}; xb{m}_{t} *= gb{t};")
            for r in range(rows):
                for w in range(nw):
                    for m in range(mrows):
                        lines.append(f"        a{w}_{r}_{m} += dot(w{w}_{r}_{t}.lo, xa{m}_{t}) + "
                                     f"dot(w{w}_{r}_{t}.hi, xb{m}_{t});")
        lines.append(f"        u += {unroll}u * WG;")
        lines.append("    }")
    lines.append("    for (; u < p.units; u += WG) {")
    lines.append("        let o = xoff(u);")
    for m in range(mrows):
        lines.append(f"        var xa{m} = xv(p.m0 + {m}u, o.x);")
        lines.append(f"        var xb{m} = xv(p.m0 + {m}u, o.y);")
        if norm:
            lines.append(f"        ss_{m} += dot(xa{m}, xa{m}) + dot(xb{m}, xb{m});")
    if norm:
        lines.append("        let ga = gv(o.x);")
        lines.append("        let gb = gv(o.y);")
        for m in range(mrows):
            lines.append(f"        xa{m} *= ga; xb{m} *= gb;")
    for r in range(rows):
        lines.append(f"        if ({row[r]} < p.n) {{")
        for w in range(nw):
            lines.append(f"            let w{w}_{r} = wunit{w}({row[r]}, u);")
            for m in range(mrows):
                lines.append(f"            a{w}_{r}_{m} += dot(w{w}_{r}.lo, xa{m}) + dot(w{w}_{r}.hi, xb{m});")
        lines.append("        }")
    lines.append("    }")
    # reduction of the nv values over the workgroup into tot[]
    if subgroups:
        for j, v in enumerate(vals):
            lines.append(f"    let s{j} = subgroupAdd({v});")
        lines.append("    if (lane == 0u) {")
        for j in range(nv):
            lines.append(f"        red[sid * NV + {j}u] = s{j};")
        lines.append("    }")
        lines.append("    workgroupBarrier();")
        lines.append("    for (var j = li; j < NV; j += WG) {")
        lines.append("        var t = 0.0;")
        lines.append("        for (var i = 0u; i < nsg; i++) { t += red[i * NV + j]; }")
        lines.append("        tot[j] = t;")
        lines.append("    }")
        red_size = f"{max(1, threads // subgroups)}u * NV"  # one slot a subgroup and value
        args = (", @builtin(subgroup_invocation_id) lane: u32, @builtin(subgroup_id) sid: u32, "
                "@builtin(num_subgroups) nsg: u32")
    else:
        chunk = 8
        red_size = f"WG * {chunk}u"
        for c0 in range(0, nv, chunk):
            part = vals[c0:c0 + chunk]
            for j, v in enumerate(part):
                lines.append(f"    red[{j}u * WG + li] = {v};")
            lines.append("    workgroupBarrier();")
            lines.append("    for (var s = WG / 2u; s > 0u; s >>= 1u) {")
            lines.append("        if (li < s) {")
            for j in range(len(part)):
                lines.append(f"            red[{j}u * WG + li] += red[{j}u * WG + li + s];")
            lines.append("        }")
            lines.append("        workgroupBarrier();")
            lines.append("    }")
            lines.append("    if (li == 0u) {")
            for j in range(len(part)):
                lines.append(f"        tot[{c0 + j}u] = red[{j}u * WG];")
            lines.append("    }")
            lines.append("    workgroupBarrier();")
        args = ""
    lines.append("    workgroupBarrier();")
    if rope:  # thread 0 rotates the four rows of every activation row and writes them
        lines.append("    if (li == 0u) {")
        for m in range(mrows):
            sc = f"inverseSqrt(tot[{rows * mrows + m}u] / f32(p.k) + p.eps)" if norm else "1.0"
            lines.append(f"        let sc{m} = {sc};")
            for r in range(rows):
                lines.append(f"        let a0_{r}_{m} = tot[{r * mrows + m}u];")
        lines += _rope_epilogue(rope, mrows, bias)
        lines.append("    }")
        return _gemv_source(kind, lines, threads, rows, mrows, nv, red_size, args, vec, norm,
                            _LINEAR_ROPE_PARAMS + _rope_io_decls(kind, vec, norm, bias, rope, weight_decls) + SINCOS)
    # outputs: thread j < rows * mrows writes (r, m)
    lines.append("    if (li < ROWS * MR) {")
    lines.append("        let r = li / MR;")
    lines.append("        let m = li % MR;")
    lines.append("        let n = n0 + r;")
    lines.append("        if (n < p.n) {")
    if norm:
        lines.append(f"            let scale = inverseSqrt(tot[{nw * rows * mrows}u + m] / f32(p.k) + p.eps);")
    else:
        lines.append("            let scale = 1.0;")
    a1 = f"tot[{rows * mrows}u + li]" if swiglu else "0.0"
    lines.append(f"            store(p.m0 + m, n, tot[li], {a1}, scale);")
    lines.append("        }")
    lines.append("    }")
    return _gemv_source(kind, lines, threads, rows, mrows, nv, red_size, args, vec, norm,
                        LINEAR_PARAMS + _io_decls(kind, vec, swiglu, norm, bias, residual)
                        + (weight_fns(kind, "1") if swiglu else "") + store_fn(swiglu, bias, residual), combine)


def _gemv_source(kind: str, lines: list[str], threads: int, rows: int, mrows: int, nv: int, red_size: str,
                 args: str, vec: bool, norm: bool, head: str, combine: tuple[int, int, int] | None = None) -> str:
    """The units GEMV's WGSL around its body ``lines``; ``head``: its params, bindings and epilogue;
    ``combine``: x is read from the combined rows in workgroup memory (``xs``)."""
    body = "\n".join(lines)
    if combine:
        heads, d, splits = combine
        reader = (f"var<workgroup> xs: array<vec4<f32>, {mrows * heads * d // 4}>;\n"
                  f"var<workgroup> cw: array<f32, {mrows * heads * splits}>;\n"
                  f"fn xv(m: u32, k: u32) -> vec4<f32> {{ return xs[(m - p.m0) * {heads * d // 4}u + k / 4u]; }}\n")
    else:
        reader = _x_reader(vec)
    src = (COMMON + head + weight_fns(kind, "0") + _xoff(kind) + reader
           + (_g_reader(vec) if norm else "")
           + f"""
const WG: u32 = {threads}u;
const ROWS: u32 = {rows}u;
const MR: u32 = {mrows}u;
const NV: u32 = {nv}u;
var<workgroup> red: array<f32, {red_size}>;
var<workgroup> tot: array<f32, NV>;

@compute @workgroup_size({threads})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32{args}) {{
{body}
}}
""")
    return src


# -- the lanes GEMV (decode): a few lanes a row, 16-byte weight loads, dequantized in registers ----
def lane_weight_decls(kind: str, first: int, tag: str) -> tuple[str, int]:
    """Declarations of a weight's arrays for :func:`linear_gemv_lanes`: the same buffers as
    :func:`weight_decls`, the values read as 16-byte vectors (vec4<u32>; vec4<f32> for f32)."""
    if kind == "f32":
        return f"@group(0) @binding({first}) var<storage, read> w{tag}: array<vec4<f32>>;\n", 1
    if kind == "f16":
        return f"@group(0) @binding({first}) var<storage, read> w{tag}: array<vec4<u32>>;\n", 1
    src = (f"@group(0) @binding({first}) var<storage, read> qs{tag}: array<vec4<u32>>;\n"
           f"@group(0) @binding({first + 1}) var<storage, read> d{tag}: array<f32>;\n")
    if kind == "q4_1":
        return src + f"@group(0) @binding({first + 2}) var<storage, read> m{tag}: array<f32>;\n", 3
    return src, 2


def _lane_chunk(kind: str, j: int, nw: int, rows: int, mrows: int, norm: bool) -> list[str]:
    """WGSL adding chunk ``c + j * L`` of the slot's rows to the accumulators ``a{w}_{r}_{m}`` (and the
    sums of squares ``ss_{m}``). A chunk is one quantization block of 32 weights (q8_0: two
    16-byte loads, q4: one) or 8 weights of a float kind (f16: one 16-byte load, f32: two). A
    chunk past the row (the unrolled tail) reads chunk 0 and counts for nothing (factor 0)."""
    quant = kind not in ("f32", "f16")
    nch = "p.blocks" if quant else "p.units"
    L: list[str] = []
    L.append(f"        let c{j} = c + {j}u * L;")
    L.append(f"        let f{j} = select(0.0, 1.0, c{j} < {nch});")
    L.append(f"        let k{j} = select(0u, c{j}, c{j} < {nch});")
    L.append(f"        let kb{j} = k{j} * {32 if quant else 8}u;")
    ws = [(w, r) for w in range(nw) for r in range(rows)]
    # every load of the chunk first (the rows' weights and scales), then the arithmetic
    for w, r in ws:
        if kind == "f32":
            L.append(f"        let wa{w}_{r}_{j} = w{w}[(rr{r} * p.units + k{j}) * 2u];")
            L.append(f"        let wb{w}_{r}_{j} = w{w}[(rr{r} * p.units + k{j}) * 2u + 1u];")
        elif kind == "f16":
            L.append(f"        let wv{w}_{r}_{j} = w{w}[rr{r} * p.units + k{j}];")
        elif kind == "q8_0":
            L.append(f"        let qa{w}_{r}_{j} = qs{w}[(rr{r} * p.blocks + k{j}) * 2u];")
            L.append(f"        let qb{w}_{r}_{j} = qs{w}[(rr{r} * p.blocks + k{j}) * 2u + 1u];")
        else:
            L.append(f"        let qa{w}_{r}_{j} = qs{w}[rr{r} * p.blocks + k{j}];")
        if quant:
            L.append(f"        let s{w}_{r}_{j} = d{w}[rr{r} * p.blocks + k{j}] * f{j};")
        if kind == "q4_1":
            L.append(f"        let o{w}_{r}_{j} = m{w}[rr{r} * p.blocks + k{j}] * f{j};")
    for m in range(mrows):
        for w, r in ws:
            L.append(f"        var t{w}_{r}_{m}_{j} = 0.0;")
        if kind in ("q4_0", "q4_1"):
            L.append(f"        var sx{m}_{j} = vec4<f32>(0.0);")
        if norm:
            L.append(f"        var cs{m}_{j} = 0.0;")
    comp = "xyzw"
    # steps of the chunk: (x offsets in the chunk, WGSL of each (w, r)'s weights as vec4s)
    steps: list[tuple[list[int], dict[tuple[int, int], list[str]]]] = []
    if kind == "f32":
        steps.append(([0, 4], {(w, r): [f"wa{w}_{r}_{j}", f"wb{w}_{r}_{j}"] for w, r in ws}))
    elif kind == "f16":
        steps.append(([0, 4], {(w, r): [
            f"vec4<f32>(unpack2x16float(wv{w}_{r}_{j}.x), unpack2x16float(wv{w}_{r}_{j}.y))",
            f"vec4<f32>(unpack2x16float(wv{w}_{r}_{j}.z), unpack2x16float(wv{w}_{r}_{j}.w))"] for w, r in ws}))
    elif kind == "q8_0":
        for i in range(8):
            src = "qa" if i < 4 else "qb"
            steps.append(([4 * i], {(w, r): [f"i8x4({src}{w}_{r}_{j}.{comp[i % 4]})"] for w, r in ws}))
    else:
        for i in range(4):
            steps.append(([4 * i, 16 + 4 * i], {(w, r): [
                f"vec4<f32>((vec4<u32>(qa{w}_{r}_{j}.{comp[i]}) >> vec4<u32>(0u, 8u, 16u, 24u)) & vec4<u32>(15u))",
                f"vec4<f32>((vec4<u32>(qa{w}_{r}_{j}.{comp[i]}) >> vec4<u32>(4u, 12u, 20u, 28u)) & vec4<u32>(15u))"]
                for w, r in ws}))
    for i, (offs, wv) in enumerate(steps):
        L.append("        {")
        if norm:
            for e, off in enumerate(offs):
                L.append(f"            let g{e} = gv(kb{j} + {off}u);")
        for (w, r), exprs in wv.items():
            for e, ex in enumerate(exprs):
                L.append(f"            let q{w}_{r}_{e} = {ex};")
        for m in range(mrows):
            for e, off in enumerate(offs):
                L.append(f"            let x{m}_{e}r = xv(p.m0 + {m}u, kb{j} + {off}u);")
                if norm:
                    L.append(f"            cs{m}_{j} += dot(x{m}_{e}r, x{m}_{e}r);")
                    L.append(f"            let x{m}_{e} = x{m}_{e}r * g{e};")
                else:
                    L.append(f"            let x{m}_{e} = x{m}_{e}r;")
            if kind in ("q4_0", "q4_1"):
                L.append(f"            sx{m}_{j} += x{m}_0 + x{m}_1;")
            for w, r in ws:
                terms = " + ".join(f"dot(q{w}_{r}_{e}, x{m}_{e})" for e in range(len(offs)))
                L.append(f"            t{w}_{r}_{m}_{j} += {terms};")
        L.append("        }")
    for m in range(mrows):
        if kind in ("q4_0", "q4_1"):
            L.append(f"        let sxs{m}_{j} = dot(sx{m}_{j}, vec4<f32>(1.0));")
        for w, r in ws:
            t = f"t{w}_{r}_{m}_{j}"
            if kind == "q4_1":
                L.append(f"        a{w}_{r}_{m} += s{w}_{r}_{j} * {t} + o{w}_{r}_{j} * sxs{m}_{j};")
            elif kind == "q4_0":
                L.append(f"        a{w}_{r}_{m} += s{w}_{r}_{j} * ({t} - 8.0 * sxs{m}_{j});")
            elif kind == "q8_0":
                L.append(f"        a{w}_{r}_{m} += s{w}_{r}_{j} * {t};")
            else:
                L.append(f"        a{w}_{r}_{m} += f{j} * {t};")
        if norm:
            L.append(f"        ss_{m} += f{j} * cs{m}_{j};")
    return L


_LINEAR_ROPE_PARAMS = """struct Params { m: u32, n: u32, k: u32, units: u32, blocks: u32, eps: f32, m0: u32, ks: u32,
                 d: u32, hq: u32, hkv: u32, pad0: u32 }
"""


def _rope_io_decls(kind: str, vec: bool, norm: bool, bias: bool, cache: str,
                   decls: Callable[[str, int, str], tuple[str, int]] | None = None) -> str:
    """Bindings of the fused QKV + RoPE + KV write: x, the weight (as ``decls`` declares it: the lanes
    kernel's by default), [g], [bias], pos, inv_freq, slots, qo, kc, vc, params."""
    xt = "vec4<f32>" if vec else "f32"
    src = f"@group(0) @binding(0) var<storage, read> x: array<{xt}>;\n"
    decl, b = (decls or lane_weight_decls)(kind, 1, "0")
    src += decl
    b += 1
    if norm:
        src += f"@group(0) @binding({b}) var<storage, read> g: array<{xt}>;\n"
        b += 1
    if bias:
        src += f"@group(0) @binding({b}) var<storage, read> bias: array<f32>;\n"
        b += 1
    ct = "u32" if cache == "f16" else "f32"
    for name, t, mode in (("pos", "i32", "read"), ("inv_freq", "f32", "read"), ("slots", "i32", "read"),
                          ("qo", "f32", "read_write"), ("kc", ct, "read_write"), ("vc", ct, "read_write")):
        src += f"@group(0) @binding({b}) var<storage, {mode}> {name}: array<{t}>;\n"
        b += 1
    return src + f"@group(0) @binding({b}) var<uniform> p: Params;\n"


def _rope_epilogue(cache: str, mrows: int, bias: bool, row: str = "p.m0") -> list[str]:
    """WGSL (inside lane 0's store block) rotating the slot's two pairs of each activation row and
    writing them: q to qo, k rotated and v as is to the row's cache slot (rows ``row + m``)."""
    L = ["        if (head < p.hq + 2u * p.hkv) {"]
    for m in range(mrows):
        L.append("        {")
        L.append(f"            let t = {row} + {m}u;")
        for r, off in enumerate(("0u", "1u", "half", "half + 1u")):
            b = f" + bias[n0 + {off}]" if bias else ""
            L.append(f"            let y{r} = a0_{r}_{m} * sc{m}{b};")
        L.append("            let cs0 = sincos(f32(pos[t]) * inv_freq[i0]);")
        L.append("            let cs1 = sincos(f32(pos[t]) * inv_freq[i0 + 1u]);")
        L.append("            let ra = y0 * cs0.y - y2 * cs0.x; let rb = y1 * cs1.y - y3 * cs1.x;")
        L.append("            let rc = y2 * cs0.y + y0 * cs0.x; let rd = y3 * cs1.y + y1 * cs1.x;")
        L.append("            if (head < p.hq) {")
        L.append("                let o = (t * p.hq + head) * p.d + i0;")
        L.append("                qo[o] = ra; qo[o + 1u] = rb; qo[o + half] = rc; qo[o + half + 1u] = rd;")
        L.append("            } else {")
        L.append("                let isk = head < p.hq + p.hkv;")
        L.append("                let hh = select(head - p.hq - p.hkv, head - p.hq, isk);")
        L.append("                let o = (u32(slots[t]) * p.hkv + hh) * p.d + i0;")
        L.append("                let v0 = select(y0, ra, isk); let v1 = select(y1, rb, isk);")
        L.append("                let v2 = select(y2, rc, isk); let v3 = select(y3, rd, isk);")
        if cache == "f16":
            L.append("                let lo = pack2x16float(vec2<f32>(v0, v1));")
            L.append("                let hi = pack2x16float(vec2<f32>(v2, v3));")
            L.append("                if (isk) { kc[o / 2u] = lo; kc[(o + half) / 2u] = hi; } "
                     "else { vc[o / 2u] = lo; vc[(o + half) / 2u] = hi; }")
        else:
            L.append("                if (isk) { kc[o] = v0; kc[o + 1u] = v1; kc[o + half] = v2; kc[o + half + 1u] = v3; }")
            L.append("                else { vc[o] = v0; vc[o + 1u] = v1; vc[o + half] = v2; vc[o + half + 1u] = v3; }")
        L.append("            }")
        L.append("        }")
    L.append("        }")
    return L


@lru_cache(maxsize=None)
def linear_gemv_lanes(kind: str, mrows: int, rows: int, lanes: int, threads: int, unroll: int, vec: bool,
                      swiglu: bool, norm: bool, bias: bool, residual: bool, subgroups: bool, rope: str = "") -> str:
    """y[M, N] = x[M, K] @ W.T for small M (decode): ``lanes`` threads a row.

    A workgroup of ``threads`` holds ``threads / lanes`` slots of ``lanes`` threads; a slot
    computes ``rows`` output rows for all ``mrows`` activation rows. Lane l of a slot takes
    chunks l, l + lanes, ... of its rows (a chunk: one quantization block of 32 weights, or 8
    weights of a float kind), ``unroll`` chunks an iteration with every load issued first: its
    rows' 16-byte weight vectors and scales, then the activations (shared by the rows), then
    the dequantization and dot products in registers. A Q4 block's dot product is
    ``d * sum(q x) + m * sum(x)`` (Q4_0: ``m = -8 d``), one multiply by each scale a block.
    The lanes' partial sums meet by ``subgroupShuffleXor`` in log2(lanes) steps (``subgroups``:
    a slot is ``lanes`` consecutive invocations of one subgroup, found from the subgroup
    builtins, so lanes must be at most the device's smallest subgroup size; no workgroup memory
    and no barrier), or else by a tree in workgroup memory. ``norm`` folds the RMSNorm of x in
    as :func:`linear_gemv` does (the slot's lanes cover K once between them, so each slot has
    the whole sum of squares). Rows past N read row N - 1 and are not stored.

    ``rope`` (``"f32"`` or ``"f16"``: the KV cache's type; ``rows`` 4): the fused QKV projection
    with RoPE and the KV-cache write in its epilogue. Slot s of head h takes rows ``2j, 2j + 1,
    2j + D/2, 2j + 1 + D/2`` of the head (j = s mod D/4): two rotate_half pairs, and whole f16
    words of the cache. q heads go rotated to ``qo`` [T, HQ, D], k heads rotated and v heads as
    they are to their cache slots, as :func:`rope_kv` does.
    """
    if lanes < 1 or lanes & (lanes - 1) or threads % lanes or unroll < 1:
        raise ValueError(f"linear_gemv_lanes: lanes ({lanes}) must be a power of two dividing threads ({threads}), "
                         f"unroll ({unroll}) >= 1")
    if rope and (rows != 4 or swiglu or residual or rope not in ("f32", "f16")):
        raise ValueError(f"linear_gemv_lanes: rope ({rope!r}) takes 4 rows a slot, no SwiGLU and no residual")
    nw = 2 if swiglu else 1
    vals = [f"a{w}_{r}_{m}" for w in range(nw) for r in range(rows) for m in range(mrows)]
    if norm:
        vals += [f"ss_{m}" for m in range(mrows)]
    nv = len(vals)
    L: list[str] = []
    if subgroups:
        L.append("    let slot = sid * (sgs / L) + sl / L;")
        L.append("    let lane = sl % L;")
    else:
        L.append("    let slot = li / L;")
        L.append("    let lane = li % L;")
    if rope:
        L.append("    let gs = hetero_workgroup_id(wid).x * S + slot;")
        L.append("    let head = gs / (p.d / 4u);")
        L.append("    let i0 = (gs % (p.d / 4u)) * 2u;")
        L.append("    let half = p.d / 2u;")
        L.append("    let n0 = head * p.d + i0;")
        offs = ["0u", "1u", "half", "half + 1u"]
        for r in range(rows):
            L.append(f"    let rr{r} = min(n0 + {offs[r]}, p.n - 1u);")
    else:
        L.append("    let n0 = (hetero_workgroup_id(wid).x * S + slot) * RS;")
        for r in range(rows):
            L.append(f"    let rr{r} = min(n0 + {r}u, p.n - 1u);")
    for v in vals:
        L.append(f"    var {v} = 0.0;")
    nch = "p.units" if kind in ("f32", "f16") else "p.blocks"
    L.append(f"    for (var c = lane; c < {nch}; c += L * {unroll}u) {{")
    for j in range(unroll):
        L += _lane_chunk(kind, j, nw, rows, mrows, norm)
    L.append("    }")
    red = ""
    if lanes > 1 and subgroups:
        s = 1
        while s < lanes:
            for v in vals:
                L.append(f"    {v} += subgroupShuffleXor({v}, {s}u);")
            s *= 2
    elif lanes > 1:
        if threads * nv > 4096:
            raise ValueError(f"linear_gemv_lanes: {threads} threads x {nv} sums pass 16 KiB of workgroup memory")
        red = f"var<workgroup> red: array<f32, {threads * nv}>;\n"
        for j, v in enumerate(vals):
            L.append(f"    red[{j}u * WG + li] = {v};")
        L.append("    workgroupBarrier();")
        L.append("    for (var s = L / 2u; s > 0u; s >>= 1u) {")
        L.append("        if (lane < s) {")
        for j in range(nv):
            L.append(f"            red[{j}u * WG + li] += red[{j}u * WG + li + s];")
        L.append("        }")
        L.append("        workgroupBarrier();")
        L.append("    }")
        for j, v in enumerate(vals):
            L.append(f"    {v} = red[{j}u * WG + li];")
    L.append("    if (lane == 0u && slot < S) {")
    for m in range(mrows):
        sc = f"inverseSqrt(ss_{m} / f32(p.k) + p.eps)" if norm else "1.0"
        L.append(f"        let sc{m} = {sc};")
    if rope:
        L += _rope_epilogue(rope, mrows, bias)
    for r in range(rows if not rope else 0):
        L.append(f"        if (n0 + {r}u < p.n) {{")
        for m in range(mrows):
            a1 = f"a1_{r}_{m}" if swiglu else "0.0"
            L.append(f"            store(p.m0 + {m}u, n0 + {r}u, a0_{r}_{m}, {a1}, sc{m});")
        L.append("        }")
    L.append("    }")
    body = "\n".join(L)
    args = (", @builtin(subgroup_invocation_id) sl: u32, @builtin(subgroup_id) sid: u32, "
            "@builtin(subgroup_size) sgs: u32") if subgroups else ""
    if rope:
        head = _LINEAR_ROPE_PARAMS + _rope_io_decls(kind, vec, norm, bias, rope) + SINCOS
    else:
        head = (LINEAR_PARAMS + _io_decls(kind, vec, swiglu, norm, bias, residual, lane_weight_decls)
                + store_fn(swiglu, bias, residual))
    return (COMMON + head + _x_reader(vec) + (_g_reader(vec) if norm else "")
            + f"""
const WG: u32 = {threads}u;
const L: u32 = {lanes}u;
const S: u32 = {threads // lanes}u;
const RS: u32 = {rows}u;
{red}
@compute @workgroup_size({threads})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32{args}) {{
{body}
}}
""")


def tiled_prelude(kind: str, vec: bool, swiglu: bool, norm: bool, bias: bool, residual: bool,
                  partial: bool) -> str:
    """What a tiled linear kernel declares before its workgroup memory and entry point: params,
    bindings (``partial``: x, the weights, [g], ``part``, [``pss``], params, for
    :func:`linear_epilogue`), ``wunit0`` (``wunit1``), ``xoff``, ``xv`` (``gv``) and ``store``
    (not with ``partial``)."""
    if partial:
        xt = "vec4<f32>" if vec else "f32"
        weights, b = weights_decls(kind, 2 if swiglu else 1, 1)
        rest, _ = buffer_decls(b, [("g", xt, False) if norm else None, ("part", "f32", True),
                                   ("pss", "f32", True) if norm else None])
        decls = f"@group(0) @binding(0) var<storage, read> x: array<{xt}>;\n" + weights + rest
        tail = ""
    else:
        decls = _io_decls(kind, vec, swiglu, norm, bias, residual)
        tail = store_fn(swiglu, bias, residual)
    return (COMMON + LINEAR_PARAMS + decls
            + weight_fns(kind, "0") + (weight_fns(kind, "1") if swiglu else "") + _xoff(kind) + _x_reader(vec)
            + (_g_reader(vec) if norm else "") + tail)


@lru_cache(maxsize=None)
def linear_tiled(kind: str, vec: bool, swiglu: bool, norm: bool, bias: bool, residual: bool,
                 partial: bool = False) -> str:
    """y[M, N] = x[M, K] @ W.T for larger M: 32 x 32 output tiles, 64 threads of 4 x 4 outputs each.

    K is walked in chunks of 32 (one quantization block, 4 units): the workgroup loads the
    x tile [32, 32] and dequantizes the weight tile [32, 32] (each of ``swiglu``'s two
    weights) into workgroup memory once, and every thread reuses them for its 16
    outputs. ``norm``: the weight tile is scaled by g (x g w = x (g w)) and each thread
    sums the squares of its 4 rows of x on the way. Workgroup z takes units ``z * p.ks ..``
    of K (``p.ks`` a multiple of 4); ``partial`` (split K): the sums go to ``part``
    ([splits, weights, M, N]) and the sums of squares to ``pss`` ([splits, M]) for
    :func:`linear_epilogue`, which adds the splits and applies the epilogue.
    """
    nw = 2 if swiglu else 1
    L = []
    L.append("    let tile = hetero_workgroup_id(wid);")
    L.append("    let m0 = tile.y * 32u;")
    L.append("    let n0 = tile.x * 32u;")
    L.append("    let tx = li % 8u;")
    L.append("    let ty = li / 8u;")
    for w in range(nw):
        for i in range(4):
            for j in range(4):
                L.append(f"    var c{w}_{i}_{j} = 0.0;")
    if norm:
        for i in range(4):
            L.append(f"    var ss{i} = 0.0;")
    L.append("    let kb0 = tile.z * p.ks;")
    L.append("    let kb1 = min(p.units, kb0 + p.ks);")
    L.append("    for (var kb = kb0; kb < kb1; kb += 4u) {")
    # x tile: 32 rows x 32 k = 256 vec4; thread li loads 4 of them
    L.append("        for (var e = li; e < 256u; e += 64u) {")
    L.append("            let rr = e / 8u;")
    L.append("            let c4 = (e % 8u) * 4u;")
    L.append("            let mm = m0 + rr;")
    L.append("            var v = vec4<f32>(0.0);")
    L.append("            if (mm < p.m) { v = xv(mm, kb * 8u + c4); }")
    L.append("            xs[rr * 33u + c4] = v.x; xs[rr * 33u + c4 + 1u] = v.y;")
    L.append("            xs[rr * 33u + c4 + 2u] = v.z; xs[rr * 33u + c4 + 3u] = v.w;")
    L.append("        }")
    # weight tiles: 32 rows x 4 units = 128 units; thread li dequantizes 2
    L.append("        for (var e = li; e < 128u; e += 64u) {")
    L.append("            let rr = e / 4u;")
    L.append("            let uu = kb + e % 4u;")
    L.append("            let nn = n0 + rr;")
    L.append("            let o = xoff(uu);")
    L.append("            let lo = o.x - kb * 8u;")
    L.append("            let hi = o.y - kb * 8u;")
    if norm:
        L.append("            let ga = gv(o.x);")
        L.append("            let gb = gv(o.y);")
    else:
        L.append("            let ga = vec4<f32>(1.0);")
        L.append("            let gb = vec4<f32>(1.0);")
    for w in range(nw):
        L.append(f"            var q{w} = Unit(vec4<f32>(0.0), vec4<f32>(0.0));")
        L.append(f"            if (nn < p.n && uu < p.units) {{ q{w} = wunit{w}(nn, uu); }}")
        L.append(f"            q{w}.lo *= ga; q{w}.hi *= gb;")
        for c in range(4):
            comp = "xyzw"[c]
            L.append(f"            ws{w}[rr * 33u + lo + {c}u] = q{w}.lo.{comp};")
            L.append(f"            ws{w}[rr * 33u + hi + {c}u] = q{w}.hi.{comp};")
    L.append("        }")
    L.append("        workgroupBarrier();")
    L.append("        for (var kk = 0u; kk < 32u; kk++) {")
    for i in range(4):
        L.append(f"            let a{i} = xs[(ty + {8 * i}u) * 33u + kk];")
        if norm:
            L.append(f"            ss{i} += a{i} * a{i};")
    for w in range(nw):
        for j in range(4):
            L.append(f"            let b{w}_{j} = ws{w}[(tx + {8 * j}u) * 33u + kk];")
        for i in range(4):
            for j in range(4):
                L.append(f"            c{w}_{i}_{j} += a{i} * b{w}_{j};")
    L.append("        }")
    L.append("        workgroupBarrier();")
    L.append("    }")
    for i in range(4):
        L.append(f"    let mr{i} = m0 + ty + {8 * i}u;")
        L.append(f"    if (mr{i} < p.m) {{")
        if partial:
            if norm:
                L.append(f"        if (tx == 0u) {{ pss[tile.z * p.m + mr{i}] = ss{i}; }}")
            for j in range(4):
                L.append(f"        if (n0 + tx + {8 * j}u < p.n) {{")
                for w in range(nw):
                    L.append(f"            part[((tile.z * {nw}u + {w}u) * p.m + mr{i}) * p.n + n0 + tx + {8 * j}u]"
                             f" = c{w}_{i}_{j};")
                L.append("        }")
        else:
            scale = f"inverseSqrt(ss{i} / f32(p.k) + p.eps)" if norm else "1.0"
            L.append(f"        let sc{i} = {scale};")
            for j in range(4):
                a1 = f"c1_{i}_{j}" if swiglu else "0.0"
                L.append(f"        if (n0 + tx + {8 * j}u < p.n) {{ store(mr{i}, n0 + tx + {8 * j}u, c0_{i}_{j}, {a1}, "
                         f"sc{i}); }}")
        L.append("    }")
    body = "\n".join(L)
    ws = "".join(f"var<workgroup> ws{w}: array<f32, {32 * 33}>;\n" for w in range(nw))
    return (tiled_prelude(kind, vec, swiglu, norm, bias, residual, partial)
            + f"""
var<workgroup> xs: array<f32, {32 * 33}>;
{ws}
@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {{
{body}
}}
""")


SPLIT_UNROLL = 4
"""Splits an epilogue pass loads at once before it adds them (the rest one at a time)."""


def split_sums(sums: Sequence[tuple[str, str]], count: str = "p.ks", indent: str = "    ") -> str:
    """WGSL adding, for each ``(acc, index)``, ``src[index]`` over s = 0 .. ``count`` - 1 into the
    declared ``acc`` (``index`` an expression of s, ``src`` named in it: ``"part[...]"``): the
    loads of :data:`SPLIT_UNROLL` splits issued together, then summed, so the pass waits on a
    memory latency per few splits rather than per split. The same order everywhere it is used."""
    u = SPLIT_UNROLL
    out = [f"{indent}var s = 0u;", f"{indent}while (s + {u}u <= {count}) {{"]
    for j, (_, expr) in enumerate(sums):
        for t in range(u):
            out.append(f"{indent}    let l{j}_{t} = {expr.replace('{s}', f'(s + {t}u)')};")
    for j, (acc, _) in enumerate(sums):
        terms = " + ".join(f"l{j}_{t}" for t in range(u))
        out.append(f"{indent}    {acc} += {terms};")
    out += [f"{indent}    s += {u}u;", f"{indent}}}", f"{indent}while (s < {count}) {{"]
    for acc, expr in sums:
        out.append(f"{indent}    {acc} += {expr.replace('{s}', 's')};")
    out += [f"{indent}    s += 1u;", f"{indent}}}"]
    return "\n".join(out)


@lru_cache(maxsize=None)
def linear_epilogue(swiglu: bool, norm: bool, bias: bool, residual: bool) -> str:
    """y[m, n] from a split-K product: the splits' partial sums (and sums of squares) added, then the
    epilogue of :func:`linear_tiled` (norm scale, bias, residual, SwiGLU). A thread an output;
    ``p.ks`` holds the number of splits."""
    nw = 2 if swiglu else 1
    decls = "@group(0) @binding(0) var<storage, read> part: array<f32>;\n"
    b = 1
    if norm:
        decls += f"@group(0) @binding({b}) var<storage, read> pss: array<f32>;\n"
        b += 1
    if bias:
        decls += f"@group(0) @binding({b}) var<storage, read> bias: array<f32>;\n"
        b += 1
    if residual:
        decls += f"@group(0) @binding({b}) var<storage, read> res: array<f32>;\n"
        b += 1
    decls += f"@group(0) @binding({b}) var<storage, read_write> y: array<f32>;\n"
    decls += f"@group(0) @binding({b + 1}) var<uniform> p: Params;\n"
    a1 = "a1" if swiglu else "0.0"
    sums = [("a0", f"part[(({{s}} * {nw}u) * p.m + m) * p.n + n]")]
    if swiglu:
        sums.append(("a1", f"part[(({{s}} * {nw}u + 1u) * p.m + m) * p.n + n]"))
    if norm:
        sums.append(("ss", "pss[{s} * p.m + m]"))
    scale = "let scale = inverseSqrt(ss / f32(p.k) + p.eps);" if norm else "let scale = 1.0;"
    return (COMMON + LINEAR_PARAMS + decls + store_fn(swiglu, bias, residual) + f"""
@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {{
    let i = hetero_workgroup_id(wid).x * 64u + li;
    if (i >= p.m * p.n) {{ return; }}
    let m = i / p.n;
    let n = i % p.n;
    var a0 = 0.0;
    var a1 = 0.0;
    var ss = 0.0;
{split_sums(sums)}
    {scale}
    store(m, n, a0, {a1}, scale);
}}
""")

@lru_cache(maxsize=None)
def linear_epilogue_rope(norm: bool, bias: bool, cache: str) -> str:
    """q, k and v from a split-K product of the fused QKV projection: the splits' partial sums (and
    sums of squares, ``norm``) added, the RMS scale and the bias applied, then :func:`_rope_epilogue`
    (q rotated to qo, k rotated and v to the rows' cache slots). A thread the two rotate_half pairs
    ``2j, 2j + 1, 2j + D/2, 2j + 1 + D/2`` of one head of one row. Bindings part, [pss], [bias], pos,
    inv_freq, slots, qo, kc, vc, params (the fused op's, ``p.ks`` the number of splits)."""
    decls, b = buffer_decls(0, [("part", "f32", False), ("pss", "f32", False) if norm else None,
                                ("bias", "f32", False) if bias else None, ("pos", "i32", False),
                                ("inv_freq", "f32", False), ("slots", "i32", False), ("qo", "f32", True),
                                ("kc", "u32" if cache == "f16" else "f32", True),
                                ("vc", "u32" if cache == "f16" else "f32", True)], params=False)
    decls += f"@group(0) @binding({b}) var<uniform> p: Params;\n"
    sums = [(f"a0_{r}_0", f"part[({{s}} * p.m + row) * p.n + n0 + {off}]")
            for r, off in enumerate(("0u", "1u", "half", "half + 1u"))]
    if norm:
        sums.append(("ss", "pss[{s} * p.m + row]"))
    sc = "    let sc0 = inverseSqrt(ss / f32(p.k) + p.eps);" if norm else "    let sc0 = 1.0;"
    body = "\n".join(_rope_epilogue(cache, 1, bias, row="row"))
    return (COMMON + _LINEAR_ROPE_PARAMS + decls + SINCOS + f"""
@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {{
    let i = hetero_workgroup_id(wid).x * 64u + li;
    let quads = (p.hq + 2u * p.hkv) * (p.d / 4u);
    if (i >= p.m * quads) {{ return; }}
    let row = i / quads;
    let w = i % quads;
    let head = w / (p.d / 4u);
    let i0 = (w % (p.d / 4u)) * 2u;
    let half = p.d / 2u;
    let n0 = head * p.d + i0;
    var a0_0_0 = 0.0; var a0_1_0 = 0.0; var a0_2_0 = 0.0; var a0_3_0 = 0.0;
    var ss = 0.0;
{split_sums(sums)}
{sc}
{body}
}}
""")


# -- RMSNorm --------------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def rmsnorm(residual: bool) -> str:
    """y = v / sqrt(mean(v^2) + eps) * g, v = x (+ residual, also written to h): a workgroup per row."""
    res_decl = ("@group(0) @binding(1) var<storage, read> res: array<f32>;\n" if residual else "")
    b = 2 if residual else 1
    h_decl = f"@group(0) @binding({b + 1}) var<storage, read_write> h: array<f32>;\n" if residual else ""
    y_b = b + 2 if residual else b + 1
    val = "x[row * p.n + i] + res[row * p.n + i]" if residual else "x[row * p.n + i]"
    store_h = "h[row * p.n + i] = v;" if residual else ""
    return f"""
struct Params {{ rows: u32, n: u32, eps: f32, pad: u32 }}
@group(0) @binding(0) var<storage, read> x: array<f32>;
{res_decl}@group(0) @binding({b}) var<storage, read> g: array<f32>;
{h_decl}@group(0) @binding({y_b}) var<storage, read_write> y: array<f32>;
@group(0) @binding({y_b + 1}) var<uniform> p: Params;
var<workgroup> red: array<f32, 64>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {{
    let row = hetero_workgroup_id(wid).x;
    var ss = 0.0;
    for (var i = li; i < p.n; i += 64u) {{
        let v = {val};
        {store_h}
        ss += v * v;
    }}
    red[li] = ss;
    workgroupBarrier();
    for (var s = 32u; s > 0u; s >>= 1u) {{
        if (li < s) {{ red[li] += red[li + s]; }}
        workgroupBarrier();
    }}
    let scale = inverseSqrt(red[0] / f32(p.n) + p.eps);
    for (var i = li; i < p.n; i += 64u) {{
        let v = {val};
        y[row * p.n + i] = v * scale * g[i];
    }}
}}
"""


# -- RoPE and the KV-cache write ------------------------------------------------------------------
def _split_bits(x: float, bits: int) -> float:
    """``x`` truncated to ``bits`` significant bits (an exact float32 with room for products)."""
    import math
    e = math.floor(math.log2(abs(x)))
    scale = 2.0 ** (bits - 1 - e)
    return math.floor(x * scale) / scale


def _pio2_parts() -> tuple[float, float, float]:
    from fractions import Fraction
    import math
    # pi/2 to 40 digits (a constant, not derived from float math.pi)
    pio2 = Fraction("1.5707963267948966192313216916397514420985846996875529104874722961")
    c1 = _split_bits(float(pio2), 12)
    c2 = _split_bits(float(pio2 - Fraction(c1)), 12)
    c3 = float(pio2 - Fraction(c1) - Fraction(c2))
    assert math.isfinite(c3)
    return c1, c2, c3


_C1, _C2, _C3 = _pio2_parts()

SINCOS = f"""
// sin and cos of a float32 angle, accurate (~1e-7) for |a| up to ~1e6: the argument is reduced by
// multiples of pi/2 split in three parts (q * part exact in float32), then minimax polynomials on
// [-pi/4, pi/4]; the builtins' accuracy is only specified on [-pi, pi] (2^-11 absolute).
fn sincos(a: f32) -> vec2<f32> {{
    let q = round(a * 0.636619772367581343);
    let r = ((a - q * {_C1!r}) - q * {_C2!r}) - q * {_C3!r};
    let z = r * r;
    let s = r + r * z * (-1.6666654611e-1 + z * (8.3321608736e-3 + z * -1.9515295891e-4));
    let c = 1.0 - 0.5 * z + z * z * (4.166664568298827e-2 + z * (-1.388731625493765e-3 + z * 2.443315711809948e-5));
    let quad = u32(i32(q) & 3);
    if (quad == 0u) {{ return vec2<f32>(s, c); }}
    if (quad == 1u) {{ return vec2<f32>(c, -s); }}
    if (quad == 2u) {{ return vec2<f32>(-s, -c); }}
    return vec2<f32>(-c, s);
}}
"""


_K_STORE_ROPE = "kc[o] = x1 * cs.y - x2 * cs.x; kc[o + half] = x2 * cs.y + x1 * cs.x;"


@lru_cache(maxsize=None)
def rope_kv(with_q: bool, with_kv: bool, rope_k: bool, f16_cache: bool = False) -> str:
    """RoPE (rotate_half pairs (i, i + D/2)) of q heads into ``qo`` and of k heads, and k, v rows written
    to their cache slots: a thread per (row, head, pair). Heads 0..HQ-1 are q, then HKV k, then HKV v.

    ``f16_cache``: the caches hold f16 pairs in u32 words (``pack2x16float``); a thread of
    an even pair i writes pairs i and i + 1 (whole words; D % 4 == 0), odd ones only rotate q.
    """
    cache_t = "u32" if f16_cache else "f32"
    if f16_cache:
        k_body = f"""if (i % 2u == 1u) {{ return; }}
        let cs1 = sincos(f32(pos[t]) * inv_freq[i + 1u]);
        let x1 = ksrc[a]; let x2 = ksrc[a + half]; let y1 = ksrc[a + 1u]; let y2 = ksrc[a + 1u + half];
        let o = ((slot * p.hkv + hk) * p.d + i) / 2u;
        {"kc[o] = pack2x16float(vec2<f32>(x1 * cs.y - x2 * cs.x, y1 * cs1.y - y2 * cs1.x)); "
         "kc[o + half / 2u] = pack2x16float(vec2<f32>(x2 * cs.y + x1 * cs.x, y2 * cs1.y + y1 * cs1.x));"
         if rope_k else
         "kc[o] = pack2x16float(vec2<f32>(x1, y1)); kc[o + half / 2u] = pack2x16float(vec2<f32>(x2, y2));"}"""
        v_body = """if (i % 2u == 1u) { return; }
    let o = ((slot * p.hkv + hv) * p.d + i) / 2u;
    vc[o] = pack2x16float(vec2<f32>(vsrc[a], vsrc[a + 1u]));
    vc[o + half / 2u] = pack2x16float(vec2<f32>(vsrc[a + half], vsrc[a + half + 1u]));"""
    else:
        k_body = f"""let x1 = ksrc[a];
        let x2 = ksrc[a + half];
        let o = (slot * p.hkv + hk) * p.d + i;
        {_K_STORE_ROPE if rope_k else "kc[o] = x1; kc[o + half] = x2;"}"""
        v_body = """let o = (slot * p.hkv + hv) * p.d + i;
    vc[o] = vsrc[a];
    vc[o + half] = vsrc[a + half];"""
    return f"""
struct Params {{ t: u32, hq: u32, hkv: u32, d: u32,
                 qs: u32, qoff: u32, ks: u32, koff: u32,
                 vs: u32, voff: u32, total: u32, pad: u32 }}
@group(0) @binding(0) var<storage, read> pos: array<i32>;
@group(0) @binding(1) var<storage, read> inv_freq: array<f32>;
@group(0) @binding(2) var<storage, read> slots: array<i32>;
@group(0) @binding(3) var<storage, read> qsrc: array<f32>;
@group(0) @binding(4) var<storage, read> ksrc: array<f32>;
@group(0) @binding(5) var<storage, read> vsrc: array<f32>;
@group(0) @binding(6) var<storage, read_write> qo: array<f32>;
@group(0) @binding(7) var<storage, read_write> kc: array<{cache_t}>;
@group(0) @binding(8) var<storage, read_write> vc: array<{cache_t}>;
@group(0) @binding(9) var<uniform> p: Params;
{SINCOS}
@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {{
    let idx = hetero_workgroup_id(wid).x * 64u + li;
    if (idx >= p.total) {{ return; }}
    let half = p.d / 2u;
    let nh = p.hq + 2u * p.hkv;
    let i = idx % half;
    let j = (idx / half) % nh;
    let t = idx / (half * nh);
    let cs = sincos(f32(pos[t]) * inv_freq[i]);
    if (j < p.hq) {{
        {"" if with_q else "return;"}
        let a = p.qoff + t * p.qs + j * p.d + i;
        let x1 = qsrc[a];
        let x2 = qsrc[a + half];
        let o = (t * p.hq + j) * p.d + i;
        qo[o] = x1 * cs.y - x2 * cs.x;
        qo[o + half] = x2 * cs.y + x1 * cs.x;
        return;
    }}
    {"return;" if not with_kv else ""}
    let slot = u32(slots[t]);
    if (j < p.hq + p.hkv) {{
        let hk = j - p.hq;
        let a = p.koff + t * p.ks + hk * p.d + i;
        {k_body}
        return;
    }}
    let hv = j - p.hq - p.hkv;
    let a = p.voff + t * p.vs + hv * p.d + i;
    {v_body}
}}
"""


# -- paged attention ------------------------------------------------------------------------------
_NEG = "-3.0e38"  # "minus infinity" that stays finite: exp2(_NEG - m) is 0, and _NEG - _NEG is not NaN


def _reduce_lines(vals: list[str], op: str, out: str, subgroups: int, wg: int) -> list[str]:
    """WGSL lines reducing each of ``vals`` (one f32 a thread) over the workgroup with ``op``
    ("max" or "add"); every thread gets the results as ``{out}{i}``."""
    L: list[str] = []
    comb = (lambda a, b: f"max({a}, {b})") if op == "max" else (lambda a, b: f"{a} + {b}")
    n = len(vals)
    if subgroups:
        fn = "subgroupMax" if op == "max" else "subgroupAdd"
        for i, v in enumerate(vals):
            L.append(f"    let sg_{out}{i} = {fn}({v});")
        L.append("    if (lane == 0u) {")
        for i in range(n):
            L.append(f"        red[sid * {n}u + {i}u] = sg_{out}{i};")
        L.append("    }")
        L.append("    workgroupBarrier();")
        for i in range(n):
            L.append(f"    var {out}{i} = red[{i}u];")
        L.append(f"    for (var si = 1u; si < nsg; si++) {{")
        for i in range(n):
            L.append(f"        {out}{i} = {comb(out + str(i), f'red[si * {n}u + {i}u]')};")
        L.append("    }")
        L.append("    workgroupBarrier();")
        return L
    for i, v in enumerate(vals):
        L.append(f"    red[{i}u * {wg}u + li] = {v};")
    L.append("    workgroupBarrier();")
    L.append(f"    for (var s = {wg // 2}u; s > 0u; s >>= 1u) {{")
    L.append("        if (li < s) {")
    for i in range(n):
        here, there = f"red[{i}u * {wg}u + li]", f"red[{i}u * {wg}u + li + s]"
        L.append(f"            {here} = {comb(here, there)};")
    L.append("        }")
    L.append("        workgroupBarrier();")
    L.append("    }")
    for i in range(n):
        L.append(f"    let {out}{i} = red[{i}u * {wg}u];")
    L.append("    workgroupBarrier();")
    return L


ATTN_WG = 64
"""Threads of an attention workgroup, and keys per tile (one key a thread for the scores)."""


@lru_cache(maxsize=None)
def attention(group: int, d: int, partial: bool, subgroups: int, f16_cache: bool = False,
              prefetch: bool = False) -> str:
    """Causal GQA attention of one query row over its sequence's paged keys (or one split of them).

    A workgroup per (query row, KV head, chunk of ``group`` query heads, split) serves the
    query heads that share the KV head, so each key and value is read once for all of them.
    Keys come in tiles of 64: one thread a key for the scores (q in workgroup memory,
    scaled by scale * log2 e), an online softmax per head (running maximum and sum, the
    accumulators rescaled when the maximum rises; exp2), then the values: thread
    (key group kg, column c) accumulates vec4 column c of the values of keys kg, kg + KG,
    ... of the tile (KG = 64 / (D / 4) key groups), and the key groups' sums meet in
    workgroup memory at the end: key rows and value columns in loops of constant trip count, the
    value phase's slots shared through workgroup memory. ``prefetch`` (D <= 64): a thread loads
    its key row and its value rows of a tile together, unrolled, right after the block table
    (each thread reads its value keys' slots there itself), so the values' loads wait for no
    barrier; :func:`attention_prefetches` says where it applies.
    ``partial``: writes (acc, m, l) unnormalised for the combine pass, a row of D + 4 floats a (query
    row, head, split) (:data:`SPLIT_ROW_PAD`: rows start on a vec4, so a consumer can read them
    as vectors), m and l at D and D + 1. ``f16_cache``: K and
    V hold f16 pairs in u32 words (4 values a vec2<u32>).
    """
    wg = ATTN_WG
    kv_t = "vec2<u32>" if f16_cache else "vec4<f32>"
    ld = ("fn ld(w: vec2<u32>) -> vec4<f32> { return vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y)); }"
          if f16_cache else "fn ld(w: vec4<f32>) -> vec4<f32> { return w; }")
    d4 = d // 4
    kg_n = max(1, wg // d4)  # key groups
    per = -(-wg // kg_n)     # keys of a tile per key group
    # prefetch, head_dim <= 64: a thread's key row and its value rows of a tile are loaded at once
    # (their slots read from the block table by the thread itself), so a tile costs one memory round
    # trip after the table, not two; longer rows would not fit in registers, and walk them in loops
    pre = prefetch and attention_prefetches(d)
    G = group
    L: list[str] = []
    L.append("    let w = hetero_workgroup_id(wid).x;")
    L.append("    let split = w % p.nsplit;")
    L.append("    let hc = (w / p.nsplit) % p.chunks;")
    L.append("    let g = (w / (p.nsplit * p.chunks)) % p.hkv;")
    L.append("    let t = w / (p.nsplit * p.chunks * p.hkv);")
    L.append(f"    let h0 = g * (p.hq / p.hkv) + hc * {G}u;  // first query head of this workgroup")
    L.append("    let seq = u32(qseq[t]);")
    L.append("    let ctx = u32(qpos[t]) + 1u;")
    L.append("    let start = split * p.split_keys;")
    L.append("    let end = min(ctx, start + p.split_keys);")
    L.append(f"    for (var e = li; e < {G * d4}u; e += {wg}u) {{")
    L.append(f"        qsh[e] = q[(t * p.hq + h0 + e / {d4}u) * {d4}u + e % {d4}u] * p.scale;")
    L.append("    }")
    L.append(f"    let kg = li / {d4}u;   // key group of the value phase")
    L.append(f"    let col = li % {d4}u;  // vec4 column of the value phase")
    L.append(f"    let vlive = kg < {kg_n}u;")
    L.append("    workgroupBarrier();")
    for h in range(G):
        L.append(f"    var m{h} = {_NEG};")
        L.append(f"    var l{h} = 0.0;")
        L.append(f"    var acc{h} = vec4<f32>(0.0);")
    L.append(f"    for (var kt = start; kt < end; kt += {wg}u) {{")
    L.append("        let j = kt + li;")
    for h in range(G):
        L.append(f"        var s{h} = {_NEG};")
    L.append("        var slot = 0u;  // keys past the end: weight 0, any valid row (the tile's first key)")
    L.append("        let jr = select(kt, j, j < end);")
    L.append("        slot = u32(bt[seq * p.maxb + jr / p.bs]) * p.bs + jr % p.bs;")
    if pre:  # the value rows this thread accumulates: keys kg, kg + KG, ... of the tile (past the end: key kt)
        for i in range(per):
            L.append(f"        let vj{i} = kt + min(kg + {i * kg_n}u, {wg - 1}u);")
            L.append(f"        let vr{i} = select(kt, vj{i}, vj{i} < end);")
            L.append(f"        let vv{i} = ld(vc[((u32(bt[seq * p.maxb + vr{i} / p.bs]) * p.bs + vr{i} % p.bs) * p.hkv"
                     f" + g) * {d4}u + col]);")
    else:
        L.append("        slots[li] = slot;")
    L.append("        if (j < end) {")
    L.append(f"            let base = (slot * p.hkv + g) * {d4}u;")
    for h in range(G):
        L.append(f"            var d{h} = 0.0;")
    if pre:
        for c in range(d4):
            L.append(f"            let kv{c} = ld(kc[base + {c}u]);")
        for c in range(d4):
            for h in range(G):
                L.append(f"            d{h} += dot(qsh[{h * d4 + c}u], kv{c});")
    else:
        L.append(f"            for (var c = 0u; c < {d4}u; c++) {{")
        L.append("                let kv = ld(kc[base + c]);")
        for h in range(G):
            L.append(f"                d{h} += dot(qsh[{h * d4}u + c], kv);")
        L.append("            }")
    for h in range(G):
        L.append(f"            s{h} = d{h};")
    L.append("        }")
    L += ["    " + x for x in _reduce_lines([f"s{h}" for h in range(G)], "max", "tm", subgroups, wg)]
    for h in range(G):
        L.append(f"        let mn{h} = max(m{h}, tm{h});")
        L.append(f"        let al{h} = exp2(m{h} - mn{h});")
        L.append(f"        m{h} = mn{h};")
        L.append(f"        let pr{h} = select(0.0, exp2(s{h} - mn{h}), j < end);")
        L.append(f"        psh[{h}u * {wg}u + li] = pr{h};")
        L.append(f"        acc{h} *= al{h};")
    L += ["    " + x for x in _reduce_lines([f"pr{h}" for h in range(G)], "add", "ts", subgroups, wg)]
    for h in range(G):
        L.append(f"        l{h} = l{h} * al{h} + ts{h};")
    # psh and slots were written before the reductions' barriers: visible here
    L.append("        if (vlive) {")
    if pre:
        for i in range(per):
            L.append(f"            let jj{i} = min(kg + {i * kg_n}u, {wg - 1}u);")
            L.append(f"            let live{i} = kg + {i * kg_n}u < {wg}u;")
            for h in range(G):
                L.append(f"            acc{h} += select(0.0, psh[{h}u * {wg}u + jj{i}], live{i}) * vv{i};")
    else:
        L.append(f"            for (var i = 0u; i < {per}u; i++) {{")
        L.append(f"                let jj = min(kg + i * {kg_n}u, {wg - 1}u);")
        L.append(f"                let live = kg + i * {kg_n}u < {wg}u;")
        L.append(f"                let vv = ld(vc[(slots[jj] * p.hkv + g) * {d4}u + col]);")
        for h in range(G):
            L.append(f"                acc{h} += select(0.0, psh[{h}u * {wg}u + jj], live) * vv;")
        L.append("            }")
    L.append("        }")
    L.append("        workgroupBarrier();")
    L.append("    }")
    # the key groups' accumulators meet in workgroup memory (reusing nothing: its own array)
    L.append("    if (vlive) {")
    for h in range(G):
        L.append(f"        ash[(kg * {G}u + {h}u) * {d4}u + col] = acc{h};")
    L.append("    }")
    L.append("    workgroupBarrier();")
    L.append(f"    for (var e = li; e < {G * d4}u; e += {wg}u) {{")
    L.append(f"        let h = e / {d4}u;")
    L.append(f"        let c = e % {d4}u;")
    L.append("        var a = vec4<f32>(0.0);")
    L.append(f"        for (var k = 0u; k < {kg_n}u; k++) {{ a += ash[(k * {G}u + h) * {d4}u + c]; }}")
    L.append("        var mh = 0.0;")
    L.append("        var lh = 0.0;")
    for h in range(G):
        L.append(f"        if (h == {h}u) {{ mh = m{h}; lh = l{h}; }}")
    L.append("        let hq = h0 + h;")
    if partial:
        L.append(f"        let pb = ((t * p.hq + hq) * p.nsplit + split) * (p.d + {SPLIT_ROW_PAD}u);")
        L.append("        out[pb + 4u * c] = a.x; out[pb + 4u * c + 1u] = a.y;")
        L.append("        out[pb + 4u * c + 2u] = a.z; out[pb + 4u * c + 3u] = a.w;")
        L.append("        if (c == 0u) { out[pb + p.d] = mh; out[pb + p.d + 1u] = lh; }")
    else:
        L.append("        let o = ((t * p.hq + hq) * p.d) + 4u * c;")
        L.append("        let r = a / lh;")
        L.append("        out[o] = r.x; out[o + 1u] = r.y; out[o + 2u] = r.z; out[o + 3u] = r.w;")
    L.append("    }")
    body = "\n".join(L)
    red_size = max(1, wg // subgroups) * G if subgroups else wg * G
    args = (", @builtin(subgroup_invocation_id) lane: u32, @builtin(subgroup_id) sid: u32, "
            "@builtin(num_subgroups) nsg: u32") if subgroups else ""
    return f"""
struct Params {{ t: u32, hq: u32, hkv: u32, d: u32, bs: u32, maxb: u32, nsplit: u32, split_keys: u32,
                 scale: f32, chunks: u32, pad1: u32, pad2: u32 }}
@group(0) @binding(0) var<storage, read> q: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> kc: array<{kv_t}>;
@group(0) @binding(2) var<storage, read> vc: array<{kv_t}>;
{ld}
@group(0) @binding(3) var<storage, read> bt: array<i32>;
@group(0) @binding(4) var<storage, read> qseq: array<i32>;
@group(0) @binding(5) var<storage, read> qpos: array<i32>;
@group(0) @binding(6) var<storage, read_write> out: array<f32>;
@group(0) @binding(7) var<uniform> p: Params;
var<workgroup> qsh: array<vec4<f32>, {G * d4}>;
var<workgroup> ash: array<vec4<f32>, {kg_n * G * d4}>;
var<workgroup> psh: array<f32, {G * wg}>;
var<workgroup> slots: array<u32, {wg}>;
var<workgroup> red: array<f32, {red_size}>;

@compute @workgroup_size({wg})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32{args}) {{
{body}
}}
"""


def attention_prefetches(d: int) -> bool:
    """Whether :func:`attention` with ``prefetch`` loads a tile's rows at once for head_dim ``d``: a
    thread's key row (D / 4 vec4) and value rows (64 / (64 / (D / 4)) of them) fit in registers."""
    d4 = d // 4
    return d4 <= 16 and -(-ATTN_WG // max(1, ATTN_WG // d4)) <= 16


SPLIT_ROW_PAD = 4
"""Floats a split attention's partial row holds past its D values: m, l and two of padding."""


@lru_cache(maxsize=None)
def attention_combine() -> str:
    """Merge the splits' (acc, m, l) of each (query row, head): o = sum acc_i 2^(m_i - M) / sum l_i 2^(m_i - M)."""
    return """
struct Params { rows: u32, d: u32, nsplit: u32, pad: u32 }
@group(0) @binding(0) var<storage, read> part: array<f32>;
@group(0) @binding(1) var<storage, read_write> out: array<f32>;
@group(0) @binding(2) var<uniform> p: Params;
const PAD: u32 = """ + f"{SPLIT_ROW_PAD}u;" + """

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let row = hetero_workgroup_id(wid).x;
    let st = p.d + PAD;
    let base = row * p.nsplit * st;
    var mx = -3.0e38;
    for (var i = 0u; i < p.nsplit; i++) { mx = max(mx, part[base + i * st + p.d]); }
    var l = 0.0;
    for (var i = 0u; i < p.nsplit; i++) { l += part[base + i * st + p.d + 1u] * exp2(part[base + i * st + p.d] - mx); }
    for (var c = li; c < p.d; c += 64u) {
        var a = 0.0;
        for (var i = 0u; i < p.nsplit; i++) { a += part[base + i * st + c] * exp2(part[base + i * st + p.d] - mx); }
        out[row * p.d + c] = a / l;
    }
}
"""


# -- embedding ------------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def embedding(kind: str, chained: bool = False) -> str:
    """out[t, :] = the dequantized row ids[t] of the table: a thread per (row, unit of 8 weights).
    Ids outside [0, V) give rows of zeros. ``chained``: row t's id is ``prev[src[t]]`` where
    ``src[t] >= 0`` (``p.np`` entries in prev; past them, id -1: zeros), ``ids[t]`` elsewhere."""
    decl, used = weight_decls(kind, 1, "0")
    chain = (f"@group(0) @binding({3 + used}) var<storage, read> src: array<i32>;\n"
             f"@group(0) @binding({4 + used}) var<storage, read> prev: array<i32>;\n") if chained else ""
    pick = """var id = ids[t];
    let from_prev = src[t];
    if (from_prev >= 0) { id = select(-1, prev[u32(from_prev)], u32(from_prev) < p.np); }""" if chained \
        else "let id = ids[t];"
    return (COMMON + """
struct Params { t: u32, h: u32, units: u32, blocks: u32, v: u32, np: u32, pad1: u32, pad2: u32 }
@group(0) @binding(0) var<storage, read> ids: array<i32>;
""" + decl + f"""@group(0) @binding({1 + used}) var<storage, read_write> out: array<f32>;
@group(0) @binding({2 + used}) var<uniform> p: Params;
""" + chain + weight_fns(kind, "0") + _xoff(kind) + """
fn put(t: u32, k: u32, v: vec4<f32>) {
    for (var c = 0u; c < 4u; c++) { if (k + c < p.h) { out[t * p.h + k + c] = v[c]; } }
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let idx = hetero_workgroup_id(wid).x * 64u + li;
    if (idx >= p.t * p.units) { return; }
    let t = idx / p.units;
    let u = idx % p.units;
    """ + pick + """
    let o = xoff(u);
    if (id < 0 || u32(id) >= p.v) {
        put(t, o.x, vec4<f32>(0.0));
        put(t, o.y, vec4<f32>(0.0));
        return;
    }
    let w = wunit0(u32(id), u);
    put(t, o.x, w.lo);
    put(t, o.y, w.hi);
}
""")


# -- sampling -------------------------------------------------------------------------------------

HASH = """
// A counter-based random number: lowbias32 (Wellons) chained over (seed, step, token); the same
// triple gives the same number on every adapter (u32 arithmetic wraps).
fn mix32(x0: u32) -> u32 {
    var x = x0;
    x ^= x >> 16u; x *= 0x21f0aaadu; x ^= x >> 15u; x *= 0x735a2d97u; x ^= x >> 15u;
    return x;
}
fn rand_u32(seed: u32, step: u32, tok: u32) -> u32 {
    return mix32(mix32(mix32(seed ^ 0x9e3779b9u) ^ step) ^ tok);
}
"""


def _reg_loads(regs: int) -> str:
    """WGSL reading this thread's vec4s of the row into r0 .. r{regs-1} (NaN as -inf)."""
    return "\n    ".join(f"var r{c} = vec4<f32>(0.0); if (li + {c}u * WG < p.v / 4u) "
                          f"{{ r{c} = clean4(logits[row * (p.v / 4u) + li + {c}u * WG]); }}" for c in range(regs))


def _hist_reduce(sg: int) -> str:
    """WGSL summing the threads' h0..h15 over the workgroup into ``bins`` (then a barrier)."""
    if sg:
        adds = "\n".join(f"        let t{b} = subgroupAdd(h{b});" for b in range(16))
        writes = " ".join(f"hist[sid * 16u + {b}u] = t{b};" for b in range(16))
        return f"""{adds}
        if (lane == 0u) {{ {writes} }}
        workgroupBarrier();
        if (li < 16u) {{
            var t = 0.0;
            for (var j = 0u; j < nsg; j++) {{ t += hist[j * 16u + li]; }}
            bins[li] = t;
        }}"""
    stores = " ".join(f"hist[{b}u * 256u + li % 256u] = h{b};" for b in range(16))
    adds = " ".join(f"hist[{b}u * 256u + li % 256u] += h{b};" for b in range(16))
    return f"""        // the threads' histograms meet in hist (16 bins x 256), 256 threads at a time
        for (var r = 0u; r < WG / 256u; r++) {{
            if (li / 256u == r) {{
                if (r == 0u) {{ {stores} }} else {{ {adds} }}
            }}
            workgroupBarrier();
        }}
        var t = 0.0;
        if (li < 256u) {{
            for (var j = 0u; j < 16u; j++) {{ t += hist[(li / 16u) * 256u + (li % 16u) * 16u + j]; }}
        }}
        workgroupBarrier();  // every partial read before any is overwritten
        if (li < 256u) {{ hist[(li / 16u) * 256u + li % 16u] = t; }}
        workgroupBarrier();
        if (li < 16u) {{
            var t2 = 0.0;
            for (var j = 0u; j < 16u; j++) {{ t2 += hist[li * 256u + j]; }}
            bins[li] = t2;
        }}"""
_CHUNK_BEST = """for (var c = li; c < p.pad0; c += WG) {
        let v = bitcast<f32>(part[(row * p.pad0 + c) * 2u]);
        let i = part[(row * p.pad0 + c) * 2u + 1u];
        if (i != 0xffffffffu && (bi == 0xffffffffu || v > bv)) { bv = v; bi = i; }
    }"""
_GUMBEL = ("if (fkey(v) >= lo) { let u = (f32(rand_u32(seed, step, i) >> 8u) + 0.5) * (1.0 / 16777216.0); "
           "let sc = (v - mx) * inv_t - log(-log(u)); if (sc > gv || gi == 0xffffffffu) { gv = sc; gi = i; } }")


def _argmax_fn(wg: int) -> str:
    """WGSL ``fn argmax2(li, v, i) -> vec2<u32>``: over a workgroup of ``wg`` threads (workgroup arrays
    ``rf`` and ``ru`` of ``wg`` each), the bits of the largest ``v`` and its ``i``; ties go to the lowest
    index, as numpy.argmax (a thread with no value passes -inf and 0xffffffff)."""
    return f"""fn argmax2(li: u32, v: f32, i: u32) -> vec2<u32> {{
    rf[li] = v;
    ru[li] = i;
    workgroupBarrier();
    for (var s = {wg // 2}u; s > 0u; s >>= 1u) {{
        if (li < s) {{
            let bv = rf[li + s];
            let bi = ru[li + s];
            if (bv > rf[li] || (bv == rf[li] && bi < ru[li])) {{ rf[li] = bv; ru[li] = bi; }}
        }}
        workgroupBarrier();
    }}
    let r = vec2<u32>(bitcast<u32>(rf[0]), ru[0]);
    workgroupBarrier();
    return r;
}}
"""


ARGMAX_WG = 256
"""Threads of a workgroup of :func:`argmax_chunks`."""
ARGMAX_LOADS = 4
"""Loads (vec4, or four scalars) a thread of :func:`argmax_chunks` issues at once."""
ARGMAX_CHUNK = ARGMAX_WG * ARGMAX_LOADS * 4
"""Logits a workgroup of :func:`argmax_chunks` takes."""


@lru_cache(maxsize=None)
def argmax_chunks(vec: bool) -> str:
    """Each chunk of :data:`ARGMAX_CHUNK` logits of a row: its largest (NaN as -inf; ties to the lowest
    id) as (value bits, id) pairs in ``part`` [S, chunks, 2]; the grid (chunks, S). Every load of a
    thread is issued at once, so a chunk costs one memory latency and a workgroup tree, and a row's
    chunks run side by side on as many SMs (a sample workgroup walks its row alone)."""
    n4 = ARGMAX_WG * ARGMAX_LOADS  # vec4 (or groups of four scalars) a chunk
    if vec:
        loads = "\n".join(
            f"    let i4_{j} = g.x * {n4}u + li + {j * ARGMAX_WG}u;\n"
            f"    var v{j} = vec4<f32>(bitcast<f32>(0xff800000u));\n"
            f"    if (i4_{j} < p.v / 4u) {{ v{j} = logits[g.y * (p.v / 4u) + i4_{j}]; }}" for j in range(ARGMAX_LOADS))
        visits = "\n".join(
            f"    for (var c = 0u; c < 4u; c++) {{ let i = i4_{j} * 4u + c; let v = clean(v{j}[c]); "
            f"if (i < p.v && (v > bv || bi == 0xffffffffu)) {{ bv = v; bi = i; }} }}" for j in range(ARGMAX_LOADS))
    else:  # four scalars a load group: ids chunk * 4 * n4 + li + k * WG, visited in increasing order
        loads = "\n".join(
            f"    let i_{k} = g.x * {4 * n4}u + li + {k * ARGMAX_WG}u;\n"
            f"    var v{k} = bitcast<f32>(0xff800000u);\n"
            f"    if (i_{k} < p.v) {{ v{k} = clean(logits[g.y * p.v + i_{k}]); }}" for k in range(4 * ARGMAX_LOADS))
        visits = "\n".join(
            f"    if (i_{k} < p.v && (v{k} > bv || bi == 0xffffffffu)) {{ bv = v{k}; bi = i_{k}; }}"
            for k in range(4 * ARGMAX_LOADS))
    return f"""
struct Params {{ s: u32, v: u32, chunks: u32, pad: u32 }}
@group(0) @binding(0) var<storage, read> logits: array<{'vec4<f32>' if vec else 'f32'}>;
@group(0) @binding(1) var<storage, read_write> part: array<u32>;
@group(0) @binding(2) var<uniform> p: Params;
var<workgroup> rf: array<f32, {ARGMAX_WG}>;
var<workgroup> ru: array<u32, {ARGMAX_WG}>;
fn clean(v: f32) -> f32 {{ return select(v, bitcast<f32>(0xff800000u), v != v); }}
{_argmax_fn(ARGMAX_WG)}
@compute @workgroup_size({ARGMAX_WG})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {{
    let g = hetero_workgroup_id(wid);
{loads}
    var bv = bitcast<f32>(0xff800000u);
    var bi = 0xffffffffu;
{visits}
    let best = argmax2(li, bv, bi);
    if (li == 0u) {{
        part[(g.y * p.chunks + g.x) * 2u] = best.x;
        part[(g.y * p.chunks + g.x) * 2u + 1u] = best.y;
    }}
}}
"""


@lru_cache(maxsize=None)
def sample(vec: bool, wg: int = 256, sg: int = 0, regs: int = 0, keep: bool = False, chunks: bool = False) -> str:
    """One token a row of logits: greedy (temperature 0) or top-k / top-p / temperature with Gumbel-max.

    ``vec`` (V % 4 == 0): the row is read as vec4s, four tokens a load; each thread still
    visits its tokens in increasing order (ties go to the lowest id). ``wg``: threads (a
    power of two >= 256): each pass over the row is a serial walk of V / wg tokens a thread.
    ``sg``: the radix histograms are summed with subgroupAdd (the smallest subgroup size; 0:
    through workgroup memory only). ``regs`` (with ``vec``): the row is read once into
    ``regs`` vec4 registers a thread (V <= 4 * wg * regs) and every later pass walks those,
    not memory. ``keep``: each row's id is also written to ``keep`` (binding 4). ``chunks``: the
    row's largest logit comes from :func:`argmax_chunks`' pairs (``part``, the binding after the
    others; ``p.pad0`` chunks a row) instead of a walk over the row, and a greedy row reads nothing
    else.
    """
    kept = " keep[row] = out[row];" if keep else ""

    def each(body: str) -> str:
        """A loop over this thread's tokens of the row: ``body`` sees ``i`` and ``v`` (NaN as -inf)."""
        if regs:
            return "\n    ".join(
                f"for (var q = 0u; q < 4u; q++) {{ let i = (li + {c}u * WG) * 4u + q; "
                f"if (i < p.v) {{ let v = r{c}[q]; {body} }} }}" for c in range(regs))
        if vec:
            return (f"for (var i4 = li; i4 < p.v / 4u; i4 += WG) {{\n"
                    f"        let v4 = logits[row * (p.v / 4u) + i4];\n"
                    f"        for (var c = 0u; c < 4u; c++) {{\n"
                    f"            let i = i4 * 4u + c;\n"
                    f"            let v = clean(v4[c]);\n"
                    f"            {body}\n        }}\n    }}")
        return (f"for (var i = li; i < p.v; i += WG) {{\n        let v = logit(row, i);\n        {body}\n    }}")

    def radix(out: str, goal: str, floor: str, mass: bool) -> str:
        """WGSL setting ``out`` to the largest key t with (count, or softmax mass with ``mass``, of the
        tokens with key >= t and key >= floor) >= goal, found 4 bits at a time from the top: each
        pass histograms the tokens whose key shares the digits found so far (per thread in named
        registers, then summed over the workgroup), and the digit taken is the highest whose
        tokens, with those above, reach the goal (the lowest digit if rounding leaves none)."""
        weight = "exp((v - mx) * inv_t)" if mass else "1.0"
        hist_body = ("let k = fkey(v); "
                     "if ((level == 0u || (k >> (shift + 4u)) == (prefix >> (shift + 4u))) && k >= " + floor + ") { "
                     "let w = " + weight + "; let dg = (k >> shift) & 15u; "
                     + " ".join(f"h{b} += select(0.0, w, dg == {b}u);" for b in range(16)) + " }")
        return f"""{"var " + out + " = 0u;" if out != "lo" else ""}
    {{
    var prefix = 0u;
    var above = 0.0;
    let goal_v = {goal};
    for (var level = 0u; level < 8u; level++) {{
        let shift = 28u - 4u * level;
        {" ".join(f"var h{b} = 0.0;" for b in range(16))}
        // the digits above this level equal the prefix (none at level 0: shift + 4 = 32)
        {each(hist_body)}
{_hist_reduce(sg)}
        workgroupBarrier();
        var dsel = 0u;
        var cum = above;
        var found = false;
        for (var dd = 0u; dd < 16u; dd++) {{
            let d = 15u - dd;
            let c = cum + bins[d];
            if (!found && c >= goal_v) {{ dsel = d; found = true; above = cum; }}
            cum = c;
        }}
        if (!found) {{ dsel = 0u; above = cum - bins[0]; }}
        prefix |= dsel << shift;
        workgroupBarrier();
    }}
    {out} = prefix;
    }}"""

    SG_BUILTINS = (", @builtin(subgroup_invocation_id) lane: u32, @builtin(subgroup_id) sid: u32, "
                   "@builtin(num_subgroups) nsg: u32") if sg else ""
    src = HASH + f"""
struct Params {{ s: u32, v: u32, pad0: u32, pad1: u32 }}
@group(0) @binding(0) var<storage, read> logits: array<{'vec4<f32>' if vec else 'f32'}>;
@group(0) @binding(1) var<storage, read> rp: array<u32>;
@group(0) @binding(2) var<storage, read_write> out: array<i32>;
@group(0) @binding(3) var<uniform> p: Params;
{"@group(0) @binding(4) var<storage, read_write> keep: array<i32>;" if keep else ""}
{f"@group(0) @binding({5 if keep else 4}) var<storage, read> part: array<u32>;" if chunks else ""}
var<workgroup> rf: array<f32, {wg}>;
var<workgroup> ru: array<u32, {wg}>;
const WG: u32 = {wg}u;

// Order-preserving map of a float32 onto u32 (larger float, larger key); NaN is taken as -inf.
fn fkey(f: f32) -> u32 {{
    var b = bitcast<u32>(f);
    if ((b & 0x7fffffffu) > 0x7f800000u) {{ b = 0xff800000u; }}
    return select(b | 0x80000000u, ~b, (b & 0x80000000u) != 0u);
}}
fn clean(v: f32) -> f32 {{ return select(v, bitcast<f32>(0xff800000u), v != v); }}
fn clean4(v: vec4<f32>) -> vec4<f32> {{ return select(v, vec4<f32>(bitcast<f32>(0xff800000u)), v != v); }}
fn logit(row: u32, i: u32) -> f32 {{
    {"return clean(logits[(row * p.v + i) / 4u][i % 4u]);" if vec else "return clean(logits[row * p.v + i]);"}
}}
fn sum_f(li: u32, v: f32) -> f32 {{
    rf[li] = v;
    workgroupBarrier();
    for (var s = {wg // 2}u; s > 0u; s >>= 1u) {{
        if (li < s) {{ rf[li] += rf[li + s]; }}
        workgroupBarrier();
    }}
    let r = rf[0];
    workgroupBarrier();
    return r;
}}
fn sum_u(li: u32, v: u32) -> u32 {{
    ru[li] = v;
    workgroupBarrier();
    for (var s = {wg // 2}u; s > 0u; s >>= 1u) {{
        if (li < s) {{ ru[li] += ru[li + s]; }}
        workgroupBarrier();
    }}
    let r = ru[0];
    workgroupBarrier();
    return r;
}}
{_argmax_fn(wg)}
// the index of the largest value; ties go to the lowest index, as numpy.argmax
fn argmax(li: u32, v: f32, i: u32) -> u32 {{ return argmax2(li, v, i).y; }}

var<workgroup> hist: array<f32, 4096>;
var<workgroup> bins: array<f32, 16>;

@compute @workgroup_size({wg})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32{SG_BUILTINS}) {{
    let row = hetero_workgroup_id(wid).x;
    let n = p.v;
    let temp = bitcast<f32>(rp[row * 8u]);
    let top_k = rp[row * 8u + 1u];
    let top_p = bitcast<f32>(rp[row * 8u + 2u]);
    let seed = rp[row * 8u + 3u];
    let step = rp[row * 8u + 4u];
    {_reg_loads(regs) if not chunks else ""}
    // the largest logit (greedy's answer)
    var bv = bitcast<f32>(0xff800000u);
    var bi = 0xffffffffu;
    {each("if (v > bv || bi == 0xffffffffu) { bv = v; bi = i; }") if not chunks else _CHUNK_BEST}
    let best = argmax(li, bv, bi);
    if (!(temp > 0.0)) {{
        if (li == 0u) {{ out[row] = i32(best);{kept} }}
        return;
    }}
    {_reg_loads(regs) if chunks else ""}
    let mx = logit(row, best);
    let inv_t = 1.0 / temp;
    // top-k: the largest key tk with count(key >= tk) >= k (the k-th largest logit), digit by digit
    // (radix 16, 8 passes): counts are exact in f32 (vocab < 2^24)
    var lo = 0u;
    let hi = fkey(mx);
    if (top_k > 0u && top_k < n) {{
        {radix("lo", "f32(top_k)", "0u", False)}
    }}
    // top-p: the largest key tp whose tokens (of the top-k set) hold at least top_p of its softmax mass
    if (top_p < 1.0) {{
        var z = 0.0;
        {each("if (fkey(v) >= lo) { z += exp((v - mx) * inv_t); }")}
        let goal = top_p * sum_f(li, z);
        {radix("tp", "goal", "lo", True)}
        lo = max(lo, tp);
    }}
    // Gumbel-max over the candidates (key >= lo): argmax of z_i / T - log(-log(u_i))
    var gv = bitcast<f32>(0xff800000u);
    var gi = 0xffffffffu;
    {each(_GUMBEL)}
    let pick = argmax(li, gv, gi);
    if (li == 0u) {{ out[row] = i32(pick);{kept} }}
}}
"""
    return src
