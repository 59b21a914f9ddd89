"""Text generation: hetero's LLM beside Hugging Face transformers on torch CUDA, same random weights.

``python -m bench generate [--shapes smollm2-135m,qwen2.5-0.5b] [--modes f16,q8_0] [--new 256]``

For each shape a random model is built with transformers (``LlamaForCausalLM`` /
``Qwen2ForCausalLM`` from the shape's config, seeded) and saved as a Hugging Face directory
(fp16 safetensors, a stand-in ``tokenizer.json``; prompts are random token ids). hetero
loads that directory with ``weights=`` each mode; transformers runs the same weights in
fp16 on CUDA. Printed, one JSON line each:

* correctness: hetero's float32-weight logits of a 64-token prompt against transformers'
  float32 logits, and how many of 64 greedy tokens agree;
* decode tokens/s at batch 1 (a 128-token prompt, ``--new`` tokens, no end-of-sequence
  token), TTFT, prefill tokens/s of a 512-token prompt, aggregate tokens/s of ``generate()``
  over 16 and 64 prompts; transformers eager fp16 ``generate`` the same, and with
  ``--compile`` its static cache under ``torch.compile``;
* the fraction of the memory-bandwidth roofline: weight bytes read a step over the step
  time, against a device-to-device copy's bandwidth measured by torch.

Without CUDA (``--layers 2`` on the CPU machine) it runs hetero alone as a smoke test.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench._common import adapter_fields, emitter, torch_cuda

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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="smollm2-135m,qwen2.5-0.5b")
    ap.add_argument("--modes", default="f16,q8_0", help="hetero weights= modes to time")
    ap.add_argument("--new", type=int, default=256, help="tokens to decode at batch 1")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (a smoke test)")
    ap.add_argument("--compile", action="store_true", help="also time transformers' static cache + torch.compile")
    ap.add_argument("--no-check", action="store_true")
    a = ap.parse_args(argv)
    import hetero
    from hetero.lowlevel import device_of
    from hetero.pipelines import LLM
    from hetero.pipelines.llm_model import load_model

    torch = torch_cuda()
    rt = hetero.Runtime()
    emit(**adapter_fields(device_of(rt)), torch_cuda=torch is not None)
    bw = bandwidth(torch) if torch is not None else None
    if bw is not None:
        emit(device_copy_GB_s=round(bw / 1e9, 1))
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
    rt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

