"""Multi-pass GPU reductions: sum, mean, max, min, argmax, argmin over a Tensor.

Each op records its passes into the calling GPU stage (``gpu``): no host round trip,
and WebGPU orders the dispatches, so every pass sees the previous pass's writes.
Scratch tensors come from ``gpu.empty`` and go back to the pool after the stage.

Shapes. ``axis=None`` reduces the whole tensor (any number of dimensions) to a 0-d
Tensor, shape ``()``. ``axis`` in ``0, 1, -1, -2`` reduces one axis of a 2-D tensor
to a 1-D Tensor holding the other dimension; a 1-D tensor also takes ``axis=0``
(or ``-1``), which is the whole tensor.

Dtypes. Input float32 or int32.

========  ================  ==============================================
op        float32 input     int32 input
========  ================  ==============================================
sum       float32           int64 (exact: 64-bit accumulation, like numpy)
mean      float32           float32 (numpy gives float64; WGSL has no f64)
max, min  float32           int32
argmax    int32             int32
argmin    int32             int32
========  ================  ==============================================

Arg-ops return int32 indices (numpy returns int64): int32 is what WGSL kernels
downstream read natively, and it covers 2**31 - 1 elements along the reduced axis
(8 GiB of float32); longer ones raise ``ValueError``. Along an axis the index is along
that axis; for ``axis=None`` it is into the flattened tensor (as numpy).

NaN and infinities behave like numpy: a NaN makes sum, mean, max and min NaN;
argmax/argmin return the index of the first NaN; ``inf - inf`` is NaN. Ties return
the first index. WGSL's ``max()`` does not propagate NaN portably, so max, min and
the arg-ops compare order-preserving 32-bit keys of the values in which NaN ranks
above everything (float bits with the sign handled, ints with the sign bit
flipped); NaN is detected from the bits, not with ``x != x``, which fast-math
compilers may fold away. ``-0.0`` and ``0.0`` tie for the arg-ops, as in numpy.
Empty inputs follow numpy: sum gives 0, mean NaN (without numpy's warning), and
max, min, argmax and argmin raise ``ValueError``.

Pass plan. Workgroups have 256 threads. A pass views its input as ``outer``
independent rows of ``inner`` elements to reduce (element ``(o, k)`` at
``o * so + k * sk``), lays the workgroup out as ``TK`` threads along ``k`` by
``TO`` along ``o`` (the memory-contiguous one varies fastest, so loads coalesce;
a whole-tensor pass is one row, ``TK`` = 256), and gives each row ``Gk``
workgroups along x. Every thread accumulates a grid-stride loop over ``k``: four
independent loads per iteration (vec4<f32> loads where rows are 16-byte aligned,
then a scalar tail), combined pairwise, and blocks of four iterations combined
before they reach the running total, so the longest chain of sequential float
additions stays short (a lane adds 16 values per block). The workgroup then
reduces its threads with ``subgroupAdd``/``subgroupMax``/``subgroupMin`` when the
device has the ``subgroup`` feature (subgroup results meet in workgroup memory and
the first subgroup reduces them), or with a workgroup-memory tree otherwise, and
writes one partial per row. ``Gk`` gives each thread at least
:data:`ITEMS_PER_THREAD` items (2 vec4 loads) and all rows together about
:data:`GRID_TARGET` workgroups (2048 on GPUs: a few per compute unit; 64 on CPU
adapters); the next
pass reduces the partials ``(Gk, outer)`` the same way, at least 16 per thread, until
``Gk`` is 1, and that last pass writes the result. A whole-tensor float32 reduction
on a GPU: 2**20 elements take 2 passes (512 workgroups of 2 vec4 per thread, then
1 workgroup); 2**28 elements (1 GiB) also 2 (2048 workgroups of 128 vec4 per thread,
then 1); 2**30 elements (4 GiB) exceed any binding: one first-pass dispatch per
window (below), then one or two more passes. Grids never exceed the per-dimension
limit: ``Gk`` is capped by it and row tiles beyond it are looped over in the kernel.

Inputs larger than ``max-storage-buffer-binding-size`` are bound in windows (byte
ranges at aligned offsets), one dispatch per window, each writing its own partials.

Why no single-pass atomics variant: WGSL atomics are integer-only (no float
``atomicAdd``, no 64-bit atomics), so a single-pass float sum would need a
CAS loop on bits (slow under contention, order-dependent results) or a "last
workgroup finishes" counter, which needs a memory model WGSL does not give
across workgroups. The second pass of the tree reduces 2048 values in one
workgroup; it costs a few microseconds of GPU time, next to nothing beside the
first pass at the sizes where throughput matters.

Test hooks (module attributes, read at each call): :data:`GRID_TARGET` (workgroups
per pass), :data:`USE_SUBGROUPS` (False forces the workgroup-memory fallback),
:data:`MAX_BINDING_BYTES` and :data:`MAX_GRID_DIM` (pretend the adapter's limits
are smaller, to exercise windows and in-kernel row loops on small inputs).
"""

from __future__ import annotations

import builtins
import struct
from dataclasses import dataclass
from string import Template
from typing import Any, Callable

import numpy as np

from hetero.lowlevel import GPUContext, Tensor

__all__ = ["argmax", "argmin", "max", "mean", "min", "sum"]

# -- tuning and test hooks ---------------------------------------------------------------
GRID_TARGET: int | None = None
"""Workgroups one pass aims for over all rows (also the cap on workgroups per row);
None: :data:`GPU_GRID_TARGET`, or :data:`CPU_GRID_TARGET` on a CPU adapter."""
GPU_GRID_TARGET = 2048
"""A few workgroups per compute unit of a large GPU (an H200 holds ~1056 of 256 threads)."""
CPU_GRID_TARGET = 64
"""CPU adapters (lavapipe, SwiftShader, WARP) run each workgroup on one CPU thread at a
cost of tens of microseconds: a few per core is faster (2**24 floats: 4x on lavapipe)."""
USE_SUBGROUPS = True
"""Use subgroup operations when the device has the ``subgroup`` feature (False: for tests)."""
MAX_BINDING_BYTES: int | None = None
"""Pretend max-storage-buffer-binding-size is this (None: the adapter's; for tests)."""
MAX_GRID_DIM: int | None = None
"""Pretend max-compute-workgroups-per-dimension is this (None: the adapter's; for tests)."""

WORKGROUP = 256
# Fewest items (vec4 or scalar) a thread reads in a pass over the input: small, so that
# mid-sized inputs still spread over enough workgroups to fill a large GPU. Passes over
# partials read more per thread, so that up to 4096 partials finish in one workgroup.
ITEMS_PER_THREAD = 2
PARTIAL_ITEMS_PER_THREAD = 16

_SUPPORTED = (np.dtype(np.float32), np.dtype(np.int32))


# -- WGSL ----------------------------------------------------------------------------------
_HELPERS = """
fn nan_bits(b: u32) -> bool { return (b & 0x7fffffffu) > 0x7f800000u; }
// Order-preserving key of an f32: a larger float has a larger key; NaN is above all.
fn key_hi_f32(v: f32) -> u32 {
    let b = bitcast<u32>(v);
    let k = select(b ^ 0x80000000u, ~b, (b & 0x80000000u) != 0u);
    return select(k, 0xffffffffu, nan_bits(b));
}
// Reversed order (a smaller float has a larger key); NaN is still above all.
fn key_lo_f32(v: f32) -> u32 {
    return select(~key_hi_f32(v), 0xffffffffu, nan_bits(bitcast<u32>(v)));
}
fn unkey_hi_f32(k: u32) -> u32 {
    if (k == 0xffffffffu) { return 0x7fc00000u; }
    return select(~k, k ^ 0x80000000u, (k & 0x80000000u) != 0u);
}
fn unkey_lo_f32(k: u32) -> u32 {
    if (k == 0xffffffffu) { return 0x7fc00000u; }
    return unkey_hi_f32(~k);
}
// -0.0 -> +0.0 (bitwise, so no compiler can fold it away): the arg-ops treat them as equal.
fn zero_canon(v: f32) -> f32 {
    let b = bitcast<u32>(v);
    return bitcast<f32>(select(b, 0u, (b & 0x7fffffffu) == 0u));
}
fn key_hi_i32(v: i32) -> u32 { return bitcast<u32>(v) ^ 0x80000000u; }
fn key_lo_i32(v: i32) -> u32 { return bitcast<u32>(v) ^ 0x7fffffffu; }
// 64-bit two's complement integers as (lo, hi).
fn add64(a: vec2<u32>, b: vec2<u32>) -> vec2<u32> {
    let lo = a.x + b.x;
    return vec2<u32>(lo, a.y + b.y + select(0u, 1u, lo < a.x));
}
fn i64_to_f32(s: vec2<u32>) -> f32 {
    let neg = (s.y & 0x80000000u) != 0u;
    var lo = s.x;
    var hi = s.y;
    if (neg) {
        lo = ~lo + 1u;
        hi = ~hi + select(0u, 1u, lo == 0u);
    }
    let m = f32(hi) * 4294967296.0 + f32(lo);
    return select(m, -m, neg);
}
"""

# Defaults for ops whose vec4 accumulator is just the state (everything but float sums).
_A_DEFAULT = """
alias A = S;
fn a_ident() -> A { return ident(); }
fn lift4(v: vec4<T>, i: u32) -> A {
    return combine(combine(lift(v.x, i), lift(v.y, i + 1u)), combine(lift(v.z, i + 2u), lift(v.w, i + 3u)));
}
fn a_merge(a: A, b: A) -> A { return combine(a, b); }
fn a_state(a: A) -> S { return a; }
"""

_SUM_F32 = """
alias S = f32;
alias O = u32;
fn ident() -> S { return 0.0; }
fn combine(a: S, b: S) -> S { return a + b; }
fn lift(v: T, i: u32) -> S { return v; }
alias A = vec4<f32>;
fn a_ident() -> A { return vec4<f32>(0.0); }
fn lift4(v: vec4<T>, i: u32) -> A { return v; }
fn a_merge(a: A, b: A) -> A { return a + b; }
fn a_state(a: A) -> S { return (a.x + a.y) + (a.z + a.w); }
fn sg_reduce(s: S) -> S { return subgroupAdd(s); }
"""

_SUM_I32 = """
alias S = vec2<u32>;
alias O = vec2<u32>;
fn ident() -> S { return vec2<u32>(0u, 0u); }
fn combine(a: S, b: S) -> S { return add64(a, b); }
fn lift(v: T, i: u32) -> S { return vec2<u32>(bitcast<u32>(v), select(0u, 0xffffffffu, v < 0)); }
""" + _A_DEFAULT

_KEY = """
alias S = u32;
alias O = u32;
fn ident() -> S { return 0u; }
fn combine(a: S, b: S) -> S { return max(a, b); }
fn lift(v: T, i: u32) -> S { return $KEY(v); }
fn sg_reduce(s: S) -> S { return subgroupMax(s); }
""" + _A_DEFAULT

_ARG = """
alias S = vec2<u32>;
alias O = u32;
fn ident() -> S { return vec2<u32>(0u, 0xffffffffu); }
fn combine(a: S, b: S) -> S {
    if (b.x > a.x || (b.x == a.x && b.y < a.y)) { return b; }
    return a;
}
fn lift(v: T, i: u32) -> S { return vec2<u32>($KEY, i); }
fn sg_reduce(s: S) -> S {
    let m = subgroupMax(s.x);
    return vec2<u32>(m, subgroupMin(select(0xffffffffu, s.y, s.x == m)));
}
fn finish(s: S, count: f32) -> O { return s.y; }
""" + _A_DEFAULT

_FINISH = {
    "sum_f32": "fn finish(s: S, count: f32) -> O { return bitcast<u32>(s); }",
    "mean_f32": """fn finish(s: S, count: f32) -> O {
    if (count == 0.0) { return 0x7fc00000u; }
    return bitcast<u32>(s / count);
}""",
    "sum_i32": "fn finish(s: S, count: f32) -> O { return s; }",
    "mean_i32": """fn finish(s: S, count: f32) -> O {
    if (count == 0.0) { return 0x7fc00000u; }
    return bitcast<u32>(i64_to_f32(s) / count);
}""",
    "max_f32": "fn finish(s: S, count: f32) -> O { return unkey_hi_f32(s); }",
    "min_f32": "fn finish(s: S, count: f32) -> O { return unkey_lo_f32(s); }",
    "max_i32": "fn finish(s: S, count: f32) -> O { return s ^ 0x80000000u; }",
    "min_i32": "fn finish(s: S, count: f32) -> O { return s ^ 0x7fffffffu; }",
}


@dataclass(frozen=True)
class _OpSpec:
    """One op on one input dtype: its WGSL, state and output layouts."""

    wgsl: str  # T, S, O, ident, combine, lift, A..., finish, [sg_reduce]
    state: tuple[Any, int]  # numpy dtype and components of one partial (S)
    out_dtype: Any
    subgroups: bool  # sg_reduce exists


def _spec(op: str, dt: np.dtype) -> _OpSpec:
    wt = "f32" if dt == np.float32 else "i32"
    head = f"alias T = {wt};\n"
    if op in ("sum", "mean"):
        if wt == "f32":
            body = _SUM_F32 + _FINISH[f"{op}_f32"]
            return _OpSpec(head + body, (np.float32, 1), np.float32, True)
        out = np.int64 if op == "sum" else np.float32
        body = _SUM_I32 + _FINISH[f"{op}_i32"]
        if op == "mean":
            body = body.replace("alias O = vec2<u32>;", "alias O = u32;")
        return _OpSpec(head + body, (np.uint32, 2), out, False)
    if op in ("max", "min"):
        key = f"key_{'hi' if op == 'max' else 'lo'}_{wt}"
        body = Template(_KEY).substitute(KEY=key) + _FINISH[f"{op}_{wt}"]
        return _OpSpec(head + body, (np.uint32, 1), dt, True)
    side = "hi" if op == "argmax" else "lo"
    key = f"key_{side}_f32(zero_canon(v))" if wt == "f32" else f"key_{side}_i32(v)"
    return _OpSpec(head + Template(_ARG).substitute(KEY=key), (np.uint32, 2), np.int32, True)


_PARAMS = """
struct Params {
    base: u32,        // first element of this window's chunk, in elements of the binding
    o_cnt: u32,       // rows (outputs) in this chunk
    k_cnt: u32,       // elements to reduce per row in this chunk
    so: u32,          // stride between rows, in elements
    sk: u32,          // stride along the reduced axis, in elements
    o_base: u32,      // first output of this chunk
    out_stride: u32,  // outputs in all (stride between rows of partials)
    g_base: u32,      // first partial row of this chunk
    k_base: u32,      // index of this chunk's first element along the reduced axis
    count: f32,       // elements reduced per output in all (mean divides by it)
    pad0: u32,
    pad1: u32,
}
"""
_PARAMS_FMT = "<9If2I"

_MAIN = """
const TK: u32 = ${TK}u;
const TO: u32 = ${TO}u;
var<workgroup> sh: array<S, ${WG}>;

fn load(o: u32, k: u32) -> S {
    ${LOAD}
}

fn thread_scalar(o: u32, k0: u32, st: u32) -> S {
    let n = p.k_cnt;
    var acc = ident();
    var k = k0;
    loop {
        if (k + 3u * st >= n) { break; }
        var blk = ident();
        for (var j = 0u; j < 4u; j++) {
            if (k + 3u * st >= n) { break; }
            let a = load(o, k);
            let b = load(o, k + st);
            let c = load(o, k + 2u * st);
            let d = load(o, k + 3u * st);
            blk = combine(blk, combine(combine(a, b), combine(c, d)));
            k += 4u * st;
        }
        acc = combine(acc, blk);
    }
    var rest = ident();
    for (; k < n; k += st) { rest = combine(rest, load(o, k)); }
    return combine(acc, rest);
}
${VEC_FN}
@compute @workgroup_size(${WG})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) li: u32${SG_ARGS}) {
    ${LAYOUT}
    let tiles = (p.o_cnt + TO - 1u) / TO;
    let st = nwg.x * TK;
    for (var t = wid.y; t < tiles; t += nwg.y) {
        let o = t * TO + to;
        var s = ident();
        if (o < p.o_cnt) {
            ${THREAD}
        }
        ${REDUCE}
        if (writer && o < p.o_cnt) {
            ${STORE}
        }
        workgroupBarrier();  // sh is reused by the next row tile
    }
}
"""

_VEC_FN = """
fn thread_vec(o: u32, k0: u32, st: u32) -> S {
    let n4 = p.k_cnt / 4u;
    let row = (p.base + o * p.so) / 4u;
    var acc = a_ident();
    var k = k0;
    loop {
        if (k + 3u * st >= n4) { break; }
        var blk = a_ident();
        for (var j = 0u; j < 4u; j++) {
            if (k + 3u * st >= n4) { break; }
            let a = src[row + k];
            let b = src[row + k + st];
            let c = src[row + k + 2u * st];
            let d = src[row + k + 3u * st];
            let i = p.k_base + 4u * k;
            blk = a_merge(blk, a_merge(a_merge(lift4(a, i), lift4(b, i + 4u * st)),
                                       a_merge(lift4(c, i + 8u * st), lift4(d, i + 12u * st))));
            k += 4u * st;
        }
        acc = a_merge(acc, blk);
    }
    var rest = a_ident();
    for (; k < n4; k += st) { rest = a_merge(rest, lift4(src[row + k], p.k_base + 4u * k)); }
    return a_state(a_merge(acc, rest));
}
"""

_THREAD_VEC = """s = thread_vec(o, wid.x * TK + tk, st);
            if (wid.x == 0u && tk == 0u) {  // the scalar tail of the row
                for (var k = (p.k_cnt / 4u) * 4u; k < p.k_cnt; k++) {
                    s = combine(s, lift(src1[p.base + o * p.so + k], p.k_base + k));
                }
            }"""

_REDUCE_SHARED = """sh[tk * TO + to] = s;
        workgroupBarrier();
        for (var h = TK / 2u; h > 0u; h = h / 2u) {
            if (tk < h) { sh[tk * TO + to] = combine(sh[tk * TO + to], sh[(tk + h) * TO + to]); }
            workgroupBarrier();
        }
        let r = sh[to];
        let writer = tk == 0u;"""

# TO == 1 here: the whole workgroup reduces one row. Subgroup results meet in sh,
# then the first subgroup reduces those (subgroup_id and num_subgroups are naga
# builtins; wgpu 0.32's naga rejects "enable subgroups;" and needs none).
_REDUCE_SUBGROUP = """let v = sg_reduce(s);
        if (lane == 0u) { sh[sid] = v; }
        workgroupBarrier();
        var r = ident();
        if (sid == 0u) {
            for (var i = lane; i < nsg; i += sgs) { r = combine(r, sh[i]); }
            r = sg_reduce(r);
        }
        let writer = sid == 0u && lane == 0u;"""

_SG_ARGS = (",\n        @builtin(subgroup_invocation_id) lane: u32, @builtin(subgroup_size) sgs: u32,"
            "\n        @builtin(subgroup_id) sid: u32, @builtin(num_subgroups) nsg: u32")


@dataclass(frozen=True)
class _Variant:
    op: str
    dtype: str  # numpy name of the input dtype
    partial: bool  # reads partial states (S) rather than input elements (T)
    vec: bool  # vec4 loads of the input
    final: bool  # writes the result (else partials)
    tk: int
    k_fast: bool  # k is the memory-contiguous dimension (threads along k vary fastest)
    subgroups: bool


def _wgsl(v: _Variant) -> str:
    spec = _spec(v.op, np.dtype(v.dtype))
    lines = [_HELPERS, spec.wgsl, _PARAMS]
    b = 0
    if v.partial:
        lines.append(f"@group(0) @binding({b}) var<storage, read> src: array<S>;")
        load = "return src[p.base + o * p.so + k * p.sk];"
    elif v.vec:
        lines.append(f"@group(0) @binding({b}) var<storage, read> src: array<vec4<T>>;")
        b += 1
        lines.append(f"@group(0) @binding({b}) var<storage, read> src1: array<T>;")
        load = "return lift(src1[p.base + o * p.so + k * p.sk], p.k_base + k);"
    else:
        lines.append(f"@group(0) @binding({b}) var<storage, read> src: array<T>;")
        load = "return lift(src[p.base + o * p.so + k * p.sk], p.k_base + k);"
    lines.append(f"@group(0) @binding({b + 1}) var<storage, read_write> dst: array<{'O' if v.final else 'S'}>;")
    lines.append(f"@group(0) @binding({b + 2}) var<uniform> p: Params;")
    to = WORKGROUP // v.tk
    if v.k_fast:
        layout = "let tk = li % TK;\n    let to = li / TK;"
    else:
        layout = "let to = li % TO;\n    let tk = li / TO;"
    if v.final:
        store = "dst[p.o_base + o] = finish(r, p.count);"
    else:
        store = "dst[(p.g_base + wid.x) * p.out_stride + p.o_base + o] = r;"
    main = Template(_MAIN).substitute(
        TK=v.tk, TO=to, WG=WORKGROUP, LOAD=load,
        VEC_FN=_VEC_FN if v.vec else "",
        SG_ARGS=_SG_ARGS if v.subgroups else "",
        LAYOUT=layout,
        THREAD=_THREAD_VEC if v.vec else "s = thread_scalar(o, wid.x * TK + tk, st);",
        REDUCE=_REDUCE_SUBGROUP if v.subgroups else _REDUCE_SHARED,
        STORE=store,
    )
    lines.append(main)
    return "\n".join(lines)


_WGSL_CACHE: dict[_Variant, str] = {}


def _source(v: _Variant) -> str:
    src = _WGSL_CACHE.get(v)
    if src is None:
        src = _WGSL_CACHE[v] = _wgsl(v)
    return src


# -- planning ------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Chunk:
    """A part of one pass bound as one window of the source tensor."""

    o0: int
    o_cnt: int
    k0: int
    k_cnt: int
    g_base: int  # first partial row this chunk writes
    groups: int  # workgroups along k (x)
    win_off: int  # window start, in elements of the source
    win_len: int  # window length, in elements
    base: int  # chunk's first element relative to the window start


def _pow2_ceil(n: int) -> int:
    return 1 << builtins.max(0, (n - 1).bit_length())


def _plan_chunks(outer: int, inner: int, so: int, sk: int, esz: int, total: int, limit: int,
                 align: int, groups_for: Callable[[int], int]) -> list[_Chunk]:
    """Split one pass into windows of at most ``limit`` bytes starting at ``align``-ed offsets.

    ``total`` is the source's length in elements; ``groups_for(k_cnt)`` the workgroups along k
    for a chunk of ``k_cnt`` elements per row (the same for every chunk of one k range, so
    the partial rows of a k range are written by every row or by none).
    """
    cap = (limit // esz)  # elements per window
    step = builtins.max(1, align // esz)  # window starts are multiples of this (elements)

    def chunk(o0: int, oc: int, k0: int, kc: int, g_base: int) -> _Chunk:
        first = o0 * so + k0 * sk
        last = (o0 + oc - 1) * so + (k0 + kc - 1) * sk if oc and kc else first
        start = first - first % step
        return _Chunk(o0, oc, k0, kc, g_base, groups_for(kc), start, last + 1 - start, first - start)

    if total <= cap:
        return [_Chunk(0, outer, 0, inner, 0, groups_for(inner), 0, builtins.max(total, 0), 0)]
    room = cap - step  # elements a window may span after aligning its start down
    out: list[_Chunk] = []
    if sk == 1:  # rows are contiguous: whole rows per window, else split each row along k
        if inner <= room:
            rows = builtins.max(1, (room - inner) // so + 1)
            for o0 in range(0, outer, rows):
                out.append(chunk(o0, builtins.min(rows, outer - o0), 0, inner, 0))
            return out
        kc = (room // 4) * 4
        for o in range(outer):
            g_base = 0
            for k0 in range(0, inner, kc):
                c = chunk(o, 1, k0, builtins.min(kc, inner - k0), g_base)
                out.append(c)
                g_base += c.groups
        return out
    # k is the slow dimension (so == 1): slices along k of all rows per window, or of
    # as many rows as fit; every window of one k range writes the same partial rows
    oc = builtins.min(outer, room)
    kc = builtins.max(1, (room - ((oc - 1) * so + 1)) // sk + 1)
    g_base = 0
    for k0 in range(0, inner, kc):
        k_cnt = builtins.min(kc, inner - k0)
        for o0 in range(0, outer, oc):
            out.append(chunk(o0, builtins.min(oc, outer - o0), k0, k_cnt, g_base))
        g_base += groups_for(k_cnt)
    return out


def _check_axis(op: str, shape: tuple[int, ...], axis: Any) -> int | None:
    if axis is None:
        return None
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"{op}: axis must be None or an int, got {axis!r}")
    axis = int(axis)
    nd = len(shape)
    if nd not in (1, 2):
        raise ValueError(f"{op}: axis={axis} given for a {nd}-D tensor of shape {shape}; axis reductions "
                         "support 1-D and 2-D tensors only: reshape to 2-D, or pass axis=None for the whole tensor")
    if not -nd <= axis < nd:
        allowed = "0 or -1" if nd == 1 else "0, 1, -1 or -2"
        raise ValueError(f"{op}: axis {axis} is out of range for a {nd}-D tensor of shape {shape}; "
                         f"use {allowed}")
    return axis % nd


def _reduce(op: str, gpu: GPUContext, x: Any, axis: Any) -> Tensor:
    if not isinstance(x, (Tensor, np.ndarray)):
        raise TypeError(f"{op}: expected a hetero.Tensor (or a numpy array), got {type(x).__name__}")
    shape = tuple(x.shape)
    if x.dtype not in _SUPPORTED:
        raise TypeError(f"{op}: unsupported dtype {x.dtype.name} (tensor of shape {shape}); "
                        "supported: float32, int32")
    ax = _check_axis(op, shape, axis)
    if isinstance(x, np.ndarray):
        x = gpu.upload(x)
    out_shape: tuple[int, ...]
    if ax is None or len(shape) == 1:
        outer, inner, so, sk, out_shape = 1, x.size, builtins.max(x.size, 1), 1, ()
    elif ax == 0:
        outer, inner, so, sk, out_shape = shape[1], shape[0], 1, shape[1], (shape[1],)
    else:
        outer, inner, so, sk, out_shape = shape[0], shape[1], shape[1], 1, (shape[0],)
    spec = _spec(op, x.dtype)
    where = f"tensor of shape {shape}" + ("" if axis is None else f" along axis {axis}")
    if inner == 0 and op not in ("sum", "mean"):
        if op.startswith("arg"):
            raise ValueError(f"{op}: zero-size {where}: {op} of an empty sequence has no answer "
                             "(numpy raises too); check the size before reducing")
        raise ValueError(f"{op}: zero-size {where}: {op} has no identity (numpy raises too); "
                         "check the size before reducing")
    if op.startswith("arg") and inner > 2**31 - 1:
        raise ValueError(f"{op}: {where} has {inner} elements along the reduced axis; int32 indices "
                         "hold at most 2**31 - 1")
    out_bytes = outer * np.dtype(spec.out_dtype).itemsize
    if out_bytes > _binding_limit(gpu):
        raise ValueError(f"{op}: {where} gives a result of {out_bytes} bytes, more than the adapter's "
                         f"max-storage-buffer-binding-size of {_binding_limit(gpu)} bytes can bind")
    out = gpu.empty(out_shape, spec.out_dtype)
    if outer == 0:
        return out
    _record(op, gpu, x, spec, outer, inner, so, sk, out, where)
    return out


def _grid_target(gpu: GPUContext) -> int:
    if GRID_TARGET is not None:
        return GRID_TARGET
    info = getattr(gpu.device, "adapter_info", None) or {}
    return CPU_GRID_TARGET if info.get("adapter_type") == "CPU" else GPU_GRID_TARGET


def _binding_limit(gpu: GPUContext) -> int:
    limit = int(gpu.limits["max-storage-buffer-binding-size"])
    return limit if MAX_BINDING_BYTES is None else builtins.min(limit, MAX_BINDING_BYTES)


def _record(op: str, gpu: GPUContext, x: Tensor, spec: _OpSpec, outer: int, inner: int, so: int, sk: int,
            out: Tensor, where: str) -> None:
    """Record the passes of one reduction of ``x`` (viewed as ``outer`` rows) into ``out``."""
    limits = gpu.limits
    dim_limit = int(limits["max-compute-workgroups-per-dimension"])
    if MAX_GRID_DIM is not None:
        dim_limit = builtins.min(dim_limit, MAX_GRID_DIM)
    limit = _binding_limit(gpu)
    align = builtins.max(16, int(limits["min-storage-buffer-offset-alignment"]))
    target = builtins.max(1, builtins.min(_grid_target(gpu), dim_limit))
    subgroups = USE_SUBGROUPS and "subgroup" in gpu.features and spec.subgroups
    count = float(inner)
    state_dt, state_n = spec.state
    src, partial = x, False
    while True:
        esz = 4 * (state_n if partial else 1)
        k_fast = sk == 1
        vec_ok = not partial and k_fast and (outer == 1 or so % 4 == 0)
        if outer == 1:
            tk = WORKGROUP
        elif k_fast:
            tk = builtins.min(WORKGROUP, _pow2_ceil(-(-inner // (4 if vec_ok else 1))))
        else:
            tk = WORKGROUP // builtins.min(WORKGROUP, _pow2_ceil(outer))
        to = WORKGROUP // tk
        o_tiles = -(-outer // to)
        per_group = tk * (PARTIAL_ITEMS_PER_THREAD if partial else ITEMS_PER_THREAD * (4 if vec_ok else 1))

        def groups_for(k_cnt: int, per_group: int = per_group, o_tiles: int = o_tiles) -> int:
            g = builtins.min(-(-k_cnt // per_group), -(-target // o_tiles))
            return builtins.max(1, builtins.min(g, target))

        chunks = _plan_chunks(outer, inner, so, sk, esz, src.nbytes // esz, limit, align, groups_for)
        rows = builtins.max(c.g_base + c.groups for c in chunks)
        final = rows == 1
        if final:
            dst = out
        else:
            n_part = rows * outer
            dst = gpu.empty((n_part, state_n) if state_n > 1 else (n_part,), state_dt)
            if dst.nbytes > limit:  # at most ~GRID_TARGET * 256 states: never with real limits
                raise ValueError(f"{op}: {where} needs {dst.nbytes} bytes of partial results, more than "
                                 f"the adapter's max-storage-buffer-binding-size of {limit} bytes can bind")
        for c in chunks:
            vec = vec_ok and c.base % 4 == 0 and c.k_cnt >= 4
            sg = subgroups and tk == WORKGROUP
            v = _Variant(op, x.dtype.name, partial, vec, final, tk, k_fast, sg)
            kern = gpu.kernel(_source(v), "main", label=_label(v))
            window = src if (c.win_off == 0 and c.win_len * esz == src.nbytes) else _window(src, c, esz, partial)
            params = struct.pack(_PARAMS_FMT, c.base, c.o_cnt, c.k_cnt, so, sk, c.o0, outer, c.g_base,
                                 c.k0, count, 0, 0)
            grid = (c.groups, builtins.min(-(-c.o_cnt // to), dim_limit))
            if vec:
                gpu.dispatch(kern, grid, window, window, dst, params)
            else:
                gpu.dispatch(kern, grid, window, dst, params)
        if final:
            return
        src, partial = dst, True
        inner, so, sk = rows, 1, outer
        if outer == 1:
            so = 1


def _window(src: Tensor, c: _Chunk, esz: int, partial: bool) -> Tensor:
    """A Tensor over elements [win_off, win_off + win_len) of ``src`` (no copy)."""
    shape: tuple[int, ...] = (c.win_len, src.shape[1]) if partial and src.ndim == 2 else (c.win_len,)
    return Tensor(src.buffer, shape, src.dtype, offset=src.offset + c.win_off * esz)


def _label(v: _Variant) -> str:
    parts = [f"reduce.{v.op}.{v.dtype}", "partial" if v.partial else ("vec4" if v.vec else "scalar"),
             "final" if v.final else "pass", f"tk{v.tk}", "kfast" if v.k_fast else "kslow"]
    if v.subgroups:
        parts.append("subgroups")
    return ".".join(parts)


# -- public ops ------------------------------------------------------------------------------
def sum(gpu: GPUContext, x: Tensor, axis: int | None = None) -> Tensor:
    """Sum of ``x`` (whole tensor, or along ``axis`` of a 2-D tensor), recorded into ``gpu``.

    float32 -> float32, int32 -> int64 (exact). Empty -> 0.
    """
    return _reduce("sum", gpu, x, axis)


def mean(gpu: GPUContext, x: Tensor, axis: int | None = None) -> Tensor:
    """Arithmetic mean of ``x`` (whole tensor, or along ``axis`` of a 2-D tensor); float32.

    Empty -> NaN (numpy warns; hetero does not).
    """
    return _reduce("mean", gpu, x, axis)


def max(gpu: GPUContext, x: Tensor, axis: int | None = None) -> Tensor:
    """Maximum of ``x``; NaN if any element is NaN (like ``numpy.max``). Empty raises ValueError."""
    return _reduce("max", gpu, x, axis)


def min(gpu: GPUContext, x: Tensor, axis: int | None = None) -> Tensor:
    """Minimum of ``x``; NaN if any element is NaN (like ``numpy.min``). Empty raises ValueError."""
    return _reduce("min", gpu, x, axis)


def argmax(gpu: GPUContext, x: Tensor, axis: int | None = None) -> Tensor:
    """Index (int32) of the first maximum of ``x``, or of the first NaN (like ``numpy.argmax``).

    ``axis=None`` indexes the flattened tensor. Empty raises ValueError.
    """
    return _reduce("argmax", gpu, x, axis)


def argmin(gpu: GPUContext, x: Tensor, axis: int | None = None) -> Tensor:
    """Index (int32) of the first minimum of ``x``, or of the first NaN (like ``numpy.argmin``).

    ``axis=None`` indexes the flattened tensor. Empty raises ValueError.
    """
    return _reduce("argmin", gpu, x, axis)

