"""The shapes served batches take, and packing sentences into them (the service path's rules).

A served batch runs packed: its sentences' tokens one after another, no padding (attention
within each sentence, ``attention_varlen``; everything else is per token). The packed length
is bucketed (:func:`token_bucket`), and so is the sentence count (:func:`row_bucket`): every
GPU stage is captured per (tokens, sentences) bucket, so served batches map to a few hundred
shapes at most (:func:`service_shapes`), all captured at warm-up. Pure functions of numbers
and arrays: no device, no runtime.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numpy as np

from .minilm import Model

__all__ = ["LENGTH_STEP", "length_bucket", "length_buckets", "pack_bucketed", "pack_tokens", "packed_tokens",
           "row_bucket", "service_examples", "service_shapes", "token_bucket"]

# Packed lengths are multiples of LENGTH_STEP up to 4 steps, then two per octave (96, 128, 192, 256,
# 384, ...); sentence counts are powers of two up to 8, then two per octave (12, 16, 24, 32, 48, ...).
# length_bucket is the same rounding for one sentence, capped at the model's max_seq_length: the
# batcher's padded-token cost.
LENGTH_STEP = 16


def _two_per_octave(n: int, start: int) -> int:
    """The least of ``start * 2**k`` and ``start * 3 * 2**(k-1)`` (k >= 0) that is >= ``n``."""
    b = start
    while b < n:
        half = b + b // 2
        if half >= n:
            return half
        b *= 2
    return b


def token_bucket(n: int) -> int:
    """The bucketed length of ``n`` tokens (see :data:`LENGTH_STEP`)."""
    if n <= 4 * LENGTH_STEP:
        return -(-max(n, 1) // LENGTH_STEP) * LENGTH_STEP
    return _two_per_octave(n, 4 * LENGTH_STEP)


def length_bucket(longest: int, max_len: int) -> int:
    """The padded length of a batch whose longest sentence has ``longest`` tokens: :func:`token_bucket`,
    at most ``max_len``."""
    return min(token_bucket(longest), max_len)


def row_bucket(n: int) -> int:
    """The bucketed count of ``n`` sentences: ``n`` up to 2, powers of two up to 8, then two per octave."""
    return n if n <= 2 else (1 << (n - 1).bit_length() if n <= 8 else _two_per_octave(n, 8))


def length_buckets(max_len: int) -> list[int]:
    """Every padded length :func:`length_bucket` gives for a model of ``max_seq_length`` ``max_len``."""
    return sorted({length_bucket(n, max_len) for n in range(1, max_len + 1)})


def packed_tokens(total: int, max_batch_tokens: int) -> int:
    """The packed length of a batch of ``total`` tokens: :func:`token_bucket`, at most ``max_batch_tokens``
    unless ``total`` is more (a batch the batcher forms never is)."""
    b = token_bucket(total)
    return b if total > max_batch_tokens else min(b, max_batch_tokens)


def _ranges(bucket: Callable[[int], int], most: int) -> dict[int, tuple[int, int]]:
    """``{bucket(n): (least n, most n)}`` for n in 1..most."""
    out: dict[int, tuple[int, int]] = {}
    for n in range(1, most + 1):
        b = bucket(n)
        lo, _ = out.get(b, (n, n))
        out[b] = (lo, n)
    return out


def service_examples(max_len: int, max_batch_tokens: int, max_batch_size: int | None = None,
                     min_len: int = 2) -> dict[tuple[int, int], tuple[int, int]]:
    """Every ``(tokens, sentences)`` shape a served batch packs to, each with an example
    ``(total tokens, sentences)`` that packs to it.

    A batch of ``r`` sentences (at most ``max_batch_size``, default ``max_batch_tokens // 2``)
    of ``min_len`` to ``max_len`` tokens each, whose padded cost (``r`` times the
    :func:`length_bucket` of its longest) is within ``max_batch_tokens`` (or one sentence).
    """
    return dict(_service_examples(max_len, max_batch_tokens, max_batch_size, min_len))


@functools.lru_cache(maxsize=16)
def _service_examples(max_len: int, max_batch_tokens: int, max_batch_size: int | None,
                      min_len: int) -> tuple[tuple[tuple[int, int], tuple[int, int]], ...]:
    most_rows = max(1, max_batch_size if max_batch_size is not None else max_batch_tokens // 2)
    longest = length_buckets(max_len)
    tokens = _ranges(lambda t: packed_tokens(t, max_batch_tokens), max_batch_tokens)
    out: dict[tuple[int, int], tuple[int, int]] = {}
    for rows, (r_lo, r_hi) in _ranges(row_bucket, most_rows).items():
        for r in range(r_lo, r_hi + 1):
            # the most tokens r sentences hold within the budget: each at most the longest
            # length whose padded cost fits (a lone sentence: max_len)
            cap = max_len if r == 1 else max((min(b, max_len) for b in longest if b * r <= max_batch_tokens),
                                             default=0)
            if cap < min_len:
                break
            for packed, (t_lo, t_hi) in tokens.items():
                lo, hi = max(t_lo, min_len * r), min(t_hi, cap * r)
                if lo <= hi and (packed, rows) not in out:
                    out[(packed, rows)] = (lo, r)
    return tuple(out.items())


def service_shapes(max_len: int, max_batch_tokens: int, max_batch_size: int | None = None,
                   min_len: int = 2) -> list[tuple[int, int]]:
    """The ``(tokens, sentences)`` shapes of :func:`service_examples`, sorted (what the warm-up captures)."""
    return sorted(service_examples(max_len, max_batch_tokens, max_batch_size, min_len))


def pack_tokens(ids: Sequence[np.ndarray], model: Model, tokens: int | None = None, rows: int | None = None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Already tokenized sentences packed one after another, no padding between them.

    Returns int32 token ids, token types and positions ``[1, T]``, each token's sentence as
    the range ``spans[t] = [start, end)`` (``[T, 2]``, :func:`hetero.ops.attention_varlen`)
    and each sentence's range ``bounds`` (``[R, 2]``, :func:`mean_pool_l2_packed`). ``T`` is
    the total of the sentences' tokens, or ``tokens``: the tokens past the sentences' are
    padding, a sequence of their own. ``R`` is ``len(ids)``, or ``rows``: the rows past
    ``len(ids)`` are empty ranges (zero rows, dropped).
    """
    n = len(ids)
    lens = np.fromiter((len(x) for x in ids), np.int64, n)
    total = int(lens.sum())
    t = total if tokens is None else tokens
    r = n if rows is None else rows
    if t < total:
        raise ValueError(f"pack_tokens: tokens {t} is fewer than the sentences' {total}")
    if r < n:
        raise ValueError(f"pack_tokens: rows {r} is fewer than the {n} sentences")
    ends = np.cumsum(lens)
    starts = ends - lens
    start_of = np.repeat(starts, lens)  # each token's sentence's first token
    flat = np.full(t, model.config.pad_token_id, np.int32)
    if total:
        flat[:total] = np.concatenate([np.asarray(x, np.int32) for x in ids])
    pos = np.zeros(t, np.int32)
    pos[:total] = np.arange(total) - start_of
    spans = np.empty((t, 2), np.int32)
    spans[:total, 0] = start_of
    spans[:total, 1] = np.repeat(ends, lens)
    spans[total:] = (total, t)
    bounds = np.full((r, 2), total, np.int32)
    bounds[:n, 0] = starts
    bounds[:n, 1] = ends
    return flat[None, :], np.zeros((1, t), np.int32), pos[None, :], spans, bounds


def pack_bucketed(ids: Sequence[np.ndarray], model: Model,
                  max_batch_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The service path's ``pack`` stage: :func:`pack_tokens` to the batch's bucketed shape."""
    total = sum(len(x) for x in ids)
    return pack_tokens(ids, model, packed_tokens(total, max_batch_tokens), row_bucket(len(ids)))
