"""The matmul op: shapes checked into a :class:`Problem`, planned into dispatches, recorded into a stage."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, cast

import numpy as np

from hetero.kernels.matmul import codegen
from hetero.kernels.matmul.cache import choose_config
from hetero.kernels.matmul.codegen import Variant
from hetero.kernels.matmul.config import MIN_SPLIT_K, MatmulConfig
from hetero.lowlevel import GPUContext, Tensor

__all__ = ["MIN_SPLIT_K", "Problem", "SPLIT_K_MAX_TILES", "Step", "cdiv", "matmul", "matmul_partials", "plan", "problem",
           "shape_spec", "split_k_parts", "split_parts"]


@dataclass(frozen=True)
class Problem:
    """One call's shapes and options, checked: what its kernels and dispatches depend on."""

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

    def variant(self, split: int = 1) -> Variant:
        """The kernel variant for this problem run with a K split into ``split`` parts."""
        k4 = self.k % 4 == 0 and self.k > 0
        vb = k4 if self.trans_b else self.n % 4 == 0
        return Variant(self.f16, k4, vb and self.k > 0, self.n % 4 == 0, self.trans_b, self.bias and split == 1,
                       split > 1, self.f16 and self.n % 2 == 1, self.act if split == 1 else "")


def _dims(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def problem(a: Any, b: Any, transpose_b: bool, bias: Any, out: Any) -> Problem:
    """Check ``matmul``'s operands (Tensors by now) and describe the product; errors name the rule broken."""
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
    return Problem(m, n, k, batch, s_a, s_b, out_shape, is16, transpose_b, bias is not None)


def _overlap(x: Tensor, y: Tensor) -> bool:
    return x.offset < y.offset + max(y.binding_size, 1) and y.offset < x.offset + max(x.binding_size, 1)


SPLIT_K_MAX_TILES = 512
"""The tuner tries K splits only for outputs of fewer tiles than this (default candidates)."""


def split_parts(p: Problem, c: MatmulConfig, cap: int) -> tuple[int, int]:
    """(parts, K per part) of ``c``'s K split for this problem; parts == 1: no split."""
    s = max(1, min(c.split_k, p.k // c.split_min))
    while s > 1 and s * p.batch * p.m * p.n * 4 > cap:  # the partials must fit one binding
        s -= 1
    if s == 1:
        return 1, max(p.k, 1)
    kc = cdiv(cdiv(p.k, s), c.bk) * c.bk  # K per part, a multiple of BK
    return cdiv(p.k, kc), kc


def cdiv(x: int, y: int) -> int:
    """``ceil(x / y)`` for positive ``y``."""
    return -(-x // y)


def _dispatches(p: Problem, c: MatmulConfig, limit: int, split: int = 1,
                kc: int = 0) -> list[tuple[tuple[int, int, int], np.ndarray]]:
    """(workgroups, uniform) per dispatch: y and z past the per-dimension limit are chunked."""
    tn, tm, zs = cdiv(p.n, c.bn), cdiv(p.m, c.bm), p.batch * split
    sc = p.m * p.n if (p.batch > 1 or split > 1) else 0
    out = []
    for y0 in range(0, tm, limit):
        for z0 in range(0, zs, limit):
            params = np.array([p.m, p.n, p.k, p.sa, p.sb, sc, y0, z0, split, kc or max(p.k, 1), p.batch, 0],
                              dtype=np.uint32)
            out.append(((tn, min(limit, tm - y0), min(limit, zs - z0)), params))
    return out


def matmul(gpu: GPUContext, a: Tensor | np.ndarray, b: Tensor | np.ndarray, *, transpose_b: bool = False,
           bias: Tensor | np.ndarray | None = None, out: Tensor | None = None,
           config: MatmulConfig | None = None, activation: str | None = None,
           small_split: bool | None = None) -> Tensor:
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
    :func:`default_config`. ``small_split=True`` asks that default, on a GPU, to split K
    for an output too small to fill it (:func:`small_output_config`): a few rows' product
    reaches the GPU's end sooner, for a second dispatch's host time (None: as
    ``HETERO_MATMUL_SMALL_SPLIT`` says; off unless it is ``1``).
    """
    p, c, a, b, bias = _setup(gpu, a, b, transpose_b, bias, out, config, small_split, activation)
    if out is None:
        out = gpu.empty(p.out_shape, a.dtype)
    if p.m == 0 or p.n == 0 or p.batch == 0:
        return out
    for kern, groups, bindings in plan(gpu, p, c, a, b, out, bias):
        gpu.dispatch(kern, groups, *bindings)
    return out


def _setup(gpu: GPUContext, a: Tensor | np.ndarray, b: Tensor | np.ndarray, transpose_b: bool,
           bias: Tensor | np.ndarray | None, out: Tensor | None, config: MatmulConfig | None,
           small_split: bool | None, activation: str | None = None
           ) -> tuple[Problem, MatmulConfig, Tensor, Tensor, Tensor | None]:
    """The checked problem, its configuration and the operands as Tensors (numpy ones uploaded)."""
    a = gpu.upload(a) if isinstance(a, np.ndarray) else a
    b = gpu.upload(b) if isinstance(b, np.ndarray) else b
    bias = gpu.upload(bias) if isinstance(bias, np.ndarray) else bias
    p = problem(a, b, transpose_b, bias, out)
    if activation is not None:
        if activation not in codegen.ACTIVATIONS:
            raise ValueError(f"matmul: activation must be None or one of {', '.join(map(repr, codegen.ACTIVATIONS))}, "
                             f"got {activation!r}")
        p = replace(p, act=activation)
    _check_bindings(gpu.limits, a, b, bias, p)
    c = _config(gpu, p, a.dtype, config, small_split)
    why = c.fits(gpu.limits)
    if why is not None:
        raise ValueError(f"matmul: config {c.name} cannot run on this device: {why}")
    return p, c, a, b, bias


def split_k_parts(gpu: GPUContext, a: Tensor | np.ndarray, b: Tensor | np.ndarray, *, transpose_b: bool = False,
                  config: MatmulConfig | None = None, small_split: bool | None = None) -> int:
    """Into how many parts :func:`matmul` splits K for these operands (1: no split); records nothing.

    Only the operands' shapes and dtypes count. A caller may use it to fuse work into the
    K split's summing pass where there is one, e.g. ``activation="gelu"``, which costs
    nothing there but slows the unsplit kernel's store.
    """
    p = problem(a if isinstance(a, Tensor) else shape_spec(a), b if isinstance(b, Tensor) else shape_spec(b),
                transpose_b, None, None)
    if p.m == 0 or p.n == 0 or p.batch == 0:
        return 1
    return split_parts(p, _config(gpu, p, a.dtype, config, small_split), _binding_cap(gpu.limits))[0]


def _config(gpu: GPUContext, p: Problem, dtype: Any, config: MatmulConfig | None,
            small_split: bool | None) -> MatmulConfig:
    """``config``, else the tuned or default configuration for ``p`` on ``gpu``."""
    return config if config is not None else choose_config(gpu, p.m, p.n, p.k, p.batch, dtype=dtype,
                                                           small_split=small_split)


def _binding_cap(limits: dict[str, int]) -> int:
    """The most bytes one storage binding may hold on this device."""
    return limits.get("max-storage-buffer-binding-size", 1 << 27)


def shape_spec(x: np.ndarray) -> Tensor:
    """A buffer-less Tensor of ``x``'s shape and dtype, for :func:`problem`'s checks of an operand not uploaded yet."""
    return Tensor(cast(Any, None), tuple(x.shape), np.dtype(x.dtype))


def matmul_partials(gpu: GPUContext, a: Tensor | np.ndarray, b: Tensor | np.ndarray, *, transpose_b: bool = False,
                    bias: Tensor | np.ndarray | None = None, config: MatmulConfig | None = None,
                    small_split: bool | None = None) -> tuple[Tensor, int]:
    """``a @ b`` (+ ``bias``) for a consumer that sums a K split itself: ``(t, parts)``, float32 only.

    ``parts == 1``: ``t`` is the product with the bias added, as :func:`matmul` returns it.
    ``parts > 1``: ``t`` is ``[parts, *result_shape]``, the products over ``parts`` ranges of
    K, without the bias; their sum plus the bias is the product. The consumer saves the
    summing pass's dispatch (see :func:`hetero.kernels.nn.matmul_layernorm`).
    """
    p, c, a, b, bias = _setup(gpu, a, b, transpose_b, bias, None, config, small_split)
    if p.f16:
        raise TypeError("matmul_partials: a and b are float16; the partial products are float32 only")
    empty = p.m == 0 or p.n == 0 or p.batch == 0
    split = 1 if empty else split_parts(p, c, _binding_cap(gpu.limits))[0]
    out = gpu.empty(p.out_shape, a.dtype) if split == 1 else None  # a split writes its own scratch
    steps = [] if empty else plan(gpu, p, c, a, b, out, bias, sum_pass=False)
    for kern, groups, bindings in steps:
        gpu.dispatch(kern, groups, *bindings)
    if out is not None:
        return out, 1
    partials = steps[0][2][2]
    return Tensor(partials.buffer, (split, *p.out_shape), partials.dtype, partials.offset, partials.block), split


Step = tuple[Any, tuple[int, int, int], tuple[Any, ...]]  # kernel, workgroups, bindings


def plan(gpu: Any, p: Problem, c: MatmulConfig, a: Tensor, b: Tensor, out: Tensor | None,
         bias: Tensor | None, *, sum_pass: bool = True) -> list[Step]:
    """The dispatches of one matmul (compiling kernels and taking scratch from ``gpu``).

    A K split's product dispatches write one scratch tensor of partials (their third
    binding), which the last step sums into ``out``; without ``sum_pass`` that step is left
    out (``out`` and ``bias`` unused) for a consumer that sums the partials itself."""
    limit = gpu.limits["max-compute-workgroups-per-dimension"]
    split, kc = split_parts(p, c, _binding_cap(gpu.limits))
    v = p.variant(split)
    kern = gpu.kernel(codegen.source(c, v), "main", label=f"matmul {c.name}" + (f" {v.act}" if v.act else ""))
    extra = (bias,) if bias is not None else ()
    if split == 1:
        return [(kern, groups, (a, b, out, params, *extra)) for groups, params in _dispatches(p, c, limit)]
    partials = gpu.empty((split * p.batch * p.m * p.n,), np.float32)
    steps: list[Step] = [(kern, groups, (a, b, partials, params))
                         for groups, params in _dispatches(p, c, limit, split, kc)]
    if not sum_pass:
        return steps
    vec = p.n % 4 == 0
    elems = p.batch * p.m * p.n
    units = elems // 4 if vec else -(-elems // 2) if p.f16 else elems
    params = np.array([units, elems // 4 if vec else elems, split, p.n, 0, 0, 0, 0], dtype=np.uint32)
    sum_kernel = gpu.kernel(codegen.sum_source(p.f16, vec, bias is not None, p.act), "main",
                            label="matmul split-k sum" + (f" {p.act}" if p.act else ""))
    steps.append((sum_kernel, (-(-units // 256), 1, 1), (partials, out, params, *extra)))
    return steps


def _check_bindings(limits: dict[str, int], a: Tensor, b: Tensor, bias: Tensor | None, p: Problem) -> None:
    cap = _binding_cap(limits)
    out_bytes = p.batch * p.m * p.n * (2 if p.f16 else 4)
    for name, nbytes in (("a", a.nbytes), ("b", b.nbytes), ("the result", out_bytes)):
        if nbytes > cap:
            raise ValueError(f"matmul: {name} is {nbytes} bytes, more than the {cap} bytes one storage binding may "
                             "hold (max-storage-buffer-binding-size); split the product")
