"""Where the host time of a tiny GPU stage goes: wgpu calls, hetero's context, the scheduler.

    python -m bench.stage_cost [--n 2000] [--profile]

Prints microseconds per iteration for each layer, from bare wgpu calls up to a
chain of GPU stages run by the scheduler, so that costs can be attributed.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from typing import Callable

import anyio
import numpy as np

import hetero
from bench._common import emitter
from bench.gpu_runtime import TINY, chain_graph

emit = emitter("stage_cost")


def per_iter(fn, n: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    rt = hetero.Runtime()
    dev = rt.device()
    d = dev.device
    k = dev.kernel(TINY)
    ctx0 = hetero.GPUContext(dev, "probe")
    t = ctx0.empty(64)
    layout = k.pipeline.get_bind_group_layout(0)
    bg = d.create_bind_group(layout=layout, entries=[{"binding": 0, "resource": {"buffer": t.buffer, "offset": 0, "size": 256}}])

    def encoder_only() -> None:
        d.create_command_encoder().finish()

    def encoder_dispatch() -> None:
        e = d.create_command_encoder()
        p = e.begin_compute_pass()
        p.set_pipeline(k.pipeline)
        p.set_bind_group(0, bg)
        p.dispatch_workgroups(1)
        p.end()
        e.finish()

    def many(passes: bool, k_disp: int = 10, submit: bool = False) -> Callable[[], None]:
        def run() -> None:
            e = d.create_command_encoder()
            p = None
            for _ in range(k_disp):
                if p is None or passes:
                    p = e.begin_compute_pass()
                p.set_pipeline(k.pipeline)
                p.set_bind_group(0, bg)
                p.dispatch_workgroups(1)
                if passes:
                    p.end()
            if not passes:
                p.end()
            cb = e.finish()
            if submit:
                dev.submit([cb])
        return run

    def bind_group() -> None:
        d.create_bind_group(layout=layout, entries=[{"binding": 0, "resource": {"buffer": t.buffer, "offset": 0, "size": 256}}])

    def kernel_lookup() -> None:
        dev.kernel(TINY)

    def submit_empty() -> None:
        dev.submit([d.create_command_encoder().finish()])

    def context_stage() -> None:
        c = hetero.GPUContext(dev, "s")
        c.dispatch(TINY, 1, t)
        dev.enqueue(c.encoder.finish())

    rows = {}
    for name, fn in [("encoder+finish", encoder_only), ("encoder+pass+dispatch+finish", encoder_dispatch),
                     ("create_bind_group", bind_group), ("kernel cache lookup", kernel_lookup),
                     ("submit empty", submit_empty), ("GPUContext dispatch+enqueue", context_stage)]:
        rows[name] = per_iter(fn, a.n)
    for name, fn in [("per dispatch: 10 passes, 1 encoder", many(True)),
                     ("per dispatch: 10 passes, 1 encoder, submitted", many(True, submit=True)),
                     ("per dispatch: 1 pass of 10, 1 encoder", many(False)),
                     ("per dispatch: 1 pass of 100, 1 encoder, submitted", many(False, 100, True))]:
        k_disp = 100 if "100" in name else 10
        rows[name] = per_iter(fn, max(1, a.n // k_disp)) / k_disp
    dev.flush()
    g = chain_graph(200)
    x = np.zeros(64, np.float32)
    anyio.run(lambda: rt.run(g, x=x))
    t0 = time.perf_counter()
    for _ in range(3):
        anyio.run(lambda: rt.run(g, x=x))
    rows["scheduler: chain stage"] = (time.perf_counter() - t0) / 600 * 1e6
    for name, us in rows.items():
        emit(layer=name, us=round(us, 1))
    if a.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(a.n):
            context_stage()
        prof.disable()
        dev.flush()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    rt.close()


if __name__ == "__main__":
    main()
