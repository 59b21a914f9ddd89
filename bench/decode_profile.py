"""What bounds a decode step: each decoder op alone on the GPU, the whole step, and the host's replay of it.

    python -m bench decode_profile [--shape smollm2-135m|qwen2.5-0.5b|llama-1b|tiny] [--layers N]
                                   [--kinds f16,q8_0,q4_1] [--batches 1,64] [--context 128]
                                   [--min-ms 20] [--repeat 3] [--steps 100] [--copy-mb 256] [--no-sweep]

Random weights of the shape, built with numpy straight in the kernels' packed formats
(:mod:`hetero.kernels.quant`: random quantized words and small scales; no torch): each
linear layer of the kind, the tied embedding / output head in the kind too except for
Q4_1, whose head is Q8_0 as in SmolLM2's own GGUF file. At each batch (decode rows: one
row per sequence, each sequence ``--context`` tokens into a paged KV cache) and kind:

* **op lines**, one per decoder op as the LLM's step calls it (``embedding``; per layer
  ``qkv`` with the RMSNorm folded in (and Qwen2's biases), ``rope_kv``, ``attention``,
  ``o`` with the residual, ``gate_up`` with SwiGLU, ``down`` with the residual; then
  ``gather_rows``, ``head`` with the final norm, greedy ``sample``; and ``qkv_rope_kv``, the
  QKV projection with RoPE and the KV write fused (``linear_rope_kv``: one dispatch where
  qkv + rope_kv are two; not in the step's sums)): µs a call, the
  dispatches a call records, the bytes it must read and write once, GB/s, and the roofline
  fraction against the device copy's bandwidth measured in the same run. A call's time is
  one submission of K calls (the first recorded, the rest repeating its dispatches into the
  same compute pass, so they wait on each other as a step's do), less an empty submission's
  round trip, over K; K fills ``--min-ms``; best of ``--repeat``. Linear ops at M <= 8 are
  timed with both GEMV kernels (``impl`` ``lanes``, the default, and ``units``, the earlier
  one), and, unless ``--no-sweep``, over a grid of the lanes kernel's knobs (``sweep`` lines:
  lanes sized for 1, 2 or 4 chunks a lane, 1 or 2 rows a slot, 64 or 128 threads). Each
  linear op's result is checked against numpy on the dequantized weights once (``check``).
* **a step line** per impl: the dispatches of a whole step of ``--layers`` layers (counted
  on a recorded step) and the sum of its ops' µs.
* **a replay line** per impl: the step as the LLM runs it, one captured GPU stage fed by
  host arrays each run, ``--steps`` runs after a warm-up: median wall µs a step, GPU µs a
  step (timestamps around the stage, ``Runtime(gpu_timing=True)``), the host's µs to replay
  the stage (from its start to its last dispatch recorded, from the stage's statistics)
  and that over the dispatches, and the recording thread's CPU µs a step.

The device copy line (``copy``): ``copy_buffer_to_buffer`` of ``--copy-mb`` MiB, read +
written bytes over its time. ``--shape tiny`` (hidden 128, vocabulary 2048) with
``--layers 1`` is the smoke test for a software adapter (lavapipe); its figures say
nothing about speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import statistics
import time
import weakref
from typing import Any, Callable

import anyio
import numpy as np

import hetero
import hetero.kernels.decoder as D
from hetero.kernels.quant import PackedWeight, concat_rows, unpack
from hetero.lowlevel import GPUContext, Tensor, device_of
from bench._common import Spy, adapter_fields, emitter, empty_round_trip, run_once, submit_timed
from bench._common import thread_cpu_ns
from bench.replay_cost import threads_by_kind

emit = emitter("decode_profile")


@dataclasses.dataclass(frozen=True)
class Shape:
    vocab: int
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    eps: float = 1e-5
    theta: float = 10000.0


SHAPES = {
    "smollm2-135m": Shape(49152, 576, 1536, 30, 9, 3, 64, theta=100000.0),
    "qwen2.5-0.5b": Shape(151936, 896, 4864, 24, 14, 2, 64, qkv_bias=True, eps=1e-6, theta=1000000.0),
    "llama-1b": Shape(49152, 2048, 8192, 16, 32, 8, 64, theta=100000.0),  # llm-anchor's 1.07B Llama shape
    "tiny": Shape(2048, 128, 256, 2, 4, 2, 32),
}
BLOCK_SIZE = 16
LAYER_OPS = ("qkv", "rope_kv", "attention", "o", "gate_up", "down")
LINEAR_OPS = ("qkv", "qkv_rope_kv", "o", "gate_up", "down", "head")


# -- random weights in the packed formats ------------------------------------------------------
def random_weight(kind: str, rows: int, cols: int, rng: np.random.Generator, scale: float = 0.02) -> PackedWeight:
    """A [rows, cols] weight of ``kind`` with random values: random quantized words and scales."""
    if kind in ("f16", "f32"):
        kp = -(-cols // 8) * 8
        w = np.zeros((rows, kp), np.float16 if kind == "f16" else np.float32)
        for r0 in range(0, rows, 8192):  # a float32 temporary of a few rows at a time
            r1 = min(rows, r0 + 8192)
            w[r0:r1, :cols] = rng.standard_normal((r1 - r0, cols), np.float32) * scale
        return PackedWeight(kind, (rows, cols), w=w.view(np.uint32) if kind == "f16" else w)
    nb = cols // 32
    words = cols // 4 if kind == "q8_0" else cols // 8
    qs = rng.integers(0, 1 << 32, (rows, words), dtype=np.uint32)
    d = (rng.random((rows, nb), np.float32) + 0.5) * (scale / (64 if kind == "q8_0" else 4))
    if kind == "q4_1":
        return PackedWeight(kind, (rows, cols), qs=qs, d=d, m=-8.0 * d)
    return PackedWeight(kind, (rows, cols), qs=qs, d=d)


@dataclasses.dataclass
class Model:
    shape: Shape
    kind: str
    embed: PackedWeight  # the tied head
    qkv: PackedWeight
    qkv_bias: np.ndarray | None
    o: PackedWeight
    gate: PackedWeight
    up: PackedWeight
    down: PackedWeight
    norm: np.ndarray
    inv_freq: np.ndarray

    @property
    def head_kind(self) -> str:
        return self.embed.kind


def random_model(shape: Shape, kind: str, seed: int = 0) -> Model:
    """One layer's weights (every layer of the step binds them: same shapes, same work) and the embedding."""
    rng = np.random.default_rng(seed)
    s = shape
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    qkv = concat_rows([random_weight(kind, q, s.hidden, rng), random_weight(kind, kv, s.hidden, rng),
                       random_weight(kind, kv, s.hidden, rng)])
    bias = rng.standard_normal(q + 2 * kv, np.float32) * 0.1 if s.qkv_bias else None
    embed = random_weight("q8_0" if kind == "q4_1" else kind, s.vocab, s.hidden, rng)
    inv = (1.0 / s.theta ** (np.arange(0, s.head_dim, 2, dtype=np.float64) / s.head_dim)).astype(np.float32)
    return Model(shape, kind, embed, qkv, bias, random_weight(kind, s.hidden, q, rng),
                 random_weight(kind, s.ffn, s.hidden, rng), random_weight(kind, s.ffn, s.hidden, rng),
                 random_weight(kind, s.hidden, s.ffn, rng), (rng.random(s.hidden, np.float32) + 0.5),
                 inv)


@dataclasses.dataclass(frozen=True, eq=False)
class Resident:
    embed: D.GPUWeight
    qkv: D.GPUWeight
    qkv_bias: Tensor | None
    o: D.GPUWeight
    gate: D.GPUWeight
    up: D.GPUWeight
    down: D.GPUWeight
    norm: Tensor
    inv_freq: Tensor
    caches: tuple[tuple[Tensor, Tensor], ...]  # a (K, V) pair a layer


# per device: (id(model), layers, blocks) -> (the model, kept so that its id stays its own; its weights there)
_RESIDENT: weakref.WeakKeyDictionary[Any, dict[tuple[int, int, int], tuple[Model, Resident]]] = \
    weakref.WeakKeyDictionary()


def resident(gpu: Any, model: Model, layers: int, num_blocks: int) -> Resident:
    """``model`` on ``gpu``'s device (uploaded once), with ``layers`` KV-cache pairs of ``num_blocks`` blocks."""
    per = _RESIDENT.setdefault(device_of(gpu), {})
    key = (id(model), layers, num_blocks)
    if key not in per:
        s = model.shape
        up = D.upload_weight
        per[key] = model, Resident(
            up(gpu, model.embed), up(gpu, model.qkv),
            None if model.qkv_bias is None else gpu.resident(model.qkv_bias), up(gpu, model.o), up(gpu, model.gate),
            up(gpu, model.up), up(gpu, model.down), gpu.resident(model.norm), gpu.resident(model.inv_freq),
            tuple(D.kv_cache(gpu, num_blocks, BLOCK_SIZE, s.kv_heads, s.head_dim) for _ in range(layers)))
    return per[key][1]


# -- the inputs of a decode step ---------------------------------------------------------------
def step_inputs(shape: Shape, batch: int, context: int) -> tuple[dict[str, np.ndarray], int]:
    """The host arrays of a decode step of ``batch`` sequences at position ``context`` (the engine's
    ``feed``), and the KV blocks they need (block 0 is scratch)."""
    per_seq = -(-(context + 1) // BLOCK_SIZE)
    width = 1 << max(0, (per_seq - 1).bit_length())
    tables = np.zeros((batch, width), np.int32)
    tables[:, :per_seq] = 1 + np.arange(batch * per_seq, dtype=np.int32).reshape(batch, per_seq)
    pos = np.full(batch, context, np.int32)
    slots = tables[np.arange(batch), pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    rng = np.random.default_rng(1)
    return {"ids": rng.integers(0, shape.vocab, batch).astype(np.int32), "pos": pos,
            "slots": slots.astype(np.int32), "tables": tables, "seqs": np.arange(batch, dtype=np.int32),
            "last": np.arange(batch, dtype=np.int32), "params": D.sampling_params(0.0, rows=batch)}, \
        1 + batch * per_seq


def forward(gpu: Any, r: Resident, shape: Shape, layers: int, ids: Any, pos: Any, slots: Any, tables: Any,
            seqs: Any, last: Any, params: Any) -> Tensor:
    """The LLM's decode step (pipelines.llm_engine's forward): embedding, six dispatches a layer, the
    last rows, the head with the final norm, greedy sampling. The QKV projection and RoPE + KV write
    stay two dispatches here so that each is timed alone; the engine fuses them (linear_rope_kv) for
    steps of at most GEMV_MAX_M rows. Split attention goes to the output projection uncombined where
    the engine's would (ATTN_COMBINE_IN_LINEAR)."""
    eps = shape.eps
    h = D.embedding(gpu, r.embed, ids)
    for n in range(layers):
        kc, vc = r.caches[n]
        qkv = D.linear(gpu, h, r.qkv, bias=r.qkv_bias, norm=r.norm, eps=eps)
        q = D.rope_kv(gpu, qkv, pos, r.inv_freq, kc, vc, slots, heads=shape.heads)
        att = D.paged_attention(gpu, q, kc, vc, tables, seqs, pos, combine=not D.ATTN_COMBINE_IN_LINEAR)
        h = D.linear(gpu, att, r.o, residual=h)
        mlp = D.linear_swiglu(gpu, h, r.gate, r.up, norm=r.norm, eps=eps)
        h = D.linear(gpu, mlp, r.down, residual=h)
    logits = D.linear(gpu, D.gather_rows(gpu, h, last), r.embed, norm=r.norm, eps=eps)
    return D.sample(gpu, logits, params)


# -- the ops alone -----------------------------------------------------------------------------
@dataclasses.dataclass
class Op:
    name: str
    record: Callable[[Any], Tensor]
    nbytes: int
    reference: Callable[[], np.ndarray] | None = None  # numpy float64 result (linear ops)


def nbytes_of(w: PackedWeight) -> int:
    return sum(a.nbytes for a in w.arrays.values())


def op_cases(ctx: GPUContext, model: Model, r: Resident, batch: int, inputs: dict[str, np.ndarray],
             context: int) -> list[Op]:
    """Each op of a step at ``batch`` decode rows, over resident random activations of its shapes."""
    s = model.shape
    rng = np.random.default_rng(2)
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    t = batch

    def act(*shape: int) -> tuple[np.ndarray, Tensor]:
        a = rng.standard_normal(shape, np.float32)
        return a, ctx.resident(a)

    h, h_t = act(t, s.hidden)
    qkv_a, qkv_t = act(t, q + 2 * kv)
    att, att_t = act(t, s.heads, s.head_dim)
    mlp, mlp_t = act(t, s.ffn)
    logits, logits_t = act(t, s.vocab)
    dev_in = {k: ctx.resident(v) for k, v in inputs.items()}
    kc, vc = r.caches[0]
    g = model.norm.astype(np.float64)

    def ref_linear(x: np.ndarray, w: PackedWeight, *, norm: bool = False, bias: Any = None,
                   residual: Any = None) -> Callable[[], np.ndarray]:
        def f() -> np.ndarray:
            x64 = x.reshape(x.shape[0], -1).astype(np.float64)
            if norm:
                x64 = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + s.eps) * g
            y = x64 @ unpack(w).astype(np.float64).T
            return y + (0 if bias is None else bias) + (0 if residual is None else residual)
        return f

    def ref_swiglu() -> np.ndarray:
        a = ref_linear(h, model.gate, norm=True)()
        b = ref_linear(h, model.up, norm=True)()
        return a / (1.0 + np.exp(-a)) * b

    f4 = 4
    act_bytes = t * s.hidden * f4
    keys = t * (context + 1) * kv * f4 * 2
    emb_w = nbytes_of(model.embed) // s.vocab  # bytes of one table row
    return [
        Op("embedding", lambda gpu: D.embedding(gpu, r.embed, dev_in["ids"]), t * (emb_w + s.hidden * f4)),
        Op("qkv", lambda gpu: D.linear(gpu, h_t, r.qkv, bias=r.qkv_bias, norm=r.norm, eps=s.eps),
           nbytes_of(model.qkv) + act_bytes + t * (q + 2 * kv) * f4,
           ref_linear(h, model.qkv, norm=True, bias=model.qkv_bias)),
        Op("qkv_rope_kv", lambda gpu: D.linear_rope_kv(gpu, h_t, r.qkv, dev_in["pos"], r.inv_freq, kc, vc,
                                                       dev_in["slots"], heads=s.heads, bias=r.qkv_bias, norm=r.norm,
                                                       eps=s.eps),
           nbytes_of(model.qkv) + act_bytes + t * (q + 2 * kv) * f4),
        Op("rope_kv", lambda gpu: D.rope_kv(gpu, qkv_t, dev_in["pos"], r.inv_freq, kc, vc, dev_in["slots"],
                                            heads=s.heads), 2 * t * (q + 2 * kv) * f4),
        Op("attention", lambda gpu: D.paged_attention(gpu, att_t, kc, vc, dev_in["tables"], dev_in["seqs"],
                                                      dev_in["pos"]), keys + 2 * t * q * f4),
        Op("o", lambda gpu: D.linear(gpu, att_t, r.o, residual=h_t), nbytes_of(model.o) + t * q * f4 + 2 * act_bytes,
           ref_linear(att, model.o, residual=h)),
        Op("gate_up", lambda gpu: D.linear_swiglu(gpu, h_t, r.gate, r.up, norm=r.norm, eps=s.eps),
           nbytes_of(model.gate) + nbytes_of(model.up) + act_bytes + t * s.ffn * f4, ref_swiglu),
        Op("down", lambda gpu: D.linear(gpu, mlp_t, r.down, residual=h_t),
           nbytes_of(model.down) + t * s.ffn * f4 + 2 * act_bytes, ref_linear(mlp, model.down, residual=h)),
        Op("gather_rows", lambda gpu: D.gather_rows(gpu, h_t, dev_in["last"]), 2 * act_bytes),
        Op("head", lambda gpu: D.linear(gpu, h_t, r.embed, norm=r.norm, eps=s.eps),
           nbytes_of(model.embed) + act_bytes + t * s.vocab * f4, ref_linear(h, model.embed, norm=True)),
        Op("sample", lambda gpu: D.sample(gpu, logits_t, dev_in["params"]), t * s.vocab * f4),
    ]


class Timer:
    """Seconds a call of an op, one submission of K calls (see the module doc)."""

    def __init__(self, dev: Any, min_ms: float, repeat: int, max_k: int) -> None:
        self.dev, self.min_s, self.repeat, self.max_k = dev, min_ms / 1e3, repeat, max_k
        self.empty = empty_round_trip(dev)

    def submission(self, record: Callable[[Any], Any], k: int) -> tuple[float, int]:
        """(seconds for one submission of k calls, dispatches a call)."""
        ctx = GPUContext(self.dev, "decode_profile")
        spy = Spy(ctx)
        record(spy)
        for _ in range(k - 1):
            for kernel, groups, bindings in spy.dispatches:
                ctx.dispatch(kernel, groups, *bindings)
        return submit_timed(self.dev, ctx), len(spy.dispatches)

    def per_call(self, record: Callable[[Any], Any]) -> tuple[float, int]:
        one, n = self.submission(record, 1)  # compiles, and sizes K
        one, _ = self.submission(record, 1)
        k = max(1, min(self.max_k, math.ceil(self.min_s / max(one - self.empty, 1e-6))))
        best = min(self.submission(record, k)[0] for _ in range(self.repeat))
        return max(best - self.empty, 1e-9) / k, n


def copy_bandwidth(timer: Timer, nbytes: int) -> float:
    """GB/s of a device-to-device buffer copy: bytes read plus written, over its time (best of repeat)."""
    ctx = GPUContext(timer.dev, "decode_profile.copy")
    a, b = ctx.empty((nbytes // 4,), np.float32), ctx.empty((nbytes // 4,), np.float32)
    ctx.settle(ran=False)

    def run(k: int) -> float:
        c = GPUContext(timer.dev, "decode_profile.copy")
        enc = c.encoder
        for _ in range(k):
            enc.copy_buffer_to_buffer(a.buffer, a.offset, b.buffer, b.offset, nbytes)
        return submit_timed(timer.dev, c)

    one = run(1)
    k = max(1, min(100, math.ceil(timer.min_s / max(one - timer.empty, 1e-6))))
    best = min(run(k) for _ in range(timer.repeat))
    ctx.release_blocks()
    return 2 * nbytes * k / max(best - timer.empty, 1e-9) / 1e9


class Knobs:
    """Set decoder module attributes for a while (the GEMV impl, the lanes kernel's layout)."""

    def __init__(self, **values: Any) -> None:
        self.values = values
        self.saved: dict[str, Any] = {}

    def __enter__(self) -> None:
        for name, v in self.values.items():
            self.saved[name] = getattr(D, name)
            setattr(D, name, v)

    def __exit__(self, *exc: Any) -> None:
        for name, v in self.saved.items():
            setattr(D, name, v)


SWEEP = [dict(GEMV_LANE_CHUNKS=c, GEMV_SLOT_ROWS=r, GEMV_LANES_THREADS=t)
         for c, r, t in itertools.product((1, 2, 4), (1, 2), (64, 128))]


def profile_ops(timer: Timer, model: Model, batch: int, context: int, layers: int, copy_gbs: float,
                sweep: bool, label: dict[str, Any]) -> dict[str, dict[str, tuple[float, int]]]:
    """The op lines at one batch and kind; {impl: {op: (seconds a call, dispatches a call)}}."""
    inputs, blocks = step_inputs(model.shape, batch, context)
    ctx = GPUContext(timer.dev, "decode_profile.setup")
    r = resident(ctx, model, layers, blocks)
    ops = op_cases(ctx, model, r, batch, inputs, context)
    ctx.settle(ran=False)
    impls = ("lanes", "units") if batch <= D.GEMV_MAX_M else ("lanes",)
    out: dict[str, dict[str, tuple[float, int]]] = {impl: {} for impl in impls}
    for op in ops:
        linear = op.name in LINEAR_OPS
        for impl in impls if linear else impls[:1]:
            with Knobs(GEMV_IMPL=impl):
                sec, n = timer.per_call(op.record)
                check: dict[str, Any] = {}
                if op.reference is not None and batch <= D.GEMV_MAX_M:
                    got = np.asarray(run_once(timer.dev, op.record), np.float64).reshape(batch, -1)
                    want = op.reference().reshape(batch, -1)
                    err = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
                    check = {"max_rel_err": float(f"{err:.3g}"), "check": "ok" if err < 1e-3 else "FAIL"}
            for i in (impl,) if linear else impls:
                out[i][op.name] = (sec, n)
            gbs = op.nbytes / sec / 1e9
            emit(**label, batch=batch, op=op.name, impl=impl if linear and batch <= D.GEMV_MAX_M else "-",
                 dispatches=n, us=round(sec * 1e6, 2), bytes=op.nbytes, gb_s=round(gbs, 1),
                 roofline=round(gbs / copy_gbs, 4), **check)
        if sweep and linear and batch <= D.GEMV_MAX_M:
            for knobs in SWEEP:
                with Knobs(GEMV_IMPL="lanes", **knobs):
                    sec, n = timer.per_call(op.record)
                gbs = op.nbytes / sec / 1e9
                emit(**label, batch=batch, op=op.name, impl="lanes", sweep={k.lower(): v for k, v in knobs.items()},
                     us=round(sec * 1e6, 2), gb_s=round(gbs, 1), roofline=round(gbs / copy_gbs, 4))
    return out


# -- the whole step ----------------------------------------------------------------------------
def step_dispatches(dev: Any, model: Model, batch: int, context: int, layers: int, impl: str) -> dict[str, int]:
    """How many dispatches of each op a recorded step has (by the ops' kernel labels)."""
    inputs, blocks = step_inputs(model.shape, batch, context)
    ctx = GPUContext(dev, "decode_profile.count")
    r = resident(ctx, model, layers, blocks)
    spy = Spy(ctx)
    with Knobs(GEMV_IMPL=impl):
        forward(spy, r, model.shape, layers, **{k: ctx.upload(v) for k, v in inputs.items()})
    ctx.discard()
    counts: dict[str, int] = {}
    for label in spy.labels:
        counts[label] = counts.get(label, 0) + 1
    return counts


def replay(rt: hetero.Runtime, model: Model, batch: int, context: int, layers: int, impl: str,
           steps: int) -> dict[str, float]:
    """The step as one captured GPU stage, ``steps`` runs: medians of wall, GPU, replay and recording-thread CPU µs."""
    inputs, blocks = step_inputs(model.shape, batch, context)

    def stage(gpu: Any, ids: Any, pos: Any, slots: Any, tables: Any, seqs: Any, last: Any, params: Any,
              impl: str) -> Tensor:
        with Knobs(GEMV_IMPL=impl):
            return forward(gpu, resident(gpu, model, layers, blocks), model.shape, layers, ids, pos, slots, tables,
                           seqs, last, params)

    g = hetero.Graph("decode_profile.step")
    names = list(inputs)
    g.output(g.gpu(stage, *[g.input(n) for n in names], impl, name="step", capture=True))
    wall, gpu_us, rep, cpu = [], [], [], []

    async def main() -> None:
        for _ in range(3):  # captured, then replayed with its bind groups made
            await rt.run(g, **inputs)
        rec = threads_by_kind()["record"]
        for _ in range(steps):
            c0, w0 = sum(thread_cpu_ns(i) for i in rec), time.perf_counter_ns()
            await rt.run(g, **inputs)
            w1, c1 = time.perf_counter_ns(), sum(thread_cpu_ns(i) for i in rec)
            st = rt.stats().stage("step")
            assert st.capture == "replayed", st.capture
            wall.append((w1 - w0) / 1e3)
            cpu.append((c1 - c0) / 1e3)
            if st.gpu_ms is not None:
                gpu_us.append(st.gpu_ms * 1e3)
            if st.started is not None and st.recorded is not None:
                rep.append((st.recorded - st.started) * 1e6)

    anyio.run(main)
    med = statistics.median
    return {"wall_us": med(wall), "gpu_us": med(gpu_us) if gpu_us else math.nan,
            "replay_us": med(rep) if rep else math.nan, "record_thread_cpu_us": med(cpu)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=None, help="layers of the step (default: the shape's)")
    p.add_argument("--kinds", default="f16,q8_0,q4_1", help="weight kinds (default: %(default)s)")
    p.add_argument("--batches", default="1,64", help="decode rows a step (default: %(default)s)")
    p.add_argument("--context", type=int, default=128, help="tokens in each sequence's cache (default: %(default)s)")
    p.add_argument("--min-ms", type=float, default=20.0, help="GPU time a timed submission fills (default: %(default)s)")
    p.add_argument("--max-calls", type=int, default=2000, help="most calls a timed submission holds")
    p.add_argument("--repeat", type=int, default=3, help="timed submissions an op, the best kept (default: %(default)s)")
    p.add_argument("--steps", type=int, default=100, help="replayed steps timed (default: %(default)s)")
    p.add_argument("--copy-mb", type=int, default=256, help="MiB of the device copy (default: %(default)s)")
    p.add_argument("--no-sweep", action="store_true", help="no grid of the lanes GEMV's knobs")
    args = p.parse_args(argv)
    shape = SHAPES[args.shape]
    layers = args.layers or shape.layers
    kinds = [k for k in args.kinds.split(",") if k]
    batches = [int(b) for b in args.batches.split(",") if b]
    for k in kinds:
        if k not in ("f32", "f16", "q8_0", "q4_0", "q4_1"):
            p.error(f"unknown weight kind {k!r}")
    # The ops are timed in contexts of the bench's own on one runtime's device; the step replays on
    # another's, which times its stages (the ops' contexts never resolve the timestamps that
    # calibrate hetero's cost model, so they would use up that device's timer).
    with hetero.Runtime(placement="gpu") as rt_ops, hetero.Runtime(placement="gpu", gpu_timing=True) as rt:
        dev = device_of(rt_ops)
        emit(figure="adapter", **adapter_fields(dev), subgroups="subgroup" in dev.features,
             shape=args.shape, layers=layers, context=args.context)
        timer = Timer(dev, args.min_ms, args.repeat, args.max_calls)
        copy_gbs = copy_bandwidth(timer, args.copy_mb << 20)
        emit(figure="copy", mib=args.copy_mb, gb_s=round(copy_gbs, 1), empty_submission_us=round(timer.empty * 1e6, 1))
        for kind in kinds:
            model = random_model(shape, kind)
            for batch in batches:
                label = {"kind": kind, "head_kind": model.head_kind}
                per = profile_ops(timer, model, batch, args.context, layers, copy_gbs, not args.no_sweep, label)
                for impl, ops in per.items():
                    counts = step_dispatches(dev, model, batch, args.context, layers, impl)
                    layer_us = sum(ops[o][0] for o in LAYER_OPS) * 1e6
                    other_us = sum(ops[o][0] for o in ("embedding", "gather_rows", "head", "sample")) * 1e6
                    total = sum(counts.values())
                    emit(figure="step", **label, batch=batch, impl=impl, layers=layers, dispatches=total,
                         dispatches_per_layer=sum(ops[o][1] for o in LAYER_OPS),
                         sum_of_ops_us=round(layer_us * layers + other_us, 1), layer_us=round(layer_us, 1))
                    fig = replay(rt, model, batch, args.context, layers, impl, args.steps)
                    emit(figure="replay", **label, batch=batch, impl=impl, layers=layers, dispatches=total,
                         **{k: round(v, 1) for k, v in fig.items()},
                         replay_us_per_dispatch=round(fig["replay_us"] / total, 2),
                         host_share=round(1.0 - fig["gpu_us"] / fig["wall_us"], 3) if fig["gpu_us"] == fig["gpu_us"]
                         else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
