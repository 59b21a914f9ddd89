"""The process supervisor of ``hetero serve --workers N``: N HTTP fronts on one port, engines behind them.

The parent process binds nothing but a probe of the port; it starts ``engines`` engine
processes (each owns a Runtime, a device of its own, and the batcher; for a generation model
one engine process owns the LLM, :mod:`~hetero.pipelines.serve_llm_link`) and ``workers`` front
processes (each parses, tokenizes and answers behind its own HTTP server, all listening on
the port with SO_REUSEPORT). It watches them: a process that exits on its own stops the
others and the server exits with status 1. SIGTERM and SIGINT stop the fronts first (they
drain: new requests get 503, those in flight finish), then the engines.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import anyio

from hetero.errors import HeteroError

from .serve_app import EmbeddingServer, ServeSettings
from .serve_base import BaseSettings
from .serve_engine import EmbeddingEngine, EngineClient
from .serve_http import freeze_heap_when_ready, listen_socket, resolve_backend, resolve_http, run_on, serve
from .serve_llm import GenerateMetrics, GenerateSettings, GenerationServer
from .serve_llm_link import GenerationClient, GenerationEngine
from .serve_metrics import ServeMetrics

__all__ = ["check_engines", "front_environment", "serve_workers"]


def front_environment() -> None:
    """A front tokenizes on its own thread (a ``TOKENIZERS_PARALLELISM`` the user set is kept).

    A front tokenizes the few texts of one event-loop pass; the tokenizers package would spread
    them over a thread pool of its own (as many threads as cores) in every front, and with many
    fronts those threads wait for cores more than they work. The fronts are the parallelism.
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _front_main(settings: BaseSettings, host: str, port: int, backend: str, http: str, address_file: str,
                secret: bytes) -> None:
    front_environment()
    server: EmbeddingServer | GenerationServer
    if isinstance(settings, GenerateSettings):
        server = GenerationServer(settings.model, settings=settings, engine=GenerationClient(address_file, secret))
    else:
        assert isinstance(settings, ServeSettings)
        server = EmbeddingServer(settings.model, settings=settings, engine=EngineClient(address_file, secret))
    serve(server, host, port, backend, http=http, reuse_port=True)


def _engine_main(settings: BaseSettings, address_file: str, secret: bytes, backend: str) -> None:
    from .embed_weights import get_model

    if isinstance(settings, GenerateSettings):
        _generation_engine_main(settings, address_file, secret, backend)
        return
    assert isinstance(settings, ServeSettings)
    s = settings
    metrics = ServeMetrics(lambda: 0, lambda: 0)  # several processes: the gauges are set, not read
    engine = EmbeddingEngine(get_model(s.model), int8=s.int8, max_batch_tokens=s.max_batch_tokens,
                             max_queued=s.max_queued, max_in_flight=s.max_in_flight, max_wait=s.max_wait,
                             precapture=s.precapture, on_batch=metrics.on_batch, on_batch_done=metrics.on_batch_done,
                             gauges=metrics.set_gauges)

    # Ctrl-C reaches the whole process group: the fronts drain, and the parent sends this
    # process SIGTERM once they are done.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    async def main() -> None:
        async with engine.running(), anyio.create_task_group() as tg:
            tg.start_soon(freeze_heap_when_ready, engine)
            await tg.start(engine.serve_fronts, address_file, secret)
            with anyio.open_signal_receiver(signal.SIGTERM) as received:
                async for _ in received:
                    break  # the fronts have drained (the parent stops them first): close
            tg.cancel_scope.cancel()

    run_on(backend, main)


def _generation_engine_main(settings: GenerateSettings, address_file: str, secret: bytes, backend: str) -> None:
    from .llm import LLM

    metrics = GenerateMetrics()  # several processes: the gauges are set, not read
    engine = GenerationEngine(LLM(settings.model, **settings.llm_options()), own=True, gauges=metrics.set_gauges)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent sends SIGTERM once the fronts have drained

    async def main() -> None:
        async with engine.running(), anyio.create_task_group() as tg:
            tg.start_soon(freeze_heap_when_ready, engine)
            await tg.start(engine.serve_fronts, address_file, secret)
            with anyio.open_signal_receiver(signal.SIGTERM) as received:
                async for _ in received:
                    break
            tg.cancel_scope.cancel()

    run_on(backend, main)


def serve_workers(settings: BaseSettings | Mapping[str, Any], host: str, port: int, backend: str, workers: int,
                  ready: Callable[[str], None] | None = None, *, engines: int = 1, http: str = "auto") -> int:
    """Serve with ``workers`` HTTP front processes listening on one port (SO_REUSEPORT: the kernel
    spreads connections over them) and ``engines`` engine processes that embed for them.

    The fronts parse requests, tokenize and encode answers; an engine owns a Runtime (a
    device of its own) and the batcher, so the sentences of every front it serves share its
    GPU batches (:mod:`hetero.pipelines.serve_engine`). Front ``i`` uses engine ``i %
    engines``: one engine's host work is bound by one interpreter lock, several share the GPU.
    ``settings``: a :class:`ServeSettings` (or a mapping of its fields), or a
    :class:`~hetero.pipelines.serve_llm.GenerateSettings` for a generation model (one engine
    process, whose LLM decodes the sequences of every front in the same steps). ``http``: the fronts'
    HTTP server (:data:`~hetero.pipelines.serve_http.HTTP_SERVERS`).
    /metrics sums every process's counters, histograms and gauges; /health and /info answer
    for the front that took the connection. SIGTERM or SIGINT shut down gracefully: the fronts
    finish their requests in flight, then the engines stop. Returns 0, or 1 if a process
    exited on its own.
    """
    import multiprocessing
    import secrets
    import shutil
    import tempfile

    check_engines(engines, workers)
    if not isinstance(settings, BaseSettings):
        settings = ServeSettings(**settings)
    if isinstance(settings, GenerateSettings) and engines != 1:
        raise HeteroError(f"--engines {engines}: a generation model runs in one engine process (its LLM batches "
                          "every front's sequences); drop --engines")
    backend = resolve_backend(backend)  # an error here, not in each process
    http = resolve_http(http, backend)
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
    engine_procs = [ctx.Process(target=_engine_main, args=(settings, addresses[k], secret, backend),
                                name="hetero-serve-engine" + (f"-{k}" if engines > 1 else ""))
                    for k in range(engines)]
    fronts = [ctx.Process(target=_front_main,
                          args=(settings, host, port, backend, http, addresses[i % engines], secret),
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


def check_engines(engines: Any, workers: int) -> None:
    """``engines`` engine processes behind ``workers`` fronts: each engine serves at least one front."""
    if isinstance(engines, bool) or not isinstance(engines, int) or not 1 <= engines <= workers:
        raise HeteroError(f"--engines must be an integer from 1 to --workers ({workers}), got {engines!r}: each "
                          "engine serves at least one front; lower --engines or raise --workers")
