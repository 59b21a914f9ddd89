"""SentencePiece (``tokenizer.ggml.model == "llama"``) tokenizers from GGUF metadata.

The vocabulary is learned from standard-library docstrings (tests/llm_fixtures.py, Llama 2's
layout). Encodings are checked against :func:`spm_encode`, a plain-Python SentencePiece BPE
written here from the algorithm (join the adjacent pair whose concatenation is the
highest-scoring token, leftmost first; characters outside the vocabulary as their UTF-8 byte
tokens), on the docstrings' paragraphs and on text with characters the vocabulary lacks.
"""

from __future__ import annotations

import os
import sys
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from llm_fixtures import (  # noqa: E402
    SPM_TRAINING_MODULES,
    SpmVocab,
    add_spm_tokenizer,
    spm_vocab,
    stdlib_docs,
    tiny_config,
    write_tiny_gguf,
)

from hetero.pipelines.llm_model import load_model  # noqa: E402
from hetero.pipelines.llm_reference import reference_greedy  # noqa: E402
from hetero.pipelines.llm_tokenizer import gguf_tokenizer, spm_merges  # noqa: E402
from hetero.pipelines.minilm import ModelConfigError  # noqa: E402

SPACE = "\u2581"
UNSEEN = ["inspect", "heapq", "re"]  # docstrings the vocabulary was not learned from
ODD = ["naïve café, Grüße: 日本語のテキスト 🙂🚀 ∑∫√",  # characters outside the vocabulary
       "  two leading spaces,  two inner,\ttab\nand a newline ", "Quiz: WHY? Kilo-Watt QQ", "x"]


def spm_encode(text: str, v: SpmVocab, space_prefix: bool = True) -> list[int]:
    """SentencePiece BPE, straight from the algorithm (no BOS)."""
    ids = {t: i for i, t in reversed(list(enumerate(v.tokens)))}
    syms = list((SPACE if space_prefix else "") + text.replace(" ", SPACE))
    while True:
        best: tuple[float, int] | None = None
        for i in range(len(syms) - 1):
            j = ids.get(syms[i] + syms[i + 1])
            if j is not None and (best is None or v.scores[j] > best[0]):
                best = (v.scores[j], i)
        if best is None:
            break
        i = best[1]
        syms[i:i + 2] = [syms[i] + syms[i + 1]]
    out: list[int] = []
    for s in syms:
        out += [ids[s]] if s in ids else [ids[f"<0x{b:02X}>"] for b in s.encode("utf-8")]
    return out


def spm_file(tmp_path, name: str = "spm.gguf", **flags) -> os.PathLike:
    v = spm_vocab()
    config = tiny_config("llama", vocab_size=(len(v.tokens) + 31) // 32 * 32)  # room past the tokenizer's ids
    return write_tiny_gguf(tmp_path / name, config=config, tokenizer=lambda w: add_spm_tokenizer(w, v, **flags))


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    return load_model(spm_file(tmp_path_factory.mktemp("spm")))


def test_docstrings_encode_as_sentencepiece_and_decode_back(spm):
    v = spm_vocab()
    texts = stdlib_docs(*SPM_TRAINING_MODULES, *UNSEEN)
    assert len(texts) > 50
    pieces = 0
    for text in texts:
        ids = spm.encode(text)
        assert ids == [1, *spm_encode(text, v)], text
        assert spm.decode(ids) == text
        pieces += len(ids)
    assert pieces < sum(map(len, texts)) / 2  # merged pieces, not characters


def test_characters_outside_the_vocabulary_fall_back_to_bytes(spm):
    v = spm_vocab()
    assert "🙂" not in v.tokens and "G" not in v.tokens
    for text in ODD:
        ids = spm.encode(text, add_special_tokens=False)
        assert ids == spm_encode(text, v)
        assert spm.decode(ids) == text
    smile = spm.encode("🙂", add_special_tokens=False)
    assert [v.tokens[i] for i in smile] == [SPACE, "<0xF0>", "<0x9F>", "<0x99>", "<0x82>"]
    assert spm.decode(smile[1:]) == "🙂"


def test_bos_and_eos_flags(tmp_path):
    default = load_model(spm_file(tmp_path, "a.gguf"))  # no flags written: llama.cpp's defaults, BOS only
    body = default.encode("Return a string.", add_special_tokens=False)
    assert default.encode("Return a string.") == [1, *body]
    assert default.encode("") == [1] and default.encode("", add_special_tokens=False) == []
    no_bos = load_model(spm_file(tmp_path, "b.gguf", add_bos=False))
    assert no_bos.encode("Return a string.") == body
    both = load_model(spm_file(tmp_path, "c.gguf", add_bos=True, add_eos=True))
    assert both.encode("Return a string.") == [1, *body, 2]
    assert both.decode(both.encode("Return a string.")) == "Return a string."
    eos_only = load_model(spm_file(tmp_path, "d.gguf", add_bos=False, add_eos=True))
    assert eos_only.encode("Return a string.") == [*body, 2]
    assert (default.tokenizer.bos_token, default.tokenizer.eos_token) == ("<s>", "</s>")


def test_missing_special_ids_take_llama_cpp_defaults(tmp_path):
    m = load_model(spm_file(tmp_path, special_ids=False))
    assert m.config.bos_token_id == 1 and m.config.eos_token_ids == (2,)
    assert m.encode("a")[0] == 1
    assert m.encode("\U0010ffff", add_special_tokens=False) == spm_encode("\U0010ffff", spm_vocab())


def test_without_a_space_prefix(tmp_path):
    m = load_model(spm_file(tmp_path, add_space_prefix=False))
    v = spm_vocab()
    for text in [*stdlib_docs("json")[:3], *ODD]:
        ids = m.encode(text, add_special_tokens=False)
        assert ids == spm_encode(text, v, space_prefix=False)
        assert m.decode(ids) == text
    assert not v.tokens[m.encode("Return", add_special_tokens=False)[0]].startswith(SPACE)


def test_control_tokens_are_special_and_text_after_them_gets_a_space_prefix(spm):
    v = spm_vocab()
    ids = spm.encode("</s>Decode a string.<s>Return it.", add_special_tokens=False)
    assert ids == [2, *spm_encode("Decode a string.", v), 1, *spm_encode("Return it.", v)]
    assert spm.decode(ids) == "Decode a string. Return it."
    assert spm.decode(ids, skip_special_tokens=False) == "</s> Decode a string.<s> Return it."


def test_streamed_text_adds_up_to_the_decoded_text(spm):
    for text in [*ODD, stdlib_docs("json")[0]]:
        ids = spm.encode(text, add_special_tokens=False)
        d = spm.tokenizer.detokenizer()
        parts = [d.push(i) for i in ids] + [d.flush()]
        assert "".join(parts) == spm.decode(ids) == text
        assert all("\ufffd" not in p for p in parts)
    # invalid UTF-8 from byte tokens: the whole run decodes as U+FFFD, and the stream says the same
    v = spm_vocab()
    byte = {b: v.tokens.index(f"<0x{b:02X}>") for b in (0x76, 0x8C, 0xF0, 0x9F)}
    ids = [byte[0x76], byte[0x8C], v.tokens.index("ow"), byte[0xF0], byte[0x9F], byte[0x76]]
    d = spm.tokenizer.detokenizer()
    parts = [d.push(i) for i in ids] + [d.flush()]
    assert parts[:3] == ["", "", "\ufffd\ufffdow"]
    assert "".join(parts) == spm.decode(ids) == "\ufffd\ufffdow\ufffd\ufffd\ufffd"


def test_spm_merges_rank_by_the_joined_token_s_score():
    tokens = ["<0x41>", "a", "b", "c", "ab", "bc", "abc", "<s>", "ca"]
    scores = [0.0, -10, -11, -12, -1, -2, -0.5, 0.0, -3]
    mergeable = [False, True, True, True, True, True, True, False, True]
    assert spm_merges(tokens, scores, mergeable) == [("ab", "c"), ("a", "bc"), ("a", "b"), ("b", "c"), ("c", "a")]
    # a token that cannot take part (control, byte) is neither a merge's result nor one of its halves
    assert spm_merges(tokens, scores, [*mergeable[:4], False, *mergeable[5:]]) == [
        ("a", "bc"), ("b", "c"), ("c", "a")]


def test_generation_with_a_sentencepiece_vocabulary(spm, shared_rt):
    from hetero.pipelines import LLM

    prompt = "Decode a JSON document, naïve 🙂"
    ids = spm.encode(prompt)
    with LLM(spm, runtime=shared_rt, kv_cache_bytes=1 << 20) as llm:
        assert llm.encode(prompt) == ids
        c = llm.generate(prompt, max_tokens=12)
        pieces = list(_stream(llm, prompt))
    want = reference_greedy(spm, ids, 12, stop_at_eos=True)
    assert c.token_ids == [t for t in want if t not in spm.config.eos_token_ids]
    assert c.text == spm.decode(c.token_ids)
    assert "".join(p.text for p in pieces) == c.text


def _stream(llm, prompt):
    import anyio

    async def run():
        return [p async for p in llm.stream(prompt, max_tokens=12)]

    return anyio.run(run)


def _meta(v: SpmVocab, **extra) -> dict:
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": list(v.tokens),
            "tokenizer.ggml.scores": list(v.scores), "tokenizer.ggml.token_type": list(v.types), **extra}


def test_broken_sentencepiece_metadata_is_refused_naming_the_file():
    v = spm_vocab()
    n = len(v.tokens)
    cases: list[tuple[dict, str]] = [
        ({"tokenizer.ggml.scores": None}, "f.gguf: a SentencePiece ('llama') tokenizer needs a score per token in "
                                          "tokenizer.ggml.scores (missing)"),
        ({"tokenizer.ggml.scores": [0.0] * 5}, "f.gguf: a SentencePiece ('llama') tokenizer needs a score per token "
                                               f"in tokenizer.ggml.scores (5 scores for {n} tokens)"),
        ({"tokenizer.ggml.token_type": [1, 1]}, f"f.gguf: tokenizer.ggml.token_type has 2 entries for {n} tokens"),
        ({"tokenizer.ggml.tokens": []}, "f.gguf: tokenizer.ggml.tokens is missing"),
    ]
    for extra, message in cases:
        meta = _meta(v)
        meta.update(extra)
        meta = {k: x for k, x in meta.items() if x is not None}
        with pytest.raises(ModelConfigError) as e:
            gguf_tokenizer(meta, "f.gguf", 4096)
        assert str(e.value) == message
    with pytest.raises(ModelConfigError) as e:
        gguf_tokenizer(_meta(v), "f.gguf", 100)
    assert str(e.value) == f"f.gguf: the tokenizer has {n} tokens, more than the vocab_size 100 of the embedding table"
    with pytest.raises(ModelConfigError) as e:
        gguf_tokenizer({}, "f.gguf", 100)
    assert str(e.value) == ("f.gguf: the file has no tokenizer (tokenizer.ggml.model is missing); load the model's "
                            "Hugging Face directory (tokenizer.json) instead")


def test_merges_in_the_file_are_used_as_they_are():
    v = spm_vocab()
    ranked = spm_merges(v.tokens, v.scores, [k == 1 for k in v.types])
    from_scores = gguf_tokenizer(_meta(v), "f.gguf", 4096)
    from_merges = gguf_tokenizer(_meta(v, **{"tokenizer.ggml.merges": [f"{a} {b}" for a, b in ranked]}), "f.gguf",
                                 4096)
    for text in stdlib_docs("json"):
        assert from_merges.encode(text) == from_scores.encode(text)
    # reversed merges rank the longest pieces last: a different (worse) segmentation, so the file's merges rule
    backwards = gguf_tokenizer(_meta(v, **{"tokenizer.ggml.merges": [f"{a} {b}" for a, b in ranked[::-1]]}),
                               "f.gguf", 4096)
    texts = stdlib_docs("json")
    assert sum(len(backwards.encode(t)) for t in texts) > sum(len(from_scores.encode(t)) for t in texts)
