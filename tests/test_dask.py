"""hetero.dask: graphs on a dask.distributed cluster (in-process workers, then worker processes).

::

    x -> double (gpu) -> check (cpu) -> output        (check fails on a chosen value)

The contract runs on a ``LocalCluster(processes=False)`` of two workers (fast); pickling,
embeddings by model path, ``hetero embed --scheduler`` and a worker killed in the middle
of a map run on a ``LocalWGPUCluster`` of two worker processes sharing the one adapter.
Workers report their adapter (the selector pattern each was given, resolved as this
process resolves it) and their counters; where two adapters share a name (lavapipe's
Vulkan and OpenGL adapters), a cluster over that name puts one worker on each.
"""

from __future__ import annotations

import argparse
import os
import pickle
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

pytest.importorskip("distributed")

from distributed import Client, LocalCluster  # noqa: E402

import hetero  # noqa: E402
from hetero._gpu.device import adapter_index, adapter_labels, list_adapters  # noqa: E402
from hetero.dask import ClusterError, DaskRuntime, HeteroPlugin, LocalWGPUCluster, WorkerAdapter  # noqa: E402
from hetero.pipelines import embed_cli  # noqa: E402
from hetero.pipelines.embed import aembed, embed  # noqa: E402
from hetero.pipelines.embed_weights import get_model  # noqa: E402
from hetero.pipelines.testing import write_random_model  # noqa: E402

DOUBLE = """
@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) id: vec3<u32>) { if (id.x < arrayLength(&x)) { y[id.x] = 2.0 * x[id.x]; } }
"""
TINY = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=40, max_seq_length=24)
TEXTS = [f"sentence number {i} with {'more ' * (i % 5)}words" for i in range(23)] + ["", "x"]


class Unpickled:
    """A graph constant that counts how often this process unpickled it."""

    count = 0

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return _unpickled, ()


def _unpickled() -> Unpickled:
    Unpickled.count += 1
    return Unpickled()


def double(gpu: hetero.GPUContext, x: hetero.Tensor) -> hetero.Tensor:
    y = gpu.empty(x.shape, np.float32)
    gpu.dispatch(DOUBLE, -(-x.size // 64), x, y)
    return y


def check(y: np.ndarray, bad: float, tag: Unpickled) -> tuple[np.ndarray, int, int]:
    """The doubled array, this process's unpickle count of the graph, and the process id."""
    if y[0] == bad:
        raise ValueError(f"bad value {bad}")
    return y, Unpickled.count, os.getpid()


def make_graph(bad: float = -1.0) -> hetero.Graph:
    g = hetero.Graph("double")
    x = g.input("x")
    g.output(g.cpu(check, g.gpu(double, x), bad, Unpickled(), name="check"))
    return g


def inputs(n: int) -> Iterator[dict[str, np.ndarray]]:
    return ({"x": np.full(5, i, np.float32)} for i in range(n))


@pytest.fixture(scope="module")
def client() -> Iterator[Client]:
    with LocalCluster(n_workers=2, processes=False, threads_per_worker=2, resources={"wgpu": 1},
                      dashboard_address=":0") as cluster, Client(cluster) as c:
        c.wait_for_workers(2, timeout=120)  # registered with the scheduler, not only started
        c.register_plugin(HeteroPlugin(cpu_threads=1))
        yield c


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_model(tmp_path_factory.mktemp("tiny"), seed=3, scale=0.3, **TINY)


# -- the contract, on in-process workers ----------------------------------------------------------------------
@pytest.mark.anyio
async def test_run_and_map_keep_runtime_contract(client: Client) -> None:
    g = make_graph()
    async with DaskRuntime(client, chunk_size=3) as drt:
        y, _, _ = await drt.run(g, x=np.arange(4, dtype=np.float32))
        np.testing.assert_array_equal(y, 2 * np.arange(4, dtype=np.float32))
        got = [r[0][0] async for r in drt.map(g, inputs(11), max_in_flight=1)]
        assert got == [2.0 * i for i in range(11)]
        assert [r async for r in drt.map(g, [])] == []
        with pytest.raises(hetero.InputError):
            await drt.run(g, y=np.zeros(2, np.float32))


@pytest.mark.anyio
async def test_stage_error_arrives_with_stage_and_cause_in_order(client: Client) -> None:
    g = make_graph(bad=14.0)  # input 7 fails
    seen: list[float] = []
    async with DaskRuntime(client, chunk_size=3) as drt:
        with pytest.raises(hetero.StageError) as info:
            async for r in drt.map(g, inputs(12)):
                seen.append(r[0][0])
    assert seen == [2.0 * i for i in range(7)]
    assert info.value.stage == "check"
    assert isinstance(info.value.__cause__, ValueError)
    assert str(info.value.__cause__) == "bad value 14.0"


def test_backpressure_holds_submission_back(client: Client) -> None:
    started: list[int] = []
    lock = threading.Lock()

    def note(x: np.ndarray) -> int:
        with lock:
            started.append(int(x[0]))
        return int(x[0])

    g = hetero.Graph("note")
    g.output(g.cpu(note, g.input("x")))
    chunk, per_worker, workers = 2, 1, 2
    with DaskRuntime(client, chunk_size=chunk) as drt:
        assert len(drt.workers()) == workers
        for i, r in enumerate(drt.map_sync(g, inputs(20), max_in_flight=per_worker)):
            assert r == i
            with lock:
                # chunks in flight: the one being yielded and at most limit - 1 behind it
                assert max(started) < (i // chunk + per_worker * workers) * chunk
    assert sorted(started) == list(range(20))


def test_sync_api(client: Client) -> None:
    g = make_graph()
    with DaskRuntime(client, chunk_size=4) as drt:
        assert drt.run_sync(g, x=np.ones(3, np.float32))[0].tolist() == [2.0, 2.0, 2.0]
        assert [r[0][0] for r in drt.map_sync(g, inputs(9))] == [2.0 * i for i in range(9)]

        async def inside() -> None:
            drt.run_sync(g, x=np.ones(3, np.float32))

        with pytest.raises(hetero.HeteroError, match="cannot be called inside a running asyncio event loop"):
            anyio.run(inside)
    with pytest.raises(hetero.HeteroError, match="this DaskRuntime is closed"):
        drt.run_sync(g, x=np.ones(3, np.float32))


def test_missing_resource_fails_fast(client: Client) -> None:
    with pytest.raises(ClusterError, match=r"^no worker of the cluster at .* declares the resource 'tpu' "
                       r"\(workers and their resources: .*'wgpu': 1.*\); start workers with 'dask worker ADDRESS "
                       r"--resources tpu=1 --preload hetero.dask' or use hetero.dask.LocalWGPUCluster$"):
        with DaskRuntime(client, resource="tpu"):
            pass



def test_workers_without_the_plugin_fail_clearly_until_it_is_registered() -> None:
    from hetero.dask import ensure_plugin

    g = make_graph()
    with LocalCluster(n_workers=1, processes=False, threads_per_worker=1, resources={"wgpu": 1},
                      dashboard_address=":0") as cluster, Client(cluster) as c, DaskRuntime(c) as drt:
        with pytest.raises(ClusterError, match=r"^worker .* has no HeteroPlugin; register it with "
                           r"client.register_plugin\(hetero.dask.HeteroPlugin\(\)\) or start workers with "
                           r"'--preload hetero.dask'$"):
            drt.run_sync(g, x=np.ones(2, np.float32))
        assert ensure_plugin(c, cpu_threads=1) is True
        assert drt.run_sync(g, x=np.ones(2, np.float32))[0].tolist() == [2.0, 2.0]
        assert ensure_plugin(c) is False
    with LocalCluster(n_workers=1, processes=False, threads_per_worker=1, resources={"wgpu": 1},
                      dashboard_address=":0", preload=["hetero.dask"]) as cluster, Client(cluster) as c:
        with DaskRuntime(c) as drt:
            assert drt.run_sync(g, x=np.ones(2, np.float32))[0].tolist() == [2.0, 2.0]


def test_workers_report_their_adapter_and_counters(client: Client) -> None:
    adapters = list_adapters()
    g = make_graph()
    with DaskRuntime(client, chunk_size=2) as drt:
        reported = drt.adapters()
        assert sorted(reported) == sorted(drt.workers())
        for a in reported.values():
            assert isinstance(a, WorkerAdapter) and a.pid == os.getpid()  # in-process workers
            assert a.index is not None and a.selector == adapter_labels(adapters)[a.index]
            assert a.summary == adapters[a.index].summary and a.backend == adapters[a.index].info["backend_type"]
            assert a.requested == (os.environ.get("HETERO_ADAPTER") or None)
        before = drt.worker_stats()
        assert [r[0][0] for r in drt.map_sync(g, inputs(10))] == [2.0 * i for i in range(10)]
        after = drt.worker_stats()
    assert sorted(after) == sorted(before)
    assert sum(after[w].runs - before[w].runs for w in after) == 10
    assert sum(after[w].chunks - before[w].chunks for w in after) == 5
    for w, s in after.items():
        ran = s.chunks > before[w].chunks
        assert (s.busy_s > before[w].busy_s) == ran
        assert (s.submissions > before[w].submissions) == ran  # each run of `double` submits
        assert s.busy_s <= s.uptime_s and (s.busy_s > 0 or not ran)


def test_a_plugin_without_an_adapter_closes_its_runtime_and_says_why(tmp_path: Path) -> None:
    """Setting up on a worker whose adapter cannot be opened fails clearly, and the Runtime made
    for it is closed (closing writes its trace file), not left behind in the worker."""
    import asyncio

    trace = tmp_path / "plugin.json"
    plugin = HeteroPlugin(adapter="no-such-adapter", cpu_threads=1, trace=str(trace))
    threads = set(threading.enumerate())
    with pytest.raises(hetero.NoAdapterError, match=r"^hetero's dask plugin cannot open a GPU device on this "
                       r"worker: no adapter matches HETERO_ADAPTER='no-such-adapter'; available: .*"
                       r"\(HeteroPlugin\(adapter=\.\.\.\) or the worker's HETERO_ADAPTER chooses the adapter\)$"):
        asyncio.run(plugin.setup(None))
    assert plugin.runtime is None
    assert trace.exists()  # the Runtime was closed
    assert [t for t in threading.enumerate() if t not in threads] == []
    with pytest.raises(ClusterError, match="not set up"):
        plugin.run_chunk(make_graph(), [], 1)


@pytest.mark.anyio
async def test_embed_on_a_dask_runtime(client: Client, model_dir: Path) -> None:
    model = get_model(model_dir)
    local = await anyio.to_thread.run_sync(lambda: embed(TEXTS, model=model, batch_size=4))
    async with DaskRuntime(client, chunk_size=2) as drt:
        remote = await aembed(TEXTS, model=model, batch_size=4, runtime=drt)
    np.testing.assert_allclose(remote, local, atol=1e-5)
    with DaskRuntime(client, chunk_size=2) as drt:
        np.testing.assert_allclose(await anyio.to_thread.run_sync(
            lambda: embed(TEXTS, model=model, batch_size=4, runtime=drt)), local, atol=1e-5)


def _placement(rt: hetero.Runtime) -> str:
    return rt.options.placement


def _refuse(rt: hetero.Runtime) -> None:
    raise ValueError(f"refused on {rt.device().summary['name']}")


def test_on_workers_asks_each_workers_runtime_and_embed_follows_their_answers(client: Client) -> None:
    """embed() on a DaskRuntime carries the CPU twins exactly when every worker's Runtime would
    (on lavapipe, where the suite runs without a GPU: yes, as a local Runtime there)."""
    from hetero.pipelines.embed_placement import offers_cpu

    with DaskRuntime(client) as drt:
        workers = drt.workers()
        assert drt.on_workers(_placement) == {w: "auto" for w in workers}
        each = drt.on_workers(offers_cpu)
        assert each == {w: a.type.strip().lower() == "cpu" for w, a in drt.adapters().items()}
        assert offers_cpu(drt) is all(each.values())
        with pytest.raises(ValueError, match="^refused on "):
            drt.on_workers(_refuse)


def test_workers_keeps_the_chunks_on_the_workers_given(client: Client) -> None:
    g = make_graph()
    with DaskRuntime(client) as everyone:
        first, second = everyone.workers()
        before = everyone.worker_stats()
        with DaskRuntime(client, chunk_size=1, workers=[second]) as drt:
            assert drt.workers() == [second]
            assert [r[0][0] for r in drt.map_sync(g, inputs(6), max_in_flight=3)] == [2.0 * i for i in range(6)]
        after = everyone.worker_stats()
    assert (after[first].chunks - before[first].chunks, after[second].chunks - before[second].chunks) == (0, 6)
    with pytest.raises(ClusterError, match=r"none of the workers given \(tcp://nowhere:1\) declares"):
        DaskRuntime(client, workers=["tcp://nowhere:1"]).workers()
    for bad in ("tcp://a:1", [], [1]):
        with pytest.raises(ValueError, match="workers must be a non-empty sequence of worker addresses"):
            DaskRuntime(client, workers=bad)  # type: ignore[arg-type]


def test_model_pickles_by_path(model_dir: Path) -> None:
    model = get_model(model_dir)
    data = pickle.dumps(model)
    assert len(data) < 1000  # the path, not the weights
    assert pickle.loads(data) is model  # this process loaded it already


# -- worker processes ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def proc_client() -> Iterator[Client]:
    with LocalWGPUCluster(n_workers=2, threads_per_worker=2) as cluster, Client(cluster) as c:
        c.register_plugin(HeteroPlugin(cpu_threads=1))
        yield c


def test_local_wgpu_cluster_pins_workers_to_adapters(proc_client: Client) -> None:
    env = proc_client.run(lambda: os.environ.get("HETERO_ADAPTER"))
    selectors = LocalWGPUCluster.selectors_for(LocalWGPUCluster.default_pattern())
    assert sorted(env.values()) == sorted(selectors[i % len(selectors)] for i in range(2))
    info = proc_client.scheduler_info(n_workers=-1)["workers"]
    assert [w["resources"] for w in info.values()] == [{"wgpu": 1}, {"wgpu": 1}]


def test_worker_processes_report_the_adapter_they_were_given(proc_client: Client) -> None:
    adapters = list_adapters()
    env = proc_client.run(lambda: os.environ.get("HETERO_ADAPTER"))
    with DaskRuntime(proc_client) as drt:
        reported = drt.adapters()
    assert sorted(reported) == sorted(env)
    for addr, a in reported.items():
        assert a.requested == env[addr] and a.pid != os.getpid()
        index = adapter_index(adapters, env[addr])
        assert (a.index, a.selector, a.summary) == (index, adapter_labels(adapters)[index], adapters[index].summary)


@pytest.mark.parametrize("given", ["last", "list"])
def test_explicit_selectors_pin_every_worker_and_bad_patterns_name_the_adapters(given: str) -> None:
    adapters = list_adapters()
    labels = adapter_labels(adapters)
    last = labels[-1]  # on a machine with several adapters, not the one hetero picks by default
    adapter: str | list[str] = last if given == "last" else [last, labels[0]]
    expect = [last, last] if given == "last" else [last, labels[0]]
    with LocalWGPUCluster(n_workers=2, adapter=adapter, threads_per_worker=1) as cluster, Client(cluster) as c:
        assert cluster.selectors == ([last] if given == "last" else expect)
        c.register_plugin(HeteroPlugin(cpu_threads=1))
        names = c.run(lambda dask_worker: dask_worker.name)
        with DaskRuntime(c) as drt:
            reported = drt.adapters()
        got = sorted((names[addr], a.selector, a.index, a.requested) for addr, a in reported.items())
        assert got == [(i, sel, labels.index(sel), sel) for i, sel in enumerate(expect)]
        if given == "last":
            with pytest.raises(hetero.NoAdapterError, match=r"HETERO_ADAPTER='vulkan#99' asks for adapter #99 of "
                               r"the \d+ that match; available: .*vulkan#0: "):
                c.register_plugin(HeteroPlugin(adapter="vulkan#99"))
    available = rf"available: {re.escape(labels[0])}: {re.escape(adapters[0].summary)}"
    with pytest.raises(hetero.NoAdapterError, match=rf"^no adapter matches HETERO_ADAPTER='no-such-gpu#0'; {available}"):
        LocalWGPUCluster(adapter="no-such-gpu")
    with pytest.raises(hetero.NoAdapterError, match=rf"^no adapter matches HETERO_ADAPTER='no-such-gpu'; {available}"):
        LocalWGPUCluster(adapter=[labels[0], "no-such-gpu"])
    with pytest.raises(ValueError, match=r"^adapter: a list of HETERO_ADAPTER values must hold non-empty strings, "
                       r"got \[\]$"):
        LocalWGPUCluster(adapter=[])


def test_adapters_of_one_name_get_one_worker_each() -> None:
    """Identical GPUs share a name and differ by index: one worker per index, none shared."""
    adapters = list_adapters()
    names = [str(a.info.get("device", "")) for a in adapters]
    name = next((n for n in names if n and names.count(n) > 1), None)
    if name is None:
        pytest.skip(f"no two adapters share a name here: {names}")
    same = [i for i, a in enumerate(adapters) if name.casefold() in a.summary.casefold()]
    gpus = [i for i in same if str(adapters[i].info.get("adapter_type", "")).casefold() != "cpu"]
    same = gpus or same  # software rasterizers only where no GPU matches
    with LocalWGPUCluster(adapter=name, threads_per_worker=1) as cluster, Client(cluster) as c:
        assert len(cluster.selectors) == len(same) == len(cluster.workers)
        c.register_plugin(HeteroPlugin(cpu_threads=1))
        with DaskRuntime(c, chunk_size=1) as drt:
            reported = drt.adapters()
            g = make_graph()
            assert [r[0][0] for r in drt.map_sync(g, inputs(8))] == [2.0 * i for i in range(8)]
    assert sorted(a.index for a in reported.values()) == same
    assert len({a.pid for a in reported.values()}) == len(same)


def test_worker_processes_get_the_graph_once_and_pickled_errors(proc_client: Client) -> None:
    g = make_graph(bad=30.0)  # input 15 fails
    with DaskRuntime(proc_client, chunk_size=2) as drt:
        results = list(drt.map_sync(g, inputs(12)))
        assert [r[0][0] for r in results] == [2.0 * i for i in range(12)]
        assert {r[1] for r in results} == {1}  # unpickled once in each worker process
        assert os.getpid() not in {r[2] for r in results}
        got: list[float] = []
        with pytest.raises(hetero.StageError) as info:
            for r in drt.map_sync(g, inputs(20)):
                got.append(r[0][0])
    assert got == [2.0 * i for i in range(15)]
    assert info.value.stage == "check" and isinstance(info.value.__cause__, ValueError)


def test_embed_and_cli_on_worker_processes(proc_client: Client, model_dir: Path, tmp_path: Path) -> None:
    model = get_model(model_dir)
    local = embed(TEXTS, model=model, batch_size=4)
    with DaskRuntime(proc_client, chunk_size=2) as drt:
        np.testing.assert_allclose(embed(TEXTS, model=model, batch_size=4, runtime=drt), local, atol=1e-5)
    src, out = tmp_path / "in.txt", tmp_path / "out.npy"
    src.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    args = argparse.Namespace(model=str(model_dir), input=str(src), output=str(out), batch_size=4, trace=None,
                              scheduler=proc_client.scheduler.address, workers=None)
    lines: list[str] = []

    class Out:
        def write(self, s: str) -> None:
            lines.append(s)

    assert embed_cli.run(args, out=Out()) == 0  # type: ignore[arg-type]
    np.testing.assert_allclose(np.load(out), local, atol=1e-5)
    assert f"on dask cluster at {proc_client.scheduler.address} (2 worker(s))" in "".join(lines)


def test_cli_cluster_options_are_checked(model_dir: Path, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    from hetero import _cli

    src = tmp_path / "in.txt"
    src.write_text("a\n", encoding="utf-8")
    common = ["embed", "--model", str(model_dir), "--input", str(src), "--output", str(tmp_path / "o.npy")]
    assert _cli.main([*common, "--scheduler", "tcp://127.0.0.1:1", "--workers", "2"]) == 2
    assert "argument --workers: not allowed with argument --scheduler" in capsys.readouterr().err
    assert _cli.main([*common, "--workers", "0"]) == 2
    args = argparse.Namespace(model=str(model_dir), input=str(src), output=str(tmp_path / "o.npy"), batch_size=4,
                              trace=str(tmp_path / "t.json"), scheduler="tcp://127.0.0.1:1", workers=None)
    with pytest.raises(hetero.HeteroError, match="^--trace records a local run; it cannot be combined with "
                       "--scheduler or --workers$"):
        embed_cli.run(args)


def die_once(x: np.ndarray, marker: str) -> np.ndarray:
    """Kill this worker process the first time input 9 arrives."""
    if x[0] == 9 and not os.path.exists(marker):
        Path(marker).write_text("killed")
        os._exit(1)
    return x


def test_a_graph_outlives_the_workers_that_held_it(proc_client: Client) -> None:
    """Every worker holding the graph's data restarts between two maps (its memory is gone): the
    next map still runs, since the graph is a task's result that dask computes again."""
    g = make_graph()
    with DaskRuntime(proc_client, chunk_size=2) as drt:
        assert [r[0][0] for r in drt.map_sync(g, inputs(6))] == [2.0 * i for i in range(6)]
        (key, holders), = proc_client.who_has(drt._graphs[id(g)][2]).items()
        assert holders
        proc_client.restart_workers(list(holders))
        assert [r[0][0] for r in drt.map_sync(g, inputs(6))] == [2.0 * i for i in range(6)]


def test_a_graph_that_does_not_pickle_is_refused_for_worker_processes(proc_client: Client) -> None:
    g = hetero.Graph("locked")
    g.output(g.cpu(check, g.input("y"), 0.0, threading.Lock()))
    with DaskRuntime(proc_client) as drt, pytest.raises(hetero.GraphError) as info:
        drt.run_sync(g, y=np.ones(2, np.float32))
    assert str(info.value).startswith("graph 'locked' cannot travel to workers in other processes: it does not "
                                      "pickle (TypeError: cannot pickle '_thread.lock' object)")


def test_killed_worker_chunks_are_retried_in_order(proc_client: Client, tmp_path: Path) -> None:
    marker = tmp_path / "killed"
    g = hetero.Graph("die")
    g.output(g.cpu(die_once, g.input("x"), str(marker)))
    with DaskRuntime(proc_client, chunk_size=2) as drt:
        got = [r[0] for r in drt.map_sync(g, inputs(16))]
    assert marker.exists()
    assert got == [float(i) for i in range(16)]
