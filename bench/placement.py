"""Placement on a mixed workload: many small products and a few large ones, auto against all-CPU and all-GPU.

    python -m bench.placement [--small 64] [--large 2048] [--n-small 2000] [--n-large 8]
                              [--in-flight 8] [--repeats 3]

One graph, one stage with two implementations (``x @ w``: ``hetero.ops.cpu.matmul`` in
numpy, ``hetero.ops.matmul`` on the GPU), run over ``--n-small`` inputs of
``--small``^2 and ``--n-large`` of ``--large``^2, shuffled (seeded), through
``Runtime.map`` with ``--in-flight`` runs at once, under ``Runtime(placement="cpu")``,
``"gpu"`` and ``"auto"``, in this order, in one process. Each mode runs the whole
workload once untimed (kernel compilation; for "auto" the model's calibration), then
``--repeats`` timed passes; the best pass counts. Results are checked against the
all-CPU ones. One JSON line per mode (seconds, items/s, how many small and large
products ran on each side in the best pass), then the ratios of auto to each.
"""

from __future__ import annotations

import argparse
import platform
import threading
import time
from collections import Counter
from typing import Any

import anyio
import numpy as np

import hetero
from hetero import ops
from bench._common import adapter_fields, emitter

emit = emitter("placement")


def build(counts: Counter[tuple[str, int]]) -> hetero.Graph:
    lock = threading.Lock()

    def on_cpu(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        with lock:
            counts[("cpu", x.shape[0])] += 1
        return ops.cpu.matmul(x, w)

    def on_gpu(gpu: hetero.GPUContext, x: Any, w: Any) -> hetero.Tensor:
        with lock:
            counts[("gpu", x.shape[0])] += 1
        return ops.matmul(gpu, x, w)

    g = hetero.Graph("placement")
    g.output(g.stage(g.input("x"), g.input("w"), cpu=on_cpu, gpu=on_gpu, name="matmul"))
    return g


def workload(args: argparse.Namespace) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    items = []
    for n, count in ((args.small, args.n_small), (args.large, args.n_large)):
        w = rng.standard_normal((n, n)).astype(np.float32) / np.float32(np.sqrt(n))
        for _ in range(count):
            items.append({"x": rng.standard_normal((n, n)).astype(np.float32), "w": w})
    order = rng.permutation(len(items))
    return [items[i] for i in order]


async def one_pass(rt: hetero.Runtime, g: hetero.Graph, items: list[dict[str, np.ndarray]],
                   in_flight: int) -> tuple[float, list[np.ndarray]]:
    outs = []
    t0 = time.perf_counter()
    async for out in rt.map(g, items, max_in_flight=in_flight):
        outs.append(out)
    return time.perf_counter() - t0, outs


async def measure(mode: str, args: argparse.Namespace, items: list[dict[str, np.ndarray]]) -> dict[str, Any]:
    counts: Counter[tuple[str, int]] = Counter()
    g = build(counts)
    async with hetero.Runtime(placement=mode) as rt:
        await one_pass(rt, g, items, args.in_flight)  # warm: kernels compiled, the model calibrated
        best, outs, best_counts = float("inf"), [], Counter[tuple[str, int]]()
        for _ in range(args.repeats):
            counts.clear()
            t, o = await one_pass(rt, g, items, args.in_flight)
            if t < best:
                best, outs, best_counts = t, o, Counter(counts)
        dev = await anyio.to_thread.run_sync(rt.device)
        fields = adapter_fields(dev)
    placed = {f"{side}_{'small' if n == args.small else 'large'}": c for (side, n), c in sorted(best_counts.items())}
    return {"mode": mode, "seconds": round(best, 4), "items_per_s": round(len(items) / best, 1), **placed,
            **fields, "outs": outs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", type=int, default=64, help="side of the small matrices (default: %(default)s)")
    p.add_argument("--large", type=int, default=2048, help="side of the large matrices (default: %(default)s)")
    p.add_argument("--n-small", type=int, default=2000)
    p.add_argument("--n-large", type=int, default=8)
    p.add_argument("--in-flight", type=int, default=8, help="runs in flight at once (Runtime.map)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    items = workload(args)
    common = {"small": args.small, "large": args.large, "n_small": args.n_small, "n_large": args.n_large,
              "in_flight": args.in_flight, "cpu": platform.processor() or platform.machine()}
    results = {}
    for mode in ("cpu", "gpu", "auto"):
        r = anyio.run(measure, mode, args, items)
        outs = r.pop("outs")
        if mode != "cpu":
            worst = max(float(np.abs(a - b).max()) for a, b in zip(outs, results["cpu"]["outs"]))
            r["max_abs_diff_vs_cpu"] = worst
            if worst > 1e-3:
                raise SystemExit(f"placement={mode!r} disagrees with the CPU implementation: max |diff| {worst}")
        emit(**common, **r)
        results[mode] = {**r, "outs": outs}
    a = results["auto"]["seconds"]
    emit(**common, auto_over_cpu=round(results["cpu"]["seconds"] / a, 3),
         auto_over_gpu=round(results["gpu"]["seconds"] / a, 3), target=1.2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
