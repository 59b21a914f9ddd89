"""Neural-network kernels a BERT encoder needs besides matmul, for GPU stages.

Every op takes the stage's ``gpu`` context first, records its dispatch into the stage
(no host round trip) and returns a new float32 :class:`hetero.Tensor` (``transpose`` and
``embedding`` keep their input's 4-byte dtype). Inputs are Tensors or numpy arrays
(uploaded first); every check runs before anything is uploaded, allocated or recorded,
and errors name the op, the shapes and the rule. Zero-size results are returned
without a dispatch.

==============================  ==========================================================
op                              what
==============================  ==========================================================
``softmax(x, mask=None,``       along the last axis of x * scale; optional additive ``mask``
``scale=None)``                 per row group
``layernorm(x, g, b, eps,``     over the last axis; ``residual``: layernorm(x + residual),
``residual=None)``              BERT's "add & norm" in one kernel
``gelu(x, bias=None)``          erf form 0.5*x*(1 + erf(x/sqrt 2)); ``bias`` fused (last axis)
``erf(x)``                      float32 erf (the function gelu is built on)
``add(x, y)``, ``add_bias``     same-shape sum; bias broadcast along the last axis
``transpose(x, axes)``          any permutation that reduces to <= 4 axes (see below)
``embedding(table, ids)``       gather rows of a [V, H] table -> ids.shape + (H,)
``embedding_layernorm(``        layernorm of the sum of 1-4 gathers (BERT's embeddings), one
``tables, ids, g, b, eps)``     dispatch
``matmul_layernorm(a, b, g,``   layernorm(a @ b + bias + residual); where the product splits K
``b, bias, residual, eps)``     the layernorm sums its partials (no summing pass)
``attention(q, k, v, mask,``    scaled dot-product attention, [B, H, S, D] (or [B, S, H, D]
``scale, layout, impl)``        with ``layout="bshd"``): one fused online-softmax kernel, or
                                matmul + softmax + matmul (``impl``; "auto" picks)
==============================  ==========================================================

Grids. Every kernel finds its workgroup with ``hetero_workgroup_id``, so any number of
workgroups is fine: hetero splits large grids into sub-dispatches (and, past the GPU-time
budget, submissions) along x inside ``gpu.dispatch``.

Row kernels (softmax, layernorm). A workgroup has 256 threads; ``TPR`` threads (a power
of two) share a row and a workgroup holds ``256 / TPR`` rows, so short rows do not leave
threads idle. ``TPR`` is the smallest power of two that gives each thread at most
:data:`ROW_ITEMS` values (4), capped at 256: n = 128 -> 32 threads a row, 8 rows a
workgroup; n = 384 -> 128 threads, 2 rows; n = 1536 -> 256 threads, 6 values each.
Thread ``j`` of a row reads elements ``j, j + TPR, ...`` (coalesced) and keeps them in
registers, up to :data:`ROW_CACHE_MAX` (16) a thread, i.e. rows up to 4096 are read
once. Longer rows loop over global memory (three reads). Row sums and maxima meet in
workgroup memory (a tree over the row's threads). Layernorm takes the mean first and
then the mean of squared deviations from the values held in registers (two-pass
variance, no cancellation), both of the values shifted by the row's first value (so a
large common offset costs no accuracy in the mean either); softmax subtracts the row
maximum first.

Softmax numerics follow ``exp(x - max) / sum`` in numpy (scipy.special.softmax and
torch.softmax agree): entries of -inf get exactly 0; a row holding NaN or +inf, or only
-inf, is all NaN. ``mask`` is added to ``x`` before the maximum; its shape is
``x.shape[:k] + (n,)`` or that with ones up to ``x``'s rank (``(B, n)`` or
``(B, 1, 1, n)`` for scores ``(B, H, S, n)``): one mask row serves a group of
consecutive rows.

GELU and erf use the float32 numerics of :mod:`hetero.kernels.wgsl_math` (``x * Phi(x)``
with Phi from an erfc that keeps its relative accuracy down to underflow): gelu's
relative error is 4.5e-7 at most over [-14, 14], erf's absolute error 1.3e-7 over
[-6, 6]; gelu(NaN) = NaN, gelu(+inf) = +inf, gelu(-inf) = 0.

Attention (``attention``). One fused kernel, as FlashAttention does it: a workgroup
takes one (batch, head) and a block of ``BQ`` query rows (64; fewer for short
sequences), one thread per query row holding its scaled query and its output
accumulator in registers (2 * D floats). Keys and values pass through workgroup memory
in tiles of ``BK`` keys (at most 16 KiB: 56 keys at D = 32, 24 at D = 64, 8 at D = 128)
loaded cooperatively, and every thread walks the tile with an online softmax (running
maximum and sum, rescaling the accumulator when the maximum rises; scores in log2 units
so it is exp2). The [S, S] score matrix never exists in memory: MiniLM's shape
([128, 12, 128, 32]) would otherwise write and read 100 MB of scores twice. D <= 128 is
the design point (registers); larger D works but spills. The ``mask`` ([B, Sk] or
[B, 1, 1, Sk]; nonzero = real token) follows HF BERT's extended attention mask
``(1 - mask) * finfo(float32).min``: padded keys get weight exactly 0, and a row whose
keys are all padding gets equal weights over all keys (the mean of ``v``, as HF
computes), never NaN.

Attention as three kernels (``impl="matmul"``): scores = q @ k^T (``matmul`` batched over
B*H, ``transpose_b``), the softmax kernel with the scale multiplied in and the padding
mask applied as a keep mask (padded entries become -finfo(float32).max, HF's
``(1 - mask) * finfo.min`` for finite scores, so a fully padded row again gets the mean
of ``v`` and never NaN), then probs @ v. The scores and probabilities are stage
temporaries of B*H*Sq*Sk floats (100 MB each at MiniLM's shape), back in the pool after
the stage. The fused kernel walks the keys serially, one thread per query row (its row
of q and its accumulator unrolled into named vec4 registers, never arrays indexed in
loops), so on a large GPU the three kernels win for long sequences: ``impl="auto"``
takes them on discrete and integrated GPUs when Sk >= :data:`ATTN_MATMUL_MIN_SEQ` (128)
and the scores fit one storage binding, and keeps the fused kernel on CPU adapters (no
wide parallel matmul to gain, and less memory traffic) and for short sequences (little
parallel work per score matrix; one dispatch instead of three). The threshold comes
from ``python -m bench.nn`` on an H200 (BENCHMARKS.md, "BERT kernels at MiniLM
shapes"), whose ``attention_fused`` and ``attention_matmul`` figures time both paths;
re-check it there when tuning.

Embedding ids out of range ([0, V)) cannot raise on the GPU: their output rows are
zeros (negative int32 ids too), which is easier to spot than a clamped real row. Ids
given as a numpy array are checked on the host, and out-of-range ones raise.

Tuning and test hooks (module attributes, read at each call): :data:`ROW_ITEMS`,
:data:`ROW_CACHE_MAX`, :data:`ATTN_BQ`, :data:`ATTN_BK`, :data:`ATTN_SMEM_BYTES`,
:data:`ATTN_MATMUL_MIN_SEQ`.
"""

from __future__ import annotations

import math
import struct
from typing import Any, Callable, Sequence

import numpy as np

from hetero.kernels import nn_wgsl
from hetero.kernels.cpu import check_spans
from hetero.kernels.matmul import MatmulConfig, matmul
from hetero.kernels.matmul.op import shape_spec, matmul_partials, problem
from hetero.kernels.nn_wgsl import WORKGROUP
from hetero.lowlevel import GPUContext, Kernel, Tensor, check_positive_int

__all__ = ["add", "add_bias", "attention", "attention_packed", "attention_varlen", "embedding", "embedding_layernorm",
           "erf", "gelu", "layernorm", "matmul_layernorm", "softmax", "transpose"]

# -- tuning and test hooks ---------------------------------------------------------------
ROW_ITEMS = 4
"""Values per thread a row kernel aims for when choosing threads per row."""
ROW_CACHE_MAX = 16
"""Most values a thread keeps in registers; longer rows (> 256 * this) loop over memory."""
ATTN_BQ: int | None = None
"""Query rows (= threads) per attention workgroup; None: 64, fewer for short sequences."""
ATTN_BK: int | None = None
"""Keys per attention tile; None: what fits in :data:`ATTN_SMEM_BYTES`, at most 64."""
ATTN_SMEM_BYTES = 16384
"""Workgroup memory an attention tile aims for (also capped by the adapter's limit)."""
ATTN_MATMUL_MIN_SEQ = 128
"""Shortest key sequence for which ``attention(impl="auto")`` takes the matmul path on a GPU."""

_F32 = np.dtype(np.float32)
_WORD_DTYPES = (np.dtype(np.float32), np.dtype(np.int32), np.dtype(np.uint32))
_ID_DTYPES = (np.dtype(np.int32), np.dtype(np.uint32))


# -- helpers --------------------------------------------------------------------------------------
def _kind(op: str, name: str, x: Any) -> None:
    if not isinstance(x, (Tensor, np.ndarray)):
        raise TypeError(f"{op}: {name} must be a hetero.Tensor (or a numpy array), got {type(x).__name__}")


def _f32(op: str, name: str, x: Any) -> tuple[int, ...]:
    """Check that ``x`` is a float32 Tensor or array; its shape."""
    _kind(op, name, x)
    shape = tuple(int(s) for s in x.shape)
    if x.dtype != _F32:
        raise TypeError(f"{op}: {name} must be float32, got {x.dtype.name} (shape {shape}); "
                        "cast with .astype(np.float32)")
    return shape


def _dev(gpu: GPUContext, x: Any) -> Tensor:
    """The Tensor for a checked input (numpy arrays are uploaded)."""
    if isinstance(x, np.ndarray):
        return gpu.upload(x if x.flags.c_contiguous else x.copy(order="C"))
    return x


def _size(shape: Sequence[int]) -> int:
    return math.prod(int(s) for s in shape)  # Python ints: no wrap-around


def _fits(gpu: GPUContext, op: str, what: str, shape: Sequence[int], itemsize: int = 4) -> None:
    limit = int(gpu.limits["max-storage-buffer-binding-size"])
    nbytes = _size(shape) * itemsize
    if nbytes > limit:
        raise ValueError(f"{op}: {what} of shape {tuple(shape)} is {nbytes} bytes, more than the adapter's "
                         f"max-storage-buffer-binding-size of {limit} bytes; split the work into smaller tensors")


def _groups(n: int, per: int) -> int:
    return -(-n // per)


def _compile(gpu: GPUContext, label: str, wgsl: str) -> Kernel:
    return gpu.kernel(wgsl, "main", label=label)


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _row_plan(n: int) -> tuple[int, int, bool]:
    """(threads per row, values per thread, cached) for rows of ``n`` elements."""
    tpr = min(WORKGROUP, _pow2_ceil(_groups(max(n, 1), ROW_ITEMS)))
    k = _groups(max(n, 1), tpr)
    if k <= ROW_CACHE_MAX:
        return tpr, k, True
    return WORKGROUP, 1, False


# -- elementwise ----------------------------------------------------------------------------------
def _elementwise(gpu: GPUContext, op: str, expr: str, x: Tensor, second: Tensor | None, shape: tuple[int, ...],
                 nb: int = 0, second_name: str | None = None) -> Tensor:
    """y = expr over ``x`` (and ``second``: ``y`` or ``b``), vec4 when every length allows."""
    n = _size(shape)
    vec = n % 4 == 0 and nb % 4 == 0
    out = gpu.empty(shape, np.float32)  # the callers checked the inputs (and _fits) before uploading
    if n == 0:
        return out
    w = 4 if vec else 1
    k = _compile(gpu, f"nn.{op}.{'vec4' if vec else 'scalar'}", nn_wgsl.elementwise(expr, vec, second_name))
    params = struct.pack("<4I", n // w, max(nb // w, 1), 0, 0)
    bindings: list[Any] = [x] + ([second] if second is not None else []) + [out, params]
    gpu.dispatch(k, _groups(n // w, WORKGROUP), *bindings)
    return out


def _bias_shape(op: str, shape: tuple[int, ...], bshape: tuple[int, ...]) -> None:
    if len(shape) == 0 or bshape != shape[-1:]:
        last = f"({shape[-1]},)" if shape else "nothing (x is 0-d)"
        raise ValueError(f"{op}: bias of shape {bshape} does not match the last axis of x of shape {shape}; "
                         f"bias must have shape {last}")


def gelu(gpu: GPUContext, x: Tensor | np.ndarray, *, bias: Tensor | np.ndarray | None = None) -> Tensor:
    """GELU, erf form as BERT uses it: 0.5 * x * (1 + erf(x / sqrt(2))), computed as x * Phi(x).

    ``bias`` (shape ``(x.shape[-1],)``) is added first, in the same kernel: the
    ``gelu(x @ W + b)`` of BERT's intermediate layer. Relative error 4.5e-7 at most against
    a float64 reference (see the module docstring); gelu(-inf) = 0.
    """
    shape = _f32("gelu", "x", x)
    _fits(gpu, "gelu", "x", shape)
    if bias is None:
        return _elementwise(gpu, "gelu", "G(x[i])", _dev(gpu, x), None, shape)
    bshape = _f32("gelu", "bias", bias)
    _bias_shape("gelu", shape, bshape)
    return _elementwise(gpu, "gelu_bias", "G(x[i] + b[i % p.nb])", _dev(gpu, x), _dev(gpu, bias), shape,
                        nb=bshape[0], second_name="b")


def erf(gpu: GPUContext, x: Tensor | np.ndarray) -> Tensor:
    """The error function, elementwise (absolute error 1.3e-7 at most against math.erf)."""
    shape = _f32("erf", "x", x)
    _fits(gpu, "erf", "x", shape)
    return _elementwise(gpu, "erf", "E(x[i])", _dev(gpu, x), None, shape)


def add(gpu: GPUContext, x: Tensor | np.ndarray, y: Tensor | np.ndarray) -> Tensor:
    """x + y for two float32 tensors of the same shape (no broadcasting: see ``add_bias``)."""
    shape = _f32("add", "x", x)
    yshape = _f32("add", "y", y)
    if yshape != shape:
        raise ValueError(f"add: x of shape {shape} and y of shape {yshape} differ; add needs equal shapes "
                         "(use add_bias to broadcast a vector along the last axis)")
    _fits(gpu, "add", "x", shape)
    return _elementwise(gpu, "add", "x[i] + y[i]", _dev(gpu, x), _dev(gpu, y), shape, second_name="y")


def add_bias(gpu: GPUContext, x: Tensor | np.ndarray, bias: Tensor | np.ndarray) -> Tensor:
    """x + bias, ``bias`` of shape ``(x.shape[-1],)`` broadcast along the last axis."""
    shape = _f32("add_bias", "x", x)
    bshape = _f32("add_bias", "bias", bias)
    _bias_shape("add_bias", shape, bshape)
    _fits(gpu, "add_bias", "x", shape)
    return _elementwise(gpu, "add_bias", "x[i] + b[i % p.nb]", _dev(gpu, x), _dev(gpu, bias), shape,
                        nb=bshape[0], second_name="b")


# -- softmax and layernorm ---------------------------------------------------------------------------
def _mask_groups(shape: tuple[int, ...], mshape: tuple[int, ...]) -> int | None:
    """Mask rows if ``mshape`` is x.shape[:k] + (n,) or that with ones up to x's rank, else None."""
    n, lead = shape[-1], shape[:-1]
    if not mshape or mshape[-1] != n:
        return None
    mlead = mshape[:-1]
    if len(mlead) > len(lead):
        return None
    k = len(mlead)
    while k > 0 and mlead[k - 1] == 1 and len(mlead) == len(lead) and lead[k - 1] != 1:
        k -= 1
    if mlead[:k] != lead[:k] or any(d != 1 for d in mlead[k:]):
        return None
    return _size(lead[:k])


def softmax(gpu: GPUContext, x: Tensor | np.ndarray, *, mask: Tensor | np.ndarray | None = None,
            scale: float | None = None) -> Tensor:
    """Softmax along the last axis of ``x * scale`` (any rank >= 1), numerically stable.

    ``scale`` (a finite number; default 1) multiplies ``x`` in the kernel, before the
    mask: attention's ``softmax(q @ k^T * scale + mask)`` needs no extra pass.
    ``mask`` (float32, additive; e.g. 0 and -1e4, finfo.min or -inf) is added to ``x``
    first. Its shape is ``x.shape[:k] + (n,)`` for some k, or that padded with ones to
    ``x``'s rank: scores ``(B, H, S, n)`` take a ``(B, n)`` or ``(B, 1, 1, n)`` mask.
    A row holding NaN or +inf, or only -inf, comes out NaN, as numpy's
    ``exp(x - max) / sum`` gives.
    """
    shape = _f32("softmax", "x", x)
    if len(shape) == 0:
        raise ValueError("softmax: x is 0-d (shape ()); softmax needs at least one axis")
    n = shape[-1]
    rows = _size(shape[:-1])
    groups = 0
    if mask is not None:
        mshape = _f32("softmax", "mask", mask)
        g = _mask_groups(shape, mshape)
        if g is None:
            eg = list(dict.fromkeys([(n,), shape[:1] + (n,), shape[:1] + (1,) * max(len(shape) - 2, 0) + (n,)]))
            eg = [e for e in eg if len(e) <= len(shape)]
            raise ValueError(f"softmax: mask of shape {mshape} does not broadcast per row group over x of shape "
                             f"{shape}; the mask must be x.shape[:k] + ({n},) for some k, or that with ones "
                             f"up to x's rank, e.g. {' or '.join(map(str, eg))}")
        groups = g
    sc = _scale("softmax", scale, 1.0)
    _fits(gpu, "softmax", "x", shape)
    xt = _dev(gpu, x)
    mt = _dev(gpu, mask) if mask is not None else None
    return _softmax_rows(gpu, xt, shape, mt, "add" if mt is not None else None,
                         max(rows // max(groups, 1), 1), sc)


def _scale(op: str, scale: Any, default: float) -> float:
    if scale is None:
        return default
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)) \
            or not math.isfinite(float(scale)):
        raise ValueError(f"{op}: scale must be a finite number, got {scale!r}")
    return float(scale)


def _softmax_rows(gpu: GPUContext, xt: Tensor, shape: tuple[int, ...], mt: Tensor | None, mode: str | None,
                  mask_div: int, scale: float) -> Tensor:
    """Record the softmax of checked ``xt`` (rows of ``shape[-1]``) into a new Tensor.

    ``mode``: None (no mask), ``"add"`` (float32 mask added), ``"keep"`` (a padding mask
    of float32, int32 or uint32 words, nonzero = keep: other entries become
    -finfo(float32).max, exactly HF's ``(1 - mask) * finfo.min`` for finite scores).
    Row ``r`` uses mask row ``r // mask_div``.
    """
    n = shape[-1]
    rows = _size(shape[:-1])
    out = gpu.empty(shape, np.float32)
    if rows * n == 0:
        return out
    tpr, k, cached = _row_plan(n)
    rpw = WORKGROUP // tpr
    kind = None if mt is None else mode if mode == "add" else ("keep_f32" if mt.dtype == _F32 else "keep_u32")
    wgsl = nn_wgsl.softmax(tpr, k, cached, kind)
    tag = "" if kind is None else ".mask" if kind == "add" else ".keep"
    kern = _compile(gpu, f"nn.softmax.tpr{tpr}.k{k if cached else 'loop'}{tag}", wgsl)
    params = struct.pack("<3If", rows, n, mask_div, scale)
    bindings: list[Any] = [xt] + ([mt] if mt is not None else []) + [out, params]
    gpu.dispatch(kern, _groups(rows, rpw), *bindings)
    return out


def layernorm(gpu: GPUContext, x: Tensor | np.ndarray, gamma: Tensor | np.ndarray, beta: Tensor | np.ndarray,
              *, eps: float = 1e-5, residual: Tensor | np.ndarray | None = None) -> Tensor:
    """Layer normalisation over the last axis: (v - mean) / sqrt(var + eps) * gamma + beta.

    ``v`` is ``x``, or ``x + residual`` (same shape) with ``residual``: BERT's
    "add & norm" in one kernel. The variance is the mean of squared deviations from the
    mean (two passes over values held in registers; no E[x^2] - E[x]^2 cancellation).
    BERT's LayerNorm uses eps=1e-12.
    """
    shape = _f32("layernorm", "x", x)
    if len(shape) == 0:
        raise ValueError("layernorm: x is 0-d (shape ()); layernorm needs at least one axis")
    _norm_args("layernorm", shape, gamma, beta, residual, eps)
    _fits(gpu, "layernorm", "x", shape)
    xt = _dev(gpu, x)
    rt = _dev(gpu, residual) if residual is not None else None
    return _norm_rows(gpu, shape, "layernorm" + (".residual" if rt is not None else ""),
                      lambda tpr, k, cached: nn_wgsl.layernorm(tpr, k, cached, rt is not None),
                      [xt] + ([rt] if rt is not None else []), gamma, beta, eps)


def _norm_args(op: str, shape: tuple[int, ...], gamma: Any, beta: Any, residual: Any, eps: Any) -> None:
    """Check a layernorm's gamma, beta, residual and eps against its input's ``shape``."""
    n = shape[-1]
    for name, t in (("gamma", gamma), ("beta", beta)):
        s = _f32(op, name, t)
        if s != (n,):
            raise ValueError(f"{op}: {name} of shape {s} does not match the last axis of x of shape "
                             f"{shape}; gamma and beta must have shape ({n},)")
    if residual is not None:
        rshape = _f32(op, "residual", residual)
        if rshape != shape:
            raise ValueError(f"{op}: residual of shape {rshape} differs from x of shape {shape}; "
                             "they must be equal")
    if isinstance(eps, bool) or not isinstance(eps, (int, float, np.floating, np.integer)) \
            or not (math.isfinite(float(eps)) and float(eps) >= 0.0):
        raise ValueError(f"{op}: eps must be a finite number >= 0, got {eps!r}")


def _norm_rows(gpu: GPUContext, shape: tuple[int, ...], label: str, wgsl: Callable[[int, int, bool], str],
               inputs: list[Tensor], gamma: Tensor | np.ndarray, beta: Tensor | np.ndarray, eps: float,
               parts: int = 0, vocab: Sequence[int] = ()) -> Tensor:
    """One dispatch of a layernorm row kernel (``wgsl(tpr, k, cached)``'s source) over rows of
    ``shape[-1]``, reading ``inputs`` (its first bindings) and writing a new [shape] tensor.
    The caller checked everything (shapes, eps, the binding size)."""
    gt, bt = _dev(gpu, gamma), _dev(gpu, beta)
    out = gpu.empty(shape, np.float32)
    n = shape[-1]
    rows = _size(shape[:-1])
    if rows * n == 0:
        return out
    tpr, k, cached = _row_plan(n)
    kern = _compile(gpu, f"nn.{label}.tpr{tpr}.k{k if cached else 'loop'}", wgsl(tpr, k, cached))
    params = struct.pack("<2If5I", rows, n, float(eps), parts, *vocab, *[0] * (4 - len(vocab)))
    gpu.dispatch(kern, _groups(rows, WORKGROUP // tpr), *inputs, gt, bt, out, params)
    return out


def matmul_layernorm(gpu: GPUContext, a: Tensor | np.ndarray, b: Tensor | np.ndarray, gamma: Tensor | np.ndarray,
                     beta: Tensor | np.ndarray, *, transpose_b: bool = False, bias: Tensor | np.ndarray | None = None,
                     residual: Tensor | np.ndarray | None = None, eps: float = 1e-5,
                     config: MatmulConfig | None = None, small_split: bool | None = None) -> Tensor:
    """``layernorm(a @ b + bias + residual)`` over the last axis: a dense layer and BERT's "add & norm".

    The result equals ``layernorm(gpu, matmul(gpu, a, b, transpose_b=transpose_b,
    bias=bias, config=config, small_split=small_split), gamma, beta, eps=eps,
    residual=residual)``, sums taken in the same order. When the product splits K (a few
    rows on a GPU, see :func:`~hetero.kernels.matmul.matmul`'s ``small_split``), the
    layernorm adds the partial products, the bias and the residual itself: one dispatch
    instead of the summing pass and the layernorm. float32 only.
    """
    def spec(x: Any) -> Any:  # numpy operands as buffer-less Tensors: checked before anything is uploaded
        return shape_spec(x) if isinstance(x, np.ndarray) else x

    shape = problem(spec(a), spec(b), transpose_b, spec(bias), None).out_shape
    if np.dtype(a.dtype) != _F32:
        raise TypeError(f"matmul_layernorm: a and b must be float32, got {np.dtype(a.dtype).name}")
    _norm_args("matmul_layernorm", shape, gamma, beta, residual, eps)
    _fits(gpu, "matmul_layernorm", "the result", shape)
    biast = _dev(gpu, bias) if bias is not None else None
    rt = _dev(gpu, residual) if residual is not None else None
    t, parts = matmul_partials(gpu, a, b, transpose_b=transpose_b, bias=biast, config=config, small_split=small_split)
    if parts == 1:
        return layernorm(gpu, t, gamma, beta, eps=eps, residual=rt)
    has_bias = biast is not None
    label = "layernorm.parts" + (".bias" if has_bias else "") + (".residual" if rt is not None else "")
    inputs = [t] + ([biast] if biast is not None else []) + ([rt] if rt is not None else [])
    return _norm_rows(gpu, shape, label,
                      lambda tpr, k, cached: nn_wgsl.layernorm(tpr, k, cached, rt is not None, parts=True,
                                                               bias=has_bias),
                      inputs, gamma, beta, eps, parts=parts)


# -- transpose and embedding ------------------------------------------------------------------------
def _word(op: str, name: str, x: Any) -> tuple[int, ...]:
    _kind(op, name, x)
    shape = tuple(int(s) for s in x.shape)
    if np.dtype(x.dtype) not in _WORD_DTYPES:
        raise TypeError(f"{op}: {name} must be float32, int32 or uint32, got {np.dtype(x.dtype).name} "
                        f"(shape {shape})")
    return shape


def _merged_perm(shape: tuple[int, ...], axes: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """Output dims and matching input strides (elements), with size-1 axes dropped and axes
    that stay adjacent merged: (B, S, H, D) by (0, 2, 1, 3) stays 4-D, (0, 1, 2, 3) is 1-D."""
    keep = [a for a in axes if shape[a] != 1]
    groups: list[list[int]] = []
    for a in keep:
        if groups and groups[-1][-1] + 1 == a:
            groups[-1].append(a)
        else:
            groups.append([a])
    order = sorted(range(len(groups)), key=lambda i: groups[i][0])  # input order of the groups
    size = [_size([shape[a] for a in g]) for g in groups]
    stride = [0] * len(groups)
    s = 1
    for i in reversed(order):
        stride[i] = s
        s *= size[i]
    return size, stride


def transpose(gpu: GPUContext, x: Tensor | np.ndarray, axes: Sequence[int]) -> Tensor:
    """Permute the axes of ``x`` (like ``numpy.transpose(x, axes)``) into a new contiguous Tensor.

    Any rank; after dropping size-1 axes and merging axes that stay adjacent the
    permutation must have at most 4 axes (every permutation of a 4-D tensor does).
    float32, int32 and uint32 tensors. When the last axis stays last and its length is
    a multiple of 4 (attention's [B, S, H, D] <-> [B, H, S, D]), whole vec4s move.
    """
    shape = _word("transpose", "x", x)
    try:
        ax = tuple(int(a) for a in axes)
    except TypeError:
        raise TypeError(f"transpose: axes must be a sequence of ints, got {axes!r}") from None
    nd = len(shape)
    norm = tuple(a % nd if nd and -nd <= a < nd else -1 for a in ax)
    if len(ax) != nd or sorted(norm) != list(range(nd)):
        raise ValueError(f"transpose: axes {ax} are not a permutation of the {nd} axes of x of shape {shape}")
    out_shape = tuple(shape[a] for a in norm)
    size, stride = _merged_perm(shape, norm)
    if len(size) > 4:
        raise ValueError(f"transpose: axes {ax} of x of shape {shape} reduce to a {len(size)}-axis permutation "
                         "(after dropping size-1 axes and merging axes that stay adjacent); at most 4 are supported")
    _fits(gpu, "transpose", "x", shape)
    xt = _dev(gpu, x)
    out = gpu.empty(out_shape, xt.dtype)
    n = _size(shape)
    if n == 0:
        return out
    # Whole vec4s when the innermost merged axis stays innermost and holds a multiple of 4.
    vec = bool(size) and stride[-1] == 1 and size[-1] % 4 == 0
    if vec:
        size[-1] //= 4
        stride = [s // 4 if s != 1 else 1 for s in stride]
    size = [1] * (4 - len(size)) + size
    stride = [0] * (4 - len(stride)) + stride
    w = 4 if vec else 1
    kern = _compile(gpu, f"nn.transpose.{'vec4' if vec else 'scalar'}", nn_wgsl.transpose(vec))
    params = struct.pack("<12I", n // w, 0, 0, 0, *size, *stride)
    gpu.dispatch(kern, _groups(n // w, WORKGROUP), xt, out, params)
    return out


def embedding(gpu: GPUContext, table: Tensor | np.ndarray, ids: Tensor | np.ndarray | Sequence[int]) -> Tensor:
    """Rows of ``table`` ([V, H]) picked by ``ids`` (any shape) -> ``ids.shape + (H,)``.

    ``ids`` are int32 or uint32 (a numpy array of any integer dtype is checked and
    converted on the host). Ids given as numpy must lie in [0, V), else ValueError; a
    Tensor's ids cannot be checked before the GPU reads them: out-of-range ids (negative
    int32 ones too) give rows of zeros.
    """
    tshape = _table("embedding", "table", table, True)
    vocab, hidden = tshape
    ids, ishape = _ids("embedding", "ids", ids, vocab)
    out_shape = ishape + (hidden,)
    _fits(gpu, "embedding", "the result", out_shape)
    if vocab == 0 and _size(out_shape):
        raise ValueError(f"embedding: table of shape {tshape} has no rows; ids of shape {ishape} "
                         "cannot pick any")
    tt = _dev(gpu, table)
    it = _dev_ids(gpu, ids)
    out = gpu.empty(out_shape, tt.dtype)
    n = _size(out_shape)
    if n == 0:
        return out
    vec = hidden % 4 == 0
    w = 4 if vec else 1
    kern = _compile(gpu, f"nn.embedding.{'vec4' if vec else 'scalar'}", nn_wgsl.embedding(vec))
    params = struct.pack("<4I", n // w, hidden // w, vocab, 0)
    gpu.dispatch(kern, _groups(n // w, WORKGROUP), tt, it, out, params)
    return out


def _table(op: str, name: str, table: Any, words: bool) -> tuple[int, int]:
    """A lookup table's (rows, width), checked: 2-D, of 4-byte words (``words``) or float32."""
    tshape = _word(op, name, table) if words else _f32(op, name, table)
    if len(tshape) != 2:
        raise ValueError(f"{op}: {name} must be 2-D [vocab, hidden], got shape {tshape}")
    return tshape[0], tshape[1]


def _ids(op: str, name: str, ids: Any, vocab: int) -> tuple[Tensor | np.ndarray, tuple[int, ...]]:
    """``ids`` checked (numpy ones also against ``vocab``), lists made arrays; and their shape."""
    if isinstance(ids, (list, tuple)):
        ids = np.asarray(ids)
    if not isinstance(ids, (Tensor, np.ndarray)):
        raise TypeError(f"{op}: {name} must be a hetero.Tensor (or a numpy array or list of ints), "
                        f"got {type(ids).__name__}")
    ishape = tuple(int(s) for s in ids.shape)
    idt = np.dtype(ids.dtype)
    if isinstance(ids, np.ndarray):
        if idt.kind not in "iu":
            raise TypeError(f"{op}: {name} must be integers, got {idt.name} (shape {ishape})")
        if ids.size:
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= vocab:
                bad = int(np.flatnonzero((ids.reshape(-1) < 0) | (ids.reshape(-1) >= vocab))[0])
                pos = tuple(int(i) for i in np.unravel_index(bad, ishape))
                raise ValueError(f"{op}: id {int(ids.reshape(-1)[bad])} at index {pos} of {name} of shape "
                                 f"{ishape} is out of range for a table of {vocab} rows; ids must lie in "
                                 f"[0, {vocab})")
    elif idt not in _ID_DTYPES:
        raise TypeError(f"{op}: {name} must be int32 or uint32, got {idt.name} (shape {ishape}); "
                        "cast on the host, e.g. ids.astype(np.int32)")
    return ids, ishape


def _dev_ids(gpu: GPUContext, ids: Tensor | np.ndarray) -> Tensor:
    return gpu.upload(np.array(ids, dtype=np.int32, order="C")) if isinstance(ids, np.ndarray) else ids


def embedding_layernorm(gpu: GPUContext, tables: Sequence[Tensor | np.ndarray],
                        ids: Sequence[Tensor | np.ndarray | Sequence[int]], gamma: Tensor | np.ndarray,
                        beta: Tensor | np.ndarray, *, eps: float = 1e-5) -> Tensor:
    """``layernorm(embedding(tables[0], ids[0]) + embedding(tables[1], ids[1]) + ...)``: BERT's embeddings.

    One to four float32 tables ``[V_i, H]`` of the same ``H``, each with its ids (all of
    one shape; checked as :func:`embedding` checks them) -> ``ids[0].shape + (H,)``. One
    dispatch: each row's lookups are summed in table order and normalised in registers,
    equal to the separate ops, sums taken in the same order. A device with too few storage
    bindings per shader stage (``2 * len(tables) + 3``) gets the separate ops.
    """
    op = "embedding_layernorm"
    if not isinstance(tables, (list, tuple)) or not isinstance(ids, (list, tuple)):
        raise TypeError(f"{op}: tables and ids must be lists (or tuples) of the same length, got "
                        f"{type(tables).__name__} and {type(ids).__name__}")
    if not 1 <= len(tables) <= 4 or len(ids) != len(tables):
        raise ValueError(f"{op}: takes 1 to 4 tables, each with its ids; got {len(tables)} tables and {len(ids)} "
                         "ids arrays")
    shapes = [_table(op, f"tables[{i}]", t, False) for i, t in enumerate(tables)]
    hidden = shapes[0][1]
    for i, (v, h) in enumerate(shapes):
        if h != hidden:
            raise ValueError(f"{op}: tables[{i}] is [{v}, {h}] but tables[0] is {list(shapes[0])}: the tables must "
                             "have the same width")
    checked = [_ids(op, f"ids[{i}]", x, shapes[i][0]) for i, x in enumerate(ids)]
    ishape = checked[0][1]
    for i, (_, s) in enumerate(checked):
        if s != ishape:
            raise ValueError(f"{op}: ids[{i}] has shape {s} but ids[0] has {ishape}: every ids array must have "
                             "the same shape")
    out_shape = ishape + (hidden,)
    _norm_args(op, out_shape, gamma, beta, None, eps)
    _fits(gpu, op, "the result", out_shape)
    for j, (v, _) in enumerate(shapes):
        if v == 0 and _size(out_shape):
            raise ValueError(f"{op}: tables[{j}] has no rows; ids of shape {ishape} cannot pick any")
    if 2 * len(tables) + 3 > gpu.limits.get("max-storage-buffers-per-shader-stage", 8):
        x = embedding(gpu, tables[0], checked[0][0])
        for t, (ti, _) in zip(tables[1:-1], checked[1:-1]):
            x = add(gpu, x, embedding(gpu, t, ti))
        last = embedding(gpu, tables[-1], checked[-1][0]) if len(tables) > 1 else None
        return layernorm(gpu, x, gamma, beta, eps=eps, residual=last)
    tts = [_dev(gpu, t) for t in tables]
    its = [_dev_ids(gpu, ti) for ti, _ in checked]
    return _norm_rows(gpu, out_shape, f"embedding_layernorm{len(tables)}",
                      lambda tpr, k, cached: nn_wgsl.embedding_layernorm(tpr, k, cached, len(tables)),
                      tts + its, gamma, beta, eps, vocab=[v for v, _ in shapes])


# -- attention ------------------------------------------------------------------------------------
def _attn_tiles(gpu: GPUContext, sq: int, sk: int, d4: int) -> tuple[int, int]:
    bq = ATTN_BQ if ATTN_BQ is not None else min(64, max(16, _pow2_ceil(sq)))
    per_key = 32 * d4 + 4  # a vec4 row of k and of v, and a mask word
    limit = int(gpu.limits["max-compute-workgroup-storage-size"])
    if ATTN_BK is not None:
        bk = ATTN_BK
    else:
        fit = min(ATTN_SMEM_BYTES, limit) // per_key
        bk = min(64, fit // 8 * 8 if fit >= 8 else fit, max(8, _pow2_ceil(sk)))
    if bk < 1 or bk * per_key > limit:
        raise ValueError(f"attention: head dimension {d4 * 4} needs {per_key} bytes of workgroup memory per key; "
                         f"the adapter's max-compute-workgroup-storage-size of {limit} bytes holds too few")
    return bq, bk


ATTN_IMPLS = ("fused", "matmul", "auto")
# attention_varlen's tiles are sized for sequences of about this many tokens (sentences), not
# for the packed axis: a workgroup's keys span its queries' sequences.
VARLEN_TILE = 32


def _adapter_type(gpu: GPUContext) -> str:
    dev = getattr(gpu, "device", None)
    info = getattr(dev, "adapter_info", None) or {}
    try:
        return str(info.get("adapter_type", "") or "")
    except AttributeError:
        return ""


def _attention_auto(adapter_type: str, sq: int, sk: int, scores_bytes: int, limit: int) -> str:
    """The implementation ``impl="auto"`` runs (see :func:`attention`)."""
    gpu_like = adapter_type.lower().replace("_", "").replace("-", "") in ("discretegpu", "integratedgpu")
    if gpu_like and sk >= ATTN_MATMUL_MIN_SEQ and scores_bytes <= limit:
        return "matmul"
    return "fused"


def _view(t: Tensor, shape: tuple[int, ...]) -> Tensor:
    """The same contiguous data under another shape (same element count)."""
    return Tensor(t.buffer, shape, t.dtype, offset=t.offset, block=t.block)


def attention(gpu: GPUContext, q: Tensor | np.ndarray, k: Tensor | np.ndarray, v: Tensor | np.ndarray, *,
              mask: Tensor | np.ndarray | None = None, scale: float | None = None, layout: str = "bhsd",
              impl: str = "auto") -> Tensor:
    """softmax(q @ k^T * scale + mask) @ v, fused (online softmax) or as matmul, softmax, matmul.

    ``q``: [B, H, Sq, D]; ``k``, ``v``: [B, H, Sk, D]; the result is shaped like ``q``.
    ``layout="bshd"`` takes and returns [B, S, H, D] instead (the layout a [B, S, H*D]
    projection has), with no transposes. ``scale`` defaults to 1/sqrt(D). ``mask``:
    [B, Sk] or [B, 1, 1, Sk], nonzero for real tokens and 0 for padding (float32, int32
    or uint32; numpy bool or integers are converted): padded keys are excluded like HF
    BERT's ``(1 - mask) * finfo(float32).min``, and a query whose keys are all padding
    gets the mean of ``v`` (HF's result too), never NaN.

    ``impl``: ``"fused"`` (one kernel, the [Sq, Sk] scores never stored), ``"matmul"``
    (three kernels: scores = q @ k^T with :func:`hetero.kernels.matmul.matmul` batched
    over B*H, the softmax kernel with the scale and the padding mask folded in, probs @ v;
    ``layout="bshd"`` adds transposes of q, k, v and the result; the scores and
    probabilities, B*H*Sq*Sk floats each, are stage temporaries) or ``"auto"``: "matmul"
    on a discrete or integrated GPU when Sk >= :data:`ATTN_MATMUL_MIN_SEQ` (128) and the
    scores fit one storage binding, else "fused" (CPU adapters such as lavapipe, short
    sequences). Both give the same results (to float32 rounding), fully padded rows too.
    """
    if impl not in ATTN_IMPLS:
        raise ValueError(f"attention: impl must be 'fused', 'matmul' or 'auto', got {impl!r}")
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"attention: layout must be 'bhsd' ([B, H, S, D]) or 'bshd' ([B, S, H, D]), got {layout!r}")
    qs, ks, vs = (_f32("attention", n, t) for n, t in (("q", q), ("k", k), ("v", v)))
    names = "[B, H, S, D]" if layout == "bhsd" else "[B, S, H, D]"
    for name, s in (("q", qs), ("k", ks), ("v", vs)):
        if len(s) != 4:
            raise ValueError(f"attention: {name} must be 4-D {names}, got shape {s}")
    hx, sx = (1, 2) if layout == "bhsd" else (2, 1)
    if ks != vs:
        raise ValueError(f"attention: k of shape {ks} and v of shape {vs} differ; they must be equal")
    if (qs[0], qs[hx], qs[3]) != (ks[0], ks[hx], ks[3]):
        raise ValueError(f"attention: q of shape {qs} and k of shape {ks} disagree on batch, heads or head "
                         f"dimension; with layout {layout!r} both are {names}")
    bsz, heads, sq, d = qs[0], qs[hx], qs[sx], qs[3]
    sk = ks[sx]
    if sk == 0 and _size(qs):
        raise ValueError(f"attention: k of shape {ks} has no keys; attention needs at least one")
    sc = _scale("attention", scale, 1.0 / math.sqrt(d) if d else 1.0)
    mt = _padding_mask("attention", mask, bsz, sk, f"keys of shape {ks}") if mask is not None else None
    for name, s in (("q", qs), ("k", ks)):
        _fits(gpu, "attention", name, s)
    scores_shape = (bsz * heads, sq, sk)
    limit = int(gpu.limits["max-storage-buffer-binding-size"])
    if impl == "auto":
        impl = _attention_auto(_adapter_type(gpu), sq, sk, _size(scores_shape) * 4, limit)
    if impl == "matmul":
        _fits(gpu, "attention (impl='matmul')", "the scores", scores_shape)
        return _attention_matmul(gpu, q, k, v, mt, sc, layout, (bsz, heads, sq, sk, d))
    qt, kt, vt = _dev(gpu, q), _dev(gpu, k), _dev(gpu, v)
    mtt = _dev(gpu, mt) if mt is not None else None
    out = gpu.empty(qs, np.float32)
    if _size(qs) == 0:
        return out
    if layout == "bhsd":
        qstr, kstr = (heads * sq * d, sq * d, d), (heads * sk * d, sk * d, d)
    else:
        qstr, kstr = (sq * heads * d, d, heads * d), (sk * heads * d, d, heads * d)
    _attention_fused(gpu, (qt, kt, vt), (0, 0, 0), qstr, kstr, qstr, out, mtt, sc, (bsz, heads, sq, sk, d))
    return out


def attention_packed(gpu: GPUContext, qkv: Tensor | np.ndarray, heads: int, *,
                     mask: Tensor | np.ndarray | None = None, scale: float | None = None,
                     bias: Tensor | np.ndarray | None = None) -> Tensor:
    """:func:`attention` over one fused Q/K/V projection: ``qkv`` is [B, S, 3*H*D] -> [B, S, H*D].

    Along the last axis ``qkv`` holds q, then k, then v, each [H, D] (the output of one
    matmul against the three projection weights stacked, ``[3*H*D, in]``): one dispatch
    instead of three projections, and the fused kernel reads q, k and v in place with
    their strides (no split, no transposes). ``mask``, ``scale``: as for :func:`attention`.

    ``qkv`` may also be [P, B, S, 3*H*D]: the projection's partial products over P ranges
    of K (:func:`~hetero.kernels.matmul.matmul_partials`), which the kernel sums as it reads
    them, and ``bias`` [3*H*D] is added to every row: a K-split projection then needs no
    summing pass.
    """
    full = _f32("attention_packed", "qkv", qkv)
    heads = check_positive_int("attention_packed: heads", heads, numpy_ints=True)
    qs, parts = _qkv_sum("attention_packed", full, 3, bias)
    if len(qs) != 3 or qs[2] % (3 * heads):
        raise ValueError(f"attention_packed: qkv must be [B, S, 3*H*D] (or [P, B, S, 3*H*D]) with H = {heads} "
                         f"heads, got shape {full}")
    bsz, sq, width = qs
    hd = width // 3
    d = hd // heads
    if d == 0:
        raise ValueError(f"attention_packed: qkv of shape {qs} has no room for {heads} heads of dimension >= 1")
    sc = _scale("attention_packed", scale, 1.0 / math.sqrt(d))
    mt = _padding_mask("attention_packed", mask, bsz, sq, f"qkv of shape {qs}") if mask is not None else None
    _fits(gpu, "attention_packed", "qkv", full)
    t = _dev(gpu, qkv)
    mtt = _dev(gpu, mt) if mt is not None else None
    bt = _dev(gpu, bias) if bias is not None else None
    out = gpu.empty((bsz, sq, hd), np.float32)
    if _size(qs) == 0:
        return out
    istr = (sq * width, d, width)  # batch, head, token strides of q, k and v inside qkv
    _attention_fused(gpu, (t, t, t), (0, hd, 2 * hd), istr, istr, (sq * hd, d, hd), out, mtt, sc,
                     (bsz, heads, sq, sq, d), summed=(parts, _size(qs), bt, width))
    return out


def attention_varlen(gpu: GPUContext, qkv: Tensor | np.ndarray, heads: int, spans: Tensor | np.ndarray, *,
                     scale: float | None = None, bias: Tensor | np.ndarray | None = None) -> Tensor:
    """:func:`attention_packed` over sequences of different lengths packed along one token axis.

    ``qkv`` is [T, 3*H*D] (q, then k, then v along the last axis, as for
    :func:`attention_packed`), the tokens of every sequence one after another, no padding;
    the result is [T, H*D]. ``spans`` is int32 or uint32 [T, 2]: each token's sequence as the
    token range ``[start, end)``, which holds the token itself; each token attends to the keys
    of its own range only. Tokens past the real ones (a packed batch rounded up to a fixed
    size) are a sequence of their own. The sequences must follow each other in order (token
    ``t``'s range starts at or after token ``t - 1``'s); with ranges that break this rule the
    results are undefined, but nothing outside ``qkv`` and the result is read or written.

    The work follows the sequences' lengths (the sum of their squares), not the longest
    one's times their number as padded attention does: one dispatch, whose shape (and so a
    captured stage's signature) depends on ``T`` alone, whatever the lengths within it.

    ``qkv`` may also be [P, T, 3*H*D], partial products summed as they are read, plus ``bias``
    (see :func:`attention_packed`).
    """
    full = _f32("attention_varlen", "qkv", qkv)
    heads = check_positive_int("attention_varlen: heads", heads, numpy_ints=True)
    qs, parts = _qkv_sum("attention_varlen", full, 2, bias)
    if len(qs) != 2 or qs[1] % (3 * heads) or qs[1] < 3 * heads:
        raise ValueError(f"attention_varlen: qkv must be [T, 3*H*D] (or [P, T, 3*H*D]) with H = {heads} heads "
                         f"and D >= 1, got shape {full}")
    _kind("attention_varlen", "spans", spans)
    sshape = tuple(int(x) for x in spans.shape)
    if sshape != (qs[0], 2):
        raise ValueError(f"attention_varlen: spans must be [T, 2] = {(qs[0], 2)} (each token's [start, end)), "
                         f"got shape {sshape}")
    if np.dtype(spans.dtype) not in _ID_DTYPES:
        raise TypeError(f"attention_varlen: spans must be int32 or uint32, got {np.dtype(spans.dtype).name}")
    if isinstance(spans, np.ndarray) and spans.size:
        check_spans(spans)
    tokens, width = qs
    hd = width // 3
    d = hd // heads
    sc = _scale("attention_varlen", scale, 1.0 / math.sqrt(d))
    _fits(gpu, "attention_varlen", "qkv", full)
    t = _dev(gpu, qkv)
    st = gpu.upload(np.ascontiguousarray(spans, dtype=np.int32)) if isinstance(spans, np.ndarray) else spans
    bt = _dev(gpu, bias) if bias is not None else None
    out = gpu.empty((tokens, hd), np.float32)
    if tokens == 0:
        return out
    istr = (tokens * width, d, width)  # (one batch), head, token strides of q, k and v inside qkv
    _attention_fused(gpu, (t, t, t), (0, hd, 2 * hd), istr, istr, (tokens * hd, d, hd), out, None, sc,
                     (1, heads, tokens, tokens, d), spans=st, summed=(parts, tokens * width, bt, width))
    return out


def _padding_mask(op: str, mask: Tensor | np.ndarray, bsz: int, sk: int, keys: str) -> Tensor | np.ndarray:
    """A checked [B, Sk] / [B, 1, 1, Sk] padding mask for ``keys``: numpy masks become uint32 0/1."""
    _kind(op, "mask", mask)
    mshape = tuple(int(s) for s in mask.shape)
    if mshape not in ((bsz, sk), (bsz, 1, 1, sk)):
        raise ValueError(f"{op}: mask of shape {mshape} does not fit {keys}; a padding "
                         f"mask is [B, Sk] = {(bsz, sk)} or [B, 1, 1, Sk] = {(bsz, 1, 1, sk)}")
    mdt = np.dtype(mask.dtype)
    if isinstance(mask, np.ndarray):
        if mdt.kind not in "biuf":
            raise TypeError(f"{op}: mask must be numeric or bool, got {mdt.name} (shape {mshape})")
        return (mask != 0).astype(np.uint32)
    if mdt not in _WORD_DTYPES:
        raise TypeError(f"{op}: mask must be float32, int32 or uint32, got {mdt.name} (shape {mshape})")
    return mask


def _attention_fused(gpu: GPUContext, qkv: tuple[Tensor, Tensor, Tensor], first: tuple[int, int, int],
                     qstr: tuple[int, int, int], kstr: tuple[int, int, int], ostr: tuple[int, int, int],
                     out: Tensor, mtt: Tensor | None, sc: float, dims: tuple[int, int, int, int, int],
                     spans: Tensor | None = None, summed: tuple[int, int, Tensor | None, int] = (1, 0, None, 0)
                     ) -> None:
    """One dispatch of the fused kernel: element offsets ``first`` and (batch, head, token) strides;
    ``spans``: each token's key range (packed sequences, one batch), instead of a mask;
    ``summed``: (planes, elements a plane, bias, its width): q, k and v are sums of partial
    products (planes > 1) plus a bias per column (a Tensor of ``width``)."""
    bsz, heads, sq, sk, d = dims
    parts, pstride, bias, bw = summed
    d4 = _groups(d, 4)
    # Packed sequences: a workgroup's keys are its queries' sequences, not the whole axis.
    bq, bk = _attn_tiles(gpu, VARLEN_TILE, VARLEN_TILE, d4) if spans is not None else _attn_tiles(gpu, sq, sk, d4)
    vec = d % 4 == 0 and all(f % 4 == 0 for f in first) and pstride % 4 == 0 and bw % 4 == 0
    float_mask = mtt is not None and mtt.dtype == _F32
    wgsl = nn_wgsl.attention(bq, bk, d4, vec, None if mtt is None else float_mask, varlen=spans is not None,
                             parts=parts > 1, bias=bias is not None)
    label = (f"nn.attention.bq{bq}.bk{bk}.d{d4 * 4}{'.vec4' if vec else ''}{'.mask' if mtt is not None else ''}"
             f"{'.varlen' if spans is not None else ''}{'.parts' if parts > 1 else ''}"
             f"{'.bias' if bias is not None else ''}")
    kern = _compile(gpu, label, wgsl)
    nqb = _groups(sq, bq)
    params = struct.pack("<12If11I", sq, sk, heads, nqb, d, *qstr, *kstr, first[0], sc * math.log2(math.e),
                         first[1], first[2], 0, *ostr, 0, parts, pstride, bw, 0)
    q, k, v = qkv
    extra = mtt if mtt is not None else spans
    bindings: list[Any] = [q, k, v, out, params] + ([extra] if extra is not None else []) + \
        ([bias] if bias is not None else [])
    gpu.dispatch(kern, bsz * heads * nqb, *bindings)


def _qkv_sum(op: str, qs: tuple[int, ...], rank: int, bias: Any) -> tuple[tuple[int, ...], int]:
    """``qkv``'s shape without its planes and how many planes it has (a rank+1-D ``qkv`` is
    partial products summed along its first axis); ``bias`` checked against its width."""
    parts = 1
    if len(qs) == rank + 1:
        parts, qs = qs[0], qs[1:]
        if parts < 1:
            raise ValueError(f"{op}: qkv of partial products has {parts} planes along its first axis; it needs >= 1")
    if bias is not None:
        bs = _f32(op, "bias", bias)
        if len(qs) == rank and bs != (qs[-1],):
            raise ValueError(f"{op}: bias of shape {bs} does not match qkv's last axis of {qs[-1]}; bias must have "
                             f"shape ({qs[-1]},)")
    return qs, parts


def _attention_matmul(gpu: GPUContext, q: Any, k: Any, v: Any, mt: Any, sc: float, layout: str,
                      dims: tuple[int, int, int, int, int]) -> Tensor:
    """The three-kernel path of :func:`attention` (inputs checked; ``mt`` a padding mask or None)."""
    bsz, heads, sq, sk, d = dims
    qt, kt, vt = _dev(gpu, q), _dev(gpu, k), _dev(gpu, v)
    mtt = _dev(gpu, mt) if mt is not None else None
    if bsz * heads * sq * d == 0:
        return gpu.empty(qt.shape, np.float32)
    bh = bsz * heads
    if layout == "bshd":  # [B, S, H, D] -> [B, H, S, D]
        qt, kt, vt = (transpose(gpu, t, (0, 2, 1, 3)) for t in (qt, kt, vt))
    q3, k3, v3 = _view(qt, (bh, sq, d)), _view(kt, (bh, sk, d)), _view(vt, (bh, sk, d))
    scores = matmul(gpu, q3, k3, transpose_b=True)                        # [B*H, Sq, Sk]
    # rows of the scores: B*H*Sq, one mask row ([B, Sk]) per H*Sq of them
    probs = _softmax_rows(gpu, scores, (bh, sq, sk), mtt, "keep", heads * sq, sc)
    out = matmul(gpu, probs, v3)                                          # [B*H, Sq, D]
    if layout == "bshd":
        return transpose(gpu, _view(out, (bsz, heads, sq, d)), (0, 2, 1, 3))
    return _view(out, (bsz, heads, sq, d))
