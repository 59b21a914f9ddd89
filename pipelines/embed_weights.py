"""The encoder's weights: the model loaded once per process, and its weights as each stage reads them.

Three forms, each made once and cached where it lives as long as what it belongs to:

* on the host for the CPU stages (:func:`cpu_weights`: the checkpoint's arrays plus Q/K/V
  stacked per layer; per model);
* float32 on a device (:func:`resident_weights`: ``gpu.resident`` buffers, never pooled,
  never released by the scheduler; in ``Model.resident``, per device, for as long as both
  the model and the device live);
* int8 on a device (:func:`resident_int8_weights`: the linear layers quantized once per model
  on the host by :func:`quantized_weights`, per output channel with ``transpose_b``, then
  uploaded like the float32 ones into ``Model.resident_int8``).

Every form stores the query, key and value projections stacked (:data:`QKV`): one matmul.
"""

from __future__ import annotations

import os
import weakref

import numpy as np

from hetero import GPUContext, Tensor
from hetero.lowlevel import device_of
from hetero.kernels.matmul_int8 import GPUWeight, QuantizedWeight, quantize_weight

from .minilm import Model, load_model

__all__ = ["LINEAR_LAYERS", "QKV", "cpu_weights", "get_model", "linear_weight", "quantized_weights",
           "resident_int8_weights", "resident_weights"]

# The encoder layers' linear projections (HF [out, in] weights): int8 with ``int8=True``.
# "attention.self.qkv" is the query, key and value projections stacked ([3*hidden, hidden]):
# one matmul, read in place by attention_packed.
QKV = "attention.self.qkv"
LINEAR_LAYERS = (QKV, "attention.output.dense", "intermediate.dense", "output.dense")
_QKV_PARTS = ("attention.self.query", "attention.self.key", "attention.self.value")

# Models loaded by get_model, by "minilm" or their directory's real path: one load per process.
_models: dict[str, Model] = {}


def get_model(model: Model | str | os.PathLike[str] = "minilm") -> Model:
    """``model`` itself, or the model loaded from a directory (or ``"minilm"``), loaded once per process."""
    if isinstance(model, Model):
        return model
    key = "minilm" if str(model) == "minilm" else os.path.realpath(model)
    m = _models.get(key)
    if m is None:
        m = _models[key] = load_model(model)
    return m


def linear_weight(model: Model, n: int, layer: str) -> tuple[np.ndarray, np.ndarray]:
    """Layer ``n``'s ``[out, in]`` weight and ``[out]`` bias of a :data:`LINEAR_LAYERS` projection."""
    p = f"encoder.layer.{n}."
    if layer == QKV:
        return (np.concatenate([model.weights[p + part + ".weight"] for part in _QKV_PARTS]),
                np.concatenate([model.weights[p + part + ".bias"] for part in _QKV_PARTS]))
    return model.weights[p + layer + ".weight"], model.weights[p + layer + ".bias"]


def resident_weights(gpu: GPUContext, model: Model) -> dict[str, Tensor]:
    """The model's weights on this stage's device: uploaded on first use, then reused.

    ``gpu.resident`` buffers, so the pool never recycles them; they live as long as the
    model and the device both do. The query, key and value projections are stored
    stacked, as ``encoder.layer.N.attention.self.qkv.weight`` / ``.bias``.
    """
    dev = device_of(gpu)
    with model.lock:
        w: dict[str, Tensor] | None = model.resident.get(dev)
        if w is None:
            w = {}
            parts = tuple(f".{part}." for part in _QKV_PARTS)
            for name, a in model.weights.items():
                if not any(x in name for x in parts):
                    w[name] = gpu.resident(a)
            for n in range(model.config.num_hidden_layers):
                weight, bias = linear_weight(model, n, QKV)
                w[f"encoder.layer.{n}.{QKV}.weight"] = gpu.resident(weight)
                w[f"encoder.layer.{n}.{QKV}.bias"] = gpu.resident(bias)
            model.resident[dev] = w
        return w


def _quantize_locked(model: Model) -> dict[str, QuantizedWeight]:
    q: dict[str, QuantizedWeight] | None = model.quantized
    if q is None:
        q = {}
        for n in range(model.config.num_hidden_layers):
            for layer in LINEAR_LAYERS:
                q[f"encoder.layer.{n}.{layer}.weight"] = quantize_weight(linear_weight(model, n, layer)[0],
                                                                         transpose_b=True)
        model.quantized = q
    return q


def quantized_weights(model: Model) -> dict[str, QuantizedWeight]:
    """The encoder's linear weights quantized to int8 (per output channel), made once per model on the host."""
    with model.lock:
        return _quantize_locked(model)


def resident_int8_weights(gpu: GPUContext, model: Model) -> dict[str, GPUWeight]:
    """The int8 linear weights on this stage's device: quantized and uploaded on first use, then reused.

    Like :func:`resident_weights`: plain wgpu buffers (packed words and padded scales as
    block-less Tensors), cached in ``model.resident_int8`` per device.
    """
    dev = device_of(gpu)
    with model.lock:
        w: dict[str, GPUWeight] | None = model.resident_int8.get(dev)
        if w is None:
            w = {}
            for name, qw in _quantize_locked(model).items():
                w[name] = GPUWeight(gpu.resident(qw.packed), gpu.resident(qw.padded_scales()), qw.k, qw.n)
            model.resident_int8[dev] = w
        return w


# The host weights the CPU stages read, per model (it holds them; they go with it).
_cpu_weights: weakref.WeakKeyDictionary[Model, dict[str, np.ndarray]] = weakref.WeakKeyDictionary()


def cpu_weights(model: Model) -> dict[str, np.ndarray]:
    """The host weights as the CPU stages read them: the checkpoint's, plus Q/K/V stacked per layer."""
    with model.lock:
        w = _cpu_weights.get(model)
        if w is None:
            w = dict(model.weights)
            for n in range(model.config.num_hidden_layers):
                weight, bias = linear_weight(model, n, QKV)
                w[f"encoder.layer.{n}.{QKV}.weight"] = weight
                w[f"encoder.layer.{n}.{QKV}.bias"] = bias
            _cpu_weights[model] = w
        return w
