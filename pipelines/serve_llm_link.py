"""The generation engine behind ``hetero serve``: an LLM and its warm-up, in-process or in a process of its own.

One :class:`GenerationEngine` owns the :class:`~hetero.pipelines.LLM` (its runtime, KV cache
and the generation loop that batches every caller's sequences). ``hetero serve`` with one
process calls it directly. With ``--workers N`` (N > 1) it runs alone in an engine process
and N HTTP front processes reach it through :class:`GenerationClient`: the fronts parse
requests, tokenize (each loads the model's tokenizer) and write the server-sent events; the
engine's LLM decodes the sequences of every front in the same steps.

Both offer the server one interface: ``running()``, ``stream(ids, **sampling)`` (an async
iterator of :class:`~hetero.pipelines.StreamPiece`; refusals raise what the LLM raises:
OverloadedError, InputError, KVCacheFullError, DeviceLostError, RuntimeClosedError),
``agenerate(ids, **sampling)`` (a :class:`~hetero.pipelines.Completion`), ``stats()`` (the
LLM's :class:`GenerationStats`-like record), ``facts`` (the model's shape and the KV cache
for ``/info``) and the state ``ready``, ``lost``, ``warmup_error``, ``adapter``.

The link is TCP on the loopback interface, begun with a secret as the embedding engine's
link is (the engine writes its port to an address file in a private directory). Frames
(:class:`~hetero.pipelines.serve_link.FrameLink`) are ``u32 body length | u8 kind | body`` in
the machine's byte order:

- ``HELLO`` (front to engine, first): the secret;
- ``GENERATE`` (front to engine): ``u64 request id | u32 n | n x int32 token ids |`` JSON sampling;
- ``CANCEL`` (front to engine): ``u64 request id``: the client left; the sequence stops;
- ``PIECES`` (engine to front): ``u32 k | k x (u64 request id, i32 token id or -1, u8 finish,
  u32 text bytes) |`` the texts (UTF-8), every piece made since the engine's writer last ran;
- ``ERROR`` (engine to front): ``u64 request id |`` JSON ``{"kind", "message"}``;
- ``STATUS`` (engine to front): JSON ``{"ready", "lost", "warmup_error", "adapter", "facts",
  "stats"}``, on connect, on each change and four times a second (the fronts' gauges and
  ``/info`` read it).

A front whose link closes answers 503 from then on; the engine cancels the sequences of a
front that left.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import json
import os
import struct
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import anyio.abc

from hetero.errors import DeviceLostError, HeteroError, InputError, OverloadedError, RuntimeClosedError

from .kv_cache import KVCacheFullError
from .llm import LLM, Completion, StreamPiece
from .serve_link import FrameLink

__all__ = ["GenerationClient", "GenerationEngine", "LinkStats", "error_kind", "raise_kind"]

_ID = struct.Struct("=Q")
_PIECE = struct.Struct("=QiBI")
_COUNT = struct.Struct("=I")
_HELLO, _GENERATE, _CANCEL, _PIECES, _ERROR, _STATUS = 1, 2, 3, 4, 5, 6
_FINISH = {None: 0, "stop": 1, "length": 2}
_FINISH_OF = {v: k for k, v in _FINISH.items()}
STATUS_EVERY_S = 0.25

# The errors a generation may end with, by the name that crosses the link.
_KINDS: tuple[tuple[str, type[BaseException]], ...] = (
    ("overloaded", OverloadedError), ("kv_cache_full", KVCacheFullError), ("input", InputError),
    ("device_lost", DeviceLostError), ("closed", RuntimeClosedError))


def error_kind(e: BaseException) -> str:
    """The name an error crosses the link by (``"error"`` for any other)."""
    return next((name for name, cls in _KINDS if isinstance(e, cls)), "error")


def raise_kind(kind: str, message: str) -> BaseException:
    """The exception a front raises for an error of ``kind`` the engine reported."""
    for name, cls in _KINDS:
        if name == kind:
            return KVCacheFullError(message) if cls is KVCacheFullError else cls(message)
    return HeteroError(f"generation failed in the engine process: {message}")


@dataclasses.dataclass(frozen=True)
class LinkStats:
    """The LLM's counts as the engine last reported them (the fields of the LLM's ``stats()``)."""

    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    tokens_generated: int = 0
    prompt_tokens: int = 0
    requests_finished: int = 0


def _stats_dict(llm: LLM) -> dict[str, int]:
    st = llm.stats()
    return {f.name: int(getattr(st, f.name)) for f in dataclasses.fields(LinkStats)}


class _Link(FrameLink):
    """A generation link: the pieces queued while the writer waited leave as one PIECES frame."""

    def __init__(self, stream: anyio.abc.ByteStream) -> None:
        super().__init__(stream, "generation link")
        self._pieces: list[tuple[int, StreamPiece]] = []

    def piece(self, rid: int, p: StreamPiece) -> None:
        """Queue a piece of request ``rid``."""
        self._pieces.append((rid, p))
        self.wake()

    def gather(self) -> None:
        if self._pieces:
            pieces, self._pieces = self._pieces, []
            texts = [p.text.encode("utf-8") for _, p in pieces]
            heads = b"".join(_PIECE.pack(rid, -1 if p.token_id is None else p.token_id, _FINISH[p.finish_reason],
                                         len(t)) for (rid, p), t in zip(pieces, texts))
            self.put(_PIECES, _COUNT.pack(len(pieces)), heads, *texts)


def parse_pieces(body: bytes) -> list[tuple[int, StreamPiece]]:
    """A PIECES frame's ``(request id, piece)``; HeteroError if it does not add up."""
    (k,) = _COUNT.unpack_from(body)
    pos = _COUNT.size
    heads = [_PIECE.unpack_from(body, pos + i * _PIECE.size) for i in range(k)]
    pos += k * _PIECE.size
    if pos + sum(h[3] for h in heads) != len(body):
        raise HeteroError(f"generation link: a malformed PIECES frame ({k} pieces in {len(body)} bytes)")
    out = []
    for rid, tok, finish, n in heads:
        out.append((rid, StreamPiece(body[pos:pos + n].decode("utf-8"), None if tok < 0 else tok, _FINISH_OF[finish])))
        pos += n
    return out


def generate_frame(rid: int, ids: list[int], sampling: dict[str, Any]) -> list[bytes]:
    return [_ID.pack(rid), _COUNT.pack(len(ids)), struct.pack(f"={len(ids)}i", *ids), json.dumps(sampling).encode()]


def parse_generate(body: bytes) -> tuple[int, list[int], dict[str, Any]]:
    (rid,) = _ID.unpack_from(body)
    (n,) = _COUNT.unpack_from(body, _ID.size)
    at = _ID.size + _COUNT.size
    if len(body) < at + 4 * n:
        raise HeteroError(f"generation link: a GENERATE frame of {len(body)} bytes is shorter than its {n} ids")
    ids = list(struct.unpack_from(f"={n}i", body, at))
    return rid, ids, json.loads(body[at + 4 * n:])


def llm_facts(llm: LLM) -> dict[str, Any]:
    """What ``/info`` says of the model and the KV cache."""
    c, engine = llm.config, llm.engine
    return {"architecture": c.arch, "layers": c.num_layers, "hidden_size": c.hidden_size, "heads": c.num_heads,
            "kv_heads": c.num_kv_heads, "vocab_size": c.vocab_size, "weights": llm.model.weight_mode,
            "max_seq_len": llm.max_seq_len, "max_batch_tokens": llm.max_batch_tokens,
            "block_size": engine.block_size, "kv_dtype": engine.kv_dtype, "kv_cache_bytes": engine.kv_cache_bytes}


class GenerationEngine:
    """An LLM, its warm-up and its state, for a server in this process or for front processes.

    ``llm``: the :class:`~hetero.pipelines.LLM`; ``own``: close it when :meth:`running` ends.
    ``gauges(stats)``, when given, is called four times a second while running (the
    process-shared Prometheus gauges of a multi-process server).
    """

    def __init__(self, llm: LLM, *, own: bool = False, gauges: Callable[[Any], None] | None = None) -> None:
        self.llm = llm
        self.own = own
        self.facts = llm_facts(llm)
        self.max_seq_len = llm.max_seq_len
        self.ready = False
        self.lost: str | None = None
        self.warmup_error: str | None = None
        self.adapter: str | None = None
        self._gauges = gauges
        self._links: set[_Link] = set()

    def stats(self) -> Any:
        return self.llm.stats()

    def stream(self, ids: list[int], **sampling: Any) -> AsyncIterator[StreamPiece]:
        return self.llm.stream(ids, **sampling)

    async def agenerate(self, ids: list[int], **sampling: Any) -> Completion:
        c = await self.llm.agenerate(ids, **sampling)
        assert isinstance(c, Completion)
        return c

    def mark_lost(self, e: BaseException) -> None:
        if self.lost is None:
            self.lost = f"the GPU device was lost: {e}"
            self._tell()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[GenerationEngine]:
        """Warm up in the background (``ready`` says when it is done); on exit, close an own LLM."""
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._warmup)
                tg.start_soon(self._tick)
                try:
                    yield self
                finally:
                    tg.cancel_scope.cancel()
        finally:
            if self.own:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(self.llm.close)

    async def _warmup(self) -> None:
        """Compile the step's kernels and capture it (a two-token generation), then ``ready``."""
        llm = self.llm
        try:
            summary = await anyio.to_thread.run_sync(lambda: llm.runtime.device().summary)
            self.adapter = str(summary["summary"])
            ids = llm.encode("Hello") or [0]
            await llm.agenerate(ids[:1], max_tokens=2)
            self.ready = True
        except HeteroError as e:
            self.warmup_error = str(e)
            if isinstance(e, DeviceLostError):
                self.lost = f"the GPU device was lost: {e}"
            print(f"hetero serve: warm-up failed: {e}", file=sys.stderr, flush=True)
        self._tell()

    async def _tick(self) -> None:
        """The gauges and the fronts' STATUS, refreshed while running."""
        while True:
            await anyio.sleep(STATUS_EVERY_S)
            if self._gauges is not None:
                self._gauges(self.llm.stats())
            self._tell()

    def _status(self) -> bytes:
        return json.dumps({"ready": self.ready, "lost": self.lost, "warmup_error": self.warmup_error,
                           "adapter": self.adapter, "facts": self.facts, "stats": _stats_dict(self.llm)}).encode()

    def _tell(self) -> None:
        if self._links:
            body = self._status()
            for link in self._links:
                link.send(_STATUS, body)

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
        os.replace(partial, address_file)
        task_status.started(port)
        async with listener:
            await listener.serve(lambda stream: self._serve_front(stream, secret))

    async def _serve_front(self, stream: anyio.abc.ByteStream, secret: bytes) -> None:
        link = _Link(stream)
        scopes: dict[int, anyio.CancelScope] = {}
        try:
            async with stream, anyio.create_task_group() as tg:
                frames = link.frames(first_limit=len(secret))
                first = await anext(frames, None)
                if first is None or first[0] != _HELLO or not hmac.compare_digest(first[1], secret):
                    return  # not one of this server's fronts
                self._links.add(link)
                tg.start_soon(link.writer)
                link.send(_STATUS, self._status())
                async for kind, body in frames:
                    if kind == _GENERATE:
                        rid, ids, sampling = parse_generate(body)
                        scope = scopes[rid] = anyio.CancelScope()
                        tg.start_soon(self._generate, link, rid, ids, sampling, scope, scopes)
                    elif kind == _CANCEL:
                        (rid,) = _ID.unpack_from(body)
                        if rid in scopes:
                            scopes[rid].cancel()
                    else:
                        raise HeteroError(f"engine: a front sent a frame of unknown kind {kind}")
                tg.cancel_scope.cancel()  # the front left: its sequences stop
        except Exception as e:  # one front's bad link never stops the engine serving the others
            print(f"hetero serve: engine: dropped a front's link: {type(e).__name__}: {e}", file=sys.stderr,
                  flush=True)
        finally:
            link.closed = True
            self._links.discard(link)

    async def _generate(self, link: _Link, rid: int, ids: list[int], sampling: dict[str, Any],
                        scope: anyio.CancelScope, scopes: dict[int, anyio.CancelScope]) -> None:
        try:
            with scope:
                async with contextlib.aclosing(self.llm.stream(ids, **sampling)) as pieces:  # type: ignore[type-var]
                    async for p in pieces:
                        link.piece(rid, p)
        except Exception as e:  # noqa: BLE001 - the front answers it (a refusal, or a 500)
            if isinstance(e, DeviceLostError):
                self.mark_lost(e)
            link.send(_ERROR, _ID.pack(rid), json.dumps({"kind": error_kind(e), "message": str(e)}).encode())
        finally:
            scopes.pop(rid, None)


class _Pending:
    """One request's pieces as they come back, and its error."""

    __slots__ = ("pieces", "event", "error", "done")

    def __init__(self) -> None:
        self.pieces: deque[StreamPiece] = deque()
        self.event = anyio.Event()
        self.error: BaseException | None = None
        self.done = False

    def wake(self) -> None:
        self.event.set()


class GenerationClient:
    """A front process's way to the :class:`GenerationEngine` of the engine process (see the module doc).

    ``address_file``: where the engine writes its loopback port; ``secret``: what the engine
    expects first. :meth:`running` connects (waiting while the engine starts, up to
    ``connect_timeout`` seconds) and follows its state; after the link closes, ``lost`` says
    so and every request in flight and after fails with RuntimeClosedError (503).
    """

    def __init__(self, address_file: str, secret: bytes, *, connect_timeout: float = 600.0) -> None:
        self.address_file = address_file
        self.secret = secret
        self.connect_timeout = connect_timeout
        self.ready = False
        self.lost: str | None = None
        self.warmup_error: str | None = None
        self.adapter: str | None = None
        self.facts: dict[str, Any] = {}
        self._stats = LinkStats()
        self._link: _Link | None = None
        self._next = 0
        self._pending: dict[int, _Pending] = {}

    @property
    def max_seq_len(self) -> int:
        return int(self.facts.get("max_seq_len", 0))

    def stats(self) -> LinkStats:
        return self._stats

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[GenerationClient]:
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
                    raise HeteroError(f"cannot reach the generation engine (address file {self.address_file}) "
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
                if kind == _PIECES:
                    for rid, piece in parse_pieces(body):
                        p = self._pending.get(rid)
                        if p is not None:
                            p.pieces.append(piece)
                            p.wake()
                elif kind == _ERROR:
                    (rid,) = _ID.unpack_from(body)
                    err = json.loads(body[_ID.size:])
                    p = self._pending.get(rid)
                    if p is not None:
                        p.error = raise_kind(err["kind"], err["message"])
                        p.wake()
                elif kind == _STATUS:
                    state = json.loads(body)
                    self.ready, self.lost = state["ready"], state["lost"]
                    self.warmup_error, self.adapter = state["warmup_error"], state["adapter"]
                    self.facts = state["facts"]
                    self._stats = LinkStats(**state["stats"])
            tg.cancel_scope.cancel()
        self._gone("the generation engine process stopped")

    def mark_lost(self, e: BaseException) -> None:
        """The engine lost its device (it tells every front too)."""
        if self.lost is None:
            self.lost = f"the GPU device was lost: {e}"

    def _gone(self, why: str) -> None:
        self.ready = False
        if self.lost is None:
            self.lost = why
        self._link = None
        for p in self._pending.values():
            if p.error is None:
                p.error = RuntimeClosedError(f"{why}; restart the server")
            p.wake()

    async def stream(self, ids: list[int], **sampling: Any) -> AsyncIterator[StreamPiece]:
        """The pieces of one generation in the engine process (see the module doc)."""
        link = self._link
        if link is None or self.lost is not None:
            raise RuntimeClosedError(f"{self.lost or 'the generation engine is not connected'}; retry shortly")
        self._next += 1
        rid = self._next
        p = self._pending[rid] = _Pending()
        link.send(_GENERATE, *generate_frame(rid, ids, sampling))
        try:
            while True:
                while p.pieces:
                    piece = p.pieces.popleft()
                    if piece.finish_reason is not None:
                        p.done = True
                    yield piece
                    if p.done:
                        return
                if p.error is not None:
                    p.done = True
                    raise p.error
                await p.event.wait()
                p.event = anyio.Event()
        finally:
            self._pending.pop(rid, None)
            if not p.done and self._link is link and not link.closed:
                link.send(_CANCEL, _ID.pack(rid))

    async def agenerate(self, ids: list[int], **sampling: Any) -> Completion:
        start = time.perf_counter()
        text, tokens, finish, first, last = [], [], "length", None, None
        async with contextlib.aclosing(self.stream(ids, **sampling)) as pieces:  # type: ignore[type-var]
            async for piece in pieces:
                now = time.perf_counter()
                first = now if first is None else first
                last = now
                text.append(piece.text)
                if piece.token_id is not None:
                    tokens.append(piece.token_id)
                if piece.finish_reason is not None:
                    finish = piece.finish_reason
        rate = (len(tokens) - 1) / (last - first) if first is not None and last and last > first else None
        return Completion("".join(text), tokens, finish, len(ids), None if first is None else first - start, rate)
