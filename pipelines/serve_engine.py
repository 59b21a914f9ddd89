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
to answer) and the state ``ready``, ``lost``, ``warmup_error``, ``adapter``, ``warmup_progress``.

The link is TCP on the loopback interface. The engine writes its port to an address file
in a private directory (mode 0700) and fronts begin with a secret the parent process gave
both; a connection without it is closed. Frames are ``u32 body length | u8 kind | body``
(in the machine's byte order: both ends run on it):

- ``HELLO`` (front to engine, first): the secret;
- ``EMBED`` (front to engine): ``u32 k | u32 m | k x u64 request ids | k x u32 sentences |
  m x u32 lengths | int32 token ids``: ``k`` requests of ``m`` sentences in all;
- ``RESULT``: ``u32 k | u32 dim | k x u64 request ids | k x u32 rows | float32 rows [sum, dim]``;
- ``ERROR``: ``u64 id |`` JSON ``{"status", "message", "code"}``;
- ``STATUS``: JSON ``{"ready", "lost", "warmup_error", "adapter", "warmup"}``, on connect and on each change.

One engine's event loop does the link work of every front's requests, so the work it does
per request is kept to a minimum. Each side gathers what it sends while its event loop runs
and writes it in one ``send``:
a front's requests of one pass of its loop travel as one EMBED frame, which the engine
admits to the batcher in one call; the answers that are ready when the engine's writer runs
travel as one RESULT frame. A front whose link closes answers 503 from then on; the engine
drops the items of a front that left.
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import itertools
import json
import os
import struct
import sys
import time
from array import array
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import anyio
import anyio.abc
import numpy as np

import hetero
from hetero.errors import DeviceLostError, HeteroError, OverloadedError

from .embed_service import EmbeddingService
from .minilm import Model

__all__ = ["EmbeddingEngine", "EngineClient", "EngineError"]

_HEADER = struct.Struct("=IB")
_ID = struct.Struct("=Q")
_COUNTS = struct.Struct("=II")  # EMBED: requests, sentences; RESULT: requests, dimension
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
        self._put(kind, *parts)
        self._wake.set()

    def _put(self, kind: int, *parts: bytes | memoryview) -> None:
        self._out += _HEADER.pack(sum(len(p) for p in parts), kind)
        for p in parts:
            self._out += p

    def _gather(self) -> None:
        """Put the frames made of what waited since the last write (the subclasses' requests, answers)."""

    async def writer(self) -> None:
        """Write what gathered since the last write, until the stream breaks or closes."""
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            while True:
                await self._wake.wait()
                self._wake = anyio.Event()
                self._gather()
                data, self._out = self._out, bytearray()
                if data:
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


# A front splits what it gathered into EMBED frames of about this many bytes at most.
_GATHER_BYTES = 16 << 20


class _FrontLink(_Link):
    """A front's link: the requests made during one pass of its event loop leave as one EMBED frame.

    ``wanted(rid)`` says whether request ``rid`` still has a caller (one cancelled before
    its frame left is not sent).
    """

    def __init__(self, stream: anyio.abc.ByteStream, wanted: Callable[[int], bool]) -> None:
        super().__init__(stream)
        self._wanted = wanted
        self._requests: list[tuple[int, Sequence[np.ndarray]]] = []

    def request(self, rid: int, ids: Sequence[np.ndarray]) -> None:
        self._requests.append((rid, ids))
        self._wake.set()

    def _gather(self) -> None:
        requests, self._requests = self._requests, []
        chunk: list[tuple[int, Sequence[np.ndarray]]] = []
        size = 0
        for rid, ids in requests:
            if not self._wanted(rid):
                continue
            chunk.append((rid, ids))
            size += 16 + sum(4 * len(x) + 4 for x in ids)
            if size >= _GATHER_BYTES:
                self._put(_EMBED, *_embed_parts(chunk))
                chunk, size = [], 0
        if chunk:
            self._put(_EMBED, *_embed_parts(chunk))


class _EngineLink(_Link):
    """The engine's link to one front: the answers ready when its writer runs leave as one RESULT frame."""

    def __init__(self, stream: anyio.abc.ByteStream, dim: int) -> None:
        super().__init__(stream)
        self.dim = dim
        self._answers: list[tuple[int, np.ndarray]] = []

    def answer(self, rid: int, rows: np.ndarray) -> None:
        self._answers.append((rid, rows))
        self._wake.set()

    def _gather(self) -> None:
        if self._answers:
            answers, self._answers = self._answers, []
            rids = array("Q", [rid for rid, _ in answers]).tobytes()
            self._put(_RESULT, _COUNTS.pack(len(answers), self.dim), rids,
                      array("I", [len(rows) for _, rows in answers]).tobytes(),
                      np.concatenate([rows for _, rows in answers]).tobytes())


def _embed_parts(requests: Sequence[tuple[int, Sequence[np.ndarray]]]) -> list[bytes]:
    """An EMBED frame's body: the requests ``(id, token id arrays)``.

    (Frames are mostly of a few sentences: the lists go through ``array`` and ``memoryview``,
    which cost a fraction of numpy's calls at that size.)
    """
    sentences = [x for _, ids in requests for x in ids]
    flat = np.concatenate(sentences).astype(np.int32, copy=False) if sentences else np.zeros(0, np.int32)
    return [_COUNTS.pack(len(requests), len(sentences)), array("Q", [rid for rid, _ in requests]).tobytes(),
            array("I", [len(ids) for _, ids in requests]).tobytes(),
            array("I", [len(x) for x in sentences]).tobytes(), flat.tobytes()]


def _parse_embed(body: bytes) -> tuple[list[int], list[int], list[np.ndarray]]:
    """An EMBED frame's request ids, sentence counts and sentences; HeteroError if it does not add up."""
    if len(body) < _COUNTS.size:
        raise HeteroError(f"engine link: an EMBED frame of {len(body)} bytes, shorter than its counts")
    k, m = _COUNTS.unpack_from(body)
    pos = _COUNTS.size
    tokens_at = pos + 12 * k + 4 * m
    if len(body) < tokens_at or (len(body) - tokens_at) % 4:
        raise HeteroError(f"engine link: an EMBED frame of {len(body)} bytes does not fit {k} requests "
                          f"of {m} sentences")
    view = memoryview(body)
    rids = view[pos:pos + 8 * k].cast("Q").tolist()
    counts = view[pos + 8 * k:pos + 12 * k].cast("I").tolist()
    lengths = view[pos + 12 * k:tokens_at].cast("I").tolist()
    flat = np.frombuffer(body, np.int32, offset=tokens_at)
    ends = list(itertools.accumulate(lengths))
    if sum(counts) != m or (ends[-1] if ends else 0) != len(flat):
        raise HeteroError(f"engine link: a malformed EMBED frame ({k} requests, {m} sentences, {len(flat)} "
                          "token ids that do not add up)")
    return rids, counts, [flat[start:end] for start, end in zip([0, *ends], ends)]


def _parse_result(body: bytes) -> list[tuple[int, np.ndarray]]:
    """A RESULT frame's ``(request id, rows)``: views of one read-only array."""
    k, dim = _COUNTS.unpack_from(body)
    pos = _COUNTS.size
    view = memoryview(body)
    rids = view[pos:pos + 8 * k].cast("Q").tolist()
    ends = list(itertools.accumulate(view[pos + 8 * k:pos + 12 * k].cast("I").tolist()))
    total = ends[-1] if ends else 0
    rows = np.frombuffer(body, np.float32, total * dim, pos + 12 * k).reshape(total, dim)
    return [(rid, rows[start:end]) for rid, start, end in zip(rids, [0, *ends], ends)]


class _Answers:
    """The requests of one EMBED frame on the engine: each sentence's row as its batch ends, each
    request answered on its link once all of its sentences are done (with the first error, if any)."""

    __slots__ = ("link", "http_error", "rids", "starts", "owner", "left", "errors", "rows")

    def __init__(self, link: _EngineLink, rids: list[int], counts: list[int],
                 http_error: Callable[[BaseException], EngineError]) -> None:
        self.link = link
        self.http_error = http_error
        self.rids = rids
        self.starts = [0, *itertools.accumulate(counts)]
        self.owner = [j for j, c in enumerate(counts) for _ in range(c)]  # each sentence's request
        self.left = list(counts)
        self.errors: list[BaseException | None] = [None] * len(rids)
        self.rows = np.empty((self.starts[-1], link.dim), np.float32)
        for j, c in enumerate(counts):
            if c == 0:
                self._answer(j)

    def row(self, i: int, row: np.ndarray | None, error: BaseException | None) -> None:
        """Sentence ``i`` of the frame finished (the batcher's ``on_done``)."""
        j = self.owner[i]
        if error is not None:
            if self.errors[j] is None:
                self.errors[j] = error
        else:
            self.rows[i] = row
        self.left[j] -= 1
        if self.left[j] == 0:
            self._answer(j)

    def row_after(self, start: int, i: int, row: np.ndarray | None, error: BaseException | None) -> None:
        """Sentence ``start + i`` of the frame finished (for the items submitted from ``start`` on)."""
        self.row(start + i, row, error)

    def refuse(self, j: int, error: BaseException) -> None:
        """Request ``j`` was refused at admission: answer its error now."""
        self.errors[j] = error
        self.left[j] = 0
        self._answer(j)

    def _answer(self, j: int) -> None:
        if self.link.closed:
            return
        error = self.errors[j]
        if error is None:
            self.link.answer(self.rids[j], self.rows[self.starts[j]:self.starts[j + 1]])
            return
        e = self.http_error(error)
        self.link.send(_ERROR, _ID.pack(self.rids[j]),
                       json.dumps({"status": e.status, "message": e.message, "code": e.code}).encode())


def _status_body(state: Any) -> bytes:
    return json.dumps({"ready": state.ready, "lost": state.lost, "warmup_error": state.warmup_error,
                       "adapter": state.adapter, "warmup": state.warmup_progress}).encode()


# While precapture runs, a progress line goes to stderr at each tenth of the shapes, and at least
# this often (a CPU adapter captures a shape in seconds, so a tenth can take minutes).
WARMUP_PRINT_EVERY_S = 10.0


class EmbeddingEngine:
    """The Runtime, the batcher and the warm-up of an embeddings server.

    ``model``: a loaded Model (``hetero.pipelines.embed.get_model``). ``runtime``: a Runtime to
    use (left open); by default :meth:`running` makes one (with a capture cache for every
    packed shape) and closes it. ``on_batch(items, cost)`` is called for each batch formed,
    ``on_batch_done(items, waited, ran)`` for each batch ended (:class:`hetero.Batcher`).
    ``gauges(queued, memory_in_use)``, when given, is called a few times a second while
    running (the process-shared Prometheus gauges of a multi-process server).
    """

    def __init__(self, model: Model, *, runtime: hetero.Runtime | None = None, int8: bool = False,
                 max_batch_tokens: int = 16384, max_queued: int = 4096, max_in_flight: int = 2,
                 max_wait: float = 0.0, precapture: bool | None = True, on_batch: Callable[[int, int], None] | None = None,
                 on_batch_done: Callable[[int, float, float], None] | None = None,
                 gauges: Callable[[int, int], None] | None = None) -> None:
        self.model = model
        self.int8 = bool(int8)
        self.max_batch_tokens = max_batch_tokens
        self.max_queued = max_queued
        self.max_in_flight = max_in_flight
        self.max_wait = max_wait
        self.precapture = precapture  # None: on, except on a CPU adapter (see _warmup)
        self._own_runtime = runtime is None
        self.runtime = runtime
        self.service: EmbeddingService | None = None
        self.ready = False
        self.lost: str | None = None  # why the device is gone, a phrase: "the GPU device was lost (...)"
        self.warmup_error: str | None = None
        self.adapter: str | None = None
        # {"shapes_done", "shapes_total", "seconds"} once warm-up has compiled the kernels (/info
        # reports it): the batch shapes run so far, and the seconds since warm-up began at the last.
        self.warmup_progress: dict[str, Any] | None = None
        self._warm_started = 0.0
        self._warm_printed = (0, 0.0)
        self._on_batch = on_batch
        self._on_batch_done = on_batch_done
        self._gauges = gauges
        self._links: set[_EngineLink] = set()
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
                                        max_in_flight=self.max_in_flight, max_wait=self.max_wait,
                                        on_batch=self._on_batch,
                                        on_batch_done=self._on_batch_done, on_warmup=self._warmup_step)
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
            rt = self.runtime
            summary = await anyio.to_thread.run_sync(lambda: rt.device().summary)
            self.adapter = str(summary["summary"])  # /info names it while warming up
            self._tell_links()
            precapture = self.precapture
            if precapture is None:
                # A software adapter captures every packed shape in minutes, not seconds (858 s on
                # the 2-core CPU machine against 5 s for one sentence): there it warms up with one.
                precapture = str(summary.get("type", "")).lower() != "cpu"
                self.precapture = precapture
                if not precapture:
                    print(f"hetero serve: {self.adapter} is a CPU adapter: warming up without capturing every batch "
                          "shape (--precapture captures them all)", file=sys.stderr, flush=True)
            started = self._warm_started = time.perf_counter()
            self._warm_printed = (0, started)  # the tenth of the shapes and the time of the last progress line
            shapes = await self.service.warmup(precapture)
            if precapture:
                print(f"hetero serve: warm-up captured {shapes} batch shapes in {time.perf_counter() - started:.1f} s",
                      file=sys.stderr, flush=True)
            self.ready = True
        except HeteroError as e:
            if self.stopping:
                return  # stopped while warming up
            self.warmup_error = str(e)
            if isinstance(e, DeviceLostError):
                self._mark_lost(e)
            print(f"hetero serve: warm-up failed: {e}", file=sys.stderr, flush=True)
        self._tell_links()

    def _warmup_step(self, done: int, total: int) -> None:
        """The service ran ``done`` of its ``total`` warm-up shapes: ``warmup_progress`` (told to the
        fronts), and with precapture a line on stderr at the start, at each tenth and at least every
        WARMUP_PRINT_EVERY_S (the last line is _warmup's)."""
        now = time.perf_counter()
        started = self._warm_started
        self.warmup_progress = {"shapes_done": done, "shapes_total": total, "seconds": round(now - started, 3)}
        self._tell_links()
        if not self.precapture or done >= total:
            return
        tenth = done * 10 // total
        if done == 0:
            print(f"hetero serve: warm-up: capturing {total} batch shapes (--no-precapture starts at once and "
                  "captures each shape when it first comes)", file=sys.stderr, flush=True)
        elif tenth > self._warm_printed[0] or now - self._warm_printed[1] >= WARMUP_PRINT_EVERY_S:
            print(f"hetero serve: warm-up: {done} of {total} batch shapes captured in {now - started:.1f} s",
                  file=sys.stderr, flush=True)
        else:
            return
        self._warm_printed = (tenth, now)

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
        link = _EngineLink(stream, self.model.dim)
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

    def _submit(self, link: _EngineLink, body: bytes) -> None:
        """One EMBED frame's sentences into the batcher in one call; each request is answered on
        ``link`` when all of its sentences are done."""
        assert self.service is not None
        rids, counts, ids = _parse_embed(body)
        answers = _Answers(link, rids, counts, self._engine_error)
        try:
            self.service.submit_each(ids, answers.row)
            return
        except OverloadedError:
            pass  # the frame as a whole does not fit: admit what does, request by request
        except Exception as e:  # refused at once (closing)
            for j in range(len(rids)):
                answers.refuse(j, e)
            return
        for j in range(len(rids)):
            start, end = answers.starts[j], answers.starts[j + 1]
            if start == end:
                continue
            try:
                self.service.submit_each(ids[start:end], functools.partial(answers.row_after, start))
            except Exception as e:
                answers.refuse(j, e)

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
        self.warmup_progress: dict[str, Any] | None = None  # the engine's (EmbeddingEngine.warmup_progress)
        self._link: _FrontLink | None = None
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
        link = self._link = _FrontLink(stream, self._pending.__contains__)
        link.send(_HELLO, self.secret)
        async with anyio.create_task_group() as tg:
            tg.start_soon(link.writer)
            async for kind, body in link.frames():
                if kind == _RESULT:
                    for rid, rows in _parse_result(body):
                        self._settle(rid, rows, None)
                elif kind == _ERROR:
                    (rid,) = _ID.unpack_from(body)
                    err = json.loads(body[_ID.size:])
                    self._settle(rid, None, EngineError(err["status"], err["message"], err["code"]))
                elif kind == _STATUS:
                    state = json.loads(body)
                    self.ready, self.lost = state["ready"], state["lost"]
                    self.warmup_error, self.adapter = state["warmup_error"], state["adapter"]
                    self.warmup_progress = state.get("warmup")
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
        link.request(rid, ids)  # sent with the other requests of this pass of the event loop
        try:
            await entry.event.wait()
        finally:
            self._pending.pop(rid, None)
        if entry.error is not None:
            raise entry.error
        assert entry.rows is not None
        return entry.rows

