"""Sentence embeddings on a dask cluster (hetero.dask) against local embed(), same model, same run.

    python -m bench dask [--n 100000] [--batch 128] [--chunk-size 16] [--worker-in-flight 4]
                          [--model random|tiny|minilm|DIR]
    python -m bench dask --profile ...      (the parts of a worker's time: bench/dask_profile.py)

Every figure embeds the same real sentences (stdlib docstrings, bench._corpus) after a
warm-up pass on each runtime (each worker in turn), best of ``--repeat`` passes (the first
pass over the corpus also captures the stages for its batch shapes, so a single pass
would favour whichever figure comes later); the cluster's embeddings must match the local
ones (``max_abs_diff``):

- ``local``: ``embed(texts, runtime=Runtime())`` in this process (the reference);
- ``dask-1``: ``embed(texts, runtime=DaskRuntime(client))`` on a LocalWGPUCluster of one
  worker process on the same adapter; ``ratio`` = dask-1 / local sentences per second;
  once per ``--chunk-size`` x ``--worker-in-flight`` pair given (comma-separated lists;
  default: DaskRuntime's defaults);
- ``dask-2``: two worker processes sharing that one adapter (each its own Runtime and
  device): does splitting the Python host work (tokenizing, recording) across
  processes help? ``ratio`` against dask-1;
- ``chunk overhead``: a graph with one trivial CPU stage through the DaskRuntime, one
  run per chunk: ``run_ms`` is one ``drt.run`` round trip (a chunk alone), ``chunk_ms``
  the time per chunk while ``max_in_flight`` chunks per worker overlap; a local
  ``rt.run`` of the same graph for reference;
- ``local gpu busy``: the share of a local pass's wall time the GPU spent on its stages
  (per-stage timestamps of a traced pass over the first ``BUSY_SENTENCES``,
  ``trace_dispatches=False``, on a Runtime of its own), and ``busy_at_local_rate``, that pass's GPU
  time over the untraced local pass's time for as many sentences: near 1, a second process on the
  same GPU can only share it, whatever it saves on the host.

``--model random`` (default) writes all-MiniLM-L6-v2's architecture with random weights
(``write_random_model``): the weights need not travel; ``tiny`` a 2-layer, 32-wide
model for a software GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("XDG_RUNTIME_DIR", tempfile.gettempdir())

TINY = dict(vocab_size=2000, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=130, max_seq_length=128)


def _identity(x: Any) -> Any:
    return x


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# Sentences of the traced pass that gives 'local gpu busy' (a share, steady well before the whole corpus).
BUSY_SENTENCES = 20_000


def gpu_busy(texts: list[str], model: Any, batch: int, warm: list[str], local_rate: float) -> dict[str, Any]:
    """The GPU's busy share of a traced local ``embed`` pass over ``texts`` (after a warm-up pass);
    ``busy_at_local_rate``: its GPU time over the time the untraced local pass (``local_rate``
    sentences/s) takes for as many sentences (tracing slows the host, not the GPU's stages)."""
    import json

    import hetero
    from hetero.pipelines.embed import embed

    from ._common import gpu_idle_causes

    with tempfile.TemporaryDirectory(prefix="hetero-bench-dask-trace-") as d:
        path = Path(d) / "trace.json"
        rt = hetero.Runtime(trace=path, trace_dispatches=False)
        try:
            embed(warm, model=model, batch_size=batch, runtime=rt)
            t0 = time.perf_counter_ns()
            embed(texts, model=model, batch_size=batch, runtime=rt)
            t1 = time.perf_counter_ns()
        finally:
            rt.close()
        trace = json.loads(path.read_text())
    origin = trace["otherData"]["origin_perf_counter_ns"]
    since, until = (t0 - origin) / 1e3, (t1 - origin) / 1e3
    idle = gpu_idle_causes(trace, since, until)
    wall_ms = (t1 - t0) / 1e6
    return {"busy": round(idle["busy_ms"] / wall_ms, 3), "wall_ms": round(wall_ms, 1), "busy_ms": idle["busy_ms"],
            "busy_at_local_rate": round(idle["busy_ms"] / (len(texts) / local_rate * 1e3), 3),
            "sentences_per_s": round(len(texts) / wall_ms * 1e3, 1),
            "note": "traced pass (a timestamp pair a stage), so a little slower than the local figure"}


def model_path(name: str, tmp: str) -> Any:
    """``--model``: ``random`` (MiniLM's architecture, random weights) and ``tiny`` are written under ``tmp``."""
    from hetero.pipelines.testing import write_random_model

    if name in ("random", "tiny"):
        return write_random_model(Path(tmp) / "model", **(TINY if name == "tiny" else {}))
    return name


def warm_workers(client: Any, model: Any, warm: list[str], batch: int) -> dict[str, int]:
    """Embed ``warm`` on each worker of ``client`` in turn (each compiles its kernels and captures its stages).

    One batch per task, kept on that worker (``DaskRuntime(workers=[...])``). Returns the
    chunks each worker ran, by address; raises SystemExit if one ran none.
    """
    from hetero.dask import DaskRuntime
    from hetero.pipelines.embed import embed

    with DaskRuntime(client) as everyone:
        start = {w: s.chunks for w, s in everyone.worker_stats().items()}
        for worker in start:
            with DaskRuntime(client, chunk_size=1, workers=[worker]) as one:
                embed(warm, model=model, batch_size=batch, runtime=one)
        ran = {w: s.chunks - start.get(w, 0) for w, s in everyone.worker_stats().items()}
    if not all(ran.values()):
        raise SystemExit(f"bench: warm-up left workers without a chunk: {ran}")
    return ran


def main(argv: list[str] | None = None) -> int:
    if "--profile" in (sys.argv[1:] if argv is None else argv):
        from .dask_profile import main as profile

        return profile(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m bench dask", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=100_000, help="sentences (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=128, help="sentences per batch (default: %(default)s)")
    ap.add_argument("--chunk-size", type=_ints, default=None,
                    help="batches per cluster task; a comma-separated list sweeps dask-1 (default: DaskRuntime's)")
    ap.add_argument("--worker-in-flight", type=_ints, default=None,
                    help="runs in flight in each chunk on the worker; a list sweeps dask-1 (default: DaskRuntime's)")
    ap.add_argument("--max-in-flight", type=int, default=4, help="chunks in flight per worker (default: %(default)s)")
    ap.add_argument("--model", default="random", help="random | tiny | minilm | a model directory")
    ap.add_argument("--overhead-chunks", type=int, default=200, help="chunks for the overhead figure")
    ap.add_argument("--no-two-workers", action="store_true", help="skip the two-worker figure")
    ap.add_argument("--repeat", type=int, default=2,
                    help="timed passes per figure, best kept (default: %(default)s; the first pass over the "
                         "corpus also captures its batch shapes)")
    args = ap.parse_args(argv)
    from hetero.dask import DEFAULT_WORKER_IN_FLIGHT

    # None: DaskRuntime's adaptive chunk size (ChunkTuning), the default a user gets
    chunk_sizes: list[int | None] = list(args.chunk_size or [None])
    args.worker_in_flight = args.worker_in_flight or [DEFAULT_WORKER_IN_FLIGHT]

    import numpy as np
    from distributed import Client

    import hetero
    from hetero.lowlevel import adapter_labels, list_adapters
    from hetero.dask import DaskRuntime, HeteroPlugin, LocalWGPUCluster
    from hetero.pipelines.embed import embed, get_model

    from ._common import adapter_fields, best_of, emitter
    from ._corpus import stdlib_sentences

    emit = emitter("dask")
    tmp = tempfile.TemporaryDirectory(prefix="hetero-bench-dask-")
    model = get_model(model_path(args.model, tmp.name))
    texts = stdlib_sentences(args.n)
    warm = texts[: args.batch * 4]
    words = float(np.mean([len(t.split()) for t in texts]))

    rt = hetero.Runtime()
    try:
        embed(warm, model=model, batch_size=args.batch, runtime=rt)
        dev = rt.device()
        adapters = list_adapters()
        label = adapter_labels(adapters)[[a.summary for a in adapters].index(dev.summary["summary"])]
        emit(**adapter_fields(dev), selector=label, sentences=len(texts), mean_words=round(words, 1),
             batch=args.batch, chunk_size=chunk_sizes[0] or "adaptive", worker_in_flight=args.worker_in_flight[0],
             model=str(args.model))
        out: dict[str, Any] = {}
        local_s = best_of(lambda: out.update(local=embed(texts, model=model, batch_size=args.batch, runtime=rt)),
                          args.repeat)
        local_rate = len(texts) / local_s
        emit(figure="local", s=round(local_s, 3), sentences_per_s=round(local_rate, 1))
        emit(figure="local gpu busy", **gpu_busy(texts[:BUSY_SENTENCES], model, args.batch, warm, local_rate))
        g = hetero.Graph("overhead")
        g.output(g.cpu(_identity, g.input("x")))

        async def local_runs(n: int) -> None:
            for i in range(n):
                await rt.run(g, x=i)

        import anyio

        n_over = args.overhead_chunks
        local_run_ms = _timed(lambda: anyio.run(local_runs, n_over)) / n_over * 1e3
    finally:
        rt.close()

    rates: dict[int, float] = {}
    for workers in (1,) if args.no_two_workers else (1, 2):
        with LocalWGPUCluster(workers, adapter=label) as cluster, Client(cluster) as client:
            client.register_plugin(HeteroPlugin())
            warm_workers(client, model, warm, args.batch)
            sweep = [(c, w) for c in chunk_sizes for w in args.worker_in_flight] if workers == 1 \
                else [(chunk_sizes[0], args.worker_in_flight[0])]
            for chunk_size, in_flight in sweep:
                with DaskRuntime(client, chunk_size=chunk_size, worker_in_flight=in_flight) as drt:
                    s = best_of(lambda: out.update(dask=embed(texts, model=model, batch_size=args.batch,
                                                              runtime=drt, max_in_flight=args.max_in_flight)),
                                args.repeat)
                diff = float(np.abs(out["dask"] - out["local"]).max())
                if not diff < 1e-4:
                    raise SystemExit(f"bench dask: embeddings on the cluster differ from local ones by {diff}")
                rate = len(texts) / s
                rates[workers] = max(rates.get(workers, 0.0), rate)
                ref = local_rate if workers == 1 else rates[1]
                emit(figure=f"dask-{workers}", workers=workers, chunk_size=chunk_size or "adaptive",
                     worker_in_flight=in_flight,
                     s=round(s, 3), sentences_per_s=round(rate, 1), ratio=round(rate / ref, 3),
                     against="local" if workers == 1 else "dask-1 (best)", max_abs_diff=diff)
            if workers == 1:
                one = DaskRuntime(client, chunk_size=1)
                with one:
                    one.run_sync(g, x=0)
                    run_ms = _timed(lambda: [one.run_sync(g, x=i) for i in range(n_over)]) / n_over * 1e3
                    chunk_ms = _timed(lambda: list(one.map_sync(g, ({"x": i} for i in range(n_over)),
                                                                max_in_flight=args.max_in_flight))) \
                        / n_over * 1e3
                emit(figure="chunk overhead", run_ms=round(run_ms, 3), chunk_ms=round(chunk_ms, 3),
                     local_run_ms=round(local_run_ms, 3), chunks=n_over)
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
