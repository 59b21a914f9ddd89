"""Tensor operations for GPU stages: ``hetero.ops.sum(gpu, x)`` and friends.

Each op takes the stage's ``gpu`` context first, records its GPU work into the stage
(no host round trip) and returns a new :class:`hetero.Tensor`. The kernels live in
``hetero.kernels``; this namespace gathers them under stable names.

Reductions (:mod:`hetero.kernels.reduce`): :func:`sum`, :func:`mean`, :func:`max`,
:func:`min`, :func:`argmax`, :func:`argmin` over the whole tensor (``axis=None``) or one
axis of a 2-D tensor.

Matrix products (:mod:`hetero.kernels.matmul`): :func:`matmul` (batched, transposed B,
fused bias; register-blocked tiles chosen per adapter by an autotuner whose choice is
cached on disk).

INT8 weight-quantized products (:mod:`hetero.kernels.matmul_int8`): :func:`quantize_weight`
(per-output-channel scales, four int8 per u32) and :func:`matmul_int8` (f32 activations
against int8 weights: dequantized per tile, or quantized per row and multiplied with
``dot4I8Packed``).

Neural-network kernels (:mod:`hetero.kernels.nn`): :func:`softmax` (last axis, stable,
optional additive mask), :func:`layernorm` (optionally fused with a residual add),
:func:`gelu` (erf form, optional fused bias), :func:`erf`, :func:`add`, :func:`add_bias`,
:func:`transpose`, :func:`embedding` (row gather), :func:`matmul_layernorm` (a dense layer and
"add & norm": where the product splits K, the layernorm sums its partial products),
:func:`embedding_layernorm` (BERT's embeddings: lookups summed and normalised in one
dispatch), :func:`attention` (scaled dot-product
attention with a padding mask) and :func:`attention_packed` (the same over one fused Q/K/V
projection) and :func:`attention_varlen` (that over sequences of different lengths packed
along one token axis, no padding).

CPU implementations (:mod:`hetero.kernels.cpu`): ``hetero.ops.cpu.matmul(a, b)`` and the
same names for every op above but the INT8 ones, without ``gpu``, in numpy with the GPU
kernels' numerics. A stage with both implementations pairs them:
``g.stage(x, cpu=lambda x: ops.cpu.gelu(x), gpu=lambda gpu, x: ops.gelu(gpu, x), name="gelu")``.
"""

from __future__ import annotations

from hetero.kernels import cpu
from hetero.kernels.matmul import matmul
from hetero.kernels.matmul_int8 import matmul_int8, quantize_weight
from hetero.kernels.nn import (add, add_bias, attention, attention_packed, attention_varlen, embedding,
                               embedding_layernorm, erf, gelu, layernorm, matmul_layernorm, softmax, transpose)
from hetero.kernels.reduce import argmax, argmin, max, mean, min, sum

__all__ = [
    "add",
    "add_bias",
    "argmax",
    "argmin",
    "attention",
    "attention_packed",
    "attention_varlen",
    "cpu",
    "embedding",
    "embedding_layernorm",
    "erf",
    "gelu",
    "layernorm",
    "matmul",
    "matmul_int8",
    "matmul_layernorm",
    "max",
    "mean",
    "min",
    "quantize_weight",
    "softmax",
    "sum",
    "transpose",
]
