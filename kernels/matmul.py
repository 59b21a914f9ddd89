"""Matrix multiplication for GPU stages: ``matmul(gpu, a, b, transpose_b=, bias=, out=)``.

Shapes (row-major, contiguous)::

    a [M, K]     @ b [K, N]       -> [M, N]
    a [B, M, K]  @ b [B, K, N]    -> [B, M, N]      batched
    a [B, M, K]  @ b [K, N]       -> [B, M, N]      one weight for every batch (folded into M)
    a [M, K]     @ b [B, K, N]    -> [B, M, N]      one left operand for every batch
    transpose_b=True: b is [N, K] (or [B, N, K]), as torch.nn.Linear stores its weight
    bias [N] is added to every row of the result (fused into the store)

float32 in and out, or float16 in and out: products and sums in float32, so only the
inputs and the result are rounded to float16. Halves travel as u32 words converted
with ``unpack2x16float``/``pack2x16float`` (core WGSL), so float16 works on every
adapter, ``shader-f16`` or not; it halves memory and traffic, not arithmetic time.
(Native f16 arithmetic would need ``enable f16;``, which must open the module, and
hetero prepends its grid prelude to kernels that use ``hetero_workgroup_id``.)

Kernel. One workgroup computes a ``BM x BN`` tile of C; its ``(BM/TM) * (BN/TN)``
threads each compute a ``TM x TN`` block of it in registers (``TM/4 * TN/4`` vec4
accumulators, every one a named WGSL variable, so nothing is indexed dynamically
and no accumulator spills to local memory). The K loop walks ``BK``-deep slices:

* every thread loads its share of the A slice (``BM x BK``) and of the B slice as
  vec4 (4 consecutive floats along K for A and for a transposed B, along N for a
  plain B; bounds-checked, so any M, N, K work; scalar loads where a row length is
  not a multiple of 4) into registers;
* the slices go to workgroup memory as ``As[k][m]`` and ``Bs[k][n]`` (K-major), rows
  padded by 4 floats: a warp storing a transposed A slice (two K-quads of 16 rows
  for BK = 8) hits all 32 banks once (BK = 16: 2-way conflicts on these stores only);
* the inner loop, unrolled over ``BK`` in the generated WGSL, reads per k ``TM/4``
  vec4 of A and ``TN/4`` vec4 of B and does ``TM * TN`` fused multiply-adds (8x8:
  64 FMAs per 4 vec4 loads). Thread ``(tx, ty)`` owns rows ``g * BM/(TM/4) + 4 ty +
  i`` and columns ``h * BN/(TN/4) + 4 tx + j``: threads next to each other read
  neighbouring vec4 (conflict-free) and write neighbouring vec4 of C (coalesced);
* double buffering: the next slice is loaded from global memory into registers
  while the current one is multiplied, then stored into the other workgroup
  buffer, so each slice costs one barrier (``double_buffer=False``: one buffer,
  two barriers, half the workgroup memory);
* ``split_k = S`` (small outputs with a long K, which would leave most of a large
  GPU idle): the grid's z holds batch x S workgroups per tile, each summing its
  part of K into float32 partials ``[S, B, M, N]``; a second dispatch adds the S
  partials and the bias (every part gets at least :data:`MIN_SPLIT_K` of K).

The grid is x over N tiles, y over M tiles, z over the batch; the kernel finds its
tile through ``hetero_workgroup_id``, so hetero may split x into sub-dispatches under
the GPU-time budget (TDR safety); y and z beyond the per-dimension limit are
covered by several dispatches (``y0``/``z0`` in the uniform).

Configurations (:class:`MatmulConfig`: BM, BN, BK, TM, TN, double buffering, split_k)
are code generation parameters; :data:`CANDIDATES` holds the ones the tuner tries.
The choice per call: ``config=`` if given, else the on-disk tuning cache for this
adapter and size class, else :func:`default_config` (by adapter type and output
size). Nothing is tuned implicitly inside a stage; fill the cache with::

    python -m hetero.kernels.matmul --tune [--sizes 1024,2048,4096]

or :func:`tune` from Python. The cache is ``$HETERO_CACHE_DIR/matmul-<adapter>.json``
(default ``$XDG_CACHE_HOME/hetero``, else ``~/.cache/hetero``); see :func:`cache_path`
for its format.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import sys
import time
import weakref
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import numpy as np

from hetero._files import atomic_write_text
from hetero._tensor import Tensor

if TYPE_CHECKING:
    from hetero._device import Device
    from hetero._gpu import GPUContext

__all__ = ["ACTIVATIONS", "CANDIDATES", "MatmulConfig", "TuneResult", "cache_path", "choose_config", "default_config",
           "explain_config", "matmul", "size_class", "tune", "wgsl"]

log = logging.getLogger("hetero")

CACHE_VERSION = 1
PAD = 4  # floats of padding per workgroup-memory row (keeps rows 16-byte aligned)


# -- configurations ----------------------------------------------------------------------------
@dataclass(frozen=True)
class MatmulConfig:
    """One tiling of the kernel: a ``bm x bn`` tile per workgroup, ``bk``-deep K slices,
    a ``tm x tn`` register block per thread, one or two workgroup buffers."""

    bm: int
    bn: int
    bk: int
    tm: int
    tn: int
    double_buffer: bool = True
    split_k: int = 1  # K split over this many workgroups (partial sums, then one more pass)

    def __post_init__(self) -> None:
        for name in ("bm", "bn", "bk", "tm", "tn"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0 or v % 4:
                raise ValueError(f"matmul config: {name} must be a positive multiple of 4, got {v!r}")
        if self.bm % self.tm or self.bn % self.tn:
            raise ValueError(f"matmul config {self.name}: bm must be a multiple of tm and bn of tn")
        if self.tm * self.tn > 128:
            raise ValueError(f"matmul config {self.name}: tm * tn must be at most 128 accumulators per thread")
        if not isinstance(self.split_k, int) or isinstance(self.split_k, bool) or not 1 <= self.split_k <= 64:
            raise ValueError(f"matmul config: split_k must be an int from 1 to 64, got {self.split_k!r}")
        if self.threads > 1024:
            raise ValueError(f"matmul config {self.name}: {self.threads} threads per workgroup, more than 1024")

    @property
    def threads(self) -> int:
        return (self.bm // self.tm) * (self.bn // self.tn)

    @property
    def name(self) -> str:
        return (f"{self.bm}x{self.bn}x{self.bk}/{self.tm}x{self.tn}" + ("/db" if self.double_buffer else "")
                + (f"/sk{self.split_k}" if self.split_k > 1 else ""))

    def workgroup_bytes(self) -> int:
        """Workgroup memory the kernel declares (both operands' slices, padded; f32)."""
        one = 4 * self.bk * ((self.bm + PAD) + (self.bn + PAD))
        return one * (2 if self.double_buffer else 1)

    def fits(self, limits: dict[str, int]) -> str | None:
        """Why this configuration cannot run with these device limits (None: it can)."""
        storage = limits.get("max-compute-workgroup-storage-size", 16384)
        inv = min(limits.get("max-compute-invocations-per-workgroup", 256),
                  limits.get("max-compute-workgroup-size-x", 256))
        if self.workgroup_bytes() > storage:
            return f"needs {self.workgroup_bytes()} bytes of workgroup memory, the device has {storage}"
        if self.threads > inv:
            return f"needs {self.threads} invocations per workgroup, the device allows {inv}"
        return None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> MatmulConfig:
        if not isinstance(d, dict) or set(d) - {"bm", "bn", "bk", "tm", "tn", "double_buffer", "split_k"}:
            raise ValueError(f"matmul config: not a configuration: {d!r}")
        db = d.get("double_buffer", True)
        if not isinstance(db, bool):
            raise ValueError(f"matmul config: double_buffer must be a bool, got {db!r}")
        return cls(d.get("bm"), d.get("bn"), d.get("bk"), d.get("tm"), d.get("tn"), db,  # type: ignore[arg-type]
                   d.get("split_k", 1))


CANDIDATES: tuple[MatmulConfig, ...] = (
    MatmulConfig(128, 128, 8, 8, 8),            # 256 threads, the classic SGEMM tile
    MatmulConfig(128, 128, 16, 8, 8),           # deeper slices: half the barriers, 34 KB
    MatmulConfig(128, 128, 8, 8, 8, False),     # one buffer, two barriers per slice
    MatmulConfig(128, 128, 16, 8, 8, False),
    MatmulConfig(128, 128, 8, 8, 16),           # 128 threads of 128 accumulators: 6 vec4 reads per 128 FMAs
    MatmulConfig(256, 128, 8, 8, 8),            # 512 threads
    MatmulConfig(128, 64, 8, 8, 8),             # 128 threads
    MatmulConfig(64, 128, 8, 8, 8),
    MatmulConfig(128, 64, 16, 8, 8),
    MatmulConfig(64, 64, 8, 8, 8),              # 64 threads: many workgroups for mid sizes
    MatmulConfig(64, 64, 16, 4, 4),             # 256 threads, 16 accumulators each
    MatmulConfig(64, 64, 8, 4, 8),              # 128 threads
    MatmulConfig(32, 32, 8, 4, 4),              # 64 threads: small outputs, CPU adapters
    MatmulConfig(32, 64, 8, 4, 4),
    MatmulConfig(128, 128, 8, 8, 8, split_k=2),  # K splits: small outputs with a long K
    MatmulConfig(128, 128, 8, 8, 8, split_k=4),
    MatmulConfig(64, 64, 8, 8, 8, split_k=4),
)
"""What :func:`tune` tries by default (those that do not fit the device are skipped)."""

_BIG = MatmulConfig(128, 128, 8, 8, 8)
_MID = MatmulConfig(64, 64, 8, 8, 8)
_SMALL = MatmulConfig(32, 32, 8, 4, 4)


def default_config(adapter_type: str, m: int, n: int, batch: int = 1,
                   limits: dict[str, int] | None = None) -> MatmulConfig:
    """The configuration used when nothing was tuned: by adapter type and output size.

    On GPUs the largest tile that still gives a few hundred workgroups (enough to
    fill a large GPU's compute units), on CPU adapters (lavapipe, SwiftShader) a small
    one (on lavapipe with 2 cores, 256^3: 64x64 tiles of 8x8 blocks 3.9 GFLOP/s, 128x128
    2.5-2.9, 32x32 of 4x4 2.9).
    """
    def tiles(c: MatmulConfig) -> int:
        return batch * -(-m // c.bm) * -(-n // c.bn)

    if adapter_type.upper() == "CPU":
        order = [_MID] if tiles(_MID) >= 4 else [_SMALL]
    else:
        order = [_BIG] if tiles(_BIG) >= 256 else [_MID] if tiles(_MID) >= 128 else [_SMALL]
        order += [_MID, _SMALL]
    for c in order + [_SMALL]:
        if limits is None or c.fits(limits) is None:
            return c
    return MatmulConfig(16, 16, 4, 4, 4)  # 16 threads, 1 KB: fits any WebGPU device


# -- WGSL generation -------------------------------------------------------------------------
@dataclass(frozen=True)
class _Variant:
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


_XYZW = "xyzw"


def _emit_block(emit: Callable[[str], Any], lines: Iterable[str], indent: int) -> None:
    pad = " " * indent
    for line in lines:
        emit(pad + line)


def guard_slot(i: int, nt: int, count: int, body: list[str]) -> list[str]:
    """``body`` for tile slot ``i`` of ``nt`` threads, guarded when the tile's ``count``
    elements end inside the slot (a tile smaller than a multiple of the threads)."""
    if (i + 1) * nt > count:
        return [f"if ((tid + {i * nt}u) < {count}u) {{"] + ["    " + s for s in body] + ["}"]
    return body


def fragments(buf: int, k: int, gm: int, gn: int, rsa4: int, rsb4: int, ty_n: int, tx_n: int) -> list[str]:
    """The thread's vec4s of K row ``k`` of the shared tiles: ``a{g}`` of As, ``b{h}`` of Bs."""
    return ([f"    let a{g} = As{buf}[{k * rsa4 + g * ty_n}u + ty];" for g in range(gm)]
            + [f"    let b{h} = Bs{buf}[{k * rsb4 + h * tx_n}u + tx];" for h in range(gn)])


def fma_rows(g: int, gn: int) -> list[str]:
    """Accumulate the outer product of ``a{g}`` (rows 4g..4g+3) and every ``b{h}`` in float32."""
    out: list[str] = []
    for i in range(4):
        r = g * 4 + i
        out.append(f"    let s{r} = vec4<f32>(a{g}.{_XYZW[i]});")
        out += [f"    c{r}_{h} = fma(s{r}, b{h}, c{r}_{h});" for h in range(gn)]
    return out


def emit_store(emit: Callable[[str], Any], gm: int, gn: int, ty_n: int, tx_n: int,
               tile: Callable[[int, int], list[str]], row: Callable[[int], list[str]] = lambda r: []) -> None:
    """The store of a thread's (4*gm) x (4*gn) block, shared by the fp32 and int8 kernels.

    Result row ``r = g*4 + i`` is ``m0 + g*4*TY + 4*ty + i`` (skipped past ``p.M``, after
    the lines ``row(r)``); each column group ``h`` gets a scope with ``col`` =
    ``n0 + h*4*TX + 4*tx`` and the lines ``tile(r, h)``, which hold its 4 columns in
    accumulator ``r, h``.
    """
    for g in range(gm):
        for i in range(4):
            r = g * 4 + i
            emit(f"    let row{r} = m0 + {g * 4 * ty_n + i}u + ty * 4u;")
            emit(f"    if (row{r} < p.M) {{")
            _emit_block(emit, row(r), 8)
            for h in range(gn):
                emit(f"        {{ let col = n0 + {h * 4 * tx_n}u + tx * 4u;")
                _emit_block(emit, tile(r, h), 10)
                emit("        }")
            emit("    }")


def emit_k_loop(emit: Callable[[str], Any], double_buffer: bool, next_k: Callable[[str], str],
                load_all: Callable[[str], Iterable[str]], compute: Callable[[int], Iterable[str]],
                store_all: Callable[[int], Iterable[str]]) -> None:
    """Emit the K loop shared by the matmul generators (fp32 here, int8 in ``matmul_int8``).

    Before it: slice 0 is loaded into registers and ``t`` is 0. ``next_k(t)`` is the WGSL
    expression of the next slice's first k; ``load_all(k)`` loads a slice into registers,
    ``store_all(buf)`` moves them into workgroup buffer ``buf``, ``compute(buf)``
    multiplies out of it. Double-buffered: the next slice loads while this one is used,
    one barrier per slice.
    """
    if double_buffer:
        _emit_block(emit, store_all(0), 4)
        emit("    workgroupBarrier();")
        emit("    loop {")
        for cur, nxt in ((0, 1), (1, 0)):
            emit("        if (t >= nt) { break; }")
            emit(f"        let k1_{cur} = {next_k('t')};")
            _emit_block(emit, load_all(f"k1_{cur}"), 8)  # the next slice (zeros past the end)
            _emit_block(emit, compute(cur), 8)
            _emit_block(emit, store_all(nxt), 8)
            emit("        workgroupBarrier();")
            emit("        t = t + 1u;")
        emit("    }")
    else:
        emit("    loop {")
        emit("        if (t >= nt) { break; }")
        _emit_block(emit, store_all(0), 8)
        emit("        workgroupBarrier();")
        emit(f"        let k1 = {next_k('t')};")
        _emit_block(emit, load_all("k1"), 8)
        _emit_block(emit, compute(0), 8)
        emit("        workgroupBarrier();")
        emit("        t = t + 1u;")
        emit("    }")


def wgsl(config: MatmulConfig, *, f16: bool = False, vec_a: bool = True, vec_b: bool = True, vec_c: bool = True,
         transpose_b: bool = False, bias: bool = False, odd_n: bool = False, activation: str | None = None) -> str:
    """The WGSL source of one kernel variant (for reading, or compiling it yourself).

    ``vec_*``: the row lengths of A (K), B (N, or K with ``transpose_b``) and C (N) are
    multiples of 4; ``odd_n``: N is odd (float16 output only). Bindings: 0 A, 1 B, 2 C
    (float32 partials when ``config.split_k > 1``), 3 the ``Params`` uniform, 4 bias.
    """
    split = config.split_k > 1
    return _wgsl(config, _Variant(f16, vec_a, vec_b, vec_c, transpose_b, bias and not split, split, f16 and odd_n,
                                  "" if split else (activation or "")))


@lru_cache(maxsize=256)
def _wgsl(c: MatmulConfig, v: _Variant) -> str:
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
    emit(f"// hetero matmul {c.name} {v}")
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
        emit(_act_prelude())
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
                body = [f"{name}[{tag}s{i} + {j * rs4}u][{tag}c{i}] = {tag}v{i}.{_XYZW[j]};" for j in range(4)]
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
    _emit_block(emit, load_all("kb"), 4)
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
        vals = [f"{acc}.{_XYZW[j]}" + (f" + {ld1('bias', f'col + {j}u')}" if v.bias else "") for j in range(4)]
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
def _sum_wgsl(f16: bool, vec: bool, bias: bool, act: str = "") -> str:
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
    helpers = (_HALF_HELPERS if f16 else "") + (_act_prelude() if act else "")
    return (_SUM_PARTIALS.replace("$PV", sv).replace("$SV", sv).replace("$CV", cv)
            .replace("$BIAS_DECL", f"@group(0) @binding(3) var<storage, read> bias: {bias_t};" if bias else "")
            .replace("$HELPERS", helpers).replace("$ZERO", "    nn_zero = p.zero;" if act else "")
            .replace("$BODY", body))


ACTIVATIONS = ("gelu",)


@lru_cache(maxsize=1)
def _act_prelude() -> str:
    """WGSL of the activations: hetero.kernels.nn's erf-form GELU (``nn_gelu``, ``nn_gelu4``)."""
    from hetero.kernels.nn import _MATH

    return _MATH + ("fn nn_gelu4(v: vec4<f32>) -> vec4<f32> "
                    "{ return vec4<f32>(nn_gelu(v.x), nn_gelu(v.y), nn_gelu(v.z), nn_gelu(v.w)); }\n")


# -- shapes -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Problem:
    m: int
    n: int
    k: int
    batch: int
    sa: int  # elements between batches of a (0: broadcast)
    sb: int  # ... of b
    out_shape: tuple[int, ...]
    f16: bool
    trans_b: bool
    bias: bool
    act: str = ""  # "" or one of ACTIVATIONS

    def variant(self, split: int = 1) -> _Variant:
        k4 = self.k % 4 == 0 and self.k > 0
        vb = k4 if self.trans_b else self.n % 4 == 0
        return _Variant(self.f16, k4, vb and self.k > 0, self.n % 4 == 0, self.trans_b, self.bias and split == 1,
                        split > 1, self.f16 and self.n % 2 == 1, self.act if split == 1 else "")


def _dims(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _problem(a: Any, b: Any, transpose_b: bool, bias: Any, out: Any) -> _Problem:
    for name, t in (("a", a), ("b", b), ("bias", bias), ("out", out)):
        if t is not None and not isinstance(t, Tensor):
            raise TypeError(f"matmul: {name} must be a hetero.Tensor or a numpy array, got {type(t).__name__}")
    sa, sb = tuple(a.shape), tuple(b.shape)
    tb = " with transpose_b" if transpose_b else ""
    for name, s, want in (("a", sa, "[M, K] or [B, M, K]"),
                          ("b", sb, "[N, K] or [B, N, K]" if transpose_b else "[K, N] or [B, K, N]")):
        if len(s) not in (2, 3):
            raise ValueError(f"matmul: {name} is {_dims(s)} ({len(s)}-D): {name} must be {want}")
    f32, f16 = np.dtype(np.float32), np.dtype(np.float16)
    if a.dtype != b.dtype or a.dtype not in (f32, f16):
        raise TypeError(f"matmul: a is {a.dtype} and b is {b.dtype}: both must be float32, or both float16")
    is16 = a.dtype == f16
    m, k = sa[-2], sa[-1]
    kb, n = (sb[-1], sb[-2]) if transpose_b else (sb[-2], sb[-1])
    if k != kb:
        raise ValueError(f"matmul: a is {_dims(sa)} and b is {_dims(sb)}{tb}: inner dimensions {k} and {kb} differ")
    batch_a = sa[0] if len(sa) == 3 else None
    batch_b = sb[0] if len(sb) == 3 else None
    if batch_a is not None and batch_b is not None and batch_a != batch_b:
        raise ValueError(f"matmul: a is {_dims(sa)} and b is {_dims(sb)}{tb}: batch dimensions {batch_a} and "
                         f"{batch_b} differ")
    if batch_b is None:
        # One weight for all: fold the batch into M (a bigger, better-shaped single matmul).
        bm, batch, s_a, s_b = (batch_a or 1) * m, 1, 0, 0
        out_shape: tuple[int, ...] = (batch_a, m, n) if batch_a is not None else (m, n)
        m = bm
    else:
        batch = batch_b
        s_a = m * k if batch_a is not None else 0
        s_b = k * n
        out_shape = (batch, m, n)
    if bias is not None:
        if bias.ndim != 1 or bias.shape[0] != n:
            raise ValueError(f"matmul: bias is {_dims(bias.shape)} and the result has N = {n} columns: "
                             f"bias must be [{n}]")
        if bias.dtype != a.dtype:
            raise TypeError(f"matmul: bias is {bias.dtype} and a, b are {a.dtype}: bias must be {a.dtype}")
    if out is not None:
        if tuple(out.shape) != out_shape or out.dtype != a.dtype:
            raise ValueError(f"matmul: out is {_dims(out.shape)} {out.dtype} but the result is {_dims(out_shape)} "
                             f"{a.dtype}")
        for name, t in (("a", a), ("b", b), ("bias", bias)):
            if t is not None and t.buffer is out.buffer and _overlap(t, out):
                raise ValueError(f"matmul: out shares memory with {name}: pass a separate output tensor")
    return _Problem(m, n, k, batch, s_a, s_b, out_shape, is16, transpose_b, bias is not None)


def _overlap(x: Tensor, y: Tensor) -> bool:
    return x.offset < y.offset + max(y.binding_size, 1) and y.offset < x.offset + max(x.binding_size, 1)


SPLIT_K_MAX_TILES = 512
"""The tuner tries K splits only for outputs of fewer tiles than this (default candidates)."""
MIN_SPLIT_K = 256
"""A K split gives every part at least this many K (fewer: the second pass costs more than it saves)."""


def _split(p: _Problem, c: MatmulConfig, cap: int) -> tuple[int, int]:
    """(parts, K per part) of ``c``'s K split for this problem; parts == 1: no split."""
    s = max(1, min(c.split_k, p.k // MIN_SPLIT_K))
    while s > 1 and s * p.batch * p.m * p.n * 4 > cap:  # the partials must fit one binding
        s -= 1
    if s == 1:
        return 1, max(p.k, 1)
    kc = _cdiv(_cdiv(p.k, s), c.bk) * c.bk  # K per part, a multiple of BK
    return _cdiv(p.k, kc), kc


def _cdiv(x: int, y: int) -> int:
    return -(-x // y)


def _dispatches(p: _Problem, c: MatmulConfig, limit: int, split: int = 1,
                kc: int = 0) -> list[tuple[tuple[int, int, int], np.ndarray]]:
    """(workgroups, uniform) per dispatch: y and z past the per-dimension limit are chunked."""
    tn, tm, zs = _cdiv(p.n, c.bn), _cdiv(p.m, c.bm), p.batch * split
    sc = p.m * p.n if (p.batch > 1 or split > 1) else 0
    out = []
    for y0 in range(0, tm, limit):
        for z0 in range(0, zs, limit):
            params = np.array([p.m, p.n, p.k, p.sa, p.sb, sc, y0, z0, split, kc or max(p.k, 1), p.batch, 0],
                              dtype=np.uint32)
            out.append(((tn, min(limit, tm - y0), min(limit, zs - z0)), params))
    return out


# -- the op -------------------------------------------------------------------------------------
def matmul(gpu: GPUContext, a: Tensor | np.ndarray, b: Tensor | np.ndarray, *, transpose_b: bool = False,
           bias: Tensor | np.ndarray | None = None, out: Tensor | None = None,
           config: MatmulConfig | None = None, activation: str | None = None) -> Tensor:
    """``a @ b`` (``a @ b.T`` with ``transpose_b``), plus ``bias`` per column, recorded into ``gpu``.

    ``activation="gelu"`` applies BERT's erf-form GELU (:func:`hetero.kernels.nn.gelu`'s
    code, same accuracy) to every result element after the bias, in the kernel's store
    (or in the K split's summing pass): ``gelu(x @ W + b)`` in one dispatch, without a
    pass over the result.

    ``a`` is ``[M, K]`` or ``[B, M, K]``; ``b`` is ``[K, N]`` or ``[B, K, N]`` (``[N, K]`` /
    ``[B, N, K]`` with ``transpose_b``); a 2-D operand is shared by every batch. ``bias`` is
    ``[N]``. All float32, or all float16 (accumulated in float32).
    Returns a new Tensor (or ``out``, which must have the result's shape and dtype and
    share no memory with the inputs). numpy arrays are uploaded first. ``config``
    forces a tiling; by default the tuned one for this adapter and size, else
    :func:`default_config`.
    """
    a = gpu.upload(a) if isinstance(a, np.ndarray) else a
    b = gpu.upload(b) if isinstance(b, np.ndarray) else b
    bias = gpu.upload(bias) if isinstance(bias, np.ndarray) else bias
    p = _problem(a, b, transpose_b, bias, out)
    if activation is not None:
        if activation not in ACTIVATIONS:
            raise ValueError(f"matmul: activation must be None or one of {', '.join(map(repr, ACTIVATIONS))}, "
                             f"got {activation!r}")
        p = replace(p, act=activation)
    _check_bindings(gpu.limits, a, b, bias, p)
    if out is None:
        out = gpu.empty(p.out_shape, a.dtype)
    if p.m == 0 or p.n == 0 or p.batch == 0:
        return out
    c = config if config is not None else choose_config(gpu, p.m, p.n, p.k, p.batch, dtype=a.dtype)
    why = c.fits(gpu.limits)
    if why is not None:
        raise ValueError(f"matmul: config {c.name} cannot run on this device: {why}")
    for kern, groups, bindings in _plan(gpu, p, c, a, b, out, bias):
        gpu.dispatch(kern, groups, *bindings)
    return out


_Step = tuple[Any, tuple[int, int, int], tuple[Any, ...]]  # kernel, workgroups, bindings


def _plan(gpu: Any, p: _Problem, c: MatmulConfig, a: Tensor, b: Tensor, out: Tensor,
          bias: Tensor | None) -> list[_Step]:
    """The dispatches of one matmul (compiling kernels and taking scratch from ``gpu``)."""
    limit = gpu.limits["max-compute-workgroups-per-dimension"]
    split, kc = _split(p, c, gpu.limits.get("max-storage-buffer-binding-size", 1 << 27))
    v = p.variant(split)
    kern = gpu.kernel(_wgsl(c, v), "main", label=f"matmul {c.name}" + (f" {v.act}" if v.act else ""))
    extra = (bias,) if bias is not None else ()
    if split == 1:
        return [(kern, groups, (a, b, out, params, *extra)) for groups, params in _dispatches(p, c, limit)]
    partials = gpu.empty((split * p.batch * p.m * p.n,), np.float32)
    steps: list[_Step] = [(kern, groups, (a, b, partials, params))
                          for groups, params in _dispatches(p, c, limit, split, kc)]
    vec = p.n % 4 == 0
    elems = p.batch * p.m * p.n
    units = elems // 4 if vec else -(-elems // 2) if p.f16 else elems
    params = np.array([units, elems // 4 if vec else elems, split, p.n, 0, 0, 0, 0], dtype=np.uint32)
    sum_kernel = gpu.kernel(_sum_wgsl(p.f16, vec, bias is not None, p.act), "main",
                            label="matmul split-k sum" + (f" {p.act}" if p.act else ""))
    steps.append((sum_kernel, (-(-units // 256), 1, 1), (partials, out, params, *extra)))
    return steps


def _check_bindings(limits: dict[str, int], a: Tensor, b: Tensor, bias: Tensor | None, p: _Problem) -> None:
    cap = limits.get("max-storage-buffer-binding-size", 1 << 27)
    out_bytes = p.batch * p.m * p.n * (2 if p.f16 else 4)
    for name, nbytes in (("a", a.nbytes), ("b", b.nbytes), ("the result", out_bytes)):
        if nbytes > cap:
            raise ValueError(f"matmul: {name} is {nbytes} bytes, more than the {cap} bytes one storage binding may "
                             "hold (max-storage-buffer-binding-size); split the product")


# -- tuning cache -------------------------------------------------------------------------------
_INFO_KEYS = (("name", "device"), ("backend", "backend_type"), ("type", "adapter_type"), ("driver", "description"),
              ("vendor", "vendor"))
_infos: weakref.WeakKeyDictionary[Any, tuple[tuple[str, str], ...]] = weakref.WeakKeyDictionary()


def _adapter_info(target: Any) -> dict[str, str]:
    """name, backend, type, driver and vendor of the adapter behind a GPUContext or Device (memoised)."""
    dev = getattr(target, "device", target)  # GPUContext / Device -> wgpu.GPUDevice
    dev = getattr(dev, "device", dev)
    try:
        hit = _infos.get(dev)
    except TypeError:  # not weak-referenceable
        hit = None
    if hit is None:
        info = getattr(dev, "adapter_info", None) or {}
        hit = tuple((k, str(info.get(src, "") or ("unknown" if k == "name" else ""))) for k, src in _INFO_KEYS)
        try:
            _infos[dev] = hit
        except TypeError:
            pass
    return dict(hit)


@lru_cache(maxsize=64)
def _adapter_id_of(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _adapter_id(info: dict[str, str]) -> str:
    return _adapter_id_of("|".join(info[k] for k, _ in _INFO_KEYS))


@lru_cache(maxsize=16)
def _cache_dir(env: str | None, xdg: str | None) -> Path:
    if env:
        return Path(env)
    return (Path(xdg) if xdg else Path.home() / ".cache") / "hetero"


def cache_dir() -> Path:
    """``$HETERO_CACHE_DIR``, else ``$XDG_CACHE_HOME/hetero``, else ``~/.cache/hetero`` (read at each call)."""
    return _cache_dir(os.environ.get("HETERO_CACHE_DIR") or None, os.environ.get("XDG_CACHE_HOME") or None)


def cache_path(target: Any) -> Path:
    """Where the tuned choices for ``target``'s adapter live (a GPUContext, Device or Runtime).

    Format (JSON)::

        {"version": 1,
         "adapter": {"name": ..., "backend": ..., "type": ..., "driver": ..., "vendor": ...},
         "entries": {"f32:n12": {"config": {"bm": 128, "bn": 128, "bk": 8, "tm": 8, "tn": 8,
                                            "double_buffer": true},
                                 "gflops": 25000.0, "shape": [4096, 4096, 4096, 1],
                                 "tuned_at": "2026-12-01T10:00:00Z"}, ...}}

    Keys are ``<dtype>:n<size class>`` (:func:`size_class`). The file is replaced
    atomically; an unreadable or malformed file, or entry, is ignored (and rewritten
    by the next tune).
    """
    return Path(_cache_file(_adapter_info(_device_of(target))))


def _cache_file(info: dict[str, str]) -> str:
    return _join(str(cache_dir()), _adapter_id(info))


@lru_cache(maxsize=64)
def _join(directory: str, adapter_id: str) -> str:
    return os.path.join(directory, f"matmul-{adapter_id}.json")


def size_class(m: int, n: int, batch: int = 1) -> int:
    """The tuning cache's size class: log2 of the output's side, ``round(log2(B*M*N) / 2)``."""
    return max(0, round(math.log2(max(1, batch * m * n)) / 2))


def _key(dtype: Any, cls: int) -> str:
    return f"{'f16' if np.dtype(dtype) == np.float16 else 'f32'}:n{cls}"


_memo: dict[str, tuple[tuple[int, int], dict[str, MatmulConfig]]] = {}


def _load(path: str | Path) -> dict[str, MatmulConfig]:
    """The valid entries of a cache file ({} when absent or unreadable); memoised by mtime."""
    try:
        st = os.stat(path)
    except OSError:
        return {}
    stamp = (st.st_mtime_ns, st.st_size)
    hit = _memo.get(str(path))
    if hit is not None and hit[0] == stamp:
        return hit[1]
    entries: dict[str, MatmulConfig] = {}
    try:
        doc = json.loads(Path(path).read_text())
        if not isinstance(doc, dict) or doc.get("version") != CACHE_VERSION or not isinstance(doc.get("entries"),
                                                                                             dict):
            raise ValueError("not a version-1 matmul cache")
        for key, e in doc["entries"].items():
            try:
                entries[str(key)] = MatmulConfig.from_dict(e["config"])
            except (ValueError, TypeError, KeyError) as err:
                log.warning("hetero: ignoring matmul cache entry %r in %s: %s", key, path, err)
    except (OSError, ValueError) as err:
        log.warning("hetero: ignoring unreadable matmul tuning cache %s: %s", path, err)
        entries = {}
    _memo[str(path)] = (stamp, entries)
    return entries


def _save(path: Path, info: dict[str, str], new: dict[str, dict[str, Any]]) -> None:
    """Merge ``new`` entries into the cache file and replace it atomically."""
    doc: dict[str, Any] = {"version": CACHE_VERSION, "adapter": info, "entries": {}}
    try:
        old = json.loads(path.read_text())
        if isinstance(old, dict) and old.get("version") == CACHE_VERSION and isinstance(old.get("entries"), dict):
            doc["entries"].update(old["entries"])
    except (OSError, ValueError):
        pass
    doc["entries"].update(new)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(doc, indent=1, sort_keys=True) + "\n")


def choose_config(gpu: Any, m: int, n: int, k: int, batch: int = 1, *, dtype: Any = np.float32) -> MatmulConfig:
    """The configuration ``matmul`` uses for this problem on ``gpu``'s adapter.

    The tuned entry of the nearest size class of this dtype (within 2 classes, so
    within a factor 4 of the output's side; ties: the larger class), if it fits the
    device; else :func:`default_config`.
    """
    return explain_config(gpu, m, n, k, batch, dtype=dtype)[0]


def explain_config(gpu: Any, m: int, n: int, k: int, batch: int = 1, *,
                   dtype: Any = np.float32) -> tuple[MatmulConfig, str]:
    """:func:`choose_config` and where the choice came from: ``"cache f32:n12"`` or ``"default"``."""
    info = _adapter_info(gpu)
    limits: dict[str, int] = gpu.limits
    entries = _load(_cache_file(info))
    if entries:
        cls = size_class(m, n, batch)
        prefix = _key(dtype, 0).split(":")[0] + ":n"
        best: tuple[int, int, MatmulConfig, str] | None = None
        for key, c in entries.items():
            if key.startswith(prefix) and key[len(prefix):].isdigit():
                d = abs(int(key[len(prefix):]) - cls)
                if d <= 2 and c.fits(limits) is None and (best is None or (d, -int(key[len(prefix):])) < best[:2]):
                    best = (d, -int(key[len(prefix):]), c, key)
        if best is not None:
            return best[2], f"cache {best[3]}"
    return default_config(info["type"], m, n, batch, limits), "default"


# -- the tuner ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class TuneResult:
    """What :func:`tune` found: the winner and every candidate's figure or reason."""

    shape: tuple[int, int, int, int]  # M, N, K, batch
    dtype: str
    best: MatmulConfig
    gflops: float
    key: str  # the cache key it was stored under
    path: str | None  # the cache file (None: not saved)
    results: tuple[tuple[str, float | None, str], ...] = field(default_factory=tuple)  # name, GFLOP/s, note


def _device_of(target: Any) -> Device:
    """A hetero Device from a Device, a GPUContext or a Runtime."""
    if hasattr(target, "device") and callable(getattr(target, "device")):
        return target.device()  # Runtime
    dev = getattr(target, "_dev", None)  # GPUContext
    return dev if dev is not None else target


def _submit_wait(dev: Device, cbs: list[Any]) -> float:
    t0 = time.perf_counter()
    dev.wait(dev.submit(cbs))
    return time.perf_counter() - t0


def _raw_timing(dev: Device, steps: list[_Step], reps: int) -> float:
    """Seconds for one submission of ``reps`` matmuls, recorded straight into a wgpu encoder.

    The tuner bypasses ``gpu.dispatch`` so that hetero's GPU-time budget never splits
    the timed submission (the budget protects graphs; a timing wants one submission).
    """
    import wgpu

    from hetero._split import grid_uniform

    device = dev.device
    usage = wgpu.BufferUsage.UNIFORM

    def resource(x: Any) -> dict[str, Any]:
        if isinstance(x, Tensor):
            return {"buffer": x.buffer, "offset": x.offset, "size": x.binding_size}
        data = np.ascontiguousarray(x).tobytes()
        data += bytes(-len(data) % 16)
        return {"buffer": device.create_buffer_with_data(data=data, usage=usage), "offset": 0, "size": len(data)}

    recorded = []
    for kern, wg, bindings in steps:
        bg0 = device.create_bind_group(layout=kern.pipeline.get_bind_group_layout(0), entries=[
            {"binding": i, "resource": resource(x)} for i, x in enumerate(bindings)])
        bg1 = None
        if kern.grid:
            bg1 = device.create_bind_group(layout=kern.pipeline.get_bind_group_layout(1), entries=[
                {"binding": 0, "resource": resource(np.frombuffer(grid_uniform((0, 0, 0), wg), np.uint8))}])
        recorded.append((kern.pipeline, wg, bg0, bg1))
    enc = device.create_command_encoder()
    cp = enc.begin_compute_pass()
    for _ in range(reps):
        for pipeline, wg, bg0, bg1 in recorded:
            cp.set_pipeline(pipeline)
            cp.set_bind_group(0, bg0)
            if bg1 is not None:
                cp.set_bind_group(1, bg1)
            cp.dispatch_workgroups(*wg)
    cp.end()
    return _submit_wait(dev, [enc.finish()])


def _run(dev: Device, record: Any) -> np.ndarray:
    """Record with a fresh GPUContext, submit, wait, and download the returned Tensor."""
    from hetero._gpu import GPUContext

    ctx = GPUContext(dev, "matmul-tune")
    try:
        t = record(ctx)
        ctx.stage_download(t)
        dev.wait(dev.submit([ctx.encoder.finish()]))
        r = ctx.read_downloads()[id(t)]
        ctx.settle(ran=True)
        return r
    finally:
        ctx.release_blocks()


def _rel_err(got: np.ndarray, want: np.ndarray) -> float:
    scale = float(np.max(np.abs(want))) if want.size else 0.0
    return float(np.max(np.abs(got.astype(np.float64) - want))) / max(scale, 1e-30) if want.size else 0.0


def _check_config(dev: Device, c: MatmulConfig, p: _Problem, dtype: Any) -> str | None:
    """Correctness on a small shape with the same divisibility (so the same kernel variant)."""
    def shrink(x: int, cap: int) -> int:
        return x if x <= cap else cap - cap % 4 + x % 4  # same residue mod 4, partial tiles

    k_cap = 3 * c.bk + 5 if c.split_k == 1 else c.split_k * MIN_SPLIT_K + 5  # long enough to split
    m, n, k = shrink(p.m, 2 * c.bm + 5), shrink(p.n, 2 * c.bn + 5), shrink(p.k, k_cap)
    rng = np.random.default_rng(1)
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((n, k) if p.trans_b else (k, n)).astype(dtype)
    want = a.astype(np.float64) @ (b.T if p.trans_b else b).astype(np.float64)
    got = _run(dev, lambda ctx: matmul(ctx, ctx.upload(a), ctx.upload(b), transpose_b=p.trans_b, config=c))
    err = _rel_err(got, want)
    tol = 5e-3 if p.f16 else 1e-4
    return None if err <= tol else f"wrong results on {m}x{n}x{k}: relative error {err:.2e}"


def tune(target: Any, m: int, n: int, k: int, *, batch: int = 1, transpose_b: bool = False,
         dtype: Any = np.float32, configs: Sequence[MatmulConfig] | None = None, min_ms: float = 20.0,
         repeat: int = 3, save: bool = True, verbose: bool = False) -> TuneResult:
    """Time the candidate configurations on ``target``'s adapter for one problem size; cache the fastest.

    ``target`` is a Runtime, a Device or a GPUContext. Each candidate that fits the
    device's limits is compiled (a failure skips it), checked against numpy on a
    small shape with the same divisibility, then timed on resident random data of
    the given size: one submission of as many matmuls as run ``min_ms``, best of
    ``repeat``. The winner is also checked at full size (Freivalds' test:
    ``C v`` against ``A (B v)``) and stored in :func:`cache_path` under
    ``<dtype>:n<size_class(m, n, batch)>`` when ``save``. Blocks the calling thread
    (do not call it on an event loop, nor inside a stage).
    """
    dev = _device_of(target)
    dt = np.dtype(dtype)
    limits = dev.limits
    rng = np.random.default_rng(0)
    a_h = (rng.random((batch, m, k) if batch > 1 else (m, k), dtype=np.float32) - 0.5).astype(dt)
    b_shape = (n, k) if transpose_b else (k, n)
    b_h = (rng.random((batch, *b_shape) if batch > 1 else b_shape, dtype=np.float32) - 0.5).astype(dt)
    from hetero._gpu import GPUContext

    holder = GPUContext(dev, "matmul-tune-data")
    a_t, b_t = holder.upload(a_h), holder.upload(b_h)
    c_t = holder.empty((batch, m, n) if batch > 1 else (m, n), dt)
    dev.wait(dev.submit([holder.encoder.finish()]))
    holder.settle(ran=True)
    p = _problem(a_t, b_t, transpose_b, None, None)
    results: list[tuple[str, float | None, str]] = []
    timed: list[tuple[float, MatmulConfig]] = []
    flops = 2.0 * p.batch * p.m * p.n * p.k
    rtt = min(_submit_wait(dev, [dev.device.create_command_encoder().finish()]) for _ in range(5))

    def note(c: MatmulConfig, g: float | None, why: str) -> None:
        results.append((c.name, g, why))
        if verbose:
            print(json.dumps({"tune": c.name, "gflops": g, "note": why}), file=sys.stderr, flush=True)

    try:
        for c in (configs if configs is not None else CANDIDATES):
            why = c.fits(limits)
            if why is None and configs is None and c.split_k > 1:
                split, _ = _split(p, c, limits.get("max-storage-buffer-binding-size", 1 << 27))
                if split == 1:
                    why = f"K = {p.k} is too short to split"
                elif p.batch * -(-p.m // c.bm) * -(-p.n // c.bn) >= SPLIT_K_MAX_TILES:
                    why = "the output alone gives enough workgroups"
            if why is not None:
                note(c, None, f"skipped: {why}")
                continue
            scratch = GPUContext(dev, "matmul-tune")  # holds this candidate's split-K partials
            try:
                try:
                    steps = _plan(scratch, p, c, a_t, b_t, c_t, None)
                    bad = _check_config(dev, c, p, dt)
                except Exception as e:  # noqa: BLE001 - a candidate that fails to compile is skipped
                    first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
                    note(c, None, f"skipped: {type(e).__name__}: {first}")
                    continue
                if bad is not None:
                    note(c, None, f"skipped: {bad}")
                    continue
                one = max(_raw_timing(dev, steps, 1) - rtt, 1e-6)  # warm-up, estimate
                reps = max(1, min(1000, math.ceil(min_ms / 1e3 / one)))
                best = min(_raw_timing(dev, steps, reps) for _ in range(max(1, repeat)))
            finally:
                scratch.release_blocks()
            sec = max(best - rtt, 1e-9) / reps
            gflops = flops / sec / 1e9
            timed.append((sec, c))
            note(c, round(gflops, 3), f"{reps} per submission")
        timed.sort(key=lambda x: x[0])
        winner: MatmulConfig | None = None
        for sec, c in timed:
            if _freivalds(dev, c, a_t, b_t, a_h, b_h, transpose_b):
                winner, best_sec = c, sec
                break
            note(c, None, "rejected: wrong results at full size")
        if winner is None:
            raise RuntimeError(f"matmul tune: no configuration ran correctly for {m}x{n}x{k} (batch {batch}): "
                               + "; ".join(f"{name}: {why}" for name, _, why in results))
    finally:
        holder.release_blocks()
    gflops = round(flops / best_sec / 1e9, 3)
    key = _key(dt, size_class(m, n, batch))
    path: Path | None = None
    if save:
        path = cache_path(dev)
        _save(path, _adapter_info(dev), {key: {
            "config": winner.to_dict(), "gflops": gflops, "shape": [m, n, k, batch],
            "tuned_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}})
    return TuneResult((m, n, k, batch), dt.name, winner, gflops, key, str(path) if path else None, tuple(results))


def _freivalds(dev: Device, c: MatmulConfig, a_t: Tensor, b_t: Tensor, a_h: np.ndarray, b_h: np.ndarray,
               transpose_b: bool) -> bool:
    """Is ``C = A B`` at full size? Compare ``C v`` with ``A (B v)`` for a random ``v`` (float64)."""
    got = _run(dev, lambda ctx: matmul(ctx, a_t, b_t, transpose_b=transpose_b, config=c)).astype(np.float64)
    v = np.random.default_rng(2).standard_normal(got.shape[-1])
    a64 = a_h.astype(np.float64)
    b64 = (np.swapaxes(b_h, -1, -2) if transpose_b else b_h).astype(np.float64)

    def times(a: np.ndarray, x: np.ndarray) -> np.ndarray:  # a x for a [.., M, K], x [.., K]
        return (a @ x[..., None])[..., 0]

    lhs, want = got @ v, times(a64, b64 @ v)
    scale = float(np.max(times(np.abs(a64), np.abs(b64) @ np.abs(v))))  # the size of the terms summed
    tol = 5e-3 if a_h.dtype == np.float16 else 1e-5
    return bool(np.max(np.abs(lhs - want)) <= tol * max(scale, 1e-30))


# -- command line -------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hetero.kernels.matmul",
                                 description="Tune hetero's matmul for this machine's adapter and cache the choice.")
    ap.add_argument("--tune", action="store_true", help="run the tuner (otherwise: show the cache)")
    ap.add_argument("--sizes", default="1024,2048,4096",
                    help="comma-separated square sizes, or MxNxK[xB] shapes (default 1024,2048,4096)")
    ap.add_argument("--transpose-b", action="store_true")
    ap.add_argument("--f16", action="store_true", help="tune float16 inputs and outputs")
    ap.add_argument("--min-ms", type=float, default=20.0)
    a = ap.parse_args(argv)
    import hetero

    with hetero.Runtime(gpu_budget_ms=1e9) as rt:
        dev = rt.device()
        path = cache_path(dev)
        print(json.dumps({"adapter": dev.summary["summary"], "cache": str(path)}))
        if a.tune:
            for s in a.sizes.split(","):
                dims = [int(x) for x in s.lower().split("x")] if "x" in s else [int(s)] * 3
                m, n, k = dims[:3]
                batch = dims[3] if len(dims) > 3 else 1
                r = tune(dev, m, n, k, batch=batch, transpose_b=a.transpose_b,
                         dtype=np.float16 if a.f16 else np.float32, min_ms=a.min_ms, verbose=True)
                print(json.dumps({"shape": list(r.shape), "key": r.key, "best": r.best.name,
                                  "gflops": r.gflops}), flush=True)
        else:
            entries = _load(path)
            print(json.dumps({key: c.name for key, c in sorted(entries.items())}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
