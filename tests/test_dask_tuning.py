"""hetero.dask's adaptive chunks: the rule on given measurements, then maps of sleep-costed runs.

::

    x -> nap (cpu: sleeps the run's cost) -> output

The rule (``ChunkTuning``) is checked on numbers given to the tuner; on a one-worker
in-process cluster, cheaper runs get longer chunks, the first chunks hold
``worker_in_flight`` runs, explicit settings are used as given, and every result comes back
in order. Counts and order only: the sizes compare two costs twenty times apart.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("distributed")

from distributed import Client, LocalCluster  # noqa: E402

import hetero  # noqa: E402
from hetero._dask import (CHUNK_MAX_S, CHUNK_MIN_S, CHUNK_ROUND_TRIPS, MAX_CHUNK_SIZE, MAX_IN_FLIGHT,  # noqa: E402
                          _Tuner)
from hetero.dask import ChunkTuning, DaskRuntime, HeteroPlugin  # noqa: E402


def nap(x: int, cost_ms: float) -> int:
    time.sleep(cost_ms / 1e3)
    return x


def nap_graph(cost_ms: float) -> hetero.Graph:
    g = hetero.Graph(f"nap-{cost_ms}")
    g.output(g.cpu(nap, g.input("x"), cost_ms))
    return g


# -- the rule ----------------------------------------------------------------------------------------------------
def test_chunk_size_follows_run_time_and_round_trip() -> None:
    t = _Tuner(None, min_size=4, tasks_per_worker=2)
    first = t.tuning()
    assert (first.chunk_size, first.max_in_flight, first.run_s, first.round_trip_s, first.chunks, first.fixed) == \
        (4, 4, None, None, 0, False)
    # 8 runs in 80 ms on the worker (10 ms a run); 30 ms from submission to done, 2 ms to fetch: 22 ms round trip
    t.observe(8, run_s=0.080, task_s=0.010 + 0.080, latency_s=0.030 + 0.080, fetch_s=0.002)
    got = t.tuning()
    assert got.run_s == pytest.approx(0.010) and got.round_trip_s == pytest.approx(0.022)
    target = min(CHUNK_MAX_S, max(CHUNK_MIN_S, CHUNK_ROUND_TRIPS * got.round_trip_s))
    assert got.chunk_size == int(target / got.run_s) in (43, 44)  # 0.44 s of 10 ms runs
    assert got.max_in_flight == 2 + 1 + math.ceil(2 * 0.022 / (got.chunk_size * 0.010))
    # a chunk that waited in the worker's queue measures a longer trip: the smallest is kept
    t.observe(8, run_s=0.080, task_s=0.090, latency_s=0.500, fetch_s=0.002)
    assert t.tuning().round_trip_s == pytest.approx(0.022)
    # ten times cheaper runs (the median of the last three): ten times longer chunks
    t.observe(40, run_s=0.040, task_s=0.041, latency_s=0.070, fetch_s=0.001)
    t.observe(40, run_s=0.040, task_s=0.041, latency_s=0.070, fetch_s=0.001)
    cheap = t.tuning()
    assert cheap.run_s == pytest.approx(0.001)
    assert cheap.chunk_size == int(target / cheap.run_s) in (439, 440)
    assert t.tuning().chunks == 4


def test_chunk_size_bounds_and_fixed_settings() -> None:
    slow = _Tuner(None, min_size=4, tasks_per_worker=2)
    slow.observe(4, run_s=40.0, task_s=40.0, latency_s=40.0, fetch_s=0.0)  # 10 s a run: at least 4 runs
    assert slow.tuning().chunk_size == 4
    assert slow.tuning().max_in_flight == 3  # the round trip is nothing beside such a chunk
    fast = _Tuner(None, min_size=4, tasks_per_worker=2)
    fast.observe(100, run_s=1e-5, task_s=1e-5, latency_s=1.0, fetch_s=0.0)  # 0.1 us a run, 1 s a trip
    assert fast.tuning().chunk_size == MAX_CHUNK_SIZE
    assert fast.tuning().max_in_flight == MAX_IN_FLIGHT
    tiny_trip = _Tuner(None, min_size=1, tasks_per_worker=1)
    tiny_trip.observe(10, run_s=0.010, task_s=0.010, latency_s=0.010, fetch_s=0.0)  # no round trip at all
    assert tiny_trip.tuning().chunk_size == int(CHUNK_MIN_S / tiny_trip.tuning().run_s) in (49, 50)
    fixed = _Tuner(16, min_size=4, tasks_per_worker=2)
    fixed.observe(16, run_s=0.016, task_s=0.017, latency_s=0.030, fetch_s=0.001)
    assert (fixed.tuning().chunk_size, fixed.tuning().fixed) == (16, True)
    fixed.observe(16, run_s=16.0, task_s=16.0, latency_s=16.0, fetch_s=0.0)
    assert fixed.tuning().chunk_size == 16


# -- on a cluster ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client() -> Iterator[Client]:
    with LocalCluster(n_workers=1, processes=False, threads_per_worker=2, resources={"wgpu": 1},
                      dashboard_address=":0") as cluster, Client(cluster) as c:
        c.wait_for_workers(1, timeout=120)
        c.register_plugin(HeteroPlugin(cpu_threads=4))
        yield c


def _chunks_and_runs(drt: DaskRuntime, before: dict) -> tuple[int, int]:
    after = drt.worker_stats()
    return (sum(after[w].chunks - before[w].chunks for w in after), sum(after[w].runs - before[w].runs for w in after))


def test_cheaper_runs_get_longer_chunks(client: Client) -> None:
    sizes = {}
    with DaskRuntime(client) as drt:
        for cost_ms, n in ((40.0, 48), (2.0, 400)):
            g = nap_graph(cost_ms)
            assert drt.tuning(g) == ChunkTuning(chunk_size=drt.worker_in_flight, max_in_flight=drt.tasks_per_worker + 2,
                                                run_s=None, round_trip_s=None, chunks=0, fixed=False)
            before = drt.worker_stats()
            assert list(drt.map_sync(g, ({"x": i} for i in range(n)))) == list(range(n))
            chunks, runs = _chunks_and_runs(drt, before)
            tuned = drt.tuning(g)
            assert runs == n and tuned.chunks == chunks
            assert tuned.run_s is not None and tuned.round_trip_s is not None
            sizes[cost_ms] = tuned.chunk_size
            # the next map of the graph starts at the size measured: fewer chunks than runs / worker_in_flight
            before = drt.worker_stats()
            assert list(drt.map_sync(g, ({"x": i} for i in range(n)))) == list(range(n))
            again, _ = _chunks_and_runs(drt, before)
            if sizes[cost_ms] > drt.worker_in_flight:
                assert again < math.ceil(n / drt.worker_in_flight)
    assert sizes[2.0] > sizes[40.0]


@pytest.mark.anyio
async def test_explicit_chunk_size_is_used_as_given(client: Client) -> None:
    g = nap_graph(1.0)
    async with DaskRuntime(client, chunk_size=5) as drt:
        before = drt.worker_stats()
        assert [r async for r in drt.map(g, ({"x": i} for i in range(23)), max_in_flight=2)] == list(range(23))
        after = drt.worker_stats()
        assert sum(after[w].chunks - before[w].chunks for w in after) == 5  # 5 + 5 + 5 + 5 + 3
        tuned = drt.tuning(g)
        assert (tuned.chunk_size, tuned.fixed) == (5, True) and tuned.chunks == 5
    with pytest.raises(ValueError, match=r"^chunk_size must be an integer >= 1 or None \(adaptive\), got 0$"):
        DaskRuntime(client, chunk_size=0)


def test_workers_time_their_chunks(client: Client) -> None:
    g = nap_graph(5.0)
    with DaskRuntime(client, chunk_size=4) as drt:
        before = drt.worker_stats()
        assert list(drt.map_sync(g, ({"x": i} for i in range(8)))) == list(range(8))
        after = drt.worker_stats()
    (w,) = after
    assert after[w].chunks - before[w].chunks == 2
    assert after[w].run_s > before[w].run_s and after[w].hop_s > before[w].hop_s


async def _runtime_name(plugin: HeteroPlugin, suffix: str) -> str:
    return f"{type(plugin.runtime).__name__}{suffix}"


async def _fails(plugin: HeteroPlugin) -> None:
    raise hetero.InputError("refused here")


def _made() -> list[int]:
    return [1]


async def _kept(plugin: HeteroPlugin) -> int:
    return id(plugin.keep("k", _made))


@pytest.mark.anyio
async def test_call_runs_on_a_workers_runtime(client: Client) -> None:
    async with DaskRuntime(client) as drt:
        assert await drt.call(_runtime_name, "!") == "Runtime!"
        with pytest.raises(hetero.InputError, match="^refused here$"):
            await drt.call(_fails)
        assert await drt.call(_kept) == await drt.call(_kept)  # made once, kept


def test_call_sync(client: Client) -> None:
    with DaskRuntime(client) as drt:
        assert drt.call_sync(_runtime_name, "?") == "Runtime?"
        with pytest.raises(TypeError, match=r"^DaskRuntime.call\(\) expects an async function, got int$"):
            drt.call_sync(3)  # type: ignore[arg-type]
