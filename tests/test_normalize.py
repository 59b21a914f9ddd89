"""``normalize_embeddings`` as in sentence-transformers: the model's modules.json decides whether its
Normalize module applies; a caller may normalise a model without one.

Three tiny random model directories of the same weights: one whose modules.json lists a Normalize
module (as all-MiniLM-L6-v2's does), one whose modules.json does not, and a plain Hugging Face
directory with no modules.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import hetero
from hetero.pipelines import Encoder
from hetero.pipelines.embed import EmbeddingService, aembed, embed
from hetero.pipelines.embed_graph import (embedding_graph, mean_pool_l2_cpu, mean_pool_l2_packed_cpu,
                                          service_graph)
from hetero.pipelines.minilm import Model, ModelConfigError, load_model
from hetero.pipelines.testing import write_random_model
from tests.test_embed import SENTENCES, TINY, reference

TEXTS = SENTENCES[:5]
ATOL = 2e-5


def _modules(d: Path, modules: object) -> None:
    (d / "modules.json").write_text(json.dumps(modules), encoding="utf-8")


TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
POOLING = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("normalize")
    out = {name: write_random_model(root / name, seed=1, scale=0.3, **TINY) for name in ("unit", "raw")}
    _modules(out["raw"], [TRANSFORMER, POOLING])  # sentence-transformers' model, without its Normalize module
    out["plain"] = write_random_model(root / "plain", seed=1, scale=0.3, sentence_transformers=False, **TINY)
    return out


@pytest.fixture(scope="module")
def unit(dirs: dict[str, Path]) -> Model:
    return load_model(dirs["unit"])


@pytest.fixture(scope="module")
def raw(dirs: dict[str, Path]) -> Model:
    return load_model(dirs["raw"])


def norms(a: np.ndarray) -> np.ndarray:
    return np.linalg.norm(a, axis=1)


def test_modules_json_decides_whether_the_model_normalises(dirs: dict[str, Path], unit: Model, raw: Model) -> None:
    assert unit.normalize and not raw.normalize
    assert not load_model(dirs["plain"]).normalize  # no modules.json: Transformer + mean Pooling only


@pytest.mark.parametrize("modules, message", [
    ([TRANSFORMER, POOLING, {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}],
     "modules.json: module 'sentence_transformers.models.Dense' (path '2_Dense') is not supported; only "
     "Transformer, Pooling, Normalize modules run here"),
    ([POOLING, TRANSFORMER],
     "modules.json: expected Transformer, Pooling, then optionally Normalize, got Pooling, Transformer"),
    ({"0": TRANSFORMER},
     'modules.json: expected a JSON list of modules, each an object with a "type" string'),
])
def test_modules_this_pipeline_cannot_run_are_refused(tmp_path: Path, modules: object, message: str) -> None:
    d = write_random_model(tmp_path / "m", seed=1, **TINY)
    _modules(d, modules)
    with pytest.raises(ModelConfigError) as e:
        load_model(d)
    assert str(e.value) == message


def test_pooling_twins_leave_vectors_raw_unless_told() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    mask = np.array([[1, 1, 0], [1, 0, 0]], np.int32)
    mean = np.stack([x[0, :2].mean(0), x[1, 0]])
    np.testing.assert_allclose(mean_pool_l2_cpu(x, mask, normalize=False), mean, atol=1e-6)
    np.testing.assert_allclose(mean_pool_l2_cpu(x, mask), mean / norms(mean)[:, None], atol=1e-6)
    bounds = np.array([[0, 2], [3, 4]], np.int32)
    flat = x.reshape(1, 6, 4)
    spans = np.stack([flat[0, 0:2].mean(0), flat[0, 3]])
    np.testing.assert_allclose(mean_pool_l2_packed_cpu(flat, bounds, normalize=False), spans, atol=1e-6)
    np.testing.assert_allclose(mean_pool_l2_packed_cpu(flat, bounds), spans / norms(spans)[:, None], atol=1e-6)


@pytest.mark.parametrize("where", ["gpu", "cpu"])
def test_embed_gives_raw_pooled_vectors_for_a_model_without_normalize(raw: Model, where: str) -> None:
    """On the GPU-only graph, and on the graph with CPU twins placed on the CPU."""
    with hetero.Runtime(cpu_threads=1, placement=where) as rt:
        got = embed(TEXTS, model=raw, runtime=rt, batch_size=2, cpu=where == "cpu")
        pools = [st for st in rt.stats().stages if st.name in ("pool", "encoder1")]
        assert [st.kind if st.placement is None else st.device for st in pools] == [where]
        unit_rows = embed(TEXTS, model=raw, runtime=rt, batch_size=2, cpu=where == "cpu", normalize_embeddings=True)
    want = reference(raw, TEXTS, normalize=False)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=1e-4)
    assert np.abs(norms(got) - 1).min() > 0.01  # raw: not unit length
    np.testing.assert_allclose(unit_rows, reference(raw, TEXTS), atol=ATOL)
    np.testing.assert_allclose(norms(unit_rows), 1.0, atol=1e-5)


def test_a_model_with_normalize_gives_unit_vectors_either_way(shared_rt: hetero.Runtime, unit: Model,
                                                              raw: Model) -> None:
    plain = embed(TEXTS, model=unit, runtime=shared_rt, normalize_embeddings=False)
    np.testing.assert_allclose(norms(plain), 1.0, atol=1e-5)
    assert np.array_equal(plain, embed(TEXTS, model=unit, runtime=shared_rt, normalize_embeddings=True))
    # One graph either way: the Normalize module already does it. The same weights without the
    # module give the same direction.
    assert embedding_graph(unit, normalize=True) is embedding_graph(unit)
    assert embedding_graph(raw, normalize=True).name == "embed-norm"
    assert embedding_graph(raw).name == "embed"
    np.testing.assert_allclose(plain, embed(TEXTS, model=raw, runtime=shared_rt, normalize_embeddings=True),
                               atol=1e-6)


def test_int8_graph_follows_the_model_too(shared_rt: hetero.Runtime, raw: Model) -> None:
    got = embed(TEXTS, model=raw, runtime=shared_rt, int8=True)
    assert np.abs(norms(got) - 1).min() > 0.01
    unit_rows = embed(TEXTS, model=raw, runtime=shared_rt, int8=True, normalize_embeddings=True)
    np.testing.assert_allclose(unit_rows, got / norms(got)[:, None], atol=1e-5)


def test_encoder_encode_as_sentence_transformers(shared_rt: hetero.Runtime, dirs: dict[str, Path]) -> None:
    enc = Encoder(dirs["raw"], runtime=shared_rt)
    want = reference(enc.model, TEXTS, normalize=False)
    np.testing.assert_allclose(enc.encode(TEXTS), want, atol=ATOL, rtol=1e-4)  # sentence-transformers' default
    np.testing.assert_allclose(enc.encode(TEXTS, normalize_embeddings=False), want, atol=ATOL, rtol=1e-4)
    np.testing.assert_allclose(enc.encode(TEXTS[1], normalize_embeddings=False), want[1], atol=ATOL, rtol=1e-4)
    np.testing.assert_allclose(enc.encode(TEXTS, normalize_embeddings=True), reference(enc.model, TEXTS), atol=ATOL)
    with_module = Encoder(dirs["unit"], runtime=shared_rt).encode(TEXTS, normalize_embeddings=False)
    np.testing.assert_allclose(norms(with_module), 1.0, atol=1e-5)


@pytest.mark.anyio
async def test_aencode_and_aembed_too(shared_rt: hetero.Runtime, dirs: dict[str, Path], raw: Model) -> None:
    enc = Encoder(dirs["raw"], runtime=shared_rt)
    want = reference(raw, TEXTS, normalize=False)
    np.testing.assert_allclose(await enc.aencode(TEXTS), want, atol=ATOL, rtol=1e-4)
    np.testing.assert_allclose(norms(await enc.aencode(TEXTS, normalize_embeddings=True)), 1.0, atol=1e-5)
    np.testing.assert_allclose(await aembed(TEXTS, model=raw, runtime=shared_rt), want, atol=ATOL, rtol=1e-4)


@pytest.mark.anyio
async def test_the_service_normalises_unless_told_not_to(raw: Model) -> None:
    """A server's path: unit vectors for any model (what OpenAI clients expect), unless told otherwise."""
    async with hetero.Runtime(cpu_threads=1, placement="gpu") as rt:
        service = EmbeddingService(rt, raw, max_batch_tokens=64, cpu=False)
        try:
            assert service.graph is service_graph(raw, max_batch_tokens=64, cpu=False, normalize=True)
            got = await service.aembed(TEXTS)
        finally:
            await service.aclose()
        np.testing.assert_allclose(got, reference(raw, TEXTS), atol=ATOL)
        service = EmbeddingService(rt, raw, max_batch_tokens=64, cpu=False, normalize_embeddings=False)
        try:
            got = await service.aembed(TEXTS)
        finally:
            await service.aclose()
        np.testing.assert_allclose(got, reference(raw, TEXTS, normalize=False), atol=ATOL, rtol=1e-4)


def test_hetero_embed_follows_the_model_and_normalize(tmp_path: Path, dirs: dict[str, Path], raw: Model,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from hetero import _cli

    src = tmp_path / "in.txt"
    src.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    got = {}
    for flag in ([], ["--normalize"]):
        out = tmp_path / f"out{len(flag)}.npy"
        assert _cli.main(["embed", "--model", str(dirs["raw"]), "--input", str(src), "--output", str(out),
                          "--no-progress", *flag]) == 0
        got[bool(flag)] = np.load(out)
    capsys.readouterr()
    np.testing.assert_allclose(got[False], reference(raw, TEXTS, normalize=False), atol=ATOL, rtol=1e-4)
    np.testing.assert_allclose(got[True], reference(raw, TEXTS), atol=ATOL)
