"""The embedding engine behind ``hetero serve``: GPU, batcher and warm-up, in-process or in a process of its own.

One :class:`EmbeddingEngine` owns the Runtime and the :class:`~hetero.pipelines.embed.EmbeddingService`
batcher. ``hetero serve`` with one process calls it directly. With ``--workers N`` (N > 1) it
runs alone in an engine process and N HTTP front processes reach it through
:class:`EngineClient`: the fronts parse requests, tokenize and encode responses (the Python
host work that grows with requests), the engine batches the sentences of every front into
the same GPU runs (the work that grows with batches). One device and one batcher for all
fronts, so concurrent requests share batches whichever front took them.

Both expose one interface to the server: ``running()`` (an async context manager),
``embed_ids(ids)`` (rows ``[len(ids), dim]``, or :class:`EngineError` with the HTTP status
to answer) and the state ``ready``, ``lost``, ``warmup_error``, ``adapter``.

The link is TCP on the loopback interface. The engine writes its port to an address file
in a private directory (mode 0700) and fronts begin with a secret the parent process gave
both; a connection without it is closed. Frames are ``u32 body length | u8 kind | body``
(little-endian):

- ``HELLO`` (front to engine, first): the secret;
- ``EMBED`` (front to engine): ``u64 id | u32 n | n x u32 lengths | int32 token ids``;
- ``RESULT``: ``u64 id | u32 n | u32 dim | float32 rows [n, dim]``;
- ``ERROR``: ``u64 id |`` JSON ``{"status", "message", "code"}``;
- ``STATUS``: JSON ``{"ready", "lost", "warmup_error", "adapter"}``, on connect and on each change.

Each side gathers the frames it sends while its event loop runs and writes them in one
``send`` (the replies to one batch leave together). A front whose link closes answers 503
from then on; the engine drops the items of a front that left.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import struct
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import anyio
import anyio.abc
import numpy as np

import hetero
from hetero.errors import DeviceLostError, HeteroError, OverloadedError

from .embed import EmbeddingService
from .minilm import Model

__all__ = ["EmbeddingEngine", "EngineClient", "EngineError"]

_HEADER = struct.Struct("<IB")
_ID = struct.Struct("<Q")
_EMBED_HEAD = struct.Struct("<QI")  # request id, sentences; then the lengths and the token ids
_RESULT_HEAD = struct.Struct("<QII")
_EMBED, _RESULT, _ERROR, _STATUS, _HELLO = 1, 2, 3, 4, 5
_RECEIVE_BYTES = 1 << 20
# The longest frame either side accepts: a request of --max-client-batch-size sentences of
# max_seq_length tokens, or its rows, stays far below it.
_MAX_FRAME = 1 << 30


class EngineError(HeteroError):
    """A request the engine could not embed: the HTTP ``status`` to answer (429, 500, 503) and an error ``code``."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


class _Link:
    """Frames over one byte stream: ``send`` gathers them, one writer task writes what gathered in one call."""

    def __init__(self, stream: anyio.abc.ByteStream) -> None:
        self.stream = stream
        self.closed = False
        self._out = bytearray()
        self._wake = anyio.Event()

    def send(self, kind: int, *parts: bytes | memoryview) -> None:
        self._out += _HEADER.pack(sum(len(p) for p in parts), kind)
        for p in parts:
            self._out += p
        self._wake.set()

    async def writer(self) -> None:
        """Write what ``send`` gathered, until the stream breaks or closes."""
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            while True:
                await self._wake.wait()
                self._wake = anyio.Event()
                data, self._out = self._out, bytearray()
                await self.stream.send(bytes(data))

    async def frames(self, first_limit: int = _MAX_FRAME) -> AsyncIterator[tuple[int, bytes]]:
        """``(kind, body)`` of each frame received, until the other side closes (then it returns).

        A frame longer than ``_MAX_FRAME`` bytes (the first one: ``first_limit``) is a
        HeteroError: the link is broken or not one of this server's.
        """
        buf = bytearray()
        limit = first_limit
        while True:
            try:
                buf += await self.stream.receive(_RECEIVE_BYTES)
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                return
            pos = 0
            while len(buf) - pos >= _HEADER.size:
                size, kind = _HEADER.unpack_from(buf, pos)
                if size > limit:
                    raise HeteroError(f"engine link: a frame of {size} bytes, more than the {limit} allowed")
                limit = _MAX_FRAME
                end = pos + _HEADER.size + size
                if end > len(buf):
                    break
                yield kind, bytes(buf[pos + _HEADER.size:end])
                pos = end
            del buf[:pos]


def _status_body(state: Any) -> bytes:
    return json.dumps({"ready": state.ready, "lost": state.lost, "warmup_error": state.warmup_error,
                       "adapter": state.adapter}).encode()


class EmbeddingEngine:
    """The Runtime, the batcher and the warm-up of an embeddings server.

    ``model``: a loaded Model (``hetero.pipelines.embed.get_model``). ``runtime``: a Runtime to
    use (left open); by default :meth:`running` makes one (with a capture cache for every
    packed shape) and closes it. ``on_batch(items, cost)`` is called for each batch formed.
    ``gauges(queued, memory_in_use)``, when given, is called a few times a second while
    running (the process-shared Prometheus gauges of a multi-process server).
    """

    def __init__(self, model: Model, *, runtime: hetero.Runtime | None = None, int8: bool = False,
                 max_batch_tokens: int = 16384, max_queued: int = 4096, max_in_flight: int = 2,
                 precapture: bool = True, on_batch: Callable[[int, int], None] | None = None,
                 gauges: Callable[[int, int], None] | None = None) -> None:
        self.model = model
        self.int8 = bool(int8)
        self.max_batch_tokens = max_batch_tokens
        self.max_queued = max_queued
        self.max_in_flight = max_in_flight
        self.precapture = bool(precapture)
        self._own_runtime = runtime is None
        self.runtime = runtime
        self.service: EmbeddingService | None = None
        self.ready = False
        self.lost: str | None = None  # why the device is gone, a phrase: "the GPU device was lost (...)"
        self.warmup_error: str | None = None
        self.adapter: str | None = None
        self._on_batch = on_batch
        self._gauges = gauges
        self._links: set[_Link] = set()
        self.stopping = False

    def capture_entries(self) -> int:
        """The own runtime's ``capture_cache``: every GPU stage at every packed shape, twice over."""
        shapes = EmbeddingService.examples_for(self.model, self.max_batch_tokens)
        return max(1024, 2 * len(shapes) * (self.model.config.num_hidden_layers + 2))

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[EmbeddingEngine]:
        """Start (warm-up in the background: ``ready`` says when it is done); on exit, let the
        batches in flight finish and close the own runtime."""
        if self.runtime is None:
            self.runtime = hetero.Runtime(capture_cache=self.capture_entries())
        self.service = EmbeddingService(self.runtime, self.model, int8=self.int8,
                                        max_batch_tokens=self.max_batch_tokens, max_queued=self.max_queued,
                                        max_in_flight=self.max_in_flight, on_batch=self._on_batch)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._warmup)
                if self._gauges is not None:
                    tg.start_soon(self._refresh_gauges, self._gauges)
                try:
                    yield self
                finally:
                    tg.cancel_scope.cancel()  # a warm-up still running stops here
        finally:
            with anyio.CancelScope(shield=True):
                self.stopping = True
                await self.service.aclose()
                if self._own_runtime:
                    rt = self.runtime
                    await anyio.to_thread.run_sync(rt.close)

    @property
    def queued(self) -> int:
        """Sentences waiting for a batch."""
        return self.service.batcher.queued if self.service is not None else 0

    def memory_in_use(self) -> int:
        return self.runtime.memory_stats().in_use_bytes if self.runtime is not None else 0

    async def _refresh_gauges(self, gauges: Callable[[int, int], None]) -> None:
        while True:
            gauges(self.queued, self.memory_in_use())
            await anyio.sleep(0.25)

    async def _warmup(self) -> None:
        assert self.service is not None and self.runtime is not None
        try:
            await self.service.warmup(self.precapture)
            rt = self.runtime
            self.adapter = await anyio.to_thread.run_sync(lambda: str(rt.device().summary["summary"]))
            self.ready = True
        except HeteroError as e:
            if self.stopping:
                return  # stopped while warming up
            self.warmup_error = str(e)
            if isinstance(e, DeviceLostError):
                self._mark_lost(e)
            print(f"hetero serve: warm-up failed: {e}", file=sys.stderr, flush=True)
        self._tell_links()

    async def embed_ids(self, ids: Sequence[np.ndarray]) -> np.ndarray:
        """Embeddings ``[len(ids), dim]`` of tokenized sentences through the batcher; :class:`EngineError` if not."""
        assert self.service is not None, "EmbeddingEngine.embed_ids outside running()"
        try:
            return await self.service.embed_ids(ids)
        except HeteroError as e:
            raise self._engine_error(e) from None

    def _engine_error(self, e: BaseException) -> EngineError:
        """The HTTP status and code that answer an embedding's error."""
        if isinstance(e, EngineError):
            return e
        if isinstance(e, OverloadedError):
            return EngineError(429, f"the server is overloaded: {e}", "overloaded")
        if isinstance(e, DeviceLostError):
            self._mark_lost(e)
            return EngineError(503, f"the GPU device was lost: {e}", "device_lost")
        if isinstance(e, HeteroError):
            return EngineError(500, f"embedding failed: {e}", "internal_error")
        return EngineError(500, f"embedding failed: {type(e).__name__}: {e}", "internal_error")

    def _mark_lost(self, e: DeviceLostError) -> None:
        """The device is gone: say so once, here and to every front."""
        if self.lost is None:
            self.lost = f"the GPU device was lost ({e})"
            self._tell_links()

    # -- the engine process's side of the links -------------------------------------------------
    async def serve_fronts(self, address_file: str, secret: bytes, *,
                           task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> None:
        """Accept front processes (inside :meth:`running`) until cancelled: listen on a loopback port,
        write it to ``address_file``, serve the connections that begin with ``secret``."""
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        partial = address_file + ".partial"
        with open(partial, "w") as f:
            f.write(str(port))
        os.replace(partial, address_file)  # fronts never read half a port number
        task_status.started(port)
        async with listener:
            await listener.serve(lambda stream: self._serve_front(stream, secret))

    async def _serve_front(self, stream: anyio.abc.ByteStream, secret: bytes) -> None:
        link = _Link(stream)
        try:
            async with stream, anyio.create_task_group() as tg:
                frames = link.frames(first_limit=len(secret))
                first = await anext(frames, None)
                if first is None or first[0] != _HELLO or not hmac.compare_digest(first[1], secret):
                    return  # not one of this server's fronts
                self._links.add(link)
                tg.start_soon(link.writer)
                link.send(_STATUS, _status_body(self))
                async for kind, body in frames:
                    if kind != _EMBED:
                        raise HeteroError(f"engine: a front sent a frame of unknown kind {kind}")
                    self._submit(link, body)
                tg.cancel_scope.cancel()  # the front left: stop its writer
        except Exception as e:  # one front's bad link never stops the engine serving the others
            print(f"hetero serve: engine: dropped a front's link: {type(e).__name__}: {e}", file=sys.stderr,
                  flush=True)
        finally:
            link.closed = True  # the sentences it sent run on; their answers go nowhere
            self._links.discard(link)

    def _submit(self, link: _Link, body: bytes) -> None:
        """One EMBED frame's sentences into the batcher; the answer goes back on ``link`` when all are done."""
        assert self.service is not None
        rid, n = _EMBED_HEAD.unpack_from(body)
        flat = np.frombuffer(body, np.int32, offset=_EMBED_HEAD.size + 4 * n)
        if n == 1:
            ids = [flat]
        else:
            lengths = np.frombuffer(body, np.uint32, n, _EMBED_HEAD.size)
            ids = np.split(flat, np.cumsum(lengths[:-1], dtype=np.int64)) if n else []

        def done(rows: np.ndarray | None, error: BaseException | None) -> None:
            if link.closed:
                return
            if rows is None:
                assert error is not None
                e = self._engine_error(error)
                link.send(_ERROR, _ID.pack(rid), json.dumps({"status": e.status, "message": e.message,
                                                             "code": e.code}).encode())
            else:
                link.send(_RESULT, _RESULT_HEAD.pack(rid, rows.shape[0], rows.shape[1]), rows.tobytes())

        try:
            self.service.submit_ids(ids, done)
        except Exception as e:  # refused at once (overloaded, closing)
            done(None, e)

    def _tell_links(self) -> None:
        body = _status_body(self)
        for link in self._links:
            link.send(_STATUS, body)


class _Pending:
    """A request a front sent: set once its rows or its error came back."""

    __slots__ = ("event", "rows", "error")

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.rows: np.ndarray | None = None
        self.error: EngineError | None = None


class EngineClient:
    """A front process's way to the :class:`EmbeddingEngine` of the engine process.

    ``address_file``: where the engine writes its loopback port; ``secret``: what the
    engine expects first. :meth:`running` connects (waiting while the engine starts, up to
    ``connect_timeout`` seconds) and follows the engine's state; after the link closes,
    ``lost`` says so and every request in flight and after gets :class:`EngineError` 503.
    """

    def __init__(self, address_file: str, secret: bytes, *, connect_timeout: float = 600.0) -> None:
        self.address_file = address_file
        self.secret = secret
        self.connect_timeout = connect_timeout
        self.ready = False
        self.lost: str | None = None
        self.warmup_error: str | None = None
        self.adapter: str | None = None
        self._link: _Link | None = None
        self._next = 0
        self._pending: dict[int, _Pending] = {}  # requests sent, by id

    @property
    def queued(self) -> int:
        """0: the sentences waiting for a batch wait in the engine process (its gauge counts them)."""
        return 0

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[EngineClient]:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._follow)
            try:
                yield self
            finally:
                tg.cancel_scope.cancel()
        if self._link is not None:
            with anyio.CancelScope(shield=True):
                await self._link.stream.aclose()

    async def _connect(self) -> anyio.abc.ByteStream:
        deadline = time.monotonic() + self.connect_timeout
        while True:
            try:
                with open(self.address_file) as f:
                    port = int(f.read())
                return await anyio.connect_tcp("127.0.0.1", port)
            except (OSError, ValueError) as e:
                if time.monotonic() > deadline:
                    raise HeteroError(f"cannot reach the embedding engine (address file {self.address_file}) "
                                      f"within {self.connect_timeout:g} s: {e}") from e
            await anyio.sleep(0.05)

    async def _follow(self) -> None:
        try:
            stream = await self._connect()
        except HeteroError as e:
            self._gone(str(e))
            return
        link = self._link = _Link(stream)
        link.send(_HELLO, self.secret)
        async with anyio.create_task_group() as tg:
            tg.start_soon(link.writer)
            async for kind, body in link.frames():
                if kind == _RESULT:
                    rid, n, dim = _RESULT_HEAD.unpack_from(body)
                    self._settle(rid, np.frombuffer(body, np.float32, n * dim, _RESULT_HEAD.size).reshape(n, dim),
                                 None)
                elif kind == _ERROR:
                    (rid,) = _ID.unpack_from(body)
                    err = json.loads(body[_ID.size:])
                    self._settle(rid, None, EngineError(err["status"], err["message"], err["code"]))
                elif kind == _STATUS:
                    state = json.loads(body)
                    self.ready, self.lost = state["ready"], state["lost"]
                    self.warmup_error, self.adapter = state["warmup_error"], state["adapter"]
            tg.cancel_scope.cancel()
        self._gone("the embedding engine process stopped")

    def _gone(self, why: str) -> None:
        self.ready = False
        if self.lost is None:
            self.lost = why
        for rid in list(self._pending):
            self._settle(rid, None, EngineError(503, f"{why}; restart the server", "engine_stopped"))

    def _settle(self, rid: int, rows: np.ndarray | None, error: EngineError | None) -> None:
        entry = self._pending.pop(rid, None)
        if entry is not None:  # else its caller was cancelled
            entry.rows, entry.error = rows, error
            entry.event.set()

    async def embed_ids(self, ids: Sequence[np.ndarray]) -> np.ndarray:
        """Embeddings ``[len(ids), dim]`` from the engine; :class:`EngineError` with the status to answer if not."""
        link = self._link
        if link is None or self.lost is not None:
            why = f"{self.lost}; restart the server" if self.lost else \
                "the embedding engine is not connected yet; retry"
            raise EngineError(503, why, "unavailable")
        rid = self._next = self._next + 1
        entry = self._pending[rid] = _Pending()
        lengths = np.fromiter((len(x) for x in ids), np.uint32, len(ids))
        flat = np.concatenate(ids).astype(np.int32, copy=False) if ids else np.zeros(0, np.int32)
        link.send(_EMBED, _EMBED_HEAD.pack(rid, len(ids)), lengths.tobytes(), flat.tobytes())
        try:
            await entry.event.wait()
        finally:
            self._pending.pop(rid, None)
        if entry.error is not None:
            raise entry.error
        assert entry.rows is not None
        return entry.rows

