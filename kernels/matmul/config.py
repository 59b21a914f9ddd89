"""Tilings of the matmul kernels: :class:`MatmulConfig`, the tuner's :data:`CANDIDATES` and :func:`default_config`.

A configuration is a code-generation parameter set (tile, K slice, register block,
buffering, K split); the float32 and int8 generators both take one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["CANDIDATES", "MatmulConfig", "PAD", "default_config"]

PAD = 4  # floats of padding per workgroup-memory row (keeps rows 16-byte aligned)


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
    fill a large GPU's compute units); on CPU adapters (lavapipe, SwiftShader) 64x64
    tiles of 8x8 blocks when the output holds at least four of them, else 32x32 tiles
    (the fastest on lavapipe: BENCHMARKS.md, "Kernel defaults on lavapipe").
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
