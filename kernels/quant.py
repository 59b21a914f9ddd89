"""GPU weight formats for decoder weights: GGUF blocks repacked into 4-byte-aligned arrays.

A GGUF block of 32 weights is not 4-byte aligned (Q8_0 is 34 bytes, Q4_0 18, Q4_1 20),
and WGSL storage buffers are arrays of 4-byte words. :func:`pack` splits each block
into its quantized values and its scales, so that a kernel reads the values as ``u32``
words and dequantizes them in registers:

=======  ===================================================  ============================
kind     arrays of :class:`PackedWeight` (``rows = shape[0]``)  value of weight ``[r, c]``
=======  ===================================================  ============================
f32      ``w`` float32 ``[rows, kp]``                          ``w[r, c]``
f16      ``w`` uint32 ``[rows, kp / 2]``: two f16 a word,      ``unpack2x16float``
         element ``2i`` in the low half
bf16     widened to f32 on the host (exact), kind ``"f32"``    as f32
q8_0     ``qs`` uint32 ``[rows, cols / 4]`` (the 32 int8 of a  ``d[r, c / 32] * q``
         block, 4 a word, little-endian), ``d`` float32
         ``[rows, cols / 32]``
q4_0     ``qs`` uint32 ``[rows, cols / 8]`` (the block's 16    ``d * (q - 8)``
         bytes as 4 words, unchanged), ``d`` float32
q4_1     as q4_0, plus ``m`` float32 ``[rows, cols / 32]``     ``d * q + m``
=======  ===================================================  ============================

``kp`` is ``cols`` rounded up to a multiple of 8, padded with zeros: the float kernels
read weights 8 at a time (zero padding adds nothing to a dot product). Quantized kinds
need ``cols`` to be a multiple of 32 (whole blocks). In a Q4 block, byte ``j`` holds
element ``j`` in its low nibble and element ``j + 16`` in its high nibble, so word
``i`` (bytes ``4i .. 4i + 3``) holds elements ``4i .. 4i + 3`` (low nibbles) and
``16 + 4i .. 16 + 4i + 3`` (high nibbles): kernels read two vec4s of activations for
one word. Scales are widened from f16 to float32 on the host (exact): 4 bytes instead
of 2 per block (Q4_1 reads 24 bytes a block instead of 20), kept simple for now.

:func:`unpack` returns the dequantized float32 weight (what the kernels compute with),
for tests and references; :func:`quantize_q8_0_blocks` quantizes a float weight to GGUF
Q8_0 bytes as llama.cpp does (the loader's ``weights="q8_0"``); :func:`concat_rows`
stacks weights of one kind along their rows (Q, K and V as one QKV projection, one
dispatch instead of three).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

__all__ = ["BLOCK", "BLOCK_BYTES", "KINDS", "PackedWeight", "concat_rows", "pack", "quantize_q8_0_blocks",
           "unpack"]

BLOCK = 32
"""Weights per quantization block (every GGUF kind here)."""
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}
"""Bytes of one GGUF block, by quantized kind."""
KINDS = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1")
"""Kinds :func:`pack` accepts (bf16 is widened to f32)."""
PACKED_KINDS = ("f32", "f16", "q8_0", "q4_0", "q4_1")


@dataclass(frozen=True)
class PackedWeight:
    """A weight ``[rows, cols]`` (``y = x @ W.T`` for a linear layer) in a GPU-ready layout.

    ``kind`` is one of ``f32``, ``f16``, ``q8_0``, ``q4_0``, ``q4_1`` (see the module
    docstring for the arrays). Float kinds keep their values in ``w``; quantized kinds
    in ``qs`` with scales ``d`` (and offsets ``m`` for q4_1). Arrays absent for a kind
    are None.
    """

    kind: str
    shape: tuple[int, int]
    w: np.ndarray | None = None
    qs: np.ndarray | None = None
    d: np.ndarray | None = None
    m: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.kind not in PACKED_KINDS:
            raise ValueError(f"PackedWeight: kind must be one of {', '.join(PACKED_KINDS)}, got {self.kind!r}")
        rows, cols = self.shape
        want = _layout(self.kind, rows, cols)
        for name, (dtype, shape) in want.items():
            a = getattr(self, name)
            if a is None or a.dtype != dtype or tuple(a.shape) != shape:
                got = "None" if a is None else f"{a.dtype.name} {tuple(a.shape)}"
                raise ValueError(f"PackedWeight: {self.kind} weight of shape {self.shape} needs {name} "
                                 f"{np.dtype(dtype).name} {shape}, got {got}")
        for name in ("w", "qs", "d", "m"):
            if name not in want and getattr(self, name) is not None:
                raise ValueError(f"PackedWeight: a {self.kind} weight has no {name} array")

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def cols(self) -> int:
        return self.shape[1]

    @property
    def arrays(self) -> dict[str, np.ndarray]:
        """The kind's arrays by name, in binding order (``w``, or ``qs``, ``d`` and ``m``)."""
        return {n: a for n in ("w", "qs", "d", "m") if (a := getattr(self, n)) is not None}

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


def _pad8(n: int) -> int:
    return -(-n // 8) * 8


def _layout(kind: str, rows: int, cols: int) -> dict[str, tuple[np.dtype[Any], tuple[int, ...]]]:
    """Array name -> (dtype, shape) of a packed weight of ``kind``."""
    u32: np.dtype[Any] = np.dtype(np.uint32)
    f32: np.dtype[Any] = np.dtype(np.float32)
    if kind == "f32":
        return {"w": (f32, (rows, _pad8(cols)))}
    if kind == "f16":
        return {"w": (u32, (rows, _pad8(cols) // 2))}
    nb = cols // BLOCK
    qs_cols = cols // 4 if kind == "q8_0" else cols // 8
    out: dict[str, tuple[np.dtype[Any], tuple[int, ...]]] = {"qs": (u32, (rows, qs_cols)), "d": (f32, (rows, nb))}
    if kind == "q4_1":
        out["m"] = (f32, (rows, nb))
    return out


def _shape(op: str, shape: Any) -> tuple[int, int]:
    try:
        s = tuple(int(v) for v in shape)
    except TypeError:
        raise TypeError(f"{op}: shape must be a sequence of two ints, got {shape!r}") from None
    if len(s) != 2 or min(s) < 1:
        raise ValueError(f"{op}: shape must be [rows, cols] with both >= 1, got {list(s)}")
    return s[0], s[1]


def pack(kind: str, data: np.ndarray, shape: Sequence[int]) -> PackedWeight:
    """A :class:`PackedWeight` of ``shape`` ``[rows, cols]`` from a loader's ``data``.

    ``data``: for float kinds an array of ``rows * cols`` values (``bf16`` as the uint16
    bit patterns, widened exactly to float32: the kernels have no bf16 path); for
    quantized kinds the raw GGUF block bytes, ``np.uint8`` of ``rows * (cols / 32) *
    block_bytes`` bytes (any shape, e.g. ``[rows, (cols / 32) * block_bytes]``).
    """
    rows, cols = _shape("pack", shape)
    if kind not in KINDS:
        raise ValueError(f"pack: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    a = np.asarray(data)
    if kind in ("f32", "f16", "bf16"):
        if a.size != rows * cols:
            raise ValueError(f"pack: {kind} data of shape {a.shape} ({a.size} values) does not hold a weight of "
                             f"shape [{rows}, {cols}] ({rows * cols} values)")
        if kind == "bf16":
            if a.dtype != np.uint16:
                raise TypeError(f"pack: bf16 data must be the uint16 bit patterns, got {a.dtype.name}")
            a = (a.astype(np.uint32) << 16).view(np.float32)
            kind = "f32"
        elif not np.issubdtype(a.dtype, np.floating):
            raise TypeError(f"pack: {kind} data must be floating point, got {a.dtype.name}")
        a = a.reshape(rows, cols)
        kp = _pad8(cols)
        if kind == "f32":
            w = np.zeros((rows, kp), np.float32)
            w[:, :cols] = a
            return PackedWeight("f32", (rows, cols), w=w)
        h = np.zeros((rows, kp), np.float16)
        h[:, :cols] = a
        return PackedWeight("f16", (rows, cols), w=h.view(np.uint32))
    if cols % BLOCK:
        raise ValueError(f"pack: a {kind} weight needs cols to be a multiple of {BLOCK} (whole blocks), got "
                         f"shape [{rows}, {cols}]")
    bb = BLOCK_BYTES[kind]
    nb = cols // BLOCK
    if a.dtype != np.uint8:
        raise TypeError(f"pack: {kind} data must be the raw GGUF block bytes as uint8, got {a.dtype.name}")
    if a.size != rows * nb * bb:
        raise ValueError(f"pack: {kind} data of shape {a.shape} ({a.size} bytes) does not hold a weight of shape "
                         f"[{rows}, {cols}] ({rows} rows x {nb} blocks x {bb} bytes = {rows * nb * bb} bytes)")
    blocks = np.ascontiguousarray(a.reshape(rows, nb, bb))
    d = blocks[:, :, 0:2].copy().view(np.float16)[:, :, 0].astype(np.float32)
    if kind == "q8_0":
        qs = blocks[:, :, 2:].reshape(rows, nb * 32).copy().view(np.uint32)
        return PackedWeight("q8_0", (rows, cols), qs=qs, d=d)
    if kind == "q4_0":
        qs = blocks[:, :, 2:].reshape(rows, nb * 16).copy().view(np.uint32)
        return PackedWeight("q4_0", (rows, cols), qs=qs, d=d)
    m = blocks[:, :, 2:4].copy().view(np.float16)[:, :, 0].astype(np.float32)
    qs = blocks[:, :, 4:].reshape(rows, nb * 16).copy().view(np.uint32)
    return PackedWeight("q4_1", (rows, cols), qs=qs, d=d, m=m)


def unpack(pw: PackedWeight) -> np.ndarray:
    """The dequantized weight ``[rows, cols]`` as float32: exactly the values the kernels use."""
    rows, cols = pw.shape
    if pw.kind == "f32":
        assert pw.w is not None
        return np.ascontiguousarray(pw.w[:, :cols])
    if pw.kind == "f16":
        assert pw.w is not None
        return pw.w.view(np.float16)[:, :cols].astype(np.float32)
    assert pw.qs is not None and pw.d is not None
    nb = cols // BLOCK
    b = pw.qs.view(np.uint8).reshape(rows, nb, -1)
    if pw.kind == "q8_0":
        q = b.view(np.int8).astype(np.float32)
        return (q * pw.d[:, :, None]).reshape(rows, cols)
    q = np.concatenate([b & 0xF, b >> 4], axis=2).astype(np.float32)  # element j low, j + 16 high
    if pw.kind == "q4_0":
        return ((q - 8.0) * pw.d[:, :, None]).reshape(rows, cols)
    assert pw.m is not None
    return (q * pw.d[:, :, None] + pw.m[:, :, None]).reshape(rows, cols)


def quantize_q8_0_blocks(w: np.ndarray) -> np.ndarray:
    """GGUF Q8_0 bytes (``uint8`` ``[rows, cols / 32 * 34]``) of a float weight, as llama.cpp quantizes.

    Per block of 32: ``d = amax / 127`` (stored as f16), ``q = round(w / d)`` (halves away
    from zero, as C's ``roundf``), ``q = 0`` where ``d == 0``. Equal to
    ``gguf.quants.quantize(w, GGMLQuantizationType.Q8_0)``.
    """
    a = np.asarray(w)
    if a.ndim != 2 or not np.issubdtype(a.dtype, np.floating):
        raise ValueError(f"quantize_q8_0_blocks: w must be a 2-d float array, got {a.dtype.name} {list(a.shape)}")
    rows, cols = a.shape
    if cols % BLOCK:
        raise ValueError(f"quantize_q8_0_blocks: cols must be a multiple of {BLOCK} (whole blocks), got shape "
                         f"[{rows}, {cols}]")
    if not np.all(np.isfinite(a)):
        raise ValueError("quantize_q8_0_blocks: w holds NaN or infinity; Q8_0 needs finite weights")
    x = a.astype(np.float32).reshape(rows, cols // BLOCK, BLOCK)
    d = np.abs(x).max(axis=-1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore", invalid="ignore"):
        ids = np.where(d == 0, np.float32(0), x / d)
    q = (np.sign(ids) * np.floor(np.abs(ids) + np.float32(0.5))).astype(np.int8)  # roundf: half away from 0
    out = np.empty((rows, cols // BLOCK, 34), np.uint8)
    out[:, :, 0:2] = d.astype(np.float16).view(np.uint8).reshape(rows, cols // BLOCK, 2)
    out[:, :, 2:] = q.view(np.uint8)
    return out.reshape(rows, cols // BLOCK * 34)


def concat_rows(weights: Sequence[PackedWeight]) -> PackedWeight:
    """Weights of one kind and one ``cols`` stacked along their rows (Q, K, V -> QKV)."""
    if not weights:
        raise ValueError("concat_rows: needs at least one weight")
    kinds = {w.kind for w in weights}
    cols = {w.cols for w in weights}
    if len(kinds) != 1 or len(cols) != 1:
        got = ", ".join(f"{w.kind} {list(w.shape)}" for w in weights)
        raise ValueError(f"concat_rows: weights must share their kind and cols, got {got}")
    first = weights[0]
    rows = sum(w.rows for w in weights)
    arrays = {n: np.concatenate([w.arrays[n] for w in weights], axis=0) for n in first.arrays}
    return PackedWeight(first.kind, (rows, first.cols), **arrays)

