"""Text generation: hetero's LLM beside Hugging Face transformers and llama.cpp, same weights.

Two ways in.

**Random Hugging Face models** (the default): ``python -m bench generate [--shapes
smollm2-135m,qwen2.5-0.5b] [--modes f16,q8_0] [--new 256] [--compile]``. For each shape a
random model is built with transformers (``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` from the
shape's config, seeded) and saved as a Hugging Face directory (fp16 safetensors, a stand-in
``tokenizer.json``; prompts are random token ids). hetero loads that directory with
``weights=`` each mode; transformers runs the same weights in fp16 on CUDA. Printed, one JSON
line each:

* correctness: hetero's float32-weight logits of a 64-token prompt against transformers'
  float32 logits, and how many of 64 greedy tokens agree;
* decode tokens/s at batch 1 (a 128-token prompt, ``--new`` tokens, no end-of-sequence
  token), TTFT, prefill tokens/s of a 512-token prompt, aggregate tokens/s of ``generate()``
  over 16 and 64 prompts; transformers eager fp16 ``generate`` the same, and with
  ``--compile`` its static cache under ``torch.compile``;
* the fraction of the memory-bandwidth roofline: weight bytes read a step over the step
  time, against a device-to-device copy's bandwidth measured by torch.

**GGUF files**: ``--gguf FILE[,FILE...]`` and/or ``--make-gguf DIR`` (random-weight files of the
SmolLM2-135M layout and of a 1.07B Llama shape, written by the llm-anchor kit: ``--kit DIR``,
default ``.llm-anchor``; ``--models`` picks from :data:`bench.llama_cpp.KIT_MODELS`). hetero
loads each file with ``weights="auto"`` (its own quantization, e.g. Q4_1) and measures with
llama-bench's definitions (see :mod:`bench.llama_cpp`):

* ``tg128``: decode tokens/s at batch 1 after an empty prompt: a one-token prompt and 128
  tokens, 128 forward steps, wall clock, the mean of ``--reps`` runs after a warm-up;
* ``pp512``: a 512-token prompt's prefill tokens/s (up to its first token);
* ``b<N>``, for ``--npl 1,64``: N prompts of ``--npp`` 128 tokens, then ``--ntg`` 128 decode
  steps each: the aggregate decode tokens/s (tokens after each prompt's first, over the time
  after the last prompt's first token) and the total rate (prompt and decoded tokens over the
  whole call), as llama-batched-bench's S_TG and S. Prompts enter 2048 rows a step (llama.cpp's
  ``n_batch``); the streams admitted first already decode in the few steps that still take
  prompts (64 x 128 tokens: 3 steps, ~1% of the decoded tokens, counted in hetero's favour);
* the step: dispatches a step and a layer (a traced run), and a step's wall time beside its
  GPU time (``gpu_timing``): host time is what the GPU waits;
* the streams step: a decode step of ``max(--npl)`` streams, its GPU time by kernel (what holds
  many streams).

``--pipeline on|off|both`` times each file with ``LLM(pipeline=)`` steps overlapping, one at a
time, or both in turn; ``--knob NAME=V1,V2`` (repeatable) with a module attribute of
``hetero.kernels.decoder`` (or of ``decoder_gemm``) set to each value in turn, e.g. ``--knob
ATTN_PREFETCH=False,True --knob GEMV_UNITS_UNROLL=1,2`` (a tuple's items joined by ``+``: ``--knob
GEMV_LANES_WIDE_KINDS=q8_0,q8_0+q4_1``; ``--knob-each``: one knob at a time, the others at their
first value, instead of every combination);
``--gemv auto,lanes,units`` (any of them, in turn) with the decode GEMV
that ``hetero.kernels.decoder.GEMV_IMPL`` names; ``--tiled auto,blocked,dp4a`` with the GEMM of prompt
chunks and many streams that ``TILED_IMPL`` names; ``--steps-per-run 1,2,4`` with runs of up to
that many decode steps (``LLM(steps_per_run=)``); ``--kv-cache f32,f16`` with the KV cache's type
(``LLM(kv_cache_dtype=)``; llama.cpp's is f16). Every combination is timed; each after the
first is a ratio line against the first, same file, same run. The step profiles run with the
first combination's kernels, or with ``--profile-each`` with each one's (a ``setting`` field names it).
With several combinations, each after the first also has an accuracy line against the first: the
logits of one 128-token prompt (the GEMMs) and 32 greedy tokens from it (the GEMVs), compared.

With ``--vs-llama-cpp BIN_DIR`` (the kit's ``run.sh`` builds into ``.llm-build/build/bin``)
llama-bench and llama-batched-bench run on the same files with the same sizes, and each
hetero / llama.cpp ratio is a line. With torch on CUDA (and not ``--no-transformers``),
transformers loads each file (``from_pretrained(dir, gguf_file=name)``: dequantized), checks
hetero's logits and 64 greedy tokens in float32, and times eager fp16 decode the same way.
``--budget-s`` stops starting work past that many seconds (hetero and llama.cpp first, then
transformers); what is skipped is a line too.

Without CUDA (``--layers 2`` on the CPU machine) it runs hetero alone as a smoke test.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np

import hetero
from bench import llama_cpp
from bench._common import adapter_fields, dispatches_between, emitter, gpu_time_by_name, torch_cuda

emit = emitter("generate")

SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 49152,
                     "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                     "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                     "max_position_embeddings": 8192, "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
                     "tie_word_embeddings": True},
    "qwen2.5-0.5b": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 151936,
                     "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32768,
                     "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True},
}


def make_model(shape: str, d: Path, layers: int | None, seed: int) -> Any:
    """A random transformers model of ``shape`` saved to ``d`` (fp16 safetensors + a stand-in tokenizer); the model."""
    import torch
    import transformers
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    cfg = dict(SHAPES[shape], hidden_act="silu", bos_token_id=None, eos_token_id=None, torch_dtype="float16")
    if layers:
        cfg["num_hidden_layers"] = layers
    torch.manual_seed(seed)
    conf = transformers.AutoConfig.for_model(**cfg)
    model = transformers.AutoModelForCausalLM.from_config(conf, torch_dtype=torch.float32)
    model = model.half()
    model.save_pretrained(d, safe_serialization=True)
    tok = Tokenizer(WordLevel({"<unk>": 0, "a": 1, "b": 2}, unk_token="<unk>"))
    tok.save(str(d / "tokenizer.json"))
    return model


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=length).tolist() for _ in range(n)]


def hetero_figures(llm: Any, vocab: int, new: int, label: dict[str, Any]) -> dict[str, float]:
    p128 = prompts(1, 128, vocab, 1)[0]
    llm.generate(p128, max_tokens=8)  # capture the shapes
    c = llm.generate(p128, max_tokens=new)
    out: dict[str, float] = {"decode_tok_s": c.tokens_per_s, "ttft_ms": c.ttft_s * 1e3}
    p512 = prompts(1, 512, vocab, 2)[0]
    llm.generate(p512, max_tokens=1)
    c512 = llm.generate(p512, max_tokens=1)
    out["prefill_tok_s"] = 512 / c512.ttft_s
    for n in (16, 64):
        ps = prompts(n, 128, vocab, 3)
        llm.generate(ps, max_tokens=4)
        t0 = time.perf_counter()
        cs = llm.generate(ps, max_tokens=128)
        out[f"aggregate{n}_tok_s"] = sum(x.completion_tokens for x in cs) / (time.perf_counter() - t0)
    emit(side="hetero", **label, **{k: round(v, 1) for k, v in out.items()})
    return out


def torch_figures(torch: Any, model: Any, vocab: int, new: int, label: dict[str, Any], compile: bool) -> dict:
    out: dict[str, float] = {}
    dev = "cuda"

    def gen(ids: list[list[int]], n: int, **kw: Any) -> float:
        x = torch.tensor(ids, device=dev)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       pad_token_id=0, **kw)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    p128 = prompts(1, 128, vocab, 1)
    gen(p128, 8)
    t_pre = gen(p128, 1)
    t_all = gen(p128, new)
    out["decode_tok_s"] = (new - 1) / max(t_all - t_pre, 1e-9)
    out["ttft_ms"] = t_pre * 1e3
    p512 = prompts(1, 512, vocab, 2)
    gen(p512, 1)
    out["prefill_tok_s"] = 512 / gen(p512, 1)
    for n in (16, 64):
        ps = prompts(n, 128, vocab, 3)
        gen(ps, 4)
        out[f"aggregate{n}_tok_s"] = n * 128 / gen(ps, 128)
    emit(side="transformers eager fp16", **label, **{k: round(v, 1) for k, v in out.items()})
    if compile:
        try:
            model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
            gen(p128, 16, cache_implementation="static")
            t_pre = gen(p128, 1, cache_implementation="static")
            t_all = gen(p128, new, cache_implementation="static")
            rate = (new - 1) / max(t_all - t_pre, 1e-9)
            out["compiled_decode_tok_s"] = rate
            emit(side="transformers static+compile fp16", **label, decode_tok_s=round(rate, 1))
        except Exception as e:  # noqa: BLE001 - compile is best effort; say why it did not run
            emit(side="transformers static+compile fp16", **label, error=f"{type(e).__name__}: {e}"[:300])
    return out


def bandwidth(torch: Any) -> float:
    a = torch.empty(1 << 28, dtype=torch.float32, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * a.numel() * 4 * 20 / (time.perf_counter() - t0)


def check(llm_f32: Any, model: Any, torch: Any, vocab: int, label: dict[str, Any]) -> None:
    ids = prompts(1, 64, vocab, 4)[0]
    got = llm_f32.logits(ids)
    m32 = model.float()
    with torch.no_grad():
        want = m32(torch.tensor([ids], device="cuda")).logits[0].float().cpu().numpy()
    err = float((np.abs(got - want) / np.abs(want).max(-1, keepdims=True)).max())
    c = llm_f32.generate(ids, max_tokens=64)
    x = torch.tensor([ids], device="cuda")
    ref = m32.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=64, min_new_tokens=64, do_sample=False,
                       pad_token_id=0)[0, len(ids):].tolist()
    same = next((i for i, (a, b) in enumerate(zip(c.token_ids, ref)) if a != b), min(len(c.token_ids), len(ref)))
    emit(check="hetero f32 vs transformers f32", **label, max_rel_logit_err=err, greedy_tokens_equal_prefix=same,
         of=64)
    model.half()


# ---------------------------------------------------------------------------------------------
# GGUF files, beside llama.cpp


PREFILL_BATCH = 2048  # prompt rows a step on GGUF files: llama.cpp's default n_batch


class Budget:
    """Seconds left of ``--budget-s`` (unbounded without it)."""

    def __init__(self, seconds: float | None) -> None:
        self.end = None if seconds is None else time.perf_counter() + seconds

    def left(self) -> float:
        return float("inf") if self.end is None else self.end - time.perf_counter()

    def allows(self, need_s: float, what: str, **label: Any) -> bool:
        if self.left() >= need_s:
            return True
        emit(**label, skipped=what, reason=f"budget: {max(self.left(), 0):.0f} s left, about {need_s:.0f} s needed")
        return False


ACCURACY_PROMPT = 128
"""Tokens of the prompt whose logits (prefill: the GEMMs) each setting computes for the accuracy line."""
ACCURACY_TOKENS = 32
"""Greedy tokens each setting decodes from that prompt (decode: the GEMVs) for the accuracy line."""


def agreement(ref_logits: np.ndarray, ref_tokens: list[int], logits: np.ndarray,
              tokens: list[int]) -> dict[str, Any]:
    """How far one setting's outputs are from another's on the same prompt: the largest error a row
    relative to the row's largest logit, the positions whose argmax agree, and the greedy tokens
    equal before the first that differs."""
    scale = np.abs(ref_logits).max(-1)
    err = np.abs(logits.astype(np.float64) - ref_logits).max(-1) / np.where(scale > 0, scale, 1.0)
    same = next((i for i, (x, y) in enumerate(zip(ref_tokens, tokens)) if x != y), min(len(ref_tokens), len(tokens)))
    return {"logits_max_row_error": float(err.max()),
            "argmax_agree": round(float((logits.argmax(-1) == ref_logits.argmax(-1)).mean()), 4),
            "greedy_same_tokens": same, "greedy_tokens": len(ref_tokens)}


def kv_bytes(config: Any, streams: int, tokens: int, block: int = 16) -> int:
    """KV cache bytes (float32 K and V) for ``streams`` sequences of ``tokens``, with room to spare."""
    per_token = config.num_layers * config.num_kv_heads * config.head_dim * 2 * 4
    blocks = streams * (-(-tokens // block) + 1) + 8
    return per_token * block * blocks


def rate_stats(rates: list[float]) -> dict[str, float]:
    """Mean and standard deviation of per-run rates, as llama-bench reports them."""
    mean = float(np.mean(rates))
    return {"tok_s": round(mean, 1), "std": round(float(np.std(rates, ddof=1)) if len(rates) > 1 else 0.0, 1)}


def hetero_gguf(llm: Any, vocab: int, a: argparse.Namespace) -> dict[str, Any]:
    """hetero's llama-bench figures on a loaded file: tg, pp, and each batched-bench row."""
    out: dict[str, Any] = {}
    one = prompts(1, 1, vocab, 5)[0]
    llm.generate(one, max_tokens=a.tg)  # warm-up: captures the decode shapes, as llama-bench warms up
    rates = []
    for _ in range(a.reps):
        t0 = time.perf_counter()
        c = llm.generate(one, max_tokens=a.tg)
        rates.append(c.completion_tokens / (time.perf_counter() - t0))
    out[f"tg{a.tg}"] = rate_stats(rates)
    p = prompts(1, a.pp, vocab, 6)[0]
    llm.generate(p, max_tokens=1)
    out[f"pp{a.pp}"] = rate_stats([a.pp / llm.generate(p, max_tokens=1).ttft_s for _ in range(a.reps)])
    for pl in a.npl:
        ps = prompts(pl, a.npp, vocab, 7 + pl)
        llm.generate(ps, max_tokens=2)  # warm-up: the prefill chunks and a decode step of pl rows
        t0 = time.perf_counter()
        cs = llm.generate(ps, max_tokens=a.ntg + 1)  # the first token comes with the prefill, then ntg steps
        wall = time.perf_counter() - t0
        decoded = sum(c.completion_tokens - 1 for c in cs)
        after = wall - max(c.ttft_s for c in cs)
        out[f"b{pl}"] = {"decode_tok_s": round(decoded / after, 1) if after > 0 else None,
                         "total_tok_s": round((pl * a.npp + decoded) / wall, 1),
                         "ttft_ms": round(max(c.ttft_s for c in cs) * 1e3, 2)}
    return out


def step_profile(lm: Any, a: argparse.Namespace, steps: int | None = None, kv_cache: str = "f32") -> dict[str, Any]:
    """Dispatches a step and a layer, and a decode step's wall and GPU time, from a traced run of
    ``steps`` (default ``--tg``) tokens after a one-token prompt: tg's own contexts, so attention
    splits (and its combine pass) where tg's steps split it."""
    import hetero
    from hetero.pipelines import LLM

    steps = a.tg if steps is None else steps

    with tempfile.TemporaryDirectory(prefix="bench-generate-trace-") as d:
        path = Path(d) / "trace.json"
        rt = hetero.Runtime(trace=path, gpu_timing=True)
        with LLM(lm, runtime=rt, kv_cache_bytes=kv_bytes(lm.config, 1, 2 * steps + 8),
                 kv_cache_dtype=kv_cache) as llm:
            one = prompts(1, 1, lm.config.vocab_size, 5)[0]
            llm.generate(one, max_tokens=steps)
            t0 = time.perf_counter()
            c = llm.generate(one, max_tokens=steps)
            wall = time.perf_counter() - t0
        rt.close()
        trace = json.loads(path.read_text())
    kernels = gpu_time_by_name(trace, "GPU dispatches")
    n_steps = sum(n for n, _ in gpu_time_by_name(trace, "GPU queue").values())
    per_step = {name: n / n_steps for name, (n, _) in kernels.items()} if n_steps else {}
    layers = lm.config.num_layers
    # the layers' dispatches: those between a step's embedding and its gather_rows, on average over the
    # steps (attention's combine pass runs only where the keys split)
    spans = dispatches_between(trace, "decoder.embedding", "decoder.gather_rows")
    total = sum(per_step.values())
    per_layer = round(sum(spans) / len(spans) / layers, 2) if spans else 0
    out: dict[str, Any] = {"dispatches_per_step": round(total, 2), "dispatches_per_layer": per_layer,
                           "kernels_per_step": {k: round(v, 2) for k, v in sorted(per_step.items())}}
    if n_steps:  # both traced calls, so the capture's first step counts; by GPU time, most first
        out["kernels_gpu_us_per_step"] = {k: round(ms / n_steps * 1e3, 1) for k, (_, ms) in kernels.items()}
    n = c.completion_tokens
    out["step_wall_us"] = round(wall / n * 1e6, 1)
    if c.gpu_s is not None:
        out["step_gpu_us"] = round(c.gpu_s / n * 1e6, 1)
        out["step_host_us"] = round((wall - c.gpu_s) / n * 1e6, 1)  # the GPU idle: recording, fences, Python
        out["gpu_busy"] = round(c.gpu_s / wall, 3)
    out["note"] = "traced run, a timestamp around every dispatch"
    return out


def streams_profile(lm: Any, a: argparse.Namespace, top: int = 12, kv_cache: str = "f32") -> dict[str, Any]:
    """A decode step of ``max(--npl)`` streams, by kernel: GPU time and dispatches a step (``gpu_timing``).

    ``generate()`` of that many ``--npp``-token prompts with ``--ntg + 1`` new tokens, less the
    same with 1 (the prompts' prefill and first token), over ``--ntg`` steps; each traced twice,
    the second call counted (the first captures).
    """
    import hetero
    from hetero.pipelines import LLM

    streams = max(a.npl)
    ids = prompts(streams, a.npp, lm.config.vocab_size, 6)
    kv = kv_bytes(lm.config, streams, a.npp + a.ntg + 2)

    def traced(new: int) -> tuple[dict[str, tuple[int, float]], float]:
        with tempfile.TemporaryDirectory(prefix="bench-generate-trace-") as d:
            path = Path(d) / "trace.json"
            rt = hetero.Runtime(trace=path, gpu_timing=True)
            with LLM(lm, runtime=rt, kv_cache_bytes=kv, max_batch_tokens=PREFILL_BATCH,
                     prefill_chunk=PREFILL_BATCH, kv_cache_dtype=kv_cache) as llm:
                llm.generate(ids, max_tokens=new)
                t0 = time.perf_counter_ns()
                llm.generate(ids, max_tokens=new)
                wall = (time.perf_counter_ns() - t0) / 1e9
            rt.close()
            trace = json.loads(path.read_text())
        origin = trace["otherData"]["origin_perf_counter_ns"]
        return gpu_time_by_name(trace, since_us=(t0 - origin) / 1e3), wall

    base, wall0 = traced(1)
    full, wall1 = traced(a.ntg + 1)
    per = {k: ((n - base.get(k, (0, 0.0))[0]) / a.ntg, (ms - base.get(k, (0, 0.0))[1]) / a.ntg * 1e3)
           for k, (n, ms) in full.items()}
    ranked = sorted(((k, v) for k, v in per.items() if v[0] > 0.005), key=lambda kv: -kv[1][1])  # decode's own
    return {"streams": streams, "step_wall_us": round((wall1 - wall0) / a.ntg * 1e6, 1),
            "step_gpu_us": round(sum(us for _, (_, us) in ranked), 1),
            "kernels_gpu_us_per_step": {k: round(us, 1) for k, (_, us) in ranked[:top]},
            "kernels_dispatches_per_step": {k: round(n, 2) for k, (n, _) in ranked[:top]},
            "note": "traced runs, a timestamp around every dispatch"}


def llama_cpp_gguf(bin_dir: str, f: Path, a: argparse.Namespace, timeout: float) -> dict[str, Any]:
    """llama-bench's tg and pp and batched-bench's rows on ``f``, keyed as :func:`hetero_gguf`'s."""
    out: dict[str, Any] = {}
    for row in llama_cpp.run_llama_bench(bin_dir, f, n_prompt=a.pp, n_gen=a.tg, reps=a.reps, timeout=timeout):
        out[row.test] = {"tok_s": round(row.avg_ts, 1), "std": round(row.stddev_ts, 1)}
    rows = llama_cpp.run_batched_bench(bin_dir, f, npp=a.npp, ntg=a.ntg, npl=tuple(a.npl), timeout=timeout,
                                       ctx=max(16384, max(a.npl) * (a.npp + a.ntg)))
    for r in rows:  # the prompts' prefill time, and a decode step's (all streams)
        out[f"b{r.pl}"] = {"decode_tok_s": round(r.speed_tg, 1), "total_tok_s": round(r.speed, 1),
                           "prefill_ms": round(r.t_pp * 1e3, 2), "step_ms": round(r.t_tg / max(1, r.tg) * 1e3, 3)}
    return out


def ttft_target(model: str, mine: dict[str, Any], ref: dict[str, Any]) -> None:
    """Issue 48's TTFT target for one stream's prompt: hetero's TTFT against llama.cpp's prefill of
    the same prompt plus one decode step."""
    h, r = mine.get("b1"), ref.get("b1")
    if not (isinstance(h, dict) and isinstance(r, dict) and "ttft_ms" in h and "prefill_ms" in r):
        return
    target = r["prefill_ms"] + r["step_ms"]
    emit(model=model, measure="ttft b1", hetero_ms=h["ttft_ms"], llama_cpp_prefill_ms=r["prefill_ms"],
         llama_cpp_step_ms=r["step_ms"], target_ms=round(target, 2), ratio=round(h["ttft_ms"] / target, 3),
         met=h["ttft_ms"] <= target)


def ratios(model: str, mine: dict[str, Any], ref: dict[str, Any], reference: str) -> None:
    """One line per measure both sides have: hetero's figure, the reference's, and their ratio."""
    for measure, h in mine.items():
        r = ref.get(measure)
        if not isinstance(h, dict) or not isinstance(r, dict):
            continue
        for key in ("tok_s", "decode_tok_s", "total_tok_s"):
            if h.get(key) and r.get(key):
                emit(model=model, measure=measure, figure=key, hetero=h[key], reference=reference,
                     reference_value=r[key], ratio=round(h[key] / r[key], 3))


def transformers_gguf(torch: Any, f: Path, a: argparse.Namespace, check: dict[str, Any] | None,
                      mine: dict[str, Any]) -> None:
    """transformers on ``f`` (dequantized): the float32 check against hetero's, then eager fp16 decode."""
    import transformers

    label = {"model": f.stem}
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(f.parent), gguf_file=f.name,
                                                              torch_dtype=torch.float32).cuda().eval()
    emit(**label, side="transformers", loaded_s=round(time.perf_counter() - t0, 1))
    if check is not None:
        ids = check["ids"]
        with torch.no_grad():
            want = model(torch.tensor([ids], device="cuda")).logits[0].float().cpu().numpy()
        err = float((np.abs(check["logits"] - want) / np.abs(want).max(-1, keepdims=True)).max())
        x = torch.tensor([ids], device="cuda")
        ref = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=64, min_new_tokens=64,
                             do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
        got = check["greedy"]
        same = next((i for i, (p, q) in enumerate(zip(got, ref)) if p != q), min(len(got), len(ref)))
        emit(**label, check="hetero (file's weights) vs transformers f32 (dequantized)", max_rel_logit_err=err,
             greedy_tokens_equal_prefix=same, of=64)
    model.half()
    one = torch.tensor([prompts(1, 1, model.config.vocab_size, 5)[0]], device="cuda")

    def gen(n: int) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(one, attention_mask=torch.ones_like(one), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    gen(8)
    ref_fig = {f"tg{a.tg}": rate_stats([a.tg / gen(a.tg)])}
    emit(**label, side="transformers eager fp16", **ref_fig)
    ratios(f.stem, mine, ref_fig, "transformers eager fp16")
    del model
    torch.cuda.empty_cache()


def gguf_main(a: argparse.Namespace, torch: Any, bw: float | None) -> int:
    from hetero.pipelines import LLM
    from hetero.pipelines.llm_model import load_model

    budget = Budget(a.budget_s)
    if a.vs_llama_cpp:
        try:
            llama_cpp.binaries(a.vs_llama_cpp)
        except llama_cpp.LlamaCppMissing as e:
            emit(error=str(e))
            print(f"bench generate: {e}", file=sys.stderr)
            return 2
    files = [Path(x) for x in a.gguf.split(",") if x] if a.gguf else []
    if a.make_gguf:
        t0 = time.perf_counter()
        try:
            made = llama_cpp.make_ggufs(a.kit, a.make_gguf, a.models.split(","), layers=a.layers)
        except (llama_cpp.LlamaCppMissing, llama_cpp.LlamaCppError, ValueError) as e:
            emit(error=str(e))
            print(f"bench generate: {e}", file=sys.stderr)
            return 2
        emit(made=[str(m) for m in made], made_s=round(time.perf_counter() - t0, 1))
        files += made
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        print(f"bench generate: no such GGUF file: {', '.join(missing)}", file=sys.stderr)
        return 2
    with_hf = torch is not None and not a.no_transformers
    checks: dict[Path, dict[str, Any]] = {}
    mine: dict[Path, dict[str, Any]] = {}
    for f in files:
        label = {"model": f.stem}
        big = f.stat().st_size > 512 << 20
        if not budget.allows(90 if big else 45, "hetero and llama.cpp", **label):
            continue
        t0 = time.perf_counter()
        lm = load_model(f)
        kinds = collections.Counter(w.kind for w in lm.weights.values() if len(w.shape) == 2)
        lm.config = dataclasses.replace(lm.config, eos_token_ids=())  # random weights: decode every token asked
        vocab = lm.config.vocab_size
        rt = hetero.Runtime()
        kv = max(kv_bytes(lm.config, max(a.npl), a.npp + a.ntg + 2),
                 kv_bytes(lm.config, 1, ACCURACY_PROMPT + ACCURACY_TOKENS + 2))
        # prompts enter in steps of up to 2048 rows, llama.cpp's n_batch, decoding streams or not
        modes = {"on": [True], "off": [False], "both": [True, False]}[a.pipeline]
        settings = [Setting(impl, tiled, spr, pipeline, kvc, knobs) for impl in a.gemv for tiled in a.tiled
                    for spr in a.steps_per_run for pipeline in modes for kvc in a.kv_cache
                    for knobs in knob_grid(a.knob, a.knob_each)]
        figs: dict[Setting, dict[str, Any]] = {}
        outputs: dict[Setting, tuple[np.ndarray, list[int]]] = {}
        for setting in settings:
            with kernel_settings(setting), LLM(lm, runtime=rt, kv_cache_bytes=kv, max_batch_tokens=PREFILL_BATCH,
                                               prefill_chunk=PREFILL_BATCH, pipeline=setting.pipeline,
                                               steps_per_run=setting.steps_per_run,
                                               kv_cache_dtype=setting.kv_cache) as llm:
                if not figs:
                    emit(**label, side="hetero", loaded_s=round(time.perf_counter() - t0, 1),
                         layers=lm.config.num_layers, hidden=lm.config.hidden_size, matrices=dict(kinds),
                         file_MiB=round(f.stat().st_size / 2**20, 1))
                if with_hf and not figs:
                    ids = prompts(1, 64, vocab, 4)[0]
                    greedy = llm.generate(ids, max_tokens=64).token_ids
                    checks[f] = {"ids": ids, "logits": llm.logits(ids), "greedy": greedy}
                if len(settings) > 1:  # what each setting computes, against the first's (accuracy)
                    acc_ids = prompts(1, ACCURACY_PROMPT, vocab, 8)[0]
                    outputs[setting] = (llm.logits(acc_ids),
                                        llm.generate(acc_ids, max_tokens=ACCURACY_TOKENS).token_ids)
                fig = figs[setting] = hetero_gguf(llm, vocab, a)
                step_bytes = llm.engine.packed.nbytes
                emit(**label, side="hetero", weights="auto", pipeline=llm.pipeline, gemv=setting.gemv,
                     tiled=setting.tiled, steps_per_run=setting.steps_per_run,
                     **({"knobs": dict(setting.knobs)} if setting.knobs else {}), **fig)
        rt.close()
        first = settings[0]
        fig = figs[first]
        mine[f] = fig
        for setting in settings[1:]:  # each setting against the first, same file, same run
            ratios(f"{f.stem} ({_setting_change(first, setting)})", fig, figs[setting], f"hetero {setting.name}")
            emit(**label, side="hetero", measure="accuracy", setting=setting.name, against=first.name,
                 **agreement(*outputs[first], *outputs[setting]))
        if bw is not None and step_bytes:
            tg = fig[f"tg{a.tg}"]["tok_s"]
            emit(**label, weight_MB_per_step=round(step_bytes / 1e6, 1),
                 roofline_fraction=round(step_bytes * tg / bw, 4))
        if not a.no_profile:  # under the first setting (the one the ratios above are against), or each
            for setting in settings if a.profile_each else settings[:1]:
                named = {"setting": setting.name} if len(settings) > 1 else {}
                with kernel_settings(setting):
                    emit(**label, **named, side="hetero", measure="step",
                         **step_profile(lm, a, kv_cache=setting.kv_cache))
                    emit(**label, **named, side="hetero", measure="streams step",
                         **streams_profile(lm, a, kv_cache=setting.kv_cache))
        if a.vs_llama_cpp:
            try:
                ref = llama_cpp_gguf(a.vs_llama_cpp, f, a, timeout=max(10.0, min(180.0, budget.left())))
            except llama_cpp.LlamaCppError as e:
                emit(**label, side="llama.cpp", error=str(e)[:2000])
            else:
                emit(**label, side="llama.cpp", **ref)
                ratios(f.stem, fig, ref, "llama.cpp")
                ttft_target(f.stem, fig, ref)
        del lm
    if with_hf:
        for f in files:
            if f in mine and budget.allows(60 if f.stat().st_size > 512 << 20 else 30, "transformers", model=f.stem):
                try:
                    transformers_gguf(torch, f, a, checks.get(f), mine[f])
                except Exception as e:  # noqa: BLE001 - the reference is best effort; say why it did not run
                    emit(model=f.stem, side="transformers", error=f"{type(e).__name__}: {e}"[:500])
    return 0


def shapes_main(a: argparse.Namespace, torch: Any, rt: Any, bw: float | None) -> None:
    from hetero.pipelines import LLM
    from hetero.pipelines.llm_model import load_model

    for shape in a.shapes.split(","):
        with tempfile.TemporaryDirectory(prefix="bench-generate-") as tmp:
            t0 = time.perf_counter()
            model = make_model(shape, Path(tmp), a.layers, 0)
            emit(shape=shape, made_s=round(time.perf_counter() - t0, 1))
            vocab = SHAPES[shape]["vocab_size"]
            if torch is not None:
                model = model.cuda().eval()
                if not a.no_check:
                    lm = load_model(tmp, weights="f32")
                    with LLM(lm, runtime=rt, kv_cache_bytes=256 << 20) as llm32:
                        check(llm32, model, torch, vocab, {"shape": shape})
                torch_figures(torch, model, vocab, a.new, {"shape": shape}, a.compile)
            for mode in a.modes.split(","):
                lm = load_model(tmp, weights=mode)
                lm.config = dataclasses.replace(lm.config, eos_token_ids=())
                with LLM(lm, runtime=rt, kv_cache_bytes=1 << 30) as llm:
                    label = {"shape": shape, "weights": mode}
                    f = hetero_figures(llm, vocab, a.new, label)
                    step_bytes = llm.engine.packed.nbytes
                    if bw is not None and f["decode_tok_s"]:
                        emit(**label, weight_MB_per_step=round(step_bytes / 1e6, 1),
                             roofline_fraction=round(step_bytes * f["decode_tok_s"] / bw, 4))
            del model
            if torch is not None:
                torch.cuda.empty_cache()


class Setting(NamedTuple):
    """One timed combination: the decode GEMV, the GEMM past GEMV_MAX_M rows, LLM's steps a run,
    pipeline and KV-cache type, and other kernel knobs (``--knob``: (module attribute, value) pairs)."""

    gemv: str
    tiled: str
    steps_per_run: int
    pipeline: bool
    kv_cache: str = "f32"
    knobs: tuple[tuple[str, Any], ...] = ()  # the last field (_setting_change)

    @property
    def name(self) -> str:
        return (f"gemv={self.gemv} tiled={self.tiled} steps_per_run={self.steps_per_run} "
                f"pipeline={'on' if self.pipeline else 'off'}"
                + (f" kv_cache={self.kv_cache}" if self.kv_cache != "f32" else "")
                + "".join(f" {k}={v}" for k, v in self.knobs))


def _setting_change(first: Setting, other: Setting) -> str:
    """What differs between two timed settings, as "first / other" (e.g. "pipeline on / off")."""
    def word(v: Any) -> str:
        return ("on" if v else "off") if isinstance(v, bool) else str(v)
    parts = [f"{name} {word(a)} / {word(b)}" for name, a, b in zip(Setting._fields[:-1], first, other) if a != b]
    parts += [f"{k} {a} / {b}" for (k, a), (_, b) in zip(first.knobs, other.knobs) if a != b]
    return ", ".join(parts)


def _knob_modules() -> tuple[Any, ...]:
    from hetero.kernels import decoder, decoder_gemm

    return decoder, decoder_gemm


def _literal(v: str) -> Any:
    """A Python literal, or the bare word itself (a string knob)."""
    import ast

    try:
        return ast.literal_eval(v)
    except (ValueError, SyntaxError):
        return v


def parse_knob(text: str) -> tuple[str, list[Any]]:
    """An argparse type: ``NAME=V1[,V2...]``, NAME an upper-case attribute of hetero.kernels.decoder
    or decoder_gemm, each value a Python literal of the attribute's type (values are split at
    commas). A tuple knob's value joins its items with ``+`` (``q8_0+q4_1``; ``()`` is empty)."""
    name, sep, values = text.partition("=")
    name = name.strip()
    mod = next((m for m in _knob_modules() if name.isupper() and hasattr(m, name)), None)
    if not sep or mod is None:
        raise argparse.ArgumentTypeError(f"expected NAME=V1[,V2...] with NAME a knob of hetero.kernels.decoder or "
                                         f"decoder_gemm (e.g. ATTN_PREFETCH=False,True); got {text!r}")
    current = getattr(mod, name)
    out = []
    for v in (x.strip() for x in values.split(",") if x.strip()):
        if isinstance(current, tuple):
            value: Any = () if v == "()" else tuple(_literal(i.strip()) for i in v.split("+") if i.strip())
            kinds = {type(i) for i in current}
            if any(type(i) not in kinds for i in value) and kinds:
                raise argparse.ArgumentTypeError(f"{name} is a tuple of {', '.join(sorted(t.__name__ for t in kinds))} "
                                                 f"({current!r}); got {v!r} (join items with '+')")
        else:
            value = _literal(v)
        if type(value) is not type(current):
            raise argparse.ArgumentTypeError(f"{name} is a {type(current).__name__} ({current!r}); got {v!r}")
        out.append(value)
    if not out or len(set(map(repr, out))) != len(out):
        raise argparse.ArgumentTypeError(f"expected distinct values for {name}; got {values!r}")
    return name, out


def knob_grid(knobs: list[tuple[str, list[Any]]], each: bool = False) -> list[tuple[tuple[str, Any], ...]]:
    """Every combination of the ``--knob`` values, the first knob's values outermost; with ``each``,
    the first values of all, then each later value of one knob with the others at their first."""
    if each:
        first = tuple((name, values[0]) for name, values in knobs)
        grid = [first]
        for i, (name, values) in enumerate(knobs):
            grid += [first[:i] + ((name, v),) + first[i + 1:] for v in values[1:]]
        return grid
    combos: list[tuple[tuple[str, Any], ...]] = [()]
    for name, values in knobs:
        combos = [g + ((name, v),) for g in combos for v in values]
    return combos


def _choices(names: tuple[str, ...]) -> Callable[[str], list[str]]:
    """An argparse type: distinct values of ``names``, comma-separated."""
    def parse(text: str) -> list[str]:
        got = [x.strip() for x in text.split(",") if x.strip()]
        if not got or set(got) - set(names) or len(set(got)) != len(got):
            raise argparse.ArgumentTypeError(f"expected distinct values of {', '.join(names)}, comma-separated; "
                                             f"got {text!r}")
        return got
    return parse


@contextlib.contextmanager
def kernel_settings(setting: Setting) -> Iterator[None]:
    """``hetero.kernels.decoder``'s ``GEMV_IMPL`` and ``TILED_IMPL`` and the ``--knob`` attributes set to
    ``setting``'s while an LLM is made and timed (its step is captured with the kernels it chooses then)."""
    from hetero.kernels import decoder

    knobs = [(next(m for m in _knob_modules() if hasattr(m, k)), k, v) for k, v in setting.knobs]
    old = decoder.GEMV_IMPL, decoder.TILED_IMPL, [(m, k, getattr(m, k)) for m, k, _ in knobs]
    decoder.GEMV_IMPL, decoder.TILED_IMPL = setting.gemv, setting.tiled
    for m, k, v in knobs:
        setattr(m, k, v)
    try:
        yield
    finally:
        decoder.GEMV_IMPL, decoder.TILED_IMPL = old[0], old[1]
        for m, k, v in old[2]:
            setattr(m, k, v)


def _ints(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    from hetero.kernels.decoder import GEMV_IMPLS, TILED_IMPL, TILED_IMPLS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="smollm2-135m,qwen2.5-0.5b")
    ap.add_argument("--modes", default="f16,q8_0", help="hetero weights= modes to time")
    ap.add_argument("--new", type=int, default=256, help="tokens to decode at batch 1")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (a smoke test; also for --make-gguf)")
    ap.add_argument("--compile", action="store_true", help="also time transformers' static cache + torch.compile")
    ap.add_argument("--no-check", action="store_true")
    g = ap.add_argument_group("GGUF files (instead of --shapes)")
    g.add_argument("--gguf", default=None, metavar="FILE[,FILE...]", help="time these GGUF files (weights 'auto')")
    g.add_argument("--make-gguf", default=None, metavar="DIR", help="write the kit's random GGUF files there and time "
                   "them (a file already there is kept)")
    g.add_argument("--kit", default=".llm-anchor",
                   help="the llm-anchor kit (make_random_gguf.py, smollm2_meta.gguf.xz)")
    g.add_argument("--models", default="smollm2-orig,smollm2-q8_0,smollm2-f16,llama1b-q4_1,llama1b-q8_0",
                   help=f"kit files for --make-gguf, of: {', '.join(llama_cpp.KIT_MODELS)}")
    g.add_argument("--vs-llama-cpp", default=None, metavar="BIN_DIR", help="run llama-bench and llama-batched-bench "
                   "from BIN_DIR on the same files (the kit's run.sh builds .llm-build/build/bin)")
    g.add_argument("--tg", type=int, default=128, help="decode steps at batch 1 after an empty prompt (llama-bench -n)")
    g.add_argument("--pp", type=int, default=512, help="prompt tokens of the prefill test (llama-bench -p)")
    g.add_argument("--reps", type=int, default=3, help="repetitions of tg and pp (llama-bench -r)")
    g.add_argument("--npp", type=int, default=128, help="prompt tokens a stream (llama-batched-bench -npp)")
    g.add_argument("--ntg", type=int, default=128, help="decode steps a stream (llama-batched-bench -ntg)")
    g.add_argument("--npl", type=_ints, default=[1, 64], help="streams, comma-separated (llama-batched-bench -npl)")
    g.add_argument("--no-transformers", action="store_true", help="skip the transformers reference on GGUF files")
    g.add_argument("--no-profile", action="store_true", help="skip the traced step profile")
    g.add_argument("--profile-each", action="store_true",
                   help="trace the step profiles under the kernels of every setting (--gemv, --tiled, --knob), "
                        "not the first only")
    g.add_argument("--budget-s", type=float, default=None, help="start no new work after this many seconds")
    g.add_argument("--pipeline", choices=("on", "off", "both"), default="on",
                   help="LLM(pipeline=): steps overlap (on, the default), one at a time (off), or both in turn")
    g.add_argument("--gemv", type=_choices(GEMV_IMPLS), default=["auto"], metavar="IMPL[,IMPL...]",
                   help="hetero.kernels.decoder.GEMV_IMPL for decode rows, in turn: auto (the default), lanes, units")
    g.add_argument("--tiled", type=_choices(TILED_IMPLS), default=[TILED_IMPL], metavar="IMPL[,IMPL...]",
                   help=f"hetero.kernels.decoder.TILED_IMPL for prompt chunks and many streams, in turn: "
                        f"{', '.join(TILED_IMPLS)} (default {TILED_IMPL})")
    g.add_argument("--steps-per-run", type=_ints, default=[1], metavar="K[,K...]",
                   help="LLM(steps_per_run=) in turn: decode steps one GPU run may take (1 to 4; default 1)")
    g.add_argument("--kv-cache", type=_choices(("f32", "f16")), default=["f32"], metavar="f32,f16",
                   help="LLM(kv_cache_dtype=) in turn (default f32; llama.cpp's default cache is f16)")
    g.add_argument("--knob", type=parse_knob, action="append", default=[], metavar="NAME=V1[,V2...]",
                   help="a module attribute of hetero.kernels.decoder (or decoder_gemm) set to each value in turn "
                        "(repeatable: every combination is timed)")
    g.add_argument("--knob-each", action="store_true",
                   help="time the --knob values one knob at a time (the others at their first value), not every "
                        "combination")
    a = ap.parse_args(argv)
    for name in ("tg", "pp", "reps", "npp", "ntg"):
        if getattr(a, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(a, name)}")
    if a.vs_llama_cpp and not (a.gguf or a.make_gguf):
        ap.error("--vs-llama-cpp needs GGUF files: --gguf FILE[,FILE...] or --make-gguf DIR")
    from hetero.pipelines.llm_engine import MAX_STEPS_PER_RUN

    if max(a.steps_per_run) > MAX_STEPS_PER_RUN or len(set(a.steps_per_run)) != len(a.steps_per_run):
        ap.error(f"--steps-per-run takes distinct values from 1 to {MAX_STEPS_PER_RUN}, got {a.steps_per_run}")
    from hetero.lowlevel import device_of

    torch = torch_cuda()
    rt = hetero.Runtime()
    dev = device_of(rt)
    # the features that decide the decoder's kernels' options (and cooperative-matrix, not yet used)
    wanted = ("subgroup", "shader-f16", "cooperative-matrix", "shader-float32-atomic")
    emit(**adapter_fields(dev), torch_cuda=torch is not None,
         features={f: f in dev.adapter.features for f in wanted})
    bw = bandwidth(torch) if torch is not None else None
    if bw is not None:
        emit(device_copy_GB_s=round(bw / 1e9, 1))
    if a.gguf or a.make_gguf:
        rt.close()
        return gguf_main(a, torch, bw)
    shapes_main(a, torch, rt, bw)
    rt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
