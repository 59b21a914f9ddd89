"""The paged KV cache's block manager (host side, pure Python; no GPU).

As in vLLM's PagedAttention, the keys and values of every sequence live in one pool of
fixed-size blocks (``block_size`` token positions each, every layer's K and V for them).
A sequence holds a :class:`BlockTable`: the pool blocks of its positions in order, so
position ``p`` is slot ``p % block_size`` of block ``table.blocks[p // block_size]``.
Blocks are taken one at a time as tokens are appended and all return to the pool at
once when the sequence is freed. Any free block serves any sequence, so sequences of
mixed lengths share the pool without fragmenting it: a sequence holds at most
``ceil(tokens / block_size)`` blocks, never a ``max_seq_len`` buffer.

Sizing: :func:`kv_pool_size` turns a byte budget into a number of blocks for a model's
shape; :func:`default_kv_cache_bytes` is the default budget from the adapter's figures.
A request that does not fit raises :class:`KVCacheFullError` (an
:class:`~hetero.errors.OutOfMemoryError`) naming the numbers, and allocates nothing.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import Any

from hetero.errors import OutOfMemoryError

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "KV_CACHE_SHARE",
    "BlockPool",
    "BlockTable",
    "KVCacheFullError",
    "PoolStats",
    "default_kv_cache_bytes",
    "kv_block_bytes",
    "kv_pool_size",
]

DEFAULT_BLOCK_SIZE = 16  # token positions per block (vLLM's default)
KV_CACHE_SHARE = 0.25  # of the adapter's memory figure, for the default KV budget


class KVCacheFullError(OutOfMemoryError):
    """The KV pool has too few free blocks for a request (or too few blocks at all).

    ``needed`` blocks were asked for, ``free`` were free, out of ``total``.
    """

    def __init__(self, message: str, needed: int = 0, free: int = 0, total: int = 0) -> None:
        super().__init__(message)
        self.needed = needed
        self.free = free
        self.total = total

    def _init_args(self) -> tuple[Any, ...]:
        return (*self.args, self.needed, self.free, self.total)


@dataclass(frozen=True)
class PoolStats:
    """A snapshot of a :class:`BlockPool`: blocks used and free, sequences and tokens held."""

    num_blocks: int
    block_size: int
    used_blocks: int
    free_blocks: int
    sequences: int
    tokens: int

    @property
    def utilization(self) -> float:
        """Token slots written over slots held (1.0 when every held block is full)."""
        held = self.used_blocks * self.block_size
        return self.tokens / held if held else 1.0


class BlockTable:
    """One sequence's blocks, in position order, and how many token positions it holds.

    Read it, grow it through its pool (:meth:`BlockPool.append`). ``blocks`` is a tuple
    snapshot of the block ids; ``num_tokens`` positions are in use, ``capacity`` are held.
    """

    def __init__(self, seq: Hashable, block_size: int) -> None:
        self.seq = seq
        self.block_size = block_size
        self.block_ids: list[int] = []
        self.num_tokens = 0

    @property
    def blocks(self) -> tuple[int, ...]:
        """The pool block ids of this sequence's positions, in order."""
        return tuple(self.block_ids)

    @property
    def capacity(self) -> int:
        """Token positions the held blocks can store."""
        return len(self.block_ids) * self.block_size

    def slot(self, position: int) -> int:
        """The pool slot of ``position``: ``block * block_size + position % block_size``."""
        if not 0 <= position < self.num_tokens:
            raise IndexError(f"position {position} is out of range for a sequence of {self.num_tokens} tokens")
        return self.block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def slots(self, start: int = 0, stop: int | None = None) -> list[int]:
        """The pool slots of positions ``start .. stop - 1`` (default: all of them)."""
        stop = self.num_tokens if stop is None else stop
        return [self.slot(p) for p in range(start, stop)]

    def blocks_for(self, extra_tokens: int) -> int:
        """New blocks that ``extra_tokens`` more positions would take."""
        need = -(-(self.num_tokens + extra_tokens) // self.block_size)
        return max(0, need - len(self.block_ids))

    def __len__(self) -> int:
        return self.num_tokens

    def __repr__(self) -> str:
        return f"BlockTable(seq={self.seq!r}, tokens={self.num_tokens}, blocks={self.block_ids})"


class BlockPool:
    """A pool of ``num_blocks`` KV blocks of ``block_size`` positions, and a table per sequence.

    Sequences are keyed by any hashable id. :meth:`append` grows a sequence (creating its
    table on first use) and takes blocks only when its last block is full; :meth:`free`
    returns all of a sequence's blocks at once. Not thread-safe: one scheduler owns it.
    """

    def __init__(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        for name, v in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"BlockPool: {name} must be an integer >= 1, got {v!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Free blocks as a stack, lowest id on top: a fresh pool hands out 0, 1, 2, ...
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[Hashable, BlockTable] = {}

    @property
    def num_free(self) -> int:
        """Blocks free now."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks held by sequences."""
        return self.num_blocks - len(self._free)

    @property
    def capacity_tokens(self) -> int:
        """Token positions the whole pool stores."""
        return self.num_blocks * self.block_size

    def stats(self) -> PoolStats:
        """Blocks used and free, sequences and tokens held, now."""
        return PoolStats(self.num_blocks, self.block_size, self.num_used, self.num_free, len(self._tables),
                         sum(t.num_tokens for t in self._tables.values()))

    def blocks_needed(self, n_tokens: int, seq: Hashable | None = None) -> int:
        """Blocks that ``n_tokens`` more positions take: for sequence ``seq`` (filling its last
        block first), or for a new sequence when ``seq`` is None or unknown."""
        if n_tokens < 0:
            raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
        table = self._tables.get(seq) if seq is not None else None
        if table is None:
            return -(-n_tokens // self.block_size)
        return table.blocks_for(n_tokens)

    def can_fit(self, n_tokens: int, seq: Hashable | None = None) -> bool:
        """Whether ``n_tokens`` more positions (of ``seq``, or of a new sequence) fit in the free blocks."""
        return self.blocks_needed(n_tokens, seq) <= len(self._free)

    def could_ever_fit(self, n_tokens: int) -> bool:
        """Whether a sequence of ``n_tokens`` positions fits in the pool when it is empty."""
        return -(-n_tokens // self.block_size) <= self.num_blocks

    def append(self, seq: Hashable, n_tokens: int = 1) -> BlockTable:
        """Grow ``seq`` by ``n_tokens`` positions (its table is made on first use); its table.

        All or nothing: when the free blocks are too few it raises :class:`KVCacheFullError`
        and takes none (a new sequence is then not registered).
        """
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 0:
            raise ValueError(f"append: n_tokens must be an integer >= 0, got {n_tokens!r}")
        table = self._tables.get(seq)
        fresh = table is None
        if table is None:
            table = BlockTable(seq, self.block_size)
        need = table.blocks_for(n_tokens)
        if need > len(self._free):
            total_tokens = table.num_tokens + n_tokens
            if -(-total_tokens // self.block_size) > self.num_blocks:
                raise KVCacheFullError(
                    f"kv cache: sequence {seq!r} of {total_tokens} tokens needs "
                    f"{-(-total_tokens // self.block_size)} blocks of {self.block_size}, more than the pool's "
                    f"{self.num_blocks} blocks ({self.capacity_tokens} tokens); raise kv_cache_bytes or shorten "
                    "the request", need, len(self._free), self.num_blocks)
            raise KVCacheFullError(
                f"kv cache: {n_tokens} more tokens of sequence {seq!r} need {need} blocks, only "
                f"{len(self._free)} of {self.num_blocks} are free; free a sequence or wait", need, len(self._free),
                self.num_blocks)
        for _ in range(need):
            table.block_ids.append(self._free.pop())
        table.num_tokens += n_tokens
        if fresh:
            self._tables[seq] = table
        return table

    def table(self, seq: Hashable) -> BlockTable:
        """The table of ``seq``."""
        try:
            return self._tables[seq]
        except KeyError:
            raise KeyError(f"kv cache: no sequence {seq!r} in the pool") from None

    def free(self, seq: Hashable) -> int:
        """Return every block of ``seq`` to the pool at once; how many blocks came back."""
        table = self._tables.pop(seq, None)
        if table is None:
            raise KeyError(f"kv cache: no sequence {seq!r} in the pool")
        # Pushed in reverse so the sequence's first block is reused first.
        self._free.extend(reversed(table.block_ids))
        n = len(table.block_ids)
        table.block_ids.clear()
        table.num_tokens = 0
        return n

    def free_all(self) -> int:
        """Free every sequence; how many blocks came back."""
        return sum(self.free(s) for s in list(self._tables))

    def __contains__(self, seq: object) -> bool:
        return seq in self._tables

    def __len__(self) -> int:
        return len(self._tables)

    def __iter__(self) -> Iterator[Hashable]:
        return iter(list(self._tables))

    def __repr__(self) -> str:
        return (f"BlockPool(num_blocks={self.num_blocks}, block_size={self.block_size}, used={self.num_used}, "
                f"sequences={len(self._tables)})")


def _kv_shape(config: Any) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a LlamaConfig-like object."""
    try:
        return int(config.num_layers), int(config.num_kv_heads), int(config.head_dim)
    except AttributeError as e:
        raise TypeError(f"kv cache: config must have num_layers, num_kv_heads and head_dim ({e})") from None


def kv_block_bytes(config: Any, block_size: int = DEFAULT_BLOCK_SIZE, dtype_bytes: int = 4) -> int:
    """Bytes one block takes: K and V of every layer for ``block_size`` positions."""
    layers, kv_heads, head_dim = _kv_shape(config)
    return 2 * layers * kv_heads * head_dim * block_size * dtype_bytes


def kv_pool_size(config: Any, kv_cache_bytes: int, dtype_bytes: int = 4, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """How many blocks a budget of ``kv_cache_bytes`` holds for ``config``'s shape (at least one, or an error)."""
    if isinstance(kv_cache_bytes, bool) or not isinstance(kv_cache_bytes, int) or kv_cache_bytes < 1:
        raise ValueError(f"kv_cache_bytes must be a positive integer, got {kv_cache_bytes!r}")
    if dtype_bytes not in (2, 4):
        raise ValueError(f"dtype_bytes must be 2 (f16) or 4 (f32), got {dtype_bytes!r}")
    per_block = kv_block_bytes(config, block_size, dtype_bytes)
    n = kv_cache_bytes // per_block
    if n < 1:
        raise KVCacheFullError(f"kv cache: kv_cache_bytes {kv_cache_bytes} is less than one block of {block_size} "
                               f"tokens ({per_block} bytes for this model); raise kv_cache_bytes", 1, 0, 0)
    return n


def default_kv_cache_bytes(memory_bytes: int, max_buffer_size: int | None = None, buffers: int = 1) -> int:
    """The default KV budget: ``KV_CACHE_SHARE`` (a quarter) of the adapter's memory figure.

    ``memory_bytes`` is what the adapter reports or the runtime's memory budget. When the
    pool lives in ``buffers`` device buffers (e.g. one per layer's K and V), each at most
    ``max_buffer_size`` bytes (the adapter's limit), the budget is capped at their total.
    A quarter leaves the weights and the activations room on a device shared with other work.
    """
    if isinstance(memory_bytes, bool) or not isinstance(memory_bytes, int) or memory_bytes < 1:
        raise ValueError(f"memory_bytes must be a positive integer, got {memory_bytes!r}")
    budget = int(memory_bytes * KV_CACHE_SHARE)
    if max_buffer_size is not None:
        if max_buffer_size < 1 or buffers < 1:
            raise ValueError(f"max_buffer_size and buffers must be >= 1, got {max_buffer_size!r} and {buffers!r}")
        budget = min(budget, max_buffer_size * buffers)
    return budget
