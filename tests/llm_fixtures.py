"""Tiny random Llama / Qwen2 models written as GGUF files and Hugging Face directories, for tests.

A plain module (no pytest fixtures): tests import it as ``from llm_fixtures import ...``.

* :func:`tiny_config` is the Hugging Face ``config.json`` dict of a tiny model;
* :func:`tiny_weights` its random float32 weights in Hugging Face layout (``[out, in]``);
* :func:`write_tiny_gguf` writes them as llama.cpp's converter would: GGUF names, llama's Q/K
  rows permuted for llama.cpp's interleaved RoPE (qwen2's are not), 2-D tensors in ``wtype``,
  1-D ones in F32, the tokenizer and chat template in the metadata;
* :func:`write_tiny_hf_dir` writes ``config.json``, ``model.safetensors`` (or shards),
  ``tokenizer.json``, ``tokenizer_config.json`` with a chatml template;
* :func:`expected_weights` is what loading a file written with ``wtype`` must give back:
  the Hugging Face weights through that type's rounding (quantized, then dequantized).
* :func:`spm_vocab` is a SentencePiece-BPE-style vocabulary (Llama 2's layout: ``<unk>``,
  ``<s>``, ``</s>``, the 256 ``<0xNN>`` byte tokens, then pieces by score) learned from
  standard-library docstrings (:func:`stdlib_docs`); :func:`add_spm_tokenizer` writes it as
  GGUF metadata (``write_tiny_gguf(..., tokenizer=...)``).

Dimensions are multiples of 32 so every 2-D tensor can be quantized per block of 32.
"""

from __future__ import annotations

import functools
import json
import struct
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "CHATML_TEMPLATE",
    "CORPUS",
    "SHAPES",
    "SPECIAL_TOKENS",
    "SPM_SPECIALS",
    "SPM_TRAINING_MODULES",
    "SpmVocab",
    "add_spm_tokenizer",
    "expected_weights",
    "gguf_name",
    "gguf_permute",
    "shaped_config",
    "spm_vocab",
    "stdlib_docs",
    "tiny_config",
    "tiny_tokenizer",
    "tiny_weights",
    "write_safetensors",
    "write_tiny_gguf",
    "write_tiny_hf_dir",
]

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "def f(x):\n    return x * 2 + 1  # numbers 12345 and 67890",
    "Héllo wörld: naïve café, 日本語のテキスト, emoji 🙂🚀 and symbols ∑∫√.",
    "A language model predicts the next token from the ones before it.",
    "Grouped-query attention shares keys and values between heads.",
] * 4


# Real models' shapes (config.json keys), for random models of the benchmark's sizes.
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
                     "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                     "max_position_embeddings": 8192, "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
                     "tie_word_embeddings": True},
    "qwen2.5-0.5b": {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
                     "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
                     "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                     "tie_word_embeddings": True},
}


def shaped_config(name: str, **overrides: Any) -> dict[str, Any]:
    """The ``config.json`` of a model of ``SHAPES[name]``'s shape (``overrides`` win, e.g. fewer layers).

    Its vocabulary is larger than the fixture tokenizer's: ids past the tokenizer's are valid
    model inputs, they just never come out of ``encode``.
    """
    shape = SHAPES[name]
    c = tiny_config(shape["model_type"])
    c.pop("head_dim", None)
    c.update(shape)
    c.update(overrides)
    return c


def tiny_config(arch: str = "llama", *, tied: bool = False, vocab_size: int | None = None,
                rope_scaling: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``config.json`` of a tiny model: 2 layers, hidden 64, 4 heads / 2 KV heads, FFN 128."""
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"arch must be 'llama' or 'qwen2', got {arch!r}")
    c: dict[str, Any] = {
        "model_type": arch,
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"],
        "vocab_size": vocab_size if vocab_size is not None else tiny_tokenizer().get_vocab_size(),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5 if arch == "llama" else 1e-6,
        "rope_theta": 10000.0 if arch == "llama" else 1000000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": tied,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    if arch == "llama":
        c["head_dim"] = 16
        c["attention_bias"] = False
    if rope_scaling is not None:
        c["rope_scaling"] = dict(rope_scaling)
    return c


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    tok = Tokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = BpeTrainer(vocab_size=384, special_tokens=SPECIAL_TOKENS,
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return str(tok.to_str())


def tiny_tokenizer() -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on :data:`CORPUS` (specials are ids 0, 1, 2)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_tokenizer_json())


def tiny_weights(config: Mapping[str, Any], *, seed: int = 0, scale: float = 0.2) -> dict[str, np.ndarray]:
    """Random float32 weights in Hugging Face layout for ``config`` (norms near 1)."""
    rng = np.random.default_rng(seed)
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or h // heads
    bias = config["model_type"] == "qwen2" or config.get("attention_bias", False)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w: dict[str, np.ndarray] = {"model.embed_tokens.weight": mat(v, h)}
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        w[p + "input_layernorm.weight"] = norm(h)
        w[p + "self_attn.q_proj.weight"] = mat(heads * hd, h)
        w[p + "self_attn.k_proj.weight"] = mat(kv * hd, h)
        w[p + "self_attn.v_proj.weight"] = mat(kv * hd, h)
        if bias:
            w[p + "self_attn.q_proj.bias"] = (rng.standard_normal(heads * hd) * 0.1).astype(np.float32)
            w[p + "self_attn.k_proj.bias"] = (rng.standard_normal(kv * hd) * 0.1).astype(np.float32)
            w[p + "self_attn.v_proj.bias"] = (rng.standard_normal(kv * hd) * 0.1).astype(np.float32)
        w[p + "self_attn.o_proj.weight"] = mat(h, heads * hd)
        w[p + "post_attention_layernorm.weight"] = norm(h)
        w[p + "mlp.gate_proj.weight"] = mat(i, h)
        w[p + "mlp.up_proj.weight"] = mat(i, h)
        w[p + "mlp.down_proj.weight"] = mat(h, i)
    w["model.norm.weight"] = norm(h)
    if not config.get("tie_word_embeddings", False):
        w["lm_head.weight"] = mat(v, h)
    return w


def gguf_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row order: each head's halves interleaved (rows, or a bias vector).

    HF row ``s * head_dim / 2 + j`` of a head becomes its row ``2 * j + s``.
    """
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GGUF_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}


def gguf_name(hf: str) -> str:
    """The GGUF tensor name of a Hugging Face one."""
    if hf in _GGUF_TOP:
        return _GGUF_TOP[hf]
    _, _, n, rest = hf.split(".", 3)
    return f"blk.{n}.{_GGUF_LAYER[rest]}"


def _round_trip(w: np.ndarray, wtype: str) -> np.ndarray:
    """``w`` through ``wtype``'s storage (float32 out)."""
    from gguf import GGMLQuantizationType, quants

    if w.ndim == 1 or wtype == "f32":
        return w
    if wtype == "f16":
        return w.astype(np.float16).astype(np.float32)
    t = GGMLQuantizationType[wtype.upper()]
    return np.asarray(quants.dequantize(quants.quantize(w, t), t), dtype=np.float32)


def expected_weights(weights: Mapping[str, np.ndarray], wtype: str) -> dict[str, np.ndarray]:
    """What loading a file written in ``wtype`` must give back, dequantized, in Hugging Face layout."""
    return {k: _round_trip(v, wtype) for k, v in weights.items()}


def write_tiny_gguf(path: str | Path, arch: str = "llama", wtype: str = "f32", tied: bool = False, *,
                    seed: int = 0, config: Mapping[str, Any] | None = None,
                    weights: Mapping[str, np.ndarray] | None = None, arch_name: str | None = None,
                    drop: Iterable[str] = (), retype: Mapping[str, str] | None = None,
                    reshape: Mapping[str, tuple[int, ...]] | None = None, add_bos: bool = False,
                    chat_template: str | None = CHATML_TEMPLATE, tokenizer_model: str = "gpt2",
                    edit: Callable[[Any], None] | None = None,
                    tokenizer: Callable[[Any], None] | None = None) -> Path:
    """Write a tiny model as a GGUF file the way llama.cpp's converter would; the path.

    ``wtype`` (f32, f16, bf16, q8_0, q4_0, q4_1) is the type of every 2-D tensor; 1-D ones are
    F32. For broken files: ``arch_name`` overrides ``general.architecture``, ``drop`` leaves
    GGUF tensors out, ``retype`` writes a GGUF tensor in another GGML type (random blocks),
    ``reshape`` writes a GGUF tensor of another numpy shape, ``edit(writer)`` adds metadata.
    ``tokenizer(writer)`` writes the tokenizer metadata in place of the byte-level BPE one
    (``add_bos``, ``chat_template`` and ``tokenizer_model`` are then its business).
    """
    import gguf
    from gguf import GGMLQuantizationType, quants

    path = Path(path)
    c = dict(config) if config is not None else tiny_config(arch, tied=tied)
    w = dict(weights) if weights is not None else tiny_weights(c, seed=seed)
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    name = arch_name or c["model_type"]
    writer = gguf.GGUFWriter(str(path), name)
    writer.add_name(f"tiny-{c['model_type']}")
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_rope_freq_base(c["rope_theta"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_vocab_size(c["vocab_size"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_file_type({"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7, "bf16": 32}[wtype])
    if tokenizer is not None:
        tokenizer(writer)
    else:
        _add_tokenizer(writer, tokenizer_model, add_bos, chat_template)
    if edit is not None:
        edit(writer)
    drop = set(drop)
    retype = dict(retype or {})
    reshape = dict(reshape or {})
    rng = np.random.default_rng(seed + 1)
    for hf, a in w.items():
        gname = gguf_name(hf)
        if gname in drop:
            continue
        a = np.asarray(a, dtype=np.float32)
        if c["model_type"] == "llama" and ".self_attn.q_proj." in hf:
            a = gguf_permute(a, heads)
        elif c["model_type"] == "llama" and ".self_attn.k_proj." in hf:
            a = gguf_permute(a, kv)
        if gname in reshape:
            a = rng.standard_normal(reshape[gname]).astype(np.float32)
        if gname in retype:
            t = GGMLQuantizationType[retype[gname]]
            block, size = gguf.GGML_QUANT_SIZES[t]
            raw = rng.integers(0, 256, (a.shape[0], a.shape[1] // block * size), dtype=np.uint8)
            writer.add_tensor(gname, raw, raw_dtype=t)
        elif a.ndim == 1 or wtype == "f32":
            writer.add_tensor(gname, a)
        elif wtype == "f16":
            writer.add_tensor(gname, a.astype(np.float16))
        else:
            t = GGMLQuantizationType[wtype.upper()]
            writer.add_tensor(gname, quants.quantize(a, t), raw_dtype=t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tokenizer(writer: Any, model: str, add_bos: bool, chat_template: str | None) -> None:
    tj = json.loads(_tokenizer_json())
    vocab: dict[str, int] = tj["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(add_bos)
    if chat_template is not None:
        writer.add_chat_template(chat_template)


SPM_SPECIALS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2, as in Llama 2's vocabulary
# The docstrings the SentencePiece-style vocabulary is learned from (ASCII text).
SPM_TRAINING_MODULES = ("json", "textwrap", "collections", "functools", "itertools", "string", "argparse", "logging")


def stdlib_docs(*modules: str) -> list[str]:
    """The paragraphs of the named standard-library modules' docstrings (``inspect.getdoc``)."""
    import importlib
    import inspect

    out: list[str] = []
    for name in modules:
        doc = inspect.getdoc(importlib.import_module(name)) or ""
        out += [p for p in doc.split("\n\n") if p.strip()]
    return out


class SpmVocab(NamedTuple):
    """A SentencePiece vocabulary as GGUF stores it: tokens, scores and token types, by id."""

    tokens: tuple[str, ...]
    scores: tuple[float, ...]
    types: tuple[int, ...]


@functools.lru_cache(maxsize=2)
def spm_vocab(size: int = 600) -> SpmVocab:
    """A SentencePiece-BPE-style vocabulary learned from :data:`SPM_TRAINING_MODULES`' docstrings.

    Laid out as Llama 2's: ``<unk>`` (type 2), ``<s>`` and ``</s>`` (control, type 3), the 256
    byte tokens ``<0x00>`` .. ``<0xFF>`` (type 6), then the learned pieces (type 1) with
    ``\u2581`` for a space, the merged ones by score (merge ``r`` scores ``-r``) and the single
    characters last, each lower than every merge. Characters the docstrings lack (``G``, ``é``,
    ``🙂``...) are only reachable through the byte tokens.
    """
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    tok = Tokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    tok.train_from_iterator(stdlib_docs(*SPM_TRAINING_MODULES), BpeTrainer(vocab_size=size, show_progress=False))
    model = json.loads(tok.to_str())["model"]
    merged = ["".join(m) if isinstance(m, list) else m.replace(" ", "") for m in model["merges"]]
    chars = [t for t in sorted(model["vocab"], key=model["vocab"].__getitem__) if len(t) == 1]
    head = [*SPM_SPECIALS, *(f"<0x{b:02X}>" for b in range(256))]
    pieces = [t for t in dict.fromkeys([*merged, *chars]) if t not in head]
    scores = [0.0] * len(head) + [-float(r) for r in range(len(pieces))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    return SpmVocab(tuple(head + pieces), tuple(scores), tuple(types))


def add_spm_tokenizer(writer: Any, vocab: SpmVocab | None = None, *, add_bos: bool | None = None,
                      add_eos: bool | None = None, add_space_prefix: bool | None = None,
                      chat_template: str | None = None, special_ids: bool = True) -> None:
    """Write ``vocab`` (default :func:`spm_vocab`) as a ``tokenizer.ggml.model = "llama"`` tokenizer.

    A flag left None is not written (the reader's default applies); ``special_ids=False``
    leaves out the BOS/EOS/unknown ids, as some converters do.
    """
    v = vocab or spm_vocab()
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(list(v.tokens))
    writer.add_token_scores(list(v.scores))
    writer.add_token_types(list(v.types))
    if special_ids:
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    if add_eos is not None:
        writer.add_add_eos_token(add_eos)
    if add_space_prefix is not None:
        writer.add_add_space_prefix(add_space_prefix)
    if chat_template is not None:
        writer.add_chat_template(chat_template)


_ST_DTYPES = {"f32": ("F32", np.float32), "f16": ("F16", np.float16), "bf16": ("BF16", np.uint16)}


def write_safetensors(path: str | Path, tensors: Mapping[str, np.ndarray], dtypes: Mapping[str, str] | None = None,
                      ) -> Path:
    """Write ``tensors`` as a safetensors file (``dtypes`` maps a name to a safetensors dtype when
    its array's own does not say it, e.g. ``"BF16"`` for uint16 bit patterns)."""
    path = Path(path)
    header: dict[str, Any] = {}
    blobs: list[bytes] = []
    offset = 0
    names = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.int8): "I8",
             np.dtype(np.uint16): "BF16"}
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)
        b = a.tobytes()
        header[name] = {"dtype": (dtypes or {}).get(name, names[a.dtype]), "shape": list(a.shape),
                        "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))
    return path


def _to_bf16(a: np.ndarray) -> np.ndarray:
    from gguf import GGMLQuantizationType, quants

    return np.asarray(quants.quantize(a, GGMLQuantizationType.BF16)).view(np.uint16).reshape(a.shape)


def write_tiny_hf_dir(path: str | Path, arch: str = "llama", tied: bool = False, *, seed: int = 0,
                      dtype: str = "f32", shards: int = 1, config: Mapping[str, Any] | None = None,
                      weights: Mapping[str, np.ndarray] | None = None,
                      chat_template: str | None = CHATML_TEMPLATE) -> Path:
    """Write a tiny model as a Hugging Face directory; the directory.

    ``dtype`` (f32, f16, bf16) is the type of every tensor; ``shards > 1`` splits the weights
    over ``model-0000i-of-0000n.safetensors`` files with ``model.safetensors.index.json``.
    """
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    c = dict(config) if config is not None else tiny_config(arch, tied=tied)
    w = dict(weights) if weights is not None else tiny_weights(c, seed=seed)
    (d / "config.json").write_text(json.dumps(c, indent=2))
    st_name, np_dtype = _ST_DTYPES[dtype]
    arrays = {k: (_to_bf16(v) if dtype == "bf16" else v.astype(np_dtype)) for k, v in w.items()}
    names = list(arrays)
    if shards <= 1:
        write_safetensors(d / "model.safetensors", arrays, {k: st_name for k in names})
    else:
        weight_map: dict[str, str] = {}
        for s in range(shards):
            part = names[s::shards]
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            write_safetensors(d / fname, {k: arrays[k] for k in part}, {k: st_name for k in part})
            weight_map.update({k: fname for k in part})
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (d / "tokenizer.json").write_text(_tokenizer_json())
    tc: dict[str, Any] = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                          "model_max_length": c["max_position_embeddings"]}
    if chat_template is not None:
        tc["chat_template"] = chat_template
    (d / "tokenizer_config.json").write_text(json.dumps(tc, indent=2))
    return d
