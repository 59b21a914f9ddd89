"""Host CPU time of a replayed run of the embedding graph, per thread, beside recording every run.

    python -m bench.replay_cost [--model tiny|random|minilm|DIR] [--batch 1] [--runs 100]
                                [--rounds 3] [--profile N] [--fused]

The GPU-only embedding graph (``Runtime(placement="gpu")``: tokenize and mask on the CPU,
then eight GPU stages: embeddings, six layers, pool; with ``--fused`` two GPU stages holding
them all, see ``hetero.pipelines.embed.FUSED_MAX_BATCH``) runs ``--runs`` times per round, one
run at a time, each on ``--batch`` sentences of the standard library's docstrings (every
shape captured by a warm pass first). Rounds alternate ``Runtime(capture=True)`` with
the reference, ``Runtime(capture=False)`` (every stage recorded every run), in the same
process. Per run it reads the CPU time (``CLOCK_THREAD_CPUTIME_ID`` of each thread, so a
loaded machine's waits do not count) of:

* ``record``: the GPU recording thread (replaying or recording the GPU stages, uploads,
  committing, submitting when it finds the GPU idle);
* ``cpu``: the CPU worker threads (tokenize, mask);
* ``loop``: the event loop's thread (starting the run, waking on its end);
* ``process``: the whole process (also the fence thread and, on a software adapter such as
  lavapipe, the driver's threads running the GPU work).

It prints one JSON line per round and mode (medians per run, in ms) and a last line with
the medians over rounds, their spread (min-max over rounds) and the ratio recording /
capture of the recording thread's time. ``--model tiny`` (the default) is MiniLM's graph
(6 layers, the same dispatches) at hidden size 64, so that a software adapter's GPU
work stays small; ``random`` is MiniLM's shapes with random weights (``bench.embed``'s).
``--profile N``: then N replayed runs (of the ``--fused`` graph or not) under cProfile on the recording thread, the top
functions by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import anyio

import hetero
from bench._common import bench_model, emitter, thread_cpu_ns

emit = emitter("replay_cost")


def threads_by_kind() -> dict[str, list[int]]:
    kinds: dict[str, list[int]] = {"record": [], "cpu": []}
    for t in threading.enumerate():
        if t.ident is None:
            continue
        if t.name.startswith("hetero-gpu"):
            kinds["record"].append(t.ident)
        elif t.name.startswith("hetero-cpu"):
            kinds["cpu"].append(t.ident)
    return kinds


def model_dir(name: str, tmp: str, texts: list[str]) -> Path:
    """The model's directory (``tiny`` and ``random`` written into ``tmp``, with ``bench.embed``'s
    tokenizer over ``texts`` for ``random``: sentences as long as real MiniLM makes them)."""
    if name in ("tiny", "random"):
        from hetero.pipelines.testing import write_random_model

        from bench.embed import corpus_tokenizer

        if name == "tiny":
            return write_random_model(tmp, seed=0, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                                      vocab_size=2000)
        d = write_random_model(tmp, seed=0)
        corpus_tokenizer(d, texts)
        return d
    return bench_model(name, "hetero-bench-replay-")[0]


def measure(model: Any, texts: list[list[str]], capture: bool, runs: int, budget_ms: float,
            fused: bool = False) -> dict[str, float]:
    """Median CPU ms per run of each kind of thread over ``runs`` runs (after a warm pass)."""
    from hetero.pipelines.embed import embedding_graph

    g = embedding_graph(model, cpu=False, fused=fused)
    per: dict[str, list[float]] = {"record": [], "cpu": [], "loop": [], "process": [], "wall": []}
    stages = ["encoder0", "encoder1"] if fused else [f"layer{n}" for n in range(model.config.num_hidden_layers)] + [
        "embeddings", "pool"]

    async def main() -> None:
        async with hetero.Runtime(capture=capture, placement="gpu", gpu_budget_ms=budget_ms) as rt:
            for batch in texts:  # warm: kernels compiled, weights resident, every shape captured
                await rt.run(g, texts=batch)
            await rt.run(g, texts=texts[0])
            kinds = threads_by_kind()
            loop = threading.get_ident()
            for r in range(runs):
                batch = texts[r % len(texts)]
                before = {k: sum(thread_cpu_ns(i) for i in ids) for k, ids in kinds.items()}
                l0, p0, w0 = thread_cpu_ns(loop), time.process_time_ns(), time.perf_counter_ns()
                await rt.run(g, texts=batch)
                w1, p1, l1 = time.perf_counter_ns(), time.process_time_ns(), thread_cpu_ns(loop)
                after = {k: sum(thread_cpu_ns(i) for i in ids) for k, ids in kinds.items()}
                for k in kinds:
                    per[k].append((after[k] - before[k]) / 1e6)
                per["loop"].append((l1 - l0) / 1e6)
                per["process"].append((p1 - p0) / 1e6)
                per["wall"].append((w1 - w0) / 1e6)
                st = rt.stats()
                want = "replayed" if capture else None
                assert all(st.stage(s).capture == want for s in stages), [st.stage(s).capture for s in stages]

    anyio.run(main)
    return {k: statistics.median(v) for k, v in per.items()}


def profile(model: Any, texts: list[list[str]], runs: int, budget_ms: float, fused: bool = False) -> None:
    """cProfile of the recording thread over ``runs`` replayed runs: the top functions by own time."""
    from hetero._scheduler import Scheduler
    from hetero.pipelines.embed import embedding_graph

    g = embedding_graph(model, cpu=False, fused=fused)
    prof = cProfile.Profile(time.thread_time_ns, 1e-9)  # CPU time: waits in C calls do not count
    on = [False]
    original = Scheduler.run_gpu

    def run_gpu(self: Scheduler, run: Any, i: int) -> None:
        if not on[0]:
            return original(self, run, i)
        prof.enable()
        try:
            return original(self, run, i)
        finally:
            prof.disable()

    async def main() -> None:
        async with hetero.Runtime(placement="gpu", gpu_budget_ms=budget_ms) as rt:
            for batch in texts * 2:  # captured, then a first replay making its bind groups
                await rt.run(g, texts=batch)
            on[0] = True
            for r in range(runs):
                await rt.run(g, texts=texts[r % len(texts)])
            on[0] = False

    Scheduler.run_gpu = run_gpu  # type: ignore[method-assign]
    try:
        anyio.run(main)
    finally:
        Scheduler.run_gpu = original  # type: ignore[method-assign]
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
    print(out.getvalue())
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(30)
    print(out.getvalue())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="tiny, random, minilm, or a model directory")
    p.add_argument("--batch", type=int, default=1, help="sentences per run (default: %(default)s)")
    p.add_argument("--runs", type=int, default=100, help="timed runs per round (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of each mode, alternated (default: %(default)s)")
    p.add_argument("--shapes", type=int, default=4, help="distinct batches cycled through (default: %(default)s)")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="then N replayed runs under cProfile")
    p.add_argument("--gpu-budget-ms", type=float, default=100.0,
                   help="Runtime(gpu_budget_ms=...) (default: %(default)s; a software adapter's slow kernels may "
                        "split a run into several submissions where a real GPU makes one: raise it there)")
    p.add_argument("--no-reference", action="store_true", help="capture=True only")
    p.add_argument("--fused", action="store_true",
                   help="the graph that records the encoder in two stages (embedding_graph(fused=True))")
    args = p.parse_args(argv)

    from bench._corpus import stdlib_sentences
    from hetero.pipelines.embed import get_model

    with tempfile.TemporaryDirectory(prefix="hetero-replay-cost-") as tmp:
        pool = stdlib_sentences(max_words=40)
        texts = [pool[i * args.batch:(i + 1) * args.batch] for i in range(args.shapes)]
        model = get_model(str(model_dir(args.model, tmp, pool[:1024])))
        modes = (True,) if args.no_reference else (True, False)
        rounds: dict[bool, list[dict[str, float]]] = {m: [] for m in modes}
        for r in range(args.rounds):
            for capture in modes if r % 2 == 0 else modes[::-1]:
                fig = measure(model, texts, capture, args.runs, args.gpu_budget_ms, args.fused)
                rounds[capture].append(fig)
                emit(round=r, capture=capture, fused=args.fused, model=args.model, batch=args.batch, runs=args.runs,
                     **{f"{k}_ms": round(v, 3) for k, v in fig.items()})
        summary: dict[str, Any] = {"model": args.model, "fused": args.fused, "batch": args.batch, "runs": args.runs,
                                   "rounds": args.rounds}
        for capture in modes:
            for k in rounds[capture][0]:
                vals = [f[k] for f in rounds[capture]]
                name = f"{'capture' if capture else 'recording'}_{k}_ms"
                summary[name] = round(statistics.median(vals), 3)
                summary[name + "_spread"] = [round(min(vals), 3), round(max(vals), 3)]
        if not args.no_reference:
            summary["ratio_recording_over_capture_record"] = round(
                summary["recording_record_ms"] / summary["capture_record_ms"], 3)
        emit(summary=True, **summary)
        if args.profile:
            profile(model, texts, args.profile, args.gpu_budget_ms, args.fused)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
