"""Where one dask worker loses time against a local run: the parts, one JSON line each.

    python -m bench dask --profile [--workload embed|fake] [--n 30000] [--batch 128] [--model random|tiny|DIR]
                                   [--host-us 1500] [--gpu-us 5000] [--repeat 2]

``--workload embed`` (default) embeds ``--n`` stdlib sentences in batches of ``--batch``, a
run being one batch; ``--workload fake`` runs a graph of two CPU stages per run instead: a
host stage that holds the interpreter for ``--host-us`` (recording, tokenizing) and a "GPU"
stage that sleeps ``--gpu-us`` under a lock of the process (one device, runs one at a time),
returning an array of ``--out-kb``: dask's own costs without an engine, on any machine.
Every figure is measured in this one run; ``ratio`` is against the figure named in
``against``:

- ``local``: the workload on a Runtime in this process (embed(): ``max_in_flight`` 4), and
  its CPU seconds per run (``process_time``, every thread);
- ``serialise``: one run's inputs and results through dask's serialisation (bytes, and
  dumps + loads microseconds), and their share of a local run;
- ``round trip``: one ``drt.run`` of a trivial graph (a chunk alone), the time per chunk
  while chunks overlap, and a local ``rt.run`` of it;
- ``transfer``: fetching one chunk's results (the default chunk's runs of results) from a
  worker once it is done (ms, GB/s);
- ``in-worker``: the whole workload as one chunk on one worker (tasks_per_worker 1,
  worker_in_flight 4, as local): the price of the worker process itself (its threads,
  its environment) without chunking; the worker's CPU seconds per run beside local's;
- ``in-worker-bare``: the same on a cluster whose workers run without dask's statistical
  profiler and without the nanny's pre-spawn environment (``MALLOC_TRIM_THRESHOLD_``,
  ``OMP_NUM_THREADS=1``, ...): ratio against ``in-worker``;
- ``fixed``: chunks of 16 runs, 4 in flight inside a chunk (the settings before they
  adapted); ``adaptive``: DaskRuntime's defaults. Each with the worker's parts: the fraction
  of the wall time a chunk was running there (``busy``), seconds in ``rt.map`` and in the
  portal hops per chunk, CPU per run, and what the tuner chose (``tuning``);
- ``sweep``: ``tasks_per_worker`` x ``worker_in_flight`` (``--sweep``) with adaptive chunks.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from typing import Any

import numpy as np

_DEVICE = threading.Lock()  # the fake GPU of this process: one run at a time


def fake_host(x: int, host_us: int) -> int:
    """Hold the interpreter for ``host_us`` (a stage's Python work: tokenizing, recording)."""
    end = time.perf_counter_ns() + host_us * 1000
    n = 0
    while time.perf_counter_ns() < end:
        n += 1
    return x


def fake_gpu(x: int, gpu_us: int, out_floats: int) -> np.ndarray:
    """Wait ``gpu_us`` on this process's one device, without the interpreter; a result array."""
    with _DEVICE:
        time.sleep(gpu_us / 1e6)
    out = np.empty(out_floats, np.float32)
    out.fill(x)
    return out


def _identity(x: Any) -> Any:
    return x


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench dask --profile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--workload", choices=("embed", "fake"), default="embed")
    ap.add_argument("--n", type=int, default=30_000, help="sentences (embed) or runs (fake); default %(default)s")
    ap.add_argument("--batch", type=int, default=128, help="sentences per batch (embed; default %(default)s)")
    ap.add_argument("--model", default="random", help="random | tiny | minilm | a model directory (embed)")
    ap.add_argument("--host-us", type=int, default=1500, help="fake: host microseconds per run")
    ap.add_argument("--gpu-us", type=int, default=5000, help="fake: device microseconds per run")
    ap.add_argument("--out-kb", type=int, default=192, help="fake: result kilobytes per run (128 x 384 floats)")
    ap.add_argument("--repeat", type=int, default=2, help="timed passes per figure, best kept")
    ap.add_argument("--round-trips", type=int, default=100, help="chunks for the round-trip figure")
    ap.add_argument("--sweep", default="1x4,2x2,2x4", help="tasks_per_worker x worker_in_flight pairs ('' skips)")
    ap.add_argument("--no-bare", action="store_true", help="skip the in-worker-bare figure (a second cluster)")
    args = ap.parse_args(argv)
    for name in ("n", "batch", "host_us", "gpu_us", "out_kb", "repeat", "round_trips"):
        if getattr(args, name) < (0 if name.endswith("_us") else 1):
            ap.error(f"--{name.replace('_', '-')} must be positive")
    return args


class Workload:
    """One workload, local or on a DaskRuntime: ``run(runtime)`` returns the results to compare."""

    def __init__(self, args: argparse.Namespace, tmp: str) -> None:
        import hetero

        self.args = args
        if args.workload == "embed":
            from bench._corpus import stdlib_sentences
            from bench.dask import model_path
            from hetero.pipelines.embed import get_model

            self.model = get_model(model_path(args.model, tmp))
            self.texts = stdlib_sentences(args.n)
            self.runs = -(-len(self.texts) // args.batch)
            self.warm = self.texts[: args.batch * 4]
        else:
            g = hetero.Graph("fake")
            g.output(g.cpu(fake_gpu, g.cpu(fake_host, g.input("x"), args.host_us, name="host"),
                           args.gpu_us, args.out_kb * 256, name="gpu"))
            self.graph = g
            self.runs = args.n

    def run(self, runtime: Any, max_in_flight: int | None = 4) -> Any:
        """The workload's results (embeddings, or the fake runs' arrays stacked)."""
        if self.args.workload == "embed":
            from hetero.pipelines.embed import embed

            return embed(self.texts, model=self.model, batch_size=self.args.batch, runtime=runtime,
                         max_in_flight=4 if max_in_flight is None else max_in_flight)
        import anyio

        import hetero

        out: list[Any] = []
        inputs = ({"x": i} for i in range(self.runs))

        async def go() -> None:
            async for r in runtime.map(self.graph, inputs, max_in_flight=4 if max_in_flight is None else max_in_flight):
                out.append(r)

        if isinstance(runtime, hetero.Runtime):
            anyio.run(go)
        else:  # a DaskRuntime: map_sync, with its own in-flight rule unless given one
            out.extend(runtime.map_sync(self.graph, inputs, max_in_flight=max_in_flight))
        return np.stack(out)

    def warm_up(self, runtime: Any) -> None:
        if self.args.workload == "embed":
            from hetero.pipelines.embed import embed

            embed(self.warm, model=self.model, batch_size=self.args.batch, runtime=runtime)
        else:
            self.run_few(runtime)

    def run_few(self, runtime: Any) -> None:
        import anyio

        import hetero

        if not isinstance(runtime, hetero.Runtime):
            list(runtime.map_sync(self.graph, ({"x": i} for i in range(8))))
            return

        async def go() -> None:
            async for _ in runtime.map(self.graph, ({"x": i} for i in range(8))):
                pass

        anyio.run(go)

    def graph_of(self) -> Any:
        """The graph the workload maps (embed's, built as embed() builds it for a GPU-only runtime)."""
        if self.args.workload == "fake":
            return self.graph
        keys = [k for k in self.model.graphs if k.startswith("embed") and "-loop" not in k]
        return self.model.graphs[keys[-1]] if keys else None

    def one_run(self) -> tuple[Any, Any]:
        """One run's inputs and a result like its own (for the serialisation figure)."""
        if self.args.workload == "fake":
            return {"x": 0}, fake_gpu(0, 0, self.args.out_kb * 256)
        texts = self.texts[: self.args.batch]
        return {"texts": list(texts)}, np.zeros((len(texts), self.model.dim), np.float32)


def _best(fn: Any, repeat: int) -> tuple[float, Any]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def _parts(before: dict[str, Any], after: dict[str, Any], wall: float, runs: int) -> dict[str, Any]:
    """The workers' share of a pass: chunks, busy fraction, rt.map and hop seconds per chunk, CPU per run."""
    d = {k: sum(getattr(after[w], k) - getattr(before[w], k) for w in after)
         for k in ("chunks", "runs", "busy_s", "run_s", "hop_s", "cpu_s")}
    chunks = max(1, d["chunks"])
    return {"chunks": d["chunks"], "runs_per_chunk": round(d["runs"] / chunks, 1),
            "busy": round(d["busy_s"] / max(wall, 1e-9) / max(1, len(after)), 3),
            "map_ms_per_chunk": round(d["run_s"] / chunks * 1e3, 2),
            "hop_ms_per_chunk": round(d["hop_s"] / chunks * 1e3, 3),
            "worker_cpu_ms_per_run": round(d["cpu_s"] / max(1, runs) * 1e3, 3)}


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    os.environ.setdefault("XDG_RUNTIME_DIR", tempfile.gettempdir())
    import dask
    from distributed import Client, wait
    from distributed.protocol import deserialize_bytes, serialize_bytes

    import hetero
    from hetero.dask import DEFAULT_CHUNK_SIZE, DaskRuntime, HeteroPlugin, LocalWGPUCluster
    from hetero.lowlevel import adapter_labels, list_adapters

    from ._common import adapter_fields, emitter

    emit = emitter("dask-profile")
    tmp = tempfile.TemporaryDirectory(prefix="hetero-bench-dask-profile-")
    work = Workload(args, tmp.name)
    runs = work.runs

    # -- local ------------------------------------------------------------------------------------------------
    rt = hetero.Runtime()
    try:
        work.warm_up(rt)
        dev = rt.device()
        adapters = list_adapters()
        label = adapter_labels(adapters)[[a.summary for a in adapters].index(dev.summary["summary"])]
        emit(figure="setup", **adapter_fields(dev), selector=label, workload=args.workload, runs=runs,
             batch=args.batch if args.workload == "embed" else None, n=args.n,
             host_us=args.host_us if args.workload == "fake" else None,
             gpu_us=args.gpu_us if args.workload == "fake" else None, cpu_count=os.cpu_count())
        work.run(rt)  # the first pass captures the stages for the corpus's batch shapes
        cpu0 = time.process_time()
        local_s, reference = _best(lambda: work.run(rt), args.repeat)
        local_cpu = (time.process_time() - cpu0) / args.repeat
        emit(figure="local", s=round(local_s, 3), runs_per_s=round(runs / local_s, 1),
             ms_per_run=round(local_s / runs * 1e3, 3), cpu_ms_per_run=round(local_cpu / runs * 1e3, 3))
        trivial = hetero.Graph("trivial")
        trivial.output(trivial.cpu(_identity, trivial.input("x")))
        import anyio

        async def local_trips(n: int) -> None:
            for i in range(n):
                await rt.run(trivial, x=i)

        t0 = time.perf_counter()
        anyio.run(local_trips, args.round_trips)
        local_trip_ms = (time.perf_counter() - t0) / args.round_trips * 1e3
    finally:
        rt.close()
    per_run_ms = local_s / runs * 1e3

    # -- serialisation of one run's inputs and results ---------------------------------------------------------
    inputs, result = work.one_run()
    parts: dict[str, Any] = {}
    for name, obj in (("inputs", inputs), ("results", result)):
        data = serialize_bytes(obj)
        t0 = time.perf_counter()
        for _ in range(50):
            deserialize_bytes(serialize_bytes(obj))
        parts[f"{name}_bytes"] = len(data)
        parts[f"{name}_us"] = round((time.perf_counter() - t0) / 50 * 1e6, 1)
    share = (parts["inputs_us"] + parts["results_us"]) / 1e3 / per_run_ms
    emit(figure="serialise", per="run", **parts, share_of_local_run=round(share, 4))

    def cluster_figures(client: Client, bare: bool) -> None:
        nonlocal in_worker_s
        client.register_plugin(HeteroPlugin())
        with DaskRuntime(client, chunk_size=1) as drt:
            work.warm_up(drt)
        if bare:
            with DaskRuntime(client, chunk_size=runs, tasks_per_worker=1) as drt:
                work.run(drt)
                s, _ = _best(lambda: work.run(drt), args.repeat)
            emit(figure="in-worker-bare", s=round(s, 3), runs_per_s=round(runs / s, 1),
                 ratio=round(in_worker_s / s, 3), against="in-worker")
            return
        # a chunk alone, and chunks overlapping
        with DaskRuntime(client, chunk_size=1) as drt:
            drt.run_sync(trivial, x=0)
            trips = []
            for i in range(args.round_trips):
                t0 = time.perf_counter()
                drt.run_sync(trivial, x=i)
                trips.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            list(drt.map_sync(trivial, ({"x": i} for i in range(args.round_trips))))
            overlap_ms = (time.perf_counter() - t0) / args.round_trips * 1e3
            emit(figure="round trip", run_ms=round(min(trips) * 1e3, 3),
                 run_median_ms=round(statistics.median(trips) * 1e3, 3), chunk_ms=round(overlap_ms, 3),
                 local_run_ms=round(local_trip_ms, 3), chunks=args.round_trips,
                 in_flight_per_worker=drt.tuning(trivial).max_in_flight)
        # fetching a chunk's results once done
        nbytes = parts["results_bytes"] * DEFAULT_CHUNK_SIZE
        times = []
        for _ in range(5):
            fut = client.submit(np.ones, nbytes // 4, np.float32, pure=False)
            wait(fut)
            t0 = time.perf_counter()
            fut.result()
            times.append(time.perf_counter() - t0)
            fut.release()
        emit(figure="transfer", bytes=nbytes, ms=round(min(times) * 1e3, 3),
             gb_per_s=round(nbytes / min(times) / 1e9, 2), share_of_chunk=round(min(times) * 1e3 / (
                 per_run_ms * DEFAULT_CHUNK_SIZE), 4))

        def measured(figure: str, drt: Any, against: float, against_name: str, **fields: Any) -> float:
            work.run(drt)  # this DaskRuntime's graph reaches the worker; adaptive sizes settle
            best = float("inf")
            for _ in range(args.repeat):
                before = drt.worker_stats()
                t0 = time.perf_counter()
                out = work.run(drt)
                wall = time.perf_counter() - t0
                after = drt.worker_stats()
                if wall < best:
                    best, ps = wall, _parts(before, after, wall, runs)
                diff = float(np.abs(np.asarray(out) - np.asarray(reference)).max())
                if not diff < 1e-4:
                    raise SystemExit(f"bench dask --profile: {figure}: results differ from local ones by {diff}")
            g = work.graph_of()
            tuning = drt.tuning(g) if g is not None else None
            emit(figure=figure, **fields, s=round(best, 3), runs_per_s=round(runs / best, 1),
                 ratio=round(against / best, 3), against=against_name, **ps,
                 tuning=None if tuning is None else {
                     "chunk_size": tuning.chunk_size, "max_in_flight": tuning.max_in_flight,
                     "run_ms": None if tuning.run_s is None else round(tuning.run_s * 1e3, 3),
                     "round_trip_ms": None if tuning.round_trip_s is None else round(tuning.round_trip_s * 1e3, 3)})
            return best

        with DaskRuntime(client, chunk_size=runs, tasks_per_worker=1) as drt:
            in_worker_s = measured("in-worker", drt, local_s, "local", chunk_size=runs, tasks_per_worker=1,
                                   worker_in_flight=4)
        with DaskRuntime(client, chunk_size=DEFAULT_CHUNK_SIZE, worker_in_flight=4) as drt:
            measured("fixed", drt, local_s, "local", chunk_size=DEFAULT_CHUNK_SIZE, worker_in_flight=4)
        with DaskRuntime(client) as drt:
            measured("adaptive", drt, local_s, "local", chunk_size=None, worker_in_flight=drt.worker_in_flight,
                     tasks_per_worker=drt.tasks_per_worker)
        for pair in filter(None, args.sweep.split(",")):
            tpw, wif = (int(v) for v in pair.split("x"))
            with DaskRuntime(client, tasks_per_worker=tpw, worker_in_flight=wif) as drt:
                measured("sweep", drt, local_s, "local", tasks_per_worker=tpw, worker_in_flight=wif)

    in_worker_s = float("nan")
    with LocalWGPUCluster(1, adapter=label) as cluster, Client(cluster) as client:
        cluster_figures(client, bare=False)
    if not args.no_bare:
        with dask.config.set({"distributed.worker.profile.enabled": False,
                              "distributed.nanny.pre-spawn-environ": {}}):
            with LocalWGPUCluster(1, adapter=label) as cluster, Client(cluster) as client:
                cluster_figures(client, bare=True)
    tmp.cleanup()
    return 0
