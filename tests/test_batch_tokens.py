"""Batches capped by padded tokens: memory stays bounded for any batch size."""

from __future__ import annotations

from pathlib import Path

import anyio
import numpy as np
import pytest

import hetero
from hetero import _cli
from hetero.pipelines.embed import batch_chunks, embed, embed_batches
from hetero.pipelines.embed_weights import get_model
from hetero.pipelines.testing import write_random_model

TINY = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            max_position_embeddings=40, max_seq_length=24)
# Long lines (truncated at 24 tokens) and short ones (at most their characters + 2 tokens).
LONG = ["word " * 30 + str(i) for i in range(6)]
SHORT = ["hi", "a b", "ok"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_model(tmp_path_factory.mktemp("m"), seed=7, **TINY)


def test_batch_chunks_cap_padded_tokens() -> None:
    texts = SHORT + LONG
    chunks = batch_chunks(texts, 100000, 48, 24)
    # Longest first: six long lines two to a batch (2 x 24 = 48 tokens), then the short ones
    # together (3 x min(24, 3 + 2) = 15 tokens).
    assert [len(c) for c in chunks] == [2, 2, 2, 3]
    assert sorted(int(i) for c in chunks for i in c) == list(range(len(texts)))
    assert all(int(i) >= len(SHORT) for c in chunks[:3] for i in c)
    assert [len(c) for c in batch_chunks(texts, 2, None, 24)] == [2, 2, 2, 2, 1]  # no cap: batch_size only
    assert [len(c) for c in batch_chunks(LONG, 100000, 10, 24)] == [1] * 6  # a batch of one may exceed it
    with pytest.raises(ValueError, match="max_batch_tokens must be an integer >= 1, got 0"):
        embed(["x"], max_batch_tokens=0)


def test_embed_batches_splits_a_huge_batch_size(model_dir: Path) -> None:
    texts = SHORT + LONG

    async def shapes() -> list[tuple[int, ...]]:
        with hetero.Runtime(cpu_threads=2) as rt:
            return [emb.shape async for _, emb in embed_batches(texts, model=str(model_dir), batch_size=100000,
                                                                 runtime=rt, max_batch_tokens=48)]

    assert anyio.run(shapes) == [(2, 32), (2, 32), (2, 32), (3, 32)]


def test_hetero_embed_caps_batches_by_tokens(tmp_path: Path, model_dir: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "in.txt"
    src.write_text("\n".join(SHORT + LONG) + "\n", encoding="utf-8")
    outs = []
    for extra in (["--batch-size", "100000", "--max-batch-tokens", "48"], ["--batch-size", "1"]):
        out = tmp_path / f"out{len(outs)}.npy"
        assert _cli.main(["embed", "--model", str(model_dir), "--input", str(src), "--output", str(out),
                          "--no-progress", *extra]) == 0
        outs.append(np.load(out))
    capsys.readouterr()
    assert outs[0].shape == (9, 32)
    np.testing.assert_allclose(outs[0], outs[1], atol=1e-5)
    with hetero.Runtime(cpu_threads=2) as rt:
        want = embed(SHORT + LONG, model=get_model(str(model_dir)), runtime=rt)
    np.testing.assert_allclose(outs[0], want, atol=1e-5)
