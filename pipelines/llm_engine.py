"""The decoder on the GPU: weights, the paged KV cache, and one forward step as a captured graph.

A :class:`DecoderEngine` owns what every generation of one model on one runtime shares:

* the weights, packed for the GPU once on the host (:func:`hetero.kernels.quant.pack`; Q, K and V
  stacked into one QKV projection), uploaded per device on first use (``gpu.resident``);
* the KV cache: one K and one V tensor a layer, ``num_blocks`` blocks of ``block_size``
  positions each, and the host's :class:`~hetero.pipelines.kv_cache.BlockPool` that hands the
  blocks out. Block 0 is the engine's scratch block: the padding rows of a step write there,
  and no sequence ever holds it;
* two graphs of one captured GPU stage each: a forward step that samples one token a sequence
  (``step``), and one that returns the logits (``logits``);
* the kept ids: a resident int32 buffer where each step's sample also writes its ids, so that
  the next step can embed them without the host (``StepRow.src``).

**A step** takes, for each of ``S`` sequences, the next ``n`` of its tokens not yet in the
cache (a prompt chunk, or the one token sampled last step): ``T`` rows in all. For each row
the host gives its token id, position, cache slot and sequence; for each sequence its block
table and the row of its last token. The GPU stage embeds the rows, runs every layer (QKV with
the RMSNorm folded in and RoPE with the KV-cache write in its epilogue, one dispatch for decode
rows (:func:`~hetero.kernels.decoder.linear_rope_kv`), two past ``GEMV_MAX_M``; paged attention;
the output projection with the residual add; gate/up with SwiGLU; down with the residual
add), gathers each sequence's last row, applies the final RMSNorm and the output head, and
samples (greedy, temperature, top-k, top-p; a seeded counter-based hash, so a seed
reproduces a sample). Only the ``S`` token ids come back to the host.

**Steps chain on the GPU.** A row may name, instead of its token, the row of the previous
step's output that holds it (``StepRow.src``): the step's embedding reads that id from the
kept ids. So the host starts step n+1 (:meth:`DecoderEngine.launch`) before step n's ids
come back, and the GPU runs the two back to back. The rule that makes it sound: with one
GPU recording thread (``gpu_threads=1``), runs started one after another run on the GPU in
that order (:meth:`hetero.Runtime.start`), so step n's sample and KV writes precede step
n+1's reads. Blocks a sequence gives back while a later step is in flight are written by
that step only before any step started after it, which is the only kind that can hand them
to another sequence.

**Several decode steps a run** (:meth:`DecoderEngine.launch`'s ``steps``, at most
:data:`MAX_STEPS_PER_RUN`): a step graph whose one captured stage runs the forward step that
many times over decode rows, each time embedding the ids the time before sampled (the kept
ids), at the next position of each sequence (its blocks taken for all of them first). The
host plans, feeds, records and waits once for that many tokens a sequence.

**Shapes are bucketed** so that the captured stage replays: ``T`` and ``S`` are rounded up
(:func:`bucket`) and the block tables' width to a power of two. Padding rows read token 0 at
position 0 and write the scratch block; padding sequences' tables are all scratch.

**Capacity.** A sequence's blocks are taken as its tokens enter the cache. Callers reserve a
sequence's worst case (prompt plus ``max_tokens``) before it starts (:meth:`DecoderEngine.reserve`),
so that a running sequence never finds the pool full.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import hetero
from hetero.kernels import decoder as D
from hetero.kernels.quant import PackedWeight, concat_rows, pack, quantize_q8_0_blocks, unpack
from hetero.lowlevel import GPUContext, Tensor, device_of

from .kv_cache import DEFAULT_BLOCK_SIZE, BlockPool, KVCacheFullError, default_kv_cache_bytes, kv_block_bytes, kv_pool_size
from .llm_model import LlamaConfig, LoadedModel, WeightTensor

__all__ = ["CPU_KV_CACHE_BYTES", "DEFAULT_MAX_BATCH_TOKENS", "MAX_STEPS_PER_RUN", "MAX_STEP_SEQS", "DecoderEngine",
           "PackedDecoder", "StepRow", "bucket", "default_num_blocks", "pack_decoder"]

DEFAULT_MAX_BATCH_TOKENS = 2048
"""Most rows (prompt tokens and decode tokens together) one step takes; longer prompts are chunked."""
CPU_KV_CACHE_BYTES = 256 << 20
"""The default KV budget on a CPU adapter (its memory is the host's)."""
MAX_STEP_SEQS = 4096
"""Most sequences one step samples for (the kept ids' length)."""
MAX_STEPS_PER_RUN = 4
"""Most decode steps one run of the step graph takes (:meth:`DecoderEngine.launch`'s ``steps``)."""

_SCRATCH = ("hetero.llm", "scratch")  # the pool key of the scratch block


def bucket(n: int) -> int:
    """``n`` rounded up to 1, 2, 4, 8, 16, 32, then two sizes an octave (48, 64, 96, 128, ...)."""
    if n <= 32:
        return 1 << max(0, (n - 1).bit_length())
    p = 1 << ((n - 1).bit_length() - 1)  # the octave's floor
    return p + p // 2 if n <= p + p // 2 else 2 * p


# ---------------------------------------------------------------------------------------------
# Weights


@dataclass(frozen=True, eq=False)
class PackedLayer:
    """One block's weights in GPU layout (biases and norms float32)."""

    qkv: PackedWeight
    qkv_bias: np.ndarray | None
    o: PackedWeight
    o_bias: np.ndarray | None
    gate: PackedWeight
    up: PackedWeight
    down: PackedWeight
    attn_norm: np.ndarray
    mlp_norm: np.ndarray


@dataclass(frozen=True, eq=False)
class PackedDecoder:
    """A decoder's weights packed for the GPU (host arrays), and the config they belong to."""

    config: LlamaConfig
    embed: PackedWeight
    layers: tuple[PackedLayer, ...]
    norm: np.ndarray
    head: PackedWeight
    inv_freq: np.ndarray

    @property
    def nbytes(self) -> int:
        """Bytes the packed weights take on the device."""
        ws = [self.embed, self.head] + [w for lay in self.layers for w in (lay.qkv, lay.o, lay.gate, lay.up,
                                                                          lay.down)]
        seen: dict[int, PackedWeight] = {id(w): w for w in ws}
        return sum(a.nbytes for w in seen.values() for a in w.arrays.values())


def _packed(wt: WeightTensor) -> PackedWeight:
    return pack(wt.kind, wt.data, wt.shape)


def _common_kind(ws: Sequence[WeightTensor]) -> list[PackedWeight]:
    """``ws`` packed in one kind: their own when they share it, else all quantized to Q8_0.

    Fused products (QKV, gate/up) read their weights in one kind; a file that mixes kinds
    among them (llama.cpp's mixed presets do) has them requantized, per block of 32.
    """
    if len({w.kind for w in ws}) == 1:
        return [_packed(w) for w in ws]
    out = []
    for w in ws:
        dense = unpack(_packed(w))
        out.append(pack("q8_0", quantize_q8_0_blocks(dense), w.shape))
    return out


def pack_decoder(model: LoadedModel) -> PackedDecoder:
    """``model``'s weights in GPU layout: Q, K and V stacked, norms and biases float32."""
    c = model.config
    w = model.weights

    def f32(name: str) -> np.ndarray:
        return np.ascontiguousarray(w[name].data, dtype=np.float32)

    layers = []
    for n in range(c.num_layers):
        p = f"model.layers.{n}."
        q, k, v = _common_kind([w[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        gate, up = _common_kind([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]])
        bias = None
        if c.attention_bias:
            bias = np.concatenate([f32(p + f"self_attn.{x}_proj.bias") for x in "qkv"])
        layers.append(PackedLayer(
            qkv=concat_rows([q, k, v]), qkv_bias=bias, o=_packed(w[p + "self_attn.o_proj.weight"]),
            o_bias=f32(p + "self_attn.o_proj.bias") if c.attention_out_bias else None,
            gate=gate, up=up, down=_packed(w[p + "mlp.down_proj.weight"]),
            attn_norm=f32(p + "input_layernorm.weight"), mlp_norm=f32(p + "post_attention_layernorm.weight")))
    embed = _packed(w["model.embed_tokens.weight"])
    head = embed if c.tie_word_embeddings else _packed(w["lm_head.weight"])
    return PackedDecoder(c, embed, tuple(layers), f32("model.norm.weight"), head,
                         c.rope_inv_freq().astype(np.float32))


@dataclass(frozen=True, eq=False)
class _ResidentLayer:
    qkv: D.GPUWeight
    qkv_bias: Tensor | None
    o: D.GPUWeight
    o_bias: Tensor | None
    gate: D.GPUWeight
    up: D.GPUWeight
    down: D.GPUWeight
    attn_norm: Tensor
    mlp_norm: Tensor
    k_cache: Tensor
    v_cache: Tensor


@dataclass(frozen=True, eq=False)
class _Resident:
    """The weights and the KV cache on one device."""

    embed: D.GPUWeight
    layers: tuple[_ResidentLayer, ...]
    norm: Tensor
    head: D.GPUWeight
    inv_freq: Tensor
    kept_ids: Tensor  # int32 [MAX_STEP_SEQS]: the last step's sampled ids


# ---------------------------------------------------------------------------------------------
# The forward step (a captured GPU stage)


def _logits(gpu: GPUContext, r: _Resident, c: LlamaConfig, h: Tensor, pos: Tensor, slots: Tensor, tables: Tensor,
            seqs: Tensor, last: Tensor) -> Tensor:
    """Every layer over the embedded rows ``h``, then the head over each sequence's last row."""
    eps = c.rms_norm_eps
    for lay in r.layers:
        q = D.linear_rope_kv(gpu, h, lay.qkv, pos, r.inv_freq, lay.k_cache, lay.v_cache, slots,
                             heads=c.num_heads, bias=lay.qkv_bias, norm=lay.attn_norm, eps=eps)
        att = D.paged_attention(gpu, q, lay.k_cache, lay.v_cache, tables, seqs, pos,
                                combine=not D.ATTN_COMBINE_IN_LINEAR)
        h = D.linear(gpu, att, lay.o, bias=lay.o_bias, residual=h)
        quantize = D.SWIGLU_QUANTIZES and D.takes_quantized_rows(int(h.shape[0]), lay.down)
        mlp = D.linear_swiglu(gpu, h, lay.gate, lay.up, norm=lay.mlp_norm, eps=eps, quantize=quantize)
        h = D.linear(gpu, mlp, lay.down, residual=h)
    return D.linear(gpu, D.gather_rows(gpu, h, last), r.head, norm=r.norm, eps=eps)


def _forward(gpu: GPUContext, ids: Tensor, src: Tensor, pos: Tensor, slots: Tensor, tables: Tensor, seqs: Tensor,
             last: Tensor, params: Tensor, engine: DecoderEngine, logits_only: bool) -> Tensor:
    r = engine.resident(gpu)
    if logits_only:
        return _logits(gpu, r, engine.config, D.embedding(gpu, r.embed, ids), pos, slots, tables, seqs, last)
    h = D.embedding(gpu, r.embed, ids, src=src, prev=r.kept_ids)
    logits = _logits(gpu, r, engine.config, h, pos, slots, tables, seqs, last)
    return D.sample(gpu, logits, params, keep=r.kept_ids)


def _forward_steps(gpu: GPUContext, ids: Tensor, src: Tensor, pos: Tensor, slots: Tensor, tables: Tensor,
                   seqs: Tensor, last: Tensor, params: Tensor, *later: Tensor, engine: DecoderEngine) -> tuple[Tensor, ...]:
    """Several decode steps in one run: ``later`` holds (src, pos, slots, params) of each step after
    the first, whose rows embed the ids the step before sampled (read from the kept ids)."""
    r = engine.resident(gpu)
    h = D.embedding(gpu, r.embed, ids, src=src, prev=r.kept_ids)
    out = [D.sample(gpu, _logits(gpu, r, engine.config, h, pos, slots, tables, seqs, last), params, keep=r.kept_ids)]
    for k in range(0, len(later), 4):
        src_k, pos_k, slots_k, params_k = later[k:k + 4]
        h = D.embedding(gpu, r.embed, ids, src=src_k, prev=r.kept_ids)
        logits = _logits(gpu, r, engine.config, h, pos_k, slots_k, tables, seqs, last)
        out.append(D.sample(gpu, logits, params_k, keep=r.kept_ids))
    return tuple(out)


_STEP_INPUTS = ("ids", "src", "pos", "slots", "tables", "seqs", "last", "params")


def _graph(engine: DecoderEngine, logits_only: bool) -> hetero.Graph:
    """::

        ids, src, pos, slots, tables, seqs, last, params --> forward (gpu, captured) --> tokens | logits
    """
    g = hetero.Graph("llm.logits" if logits_only else "llm.step")
    g.output(g.gpu(_forward, *[g.input(n) for n in _STEP_INPUTS], engine, logits_only,
                   name="logits" if logits_only else "forward", capture=True))
    return g


def _later_inputs(steps: int) -> list[str]:
    return [f"{name}{k}" for k in range(1, steps) for name in ("src", "pos", "slots", "params")]


def _steps_graph(engine: DecoderEngine, steps: int) -> hetero.Graph:
    """::

        ids, src, pos, slots, tables, seqs, last, params, (src, pos, slots, params) x (steps - 1)
            --> forward (gpu, captured) --> (tokens,) x steps
    """
    g = hetero.Graph(f"llm.step{steps}")
    g.output(g.gpu(_forward_steps, *[g.input(n) for n in (*_STEP_INPUTS, *_later_inputs(steps))],
                   engine=engine, name="forward", capture=True))
    return g


@dataclass
class StepRow:
    """One sequence's part of a step: ``tokens`` (ids entering the cache at ``start`` .. ``start + n - 1``)
    and its sampling parameters for the token after them.

    ``src`` >= 0: the row's one token is the one the previous step sampled in its output row
    ``src`` (still on the GPU); ``tokens`` then holds one placeholder id.
    """

    key: Any
    tokens: Sequence[int]
    start: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    step: int = 0
    src: int = -1


class DecoderEngine:
    """One model's weights, KV cache and step graphs on one runtime (see the module doc).

    ``num_blocks`` usable KV blocks of ``block_size`` positions (plus the scratch block);
    ``kv_dtype`` ``"f32"`` or ``"f16"`` (half the memory; rows rounded to f16 when
    written). Thread-safe: the pool and the reservations are taken under one lock.
    """

    def __init__(self, packed: PackedDecoder, runtime: hetero.Runtime, *, num_blocks: int,
                 block_size: int = DEFAULT_BLOCK_SIZE, kv_dtype: str = "f32") -> None:
        if kv_dtype not in ("f32", "f16"):
            raise ValueError(f"kv_cache_dtype must be 'f32' or 'f16', got {kv_dtype!r}")
        self.packed = packed
        self.config = packed.config
        self.runtime = runtime
        self.block_size = block_size
        self.kv_dtype = kv_dtype
        self.pool = BlockPool(num_blocks + 1, block_size)
        self.pool.append(_SCRATCH, block_size)  # block 0
        self._reserved = 0
        self._lock = threading.Lock()
        self._resident: weakref.WeakKeyDictionary[Any, _Resident] = weakref.WeakKeyDictionary()
        self._resident_lock = threading.Lock()
        self.step_graph = _graph(self, False)
        self.logits_graph = _graph(self, True)
        self._steps_graphs: dict[int, hetero.Graph] = {}  # by steps (2 ..): made on first use

    @property
    def num_blocks(self) -> int:
        """KV blocks sequences may hold (the scratch block not counted)."""
        return self.pool.num_blocks - 1

    @property
    def capacity_tokens(self) -> int:
        """Token positions the KV cache holds for sequences."""
        return self.num_blocks * self.block_size

    @property
    def kv_cache_bytes(self) -> int:
        """Device bytes of the whole KV cache (every layer's K and V, the scratch block included)."""
        return self.pool.num_blocks * kv_block_bytes(self.config, self.block_size, 2 if self.kv_dtype == "f16" else 4)

    # -- the device side ------------------------------------------------------------------------
    def resident(self, gpu: GPUContext) -> _Resident:
        """The weights and KV cache on ``gpu``'s device, uploaded on first use."""
        dev = device_of(gpu)
        r = self._resident.get(dev)
        if r is not None:
            return r
        with self._resident_lock:
            r = self._resident.get(dev)
            if r is None:
                r = self._upload(gpu)
                self._resident[dev] = r
        return r

    def _upload(self, gpu: GPUContext) -> _Resident:
        p, c = self.packed, self.config
        up = {}  # one upload per PackedWeight (a tied head is the embedding)

        def weight(w: PackedWeight) -> D.GPUWeight:
            if id(w) not in up:
                up[id(w)] = D.upload_weight(gpu, w)
            return up[id(w)]

        def vec(a: np.ndarray | None) -> Tensor | None:
            return None if a is None else gpu.resident(a)

        layers = []
        for lay in p.layers:
            kc, vc = D.kv_cache(gpu, self.pool.num_blocks, self.block_size, c.num_kv_heads, c.head_dim,
                                dtype=self.kv_dtype)
            layers.append(_ResidentLayer(weight(lay.qkv), vec(lay.qkv_bias), weight(lay.o), vec(lay.o_bias),
                                         weight(lay.gate), weight(lay.up), weight(lay.down),
                                         gpu.resident(lay.attn_norm), gpu.resident(lay.mlp_norm), kc, vc))
        return _Resident(weight(p.embed), tuple(layers), gpu.resident(p.norm), weight(p.head),
                         gpu.resident(p.inv_freq), gpu.resident(np.zeros(MAX_STEP_SEQS, np.int32)))

    # -- capacity -------------------------------------------------------------------------------
    def blocks_for(self, tokens: int) -> int:
        """Blocks a sequence of ``tokens`` positions holds."""
        return -(-tokens // self.block_size)

    def check_fits(self, tokens: int) -> None:
        """Raise :class:`KVCacheFullError` when a sequence of ``tokens`` positions could never fit."""
        need = self.blocks_for(tokens)
        if need > self.num_blocks:
            raise KVCacheFullError(
                f"kv cache: a sequence of {tokens} tokens needs {need} blocks of {self.block_size}, more than the "
                f"cache's {self.num_blocks} blocks ({self.capacity_tokens} tokens); raise kv_cache_bytes, or shorten "
                "the prompt or max_tokens", need, self.num_blocks - self._reserved, self.num_blocks)

    def reserve(self, tokens: int) -> bool:
        """Reserve room for a sequence of up to ``tokens`` positions; False when it does not fit now.

        Raises :class:`KVCacheFullError` when it could never fit (more than the whole pool).
        """
        self.check_fits(tokens)
        need = self.blocks_for(tokens)
        with self._lock:
            if self._reserved + need > self.num_blocks:
                return False
            self._reserved += need
            return True

    def release(self, key: Any, tokens: int) -> None:
        """Give back a sequence's reservation (of ``tokens`` positions) and its blocks."""
        with self._lock:
            self._reserved -= self.blocks_for(tokens)
            if key in self.pool:
                self.pool.free(key)

    @property
    def reserved_blocks(self) -> int:
        """Blocks reserved by running sequences (held or not yet)."""
        return self._reserved

    # -- a step ---------------------------------------------------------------------------------
    def feed(self, rows: Sequence[StepRow], steps: int = 1) -> dict[str, np.ndarray]:
        """The graph inputs of one step over ``rows`` (their blocks taken in the pool); with ``steps``
        > 1, of that many decode steps in one run (every row one token: see :meth:`launch`)."""
        bs = self.block_size
        n_seq = len(rows)
        if n_seq > MAX_STEP_SEQS:
            raise ValueError(f"DecoderEngine: a step of {n_seq} sequences is more than MAX_STEP_SEQS "
                             f"({MAX_STEP_SEQS}); run fewer at once")
        if not 1 <= steps <= MAX_STEPS_PER_RUN:
            raise ValueError(f"DecoderEngine: steps must be from 1 to MAX_STEPS_PER_RUN ({MAX_STEPS_PER_RUN}), "
                             f"got {steps}")
        if steps > 1 and any(len(r.tokens) != 1 for r in rows):
            raise ValueError("DecoderEngine: a run of several steps takes decode rows only (one token each)")
        n_rows = sum(len(r.tokens) for r in rows)
        s_b = bucket(n_seq)
        t_b = max(bucket(n_rows), s_b)
        ids = np.zeros(t_b, np.int32)
        src = np.full(t_b, -1, np.int32)
        pos = np.zeros(t_b, np.int32)
        slots = np.zeros(t_b, np.int32)  # padding rows write slot 0 of the scratch block
        seqs = np.zeros(t_b, np.int32)
        last = np.zeros(s_b, np.int32)
        tables: list[list[int]] = []
        # Rows of one token (every decoding sequence's) as tuples of Python ints, written into the
        # arrays at once below: numpy's cost per small call would be most of a 64-row step's feed.
        one: list[tuple[int, int, int, int, int, int]] = []  # (row, id, src, position, slot, sequence)
        ends: list[int] = []
        t = 0
        with self._lock:
            append, table_of = self.pool.append, self.pool.table
            for j, r in enumerate(rows):
                n = len(r.tokens)
                if r.src >= 0 and n != 1:
                    raise ValueError(f"DecoderEngine: a row fed from the previous step holds one token, got {n}")
                blocks = (append(r.key, n + steps - 1) if n else table_of(r.key)).block_ids
                if n == 1:
                    p = r.start
                    one.append((t, 0 if r.src >= 0 else r.tokens[0], r.src, p, blocks[p // bs] * bs + p % bs, j))
                elif n:
                    ids[t:t + n] = r.tokens
                    ps = np.arange(r.start, r.start + n, dtype=np.int64)
                    pos[t:t + n] = ps
                    slots[t:t + n] = np.asarray(blocks, np.int64)[ps // bs] * bs + ps % bs
                    seqs[t:t + n] = j
                ends.append(t + n - 1)
                tables.append(list(blocks))
                t += n
        if one:
            cols = np.array(one, np.int64).T
            at = cols[0]
            for arr, col in zip((ids, src, pos, slots, seqs), cols[1:]):
                arr[at] = col
        last[:n_seq] = ends
        width = 1 << max(0, (max((len(tb) for tb in tables), default=1) - 1).bit_length())
        tab = np.zeros((s_b, width), np.int32)  # padding entries are the scratch block
        for j, tb in enumerate(tables):
            tab[j, :len(tb)] = tb
        params = D.sampling_params([r.temperature for r in rows] + [0.0] * (s_b - n_seq),
                                   [r.top_k for r in rows] + [0] * (s_b - n_seq),
                                   [r.top_p for r in rows] + [1.0] * (s_b - n_seq),
                                   [r.seed for r in rows] + [0] * (s_b - n_seq),
                                   [r.step for r in rows] + [0] * (s_b - n_seq))
        feed = {"ids": ids, "src": src, "pos": pos, "slots": slots, "tables": tab, "seqs": seqs, "last": last,
                "params": params}
        if steps > 1:  # row t is sequence t: each later step embeds the id the step before sampled for it
            self._feed_later(feed, rows, tables, steps)
        return feed

    def _feed_later(self, feed: dict[str, np.ndarray], rows: Sequence[StepRow], tables: list[list[int]],
                    steps: int) -> None:
        bs = self.block_size
        n_seq, t_b = len(rows), len(feed["ids"])
        starts = np.array([r.start for r in rows], np.int64)
        blocks = np.zeros((n_seq, max(len(tb) for tb in tables)), np.int64)
        for j, tb in enumerate(tables):
            blocks[j, :len(tb)] = tb
        for k in range(1, steps):
            src = np.full(t_b, -1, np.int32)
            src[:n_seq] = np.arange(n_seq)
            pos = np.zeros(t_b, np.int32)
            slots = np.zeros(t_b, np.int32)
            p = starts + k
            pos[:n_seq] = p
            slots[:n_seq] = blocks[np.arange(n_seq), p // bs] * bs + p % bs
            params = feed["params"].copy()
            params[:n_seq, 4] += k  # the sample's step: the token's index among the generated
            feed.update({f"src{k}": src, f"pos{k}": pos, f"slots{k}": slots, f"params{k}": params})

    def launch(self, rows: Sequence[StepRow], steps: int = 1) -> hetero.StartedRun:
        """Start one step over ``rows`` now (on the caller's event loop); its result holds the next
        token of each in its first ``len(rows)`` entries. A row with ``src`` reads the step started
        just before this one.

        ``steps`` > 1: that many decode steps in one run (every row one token, and each sequence's
        cache room for ``steps`` positions reserved); the result is a tuple of ``steps`` such arrays,
        each step's rows embedding the ids the step before sampled, on the GPU.
        """
        feed = self.feed(rows, steps)  # checks steps
        if steps == 1:
            return self.runtime.start(self.step_graph, **feed)
        graph = self._steps_graphs.get(steps)
        if graph is None:
            graph = self._steps_graphs[steps] = _steps_graph(self, steps)
        return self.runtime.start(graph, **feed)

    async def step(self, rows: Sequence[StepRow]) -> np.ndarray:
        """Run one step over ``rows``: the next token of each (int32 [len(rows)])."""
        out = await self.launch(rows).result()
        return np.asarray(out[:len(rows)])

    @property
    def chains_in_order(self) -> bool:
        """Whether steps started back to back run on the GPU in that order (one GPU recording
        thread), so that a row may take its token from the step before (``StepRow.src``)."""
        return self.runtime.options.gpu_threads == 1

    async def logits(self, key: Any, ids: Sequence[int], start: int) -> np.ndarray:
        """Feed ``ids`` of sequence ``key`` at positions ``start ..``; the logits of every row ([n, vocab])."""
        f = self.feed([StepRow(key, ids, start)])
        f["last"] = np.arange(len(f["ids"]), dtype=np.int32)
        out = await self.runtime.run(self.logits_graph, **f)
        return np.asarray(out[:len(ids)])

    def rows_for_logits(self) -> int:
        """Most rows one logits pass returns within the adapter's binding limit."""
        limit = int(device_of(self.runtime).limits["max-storage-buffer-binding-size"])
        return max(1, min(DEFAULT_MAX_BATCH_TOKENS, limit // (4 * self.config.vocab_size) // 2))


def default_num_blocks(config: LlamaConfig, runtime: hetero.Runtime, kv_cache_bytes: int | None, *,
                       block_size: int = DEFAULT_BLOCK_SIZE, kv_dtype: str = "f32") -> int:
    """How many KV blocks ``kv_cache_bytes`` holds (default: a share of the runtime's memory budget).

    Fewer when one layer's K (or V) tensor of that many blocks would pass the adapter's
    ``max-storage-buffer-binding-size``: each is one buffer bound whole.
    """
    dtype_bytes = 2 if kv_dtype == "f16" else 4
    dev = device_of(runtime)
    per_layer_limit = int(dev.limits["max-storage-buffer-binding-size"])
    if kv_cache_bytes is None:
        if str(dev.summary.get("type", "")).upper() == "CPU":
            kv_cache_bytes = CPU_KV_CACHE_BYTES
        else:
            kv_cache_bytes = default_kv_cache_bytes(runtime.memory_stats().budget_bytes, per_layer_limit,
                                                    2 * config.num_layers)
    blocks = kv_pool_size(config, int(kv_cache_bytes), dtype_bytes, block_size) - 1  # the scratch block
    if blocks < 1:
        raise KVCacheFullError(f"kv cache: kv_cache_bytes {kv_cache_bytes} holds no block besides the scratch "
                               f"block ({kv_block_bytes(config, block_size, dtype_bytes)} bytes a block for this "
                               "model); raise kv_cache_bytes", 1, 0, 0)
    # one layer's K (or V) is one buffer: at most the adapter's binding size
    row = block_size * config.num_kv_heads * config.head_dim * dtype_bytes
    most = per_layer_limit // row - 1
    return max(1, min(blocks, most))

