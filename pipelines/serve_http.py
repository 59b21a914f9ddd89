"""The HTTP runner of ``hetero serve``: an application behind granian or hypercorn.

The application is a :class:`~hetero.pipelines.serve_base.ServerBase`: an
:class:`~hetero.pipelines.serve_app.EmbeddingServer` or a
:class:`~hetero.pipelines.serve_llm.GenerationServer`. Two HTTP servers, one application:

- **granian** (the default on asyncio and uvloop): a Rust HTTP server; requests reach the
  server's RSGI entry point with the HTTP parsing done outside the interpreter, so a front
  spends its interpreter time on requests, not on HTTP. Its embedded server runs on the
  running asyncio loop; it binds the port with SO_REUSEPORT, so front processes share it.
- **hypercorn**: ASGI on asyncio and trio (granian has no trio: ``--backend trio`` takes
  hypercorn).

Shutdown is the same on both: :meth:`~hetero.pipelines.serve_base.ServerBase.shutdown`
(SIGTERM, Ctrl-C) makes new requests 503 while the listener stays open; once the requests
in flight have finished (at most ``graceful_timeout`` seconds) the HTTP server stops, then
the engine closes.
"""

from __future__ import annotations

import gc
import importlib.util
import signal
import socket
from collections.abc import Callable
from typing import Any

import anyio

from hetero.errors import HeteroError
from hetero.lowlevel import running_loop

from .serve_base import ServerBase

__all__ = ["BACKENDS", "HTTP_SERVERS", "freeze_heap_when_ready", "listen_socket", "resolve_backend", "resolve_http", "run_on", "serve",
           "serve_async"]

# The event loops a server runs on: asyncio's own, asyncio with uvloop's loop, trio; "auto" is
# uvloop where it is installed (the [serve] extra installs it where it builds), else asyncio.
BACKENDS = ("auto", "asyncio", "uvloop", "trio")
# The HTTP servers in front: "auto" is granian unless the loop is trio's (granian runs on asyncio only).
HTTP_SERVERS = ("auto", "granian", "hypercorn")


def resolve_backend(backend: str) -> str:
    """``backend`` (one of :data:`BACKENDS`) as the loop a server will run on: ``"auto"`` becomes
    ``"uvloop"`` where uvloop is installed, else ``"asyncio"``. HeteroError for an unknown name
    or for ``"uvloop"`` without uvloop."""
    if backend not in BACKENDS:
        raise HeteroError(f"--backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    have_uvloop = importlib.util.find_spec("uvloop") is not None
    if backend == "auto":
        return "uvloop" if have_uvloop else "asyncio"
    if backend == "uvloop" and not have_uvloop:
        raise HeteroError("--backend uvloop needs uvloop, which is not installed: pip install 'hetero[serve]' "
                          "(uvloop builds on Linux and macOS), or choose --backend asyncio")
    return backend


def resolve_http(http: str, backend: str) -> str:
    """``http`` (one of :data:`HTTP_SERVERS`) as the server that runs on ``backend`` (a resolved loop):
    ``"auto"`` is granian, or hypercorn on trio or where granian is not installed. HeteroError for
    an unknown name, for granian on trio, and for a server that is not installed."""
    if http not in HTTP_SERVERS:
        raise HeteroError(f"--http must be one of {', '.join(HTTP_SERVERS)}; got {http!r}")
    have_granian = importlib.util.find_spec("granian") is not None
    if http == "auto":
        http = "granian" if backend != "trio" and have_granian else "hypercorn"
    if http == "granian":
        if backend == "trio":
            raise HeteroError("--http granian runs on asyncio only, not --backend trio: choose --http hypercorn "
                              "with trio, or --backend asyncio or uvloop with granian")
        if not have_granian:
            raise HeteroError("--http granian needs granian, which is not installed: pip install 'hetero[serve]', "
                              "or choose --http hypercorn")
    elif importlib.util.find_spec("hypercorn") is None:
        raise HeteroError("--http hypercorn needs hypercorn, which is not installed: pip install 'hetero[serve]'")
    return http


def run_on(backend: str, main: Callable[[], Any]) -> Any:
    """``anyio.run(main)`` on ``backend``'s event loop (:func:`resolve_backend` first)."""
    backend = resolve_backend(backend)
    if backend == "trio":
        return anyio.run(main, backend="trio")
    return anyio.run(main, backend="asyncio", backend_options={"use_uvloop": backend == "uvloop"})


def listen_socket(host: str, port: int, *, reuse_port: bool = False, listen: bool = True) -> socket.socket:
    """A TCP socket bound to ``host:port`` (0: an ephemeral port).

    ``reuse_port``: SO_REUSEPORT, so that front processes listen on one port and the kernel
    spreads connections over them. ``listen=False`` binds only: a probe that holds the port
    (and finds an ephemeral one) for servers that bind it themselves with SO_REUSEPORT.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        if listen:
            sock.listen(1024)  # connections made before the server accepts wait in the backlog
    except OSError as e:
        sock.close()
        raise HeteroError(f"cannot listen on {host}:{port}: {e.strerror or e}; choose another --host or --port") \
            from e
    return sock


async def serve_async(server: ServerBase, host: str = "127.0.0.1", port: int = 8080, *, http: str = "auto",
                      ready: Callable[[str], None] | None = None, graceful_timeout: float = 30.0,
                      signals: bool = True, reuse_port: bool = False, freeze_heap: bool = False) -> None:
    """Serve ``server`` with ``http`` (one of :data:`HTTP_SERVERS`) on the running loop until
    :meth:`~hetero.pipelines.serve_base.ServerBase.shutdown`.

    ``signals``: SIGTERM and SIGINT call ``server.shutdown()``. ``ready(url)`` is called
    once the port is bound and the server accepts (``port=0`` binds an ephemeral port; the URL
    names it). Shutdown is graceful: new requests get 503, requests in flight finish (up to
    ``graceful_timeout`` seconds), then the HTTP server and the engine stop. ``freeze_heap``:
    the process is the server's alone; once warm-up is over, ``gc.freeze()``.
    """
    loop = running_loop()
    http = resolve_http(http, "trio" if loop == "trio" else "asyncio")
    server.http_server = http
    # granian binds the port itself (SO_REUSEPORT); the probe holds it and finds an ephemeral one
    sock = listen_socket(host, port, reuse_port=reuse_port or http == "granian", listen=http == "hypercorn")
    bound_host, bound_port = sock.getsockname()[:2]
    stop = server.stop_event()

    async def on_signal() -> None:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as received:
            async for _ in received:  # a second signal must not kill the process mid-shutdown
                server.shutdown()

    async def announce() -> None:
        if ready is not None:
            shown = f"[{bound_host}]" if ":" in bound_host else bound_host
            ready(f"http://{shown}:{bound_port}")

    async with server.running(), anyio.create_task_group() as tg:
        if signals:
            tg.start_soon(on_signal)
        if freeze_heap:
            tg.start_soon(freeze_heap_when_ready, server)
        drained = anyio.Event()  # set once shutdown began and the requests in flight finished

        async def drain() -> None:
            await stop.wait()
            with anyio.move_on_after(graceful_timeout):
                await server.stop()
            drained.set()

        tg.start_soon(drain)
        try:
            if http == "granian":
                await _serve_granian(server, bound_host, bound_port, sock, announce, drained)
            else:
                await _serve_hypercorn(server, sock, announce, drained, graceful_timeout, loop == "trio")
        finally:
            sock.close()
            tg.cancel_scope.cancel()  # the signal watcher, the drain and the heap freezer end with the server


async def _serve_hypercorn(server: ServerBase, sock: socket.socket, announce: Callable[[], Any],
                           drained: anyio.Event, graceful_timeout: float, trio: bool) -> None:
    from hypercorn.config import Config

    config = Config()
    config.bind = [f"fd://{sock.detach()}"]  # hypercorn owns the descriptor from here on
    config.graceful_timeout = graceful_timeout
    config.keep_alive_timeout = 75.0  # load generators and proxies keep connections open between requests
    config.accesslog = None
    await announce()  # the socket listens already: connections wait in its backlog
    if trio:
        from hypercorn.trio import serve as hserve_trio

        await hserve_trio(server.app, config, shutdown_trigger=drained.wait)
    else:
        from hypercorn.asyncio import serve as hserve_asyncio

        await hserve_asyncio(server.app, config, shutdown_trigger=drained.wait)


async def _serve_granian(server: ServerBase, host: str, port: int, probe: socket.socket,
                         announce: Callable[[], Any], drained: anyio.Event) -> None:
    import logging

    from granian.constants import HTTPModes, Interfaces
    from granian.server.embed import Server

    logging.getLogger("granian").setLevel(logging.ERROR)  # its start and stop lines are hetero serve's to say
    front = Server(server, address=host, port=port, interface=Interfaces.RSGI, http=HTTPModes.auto,
                   backlog=1024, log_enabled=False)
    async with anyio.create_task_group() as tg:
        async def stop_when_drained() -> None:
            await drained.wait()
            front.stop()  # granian lets the connections' requests in flight finish

        tg.start_soon(stop_when_drained)
        tg.start_soon(_announce_when_accepting, host, port, probe, announce)
        await front.serve()
        tg.cancel_scope.cancel()


async def _announce_when_accepting(host: str, port: int, probe: socket.socket, announce: Callable[[], Any]) -> None:
    """Once granian accepts on the port, close the probe that held it and call ``announce``."""
    while True:
        try:
            stream = await anyio.connect_tcp(host, port)
        except OSError:
            await anyio.sleep(0.005)
            continue
        await stream.aclose()
        break
    probe.close()
    await announce()


def serve(server: ServerBase, host: str = "127.0.0.1", port: int = 8080, backend: str = "auto",
          *, http: str = "auto", ready: Callable[[str], None] | None = None, graceful_timeout: float = 30.0,
          reuse_port: bool = False) -> None:
    """:func:`serve_async` on a new ``backend`` event loop (one of :data:`BACKENDS`), until SIGTERM
    or SIGINT.

    The process is the server's from here on: once warm-up is over, what start-up allocated
    is moved out of the garbage collector's reach (``gc.freeze()``).
    """
    run_on(backend, lambda: serve_async(server, host, port, http=http, ready=ready,
                                        graceful_timeout=graceful_timeout, reuse_port=reuse_port, freeze_heap=True))


async def freeze_heap_when_ready(state: Any) -> None:
    """Once ``state`` (a server or an engine) is ready, or its warm-up failed, ``gc.freeze()``.

    For a process that is the server's alone. What start-up allocated (the model, its
    tokenizer, compiled kernels, captured stages: tens of thousands of objects) moves out
    of the garbage collector's reach, so that its collections, which the objects of every
    request trigger, no longer scan it.
    """
    while not state.ready and state.warmup_error is None and state.lost is None:
        await anyio.sleep(0.05)
    gc.collect()  # what is garbage now is not kept for good
    gc.freeze()

