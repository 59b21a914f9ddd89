"""GPU time of hetero's BERT kernels (``hetero.kernels.nn``) at MiniLM shapes, beside torch (or numpy).

    python -m bench.nn [--batch 128] [--seq 128] [--ops softmax,gelu,...] [--repeat 5] [--min-ms 50]
                       [--check-batch 2] [--no-accuracy]

Shapes are all-MiniLM-L6-v2's: hidden 384 = 12 heads of 32, intermediate 1536, vocabulary
30522, here at ``--batch`` sequences of ``--seq`` tokens (default 128 x 128):

=============  ================================================  =====================================
op             hetero                                            reference (torch on CUDA)
=============  ================================================  =====================================
softmax        softmax of scores [B, 12, S, S]                   torch.softmax(x, -1)
softmax_mask   the same plus the padding mask [B, S] (additive)  torch.softmax(x + mask[:, None, None], -1)
layernorm      layernorm of [B, S, 384], eps 1e-12               F.layer_norm
add_layernorm  layernorm(x + residual): BERT's add & norm        F.layer_norm(x + r)
gelu           gelu of [B, S, 1536] (erf form)                   F.gelu
gelu_bias      gelu(x + bias), fused                             F.gelu(x + b)
add_bias       [B, S, 384] + bias                                x + b
add            [B, S, 384] + [B, S, 384]                         x + y
transpose      [B, S, 12, 32] -> [B, 12, S, 32]                  x.permute(0, 2, 1, 3).contiguous()
embedding      rows of a [30522, 384] table by ids [B, S]        F.embedding
attention      attention [B, 12, S, 32], padding mask, as        F.scaled_dot_product_attention with
               ``impl="auto"`` picks (its ``picked`` field)      the additive mask (1 - m) * finfo.min
attention_     the same, ``impl="fused"``: one online-softmax    the same
fused          kernel, one thread per query row
attention_     the same, ``impl="matmul"``: q @ k^T (matmul),    the same
matmul         softmax with scale and mask, probs @ v (matmul)
=============  ================================================  =====================================

Every input is uploaded once. For each op, K calls are recorded into one command encoder
with the low-level API (``hetero.GPUContext`` on the runtime's device; the outputs and
temporaries of the K calls share buffers, the i-th of a shape in one call with the i-th in
the next, so memory stays flat), submitted at once and waited for; the time
per call is (wall time - one empty submission's round trip) / K, best of ``--repeat``, with
K chosen so that one submission runs at least ``--min-ms``. GB/s counts the bytes an op must
read and write once (GB = 1e9 bytes); attention also reports GFLOP/s (4 B H S^2 D).

The reference is torch on CUDA in the same process (CUDA events over K calls) when torch with
CUDA is importable, else numpy on the host (float32, best of two calls). Correctness is
checked once per op: hetero's result for the first ``--check-batch`` sequences against
numpy in float64.
Padding: sequence b keeps S - (b mod 4) * S/8 tokens (up to 3/8 of a sequence is padding).

Then the accuracy of erf and gelu over a dense grid against Python's math.erf/erfc in
float64 (``--no-accuracy`` skips it).

One JSON line per figure: ``adapter``, ``empty_submission_ms``, then per op ``check``, the
hetero line, the reference's line and ``{"ratio": "hetero/<ref>", "value": t_ref / t_hetero}``
(> 1: hetero faster); then the ``accuracy`` lines.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

import hetero
import hetero.kernels.nn as nn
from hetero.lowlevel import Device
from bench._common import adapter_fields, cuda_seconds, emitter, empty_round_trip, run_once, submit_timed, torch_cuda

HIDDEN, HEADS, HEAD_DIM, INTERMEDIATE, VOCAB = 384, 12, 32, 1536, 30522
F32_MIN = float(np.finfo(np.float32).min)


emit = emitter("nn")


class SharedOutputs:
    """A GPUContext stand-in whose ``empty`` hands the i-th request of a shape in each call the
    same buffer: K recorded calls of an op write the same outputs and temporaries (WebGPU
    orders the dispatches), so memory stays flat, while two tensors of one shape within a call
    (attention's scores and probabilities) stay apart. ``next_call()`` starts a call."""

    def __init__(self, gpu: hetero.GPUContext) -> None:
        self._gpu = gpu
        self._outs: dict[tuple[Any, ...], hetero.Tensor] = {}
        self._seen: dict[tuple[Any, ...], int] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._gpu, name)

    def next_call(self) -> None:
        self._seen.clear()

    def empty(self, shape: Any, dtype: Any = np.float32) -> hetero.Tensor:
        base = (tuple(shape) if not isinstance(shape, int) else (shape,), np.dtype(dtype).str)
        i = self._seen.get(base, 0)
        self._seen[base] = i + 1
        key = base + (i,)
        if key not in self._outs:
            self._outs[key] = self._gpu.empty(shape, dtype)
        return self._outs[key]


@dataclass
class Case:
    """One op at MiniLM shapes: host inputs, how to record it, its references."""

    name: str
    shape: str
    inputs: dict[str, np.ndarray]
    record: Callable[[Any, dict[str, hetero.Tensor]], hetero.Tensor]
    reference: Callable[[dict[str, np.ndarray]], np.ndarray]  # numpy float64, on the first sequences
    torch_fn: Callable[[Any, Any, dict[str, Any]], Any]  # (torch, torch.nn.functional, inputs)
    numpy_fn: Callable[[dict[str, np.ndarray]], Any]
    nbytes: int
    flops: int = 0
    batched: frozenset[str] = field(default_factory=frozenset)  # inputs with the batch as axis 0
    tol: tuple[float, float] = (1e-5, 1e-6)  # rtol, atol


# -- numpy references ---------------------------------------------------------------------------
def np_softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def np_layernorm(v: np.ndarray, g: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mu = v.mean(axis=-1, keepdims=True)
    return (v - mu) / np.sqrt(((v - mu) ** 2).mean(axis=-1, keepdims=True) + eps) * g + b


_ERFC = np.vectorize(math.erfc, otypes=[np.float64])


def np_gelu(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return 0.5 * x * _ERFC(-x / math.sqrt(2.0))


def np_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, m: np.ndarray, dtype: Any = np.float64) -> np.ndarray:
    """HF BERT: softmax(q k^T / sqrt(D) + (1 - m) * finfo.min) v."""
    s = q.astype(dtype) @ np.swapaxes(k.astype(dtype), -1, -2) * dtype(1.0 / math.sqrt(q.shape[-1]))
    s = s + ((1.0 - m.astype(dtype)) * dtype(F32_MIN))[:, None, None, :]
    return np_softmax(s) @ v.astype(dtype)


def f64(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float64)


# -- cases --------------------------------------------------------------------------------------
def padding_mask(b: int, s: int) -> np.ndarray:
    m = np.ones((b, s), np.float32)
    for i in range(b):
        m[i, s - (i % 4) * (s // 8):] = 0.0
    return m


def cases(b: int, s: int, rng: np.random.Generator) -> list[Case]:
    def r(*shape: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)).astype(np.float32)

    mask = padding_mask(b, s)
    add_mask = (1.0 - mask) * np.float32(F32_MIN)
    x_h, r_h, x_i = r(b, s, HIDDEN), r(b, s, HIDDEN), r(b, s, INTERMEDIATE, scale=2.0)
    gamma, beta, bias_h, bias_i = r(HIDDEN), r(HIDDEN), r(HIDDEN), r(INTERMEDIATE)
    scores = r(b, HEADS, s, s, scale=3.0)
    heads = r(b, s, HEADS, HEAD_DIM)
    q, k, v = (r(b, HEADS, s, HEAD_DIM) for _ in range(3))
    table = r(VOCAB, HIDDEN, scale=0.05)
    ids = rng.integers(0, VOCAB, (b, s)).astype(np.int32)
    n_h, n_i, n_s = b * s * HIDDEN * 4, b * s * INTERMEDIATE * 4, scores.nbytes
    eps = 1e-12

    return [
        Case("softmax", f"[{b}, {HEADS}, {s}, {s}]", {"x": scores}, lambda g, t: nn.softmax(g, t["x"]),
             lambda h: np_softmax(f64(h["x"])), lambda torch, F, t: torch.softmax(t["x"], -1),
             lambda h: np_softmax(h["x"]), 2 * n_s, batched=frozenset({"x"})),
        Case("softmax_mask", f"[{b}, {HEADS}, {s}, {s}] + mask [{b}, {s}]", {"x": scores, "m": add_mask},
             lambda g, t: nn.softmax(g, t["x"], mask=t["m"]),
             lambda h: np_softmax(f64(h["x"]) + f64(h["m"])[:, None, None, :]),
             lambda torch, F, t: torch.softmax(t["x"] + t["m"][:, None, None, :], -1),
             lambda h: np_softmax(h["x"] + h["m"][:, None, None, :]), 2 * n_s, batched=frozenset({"x", "m"})),
        Case("layernorm", f"[{b}, {s}, {HIDDEN}]", {"x": x_h, "g": gamma, "b": beta},
             lambda g, t: nn.layernorm(g, t["x"], t["g"], t["b"], eps=eps),
             lambda h: np_layernorm(f64(h["x"]), h["g"], h["b"], eps),
             lambda torch, F, t: F.layer_norm(t["x"], (HIDDEN,), t["g"], t["b"], eps),
             lambda h: np_layernorm(h["x"], h["g"], h["b"], eps), 2 * n_h, batched=frozenset({"x"}), tol=(1e-5, 2e-5)),
        Case("add_layernorm", f"[{b}, {s}, {HIDDEN}] x 2", {"x": x_h, "r": r_h, "g": gamma, "b": beta},
             lambda g, t: nn.layernorm(g, t["x"], t["g"], t["b"], eps=eps, residual=t["r"]),
             lambda h: np_layernorm(f64(h["x"]) + f64(h["r"]), h["g"], h["b"], eps),
             lambda torch, F, t: F.layer_norm(t["x"] + t["r"], (HIDDEN,), t["g"], t["b"], eps),
             lambda h: np_layernorm(h["x"] + h["r"], h["g"], h["b"], eps), 3 * n_h,
             batched=frozenset({"x", "r"}), tol=(1e-5, 2e-5)),
        Case("gelu", f"[{b}, {s}, {INTERMEDIATE}]", {"x": x_i}, lambda g, t: nn.gelu(g, t["x"]),
             lambda h: np_gelu(h["x"]), lambda torch, F, t: F.gelu(t["x"]),
             lambda h: h["x"] * 0.5 * (1.0 + np.tanh(0.7978845608 * (h["x"] + 0.044715 * h["x"] ** 3))),
             2 * n_i, batched=frozenset({"x"}), tol=(1e-6, 1e-30)),
        Case("gelu_bias", f"[{b}, {s}, {INTERMEDIATE}] + bias", {"x": x_i, "b": bias_i},
             lambda g, t: nn.gelu(g, t["x"], bias=t["b"]), lambda h: np_gelu(h["x"] + h["b"]),  # float32 sum, as fused
             lambda torch, F, t: F.gelu(t["x"] + t["b"]),
             lambda h: (lambda y: y * 0.5 * (1.0 + np.tanh(0.7978845608 * (y + 0.044715 * y ** 3))))(h["x"] + h["b"]),
             2 * n_i, batched=frozenset({"x"}), tol=(1e-6, 1e-30)),
        Case("add_bias", f"[{b}, {s}, {HIDDEN}] + bias", {"x": x_h, "b": bias_h},
             lambda g, t: nn.add_bias(g, t["x"], t["b"]), lambda h: f64(h["x"]) + h["b"],
             lambda torch, F, t: t["x"] + t["b"], lambda h: h["x"] + h["b"], 2 * n_h, batched=frozenset({"x"})),
        Case("add", f"[{b}, {s}, {HIDDEN}] x 2", {"x": x_h, "y": r_h}, lambda g, t: nn.add(g, t["x"], t["y"]),
             lambda h: f64(h["x"]) + h["y"], lambda torch, F, t: t["x"] + t["y"], lambda h: h["x"] + h["y"],
             3 * n_h, batched=frozenset({"x", "y"})),
        Case("transpose", f"[{b}, {s}, {HEADS}, {HEAD_DIM}] -> (0, 2, 1, 3)", {"x": heads},
             lambda g, t: nn.transpose(g, t["x"], (0, 2, 1, 3)), lambda h: h["x"].transpose(0, 2, 1, 3),
             lambda torch, F, t: t["x"].permute(0, 2, 1, 3).contiguous(),
             lambda h: np.ascontiguousarray(h["x"].transpose(0, 2, 1, 3)), 2 * n_h,
             batched=frozenset({"x"}), tol=(0.0, 0.0)),
        Case("embedding", f"[{VOCAB}, {HIDDEN}] by ids [{b}, {s}]", {"t": table, "i": ids},
             lambda g, t: nn.embedding(g, t["t"], t["i"]), lambda h: h["t"][h["i"]],
             lambda torch, F, t: F.embedding(t["i"], t["t"]), lambda h: h["t"][h["i"]],
             2 * n_h + ids.nbytes, batched=frozenset({"i"}), tol=(0.0, 0.0)),
    ] + [attention_case(name, impl, b, s, q, k, v, mask, add_mask)
         for name, impl in (("attention", "auto"), ("attention_fused", "fused"), ("attention_matmul", "matmul"))]


def attention_case(name: str, impl: str, b: int, s: int, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                   mask: np.ndarray, add_mask: np.ndarray) -> Case:
    return Case(name, f"[{b}, {HEADS}, {s}, {HEAD_DIM}] + mask [{b}, {s}], impl={impl}",
                # "am": HF's extended mask [B, 1, 1, S], made once per forward, for torch
                {"q": q, "k": k, "v": v, "m": mask, "am": add_mask[:, None, None, :]},
                lambda g, t: nn.attention(g, t["q"], t["k"], t["v"], mask=t["m"], impl=impl),
                lambda h: np_attention(h["q"], h["k"], h["v"], h["m"]),
                lambda torch, F, t: F.scaled_dot_product_attention(t["q"], t["k"], t["v"], attn_mask=t["am"]),
                lambda h: np_attention(h["q"], h["k"], h["v"], h["m"], np.float32),
                4 * q.nbytes + mask.nbytes, flops=4 * b * HEADS * s * s * HEAD_DIM,
                batched=frozenset({"q", "k", "v", "m", "am"}), tol=(1e-5, 2e-6))


# -- hetero timing ---------------------------------------------------------------------------------
def upload(dev: Device, arrays: dict[str, np.ndarray]) -> tuple[dict[str, hetero.Tensor], hetero.GPUContext]:
    """Copy the inputs to the device once; the context holds them until ``release_blocks``."""
    ctx = hetero.GPUContext(dev, "bench-upload")
    ts = {k: ctx.upload(a) for k, a in arrays.items()}
    dev.wait(dev.submit([ctx.encoder.finish()]))
    ctx.settle(ran=True)
    return ts, ctx


def timed_k(dev: Device, case: Case, ts: dict[str, hetero.Tensor], k: int) -> float:
    """Seconds for one submission holding ``k`` calls (recording excluded)."""
    ctx = hetero.GPUContext(dev, "bench")
    shared = SharedOutputs(ctx)
    for _ in range(k):
        shared.next_call()
        case.record(shared, ts)
    return submit_timed(dev, ctx)


def check(case: Case, got: np.ndarray, cb: int) -> dict[str, Any]:
    host = {k: (a[:cb] if k in case.batched else a) for k, a in case.inputs.items()}
    want = case.reference(host)
    g = got[:cb].astype(np.float64)
    err = np.abs(g - want)
    rtol, atol = case.tol
    ok = bool(np.all(err <= atol + rtol * np.abs(want)))
    nz = np.abs(want) > 1e-30
    rel = float((err[nz] / np.abs(want[nz])).max()) if nz.any() else 0.0
    return dict(max_abs_err=float(f"{err.max():.3g}"), max_rel_err=float(f"{rel:.3g}"), rtol=rtol, atol=atol,
                sequences=cb, ok=ok)


# -- references --------------------------------------------------------------------------------------
def torch_seconds(torch: Any, case: Case, repeat: int, min_s: float) -> tuple[float, int]:
    import torch.nn.functional as F

    # integer inputs (ids) as int64, as torch wants them: converted once, not per call
    t = {k: torch.from_numpy(a.astype(np.int64) if a.dtype.kind in "iu" else a).cuda()
         for k, a in case.inputs.items()}
    with torch.no_grad():
        best, k = cuda_seconds(torch, lambda: case.torch_fn(torch, F, t), repeat, min_s)
    del t
    torch.cuda.empty_cache()
    return best, k


def numpy_seconds(case: Case, repeat: int) -> float:
    best = math.inf
    with np.errstate(all="ignore"):
        for _ in range(max(1, repeat)):
            t0 = time.perf_counter()
            case.numpy_fn(case.inputs)
            best = min(best, time.perf_counter() - t0)
    return best


def figure(case: Case, secs: float) -> dict[str, Any]:
    line: dict[str, Any] = dict(ms=round(secs * 1e3, 4), GBps=round(case.nbytes / secs / 1e9, 2))
    if case.flops:
        line["GFLOPs"] = round(case.flops / secs / 1e9, 1)
    return line


def bench_case(dev: Device, case: Case, a: argparse.Namespace, torch: Any, rtt: float) -> None:
    ts, holder = upload(dev, case.inputs)
    try:
        got = run_once(dev, lambda g: case.record(g, ts))  # also compiles the kernel
        emit(check=case.name, **check(case, got, a.check_batch))
        one = max(timed_k(dev, case, ts, 1) - rtt, 1e-6)
        k = max(1, min(500, math.ceil(a.min_ms / 1e3 / one)))
        best = min(timed_k(dev, case, ts, k) for _ in range(a.repeat))
        secs = max(best - rtt, 1e-9) / k
    finally:
        holder.release_blocks()
    extra: dict[str, Any] = {}
    if case.name == "attention":  # what impl="auto" ran (same rule as nn.attention)
        bq, hq, sq, _ = case.inputs["q"].shape
        limit = int(dev.limits["max-storage-buffer-binding-size"])
        extra["picked"] = nn._attention_auto(nn._adapter_type(dev), sq, sq, bq * hq * sq * sq * 4, limit)
    emit(op=case.name, impl="hetero", shape=case.shape, k=k, **extra, **figure(case, secs))
    if torch is not None:
        t_s, t_k = torch_seconds(torch, case, a.repeat, a.min_ms / 1e3)
        ref = "torch"
        emit(op=case.name, impl=ref, shape=case.shape, k=t_k, **figure(case, t_s))
    else:
        t_s = numpy_seconds(case, min(a.repeat, 2))
        ref = "numpy"
        note = "numpy float32 on the host; gelu uses the tanh approximation (numpy has no erf)" \
            if case.name.startswith("gelu") else "numpy float32 on the host"
        emit(op=case.name, impl=ref, shape=case.shape, note=note, **figure(case, t_s))
    emit(ratio=f"hetero/{ref}", op=case.name, value=round(t_s / secs, 3), note="time ratio (>1: hetero faster)")


def accuracy(dev: Device) -> None:
    """erf and gelu on a dense grid against math.erf / math.erfc in float64."""
    z = np.linspace(-6, 6, 200001, dtype=np.float32)
    got = run_once(dev, lambda g: nn.erf(g, z)).astype(np.float64)
    want = np.vectorize(math.erf, otypes=[np.float64])(z.astype(np.float64))
    nz = want != 0
    emit(accuracy="erf", range=[-6, 6], points=z.size, max_abs_err=float(f"{np.abs(got - want).max():.3g}"),
         max_rel_err=float(f"{(np.abs(got - want)[nz] / np.abs(want[nz])).max():.3g}"))
    x = np.linspace(-14, 14, 400001, dtype=np.float32)
    got = run_once(dev, lambda g: nn.gelu(g, x)).astype(np.float64)
    want = np_gelu(x)
    big = np.abs(want) > 1e-37
    rel = np.abs(got - want)[big] / np.abs(want[big])
    with np.errstate(all="ignore"):
        naive = (np.float32(0.5) * x * (np.float32(1.0) + np.vectorize(
            lambda t: np.float32(math.erf(t)), otypes=[np.float32])(x / np.float32(math.sqrt(2.0))))).astype(np.float64)
        naive_rel = np.abs(naive - want)[big] / np.abs(want[big])
    emit(accuracy="gelu", range=[-14, 14], points=x.size, max_rel_err=float(f"{rel.max():.3g}"),
         worst_x=float(x[big][rel.argmax()]), float32_textbook_max_rel_err=float(f"{naive_rel.max():.3g}"),
         note="textbook: 0.5*x*(1+erf(x/sqrt2)) in float32 with a correctly rounded erf (cancels for x < 0)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=128, help="sequences per batch")
    ap.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    ap.add_argument("--ops", default="all", help="comma-separated op names (see the table above), or all")
    ap.add_argument("--repeat", type=int, default=5, help="timed submissions per op (best is kept)")
    ap.add_argument("--min-ms", type=float, default=50.0, help="GPU time one timed submission aims for")
    ap.add_argument("--check-batch", type=int, default=2, help="sequences checked against numpy float64")
    ap.add_argument("--no-accuracy", action="store_true", help="skip the erf/gelu accuracy sweep")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    all_cases = cases(a.batch, a.seq, rng)
    wanted = [c.name for c in all_cases] if a.ops == "all" else [o.strip() for o in a.ops.split(",") if o.strip()]
    unknown = sorted(set(wanted) - {c.name for c in all_cases})
    if unknown:
        raise SystemExit(f"bench.nn: unknown ops {unknown}; known: {[c.name for c in all_cases]}")
    # A GPU-time budget far above any timed submission: K calls stay in one submission.
    rt = hetero.Runtime(gpu_budget_ms=1e9)
    try:
        dev = rt.device()
        torch = torch_cuda()
        emit(**adapter_fields(dev),
             batch=a.batch, seq=a.seq, reference="torch (CUDA)" if torch is not None else "numpy (host)")
        rtt = empty_round_trip(dev)
        emit(empty_submission_ms=round(rtt * 1e3, 4))
        for case in all_cases:
            if case.name in wanted:
                bench_case(dev, case, a, torch, rtt)
        if not a.no_accuracy:
            accuracy(dev)
    finally:
        rt.close()


if __name__ == "__main__":
    main()
