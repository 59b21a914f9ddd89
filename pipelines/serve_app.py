"""The application behind ``hetero serve``: routes, request checks and answers, for any HTTP server.

:class:`EmbeddingServer` holds the server's state (the engine it embeds with, draining,
requests in flight, metrics) and answers one request at a time through :meth:`~EmbeddingServer.handle`:
method, path, body in; status, headers, body out. Two thin adapters put it behind an HTTP
server: ``app`` is an ASGI application (hypercorn, and httpx's ASGI transport in tests) and
``__rsgi__`` is an RSGI application (granian, which parses HTTP outside the interpreter).
Both call the same ``handle``, so every answer is the same bytes on both servers. What every
application of ``hetero serve`` shares (those entry points, the common routes, errors, the
lifecycle) is :class:`~hetero.pipelines.serve_base.ServerBase`'s.

Routes:

- ``POST /v1/embeddings`` (and ``/embeddings``): ``{"input": str | [str, ...], "model": str,
  "encoding_format": "float" | "base64"}`` -> ``{"object": "list", "data": [{"object":
  "embedding", "index": i, "embedding": [...] | "<base64 of little-endian float32>"}], "model":
  ..., "usage": {"prompt_tokens": n, "total_tokens": n}}`` (tokens counted with ``[CLS]`` and
  ``[SEP]``).
- ``GET /health``: 200 once warmed up; 503 before, after a DeviceLostError, and while
  shutting down.
- ``GET /info``: model, dimension, max input tokens, adapter, limits, the HTTP server.
- ``GET /metrics``: Prometheus text (``hetero_embed_*`` counters and histograms, queue and
  GPU memory gauges).

Errors have OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400 for bad
JSON, empty input, non-strings and token arrays; 404 for an unknown path, 405 (``Allow``) for
a known path with another method; 413 past ``max_client_batch_size`` inputs; 429
(``Retry-After``) when the batcher's queue is full; 503 (``Retry-After``) while warming up,
after the GPU device was lost, and while shutting down.

Each sentence of a request is one item of the :class:`~hetero.pipelines.embed.EmbeddingService`
batcher: concurrent requests share GPU batches (continuous batching under a padded-token
budget, ``max_batch_tokens``), packed (no padding between sentences) to bucketed shapes
whose GPU stages the warm-up captured (``precapture``), so that every batch replays them.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import os
import time
from collections.abc import AsyncIterator
from typing import Any, ClassVar

import anyio
import numpy as np

import hetero
from hetero.errors import HeteroError

from .embed_service import EmbeddingService
from .embed_tokens import TokenGroups
from .minilm import Model
from .serve_base import (JSON_HEADER, RETRY_AFTER_S, BaseSettings, RequestError, Response, ServerBase, token_id,
                         unavailable)
from .serve_engine import EmbeddingEngine, EngineClient, EngineError
from .serve_metrics import ServeMetrics, import_serve

_orjson: Any
try:  # optional: serializes float32 rows ~20x faster than the standard library (the "float" format)
    import orjson as _orjson
except ImportError:  # pragma: no cover - depends on the environment
    _orjson = None

__all__ = ["RETRY_AFTER_S", "EmbeddingServer", "RequestError", "Response", "ServeSettings", "encode_embeddings"]

# Texts longer than this many characters are first measured on a prefix (cut at a space), so that
# a megabyte string is not tokenized whole to learn that it is too long.
PREFIX_CHARS = 16384

@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)  # BaseSettings' repr hides the key
class ServeSettings(BaseSettings):
    """What ``hetero serve`` is told for an embedding model, checked once: the model and the
    batcher's and fronts' limits (beside :class:`~hetero.pipelines.serve_base.BaseSettings`' own).

    Picklable (the model as a name or path): the supervisor hands it to every front and
    engine process. ``max_batch_tokens`` is also checked against the model's longest input
    where the model is loaded (:class:`EmbeddingServer`). Every bad value raises
    :class:`~hetero.errors.HeteroError` naming the option.
    """

    MODEL_RULE: ClassVar[str] = "a directory or 'minilm'"

    model: str = "minilm"
    int8: bool = False
    max_batch_tokens: int = 16384
    max_client_batch_size: int = 2048
    max_queued: int = 4096
    max_in_flight: int = 2
    max_wait: float = 0.0
    precapture: bool | None = None
    auto_truncate: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_positive("max_batch_tokens", "max_client_batch_size", "max_queued", "max_in_flight")
        wait = self.max_wait
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait < 60:
            raise HeteroError(f"max_wait must be seconds from 0 to below 60 (--max-wait takes milliseconds), "
                              f"got {wait!r}")
        object.__setattr__(self, "max_wait", float(wait))
        object.__setattr__(self, "int8", bool(self.int8))
        object.__setattr__(self, "auto_truncate", bool(self.auto_truncate))
        if self.precapture is not None:
            object.__setattr__(self, "precapture", bool(self.precapture))


class EmbeddingServer(ServerBase):
    """The server's state and its applications: ``app`` (ASGI) and ``__rsgi__`` (RSGI, granian).

    ``model``: a loaded Model, a model directory or ``"minilm"``. ``runtime``: a
    :class:`hetero.Runtime` to use (left open at the end); by default the server makes
    one when it starts and closes it when it stops. ``engine``: the link to an engine
    process (:class:`~hetero.pipelines.serve_engine.EngineClient`) that embeds for this
    server, which then only parses, tokenizes and answers (``--workers``); by default the
    engine runs in this process. The other keywords are :class:`ServeSettings`' (or pass
    ``settings=``). ``http_server`` names the HTTP server in front (``/info`` reports it).
    ``running()`` starts (warm-up in the background) and stops it.
    """

    routes: ClassVar[dict[str, str]] = {"/v1/embeddings": "POST", "/embeddings": "POST"}
    settings: ServeSettings

    def __init__(self, model: Model | str | os.PathLike[str] = "minilm", *, runtime: hetero.Runtime | None = None,
                 engine: EngineClient | None = None, settings: ServeSettings | None = None,
                 http_server: str | None = None, **options: Any) -> None:
        import_serve()
        from .embed_weights import get_model

        if settings is None:
            name = model if isinstance(model, (str, os.PathLike)) else "minilm"
            if not isinstance(model, (str, os.PathLike)):
                options.setdefault("model_name", "hetero-embed")
            settings = ServeSettings(model=os.fspath(name), **options)
        elif options:
            raise HeteroError(f"EmbeddingServer: give settings= or {', '.join(sorted(options))}, not both")
        super().__init__(settings, http_server)
        s = settings
        self.model = get_model(model)
        self._tokenize = TokenGroups(self.model)  # concurrent requests' texts in one tokenizer call
        longest = self.model.config.max_seq_length
        if s.max_batch_tokens < longest:
            raise HeteroError(f"--max-batch-tokens {s.max_batch_tokens} is below the model's max_seq_length "
                              f"({longest}): a longest sentence could never run; raise it to at least {longest}")
        self._whole: Any = None  # the tokenizer without truncation, made on first use
        self.metrics = ServeMetrics(lambda: self.backend.queued, self._memory_in_use)
        self.backend: EmbeddingEngine | EngineClient
        if engine is not None:
            if runtime is not None:
                raise HeteroError("EmbeddingServer: give runtime= or engine=, not both (the engine process owns "
                                  "the runtime)")
            self.backend = engine
        else:
            self.backend = EmbeddingEngine(
                self.model, runtime=runtime, int8=s.int8, max_batch_tokens=s.max_batch_tokens,
                max_queued=s.max_queued, max_in_flight=s.max_in_flight, max_wait=s.max_wait,
                precapture=s.precapture, on_batch=self.metrics.on_batch, on_batch_done=self.metrics.on_batch_done,
                gauges=self.metrics.set_gauges if self.metrics.multiprocess else None)

    # -- the settings, by their old names --------------------------------------------------------
    @property
    def int8(self) -> bool:
        return self.settings.int8

    @property
    def max_batch_tokens(self) -> int:
        return self.settings.max_batch_tokens

    @property
    def max_client_batch_size(self) -> int:
        return self.settings.max_client_batch_size

    @property
    def max_queued(self) -> int:
        return self.settings.max_queued

    @property
    def max_in_flight(self) -> int:
        return self.settings.max_in_flight

    @property
    def max_wait(self) -> float:
        return self.settings.max_wait

    @property
    def precapture(self) -> bool | None:
        """Whether the warm-up captures every batch shape (None until decided: off on a CPU adapter)."""
        backend = self.backend
        return backend.precapture if isinstance(backend, EmbeddingEngine) else self.settings.precapture

    # -- the application's routes ----------------------------------------------------------------
    async def post(self, path: str, body: bytes) -> Response:
        """``POST /v1/embeddings`` (the only POST route)."""
        return await self._respond(body)

    # -- state ----------------------------------------------------------------------------------
    @property
    def runtime(self) -> hetero.Runtime | None:
        """The in-process engine's Runtime (None with an engine process)."""
        return self.backend.runtime if isinstance(self.backend, EmbeddingEngine) else None

    @property
    def service(self) -> EmbeddingService | None:
        """The in-process engine's batcher service (None with an engine process, or before ``running()``)."""
        return self.backend.service if isinstance(self.backend, EmbeddingEngine) else None

    @property
    def ready(self) -> bool:
        return self.backend.ready

    @property
    def lost(self) -> str | None:
        """Why the device (or the engine process) is gone; None while it works."""
        return self.backend.lost

    @property
    def warmup_error(self) -> str | None:
        return self.backend.warmup_error

    @property
    def adapter(self) -> str | None:
        return self.backend.adapter

    def info(self) -> dict[str, Any]:
        """What ``GET /info`` answers."""
        s = self.settings
        return {
            "model": self.model_name, "dimension": self.model.dim,
            "max_input_tokens": self.model.config.max_seq_length, "int8": s.int8, "adapter": self.adapter,
            "ready": self.ready, "max_batch_tokens": s.max_batch_tokens,
            "max_client_batch_size": s.max_client_batch_size, "max_queued_inputs": s.max_queued,
            "max_batches_in_flight": s.max_in_flight, "max_wait_ms": s.max_wait * 1e3,
            "precapture": self.precapture, "warmup": self.backend.warmup_progress,  # shapes done of total, seconds
            "max_request_bytes": s.max_request_bytes,
            "auto_truncate": s.auto_truncate, "models": list(s.model_ids),
            "http_server": self.http_server, "hetero_version": hetero.__version__, "worker_pid": os.getpid(),
        }

    # -- lifecycle ----------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[EmbeddingServer]:
        """Start (warm-up in the background: /health says when it is done); on exit, :meth:`stop`,
        then close the batcher (and the own runtime)."""
        self.open_lifecycle()
        async with self.backend.running():
            try:
                yield self
            finally:
                with anyio.CancelScope(shield=True):
                    await self.stop()

    def capture_entries(self) -> int:
        """The own runtime's ``capture_cache``: every GPU stage at every packed shape, twice over."""
        if isinstance(self.backend, EmbeddingEngine):
            return self.backend.capture_entries()
        return 0

    def _memory_in_use(self) -> int:
        return self.backend.memory_in_use() if isinstance(self.backend, EmbeddingEngine) else 0

    # -- the embeddings route -----------------------------------------------------------------------
    async def _respond(self, raw: bytes) -> Response:
        """The answer to one ``/v1/embeddings`` request body."""
        t0 = time.perf_counter()
        self.begin_request()
        status = 200
        try:
            try:
                why = self.unavailable_reason()
                if why is not None:
                    raise unavailable(why)
                return Response(200, [JSON_HEADER], await self._embed(self._parse(raw)))
            except RequestError as e:
                status = e.status
                return e.response()
            except Exception:
                status = 500
                raise
        finally:
            self.end_request()
            self.metrics.requests.labels(code=str(status)).inc()
            self.metrics.duration.observe(time.perf_counter() - t0)

    def _parse(self, raw: bytes) -> _Ask:
        """What a request body asks for; RequestError for a bad one.

        orjson reads well-formed requests (strings read the same); a body it refuses or that
        fails a check is read again by the standard library, whose reading of numbers (NaN,
        integers past 64 bits: token ids) the error messages follow.
        """
        if _orjson is not None:
            try:
                return self._check(_orjson.loads(raw))
            except (ValueError, RequestError):
                pass
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise RequestError(400, f"the request body is not valid JSON: {e}") from None
        return self._check(body)

    def _check(self, body: Any) -> _Ask:
        if not isinstance(body, dict):
            raise RequestError(400, f"the request body must be a JSON object, got {type(body).__name__}")
        if "input" not in body:
            raise RequestError(400, "'input' is required: a string or a list of strings", "input")
        inp = body["input"]
        texts = [inp] if isinstance(inp, str) else inp
        if not isinstance(texts, list):
            raise RequestError(400, f"'input' must be a string or a list of strings, got {type(inp).__name__}",
                               "input")
        if not texts:
            raise RequestError(400, "'input' must not be empty", "input")
        for i, t in enumerate(texts):
            if isinstance(t, str):
                if not t:
                    raise RequestError(400, f"'input[{i}]' is an empty string; send non-empty text", "input")
                if not t.isascii():
                    try:
                        t.encode("utf-8")
                    except UnicodeEncodeError as e:
                        raise RequestError(400, f"'input[{i}]' is not valid Unicode text: a lone surrogate "
                                           f"{t[e.start]!r} at character {e.start}", "input") from None
                continue
            if token_id(t) or (isinstance(t, list) and all(token_id(x) for x in t)):
                raise RequestError(400, "'input' holds token ids: token arrays are not supported, send strings",
                                   "input")
            raise RequestError(400, f"'input[{i}]' must be a string, got {type(t).__name__}", "input")
        limit = self.settings.max_client_batch_size
        if len(texts) > limit:
            raise RequestError(413, f"'input' has {len(texts)} strings, more than this server's "
                               f"max_client_batch_size of {limit}; split the request", "input")
        self.check_model(body)
        fmt = body.get("encoding_format", "float")
        if fmt is None:
            fmt = "float"
        if fmt not in ("float", "base64"):
            raise RequestError(400, f"'encoding_format' must be 'float' or 'base64', got {fmt!r}",
                               "encoding_format")
        dims = body.get("dimensions")
        width = self.model.dim
        if dims is not None and (not token_id(dims) or not 1 <= dims <= width):
            raise RequestError(400, f"'dimensions' must be an integer from 1 to the model's {width}, got "
                               f"{dims!r}", "dimensions")
        truncate = body.get("truncate", False)
        if not isinstance(truncate, bool):
            raise RequestError(400, f"'truncate' must be true or false, got {truncate!r}", "truncate")
        return _Ask(texts, fmt, dims, truncate or self.settings.auto_truncate)

    async def _embed(self, ask: _Ask) -> bytes:
        texts = self._check_long(ask.texts, ask.truncate)
        ids = await self._tokenize(texts)
        if not ask.truncate:
            self._check_truncated(texts, ids)
        try:
            emb = await self.backend.embed_ids(ids)
        except EngineError as e:
            raise RequestError(e.status, e.message, type_="rate_limit_error" if e.status == 429 else "server_error",
                               code=e.code) from None
        if ask.dimensions is not None and ask.dimensions < emb.shape[1]:
            # sentence-transformers' truncate_dim, then unit length again
            emb = emb[:, :ask.dimensions]
            emb = emb / np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)
        self.metrics.inputs.inc(len(texts))
        return encode_embeddings(emb, ask.fmt, self.model_name, sum(len(x) for x in ids))

    # -- inputs past the model's longest ------------------------------------------------------------
    def _untruncated(self) -> Any:
        """The model's tokenizer without its truncation (made once)."""
        if self._whole is None:
            from tokenizers import Tokenizer

            whole = Tokenizer.from_str(self.model.tokenizer.to_str())
            whole.no_truncation()
            self._whole = whole
        return self._whole

    def _too_long(self, i: int, tokens: str) -> RequestError:
        limit = self.model.config.max_seq_length
        return RequestError(413, f"'input[{i}]' has {tokens} tokens, more than the model's maximum of {limit}; "
                            f"shorten it, or send \"truncate\": true to embed its first {limit} tokens", "input",
                            code="input_too_long")

    def _check_long(self, texts: list[str], truncate: bool) -> list[str]:
        """Texts past :data:`PREFIX_CHARS` measured on their prefix (cut at a space): too long, 413
        (unless ``truncate``: then the prefix, whose first tokens are the text's, stands in)."""
        if all(len(t) <= PREFIX_CHARS for t in texts):
            return texts
        limit = self.model.config.max_seq_length
        out = list(texts)
        for i, t in enumerate(texts):
            if len(t) <= PREFIX_CHARS:
                continue
            cut = t.rfind(" ", 0, PREFIX_CHARS)
            if cut <= 0:
                continue  # no word boundary to cut at: measured whole, after tokenizing
            n = len(self._untruncated().encode(t[:cut]).ids)
            if n > limit:
                if not truncate:
                    raise self._too_long(i, f"more than {n}")
                out[i] = t[:cut]
        return out

    def _check_truncated(self, texts: list[str], ids: list[np.ndarray]) -> None:
        """413 for a text whose ids the tokenizer cut at the model's maximum."""
        limit = self.model.config.max_seq_length
        for i, row in enumerate(ids):
            if len(row) >= limit:
                n = len(self._untruncated().encode(texts[i]).ids)
                if n > limit:
                    raise self._too_long(i, str(n))


@dataclasses.dataclass(frozen=True)
class _Ask:
    """What one embeddings request asks for, checked."""

    texts: list[str]
    fmt: str
    dimensions: int | None
    truncate: bool


def encode_embeddings(emb: np.ndarray, fmt: str, model: str, tokens: int, *, fast: bool = True) -> bytes:
    """The ``/v1/embeddings`` response body for the rows of ``emb`` (float32 ``[n, dim]``).

    ``fmt`` ``"float"``: JSON numbers, each the shortest text that reads back as the same
    float32 with orjson (when installed and ``fast``; else the float64 value of it,
    with the standard library); ``"base64"``: little-endian float32 bytes.
    """
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    if fmt == "base64":
        le = emb.astype("<f4", copy=False)
        data: list[dict[str, Any]] = [
            {"object": "embedding", "index": i, "embedding": base64.b64encode(row.tobytes()).decode("ascii")}
            for i, row in enumerate(le)]
        if fast and _orjson is not None:
            return bytes(_orjson.dumps({"object": "list", "data": data, "model": model, "usage": usage}))
    elif fast and _orjson is not None:
        data = [{"object": "embedding", "index": i, "embedding": row} for i, row in enumerate(emb)]
        return bytes(_orjson.dumps({"object": "list", "data": data, "model": model, "usage": usage},
                                   option=_orjson.OPT_SERIALIZE_NUMPY))
    else:
        data = [{"object": "embedding", "index": i, "embedding": row}
                for i, row in enumerate(emb.astype(np.float64).tolist())]
    return json.dumps({"object": "list", "data": data, "model": model, "usage": usage},
                      separators=(",", ":")).encode()
