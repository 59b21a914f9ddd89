"""Overhead of TDR-safe splitting: one long kernel run unsplit and under GPU-time budgets.

    python -m bench.split [--iters 4000] [--budgets 5,50,500] [--repeat 3]

The kernel uses hetero's grid helpers, so it may be split. "unsplit" runs it as one
dispatch in one submission (a budget larger than the whole kernel); each budget then
runs the same work split into sub-dispatches and submissions that fit the budget,
after one warm-up run that calibrates the cost model. The overhead is the extra wall
time against the unsplit run.
"""

from __future__ import annotations

import argparse
import time

import anyio
import numpy as np

import hetero
from bench._common import emitter

HEAVY = """
@group(0) @binding(0) var<storage, read_write> out: array<u32>;
struct P { iters: u32, n: u32 }
@group(0) @binding(1) var<uniform> p: P;
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = hetero_workgroup_id(wid).x * 256u + lid.x;
    if (i >= p.n) { return; }
    var a = i;
    for (var j = 0u; j < p.iters; j++) { a = a * 1664525u + 1013904223u; }
    out[i] = a;
}
"""


emit = emitter("split")


def graph(n: int, iters: int, infos: list) -> hetero.Graph:
    def heavy(gpu: hetero.GPUContext) -> hetero.Tensor:
        out = gpu.empty(n, np.uint32)
        infos.append(gpu.dispatch(HEAVY, -(-n // 256), out, np.array([iters, n], np.uint32)))
        return out

    g = hetero.Graph("heavy")
    g.output(g.cpu(lambda v: int(v[-1]), g.gpu(heavy), name="last"))
    return g


def timed(budget_ms: float, n: int, iters: int, repeat: int) -> tuple[float, object, int]:
    infos: list = []
    g = graph(n, iters, infos)
    with hetero.Runtime(gpu_budget_ms=budget_ms) as rt:
        ref = anyio.run(lambda: rt.run(g))  # warm-up: compile, calibrate
        dev = rt.device()
        best, subs = float("inf"), 0
        for _ in range(repeat):
            before = dev.submissions
            t0 = time.perf_counter()
            assert anyio.run(lambda: rt.run(g)) == ref
            best = min(best, time.perf_counter() - t0)
            subs = dev.submissions - before
    return best, infos[-1], subs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workgroups", type=int, default=65535)
    ap.add_argument("--iters", type=int, default=4000)
    ap.add_argument("--budgets", default="5,50,500")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    n = a.workgroups * 256
    with hetero.Runtime() as rt:
        emit(adapter=rt.device().summary["summary"])
    base, info, subs = timed(1e9, n, a.iters, a.repeat)
    emit(config="unsplit", ms=round(base * 1e3, 2), sub_dispatches=info.sub_dispatches, submissions=subs)
    for b in (float(x) for x in a.budgets.split(",")):
        t, info, subs = timed(b, n, a.iters, a.repeat)
        emit(config=f"budget {b:g} ms", ms=round(t * 1e3, 2), sub_dispatches=info.sub_dispatches,
             chunk=info.chunk, submissions=subs, overhead_pct=round((t / base - 1) * 100, 2))


if __name__ == "__main__":
    main()
