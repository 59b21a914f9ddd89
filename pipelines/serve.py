"""``hetero serve``: an OpenAI-compatible embeddings server (Starlette app, served by hypercorn).

Needs the optional extra ``hetero[serve]`` (starlette, hypercorn, prometheus-client).

Routes:

- ``POST /v1/embeddings``: ``{"input": str | [str, ...], "model": str, "encoding_format":
  "float" | "base64"}`` -> ``{"object": "list", "data": [{"object": "embedding", "index": i,
  "embedding": [...] | "<base64 of little-endian float32>"}], "model": ..., "usage":
  {"prompt_tokens": n, "total_tokens": n}}`` (tokens counted with ``[CLS]`` and ``[SEP]``).
  Errors have OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400 for bad
  JSON, empty input, non-strings and token arrays; 413 past ``max_client_batch_size``
  inputs; 429 (``Retry-After``) when the batcher's queue is full; 503 while warming up,
  after the GPU device was lost, and while shutting down.
- ``GET /health``: 200 once warmed up; 503 before, after a DeviceLostError, and while
  shutting down.
- ``GET /info``: model, dimension, max input tokens, adapter, limits.
- ``GET /metrics``: Prometheus text (``hetero_embed_*`` counters and histograms, queue and
  GPU memory gauges).

Each sentence of a request is one item of the :class:`~hetero.pipelines.embed.EmbeddingService`
batcher: concurrent requests share GPU batches (continuous batching under a padded-token
budget, ``max_batch_tokens``), packed (no padding between sentences) to bucketed shapes
whose GPU stages the warm-up captured (``precapture``), so that every batch replays them.
Shutdown (SIGTERM, Ctrl-C): new requests get 503, requests in flight finish, then the
runtime closes.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import gc
import json
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TextIO

import anyio
import numpy as np

import hetero
from hetero.errors import HeteroError
from hetero.lowlevel import running_loop

from .cli import positive_int
from .embed import EmbeddingService, TokenGroups
from .minilm import Model
from .serve_engine import EmbeddingEngine, EngineClient, EngineError
from .serve_metrics import ServeMetrics, import_serve

_orjson: Any
try:  # optional: serializes float32 rows ~20x faster than the standard library (the "float" format)
    import orjson as _orjson
except ImportError:  # pragma: no cover - depends on the environment
    _orjson = None

__all__ = ["EmbeddingServer", "RequestError", "add_parser", "encode_embeddings", "listen_socket", "run", "serve",
           "serve_async", "serve_workers"]

_EMBEDDING_PATHS = frozenset(("/v1/embeddings", "/embeddings"))


def _dumps(obj: Any) -> bytes:
    """Compact JSON bytes, as Starlette's JSONResponse writes them."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


# Retry-After (seconds) of a 429: about one batch's time, rounded up to what the header can say.
RETRY_AFTER_S = 1


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


class EmbeddingServer:
    """The server's state and its ASGI ``app``: a direct embeddings route before the Starlette ``routes``.

    ``model``: a loaded Model, a model directory or ``"minilm"``. ``runtime``: a
    :class:`hetero.Runtime` to use (left open at the end); by default the server makes
    one when it starts and closes it when it stops. ``engine``: the link to an engine
    process (:class:`~hetero.pipelines.serve_engine.EngineClient`) that embeds for this
    server, which then only parses, tokenizes and answers (``--workers``); by default the
    engine runs in this process. ``running()`` starts (warm-up in the background) and stops it;
    the app's lifespan uses it.
    """

    def __init__(self, model: Model | str | os.PathLike[str] = "minilm", *, runtime: hetero.Runtime | None = None,
                 model_name: str | None = None, int8: bool = False, max_batch_tokens: int = 16384,
                 max_client_batch_size: int = 2048, max_queued: int = 4096, max_in_flight: int = 2,
                 max_wait: float = 0.0, precapture: bool = True, engine: EngineClient | None = None) -> None:
        import_serve()
        from starlette.applications import Starlette
        from starlette.routing import Route

        from .embed import get_model

        self.model = get_model(model)
        self._tokenize = TokenGroups(self.model)  # concurrent requests' texts in one tokenizer call
        self.model_name = model_name or (str(model) if isinstance(model, (str, os.PathLike)) else "hetero-embed")
        if isinstance(model, (str, os.PathLike)) and str(model) != "minilm":
            self.model_name = model_name or os.path.basename(os.path.normpath(str(model)))
        self.int8 = bool(int8)
        longest = self.model.config.max_seq_length
        if max_batch_tokens < longest:
            raise HeteroError(f"--max-batch-tokens {max_batch_tokens} is below the model's max_seq_length "
                              f"({longest}): a longest sentence could never run; raise it to at least {longest}")
        self.max_batch_tokens = max_batch_tokens
        self.max_client_batch_size = max_client_batch_size
        self.max_queued = max_queued
        self.max_in_flight = max_in_flight
        if isinstance(max_wait, bool) or not isinstance(max_wait, (int, float)) or not 0 <= max_wait < 60:
            raise HeteroError(f"max_wait must be seconds from 0 to below 60 (--max-wait takes milliseconds), "
                              f"got {max_wait!r}")
        self.max_wait = float(max_wait)
        self.precapture = bool(precapture)
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
                self.model, runtime=runtime, int8=self.int8, max_batch_tokens=max_batch_tokens,
                max_queued=max_queued, max_in_flight=max_in_flight, max_wait=max_wait, precapture=self.precapture,
                on_batch=self.metrics.on_batch, on_batch_done=self.metrics.on_batch_done,
                gauges=self.metrics.set_gauges if self.metrics.multiprocess else None)

        self.routes = Starlette(routes=[
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
            Route("/embeddings", self.embeddings, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/info", self.info, methods=["GET"]),
            Route("/metrics", self.metrics_route, methods=["GET"]),
        ], lifespan=self._lifespan)

    async def app(self, scope: Any, receive: Any, send: Any) -> None:
        """The ASGI app: ``POST /v1/embeddings`` (and ``/embeddings``) directly, everything else through
        the Starlette routes (``self.routes``).

        The embeddings route skips Starlette's middleware, routing and request/response objects
        (the per-request host time of the busiest route); its responses are the same bytes.
        """
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in _EMBEDDING_PATHS:
            chunks = []
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return  # the client left before sending its body: nothing to answer
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    break
            status, body, extra = await self._respond(b"".join(chunks))
            headers = [(b"content-length", str(len(body)).encode()), (b"content-type", b"application/json"),
                       *extra]
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        await self.routes(scope, receive, send)

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

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Any) -> AsyncIterator[None]:
        async with self.running():
            yield

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
        """Begin a graceful shutdown: new requests get 503; the listener stops once those in flight finish."""
        self.draining = True
        self.stop_event().set()

    def stop_event(self) -> anyio.Event:
        if self._stop is None:
            self._stop = anyio.Event()
        return self._stop

    def _memory_in_use(self) -> int:
        return self.backend.memory_in_use() if isinstance(self.backend, EmbeddingEngine) else 0

    # -- routes -----------------------------------------------------------------------------------
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

    async def health(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        why = self._unavailable()
        if why is not None:
            return JSONResponse({"status": "unavailable", "reason": why}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def info(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        c = self.model.config
        return JSONResponse({
            "model": self.model_name, "dimension": self.model.dim, "max_input_tokens": c.max_seq_length,
            "int8": self.int8, "adapter": self.adapter, "ready": self.ready,
            "max_batch_tokens": self.max_batch_tokens, "max_client_batch_size": self.max_client_batch_size,
            "max_queued_inputs": self.max_queued, "max_batches_in_flight": self.max_in_flight,
            "max_wait_ms": self.max_wait * 1e3,
            "hetero_version": hetero.__version__, "worker_pid": os.getpid(),
        })

    async def metrics_route(self, request: Any) -> Any:
        from starlette.responses import Response

        return Response(self.metrics.render(), media_type=self.metrics.prom.CONTENT_TYPE_LATEST)

    async def embeddings(self, request: Any) -> Any:
        """The embeddings route as a Starlette endpoint (``app`` answers it without Starlette)."""
        from starlette.responses import Response

        status, body, extra = await self._respond(await request.body())
        return Response(body, status_code=status, media_type="application/json",
                        headers={k.decode(): v.decode() for k, v in extra})

    async def _respond(self, raw: bytes) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        """Status, JSON body and extra headers of the answer to one ``/v1/embeddings`` request body."""
        t0 = time.perf_counter()
        self.active += 1
        status = 200
        try:
            try:
                why = self._unavailable()
                if why is not None:
                    raise RequestError(503, why, type_="server_error", code="unavailable")
                texts, fmt = self._parse(raw)
                return 200, await self._embed(texts, fmt), []
            except RequestError as e:
                status = e.status
                headers = [(b"retry-after", str(RETRY_AFTER_S).encode())] if e.status in (429, 503) else []
                return e.status, _dumps({"error": {"message": e.message, "type": e.type, "param": e.param,
                                                   "code": e.code}}), headers
            except Exception:
                status = 500
                raise
        finally:
            self.active -= 1
            self.metrics.requests.labels(code=str(status)).inc()
            self.metrics.duration.observe(time.perf_counter() - t0)
            if self.active == 0 and self.draining and self._idle is not None:
                self._idle.set()

    def _parse(self, raw: bytes) -> tuple[list[str], str]:
        """Texts and encoding format of a request body; RequestError for a bad one.

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

    def _check(self, body: Any) -> tuple[list[str], str]:
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
                continue
            if _token_id(t) or (isinstance(t, list) and all(_token_id(x) for x in t)):
                raise RequestError(400, "'input' holds token ids: token arrays are not supported, send strings",
                                   "input")
            raise RequestError(400, f"'input[{i}]' must be a string, got {type(t).__name__}", "input")
        if len(texts) > self.max_client_batch_size:
            raise RequestError(413, f"'input' has {len(texts)} strings, more than this server's "
                               f"max_client_batch_size of {self.max_client_batch_size}; split the request",
                               "input")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise RequestError(400, f"'model' must be a string, got {type(model).__name__}", "model")
        fmt = body.get("encoding_format", "float")
        if fmt is None:
            fmt = "float"
        if fmt not in ("float", "base64"):
            raise RequestError(400, f"'encoding_format' must be 'float' or 'base64', got {fmt!r}",
                               "encoding_format")
        return texts, fmt

    async def _embed(self, texts: list[str], fmt: str) -> bytes:
        ids = await self._tokenize(texts)
        try:
            emb = await self.backend.embed_ids(ids)
        except EngineError as e:
            raise RequestError(e.status, e.message, type_="rate_limit_error" if e.status == 429 else "server_error",
                               code=e.code) from None
        self.metrics.inputs.inc(len(texts))
        return encode_embeddings(emb, fmt, self.model_name, sum(len(x) for x in ids))


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


# -- serving ---------------------------------------------------------------------------------------------
def listen_socket(host: str, port: int, *, reuse_port: bool = False, listen: bool = True) -> socket.socket:
    """A TCP socket bound to ``host:port`` (0: an ephemeral port), for hypercorn to listen on.

    ``reuse_port``: SO_REUSEPORT, so that worker processes listen on one port and the kernel
    spreads connections over them.
    """
    import socket as socket_mod

    family = socket_mod.AF_INET6 if ":" in host else socket_mod.AF_INET
    sock = socket_mod.socket(family, socket_mod.SOCK_STREAM)
    try:
        sock.setsockopt(socket_mod.SOL_SOCKET, socket_mod.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket_mod.SOL_SOCKET, socket_mod.SO_REUSEPORT, 1)
        sock.bind((host, port))
        if listen:
            sock.listen(1024)  # connections made before hypercorn accepts wait in the backlog
    except OSError as e:
        sock.close()
        raise HeteroError(f"cannot listen on {host}:{port}: {e.strerror or e}; choose another --host or --port") \
            from e
    return sock


async def serve_async(server: EmbeddingServer, host: str = "127.0.0.1", port: int = 8080, *,
                      ready: Callable[[str], None] | None = None, graceful_timeout: float = 30.0,
                      signals: bool = True, reuse_port: bool = False, freeze_heap: bool = False) -> None:
    """Serve ``server.app`` with hypercorn on the running loop (asyncio or trio) until :meth:`~EmbeddingServer.shutdown`.

    ``signals``: SIGTERM and SIGINT call ``server.shutdown()``. ``ready(url)`` is called
    once the socket is bound (``port=0`` binds an ephemeral port; the URL names it).
    Shutdown is graceful: new requests get 503, requests in flight finish (up to
    ``graceful_timeout`` seconds), then the lifespan stops the server. ``freeze_heap``: the
    process is the server's alone; once warm-up is over, ``gc.freeze()``.
    """
    try:
        from hypercorn.config import Config
    except ImportError as e:
        raise HeteroError("hetero serve needs the optional extra 'serve' (hypercorn is not installed): "
                          "pip install 'hetero[serve]'") from e
    sock = listen_socket(host, port, reuse_port=reuse_port)
    bound_host, bound_port = sock.getsockname()[:2]
    config = Config()
    config.bind = [f"fd://{sock.detach()}"]  # hypercorn owns the descriptor from here on
    config.graceful_timeout = graceful_timeout
    config.startup_timeout = 600.0  # warm-up runs in the background; this covers the lifespan's start only
    config.keep_alive_timeout = 75.0  # load generators and proxies keep connections open between requests
    stop = server.stop_event()

    watching = anyio.CancelScope()  # cancelled once hypercorn has returned (the host task is never cancelled)
    freezing = anyio.CancelScope()  # the same, for a warm-up that never ended

    async def on_signal() -> None:
        with watching, anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as received:
            async for _ in received:  # a second signal must not kill the process mid-shutdown
                server.shutdown()

    async with anyio.create_task_group() as tg:
        if signals:
            tg.start_soon(on_signal)
        if freeze_heap:
            tg.start_soon(_freeze_heap_when_ready, server, freezing)
        if ready is not None:
            shown = f"[{bound_host}]" if ":" in bound_host else bound_host
            ready(f"http://{shown}:{bound_port}")
        if running_loop() == "trio":
            from hypercorn.trio import serve as hserve_trio

            await hserve_trio(server.app, config, shutdown_trigger=stop.wait)
        else:
            from hypercorn.asyncio import serve as hserve_asyncio

            await hserve_asyncio(server.app, config, shutdown_trigger=stop.wait)
        watching.cancel()
        freezing.cancel()


# The event loops a server runs on: asyncio's own, asyncio with uvloop's loop, trio; "auto" is
# uvloop where it is installed (the [serve] extra installs it where it builds), else asyncio.
BACKENDS = ("auto", "asyncio", "uvloop", "trio")


def resolve_backend(backend: str) -> str:
    """``backend`` (one of :data:`BACKENDS`) as the loop a server will run on: ``"auto"`` becomes
    ``"uvloop"`` where uvloop is installed, else ``"asyncio"``. HeteroError for an unknown name
    or for ``"uvloop"`` without uvloop."""
    import importlib.util

    if backend not in BACKENDS:
        raise HeteroError(f"--backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    have_uvloop = importlib.util.find_spec("uvloop") is not None
    if backend == "auto":
        return "uvloop" if have_uvloop else "asyncio"
    if backend == "uvloop" and not have_uvloop:
        raise HeteroError("--backend uvloop needs uvloop, which is not installed: pip install 'hetero[serve]' "
                          "(uvloop builds on Linux and macOS), or choose --backend asyncio")
    return backend


def run_on(backend: str, main: Callable[[], Any]) -> Any:
    """``anyio.run(main)`` on ``backend``'s event loop (:func:`resolve_backend` first)."""
    backend = resolve_backend(backend)
    if backend == "trio":
        return anyio.run(main, backend="trio")
    return anyio.run(main, backend="asyncio", backend_options={"use_uvloop": backend == "uvloop"})


def serve(server: EmbeddingServer, host: str = "127.0.0.1", port: int = 8080, backend: str = "auto",
          *, ready: Callable[[str], None] | None = None, graceful_timeout: float = 30.0,
          reuse_port: bool = False) -> None:
    """:func:`serve_async` on a new ``backend`` event loop (one of :data:`BACKENDS`), until SIGTERM
    or SIGINT.

    The process is the server's from here on: once warm-up is over, what start-up allocated
    is moved out of the garbage collector's reach (``gc.freeze()``).
    """
    run_on(backend, lambda: serve_async(server, host, port, ready=ready, graceful_timeout=graceful_timeout,
                                        reuse_port=reuse_port, freeze_heap=True))


async def _freeze_heap_when_ready(state: Any, scope: anyio.CancelScope | None = None) -> None:
    """Once ``state`` (a server or an engine) is ready, or its warm-up failed, ``gc.freeze()``.

    For a process that is the server's alone. What start-up allocated (the model, its
    tokenizer, compiled kernels, captured stages: tens of thousands of objects) moves out
    of the garbage collector's reach, so that its collections, which the objects of every
    request trigger, no longer scan it (about a tenth of an engine's host time per request
    on the CPU machine, BENCHMARKS.md). ``scope``: run inside it (cancelled when serving ends).
    """
    with scope if scope is not None else contextlib.nullcontext():
        while not state.ready and state.warmup_error is None and state.lost is None:
            await anyio.sleep(0.05)
        gc.collect()  # what is garbage now is not kept for good
        gc.freeze()


# The EmbeddingServer options an engine process takes (the others are the fronts').
_ENGINE_OPTIONS = ("int8", "max_batch_tokens", "max_queued", "max_in_flight", "max_wait", "precapture")


def _front_environment() -> None:
    """A front tokenizes on its own thread (a ``TOKENIZERS_PARALLELISM`` the user set is kept).

    A front tokenizes the few texts of one event-loop pass; the tokenizers package would spread
    them over a thread pool of its own (as many threads as cores) in every front, and with many
    fronts those threads wait for cores more than they work. The fronts are the parallelism.
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _front_main(options: dict[str, Any], host: str, port: int, backend: str, address_file: str, secret: bytes
                ) -> None:
    _front_environment()
    serve(EmbeddingServer(**options, engine=EngineClient(address_file, secret)), host, port, backend, reuse_port=True)


def _engine_main(options: dict[str, Any], address_file: str, secret: bytes, backend: str) -> None:
    from .embed import get_model

    metrics = ServeMetrics(lambda: 0, lambda: 0)  # several processes: the gauges are set, not read
    engine = EmbeddingEngine(get_model(options.get("model", "minilm")),
                             **{k: options[k] for k in _ENGINE_OPTIONS if k in options},
                             on_batch=metrics.on_batch, on_batch_done=metrics.on_batch_done,
                             gauges=metrics.set_gauges)

    # Ctrl-C reaches the whole process group: the fronts drain, and the parent sends this
    # process SIGTERM once they are done.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    async def main() -> None:
        async with engine.running(), anyio.create_task_group() as tg:
            tg.start_soon(_freeze_heap_when_ready, engine)
            await tg.start(engine.serve_fronts, address_file, secret)
            with anyio.open_signal_receiver(signal.SIGTERM) as received:
                async for _ in received:
                    break  # the fronts have drained (the parent stops them first): close
            tg.cancel_scope.cancel()

    run_on(backend, main)


def serve_workers(options: dict[str, Any], host: str, port: int, backend: str, workers: int,
                  ready: Callable[[str], None] | None = None, *, engines: int = 1) -> int:
    """Serve with ``workers`` HTTP front processes listening on one port (SO_REUSEPORT: the kernel
    spreads connections over them) and ``engines`` engine processes that embed for them.

    The fronts parse requests, tokenize and encode answers; an engine owns a Runtime (a
    device of its own) and the batcher, so the sentences of every front it serves share its
    GPU batches (:mod:`hetero.pipelines.serve_engine`). Front ``i`` uses engine ``i %
    engines``: one engine's host work is bound by one interpreter lock, several share the GPU.
    ``options`` are EmbeddingServer's keyword arguments (picklable: the model as a path).
    /metrics sums every process's counters, histograms and gauges; /health and /info answer
    for the front that took the connection. SIGTERM or SIGINT shut down gracefully: the fronts
    finish their requests in flight, then the engines stop. Returns 0, or 1 if a process
    exited on its own.
    """
    import multiprocessing
    import secrets
    import shutil
    import tempfile

    _check_engines(engines, workers)
    backend = resolve_backend(backend)  # an error here, not in each process
    probe = listen_socket(host, port, reuse_port=True, listen=False)  # a port that is taken fails here
    port = probe.getsockname()[1]
    private = tempfile.mkdtemp(prefix="hetero-serve-")  # mode 0700: the engines' addresses and the metric files
    metrics_dir = os.path.join(private, "metrics")
    os.mkdir(metrics_dir)
    addresses = [os.path.join(private, f"engine-{k}.port") for k in range(engines)]
    secret = secrets.token_bytes(32)
    saved_env = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # inherited by the processes before they import it
    ctx = multiprocessing.get_context("spawn")
    engine_procs = [ctx.Process(target=_engine_main, args=(options, addresses[k], secret, backend),
                                name="hetero-serve-engine" + (f"-{k}" if engines > 1 else ""))
                    for k in range(engines)]
    fronts = [ctx.Process(target=_front_main, args=(options, host, port, backend, addresses[i % engines], secret),
                          name=f"hetero-serve-{i}") for i in range(workers)]
    stopping = False

    def stop_fronts(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True
        _signal_all(fronts)

    previous = {sig: signal.signal(sig, stop_fronts) for sig in (signal.SIGINT, signal.SIGTERM)}
    status = 0
    try:
        for i, proc in enumerate([*engine_procs, *fronts]):
            try:
                proc.start()
            except Exception as e:
                # The processes started before it would serve on alone: stop them, fronts first.
                started_fronts = fronts[:max(0, i - engines)]
                for group in (started_fronts, engine_procs[:i]):
                    _signal_all(group)
                    _reap(group, graceful_timeout=_WORKER_STOP_S)
                what = f"engine process {proc.name}" if i < engines else \
                    f"worker process {proc.name} ({i - engines + 1} of {workers})"
                stopped = ""
                if i:
                    n_fronts, n_engines = len(started_fronts), min(i, engines)
                    them = [("the engine" if n_engines == 1 else f"the {n_engines} engines") if n_engines else "",
                            f"the {n_fronts} worker{'s' if n_fronts != 1 else ''}" if n_fronts else ""]
                    stopped = f"; stopped {' and '.join(t for t in them if t)} started before it"
                raise HeteroError(f"cannot start {what}: {type(e).__name__}: {e}{stopped}") from e
        probe.close()
        if ready is not None:
            shown = f"[{host}]" if ":" in host else host
            ready(f"http://{shown}:{port}")
        while any(proc.exitcode is None for proc in fronts):
            for proc in [*fronts, *engine_procs]:
                proc.join(0.1)
                if proc.exitcode is not None and not stopping:
                    print(f"hetero serve: {proc.name} exited with status {proc.exitcode}; stopping the others",
                          file=sys.stderr, flush=True)
                    status = 1
                    stop_fronts(signal.SIGTERM, None)
        _signal_all(engine_procs)  # every front has finished its requests: the engines may close
        _reap(engine_procs, graceful_timeout=_WORKER_STOP_S)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        probe.close()
        if saved_env is None:
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        else:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = saved_env
        shutil.rmtree(private, ignore_errors=True)
    return status


def _signal_all(procs: list[Any]) -> None:
    """SIGTERM to each of ``procs`` still running."""
    for proc in procs:
        if proc.pid is not None and proc.exitcode is None:
            try:
                os.kill(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


# How long a worker may take to shut down gracefully after SIGTERM before it is killed.
_WORKER_STOP_S = 60.0


def _reap(procs: list[Any], graceful_timeout: float) -> None:
    """Wait for ``procs`` (already sent SIGTERM) to exit; kill those still running after the timeout."""
    deadline = time.monotonic() + graceful_timeout
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.exitcode is None:
            proc.kill()
            proc.join()


def _token_id(v: object) -> bool:
    """An int as OpenAI's token arrays hold them (JSON true and false are no token ids)."""
    return isinstance(v, int) and not isinstance(v, bool)


# -- the command line --------------------------------------------------------------------------------------
def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``serve`` command to an ``argparse`` subparsers object; its ``func`` is :func:`run`."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "serve",
        help="an OpenAI-compatible embeddings server (POST /v1/embeddings) with dynamic batching",
        description="Serve sentence embeddings over HTTP: POST /v1/embeddings (OpenAI-compatible), GET /health, "
        "/info and /metrics (Prometheus). Concurrent requests share GPU batches under a padded-token budget. "
        "SIGTERM or Ctrl-C shut down gracefully. Needs pip install 'hetero[serve]'.",
    )
    p.add_argument("--model", required=True, metavar="DIR|minilm",
                   help="model directory (config.json, model.safetensors, tokenizer.json) or 'minilm'")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=_port, default=8080, help="port to listen on (default: %(default)s)")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="event loop the server runs on: asyncio, asyncio on uvloop's loop (less CPU time per "
                   "request), trio; auto: uvloop where installed, else asyncio (default: %(default)s)")
    p.add_argument("--max-batch-tokens", type=positive_int, default=16384, metavar="N",
                   help="padded tokens per batch: sentences x longest sentence (default: %(default)s)")
    p.add_argument("--max-client-batch-size", type=positive_int, default=2048, metavar="N",
                   help="most strings in one request; more get 413 (default: %(default)s)")
    p.add_argument("--max-queued", type=positive_int, default=4096, metavar="N",
                   help="sentences waiting for a batch before requests get 429 (default: %(default)s)")
    p.add_argument("--max-in-flight", type=positive_int, default=2, metavar="N",
                   help="batches an engine runs at once: the next forms while the GPU encodes these "
                   "(default: %(default)s)")
    p.add_argument("--max-wait", dest="max_wait_ms", type=_milliseconds, default=0.0, metavar="MS",
                   help="how long a batch may wait for more sentences after its first, unless full; 0: a batch "
                   "forms as soon as the engine can take it (default: %(default)s)")
    p.add_argument("--workers", type=positive_int, default=1, metavar="N",
                   help="HTTP front processes on the port (parsing, tokenizing, answering); with more than one, "
                   "they share one engine process that owns the GPU and batches the sentences of all of them; "
                   "/metrics sums them (default: %(default)s)")
    p.add_argument("--engines", type=positive_int, default=1, metavar="K",
                   help="engine processes behind the --workers fronts (front i uses engine i mod K), each with "
                   "a device of its own on the GPU: one engine's host work is bound by one interpreter lock "
                   "(default: %(default)s)")
    p.add_argument("--int8", action="store_true",
                   help="int8 weights for the encoder's linear layers (see hetero embed --int8)")
    p.add_argument("--no-precapture", dest="precapture", action="store_false",
                   help="warm up with one sentence instead of capturing every packed batch shape (faster start, "
                   "slower first batches of each shape)")
    p.set_defaults(func=run)
    return p


def _milliseconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value < 60_000:
        raise argparse.ArgumentTypeError(f"expected milliseconds from 0 to below 60000, got {text!r}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number in [0, 65535], got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number in [0, 65535], got {value}")
    return value


def _check_engines(engines: Any, workers: int) -> None:
    """``engines`` engine processes behind ``workers`` fronts: each engine serves at least one front."""
    if isinstance(engines, bool) or not isinstance(engines, int) or not 1 <= engines <= workers:
        raise HeteroError(f"--engines must be an integer from 1 to --workers ({workers}), got {engines!r}: each "
                          "engine serves at least one front; lower --engines or raise --workers")


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run ``hetero serve`` with parsed ``args`` until SIGTERM or Ctrl-C; return the exit status."""
    out = out if out is not None else sys.stdout
    options: dict[str, Any] = dict(model=args.model, int8=bool(args.int8), max_batch_tokens=args.max_batch_tokens,
                                   max_client_batch_size=args.max_client_batch_size, max_queued=args.max_queued,
                                   max_in_flight=int(getattr(args, "max_in_flight", 2)),
                                   max_wait=float(getattr(args, "max_wait_ms", 0.0)) / 1e3,
                                   precapture=bool(getattr(args, "precapture", True)))
    workers = int(getattr(args, "workers", 1))
    engines = int(getattr(args, "engines", 1))
    _check_engines(engines, workers)  # before the model loads
    backend = resolve_backend(getattr(args, "backend", "auto"))
    server = EmbeddingServer(**options)  # loads the model: a bad --model or limit fails here, once

    def ready(url: str) -> None:
        procs = f", {workers} front processes and " + ("an engine process" if engines == 1 else
                                                         f"{engines} engine processes") if workers > 1 else ""
        print(f"hetero serve: {server.model_name} ({server.model.dim}-d) on {url} ({backend}{procs}); "
              "warming up, GET /health says when ready", file=out, flush=True)

    if workers > 1:
        status = serve_workers(options, args.host, args.port, backend, workers, ready=ready, engines=engines)
    else:
        serve(server, args.host, args.port, backend, ready=ready)
        status = 0
    print("hetero serve: stopped", file=out, flush=True)
    return status
