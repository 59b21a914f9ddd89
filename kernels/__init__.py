"""GPU kernels (WGSL) and their thin Python wrappers, shipped as ``hetero.kernels``.

One module per family:

* :mod:`hetero.kernels.reduce`, :mod:`hetero.kernels.matmul`, :mod:`hetero.kernels.matmul_int8`,
  :mod:`hetero.kernels.nn` and their numpy twins :mod:`hetero.kernels.cpu`: gathered under
  stable names in :mod:`hetero.ops`;
* :mod:`hetero.kernels.decoder` (a Llama-family decoder's ops: quantized linear layers,
  RMSNorm, RoPE, the paged KV cache and attention, sampling) and :mod:`hetero.kernels.quant`
  (the weight formats they read: F32, F16, BF16, Q8_0, Q4_0, Q4_1 blocks): re-exported here,
  so ``from hetero.kernels import linear, paged_attention, pack`` works. They are not in
  :mod:`hetero.ops`, whose ``embedding`` and ``attention`` are BERT's.

The re-exported names load on first use (PEP 562), so importing one kernel module does not
import the decoder's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hetero.kernels.decoder import (AttentionSplits, GPUWeight, QuantizedRows, add_rmsnorm, combine_attention,
                                        embedding, gather_rows, kv_cache, kv_write, linear, linear_rope_kv,
                                        linear_swiglu, paged_attention, rmsnorm, rope, rope_kv, sample,
                                        sampling_params, silu_mul, takes_quantized_rows, upload_weight)
    from hetero.kernels.quant import (BLOCK, BLOCK_BYTES, KINDS, PackedWeight, concat_rows, pack,
                                      quantize_q8_0_blocks, unpack)

_DECODER = ("AttentionSplits", "GPUWeight", "QuantizedRows", "add_rmsnorm", "combine_attention", "embedding", "gather_rows",
            "kv_cache", "kv_write", "linear", "linear_rope_kv", "linear_swiglu", "paged_attention", "rmsnorm", "rope",
            "rope_kv", "sample", "sampling_params", "silu_mul", "takes_quantized_rows", "upload_weight")
_QUANT = ("BLOCK", "BLOCK_BYTES", "KINDS", "PackedWeight", "concat_rows", "pack", "quantize_q8_0_blocks", "unpack")

__all__ = [
    "AttentionSplits",
    "BLOCK",
    "BLOCK_BYTES",
    "GPUWeight",
    "KINDS",
    "PackedWeight",
    "QuantizedRows",
    "add_rmsnorm",
    "combine_attention",
    "concat_rows",
    "embedding",
    "gather_rows",
    "kv_cache",
    "kv_write",
    "linear",
    "linear_rope_kv",
    "linear_swiglu",
    "pack",
    "paged_attention",
    "quantize_q8_0_blocks",
    "rmsnorm",
    "rope",
    "rope_kv",
    "sample",
    "sampling_params",
    "silu_mul",
    "takes_quantized_rows",
    "unpack",
    "upload_weight",
]


def __getattr__(name: str) -> Any:
    if name in _DECODER:
        from hetero.kernels import decoder

        return getattr(decoder, name)
    if name in _QUANT:
        from hetero.kernels import quant

        return getattr(quant, name)
    raise AttributeError(f"module 'hetero.kernels' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
