"""Stages with a CPU and a GPU implementation, placed per execution by a performance model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import hetero
from hetero import GraphError, PerfModel, Placement, StageError, ops
from hetero._placement import HEAVY_BYTES, Placer, size_bucket

pytestmark = pytest.mark.anyio


def rand(shape: Any, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _gelu_cpu(x: np.ndarray) -> np.ndarray:
    return ops.cpu.gelu(x)


def _gelu_gpu(gpu: hetero.GPUContext, x: Any) -> hetero.Tensor:
    return ops.gelu(gpu, x)


def mixed_graph() -> hetero.Graph:
    """A plain GPU stage, two mixed stages, a plain CPU stage: every kind of edge around a mixed stage."""
    g = hetero.Graph("mixed")
    x = g.input("x")
    gamma, beta = np.linspace(0.5, 1.5, 16, dtype=np.float32), np.linspace(-1, 1, 16, dtype=np.float32)
    scaled = g.gpu(lambda gpu, v: ops.add(gpu, v, v), x, name="double")  # a device value
    act = g.stage(scaled, cpu=_gelu_cpu, gpu=_gelu_gpu, name="gelu")
    norm = g.stage(act, scaled, gamma, beta, name="norm",
                   cpu=lambda a, r, gm, bt: ops.cpu.layernorm(a, gm, bt, eps=1e-6, residual=r),
                   gpu=lambda gpu, a, r, gm, bt: ops.layernorm(gpu, a, gm, bt, eps=1e-6, residual=r))
    soft = g.stage(norm, name="softmax", cpu=lambda v: ops.cpu.softmax(v, scale=0.5),
                   gpu=lambda gpu, v: ops.softmax(gpu, v, scale=0.5))
    total = g.cpu(lambda v: float(v.sum()), soft, name="total")
    g.output(soft, total, norm)
    return g


def reference(x: np.ndarray) -> np.ndarray:
    import math

    d = (2 * x).astype(np.float64)
    a = d * 0.5 * np.vectorize(math.erfc)(-d / math.sqrt(2))
    v = a + d
    v = (v - v.mean(-1, keepdims=True)) / np.sqrt(v.var(-1, keepdims=True) + 1e-6)
    v = v * np.linspace(0.5, 1.5, 16) + np.linspace(-1, 1, 16)
    e = np.exp(0.5 * v - (0.5 * v).max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


_ADAPTER: list[Any] = []


def runtime(**kw: Any) -> hetero.Runtime:
    """A Runtime on the session's one adapter (adapters are only released with the process)."""
    if not _ADAPTER:
        from hetero._gpu.device import select_adapter

        _ADAPTER.append(select_adapter())
    return hetero.Runtime(cpu_threads=2, adapter=_ADAPTER[0], **kw)


@pytest.fixture(scope="module", params=["cpu", "gpu", "auto"])
def placed_rt(request: pytest.FixtureRequest) -> Iterator[hetero.Runtime]:
    rt = runtime(placement=request.param)
    yield rt
    rt.close()


# -- declaring ------------------------------------------------------------------------------------------------
def test_stage_declares_two_implementations() -> None:
    g = hetero.Graph("g")
    x = g.input("x")
    s = g.stage(x, cpu=_gelu_cpu, gpu=_gelu_gpu)
    assert s.name == "_gelu_cpu" and s.kind == "mixed" and s.cpu_fn is _gelu_cpu and s.fn is _gelu_gpu
    with pytest.raises(GraphError, match="needs callable cpu= and gpu="):
        g.stage(x, cpu=_gelu_cpu, gpu=None, name="bad")  # type: ignore[arg-type]
    with pytest.raises(GraphError, match="lambda implementations needs name="):
        g.stage(x, cpu=lambda v: v, gpu=_gelu_gpu)
    with pytest.raises(GraphError, match="already has a stage named"):
        g.stage(x, cpu=_gelu_cpu, gpu=_gelu_gpu)
    g.output(s)
    plan = g.plan()
    cpu_v, gpu_v = plan.variants[s.index]
    assert (cpu_v.kind, cpu_v.fn, gpu_v.kind, gpu_v.fn) == ("cpu", _gelu_cpu, "gpu", _gelu_gpu)
    assert plan.stages[s.index].kind == "mixed" and plan.has_gpu


async def test_a_graph_with_two_implementation_stages_pickles() -> None:
    import pickle

    g = hetero.Graph("pickled")
    g.output(g.stage(g.input("x"), cpu=_gelu_cpu, gpu=_gelu_gpu, name="gelu"))
    copy = pickle.loads(pickle.dumps(g))
    x = rand((3, 5))
    with runtime(placement="cpu") as rt:
        np.testing.assert_array_equal(await rt.run(copy, x=x), await rt.run(g, x=x))
        assert rt.stats().devices == {"gelu": "cpu"}


def test_runtime_rejects_bad_placement_options() -> None:
    with pytest.raises(ValueError, match="placement must be one of 'auto', 'cpu', 'gpu', got 'fast'"):
        hetero.Runtime(placement="fast")
    with pytest.raises(TypeError, match="perf_model must be a hetero.PerfModel"):
        hetero.Runtime(perf_model={})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="calibration_samples"):
        PerfModel(calibration_samples=0)
    with pytest.raises(ValueError, match="blas_threads must be an integer >= 0 or None, got -1"):
        hetero.Runtime(blas_threads=-1)


# -- results --------------------------------------------------------------------------------------------------
async def test_results_agree_across_placements(placed_rt: hetero.Runtime) -> None:
    x = rand((12, 16), seed=3)
    g = mixed_graph()
    for _ in range(3):
        soft, total, norm = await placed_rt.run(g, x=x)
    np.testing.assert_allclose(soft, reference(x), rtol=2e-5, atol=1e-6)
    assert total == pytest.approx(12.0, rel=1e-5)
    assert norm.shape == (12, 16)
    stats = placed_rt.stats()
    mode = placed_rt.options.placement
    placed = {s.name: s for s in stats.stages if s.placement is not None}
    assert sorted(placed) == ["gelu", "norm", "softmax"]
    assert stats.devices["double"] == "gpu" and stats.devices["total"] == "cpu"
    for s in placed.values():
        assert s.device == s.kind == s.placement.device
        if mode != "auto":
            assert (s.placement.device, s.placement.reason) == (mode, "forced")


async def test_a_cpu_placed_stage_downloads_what_a_gpu_stage_left_on_the_device() -> None:
    """Forced onto the CPU, a mixed stage reading a GPU stage's value receives a host array."""
    seen: list[type] = []

    def cpu(v: np.ndarray) -> np.ndarray:
        seen.append(type(v))
        return v * 3

    g = hetero.Graph("down")
    d = g.gpu(lambda gpu, v: ops.add(gpu, v, v), g.input("x"), name="double")
    g.output(g.stage(d, cpu=cpu, gpu=lambda gpu, v: ops.add(gpu, v, ops.add(gpu, v, v)), name="triple"))
    with runtime(placement="cpu") as forced:
        out = await forced.run(g, x=np.arange(8, dtype=np.float32))
    assert seen == [np.ndarray]
    np.testing.assert_array_equal(out, np.arange(8, dtype=np.float32) * 6)
    assert forced.memory_stats().in_use_bytes == 0


# -- the model ------------------------------------------------------------------------------------------------
def frozen(**seeds: tuple[float, float]) -> PerfModel:
    """A model that learns nothing: ``stage=(cpu seconds, gpu seconds)`` for every bucket up to 40."""
    m = PerfModel(learn=False)
    for stage, (c, g) in seeds.items():
        for b in range(41):
            m.seed(stage, "cpu", b, c)
            m.seed(stage, "gpu", b, g)
    return m


async def test_a_seeded_model_decides_and_stats_show_the_estimates() -> None:
    x = rand((4, 4))  # 64 bytes: light work
    g = hetero.Graph("one")
    g.output(g.stage(g.input("x"), cpu=_gelu_cpu, gpu=_gelu_gpu, name="gelu"))
    for (c, gs), want in (((1e-3, 1e-1), "cpu"), ((1e-1, 1e-3), "gpu")):
        with runtime(perf_model=frozen(gelu=(c, gs))) as rt:
            for _ in range(3):
                await rt.run(g, x=x)
            p = rt.stats().stage("gelu").placement
            assert rt.stats().devices["gelu"] == want
        assert isinstance(p, Placement)
        assert (p.device, p.reason, p.bytes, p.bucket) == (want, "model", 64, size_bucket(64))
        est = dict(p.estimates)
        assert dict(est["cpu"])["exec"] == c and dict(est["gpu"])["exec"] == gs
        assert dict(est["cpu"])["transfer"] == 0.0 and dict(est["gpu"])["transfer"] > 0  # x is on the host
        assert p.cpu_s == pytest.approx(c) and p.gpu_s == pytest.approx(gs + dict(est["gpu"])["transfer"])
        assert json.loads(json.dumps(p.as_dict()))["estimates"]["cpu"]["exec"] == c


async def test_cold_start_calibrates_one_side_then_the_other_then_uses_the_model() -> None:
    g = hetero.Graph("cold")
    g.output(g.stage(g.input("x"), cpu=_gelu_cpu, gpu=_gelu_gpu, name="gelu"))
    seen = []
    with runtime(perf_model=PerfModel(calibration_samples=2)) as rt:
        for _ in range(7):
            await rt.run(g, x=rand((2, 4)))
            p = rt.stats().stage("gelu").placement
            assert p is not None
            seen.append((p.device, p.reason))
        # One warm-up execution per side calibrates nothing, then two samples each; the GPU
        # side first, unless the adapter is CPU-emulated.
        emulated = hetero.lowlevel.device_of(rt).summary["type"].lower() == "cpu"
        first, second = ("cpu", "gpu") if emulated else ("gpu", "cpu")
        assert seen[:6] == [(first, "calibrating")] * 3 + [(second, "calibrating")] * 3
        assert seen[6][1] == "model"
        table = rt.perf_model.table()["gelu"]
        b = size_bucket(32)
        assert table["cpu"][b][0] == 2 + (seen[6][0] == "cpu") and table["gpu"][b][0] == 2 + (seen[6][0] == "gpu")


def test_rules_ties_queue_waits_and_dominated_sides() -> None:
    m = PerfModel(learn=False)
    m.seed("s", "cpu", 0, 1.0)
    m.seed("s", "gpu", 0, 1.0)
    placer = Placer("auto", m, cpu_workers=1)
    tie = placer.decide("s", 0, 0, True, "DiscreteGPU")
    assert (tie.device, tie.reason, tie.cpu_s, tie.gpu_s) == ("cpu", "model", 1.0, 1.0)  # a tie goes to the CPU
    # The CPU's queue now holds 1 s of work: the GPU completes first.
    second = placer.decide("s", 0, 0, True, "DiscreteGPU")
    assert (second.device, second.cpu_s, second.gpu_s) == ("gpu", 2.0, 1.0)
    placer.finished("s", tie, None)
    placer.finished("s", second, None)
    assert placer.decide("s", 0, 0, True, "DiscreteGPU").device == "cpu"
    # A side far slower wherever both were measured is not calibrated at a new size.
    m.seed("big", "cpu", 20, 3.2)
    m.seed("big", "gpu", 20, 0.1)
    m.seed("big", "gpu", 21, 0.2)
    dom = Placer("auto", m, 1).decide("big", 1 << 20, 0, True, "DiscreteGPU")
    assert (dom.device, dom.reason) == ("gpu", "dominated")
    m.seed("close", "cpu", 20, 0.3)
    m.seed("close", "gpu", 20, 0.1)
    m.seed("close", "gpu", 21, 0.2)
    assert Placer("auto", m, 1).decide("close", 1 << 20, 0, True, "DiscreteGPU").reason == "calibrating"
    # Heavy work never goes to a CPU-emulated adapter; light work follows the model.
    m.seed("fast_gpu", "cpu", size_bucket(HEAVY_BYTES), 1.0)
    m.seed("fast_gpu", "gpu", size_bucket(HEAVY_BYTES), 1e-6)
    assert Placer("auto", m, 1).decide("fast_gpu", HEAVY_BYTES, 0, True, "CPU").reason == "cpu adapter"
    assert Placer("auto", m, 1).decide("fast_gpu", HEAVY_BYTES, 0, True, "DiscreteGPU").device == "gpu"
    assert Placer("auto", m, 1).decide("fast_gpu", HEAVY_BYTES, 0, False, "").reason == "no gpu"
    assert Placer("gpu", m, 1).decide("fast_gpu", HEAVY_BYTES, 0, True, "CPU").reason == "forced"
    # Cold start: the GPU side first, the CPU side first on a CPU-emulated adapter.
    assert Placer("auto", m, 1).decide("new", 8, 0, True, "DiscreteGPU").device == "gpu"
    assert Placer("auto", m, 1).decide("new", 8, 0, True, "CPU").device == "cpu"


async def test_a_cpu_emulated_adapter_gets_no_heavy_work(shared_rt: hetero.Runtime) -> None:
    dev = hetero.lowlevel.device_of(shared_rt)
    if dev.summary["type"].lower() != "cpu":
        pytest.skip(f"the adapter is a {dev.summary['type']}, not CPU-emulated")
    g = hetero.Graph("heavy")
    g.output(g.stage(g.input("x"), cpu=_gelu_cpu, gpu=_gelu_gpu, name="gelu"))
    with runtime(perf_model=frozen(gelu=(1.0, 1e-6))) as rt:
        await rt.run(g, x=rand((HEAVY_BYTES // 4,)))
        heavy = rt.stats().stage("gelu").placement
        await rt.run(g, x=rand((4,)))
        light = rt.stats().stage("gelu").placement
    assert heavy is not None and (heavy.device, heavy.reason) == ("cpu", "cpu adapter")
    assert light is not None and (light.device, light.reason) == ("gpu", "model")


async def test_without_a_gpu_every_mixed_stage_runs_on_the_cpu() -> None:
    g = hetero.Graph("nogpu")
    g.output(g.stage(g.input("x"), cpu=_gelu_cpu, gpu=_gelu_gpu, name="gelu"))
    with hetero.Runtime(cpu_threads=2, adapter="not an adapter") as rt:
        out = await rt.run(g, x=np.zeros(3, np.float32))
        p = rt.stats().stage("gelu").placement
    assert p is not None and (p.device, p.reason) == ("cpu", "no gpu")
    np.testing.assert_array_equal(out, np.zeros(3, np.float32))


async def test_a_failing_implementation_fails_the_run_and_frees_its_queue_charge() -> None:
    def boom(v: np.ndarray) -> np.ndarray:
        raise RuntimeError("broken on the cpu")

    g = hetero.Graph("fail")
    g.output(g.stage(g.input("x"), cpu=boom, gpu=_gelu_gpu, name="gelu"))
    with runtime(perf_model=frozen(gelu=(1e-3, 1.0))) as rt:
        with pytest.raises(StageError, match="cpu stage 'gelu' failed: RuntimeError: broken on the cpu"):
            await rt.run(g, x=rand((4,)))
        assert rt._sched.placer._pending == {"cpu": 0.0, "gpu": 0.0}


async def test_a_two_implementation_stage_retries_as_cpu_and_gpu_stages_do() -> None:
    """``retry_on`` and ``backoff`` are stage options of ``g.stage`` too, never arguments of its functions."""
    calls: list[int] = []

    def flaky(v: np.ndarray) -> np.ndarray:
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError("first call fails")
        return _gelu_cpu(v)

    g = hetero.Graph("retry")
    g.output(g.stage(g.input("x"), cpu=flaky, gpu=_gelu_gpu, name="gelu", retries=1, retry_on=ConnectionError,
                     backoff=0.0))
    x = rand((4,))
    with runtime(placement="cpu") as rt:
        np.testing.assert_allclose(await rt.run(g, x=x), _gelu_cpu(x))
    assert len(calls) == 2
    g2 = hetero.Graph("no-retry")
    g2.output(g2.stage(g2.input("x"), cpu=flaky, gpu=_gelu_gpu, name="gelu", retries=1, retry_on=KeyError))
    calls.clear()
    with runtime(placement="cpu") as rt:
        with pytest.raises(StageError, match="ConnectionError: first call fails"):
            await rt.run(g2, x=x)
    assert len(calls) == 1


async def test_the_trace_says_where_each_stage_ran_and_why(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    with runtime(trace=path, perf_model=frozen(gelu=(1e-3, 1.0))) as rt:
        g = hetero.Graph("traced")
        g.output(g.stage(g.input("x"), cpu=_gelu_cpu, gpu=_gelu_gpu, name="gelu"))
        await rt.run(g, x=rand((4,)))
    events = json.loads(path.read_text())["traceEvents"]
    place = [e for e in events if e.get("cat") == "placement"]
    assert [e["name"] for e in place] == ["place gelu on cpu"]
    assert place[0]["args"]["reason"] == "model" and place[0]["args"]["estimates"]["gpu"]["exec"] == 1.0
    span = [e for e in events if e.get("name") == "gelu" and e.get("cat") == "cpu"]
    assert span and span[0]["args"]["placement"]["device"] == "cpu"


async def test_a_picture_marks_two_implementation_stages_and_where_they_ran() -> None:
    g = mixed_graph()
    kinds = {n: d["kind"] for n, d in g.to_networkx().nodes(data=True)}
    assert kinds["gelu"] == "mixed" and kinds["double"] == "gpu" and kinds["total"] == "cpu"
    edges = {(a, b): d["kind"] for a, b, d in g.to_networkx().edges(data=True)}
    assert edges[("double", "gelu")] == "download if on cpu"
    assert edges[("gelu", "norm")] == "value"
    assert edges[("softmax", "total")] == "download if on gpu"
    with runtime(placement="cpu") as rt:
        await rt.run(g, x=rand((2, 16)))
        text = g.to_dot(stats=rt.stats())
    assert "cpu | gpu" in text and "ran on cpu" in text


# -- the embedding pipeline -----------------------------------------------------------------------------------
async def test_embeddings_agree_across_placements_and_stay_off_a_cpu_emulated_adapter(tmp_path: Path) -> None:
    from hetero.pipelines.embed import aembed
    from hetero.pipelines.minilm import load_model
    from hetero.pipelines.testing import write_random_model

    model = load_model(write_random_model(tmp_path, seed=2, scale=0.3, vocab_size=300, hidden_size=32,
                                          intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          max_position_embeddings=40, max_seq_length=24))
    texts = [d.strip() for d in (json.__doc__ or "").split("\n") if len(d.split()) > 3][:24]
    outs = {}
    for mode in ("cpu", "gpu", "auto"):
        with runtime(placement=mode) as rt:
            outs[mode] = await aembed(texts, model=model, batch_size=12, runtime=rt)
            stats = rt.stats()
            adapter = hetero.lowlevel.device_of(rt).summary["type"].lower() if mode == "auto" else ""
        if mode != "auto":  # on the GPU alone the encoder is two stages (FUSED_MAX_BATCH)
            names = [f"layer{n}" for n in range(2)] if mode == "cpu" else ["encoder0", "encoder1"]
            assert {stats.devices[name] for name in names} == {mode}
        elif adapter == "cpu":
            for name in ("layer0", "layer1", "pool"):
                p = stats.stage(name).placement
                assert p is not None and (p.device, p.reason) == ("cpu", "cpu adapter")
    np.testing.assert_allclose(outs["cpu"], outs["gpu"], atol=2e-5)
    np.testing.assert_allclose(outs["auto"], outs["gpu"], atol=2e-5)


def test_data_on_a_real_gpu_stays_there_until_the_cpu_side_is_calibrated() -> None:
    m = PerfModel(learn=False)
    m.seed("layer", "gpu", size_bucket(1 << 20), 0.5)
    placer = Placer("auto", m, cpu_workers=4)
    # Inputs mostly on the device, CPU side never measured: no CPU run just to calibrate.
    p = placer.decide("layer", 4096, 1 << 20, True, "DiscreteGPU")
    assert (p.device, p.reason) == ("gpu", "locality")
    # Host inputs are explored as before, and a CPU-emulated adapter keeps its own rule.
    assert placer.decide("layer", 1 << 20, 4096, True, "DiscreteGPU").reason == "calibrating"
    assert placer.decide("layer", 4096, 1 << 20, True, "CPU").reason == "cpu adapter"
    # Once the CPU side is calibrated, the model decides.
    m.seed("layer", "cpu", size_bucket((1 << 20) + 4096), 0.001)
    p = placer.decide("layer", 4096, 1 << 20, True, "DiscreteGPU")
    assert (p.device, p.reason) == ("cpu", "model")
