"""Tokenizers of Llama-family decoders, built with the ``tokenizers`` library, and the chat template.

:func:`gguf_tokenizer` builds the tokenizer a GGUF file's metadata describes, as Hugging Face's
own GGUF loading builds it; ``tokenizer.ggml.model`` names its kind:

* ``"gpt2"``: byte-level BPE (Llama 3, Qwen2, SmolLM): the file's tokens and merges, GPT-2's
  byte-to-character map, the split rule ``tokenizer.ggml.pre`` names;
* ``"llama"``: SentencePiece BPE (Llama 2, Mistral, TinyLlama): tokens with scores and token
  types, ``\u2581`` for a space, characters outside the vocabulary spelled as their UTF-8
  bytes through the ``<0xNN>`` tokens (byte fallback), ``add_space_prefix``, ``add_bos_token``
  and ``add_eos_token`` with llama.cpp's defaults. See :func:`spm_merges` for how scores
  become merges.

Any other kind (``bert``, ``t5``, ...) is refused, naming the file and the kind.
:func:`hf_tokenizer` reads a Hugging Face directory's ``tokenizer.json``. Both give a
:class:`TextTokenizer` (encode, decode, the chat template rendered with jinja2 as Hugging Face
renders it); :class:`IncrementalDetokenizer` turns a growing list of ids into text deltas.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hetero.errors import InputError

from .minilm import ModelConfigError, ModelError, ModelNotFoundError

__all__ = ["BYTE", "CONTROL", "NORMAL", "TOKENIZER_MODELS", "UNKNOWN", "UNUSED", "USER_DEFINED",
           "IncrementalDetokenizer", "TextTokenizer", "gguf_tokenizer", "hf_tokenizer", "spm_merges"]

# GGUF token types (``tokenizer.ggml.token_type``), as llama.cpp writes them.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
TOKENIZER_MODELS = ("gpt2", "llama")
"""The GGUF ``tokenizer.ggml.model`` kinds :func:`gguf_tokenizer` builds."""


class TextTokenizer:
    """A ``tokenizers.Tokenizer`` with the model's special tokens and chat template.

    ``encode(text, add_special_tokens=True)`` adds what the model's tokenizer adds (a BOS
    where the model asks for it); text rendered by :meth:`apply_chat_template` carries its
    own special tokens, so encode it with ``add_special_tokens=False`` (:meth:`chat_ids`
    does), as transformers does.
    """

    def __init__(self, tokenizer: Any, *, bos_token: str | None, eos_token: str | None,
                 chat_template: str | None, source: str) -> None:
        self.tokenizer = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.source = source  # the file the template came from, for error messages
        self._template: Any = None
        self._byte_ids: frozenset[int] | None = None

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included."""
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def byte_ids(self) -> frozenset[int]:
        """Ids of the byte-fallback tokens (``<0x00>`` .. ``<0xFF>``) of the vocabulary (often none).

        A run of them decodes as one group (invalid UTF-8 makes every byte of it U+FFFD), so
        the text of a run is not known until a token of another kind ends it.
        """
        if self._byte_ids is None:
            vocab = self.tokenizer.get_vocab(with_added_tokens=False)
            self._byte_ids = frozenset(i for t, i in vocab.items()
                                       if len(t) == 6 and t.startswith("<0x") and t.endswith(">")
                                       and all(c in "0123456789ABCDEF" for c in t[3:5]))
        return self._byte_ids

    def token_to_id(self, token: str) -> int | None:
        """The id of one token string, or None."""
        i = self.tokenizer.token_to_id(token)
        return None if i is None else int(i)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``."""
        if not isinstance(text, str):
            raise TypeError(f"encode: text must be str, got {type(text).__name__}")
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids`` (special tokens left out unless ``skip_special_tokens=False``)."""
        return str(self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            **extra: Any) -> str:
        """``messages`` rendered with the model's chat template, as Hugging Face renders it.

        jinja2's sandbox with ``trim_blocks`` and ``lstrip_blocks``, ``raise_exception`` and
        ``strftime_now`` as globals, a ``tojson`` filter, and the variables ``messages``,
        ``add_generation_prompt``, ``bos_token``, ``eos_token`` (plus ``extra``).
        """
        if self.chat_template is None:
            raise InputError(f"{self.source}: the model has no chat template; pass a plain prompt instead")
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise TypeError("apply_chat_template: messages must be a list of {'role': ..., 'content': ...} dicts")
        for n, m in enumerate(messages):
            if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
                raise TypeError(f"apply_chat_template: messages[{n}] must be a dict with 'role' and 'content', "
                                f"got {m!r}")
        import jinja2

        template = self._compiled()
        try:
            return str(template.render(messages=[dict(m) for m in messages],
                                       add_generation_prompt=add_generation_prompt,
                                       bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra))
        except jinja2.TemplateError as e:
            raise InputError(f"{self.source}: the chat template refused the messages: {e}") from e

    def chat_ids(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered chat (its special tokens come from the template, none added)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        """A fresh :class:`IncrementalDetokenizer` for streaming one generation."""
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)

    def _compiled(self) -> Any:
        if self._template is None:
            import jinja2
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise jinja2.TemplateError(message)

            def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
                       separators: Any = None, sort_keys: bool = False) -> str:
                return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                                  sort_keys=sort_keys)

            def strftime_now(fmt: str) -> str:
                import datetime

                return datetime.datetime.now().strftime(fmt)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
            env.filters["tojson"] = tojson
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = strftime_now
            assert self.chat_template is not None
            try:
                self._template = env.from_string(self.chat_template)
            except jinja2.TemplateError as e:
                raise ModelConfigError(f"{self.source}: the chat template does not compile: {e}") from e
        return self._template


class IncrementalDetokenizer:
    """Text deltas of a growing list of token ids, for streaming.

    :meth:`push` takes the next id and returns the text it completes (often ``""``): text
    is only emitted once it is final, so a multi-byte UTF-8 character split over several
    byte-level tokens comes out whole, and a word the tokenizer's decoder would still change
    is not split; nothing is emitted while a run of byte-fallback tokens
    (:attr:`TextTokenizer.byte_ids`) may still grow. It decodes a small window of ids (from
    the last emitted boundary), never the whole sequence. :meth:`flush` returns what is left
    at the end. The deltas add up to ``decode`` of all the ids.
    """

    def __init__(self, tokenizer: TextTokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # window start: ids before it are done
        self._read = 0  # ids in [prefix, read) are already emitted
        self._bytes = tokenizer.byte_ids

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one token id; the newly completed text."""
        self.ids.append(int(token_id))
        if self.ids[-1] in self._bytes:
            return ""
        done = self._text(self.ids[self._prefix:self._read])
        text = self._text(self.ids[self._prefix:])
        if len(text) > len(done) and not text.endswith("\ufffd"):
            delta = text[len(done):]
            self._prefix, self._read = self._read, len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """The text not yet emitted (an incomplete character decodes as U+FFFD)."""
        done = self._text(self.ids[self._prefix:self._read])
        text = self._text(self.ids[self._prefix:])
        self._prefix = self._read = len(self.ids)
        return text[len(done):]


# ---------------------------------------------------------------------------------------------
# GGUF metadata


def gguf_tokenizer(meta: Mapping[str, Any], source: str, vocab_size: int) -> TextTokenizer:
    """The tokenizer a GGUF file's metadata describes (``source`` names the file in errors).

    ``vocab_size`` is the embedding table's: a tokenizer with more tokens is refused.
    """
    model = meta.get("tokenizer.ggml.model")
    if model == "gpt2":
        return _bpe_tokenizer(meta, source, vocab_size)
    if model == "llama":
        return _spm_tokenizer(meta, source, vocab_size)
    if model is None:
        raise ModelConfigError(f"{source}: the file has no tokenizer (tokenizer.ggml.model is missing); load the "
                               "model's Hugging Face directory (tokenizer.json) instead")
    raise ModelConfigError(
        f"{source}: tokenizer model {model!r} is not supported; supported: 'gpt2' (byte-level BPE: Llama 3, "
        "Qwen2, SmolLM) and 'llama' (SentencePiece BPE: Llama 2, Mistral, TinyLlama); load the model's Hugging "
        "Face directory (tokenizer.json) instead")

# Pre-tokenizer split rules for byte-level BPE vocabularies, by GGUF ``tokenizer.ggml.pre``.
# A vocabulary's merges were learned on chunks cut by its own rule, so the rule must match.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_SPLITS = {name: _LLAMA3_SPLIT for name in ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3")}
_PRE_SPLITS.update({name: _QWEN2_SPLIT for name in ("qwen2", "deepseek-r1-qwen")})
# StarCoder-style vocabularies (SmolLM's): every digit on its own, then GPT-2's split.
_PRE_DIGITS = ("smollm", "starcoder", "refact")


def _bpe_tokenizer(meta: Mapping[str, Any], source: str, vocab_size: int) -> TextTokenizer:
    """The byte-level BPE tokenizer (``tokenizer.ggml.model == "gpt2"``) a GGUF file describes.

    Built as transformers builds it for such files (a BPE over the file's tokens and merges,
    GPT-2 byte-level pre-tokenizer and decoder, control tokens (type 3) added as special
    tokens so ``<|im_start|>`` is one id, a BOS template when ``add_bos_token``), with the
    split rule ``tokenizer.ggml.pre`` names. For ``smollm`` that rule splits digits one by
    one, as SmolLM's own ``tokenizer.json`` and llama.cpp do (transformers falls back to
    GPT-2's split there). Unknown ``pre`` names get GPT-2's split.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    tokens = meta.get("tokenizer.ggml.tokens")
    merges = meta.get("tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise ModelConfigError(f"{source}: tokenizer.ggml.tokens or tokenizer.ggml.merges is missing")
    if len(tokens) > vocab_size:
        raise ModelConfigError(f"{source}: the tokenizer has {len(tokens)} tokens, more than the vocab_size "
                               f"{vocab_size} of the embedding table")
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    spelling = _bytes_to_unicode()
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):  # a token whose bytes llama.cpp wrote raw is respelled as the merges spell it
        vocab.setdefault(t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")), i)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(BPE(vocab=vocab, merges=pairs, continuing_subword_prefix="", end_of_word_suffix="",
                        fuse_unk=False))
    pre = meta.get("tokenizer.ggml.pre")
    add_prefix_space = bool(meta.get("tokenizer.ggml.add_space_prefix", False))
    if pre in _PRE_SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_PRE_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False)])
        if pre in ("qwen2", "deepseek-r1-qwen"):
            tok.normalizer = normalizers.NFC()
    elif pre in _PRE_DIGITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or []
    control = [AddedToken(t, normalized=False, special=True) for t, kind in zip(tokens, types)
               if kind == CONTROL and set(t) <= alphabet]
    if control:
        tok.add_special_tokens(control)

    def token(key: str) -> str | None:
        i = meta.get(key)
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    bos = token("tokenizer.ggml.bos_token_id")
    eos = token("tokenizer.ggml.eos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        bos_id = int(meta["tokenizer.ggml.bos_token_id"])
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, bos_id)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return TextTokenizer(tok, bos_token=bos, eos_token=eos, chat_template=meta.get("tokenizer.chat_template"),
                         source=source)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (bytes that print stand for themselves)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + n)
            n += 1
    return out


def spm_merges(tokens: Sequence[str], scores: Sequence[float], mergeable: Sequence[bool]) -> list[tuple[str, str]]:
    """BPE merges that reproduce SentencePiece's score-driven merging, best first.

    A SentencePiece BPE tokenizer (llama.cpp's ``llm_tokenizer_spm`` does the same) starts
    from characters and repeatedly joins the adjacent pair whose concatenation is the token
    with the highest score, leftmost first at equal scores. A ranked BPE does the same if each
    token that two tokens can be split into is a merge, ranked by the token's score: so every
    split ``(t[:k], t[k:])`` of a mergeable token ``t`` whose halves are mergeable tokens
    becomes a merge, ranked by ``t``'s score (then by id; the splits of one token by their
    halves' scores). Control, unknown and byte tokens (``mergeable`` False) take no part.
    """
    ids: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if mergeable[i]:
            ids.setdefault(t, i)
    ranked: list[tuple[float, int, float, float, str, str]] = []
    for t, i in ids.items():
        for k in range(1, len(t)):
            left, right = ids.get(t[:k]), ids.get(t[k:])
            if left is not None and right is not None:
                ranked.append((-float(scores[i]), i, -float(scores[left]), -float(scores[right]), t[:k], t[k:]))
    ranked.sort()
    return [(r[4], r[5]) for r in ranked]


def _spm_tokenizer(meta: Mapping[str, Any], source: str, vocab_size: int) -> TextTokenizer:
    """The SentencePiece BPE tokenizer (``tokenizer.ggml.model == "llama"``) a GGUF file describes.

    As transformers builds it for such files: a BPE over the tokens with byte fallback and
    merges from the scores (:func:`spm_merges`; the file's own ``tokenizer.ggml.merges`` when
    it has them), a normalizer that puts ``\u2581`` before the text (``add_space_prefix``,
    default true) and for every space, control tokens (type 3) as special tokens, a decoder
    that turns ``<0xNN>`` tokens back into bytes and ``\u2581`` into spaces and drops the
    prefixed space, and BOS/EOS added as ``add_bos_token`` (default true) and
    ``add_eos_token`` (default false) say. User-defined tokens (type 4) are matched whole in
    any text, as llama.cpp matches them. The defaults are llama.cpp's: BOS id 1, EOS id 2,
    and the unknown token is ``tokenizer.ggml.unknown_token_id`` or the first of type 2.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
    from tokenizers.models import BPE

    tokens = meta.get("tokenizer.ggml.tokens")
    scores = meta.get("tokenizer.ggml.scores")
    merges = meta.get("tokenizer.ggml.merges")
    if not tokens:
        raise ModelConfigError(f"{source}: tokenizer.ggml.tokens is missing")
    if len(tokens) > vocab_size:
        raise ModelConfigError(f"{source}: the tokenizer has {len(tokens)} tokens, more than the vocab_size "
                               f"{vocab_size} of the embedding table")
    if merges is None and (scores is None or len(scores) != len(tokens)):
        got = "missing" if scores is None else f"{len(scores)} scores for {len(tokens)} tokens"
        raise ModelConfigError(f"{source}: a SentencePiece ('llama') tokenizer needs a score per token in "
                               f"tokenizer.ggml.scores ({got})")
    types = meta.get("tokenizer.ggml.token_type")
    if types is None:
        types = [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ModelConfigError(f"{source}: tokenizer.ggml.token_type has {len(types)} entries for "
                               f"{len(tokens)} tokens")
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    if merges is not None:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
    else:
        pairs = spm_merges(tokens, list(scores or ()), [kind in (NORMAL, USER_DEFINED, UNUSED) for kind in types])

    def token_at(key: str, default: int | None) -> str | None:
        i = meta.get(key, default)
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    unk = token_at("tokenizer.ggml.unknown_token_id", next((i for i, k in enumerate(types) if k == UNKNOWN), None))
    tok = Tokenizer(BPE(vocab=vocab, merges=pairs, unk_token=unk, fuse_unk=True, byte_fallback=True))
    space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend("\u2581")] if space_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "\u2581")])
    tail = [decoders.Strip(" ", 1, 0)] if space_prefix else []
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse(), decoders.Replace("\u2581", " "),
                                     *tail])
    control = [AddedToken(t, normalized=False, special=True) for t, kind in zip(tokens, types) if kind == CONTROL]
    if control:
        tok.add_special_tokens(control)
    user = [AddedToken(t, normalized=False, special=False) for t, kind in zip(tokens, types)
            if kind == USER_DEFINED]
    if user:
        tok.add_tokens(user)
    bos = token_at("tokenizer.ggml.bos_token_id", 1)
    eos = token_at("tokenizer.ggml.eos_token_id", 2)
    first = [bos] if bos is not None and meta.get("tokenizer.ggml.add_bos_token", True) else []
    last = [eos] if eos is not None and meta.get("tokenizer.ggml.add_eos_token", False) else []
    if first or last:
        tok.post_processor = processors.TemplateProcessing(
            single=" ".join([*first, "$A", *last]), pair=" ".join([*first, "$A", *last, *first, "$B", *last]),
            special_tokens=[(t, vocab[t]) for t in dict.fromkeys([*first, *last])])
    return TextTokenizer(tok, bos_token=bos, eos_token=eos, chat_template=meta.get("tokenizer.chat_template"),
                         source=source)


# ---------------------------------------------------------------------------------------------
# Hugging Face directories


def hf_tokenizer(d: Path, vocab_size: int) -> TextTokenizer:
    """The tokenizer of a Hugging Face model directory: ``tokenizer.json``, the special tokens of
    ``tokenizer_config.json``, the chat template from ``chat_template.jinja`` or that file.

    ``vocab_size`` is the model's (``config.json``): a token id at or past it is refused.
    """
    try:
        from tokenizers import Tokenizer
    except ImportError as e:  # pragma: no cover - a dependency
        raise ModelError("the tokenizer needs the 'tokenizers' package: pip install tokenizers") from e
    p = d / "tokenizer.json"
    if not p.is_file():
        raise ModelNotFoundError(f"model directory {str(d)!r} has no tokenizer.json")
    try:
        tok = Tokenizer.from_file(str(p))
    except Exception as e:
        raise ModelConfigError(f"{p}: cannot load it with the tokenizers package ({e})") from e
    tok.no_padding()
    tok.no_truncation()
    if tok.get_vocab_size(with_added_tokens=True) > vocab_size:
        largest = max(tok.get_vocab(with_added_tokens=True).values())
        if largest >= vocab_size:
            raise ModelConfigError(f"{p}: token id {largest} is out of range for config.json's vocab_size "
                                   f"{vocab_size}; use the tokenizer that belongs to this model")
    tc = _read_object(d / "tokenizer_config.json") if (d / "tokenizer_config.json").is_file() else {}

    def token(key: str) -> str | None:
        v = tc.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        return v if isinstance(v, str) else None

    template: Any = None
    source = d / "tokenizer_config.json"
    if (d / "chat_template.jinja").is_file():
        source = d / "chat_template.jinja"
        template = source.read_text(encoding="utf-8")
    else:
        template = tc.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if not isinstance(template, str):
            template = None
    return TextTokenizer(tok, bos_token=token("bos_token"), eos_token=token("eos_token"), chat_template=template,
                         source=str(source))


def _read_object(p: Path) -> dict[str, Any]:
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelConfigError(f"{p}: cannot read it as JSON: {e}") from e
    if not isinstance(data, dict):
        raise ModelConfigError(f"{p}: expected a JSON object, got {type(data).__name__}")
    return data
