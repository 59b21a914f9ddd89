"""Host time to record one op inside a GPU stage (tiny shapes: the GPU's time does not count).

    python -m bench.op_record [R] [M]

One GPU stage records an op ``R`` times (default 200) on ``[M, 384]`` float32 data
(default M = 8), and returns the time per op measured inside the stage; each figure is
the best of three runs after a warm one (compiled kernels, pooled buffers, cached bind
groups and uniforms). Ops: ``dispatch_only`` (a one-binding kernel through
``gpu.dispatch``), ``gelu`` (with bias), ``layernorm`` (with residual) and ``matmul``
(``transpose_b``, bias, a [384, 384] weight). The same four again with a pure-Python
thread spinning beside the stage: what the GIL does to a recording thread (each wgpu call
releases the GIL and may wait up to the switch interval to get it back).

Prints one JSON line per op with the device's bind-cache counters (uniforms, bind groups,
hits, misses) after it.
"""

from __future__ import annotations

import sys
import threading
import time
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


def graph(kind: str, r: int) -> hetero.Graph:
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
    out = g.gpu(stage, g.input("x"), g.input("w"), g.input("g"), name=kind)
    g.output(g.cpu(lambda v: v, out, name="id"))
    return g


def measure(rt: hetero.Runtime, kinds: tuple[str, ...], r: int, arrays: dict[str, np.ndarray],
            **extra: Any) -> None:
    for kind in kinds:
        g = graph(kind, r)
        anyio.run(lambda: rt.run(g, **arrays))
        us = [float(anyio.run(lambda: rt.run(g, **arrays))) for _ in range(3)]
        emit(op=kind, **extra, record_us_per_op=round(min(us), 1), adapter=rt.device().summary["summary"],
             **rt.device().binds.stats())


def main() -> None:
    r = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    m = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    rng = np.random.default_rng(0)
    arrays = {"x": rng.standard_normal((m, 384), dtype=np.float32),
              "w": rng.standard_normal((384, 384), dtype=np.float32),
              "g": rng.standard_normal(384, dtype=np.float32)}
    with hetero.Runtime() as rt:
        measure(rt, ("dispatch_only", "gelu", "layernorm", "matmul"), r, arrays)
    stop = [False]

    def busy() -> None:
        x = 0
        while not stop[0]:
            x += 1

    th = threading.Thread(target=busy, daemon=True)
    th.start()
    try:
        with hetero.Runtime() as rt:
            measure(rt, ("dispatch_only", "gelu", "matmul"), r, arrays, with_busy_python_thread=True)
    finally:
        stop[0] = True


if __name__ == "__main__":
    main()
