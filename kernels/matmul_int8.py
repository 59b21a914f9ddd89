"""INT8 weight-quantized matmul for GPU stages: ``matmul_int8(gpu, x, qw, bias=, strategy=)``.

``y = x @ w (+ bias)`` with ``x`` float32 ``[M, K]`` or ``[B, S, K]`` and ``w`` a float32
``[K, N]`` weight (``[N, K]``, torch.nn.Linear's layout, with ``transpose_b=True``)
quantized once on the host by :func:`quantize_weight`.

Quantization (host, numpy). Per output channel ``n``, symmetric:
``scale_n = max_k |w[k, n]| / 127``, ``q[k, n] = round(w[k, n] / scale_n)`` in
``[-127, 127]`` (a zero column gets scale 0 and q 0). Error per element:
``|w[k, n] - scale_n * q[k, n]| <= scale_n / 2``, so for ``y = x w`` each output is
within ``(scale_n / 2) * sum_k |x_k|`` of ``x dequant(q)`` (plus float32 rounding).

Packed layout (:attr:`QuantizedWeight.packed`, ``uint32 [Kp / 4, Np]``): word
``packed[k4, n]`` holds ``q[4 k4 + j, n]`` in byte ``j`` (two's complement, byte 0
the least significant), i.e. four K-consecutive int8 of one output channel per word,
with consecutive channels in consecutive words. ``Kp`` is K rounded up to a multiple
of 16 and ``Np`` N rounded up to a multiple of 4, the padding zeros. So a workgroup's
weight tile is loaded as ``vec4<u32>`` rows (4 channels x 4 K each, coalesced along
N), which is what both kernels read best, and needs no transpose in workgroup memory.

Kernel strategies (``strategy=``), all register-blocked like
:mod:`hetero.kernels.matmul` (its :class:`MatmulConfig` tiles: a ``bm x bn`` tile per
workgroup, ``tm x tn`` vec4 accumulators per thread, ``bk``-deep K slices, optional
double buffering; no split-K):

* ``"dequant"``: activations stay float32. The weight tile is unpacked to float32
  *once per tile load* (shift the byte to the top, arithmetic shift back:
  ``bitcast<vec4<i32>>(v << s) >> 24``, four channels at a time) into workgroup
  memory, so the inner loop is exactly the float32 kernel's (``tm * tn`` FMAs per
  ``tm/4 + tn/4`` vec4 reads). The channel scale is factored out of the sum and
  applied in the store: ``y = scale_n * sum_k x_k q_kn + bias_n``. Reads 4x fewer
  weight bytes than float32; arithmetic is that of the float32 kernel.
* ``"dp4a"``: activations quantized too. A first dispatch computes per row
  ``rs_m = max_k |x[m, k]| / 127`` and packs ``round(x / rs_m)`` four per u32
  (``pack4xI8``, ``[M, Kp/4]``); the matmul keeps int8x4 words of both operands in
  workgroup memory and accumulates ``dot4I8Packed`` (4 multiply-adds per
  instruction, exact in i32 for ``K < 133000``), then ``y = rs_m * scale_n * acc + bias_n``.
  Extra error per output: ``(rs_m / 2) * sum_k |dequant(q)[k, n]|``
  (:meth:`QuantizedWeight.error_bound` with ``strategy="dp4a"``).
* ``"dp4a-g32"``, ``"dp4a-g64"``: dp4a with one activation scale per row *and* per group
  of G consecutive K (scales ``[M, ceil(K/G)]``; :func:`quantize_activations` with
  ``group=G``), so an outlier feature only coarsens its own group. The inner loop is
  dp4a's; every G K (``bk`` must divide G or be a multiple of it) each thread adds
  ``f32(acc_i32) * rs_mg`` into float32 accumulators and zeroes the i32 ones (one
  convert + FMA per output per G/4 dot4s); the channel scale is applied at the store.
  Extra error per output: ``sum_g (rs_mg / 2) * sum_{k in g} |dequant(q)[k, n]|``.
  On the MiniLM fixture (min / mean cosine against sentence-transformers): dp4a 0.9857 /
  0.9952, dp4a-g32 0.9948 / 0.9986, dp4a-g64 0.9946 / 0.9984, dequant 0.9965 / 0.9991.

Choosing. ``strategy="auto"`` (default) picks ``"dp4a"`` on every adapter: it has 4x the
multiply-adds per instruction and a quarter of the workgroup-memory traffic of float32,
and it is the fastest strategy on lavapipe and on the H200 (BENCHMARKS.md, "INT8
weight-quantized matmul" and "Kernel defaults on lavapipe"). ``"dequant"`` keeps the
activations exact (only the weight's error), at float32 arithmetic speed.
``python -m bench.matmul_int8 --strategy all`` measures every strategy, so the choice can
be confirmed per device; pass ``strategy=`` to force one.

Keeping the weight on the device. ``matmul_int8`` accepts a :class:`QuantizedWeight`
(its packed words and scales are uploaded by every call) or a :class:`GPUWeight`:
``qw.to_gpu(gpu)`` records the upload into a GPU context and returns tensors that live
as long as that context holds them (a stage's temporaries: until the stage is
submitted); :func:`resident` uploads into a context of its own on a Runtime's or
Device's device and keeps the weight there across runs until ``.release()``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, Literal

import numpy as np

from hetero.kernels.matmul.cache import adapter_info
from hetero.kernels.matmul.config import PAD, MatmulConfig, default_config
from hetero.kernels.matmul.emit import XYZW, emit_block, emit_k_loop, emit_store, fma_rows, fragments, guard_slot
from hetero.kernels.matmul.op import cdiv
from hetero.lowlevel import Device, GPUContext, Tensor, device_of

__all__ = ["DP4A_CANDIDATES", "DEQUANT_CANDIDATES", "GPUWeight", "QuantizedWeight", "Strategy", "choose",
           "dequantize", "matmul_int8", "quantize_activations", "quantize_weight", "resident", "wgsl"]

Strategy = Literal["auto", "dequant", "dp4a", "dp4a-g32", "dp4a-g64"]
STRATEGIES: tuple[str, ...] = ("dequant", "dp4a", "dp4a-g32", "dp4a-g64")
GROUPS: dict[str, int] = {"dp4a-g32": 32, "dp4a-g64": 64}  # activation scale per row and per G consecutive K


def _group(strategy: str) -> int:
    """The activation group size of a dp4a strategy: 0 (one scale per row) or G."""
    return GROUPS.get(strategy, 0)
DP4A_MAX_K = (2**31 - 1) // (127 * 127)  # 133144: i32 sums of int8 products cannot overflow
K_ALIGN = 16  # K is padded to this in the packed layout (a vec4<u32> of int8 per row and slice)


# -- host side ----------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """An int8 weight ``[K, N]`` with per-output-channel float32 scales (see the module doc).

    ``packed``: ``uint32 [Kp/4, Np]``; ``scales``: ``float32 [N]``; ``k``, ``n``: the
    weight's logical shape. Error bound per element: ``|w - dequant| <= scales / 2``.
    """

    packed: np.ndarray
    scales: np.ndarray
    k: int
    n: int

    @property
    def k_padded(self) -> int:
        return int(self.packed.shape[0]) * 4

    @property
    def n_padded(self) -> int:
        return int(self.packed.shape[1])

    def values(self) -> np.ndarray:
        """The int8 values ``q`` as ``[K, N]``."""
        b = self.packed.astype("<u4").view(np.int8).reshape(self.packed.shape[0], self.n_padded, 4)
        return np.ascontiguousarray(b.transpose(0, 2, 1).reshape(self.k_padded, self.n_padded)[:self.k, :self.n])

    def dequantize(self) -> np.ndarray:
        """``scale_n * q[k, n]`` as float32 ``[K, N]``."""
        return (self.values().astype(np.float32) * self.scales[None, :]).astype(np.float32)

    def padded_scales(self) -> np.ndarray:
        s = np.zeros(self.n_padded, np.float32)
        s[:self.n] = self.scales
        return s

    def error_bound(self, x: np.ndarray, strategy: str = "dequant") -> np.ndarray:
        """Per-output bound on ``|matmul_int8(x, self) - x @ w|`` (float64, shape of the result).

        ``(scale_n / 2) * sum_k |x_k|``; with ``"dp4a"`` plus ``(rs_m / 2) * sum_k |dequant[k, n]|``
        (activation quantization, ``rs_m = max_k |x[m, k]| / 127``); with ``"dp4a-gG"`` plus
        ``sum_g (rs_mg / 2) * sum_{k in g} |dequant[k, n]|`` (``rs_mg`` over the group's K).
        Float32 rounding not included.
        """
        x64 = np.asarray(x, np.float64)
        bound = 0.5 * np.abs(x64).sum(axis=-1, keepdims=True) * self.scales.astype(np.float64)
        if strategy == "dp4a":
            rs = np.abs(x64).max(axis=-1, keepdims=True, initial=0.0) / 127.0
            bound = bound + 0.5 * rs * np.abs(self.dequantize().astype(np.float64)).sum(axis=0)
        elif strategy in GROUPS:  # per group: (rs_mg / 2) * sum_{k in g} |dequant[k, n]|
            g = GROUPS[strategy]
            ng = cdiv(max(self.k, 1), g)
            xp = np.zeros((*x64.shape[:-1], ng * g))
            xp[..., :self.k] = np.abs(x64)
            rs = xp.reshape(*x64.shape[:-1], ng, g).max(axis=-1) / 127.0  # [.., NG]
            dq = np.zeros((ng * g, self.n))
            dq[:self.k] = np.abs(self.dequantize().astype(np.float64))
            bound = bound + 0.5 * rs @ dq.reshape(ng, g, self.n).sum(axis=1)
        return bound

    def to_gpu(self, gpu: GPUContext) -> GPUWeight:
        """Upload into ``gpu`` (recorded into its stage): lives as long as that context holds it."""
        return GPUWeight(gpu.upload(self.packed), gpu.upload(self.padded_scales()), self.k, self.n)


@dataclass(frozen=True, eq=False)
class GPUWeight:
    """A :class:`QuantizedWeight` on the device: ``packed`` u32 ``[Kp/4, Np]``, ``scales`` f32 ``[Np]``."""

    packed: Tensor
    scales: Tensor
    k: int
    n: int
    holder: Any = None  # the GPUContext that owns the buffers (resident weights)

    def release(self) -> None:
        """Give the buffers of a :func:`resident` weight back to the pool (no-op for others)."""
        if self.holder is not None:
            self.holder.release_blocks()


def quantize_weight(w: np.ndarray, *, transpose_b: bool = False) -> QuantizedWeight:
    """Quantize a float weight ``[K, N]`` (``[N, K]`` with ``transpose_b``) to int8 per output channel."""
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"quantize_weight: w is {list(w.shape)} ({w.ndim}-D): w must be [K, N] "
                         f"({'[N, K] with transpose_b' if transpose_b else 'or [N, K] with transpose_b=True'})")
    if not np.issubdtype(w.dtype, np.floating):
        raise TypeError(f"quantize_weight: w is {w.dtype}: w must be a float array")
    wk = np.asarray(w.T if transpose_b else w, np.float32)  # [K, N]
    if not np.all(np.isfinite(wk)):
        raise ValueError("quantize_weight: w holds NaN or infinity")
    k, n = wk.shape
    amax = np.max(np.abs(wk), axis=0, initial=0.0).astype(np.float32)
    scales = (amax / np.float32(127.0)).astype(np.float32)
    safe = np.where(scales > 0, scales, np.float32(1.0))
    q = np.clip(np.rint(wk / safe[None, :]), -127, 127).astype(np.int8)
    kp, np_ = cdiv(max(k, 1), K_ALIGN) * K_ALIGN, cdiv(max(n, 1), 4) * 4
    full = np.zeros((kp, np_), np.int8)
    full[:k, :n] = q
    # word [k4, n] = bytes q[4 k4 + 0..3, n] (little-endian: byte j is K index 4 k4 + j)
    packed = np.ascontiguousarray(full.reshape(kp // 4, 4, np_).transpose(0, 2, 1)).view("<u4")
    return QuantizedWeight(np.ascontiguousarray(packed.reshape(kp // 4, np_).astype(np.uint32)), scales, k, n)


def dequantize(qw: QuantizedWeight) -> np.ndarray:
    """``qw.dequantize()``: the float32 ``[K, N]`` weight the kernels multiply by."""
    return qw.dequantize()


def quantize_activations(x: np.ndarray, group: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The ``"dp4a"`` activation rule on the host (for checking): ``(q int8 [.., K], rs float32 [.., 1])``.

    ``rs = max|x| / 127`` per row, ``q = clamp(round(x * (127 / max|x|)), -127, 127)`` in float32,
    as the GPU's first pass computes it (ties may round differently there: round-half-even both).
    ``group=G`` (``"dp4a-gG"``): the same per row and per G consecutive K (the last group may be
    short); ``rs`` is then ``[.., ceil(K / G)]``.
    """
    x = np.asarray(x, np.float32)
    if group:
        k = x.shape[-1]
        ng = cdiv(max(k, 1), group)
        xp = np.zeros((*x.shape[:-1], ng * group), np.float32)
        xp[..., :k] = x
        q, rs = quantize_activations(xp.reshape(*x.shape[:-1], ng, group))
        return np.ascontiguousarray(q.reshape(*x.shape[:-1], ng * group)[..., :k]), rs[..., 0]
    amax = np.max(np.abs(x), axis=-1, keepdims=True, initial=0.0).astype(np.float32)
    inv = np.where(amax > 0, np.float32(127.0) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.clip(np.rint(x * inv), -127, 127).astype(np.int8)
    return q, (amax / np.float32(127.0)).astype(np.float32)


def resident(target: Any, qw: QuantizedWeight) -> GPUWeight:
    """Upload ``qw`` once to the device of ``target`` (a Runtime, Device or GPUContext), kept until ``.release()``.

    Blocks until the copy completed (call it outside stages, e.g. before running graphs);
    the returned :class:`GPUWeight` may be passed to any stage of any run on that device.
    """
    dev: Device = device_of(target)
    holder = GPUContext(dev, "int8-weight")
    g = qw.to_gpu(holder)
    dev.wait(dev.submit([holder.encoder.finish()]))
    holder.settle(ran=True)
    return GPUWeight(g.packed, g.scales, g.k, g.n, holder)


# -- configurations -----------------------------------------------------------------------------
DEQUANT_CANDIDATES: tuple[MatmulConfig, ...] = (
    MatmulConfig(128, 128, 8, 8, 8), MatmulConfig(128, 128, 16, 8, 8), MatmulConfig(64, 64, 8, 8, 8),
    MatmulConfig(64, 64, 16, 4, 4), MatmulConfig(32, 32, 8, 4, 4),
)
DP4A_CANDIDATES: tuple[MatmulConfig, ...] = (
    MatmulConfig(128, 128, 32, 8, 8), MatmulConfig(128, 128, 64, 8, 8), MatmulConfig(64, 64, 32, 8, 8),
    MatmulConfig(64, 64, 64, 4, 4), MatmulConfig(32, 32, 32, 4, 4),
)


def _check_config(c: MatmulConfig, strategy: str) -> None:
    if c.split_k != 1:
        raise ValueError(f"matmul_int8: config {c.name}: split_k is not supported")
    if strategy.startswith("dp4a") and c.bk % 16:
        raise ValueError(f"matmul_int8: config {c.name}: bk must be a multiple of 16 for dp4a")
    g = _group(strategy)
    if g and c.bk % g and g % c.bk:
        raise ValueError(f"matmul_int8: config {c.name}: bk must divide or be a multiple of the group {g}")


def _fits(c: MatmulConfig, strategy: str, limits: dict[str, int]) -> str | None:
    """Why ``c`` cannot run (None: it can). dp4a keeps int8x4 words: a quarter of the float32 tile's memory."""
    _check_config(c, strategy)
    return (replace(c, bk=c.bk // 4) if strategy.startswith("dp4a") else c).fits(limits)


def default_int8_config(strategy: str, adapter_type: str, m: int, n: int,
                        limits: dict[str, int] | None = None) -> MatmulConfig:
    """The float32 kernel's default tile; for ``"dp4a"`` with 32-deep K slices (two int8x4 words per row)."""
    c = default_config(adapter_type, m, n, 1, limits)
    if strategy.startswith("dp4a"):
        c = MatmulConfig(c.bm, c.bn, 32, c.tm, c.tn, c.double_buffer)
    return c


def choose(gpu: Any, m: int, n: int, strategy: str = "auto") -> tuple[str, MatmulConfig]:
    """The strategy and tile ``matmul_int8`` uses on ``gpu``'s adapter for an ``M x N`` output."""
    info = adapter_info(gpu)
    if strategy == "auto":
        strategy = "dp4a"  # see "Choosing" in the module doc
    if strategy not in STRATEGIES:
        raise ValueError(f"matmul_int8: strategy must be 'auto' or one of {', '.join(STRATEGIES)}, "
                         f"got {strategy!r}")
    return strategy, default_int8_config(strategy, info["type"], m, n, gpu.limits)


# -- WGSL ---------------------------------------------------------------------------------------
# M, N: the output; K: the activations' row length; K4: u32 words per packed row (Kp / 4);
# NQ: vec4<u32> per weight row (Np / 4); y0: the first row tile of this dispatch.
_PARAMS = "struct Params { M: u32, N: u32, K: u32, K4: u32, NQ: u32, y0: u32, pad0: u32, pad1: u32 }"


def wgsl(config: MatmulConfig, strategy: str, *, vec_a: bool = True, vec_c: bool = True, bias: bool = False) -> str:
    """The WGSL of one kernel variant. ``vec_a``: K % 4 == 0 (dequant only); ``vec_c``: N % 4 == 0.

    Bindings, dequant: 0 x f32, 1 packed weight, 2 scales, 3 out, 4 Params, 5 bias.
    dp4a: 0 packed activations, 1 packed weight, 2 scales, 3 row scales, 4 out, 5 Params, 6 bias
    (dp4a-gG: 3 row-group scales ``[M, NG]``, NG in ``Params.pad0``).
    """
    _check_config(config, strategy)
    if strategy not in STRATEGIES:
        raise ValueError(f"matmul_int8: unknown strategy {strategy!r}")
    return _wgsl(config, strategy, vec_a or strategy.startswith("dp4a"), vec_c, bias)


@lru_cache(maxsize=128)
def _wgsl(c: MatmulConfig, strategy: str, vec_a: bool, vec_c: bool, bias: bool) -> str:
    dp = strategy.startswith("dp4a")
    grp = _group(strategy)  # 0, or G: i32 sums per group, flushed into f32 with the row-group scale
    nt, tx_n, ty_n = c.threads, c.bn // c.tn, c.bm // c.tm
    rsa4, rsb4 = (c.bm + PAD) // 4, (c.bn + PAD) // 4
    gm, gn = c.tm // 4, c.tn // 4
    kq4 = c.bk // 4  # packed words per row and slice
    rows = kq4 if dp else c.bk  # workgroup-memory rows per slice (words or K)
    ev = "vec4<u32>" if dp else "vec4<f32>"
    zero4 = f"{ev}(0u)" if dp else "vec4<f32>(0.0)"
    L: list[str] = []
    emit = L.append
    emit(f"// hetero matmul_int8 {strategy} {c.name} vec_a={vec_a} vec_c={vec_c} bias={bias}")
    emit(_PARAMS)
    b = 0
    if dp:
        emit("@group(0) @binding(0) var<storage, read> A: array<vec4<u32>>;")
    else:
        emit(f"@group(0) @binding(0) var<storage, read> A: {'array<vec4<f32>>' if vec_a else 'array<f32>'};")
    emit("@group(0) @binding(1) var<storage, read> Q: array<vec4<u32>>;")
    emit("@group(0) @binding(2) var<storage, read> S: array<vec4<f32>>;")
    b = 3
    if dp:  # per row [M], or per row and group [M, NG] (NG = p.pad0)
        emit("@group(0) @binding(3) var<storage, read> RS: array<f32>;")
        b = 4
    emit(f"@group(0) @binding({b}) var<storage, read_write> C: {'array<vec4<f32>>' if vec_c else 'array<f32>'};")
    emit(f"@group(0) @binding({b + 1}) var<uniform> p: Params;")
    if bias:
        emit(f"@group(0) @binding({b + 2}) var<storage, read> bias: array<f32>;")
    bufs = (0, 1) if c.double_buffer else (0,)
    for i in bufs:
        emit(f"var<workgroup> As{i}: array<{ev}, {rows * rsa4}>;")
        emit(f"var<workgroup> Bs{i}: array<{ev}, {rows * rsb4}>;")
    emit(f"@compute @workgroup_size({nt})")
    emit("fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) tid: u32) {")
    emit("    let w = hetero_workgroup_id(wid);")
    emit(f"    let tx = tid % {tx_n}u;")
    emit(f"    let ty = tid / {tx_n}u;")
    emit(f"    let m0 = (w.y + p.y0) * {c.bm}u;")
    emit(f"    let n0 = w.x * {c.bn}u;")
    acc0 = "vec4<i32>(0)" if dp else "vec4<f32>(0.0)"
    for r in range(c.tm):
        for h in range(gn):
            emit(f"    var c{r}_{h} = {acc0};")
            if grp:
                emit(f"    var f{r}_{h} = vec4<f32>(0.0);")

    def row_of(r: int) -> str:
        return f"m0 + {(r // 4) * 4 * ty_n + r % 4}u + ty * 4u"

    def flush(gi: str) -> list[str]:  # add the group's i32 sums, scaled by RS[row, gi], into the f32 ones
        out = ["{", f"    let gi = min({gi}, p.pad0 - 1u);"]
        for r in range(c.tm):
            out.append(f"    let gs{r} = vec4<f32>(RS[min({row_of(r)}, p.M - 1u) * p.pad0 + gi]);")
            for h in range(gn):
                out.append(f"    f{r}_{h} = fma(vec4<f32>(c{r}_{h}), gs{r}, f{r}_{h});")
                out.append(f"    c{r}_{h} = vec4<i32>(0);")
        out.append("}")
        return out

    # A slots: a row of the tile and a quad along it (4 floats, or 4 words = 16 int8).
    qa = kq4 // 4 if dp else kq4  # quads per row and slice
    a_count = c.bm * qa
    a_slots = cdiv(a_count, nt)
    for i in range(a_slots):
        idx = f"(tid + {i * nt}u)"
        guard = f" && {idx} < {a_count}u" if (i + 1) * nt > a_count else ""
        emit(f"    let ar{i} = {idx} / {qa}u;")
        emit(f"    let ak{i} = ({idx} % {qa}u) * 4u;")  # K (dequant) or word (dp4a) offset in the slice
        emit(f"    let aok{i} = m0 + ar{i} < p.M{guard};")
        emit(f"    let ae{i} = (m0 + ar{i}) * {'p.K4' if dp else 'p.K'} + ak{i};")
        emit(f"    let as{i} = ak{i} * {rsa4}u + ar{i} / 4u;")
        emit(f"    let ac{i} = ar{i} % 4u;")
        emit(f"    var av{i} = {zero4};")
    # B slots: a packed row (4 K) and a quad of channels.
    nq = c.bn // 4
    b_count = kq4 * nq
    b_slots = cdiv(b_count, nt)
    for i in range(b_slots):
        idx = f"(tid + {i * nt}u)"
        guard = f" && {idx} < {b_count}u" if (i + 1) * nt > b_count else ""
        emit(f"    let bk{i} = {idx} / {nq}u;")
        emit(f"    let bq{i} = {idx} % {nq}u;")
        emit(f"    let bok{i} = n0 / 4u + bq{i} < p.NQ{guard};")
        emit(f"    let be{i} = bk{i} * p.NQ + n0 / 4u + bq{i};")
        emit(f"    var bv{i} = vec4<u32>(0u);")

    def load_all(k0: str) -> list[str]:  # k0: K (dequant) or word (dp4a) index of the slice
        out: list[str] = []
        for i in range(a_slots):
            kk = f"({k0} + ak{i})"
            if dp:
                out.append(f"av{i} = select({zero4}, A[(ae{i} + {k0}) / 4u], aok{i} && {kk} < p.K4);")
            elif vec_a:
                out.append(f"av{i} = select({zero4}, A[(ae{i} + {k0}) / 4u], aok{i} && {kk} < p.K);")
            else:
                parts = [f"select(0.0, A[ae{i} + {k0} + {j}u], aok{i} && {kk} + {j}u < p.K)" for j in range(4)]
                out.append(f"av{i} = vec4<f32>({', '.join(parts)});")
        k4 = k0 if dp else f"({k0} / 4u)"
        for i in range(b_slots):
            out.append(f"bv{i} = select(vec4<u32>(0u), Q[be{i} + {k4} * p.NQ], bok{i} && {k4} + bk{i} < p.K4);")
        return out

    def store_all(buf: int) -> list[str]:
        out: list[str] = []
        for i in range(a_slots):
            body = [f"As{buf}[as{i} + {j * rsa4}u][ac{i}] = av{i}.{XYZW[j]};" for j in range(4)]
            out += guard_slot(i, nt, a_count, body)
        for i in range(b_slots):
            if dp:
                body = [f"Bs{buf}[bk{i} * {rsb4}u + bq{i}] = bv{i};"]
            else:  # byte j of the 4 words: K row 4 bk + j of 4 channels, sign-extended
                body = [f"Bs{buf}[(bk{i} * 4u + {j}u) * {rsb4}u + bq{i}] = "
                        f"vec4<f32>(bitcast<vec4<i32>>(bv{i} << vec4<u32>({24 - 8 * j}u)) >> vec4<u32>(24u));"
                        for j in range(4)]
            out += guard_slot(i, nt, b_count, body)
        return out

    def compute(buf: int) -> list[str]:
        out: list[str] = []
        for k in range(rows):
            out.append("{")
            out += fragments(buf, k, gm, gn, rsa4, rsb4, ty_n, tx_n)
            for g in range(gm):
                if not dp:
                    out += fma_rows(g, gn)
                    continue
                for i in range(4):
                    r = g * 4 + i
                    for h in range(gn):
                        dots = ", ".join(f"dot4I8Packed(a{g}.{XYZW[i]}, b{h}.{XYZW[j]})" for j in range(4))
                        out.append(f"    c{r}_{h} = c{r}_{h} + vec4<i32>({dots});")
            out.append("}")
            gw = grp // 4  # words per group
            if grp and grp <= c.bk and (k + 1) % gw == 0:  # groups inside the slice
                out += flush(f"t * {c.bk // grp}u + {(k + 1) // gw - 1}u")
        if grp and grp > c.bk:  # a group spans several slices
            per = grp // c.bk
            out += [f"if ((t + 1u) % {per}u == 0u || t + 1u == nt) {{"]
            out += ["    " + s for s in flush(f"t / {per}u")] + ["}"]
        return out

    step = kq4 if dp else c.bk
    end = "p.K4" if dp else "p.K"
    emit(f"    let nt = ({end} + {step - 1}u) / {step}u;")
    emit_block(emit, load_all("0u"), 4)
    emit("    var t = 0u;")
    emit_k_loop(emit, c.double_buffer, lambda t: f"({t} + 1u) * {step}u", load_all, compute, store_all)

    def tile(r: int, h: int) -> list[str]:
        out = ["if (col < p.N) {", f"let e = row{r} * p.N + col;"]
        if grp:
            out.append(f"var y = f{r}_{h} * S[col / 4u];")
        else:
            scale = f"S[col / 4u] * rs{r}" if dp else "S[col / 4u]"
            out.append(f"var y = vec4<f32>(c{r}_{h}) * ({scale});")
        if bias and vec_c:
            out.append("y = y + vec4<f32>(bias[col], bias[col + 1u], bias[col + 2u], bias[col + 3u]);")
        if vec_c:
            out.append("C[e / 4u] = y;")
        else:
            out += [f"if (col + {j}u < p.N) {{ C[e + {j}u] = y.{XYZW[j]}" + (f" + bias[col + {j}u]" if bias else "")
                    + "; }" for j in range(4)]
        return out + ["}"]

    emit_store(emit, gm, gn, ty_n, tx_n, tile, row=lambda r: [f"let rs{r} = RS[row{r}];"] if dp and not grp else [])
    emit("}")
    return "\n".join(L) + "\n"


# The dp4a first pass: one workgroup per row: absmax, then round(x * 127 / absmax) packed 4 per word.
_QUANT_ROWS = """
struct QP { M: u32, K: u32, K4: u32, pad: u32 }
@group(0) @binding(0) var<storage, read> X: array<f32>;
@group(0) @binding(1) var<storage, read_write> XQ: array<u32>;
@group(0) @binding(2) var<storage, read_write> RS: array<f32>;
@group(0) @binding(3) var<uniform> p: QP;
var<workgroup> red: array<f32, 64>;
@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
    let row = hetero_workgroup_id(wid).x;  // the grid is exactly M rows
    let base = row * p.K;
    var m = 0.0;
    for (var k = tid; k < p.K; k = k + 64u) { m = max(m, abs(X[base + k])); }
    red[tid] = m;
    workgroupBarrier();
    for (var s = 32u; s > 0u; s = s >> 1u) {
        if (tid < s) { red[tid] = max(red[tid], red[tid + s]); }
        workgroupBarrier();
    }
    let amax = red[0];
    let inv = select(0.0, 127.0 / amax, amax > 0.0);
    if (tid == 0u) { RS[row] = amax / 127.0; }
    for (var k4 = tid; k4 < p.K4; k4 = k4 + 64u) {
        var q = vec4<i32>(0);
        for (var j = 0u; j < 4u; j = j + 1u) {
            let k = 4u * k4 + j;
            if (k < p.K) { q[j] = i32(clamp(round(X[base + k] * inv), -127.0, 127.0)); }
        }
        XQ[row * p.K4 + k4] = pack4xI8(q);
    }
}
"""

# The dp4a-gG first pass: one workgroup per row, a thread per group of G (= p.G) consecutive K:
# absmax over the group, RS[row, g] = absmax / 127, round(x * 127 / absmax) packed 4 per word.
_QUANT_GROUPS = """
struct QP { M: u32, K: u32, K4: u32, G: u32, NG: u32, pad0: u32, pad1: u32, pad2: u32 }
@group(0) @binding(0) var<storage, read> X: array<f32>;
@group(0) @binding(1) var<storage, read_write> XQ: array<u32>;
@group(0) @binding(2) var<storage, read_write> RS: array<f32>;
@group(0) @binding(3) var<uniform> p: QP;
@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
    let row = hetero_workgroup_id(wid).x;  // the grid is exactly M rows
    let base = row * p.K;
    for (var g = tid; g < p.NG; g = g + 64u) {
        let k0 = g * p.G;
        let k1 = min(k0 + p.G, p.K);
        var m = 0.0;
        for (var k = k0; k < k1; k = k + 1u) { m = max(m, abs(X[base + k])); }
        let inv = select(0.0, 127.0 / m, m > 0.0);
        RS[row * p.NG + g] = m / 127.0;
        for (var k4 = k0 / 4u; k4 < min((k0 + p.G) / 4u, p.K4); k4 = k4 + 1u) {
            var q = vec4<i32>(0);
            for (var j = 0u; j < 4u; j = j + 1u) {
                let k = 4u * k4 + j;
                if (k < p.K) { q[j] = i32(clamp(round(X[base + k] * inv), -127.0, 127.0)); }
            }
            XQ[row * p.K4 + k4] = pack4xI8(q);
        }
    }
}
"""


# -- the op -------------------------------------------------------------------------------------
def matmul_int8(gpu: GPUContext, a: Tensor | np.ndarray, qw: QuantizedWeight | GPUWeight, *,
                bias: Tensor | np.ndarray | None = None, strategy: Strategy = "auto",
                config: MatmulConfig | None = None) -> Tensor:
    """``a @ dequant(qw) + bias`` recorded into ``gpu``; ``a`` float32 ``[M, K]`` or ``[B, S, K]``.

    ``qw``: a :class:`QuantizedWeight` (uploaded by this call) or a :class:`GPUWeight`
    (``qw.to_gpu(gpu)`` / :func:`resident`: already on the device). ``bias``: float32 ``[N]``.
    ``strategy``: ``"dequant"``, ``"dp4a"``, ``"dp4a-g32"``, ``"dp4a-g64"`` or ``"auto"`` (see the
    module doc); ``config`` forces a tile. Returns a new float32 Tensor ``[M, N]`` or ``[B, S, N]``.
    """
    a = gpu.upload(np.ascontiguousarray(a, np.float32)) if isinstance(a, np.ndarray) else a
    bias = gpu.upload(np.ascontiguousarray(bias, np.float32)) if isinstance(bias, np.ndarray) else bias
    if not isinstance(a, Tensor):
        raise TypeError(f"matmul_int8: a must be a hetero.Tensor or a numpy array, got {type(a).__name__}")
    if isinstance(qw, QuantizedWeight):
        qw = qw.to_gpu(gpu)
    if not isinstance(qw, GPUWeight):
        raise TypeError(f"matmul_int8: qw must be a QuantizedWeight or GPUWeight, got {type(qw).__name__}")
    if a.dtype != np.float32:
        raise TypeError(f"matmul_int8: a is {a.dtype}: a must be float32")
    if a.ndim not in (2, 3):
        raise ValueError(f"matmul_int8: a is {list(a.shape)}: a must be [M, K] or [B, S, K]")
    k, n = qw.k, qw.n
    if a.shape[-1] != k:
        raise ValueError(f"matmul_int8: a is {list(a.shape)} and the weight is [K={k}, N={n}]: "
                         f"inner dimensions {a.shape[-1]} and {k} differ")
    if bias is not None and (bias.ndim != 1 or bias.shape[0] != n or bias.dtype != np.float32):
        raise ValueError(f"matmul_int8: bias is {list(bias.shape)} {bias.dtype}: bias must be float32 [{n}]")
    m = math.prod(a.shape[:-1])
    out = gpu.empty((*a.shape[:-1], n), np.float32)
    if m == 0 or n == 0:
        return out
    strat, c = choose(gpu, m, n, strategy)
    if config is not None:
        c = config
    why = _fits(c, strat, gpu.limits)
    if why is not None:
        raise ValueError(f"matmul_int8: config {c.name} cannot run on this device: {why}")
    cap = gpu.limits.get("max-storage-buffer-binding-size", 1 << 27)
    for name, nbytes in (("a", a.nbytes), ("the weight", qw.packed.nbytes), ("the result", out.nbytes)):
        if nbytes > cap:
            raise ValueError(f"matmul_int8: {name} is {nbytes} bytes, more than one storage binding may hold "
                             f"({cap}); split the product")
    if strat.startswith("dp4a") and k > DP4A_MAX_K:
        raise ValueError(f"matmul_int8: K = {k} may overflow dp4a's i32 sums (at most {DP4A_MAX_K}); "
                         "use strategy='dequant'")
    k4, nq = int(qw.packed.shape[0]), int(qw.packed.shape[1]) // 4
    extra = (bias,) if bias is not None else ()
    grp = _group(strat)
    ng = cdiv(k, grp) if grp else 0
    if grp:
        xq = gpu.empty((m, k4), np.uint32)
        rs = gpu.empty((m, ng), np.float32)
        quant = gpu.kernel(_QUANT_GROUPS, "main", label="matmul_int8 quantize row groups")
        gpu.dispatch(quant, (m, 1, 1), a, xq, rs, np.array([m, k, k4, grp, ng, 0, 0, 0], np.uint32))
        src = _wgsl(c, strat, True, n % 4 == 0, bias is not None)
        first: tuple[Any, ...] = (xq, qw.packed, qw.scales, rs)
    elif strat == "dp4a":
        xq = gpu.empty((m, k4), np.uint32)
        rs = gpu.empty((m,), np.float32)
        quant = gpu.kernel(_QUANT_ROWS, "main", label="matmul_int8 quantize rows")
        gpu.dispatch(quant, (m, 1, 1), a, xq, rs, np.array([m, k, k4, 0], np.uint32))
        src = _wgsl(c, "dp4a", True, n % 4 == 0, bias is not None)
        first = (xq, qw.packed, qw.scales, rs)
    else:
        src = _wgsl(c, "dequant", k % 4 == 0, n % 4 == 0, bias is not None)
        first = (a, qw.packed, qw.scales)
    kern = gpu.kernel(src, "main", label=f"matmul_int8 {strat} {c.name}")
    limit = gpu.limits["max-compute-workgroups-per-dimension"]
    tiles_m = cdiv(m, c.bm)
    for y0 in range(0, tiles_m, limit):
        params = np.array([m, n, k, k4, nq, y0, ng, 0], np.uint32)
        gpu.dispatch(kern, (cdiv(n, c.bn), min(limit, tiles_m - y0), 1), *first, out, params, *extra)
    return out
