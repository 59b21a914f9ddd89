"""GPU kernels of a Llama / Qwen2 decoder: quantized linear layers, RMSNorm, RoPE, paged attention, sampling.

Every op takes the stage's ``gpu`` context first, records its dispatch(es) into the stage
and returns new float32 :class:`hetero.Tensor` objects (``kv_write`` and ``rope_kv``
write into the caches given). Every check runs before anything is uploaded, allocated or
recorded; errors name the op, the shapes and the rule. Weights are
:class:`~hetero.kernels.quant.PackedWeight` records (see :mod:`hetero.kernels.quant` for
the layouts), made device-resident once with :func:`upload_weight`.

==================================  ============================================================
op                                  what (and what it fuses)
==================================  ============================================================
``upload_weight(gpu, pw)``          a PackedWeight's arrays as resident Tensors (a GPUWeight)
``linear(x, w, bias, residual,``    ``y = rmsnorm(x) @ W.T + bias + residual``: every weight kind
``norm, eps)``                      dequantized in registers; ``norm`` (the RMSNorm weight) folds
                                    the RMSNorm of x into the product, ``residual`` the residual
                                    add; GEMV for M <= 8 rows, tiled GEMM above
``linear_swiglu(x, w_gate, w_up,``  ``silu(x Wg^T) * (x Wu^T)`` in one dispatch (RMSNorm folded
``norm, eps, quantize)``            in too): the MLP's gate, up and SiLU-mul; ``quantize`` returns
                                    :class:`QuantizedRows` for a dp4a product next
``takes_quantized_rows(m, w)``      whether ``linear(x, w)`` over m rows takes QuantizedRows
``linear_rope_kv(x, w_qkv, ...)``   the QKV projection (RMSNorm, biases) with RoPE and the KV-cache
                                    write in its epilogue: one dispatch for decode rows (the lanes
                                    GEMV), ``linear`` then ``rope_kv`` otherwise
``rmsnorm(x, weight, eps)``         ``x / sqrt(mean(x^2) + eps) * weight`` over the last axis
``add_rmsnorm(x, residual, w, eps)`` ``(h, rmsnorm(h))`` with ``h = x + residual``, one dispatch
``silu_mul(gate, up)``              ``silu(gate) * up`` (when the two products are separate)
``rope(x, positions, inv_freq)``    RoPE, Hugging Face's rotate_half pairs (i, i + D/2)
``rope_kv(qkv, positions, inv_freq,`` RoPE of q and k out of the fused QKV projection, q out, and
``k_cache, v_cache, slots, ...)``   k and v written to their cache slots: one dispatch
``kv_write(k_cache, v_cache, k, v,`` rows of k and v into their cache slots
``slots)``
``kv_cache(nb, bs, kv_heads, D,``   a zeroed, resident (K, V) pair, float32 or f16 pairs
``dtype)``
``paged_attention(q, k_cache,``     causal grouped-query attention over a paged KV cache, one
``v_cache, block_tables,``          dispatch (online softmax), or split along the keys with a
``query_seq, query_pos, scale,``    combine pass (flash-decoding) when there are few queries;
``combine)``                        ``combine=False`` leaves the combine to ``linear``
``combine_attention(splits)``       the combine pass of an :class:`AttentionSplits`
``embedding(table, ids,``           rows of a (quantized) table, dequantized; ``src``/``prev``
``src, prev)``                      take some ids from a tensor an earlier ``sample`` kept
``gather_rows(x, rows)``            rows of a float32 [T, H] tensor (the last token of each
                                    sequence, before the output head)
``sample(logits, params, keep)``    a token id a row: greedy, or temperature / top-k / top-p and
                                    a seeded Gumbel-max; ``sampling_params(...)`` builds params
==================================  ============================================================

Linear layers (``linear``, ``linear_swiglu``). ``x`` is float32 ``[M, K]``, the weight
``[N, K]`` (y = x @ W.T). Weights are read as u32 words and dequantized in registers. For
M <= :data:`GEMV_MAX_M` (decode) the *lanes* GEMV: a workgroup of
:data:`GEMV_LANES_THREADS` threads is a few slots of ``lanes`` threads, and a slot computes
one output row (:data:`GEMV_SLOT_ROWS`) for all M activation rows, so a large GPU gets a
subgroup's worth of threads per few rows and thousands of them per product. Lane l takes
chunks l, l + lanes, ... of the row (a chunk: a quantization block of 32 weights, read as
16-byte vectors: one for Q4, two for Q8_0; or 8 weights of a float kind), several at once
(:data:`GEMV_UNROLL`, loads first), and dequantizes them in registers (a Q4_1 block's dot
product is ``d * sum(q x) + m * sum(x)``). Lanes are sized for about
:data:`GEMV_LANE_CHUNKS` chunks each; their partial sums meet by ``subgroupShuffleXor``
where the device has the ``subgroup`` feature (:data:`USE_SUBGROUPS`; a slot then lies in
one subgroup, so lanes are at most its smallest size) or by a workgroup-memory tree.
Rows of :data:`GEMV_UNITS_MIN_K` weights or more take the *units* GEMV instead (a workgroup
of :data:`GEMV_THREADS` per :data:`GEMV_ROWS` rows, thread t taking the 8-weight units t, t +
64, ... of each row), the faster of the two on the H200 for a decoder layer's products; the
lanes kernel keeps shorter rows and wide Q8_0 products (an output head, see
:data:`GEMV_LANES_MIN_N`; BENCHMARKS.md). :data:`GEMV_IMPL` forces one of them. For larger M
(prefill, many streams) a GEMM, :data:`TILED_IMPL`: the register-blocked kernel of
:mod:`hetero.kernels.decoder_gemm` (64 x 64 outputs a workgroup, 8 x 8 a thread in vec4
registers, the weight tile dequantized once into workgroup memory per 16 columns of K and
reused by 64 rows of x), or for large Q8_0 / Q4 weights (:data:`TILED_DP4A_MIN_WEIGHTS`) its
dp4a kernel (x quantized a block of 32 by a first pass, integer dot products), or ``"t32"``,
32 x 32 outputs a workgroup of 4 x 4 a thread; when its tiles are fewer than
:data:`TILED_MIN_GROUPS` workgroups, K is split among more (partial sums, then an epilogue pass
adds them: two dispatches). With ``norm`` the
RMSNorm of x is folded in: ``rmsnorm(x) W^T = (x * g) W^T / sqrt(mean(x^2) + eps)``, the
sum of squares accumulated beside the dot products (the GEMV's threads cover the whole row
between them; the tiled kernel's threads sum their rows), so a decoder layer needs no
separate norm dispatch.

RoPE. Hugging Face's convention (``q * cos + rotate_half(q) * sin``): pairs ``(i, i +
D/2)``, angle ``pos * inv_freq[i]`` in float32 as transformers computes it.
``inv_freq`` (float32 ``[D/2]``) comes from the host, so any scaling (llama3, linear,
NTK) is the host's business. sin and cos are computed in the kernel with a careful
argument reduction (the WGSL builtins are only specified on [-pi, pi]).

KV cache. One cache tensor per layer for K and one for V, float32 ``[num_blocks,
block_size, kv_heads, head_dim]``, or f16 pairs in uint32 ``[..., head_dim / 2]`` (half the
memory; :func:`kv_cache` makes a pair of either); a token's row goes to
flat slot ``block * block_size + offset`` (``slots``, int32). ``paged_attention`` finds
key ``j`` of sequence ``s`` at slot ``block_tables[s, j // block_size] * block_size + j
% block_size``. Slots and block-table entries are not checked on the GPU: the host
that hands them out keeps them in range.

Paged attention. Query row ``t`` (of ``q`` ``[T, heads, D]``) belongs to sequence
``query_seq[t]`` and sits at position ``query_pos[t]``; it attends to keys ``0 ..
query_pos[t]`` of its sequence (causal; a prefill chunk's keys must be in the cache
before, i.e. ``rope_kv``/``kv_write`` first). A workgroup takes one query row and one KV
head and serves the query heads sharing it (up to :data:`ATTN_MAX_HEADS` of them; a larger
group in chunks), so each key and value is read once for the group. Keys come in tiles of
64: a thread a key for the scores, then 64 / (D / 4) groups of keys whose vec4 columns of
the values the threads accumulate (constant trip counts, loads in flight together). A
workgroup's latency is its serial walk over its tiles, so with few workgroups (query rows x
KV heads x head chunks < :data:`ATTN_SPLIT_MIN_GROUPS`) the keys are split
(flash-decoding) into up to ``max_blocks * block_size / ATTN_SPLIT_KEYS`` chunks: partial
(acc, max, sum) per split, then a combine pass. Splits past a row's position end at once. With
``combine=False`` a split attention returns its partial rows (:class:`AttentionSplits`) instead,
which ``linear`` takes as x: the units GEMV combines them on load (one dispatch fewer), any other
kernel after :func:`combine_attention`.

Sampling (``sample``). A workgroup of :data:`SAMPLE_THREADS` threads a row of logits
``[S, V]``; per-row parameters (:func:`sampling_params` builds them) so rows of one batch
can differ. Temperature 0 is greedy: the argmax, ties to the lowest id (as ``numpy.argmax``).
Otherwise, as transformers' warpers in order (temperature, top-k, top-p): the top-k
threshold is the k-th largest logit, found digit by digit over the float's order-preserving
32-bit key (radix 16: 8 passes over the row, each a histogram of the tokens that share the
digits found so far; counts exact); the top-p threshold the smallest top set whose softmax
mass (at temperature T, within the top-k set) reaches ``top_p``, found the same way with
masses. Ties at a threshold keep all tied tokens. Then Gumbel-max over the survivors:
``argmax(z_i / T - log(-log(u_i)))`` with ``u_i`` from a counter-based hash of ``(seed,
step, token id)``: the same seed and step give the same token on any adapter, whatever
the row's place in the batch. NaN logits count as -inf. Only the int32 ids need to come
back to the host.

Tuning and test hooks (module attributes, read at each call): :data:`GEMV_MAX_M`,
:data:`GEMV_IMPL`, :data:`GEMV_UNITS_MIN_K`, :data:`GEMV_LANES_MIN_N`, :data:`GEMV_LANES_WIDE_KINDS`,
:data:`GEMV_UNITS_WIDE_MIN_K`,
:data:`GEMV_LANES`, :data:`GEMV_LANE_CHUNKS`, :data:`GEMV_MAX_LANES`, :data:`GEMV_LANES_THREADS`,
:data:`GEMV_SLOT_ROWS`, :data:`GEMV_UNROLL`, :data:`GEMV_THREADS`, :data:`GEMV_ROWS`, :data:`GEMV_UNITS_UNROLL`,
:data:`GEMV_WIDE_N`,
:data:`TILED_IMPL`, :data:`TILED_DP4A_MIN_WEIGHTS`, :data:`TILED_DP4A_WIDE`, :data:`TILED_F16`, :data:`TILED_MIN_GROUPS`,
:data:`TILED_SPLIT_MIN_CHUNKS`, :data:`SAMPLE_THREADS`, :data:`SAMPLE_REGS`, :data:`SAMPLE_ARGMAX_PASS`,
:data:`USE_SUBGROUPS`,
:data:`ATTN_SPLIT_KEYS`, :data:`ATTN_SPLIT_MIN_GROUPS`, :data:`ATTN_MAX_HEADS`, :data:`ATTN_PREFETCH`,
:data:`ATTN_COMBINE_IN_LINEAR`, :data:`ATTN_COMBINE_MAX_SPLITS`, :data:`SWIGLU_QUANTIZES`.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from hetero.kernels import decoder_gemm as G
from hetero.kernels import decoder_wgsl as W
from hetero.kernels.quant import PackedWeight
from hetero.lowlevel import GPUContext, Tensor

# hetero.kernels re-exports this list (its __all__ mirrors this one; a test checks both ways)
__all__ = ["AttentionSplits", "GPUWeight", "QuantizedRows", "add_rmsnorm", "combine_attention", "embedding",
           "gather_rows", "kv_cache", "kv_write", "linear", "linear_rope_kv", "linear_swiglu", "paged_attention",
           "rmsnorm", "rope", "rope_kv", "sample", "sampling_params", "silu_mul", "takes_quantized_rows",
           "upload_weight"]

# -- tuning and test hooks ---------------------------------------------------------------------
SAMPLE_THREADS = 1024
"""Threads of a sampling workgroup (one a row), at most the adapter's limit: each pass over the
row is a serial walk of V / threads tokens a thread."""
SAMPLE_ARGMAX_PASS = False
"""``sample`` first finds each chunk's largest logit with many workgroups at once
(:func:`~hetero.kernels.decoder_wgsl.argmax_chunks`), and each row's workgroup then reads those
pairs, not its row, for the largest: all a greedy row needs. A dispatch more a step, for a walk of
the vocabulary by one workgroup less (67 us a step for the 1.07B shape's 128,256 logits at batch 1
on the H200). Off by default: not yet timed on a GPU."""
SAMPLE_REGS = 16
"""Most vec4 registers a sampling thread holds the row in (V <= 4 x threads x this, and V a
multiple of 4): the row is read from memory once, the 16-20 passes walk registers."""
GEMV_MAX_M = 8
"""Most activation rows ``linear`` multiplies with the GEMV kernel; more take the tiled kernel."""
GEMV_THREADS = 64
"""Threads of a workgroup of the ``units`` GEMV (a power of two)."""
GEMV_ROWS = 4
"""Output rows a GEMV workgroup of the ``units`` kernel computes at M = 1 (fewer for larger M: registers)."""
GEMV_UNITS_UNROLL = 1
"""Units a thread of the ``units`` GEMV loads before it multiplies them, while that many are left (its
row's later units one at a time): with 2, a row of K weights waits on a memory latency per 2 x 64
x 8 weights, not per 64 x 8 (the 1.07B shape's down projection, K 8192, walks 16). Not yet timed on
a GPU: 1 (the loop as before) by default."""
GEMV_IMPLS = ("auto", "lanes", "units")
"""The values :data:`GEMV_IMPL` takes."""
GEMV_IMPL = "auto"
"""The GEMV kernel: ``"auto"`` (by the row's length, see :data:`GEMV_UNITS_MIN_K` and
:data:`GEMV_LANES_MIN_N`), ``"lanes"`` (a
few lanes a row, 16-byte weight loads, subgroup shuffles) or ``"units"`` (a workgroup of
:data:`GEMV_THREADS` per :data:`GEMV_ROWS` rows, one word a thread a row), for every product."""
GEMV_UNITS_MIN_K = 512
"""With ``GEMV_IMPL = "auto"``, products over rows of at least this many weights (K) take the units
GEMV, shorter ones the lanes GEMV (``linear_rope_kv`` is one dispatch on either). On the H200 the
units kernel took SmolLM2's layer products (K 576 and 1536) in 12% less GPU time a step than
the lanes kernel (BENCHMARKS.md, twenty-seventh session)."""
GEMV_LANES_MIN_N = 16384
"""With ``GEMV_IMPL = "auto"``, products of at least this many output rows (an output head) are
*wide*: those with weights of a kind in :data:`GEMV_LANES_WIDE_KINDS` take the lanes GEMV whatever
their K, the others the units GEMV from :data:`GEMV_UNITS_WIDE_MIN_K` weights a row."""
GEMV_LANES_WIDE_KINDS = ("q8_0",)
"""The weight kinds whose wide products stay on lanes. Measured on the H200: a Q8_0 head of 49152
rows took 7.9 us on lanes against 18.4 on units (K 576) and 32 against 592 (K 2048); the Q4_1 head
of the 1.07B shape (K 2048) 128 us a step on lanes against 77 on units."""
GEMV_UNITS_WIDE_MIN_K = 2048
"""Fewest weights a row for a wide product of another kind to take the units GEMV (the rule before
:data:`GEMV_UNITS_MIN_K` came down to 512; heads of K under 2048 in f16 or Q4 were not measured on
units)."""
GEMV_LANES = 0
"""Lanes (threads) a row of the lanes GEMV; 0 chooses (see ``_lanes_shape``)."""
GEMV_LANE_CHUNKS = 2
"""Chunks (blocks of 32 quantized weights, or 8 float weights) a lane of the lanes GEMV takes, about:
it sizes the lanes a row. Few: a short serial walk a lane, all its loads in flight at once."""
GEMV_MAX_LANES = 32
"""Most lanes a row of the lanes GEMV where its partial sums meet in workgroup memory."""
GEMV_LANES_THREADS = 64
"""Threads of a lanes-GEMV workgroup (a power of two)."""
GEMV_SLOT_ROWS = 1
"""Output rows a slot of the lanes GEMV computes at M = 1 (its lanes read the activations once for
them all); at most 8 // M."""
GEMV_UNROLL = 2
"""Chunks a lane of the lanes GEMV loads before it computes (an unrolled loop: loads in flight together)."""
TILED_IMPLS = ("auto", "t32", "blocked", "dp4a")
"""The values :data:`TILED_IMPL` takes."""
TILED_IMPL = "auto"
"""The GEMM kernel of ``linear`` past :data:`GEMV_MAX_M` rows: ``"t32"`` (32 x 32 outputs a workgroup,
4 x 4 a thread, K in chunks of 32), ``"blocked"`` (:mod:`hetero.kernels.decoder_gemm`: 64 x 64
(32 rows at M <= 32, 32 columns with SwiGLU), 8 x 8 a thread in vec4 registers, K in slices of 16),
``"dp4a"`` (Q8_0 and Q4 weights: x quantized a block of 32 as llama.cpp's Q8_1, then
``dot4I8Packed``; float weights take the blocked kernel) or ``"auto"`` (the default): dp4a for
Q8_0 and Q4 weights of at least :data:`TILED_DP4A_MIN_WEIGHTS`, blocked otherwise."""
TILED_DP4A_MIN_WEIGHTS = 1 << 21
"""With ``TILED_IMPL = "auto"``, integer-block weights of at least this many values (N x K) take the
dp4a GEMM. On the H200 it ran the 1.07B shape's products (4.2M-16.8M weights) 1.36-1.49x faster
on a 512-token prompt and 1.04-1.31x on 64 streams than the blocked kernel, and SmolLM2's
(0.3M-0.9M) 0.73-0.79x on 64 streams: its quantize pass is a dispatch more a product, which small
products do not repay (BENCHMARKS.md, twenty-seventh session)."""
TILED_DP4A_WIDE = True
"""With ``TILED_IMPL = "auto"``, wide products (at least :data:`GEMV_LANES_MIN_N` rows: output heads) take
the dp4a GEMM like the others. False keeps them on the blocked kernel, so a step of many rows rounds
its logits as a batch-1 step's float32 GEMV does: the dp4a head moved 3 of 128 argmaxes of a real
SmolLM2 prompt (BENCHMARKS.md, twenty-eighth session) and took 139 us against 197 a 64-stream step
(twenty-seventh)."""
TILED_F16 = False
"""The blocked GEMM multiplies in f16 where the device has ``shader-f16``: its tiles stored in f16, a
slice's 16 products a thread's output summed in f16 and then added in float32 (see
:func:`~hetero.kernels.decoder_gemm.linear_blocked`). Activations must fit f16's range (llama.cpp's
cuBLAS path makes the same assumption). Off by default: not yet timed on a GPU."""
SWIGLU_QUANTIZES = False
"""The decoder engine asks ``linear_swiglu`` for :class:`QuantizedRows` where the down projection
takes the dp4a GEMM (:func:`takes_quantized_rows`): where gate/up splits K, its epilogue quantizes
the SwiGLU output for down, one dispatch a layer (down's quantize pass) fewer and no float32
[M, F] written and read. Off by default: not yet timed on a GPU."""
TILED_MIN_GROUPS = 512
"""The tiled kernel splits K (partial sums, then an epilogue pass) while its output tiles are
fewer workgroups than this (prefill of a short prompt, a few dozen streams): about four of the
blocked kernel's 64-thread workgroups an H200 SM (BENCHMARKS.md, twenty-sixth session)."""
TILED_SPLIT_MIN_CHUNKS = 2
"""Fewest chunks of 32 along K a split of the tiled kernel takes."""
GEMV_WIDE_N = 16384
"""From this many output rows a GEMV workgroup computes one (there are workgroups enough; on
the H200, 40 independent dispatches of the 49152 x 576 Q8_0 output head took 5.3 us of GPU
time each with one row a workgroup, 13 us with four)."""
USE_SUBGROUPS = True
"""Reduce with subgroup operations where the device has the ``subgroup`` feature (False: for tests)."""
ATTN_SPLIT_KEYS = 64
"""Fewest keys per split of a split (flash-decoding) attention (one tile of 64: a workgroup's
latency is its serial walk over its tiles)."""
ATTN_SPLIT_MIN_GROUPS = 128
"""Split the keys while fewer workgroups (query rows x KV heads x head chunks x splits) than this
would run; past it, longer splits."""
ATTN_MAX_HEADS = 8
"""Most query heads one attention workgroup serves (a group of more is served in chunks)."""
ATTN_PREFETCH = False
"""Attention loads a tile's key row and value rows of a thread at once, its value slots read from the
block table by the thread (head_dim <= 64), instead of the values after the softmax's barriers: one
memory round trip a tile instead of two. Off by default: not yet timed on a GPU."""

ATTN_COMBINE_IN_LINEAR = False
"""The decoder engine leaves a split attention's combine to the output projection: the units GEMV
combines the partial rows on load (:class:`AttentionSplits`), one dispatch a layer fewer at every
context long enough to split. Off by default: not yet timed on a GPU."""
ATTN_COMBINE_MAX_SPLITS = 8
"""Most splits the GEMV combines on load: every workgroup of the product combines the whole rows,
so their cost grows with the splits where the combine pass's does not."""

_F32 = np.dtype(np.float32)
_I32 = np.dtype(np.int32)
_FLOAT_KINDS = ("f32", "f16")


@dataclass(frozen=True)
class GPUWeight:
    """A :class:`~hetero.kernels.quant.PackedWeight` on the device: its arrays as Tensors, in binding order."""

    kind: str
    shape: tuple[int, int]
    tensors: tuple[Tensor, ...]

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def cols(self) -> int:
        return self.shape[1]


def upload_weight(gpu: GPUContext, pw: PackedWeight) -> GPUWeight:
    """``pw``'s arrays as resident Tensors (``gpu.resident``): upload once, keep, pass to the ops."""
    if not isinstance(pw, PackedWeight):
        raise TypeError(f"upload_weight: expected a PackedWeight, got {type(pw).__name__}")
    for name, a in pw.arrays.items():
        _fits(gpu, "upload_weight", f"the weight's {name}", a.shape, a.dtype.itemsize)
    return GPUWeight(pw.kind, pw.shape, tuple(gpu.resident(a) for a in pw.arrays.values()))


# -- helpers ------------------------------------------------------------------------------------
def _kind(op: str, name: str, x: Any) -> None:
    if not isinstance(x, (Tensor, np.ndarray)):
        raise TypeError(f"{op}: {name} must be a hetero.Tensor (or a numpy array), got {type(x).__name__}")


def _arr(op: str, name: str, x: Any, dtype: np.dtype[Any], ndim: int | None = None) -> tuple[int, ...]:
    """Check that ``x`` is a Tensor or array of ``dtype`` (and rank ``ndim``); its shape."""
    _kind(op, name, x)
    shape = tuple(int(s) for s in x.shape)
    if np.dtype(x.dtype) != dtype:
        raise TypeError(f"{op}: {name} must be {dtype.name}, got {np.dtype(x.dtype).name} (shape {shape}); "
                        f"cast with .astype(np.{dtype.name})")
    if ndim is not None and len(shape) != ndim:
        raise ValueError(f"{op}: {name} must have {ndim} axes, got shape {shape}")
    return shape


def _dev(gpu: GPUContext, x: Any) -> Tensor:
    if isinstance(x, np.ndarray):
        return gpu.upload(np.ascontiguousarray(x))
    return x


def _fits(gpu: GPUContext, op: str, what: str, shape: Sequence[int], itemsize: int = 4) -> None:
    limit = int(gpu.limits["max-storage-buffer-binding-size"])
    nbytes = math.prod(int(s) for s in shape) * itemsize
    if nbytes > limit:
        raise ValueError(f"{op}: {what} of shape {tuple(shape)} is {nbytes} bytes, more than the adapter's "
                         f"max-storage-buffer-binding-size of {limit} bytes; split the work into smaller tensors")


def _groups(n: int, per: int) -> int:
    return -(-n // per)


def _eps(op: str, eps: Any) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float, np.floating, np.integer)) \
            or not (math.isfinite(float(eps)) and float(eps) >= 0.0):
        raise ValueError(f"{op}: eps must be a finite number >= 0, got {eps!r}")
    return float(eps)


def _subgroups(gpu: GPUContext) -> int:
    """The device's smallest subgroup size where the subgroup path is taken, else 0.

    It sizes the workgroup memory that the subgroups' partial results meet in; an
    adapter that does not say (wgpu-py 0.32 spells the key ``stackgroup_min_size``) is
    taken to have subgroups of 1.
    """
    if not (USE_SUBGROUPS and "subgroup" in gpu.features):
        return 0
    info = getattr(gpu.device, "adapter_info", None) or {}
    size = info.get("subgroup_min_size", info.get("stackgroup_min_size", 1)) if hasattr(info, "get") else 1
    try:
        return max(1, int(size))
    except (TypeError, ValueError):
        return 1


def _weight(op: str, name: str, w: Any) -> tuple[str, tuple[int, int]]:
    if not isinstance(w, (PackedWeight, GPUWeight)):
        raise TypeError(f"{op}: {name} must be a PackedWeight or a GPUWeight (upload_weight), got "
                        f"{type(w).__name__}")
    return w.kind, (int(w.shape[0]), int(w.shape[1]))


def _weight_tensors(gpu: GPUContext, w: PackedWeight | GPUWeight) -> list[Tensor]:
    if isinstance(w, GPUWeight):
        return list(w.tensors)
    return [gpu.upload(a) for a in w.arrays.values()]


def _units(kind: str, cols: int) -> tuple[int, int]:
    """(units of 8 weights, blocks of 32) in a row of ``cols`` weights of ``kind``."""
    if kind in _FLOAT_KINDS:
        return -(-cols // 8), 0
    return cols // 8, cols // 32


# -- linear layers ------------------------------------------------------------------------------
def _linear_checks(op: str, gpu: GPUContext, x: Any, weights: list[tuple[str, Any]], bias: Any, residual: Any,
                   norm: Any, eps: Any) -> tuple[int, int, int, str]:
    if isinstance(x, AttentionSplits) and op != "linear":
        raise TypeError(f"{op}: x is a split attention's partial results (AttentionSplits), which only linear "
                        "combines on load; pass combine_attention(gpu, x)")
    if isinstance(x, AttentionSplits):
        _splits_check(op, x)
    if isinstance(x, QuantizedRows) and op != "linear":
        raise TypeError(f"{op}: x is quantized rows (QuantizedRows), which only linear's dp4a GEMM takes")
    xs = x.shape if isinstance(x, (AttentionSplits, QuantizedRows)) else _arr(op, "x", x, _F32)
    if len(xs) < 2:
        raise ValueError(f"{op}: x must be [M, K] (or [M, ...] with the trailing axes making K), got shape {xs}")
    m, k = xs[0], math.prod(xs[1:])  # [T, heads, D] (attention's output) is [T, heads * D]
    kinds = []
    n = 0
    for name, w in weights:
        kind, (wn, wk) = _weight(op, name, w)
        if wk != k:
            raise ValueError(f"{op}: x of shape {list(xs)} and {name} of shape [{wn}, {wk}] do not chain; "
                             f"y = x @ W.T needs x's last axis ({k}) equal to W's cols ({wk})")
        kinds.append((name, kind, wn))
        n = wn
    if len({kd for _, kd, _ in kinds}) != 1 or len({r for _, _, r in kinds}) != 1:
        got = ", ".join(f"{nm} {kd} rows {r}" for nm, kd, r in kinds)
        raise ValueError(f"{op}: the weights must share their kind and shape, got {got}")
    if bias is not None:
        bs = _arr(op, "bias", bias, _F32)
        if bs != (n,):
            raise ValueError(f"{op}: bias of shape {bs} does not match the {n} output features; it must be ({n},)")
    if residual is not None:
        rs = _arr(op, "residual", residual, _F32)
        if rs != (m, n):
            raise ValueError(f"{op}: residual of shape {rs} differs from the result's shape ({m}, {n})")
    if norm is not None:
        gs = _arr(op, "norm", norm, _F32)
        if gs != (k,):
            raise ValueError(f"{op}: norm (the RMSNorm weight) of shape {gs} does not match x's last axis of "
                             f"{k}; it must be ({k},)")
        _eps(op, eps)
    _fits(gpu, op, "x", xs)
    _fits(gpu, op, "the result", (m, n))
    return m, k, n, kinds[0][1]


def _lanes_shape(chunks: int, sg: int) -> tuple[int, int, int]:
    """(lanes a row, threads a workgroup, rows a slot) of the lanes GEMV over rows of ``chunks`` chunks.

    Lanes: enough for about :data:`GEMV_LANE_CHUNKS` chunks a lane (a power of two), at most
    the smallest subgroup size ``sg`` where the subgroup path is taken (a slot lies within one
    subgroup), else :data:`GEMV_MAX_LANES`; :data:`GEMV_LANES` overrides.
    """
    threads = int(GEMV_LANES_THREADS)
    if threads < 1 or threads & (threads - 1):
        raise ValueError(f"GEMV_LANES_THREADS must be a power of two, got {threads}")
    cap = min(threads, sg if sg else int(GEMV_MAX_LANES))
    want = int(GEMV_LANES) or _groups(chunks, max(1, int(GEMV_LANE_CHUNKS)))
    lanes = 1
    while lanes < want and lanes * 2 <= cap:
        lanes *= 2
    return lanes, threads, max(1, int(GEMV_SLOT_ROWS))


def _gemv_impl(op: str, k: int, n: int, kind: str) -> str:
    """The GEMV kernel (``"lanes"`` or ``"units"``) for ``n`` rows of ``k`` weights of ``kind``, by
    :data:`GEMV_IMPL`."""
    if GEMV_IMPL == "auto":
        if n >= GEMV_LANES_MIN_N:  # a wide product: an output head
            return "units" if kind not in GEMV_LANES_WIDE_KINDS and k >= GEMV_UNITS_WIDE_MIN_K else "lanes"
        return "units" if k >= GEMV_UNITS_MIN_K else "lanes"
    if GEMV_IMPL not in GEMV_IMPLS:
        raise ValueError(f"{op}: GEMV_IMPL must be 'auto', 'lanes' or 'units', got {GEMV_IMPL!r}")
    return str(GEMV_IMPL)


def _tiled_impl(op: str, kind: str, n: int, k: int) -> str:
    """The GEMM kernel (``"t32"``, ``"blocked"`` or ``"dp4a"``) for an [n, k] weight of ``kind``, by
    :data:`TILED_IMPL`."""
    if TILED_IMPL not in TILED_IMPLS:
        raise ValueError(f"{op}: TILED_IMPL must be one of {', '.join(map(repr, TILED_IMPLS))}, got {TILED_IMPL!r}")
    if TILED_IMPL == "auto":
        wide_ok = TILED_DP4A_WIDE or n < GEMV_LANES_MIN_N
        return "dp4a" if kind in G.DP4A_KINDS and n * k >= TILED_DP4A_MIN_WEIGHTS and wide_ok else "blocked"
    return str(TILED_IMPL)


@dataclass(frozen=True)
class _Rope:
    """linear_rope_kv's RoPE and KV write, for a split-K product's epilogue to do: what it reads and
    writes."""

    positions: Tensor
    inv_freq: Tensor
    slots: Tensor
    k_cache: Tensor
    v_cache: Tensor
    heads: int
    hkv: int
    d: int


def _linear_run(op: str, gpu: GPUContext, x: Any, ws: list[PackedWeight | GPUWeight], m: int, k: int, n: int,
                kind: str, bias: Any, residual: Any, norm: Any, eps: float, path: str) -> Tensor:
    """The product ``linear`` and ``linear_swiglu`` record: y [M, N]."""
    y = _linear_product(op, gpu, x, ws, m, k, n, kind, bias, residual, norm, eps, path)[0]
    assert isinstance(y, Tensor)  # quantized output is asked for only by linear_swiglu
    return y


def _linear_product(op: str, gpu: GPUContext, x: Any, ws: list[PackedWeight | GPUWeight], m: int, k: int, n: int,
                    kind: str, bias: Any, residual: Any, norm: Any, eps: float, path: str,
                    rope: _Rope | None = None, quantize: bool = False) -> tuple[Tensor | QuantizedRows, bool]:
    """(y [M, N], False); with ``rope``, (q [M, heads, D], True) where a split-K epilogue did the RoPE
    and the KV write (``linear_rope_kv``'s product past GEMV_MAX_M rows); with ``quantize`` (SwiGLU),
    y as QuantizedRows where a split-K epilogue quantized it, else the float32 y (the caller
    quantizes it)."""
    swiglu = len(ws) == 2
    if m == 0:
        return gpu.empty((m, n), np.float32), False
    units, blocks = _units(kind, k)
    vec = k % 8 == 0
    if path not in ("auto", "gemv", "tiled"):
        raise ValueError(f"{op}: path must be 'auto', 'gemv' or 'tiled', got {path!r}")
    if isinstance(x, QuantizedRows):
        if norm is not None or not takes_quantized_rows(m, ws[0], path):
            raise ValueError(f"{op}: x is quantized rows, which only the dp4a GEMM takes (Q8_0 or Q4 weights, "
                             f"past GEMV_MAX_M={GEMV_MAX_M} rows, TILED_IMPL choosing dp4a, no norm: the rows are "
                             f"final); got {m} rows of a {kind} weight [{n}, {k}]{' and a norm' if norm is not None else ''}"
                             "; check takes_quantized_rows first")
        ends = [_dev(gpu, t) for t in (bias, residual) if t is not None]
        tag = "".join(t for t, f in zip((".bias", ".res"), (bias is not None, residual is not None)) if f)
        return _linear_dp4a(op, gpu, x.xq, _weight_tensors(gpu, ws[0]), None, m, k, n, kind, eps, ends,
                            (False, bias is not None, residual is not None), tag + ".q8in", pre=x)
    gemv = path == "gemv" or (path == "auto" and m <= GEMV_MAX_M)
    impl = _gemv_impl(op, k, n, kind) if gemv else None
    comb = None  # (heads, D, splits) where the units GEMV combines a split attention on load
    if isinstance(x, AttentionSplits):
        if impl == "units" and _combines_on_load(gpu, x, min(m, GEMV_MAX_M), vec):
            comb = (x.shape[1], x.shape[2], x.splits)
            x = x.part
        else:
            x = combine_attention(gpu, x)
    xt = _dev(gpu, x)
    inputs: list[Any] = [xt]  # x, the weights' arrays, the norm weight: what the products read
    for w in ws:
        inputs += _weight_tensors(gpu, w)
    if norm is not None:
        inputs.append(_dev(gpu, norm))
    extras: list[Any] = []  # what the epilogue reads
    if bias is not None:
        extras.append(_dev(gpu, bias))
    if residual is not None:
        extras.append(_dev(gpu, residual))
    flags = (swiglu, norm is not None, bias is not None, residual is not None)
    tag = "".join(t for t, f in zip((".swiglu", ".norm", ".bias", ".res"), flags) if f)
    if impl == "lanes":
        sg = _subgroups(gpu)
        chunks = blocks if kind not in _FLOAT_KINDS else units
        lanes, threads, slot_rows = _lanes_shape(chunks, sg)
        unroll = max(1, int(GEMV_UNROLL))
        out = gpu.empty((m, n), np.float32)
        for m0 in range(0, m, GEMV_MAX_M):
            mr = min(GEMV_MAX_M, m - m0)
            rows = max(1, min(slot_rows, 8 // mr))
            src = W.linear_gemv_lanes(kind, mr, rows, lanes, threads, unroll, vec, swiglu, norm is not None,
                                      bias is not None, residual is not None, bool(sg))
            kern = gpu.kernel(src, "main", label=f"decoder.linear.lanes.{kind}.m{mr}.r{rows}.l{lanes}.t{threads}"
                              f".u{unroll}{tag}{'.sg' if sg else ''}")
            params = struct.pack("<5If2I", m, n, k, units, blocks, eps, m0, 0)
            gpu.dispatch(kern, _groups(n, threads // lanes * rows), *inputs, *extras, out, params)
        return out, False
    if gemv:
        sg = _subgroups(gpu)
        # GEMV_MAX_M rows of x at a time (registers); the params say which
        out = gpu.empty((m, n), np.float32)
        for m0 in range(0, m, GEMV_MAX_M):
            mr = min(GEMV_MAX_M, m - m0)
            rows = 1 if n >= GEMV_WIDE_N else max(1, min(GEMV_ROWS, 8 // mr))
            unroll = max(1, int(GEMV_UNITS_UNROLL))
            src = W.linear_gemv(kind, mr, rows, GEMV_THREADS, vec, swiglu, norm is not None, bias is not None,
                                residual is not None, sg, unroll=unroll, combine=comb)
            kern = gpu.kernel(src, "main", label=f"decoder.linear.gemv.{kind}.m{mr}.r{rows}{tag}"
                              f"{f'.comb{comb[2]}' if comb else ''}"
                              f"{f'.u{unroll}' if unroll > 1 else ''}{f'.sg{sg}' if sg else ''}")
            params = struct.pack("<5If2I", m, n, k, units, blocks, eps, m0, 0)
            gpu.dispatch(kern, _groups(n, rows), *inputs, *extras, out, params)
        return out, False
    impl = _tiled_impl(op, kind, n, k)
    if impl == "dp4a":
        if kind in G.DP4A_KINDS:
            g = inputs[-1] if norm is not None else None
            return _linear_dp4a(op, gpu, inputs[0], inputs[1:-1] if g is not None else inputs[1:], g, m, k, n, kind,
                                eps, extras, (swiglu, bias is not None, residual is not None), tag, rope,
                                quantize=quantize)
        impl = "blocked"  # float weights: no integer blocks to multiply
    shape = G.blocking(m, swiglu) if impl == "blocked" else G.Blocking(32, 32, 4, 4)
    half = impl == "blocked" and bool(TILED_F16) and "shader-f16" in gpu.features

    def source(bias: bool, residual: bool, partial: bool) -> str:
        if impl == "blocked":
            return G.linear_blocked(kind, vec, swiglu, norm is not None, bias, residual, partial, shape, half)
        return W.linear_tiled(kind, vec, swiglu, norm is not None, bias, residual, partial=partial)
    label = (f"decoder.linear.tiled.{kind}.{impl}"
             + (f".{shape.bm}x{shape.bn}.t{shape.tm}x{shape.tn}" if impl == "blocked" else "")
             + (".f16math" if half else "") + tag)
    splits, ks = _splits(m, n, units, shape)
    params = struct.pack("<5If2I", m, n, k, units, blocks, eps, 0, ks)
    grid = (_groups(n, shape.bn), _groups(m, shape.bm), splits)
    if splits == 1:
        out = gpu.empty((m, n), np.float32)
        kern = gpu.kernel(source(bias is not None, residual is not None, False), "main", label=label)
        gpu.dispatch(kern, grid, *inputs, *extras, out, params)
        return out, False
    _fits(gpu, op, "the split-K partial sums", (splits, len(ws), m, n))
    part = gpu.empty((splits, len(ws), m, n), np.float32)
    pss = [gpu.empty((splits, m), np.float32)] if norm is not None else []
    kern = gpu.kernel(source(False, False, True), "main", label=f"{label}.splitk")
    gpu.dispatch(kern, grid, *inputs, part, *pss, params)
    if rope is not None:
        return _split_rope_epilogue(gpu, op, rope, part, pss, extras, m, n, k, eps, splits, tag), True
    if quantize and swiglu:
        return _swiglu_quantized_epilogue(gpu, op, part, pss, m, n, k, eps, splits, tag), False
    epi = gpu.kernel(W.linear_epilogue(swiglu, norm is not None, bias is not None, residual is not None), "main",
                     label=f"decoder.linear.epilogue{tag}")
    out = gpu.empty((m, n), np.float32)
    gpu.dispatch(epi, _groups(m * n, 64), part, *pss, *extras, out,
                 struct.pack("<5If2I", m, n, k, units, blocks, eps, 0, splits))
    return out, False


_GEMV_OWN_BYTES = 4096
"""Workgroup memory the units GEMV takes for its reductions, at most (its partial sums meet there)."""


def _combines_on_load(gpu: GPUContext, x: AttentionSplits, mrows: int, vec: bool) -> bool:
    """Whether the units GEMV over ``mrows`` rows combines ``x`` on load: rows of a multiple of 8,
    at most :data:`ATTN_COMBINE_MAX_SPLITS` splits, and the combined rows in workgroup memory."""
    _, hq, d = x.shape
    limit = int(gpu.limits["max-compute-workgroup-storage-size"])
    return (vec and x.splits <= ATTN_COMBINE_MAX_SPLITS
            and W.combine_bytes(mrows, hq, d, x.splits) + _GEMV_OWN_BYTES <= limit)


def _split_rope_epilogue(gpu: GPUContext, op: str, rope: _Rope, part: Tensor, pss: list[Tensor], extras: list[Any],
                   m: int, n: int, k: int, eps: float, splits: int, tag: str) -> Tensor:
    """The split-K epilogue of linear_rope_kv's product: the splits added, RoPE, q out (returned)
    and k, v to their cache slots; one dispatch instead of an epilogue and a rope_kv."""
    _fits(gpu, op, "q", (m, rope.heads, rope.d))
    q = gpu.empty((m, rope.heads, rope.d), np.float32)
    cache = "f16" if rope.k_cache.dtype == _U32 else "f32"
    epi = gpu.kernel(W.linear_epilogue_rope(bool(pss), bool(extras), cache), "main",
                     label=f"decoder.linear.epilogue.rope{tag}.{cache}")
    quads = (rope.heads + 2 * rope.hkv) * rope.d // 4
    gpu.dispatch(epi, _groups(m * quads, 64), part, *pss, *extras, rope.positions, rope.inv_freq, rope.slots, q,
                 rope.k_cache, rope.v_cache,
                 struct.pack("<5If6I", m, n, k, 0, 0, float(eps), 0, splits, rope.d, rope.heads, rope.hkv, 0))
    return q


def _swiglu_quantized_epilogue(gpu: GPUContext, op: str, part: Tensor, pss: list[Tensor], m: int, n: int, k: int,
                               eps: float, splits: int, tag: str) -> QuantizedRows:
    """A split-K SwiGLU product's epilogue that writes its output quantized for the next product
    (:func:`~hetero.kernels.decoder_gemm.swiglu_epilogue_quantized`): one dispatch where the epilogue
    and the next product's quantize pass were two, and no float32 [M, N] written."""
    blocks = n // 32
    xq, xd, xs = _quantized_buffers(gpu, op, m, blocks)
    epi = gpu.kernel(G.swiglu_epilogue_quantized(bool(pss)), "main", label=f"decoder.linear.epilogue{tag}.q8out")
    gpu.dispatch(epi, (_groups(blocks, G.QUANT_BLOCKS), m), part, *pss, xq, xd, xs,
                 struct.pack("<5If2I", m, n, k, 0, blocks, float(eps), 0, splits))
    return QuantizedRows(xq, xd, xs, (m, n))


def _splits(m: int, n: int, units: int, shape: G.Blocking) -> tuple[int, int]:
    """(splits of K, units a split) for a GEMM of ``shape`` tiles: K splits while the output tiles
    alone are fewer than TILED_MIN_GROUPS workgroups (a workgroup's latency is its serial walk
    over K), each split at least TILED_SPLIT_MIN_CHUNKS chunks of 32."""
    tiles = _groups(n, shape.bn) * _groups(m, shape.bm)
    chunks = _groups(units, 4)
    splits = min(_groups(TILED_MIN_GROUPS, tiles), max(1, chunks // TILED_SPLIT_MIN_CHUNKS))
    ks = _groups(chunks, splits) * 4  # units of K a split takes
    return _groups(units, ks), ks


def _linear_dp4a(op: str, gpu: GPUContext, xt: Tensor, weights: list[Tensor], g: Tensor | None, m: int, k: int,
                 n: int, kind: str, eps: float, extras: list[Any], flags: tuple[bool, bool, bool], tag: str,
                 rope: _Rope | None = None, pre: QuantizedRows | None = None,
                 quantize: bool = False) -> tuple[Tensor | QuantizedRows, bool]:
    """The dp4a GEMM (:mod:`hetero.kernels.decoder_gemm`): x quantized a block of 32 (the RMSNorm,
    weight ``g``, folded in there; ``pre``: x came quantized), then integer dot products against the
    weight's blocks; the result as :func:`_linear_product` returns it.
    ``weights``: the weights' tensors in binding order; ``flags``: (SwiGLU, bias, residual)."""
    swiglu, bias, residual = flags
    nw = 2 if swiglu else 1
    units, blocks = _units(kind, k)
    if pre is not None:
        xq, xd, xs = pre.xq, pre.xd, pre.xs
    else:
        xq, xd, xs = _quantized_buffers(gpu, op, m, blocks)
        params = struct.pack("<5If2I", m, n, k, units, blocks, eps, 0, 0)
        quant = gpu.kernel(G.quantize_rows(g is not None), "main",
                           label=f"decoder.linear.quantize{'.norm' if g is not None else ''}")
        gpu.dispatch(quant, (_groups(blocks, G.QUANT_BLOCKS), m), xt, *([g] if g is not None else []), xq, xd, xs,
                     params)
    shape = G.dp4a_blocking(m, swiglu)
    nb = G.dp4a_slice_blocks(shape, kind, swiglu, int(gpu.limits["max-compute-workgroup-storage-size"]))
    splits, ks = _splits(m, n, units, shape)
    grid = (_groups(n, shape.bn), _groups(m, shape.bm), splits)
    label = f"decoder.linear.tiled.{kind}.dp4a.{shape.bm}x{shape.bn}.t{shape.tm}x{shape.tn}.s{nb}{tag}"
    params = struct.pack("<5If2I", m, n, k, units, blocks, eps, 0, ks)
    if splits == 1:
        out = gpu.empty((m, n), np.float32)
        kern = gpu.kernel(G.linear_dp4a(kind, swiglu, bias, residual, False, shape, nb), "main", label=label)
        gpu.dispatch(kern, grid, xq, xd, xs, *weights, *extras, out, params)
        return out, False
    _fits(gpu, op, "the split-K partial sums", (splits, nw, m, n))
    part = gpu.empty((splits, nw, m, n), np.float32)
    kern = gpu.kernel(G.linear_dp4a(kind, swiglu, False, False, True, shape, nb), "main", label=f"{label}.splitk")
    gpu.dispatch(kern, grid, xq, xd, xs, *weights, part, params)
    etag = "".join(t for t, f in zip((".swiglu", ".bias", ".res"), flags) if f)  # the norm was the quantize pass's
    if rope is not None:
        return _split_rope_epilogue(gpu, op, rope, part, [], extras, m, n, k, eps, splits, etag), True
    if quantize and swiglu:
        return _swiglu_quantized_epilogue(gpu, op, part, [], m, n, k, eps, splits, etag), False
    epi = gpu.kernel(W.linear_epilogue(swiglu, False, bias, residual), "main", label=f"decoder.linear.epilogue{etag}")
    out = gpu.empty((m, n), np.float32)
    gpu.dispatch(epi, _groups(m * n, 64), part, *extras, out,
                 struct.pack("<5If2I", m, n, k, units, blocks, eps, 0, splits))
    return out, False


def linear(gpu: GPUContext, x: Tensor | np.ndarray | AttentionSplits | QuantizedRows, w: PackedWeight | GPUWeight, *,
           bias: Tensor | np.ndarray | None = None, residual: Tensor | np.ndarray | None = None,
           norm: Tensor | np.ndarray | None = None, eps: float = 1e-6, path: str = "auto") -> Tensor:
    """``y = x' @ W.T + bias + residual`` for x float32 [M, K] and a weight [N, K] of any kind -> [M, N].

    ``x'`` is ``x``, or with ``norm`` (the RMSNorm weight, float32 [K]) ``rmsnorm(x, norm,
    eps)``, folded into the product. ``x`` may have more axes, [M, ...], the trailing ones
    making K: attention's [T, heads, D] output feeds the output projection as it is.
    ``residual`` ([M, N]) is added in the epilogue (the attention output projection and the
    MLP's down projection add the residual stream).
    ``path``: "gemv" (the decode kernel; M <= :data:`GEMV_MAX_M` rows at a time), "tiled"
    (the GEMM kernel) or "auto" (GEMV for M <= :data:`GEMV_MAX_M`). The output head is
    ``linear(h, embedding_weight, norm=final_norm)`` for a tied embedding. ``x`` may be the
    :class:`AttentionSplits` of a split attention (the output projection): the units GEMV combines
    them as it loads them, where its workgroup memory holds the combined rows (see
    :data:`ATTN_COMBINE_MAX_SPLITS`); any other path runs :func:`combine_attention` first. ``x``
    may also be :class:`QuantizedRows` where the product runs the dp4a GEMM
    (:func:`takes_quantized_rows`): its quantize pass is then not run.
    """
    m, k, n, kind = _linear_checks("linear", gpu, x, [("w", w)], bias, residual, norm, eps)
    return _linear_run("linear", gpu, x, [w], m, k, n, kind, bias, residual, norm, float(eps), path)


def linear_swiglu(gpu: GPUContext, x: Tensor | np.ndarray, w_gate: PackedWeight | GPUWeight,
                  w_up: PackedWeight | GPUWeight, *, norm: Tensor | np.ndarray | None = None, eps: float = 1e-6,
                  path: str = "auto", quantize: bool = False) -> Tensor | QuantizedRows:
    """``silu(x' Wg^T) * (x' Wu^T)`` -> [M, F]: the MLP's gate and up projections and SwiGLU, one dispatch.

    ``x'`` as in :func:`linear` (``norm`` folds the post-attention RMSNorm in). Both
    weights [F, K] of one kind. ``quantize``: the result as :class:`QuantizedRows` for a next
    product that runs the dp4a GEMM (:func:`takes_quantized_rows`; F a multiple of 32). Where K is
    split, the epilogue that adds the splits quantizes them too (one dispatch, no float32 [M, F]);
    otherwise the quantize pass runs on the float32 result.
    """
    op = "linear_swiglu"
    m, k, n, kind = _linear_checks(op, gpu, x, [("w_gate", w_gate), ("w_up", w_up)], None, None, norm, eps)
    if not isinstance(quantize, (bool, np.bool_)):
        raise ValueError(f"{op}: quantize must be True or False, got {quantize!r}")
    if quantize and n % 32:
        raise ValueError(f"{op}: quantize needs rows of a multiple of 32 values (blocks of 32), got {n}")
    y = _linear_product(op, gpu, x, [w_gate, w_up], m, k, n, kind, None, None, norm, float(eps), path,
                        quantize=bool(quantize))[0]
    return _quantize(gpu, op, y) if quantize and isinstance(y, Tensor) else y


def silu_mul(gpu: GPUContext, gate: Tensor | np.ndarray, up: Tensor | np.ndarray) -> Tensor:
    """``silu(gate) * up`` elementwise for two float32 tensors of one shape (SwiGLU's activation)."""
    gs = _arr("silu_mul", "gate", gate, _F32)
    us = _arr("silu_mul", "up", up, _F32)
    if gs != us:
        raise ValueError(f"silu_mul: gate of shape {gs} and up of shape {us} differ; they must be equal")
    _fits(gpu, "silu_mul", "gate", gs)
    out = gpu.empty(gs, np.float32)
    total = math.prod(gs)
    if total == 0:
        return out
    kern = gpu.kernel(_SILU_MUL, "main", label="decoder.silu_mul")
    gpu.dispatch(kern, _groups(total, 256), _dev(gpu, gate), _dev(gpu, up), out, struct.pack("<4I", total, 0, 0, 0))
    return out


_SILU_MUL = """
struct Params { n: u32, pad0: u32, pad1: u32, pad2: u32 }
@group(0) @binding(0) var<storage, read> g: array<f32>;
@group(0) @binding(1) var<storage, read> u: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<uniform> p: Params;
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let i = hetero_workgroup_id(wid).x * 256u + li;
    if (i >= p.n) { return; }
    let v = g[i];
    y[i] = v / (1.0 + exp(-v)) * u[i];
}
"""


# -- RMSNorm --------------------------------------------------------------------------------------
def _norm_checks(op: str, gpu: GPUContext, x: Any, weight: Any, eps: Any, residual: Any) -> tuple[int, int]:
    xs = _arr(op, "x", x, _F32)
    if len(xs) == 0:
        raise ValueError(f"{op}: x is 0-d (shape ()); it needs at least one axis")
    n = xs[-1]
    ws = _arr(op, "weight", weight, _F32)
    if ws != (n,):
        raise ValueError(f"{op}: weight of shape {ws} does not match the last axis of x of shape {xs}; it must "
                         f"be ({n},)")
    if residual is not None:
        rs = _arr(op, "residual", residual, _F32)
        if rs != xs:
            raise ValueError(f"{op}: residual of shape {rs} differs from x of shape {xs}; they must be equal")
    _eps(op, eps)
    _fits(gpu, op, "x", xs)
    return math.prod(xs[:-1]), n


def rmsnorm(gpu: GPUContext, x: Tensor | np.ndarray, weight: Tensor | np.ndarray, eps: float = 1e-6) -> Tensor:
    """RMSNorm over the last axis: ``x / sqrt(mean(x^2) + eps) * weight`` (Llama's, in float32)."""
    rows, n = _norm_checks("rmsnorm", gpu, x, weight, eps, None)
    out = gpu.empty(tuple(int(s) for s in x.shape), np.float32)
    if rows * n == 0:
        return out
    kern = gpu.kernel(W.rmsnorm(False), "main", label="decoder.rmsnorm")
    gpu.dispatch(kern, rows, _dev(gpu, x), _dev(gpu, weight), out, struct.pack("<2If1I", rows, n, float(eps), 0))
    return out


def add_rmsnorm(gpu: GPUContext, x: Tensor | np.ndarray, residual: Tensor | np.ndarray,
                weight: Tensor | np.ndarray, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """``(h, rmsnorm(h, weight, eps))`` with ``h = x + residual``: the residual stream and its norm, one dispatch."""
    rows, n = _norm_checks("add_rmsnorm", gpu, x, weight, eps, residual)
    shape = tuple(int(s) for s in x.shape)
    h = gpu.empty(shape, np.float32)
    out = gpu.empty(shape, np.float32)
    if rows * n == 0:
        return h, out
    kern = gpu.kernel(W.rmsnorm(True), "main", label="decoder.add_rmsnorm")
    gpu.dispatch(kern, rows, _dev(gpu, x), _dev(gpu, residual), _dev(gpu, weight), h, out,
                 struct.pack("<2If1I", rows, n, float(eps), 0))
    return h, out


# -- RoPE and the KV cache ------------------------------------------------------------------------
def kv_cache(gpu: GPUContext, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, *,
             dtype: str = "f32") -> tuple[Tensor, Tensor]:
    """A (K, V) pair of resident, zeroed caches for ``num_blocks`` blocks of ``block_size`` tokens.

    ``dtype="f32"``: float32 [num_blocks, block_size, kv_heads, head_dim]. ``"f16"``: half
    the memory, uint32 [num_blocks, block_size, kv_heads, head_dim / 2] holding f16 pairs
    (``pack2x16float``: element 2i in the low half), head_dim a multiple of 4; rows are
    rounded to f16 when written, attention computes in float32.
    """
    for name, v in (("num_blocks", num_blocks), ("block_size", block_size), ("kv_heads", kv_heads),
                    ("head_dim", head_dim)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"kv_cache: {name} must be an int >= 1, got {v!r}")
    if dtype not in ("f32", "f16"):
        raise ValueError(f"kv_cache: dtype must be 'f32' or 'f16', got {dtype!r}")
    if dtype == "f16" and head_dim % 4:
        raise ValueError(f"kv_cache: an f16 cache needs head_dim to be a multiple of 4, got {head_dim}")
    last = int(head_dim) // 2 if dtype == "f16" else int(head_dim)
    shape = (int(num_blocks), int(block_size), int(kv_heads), last)
    _fits(gpu, "kv_cache", "a cache", shape)
    z = np.zeros(shape, np.uint32 if dtype == "f16" else np.float32)
    return gpu.resident(z), gpu.resident(z)


_U32 = np.dtype(np.uint32)


def _cache_shape(op: str, name: str, c: Any) -> tuple[int, int, int, int]:
    """[num_blocks, block_size, kv_heads, head_dim] of a cache (float32, or uint32 f16 pairs)."""
    _kind(op, name, c)
    if not isinstance(c, Tensor):
        raise TypeError(f"{op}: {name} must be a hetero.Tensor (the cache is written in place), got a numpy array")
    if c.dtype not in (_F32, _U32):
        raise TypeError(f"{op}: {name} must be float32 (or uint32 f16 pairs, kv_cache(dtype='f16')), got "
                        f"{c.dtype.name} (shape {c.shape})")
    s = _arr(op, name, c, c.dtype, 4)
    return s[0], s[1], s[2], s[3] * (2 if c.dtype == _U32 else 1)


def _ints(op: str, name: str, a: Any, shape: tuple[int, ...]) -> None:
    s = _arr(op, name, a, _I32)
    if s != shape:
        raise ValueError(f"{op}: {name} of shape {s} must have shape {shape}")


def _rope_record(gpu: GPUContext, label: str, t: int, hq: int, hkv: int, d: int, pos: Any, inv_freq: Any,
                 slots: Any, src: tuple[Any, int, int], ksrc: tuple[Any, int, int], vsrc: tuple[Any, int, int],
                 qo: Tensor, kc: Tensor, vc: Tensor, with_q: bool, with_kv: bool, rope_k: bool) -> None:
    total = t * (hq + 2 * hkv) * (d // 2)
    if total == 0:
        return
    f16 = with_kv and kc.dtype == _U32
    kern = gpu.kernel(W.rope_kv(with_q, with_kv, rope_k, f16), "main", label=label + (".f16" if f16 else ""))
    params = struct.pack("<12I", t, hq, hkv, d, src[1], src[2], ksrc[1], ksrc[2], vsrc[1], vsrc[2], total, 0)
    gpu.dispatch(kern, _groups(total, 64), pos, inv_freq, slots, src[0], ksrc[0], vsrc[0], qo, kc, vc, params)


def _rope_common(op: str, positions: Any, inv_freq: Any, t: int, d: int) -> None:
    if d % 2:
        raise ValueError(f"{op}: head_dim must be even for rotate_half pairs, got {d}")
    _ints(op, "positions", positions, (t,))
    fs = _arr(op, "inv_freq", inv_freq, _F32)
    if fs != (d // 2,):
        raise ValueError(f"{op}: inv_freq of shape {fs} must have shape ({d // 2},) (head_dim / 2)")
    if isinstance(positions, np.ndarray) and positions.size and int(positions.min()) < 0:
        raise ValueError(f"{op}: positions must be >= 0, got {int(positions.min())}")


def rope(gpu: GPUContext, x: Tensor | np.ndarray, positions: Tensor | np.ndarray,
         inv_freq: Tensor | np.ndarray) -> Tensor:
    """RoPE of x [T, heads, D] at ``positions`` (int32 [T]): rotate_half pairs (i, i + D/2) -> [T, heads, D]."""
    t, h, d = _arr("rope", "x", x, _F32, 3)
    _rope_common("rope", positions, inv_freq, t, d)
    _fits(gpu, "rope", "x", (t, h, d))
    out = gpu.empty((t, h, d), np.float32)
    if t * h * d == 0:
        return out
    xt = _dev(gpu, x)
    dummy = gpu.empty((1,), np.float32)
    dummy_i = gpu.empty((1,), np.int32)
    dummy2 = gpu.empty((1,), np.float32)
    _rope_record(gpu, "decoder.rope", t, h, 0, d, _dev(gpu, positions), _dev(gpu, inv_freq), dummy_i,
                 (xt, h * d, 0), (xt, h * d, 0), (xt, h * d, 0), out, dummy, dummy2, True, False, True)
    return out


def _slots_check(op: str, slots: Any, t: int, kc_shape: tuple[int, int, int, int]) -> None:
    _ints(op, "slots", slots, (t,))
    cap = kc_shape[0] * kc_shape[1]
    if isinstance(slots, np.ndarray) and slots.size and (int(slots.min()) < 0 or int(slots.max()) >= cap):
        raise ValueError(f"{op}: slots must be in [0, {cap}) (num_blocks * block_size of the cache), got "
                         f"[{int(slots.min())}, {int(slots.max())}]")


def _caches(op: str, k_cache: Any, v_cache: Any) -> tuple[int, int, int, int]:
    ks = _cache_shape(op, "k_cache", k_cache)
    vs = _cache_shape(op, "v_cache", v_cache)
    if ks != vs or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"{op}: k_cache ({k_cache.dtype.name} {tuple(k_cache.shape)}) and v_cache "
                         f"({v_cache.dtype.name} {tuple(v_cache.shape)}) differ; they must be equal")
    if k_cache.dtype == _U32 and ks[3] % 4:
        raise ValueError(f"{op}: f16 caches need head_dim to be a multiple of 4, got {ks[3]} "
                         f"(k_cache {tuple(k_cache.shape)} of f16 pairs)")
    return ks


def kv_write(gpu: GPUContext, k_cache: Tensor, v_cache: Tensor, k: Tensor | np.ndarray, v: Tensor | np.ndarray,
             slots: Tensor | np.ndarray) -> None:
    """Write rows k, v [T, kv_heads, D] into the caches at flat slots (int32 [T]), in place."""
    ks = _caches("kv_write", k_cache, v_cache)
    kshape = _arr("kv_write", "k", k, _F32, 3)
    vshape = _arr("kv_write", "v", v, _F32, 3)
    t = kshape[0]
    if kshape != vshape or kshape[1:] != ks[2:]:
        raise ValueError(f"kv_write: k of shape {kshape} and v of shape {vshape} must both be [T, {ks[2]}, {ks[3]}] "
                         f"(T, the caches' kv_heads and head_dim)")
    _slots_check("kv_write", slots, t, ks)
    if ks[3] % 2:
        raise ValueError(f"kv_write: head_dim must be even, got {ks[3]}")
    if t == 0:
        return
    kt, vt = _dev(gpu, k), _dev(gpu, v)
    hkv, d = ks[2], ks[3]
    dummy_f = gpu.empty((d // 2,), np.float32)
    dummy_p = gpu.empty((t,), np.int32)
    dummy_q = gpu.empty((1,), np.float32)
    _rope_record(gpu, "decoder.kv_write", t, 0, hkv, d, dummy_p, dummy_f, _dev(gpu, slots),
                 (kt, hkv * d, 0), (kt, hkv * d, 0), (vt, hkv * d, 0), dummy_q, k_cache, v_cache,
                 False, True, False)


def rope_kv(gpu: GPUContext, qkv: Tensor | np.ndarray, positions: Tensor | np.ndarray,
            inv_freq: Tensor | np.ndarray, k_cache: Tensor, v_cache: Tensor, slots: Tensor | np.ndarray, *,
            heads: int) -> Tensor:
    """RoPE of q and k out of a fused QKV projection, k and v written to the cache: one dispatch.

    ``qkv`` float32 [T, (heads + 2 kv_heads) * D] (q's heads, then k's, then v's: the
    output of ``linear`` with ``concat_rows([wq, wk, wv])``); returns q [T, heads, D],
    rotated; k (rotated) and v go to ``slots`` (int32 [T]) of the caches.
    """
    ks = _caches("rope_kv", k_cache, v_cache)
    hkv, d = ks[2], ks[3]
    t, c = _arr("rope_kv", "qkv", qkv, _F32, 2)
    if isinstance(heads, bool) or not isinstance(heads, (int, np.integer)) or heads < 1:
        raise ValueError(f"rope_kv: heads must be an int >= 1, got {heads!r}")
    if c != (heads + 2 * hkv) * d:
        raise ValueError(f"rope_kv: qkv of shape {(t, c)} must be [T, (heads + 2 kv_heads) * head_dim] = "
                         f"[T, ({heads} + 2*{hkv}) * {d}] = [T, {(heads + 2 * hkv) * d}]")
    _rope_common("rope_kv", positions, inv_freq, t, d)
    _slots_check("rope_kv", slots, t, ks)
    _fits(gpu, "rope_kv", "qkv", (t, c))
    out = gpu.empty((t, heads, d), np.float32)
    if t == 0:
        return out
    src = _dev(gpu, qkv)
    _rope_record(gpu, "decoder.rope_kv", t, heads, hkv, d, _dev(gpu, positions), _dev(gpu, inv_freq),
                 _dev(gpu, slots), (src, c, 0), (src, c, heads * d), (src, c, (heads + hkv) * d), out,
                 k_cache, v_cache, True, True, True)
    return out


def linear_rope_kv(gpu: GPUContext, x: Tensor | np.ndarray, w_qkv: PackedWeight | GPUWeight,
                   positions: Tensor | np.ndarray, inv_freq: Tensor | np.ndarray, k_cache: Tensor, v_cache: Tensor,
                   slots: Tensor | np.ndarray, *, heads: int, bias: Tensor | np.ndarray | None = None,
                   norm: Tensor | np.ndarray | None = None, eps: float = 1e-6) -> Tensor:
    """The fused QKV projection with RoPE and the KV-cache write: ``rope_kv(linear(x, w_qkv, bias=bias,
    norm=norm, eps=eps), ...)``, one dispatch for decode rows.

    ``w_qkv`` [(heads + 2 kv_heads) * D, K] (``concat_rows([wq, wk, wv])``); returns q
    [T, heads, D], rotated; k (rotated) and v go to ``slots`` of the caches. For T <= :data:`GEMV_MAX_M`
    rows (and D a multiple of 4) one dispatch of the GEMV kernel the product takes (see
    :data:`GEMV_IMPL`), each slot (lanes) or workgroup (units) taking the rows of two rotate_half
    pairs and writing them in its epilogue. More rows take the GEMM; where it splits K, its epilogue
    pass adds the splits and does RoPE and the KV write (D a multiple of 4); otherwise the two ops.
    """
    op = "linear_rope_kv"
    m, k, n, kind = _linear_checks(op, gpu, x, [("w_qkv", w_qkv)], bias, None, norm, eps)
    ks = _caches(op, k_cache, v_cache)
    hkv, d = ks[2], ks[3]
    if isinstance(heads, bool) or not isinstance(heads, (int, np.integer)) or heads < 1:
        raise ValueError(f"{op}: heads must be an int >= 1, got {heads!r}")
    if n != (heads + 2 * hkv) * d:
        raise ValueError(f"{op}: w_qkv of shape [{n}, {k}] must have (heads + 2 kv_heads) * head_dim = "
                         f"({heads} + 2*{hkv}) * {d} = {(heads + 2 * hkv) * d} rows")
    _rope_common(op, positions, inv_freq, m, d)
    _slots_check(op, slots, m, ks)
    if m > GEMV_MAX_M or d % 4:
        # a split-K product does RoPE and the KV write in its epilogue; otherwise the two ops
        rope = (_Rope(_dev(gpu, positions), _dev(gpu, inv_freq), _dev(gpu, slots), k_cache, v_cache, int(heads),
                      hkv, d) if d % 4 == 0 else None)
        qkv, rotated = _linear_product(op, gpu, x, [w_qkv], m, k, n, kind, bias, None, norm, float(eps), "auto",
                                       rope)
        assert isinstance(qkv, Tensor)  # no quantized output was asked for
        if rotated:
            return qkv
        return rope_kv(gpu, qkv, positions, inv_freq, k_cache, v_cache, slots, heads=int(heads))
    impl = _gemv_impl(op, k, n, kind)
    _fits(gpu, op, "q", (m, heads, d))
    out = gpu.empty((m, heads, d), np.float32)
    if m == 0:
        return out
    units, blocks = _units(kind, k)
    vec = k % 8 == 0
    sg = _subgroups(gpu)
    cache = "f16" if k_cache.dtype == _U32 else "f32"
    tag = "".join(t for t, f in zip((".norm", ".bias"), (norm is not None, bias is not None)) if f)
    quads = (heads + 2 * hkv) * d // 4  # the rows in fours: two rotate_half pairs each
    if impl == "lanes":
        lanes, threads, _ = _lanes_shape(blocks if kind not in _FLOAT_KINDS else units, sg)
        unroll = max(1, int(GEMV_UNROLL))
        src = W.linear_gemv_lanes(kind, m, 4, lanes, threads, unroll, vec, False, norm is not None, bias is not None,
                                  False, bool(sg), cache)
        label = f"decoder.linear_rope_kv.lanes.{kind}.m{m}.l{lanes}.t{threads}.u{unroll}"
        groups = _groups(quads, threads // lanes)
    else:
        unroll = max(1, int(GEMV_UNITS_UNROLL))
        src = W.linear_gemv(kind, m, 4, GEMV_THREADS, vec, False, norm is not None, bias is not None, False, sg,
                            cache, unroll=unroll)
        label = f"decoder.linear_rope_kv.gemv.{kind}.m{m}{f'.u{unroll}' if unroll > 1 else ''}"
        groups = quads  # a workgroup a four rows
    kern = gpu.kernel(src, "main", label=f"{label}.{cache}{tag}{f'.sg{sg}' if sg else ''}")
    inputs: list[Any] = [_dev(gpu, x), *_weight_tensors(gpu, w_qkv)]
    if norm is not None:
        inputs.append(_dev(gpu, norm))
    if bias is not None:
        inputs.append(_dev(gpu, bias))
    params = struct.pack("<5If6I", m, n, k, units, blocks, float(eps), 0, 0, d, int(heads), hkv, 0)
    gpu.dispatch(kern, groups, *inputs, _dev(gpu, positions), _dev(gpu, inv_freq), _dev(gpu, slots), out,
                 k_cache, v_cache, params)
    return out


# -- paged attention -------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class AttentionSplits:
    """A split attention's result before its combine pass (``paged_attention(..., combine=False)``).

    ``part`` holds float32 [T, heads, splits, D + 4]: each split's unnormalised sum of values, then
    its running maximum and sum of weights (base 2). :func:`linear` takes it as x ([T, heads * D]);
    :func:`combine_attention` makes the [T, heads, D] attention output of it.
    """

    part: Tensor
    shape: tuple[int, int, int]  # (T, heads, D) of the combined result
    splits: int

    @property
    def dtype(self) -> np.dtype[Any]:
        return _F32


def _splits_check(op: str, x: AttentionSplits) -> None:
    """``x``'s partial rows are what its shape and splits say (an AttentionSplits made by hand may not be)."""
    t, hq, d = x.shape
    want = (t, hq, x.splits, d + W.SPLIT_ROW_PAD)
    if not isinstance(x.part, Tensor) or x.part.dtype != _F32 or tuple(x.part.shape) != want:
        got = f"{np.dtype(x.part.dtype).name} {tuple(x.part.shape)}" if isinstance(x.part, Tensor) else \
            type(x.part).__name__
        raise ValueError(f"{op}: an AttentionSplits of shape {x.shape} and {x.splits} splits holds float32 partial "
                         f"rows {want}, got {got}; make it with paged_attention(..., combine=False)")


def combine_attention(gpu: GPUContext, splits: AttentionSplits) -> Tensor:
    """The combine pass of a split attention: ``splits``' partial rows -> float32 [T, heads, D]."""
    if not isinstance(splits, AttentionSplits):
        raise TypeError(f"combine_attention: expected the AttentionSplits of paged_attention(..., combine=False), "
                        f"got {type(splits).__name__}")
    _splits_check("combine_attention", splits)
    t, hq, d = splits.shape
    out = gpu.empty((t, hq, d), np.float32)
    comb = gpu.kernel(W.attention_combine(), "main", label="decoder.paged_attention.combine")
    gpu.dispatch(comb, t * hq, splits.part, out, struct.pack("<4I", t * hq, d, splits.splits, 0))
    return out


@dataclass(frozen=True, eq=False)
class QuantizedRows:
    """Activations [M, K] quantized for the dp4a GEMM, as llama.cpp's Q8_1 does a block of 32: ``xq``
    (uint32 [M, K / 4], four int8 a word), ``xd`` (float32 [M, K / 32]: each block's d) and ``xs``
    (float32 [M, K / 32]: d * sum(q)). ``linear_swiglu(..., quantize=True)`` makes them and
    :func:`linear` takes them as x where its product runs the dp4a GEMM
    (:func:`takes_quantized_rows`)."""

    xq: Tensor
    xd: Tensor
    xs: Tensor
    shape: tuple[int, int]

    @property
    def dtype(self) -> np.dtype[Any]:
        return _F32


def takes_quantized_rows(m: int, w: PackedWeight | GPUWeight, path: str = "auto") -> bool:
    """Whether ``linear(x, w, path=path)`` over ``m`` rows runs the dp4a GEMM, so that x may be
    :class:`QuantizedRows` (the settings read now: :data:`TILED_IMPL`, :data:`GEMV_MAX_M`)."""
    kind, (n, k) = _weight("takes_quantized_rows", "w", w)
    tiled = path == "tiled" or (path == "auto" and m > GEMV_MAX_M)
    return tiled and kind in G.DP4A_KINDS and k % 32 == 0 and _tiled_impl("takes_quantized_rows", kind, n, k) == "dp4a"


def _quantize(gpu: GPUContext, op: str, y: Tensor) -> QuantizedRows:
    """``y`` [M, K] (K a multiple of 32) as QuantizedRows: the dp4a GEMM's quantize pass."""
    m, k = (int(v) for v in y.shape)
    blocks = k // 32
    xq, xd, xs = _quantized_buffers(gpu, op, m, blocks)
    if m == 0:
        return QuantizedRows(xq, xd, xs, (m, k))
    params = struct.pack("<5If2I", m, 0, k, k // 8, blocks, 0.0, 0, 0)
    quant = gpu.kernel(G.quantize_rows(False), "main", label="decoder.linear.quantize")
    gpu.dispatch(quant, (_groups(blocks, G.QUANT_BLOCKS), m), y, xq, xd, xs, params)
    return QuantizedRows(xq, xd, xs, (m, k))


def _quantized_buffers(gpu: GPUContext, op: str, m: int, blocks: int) -> tuple[Tensor, Tensor, Tensor]:
    _fits(gpu, op, "the quantized activations", (m, blocks * 8), 4)
    return (gpu.empty((m, blocks * 8), np.uint32), gpu.empty((m, blocks), np.float32),
            gpu.empty((m, blocks), np.float32))


def paged_attention(gpu: GPUContext, q: Tensor | np.ndarray, k_cache: Tensor, v_cache: Tensor,
                    block_tables: Tensor | np.ndarray, query_seq: Tensor | np.ndarray,
                    query_pos: Tensor | np.ndarray, *, scale: float | None = None,
                    splits: int | None = None, combine: bool = True) -> Tensor | AttentionSplits:
    """Causal GQA attention of q [T, heads, D] over the paged caches -> [T, heads, D].

    Query row t attends to keys 0 .. ``query_pos[t]`` of sequence ``query_seq[t]``, found
    through ``block_tables`` (int32 [S, max_blocks]). ``scale`` defaults to 1/sqrt(D).
    ``splits``: key chunks (flash-decoding) of ``ceil(max_blocks * block_size / splits)``
    keys; None chooses (see the module docstring), 1 never splits. ``combine=False``: where
    the keys were split, the partial results (:class:`AttentionSplits`, for :func:`linear`
    to combine on load) instead of the combine pass; a Tensor as before where they were not.
    """
    op = "paged_attention"
    nb, bs, hkv, d = _caches(op, k_cache, v_cache)
    t, hq, qd = _arr(op, "q", q, _F32, 3)
    if qd != d:
        raise ValueError(f"{op}: q of shape {(t, hq, qd)} has head_dim {qd}, the caches {d}; they must be equal")
    if hq % hkv:
        raise ValueError(f"{op}: heads ({hq}) must be a multiple of the caches' kv_heads ({hkv}) for "
                         "grouped-query attention")
    if d % 4:
        raise ValueError(f"{op}: head_dim must be a multiple of 4, got {d}")
    if d > 256:
        raise ValueError(f"{op}: head_dim must be at most 256, got {d}")
    group = hq // hkv
    bts = _arr(op, "block_tables", block_tables, _I32, 2)
    _ints(op, "query_seq", query_seq, (t,))
    _ints(op, "query_pos", query_pos, (t,))
    s, maxb = bts
    if isinstance(query_seq, np.ndarray) and t and (int(query_seq.min()) < 0 or int(query_seq.max()) >= s):
        raise ValueError(f"{op}: query_seq must be in [0, {s}) (rows of block_tables), got "
                         f"[{int(query_seq.min())}, {int(query_seq.max())}]")
    if isinstance(query_pos, np.ndarray) and t and (int(query_pos.min()) < 0 or
                                                    int(query_pos.max()) >= maxb * bs):
        raise ValueError(f"{op}: query_pos must be in [0, {maxb * bs}) (max_blocks * block_size), got "
                         f"[{int(query_pos.min())}, {int(query_pos.max())}]")
    if isinstance(block_tables, np.ndarray) and block_tables.size and \
            (int(block_tables.min()) < 0 or int(block_tables.max()) >= nb):
        raise ValueError(f"{op}: block_tables entries must be in [0, {nb}) (the caches' num_blocks), got "
                         f"[{int(block_tables.min())}, {int(block_tables.max())}]")
    sc = 1.0 / math.sqrt(d) if scale is None else scale
    if isinstance(sc, bool) or not isinstance(sc, (int, float, np.floating)) or not math.isfinite(float(sc)):
        raise ValueError(f"{op}: scale must be a finite number, got {scale!r}")
    if splits is not None and (isinstance(splits, bool) or not isinstance(splits, (int, np.integer)) or splits < 1):
        raise ValueError(f"{op}: splits must be an int >= 1 or None, got {splits!r}")
    if not isinstance(combine, (bool, np.bool_)):
        raise ValueError(f"{op}: combine must be True or False, got {combine!r}")
    _fits(gpu, op, "q", (t, hq, d))
    if t == 0 or s == 0:
        return gpu.empty((t, hq, d), np.float32)
    cap = maxb * bs
    # query heads a workgroup serves: the largest divisor of the group <= ATTN_MAX_HEADS (registers)
    per_wg = max(c for c in range(1, min(group, ATTN_MAX_HEADS) + 1) if group % c == 0)
    chunks = group // per_wg
    if splits is None:
        base = t * hkv * chunks
        splits = 1
        if base < ATTN_SPLIT_MIN_GROUPS and cap > ATTN_SPLIT_KEYS:
            splits = min(_groups(cap, ATTN_SPLIT_KEYS), _groups(ATTN_SPLIT_MIN_GROUPS, base))
    splits = min(int(splits), cap)
    split_keys = _groups(cap, splits)
    splits = _groups(cap, split_keys)
    sg = _subgroups(gpu)
    partial = splits > 1
    f16 = k_cache.dtype == _U32
    pre = bool(ATTN_PREFETCH) and W.attention_prefetches(d)
    kern = gpu.kernel(W.attention(per_wg, d, partial, sg, f16, pre), "main",
                      label=f"decoder.paged_attention.g{per_wg}.d{d}{'.split' if partial else ''}"
                      f"{'.pre' if pre else ''}"
                      f"{'.f16' if f16 else ''}"
                      f"{f'.sg{sg}' if sg else ''}")
    params = struct.pack("<8If3I", t, hq, hkv, d, bs, maxb, splits, split_keys,
                         float(sc) * 1.4426950408889634, chunks, 0, 0)
    qt, btt, qst, qpt = _dev(gpu, q), _dev(gpu, block_tables), _dev(gpu, query_seq), _dev(gpu, query_pos)
    workgroups = t * hkv * chunks * splits
    if not partial:
        out = gpu.empty((t, hq, d), np.float32)
        gpu.dispatch(kern, workgroups, qt, k_cache, v_cache, btt, qst, qpt, out, params)
        return out
    _fits(gpu, op, "the partial results", (t, hq, splits, d + W.SPLIT_ROW_PAD))
    part = gpu.empty((t, hq, splits, d + W.SPLIT_ROW_PAD), np.float32)
    gpu.dispatch(kern, workgroups, qt, k_cache, v_cache, btt, qst, qpt, part, params)
    result = AttentionSplits(part, (t, hq, d), splits)
    return result if not combine else combine_attention(gpu, result)


# -- embedding ------------------------------------------------------------------------------------
def embedding(gpu: GPUContext, table: PackedWeight | GPUWeight, ids: Tensor | np.ndarray, *,
              src: Tensor | np.ndarray | None = None, prev: Tensor | None = None) -> Tensor:
    """Rows ``ids`` (int32 [T]) of a [V, H] table of any kind, dequantized -> float32 [T, H].

    Ids outside [0, V) give rows of zeros on the GPU; ids given as a numpy array are
    checked on the host, and out-of-range ones raise.

    ``src`` (int32 [T]) with ``prev`` (an int32 [P] tensor, as ``sample(..., keep=prev)``
    left it) chains steps without the host: row t embeds ``prev[src[t]]`` where
    ``src[t] >= 0``, ``ids[t]`` where it is negative (a ``src`` of P or more gives zeros).
    """
    kind, (v, h) = _weight("embedding", "table", table)
    s = _arr("embedding", "ids", ids, _I32, 1)
    t = s[0]
    if (src is None) != (prev is None):
        raise ValueError("embedding: src and prev go together (row t takes prev[src[t]] where src[t] >= 0)")
    n_prev = 0
    if src is not None:
        if _arr("embedding", "src", src, _I32, 1) != (t,):
            raise ValueError(f"embedding: src of shape {tuple(src.shape)} must be ({t},) (one entry an id)")
        (n_prev,) = _arr("embedding", "prev", prev, _I32, 1)
        if isinstance(src, np.ndarray) and t and int(src.max()) >= n_prev:
            raise ValueError(f"embedding: src must be < {n_prev} (prev's length) where it is >= 0, got "
                             f"{int(src.max())}")
    if isinstance(ids, np.ndarray) and t and (int(ids.min()) < 0 or int(ids.max()) >= v):
        raise ValueError(f"embedding: ids must be in [0, {v}) (the table's rows), got [{int(ids.min())}, "
                         f"{int(ids.max())}]")
    _fits(gpu, "embedding", "the result", (t, h))
    out = gpu.empty((t, h), np.float32)
    if t == 0:
        return out
    units, blocks = _units(kind, h)
    chained = src is not None
    kern = gpu.kernel(W.embedding(kind, chained), "main",
                      label=f"decoder.embedding.{kind}{'.chained' if chained else ''}")
    extra = (_dev(gpu, src), _dev(gpu, prev)) if chained else ()
    gpu.dispatch(kern, _groups(t * units, 64), _dev(gpu, ids), *_weight_tensors(gpu, table), out,
                 struct.pack("<8I", t, h, units, blocks, v, n_prev, 0, 0), *extra)
    return out


def gather_rows(gpu: GPUContext, x: Tensor | np.ndarray, rows: Tensor | np.ndarray) -> Tensor:
    """Rows ``rows`` (int32 [R]) of x (float32 [T, H]) -> float32 [R, H].

    Row ids outside [0, T) give rows of zeros on the GPU; ids given as a numpy array are
    checked on the host, and out-of-range ones raise.
    """
    t, h = _arr("gather_rows", "x", x, _F32, 2)
    (r,) = _arr("gather_rows", "rows", rows, _I32, 1)
    if isinstance(rows, np.ndarray) and r and (int(rows.min()) < 0 or int(rows.max()) >= t):
        raise ValueError(f"gather_rows: rows must be in [0, {t}) (the rows of x), got [{int(rows.min())}, "
                         f"{int(rows.max())}]")
    _fits(gpu, "gather_rows", "the result", (r, h))
    out = gpu.empty((r, h), np.float32)
    if r * h == 0:
        return out
    kern = gpu.kernel(_GATHER_ROWS, "main", label="decoder.gather_rows")
    gpu.dispatch(kern, _groups(r * h, 256), _dev(gpu, x), _dev(gpu, rows), out, struct.pack("<4I", t, h, r, 0))
    return out


_GATHER_ROWS = """
struct Params { t: u32, h: u32, r: u32, pad0: u32 }
@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read> rows: array<i32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<uniform> p: Params;
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let i = hetero_workgroup_id(wid).x * 256u + li;
    if (i >= p.r * p.h) { return; }
    let src = rows[i / p.h];
    if (src < 0 || u32(src) >= p.t) { y[i] = 0.0; return; }
    y[i] = x[u32(src) * p.h + i % p.h];
}
"""


# -- sampling -------------------------------------------------------------------------------------
def sampling_params(temperature: Sequence[float] | float, top_k: Sequence[int] | int = 0,
                    top_p: Sequence[float] | float = 1.0, seed: Sequence[int] | int = 0,
                    step: Sequence[int] | int = 0, *, rows: int | None = None) -> np.ndarray:
    """The per-row parameter array ``sample`` reads: uint32 [S, 8] of (temperature bits, top_k,
    top_p bits, seed, step, 0, 0, 0).

    Scalars are broadcast to ``rows`` (or to the length of the sequences given).
    ``temperature`` 0 is greedy; ``top_k`` 0 (or >= vocab) and ``top_p`` 1 disable those
    filters; ``seed`` and ``step`` are taken modulo 2**32.
    """
    names = ("temperature", "top_k", "top_p", "seed", "step")
    cols = [np.atleast_1d(np.asarray(a)) for a in (temperature, top_k, top_p, seed, step)]
    n = rows if rows is not None else max(c.shape[0] for c in cols)
    for name, c in zip(names, cols):
        if c.ndim != 1 or c.shape[0] not in (1, n):
            raise ValueError(f"sampling_params: {name} must be a scalar or a sequence of {n}, got shape {c.shape}")
    # one array a kind (floats, ints): a step's params are built every step, so few numpy calls
    floats = np.empty((2, n), np.float32)
    floats[0], floats[1] = cols[0], cols[2]
    if not np.isfinite(floats).all() or (floats < 0).any():
        j = 0 if not (np.isfinite(floats[0]).all() and (floats[0] >= 0).all()) else 1
        raise ValueError(f"sampling_params: {('temperature', 'top_p')[j]} must be finite and >= 0, got "
                         f"{cols[2 * j].tolist()}")
    if (floats[1] <= 0).any():
        raise ValueError(f"sampling_params: top_p must be in (0, 1], got {cols[2].tolist()}")
    ints = np.empty((3, n), np.int64)
    ints[0], ints[1], ints[2] = cols[1], cols[3], cols[4]
    if (ints[0] < 0).any():
        raise ValueError(f"sampling_params: top_k must be >= 0, got {cols[1].tolist()}")
    out = np.zeros((n, 8), np.uint32)
    out[:, 0], out[:, 2] = floats.view(np.uint32)
    out[:, [1, 3, 4]] = (ints % (1 << 32)).T
    return out


def sample(gpu: GPUContext, logits: Tensor | np.ndarray, params: Tensor | np.ndarray, *,
           keep: Tensor | None = None) -> Tensor:
    """One token id a row of ``logits`` (float32 [S, V]) -> int32 [S], with per-row ``params``
    (uint32 [S, 8], from :func:`sampling_params`): greedy, or temperature / top-k / top-p sampling.

    ``keep`` (an int32 [>= S] tensor, resident): the ids are written there too, where a later
    stage's ``embedding(..., src=, prev=keep)`` reads them on the GPU."""
    s, v = _arr("sample", "logits", logits, _F32, 2)
    ps = _arr("sample", "params", params, np.dtype(np.uint32), 2)
    if ps != (s, 8):
        raise ValueError(f"sample: params of shape {ps} must be ({s}, 8) (one row of sampling_params per logits "
                         "row)")
    if keep is not None:
        if isinstance(keep, np.ndarray):
            raise ValueError("sample: keep must be a resident tensor (gpu.resident), not a host array: the ids "
                             "written there stay on the GPU")
        (nk,) = _arr("sample", "keep", keep, _I32, 1)
        if nk < s:
            raise ValueError(f"sample: keep holds {nk} ids, fewer than the {s} rows sampled")
    if v == 0 and s:
        raise ValueError("sample: logits have no columns (vocab 0); nothing to sample")
    _fits(gpu, "sample", "logits", (s, v))
    out = gpu.empty((s,), np.int32)
    if s == 0:
        return out
    vec = v % 4 == 0
    cap = min(int(SAMPLE_THREADS), int(gpu.limits["max-compute-invocations-per-workgroup"]),
              int(gpu.limits["max-compute-workgroup-size-x"]))
    wg = max(256, 1 << (max(cap, 1).bit_length() - 1))  # a power of two; WebGPU guarantees 256
    sg = _subgroups(gpu)
    sg = sg if sg and wg // sg * 16 <= 4096 else 0  # the histogram scratch holds 16 bins a subgroup
    regs = _groups(v, 4 * wg) if vec else 0
    regs = regs if regs <= SAMPLE_REGS else 0
    lt = _dev(gpu, logits)
    chunks = _groups(v, W.ARGMAX_CHUNK) if SAMPLE_ARGMAX_PASS else 0
    extra: tuple[Tensor, ...] = () if keep is None else (keep,)
    if chunks:
        part = gpu.empty((s, chunks, 2), np.uint32)
        first = gpu.kernel(W.argmax_chunks(vec), "main", label=f"decoder.sample.argmax{'.vec4' if vec else ''}")
        gpu.dispatch(first, (chunks, s), lt, part, struct.pack("<4I", s, v, chunks, 0))
        extra += (part,)
    kern = gpu.kernel(W.sample(vec, wg, sg, regs, keep is not None, bool(chunks)), "main",
                      label=f"decoder.sample.t{wg}{'.vec4' if vec else ''}{f'.sg{sg}' if sg else ''}"
                      f"{f'.r{regs}' if regs else ''}{'.keep' if keep is not None else ''}"
                      f"{'.chunks' if chunks else ''}")
    gpu.dispatch(kern, s, lt, _dev(gpu, params), out, struct.pack("<4I", s, v, chunks, 0), *extra)
    return out

