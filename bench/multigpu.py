"""Sentence embeddings scaled out over several GPUs: one dask worker per GPU against one worker on one GPU.

    python -m bench multigpu [--n 1000000] [--ref-n 200000] [--gpus N] [--workers W] [--adapter PATTERN]
                             [--model random|tiny|minilm|DIR] [--batch 128] [--chunk-size 16]
                             [--max-in-flight 4] [--budget-s 480]

In order, each phase printing its seconds (``phase`` lines, ``elapsed_s`` since the start):

1. ``setup``: the text, the adapters (``hetero info``'s selectors) and, where
   ``nvidia-smi`` exists, its GPUs (index, PCI bus, memory in use).
2. ``reference``: a ``LocalWGPUCluster`` of ONE worker on the first GPU, warmed, embeds
   ``--ref-n`` sentences (a prefix of the same text) through a ``DaskRuntime``.
3. ``scale-out``: a ``LocalWGPUCluster`` of one worker per GPU (every GPU of the default
   backend, or the first ``--gpus``; ``--workers`` more than that share them round-robin,
   to try the program on one adapter), ``HeteroPlugin`` registered, every worker warmed
   until each has run a chunk (each compiles its kernels). Each worker's adapter comes
   from ``DaskRuntime.adapters()`` (selector, index, name, vendor/device id, pid; wgpu
   gives no PCI bus) and, where nvidia-smi shows processes, the GPU holding the worker's
   pid. Two workers on one adapter while the pattern has more adapters is a failure.
   Then ``--n`` sentences, timed.
4. While each timed pass runs, ``nvidia-smi`` samples every GPU every ``--interval-ms``:
   ``gpu busy`` lines give per-GPU mean and max utilization and memory. Without
   nvidia-smi (lavapipe), ``worker busy`` lines are what hetero reports per worker
   (``DaskRuntime.worker_stats()`` before and after): runs, the fraction of the pass a
   chunk was running (host time), CPU cores used, GPU submissions. They are printed
   with nvidia-smi too.
5. ``figure: scale-out``: sentences/s on W workers and on one, ``ratio``, ``ratio_per_gpu``
   (the issue's goal: >= 0.9), and max |difference| of the embeddings of the reference's
   sentences against the reference run.

The program exits 1, after printing every figure, when workers shared an adapter while
more existed, when the Vulkan adapters are fewer than nvidia-smi's GPUs, when a GPU
holding a worker stayed idle (mean utilization under 5%), or when embeddings differ by
1e-4 or more.

The text is the standard library's docstring sentences (``bench._corpus``, a few thousand
distinct ones) repeated cyclically up to ``--n``; the ``setup`` line says how often.
``--model random`` writes all-MiniLM-L6-v2's architecture with random weights; ``tiny``
a 2-layer, 32-wide model for a software GPU.

Sizing: on the H200 one dask worker embedded about 9,600 sentences/s (random weights,
batch 128; BENCHMARKS.md, Dask). The 200,000-sentence reference then takes ~21 s; 1M
sentences take ~58 s on 2 GPUs and ~15 s on 8 at 0.9 x N; starting and warming the two
clusters ~1 min; about 2-3 minutes in all. ``--budget-s`` (seconds for the whole program)
caps ``--n`` after the reference pass, so that the timed pass fits even with no speed-up
at all.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import asdict
from typing import Any

os.environ.setdefault("XDG_RUNTIME_DIR", tempfile.gettempdir())

# Seconds kept back from --budget-s for starting, warming and closing the second cluster.
RESERVE_S = 90.0
# A GPU holding a worker whose mean utilization stays under this (%) counts as idle.
IDLE_UTIL = 5.0
# Memory (MiB) a GPU gains when a worker opens a device on it.
DEVICE_MIB = 64.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench multigpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1_000_000, help="sentences on all GPUs (default: %(default)s)")
    ap.add_argument("--ref-n", type=int, default=200_000,
                    help="sentences on one GPU, the reference (default: %(default)s, at most --n)")
    ap.add_argument("--gpus", type=int, default=None, help="use the first N adapters (default: all of them)")
    ap.add_argument("--workers", type=int, default=None, help="workers (default: one per GPU; more share them)")
    ap.add_argument("--adapter", default=None,
                    help="HETERO_ADAPTER pattern of the GPUs (default: LocalWGPUCluster.default_pattern())")
    ap.add_argument("--model", default="random", help="random | tiny | minilm | a model directory")
    ap.add_argument("--batch", type=int, default=128, help="sentences per batch (default: %(default)s)")
    ap.add_argument("--chunk-size", type=int, default=None,
                    help="batches per cluster task (default: DaskRuntime's, hetero.dask.DEFAULT_CHUNK_SIZE)")
    ap.add_argument("--max-in-flight", type=int, default=4, help="chunks in flight per worker (default: %(default)s)")
    ap.add_argument("--cpu-threads", type=int, default=None, help="each worker Runtime's cpu_threads")
    ap.add_argument("--budget-s", type=float, default=480.0, help="seconds for the whole program (default: %(default)s)")
    ap.add_argument("--interval-ms", type=int, default=200, help="nvidia-smi sampling interval (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.chunk_size is None:
        from hetero.dask import DEFAULT_CHUNK_SIZE
        args.chunk_size = DEFAULT_CHUNK_SIZE
    for name in ("n", "ref_n", "batch", "chunk_size", "max_in_flight"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    start = time.perf_counter()

    import numpy as np
    from distributed import Client

    from hetero.lowlevel import adapter_labels, list_adapters
    from hetero.dask import DaskRuntime, HeteroPlugin, LocalWGPUCluster
    from hetero.pipelines.embed import embed, get_model

    from . import _nvsmi
    from ._common import emitter
    from ._corpus import stdlib_sentences
    from .dask import model_path, warm_workers

    emit = emitter("multigpu")
    problems: list[str] = []

    def phase(name: str, since: float, **kw: Any) -> float:
        now = time.perf_counter()
        emit(phase=name, s=round(now - since, 2), elapsed_s=round(now - start, 1), **kw)
        return now

    # -- setup: text, model, adapters, GPUs ---------------------------------------------------------------
    t = time.perf_counter()
    tmp = tempfile.TemporaryDirectory(prefix="hetero-bench-multigpu-")
    model = get_model(model_path(args.model, tmp.name))
    corpus = stdlib_sentences()
    texts = [corpus[i % len(corpus)] for i in range(args.n)]
    ref_n = min(args.ref_n, args.n)
    warm = corpus[: args.batch * 2]
    emit(figure="text", sentences=args.n, distinct=len(corpus), cyclic=args.n > len(corpus),
         repeats=round(args.n / len(corpus), 2), ref_sentences=ref_n,
         mean_words=round(float(np.mean([len(s.split()) for s in texts])), 2),
         ref_mean_words=round(float(np.mean([len(s.split()) for s in texts[:ref_n]])), 2),
         model=str(args.model), batch=args.batch, chunk_size=args.chunk_size, max_in_flight=args.max_in_flight)

    adapters = list_adapters()
    labels = adapter_labels(adapters)
    pattern = args.adapter if args.adapter is not None else LocalWGPUCluster.default_pattern()
    selectors = LocalWGPUCluster.selectors_for(pattern)
    if args.gpus is not None and not 1 <= args.gpus <= len(selectors):
        raise SystemExit(f"bench multigpu: --gpus {args.gpus}, but {len(selectors)} adapter(s) match {pattern!r}: "
                         f"{', '.join(selectors)}")
    used = selectors[: args.gpus or len(selectors)]
    workers = args.workers or len(used)
    emit(figure="adapters", pattern=pattern, matching=selectors, used=used, workers=workers,
         all={label: a.summary for label, a in zip(labels, adapters)})
    smi = _nvsmi.gpus()
    if smi is None:
        emit(figure="nvidia-smi", available=False,
             note="no nvidia-smi: GPU utilization is not sampled; see the 'worker busy' lines (hetero's counters)")
    else:
        emit(figure="nvidia-smi", available=True, gpus=smi)
        if args.gpus is None and len(selectors) < len(smi):
            problems.append(f"{pattern!r} matches {len(selectors)} adapter(s) but nvidia-smi lists {len(smi)} GPUs: "
                            "the Vulkan driver does not see them all")
    base_mem = {g["index"]: g["mem_mib"] for g in smi or []}
    plugin_options = {} if args.cpu_threads is None else {"cpu_threads": args.cpu_threads}
    t = phase("setup", t)

    def stats_lines(label: str, before: dict[str, Any], after: dict[str, Any], seconds: float,
                    where: dict[str, Any]) -> None:
        for addr in sorted(after, key=lambda a: where[a].index if where[a].index is not None else -1):
            b, a = before[addr], after[addr]
            emit(figure="worker busy", run=label, worker=addr, selector=where[addr].selector, runs=a.runs - b.runs,
                 chunks=a.chunks - b.chunks, busy=round((a.busy_s - b.busy_s) / seconds, 3),
                 cpu_cores=round((a.cpu_s - b.cpu_s) / seconds, 2), submissions=a.submissions - b.submissions)
            if label == "scale-out" and a.runs == b.runs:
                problems.append(f"worker {addr} on {where[addr].selector} ran nothing in the timed pass")

    sampler = _nvsmi.Sampler(args.interval_ms)
    with sampler:
        # -- the reference: one worker on one GPU --------------------------------------------------------------
        with LocalWGPUCluster(1, adapter=[used[0]]) as cluster, Client(cluster) as client:
            client.register_plugin(HeteroPlugin(**plugin_options))
            t = phase("reference: cluster up", t)
            warm_workers(client, model, warm, args.batch)
            t = phase("reference: warm", t)
            with DaskRuntime(client, chunk_size=args.chunk_size) as drt:
                where = drt.adapters()
                for addr, a in where.items():
                    emit(figure="worker", run="reference", worker=addr, **asdict(a))
                before = drt.worker_stats()
                t0 = time.perf_counter()
                ref = embed(texts[:ref_n], model=model, batch_size=args.batch, runtime=drt,
                            max_in_flight=args.max_in_flight)
                t1 = time.perf_counter()
                stats_lines("reference", before, drt.worker_stats(), t1 - t0, where)
        windows = {"reference": (t0, t1)}
        ref_s = t1 - t0
        ref_rate = ref_n / ref_s
        emit(figure="reference", workers=1, selector=used[0], sentences=ref_n, s=round(ref_s, 3),
             sentences_per_s=round(ref_rate, 1))
        t = phase("reference", t)

        # -- the budget ---------------------------------------------------------------------------------------
        left = args.budget_s - (time.perf_counter() - start) - RESERVE_S
        cap = max(ref_n, int(ref_rate * left))  # the pass's length with no speed-up at all
        if len(texts) > cap:
            emit(note=f"--budget-s {args.budget_s:g}: {left:.0f} s left for the timed pass; at the reference's "
                      f"{ref_rate:.0f}/s (no speed-up assumed) --n {len(texts)} becomes {cap}")
            texts = texts[:cap]

        # -- one worker per GPU --------------------------------------------------------------------------------
        with LocalWGPUCluster(workers, adapter=used) as cluster, Client(cluster) as client:
            client.register_plugin(HeteroPlugin(**plugin_options))
            t = phase("scale-out: cluster up", t, workers=workers)
            warmed = warm_workers(client, model, warm, args.batch)
            t = phase("scale-out: warm", t, warm_chunks=warmed)
            with DaskRuntime(client, chunk_size=args.chunk_size) as drt:
                where = drt.adapters()
                on_gpu = _nvsmi.processes()
                for addr, a in sorted(where.items(), key=lambda kv: (kv[1].index is None, kv[1].index or 0)):
                    emit(figure="worker", run="scale-out", worker=addr, **asdict(a), nvidia_gpu=on_gpu.get(a.pid))
                distinct = {a.index for a in where.values()}
                if None in distinct or len(distinct) < min(len(where), len(used)):
                    problems.append(f"{len(where)} workers report {len(distinct)} distinct adapter(s) "
                                    f"({sorted(str(a.selector) for a in where.values())}) while {len(used)} "
                                    f"were given ({used})")
                    print(f"bench multigpu: {problems[-1]}", file=sys.stderr, flush=True)
                now_gpus = _nvsmi.gpus()
                held = _gpus_holding_workers(now_gpus, base_mem, on_gpu, where)
                for g in now_gpus or []:
                    emit(figure="gpu memory", gpu=g["index"], bus_id=g["bus_id"], base_mib=base_mem.get(g["index"]),
                         warm_mib=g["mem_mib"], holds_a_worker=g["index"] in held)
                before = drt.worker_stats()
                t0 = time.perf_counter()
                out = embed(texts, model=model, batch_size=args.batch, runtime=drt, max_in_flight=args.max_in_flight)
                t1 = time.perf_counter()
                stats_lines("scale-out", before, drt.worker_stats(), t1 - t0, where)
        windows["scale-out"] = (t0, t1)
        t = phase("scale-out", t)

    # -- GPU utilization during each timed pass (nvidia-smi) ---------------------------------------------------
    if sampler.running:
        for label, (w0, w1) in windows.items():
            for index, row in sampler.summary(w0, w1).items():
                emit(figure="gpu busy", run=label, gpu=index, **row)
        busy = sampler.summary(*windows["scale-out"])
        idle = [i for i in sorted(held) if (busy.get(i, {}).get("util_mean") or 0.0) < IDLE_UTIL]
        if idle:
            problems.append(f"GPU(s) {idle} hold a worker but stayed idle (mean utilization < {IDLE_UTIL}%)")
        if sampler.failures:
            emit(note=f"{sampler.failures} nvidia-smi queries failed")

    rate = len(texts) / (t1 - t0)
    gpus = len({a.index for a in where.values()})
    diff = float(np.abs(out[:ref_n] - ref).max())
    ratio = rate / ref_rate
    emit(figure="scale-out", workers=len(where), gpus=gpus, sentences=len(texts), s=round(t1 - t0, 3),
         sentences_per_s=round(rate, 1), reference_per_s=round(ref_rate, 1), ratio=round(ratio, 3),
         ratio_per_gpu=round(ratio / gpus, 3), goal_per_gpu=0.9, max_abs_diff=diff)
    if not diff < 1e-4:
        problems.append(f"embeddings on {len(where)} workers differ from the one-worker reference by {diff}")
    tmp.cleanup()
    phase("total", start)
    for p in problems:
        print(f"bench multigpu: FAILED: {p}", file=sys.stderr, flush=True)
    return 1 if problems else 0


def _gpus_holding_workers(now: list[dict[str, Any]] | None, base_mem: dict[int, Any], on_gpu: dict[int, int],
                          where: dict[str, Any]) -> set[int]:
    """nvidia-smi indices of the GPUs that hold a worker: by the workers' pids, else by memory gained since the start."""
    pids = {a.pid for a in where.values()}
    held = {gpu for pid, gpu in on_gpu.items() if pid in pids}
    if held or not now:
        return held
    return {g["index"] for g in now
            if g["mem_mib"] is not None and (g["mem_mib"] - (base_mem.get(g["index"]) or 0.0)) >= DEVICE_MIB}


if __name__ == "__main__":
    sys.exit(main())
