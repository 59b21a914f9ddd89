"""What every ``hetero serve`` application shares: settings, answers, errors, the HTTP entry points, the lifecycle.

Two applications stand on it: :class:`~hetero.pipelines.serve_app.EmbeddingServer`
(``/v1/embeddings``) and :class:`~hetero.pipelines.serve_llm.GenerationServer`
(``/v1/chat/completions``, ``/v1/completions``). :class:`ServerBase` answers for both:

- the HTTP entry points, ``app`` (ASGI: hypercorn, httpx's ASGI transport) and ``__rsgi__``
  (RSGI: granian), which check the API key and the body's size before reading it, read it,
  call :meth:`ServerBase.handle` and send its answer: a :class:`Response` (a whole body) or a
  :class:`StreamResponse` (chunks as they come: server-sent events). An application that
  sets ``watch_disconnect`` has its request cancelled when the client leaves (a generation
  in flight stops and frees its KV blocks);
- the routes every server has: ``GET /health``, ``/info``, ``/metrics``, ``/v1/models``, 404
  for an unknown path and 405 (``Allow``) for a known one asked with another method;
- errors in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}`` (500 with a
  request id in the log), ``Retry-After`` on 429 and 503;
- the lifecycle: 503 while warming up, after the device was lost and while shutting down;
  :meth:`ServerBase.shutdown` and :meth:`ServerBase.stop` drain the requests in flight.

A subclass says what it serves: ``routes`` (its POST paths beside the common ones),
:meth:`ServerBase.post`, :meth:`ServerBase.info`, ``metrics`` (with a ``requests`` counter
by status code and ``render()``) and the state ``ready``, ``lost``, ``warmup_error``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hmac
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any, ClassVar

import anyio

from hetero.errors import HeteroError

__all__ = ["JSON_HEADER", "RETRY_AFTER_S", "BaseSettings", "RequestError", "Response", "ServerBase",
           "StreamResponse", "dumps", "token_id"]

# Retry-After (seconds) of a 429 and a 503: about one batch's time, rounded up to what the header can say.
RETRY_AFTER_S = 1
JSON_HEADER = ("content-type", "application/json")
# The routes every server answers (path -> its one method), beside the application's own.
COMMON_ROUTES = {"/v1/models": "GET", "/models": "GET", "/health": "GET", "/info": "GET", "/metrics": "GET"}

log = logging.getLogger("hetero.serve")


def dumps(obj: Any) -> bytes:
    """Compact JSON bytes."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


def token_id(v: object) -> bool:
    """An int as OpenAI's token arrays hold them (JSON true and false are no token ids)."""
    return isinstance(v, int) and not isinstance(v, bool)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BaseSettings:
    """The settings every ``hetero serve`` application has, checked once: the model, the names it
    is served under, the API key and the largest body. Every bad value raises
    :class:`~hetero.errors.HeteroError` naming the option."""

    # What --model may be, for the error message of a bad one.
    MODEL_RULE: ClassVar[str] = "a directory or a model name"

    model: str
    model_name: str | None = None
    max_request_bytes: int = 2 * 1024 * 1024
    served_model_names: tuple[str, ...] = ()
    api_key: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise HeteroError(f"the model must be {self.MODEL_RULE}, got {self.model!r}")
        self.check_positive("max_request_bytes")
        names = tuple(self.served_model_names)
        if any(not isinstance(n, str) or not n for n in names):
            raise HeteroError(f"--served-model-name must be non-empty names, got {list(names)!r}")
        object.__setattr__(self, "served_model_names", names)
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise HeteroError("--api-key must be a non-empty string")

    def check_positive(self, *names: str) -> None:
        """HeteroError naming the option of each of ``names`` that is not a positive integer."""
        for name in names:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise HeteroError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")

    @functools.cached_property
    def served_name(self) -> str:
        """The model's name in answers: the first served name, else ``model_name``, else the
        file's or directory's name (or the name given, such as ``"minilm"``)."""
        if self.served_model_names:
            return self.served_model_names[0]
        if self.model_name:
            return self.model_name
        if os.path.isdir(self.model):
            return os.path.basename(os.path.normpath(self.model))
        if os.path.isfile(self.model):
            return os.path.splitext(os.path.basename(self.model))[0]
        return self.model

    @functools.cached_property
    def model_ids(self) -> tuple[str, ...]:
        """The ids a request's ``model`` may name (``GET /v1/models`` lists them); found once, as
        requests check against them."""
        return self.served_model_names or (self.served_name,)

    def __repr__(self) -> str:  # the key stays out of logs and tracebacks
        fields = ", ".join(f"{f.name}={'<set>' if f.name == 'api_key' and self.api_key else getattr(self, f.name)!r}"
                           for f in dataclasses.fields(self))
        return f"{type(self).__name__}({fields})"


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

    def body(self) -> dict[str, Any]:
        """OpenAI's error object."""
        param = None if self.status == 405 else self.param
        return {"error": {"message": self.message, "type": self.type, "param": param, "code": self.code}}

    def response(self) -> Response:
        headers = [JSON_HEADER]
        if self.status in (429, 503):
            headers.append(("retry-after", str(RETRY_AFTER_S)))
        elif self.status == 405 and self.param is not None:
            headers.append(("allow", self.param))
        return Response(self.status, headers, dumps(self.body()))


@dataclasses.dataclass(frozen=True)
class Response:
    """One answer: status, headers (lowercase names; the HTTP server adds content-length) and body."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes


@dataclasses.dataclass(frozen=True)
class StreamResponse:
    """An answer sent as it is made: status, headers, then each chunk of ``chunks`` as it comes.

    ``chunks`` is an async generator; the entry points close it (``aclose``) once it ends, the
    client leaves or sending fails, so what it holds (a generation, its KV blocks) is freed.
    """

    status: int
    headers: list[tuple[str, str]]
    chunks: AsyncIterator[bytes]


def unavailable(message: str) -> RequestError:
    """A 503 (with Retry-After)."""
    return RequestError(503, message, type_="server_error", code="unavailable")


class ServerBase:
    """The HTTP entry points, the common routes and the lifecycle of a ``hetero serve`` application
    (see the module doc); subclasses set ``settings``, ``metrics``, ``routes`` and the state."""

    # path -> the one method of the application's own routes (POST ones are answered by post())
    routes: ClassVar[Mapping[str, str]] = {}
    # cancel a request whose client left before its answer was sent (ASGI and RSGI)
    watch_disconnect: ClassVar[bool] = False

    settings: BaseSettings
    metrics: Any

    def __init__(self, settings: BaseSettings, http_server: str | None) -> None:
        self.settings = settings
        self.model_name = settings.served_name
        self.http_server = http_server
        self._started = int(time.time())
        self._all_routes = {**self.routes, **COMMON_ROUTES}
        self.draining = False
        self.active = 0  # requests being served (a stream counts until its last chunk)
        self._idle: anyio.Event | None = None
        self._stop: anyio.Event | None = None

    # -- what a subclass says ---------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        raise NotImplementedError

    @property
    def lost(self) -> str | None:
        """Why the device (or the engine process) is gone; None while it works."""
        raise NotImplementedError

    @property
    def warmup_error(self) -> str | None:
        raise NotImplementedError

    def info(self) -> dict[str, Any]:
        """What ``GET /info`` answers."""
        raise NotImplementedError

    def running(self) -> contextlib.AbstractAsyncContextManager[Any]:
        """Start the application (warm-up in the background) for the body of the block; on exit,
        drain (:meth:`stop`) and close what it started."""
        raise NotImplementedError

    async def post(self, path: str, body: bytes) -> Response | StreamResponse:
        """The answer to a POST to one of ``routes``."""
        raise NotImplementedError

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
        r: Response | StreamResponse | None = self.refuse_early(method, path, auth.decode("latin-1") if auth is not None else None,
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
            if r is None and self.watch_disconnect:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_asgi_watch, receive, tg.cancel_scope)
                    await _asgi_send(await self.handle(method, path, b"".join(chunks), checked=True), send)
                    tg.cancel_scope.cancel()
                return
            if r is None:
                r = await self.handle(method, path, b"".join(chunks), checked=True)
        if r is not None:
            await _asgi_send(r, send)

    async def __rsgi__(self, scope: Any, proto: Any) -> None:
        """The RSGI application (granian): the same answers as ``app``."""
        if scope.proto != "http":
            return  # websockets: not served
        method, path, headers = scope.method, scope.path, scope.headers
        r: Response | StreamResponse | None = self.refuse_early(method, path, headers.get("authorization"), headers.get("content-length"))
        if r is None:
            chunks, size, limit = [], 0, self.settings.max_request_bytes
            async for chunk in proto:
                size += len(chunk)
                if size > limit:
                    r = self._too_large(f"more than {limit}")
                    break
                chunks.append(chunk)
            if r is None and self.watch_disconnect:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_rsgi_watch, proto, tg.cancel_scope)
                    await _rsgi_send(await self.handle(method, path, b"".join(chunks), checked=True), proto)
                    tg.cancel_scope.cancel()
                return
            if r is None:
                r = await self.handle(method, path, b"".join(chunks), checked=True)
        if isinstance(r, Response):
            proto.response_bytes(r.status, r.headers, r.body)
        elif r is not None:
            await _rsgi_send(r, proto)

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
                     checked: bool = False) -> Response | StreamResponse:
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
            return Response(500, [JSON_HEADER, ("x-request-id", rid)], dumps(internal_error(rid)))

    async def _route(self, method: str, path: str, body: bytes) -> Response | StreamResponse:
        want = self._all_routes.get(path)
        if want is None:
            return RequestError(404, f"no route {path!r}: this server answers {', '.join(self._all_routes)}",
                                code="not_found").response()
        if method != want:
            return RequestError(405, f"{path} takes {want}, not {method}", want, code="method_not_allowed"
                                ).response()
        if want == "POST":
            return await self.post(path, body)
        if path == "/health":
            why = self.unavailable_reason()
            if why is not None:
                return Response(503, [JSON_HEADER], dumps({"status": "unavailable", "reason": why}))
            return Response(200, [JSON_HEADER], dumps({"status": "ok"}))
        if path == "/info":
            return Response(200, [JSON_HEADER], dumps(self.info()))
        if path in ("/v1/models", "/models"):
            return Response(200, [JSON_HEADER], dumps({"object": "list", "data": [
                {"id": name, "object": "model", "created": self._started, "owned_by": "hetero"}
                for name in self.settings.model_ids]}))
        return Response(200, [("content-type", self.metrics.prom.CONTENT_TYPE_LATEST)], self.metrics.render())

    def check_model(self, body: Mapping[str, Any], required: bool = False) -> None:
        """A request's ``model``: a string this server serves (404 ``model_not_found`` if not)."""
        model = body.get("model")
        if model is None:
            if required:
                raise RequestError(400, "'model' is required: one of the ids GET /v1/models lists", "model")
            return
        if not isinstance(model, str):
            raise RequestError(400, f"'model' must be a string, got {type(model).__name__}", "model")
        if model not in self.settings.model_ids:
            raise RequestError(404, f"the model {model!r} does not exist on this server; it serves "
                               f"{', '.join(map(repr, self.settings.model_ids))} (GET /v1/models)", "model",
                               code="model_not_found")

    # -- lifecycle ----------------------------------------------------------------------------
    def unavailable_reason(self) -> str | None:
        """Why requests get 503 now (shutting down, device lost, warm-up failed or not over); None when served."""
        if self.draining:
            return "the server is shutting down; retry on another instance"
        if self.lost is not None:
            return f"{self.lost}; restart the server"
        if self.warmup_error is not None:
            return f"the server failed to warm up: {self.warmup_error}"
        if not self.ready:
            return "the server is warming up (compiling kernels, uploading weights); retry shortly"
        return None

    def begin_request(self) -> None:
        """One more request in flight (paired with :meth:`end_request`)."""
        self.active += 1

    def end_request(self) -> None:
        """A request in flight ended; the last one while draining lets :meth:`stop` return."""
        self.active -= 1
        if self.active == 0 and self.draining and self._idle is not None:
            self._idle.set()

    def open_lifecycle(self) -> None:
        """Called as the server starts (``running()``): :meth:`stop` may wait for requests from now on."""
        self._idle = anyio.Event()

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


def internal_error(rid: str) -> dict[str, Any]:
    """The body of a 500 (or of the error event that ends a failed stream)."""
    return {"error": {"message": f"the server failed to answer this request (request id {rid}, in the server's "
                      "log)", "type": "server_error", "param": None, "code": "internal_error"}}


async def _asgi_watch(receive: Any, scope: anyio.CancelScope) -> None:
    """Cancel ``scope`` once the client disconnects."""
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


async def _rsgi_watch(proto: Any, scope: anyio.CancelScope) -> None:
    await proto.client_disconnect()
    scope.cancel()


async def _asgi_send(r: Response | StreamResponse, send: Any) -> None:
    if isinstance(r, Response):
        out = [(b"content-length", str(len(r.body)).encode()),
               *((k.encode("latin-1"), v.encode("latin-1")) for k, v in r.headers)]
        await send({"type": "http.response.start", "status": r.status, "headers": out})
        await send({"type": "http.response.body", "body": r.body})
        return
    try:
        await send({"type": "http.response.start", "status": r.status,
                    "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in r.headers]})
        async for chunk in r.chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    finally:
        with anyio.CancelScope(shield=True):
            await r.chunks.aclose()  # type: ignore[attr-defined]


async def _rsgi_send(r: Response | StreamResponse, proto: Any) -> None:
    if isinstance(r, Response):
        proto.response_bytes(r.status, r.headers, r.body)
        return
    try:
        transport = proto.response_stream(r.status, r.headers)
        async for chunk in r.chunks:
            await transport.send_bytes(chunk)
    except RuntimeError as e:  # granian's ProtocolClosed: the client left; the stream closes below
        if type(e).__name__ not in ("RSGIProtocolClosed", "ProtocolClosed"):
            raise
    finally:
        with anyio.CancelScope(shield=True):
            await r.chunks.aclose()  # type: ignore[attr-defined]
