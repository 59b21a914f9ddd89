"""A numpy reference decoder for Llama-family models: the test oracle for the GPU path.

Straightforward and unfused, the way transformers' ``LlamaForCausalLM`` / ``Qwen2ForCausalLM``
compute it: RMSNorm, RoPE (rotate-half, the config's theta and scaling), grouped-query
causal attention, SwiGLU MLP, Qwen2's Q/K/V biases, tied or separate output projection.
Weights are dequantized once per (model, dtype) and cached while the model lives; the math
runs in ``dtype`` (float64 by default, float32 for a quick check of a real model).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from .llm_model import LoadedModel, dequantize

__all__ = ["ReferenceCache", "reference_forward", "reference_greedy", "reference_logits"]

# (id(model), dtype name) -> dequantized weights; entries go when their model does.
_weights: weakref.WeakKeyDictionary[LoadedModel, dict[str, dict[str, np.ndarray]]] = weakref.WeakKeyDictionary()


def _dense(model: LoadedModel, dtype: Any) -> dict[str, np.ndarray]:
    per_model = _weights.setdefault(model, {})
    key = np.dtype(dtype).name
    if key not in per_model:
        per_model[key] = {name: dequantize(w).astype(dtype, copy=False) for name, w in model.weights.items()}
    return per_model[key]


class ReferenceCache:
    """Per-layer keys and values of the positions run so far (``[kv_heads, positions, head_dim]``)."""

    def __init__(self, num_layers: int) -> None:
        self.keys: list[np.ndarray | None] = [None] * num_layers
        self.values: list[np.ndarray | None] = [None] * num_layers

    @property
    def length(self) -> int:
        """Positions held."""
        k = self.keys[0]
        return 0 if k is None else int(k.shape[1])


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE on ``x`` [heads, positions, head_dim]: pair (j, j + head_dim/2) turns by angle j."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def reference_forward(model: LoadedModel, ids: Sequence[int], cache: ReferenceCache | None = None, *,
                      dtype: Any = np.float64, last_only: bool = False) -> np.ndarray:
    """Logits of ``ids`` placed after the ``cache.length`` positions the cache holds (it grows).

    Returns ``[len(ids), vocab]`` (or ``[1, vocab]`` for the last id with ``last_only``) in ``dtype``.
    """
    c = model.config
    w = _dense(model, dtype)
    ids = [int(i) for i in ids]
    if not ids:
        raise ValueError("reference_forward: ids must not be empty")
    if not all(0 <= i < c.vocab_size for i in ids):
        raise ValueError(f"reference_forward: token ids must lie in [0, {c.vocab_size})")
    cache = cache if cache is not None else ReferenceCache(c.num_layers)
    start = cache.length
    n = len(ids)
    positions = np.arange(start, start + n, dtype=np.float64)
    angles = positions[:, None] * c.rope_inv_freq()[None, :]  # [n, head_dim/2]
    cos, sin = np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)
    total = start + n
    # Causal mask: query i (absolute position start + i) sees keys 0 .. start + i.
    mask = np.arange(total)[None, :] > (start + np.arange(n))[:, None]
    group = c.num_heads // c.num_kv_heads
    scale = np.dtype(dtype).type(1.0 / np.sqrt(c.head_dim))

    x = w["model.embed_tokens.weight"][ids]  # [n, hidden]; every op below keeps dtype
    for layer in range(c.num_layers):
        p = f"model.layers.{layer}."
        h = _rms_norm(x, w[p + "input_layernorm.weight"], c.rms_norm_eps)
        q = h @ w[p + "self_attn.q_proj.weight"].T
        k = h @ w[p + "self_attn.k_proj.weight"].T
        v = h @ w[p + "self_attn.v_proj.weight"].T
        if c.attention_bias:
            q = q + w[p + "self_attn.q_proj.bias"]
            k = k + w[p + "self_attn.k_proj.bias"]
            v = v + w[p + "self_attn.v_proj.bias"]
        q = _rope(q.reshape(n, c.num_heads, c.head_dim).transpose(1, 0, 2), cos, sin)
        k = _rope(k.reshape(n, c.num_kv_heads, c.head_dim).transpose(1, 0, 2), cos, sin)
        v = v.reshape(n, c.num_kv_heads, c.head_dim).transpose(1, 0, 2)
        old_k, old_v = cache.keys[layer], cache.values[layer]
        if old_k is not None and old_v is not None:
            k = np.concatenate([old_k, k], axis=1)
            v = np.concatenate([old_v, v], axis=1)
        cache.keys[layer], cache.values[layer] = k, v
        kk = np.repeat(k, group, axis=0)  # query head j reads kv head j // group
        vv = np.repeat(v, group, axis=0)
        scores = (q @ kk.transpose(0, 2, 1)) * scale  # [heads, n, total]
        scores = np.where(mask[None], -np.inf, scores)
        scores = scores - scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        attn = (probs @ vv).transpose(1, 0, 2).reshape(n, c.q_size)
        o = attn @ w[p + "self_attn.o_proj.weight"].T
        if c.attention_out_bias:
            o = o + w[p + "self_attn.o_proj.bias"]
        x = x + o
        h = _rms_norm(x, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        up = h @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1.0 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    if last_only:
        x = x[-1:]
    x = _rms_norm(x, w["model.norm.weight"], c.rms_norm_eps)
    head = w["model.embed_tokens.weight"] if c.tie_word_embeddings else w["lm_head.weight"]
    return np.asarray(x @ head.T)


def reference_logits(model: LoadedModel, ids: Sequence[int], *, dtype: Any = np.float64) -> np.ndarray:
    """float32 logits ``[len(ids), vocab]`` of a prefill of ``ids`` at positions 0..len-1."""
    return reference_forward(model, ids, dtype=dtype).astype(np.float32)


def reference_greedy(model: LoadedModel, ids: Sequence[int], n: int, *, dtype: Any = np.float64,
                     stop_at_eos: bool = False) -> list[int]:
    """The ``n`` tokens greedy decoding generates after ``ids`` (argmax each step, KV cached).

    With ``stop_at_eos`` it stops after the first of ``config.eos_token_ids``.
    """
    if n < 0:
        raise ValueError(f"reference_greedy: n must be >= 0, got {n}")
    cache = ReferenceCache(model.config.num_layers)
    out: list[int] = []
    step = list(ids)
    for _ in range(n):
        logits = reference_forward(model, step, cache, dtype=dtype, last_only=True)
        nxt = int(np.argmax(logits[-1]))
        out.append(nxt)
        if stop_at_eos and nxt in model.config.eos_token_ids:
            break
        step = [nxt]
    return out
