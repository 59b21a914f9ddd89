"""Texts to token ids: the checks every entry point makes, and the tokenizer calls of both paths.

The bulk path (:func:`hetero.pipelines.embed.embed`) tokenizes a batch in its graph's
``tokenize`` stage (:func:`tokenize`: padded arrays); the service path tokenizes each
request on arrival (:func:`token_ids`, or :class:`TokenGroups` for many concurrent callers)
and its graph packs the ids. Both read the tokenizer through :func:`encodings`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np

import hetero

from .minilm import Model

__all__ = ["LOOP_TOKENIZE_MAX", "TokenGroups", "atoken_ids", "check_texts", "encodings", "text_list",
           "token_ids", "tokenize"]

# Requests (the service path) and embed() calls with more texts than this are tokenized on a worker
# thread, not on the event loop.
LOOP_TOKENIZE_MAX = 16


def check_texts(texts: Sequence[str]) -> None:
    """Raise :class:`hetero.InputError` naming the first text that is not valid Unicode.

    A Python str can hold a lone surrogate (``"\\ud800"``: valid JSON, and what
    ``surrogateescape`` decoding makes of bad bytes), which no tokenizer takes; the
    error names its index and position instead of the tokenizer's ``TypeError``. One
    check for every entry point: the Python API and the server.
    """
    for i, t in enumerate(texts):
        try:
            t.encode("utf-8")
        except UnicodeEncodeError as e:
            raise hetero.InputError(
                f"texts[{i}] is not valid Unicode: a lone surrogate U+{ord(t[e.start]):04X} at character "
                f"{e.start}; pass text decoded as UTF-8 (invalid bytes replaced, errors='replace')") from None


def text_list(texts: Sequence[str]) -> list[str]:
    """``texts`` as a list, each checked to be a str (a TypeError naming the first that is not) and
    valid Unicode (:func:`check_texts`): what every embedding entry point takes."""
    if isinstance(texts, str):
        raise TypeError("embed: texts must be a sequence of str, got a single str (wrap it in a list)")
    out = list(texts)
    for i, t in enumerate(out):
        if not isinstance(t, str):
            raise TypeError(f"embed: texts[{i}] must be str, got {type(t).__name__}")
    check_texts(out)
    return out


def tokenize(texts: Sequence[str], model: Model) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Token ids, token-type ids, position ids and attention mask, int32 ``[B, S]``, padded to the longest."""
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise TypeError("tokenize: texts must be a sequence of str")
    encs = encodings(model, texts)
    b = len(encs)
    if b == 1:  # a lone sentence (the latency path): no padding, four arrays of one row
        ids = np.array(encs[0].ids, np.int32)[None]
        s = ids.shape[1]
        return (ids, np.array(encs[0].type_ids, np.int32)[None], np.arange(s, dtype=np.int32)[None],
                np.ones((1, s), np.int32))
    # The model's tokenizer never pads, so every token is real: the mask follows from
    # the lengths. Flat fills keep this GIL-holding part short (0.9 ms for 128 sentences
    # on the CPU machine, against 1.9 ms row by row): GPU stages record meanwhile on
    # another thread, and wait for the GIL whenever this holds it.
    lens = np.fromiter((len(e.ids) for e in encs), np.int64, b)
    s = int(lens.max()) if b else 0
    real = np.arange(s) < lens[:, None]
    total = int(lens.sum())
    ids = np.full((b, s), model.config.pad_token_id, np.int32)
    ids[real] = np.fromiter(itertools.chain.from_iterable(e.ids for e in encs), np.int32, total)
    types = np.zeros((b, s), np.int32)
    types[real] = np.fromiter(itertools.chain.from_iterable(e.type_ids for e in encs), np.int32, total)
    pos = np.ascontiguousarray(np.broadcast_to(np.arange(s, dtype=np.int32), (b, s)))
    return ids, types, pos, real.astype(np.int32)


def encodings(model: Model, texts: Sequence[str]) -> list[Any]:
    """The tokenizer's encodings of ``texts`` (their ids and type ids are read, nothing else).
    One text is encoded on this thread: encode_batch hands even one text to the tokenizer's
    thread pool, whose wake-up is most of a lone sentence's tokenizing on a many-core host.
    Several go through ``encode_batch_fast`` where the tokenizers package has it (0.20 on):
    the same ids without character offsets, about a sixth less time per text."""
    tok = model.tokenizer
    if len(texts) == 1:
        return [tok.encode(texts[0])]
    batch = getattr(tok, "encode_batch_fast", None) or tok.encode_batch
    return batch(list(texts))


def token_ids(model: Model, texts: Sequence[str]) -> list[np.ndarray]:
    """Token ids of each text (truncated at the model's ``max_seq_length``), int32."""
    return [np.asarray(e.ids, np.int32) for e in encodings(model, text_list(texts))]


async def atoken_ids(model: Model, texts: Sequence[str]) -> list[np.ndarray]:
    """:func:`token_ids`, on a worker thread for more than :data:`LOOP_TOKENIZE_MAX` texts."""
    if len(texts) <= LOOP_TOKENIZE_MAX:
        return token_ids(model, texts)
    return await anyio.to_thread.run_sync(token_ids, model, texts)


class _Group:
    """The texts of the callers that joined one tokenizer call, and its outcome."""

    __slots__ = ("token", "texts", "done", "ids")

    def __init__(self, token: object) -> None:
        self.token = token
        self.texts: list[str] = []
        self.done = anyio.Event()
        self.ids: list[np.ndarray] | None = None  # None once done: tokenizing failed, each caller retries alone


class TokenGroups:
    """:func:`atoken_ids` for many concurrent callers: the texts of the callers that ask in the
    same pass of the event loop are tokenized in one batch call (:func:`encodings`).

    Each caller tokenizing its own request held the interpreter for the whole of its
    ``encode`` call: under 256 concurrent single-sentence callers in one process the
    event loop spent about half its time there (BENCHMARKS.md). ``encode_batch`` lets the
    interpreter go and spreads the texts over the tokenizer's threads. The first caller
    yields once so that the callers ready in the same pass join it; up to
    :data:`LOOP_TOKENIZE_MAX` texts are tokenized on the event loop, more on a worker
    thread. Each caller's texts are checked on their own (a bad one fails only its caller);
    if the joint call fails, every caller tokenizes its own texts. One instance per event
    loop's use (a caller from another loop never joins a group).
    """

    def __init__(self, model: Model) -> None:
        self.model = model
        self._open: _Group | None = None
        self.calls = 0  # tokenizer calls made (joint or not)

    async def __call__(self, texts: Sequence[str]) -> list[np.ndarray]:
        items = text_list(texts)
        if not items:
            return []
        if len(items) > LOOP_TOKENIZE_MAX:
            self.calls += 1
            return await atoken_ids(self.model, items)
        token = anyio.lowlevel.current_token()
        group = self._open
        first = group is None or group.token != token  # this caller starts a group and tokenizes it
        if group is None or first:
            group = self._open = _Group(token)
        start = len(group.texts)
        group.texts.extend(items)
        if not first:
            await group.done.wait()
        else:
            with anyio.CancelScope(shield=True):  # the others wait on this caller: it finishes the group
                try:
                    await anyio.lowlevel.checkpoint()  # the callers ready in this pass join
                finally:
                    if self._open is group:
                        self._open = None
                self.calls += 1
                try:
                    group.ids = await atoken_ids(self.model, group.texts)
                except Exception:  # noqa: BLE001 - each caller tokenizes its own texts below
                    group.ids = None
                finally:
                    group.done.set()
            await anyio.lowlevel.checkpoint_if_cancelled()
        if group.ids is None:
            self.calls += 1
            return token_ids(self.model, items)
        return group.ids[start:start + len(items)]
