"""Tilings of the matmul kernels: :class:`MatmulConfig`, the tuner's :data:`CANDIDATES` and :func:`default_config`.

A configuration is a code-generation parameter set (tile, K slice, register block,
buffering, K split); the float32 and int8 generators both take one.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, replace
from typing import Any

from hetero.lowlevel import check_positive_int

__all__ = ["CANDIDATES", "MIN_SPLIT_K", "MatmulConfig", "PAD", "SMALL_M_CANDIDATES", "SMALL_SPLIT_ENV",
           "SMALL_SPLIT_MAX", "SMALL_SPLIT_MIN", "SMALL_SPLIT_WORKGROUPS", "SKINNY_M", "default_config",
           "small_output_config"]

PAD = 4  # floats of padding per workgroup-memory row (keeps rows 16-byte aligned)

MIN_SPLIT_K = 256
"""A K split gives every part at least this many K unless the configuration says otherwise
(``split_min``); fewer, and for large outputs the second pass costs more than it saves."""


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
    split_min: int = MIN_SPLIT_K  # ... into parts of at least this many K (fewer parts when K is short)

    def __post_init__(self) -> None:
        for name in ("bm", "bn", "bk", "tm", "tn"):
            check_positive_int(f"matmul config: {name}", getattr(self, name), multiple_of=4,
                               rule="a positive multiple of 4")
        if self.bm % self.tm or self.bn % self.tn:
            raise ValueError(f"matmul config {self.name}: bm must be a multiple of tm and bn of tn")
        if self.tm * self.tn > 128:
            raise ValueError(f"matmul config {self.name}: tm * tn must be at most 128 accumulators per thread")
        check_positive_int("matmul config: split_k", self.split_k, maximum=64, rule="an int from 1 to 64")
        check_positive_int("matmul config: split_min", self.split_min, multiple_of=4, rule="a positive multiple of 4")
        if self.threads > 1024:
            raise ValueError(f"matmul config {self.name}: {self.threads} threads per workgroup, more than 1024")

    @property
    def threads(self) -> int:
        return (self.bm // self.tm) * (self.bn // self.tn)

    @property
    def name(self) -> str:
        return (f"{self.bm}x{self.bn}x{self.bk}/{self.tm}x{self.tn}" + ("/db" if self.double_buffer else "")
                + (f"/sk{self.split_k}" if self.split_k > 1 else "")
                + (f"/p{self.split_min}" if self.split_k > 1 and self.split_min != MIN_SPLIT_K else ""))

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
        d = asdict(self)
        if self.split_min == MIN_SPLIT_K:  # the default stays out: caches stay readable by older versions
            del d["split_min"]
        return d

    @classmethod
    def from_dict(cls, d: Any) -> MatmulConfig:
        if not isinstance(d, dict) or set(d) - {"bm", "bn", "bk", "tm", "tn", "double_buffer", "split_k", "split_min"}:
            raise ValueError(f"matmul config: not a configuration: {d!r}")
        db = d.get("double_buffer", True)
        if not isinstance(db, bool):
            raise ValueError(f"matmul config: double_buffer must be a bool, got {db!r}")
        return cls(d.get("bm"), d.get("bn"), d.get("bk"), d.get("tm"), d.get("tn"), db,  # type: ignore[arg-type]
                   d.get("split_k", 1), d.get("split_min", MIN_SPLIT_K))


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

SMALL_SPLIT_MIN = 64
"""K per part of the small-output splits (:data:`SMALL_M_CANDIDATES`, :func:`small_output_config`):
eight BK = 8 slices. Below :data:`MIN_SPLIT_K` because the summing pass over a small output is
one tiny dispatch (S x M x N floats: at most 16 x 128 x 1536 x 4 bytes = 12 MiB, read once)."""

_P = SMALL_SPLIT_MIN
SMALL_M_CANDIDATES: tuple[MatmulConfig, ...] = (
    MatmulConfig(32, 32, 8, 4, 4),                              # today's GPU default for small outputs
    MatmulConfig(32, 32, 8, 4, 4, split_k=2, split_min=_P),
    MatmulConfig(32, 32, 8, 4, 4, split_k=4, split_min=_P),
    MatmulConfig(32, 32, 8, 4, 4, split_k=8, split_min=_P),
    MatmulConfig(32, 32, 8, 4, 4, split_k=16, split_min=_P),
    MatmulConfig(32, 64, 8, 4, 4, split_k=4, split_min=_P),     # 128 threads
    MatmulConfig(32, 64, 8, 4, 4, split_k=8, split_min=_P),
    MatmulConfig(16, 64, 8, 4, 4),                              # skinny: 16 rows, 64 threads
    MatmulConfig(16, 64, 8, 4, 4, split_k=4, split_min=_P),
    MatmulConfig(16, 64, 8, 4, 4, split_k=8, split_min=_P),
    MatmulConfig(16, 64, 8, 4, 4, split_k=16, split_min=_P),
    MatmulConfig(16, 64, 16, 4, 4, split_k=8, split_min=_P),    # deeper slices: half the barriers
    MatmulConfig(16, 32, 8, 4, 4, split_k=8, split_min=_P),     # 32 threads
    MatmulConfig(8, 64, 8, 4, 4, split_k=8, split_min=_P),      # 32 threads, 8 rows
    MatmulConfig(4, 128, 8, 4, 4, split_k=8, split_min=_P),     # one row quad per workgroup (GEMV-like)
    MatmulConfig(4, 128, 8, 4, 4, split_k=16, split_min=_P),
    MatmulConfig(4, 256, 8, 4, 4, split_k=8, split_min=_P),     # 64 threads over 256 columns
)
"""Candidates for small outputs on GPUs (a few rows times a linear layer's width): small and
skinny tiles, most with a K split into parts of at least :data:`SMALL_SPLIT_MIN`. Not in
:data:`CANDIDATES` (the tuner's default set); pass them as ``tune(..., configs=)``."""

SMALL_SPLIT_WORKGROUPS = 256
"""Workgroups a small-output split aims for: about two per compute unit of a 132-SM GPU (H200),
the same few hundred that :func:`default_config`'s tile choice aims for."""
SMALL_SPLIT_MAX = 16
"""At most this many K parts (partials memory and the summing pass grow with it)."""
SKINNY_M = 16
"""Outputs of at most this many rows take 16-row tiles: a 32-row tile would compute half zeros or more."""
SMALL_SPLIT_ENV = "HETERO_MATMUL_SMALL_SPLIT"
"""Set to ``1`` to make :func:`default_config` apply :func:`small_output_config` on GPUs
wherever the caller did not say (``small_split=None``)."""

_BIG = MatmulConfig(128, 128, 8, 8, 8)
_MID = MatmulConfig(64, 64, 8, 8, 8)
_SMALL = MatmulConfig(32, 32, 8, 4, 4)
_SKINNY = MatmulConfig(16, 64, 8, 4, 4)


def _tiles(c: MatmulConfig, m: int, n: int, batch: int) -> int:
    """Workgroups of ``c``'s tiles over a ``batch`` of ``m`` x ``n`` outputs."""
    return batch * -(-m // c.bm) * -(-n // c.bn)


def small_output_config(m: int, n: int, k: int, batch: int = 1,
                        limits: dict[str, int] | None = None) -> MatmulConfig | None:
    """The proposed GPU configuration for an output of too few tiles to fill a large GPU (None: not such an output).

    When 32x32 tiles give fewer than :data:`SMALL_SPLIT_WORKGROUPS` workgroups (MiniLM's
    linear layers for a few sentences: M = 1..128 rows, N = 384..1536), the tile is
    16x64 for at most :data:`SKINNY_M` rows, else 32x32, and K is split into
    ``S = min(SMALL_SPLIT_MAX, ceil(SMALL_SPLIT_WORKGROUPS / tiles), K // SMALL_SPLIT_MIN)``
    parts. None when S < 2 (K too short to split: the default tiles stay).

    :func:`default_config` applies it when asked (``small_split=True``, e.g. through
    ``matmul(..., small_split=True)``, or ``HETERO_MATMUL_SMALL_SPLIT=1``). Its kernels are
    faster on a large GPU (``python -m bench matmul --small-m``), but its second dispatch
    costs host time: it pays in runs that wait on the GPU with the host idle (a lone
    sentence through MiniLM), not in runs whose host is the bottleneck (a busy server's
    batches); see BENCHMARKS.md, "Small outputs" and the seventh session.
    """
    def tiles(c: MatmulConfig) -> int:
        return _tiles(c, m, n, batch)

    if m <= 0 or n <= 0 or batch <= 0 or tiles(_SMALL) >= SMALL_SPLIT_WORKGROUPS:
        return None
    tile = _SKINNY if m <= SKINNY_M else _SMALL
    s = min(SMALL_SPLIT_MAX, math.ceil(SMALL_SPLIT_WORKGROUPS / tiles(tile)), k // SMALL_SPLIT_MIN)
    if s < 2:
        return None
    c = replace(tile, split_k=s, split_min=SMALL_SPLIT_MIN)
    return c if limits is None or c.fits(limits) is None else None


def default_config(adapter_type: str, m: int, n: int, batch: int = 1,
                   limits: dict[str, int] | None = None, *, k: int | None = None,
                   small_split: bool | None = None) -> MatmulConfig:
    """The configuration used when nothing was tuned: by adapter type and output size.

    On GPUs the largest tile that still gives a few hundred workgroups (enough to
    fill a large GPU's compute units); on CPU adapters (lavapipe, SwiftShader) 64x64
    tiles of 8x8 blocks when the output holds at least four of them, else 32x32 tiles
    (the fastest on lavapipe: BENCHMARKS.md, "Kernel defaults on lavapipe").

    On GPUs, given ``k`` and with ``small_split`` true (None, the default: the environment
    variable ``HETERO_MATMUL_SMALL_SPLIT=1``), outputs too small to fill the GPU take
    :func:`small_output_config` (see there for when that pays).
    """
    def tiles(c: MatmulConfig) -> int:
        return _tiles(c, m, n, batch)

    if adapter_type.upper() == "CPU":
        order = [_MID] if tiles(_MID) >= 4 else [_SMALL]
    else:
        if k is not None and tiles(_SMALL) < SMALL_SPLIT_WORKGROUPS and (
                small_split if small_split is not None else os.environ.get(SMALL_SPLIT_ENV) == "1"):
            proposed = small_output_config(m, n, k, batch, limits)
            if proposed is not None:
                return proposed
        order = [_BIG] if tiles(_BIG) >= 256 else [_MID] if tiles(_MID) >= 128 else [_SMALL]
        order += [_MID, _SMALL]
    for c in order + [_SMALL]:
        if limits is None or c.fits(limits) is None:
            return c
    return MatmulConfig(16, 16, 4, 4, 4)  # 16 threads, 1 KB: fits any WebGPU device
