"""Host time to record one op inside a GPU stage (tiny shapes: the GPU's time does not count).

    python -m bench.op_record [R] [M]

One GPU stage records an op ``R`` times (default 200) on ``[M, 384]`` float32 data
(default M = 8), and returns the time per op measured inside the stage; each figure is
the best of three runs after a warm one (compiled kernels, pooled buffers, cached bind
groups and uniforms). Ops: ``dispatch_only`` (a one-binding kernel through
``gpu.dispatch``), ``gelu`` (with bias), ``layernorm`` (with residual) and ``matmul``
(``transpose_b``, bias, a [384, 384] weight). The same four again with a pure-Python
thread spinning beside the stage: what the GIL does to a recording thread (each wgpu call
releases the GIL and may wait up to the switch interval to get it back); three of them
replayed beside that thread too (a replay's pass commands keep the GIL); and the same three
once more on a traced Runtime (``traced``: two GPU timestamps around every dispatch, where
the adapter can write them inside passes).

Prints one JSON line per op with the device's bind-cache counters (uniforms, bind groups,
hits, misses) after it.

Then the same stages declared with ``capture=True`` (see ``hetero._gpu.capture``): the first
run captures, the next ones replay without calling the stage function. A replay is timed
from the stage's start to the end of its recording (``rt.stats()``: ``recorded - started``,
which also holds the stage's fixed cost, spread over ``R`` ops), median of nine; printed per
op and per replayed dispatch beside the recorded figure of the same op in this run, with
their ratio.
"""

from __future__ import annotations

import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np

import hetero
from hetero import ops
from bench._common import emitter

TOUCH = """
@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) { if (gid.x < 4u) { x[gid.x] += 1.0; } }
"""

emit = emitter("op_record")
REPLAYS = 9  # replayed runs per op; the median counts


def graph(kind: str, r: int, capture: bool = False) -> hetero.Graph:
    def stage(gpu: hetero.GPUContext, x: Any, w: Any, g_: Any) -> np.float64:
        t0 = time.perf_counter()
        for _ in range(r):
            if kind == "matmul":
                ops.matmul(gpu, x, w, transpose_b=True, bias=g_)
            elif kind == "layernorm":
                ops.layernorm(gpu, x, g_, g_, residual=x)
            elif kind == "gelu":
                ops.gelu(gpu, x, bias=g_)
            else:
                gpu.dispatch(TOUCH, 1, x)
        return np.float64((time.perf_counter() - t0) / r * 1e6)

    g = hetero.Graph(kind)
    out = g.gpu(stage, g.input("x"), g.input("w"), g.input("g"), name=kind, capture=capture)
    g.output(g.cpu(lambda v: v, out, name="id"))
    return g


def measure(rt: hetero.Runtime, kinds: tuple[str, ...], r: int, arrays: dict[str, np.ndarray],
            **extra: Any) -> dict[str, float]:
    recorded = {}
    for kind in kinds:
        g = graph(kind, r)
        anyio.run(lambda: rt.run(g, **arrays))
        us = [float(anyio.run(lambda: rt.run(g, **arrays))) for _ in range(3)]
        recorded[kind] = min(us)
        emit(op=kind, **extra, record_us_per_op=round(min(us), 1), adapter=rt.device().summary["summary"],
             **rt.device().binds.stats())
    return recorded


def measure_replay(rt: hetero.Runtime, kinds: tuple[str, ...], r: int, arrays: dict[str, np.ndarray],
                   recorded: dict[str, float], **extra: Any) -> None:
    """Host time of a replayed op and of one replayed dispatch, beside recording the op."""
    cache = rt.device().captures
    for kind in kinds:
        g = graph(kind, r, capture=True)
        before = cache.stats()["captures"]
        anyio.run(lambda: rt.run(g, **arrays))  # captures
        assert cache.stats()["captures"] == before + 1
        dispatches = cache.newest_dispatches()
        us = []
        for _ in range(REPLAYS):
            anyio.run(lambda: rt.run(g, **arrays))
            st = rt.stats().stage(kind)
            assert st.replayed and st.started is not None and st.recorded is not None
            us.append((st.recorded - st.started) * 1e6 / r)
        per_op = float(np.median(us))
        emit(op=kind, **extra, replay_us_per_op=round(per_op, 2), dispatches_per_op=dispatches / r,
             replay_us_per_dispatch=round(per_op * r / dispatches, 2),
             best_replay_us_per_dispatch=round(min(us) * r / dispatches, 2), record_us_per_op=round(recorded[kind], 1),
             ratio_record_over_replay=round(recorded[kind] / per_op, 1), **rt.device().binds.stats())


def main() -> None:
    r = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    m = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    rng = np.random.default_rng(0)
    arrays = {"x": rng.standard_normal((m, 384), dtype=np.float32),
              "w": rng.standard_normal((384, 384), dtype=np.float32),
              "g": rng.standard_normal(384, dtype=np.float32)}
    kinds = ("dispatch_only", "gelu", "layernorm", "matmul")
    with hetero.Runtime() as rt:
        recorded = measure(rt, kinds, r, arrays)
        measure_replay(rt, kinds, r, arrays, recorded)
    stop = [False]

    def busy() -> None:
        x = 0
        while not stop[0]:
            x += 1

    th = threading.Thread(target=busy, daemon=True)
    th.start()
    try:
        busy_kinds = ("dispatch_only", "gelu", "matmul")
        with hetero.Runtime() as rt:
            recorded = measure(rt, busy_kinds, r, arrays, with_busy_python_thread=True)
            measure_replay(rt, busy_kinds, r, arrays, recorded, with_busy_python_thread=True)
        with tempfile.TemporaryDirectory(prefix="hetero-op-record-") as d, \
                hetero.Runtime(trace=Path(d) / "trace.json") as rt:
            # traced: two GPU timestamps around every dispatch, where the adapter writes them in passes
            recorded = measure(rt, busy_kinds, r, arrays, with_busy_python_thread=True, traced=True)
            measure_replay(rt, busy_kinds, r, arrays, recorded, with_busy_python_thread=True, traced=True)
    finally:
        stop[0] = True


if __name__ == "__main__":
    main()
