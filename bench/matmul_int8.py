"""GPU time of hetero's INT8 weight-quantized matmul (every strategy) beside its float32 matmul.

    python -m bench.matmul_int8 [--sizes 1024,4096] [--strategy all|both|dequant,dp4a-g32,...] [--repeat 5]
                                [--min-ms 50]

``--strategy``: ``all`` (default: dequant, dp4a, dp4a-g32, dp4a-g64), ``both`` (dequant and
dp4a), or a comma-separated list of strategies.

Sizes are square ``M = N = K`` (or ``MxNxK``): x float32 ``[M, K]`` times a weight
``[K, N]``. The data is resident: x, the float32 weight (for the reference) and the
quantized weight (:func:`hetero.kernels.matmul_int8.resident`) are uploaded once. Timing
as ``bench/matmul.py``: K products recorded into one command encoder (the first
by the op, the others repeating its dispatches, the dp4a activation-quantization
pass included), submitted at once; time per product = (wall - one empty
submission's round trip) / K, best of ``--repeat``; K chosen so that a submission
runs at least ``--min-ms``. TFLOP/s-equivalent = 2 M N K / time for every line.

Each strategy's result is checked once per size (Freivalds' test in float64
against ``x dequant(q)``, with the activations quantized on the host as the GPU
does for dp4a and dp4a-gG) and its error against ``x w`` is reported as the fraction of the
documented bound used (``bound_used`` <= 1).

One JSON line per figure: ``adapter``, then per size a line per strategy and the
float32 matmul's line, and ``{"ratio": "int8-<strategy>/fp32", "value": ...}``
(> 1: int8 faster; target on the H200 at 4096^3: >= 1.5); when dp4a was measured too,
``{"ratio": "int8-dp4a-gG/int8-dp4a", ...}`` (the per-group scales' cost: < 1 slower).
"""

from __future__ import annotations

import argparse
import math
from typing import Any, Callable

import numpy as np

import hetero
import hetero.kernels.matmul as mm
import hetero.kernels.matmul_int8 as q8
from bench.matmul import empty_round_trip, parse_shape, upload
from hetero.lowlevel import Device
from bench._common import adapter_fields, emitter, replay_timed, run_once

TARGET = (4096, 1.5)


emit = emitter("matmul_int8")


def seconds(dev: Device, record: Callable[[Any], Any], a_: argparse.Namespace, rtt: float) -> tuple[float, int]:
    one = max(replay_timed(dev, record, 1) - rtt, 1e-7)
    reps = max(1, min(1000, math.ceil(a_.min_ms / 1e3 / one)))
    best = min(replay_timed(dev, record, reps) for _ in range(max(1, a_.repeat)))
    return max(best - rtt, 1e-9) / reps, reps


def check(got: np.ndarray, x: np.ndarray, w: np.ndarray, qw: q8.QuantizedWeight, strategy: str) -> dict[str, Any]:
    dq = qw.dequantize().astype(np.float64)
    if strategy.startswith("dp4a"):
        g = q8.GROUPS.get(strategy, 0)
        xq, rs = q8.quantize_activations(x, group=g)
        x64 = xq.astype(np.float64) * (np.repeat(rs, g, axis=-1)[:, :x.shape[1]] if g else rs)
    else:
        x64 = x.astype(np.float64)
    v = np.random.default_rng(7).standard_normal(got.shape[1])
    lhs, rhs = got.astype(np.float64) @ v, x64 @ (dq @ v)
    scale = float(np.max(np.abs(x64) @ (np.abs(dq) @ np.abs(v))))
    res: dict[str, Any] = {"freivalds_rel_err": float(f"{np.max(np.abs(lhs - rhs)) / max(scale, 1e-30):.3g}")}
    ok = res["freivalds_rel_err"] < (1e-4 if strategy.startswith("dp4a") else 1e-5)
    rows = min(x.shape[0], 64)  # the error against x w, on a few rows (the bound is per output)
    err = np.abs(got[:rows] - x[:rows].astype(np.float64) @ w.astype(np.float64))
    bound = qw.error_bound(x[:rows], strategy)
    res["bound_used"] = float(f"{float(np.max(err / np.maximum(bound, 1e-30))):.3g}")
    res["ok"] = bool(ok and res["bound_used"] <= 1.0 + 1e-3)
    return res


def bench_size(dev: Device, shape: tuple[int, int, int], strategies: list[str], a_: argparse.Namespace,
               rtt: float) -> None:
    m, n, k = shape
    label = f"{m}" if m == n == k else f"{m}x{n}x{k}"
    rng = np.random.default_rng(0)
    x = rng.random((m, k), dtype=np.float32) - 0.5
    w = rng.random((k, n), dtype=np.float32) - 0.5
    flops = 2.0 * m * n * k
    qw = q8.quantize_weight(w)
    (xt, wt), holder = upload(dev, x, w)
    gw = q8.resident(dev, qw)
    try:
        c = holder.empty((m, n), np.float32)
        got = run_once(dev, lambda g: mm.matmul(g, xt, wt))
        if not np.allclose(got[:8], x[:8] @ w, rtol=1e-3, atol=1e-3):
            raise SystemExit(f"fp32 matmul {label} is wrong")
        f_s, f_k = seconds(dev, lambda g: mm.matmul(g, xt, wt, out=c), a_, rtt)
        times: dict[str, float] = {}
        emit(impl="fp32", size=label, ms=round(f_s * 1e3, 4), TFLOPs=round(flops / f_s / 1e12, 3),
             GFLOPs=round(flops / f_s / 1e9, 3), k=f_k, config=mm.choose_config(holder, m, n, k).name)
        for s in strategies:
            def rec(g: Any, s: str = s) -> hetero.Tensor:
                return q8.matmul_int8(g, xt, gw, strategy=s)

            res = check(run_once(dev, rec), x, w, qw, s)
            if not res["ok"]:
                raise SystemExit(f"matmul_int8 {s} {label} is wrong: {res}")
            sec, reps = seconds(dev, rec, a_, rtt)
            times[s] = sec
            emit(impl=f"int8-{s}", size=label, ms=round(sec * 1e3, 4), TFLOPs=round(flops / sec / 1e12, 3),
                 GFLOPs=round(flops / sec / 1e9, 3), k=reps, config=q8.choose(holder, m, n, s)[1].name, **res)
            line: dict[str, Any] = dict(ratio=f"int8-{s}/fp32", size=label, value=round(f_s / sec, 3),
                                        note="throughput ratio (>1: int8 faster)")
            if m == n == k == TARGET[0]:
                line["target"], line["met"] = TARGET[1], f_s / sec >= TARGET[1]
            emit(**line)
            if s in q8.GROUPS and "dp4a" in times:
                emit(ratio=f"int8-{s}/int8-dp4a", size=label, value=round(times["dp4a"] / sec, 3),
                     note="throughput ratio (<1: the per-group scales cost)")
    finally:
        gw.release()
        holder.release_blocks()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1024,4096", help="comma-separated N (square) or MxNxK")
    ap.add_argument("--strategy", default="all",
                    help=f"all, both (dequant,dp4a) or a comma-separated list of {', '.join(q8.STRATEGIES)}")
    ap.add_argument("--repeat", type=int, default=5, help="timed submissions per figure (best is kept)")
    ap.add_argument("--min-ms", type=float, default=50.0, help="GPU time one timed submission aims for")
    a = ap.parse_args()
    shapes = [parse_shape(s) for s in a.sizes.split(",") if s.strip()]
    if a.strategy == "all":
        strategies = list(q8.STRATEGIES)
    elif a.strategy == "both":
        strategies = ["dequant", "dp4a"]
    else:
        strategies = [s.strip() for s in a.strategy.split(",") if s.strip()]
        bad = [s for s in strategies if s not in q8.STRATEGIES]
        if bad or not strategies:
            ap.error(f"--strategy: unknown {bad or a.strategy!r}; choose all, both or from {', '.join(q8.STRATEGIES)}")
    rt = hetero.Runtime(gpu_budget_ms=1e9)  # K products stay in one submission
    try:
        dev = rt.device()
        emit(**adapter_fields(dev), auto=q8.choose(dev, 1024, 1024)[0])
        rtt = empty_round_trip(dev)
        emit(empty_submission_ms=round(rtt * 1e3, 4))
        for shape in shapes:
            bench_size(dev, shape, strategies, a, rtt)
    finally:
        rt.close()


if __name__ == "__main__":
    main()
