"""Per-stage timings of the last run: wall-clock instants in order, GPU time kept apart."""

from __future__ import annotations

import operator
import time

import numpy as np
import pytest

import hetero

pytestmark = pytest.mark.anyio

DOUBLE = """
@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) { if (gid.x < arrayLength(&x)) { x[gid.x] = 2.0 * x[gid.x]; } }
"""


def double(gpu: hetero.GPUContext, t: hetero.Tensor) -> hetero.Tensor:
    out = gpu.upload(np.zeros(t.shape, np.float32))
    gpu.dispatch(DOUBLE, (t.size + 63) // 64, out)
    return out


async def test_stats_of_a_cpu_gpu_cpu_run(shared_rt: hetero.Runtime) -> None:
    """
    ::

        x -> prep (cpu, sleeps 20 ms) -> double (gpu) -> total (cpu)
    """
    def prep(v: np.ndarray) -> np.ndarray:
        time.sleep(0.02)
        return v.astype(np.float32)

    g = hetero.Graph("timed")
    p = g.cpu(prep, g.input("x"))
    d = g.gpu(double, p)
    g.output(g.cpu(lambda a: float(a.sum()), d, name="total"))
    assert await shared_rt.run(g, x=np.ones(10)) == 0.0  # double() doubles zeros
    s = shared_rt.stats()
    assert s.graph == "timed" and s.ok and s.wall_ms > 20
    assert [st.name for st in s.stages] == ["prep", "double", "total"]
    prep_s, gpu_s, total_s = s.stages
    assert prep_s.kind == "cpu" and gpu_s.kind == "gpu"
    for st in s.stages:
        assert st.queued is not None and st.started is not None and st.completed is not None
        assert 0 <= st.queued <= st.started <= st.completed <= s.wall_ms / 1e3
    assert prep_s.wall_ms is not None and prep_s.wall_ms >= 20
    assert gpu_s.recorded is not None and gpu_s.submitted is not None
    assert gpu_s.started <= gpu_s.recorded <= gpu_s.submitted <= gpu_s.completed
    assert prep_s.completed <= gpu_s.started and gpu_s.completed <= total_s.started
    assert prep_s.submitted is None  # CPU stages are not submitted
    assert s.stage("double") is gpu_s
    with pytest.raises(KeyError, match="has no stage 'nope'"):
        s.stage("nope")


async def test_stats_of_a_failed_run(rt: hetero.Runtime) -> None:
    g = hetero.Graph("bad")
    a = g.cpu(operator.truediv, 1, 0, name="div")
    g.output(g.cpu(operator.neg, a, name="neg"))
    with pytest.raises(hetero.StageError):
        await rt.run(g)
    s = rt.stats()
    assert not s.ok
    assert s.stage("div").started is not None and s.stage("div").completed is None
    assert s.stage("neg").queued is None


def test_stats_before_any_run() -> None:
    with hetero.Runtime() as rt:
        with pytest.raises(hetero.HeteroError, match="no run yet"):
            rt.stats()
