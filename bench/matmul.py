"""GPU time of hetero's float32 matmul on device-resident data, beside torch.matmul (or numpy).

    python -m bench.matmul [--sizes 1024,2048,4096] [--tune] [--transpose-b] [--repeat 5] [--min-ms 50]
    python -m bench.matmul --small-m [--ms 1,8,20,32,64,128] [--linears qkv,attn_out,inter,out]

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

``--small-m``: MiniLM's linear layers for a few rows (``M`` = sentences x tokens: one
sentence of ~20 tokens is M = 20), ``x [M, K] @ W.T + b`` with ``W [N, K]`` as nn.Linear
stores it, for every M of ``--ms`` and every layer of ``--linears`` (qkv 1152x384,
attn_out 384x384, inter 1536x384 without bias, out 384x1536; N x K). Per shape it times,
in the same process and the same way as above (K calls per submission):

* ``default``: the unsplit tile :func:`hetero.kernels.matmul.default_config` picks for this
  adapter (``small_split=False``);
* ``proposed``: :func:`hetero.kernels.matmul.small_output_config`, the K-split rule that
  ``matmul(..., small_split=True)`` and ``HETERO_MATMUL_SMALL_SPLIT=1`` turn on;
* ``tuned``: the winner of :func:`hetero.kernels.matmul.tune` over
  :data:`~hetero.kernels.matmul.SMALL_M_CANDIDATES` (plus the two above), tuned here and
  not saved (``--max-candidates`` takes the first few only, for a quick run);
* the reference ``torch.nn.functional.linear`` on CUDA (TF32 off), CUDA events over K eager
  calls, and the same K calls replayed from one CUDA graph (``torch_graph``: its GPU time
  without launch gaps), when torch with CUDA is importable; else ``x @ W.T + b`` in numpy.

Every hetero configuration's result is checked against numpy (float64) before it is
timed. JSON lines per figure (``small_m`` lines, the tuner's ``tune`` lines), then a
markdown table: microseconds per call, ``default/proposed`` and ``default/tuned`` (> 1: the
new configuration is faster), ``torch/<winner>`` (> 1: hetero faster) and the winner; and
per M the sum over the layers (one encoder layer's linear time).

What decides making the proposal the default on GPUs: on a large GPU (the H200), the
per-M sum ``default/proposed`` at least 1.25 at M = 20 and 32 (one sentence) and at
least 1.0 at every M, and no single shape below 0.9; where ``tuned`` beats ``proposed``
by 1.2x or more on most shapes, the rule follows the tuned winners first. Then an
end-to-end check: ``bench embed``'s one-sentence latency with and without
``HETERO_MATMUL_SMALL_SPLIT=1``, paired runs, and ``bench op_record``'s host time per
matmul. On the H200 (BENCHMARKS.md, "Small outputs") the kernel rule held, but end to end
the runs were within noise of each other and the second dispatch doubled the host time of
a small matmul (recorded 84-125 -> 185-208 µs, replayed 12.6-13.6 -> 24.3 µs), which is what
one-sentence runs waited on: the split stayed opt-in. Once stages were captured and replayed,
lone sentences and batches of 32 got faster with it and served batches did not: the embedding
pipeline's padded graph asks for it (BENCHMARKS.md, seventh session).
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import numpy as np

import hetero
import hetero.kernels.matmul as mm
from hetero.lowlevel import Device
from bench._common import adapter_fields, cuda_seconds, emitter, empty_round_trip, replay_timed, run_once

# MiniLM's linear layers: name -> (N, K, bias) of x [M, K] @ W.T (+ b), W [N, K]. The intermediate
# layer's bias goes with its gelu (pipelines/embed.py), so its matmul has none.
LINEARS = {"qkv": (1152, 384, True), "attn_out": (384, 384, True), "inter": (1536, 384, False),
           "out": (384, 1536, True)}
SMALL_MS = "1,8,20,32,64,128"

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


def cuda_graph_seconds(torch: Any, op: Any, repeat: int, k: int) -> float:
    """Best seconds per ``op()`` when ``k`` calls are replayed from one CUDA graph (CUDA events)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch.cuda.graphs asks
        for _ in range(3):
            op()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(k):
            op()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = math.inf
    for _ in range(max(1, repeat)):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / k)
    del graph
    return best


def small_m_reference(torch: Any, x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, a_: argparse.Namespace
                      ) -> dict[str, float]:
    """Seconds per ``F.linear(x, w, bias)``: eager (``torch``) and from a CUDA graph (``torch_graph``);
    without torch, ``numpy`` (``x @ w.T + b``, best of ``--repeat``)."""
    if torch is None:
        best = math.inf
        for _ in range(max(1, a_.repeat)):
            t0 = time.perf_counter()
            r = x @ w.T
            if bias is not None:
                r += bias
            best = min(best, time.perf_counter() - t0)
        return {"numpy": best}
    import torch.nn.functional as F

    tx, tw = torch.from_numpy(x).cuda(), torch.from_numpy(w).cuda()
    tb = torch.from_numpy(bias).cuda() if bias is not None else None

    def op() -> Any:
        return F.linear(tx, tw, tb)

    eager, k = cuda_seconds(torch, op, a_.repeat, a_.min_ms / 1e3)
    out = {"torch": eager}
    try:
        out["torch_graph"] = cuda_graph_seconds(torch, op, a_.repeat, k)
    except Exception as e:  # noqa: BLE001 - the eager figure stands alone
        emit(note=f"torch CUDA graph timing failed: {type(e).__name__}: {e}")
    del tx, tw, tb
    torch.cuda.empty_cache()
    return out


def time_config(dev: Device, c: mm.MatmulConfig, x: hetero.Tensor, w: hetero.Tensor, bias: hetero.Tensor | None,
                out: hetero.Tensor, a_: argparse.Namespace, rtt: float) -> tuple[float, int]:
    """Seconds per ``matmul(x, w, transpose_b=True, bias=, config=c)`` into ``out``, and the calls per submission."""
    def rec(g: Any) -> Any:
        return mm.matmul(g, x, w, transpose_b=True, bias=bias, out=out, config=c)

    one = max(replay_timed(dev, rec, 1) - rtt, 1e-7)
    reps = max(1, min(1000, math.ceil(a_.min_ms / 1e3 / one)))
    best = min(replay_timed(dev, rec, reps) for _ in range(max(1, a_.repeat)))
    return max(best - rtt, 1e-9) / reps, reps


def bench_small_m(dev: Device, a_: argparse.Namespace, torch: Any, rtt: float) -> None:
    """``--small-m``: default, proposed and tuned configurations and the reference per (M, layer)."""
    ms = [int(v) for v in a_.ms.split(",") if v.strip()]
    names = [v.strip() for v in a_.linears.split(",") if v.strip()]
    unknown = [v for v in names if v not in LINEARS]
    if unknown or not names or not ms or min(ms) <= 0:
        raise SystemExit(f"bench matmul --small-m: --linears takes {', '.join(LINEARS)}; --ms positive ints "
                         f"(got --linears {a_.linears!r}, --ms {a_.ms!r})")
    kind = dev.summary["type"]
    limits = dev.limits
    rows: list[dict[str, Any]] = []
    for m in ms:
        for name in names:
            n, k, has_bias = LINEARS[name]
            shape = f"{m}x{n}x{k}"
            rng = np.random.default_rng(m * 7 + n + k)
            x = rng.random((m, k), dtype=np.float32) - 0.5
            w = rng.random((n, k), dtype=np.float32) - 0.5
            bias = (rng.random(n, dtype=np.float32) - 0.5) if has_bias else None
            want = x.astype(np.float64) @ w.T.astype(np.float64) + (bias if bias is not None else 0.0)
            ref = small_m_reference(torch, x, w, bias, a_)  # first: see bench_size
            default = mm.default_config(kind, m, n, 1, limits, k=k, small_split=False)
            proposed = mm.small_output_config(m, n, k, 1, limits) or default
            cands = list(dict.fromkeys([*mm.SMALL_M_CANDIDATES[:a_.max_candidates], default, proposed]))
            cands = [c for c in cands if c.fits(limits) is None]
            t0 = time.perf_counter()
            r = mm.tune(dev, m, n, k, transpose_b=True, configs=cands, min_ms=a_.tune_min_ms, repeat=a_.repeat,
                        save=False)
            flops = 2.0 * m * n * k
            for cname, gflops, note in r.results:
                emit(tune=shape, layer=name, config=cname, GFLOPs=gflops,
                     us=round(flops / gflops / 1e3, 3) if gflops else None, note=note)
            emit(tuned=shape, layer=name, best=r.best.name, seconds=round(time.perf_counter() - t0, 1))
            roles = {"default": default, "proposed": proposed, "tuned": r.best}
            arrays = [x, w] + ([bias] if bias is not None else [])
            ts, holder = upload(dev, *arrays)
            try:
                xt, wt = ts[0], ts[1]
                bt = ts[2] if bias is not None else None
                out = holder.empty((m, n), np.float32)
                secs: dict[mm.MatmulConfig, float] = {}
                for role, c in roles.items():
                    if c not in secs:
                        got = run_once(dev, lambda g, c=c: mm.matmul(g, xt, wt, transpose_b=True, bias=bt, config=c))
                        err = float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))
                        if err > 1e-4:
                            raise SystemExit(f"hetero matmul {shape} with {c.name} is wrong: relative error {err:.3g}")
                        secs[c], reps = time_config(dev, c, xt, wt, bt, out, a_, rtt)
                        emit(small_m=shape, layer=name, role=role, config=c.name, us=round(secs[c] * 1e6, 3), k=reps,
                             max_rel_err=float(f"{err:.3g}"))
                    else:
                        emit(small_m=shape, layer=name, role=role, config=c.name, us=round(secs[c] * 1e6, 3),
                             same_as=next(ro for ro, cc in roles.items() if cc == c))
            finally:
                holder.release_blocks()
            for impl, sec in ref.items():
                emit(small_m=shape, layer=name, impl=impl, us=round(sec * 1e6, 3))
            row: dict[str, Any] = {"m": m, "layer": name, "shape": shape, "ref": ref,
                                   **{role: (c, secs[c]) for role, c in roles.items()}}
            win = min(roles, key=lambda ro: (secs[roles[ro]], list(roles).index(ro)))
            row["winner"] = win
            emit(small_m=shape, layer=name, winner=win, config=roles[win].name,
                 **{f"default/{ro}": round(secs[default] / secs[roles[ro]], 3) for ro in ("proposed", "tuned")},
                 **{f"{impl}/hetero": round(sec / secs[roles[win]], 3) for impl, sec in ref.items()})
            rows.append(row)
    small_m_table(rows)


def small_m_table(rows: list[dict[str, Any]]) -> None:
    """The markdown table of ``--small-m`` (µs per call; ratios > 1: the left one is slower)."""
    refs = list(dict.fromkeys(impl for r in rows for impl in r["ref"]))

    def us(s: float) -> str:
        return f"{s * 1e6:.1f}"

    print()
    print("| M | layer | N x K | default | proposed | tuned | " + " | ".join(refs)
          + " | default/proposed | default/tuned | " + " | ".join(f"{ref}/best" for ref in refs) + " | winner |")
    print("|" + "---|" * (9 + 2 * len(refs)))
    for r in rows:
        best = r[r["winner"]][1]
        print(f"| {r['m']} | {r['layer']} | {r['shape'].split('x', 1)[1]} | "
              + " | ".join(f"{us(r[ro][1])} ({r[ro][0].name})" for ro in ("default", "proposed", "tuned")) + " | "
              + " | ".join(us(r["ref"][ref]) if ref in r["ref"] else "" for ref in refs) + " | "
              + f"{r['default'][1] / r['proposed'][1]:.2f} | {r['default'][1] / r['tuned'][1]:.2f} | "
              + " | ".join(f"{r['ref'][ref] / best:.2f}" if ref in r["ref"] else "" for ref in refs)
              + f" | {r['winner']} |")
    print()
    print("| M | layers | default µs | proposed µs | tuned µs | " + " | ".join(f"{ref} µs" for ref in refs)
          + " | default/proposed | default/tuned |")
    print("|" + "---|" * (7 + len(refs)))
    for m in dict.fromkeys(r["m"] for r in rows):
        sel = [r for r in rows if r["m"] == m]
        tot = {ro: sum(r[ro][1] for r in sel) for ro in ("default", "proposed", "tuned")}
        rt = {ref: sum(r["ref"].get(ref, 0.0) for r in sel) for ref in refs}
        print(f"| {m} | {len(sel)} | {us(tot['default'])} | {us(tot['proposed'])} | {us(tot['tuned'])} | "
              + " | ".join(us(rt[ref]) for ref in refs)
              + f" | {tot['default'] / tot['proposed']:.2f} | {tot['default'] / tot['tuned']:.2f} |")
    emit(small_m_summary={str(m): {ro: round(sum(r[ro][1] for r in rows if r["m"] == m) * 1e6, 3)
                                   for ro in ("default", "proposed", "tuned")}
                          for m in dict.fromkeys(r["m"] for r in rows)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1024,2048,4096", help="comma-separated N (square) or MxNxK")
    ap.add_argument("--tune", action="store_true", help="run the autotuner for each size first (fills the cache)")
    ap.add_argument("--transpose-b", action="store_true", help="b is [N, K] (torch.nn.Linear's layout)")
    ap.add_argument("--repeat", type=int, default=5, help="timed submissions per size (best is kept)")
    ap.add_argument("--min-ms", type=float, default=50.0, help="GPU time one timed submission aims for")
    ap.add_argument("--tune-min-ms", type=float, default=20.0, help="the same, for each tuner candidate")
    ap.add_argument("--small-m", action="store_true",
                    help="MiniLM's linear layers for a few rows: default, proposed and tuned configs beside torch")
    ap.add_argument("--ms", default=SMALL_MS, help="--small-m: the rows M (comma-separated)")
    ap.add_argument("--linears", default=",".join(LINEARS), help=f"--small-m: layers among {', '.join(LINEARS)}")
    ap.add_argument("--max-candidates", type=int, default=len(mm.SMALL_M_CANDIDATES),
                    help="--small-m: tune over the first N of SMALL_M_CANDIDATES only (and default, proposed)")
    a = ap.parse_args()
    shapes = [] if a.small_m else [parse_shape(s) for s in a.sizes.split(",") if s.strip()]
    # A GPU-time budget far above any timed submission: K matmuls stay in one submission.
    rt = hetero.Runtime(gpu_budget_ms=1e9)
    try:
        dev = rt.device()
        torch = torch_cuda()
        emit(**adapter_fields(dev), cache=str(mm.cache_path(dev)),
             reference=(("torch.nn.functional.linear" if a.small_m else "torch.matmul") + " (CUDA, TF32 off)"
                        if torch is not None else "numpy.matmul (host)"))
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
        if a.small_m:
            bench_small_m(dev, a, torch, rtt)
    finally:
        rt.close()


if __name__ == "__main__":
    main()
