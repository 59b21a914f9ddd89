"""WGSL of hetero's neural-network kernels (:mod:`hetero.kernels.nn`): templates and their generators.

Each generator returns the source of one kernel variant (memoised); the ops in
:mod:`hetero.kernels.nn` choose the variant, compile it and dispatch it. Every kernel
finds its workgroup with ``hetero_workgroup_id``, so hetero may split its grid.
"""

from __future__ import annotations

from functools import lru_cache
from string import Template

from hetero.kernels.wgsl_math import MATH

__all__ = ["WORKGROUP", "attention", "elementwise", "embedding", "embedding_layernorm", "layernorm", "softmax",
           "transpose"]

WORKGROUP = 256
"""Threads per workgroup of every kernel here but attention (``@workgroup_size(256)``)."""

# -- WGSL: elementwise -------------------------------------------------------------------------
_ELEMENTWISE = Template("""
alias T = $T;
struct Params { n: u32, nb: u32, zero: u32, pad: u32 }
@group(0) @binding(0) var<storage, read> x: array<T>;
$SECOND
@group(0) @binding($OUT) var<storage, read_write> dst: array<T>;
@group(0) @binding($PARAMS) var<uniform> p: Params;
$MATH
fn gelu4(v: vec4<f32>) -> vec4<f32> { return vec4<f32>(nn_gelu(v.x), nn_gelu(v.y), nn_gelu(v.z), nn_gelu(v.w)); }
fn erf4(v: vec4<f32>) -> vec4<f32> { return vec4<f32>(nn_erf(v.x), nn_erf(v.y), nn_erf(v.z), nn_erf(v.w)); }

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    nn_zero = p.zero;
    let i = hetero_workgroup_id(wid).x * 256u + li;
    if (i >= p.n) { return; }
    dst[i] = $EXPR;
}
""")

# -- WGSL: row kernels ---------------------------------------------------------------------------
_ROW_COMMON = """
const TPR: u32 = ${TPR}u;   // threads per row
const RPW: u32 = ${RPW}u;   // rows per workgroup
const K: u32 = ${K}u;       // values per thread kept in registers
var<workgroup> red: array<f32, 256>;

// Sum / max of one value per thread over the TPR threads of each row (a tree in
// workgroup memory); every thread gets its row's result. Uniform control flow only.
""" + "".join(Template("""fn row_$NAME(li: u32, v: f32) -> f32 {
    let lane = li % TPR;
    red[li] = v;
    workgroupBarrier();
    for (var s = TPR / 2u; s > 0u; s >>= 1u) {
        if (lane < s) { red[li] = $COMBINE; }
        workgroupBarrier();
    }
    let r = red[li - lane];
    workgroupBarrier();
    return r;
}
""").substitute(NAME=name, COMBINE=combine) for name, combine in (("sum", "red[li] + red[li + s]"),
                                                                   ("max", "max(red[li], red[li + s])")))

_SOFTMAX = Template(_ROW_COMMON + """
struct Params { rows: u32, n: u32, mask_div: u32, scale: f32 }
@group(0) @binding(0) var<storage, read> x: array<f32>;
$MASK_DECL
@group(0) @binding($OUT) var<storage, read_write> y: array<f32>;
@group(0) @binding($PARAMS) var<uniform> p: Params;
$MATH

// x * scale (+ mask), with NaN mapped to +inf: either makes the row's maximum +inf, and the row NaN.
fn val(row: u32, i: u32, mrow: u32) -> f32 {
    var v = x[row * p.n + i] * p.scale;
    $MASK_ADD
    return select(v, nn_inf(), nn_is_nan(v));
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let lane = li % TPR;
    let row = hetero_workgroup_id(wid).x * RPW + li / TPR;
    let live = row < p.rows;
    let n = p.n;
    let neg_inf = -nn_inf();
    let mrow = (row / p.mask_div) * n;   // first mask element of this row's group
$BODY
}
""")

_SOFTMAX_CACHED = """
    var v: array<f32, K>;
    var m = neg_inf;
    for (var j = 0u; j < K; j++) {
        let i = lane + j * TPR;
        var t = neg_inf;
        if (live && i < n) { t = val(row, i, mrow); }
        v[j] = t;
        m = max(m, t);
    }
    let mx = row_max(li, m);
    // +-inf: a NaN or +inf in the row, or nothing but -inf: numpy's exp(x - max) is NaN there
    let bad = (bitcast<u32>(mx) & 0x7fffffffu) == 0x7f800000u;
    var s = 0.0;
    for (var j = 0u; j < K; j++) {
        var e = 0.0;
        if (live && !bad && lane + j * TPR < n) { e = exp(v[j] - mx); }
        v[j] = e;
        s += e;
    }
    let tot = row_sum(li, s);
    if (live) {
        for (var j = 0u; j < K; j++) {
            let i = lane + j * TPR;
            if (i < n) { y[row * n + i] = select(v[j] / tot, nn_nan(), bad); }
        }
    }
"""

_SOFTMAX_LOOP = """
    var m = neg_inf;
    if (live) { for (var i = lane; i < n; i += TPR) { m = max(m, val(row, i, mrow)); } }
    let mx = row_max(li, m);
    let bad = (bitcast<u32>(mx) & 0x7fffffffu) == 0x7f800000u;
    var s = 0.0;
    if (live && !bad) { for (var i = lane; i < n; i += TPR) { s += exp(val(row, i, mrow) - mx); } }
    let tot = row_sum(li, s);
    if (live) {
        for (var i = lane; i < n; i += TPR) {
            y[row * n + i] = select(exp(val(row, i, mrow) - mx) / tot, nn_nan(), bad);
        }
    }
"""

_LAYERNORM = Template(_ROW_COMMON + """
struct Params { rows: u32, n: u32, eps: f32, parts: u32, vocab: vec4<u32> }
$DECLS
@group(0) @binding($G) var<storage, read> gamma: array<f32>;
@group(0) @binding($B) var<storage, read> beta: array<f32>;
@group(0) @binding($OUT) var<storage, read_write> y: array<f32>;
@group(0) @binding($PARAMS) var<uniform> p: Params;

$VAL_FN

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let lane = li % TPR;
    let row = hetero_workgroup_id(wid).x * RPW + li / TPR;
    let live = row < p.rows;
    let n = p.n;
    let base = row * n;
    let nf = f32(n);
    // Shifted data: sums of v - v[0] keep the mean exact-ish for rows with a large offset
    // (a float32 sum of 384 values near 1e4 alone would be off by ~1e-3).
    var shift = 0.0;
    if (live) { shift = val(base); }
$BODY
}
""")

_LAYERNORM_CACHED = """
    var v: array<f32, K>;
    var s = 0.0;
    for (var j = 0u; j < K; j++) {
        let i = lane + j * TPR;
        var t = 0.0;
        if (live && i < n) { t = val(base + i) - shift; }
        v[j] = t;
        s += t;
    }
    let mean = row_sum(li, s) / nf;   // of the shifted values
    var q = 0.0;
    for (var j = 0u; j < K; j++) {
        if (lane + j * TPR < n) {
            let d = v[j] - mean;
            v[j] = d;
            q += d * d;
        }
    }
    let rstd = inverseSqrt(row_sum(li, q) / nf + p.eps);
    if (live) {
        for (var j = 0u; j < K; j++) {
            let i = lane + j * TPR;
            if (i < n) { y[base + i] = (v[j] * rstd) * gamma[i] + beta[i]; }
        }
    }
"""

_LAYERNORM_LOOP = """
    var s = 0.0;
    if (live) { for (var i = lane; i < n; i += TPR) { s += val(base + i) - shift; } }
    let mean = row_sum(li, s) / nf;
    var q = 0.0;
    if (live) {
        for (var i = lane; i < n; i += TPR) {
            let d = (val(base + i) - shift) - mean;
            q += d * d;
        }
    }
    let rstd = inverseSqrt(row_sum(li, q) / nf + p.eps);
    if (live) {
        for (var i = lane; i < n; i += TPR) {
            y[base + i] = (((val(base + i) - shift) - mean) * rstd) * gamma[i] + beta[i];
        }
    }
"""

# -- WGSL: data movement --------------------------------------------------------------------------
_TRANSPOSE = Template("""
alias T = $T;
struct Params { n: u32, pad0: u32, pad1: u32, pad2: u32, dims: vec4<u32>, strides: vec4<u32> }
@group(0) @binding(0) var<storage, read> x: array<T>;
@group(0) @binding(1) var<storage, read_write> y: array<T>;
@group(0) @binding(2) var<uniform> p: Params;

// Thread i writes output element i (coalesced); dims are the output's (outermost
// first), strides the input's for each output axis.
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let i = hetero_workgroup_id(wid).x * 256u + li;
    if (i >= p.n) { return; }
    var r = i;
    let c3 = r % p.dims.w;
    r = r / p.dims.w;
    let c2 = r % p.dims.z;
    r = r / p.dims.z;
    let c1 = r % p.dims.y;
    r = r / p.dims.y;
    y[i] = x[r * p.strides.x + c1 * p.strides.y + c2 * p.strides.z + c3 * p.strides.w];
}
""")

_EMBEDDING = Template("""
alias T = $T;
struct Params { n: u32, h: u32, vocab: u32, pad: u32 }
@group(0) @binding(0) var<storage, read> table: array<T>;
@group(0) @binding(1) var<storage, read> ids: array<u32>;
@group(0) @binding(2) var<storage, read_write> y: array<T>;
@group(0) @binding(3) var<uniform> p: Params;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let i = hetero_workgroup_id(wid).x * 256u + li;
    if (i >= p.n) { return; }
    let row = i / p.h;
    let id = ids[row];  // int32 ids as u32: negative ones are >= 2**31, out of range too
    var v = T(0);
    if (id < p.vocab) { v = table[id * p.h + (i - row * p.h)]; }
    y[i] = v;
}
""")

# -- WGSL: attention ------------------------------------------------------------------------------
_ATTENTION = Template("""
const BQ: u32 = ${BQ}u;   // query rows per workgroup, one per thread
const BK: u32 = ${BK}u;   // keys per tile in workgroup memory
const D4: u32 = ${D4}u;   // head dimension in vec4s (zero-padded)
struct Params {
    sq: u32, sk: u32, h: u32, nqb: u32,
    d: u32, qs_b: u32, qs_h: u32, qs_s: u32,    // strides of q, in elements
    ks_b: u32, ks_h: u32, ks_s: u32, q0: u32,   // strides of k and v; q's first element
    scale: f32, k0: u32, v0: u32, pad0: u32,    // softmax scale times log2(e); k's and v's first elements
    os_b: u32, os_h: u32, os_s: u32, pad1: u32, // strides of the output
    parts: u32, pstride: u32, bw: u32, pad2: u32, // summed inputs: planes, elements a plane, bias width
}
@group(0) @binding(0) var<storage, read> q: array<$T>;
@group(0) @binding(1) var<storage, read> k: array<$T>;
@group(0) @binding(2) var<storage, read> v: array<$T>;
@group(0) @binding(3) var<storage, read_write> o: array<$T>;
@group(0) @binding(4) var<uniform> p: Params;
$MASK_DECL
$BIAS_DECL
const NN_FLT_MAX: f32 = 3.40282347e38;

var<workgroup> tk: array<vec4<f32>, BK * D4>;
var<workgroup> tv: array<vec4<f32>, BK * D4>;
var<workgroup> tm: array<u32, BK>;   // 1: a real key, 0: padding

fn ld_q(base: u32, c: u32) -> vec4<f32> { $LD_Q }
fn ld_k(base: u32, c: u32) -> vec4<f32> { $LD_K }
fn ld_v(base: u32, c: u32) -> vec4<f32> { $LD_V }
fn key_real(b: u32, key: u32) -> u32 { $KEY_REAL }

@compute @workgroup_size(BQ)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let w = hetero_workgroup_id(wid).x;
    let qb = w % p.nqb;
    let bh = w / p.nqb;
    let b = bh / p.h;
    let hh = bh % p.h;
    let qi = qb * BQ + li;
    let live = qi < p.sq;
$RANGE
    let qbase = p.q0 + b * p.qs_b + hh * p.qs_h + qi * p.qs_s;
    let obase = b * p.os_b + hh * p.os_h + qi * p.os_s;
    let kbase = b * p.ks_b + hh * p.ks_h;

    // The query row and the accumulator live in named registers, one vec4 each (the
    // generator unrolls every loop over the head dimension): arrays indexed in loops
    // ended up in local memory on NVIDIA's compiler.
$DECL
    // Running maximum (log2 units) and sum. Scores of padded keys are finfo.min, as in HF:
    // they count (with weight 1 each) only while no real key was seen.
    var m = -NN_FLT_MAX;
    var l = 0.0;
    for (var t0 = t_lo; t0 < t_hi; t0 += BK) {
        workgroupBarrier();   // the previous tile is consumed
        for (var e = li; e < BK * D4; e += BQ) {
            let key = t0 + e / D4;
            let c = e % D4;
            var kk = vec4<f32>(0.0);
            var vv = vec4<f32>(0.0);
            if (key < t_hi) {
                let kb = kbase + key * p.ks_s;
                kk = ld_k(p.k0 + kb, c);
                vv = ld_v(p.v0 + kb, c);
            }
            tk[e] = kk;
            tv[e] = vv;
        }
        for (var j = li; j < BK; j += BQ) {
            tm[j] = select(0u, key_real(b, t0 + j), t0 + j < t_hi);
        }
        workgroupBarrier();
        let cnt = min(BK, t_hi - t0);
        if (live) {
            for (var j = 0u; j < cnt; j++) {
                let r = j * D4;
$KEY_SKIP
                if (tm[j] == 0u) {
                    if (m == -NN_FLT_MAX) {
                        l += 1.0;
$ACC_PAD
                    }
                    continue;
                }
                var s4 = vec4<f32>(0.0);
                var u4 = vec4<f32>(0.0);   // two partial sums: half the dependency chain
$DOT
                s4 += u4;
                let s = (s4.x + s4.y) + (s4.z + s4.w);
                if (s > m) {
                    let alpha = select(exp2(m - s), 0.0, m == -NN_FLT_MAX);
                    l *= alpha;
$RESCALE
                    m = s;
                }
                let pj = exp2(s - m);
                l += pj;
$ACC
            }
        }
    }
    if (live) {
        let inv = 1.0 / l;
$STORE
    }
}
""")

_LD_VEC = "return {buf}[(base >> 2u) + c];"
_LD_SCALAR = """let d0 = c * 4u;
    var r = vec4<f32>(0.0);
    for (var i = 0u; i < 4u; i++) {{ if (d0 + i < p.d) {{ r[i] = {buf}[base + d0 + i]; }} }}
    return r;"""
# Summed inputs (``parts``: q, k and v are the sums of p.parts planes of p.pstride elements, a
# K split's partial products, in plane order; ``bias``: plus qb[column], p.bw columns a row),
# the arithmetic of the split's summing pass, so the values equal the summed product's.
_LD_VEC_SUM = """let i = (base >> 2u) + c;
    var s = {buf}[i];
    {parts}
    return s{bias};"""
_LD_SCALAR_SUM = """let d0 = c * 4u;
    var r = vec4<f32>(0.0);
    for (var i = 0u; i < 4u; i++) {{
        if (d0 + i < p.d) {{
            let e = base + d0 + i;
            var s = {buf}[e];
            {parts}
            r[i] = s{bias};
        }}
    }}
    return r;"""
_ST_VEC = "o[(obase >> 2u) + {c}u] = a{c} * inv;"
_ST_SCALAR = """{{ let r = a{c} * inv;
            for (var i = 0u; i < 4u; i++) {{ if ({c}u * 4u + i < p.d) {{ o[obase + {c}u * 4u + i] = r[i]; }} }} }}"""


# -- generators -------------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def elementwise(expr: str, vec: bool, second: str | None) -> str:
    """``dst[i] = expr`` over ``x`` (and a second input named ``second``); ``G(``/``E(`` call gelu/erf."""
    t = "vec4<f32>" if vec else "f32"
    decl = f"@group(0) @binding(1) var<storage, read> {second}: array<T>;" if second else ""
    out = 2 if second else 1
    e = expr.replace("G(", "gelu4(" if vec else "nn_gelu(").replace("E(", "erf4(" if vec else "nn_erf(")
    return _ELEMENTWISE.substitute(T=t, SECOND=decl, OUT=out, PARAMS=out + 1, EXPR=e, MATH=MATH)


@lru_cache(maxsize=None)
def softmax(tpr: int, k: int, cached: bool, masked: str | None) -> str:
    """The softmax row kernel: ``tpr`` threads a row, ``k`` values each (``cached``: in registers)."""
    if masked is None:
        decl, add = "", ""
    elif masked == "add":
        decl, add = "@group(0) @binding(1) var<storage, read> mask: array<f32>;", "v = v + mask[mrow + i];"
    else:
        decl = "@group(0) @binding(1) var<storage, read> mask: array<u32>;"
        bits = "(mask[mrow + i] & 0x7fffffffu)" if masked == "keep_f32" else "mask[mrow + i]"
        add = f"if ({bits} == 0u) {{ v = -NN_FLT_MAX; }}"
    out = 2 if masked else 1
    body = _SOFTMAX_CACHED if cached else _SOFTMAX_LOOP
    return _SOFTMAX.substitute(TPR=tpr, RPW=WORKGROUP // tpr, K=k, MASK_DECL=decl, MASK_ADD=add, OUT=out,
                               PARAMS=out + 1, MATH=MATH, BODY=body)


@lru_cache(maxsize=None)
def layernorm(tpr: int, k: int, cached: bool, residual: bool, parts: bool = False, bias: bool = False) -> str:
    """The layernorm row kernel, planned like :func:`softmax`, of ``v``: ``x``, or with
    ``parts``, ``x`` as ``p.parts`` planes of ``rows * n`` summed in order (a K split's
    partial products), then ``+ bias`` (per column) and ``+ res``, as given. The sums are
    in the order of the unfused ops (summing pass, bias, residual add)."""
    decls = ["@group(0) @binding(0) var<storage, read> x: array<f32>;"]
    if bias:
        decls.append(f"@group(0) @binding({len(decls)}) var<storage, read> bias: array<f32>;")
    if residual:
        decls.append(f"@group(0) @binding({len(decls)}) var<storage, read> res: array<f32>;")
    if parts:
        fn = ("fn val(k: u32) -> f32 {\n    var s = x[k];\n    let stride = p.rows * p.n;\n"
              "    for (var j = 1u; j < p.parts; j++) { s = s + x[k + j * stride]; }\n"
              f"    return s{' + bias[k % p.n]' if bias else ''}{' + res[k]' if residual else ''};\n}}")
    else:
        fn = f"fn val(k: u32) -> f32 {{ return x[k]{' + bias[k % p.n]' if bias else ''}{' + res[k]' if residual else ''}; }}"
    return _norm(tpr, k, cached, decls, fn)


@lru_cache(maxsize=None)
def embedding_layernorm(tpr: int, k: int, cached: bool, tables: int) -> str:
    """The layernorm row kernel of the sum of ``tables`` (1-4) row gathers: table ``i`` at
    binding ``i``, its ids at ``tables + i``, its row count in ``p.vocab[i]``. Out-of-range
    ids pick zeros, as :func:`embedding` does; the sum is in table order."""
    decls = [f"@group(0) @binding({i}) var<storage, read> t{i}: array<f32>;" for i in range(tables)]
    decls += [f"@group(0) @binding({tables + i}) var<storage, read> ids{i}: array<u32>;" for i in range(tables)]
    picks = "".join(f"fn pick{i}(r: u32, c: u32) -> f32 {{\n    let id = ids{i}[r];  // int32 ids as u32: negative ones are "
                    f"out of range too\n    if (id < p.vocab[{i}]) {{ return t{i}[id * p.n + c]; }}\n    return 0.0;\n}}\n"
                    for i in range(tables))
    total = " + ".join(f"pick{i}(r, c)" for i in range(tables))
    fn = picks + f"fn val(k: u32) -> f32 {{\n    let r = k / p.n;\n    let c = k - r * p.n;\n    return {total};\n}}"
    return _norm(tpr, k, cached, decls, fn)


def _norm(tpr: int, k: int, cached: bool, decls: list[str], val_fn: str) -> str:
    b = len(decls)
    return _LAYERNORM.substitute(TPR=tpr, RPW=WORKGROUP // tpr, K=k, DECLS="\n".join(decls), G=b, B=b + 1, OUT=b + 2,
                                 PARAMS=b + 3, VAL_FN=val_fn, BODY=_LAYERNORM_CACHED if cached else _LAYERNORM_LOOP)


@lru_cache(maxsize=None)
def transpose(vec: bool) -> str:
    """The transpose kernel over 4-byte words (``vec``: whole vec4 of them)."""
    return _TRANSPOSE.substitute(T="vec4<u32>" if vec else "u32")


@lru_cache(maxsize=None)
def embedding(vec: bool) -> str:
    """The row-gather kernel over 4-byte words (``vec``: whole vec4 of them)."""
    return _EMBEDDING.substitute(T="vec4<u32>" if vec else "u32")


# Variable-length sequences packed along one token axis (attention_varlen): binding 5 holds each
# token's [start, end) key range, its own sequence's. A workgroup's keys are the union of its
# queries' ranges, [start of the first, end of the last) (the sequences lie one after another),
# read from a read-only buffer at a workgroup-uniform index, so the tile loop stays uniform; each
# query skips the keys outside its own range.
_VARLEN_DECL = "@group(0) @binding(5) var<storage, read> spans: array<u32>;"
_VARLEN_RANGE = """    let first = min(qb * BQ, p.sq - 1u);
    let last = min(qb * BQ + BQ - 1u, p.sq - 1u);
    let t_lo = min(spans[2u * first], p.sk);
    let t_hi = max(min(spans[2u * last + 1u], p.sk), t_lo);
    var my_lo = 0u;
    var my_hi = 0u;
    if (live) { my_lo = spans[2u * qi]; my_hi = spans[2u * qi + 1u]; }"""
_VARLEN_SKIP = " " * 16 + "if (t0 + j < my_lo || t0 + j >= my_hi) { continue; }"


@lru_cache(maxsize=None)
def attention(bq: int, bk: int, d4: int, vec: bool, float_mask: bool | None, varlen: bool = False,
              parts: bool = False, bias: bool = False) -> str:
    """The fused attention kernel: ``bq`` queries, ``bk`` keys a tile, ``d4`` vec4 per head row;
    ``float_mask``: the padding mask's kind (None: no mask); ``varlen``: packed sequences;
    ``parts``, ``bias``: q, k and v summed from partial products, plus a bias per column (bound
    after the mask or spans)."""
    t = "vec4<f32>" if vec else "f32"
    if parts or bias:
        if vec:
            step = "for (var j = 1u; j < p.parts; j++) {{ s = s + {buf}[i + j * (p.pstride >> 2u)]; }}"
            add = " + qb[i % (p.bw >> 2u)]"
        else:
            step = "for (var j = 1u; j < p.parts; j++) {{ s = s + {buf}[e + j * p.pstride]; }}"
            add = " + qb[e % p.bw]"
        ld = (_LD_VEC_SUM if vec else _LD_SCALAR_SUM).replace("{parts}", step if parts else "").replace(
            "{bias}", add if bias else "")
    else:
        ld = _LD_VEC if vec else _LD_SCALAR
    bias_at = 6 if (varlen or float_mask is not None) else 5
    bias_decl = f"@group(0) @binding({bias_at}) var<storage, read> qb: array<{t}>;" if bias else ""
    if varlen:
        decl, real = _VARLEN_DECL, "return 1u;"
    elif float_mask is None:
        decl, real = "", "return 1u;"
    else:
        decl = "@group(0) @binding(5) var<storage, read> mask: array<u32>;"
        bits = "mask[b * p.sk + key]"
        real = (f"return select(0u, 1u, ({bits} & 0x7fffffffu) != 0u);" if float_mask
                else f"return select(0u, 1u, {bits} != 0u);")
    def each(line: str, indent: int) -> str:
        return "\n".join(" " * indent + line.format(c=c) for c in range(d4))

    return _ATTENTION.substitute(
        BQ=bq, BK=bk, D4=d4, T=t, MASK_DECL=decl, BIAS_DECL=bias_decl, KEY_REAL=real,
        RANGE=_VARLEN_RANGE if varlen else "    let t_lo = 0u;\n    let t_hi = p.sk;",
        KEY_SKIP=_VARLEN_SKIP if varlen else "",
        LD_Q=ld.format(buf="q"), LD_K=ld.format(buf="k"), LD_V=ld.format(buf="v"),
        DECL=each("var a{c} = vec4<f32>(0.0);\n    var q{c} = vec4<f32>(0.0);\n"
                  "    if (live) {{ q{c} = ld_q(qbase, {c}u) * p.scale; }}", 4),
        ACC_PAD=each("a{c} += tv[r + {c}u];", 24),
        DOT="\n".join(" " * 16 + f"{'su'[c % 2]}4 += q{c} * tk[r + {c}u];" for c in range(d4)),
        RESCALE=each("a{c} *= alpha;", 20), ACC=each("a{c} += pj * tv[r + {c}u];", 16),
        STORE=each(_ST_VEC if vec else _ST_SCALAR, 8))
