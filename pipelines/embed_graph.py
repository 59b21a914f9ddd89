"""The encoder's graphs: BERT encoder stages (GPU, and their numpy twins) and the graphs made of them.

::

    texts -> tokenize (cpu) -+-> embeddings (*) -> layer0 (*) -> ... -> layerN-1 (*) -> pool (*) -> [B, H]
                             \\-> mask (cpu) ----------^-----------------------^---------------^

    (*) a stage with a CPU and a GPU implementation, placed per batch by the runtime

Every stage after ``tokenize`` has a GPU implementation (below) and a numpy one
(``hetero.ops.cpu``, float32 BLAS products, the same numerics). The graph builders take
``cpu``: whether the stages carry their CPU implementations, for the runtime to place per
batch, or are GPU stages only. The caller decides (see
:func:`hetero.pipelines.embed_placement.offers_cpu`); nothing here asks a runtime. The
int8 graph is GPU-only.

``tokenize`` runs the model's ``tokenizers`` tokenizer (truncating at the model's
``max_seq_length``, 256 for all-MiniLM-L6-v2) and pads to the batch's longest
sentence. ``embeddings`` gathers word + position + token-type rows and normalises
them; each ``layer`` stage is one BERT encoder layer (one Q/K/V projection against the
checkpoint's three ``[out, in]`` weights stacked, with ``transpose_b``; fused attention
with the padding mask reading q, k and v in place; output projection + residual
layernorm; gelu feed-forward + residual layernorm); ``pool`` averages the real tokens
and L2-normalises (one kernel of this module) when the model's ``modules.json`` lists a
Normalize module or the caller asks (``normalize``), as sentence-transformers does. One stage per layer keeps the
temporaries of a layer in the buffer pool only while it is recorded; the queue orders
the stages without host round trips. Every GPU stage is captured (``capture=True``):
its function runs once per batch shape (sentences, padded length) and later batches of
that shape replay its dispatches. The weights come from :mod:`hetero.pipelines.embed_weights`.

INT8 (``int8=True``): the encoder's linear layers (Q/K/V stacked, attention output,
intermediate, output) multiply by int8 weights with :func:`hetero.ops.matmul_int8`
(``strategy=INT8_STRATEGY``, ``"dp4a-g64"``: activations quantized per row and per group of
64 along K, multiplied with ``dot4I8Packed``). Embeddings, layernorms, attention and pooling
stay float32.

:func:`embedding_graph` is the bulk path's (padded batches); :func:`service_graph` the
service path's (``ids -> pack -> ... -> pool -> rows``: sentences packed one after another,
:mod:`hetero.pipelines.embed_shapes`).
"""

from __future__ import annotations

import string
from collections.abc import Sequence

import numpy as np

import hetero
from hetero import GPUContext, Tensor, ops
from hetero.kernels.matmul import matmul_partials, split_k_parts
from hetero.kernels.matmul_int8 import Strategy, matmul_int8

from .embed_shapes import pack_bucketed
from .embed_tokens import tokenize
from .embed_weights import QKV, cpu_weights, resident_int8_weights, resident_weights
from .minilm import Model

__all__ = ["INT8_STRATEGY", "PACKED_SPLIT_MAX_TOKENS", "POOL_WGSL", "SPAN_POOL_WGSL", "SPLIT_SMALL",
           "embedding_graph", "mean_pool_l2", "mean_pool_l2_cpu", "mean_pool_l2_packed", "mean_pool_l2_packed_cpu",
           "service_graph"]

# matmul_int8's strategy for the encoder: "dp4a-g64" (activations quantized to int8 per row and per
# 64 consecutive features, dot4I8Packed sums scaled per group). One scale per row ("dp4a") is too
# coarse for BERT's outlier features. MiniLM fixture against sentence-transformers, min / mean cosine:
# dp4a 0.9857 / 0.9952, dp4a-g32 0.9948 / 0.9986, dp4a-g64 0.9946 / 0.9984, dequant 0.9965 / 0.9991.
INT8_STRATEGY: Strategy = "dp4a-g64"

# Mean pooling and L2 normalisation (sentence-transformers' Pooling(mean) + Normalize), one
# workgroup per output row: out[r] = v / max(|v|, 1e-12), v = the mean of row r's tokens (their
# sum / max(count, 1e-9)); with p.norm 0, v itself (a model without a Normalize module). The two
# kernels differ only in which tokens a row takes.
_POOL_WGSL = string.Template("""
// $WHAT
struct Params { rows: u32, n: u32, h: u32, norm: u32 }
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
    if (p.norm == 0u) { return; }   // uniform control flow: p.norm is the same for every invocation
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


def _mask(tokens: tuple[np.ndarray, ...]) -> np.ndarray:
    return tokens[3]


def _bounds(tokens: tuple[np.ndarray, ...]) -> np.ndarray:
    return tokens[4]


# -- GPU stages ---------------------------------------------------------------------------------------------
def _view(t: Tensor, shape: tuple[int, ...]) -> Tensor:
    """``t`` with another shape of the same size (same buffer, offset and pool block)."""
    return Tensor(t.buffer, shape, t.dtype, t.offset, t.block)


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


def mean_pool_l2(gpu: GPUContext, x: Tensor, mask: Tensor, normalize: bool = True) -> Tensor:
    """Masked mean over the sequence of ``x`` ``[B, S, H]`` (``mask`` int32 ``[B, S]``), L2-normalised
    unless not ``normalize``: ``[B, H]``."""
    b, s, h = x.shape
    if tuple(mask.shape) != (b, s) or mask.dtype != np.int32:
        raise ValueError(f"mean_pool_l2: mask must be int32 of shape {(b, s)}, got {mask.dtype.name} {mask.shape}")
    return _pool_rows(gpu, POOL_WGSL, "mean_pool_l2", x, mask, b, s, h, normalize)


def _pool_rows(gpu: GPUContext, wgsl: str, name: str, x: Tensor, pick: Tensor, rows: int, n: int, h: int,
               normalize: bool) -> Tensor:
    """One dispatch of a :data:`_POOL_WGSL` kernel: ``rows`` rows of ``h`` from ``x`` (``n`` tokens
    per row, or in all when packed), the tokens each takes given by ``pick``; L2-normalised if ``normalize``."""
    out = gpu.empty((rows, h), np.float32)
    if rows:
        gpu.dispatch(gpu.kernel(wgsl, label=f"pipelines.embed.{name}"), rows, x, pick, out,
                     np.array([rows, n, h, int(bool(normalize))], np.uint32))
    return out


def _pool(gpu: GPUContext, x: Tensor, mask: Tensor, normalize: bool = True) -> Tensor:
    return mean_pool_l2(gpu, x, mask, normalize)


_pool.kernels = [POOL_WGSL]  # type: ignore[attr-defined]


def mean_pool_l2_packed(gpu: GPUContext, x: Tensor, bounds: Tensor, normalize: bool = True) -> Tensor:
    """:func:`mean_pool_l2` of packed sentences: ``x`` [1, T, H] (or [T, H]), ``bounds`` int32
    [R, 2] each sentence's token range ``[start, end)`` (an empty range: a zero row) -> [R, H]."""
    h = x.shape[-1]
    t = int(np.prod(x.shape[:-1]))
    r = bounds.shape[0]
    if tuple(bounds.shape) != (r, 2) or bounds.dtype != np.int32:
        raise ValueError(f"mean_pool_l2_packed: bounds must be int32 [R, 2], got {bounds.dtype.name} {bounds.shape}")
    return _pool_rows(gpu, SPAN_POOL_WGSL, "mean_pool_l2_packed", x, bounds, r, t, h, normalize)


mean_pool_l2_packed.kernels = [SPAN_POOL_WGSL]  # type: ignore[attr-defined]


def _encode_head(gpu: GPUContext, tokens: tuple[Tensor, ...], mask: Tensor, model: Model,
                 int8: bool, layers: int, bounds: Tensor | None = None) -> Tensor:
    """The embeddings and the first ``layers`` layers in one GPU stage (see :data:`~hetero.pipelines.embed.FUSED_MAX_BATCH`);
    with ``bounds``, of packed sentences (``mask``: their spans).

    ``bounds`` is not read here: taking it makes this stage its first GPU reader, so it goes
    up with the tokens it is part of, and ``encoder1`` finds it on the device."""
    x = _embeddings(gpu, tokens, mask, model)
    for n in range(layers):
        x = _layer(gpu, x, mask, model, n, int8, bounds is not None)
    return x


def _encode_tail(gpu: GPUContext, x: Tensor, mask: Tensor, model: Model, int8: bool, first: int,
                 bounds: Tensor | None = None, normalize: bool = True) -> Tensor:
    """The layers from ``first`` on and the pooling in one GPU stage (see :data:`~hetero.pipelines.embed.FUSED_MAX_BATCH`);
    with ``bounds``, of packed sentences (``mask``: their spans)."""
    for n in range(first, model.config.num_hidden_layers):
        x = _layer(gpu, x, mask, model, n, int8, bounds is not None)
    return _pool(gpu, x, mask, normalize) if bounds is None else mean_pool_l2_packed(gpu, x, bounds, normalize)


_encode_tail.kernels = [POOL_WGSL, SPAN_POOL_WGSL]  # type: ignore[attr-defined]


def embedding_graph(model: Model, int8: bool = False, cpu: bool = True, fused: bool = False,
                    loop_tokenize: bool = False, normalize: bool = False) -> hetero.Graph:
    """The graph ``texts -> float32 [len(texts), hidden]`` for ``model`` (built once per model and mode).

    The embeddings are L2-normalised when the model has a Normalize module (``model.normalize``,
    from its ``modules.json``) or ``normalize`` asks for it; else they are the mean-pooled vectors.

    ``int8``: the encoder's linear layers use int8 weights (:func:`matmul_int8`).
    ``cpu``: the float32 stages also carry their CPU implementations, placed by the
    runtime (the caller's choice: see :mod:`hetero.pipelines.embed_placement`); without, they
    are GPU stages only.
    ``fused``: a GPU-only graph (``int8`` or not ``cpu``) records the encoder in two stages
    (see :data:`~hetero.pipelines.embed.FUSED_MAX_BATCH`). ``loop_tokenize``: the tokenizer
    runs inline, on the thread that starts the run (the event loop's), not handed to a CPU
    worker: for calls of at most :data:`~hetero.pipelines.embed_tokens.LOOP_TOKENIZE_MAX`
    texts, whose tokenizing costs less than the hand-off.
    """
    if fused and cpu and not int8:
        raise ValueError("embedding_graph: fused=True needs a GPU-only graph (cpu=False or int8=True): "
                         "stages with CPU implementations are placed one by one")
    unit = model.normalize or normalize
    key = (("embed-int8" if int8 else ("embed" if cpu else "embed-gpu")) + ("-fused" if fused else "")
           + ("-loop" if loop_tokenize else "") + _norm_suffix(model, unit))
    with model.lock:
        g = model.graphs.get(key)
        if g is not None:
            return g
        g = hetero.Graph(key)
        tokens = g.cpu(tokenize, g.input("texts"), model, name="tokenize", inline=loop_tokenize)
        g.output(_encoder(g, tokens, model, int8, cpu, fused, normalize=unit))
        model.graphs[key] = g
        return g


def _norm_suffix(model: Model, unit: bool) -> str:
    """A graph's name marks a normalisation its model's modules do not do: "-norm", else nothing."""
    return "-norm" if unit and not model.normalize else ""


# -- CPU implementations ------------------------------------------------------------------------------------
# Each GPU stage above but tokenize's has a numpy twin computing the same value (hetero.ops.cpu, float32
# BLAS products); the runtime places every execution on one or the other (Runtime(placement=...)).
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


def mean_pool_l2_cpu(x: np.ndarray, mask: np.ndarray, normalize: bool = True) -> np.ndarray:
    """:func:`mean_pool_l2` in numpy: masked mean over the sequence, L2-normalised (norm floored at
    1e-12) unless not ``normalize``."""
    b, s, h = x.shape
    if tuple(mask.shape) != (b, s):
        raise ValueError(f"mean_pool_l2: mask must be of shape {(b, s)}, got {mask.shape}")
    m = (mask != 0).astype(np.float32)
    out = np.einsum("bsh,bs->bh", x, m) / np.maximum(m.sum(1), 1.0)[:, None].astype(np.float32)
    if normalize:
        out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), np.float32(1e-12))
    return out.astype(np.float32, copy=False)


def mean_pool_l2_packed_cpu(x: np.ndarray, bounds: np.ndarray, normalize: bool = True) -> np.ndarray:
    """:func:`mean_pool_l2_packed` in numpy."""
    flat = x.reshape(-1, x.shape[-1])
    b = np.clip(np.asarray(bounds, np.int64).reshape(-1, 2), 0, len(flat))
    b[:, 1] = np.maximum(b[:, 1], b[:, 0])
    cs = np.zeros((len(flat) + 1, flat.shape[1]), np.float64)
    np.cumsum(flat, axis=0, dtype=np.float64, out=cs[1:])
    counts = (b[:, 1] - b[:, 0]).astype(np.float64)
    out = ((cs[b[:, 1]] - cs[b[:, 0]]) / np.maximum(counts, 1e-9)[:, None]).astype(np.float32)
    if normalize:
        out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), np.float32(1e-12))
    return out


def _encoder(g: hetero.Graph, tokens: hetero.Node, model: Model, int8: bool, cpu: bool = True,
             fused: bool = False, packed: bool = False, normalize: bool = True) -> hetero.Node:
    """The graph's stages after tokenization: mask, embeddings, the layers, pooling (returned;
    L2-normalised if ``normalize``).

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
        return g.gpu(_encode_tail, x, mask, model, int8, half, name="encoder1", capture=True, bounds=bounds,
                     normalize=normalize)
    # What the pooling reads: each row's mask, or packed, each sentence's token range.
    pool_by, pool_gpu, pool_cpu = ((bounds, mean_pool_l2_packed, mean_pool_l2_packed_cpu) if packed
                                   else (mask, _pool, mean_pool_l2_cpu))
    if int8 or not cpu:
        x = g.gpu(_embeddings, tokens, mask, model, name="embeddings", capture=True)
        for n in range(model.config.num_hidden_layers):
            x = g.gpu(_layer, x, mask, model, n, int8, name=f"layer{n}", capture=True, packed=packed)
        return g.gpu(pool_gpu, x, pool_by, normalize, name="pool", capture=True)
    x = g.stage(tokens, mask, model, cpu=_embeddings_cpu, gpu=_embeddings, name="embeddings", capture=True)
    for n in range(model.config.num_hidden_layers):
        x = g.stage(x, mask, model, n, cpu=_layer_cpu, gpu=_layer, name=f"layer{n}", capture=True, packed=packed)
    return g.stage(x, pool_by, normalize, cpu=pool_cpu, gpu=pool_gpu, name="pool", capture=True)


def _real_rows(emb: np.ndarray, ids: Sequence[np.ndarray]) -> np.ndarray:
    """The service path's output: the rows of the real sentences (a copy: ``emb`` is staging memory)."""
    return np.array(emb[: len(ids)])


def service_graph(model: Model, int8: bool = False, max_batch_tokens: int = 16384, cpu: bool = True,
                  normalize: bool = False) -> hetero.Graph:
    """The graph ``ids (list of int32 token arrays) -> float32 [len(ids), hidden]`` of the service path.

    A batch runs packed (:func:`pack_bucketed`: no padding between sentences, the shape
    bucketed within ``max_batch_tokens``), so that the captured GPU stages replay and the
    GPU encodes the sentences' own tokens, not a padded rectangle. ``cpu``: as in
    :func:`embedding_graph`; without it (or with ``int8``) the encoder is two fused stages
    (:data:`~hetero.pipelines.embed.FUSED_MAX_BATCH`). ``normalize``: as in :func:`embedding_graph`.
    """
    unit = model.normalize or normalize
    key = ((f"serve-int8-{max_batch_tokens}" if int8 else f"serve-{max_batch_tokens}" + ("" if cpu else "-gpu"))
           + _norm_suffix(model, unit))
    with model.lock:
        g = model.graphs.get(key)
        if g is not None:
            return g
        g = hetero.Graph(key)
        ids = g.input("ids")
        # Packing is a few numpy calls over the batch's ids: inline, on the thread that starts
        # the run (the batcher's, on the event loop), which the hand-off to a worker costs more.
        packed = g.cpu(pack_bucketed, ids, model, max_batch_tokens, name="pack", inline=True)
        emb = _encoder(g, packed, model, int8, cpu, fused=int8 or not cpu, packed=True, normalize=unit)
        g.output(g.cpu(_real_rows, emb, ids, name="rows", inline=True))  # a copy of a few rows
        model.graphs[key] = g
        return g
