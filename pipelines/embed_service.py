"""The batched service path: :class:`EmbeddingService`, embeddings for many concurrent callers (a server).

Each sentence is tokenized on arrival (:mod:`hetero.pipelines.embed_tokens`) and becomes one
item of a :class:`hetero.Batcher` over :func:`~hetero.pipelines.embed_graph.service_graph`
(``ids -> pack -> ... -> pool -> rows``), whose cost is padded tokens; a formed batch runs
packed into one of the shapes of :mod:`hetero.pipelines.embed_shapes`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

import hetero
from hetero.lowlevel import check_positive_int

from .embed_graph import service_graph
from .embed_placement import offers_cpu
from .embed_shapes import length_bucket, service_examples
from .embed_tokens import TokenGroups, token_ids
from .embed_weights import get_model
from .minilm import Model

__all__ = ["EmbeddingService"]


class EmbeddingService:
    """Embeddings for many concurrent callers: each sentence is one item of a :class:`hetero.Batcher`.

    The batcher's cost is tokens, padded as text-embeddings-inference counts them, with
    the padded length bucketed: a batch of ``n`` sentences whose longest has ``L``
    tokens (``[CLS]`` and ``[SEP]`` included) costs ``length_bucket(L) * n``, at most
    ``max_batch_tokens``. A formed batch runs as one packed run (:func:`pack_bucketed`):
    its sentences' tokens one after another, attention within each sentence, so the GPU
    encodes the sentences' own tokens whatever their mix of lengths (no sorting or
    splitting needed). The packed shape is bucketed (tokens by :func:`token_bucket`,
    sentences by :func:`row_bucket`; padding tokens and empty rows dropped), so its
    captured GPU stages replay; :meth:`warmup` captures every such shape
    (:func:`service_shapes`) unless ``precapture=False``. Packing never changes a
    sentence's embedding (each token attends to its own sentence's tokens only, everything
    else is per token). ``max_in_flight`` batches run at once, so the next one is packed
    while the GPU encodes this one. ``cpu``: the graph carries the stages' CPU
    implementations (see :func:`~hetero.pipelines.embed.embed`); by default as
    :func:`~hetero.pipelines.embed_placement.offers_cpu` answers for ``runtime``.

    ``normalize_embeddings`` (default True): embeddings have unit length whatever the model,
    as a server's clients expect (OpenAI's embeddings are unit vectors, and
    text-embeddings-inference normalises unless told not to); ``False`` leaves it to the
    model's ``modules.json``, as :func:`~hetero.pipelines.embed.embed` does.
    ``on_warmup(done, total)``: called as :meth:`warmup` runs its shapes (a server's progress).
    """

    def __init__(self, runtime: hetero.Runtime, model: Model | str | os.PathLike[str] = "minilm", *,
                 int8: bool = False, max_batch_tokens: int = 16384, max_batch_size: int | None = None,
                 max_queued: int = 4096, max_in_flight: int = 2, max_wait: float = 0.0,
                 on_batch: Callable[[int, int], None] | None = None,
                 on_batch_done: Callable[[int, float, float], None] | None = None, cpu: bool | None = None,
                 normalize_embeddings: bool = True, on_warmup: Callable[[int, int], None] | None = None) -> None:
        self.model = get_model(model)
        self.int8 = bool(int8)
        longest = self.model.config.max_seq_length
        self.max_batch_tokens = check_positive_int("max_batch_tokens", max_batch_tokens, minimum=longest,
                                                   rule=f"an integer >= the model's max_seq_length ({longest})")
        self.max_batch_size = max_batch_size or max(1, max_batch_tokens // 2)
        self.runtime = runtime
        if cpu is None:  # the runtime's answer: this opens its device (once, at start-up)
            cpu = offers_cpu(runtime)
        self.normalize_embeddings = bool(normalize_embeddings)
        self.graph = service_graph(self.model, self.int8, max_batch_tokens, cpu=cpu,
                                   normalize=self.normalize_embeddings)
        self.batcher = runtime.batcher(
            self.graph, max_batch_size=self.max_batch_size, max_wait=max_wait,
            cost=functools.partial(_bucketed_tokens, longest), max_cost=max_batch_tokens, max_queued=max_queued,
            max_in_flight=max_in_flight, on_batch=on_batch, on_batch_done=on_batch_done)
        self._filler = np.asarray(self.model.tokenizer.encode("").ids, np.int32)  # the shortest sentence
        self._tokenize = TokenGroups(self.model)
        self._on_warmup = on_warmup

    def _examples(self) -> dict[tuple[int, int], tuple[int, int]]:
        return self.examples_for(self.model, self.max_batch_tokens, self.max_batch_size, len(self._filler))

    @staticmethod
    def examples_for(model: Model, max_batch_tokens: int, max_batch_size: int | None = None,
                     shortest: int | None = None) -> dict[tuple[int, int], tuple[int, int]]:
        """:func:`service_examples` of a service of ``model`` with these limits (before one exists:
        e.g. to size a runtime's capture cache); its shortest sentence is the empty one, whose
        token count ``shortest`` is, when the caller has it."""
        if shortest is None:
            shortest = len(model.tokenizer.encode("").ids)
        return service_examples(model.config.max_seq_length, max_batch_tokens, max_batch_size, max(1, shortest))

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """The ``(tokens, sentences)`` shapes batches are packed to (:func:`service_shapes`)."""
        return sorted(self._examples())

    def tokenize(self, texts: Sequence[str]) -> list[np.ndarray]:
        """:func:`token_ids` of ``texts`` with this service's model."""
        return token_ids(self.model, texts)

    async def atokenize(self, texts: Sequence[str]) -> list[np.ndarray]:
        """:func:`token_ids` of ``texts`` with this service's model, from the event loop: concurrent
        callers' texts are tokenized together (:class:`TokenGroups`)."""
        return await self._tokenize(texts)

    async def embed_ids(self, ids: Sequence[np.ndarray]) -> np.ndarray:
        """Embeddings ``[len(ids), hidden]`` of tokenized sentences, each one item of the batcher."""
        if len(ids) == 1:
            return (await self.batcher(ids=ids[0]))[None, :]
        rows = await self.batcher.gather([{"ids": x} for x in ids])
        if not rows:
            return np.zeros((0, self.model.dim), np.float32)
        return np.stack(rows)

    def submit_each(self, ids: Sequence[np.ndarray],
                    on_row: Callable[[int, np.ndarray | None, BaseException | None], None]) -> None:
        """Each tokenized sentence as one item of the batcher, without waiting, from the event loop.

        ``on_row(i, row, None)`` once sentence ``i`` is embedded (``row``: ``[hidden]``, copied out
        of the batch's output), or ``on_row(i, None, error)`` if its batch failed. Admission is all or none, and
        a full queue raises :class:`hetero.OverloadedError` at once (:meth:`hetero.Batcher.submit`).
        A server answering many requests from one task submits them together this way.
        """
        if len(ids):
            self.batcher.submit([{"ids": x} for x in ids], on_row)

    async def aembed(self, texts: Sequence[str]) -> np.ndarray:
        """Embeddings of ``texts`` ``[len(texts), hidden]``, in order, through the batcher."""
        return await self.embed_ids(await self.atokenize(texts))

    async def warmup(self, precapture: bool = True) -> int:
        """Compile the graph's kernels, upload the weights and capture every packed shape.

        With ``precapture`` (the default) one batch of each of :attr:`shapes` runs (made of
        the empty sentence, some repeated to length), so that served batches replay captured stages from
        the first request on; else one sentence. Stages the runtime places on the CPU
        (``Runtime(placement=...)``) have nothing to capture. The ``on_warmup(done, total)``
        hook is called on the event loop once the kernels are compiled (``done`` 0) and after
        each shape's batch ran. Returns the shapes run.
        """
        await self.runtime.warmup(self.graph)
        filler = self._filler
        examples = list(self._examples().values()) if precapture else [(len(filler), 1)]
        progress = self._on_warmup
        if progress is not None:
            progress(0, len(examples))
        for done, (total, rows) in enumerate(examples, 1):
            # rows sentences of `total` tokens in all: the shortest sentence in every row, the
            # rest spread over as few rows as the longest sentence (max_seq_length) allows
            lens = [len(filler)] * rows
            extra, longest, i = total - len(filler) * rows, self.model.config.max_seq_length, 0
            while extra > 0:
                add = min(extra, longest - lens[i])
                lens[i] += add
                extra -= add
                i += 1
            await self.runtime.run(self.graph, ids=[np.resize(filler, n) for n in lens])
            if progress is not None:
                progress(done, len(examples))
        return len(examples)

    async def aclose(self) -> None:
        """Let queued and running batches finish; take no more."""
        await self.batcher.aclose()


def _bucketed_tokens(max_len: int, inputs: Mapping[str, Any]) -> int:
    return length_bucket(len(inputs["ids"]), max_len)
