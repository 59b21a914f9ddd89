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
budget, ``max_batch_tokens``), padded to bucketed shapes whose GPU stages the warm-up
captured (``precapture``), so that every batch replays them. Shutdown (SIGTERM, Ctrl-C): new requests get 503, requests in
flight finish, then the runtime closes.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
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
from hetero.errors import DeviceLostError, HeteroError, OverloadedError
from hetero.lowlevel import running_loop

from .cli import positive_int
from .embed import EmbeddingService, service_shapes
from .minilm import Model

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


def _import_serve() -> Any:
    try:
        import prometheus_client
        import starlette  # noqa: F401
    except ImportError as e:
        raise HeteroError(f"hetero serve needs the optional extra 'serve' ({e.name} is not installed): "
                          "pip install 'hetero[serve]'") from e
    return prometheus_client


class EmbeddingServer:
    """The server's state and its ASGI ``app``: a direct embeddings route before the Starlette ``routes``.

    ``model``: a loaded Model, a model directory or ``"minilm"``. ``runtime``: a
    :class:`hetero.Runtime` to use (left open at the end); by default the server makes
    one when it starts and closes it when it stops. ``running()`` starts (warm-up in the
    background) and stops it; the app's lifespan uses it.
    """

    def __init__(self, model: Model | str | os.PathLike[str] = "minilm", *, runtime: hetero.Runtime | None = None,
                 model_name: str | None = None, int8: bool = False, max_batch_tokens: int = 16384,
                 max_client_batch_size: int = 2048, max_queued: int = 4096, max_in_flight: int = 2,
                 precapture: bool = True) -> None:
        prom = _import_serve()
        from starlette.applications import Starlette
        from starlette.routing import Route

        from .embed import get_model

        self.model = get_model(model)
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
        self.precapture = bool(precapture)
        self._own_runtime = runtime is None
        self.runtime: hetero.Runtime | None = runtime
        self.service: EmbeddingService | None = None
        self.ready = False
        self.lost: str | None = None  # why the device is gone
        self.warmup_error: str | None = None
        self.draining = False
        self.adapter: str | None = None
        self.active = 0  # requests being served
        self._idle: anyio.Event | None = None
        self._stop: anyio.Event | None = None

        # With several worker processes (PROMETHEUS_MULTIPROC_DIR set before prometheus_client was
        # imported), every worker writes its samples to files there and /metrics sums them all;
        # the gauges are then refreshed by each worker (livesum), not read at scrape time.
        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        reg = self.registry = prom.CollectorRegistry()
        self.m_requests = prom.Counter("hetero_embed_requests", "Embedding requests by HTTP status code",
                                       ["code"], registry=reg)
        self.m_inputs = prom.Counter("hetero_embed_inputs", "Sentences embedded", registry=reg)
        self.m_batches = prom.Counter("hetero_embed_batches", "Batches formed by the batcher", registry=reg)
        self.m_duration = prom.Histogram(
            "hetero_embed_request_duration_seconds", "Time to serve an embedding request", registry=reg,
            buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10))
        self.m_batch_size = prom.Histogram(
            "hetero_embed_batch_size", "Sentences per batch formed", registry=reg,
            buckets=tuple(float(1 << k) for k in range(13)))
        self.m_queue = prom.Gauge("hetero_embed_queue_inputs", "Sentences waiting for a batch", registry=reg,
                                  multiprocess_mode="livesum")
        self.m_memory = prom.Gauge("hetero_gpu_memory_in_use_bytes", "Device memory in use by the buffer pool",
                                   registry=reg, multiprocess_mode="livesum")
        if self.multiprocess:
            from prometheus_client import multiprocess

            self.exposed = prom.CollectorRegistry()
            multiprocess.MultiProcessCollector(self.exposed)
        else:
            self.exposed = reg
            self.m_queue.set_function(self._queued)
            self.m_memory.set_function(self._memory_in_use)
        self._prom = prom

        self.routes = Starlette(routes=[
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
            Route("/embeddings", self.embeddings, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/info", self.info, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
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

    # -- lifecycle ----------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[EmbeddingServer]:
        """Start (warm-up in the background: /health says when it is done); on exit, :meth:`stop`."""
        if self.runtime is None:
            self.runtime = hetero.Runtime(capture_cache=self.capture_entries())
        self.service = EmbeddingService(self.runtime, self.model, int8=self.int8,
                                        max_batch_tokens=self.max_batch_tokens, max_queued=self.max_queued,
                                        max_in_flight=self.max_in_flight, on_batch=self._on_batch)
        self._idle = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._warmup)
            if self.multiprocess:
                tg.start_soon(self._refresh_gauges)
            try:
                yield self
            finally:
                tg.cancel_scope.cancel()  # a warm-up still running stops here
                with anyio.CancelScope(shield=True):
                    await self.stop()

    def capture_entries(self) -> int:
        """The own runtime's ``capture_cache``: every GPU stage at every padded shape, twice over."""
        shapes = service_shapes(self.model.config.max_seq_length, self.max_batch_tokens,
                                max(1, self.max_batch_tokens // 2))
        return max(1024, 2 * len(shapes) * (self.model.config.num_hidden_layers + 2))

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Any) -> AsyncIterator[None]:
        async with self.running():
            yield

    async def wait_ready(self) -> None:
        """Wait until warm-up ended (ready, or failed: see ``warmup_error``)."""
        while not self.ready and self.warmup_error is None:
            await anyio.sleep(0.01)

    async def _warmup(self) -> None:
        assert self.service is not None and self.runtime is not None
        try:
            await self.service.warmup(self.precapture)
            rt = self.runtime
            self.adapter = await anyio.to_thread.run_sync(lambda: str(rt.device().summary["summary"]))
            self.ready = True
        except HeteroError as e:
            if self.draining:
                return  # stopped while warming up
            self.warmup_error = str(e)
            if isinstance(e, DeviceLostError):
                self.lost = str(e)
            print(f"hetero serve: warm-up failed: {e}", file=sys.stderr, flush=True)

    async def stop(self) -> None:
        """New requests get 503; wait for the requests in flight; close the batcher (and the own runtime)."""
        self.draining = True
        if self.active and self._idle is not None:
            await self._idle.wait()
        if self.service is not None:
            await self.service.aclose()
        if self._own_runtime and self.runtime is not None:
            rt = self.runtime
            await anyio.to_thread.run_sync(rt.close)

    def shutdown(self) -> None:
        """Begin a graceful shutdown: new requests get 503; the listener stops once those in flight finish."""
        self.draining = True
        self.stop_event().set()

    def stop_event(self) -> anyio.Event:
        if self._stop is None:
            self._stop = anyio.Event()
        return self._stop

    def _queued(self) -> int:
        return self.service.batcher.queued if self.service is not None else 0

    def _memory_in_use(self) -> int:
        return self.runtime.memory_stats().in_use_bytes if self.runtime is not None else 0

    async def _refresh_gauges(self) -> None:
        """Worker processes: write the gauges to the shared metric files a few times a second."""
        while True:
            self.m_queue.set(self._queued())
            self.m_memory.set(self._memory_in_use())
            await anyio.sleep(0.25)

    def _on_batch(self, items: int, cost: int) -> None:
        self.m_batches.inc()
        self.m_batch_size.observe(items)

    # -- routes -----------------------------------------------------------------------------------
    def _unavailable(self) -> str | None:
        if self.draining:
            return "the server is shutting down; retry on another instance"
        if self.lost is not None:
            return f"the GPU device was lost ({self.lost}); restart the server"
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
            "hetero_version": hetero.__version__, "worker_pid": os.getpid(),
        })

    async def metrics(self, request: Any) -> Any:
        from starlette.responses import Response

        return Response(self._prom.generate_latest(self.exposed), media_type=self._prom.CONTENT_TYPE_LATEST)

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
            self.m_requests.labels(code=str(status)).inc()
            self.m_duration.observe(time.perf_counter() - t0)
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
        assert self.service is not None
        ids = await self.service.atokenize(texts)
        try:
            emb = await self.service.embed_ids(ids)
        except OverloadedError as e:
            raise RequestError(429, f"the server is overloaded: {e}", type_="rate_limit_error",
                               code="overloaded") from None
        except DeviceLostError as e:
            self.lost = str(e)
            raise RequestError(503, f"the GPU device was lost: {e}", type_="server_error",
                               code="device_lost") from None
        except HeteroError as e:
            raise RequestError(500, f"embedding failed: {e}", type_="server_error", code="internal_error") from None
        self.m_inputs.inc(len(texts))
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
                      signals: bool = True, reuse_port: bool = False) -> None:
    """Serve ``server.app`` with hypercorn on the running loop (asyncio or trio) until :meth:`~EmbeddingServer.shutdown`.

    ``signals``: SIGTERM and SIGINT call ``server.shutdown()``. ``ready(url)`` is called
    once the socket is bound (``port=0`` binds an ephemeral port; the URL names it).
    Shutdown is graceful: new requests get 503, requests in flight finish (up to
    ``graceful_timeout`` seconds), then the lifespan stops the server.
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

    async def on_signal() -> None:
        with watching, anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as received:
            async for _ in received:  # a second signal must not kill the process mid-shutdown
                server.shutdown()

    async with anyio.create_task_group() as tg:
        if signals:
            tg.start_soon(on_signal)
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


def serve(server: EmbeddingServer, host: str = "127.0.0.1", port: int = 8080, backend: str = "asyncio",
          *, ready: Callable[[str], None] | None = None, graceful_timeout: float = 30.0,
          reuse_port: bool = False) -> None:
    """:func:`serve_async` on a new ``backend`` event loop, until SIGTERM or SIGINT."""
    if backend not in ("asyncio", "trio"):
        raise HeteroError(f"--backend must be 'asyncio' or 'trio', got {backend!r}")
    anyio.run(lambda: serve_async(server, host, port, ready=ready, graceful_timeout=graceful_timeout,
                                  reuse_port=reuse_port), backend=backend)


def _worker_main(options: dict[str, Any], host: str, port: int, backend: str) -> None:
    serve(EmbeddingServer(**options), host, port, backend, reuse_port=True)


def serve_workers(options: dict[str, Any], host: str, port: int, backend: str, workers: int,
                  ready: Callable[[str], None] | None = None) -> int:
    """Serve with ``workers`` processes, each an :class:`EmbeddingServer` (its own Runtime and device)
    listening on one port (SO_REUSEPORT: the kernel spreads connections over them).

    ``options`` are EmbeddingServer's keyword arguments (picklable: the model as a path).
    /metrics sums every worker's counters, histograms and gauges; /health and /info answer for
    the worker that took the connection. SIGTERM or SIGINT shut every worker down gracefully.
    Returns 0, or 1 if a worker exited on its own.
    """
    import multiprocessing
    import shutil
    import tempfile

    probe = listen_socket(host, port, reuse_port=True, listen=False)  # a port that is taken fails here
    port = probe.getsockname()[1]
    metrics_dir = tempfile.mkdtemp(prefix="hetero-serve-metrics-")
    saved_env = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # inherited by the workers before they import it
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_worker_main, args=(options, host, port, backend), name=f"hetero-serve-{i}")
             for i in range(workers)]
    stopping = False

    def forward(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True
        for proc in procs:
            if proc.pid is not None and proc.exitcode is None:
                try:
                    os.kill(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    status = 0
    try:
        for i, proc in enumerate(procs):
            try:
                proc.start()
            except Exception as e:
                # The workers started before it would serve on alone: stop them first.
                forward(signal.SIGTERM, None)
                _reap(procs[:i], graceful_timeout=_WORKER_STOP_S)
                raise HeteroError(f"cannot start worker process {proc.name} ({i + 1} of {workers}): "
                                  f"{type(e).__name__}: {e}; stopped the {i} worker{'s' if i != 1 else ''} "
                                  "started before it") from e
        probe.close()
        if ready is not None:
            shown = f"[{host}]" if ":" in host else host
            ready(f"http://{shown}:{port}")
        while any(proc.exitcode is None for proc in procs):
            for proc in procs:
                proc.join(0.2)
                if proc.exitcode is not None and not stopping:
                    print(f"hetero serve: worker {proc.name} exited with status {proc.exitcode}; stopping the others",
                          file=sys.stderr, flush=True)
                    status = 1
                    forward(signal.SIGTERM, None)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        probe.close()
        if saved_env is None:
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        else:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = saved_env
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return status


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
    p.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio",
                   help="event loop hypercorn runs on (default: %(default)s)")
    p.add_argument("--max-batch-tokens", type=positive_int, default=16384, metavar="N",
                   help="padded tokens per batch: sentences x longest sentence (default: %(default)s)")
    p.add_argument("--max-client-batch-size", type=positive_int, default=2048, metavar="N",
                   help="most strings in one request; more get 413 (default: %(default)s)")
    p.add_argument("--max-queued", type=positive_int, default=4096, metavar="N",
                   help="sentences waiting for a batch before requests get 429 (default: %(default)s)")
    p.add_argument("--workers", type=positive_int, default=1, metavar="N",
                   help="server processes on the port, each with its own runtime and batcher; /metrics sums "
                   "them (default: %(default)s)")
    p.add_argument("--int8", action="store_true",
                   help="int8 weights for the encoder's linear layers (see hetero embed --int8)")
    p.add_argument("--no-precapture", dest="precapture", action="store_false",
                   help="warm up with one sentence instead of capturing every padded batch shape (faster start, "
                   "slower first batches of each shape)")
    p.set_defaults(func=run)
    return p


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number in [0, 65535], got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number in [0, 65535], got {value}")
    return value


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run ``hetero serve`` with parsed ``args`` until SIGTERM or Ctrl-C; return the exit status."""
    out = out if out is not None else sys.stdout
    options: dict[str, Any] = dict(model=args.model, int8=bool(args.int8), max_batch_tokens=args.max_batch_tokens,
                                   max_client_batch_size=args.max_client_batch_size, max_queued=args.max_queued,
                                   precapture=bool(getattr(args, "precapture", True)))
    server = EmbeddingServer(**options)  # loads the model: a bad --model or limit fails here, once
    workers = int(getattr(args, "workers", 1))

    def ready(url: str) -> None:
        procs = f", {workers} worker processes" if workers > 1 else ""
        print(f"hetero serve: {server.model_name} ({server.model.dim}-d) on {url} ({args.backend}{procs}); "
              "warming up, GET /health says when ready", file=out, flush=True)

    if workers > 1:
        status = serve_workers(options, args.host, args.port, args.backend, workers, ready=ready)
    else:
        serve(server, args.host, args.port, args.backend, ready=ready)
        status = 0
    print("hetero serve: stopped", file=out, flush=True)
    return status
