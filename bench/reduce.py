"""GPU time of hetero's float32 sum over device-resident data, beside torch.sum (or numpy).

    python -m bench.reduce [--sizes 1M,16M,256M,1G] [--repeat 5] [--min-ms 50] [--no-accuracy]
                           [--grid-targets 1024,2048,4096] [--items 1,2,4]

Sizes are bytes of float32 data. For each size the data is uploaded once; then K
reductions (``hetero.ops.sum``) are recorded into one command encoder with the
lower-level API (``hetero.GPUContext`` on the runtime's device), submitted at once
and waited for; the time per reduction is (wall time - one empty submission's round
trip) / K, best of ``--repeat``. K is chosen so that one submission runs at least
``--min-ms``. Sizes that fit the GPU's last-level cache (50 MB on an H200) are read from
it on repeats, by hetero and by torch alike. GB/s = bytes read / time (GB = 1e9 bytes). The first result is checked
against a float64 sum of the same data.

``--grid-targets`` and ``--items`` sweep hetero's tuning knobs
(``hetero.kernels.reduce.GRID_TARGET``: workgroups per pass; ``ITEMS_PER_THREAD``: the
fewest vec4 loads per thread, which decides the grid of mid-sized inputs); each
combination gets its own hetero line, tagged ``grid_target`` and ``items``, and the
ratio line uses the fastest.

The reference in the same run is ``torch.sum`` on CUDA (timed with CUDA events over
K calls) when torch with CUDA is importable, else ``numpy.sum`` on the host.

Then the accuracy check at 2**24 elements (uniform [0, 1) and standard normal
data): the absolute error of hetero's float32 sum against a float64 reference,
beside numpy's float32 (pairwise) sum; ``ratio`` = hetero's error /
max(numpy's error, one ulp of the result) (an error below an ulp cannot be told
from rounding the result itself). The target is ratio <= 4.

One JSON line per figure: first ``adapter``, then per size ``{"impl": "hetero", "ms",
"GBps", "passes", ...}`` and the reference's line, then ``{"ratio": "hetero/<ref>"}``,
then ``{"check": "accuracy", ...}`` lines.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import numpy as np

import hetero
from bench._common import (Spy, adapter_fields, cuda_seconds, emitter, empty_round_trip, human, parse_size, run_once,
                           submit_timed, torch_cuda)
import hetero.kernels.reduce as reduce_kernels
import hetero.ops
from hetero.lowlevel import Device

emit = emitter("reduce")


def passes(labels: list[str]) -> int:
    """Passes of one reduction: the first reads the input (one dispatch per binding window),
    each later one reads the partials (``reduce.<op>.<dtype>.partial...``) in one dispatch."""
    return int(any(".partial." not in lb for lb in labels)) + sum(".partial." in lb for lb in labels)


def upload(dev: Device, a: np.ndarray) -> tuple[hetero.Tensor, hetero.GPUContext]:
    """Copy ``a`` to the device once; the context holds the tensor until ``release_blocks``."""
    ctx = hetero.GPUContext(dev, "bench-upload")
    t = ctx.upload(a)
    dev.wait(dev.submit([ctx.encoder.finish()]))
    ctx.settle(ran=True)
    return t, ctx


def timed_k(dev: Device, x: hetero.Tensor, k: int) -> float:
    """Seconds for one submission holding ``k`` sums of ``x`` (recording excluded)."""
    ctx = hetero.GPUContext(dev, "bench")
    for _ in range(k):
        hetero.ops.sum(ctx, x)
    return submit_timed(dev, ctx)


def torch_sum_seconds(torch: Any, host: np.ndarray, repeat: int, min_s: float) -> tuple[float, float, int]:
    """Seconds per ``torch.sum`` of a resident CUDA tensor (CUDA events), its result, and K."""
    t = torch.from_numpy(host).cuda()
    s = torch.sum(t)
    best, k = cuda_seconds(torch, lambda: torch.sum(t), repeat, min_s)
    value = float(s.item())
    del t
    torch.cuda.empty_cache()
    return best, value, k


def numpy_sum_seconds(host: np.ndarray, repeat: int) -> float:
    best = math.inf
    for _ in range(max(1, repeat)):
        t0 = time.perf_counter()
        np.sum(host)
        best = min(best, time.perf_counter() - t0)
    return best


def hetero_seconds(dev: Device, x: hetero.Tensor, ref: float, repeat: int, min_ms: float,
                   rtt: float) -> tuple[float, int, list[str], float]:
    """Best seconds per sum of the resident ``x``, K, the kernels of one sum, its relative error."""
    labels: list[str] = []

    def record(ctx: hetero.GPUContext) -> hetero.Tensor:
        spy = Spy(ctx)
        out = hetero.ops.sum(spy, x)
        labels[:] = spy.labels
        return out

    got = float(run_once(dev, record))  # also compiles the kernels
    rel = abs(got - ref) / max(abs(ref), 1e-30)
    if not rel < 1e-5:
        raise SystemExit(f"hetero sum of {x.size} floats is {got}, float64 reference {ref} "
                         f"(relative error {rel:.2e})")
    one = max(timed_k(dev, x, 1) - rtt, 1e-6)
    k = max(1, min(500, math.ceil(min_ms / 1e3 / one)))
    best = min(timed_k(dev, x, k) for _ in range(repeat))
    return max(best - rtt, 1e-9) / k, k, labels, rel


def bench_size(dev: Device, nbytes: int, repeat: int, min_ms: float, torch: Any, rtt: float,
               grid_targets: list[int | None], items: list[int]) -> None:
    n = nbytes // 4
    host = np.random.default_rng(0).random(n, dtype=np.float32)
    ref = float(host.sum(dtype=np.float64))
    x, holder = upload(dev, host)
    per = math.inf
    defaults = reduce_kernels.GRID_TARGET, reduce_kernels.ITEMS_PER_THREAD
    try:
        for gt in grid_targets:
            for it in items:
                reduce_kernels.GRID_TARGET, reduce_kernels.ITEMS_PER_THREAD = gt, it
                s, k, labels, rel = hetero_seconds(dev, x, ref, repeat, min_ms, rtt)
                per = min(per, s)
                emit(op="sum", impl="hetero", size=human(nbytes), bytes=nbytes, elements=n,
                     ms=round(s * 1e3, 4), GBps=round(nbytes / s / 1e9, 2), k=k, grid_target=gt or "auto", items=it,
                     passes=passes(labels), dispatches=len(labels), kernels=sorted(set(labels)),
                     rel_err=float(f"{rel:.3g}"))
    finally:
        reduce_kernels.GRID_TARGET, reduce_kernels.ITEMS_PER_THREAD = defaults
        holder.release_blocks()
    if torch is not None:
        t_s, t_val, t_k = torch_sum_seconds(torch, host, repeat, min_ms / 1e3)
        ref_name = "torch.sum"
        emit(op="sum", impl=ref_name, size=human(nbytes), bytes=nbytes, elements=n, ms=round(t_s * 1e3, 4),
             GBps=round(nbytes / t_s / 1e9, 2), k=t_k, rel_err=float(f"{abs(t_val - ref) / abs(ref):.3g}"))
    else:
        t_s = numpy_sum_seconds(host, repeat)
        ref_name = "numpy.sum"
        emit(op="sum", impl=ref_name, size=human(nbytes), bytes=nbytes, elements=n, ms=round(t_s * 1e3, 4),
             GBps=round(nbytes / t_s / 1e9, 2))
    emit(ratio=f"hetero/{ref_name}", size=human(nbytes), value=round(t_s / per, 3),
         note="throughput ratio (>1: hetero faster)")


def accuracy(dev: Device, torch: Any) -> None:
    n = 1 << 24
    rng = np.random.default_rng(24)
    for dist in ("uniform", "normal"):
        host = (rng.random(n, dtype=np.float32) if dist == "uniform"
                else rng.standard_normal(n, dtype=np.float32))
        ref = float(host.sum(dtype=np.float64))
        x, holder = upload(dev, host)
        got = float(run_once(dev, lambda ctx: hetero.ops.sum(ctx, x)))
        holder.release_blocks()
        err = abs(got - ref)
        np_err = abs(float(np.sum(host)) - ref)
        ulp = float(np.spacing(np.float32(abs(ref))))
        line: dict[str, Any] = dict(check="accuracy", elements=n, dist=dist, err=float(f"{err:.3g}"),
                                    numpy_err=float(f"{np_err:.3g}"), ulp=ulp,
                                    ratio=round(err / max(np_err, ulp), 3))
        if torch is not None:
            line["torch_err"] = float(f"{abs(float(torch.sum(torch.from_numpy(host).cuda()).item()) - ref):.3g}")
        line["ok"] = line["ratio"] <= 4
        emit(**line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1M,16M,256M,1G", help="comma-separated byte sizes (K, M, G suffixes)")
    ap.add_argument("--repeat", type=int, default=5, help="timed submissions per size (best is kept)")
    ap.add_argument("--min-ms", type=float, default=50.0, help="GPU time one timed submission aims for")
    ap.add_argument("--no-accuracy", action="store_true", help="skip the 2**24-element accuracy check")
    ap.add_argument("--grid-targets", default="auto",
                    help="comma-separated values of hetero.kernels.reduce.GRID_TARGET to try "
                         "(auto: 2048 on GPUs, 64 on CPU adapters)")
    ap.add_argument("--items", default=str(reduce_kernels.ITEMS_PER_THREAD),
                    help="comma-separated values of hetero.kernels.reduce.ITEMS_PER_THREAD to try")
    a = ap.parse_args()
    sizes = [parse_size(s) for s in a.sizes.split(",") if s.strip()]
    grid_targets = [None if v.strip() == "auto" else int(v) for v in a.grid_targets.split(",") if v.strip()]
    items = [int(v) for v in a.items.split(",") if v.strip()]
    # A GPU-time budget far above any timed submission: K reductions stay in one submission.
    rt = hetero.Runtime(gpu_budget_ms=1e9)
    try:
        dev = rt.device()
        torch = torch_cuda()
        emit(**adapter_fields(dev),
             subgroups="subgroup" in dev.features,
             max_storage_buffer_binding_size=dev.limits["max-storage-buffer-binding-size"],
             reference="torch.sum (CUDA)" if torch is not None else "numpy.sum (host)")
        rtt = empty_round_trip(dev)
        emit(empty_submission_ms=round(rtt * 1e3, 4))
        for nbytes in sizes:
            bench_size(dev, nbytes, a.repeat, a.min_ms, torch, rtt, grid_targets, items)
        if not a.no_accuracy:
            accuracy(dev, torch)
    finally:
        rt.close()


if __name__ == "__main__":
    main()
