"""The application behind ``hetero serve``: routes, request checks and answers, for any HTTP server.

:class:`EmbeddingServer` holds the server's state (the engine it embeds with, draining,
requests in flight, metrics) and answers one request at a time through :meth:`~EmbeddingServer.handle`:
method, path, body in; status, headers, body out. Two thin adapters put it behind an HTTP
server: ``app`` is an ASGI application (hypercorn, and httpx's ASGI transport in tests) and
``__rsgi__`` is an RSGI application (granian, which parses HTTP outside the interpreter).
Both call the same ``handle``, so every answer is the same bytes on both servers.

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
import functools
import hmac
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
import numpy as np

import hetero
from hetero.errors import HeteroError

from .embed_service import EmbeddingService
from .embed_tokens import TokenGroups
from .minilm import Model
from .serve_engine import EmbeddingEngine, EngineClient, EngineError
from .serve_metrics import ServeMetrics, import_serve

_orjson: Any
try:  # optional: serializes float32 rows ~20x faster than the standard library (the "float" format)
    import orjson as _orjson
except ImportError:  # pragma: no cover - depends on the environment
    _orjson = None

__all__ = ["EmbeddingServer", "RequestError", "Response", "ServeSettings", "encode_embeddings"]

# Retry-After (seconds) of a 429 and a 503: about one batch's time, rounded up to what the header can say.
RETRY_AFTER_S = 1

_JSON = ("content-type", "application/json")
_EMBEDDINGS = frozenset(("/v1/embeddings", "/embeddings"))
# path -> the one method it answers
_ROUTES = {"/v1/embeddings": "POST", "/embeddings": "POST", "/v1/models": "GET", "/models": "GET", "/health": "GET",
           "/info": "GET", "/metrics": "GET"}
# Texts longer than this many characters are first measured on a prefix (cut at a space), so that
# a megabyte string is not tokenized whole to learn that it is too long.
PREFIX_CHARS = 16384

log = logging.getLogger("hetero.serve")


def _dumps(obj: Any) -> bytes:
    """Compact JSON bytes."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


@dataclasses.dataclass(frozen=True)
class ServeSettings:
    """What ``hetero serve`` is told, checked once: the model and the batcher's and fronts' limits.

    Picklable (the model as a name or path): the supervisor hands it to every front and
    engine process. ``max_batch_tokens`` is also checked against the model's longest input
    where the model is loaded (:class:`EmbeddingServer`). Every bad value raises
    :class:`~hetero.errors.HeteroError` naming the option.
    """

    model: str = "minilm"
    model_name: str | None = None
    int8: bool = False
    max_batch_tokens: int = 16384
    max_client_batch_size: int = 2048
    max_queued: int = 4096
    max_in_flight: int = 2
    max_wait: float = 0.0
    precapture: bool | None = None
    max_request_bytes: int = 2 * 1024 * 1024
    auto_truncate: bool = False
    served_model_names: tuple[str, ...] = ()
    api_key: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise HeteroError(f"the model must be a directory or 'minilm', got {self.model!r}")
        for name in ("max_batch_tokens", "max_client_batch_size", "max_queued", "max_in_flight", "max_request_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise HeteroError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        wait = self.max_wait
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait < 60:
            raise HeteroError(f"max_wait must be seconds from 0 to below 60 (--max-wait takes milliseconds), "
                              f"got {wait!r}")
        object.__setattr__(self, "max_wait", float(wait))
        object.__setattr__(self, "int8", bool(self.int8))
        object.__setattr__(self, "auto_truncate", bool(self.auto_truncate))
        if self.precapture is not None:
            object.__setattr__(self, "precapture", bool(self.precapture))
        names = tuple(self.served_model_names)
        if any(not isinstance(n, str) or not n for n in names):
            raise HeteroError(f"--served-model-name must be non-empty names, got {list(names)!r}")
        object.__setattr__(self, "served_model_names", names)
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise HeteroError("--api-key must be a non-empty string")

    @functools.cached_property
    def served_name(self) -> str:
        """The model's name in answers: the first served name, else ``model_name``, else the
        directory's name (or the name given, such as ``"minilm"``)."""
        if self.served_model_names:
            return self.served_model_names[0]
        if self.model_name:
            return self.model_name
        return self.model if not os.path.isdir(self.model) else os.path.basename(os.path.normpath(self.model))

    @functools.cached_property
    def model_ids(self) -> tuple[str, ...]:
        """The ids a request's ``model`` may name (``GET /v1/models`` lists them); found once, as
        requests check against them."""
        return self.served_model_names or (self.served_name,)

    def __repr__(self) -> str:  # the key stays out of logs and tracebacks
        fields = ", ".join(f"{f.name}={'<set>' if f.name == 'api_key' and self.api_key else getattr(self, f.name)!r}"
                           for f in dataclasses.fields(self))
        return f"ServeSettings({fields})"


class RequestError(Exception):
    """A request the server refuses: HTTP status, OpenAI error type, message, offending parameter."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_
        self.code = code

    def response(self) -> Response:
        headers = [_JSON]
        if self.status in (429, 503):
            headers.append(("retry-after", str(RETRY_AFTER_S)))
        elif self.status == 405 and self.param is not None:
            headers.append(("allow", self.param))
        param = None if self.status == 405 else self.param
        body = _dumps({"error": {"message": self.message, "type": self.type, "param": param, "code": self.code}})
        return Response(self.status, headers, body)


@dataclasses.dataclass(frozen=True)
class Response:
    """One answer: status, headers (lowercase names; the HTTP server adds content-length) and body."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes


class EmbeddingServer:
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
        self.settings = s = settings
        self.model = get_model(model)
        self._tokenize = TokenGroups(self.model)  # concurrent requests' texts in one tokenizer call
        self.model_name = s.served_name
        longest = self.model.config.max_seq_length
        if s.max_batch_tokens < longest:
            raise HeteroError(f"--max-batch-tokens {s.max_batch_tokens} is below the model's max_seq_length "
                              f"({longest}): a longest sentence could never run; raise it to at least {longest}")
        self.http_server = http_server
        self._started = int(time.time())
        self._whole: Any = None  # the tokenizer without truncation, made on first use
        self.draining = False
        self.active = 0  # requests being served
        self._idle: anyio.Event | None = None
        self._stop: anyio.Event | None = None
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

    # -- the HTTP servers' entry points ---------------------------------------------------------
    async def app(self, scope: Any, receive: Any, send: Any) -> None:
        """The ASGI application (lifespan events are acknowledged: the runner starts the server)."""
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                kind = message["type"].rsplit(".", 1)[-1]  # startup or shutdown
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        if scope["type"] != "http":
            return  # websockets: not served (the connection closes)
        method, path = scope["method"], scope["path"]
        headers = dict(scope["headers"])
        auth, length = headers.get(b"authorization"), headers.get(b"content-length")
        r = self.refuse_early(method, path, auth.decode("latin-1") if auth is not None else None,
                              length.decode("latin-1") if length is not None else None)
        if r is None:
            chunks, size, limit = [], 0, self.settings.max_request_bytes
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return  # the client left before sending its body: nothing to answer
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:  # a chunked body past the limit: cut off here
                    r = self._too_large(f"more than {limit}")
                    break
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
            if r is None:
                r = await self.handle(method, path, b"".join(chunks), checked=True)
        out = [(b"content-length", str(len(r.body)).encode()),
               *((k.encode("latin-1"), v.encode("latin-1")) for k, v in r.headers)]
        await send({"type": "http.response.start", "status": r.status, "headers": out})
        await send({"type": "http.response.body", "body": r.body})

    async def __rsgi__(self, scope: Any, proto: Any) -> None:
        """The RSGI application (granian): the same answers as ``app``."""
        if scope.proto != "http":
            return  # websockets: not served
        method, path, headers = scope.method, scope.path, scope.headers
        r = self.refuse_early(method, path, headers.get("authorization"), headers.get("content-length"))
        if r is None:
            chunks, size, limit = [], 0, self.settings.max_request_bytes
            async for chunk in proto:
                size += len(chunk)
                if size > limit:
                    r = self._too_large(f"more than {limit}")
                    break
                chunks.append(chunk)
            if r is None:
                r = await self.handle(method, path, b"".join(chunks), checked=True)
        proto.response_bytes(r.status, r.headers, r.body)

    def refuse_early(self, method: str, path: str, authorization: str | None,
                     content_length: str | None) -> Response | None:
        """The answer to a request that is refused before its body is read (wrong key, body too
        large by its ``Content-Length``), else None."""
        if self.settings.api_key is not None and path != "/health" and not self._authorized(authorization):
            return RequestError(401, "a valid API key is required: send the header 'Authorization: Bearer KEY'",
                                type_="invalid_request_error", code="invalid_api_key").response()
        if content_length is not None:
            try:
                n = int(content_length)
            except ValueError:
                return RequestError(400, f"the Content-Length header is not a number: {content_length!r}"
                                    ).response()
            if n > self.settings.max_request_bytes:
                return self._too_large(str(n))
        return None

    def _authorized(self, authorization: str | None) -> bool:
        key = self.settings.api_key
        assert key is not None
        scheme, _, given = (authorization or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())

    def _too_large(self, size: str) -> Response:
        limit = self.settings.max_request_bytes
        self.metrics.requests.labels(code="413").inc()
        return RequestError(413, f"the request body has {size} bytes, more than this server's max_request_bytes "
                            f"of {limit}; split the request", code="request_too_large").response()

    async def handle(self, method: str, path: str, body: bytes, *, authorization: str | None = None,
                     checked: bool = False) -> Response:
        """The answer to one request. ``checked``: :meth:`refuse_early` already passed it (the HTTP
        entry points call it before reading the body); else the key and the size are checked here."""
        if not checked:
            early = self.refuse_early(method, path, authorization, None)
            if early is not None:
                return early
            if len(body) > self.settings.max_request_bytes:
                return self._too_large(str(len(body)))
        try:
            return await self._route(method, path, body)
        except Exception:  # noqa: BLE001 - any failure is a 500 with a body and a logged request id
            rid = uuid.uuid4().hex
            log.exception("hetero serve: request %s (%s %s) failed", rid, method, path)
            return Response(500, [_JSON, ("x-request-id", rid)], _dumps({"error": {
                "message": f"the server failed to answer this request (request id {rid}, in the server's log)",
                "type": "server_error", "param": None, "code": "internal_error"}}))

    async def _route(self, method: str, path: str, body: bytes) -> Response:
        if path in _EMBEDDINGS and method == "POST":
            return await self._respond(body)
        want = _ROUTES.get(path)
        if want is None:
            return RequestError(404, f"no route {path!r}: this server answers {', '.join(_ROUTES)}",
                                code="not_found").response()
        if method != want:
            return RequestError(405, f"{path} takes {want}, not {method}", want, code="method_not_allowed"
                                ).response()
        if path == "/health":
            why = self._unavailable()
            if why is not None:
                return Response(503, [_JSON], _dumps({"status": "unavailable", "reason": why}))
            return Response(200, [_JSON], _dumps({"status": "ok"}))
        if path == "/info":
            return Response(200, [_JSON], _dumps(self.info()))
        if path in ("/v1/models", "/models"):
            return Response(200, [_JSON], _dumps({"object": "list", "data": [
                {"id": name, "object": "model", "created": self._started, "owned_by": "hetero"}
                for name in self.settings.model_ids]}))
        return Response(200, [("content-type", self.metrics.prom.CONTENT_TYPE_LATEST)], self.metrics.render())

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
            "precapture": self.precapture, "max_request_bytes": s.max_request_bytes,
            "auto_truncate": s.auto_truncate, "models": list(s.model_ids),
            "http_server": self.http_server, "hetero_version": hetero.__version__, "worker_pid": os.getpid(),
        }

    # -- lifecycle ----------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[EmbeddingServer]:
        """Start (warm-up in the background: /health says when it is done); on exit, :meth:`stop`,
        then close the batcher (and the own runtime)."""
        self._idle = anyio.Event()
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

    async def wait_ready(self) -> None:
        """Wait until warm-up ended (ready, or failed: see ``warmup_error``)."""
        while not self.ready and self.warmup_error is None and self.lost is None:
            await anyio.sleep(0.01)

    async def stop(self) -> None:
        """New requests get 503; wait for the requests in flight (``running()`` then closes the engine)."""
        self.draining = True
        if self.active and self._idle is not None:
            await self._idle.wait()

    def shutdown(self) -> None:
        """Begin a graceful shutdown: new requests get 503 from now on; the runner stops listening
        once the requests in flight have finished (:meth:`stop`)."""
        self.draining = True
        self.stop_event().set()

    def stop_event(self) -> anyio.Event:
        """Set by :meth:`shutdown`: the runner then drains (:meth:`stop`) and stops its HTTP server."""
        if self._stop is None:
            self._stop = anyio.Event()
        return self._stop

    def _memory_in_use(self) -> int:
        return self.backend.memory_in_use() if isinstance(self.backend, EmbeddingEngine) else 0

    # -- the embeddings route -----------------------------------------------------------------------
    def _unavailable(self) -> str | None:
        if self.draining:
            return "the server is shutting down; retry on another instance"
        if self.lost is not None:
            return f"{self.lost}; restart the server"
        if self.warmup_error is not None:
            return f"the server failed to warm up: {self.warmup_error}"
        if not self.ready:
            return "the server is warming up (compiling kernels, uploading weights); retry shortly"
        return None

    async def _respond(self, raw: bytes) -> Response:
        """The answer to one ``/v1/embeddings`` request body."""
        t0 = time.perf_counter()
        self.active += 1
        status = 200
        try:
            try:
                why = self._unavailable()
                if why is not None:
                    raise RequestError(503, why, type_="server_error", code="unavailable")
                return Response(200, [_JSON], await self._embed(self._parse(raw)))
            except RequestError as e:
                status = e.status
                return e.response()
            except Exception:
                status = 500
                raise
        finally:
            self.active -= 1
            self.metrics.requests.labels(code=str(status)).inc()
            self.metrics.duration.observe(time.perf_counter() - t0)
            if self.active == 0 and self.draining and self._idle is not None:
                self._idle.set()

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
            if _token_id(t) or (isinstance(t, list) and all(_token_id(x) for x in t)):
                raise RequestError(400, "'input' holds token ids: token arrays are not supported, send strings",
                                   "input")
            raise RequestError(400, f"'input[{i}]' must be a string, got {type(t).__name__}", "input")
        limit = self.settings.max_client_batch_size
        if len(texts) > limit:
            raise RequestError(413, f"'input' has {len(texts)} strings, more than this server's "
                               f"max_client_batch_size of {limit}; split the request", "input")
        model = body.get("model")
        if model is not None:
            if not isinstance(model, str):
                raise RequestError(400, f"'model' must be a string, got {type(model).__name__}", "model")
            if model not in self.settings.model_ids:
                raise RequestError(404, f"the model {model!r} does not exist on this server; it serves "
                                   f"{', '.join(map(repr, self.settings.model_ids))} (GET /v1/models)", "model",
                                   code="model_not_found")
        fmt = body.get("encoding_format", "float")
        if fmt is None:
            fmt = "float"
        if fmt not in ("float", "base64"):
            raise RequestError(400, f"'encoding_format' must be 'float' or 'base64', got {fmt!r}",
                               "encoding_format")
        dims = body.get("dimensions")
        width = self.model.dim
        if dims is not None and (not _token_id(dims) or not 1 <= dims <= width):
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


def _token_id(v: object) -> bool:
    """An int as OpenAI's token arrays hold them (JSON true and false are no token ids)."""
    return isinstance(v, int) and not isinstance(v, bool)


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
