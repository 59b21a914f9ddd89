"""The paged KV block manager: allocation on demand, freeing, fitting, sizing (pure Python)."""

from __future__ import annotations

import pickle
import random
from dataclasses import dataclass

import pytest

from hetero.errors import HeteroError, OutOfMemoryError
from hetero.pipelines.kv_cache import (
    DEFAULT_BLOCK_SIZE,
    BlockPool,
    KVCacheFullError,
    default_kv_cache_bytes,
    kv_block_bytes,
    kv_pool_size,
)


@dataclass(frozen=True)
class Shape:
    num_layers: int
    num_kv_heads: int
    head_dim: int


SMOLLM2 = Shape(num_layers=30, num_kv_heads=3, head_dim=64)


def test_fresh_pool_hands_out_blocks_in_order():
    pool = BlockPool(8, block_size=4)
    t = pool.append("a", 5)
    assert t.blocks == (0, 1) and t.num_tokens == 5 and t.capacity == 8
    assert pool.num_used == 2 and pool.num_free == 6
    assert pool.stats().sequences == 1 and pool.stats().tokens == 5


def test_blocks_are_taken_only_when_the_last_block_is_full():
    pool = BlockPool(8, block_size=4)
    pool.append("a", 3)
    assert pool.num_used == 1
    pool.append("a")
    assert pool.num_used == 1  # 4 tokens: one full block
    pool.append("a")
    assert pool.num_used == 2 and pool.table("a").num_tokens == 5
    pool.append("a", 0)
    assert pool.num_used == 2


def test_slots_map_positions_through_the_block_table():
    pool = BlockPool(8, block_size=4)
    pool.append("a", 2)
    pool.append("b", 4)
    pool.append("a", 4)  # a: blocks 0 then 2
    t = pool.table("a")
    assert t.blocks == (0, 2)
    assert t.slots() == [0, 1, 2, 3, 8, 9]
    assert t.slot(5) == 9
    with pytest.raises(IndexError, match="position 6 is out of range for a sequence of 6 tokens"):
        t.slot(6)


def test_free_returns_every_block_at_once():
    pool = BlockPool(10, block_size=16)
    pool.append(1, 100)  # 7 blocks
    pool.append(2, 20)  # 2 blocks
    assert pool.num_free == 1
    assert pool.free(1) == 7
    assert pool.num_free == 8 and 1 not in pool and len(pool) == 1
    assert pool.free_all() == 2
    assert pool.num_free == 10 and len(pool) == 0
    with pytest.raises(KeyError, match="no sequence 1 in the pool"):
        pool.free(1)


def test_freed_blocks_serve_any_sequence():
    pool = BlockPool(4, block_size=2)
    for s in range(4):
        pool.append(s, 2)
    pool.free(1)
    pool.free(3)
    t = pool.append("new", 4)  # two non-adjacent blocks serve one sequence
    assert sorted(t.blocks) == [1, 3]


def test_request_that_does_not_fit_now_names_the_numbers_and_takes_nothing():
    pool = BlockPool(4, block_size=16)
    pool.append("a", 40)  # 3 blocks
    assert not pool.can_fit(17)
    assert pool.can_fit(16)
    assert pool.can_fit(8, "a")  # fills a's last block
    assert not pool.can_fit(9 + 16, "a")
    with pytest.raises(KVCacheFullError) as e:
        pool.append("b", 17)
    assert str(e.value) == ("kv cache: 17 more tokens of sequence 'b' need 2 blocks, only 1 of 4 are free; "
                            "free a sequence or wait")
    assert (e.value.needed, e.value.free, e.value.total) == (2, 1, 4)
    assert "b" not in pool and pool.num_free == 1
    with pytest.raises(KVCacheFullError):
        pool.append("a", 30)
    assert pool.table("a").num_tokens == 40 and pool.num_free == 1


def test_request_that_can_never_fit_says_so():
    pool = BlockPool(4, block_size=16)
    assert pool.could_ever_fit(64) and not pool.could_ever_fit(65)
    with pytest.raises(KVCacheFullError) as e:
        pool.append("long", 65)
    assert str(e.value) == ("kv cache: sequence 'long' of 65 tokens needs 5 blocks of 16, more than the pool's 4 "
                            "blocks (64 tokens); raise kv_cache_bytes or shorten the request")
    assert isinstance(e.value, OutOfMemoryError) and isinstance(e.value, HeteroError)


def test_kv_cache_full_error_pickles_with_its_numbers():
    e = KVCacheFullError("kv cache: full", 3, 1, 8)
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is KVCacheFullError and str(back) == "kv cache: full"
    assert (back.needed, back.free, back.total) == (3, 1, 8)


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_blocks must be an integer >= 1, got 0"):
        BlockPool(0)
    with pytest.raises(ValueError, match="block_size must be an integer >= 1, got True"):
        BlockPool(4, block_size=True)
    pool = BlockPool(4)
    with pytest.raises(ValueError, match="n_tokens must be an integer >= 0, got -1"):
        pool.append("a", -1)
    with pytest.raises(KeyError, match="no sequence 'x' in the pool"):
        pool.table("x")


def test_256_mixed_sequences_fit_where_max_len_buffers_would_not():
    rng = random.Random(0)
    lengths = [rng.randint(32, 2048) for _ in range(256)]
    max_seq_len = 2048
    bs = DEFAULT_BLOCK_SIZE
    budget_blocks = sum(-(-n // bs) for n in lengths)  # exactly what paging needs
    pool = BlockPool(budget_blocks, bs)
    # Per-sequence max_seq_len buffers of the same memory hold about half as many sequences.
    assert budget_blocks * bs // max_seq_len <= 0.6 * 256
    # Interleaved growth, one token (or a prompt chunk) at a time, as decoding does.
    remaining = dict(enumerate(lengths))
    while remaining:
        for s in list(remaining):
            step = min(remaining[s], rng.choice([1, 1, 1, 37]))
            pool.append(s, step)
            remaining[s] -= step
            if not remaining[s]:
                del remaining[s]
    assert len(pool) == 256 and pool.num_free == 0
    for s, n in enumerate(lengths):
        t = pool.table(s)
        assert t.num_tokens == n
        assert len(t.blocks) <= n // bs + 1
        assert len(t.blocks) == -(-n // bs)
    held = [b for s in range(256) for b in pool.table(s).blocks]
    assert len(held) == len(set(held)) == budget_blocks  # no block is shared
    assert pool.stats().utilization > 0.98
    assert pool.free_all() == budget_blocks and pool.num_free == budget_blocks


def test_churn_keeps_the_books_balanced():
    rng = random.Random(1)
    pool = BlockPool(200, block_size=16)
    live: dict[int, int] = {}
    for i in range(3000):
        if live and (rng.random() < 0.3 or not pool.can_fit(64)):
            s = rng.choice(list(live))
            assert pool.free(s) == -(-live.pop(s) // 16)
        else:
            n = rng.randint(1, 64)
            pool.append(i, n)
            live[i] = n
        assert pool.num_used == sum(-(-n // 16) for n in live.values())
    pool.free_all()
    assert pool.num_free == 200


def test_pool_sizing_from_bytes():
    per_block = kv_block_bytes(SMOLLM2)
    assert per_block == 2 * 30 * 3 * 64 * 16 * 4
    assert kv_block_bytes(SMOLLM2, dtype_bytes=2) == per_block // 2
    assert kv_pool_size(SMOLLM2, 1 << 30) == (1 << 30) // per_block
    assert kv_pool_size(SMOLLM2, per_block) == 1
    assert kv_pool_size(SMOLLM2, per_block, dtype_bytes=2) == 2
    with pytest.raises(KVCacheFullError, match=f"kv_cache_bytes 100 is less than one block of 16 tokens "
                                               f"\\({per_block} bytes for this model\\)"):
        kv_pool_size(SMOLLM2, 100)
    with pytest.raises(ValueError, match="kv_cache_bytes must be a positive integer, got 0"):
        kv_pool_size(SMOLLM2, 0)
    with pytest.raises(ValueError, match="dtype_bytes must be 2 \\(f16\\) or 4 \\(f32\\), got 3"):
        kv_pool_size(SMOLLM2, 1 << 20, dtype_bytes=3)


def test_default_budget_is_a_quarter_capped_by_buffers():
    assert default_kv_cache_bytes(8 << 30) == 2 << 30
    assert default_kv_cache_bytes(8 << 30, max_buffer_size=1 << 30) == 1 << 30
    assert default_kv_cache_bytes(8 << 30, max_buffer_size=1 << 28, buffers=60) == 2 << 30
    with pytest.raises(ValueError, match="memory_bytes must be a positive integer"):
        default_kv_cache_bytes(0)
