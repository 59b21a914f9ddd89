"""Loading Llama-family decoders (GGUF, Hugging Face directories, SmolLM2) and the numpy reference decoder."""

from __future__ import annotations

import json
import os
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from llm_fixtures import (  # noqa: E402
    CHATML_TEMPLATE,
    CORPUS,
    expected_weights,
    gguf_permute,
    shaped_config,
    tiny_config,
    tiny_tokenizer,
    tiny_weights,
    write_safetensors,
    write_tiny_gguf,
    write_tiny_hf_dir,
)

from hetero.errors import HeteroError, InputError  # noqa: E402
from hetero.pipelines.llm_model import (  # noqa: E402
    BLOCK_BYTES,
    LlamaConfig,
    RopeScaling,
    WeightTensor,
    dequantize,
    find_smollm2,
    load_model,
    quantize_q8_0,
)
from hetero.pipelines.llm_reference import (  # noqa: E402
    ReferenceCache,
    reference_forward,
    reference_greedy,
    reference_logits,
)
from hetero.pipelines.minilm import (  # noqa: E402
    ModelConfigError,
    ModelError,
    ModelNotFoundError,
    ModelWeightsError,
)

WTYPES = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Tiny models on disk, written once per module: (arch, wtype, tied) -> .gguf path, and HF dirs."""
    d = tmp_path_factory.mktemp("llm")
    out: dict = {}
    for arch in ("llama", "qwen2"):
        for wt in WTYPES:
            out[arch, wt, False] = write_tiny_gguf(d / f"{arch}-{wt}.gguf", arch, wt)
        out[arch, "f32", True] = write_tiny_gguf(d / f"{arch}-tied.gguf", arch, "f32", tied=True)
        out[arch, "hf"] = write_tiny_hf_dir(d / f"{arch}-hf", arch)
    return out


# --- GGUF round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("wtype", WTYPES)
def test_gguf_loads_back_to_the_hf_weights(files, arch, wtype):
    m = load_model(files[arch, wtype, False])
    c = m.config
    assert (c.arch, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (arch, 2, 64, 4, 2, 16)
    assert c.attention_bias == (arch == "qwen2") and not c.tie_word_embeddings
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,)
    want = expected_weights(tiny_weights(tiny_config(arch)), wtype)
    assert set(m.weights) == set(want) == set(c.tensor_shapes())
    for name, w in m.weights.items():
        assert w.name == name and w.shape == want[name].shape
        assert w.kind == ("f32" if len(w.shape) == 1 else wtype), name
        if w.quantized:
            assert w.data.dtype == np.uint8
            assert w.data.shape == (w.shape[0], w.shape[1] // 32 * BLOCK_BYTES[wtype])
        np.testing.assert_array_equal(dequantize(w), want[name], err_msg=name)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tied_gguf_has_no_lm_head(files, arch):
    m = load_model(files[arch, "f32", True])
    assert m.config.tie_word_embeddings and "lm_head.weight" not in m.weights
    assert m.lm_head() is m.weights["model.embed_tokens.weight"]


def test_quantized_q_and_k_rows_are_unpermuted_packed(files):
    """The packed Q/K blocks come back row-unpermuted, without a dequantize/requantize."""
    from gguf import GGMLQuantizationType, GGUFReader

    m = load_model(files["llama", "q4_1", False])
    raw = {t.name: np.asarray(t.data) for t in GGUFReader(files["llama", "q4_1", False]).tensors}
    q = m.weights["model.layers.1.self_attn.q_proj.weight"]
    assert q.kind == "q4_1"
    np.testing.assert_array_equal(gguf_permute(q.data, 4), raw["blk.1.attn_q.weight"])
    k = m.weights["model.layers.0.self_attn.k_proj.weight"]
    np.testing.assert_array_equal(gguf_permute(k.data, 2), raw["blk.0.attn_k.weight"])
    assert GGMLQuantizationType.Q4_1  # the file's type, kept


def test_unpermuted_rows_give_llama_cpp_interleaved_rope_scores():
    """Attention scores of HF rotate-half RoPE on HF rows = llama.cpp's interleaved RoPE on the file's rows."""
    rng = np.random.default_rng(3)
    hd, heads = 16, 2
    wq, wk = rng.standard_normal((heads * hd, 8)), rng.standard_normal((heads * hd, 8))
    x, y = rng.standard_normal(8), rng.standard_normal(8)
    inv = 1.0 / 10000 ** (np.arange(0, hd, 2) / hd)

    def rotate_half(v, pos):  # per head, pairs (j, j + hd/2)
        v = v.reshape(heads, hd)
        a, b, c, s = v[:, :hd // 2], v[:, hd // 2:], np.cos(pos * inv), np.sin(pos * inv)
        return np.concatenate([a * c - b * s, b * c + a * s], axis=1)

    def interleaved(v, pos):  # per head, pairs (2j, 2j + 1), as llama.cpp's rope
        v = v.reshape(heads, hd // 2, 2)
        a, b, c, s = v[..., 0], v[..., 1], np.cos(pos * inv), np.sin(pos * inv)
        return np.stack([a * c - b * s, b * c + a * s], axis=-1).reshape(heads, hd)

    for m, n in [(0, 0), (3, 1), (7, 2), (40, 39)]:
        hf = (rotate_half(wq @ x, m) * rotate_half(wk @ y, n)).sum(1)
        cpp = (interleaved(gguf_permute(wq, heads) @ x, m) * interleaved(gguf_permute(wk, heads) @ y, n)).sum(1)
        np.testing.assert_allclose(hf, cpp, rtol=1e-12)
        unpermuted = (interleaved(wq @ x, m) * interleaved(wk @ y, n)).sum(1)
        if m != n:
            assert not np.allclose(hf, unpermuted)  # the permutation matters


def test_gguf_rope_freqs_tensor_is_llama3_scaling(tmp_path):
    factors = np.linspace(1.0, 8.0, 8).astype(np.float32)
    p = write_tiny_gguf(tmp_path / "a.gguf", edit=lambda w: w.add_tensor("rope_freqs.weight", factors))
    c = load_model(p).config
    assert c.rope_scaling is not None and c.rope_scaling.rope_type == "factors"
    base = 1.0 / 10000.0 ** (np.arange(0, 16, 2) / 16)
    np.testing.assert_allclose(c.rope_inv_freq(), base / factors.astype(np.float64), rtol=1e-12)


def test_gguf_and_hf_directory_give_the_same_logits(files):
    for arch in ("llama", "qwen2"):
        g = load_model(files[arch, "f32", False])
        h = load_model(files[arch, "hf"])
        ids = h.encode(CORPUS[1])
        assert g.encode(CORPUS[1]) == ids
        np.testing.assert_allclose(reference_logits(g, ids), reference_logits(h, ids), rtol=1e-6, atol=1e-6)


# --- Hugging Face directories ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_hf_directory_in_each_dtype(tmp_path, dtype):
    d = write_tiny_hf_dir(tmp_path / "m", "qwen2", tied=True, dtype=dtype)
    m = load_model(d)
    assert m.source == "hf" and m.config.arch == "qwen2" and m.config.tie_word_embeddings
    assert m.config.rope_theta == 1e6 and m.config.rms_norm_eps == 1e-6 and m.config.attention_bias
    want = tiny_weights(tiny_config("qwen2", tied=True))
    for name, w in m.weights.items():
        assert w.kind == ("f32" if len(w.shape) == 1 else dtype)
        tol = {"f32": 0, "f16": 1e-3, "bf16": 1e-2}[dtype]
        np.testing.assert_allclose(dequantize(w), want[name], rtol=tol, atol=tol, err_msg=name)


def test_sharded_hf_directory(tmp_path):
    d = write_tiny_hf_dir(tmp_path / "m", "llama", shards=3)
    assert not (d / "model.safetensors").exists() and (d / "model.safetensors.index.json").is_file()
    m = load_model(d)
    want = tiny_weights(tiny_config("llama"))
    for name, w in m.weights.items():
        np.testing.assert_array_equal(dequantize(w), want[name])


def test_hf_config_rope_scaling_and_transformers_5_rope_parameters(tmp_path):
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}
    c = tiny_config("llama", rope_scaling=rope)
    m = load_model(write_tiny_hf_dir(tmp_path / "a", config=c))
    assert m.config.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    inv = m.config.rope_inv_freq()
    base = 1.0 / 10000.0 ** (np.arange(0, 16, 2) / 16)
    wavelen = 2 * np.pi / base
    assert np.all(inv[wavelen < 16] == base[wavelen < 16])  # high frequencies kept
    np.testing.assert_allclose(inv[wavelen > 64], base[wavelen > 64] / 8)  # low ones divided by factor
    c5 = tiny_config("llama")
    del c5["rope_theta"]
    c5["rope_parameters"] = {"rope_theta": 5000.0, "rope_type": "linear", "factor": 2.0}
    m5 = load_model(write_tiny_hf_dir(tmp_path / "b", config=c5))
    assert m5.config.rope_theta == 5000.0 and m5.config.rope_scaling == RopeScaling("linear", factor=2.0)
    np.testing.assert_allclose(m5.config.rope_inv_freq(), 1.0 / 5000.0 ** (np.arange(0, 16, 2) / 16) / 2)


# --- weights= -------------------------------------------------------------------------------------


def test_weights_modes(files):
    p = files["llama", "q4_1", False]
    base = load_model(p)
    f16 = load_model(p, weights="f16")
    f32 = load_model(p, weights="f32")
    q8 = load_model(p, weights="q8_0")
    for name, w in base.weights.items():
        is_2d = len(w.shape) == 2
        assert f16.weights[name].kind == ("f16" if is_2d else "f32")
        assert f32.weights[name].kind == "f32"
        assert q8.weights[name].kind == ("q8_0" if is_2d else "f32")
        exact = dequantize(w)
        np.testing.assert_array_equal(dequantize(f32.weights[name]), exact)
        as_f16 = exact.astype(np.float16).astype(np.float32) if is_2d else exact
        np.testing.assert_array_equal(dequantize(f16.weights[name]), as_f16)
        if is_2d:
            np.testing.assert_array_equal(q8.weights[name].data, quantize_q8_0(exact))
    assert q8.weight_mode == "q8_0" and base.weight_mode == "auto"
    with pytest.raises(ValueError, match="weights must be one of 'auto', 'f16', 'f32', 'q8_0', got 'int4'"):
        load_model(p, weights="int4")


# --- quantization formats -----------------------------------------------------------------------


def test_quantize_q8_0_is_bit_exact_with_gguf():
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(0)
    w = rng.standard_normal((7, 96)).astype(np.float32)
    w[1, :32] = 0  # an all-zero block
    w[2, :32] = np.linspace(-1, 1, 32)  # a block with exact halves after scaling
    w[3, 32:64] = 0.5
    q = quantize_q8_0(w)
    assert q.dtype == np.uint8 and q.shape == (7, 3 * 34)
    np.testing.assert_array_equal(q, quants.quantize(w, GGMLQuantizationType.Q8_0))
    with pytest.raises(ValueError, match="multiple of 32 columns, got shape \\(2, 40\\)"):
        quantize_q8_0(np.zeros((2, 40), np.float32))


def test_block_layouts_as_documented():
    """Q8_0: d, 32 int8, w = d*q. Q4_0: d, 16 bytes, w = d*(q-8), low nibbles first. Q4_1: d, m, w = d*q + m."""
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(1)
    w = rng.standard_normal((3, 64)).astype(np.float32)
    for kind in ("q8_0", "q4_0", "q4_1"):
        raw = quants.quantize(w, GGMLQuantizationType[kind.upper()])
        blocks = raw.reshape(-1, BLOCK_BYTES[kind])
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
        if kind == "q8_0":
            mine = d * blocks[:, 2:].view(np.int8).astype(np.float32)
        else:
            start = 2 if kind == "q4_0" else 4
            nib = blocks[:, start:]
            q = np.concatenate([nib & 0xF, nib >> 4], axis=1).astype(np.float32)  # elements 0..15 low, 16..31 high
            if kind == "q4_0":
                mine = d * (q - 8)
            else:
                m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
                mine = d * q + m
        wt = WeightTensor("t", (3, 64), kind, raw)
        np.testing.assert_array_equal(dequantize(wt), mine.reshape(3, 64))
        np.testing.assert_array_equal(dequantize(wt), quants.dequantize(raw, GGMLQuantizationType[kind.upper()]))


def test_weight_tensor_checks_its_data():
    with pytest.raises(ValueError, match="q8_0 data must be uint8 of shape \\(2, 34\\), got uint8 of shape \\(2, 33\\)"):
        WeightTensor("x", (2, 32), "q8_0", np.zeros((2, 33), np.uint8))
    with pytest.raises(ValueError, match="weight kind must be one of"):
        WeightTensor("x", (2,), "q5_0", np.zeros(2, np.float32))


# --- tokenizer, chat template, streaming ----------------------------------------------------------


def test_gguf_tokenizer_matches_the_tokenizer_json(files):
    g = load_model(files["llama", "f32", False])
    ref = tiny_tokenizer()
    for text in [*CORPUS[:6], "  leading spaces\nand\ttabs", "<|im_start|>user\nhi<|im_end|>"]:
        assert g.encode(text) == ref.encode(text).ids
        assert g.decode(g.encode(text), skip_special_tokens=False) == text
    assert g.encode("<|im_start|>") == [1]
    assert g.tokenizer.bos_token == "<|im_start|>" and g.tokenizer.eos_token == "<|im_end|>"


def test_add_bos_token_prepends_bos(tmp_path):
    m = load_model(write_tiny_gguf(tmp_path / "b.gguf", add_bos=True))
    ids = m.encode("hello")
    assert ids[0] == 1 and ids[1:] == m.encode("hello", add_special_tokens=False)


def test_chat_template_renders_as_hugging_face(files):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    for key in (("llama", "f32", False), ("llama", "hf")):
        m = load_model(files[key])
        assert m.apply_chat_template(msgs) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi"
                                               "<|im_end|>\n<|im_start|>assistant\n")
        assert m.apply_chat_template(msgs, add_generation_prompt=False).endswith("Hi<|im_end|>\n")
        assert m.chat_ids(msgs)[:1] == [1] and m.chat_ids(msgs).count(1) == 3


def test_chat_template_errors(tmp_path):
    t = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}"
    m = load_model(write_tiny_gguf(tmp_path / "a.gguf", chat_template=t))
    with pytest.raises(InputError, match="the chat template refused the messages: first message must be from the user"):
        m.apply_chat_template([{"role": "assistant", "content": "x"}])
    with pytest.raises(TypeError, match="messages\\[0\\] must be a dict with 'role' and 'content'"):
        m.apply_chat_template([{"content": "x"}])
    none = load_model(write_tiny_gguf(tmp_path / "b.gguf", chat_template=None))
    with pytest.raises(InputError, match="b.gguf: the model has no chat template; pass a plain prompt instead"):
        none.apply_chat_template([{"role": "user", "content": "x"}])


def test_hf_chat_template_from_a_jinja_file(tmp_path):
    d = write_tiny_hf_dir(tmp_path / "m", chat_template=None)
    (d / "chat_template.jinja").write_text("{{ bos_token }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    m = load_model(d)
    assert m.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == \
        "<|im_start|>[a][b]"


def test_incremental_detokenizer_never_splits_a_character(files):
    m = load_model(files["qwen2", "f32", False])
    text = "Héllo wörld: 日本語のテキスト 🙂🚀 ∑∫√ done."
    ids = m.encode(text)
    assert len(ids) > len(text.split())  # multi-byte characters span several tokens
    det = m.tokenizer.detokenizer()
    pieces = [det.push(i) for i in ids]
    pieces.append(det.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert sum(1 for p in pieces if p) > 5  # it streams, not all at the end


# --- SmolLM2, the real model ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    try:
        find_smollm2()
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    return load_model("smollm2")


def test_smollm2_config_and_kinds(smollm2):
    c = smollm2.config
    assert (c.arch, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == \
        ("llama", 30, 576, 9, 3, 64)
    assert (c.intermediate_size, c.vocab_size, c.max_position_embeddings) == (1536, 49152, 8192)
    assert c.rope_theta == 100000.0 and c.rope_scaling is None and c.tie_word_embeddings
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,)
    kinds = {name: w.kind for name, w in smollm2.weights.items()}
    assert kinds["model.embed_tokens.weight"] == "q8_0"
    assert kinds["model.layers.0.self_attn.q_proj.weight"] == "q4_1"
    assert kinds["model.layers.29.mlp.down_proj.weight"] == "q4_1"
    assert kinds["model.norm.weight"] == "f32"
    assert sorted(set(kinds.values())) == ["f32", "q4_1", "q8_0"]
    assert sum(k == "q4_1" for k in kinds.values()) == 210
    assert smollm2.weights["model.embed_tokens.weight"].data.shape == (49152, 576 // 32 * 34)
    assert 90e6 < smollm2.nbytes < 100e6  # packed as in the file


def test_smollm2_tokenizer(smollm2):
    import json as json_module

    for text in [json_module.__doc__, os.__doc__, pickle.__doc__, "Numbers 2024 and 3.14159, ünïcödé ✓"]:
        ids = smollm2.encode(text)
        assert smollm2.decode(ids) == text
    assert smollm2.encode("<|im_start|>") == [1] and smollm2.encode("<|im_end|>") == [2]
    assert smollm2.encode("12345") == [33, 34, 35, 36, 37]  # digits one by one, as SmolLM's own tokenizer
    assert smollm2.encode("Hello world") == [19556, 905]
    msgs = [{"role": "user", "content": "Hi"}]
    assert smollm2.apply_chat_template(msgs) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_smollm2_reference_answers_paris(smollm2):
    msgs = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    ids = smollm2.chat_ids(msgs)
    out = reference_greedy(smollm2, ids, 12, dtype=np.float32, stop_at_eos=True)
    assert "Paris" in smollm2.decode(out)


# --- the reference decoder ----------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_reference_cached_decode_equals_full_prefill(files, arch):
    m = load_model(files[arch, "q8_0", False])
    ids = m.encode(CORPUS[0])
    full = reference_logits(m, ids)
    assert full.shape == (len(ids), m.config.vocab_size) and full.dtype == np.float32
    cache = ReferenceCache(m.config.num_layers)
    head = reference_forward(m, ids[:4], cache)
    steps = [reference_forward(m, [i], cache) for i in ids[4:]]
    assert cache.length == len(ids)
    np.testing.assert_allclose(np.concatenate([head, *steps]), full, rtol=1e-5, atol=1e-5)
    greedy = reference_greedy(m, ids, 5)
    again = list(ids)
    for _ in range(5):
        again.append(int(np.argmax(reference_logits(m, again)[-1])))
    assert greedy == again[len(ids):]
    f32 = reference_logits(m, ids, dtype=np.float32)
    np.testing.assert_allclose(f32, full, rtol=1e-3, atol=1e-3)


def test_reference_is_causal(files):
    m = load_model(files["qwen2", "f32", False])
    a = reference_logits(m, [5, 6, 7, 8])
    b = reference_logits(m, [5, 6, 7, 9])
    np.testing.assert_array_equal(a[:3], b[:3])
    assert not np.allclose(a[3], b[3])


# --- bad files ----------------------------------------------------------------------------------


def test_truncated_gguf(files, tmp_path):
    data = Path(files["llama", "f32", False]).read_bytes()
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[:len(data) // 2])
    with pytest.raises(ModelWeightsError) as e:
        load_model(p)
    assert str(e.value).startswith(f"{p}: ")
    assert "truncated" in str(e.value)
    head = tmp_path / "head.gguf"
    head.write_bytes(data[:100])
    with pytest.raises(ModelWeightsError, match="cannot read it as GGUF: truncated or corrupt"):
        load_model(head)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelWeightsError, match="cannot read it as GGUF: not a GGUF file \\(no GGUF magic\\)"):
        load_model(junk)


def test_unknown_architecture(tmp_path):
    p = write_tiny_gguf(tmp_path / "a.gguf", arch_name="gpt2")
    with pytest.raises(ModelConfigError) as e:
        load_model(p)
    assert str(e.value) == f"{p}: architecture 'gpt2' is not supported; supported: llama, qwen2"


def test_missing_tensor(tmp_path):
    p = write_tiny_gguf(tmp_path / "a.gguf", drop=["blk.1.ffn_up.weight"])
    with pytest.raises(ModelWeightsError) as e:
        load_model(p)
    assert str(e.value) == (f"{p}: tensor 'blk.1.ffn_up.weight' (model.layers.1.mlp.up_proj.weight) is missing; "
                            "expected shape (128, 64)")


def test_shape_mismatch(tmp_path):
    p = write_tiny_gguf(tmp_path / "a.gguf", reshape={"blk.0.attn_k.weight": (64, 64)})
    with pytest.raises(ModelWeightsError) as e:
        load_model(p)
    assert str(e.value) == f"{p}: tensor 'blk.0.attn_k.weight' has shape (64, 64), expected (32, 64) from the config"


def test_unsupported_type(tmp_path):
    p = write_tiny_gguf(tmp_path / "a.gguf", retype={"blk.0.ffn_down.weight": "Q5_0"})
    with pytest.raises(ModelWeightsError) as e:
        load_model(p)
    assert str(e.value) == (f"{p}: tensor 'blk.0.ffn_down.weight' has type Q5_0, which is not supported; "
                            "supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1")


@pytest.mark.parametrize("kind", ["bert", "t5", "rwkv"])
def test_unsupported_tokenizer_model(tmp_path, kind):
    p = write_tiny_gguf(tmp_path / "a.gguf", tokenizer_model=kind)
    with pytest.raises(ModelConfigError) as e:
        load_model(p)
    assert str(e.value) == (f"{p}: tokenizer model {kind!r} is not supported; supported: 'gpt2' (byte-level BPE: "
                            "Llama 3, Qwen2, SmolLM) and 'llama' (SentencePiece BPE: Llama 2, Mistral, TinyLlama); "
                            "load the model's Hugging Face directory (tokenizer.json) instead")


def test_unsupported_rope_scaling_in_gguf(tmp_path):
    p = write_tiny_gguf(tmp_path / "a.gguf", edit=lambda w: w.add_string("llama.rope.scaling.type", "yarn"))
    with pytest.raises(ModelConfigError, match="llama.rope.scaling.type 'yarn' is not supported"):
        load_model(p)


def test_bad_hf_directories(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist; pass a .gguf file, a Hugging Face model directory"):
        load_model(tmp_path / "nothing")
    d = write_tiny_hf_dir(tmp_path / "a")
    (d / "tokenizer.json").unlink()
    with pytest.raises(ModelNotFoundError, match="has no tokenizer.json"):
        load_model(d)

    d = write_tiny_hf_dir(tmp_path / "b")
    c = json.loads((d / "config.json").read_text())
    c["model_type"] = "mistral"
    (d / "config.json").write_text(json.dumps(c))
    with pytest.raises(ModelConfigError) as e:
        load_model(d)
    assert str(e.value) == f"{d / 'config.json'}: model_type 'mistral' is not supported; supported: llama, qwen2"

    w = tiny_weights(tiny_config("llama"))
    d = write_tiny_hf_dir(tmp_path / "c", weights={k: v for k, v in w.items() if "layers.1.mlp.gate" not in k})
    with pytest.raises(ModelWeightsError) as e:
        load_model(d)
    assert str(e.value) == f"{d}: tensor 'model.layers.1.mlp.gate_proj.weight' is missing; expected shape (128, 64)"

    w2 = dict(w, **{"model.norm.weight": np.ones(32, np.float32)})
    d = write_tiny_hf_dir(tmp_path / "d", weights=w2)
    with pytest.raises(ModelWeightsError) as e:
        load_model(d)
    assert str(e.value) == (f"{d / 'model.safetensors'}: tensor 'model.norm.weight' has shape (32,), expected (64,) "
                            "from the config")

    d = write_tiny_hf_dir(tmp_path / "e")
    write_safetensors(d / "model.safetensors", {k: (v * 10).astype(np.int8) for k, v in w.items()})
    with pytest.raises(ModelWeightsError, match="tensor 'model.embed_tokens.weight' has dtype I8, which is not "
                                                "supported; supported: F32, F16, BF16"):
        load_model(d)

    d = write_tiny_hf_dir(tmp_path / "f")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:len(data) - 1000])
    with pytest.raises(ModelWeightsError, match="model.safetensors: truncated: tensor .* needs bytes up to"):
        load_model(d)


def test_config_validation():
    with pytest.raises(ModelConfigError, match="num_heads 6 must be a multiple of num_kv_heads 4"):
        LlamaConfig("llama", 10, 64, 128, 1, 6, 4, 16, 1e-5, 1e4, 64, False)
    with pytest.raises(ModelConfigError, match="architecture 'gemma' is not supported"):
        LlamaConfig("gemma", 10, 64, 128, 1, 4, 4, 16, 1e-5, 1e4, 64, False)
    with pytest.raises(ModelConfigError, match="special token id 12 is out of range for vocab_size 10"):
        LlamaConfig("llama", 10, 64, 128, 1, 4, 4, 16, 1e-5, 1e4, 64, False, eos_token_ids=(12,))
    with pytest.raises(ModelConfigError, match="rope scaling type 'yarn' is not supported"):
        RopeScaling("yarn")


def test_model_errors_are_hetero_errors_and_pickle(tmp_path):
    p = write_tiny_gguf(tmp_path / "a.gguf", arch_name="bert")
    with pytest.raises(ModelError) as e:
        load_model(p)
    assert isinstance(e.value, HeteroError)
    back = pickle.loads(pickle.dumps(e.value))
    assert type(back) is ModelConfigError and str(back) == str(e.value)


def test_tiny_chatml_template_is_the_fixture_one(files):
    assert load_model(files["qwen2", "hf"]).tokenizer.chat_template == CHATML_TEMPLATE


def test_shaped_configs_load(tmp_path):
    c = shaped_config("smollm2-135m", num_hidden_layers=1, vocab_size=512)
    m = load_model(write_tiny_hf_dir(tmp_path / "s", config=c))
    assert (m.config.hidden_size, m.config.num_heads, m.config.num_kv_heads, m.config.head_dim) == (576, 9, 3, 64)
    assert m.config.tie_word_embeddings and m.config.num_layers == 1
