"""WGSL of the decoder's register-blocked GEMM: ``linear`` for many rows (prefill, many streams).

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

from hetero.kernels import decoder_wgsl as W

__all__ = ["SLICE_UNITS", "THREAD_BLOCK", "Blocking", "blocking", "linear_blocked"]

SLICE_UNITS = 2
"""Weight units (8 weights) of K a slice of the blocked kernel takes: 16 k, so that a 64 x 64
tile's two slices of workgroup memory (x and one weight) are 8 KiB, within WebGPU's default 16 KiB."""

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
    for g in range(gm):
        for i in range(4):
            r = g * 4 + i
            add(f"    let row{r} = m0 + {g * 4 * ty_n + i}u + ty * 4u;")
            add(f"    if (row{r} < p.m) {{")
            ss = f"ss{g}.{_XYZW[i]}"
            if partial:
                if norm:
                    add(f"        if (tx == 0u) {{ pss[tile.z * p.m + row{r}] = {ss}; }}")
            else:
                scale = f"inverseSqrt({ss} / f32(p.k) + p.eps)" if norm else "1.0"
                add(f"        let sc{r} = {scale};")
            for h in range(gn):
                add(f"        let col{r}_{h} = n0 + {h * 4 * tx_n}u + tx * 4u;")
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
    body = "\n".join(L)
    shared = f"var<workgroup> As: array<vec4<f32>, {bk * bm // 4}>;\n" + "".join(
        f"var<workgroup> Bs{w}: array<vec4<f32>, {bk * bn // 4}>;\n" for w in range(nw))
    return (W.tiled_prelude(kind, vec, swiglu, norm, bias, residual, partial) + "\n" + shared + f"""
@compute @workgroup_size({threads})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {{
{body}
}}
""")
