"""CPU implementations of hetero's GPU ops, in numpy: ``hetero.ops.cpu.matmul(a, b)`` and friends.

Each function takes the same arguments as its GPU op in :mod:`hetero.ops`, without the
``gpu`` context, and returns a numpy array with the same numerics, so that a stage
declared with both implementations (``g.stage(..., cpu=..., gpu=...)``) gives the same
result wherever the runtime places it, within float32 rounding:

- float32 in, float32 out; products are float32 BLAS calls (``numpy.matmul``);
- :func:`gelu` is the erf form ``x * Phi(x)``, Phi from the erfc of Abramowitz & Stegun
  7.1.26 (absolute error 1.5e-7; :func:`erf` uses Numerical Recipes' erfcc, as the GPU
  kernels do), not the tanh approximation;
- :func:`layernorm` takes the variance as the mean of squared deviations (no
  ``E[x^2] - E[x]^2``), with the caller's ``eps`` (BERT: 1e-12);
- :func:`softmax` multiplies by ``scale`` before adding the additive ``mask``, and
  subtracts the row maximum;
- :func:`attention` and :func:`attention_packed` exclude the keys whose padding-mask
  entry is 0 (as the GPU kernels do) and scale by ``1/sqrt(D)`` by default;
- reductions follow numpy: :func:`sum` of int32 is int64, :func:`mean` of an empty
  array is NaN, :func:`argmax`/:func:`argmin` return int32 indices.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "add",
    "add_bias",
    "argmax",
    "argmin",
    "attention",
    "attention_packed",
    "attention_varlen",
    "embedding",
    "embedding_layernorm",
    "erf",
    "gelu",
    "layernorm",
    "matmul",
    "matmul_layernorm",
    "max",
    "mean",
    "min",
    "softmax",
    "sum",
    "transpose",
]

_F32 = np.float32


def _f32(op: str, name: str, x: Any) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype != _F32:
        raise TypeError(f"{op}: {name} must be float32, got {a.dtype.name} (shape {a.shape})")
    return a


def matmul(a: Any, b: Any, *, transpose_b: bool = False, bias: Any = None, activation: str | None = None) -> np.ndarray:
    """``a @ b`` (``a @ b.T`` with ``transpose_b``) plus ``bias`` per column, as :func:`hetero.ops.matmul`.

    ``a`` is ``[M, K]`` or ``[B, M, K]``; ``b`` is ``[K, N]`` or ``[B, K, N]`` (``[N, K]`` /
    ``[B, N, K]`` with ``transpose_b``). ``activation="gelu"`` applies :func:`gelu` after the bias.
    """
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != b.dtype or a.dtype not in (np.float32, np.float16):
        raise TypeError(f"matmul: a and b must both be float32 (or both float16), got {a.dtype.name} and "
                        f"{b.dtype.name}")
    if a.ndim not in (2, 3) or b.ndim not in (2, 3):
        raise ValueError(f"matmul: a and b must be 2-D or 3-D, got shapes {a.shape} and {b.shape}")
    if activation not in (None, "gelu"):
        raise ValueError(f"matmul: activation must be None or 'gelu', got {activation!r}")
    half = a.dtype == np.float16
    if half:  # accumulated in float32, as the GPU kernel does
        a, b = a.astype(_F32), b.astype(_F32)
    bt = np.swapaxes(b, -1, -2) if transpose_b else b
    if a.shape[-1] != bt.shape[-2]:
        raise ValueError(f"matmul: inner dimensions differ: a {a.shape} and b {b.shape}"
                         f"{' (transposed)' if transpose_b else ''}")
    out = np.matmul(a, bt)
    if bias is not None:
        out += np.asarray(bias, dtype=out.dtype)
    if activation == "gelu":
        out = gelu(out)
    return out.astype(np.float16) if half else out


# Numerical Recipes' erfcc, as the GPU kernels use it: erfc(z) = t exp(-z^2 + c(t)), t = 1 / (1 + z/2).
_C = tuple(_F32(v) for v in (0.17087277, -0.82215223, 1.48851587, -1.13520398, 0.27886807, -0.18628806,
                              0.09678418, 0.37409196, 1.00002368, -1.26551223))


def _erfc_pos(z: np.ndarray) -> np.ndarray:
    """erfc(z) for z >= 0, float32 (relative error a few 1e-7, keeps its relative accuracy in the tail)."""
    t = z * _F32(0.5)
    t += _F32(1.0)
    np.reciprocal(t, out=t)
    c = _C[0] * t
    for k in _C[1:-1]:
        c += k
        c *= t
    c += _C[-1]
    c -= np.square(z)
    np.exp(c, out=c)
    c *= t
    return c


def erf(x: Any) -> np.ndarray:
    """The error function, elementwise (float32; absolute error 5e-7)."""
    a = _f32("erf", "x", x)
    c = _erfc_pos(np.abs(a))
    return np.copysign(1.0 - c, a).astype(_F32, copy=False)


_CHUNK = 1 << 16  # elements per block of the elementwise ops: their temporaries stay in cache


def gelu(x: Any, *, bias: Any = None) -> np.ndarray:
    """GELU, erf form: ``x * Phi(x)`` with ``Phi(x) = erfc(-x / sqrt 2) / 2`` (``bias`` added first)."""
    a = _f32("gelu", "x", x)
    v = a + _f32("gelu", "bias", bias) if bias is not None else a.copy()
    flat = v.reshape(-1)
    with np.errstate(invalid="ignore"):
        for lo in range(0, flat.size, _CHUNK):
            _gelu_inplace(flat[lo:lo + _CHUNK])
    return v


# Abramowitz & Stegun 7.1.26 (absolute error 1.5e-7): erfc(z) = t (a1 + t (a2 + ... + t a5)) exp(-z^2),
# t = 1 / (1 + p z). Half the passes of the erfcc form, for the large GELU inputs of encoder layers.
_AS_P = _F32(0.3275911)
_AS = tuple(_F32(v) for v in (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429))


def _gelu_inplace(v: np.ndarray) -> None:
    z = np.abs(v)
    z *= _F32(1.0 / math.sqrt(2.0))
    t = z * _AS_P
    t += _F32(1.0)
    np.reciprocal(t, out=t)
    tail = _AS[4] * t
    for c in (_AS[3], _AS[2], _AS[1]):
        tail += c
        tail *= t
    tail += _AS[0]
    tail *= t
    np.square(z, out=z)
    np.negative(z, out=z)
    np.exp(z, out=z)
    tail *= z
    tail *= _F32(0.5)  # erfc(|v| / sqrt 2) / 2 = Phi(-|v|)
    # Phi(v) = tail for v < 0, 1 - tail for v >= 0: no cancellation for negative v.
    np.subtract(_F32(1.0), tail, out=tail, where=v >= 0)
    neg_inf = np.isneginf(v) if v.size and np.fmin.reduce(v) == -np.inf else None
    v *= tail
    if neg_inf is not None:
        v[neg_inf] = 0.0  # gelu(-inf) = 0, the limit


def add(x: Any, y: Any) -> np.ndarray:
    """x + y for two float32 arrays of the same shape."""
    a, b = _f32("add", "x", x), _f32("add", "y", y)
    if a.shape != b.shape:
        raise ValueError(f"add: x of shape {a.shape} and y of shape {b.shape} differ; use add_bias to broadcast")
    return a + b


def add_bias(x: Any, bias: Any) -> np.ndarray:
    """x + bias, ``bias`` of shape ``(x.shape[-1],)``."""
    return _f32("add_bias", "x", x) + _f32("add_bias", "bias", bias)


def softmax(x: Any, *, mask: Any = None, scale: float | None = None) -> np.ndarray:
    """Softmax along the last axis of ``x * scale + mask`` (``mask`` additive, broadcast per row group)."""
    a = _f32("softmax", "x", x)
    if a.ndim == 0:
        raise ValueError("softmax: x is 0-d (shape ()); softmax needs at least one axis")
    v = a * _F32(scale) if scale is not None else a.copy()
    if mask is not None:
        m = _f32("softmax", "mask", mask)
        if m.ndim < v.ndim:  # x.shape[:k] + (n,): one mask row per group of leading axes
            m = m.reshape(m.shape[:-1] + (1,) * (v.ndim - m.ndim) + m.shape[-1:])
        v += m
    with np.errstate(invalid="ignore", over="ignore"):
        v -= v.max(axis=-1, keepdims=True)
        np.exp(v, out=v)
        v /= v.sum(axis=-1, keepdims=True)
    return v


def layernorm(x: Any, gamma: Any, beta: Any, *, eps: float = 1e-5, residual: Any = None) -> np.ndarray:
    """(v - mean) / sqrt(var + eps) * gamma + beta over the last axis; ``v = x (+ residual)``."""
    a = _f32("layernorm", "x", x)
    v = a + _f32("layernorm", "residual", residual) if residual is not None else a.copy()
    v -= v.mean(axis=-1, keepdims=True)
    var = np.einsum("...i,...i->...", v, v)[..., None] / _F32(v.shape[-1])
    var += _F32(eps)
    v *= 1.0 / np.sqrt(var)
    v *= _f32("layernorm", "gamma", gamma)
    v += _f32("layernorm", "beta", beta)
    return v


def transpose(x: Any, axes: Sequence[int]) -> np.ndarray:
    """Permute the axes of ``x`` into a new contiguous array."""
    return np.ascontiguousarray(np.transpose(np.asarray(x), tuple(axes)))


def embedding(table: Any, ids: Any) -> np.ndarray:
    """Rows of ``table`` ``[V, H]`` picked by ``ids`` (any shape) -> ``ids.shape + (H,)``."""
    t = np.asarray(table)
    i = np.asarray(ids)
    if i.size and (int(i.min()) < 0 or int(i.max()) >= t.shape[0]):
        raise IndexError(f"embedding: ids must lie in [0, {t.shape[0]}), got values in [{int(i.min())}, "
                         f"{int(i.max())}]")
    return t[i]


def embedding_layernorm(tables: Sequence[Any], ids: Sequence[Any], gamma: Any, beta: Any, *,
                        eps: float = 1e-5) -> np.ndarray:
    """``layernorm(embedding(tables[0], ids[0]) + embedding(tables[1], ids[1]) + ...)``, summed in table order."""
    if len(tables) != len(ids) or not tables:
        raise ValueError(f"embedding_layernorm: takes tables, each with its ids; got {len(tables)} tables and "
                         f"{len(ids)} ids arrays")
    v = embedding(_f32("embedding_layernorm", "tables[0]", tables[0]), ids[0])
    for i, (t, x) in enumerate(zip(tables[1:], ids[1:]), 1):
        v = v + embedding(_f32("embedding_layernorm", f"tables[{i}]", t), x)
    return layernorm(v, gamma, beta, eps=eps)


def matmul_layernorm(a: Any, b: Any, gamma: Any, beta: Any, *, transpose_b: bool = False, bias: Any = None,
                     residual: Any = None, eps: float = 1e-5) -> np.ndarray:
    """``layernorm(a @ b + bias + residual)`` over the last axis, as :func:`hetero.ops.matmul_layernorm`."""
    return layernorm(matmul(a, b, transpose_b=transpose_b, bias=bias), gamma, beta, eps=eps, residual=residual)


def _key_bias(mask: Any, bsz: int, sk: int) -> np.ndarray:
    """Additive [B, 1, 1, Sk] bias from a [B, Sk] / [B, 1, 1, Sk] padding mask: -inf where it is 0."""
    m = np.asarray(mask)
    if m.shape not in ((bsz, sk), (bsz, 1, 1, sk)):
        raise ValueError(f"attention: mask of shape {m.shape} does not fit; a padding mask is [B, Sk] = "
                         f"{(bsz, sk)} or [B, 1, 1, Sk] = {(bsz, 1, 1, sk)}")
    return np.where(m.reshape(bsz, 1, 1, sk) != 0, _F32(0.0), _F32(-np.inf))


def _attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: Any, scale: float) -> np.ndarray:
    """q [B, H, Sq, D], k and v [B, H, Sk, D] (any strides) -> [B, H, Sq, D]."""
    # Contiguous operands: numpy hands each [S, D] product to BLAS only then.
    # One batch entry at a time: its scores stay in cache through the softmax.
    bias = _key_bias(mask, q.shape[0], k.shape[2]) if mask is not None else None
    out = np.empty(q.shape, _F32)
    for b in range(q.shape[0]):
        qb, vb = np.ascontiguousarray(q[b]), np.ascontiguousarray(v[b])
        scores = np.matmul(qb, np.ascontiguousarray(np.swapaxes(k[b], -1, -2)))
        scores *= _F32(scale)
        if bias is not None:
            scores += bias[b]
        with np.errstate(invalid="ignore"):
            scores -= scores.max(axis=-1, keepdims=True)
            np.exp(scores, out=scores)
            scores /= scores.sum(axis=-1, keepdims=True)
        np.matmul(scores, vb, out=out[b])
    return out


def attention(q: Any, k: Any, v: Any, *, mask: Any = None, scale: float | None = None,
              layout: str = "bhsd") -> np.ndarray:
    """softmax(q @ k^T * scale + mask) @ v; ``layout`` "bhsd" ([B, H, S, D]) or "bshd" ([B, S, H, D])."""
    qa, ka, va = (_f32("attention", n, t) for n, t in (("q", q), ("k", k), ("v", v)))
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"attention: layout must be 'bhsd' or 'bshd', got {layout!r}")
    for name, t in (("q", qa), ("k", ka), ("v", va)):
        if t.ndim != 4:
            raise ValueError(f"attention: {name} must be 4-D, got shape {t.shape}")
    if layout == "bshd":
        qa, ka, va = (np.swapaxes(t, 1, 2) for t in (qa, ka, va))
    sc = 1.0 / math.sqrt(qa.shape[-1]) if scale is None else float(scale)
    out = _attend(qa, ka, va, mask, sc)
    return np.ascontiguousarray(np.swapaxes(out, 1, 2) if layout == "bshd" else out)


def _summed_qkv(op: str, qkv: Any, rank: int, bias: Any) -> np.ndarray:
    """``qkv``, or a rank+1-D ``qkv``'s partial products summed along the first axis in order, plus ``bias``."""
    a = _f32(op, "qkv", qkv)
    if a.ndim == rank + 1:
        s = a[0].copy()
        for plane in a[1:]:
            s += plane
        a = s
    return a + _f32(op, "bias", bias) if bias is not None else a


def attention_packed(qkv: Any, heads: int, *, mask: Any = None, scale: float | None = None,
                     bias: Any = None) -> np.ndarray:
    """:func:`attention` over one fused Q/K/V projection: ``qkv`` [B, S, 3*H*D] (or partial products
    [P, B, S, 3*H*D], summed) plus ``bias`` -> [B, S, H*D]."""
    a = _summed_qkv("attention_packed", qkv, 3, bias)
    if a.ndim != 3 or a.shape[2] % (3 * heads):
        raise ValueError(f"attention_packed: qkv must be [B, S, 3*H*D] with H = {heads} heads, got shape {a.shape}")
    bsz, s, width = a.shape
    d = width // (3 * heads)
    parts = a.reshape(bsz, s, 3, heads, d).transpose(2, 0, 3, 1, 4)  # 3, B, H, S, D (views)
    sc = 1.0 / math.sqrt(d) if scale is None else float(scale)
    out = _attend(parts[0], parts[1], parts[2], mask, sc)  # [B, H, S, D]
    return np.ascontiguousarray(out.transpose(0, 2, 1, 3)).reshape(bsz, s, heads * d)


def check_spans(spans: np.ndarray) -> None:
    """Host ``spans`` (see :func:`attention_varlen`): each token inside its own range, the ranges in order."""
    s = spans.astype(np.int64)
    t = np.arange(len(s))
    bad = np.flatnonzero((s[:, 0] > t) | (s[:, 1] <= t) | (s[:, 1] > len(s)))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"attention_varlen: spans[{i}] = {s[i].tolist()} does not hold token {i} within the "
                         f"{len(s)} tokens; each token's range [start, end) holds the token itself")
    back = np.flatnonzero(np.diff(s[:, 0]) < 0)
    if back.size:
        i = int(back[0]) + 1
        raise ValueError(f"attention_varlen: spans[{i}] starts at {int(s[i, 0])}, before spans[{i - 1}] "
                         f"({int(s[i - 1, 0])}); the sequences must follow each other in order")


def attention_varlen(qkv: Any, heads: int, spans: Any, *, scale: float | None = None, bias: Any = None) -> np.ndarray:
    """:func:`attention_packed` over sequences packed along one token axis: ``qkv`` [T, 3*H*D]
    (or [P, T, 3*H*D]) plus ``bias``, ``spans`` [T, 2] each token's sequence ``[start, end)`` ->
    [T, H*D] (see the GPU op)."""
    a = _summed_qkv("attention_varlen", qkv, 2, bias)
    if a.ndim != 2 or a.shape[1] % (3 * heads) or a.shape[1] < 3 * heads:
        raise ValueError(f"attention_varlen: qkv must be [T, 3*H*D] with H = {heads} heads and D >= 1, "
                         f"got shape {a.shape}")
    sp = np.asarray(spans)
    if sp.shape != (a.shape[0], 2) or sp.dtype.kind not in "iu":
        raise ValueError(f"attention_varlen: spans must be integers of shape [T, 2] = {(a.shape[0], 2)}, "
                         f"got {sp.dtype.name} {sp.shape}")
    out = np.empty((a.shape[0], a.shape[1] // 3), _F32)
    if not len(a):
        return out
    check_spans(sp)
    # One packed_attention call per distinct range (a sequence, or the padding after them).
    starts = np.flatnonzero(np.r_[True, (np.diff(sp[:, 0]) != 0) | (np.diff(sp[:, 1]) != 0)])
    for t0 in starts.tolist():
        lo, hi = int(sp[t0, 0]), int(sp[t0, 1])
        out[lo:hi] = attention_packed(a[None, lo:hi], heads, scale=scale)[0]
    return out


def _reduce(op: str, x: Any, axis: int | None) -> np.ndarray:
    a = np.asarray(x)
    if axis is not None and (a.ndim != 2 or axis not in (0, 1, -1, -2)):
        raise ValueError(f"{op}: axis must be None, or 0 or 1 of a 2-D array, got axis={axis!r} for shape {a.shape}")
    if op == "sum":
        return np.asarray(a.sum(axis=axis, dtype=np.int64 if a.dtype.kind in "iu" else a.dtype))
    if op == "mean":
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.asarray(a.astype(_F32, copy=False).mean(axis=axis) if a.size else np.float32(np.nan),
                              dtype=_F32)
    if a.size == 0:
        raise ValueError(f"{op}: x is empty (shape {a.shape}); it has no {op[3:] if op.startswith('arg') else op}")
    if op in ("argmax", "argmin"):
        return np.asarray(getattr(np, op)(a, axis=axis), dtype=np.int32)
    return np.asarray(getattr(np, op)(a, axis=axis))


def sum(x: Any, axis: int | None = None) -> np.ndarray:
    """Sum of ``x`` (whole array, or along ``axis`` of a 2-D array); int32 -> int64."""
    return _reduce("sum", x, axis)


def mean(x: Any, axis: int | None = None) -> np.ndarray:
    """Arithmetic mean of ``x``; float32. Empty -> NaN."""
    return _reduce("mean", x, axis)


def max(x: Any, axis: int | None = None) -> np.ndarray:
    """Maximum of ``x``; NaN if any element is NaN. Empty raises ValueError."""
    return _reduce("max", x, axis)


def min(x: Any, axis: int | None = None) -> np.ndarray:
    """Minimum of ``x``; NaN if any element is NaN. Empty raises ValueError."""
    return _reduce("min", x, axis)


def argmax(x: Any, axis: int | None = None) -> np.ndarray:
    """Index (int32) of the first maximum of ``x`` (flattened when ``axis`` is None)."""
    return _reduce("argmax", x, axis)


def argmin(x: Any, axis: int | None = None) -> np.ndarray:
    """Index (int32) of the first minimum of ``x`` (flattened when ``axis`` is None)."""
    return _reduce("argmin", x, axis)

