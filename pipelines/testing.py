"""Model directories with random weights, for tests and benchmarks that must not need the real model.

``write_random_model(dir, ...)`` writes ``config.json`` (Hugging Face BERT), a
``model.safetensors`` of random float32 weights of the right shapes and a WordPiece
``tokenizer.json`` (BERT normaliser, pre-tokenizer and ``[CLS] ... [SEP]`` template)
whose vocabulary has ``vocab_size`` entries: a directory that both
:func:`hetero.pipelines.minilm.load_model` and sentence-transformers
(``models.Transformer(dir)`` + ``models.Pooling`` + ``models.Normalize``) can load.
"""

from __future__ import annotations

import json
import os
import string
from pathlib import Path
from typing import Any

import numpy as np

from .minilm import BertConfig

__all__ = ["MINILM_CONFIG", "write_random_model"]

# all-MiniLM-L6-v2's architecture (config.json of sentence-transformers/all-MiniLM-L6-v2).
MINILM_CONFIG: dict[str, Any] = {
    "architectures": ["BertModel"], "model_type": "bert", "hidden_act": "gelu", "hidden_size": 384,
    "intermediate_size": 1536, "num_hidden_layers": 6, "num_attention_heads": 12, "vocab_size": 30522,
    "max_position_embeddings": 512, "type_vocab_size": 2, "layer_norm_eps": 1e-12, "pad_token_id": 0,
    "position_embedding_type": "absolute", "attention_probs_dropout_prob": 0.1, "hidden_dropout_prob": 0.1,
    "initializer_range": 0.02,
}
_SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def _vocab(size: int) -> list[str]:
    """``size`` distinct WordPiece entries: specials, characters, then words and ##pieces."""
    chars = list(string.ascii_lowercase + string.digits + string.punctuation)
    words = _SPECIAL + chars + ["##" + c for c in string.ascii_lowercase + string.digits]
    letters = string.ascii_lowercase
    i = 0
    while len(words) < size:
        a, b, c = letters[i % 26], letters[(i // 26) % 26], letters[(i // 676) % 26]
        w = a + b + (c if i >= 676 else "")
        words.append(w if (i // 17576) % 2 == 0 else "##" + w)
        i += 1
    if len(set(words[:size])) != min(size, len(words)):  # pragma: no cover - a bug in the generator
        raise AssertionError("vocabulary entries repeat")
    return words[:size]


def write_tokenizer(path: str | os.PathLike[str], vocab_size: int, max_length: int = 128) -> None:
    """A BERT-style WordPiece tokenizer.json with ``vocab_size`` entries (``[PAD]`` = 0)."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece

    vocab = {w: i for i, w in enumerate(_vocab(vocab_size))}
    tok = Tokenizer(WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    tok.enable_truncation(max_length=max_length)
    tok.save(str(path))


def write_random_model(directory: str | os.PathLike[str], *, seed: int = 0, scale: float = 0.05,
                       sentence_transformers: bool = True, **overrides: Any) -> Path:
    """Write a random BERT model directory (MiniLM's shapes unless ``overrides`` change them); return it.

    ``sentence_transformers`` also writes ``modules.json``, ``sentence_bert_config.json``
    (max_seq_length 256, or ``max_seq_length`` from ``overrides``) and ``1_Pooling/config.json``
    (mean pooling), so ``SentenceTransformer(dir)`` loads it as all-MiniLM-L6-v2 is loaded.
    """
    from safetensors.numpy import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    max_seq = int(overrides.pop("max_seq_length", 256))
    cfg = {**MINILM_CONFIG, **overrides}
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    bc = BertConfig(cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
                    cfg["intermediate_size"], cfg["max_position_embeddings"], cfg["type_vocab_size"],
                    cfg["layer_norm_eps"], max_seq_length=min(max_seq, cfg["max_position_embeddings"]))
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    for name, shape in bc.tensor_shapes().items():
        if name.endswith("LayerNorm.weight"):
            a = 1.0 + scale * rng.standard_normal(shape)
        else:
            a = scale * rng.standard_normal(shape)
        tensors[name] = a.astype(np.float32)
    h = cfg["hidden_size"]  # BertModel's pooler: unused by sentence embeddings, present in checkpoints
    tensors["pooler.dense.weight"] = (scale * rng.standard_normal((h, h))).astype(np.float32)
    tensors["pooler.dense.bias"] = np.zeros(h, np.float32)
    save_file(tensors, str(d / "model.safetensors"))
    write_tokenizer(d / "tokenizer.json", cfg["vocab_size"], max_length=min(max_seq, 512))
    (d / "vocab.txt").write_text("\n".join(_vocab(cfg["vocab_size"])) + "\n", encoding="utf-8")
    if sentence_transformers:
        (d / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq, "do_lower_case": False}))
        (d / "1_Pooling").mkdir(exist_ok=True)
        (d / "1_Pooling" / "config.json").write_text(json.dumps({
            "word_embedding_dimension": cfg["hidden_size"], "pooling_mode_cls_token": False,
            "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False,
            "pooling_mode_mean_sqrt_len_tokens": False}))
        (d / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
        (d / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "BertTokenizer", "do_lower_case": True, "model_max_length": 512,
            "unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]",
            "mask_token": "[MASK]"}))
    return d
