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
        assert st.queued_s is not None and st.started_s is not None and st.completed_s is not None
        assert 0 <= st.queued_s <= st.started_s <= st.completed_s <= s.wall_ms / 1e3
    assert prep_s.wall_ms is not None and prep_s.wall_ms >= 20
    assert gpu_s.recorded_s is not None and gpu_s.submitted_s is not None
    assert gpu_s.started_s <= gpu_s.recorded_s <= gpu_s.submitted_s <= gpu_s.completed_s
    assert prep_s.completed_s <= gpu_s.started_s and gpu_s.completed_s <= total_s.started_s
    assert prep_s.submitted_s is None  # CPU stages are not submitted
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
    assert s.stage("div").started_s is not None and s.stage("div").completed_s is None
    assert s.stage("neg").queued_s is None


def test_stats_before_any_run() -> None:
    with hetero.Runtime() as rt:
        with pytest.raises(hetero.HeteroError, match="no run yet"):
            rt.stats()


async def test_runtime_trace_holds_cpu_gpu_fence_transfer_and_memory_events(tmp_path) -> None:
    """One trace file: CPU worker spans, GPU recording, GPU stage spans on the queue track, fences."""
    from tests.test_trace import check_trace, load

    path = tmp_path / "run.trace.json"
    g = hetero.Graph("traced")
    d = g.gpu(double, g.cpu(lambda v: v.astype(np.float32), g.input("x"), name="prep"))
    g.output(g.cpu(lambda a: float(a.sum()), d, name="total"))
    async with hetero.Runtime(trace=path) as rt:
        for _ in range(2):
            await rt.run(g, x=np.ones(100))
        timed = rt.device().timer.strategy == "inside-passes"
    data = load(path)
    tracks = check_trace(data)  # the trace-event rules Perfetto's importer applies
    names = set(tracks.values())
    assert "GPU queue" in names and "event loop" in names
    assert any(n.startswith("hetero-cpu") for n in names) and any(n.startswith("hetero-gpu") for n in names)
    assert any(n.startswith("hetero-fence") for n in names)
    events = [e for e in data["traceEvents"] if e["ph"] == "X"]
    cats = {e["cat"] for e in events}
    assert {"cpu", "gpu-record", "fence", "transfer", "submit"} <= cats
    by_name = {(e["cat"], e["name"]) for e in events}
    assert ("cpu", "prep") in by_name and ("gpu-record", "double") in by_name
    if timed:  # lavapipe writes timestamps inside passes: the stage appears on the GPU queue track
        gpu = [e for e in events if e["cat"] == "gpu" and e["name"] == "double"]
        assert len(gpu) == 2 and all(tracks[e["tid"]] == "GPU queue" for e in gpu)
        # each GPU span names its run, as the stage's recording span does
        recorded = sorted(e["args"]["run"] for e in events if e["cat"] == "gpu-record" and e["name"] == "double")
        assert sorted(e["args"]["run"] for e in gpu) == recorded and len(set(recorded)) == 2
        assert rt.stats().stage("double").gpu_ms is not None
    assert any(e["ph"] == "C" and e["name"] == "gpu memory" for e in data["traceEvents"])


async def test_gpu_time_per_stage_when_asked() -> None:
    g = hetero.Graph("gpu_timed")
    g.output(g.gpu(double, g.input("x")))
    for timing in (False, True):
        async with hetero.Runtime(gpu_timing=timing) as rt:
            await rt.run(g, x=np.ones(1000, np.float32))
            s = rt.stats().stage("double")
            measured = timing and rt.device().timer.strategy == "inside-passes"
            assert (s.gpu_ms is not None) == measured
            if measured:
                assert s.gpu_ms is not None and 0 <= s.gpu_ms < rt.stats().wall_ms


def test_instants_carry_their_unit_and_keep_their_old_names() -> None:
    s = hetero.StageStats("a", "cpu", 0.5, 1.0, 1.25, None, 1.5, gpu_ms=None)
    assert (s.queued_s, s.started_s, s.recorded_s, s.submitted_s, s.completed_s) == (0.5, 1.0, 1.25, None, 1.5)
    assert (s.queued, s.started, s.recorded, s.submitted, s.completed) == (0.5, 1.0, 1.25, None, 1.5)
    assert s.wall_ms == 500.0
