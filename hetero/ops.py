"""Tensor operations for GPU stages: ``hetero.ops.sum(gpu, x)`` and friends.

Each op takes the stage's ``gpu`` context first, records its GPU work into the stage
(no host round trip) and returns a new :class:`hetero.Tensor`. The kernels live in
``hetero.kernels``; this namespace gathers them under stable names.

Reductions (:mod:`hetero.kernels.reduce`): :func:`sum`, :func:`mean`, :func:`max`,
:func:`min`, :func:`argmax`, :func:`argmin` over the whole tensor (``axis=None``) or one
axis of a 2-D tensor.
"""

from __future__ import annotations

from hetero.kernels.reduce import argmax, argmin, max, mean, min, sum

__all__ = ["argmax", "argmin", "max", "mean", "min", "sum"]
