"""GPU time of hetero's float32 matmul on device-resident data, beside torch.matmul (or numpy).

    python -m bench.matmul [--sizes 1024,2048,4096] [--tune] [--transpose-b] [--repeat 5] [--min-ms 50]

Sizes are square ``M = N = K`` (or ``MxNxK``). For each size A and B are uploaded once;
then K matmuls (``hetero.kernels.matmul.matmul`` writing into one preallocated C; its
dispatches recorded again K - 1 times) are recorded into one command encoder with the lower-level API (``hetero.GPUContext`` on
the runtime's device), submitted at once and waited for; the time per matmul is
(wall time - one empty submission's round trip) / K, best of ``--repeat``. K is
chosen so that one submission runs at least ``--min-ms``. TFLOP/s = 2 M N K / time.
Each size's result is checked once: Freivalds' test (``C v`` against ``A (B v)`` in
float64) at every size, and a full comparison with numpy (float64) up to 1024.

``--tune`` runs :func:`hetero.kernels.matmul.tune` for every size first (it writes the
on-disk cache that ``matmul`` reads; one ``tune`` line per candidate). Without it,
``matmul`` uses what the cache holds for this adapter, else its default; the
``config`` and ``source`` fields say which.

The reference in the same run is ``torch.matmul`` on CUDA with TF32 off
(``torch.backends.cuda.matmul.allow_tf32 = False``), timed with CUDA events over K
calls, when torch with CUDA is importable, else ``numpy.matmul`` on the host.
Targets: hetero/torch >= 0.5 at 4096^3, >= 0.3 at 1024^3.

One JSON line per figure: ``adapter``, then per size the ``hetero`` line, the
reference's line and ``{"ratio": "hetero/<ref>", "value": ...}`` (> 1: hetero faster).
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import numpy as np

import hetero
import hetero.kernels.matmul as mm
from hetero._gpu.device import Device
from bench._common import adapter_fields, cuda_seconds, emitter, empty_round_trip, replay_timed, run_once

TARGETS = {1024: 0.3, 4096: 0.5}


emit = emitter("matmul")


def parse_shape(text: str) -> tuple[int, int, int]:
    dims = [int(x) for x in text.lower().split("x")]
    if len(dims) == 1:
        dims *= 3
    if len(dims) != 3 or min(dims) <= 0:
        raise argparse.ArgumentTypeError(f"size {text!r}: give N (square) or MxNxK")
    return dims[0], dims[1], dims[2]


def torch_cuda() -> Any:
    try:
        import torch
    except Exception:
        return None
    if not torch.cuda.is_available():
        return None
    torch.backends.cuda.matmul.allow_tf32 = False  # plain fp32 (the TF32 tensor-core path is 8x faster)
    torch.backends.cudnn.allow_tf32 = False
    return torch


def upload(dev: Device, *arrays: np.ndarray) -> tuple[list[hetero.Tensor], hetero.GPUContext]:
    """Copy arrays to the device once; the context holds the tensors until ``release_blocks``."""
    ctx = hetero.GPUContext(dev, "bench-upload")
    ts = [ctx.upload(a) for a in arrays]
    dev.wait(dev.submit([ctx.encoder.finish()]))
    ctx.settle(ran=True)
    return ts, ctx


def timed_k(dev: Device, a: hetero.Tensor, b: hetero.Tensor, c: hetero.Tensor, transpose_b: bool, k: int) -> float:
    """Seconds for one submission holding ``k`` matmuls into ``c`` (recording excluded; see replay_timed)."""
    return replay_timed(dev, lambda g: mm.matmul(g, a, b, transpose_b=transpose_b, out=c), k)


def check(got: np.ndarray, a: np.ndarray, b: np.ndarray) -> dict[str, Any]:
    """Freivalds' test at any size, and the full product against numpy (float64) for small ones."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    v = np.random.default_rng(7).standard_normal(b.shape[1])
    lhs, rhs = got.astype(np.float64) @ v, a64 @ (b64 @ v)
    scale = float(np.max(np.abs(a64) @ (np.abs(b64) @ np.abs(v))))
    res: dict[str, Any] = {"freivalds_rel_err": float(f"{np.max(np.abs(lhs - rhs)) / scale:.3g}")}
    ok = res["freivalds_rel_err"] < 1e-5
    if a.shape[0] * a.shape[1] * b.shape[1] <= 1024**3:
        want = a64 @ b64
        err = float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))
        res["max_rel_err"] = float(f"{err:.3g}")
        ok = ok and err < 1e-4
    res["ok"] = bool(ok)
    return res


def torch_seconds(torch: Any, a: np.ndarray, b: np.ndarray, transpose_b: bool, repeat: int,
                  min_s: float) -> tuple[float, int]:
    ta, tb = torch.from_numpy(a).cuda(), torch.from_numpy(b).cuda()

    def op() -> Any:
        return torch.matmul(ta, tb.t() if transpose_b else tb)

    best, k = cuda_seconds(torch, op, repeat, min_s)
    del ta, tb
    torch.cuda.empty_cache()
    return best, k


def numpy_seconds(a: np.ndarray, b: np.ndarray, transpose_b: bool, repeat: int) -> float:
    best = math.inf
    bb = b.T if transpose_b else b
    for _ in range(max(1, repeat)):
        t0 = time.perf_counter()
        np.matmul(a, bb)
        best = min(best, time.perf_counter() - t0)
    return best


def bench_size(dev: Device, shape: tuple[int, int, int], a_: argparse.Namespace, torch: Any, rtt: float) -> None:
    m, n, k = shape
    label = f"{m}" if m == n == k else f"{m}x{n}x{k}"
    rng = np.random.default_rng(0)
    a = rng.random((m, k), dtype=np.float32) - 0.5
    b = rng.random((n, k) if a_.transpose_b else (k, n), dtype=np.float32) - 0.5
    flops = 2.0 * m * n * k
    # The reference first: right after a long lavapipe submission its worker threads still
    # hold the CPU, and numpy would measure 100x slow.
    if torch is not None:
        t_s, t_k = torch_seconds(torch, a, b, a_.transpose_b, a_.repeat, a_.min_ms / 1e3)
        ref = "torch.matmul"
        ref_line: dict[str, Any] = dict(impl=ref, size=label, ms=round(t_s * 1e3, 4),
                                        TFLOPs=round(flops / t_s / 1e12, 3), GFLOPs=round(flops / t_s / 1e9, 3),
                                        k=t_k, tf32=False)
    else:
        t_s = numpy_seconds(a, b, a_.transpose_b, a_.repeat)
        ref = "numpy.matmul"
        ref_line = dict(impl=ref, size=label, ms=round(t_s * 1e3, 4), TFLOPs=round(flops / t_s / 1e12, 3),
                        GFLOPs=round(flops / t_s / 1e9, 3))
    (at, bt), holder = upload(dev, a, b)
    try:
        cfg, source = mm.explain_config(holder, m, n, k)
        got = run_once(dev, lambda g: mm.matmul(g, at, bt, transpose_b=a_.transpose_b))  # also compiles
        res = check(got, a, b.T if a_.transpose_b else b)
        if not res["ok"]:
            raise SystemExit(f"hetero matmul {label} is wrong: {res}")
        c = holder.empty((m, n), np.float32)
        one = max(timed_k(dev, at, bt, c, a_.transpose_b, 1) - rtt, 1e-7)
        reps = max(1, min(1000, math.ceil(a_.min_ms / 1e3 / one)))
        best = min(timed_k(dev, at, bt, c, a_.transpose_b, reps) for _ in range(a_.repeat))
        sec = max(best - rtt, 1e-9) / reps
        emit(impl="hetero", size=label, transpose_b=a_.transpose_b, ms=round(sec * 1e3, 4),
             TFLOPs=round(flops / sec / 1e12, 3), GFLOPs=round(flops / sec / 1e9, 3), k=reps, config=cfg.name,
             source=source, **res)
    finally:
        holder.release_blocks()
    emit(**ref_line)
    line: dict[str, Any] = dict(ratio=f"hetero/{ref}", size=label, value=round(t_s / sec, 3),
                                note="throughput ratio (>1: hetero faster)")
    if torch is not None and m == n == k and m in TARGETS:
        line["target"] = TARGETS[m]
        line["met"] = line["value"] >= TARGETS[m]
    emit(**line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1024,2048,4096", help="comma-separated N (square) or MxNxK")
    ap.add_argument("--tune", action="store_true", help="run the autotuner for each size first (fills the cache)")
    ap.add_argument("--transpose-b", action="store_true", help="b is [N, K] (torch.nn.Linear's layout)")
    ap.add_argument("--repeat", type=int, default=5, help="timed submissions per size (best is kept)")
    ap.add_argument("--min-ms", type=float, default=50.0, help="GPU time one timed submission aims for")
    ap.add_argument("--tune-min-ms", type=float, default=20.0, help="the same, for each tuner candidate")
    a = ap.parse_args()
    shapes = [parse_shape(s) for s in a.sizes.split(",") if s.strip()]
    # A GPU-time budget far above any timed submission: K matmuls stay in one submission.
    rt = hetero.Runtime(gpu_budget_ms=1e9)
    try:
        dev = rt.device()
        torch = torch_cuda()
        emit(**adapter_fields(dev), cache=str(mm.cache_path(dev)),
             reference="torch.matmul (CUDA, TF32 off)" if torch is not None else "numpy.matmul (host)")
        rtt = empty_round_trip(dev)
        emit(empty_submission_ms=round(rtt * 1e3, 4))
        if a.tune:
            for m, n, k in shapes:
                t0 = time.perf_counter()
                r = mm.tune(dev, m, n, k, transpose_b=a.transpose_b, min_ms=a.tune_min_ms)
                for name, gflops, note in r.results:
                    emit(tune=f"{m}x{n}x{k}", config=name, GFLOPs=gflops, note=note)
                emit(tuned=f"{m}x{n}x{k}", key=r.key, best=r.best.name, GFLOPs=r.gflops,
                     seconds=round(time.perf_counter() - t0, 1))
        for shape in shapes:
            bench_size(dev, shape, a, torch, rtt)
    finally:
        rt.close()


if __name__ == "__main__":
    main()
