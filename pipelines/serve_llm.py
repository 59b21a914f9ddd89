"""``hetero serve`` for text generation: OpenAI's chat and completions endpoints on an :class:`~hetero.pipelines.LLM`.

:class:`GenerationServer` stands on :class:`~hetero.pipelines.serve_base.ServerBase` (the
HTTP entry points, the common routes, errors, the lifecycle) and answers:

- ``POST /v1/chat/completions`` (and ``/chat/completions``): ``messages`` (roles ``system``,
  ``developer``, ``user``, ``assistant``, ``tool``; content a string or a list of text parts),
  rendered with the model's chat template;
- ``POST /v1/completions`` (and ``/completions``): ``prompt``, a string or a list of token ids
  (or a list holding one of those);

with ``max_tokens`` (chat also ``max_completion_tokens``; default ``default_max_tokens``, at
most the room left in ``max_seq_len``), ``temperature`` (0 to 2, default 1; 0 is greedy),
``top_p``, ``top_k`` (beside OpenAI's), ``seed``, ``stop`` (a string or up to 16), ``n`` (1
only). Answers have OpenAI's shapes (``chat.completion``, ``text_completion``, with
``usage``). With ``"stream": true`` the answer is server-sent events: ``data: {chunk}`` lines
(``chat.completion.chunk``: a first ``delta`` with the role, then content, the last chunk with
``finish_reason``; with ``stream_options: {"include_usage": true}`` every chunk has ``usage``
null and one more chunk carries it) and ``data: [DONE]``.

Concurrent requests share the LLM's decode steps (its continuous batching); with
``--workers N`` the LLM runs in an engine process and N fronts reach it
(:mod:`~hetero.pipelines.serve_llm_link`). A client that
disconnects cancels its request: the stream closes and its sequence's KV blocks return.
Errors keep OpenAI's shape: 400 names the bad parameter (``context_length_exceeded`` past
``max_seq_len``), 404 ``model_not_found``, 429 (``Retry-After``) past ``max_waiting``
sequences waiting to start, 503 while warming up, after the device was lost and while
shutting down. A stream that fails after its first chunk ends with an ``error`` event.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import anyio

import hetero
from hetero.errors import DeviceLostError, HeteroError, InputError, OverloadedError, RuntimeClosedError

from .kv_cache import KVCacheFullError
from .llm import LLM, StreamPiece
from .llm_engine import MAX_STEPS_PER_RUN
from .llm_model import ARCHITECTURES, load_model
from .serve_base import (JSON_HEADER, BaseSettings, RequestError, Response, ServerBase, StreamResponse, dumps,
                         internal_error, log, token_id, unavailable)
from .serve_llm_link import GenerationClient, GenerationEngine
from .serve_metrics import import_serve

_orjson: Any
try:  # optional: reads request bodies faster
    import orjson as _orjson
except ImportError:  # pragma: no cover - depends on the environment
    _orjson = None

__all__ = ["GenerateMetrics", "GenerateSettings", "GenerationServer", "model_kind"]

CHAT_PATHS = frozenset(("/v1/chat/completions", "/chat/completions"))
SSE_HEADERS = [("content-type", "text/event-stream; charset=utf-8"), ("cache-control", "no-cache"),
               ("x-accel-buffering", "no")]
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOPS = 16
# Prompts longer than this many characters are tokenized on a worker thread, not the event loop.
THREAD_TOKENIZE_CHARS = 4096
# Parameters whose non-default values this server cannot honour: (name, its default(s)).
UNSUPPORTED = (("logprobs", (None, False, 0)), ("top_logprobs", (None, 0)), ("echo", (None, False)),
               ("best_of", (None, 1)), ("suffix", (None, "")), ("presence_penalty", (None, 0)),
               ("frequency_penalty", (None, 0)), ("logit_bias", (None,)), ("tools", (None,)),
               ("functions", (None,)))


def model_kind(model: str | os.PathLike[str]) -> str:
    """``"generation"`` for what :class:`~hetero.pipelines.LLM` loads (``"smollm2"``, a ``.gguf``
    file, a directory whose ``config.json`` has ``model_type`` llama or qwen2), else ``"embedding"``."""
    text = os.fspath(model)
    if text == "smollm2":
        return "generation"
    p = Path(text).expanduser()
    if p.is_file() and p.suffix.lower() == ".gguf":
        return "generation"
    cfg = p / "config.json"
    if p.is_dir() and cfg.is_file():
        try:
            model_type = json.loads(cfg.read_text()).get("model_type")
        except (OSError, ValueError, AttributeError):
            return "embedding"  # the embedding loader says what is wrong with it
        if model_type in ARCHITECTURES:
            return "generation"
    return "embedding"


@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)  # BaseSettings' repr hides the key
class GenerateSettings(BaseSettings):
    """What ``hetero serve`` is told for a generation model (beside
    :class:`~hetero.pipelines.serve_base.BaseSettings`' own): the :class:`~hetero.pipelines.LLM`'s
    options (``weights``, ``max_seq_len``, ``kv_cache_bytes``, ``kv_cache_dtype``,
    ``max_batch_tokens``, ``max_running``, ``max_waiting``, ``steps_per_run``) and
    ``default_max_tokens``, the tokens a request that names no ``max_tokens`` may generate."""

    MODEL_RULE: ClassVar[str] = "a .gguf file, a Hugging Face directory or 'smollm2'"

    model: str = "smollm2"
    weights: str = "auto"
    max_seq_len: int | None = None
    kv_cache_bytes: int | None = None
    kv_cache_dtype: str = "f32"
    max_batch_tokens: int = 2048
    max_running: int | None = None
    max_waiting: int = 1024
    default_max_tokens: int = 256
    steps_per_run: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_positive("max_batch_tokens", "max_waiting", "default_max_tokens",
                            *(n for n in ("max_seq_len", "kv_cache_bytes", "max_running") if getattr(self, n) is not None))
        if self.weights not in ("auto", "f32", "f16", "q8_0"):
            raise HeteroError(f"--weights must be auto, f32, f16 or q8_0, got {self.weights!r}")
        if self.kv_cache_dtype not in ("f32", "f16"):
            raise HeteroError(f"--kv-cache-dtype must be f32 or f16, got {self.kv_cache_dtype!r}")
        if self.steps_per_run not in range(1, MAX_STEPS_PER_RUN + 1):
            raise HeteroError(f"--steps-per-run must be from 1 to {MAX_STEPS_PER_RUN}, got {self.steps_per_run!r}")

    def llm_options(self) -> dict[str, Any]:
        """The keywords of :class:`~hetero.pipelines.LLM` these settings give."""
        out: dict[str, Any] = {"weights": self.weights, "max_seq_len": self.max_seq_len,
                               "kv_cache_bytes": self.kv_cache_bytes, "kv_cache_dtype": self.kv_cache_dtype,
                               "max_batch_tokens": self.max_batch_tokens, "max_waiting": self.max_waiting,
                               "steps_per_run": self.steps_per_run}
        if self.max_running is not None:
            out["max_running"] = self.max_running
        return out


class GenerateMetrics:
    """The Prometheus metrics of a generation server: requests by status, request duration, time
    to first token, inter-token latency, tokens generated and prompted, and the LLM's running
    and waiting sequences and KV blocks.

    In one process the gauges read ``stats()`` at scrape time. With several
    (``PROMETHEUS_MULTIPROC_DIR`` set) ``/metrics`` sums every process's files, and the engine
    process writes the gauges with :meth:`set_gauges` (``stats`` is then not read).
    """

    GAUGES = {"hetero_generate_running_sequences": ("Sequences decoding", "running"),
              "hetero_generate_waiting_sequences": ("Sequences waiting to start", "waiting"),
              "hetero_kv_cache_blocks_in_use": ("KV cache blocks held by sequences", "kv_blocks_used"),
              "hetero_kv_cache_blocks": ("KV cache blocks in all", "kv_blocks_total")}

    def __init__(self, stats: Any = None) -> None:
        prom = self.prom = import_serve()
        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        reg = self.exposed = prom.CollectorRegistry()
        self.requests = prom.Counter("hetero_generate_requests", "Generation requests by HTTP status code (499: "
                                     "the client left first)", ["code"], registry=reg)
        self.duration = prom.Histogram(
            "hetero_generate_request_duration_seconds", "Time to serve a generation request, to its last token",
            registry=reg, buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120))
        self.ttft = prom.Histogram(
            "hetero_generate_time_to_first_token_seconds", "Time from a request's arrival to its first token",
            registry=reg, buckets=(.005, .01, .025, .05, .1, .15, .25, .5, 1, 2.5, 5, 10, 30))
        self.itl = prom.Histogram(
            "hetero_generate_inter_token_latency_seconds", "Time between a stream's successive tokens",
            registry=reg, buckets=(.0005, .001, .002, .005, .01, .02, .05, .1, .25, .5, 1, 2.5))
        self.tokens = prom.Counter("hetero_generate_tokens", "Tokens generated", registry=reg)
        self.prompt_tokens = prom.Counter("hetero_generate_prompt_tokens", "Prompt tokens of the requests served",
                                          registry=reg)
        self.gauges = {field: prom.Gauge(name, doc, registry=reg, multiprocess_mode="livesum")
                       for name, (doc, field) in self.GAUGES.items()}
        if self.multiprocess:
            from prometheus_client import multiprocess

            self.exposed = prom.CollectorRegistry()
            multiprocess.MultiProcessCollector(self.exposed)
        elif stats is not None:
            for field, gauge in self.gauges.items():
                gauge.set_function(lambda f=field: getattr(stats(), f))

    def set_gauges(self, stats: Any) -> None:
        """Write the gauges from ``stats`` (the engine process of a multi-process server)."""
        for field, gauge in self.gauges.items():
            gauge.set(getattr(stats, field))

    def render(self) -> bytes:
        """The Prometheus text of ``exposed``."""
        data: bytes = self.prom.generate_latest(self.exposed)
        return data


@dataclasses.dataclass
class _Ask:
    """One generation request, checked: the prompt's ids and the sampling keywords of ``LLM.stream``."""

    chat: bool
    ids: list[int]
    sampling: dict[str, Any]
    stream: bool
    usage_chunk: bool


class GenerationServer(ServerBase):
    """A generation server's state and its applications: ``app`` (ASGI) and ``__rsgi__`` (RSGI).

    ``model``: an :class:`~hetero.pipelines.LLM` (left open at the end), or what it loads (a
    ``.gguf`` file, a Hugging Face directory, ``"smollm2"``: loaded here, closed when the
    server stops). ``runtime``: the :class:`hetero.Runtime` a loaded model runs on (default:
    its own). ``engine``: the link to an engine process
    (:class:`~hetero.pipelines.serve_llm_link.GenerationClient`) that generates for this
    server, which then loads only the model's tokenizer and chat template, and parses,
    tokenizes and streams (``--workers``). The other keywords are :class:`GenerateSettings`' (or pass ``settings=``).
    ``http_server`` names the HTTP server in front. ``running()`` starts it (warm-up in the
    background: /health says when it is done) and stops it.
    """

    routes: ClassVar[dict[str, str]] = {"/v1/chat/completions": "POST", "/chat/completions": "POST",
                                        "/v1/completions": "POST", "/completions": "POST"}
    watch_disconnect: ClassVar[bool] = True
    settings: GenerateSettings

    def __init__(self, model: LLM | str | os.PathLike[str] = "smollm2", *, runtime: hetero.Runtime | None = None,
                 engine: GenerationClient | None = None, settings: GenerateSettings | None = None,
                 http_server: str | None = None, **options: Any) -> None:
        if settings is None:
            if isinstance(model, LLM):
                options.setdefault("model_name", Path(str(model.model.path)).stem)
                settings = GenerateSettings(model=str(model.model.path), **options)
            else:
                settings = GenerateSettings(model=os.fspath(model), **options)
        elif options:
            raise HeteroError(f"GenerationServer: give settings= or {', '.join(sorted(options))}, not both")
        import_serve()
        super().__init__(settings, http_server)
        self.metrics = GenerateMetrics()
        self.llm: LLM | None = None  # the LLM in this process (None with an engine process)
        self.backend: GenerationEngine | GenerationClient
        if engine is not None:
            if runtime is not None or isinstance(model, LLM):
                raise HeteroError("GenerationServer: give engine= with a model to tokenize for, not with an LLM "
                                  "or a runtime (the engine process owns them)")
            self.model = load_model(model)  # its tokenizer and chat template: the weights stay on the disk
            self.backend = engine
        else:
            if isinstance(model, LLM):
                if runtime is not None:
                    raise HeteroError("GenerationServer: give runtime= with a model to load, not with an LLM (it "
                                      "has its runtime)")
                self.llm = model
            else:
                self.llm = LLM(model, runtime=runtime, **settings.llm_options())
            self.model = self.llm.model
            self.metrics = GenerateMetrics(self.llm.stats)
            self.backend = GenerationEngine(self.llm, own=not isinstance(model, LLM))

    # -- state ----------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.backend.ready

    @property
    def lost(self) -> str | None:
        return self.backend.lost

    @property
    def warmup_error(self) -> str | None:
        return self.backend.warmup_error

    @property
    def adapter(self) -> str | None:
        return self.backend.adapter

    @property
    def max_seq_len(self) -> int:
        """The most positions a sequence takes (the engine's LLM's)."""
        return self.backend.max_seq_len

    def info(self) -> dict[str, Any]:
        """What ``GET /info`` answers: the model kind and shape, max_seq_len, the KV cache, limits."""
        s, f, st = self.settings, self.backend.facts, self.backend.stats()
        return {
            "model": self.model_name, "kind": "generation", "architecture": f.get("architecture"),
            "layers": f.get("layers"), "hidden_size": f.get("hidden_size"), "heads": f.get("heads"),
            "kv_heads": f.get("kv_heads"), "vocab_size": f.get("vocab_size"), "weights": f.get("weights"),
            "max_seq_len": f.get("max_seq_len"),
            "kv_cache": {"blocks": st.kv_blocks_total, "blocks_in_use": st.kv_blocks_used,
                         "block_size": f.get("block_size"), "dtype": f.get("kv_dtype"),
                         "bytes": f.get("kv_cache_bytes")},
            "running": st.running, "waiting": st.waiting, "tokens_generated": st.tokens_generated,
            "max_batch_tokens": f.get("max_batch_tokens"),
            "max_waiting": s.max_waiting, "default_max_tokens": s.default_max_tokens, "adapter": self.adapter,
            "ready": self.ready, "max_request_bytes": s.max_request_bytes, "models": list(s.model_ids),
            "http_server": self.http_server, "hetero_version": hetero.__version__, "worker_pid": os.getpid(),
        }

    # -- lifecycle ----------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[GenerationServer]:
        """Start (warm-up in the background, or the link to the engine process); on exit,
        :meth:`stop` (drain), then close the LLM when the server loaded it."""
        self.open_lifecycle()
        async with self.backend.running():
            try:
                yield self
            finally:
                with anyio.CancelScope(shield=True):
                    await self.stop()

    # -- the routes -------------------------------------------------------------------------------
    async def post(self, path: str, body: bytes) -> Response | StreamResponse:
        """``POST /v1/chat/completions`` or ``/v1/completions``."""
        t0 = time.perf_counter()
        self.begin_request()
        status = 200
        try:
            why = self.unavailable_reason()
            if why is not None:
                raise unavailable(why)
            ask = await self._parse(body, path in CHAT_PATHS)
            if ask.stream:
                stream = await self._open_stream(ask, t0)
                status = -1  # the stream counts its own status when it ends
                return stream
            return await self._complete(ask, t0)
        except RequestError as e:
            status = e.status
            return e.response()
        except Exception:
            status = 500
            raise
        except BaseException:  # cancelled: the client left
            status = 499
            raise
        finally:
            if status != -1:
                self.finish_request(status, t0)

    def finish_request(self, status: int, t0: float) -> None:
        """A request (begun at ``t0``) ended with ``status``: counted, and no longer in flight."""
        self.end_request()
        self.metrics.requests.labels(code=str(status)).inc()
        self.metrics.duration.observe(time.perf_counter() - t0)

    async def _complete(self, ask: _Ask, t0: float) -> Response:
        try:
            c = await self.backend.agenerate(ask.ids, **ask.sampling)
        except Exception as e:  # noqa: BLE001 - refusals become their status; the rest a 500
            raise self.refusal(e, ask) from e
        m = self.metrics
        if c.ttft_s is not None:
            m.ttft.observe(c.ttft_s)
        m.tokens.inc(c.completion_tokens)
        m.prompt_tokens.inc(c.prompt_tokens)
        usage = {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
                 "total_tokens": c.prompt_tokens + c.completion_tokens}
        head = _head(ask.chat, False, self.model_name)
        if ask.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": c.text}, "logprobs": None,
                      "finish_reason": c.finish_reason}
        else:
            choice = {"index": 0, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
        return Response(200, [JSON_HEADER], dumps({**head, "choices": [choice], "usage": usage}))

    async def _open_stream(self, ask: _Ask, t0: float) -> StreamResponse:
        """The stream's first piece is awaited here, so that a refusal (429, 400) is an HTTP status."""
        pieces = self.backend.stream(ask.ids, **ask.sampling)
        try:
            first = await pieces.__anext__()
        except BaseException as e:
            with anyio.CancelScope(shield=True):
                await pieces.aclose()  # type: ignore[attr-defined]
            if isinstance(e, Exception):
                raise self.refusal(e, ask) from e
            raise
        return StreamResponse(200, list(SSE_HEADERS), _Events(self, ask, pieces, first, t0))

    def refusal(self, e: Exception, ask: _Ask) -> Exception:
        """The RequestError that answers a generation's failure (or ``e`` itself: a 500)."""
        where = "messages" if ask.chat else "prompt"
        if isinstance(e, OverloadedError):
            return RequestError(429, f"the server is overloaded: {e}", type_="rate_limit_error", code="overloaded")
        if isinstance(e, KVCacheFullError):
            return RequestError(400, f"{e}", "max_tokens", code="context_length_exceeded")
        if isinstance(e, InputError):
            return RequestError(400, f"'{where}': {e}", where)
        if isinstance(e, DeviceLostError):
            self.backend.mark_lost(e)
            return unavailable(f"the GPU device was lost: {e}; restart the server")
        if isinstance(e, RuntimeClosedError):
            return unavailable(f"the server is shutting down: {e}")
        return e

    # -- reading a request ------------------------------------------------------------------------
    async def _parse(self, raw: bytes, chat: bool) -> _Ask:
        try:
            body = _orjson.loads(raw) if _orjson is not None else json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise RequestError(400, f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise RequestError(400, f"the request body must be a JSON object, got {type(body).__name__}")
        self.check_model(body)
        for name, defaults in UNSUPPORTED:
            v = body.get(name)
            if not (v is None or v in defaults or (name in ("logit_bias", "tools", "functions") and not v)):
                raise RequestError(400, f"'{name}' is not supported by this server; leave it out", name)
        n = body.get("n")
        if n is not None and (not token_id(n) or n != 1):
            raise RequestError(400, f"'n' must be 1 (one choice per request), got {n!r}; send n requests instead",
                               "n")
        stream = _flag(body, "stream")
        options = body.get("stream_options")
        if options is not None and (not isinstance(options, dict) or not stream):
            raise RequestError(400, "'stream_options' must be an object, and only with \"stream\": true",
                               "stream_options")
        usage_chunk = options is not None and _flag(options, "include_usage", "stream_options.include_usage")
        if chat:
            ids = await self._chat_ids(body)
        else:
            ids = await self._prompt_ids(body)
        limit = self.max_seq_len
        where = "messages" if chat else "prompt"
        if len(ids) >= limit:
            raise RequestError(400, f"'{where}' has {len(ids)} tokens; this model's max_seq_len is {limit}, and "
                               "at least one token must be left to generate: shorten it", where,
                               code="context_length_exceeded")
        sampling = _sampling(body, chat, self.settings.default_max_tokens, limit - len(ids), len(ids))
        return _Ask(chat, ids, sampling, stream, usage_chunk)

    async def _chat_ids(self, body: Mapping[str, Any]) -> list[int]:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise RequestError(400, "'messages' is required: a non-empty list of {\"role\", \"content\"} objects",
                               "messages")
        out = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict):
                raise RequestError(400, f"'messages[{i}]' must be an object, got {type(m).__name__}", "messages")
            role = m.get("role")
            if role not in ROLES:
                raise RequestError(400, f"'messages[{i}].role' must be one of {', '.join(ROLES)}, got {role!r}",
                                   "messages")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _content(m.get("content"), i)})
        model = self.model
        try:
            if sum(len(m["content"]) for m in out) > THREAD_TOKENIZE_CHARS:
                return list(await anyio.to_thread.run_sync(model.chat_ids, out))
            return list(model.chat_ids(out))
        except (InputError, TypeError, ValueError) as e:
            raise RequestError(400, f"'messages' cannot be rendered with the model's chat template: {e}",
                               "messages") from None

    async def _prompt_ids(self, body: Mapping[str, Any]) -> list[int]:
        if "prompt" not in body:
            raise RequestError(400, "'prompt' is required: a string or a list of token ids", "prompt")
        p = body["prompt"]
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]  # a list of one prompt
        if isinstance(p, list) and p and all(token_id(t) for t in p):
            vocab = self.model.config.vocab_size
            bad = next((t for t in p if not 0 <= t < vocab), None)
            if bad is not None:
                raise RequestError(400, f"'prompt' holds the token id {bad}, outside this model's vocabulary of "
                                   f"{vocab}", "prompt")
            return list(p)
        if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
            raise RequestError(400, f"'prompt' holds {len(p)} prompts; this server takes one per request", "prompt")
        if not isinstance(p, str):
            raise RequestError(400, "'prompt' must be a string or a non-empty list of token ids, got "
                               f"{type(p).__name__}", "prompt")
        ids = (await anyio.to_thread.run_sync(self.model.encode, p) if len(p) > THREAD_TOKENIZE_CHARS
               else self.model.encode(p))
        if not ids:
            raise RequestError(400, "'prompt' has no tokens (an empty string, and the model adds no BOS); send text",
                               "prompt")
        return list(ids)


def _flag(body: Mapping[str, Any], name: str, where: str | None = None) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise RequestError(400, f"'{where or name}' must be true or false, got {v!r}", where or name)
    return v


def _content(c: Any, i: int) -> str:
    """A message's content as text: a string, text parts joined, or nothing (``null``)."""
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        parts = []
        for part in c:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(400, f"'messages[{i}].content' parts must be {{\"type\": \"text\", \"text\": "
                                   f"...}}: this server reads text only, got {part!r:.80}", "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(400, f"'messages[{i}].content' must be a string or a list of text parts, got "
                       f"{type(c).__name__}", "messages")


def _number(body: Mapping[str, Any], name: str, default: float, low: float, high: float, open_low: bool) -> float:
    v = body.get(name)
    if v is None:
        return default
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (low < v if open_low else low <= v) and v <= high
    if not ok:
        span = f"{'(' if open_low else '['}{low:g}, {high:g}]"
        raise RequestError(400, f"'{name}' must be a number in {span}, got {v!r}", name)
    return float(v)


def _sampling(body: Mapping[str, Any], chat: bool, default_max: int, room: int, prompt_tokens: int) -> dict[str, Any]:
    """The keywords of ``LLM.stream`` / ``agenerate`` a request asks for (RequestError naming a bad one)."""
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(name)
    if max_tokens is None:
        max_tokens = min(default_max, room)
    elif not token_id(max_tokens) or max_tokens < 1:
        raise RequestError(400, f"'{name}' must be a positive integer, got {max_tokens!r}", name)
    elif max_tokens > room:
        raise RequestError(400, f"'{name}' is {max_tokens}, but the prompt has {prompt_tokens} tokens and this "
                           f"model's max_seq_len is {prompt_tokens + room}: at most {room} tokens can follow it; "
                           f"lower '{name}' or shorten the prompt", name, code="context_length_exceeded")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0, False)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, True)
    top_k = body.get("top_k")
    if top_k is None or top_k == -1:
        top_k = 0
    elif not token_id(top_k) or top_k < 0:
        raise RequestError(400, f"'top_k' must be an integer >= 0 (0 or -1: no top-k filter), got {top_k!r}", "top_k")
    seed = body.get("seed")
    if seed is not None and not token_id(seed):
        raise RequestError(400, f"'seed' must be an integer, got {seed!r}", "seed")
    stop = body.get("stop")
    stops: list[str] = []
    if isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    elif stop is not None:
        raise RequestError(400, f"'stop' must be a string or a list of strings, got {stop!r:.80}", "stop")
    if len(stops) > MAX_STOPS or any(not s for s in stops):
        raise RequestError(400, f"'stop' takes up to {MAX_STOPS} non-empty strings, got {stops!r:.200}", "stop")
    return {"max_tokens": int(max_tokens), "temperature": temperature, "top_p": top_p, "top_k": int(top_k),
            "seed": None if seed is None else seed % (1 << 32), "stop": stops or None}


def _head(chat: bool, chunk: bool, model: str) -> dict[str, Any]:
    """An answer's ``id``, ``object``, ``created`` and ``model``."""
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
    return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "object": kind,
            "created": int(time.time()), "model": model}


class _Events:
    """A stream's server-sent events: ``data: {chunk}`` per piece of text, the finish, ``[DONE]``.

    An async iterator of bytes whose :meth:`aclose` closes the LLM's stream (its sequence stops
    and frees its KV blocks) and counts the request, whether or not iteration began.
    """

    def __init__(self, server: GenerationServer, ask: _Ask, pieces: AsyncIterator[StreamPiece],
                 first: StreamPiece | None, t0: float) -> None:
        self.server, self.ask, self.pieces, self.first, self.t0 = server, ask, pieces, first, t0
        self.head = _head(ask.chat, True, server.model_name)
        self.tokens = 0
        self.finished = False  # the last event was made
        self.closed = False
        self.status = 499  # until it ends: the client left
        self.last = time.perf_counter()
        server.metrics.ttft.observe(self.last - t0)
        server.metrics.prompt_tokens.inc(len(ask.ids))

    def __aiter__(self) -> _Events:
        return self

    def _event(self, text: str | None, finish: str | None, role: bool = False) -> bytes:
        if self.ask.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else (
                {"content": text} if text is not None else {})
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        chunk = {**self.head, "choices": [choice]}
        if self.ask.usage_chunk:
            chunk["usage"] = None
        return b"data: " + dumps(chunk) + b"\n\n"

    def _piece(self, piece: StreamPiece) -> bytes:
        out = b""
        if piece.token_id is not None:
            self.tokens += 1
            self.server.metrics.tokens.inc()
        if piece.text:
            out += self._event(piece.text, None)
        if piece.finish_reason is not None:
            out += self._event(None, piece.finish_reason)
            if self.ask.usage_chunk:
                p = len(self.ask.ids)
                usage = {"prompt_tokens": p, "completion_tokens": self.tokens, "total_tokens": p + self.tokens}
                out += b"data: " + dumps({**self.head, "choices": [], "usage": usage}) + b"\n\n"
            out += b"data: [DONE]\n\n"
            self.finished = True
            self.status = 200
        return out

    async def __anext__(self) -> bytes:
        if self.finished or self.closed:
            raise StopAsyncIteration
        if self.first is not None:
            first, self.first = self.first, None
            head = self._event(None, None, role=True) if self.ask.chat else b""
            return head + self._piece(first)
        while True:
            try:
                piece = await self.pieces.__anext__()
            except StopAsyncIteration:  # ended without a finish reason: say so, as OpenAI's clients expect one
                return self._piece(StreamPiece("", None, "stop"))
            except Exception as e:  # noqa: BLE001 - after the first chunk a failure can only be an event
                rid = uuid.uuid4().hex
                refusal = self.server.refusal(e, self.ask)
                body = refusal.body() if isinstance(refusal, RequestError) else internal_error(rid)
                if not isinstance(refusal, RequestError):
                    log.error("hetero serve: stream %s failed", rid, exc_info=e)
                self.finished = True
                self.status = refusal.status if isinstance(refusal, RequestError) else 500
                return b"data: " + dumps(body) + b"\n\n"
            now = time.perf_counter()
            if piece.token_id is not None:
                self.server.metrics.itl.observe(now - self.last)
                self.last = now
            out = self._piece(piece)
            if out:
                return out

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            with anyio.CancelScope(shield=True):
                await self.pieces.aclose()  # type: ignore[attr-defined]
        finally:
            self.server.finish_request(self.status, self.t0)
