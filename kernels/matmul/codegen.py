"""WGSL of the float32/float16 matmul kernel and of the K split's summing pass.

:func:`wgsl` (and :func:`source`, memoised) generate one kernel per configuration and
call :class:`Variant`; :func:`sum_source` the pass that adds a K split's partials. The
layout of a thread's work is described in :mod:`hetero.kernels.matmul`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from hetero.kernels.matmul.config import PAD, MatmulConfig
from hetero.kernels.matmul.emit import XYZW, emit_block, emit_k_loop, emit_store, fma_rows, fragments, guard_slot
from hetero.kernels.wgsl_math import GELU4, MATH

__all__ = ["ACTIVATIONS", "Variant", "activation_prelude", "source", "sum_source", "wgsl"]


@dataclass(frozen=True)
class Variant:
    """What the shapes and options of one call change in the generated WGSL."""

    f16: bool  # float16 storage (inputs and output), float32 arithmetic
    vec_a: bool  # A rows (K) are a multiple of 4: vec4 loads
    vec_b: bool  # B rows (N, or K when transposed) are a multiple of 4: vec4 loads
    vec_c: bool  # N is a multiple of 4: vec4 stores of C (and bias)
    trans_b: bool
    bias: bool
    partial: bool = False  # write float32 partial sums of a K split (no bias); a second pass adds them
    odd_n: bool = False  # float16 output with an odd N: rows do not start on 32-bit words
    act: str = ""  # "gelu": applied to every result element (after the bias) in the store


def wgsl(config: MatmulConfig, *, f16: bool = False, vec_a: bool = True, vec_b: bool = True, vec_c: bool = True,
         transpose_b: bool = False, bias: bool = False, odd_n: bool = False, activation: str | None = None) -> str:
    """The WGSL source of one kernel variant (for reading, or compiling it yourself).

    ``vec_*``: the row lengths of A (K), B (N, or K with ``transpose_b``) and C (N) are
    multiples of 4; ``odd_n``: N is odd (float16 output only). Bindings: 0 A, 1 B, 2 C
    (float32 partials when ``config.split_k > 1``), 3 the ``Params`` uniform, 4 bias.
    """
    split = config.split_k > 1
    return source(config, Variant(f16, vec_a, vec_b, vec_c, transpose_b, bias and not split, split, f16 and odd_n,
                                  "" if split else (activation or "")))


@lru_cache(maxsize=256)
def source(c: MatmulConfig, v: Variant) -> str:
    """The WGSL of configuration ``c`` for the call variant ``v`` (memoised)."""
    nt, tx_n, ty_n = c.threads, c.bn // c.tn, c.bm // c.tm
    rsa4, rsb4 = (c.bm + PAD) // 4, (c.bn + PAD) // 4  # vec4 per K-row of As / Bs
    zero4 = "vec4<f32>(0.0)"
    gm, gn = c.tm // 4, c.tn // 4
    # float16 data travels as u32 words (two halves each) and is converted with
    # unpack2x16float / pack2x16float: core WGSL, no shader-f16 needed, f32 arithmetic.
    half_out = v.f16 and not v.partial

    def arr(vec: bool, f16: bool) -> str:
        if f16:
            return "array<vec2<u32>>" if vec else "array<u32>"
        return "array<vec4<f32>>" if vec else "array<f32>"

    def ld4(src: str, i: str) -> str:  # 4 values at vec4 index i (element 4 i)
        return f"h4({src}[{i}])" if v.f16 else f"{src}[{i}]"

    def ld1(src: str, e: str) -> str:  # the value at element e
        return f"h1w({src}[({e}) / 2u], {e})" if v.f16 else f"{src}[{e}]"

    L: list[str] = []
    emit = L.append
    # The header spells the variant "_Variant(...)": pipelines are cached by a hash of this source.
    emit(f"// hetero matmul {c.name} _{v!r}")
    emit(_PARAMS)
    emit(f"@group(0) @binding(0) var<storage, read> A: {arr(v.vec_a, v.f16)};")
    emit(f"@group(0) @binding(1) var<storage, read> B: {arr(v.vec_b, v.f16)};")
    if half_out and not v.vec_c and v.odd_n:
        emit("@group(0) @binding(2) var<storage, read_write> C: array<atomic<u32>>;")  # halves of shared words
    else:
        emit(f"@group(0) @binding(2) var<storage, read_write> C: {arr(v.vec_c, half_out)};")
    emit("@group(0) @binding(3) var<uniform> p: Params;")
    if v.bias:
        emit(f"@group(0) @binding(4) var<storage, read> bias: {arr(v.vec_c, v.f16)};")
    if v.f16:
        emit(_HALF_HELPERS)
    if v.act:
        emit(activation_prelude())
    if half_out and not v.vec_c and v.odd_n:
        emit(_STORE_HALF)
    bufs = (0, 1) if c.double_buffer else (0,)
    for b in bufs:
        emit(f"var<workgroup> As{b}: array<vec4<f32>, {c.bk * rsa4}>;")
        emit(f"var<workgroup> Bs{b}: array<vec4<f32>, {c.bk * rsb4}>;")
    emit(f"@compute @workgroup_size({nt})")
    emit("fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) tid: u32) {")
    emit("    let w = hetero_workgroup_id(wid);")
    if v.act:
        emit("    nn_zero = p.pad;  // 0, unknown to the compiler (see hetero.kernels.nn)")
    emit(f"    let tx = tid % {tx_n}u;")
    emit(f"    let ty = tid / {tx_n}u;")
    emit(f"    let m0 = (w.y + p.y0) * {c.bm}u;")
    emit(f"    let n0 = w.x * {c.bn}u;")
    emit("    let zz = w.z + p.z0;  // batch * split + the K part")
    emit("    let z = zz / p.split;")
    emit("    let kb = (zz % p.split) * p.kc;  // this workgroup's K range: [kb, ke)")
    emit("    let ke = min(p.K, kb + p.kc);")
    emit("    let ba = z * p.sa;")
    emit("    let bb = z * p.sb;")
    emit("    let bc = ((zz % p.split) * p.nb + z) * p.sc;  // partials: [split, batch, M, N]")
    for r in range(c.tm):
        for h in range(gn):
            emit(f"    var c{r}_{h} = {zero4};")

    # Loaders. A "rowk" tile holds `rows` rows of BK along K (A, and B when transposed):
    # thread slot idx -> row idx / (BK/4), K-quad idx % (BK/4); it is stored transposed,
    # one float at a time. The plain B tile holds BK rows of BN along N: idx -> k idx / (BN/4),
    # N-quad idx % (BN/4); stored as it is, one vec4 at a time.
    kq, nq = c.bk // 4, c.bn // 4
    loads: list[tuple[str, int, int]] = []  # (tag, slot, number of vec4 in the tile)

    def rowk_setup(tag: str, rows: int, origin: str, limit: str, base: str) -> None:
        count = rows * kq
        rs4 = rsa4 if tag == "a" else rsb4
        for i in range(-(-count // nt)):
            idx = f"(tid + {i * nt}u)"
            guard = f" && {idx} < {count}u" if (i + 1) * nt > count else ""
            emit(f"    let {tag}r{i} = {idx} / {kq}u;")
            emit(f"    let {tag}k{i} = ({idx} % {kq}u) * 4u;")
            emit(f"    let {tag}ok{i} = {origin} + {tag}r{i} < {limit}{guard};")
            emit(f"    let {tag}e{i} = {base} + ({origin} + {tag}r{i}) * p.K + {tag}k{i};")
            emit(f"    let {tag}s{i} = {tag}k{i} * {rs4}u + {tag}r{i} / 4u;")
            emit(f"    let {tag}c{i} = {tag}r{i} % 4u;")
            emit(f"    var {tag}v{i} = {zero4};")
            loads.append((tag, i, count))

    def rowk_load(tag: str, i: int, k0: str, vec: bool) -> list[str]:
        src = "A" if tag == "a" else "B"
        ok, e, kk = f"{tag}ok{i}", f"{tag}e{i}", f"({k0} + {tag}k{i})"
        if vec:
            return [f"{tag}v{i} = select({zero4}, {ld4(src, f'({e} + {k0}) / 4u')}, {ok} && {kk} < ke);"]
        parts = [f"select(0.0, {ld1(src, f'{e} + {k0} + {j}u')}, {ok} && {kk} + {j}u < ke)" for j in range(4)]
        return [f"{tag}v{i} = vec4<f32>({', '.join(parts)});"]

    def plain_b_setup() -> None:
        count = c.bk * nq
        for i in range(-(-count // nt)):
            idx = f"(tid + {i * nt}u)"
            guard = f" && {idx} < {count}u" if (i + 1) * nt > count else ""
            emit(f"    let bk{i} = {idx} / {nq}u;")
            emit(f"    let bn{i} = ({idx} % {nq}u) * 4u;")
            emit(f"    let bok{i} = n0 + bn{i} < p.N{guard};")
            emit(f"    let be{i} = bb + bk{i} * p.N + n0 + bn{i};")
            emit(f"    let bs{i} = bk{i} * {rsb4}u + bn{i} / 4u;")
            emit(f"    var bv{i} = {zero4};")
            loads.append(("p", i, count))

    def plain_b_load(i: int, k0: str, vec: bool) -> list[str]:
        ok = f"bok{i} && {k0} + bk{i} < ke"
        e = f"be{i} + {k0} * p.N"
        if vec:
            return [f"bv{i} = select({zero4}, {ld4('B', f'({e}) / 4u')}, {ok});"]
        parts = [f"select(0.0, {ld1('B', f'{e} + {j}u')}, {ok} && n0 + bn{i} + {j}u < p.N)" for j in range(4)]
        return [f"bv{i} = vec4<f32>({', '.join(parts)});"]

    rowk_setup("a", c.bm, "m0", "p.M", "ba")
    if v.trans_b:
        rowk_setup("b", c.bn, "n0", "p.N", "bb")
    else:
        plain_b_setup()

    def load_all(k0: str) -> list[str]:
        out: list[str] = []
        for tag, i, _ in loads:
            if tag == "p":
                out += plain_b_load(i, k0, v.vec_b)
            else:
                out += rowk_load(tag, i, k0, v.vec_a if tag == "a" else v.vec_b)
        return out

    def store_all(buf: int) -> list[str]:
        out: list[str] = []
        for tag, i, count in loads:
            if tag == "p":
                body = [f"Bs{buf}[bs{i}] = bv{i};"]
            else:
                name, rs4 = (f"As{buf}", rsa4) if tag == "a" else (f"Bs{buf}", rsb4)
                body = [f"{name}[{tag}s{i} + {j * rs4}u][{tag}c{i}] = {tag}v{i}.{XYZW[j]};" for j in range(4)]
            out += guard_slot(i, nt, count, body)
        return out

    def compute(buf: int) -> list[str]:
        out: list[str] = []
        for k in range(c.bk):
            out.append("{")
            out += fragments(buf, k, gm, gn, rsa4, rsb4, ty_n, tx_n)
            for g in range(gm):
                out += fma_rows(g, gn)
            out.append("}")
        return out

    emit(f"    let nt = select(0u, (ke - kb + {c.bk - 1}u) / {c.bk}u, ke > kb);")
    emit_block(emit, load_all("kb"), 4)
    emit("    var t = 0u;")
    emit_k_loop(emit, c.double_buffer, lambda t: f"kb + ({t} + 1u) * {c.bk}u", load_all, compute, store_all)

    def tile(r: int, h: int) -> list[str]:
        out = [f"let e = bc + row{r} * p.N + col;"]
        acc = f"c{r}_{h}"
        if v.vec_c:
            val = f"{acc} + {ld4('bias', 'col / 4u')}" if v.bias else acc
            if v.act:
                val = f"nn_gelu4({val})"
            if half_out:
                out.append(f"let q = {val};")
                val = "vec2<u32>(pack2x16float(q.xy), pack2x16float(q.zw))"
            return out + [f"if (col < p.N) {{ C[e / 4u] = {val}; }}"]
        vals = [f"{acc}.{XYZW[j]}" + (f" + {ld1('bias', f'col + {j}u')}" if v.bias else "") for j in range(4)]
        if v.act:
            vals = [f"nn_gelu({x})" for x in vals]
        if not half_out:
            return out + [f"if (col + {j}u < p.N) {{ C[e + {j}u] = {vals[j]}; }}" for j in range(4)]
        if not v.odd_n:  # N even: e is even, the thread owns whole words
            return out + [f"if (col < p.N) {{ C[e / 2u] = pack2x16float(vec2<f32>({vals[0]}, {vals[1]})); }}",
                          f"if (col + 2u < p.N) {{ C[e / 2u + 1u] = pack2x16float(vec2<f32>({vals[2]}, {vals[3]})); }}"]
        # N odd: a word may hold halves of two threads' elements
        return out + [f"if (col + {j}u < p.N) {{ store_half(e + {j}u, {vals[j]}); }}" for j in range(4)]

    emit_store(emit, gm, gn, ty_n, tx_n, tile)
    emit("}")
    return "\n".join(L) + "\n"


_STORE_HALF = """
fn store_half(e: u32, x: f32) {
    let sh = (e & 1u) * 16u;
    atomicAnd(&C[e / 2u], ~(0xffffu << sh));
    atomicOr(&C[e / 2u], (pack2x16float(vec2<f32>(x, 0.0)) & 0xffffu) << sh);
}
"""
_HALF_HELPERS = """
fn h4(v: vec2<u32>) -> vec4<f32> { return vec4<f32>(unpack2x16float(v.x), unpack2x16float(v.y)); }
fn h1w(w: u32, e: u32) -> f32 { let u = unpack2x16float(w); return select(u.x, u.y, (e & 1u) == 1u); }
"""


# sa, sb, sc: elements between batches of A, B, C; y0, z0: the first row tile and batch x split
# index of this dispatch; split: K parts, kc: K per part; nb: the batch.
_PARAMS = ("struct Params { M: u32, N: u32, K: u32, sa: u32, sb: u32, sc: u32, y0: u32, z0: u32, "
           "split: u32, kc: u32, nb: u32, pad: u32 }")

# The second pass of a K split: C = the sum of the `split` partials (+ bias), one unit per
# invocation (a vec4 when N is a multiple of 4; else one float32, or two float16 in a word);
# any number of workgroups along x.
_SUM_PARTIALS = """
struct SumParams { units: u32, stride: u32, split: u32, n: u32, zero: u32, p0: u32, p1: u32, p2: u32 }  // stride: P units per part
@group(0) @binding(0) var<storage, read> P: array<$PV>;
@group(0) @binding(1) var<storage, read_write> C: array<$CV>;
@group(0) @binding(2) var<uniform> p: SumParams;
$BIAS_DECL
$HELPERS
fn part(i: u32) -> $SV {
    var s = P[i];
    for (var j = 1u; j < p.split; j = j + 1u) { s = s + P[i + j * p.stride]; }
    return s;
}
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
    let i = hetero_workgroup_id(wid).x * 256u + tid;
    if (i >= p.units) { return; }
$ZERO
$BODY
}
"""


@lru_cache(maxsize=32)
def sum_source(f16: bool, vec: bool, bias: bool, act: str = "") -> str:
    """The second pass of a K split: the partials summed (+ bias, + activation) into C."""
    sv = "vec4<f32>" if vec else "f32"

    def a(x: str, four: bool = False) -> str:  # the activation, if any
        return x if not act else f"nn_gelu4({x})" if four else f"nn_gelu({x})"

    if vec:
        cv = "vec2<u32>" if f16 else "vec4<f32>"
        b = ("h4(bias[i % (p.n / 4u)])" if f16 else "bias[i % (p.n / 4u)]") if bias else ""
        val = a("part(i)" + (f" + {b}" if bias else ""), four=True)
        body = (f"    let q = {val};\n    C[i] = vec2<u32>(pack2x16float(q.xy), pack2x16float(q.zw));" if f16
                else f"    C[i] = {val};")
    elif not f16:
        cv = "f32"
        body = "    C[i] = " + a("part(i)" + (" + bias[i % p.n]" if bias else "")) + ";"
    else:  # two float16 per u32 word: elements 2i and 2i + 1 (the second may be past the end)
        cv = "u32"
        lo = a("part(2u * i)" + (" + h1w(bias[((2u * i) % p.n) / 2u], (2u * i) % p.n)" if bias else ""))
        hi = ("select(0.0, " + a("part(2u * i + 1u)" + (" + h1w(bias[((2u * i + 1u) % p.n) / 2u], (2u * i + 1u) % p.n)"
                                                        if bias else "")) + ", 2u * i + 1u < p.stride)")
        body = f"    C[i] = pack2x16float(vec2<f32>({lo}, {hi}));"
    bias_t = ("array<vec2<u32>>" if vec else "array<u32>") if f16 else f"array<{sv}>"
    helpers = (_HALF_HELPERS if f16 else "") + (activation_prelude() if act else "")
    return (_SUM_PARTIALS.replace("$PV", sv).replace("$SV", sv).replace("$CV", cv)
            .replace("$BIAS_DECL", f"@group(0) @binding(3) var<storage, read> bias: {bias_t};" if bias else "")
            .replace("$HELPERS", helpers).replace("$ZERO", "    nn_zero = p.zero;" if act else "")
            .replace("$BODY", body))


ACTIVATIONS = ("gelu",)


def activation_prelude() -> str:
    """WGSL of the activations: the erf-form GELU of :mod:`hetero.kernels.wgsl_math` (``nn_gelu``, ``nn_gelu4``)."""
    return _ACTIVATION_PRELUDE


_ACTIVATION_PRELUDE = MATH + GELU4
