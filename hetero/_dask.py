"""Running graphs on a dask.distributed cluster (the ``hetero[dask]`` extra).

Policy, in the words of the code below:

- **A cluster task is a chunk of whole graph runs.** Dask costs milliseconds per task and
  hetero microseconds per stage, and a stage's tensors cannot leave their device, so a
  task never holds a single stage: it runs a chunk of inputs through the worker's
  :class:`~hetero.Runtime` with ``rt.map``.
- **Chunk sizes follow measurements.** Each chunk returns the worker's time on it; by
  default a chunk lasts about 20 client round trips (0.05 to 1 s) of the measured run time,
  and enough chunks are in flight to cover a round trip (:class:`ChunkTuning` states the
  rule). Explicit ``chunk_size`` and ``max_in_flight`` are used as given.
- **One Runtime per worker.** :class:`HeteroPlugin` creates it (and its device) in
  ``setup``, runs it on an event loop of its own (an anyio blocking portal) and closes
  it in ``teardown``. Task threads hand their chunk to that loop and wait.
- **A graph is unpickled once per worker.** :class:`DaskRuntime` pickles each graph once
  into a small cluster task of its own that returns those bytes; chunk tasks depend on
  it, and each worker unpickles a graph's bytes once (a cache keyed by the task).
  Scattered data would be lost for good with the one worker holding it (the scheduler's
  memory manager keeps one replica), failing every chunk that needs it; a task's result
  is computed again. Graphs pickle by reference to their stage functions; a
  :class:`~hetero.pipelines.minilm.Model` among their constants pickles as its path and
  reloads on the worker, once per process.
- **Order and backpressure.** The client keeps a queue of chunk futures in input order.
  A chunk counts as in flight until its last result was yielded, so a slow consumer
  holds submission back. Each chunk asks for ``1 / tasks_per_worker`` of the resource:
  a worker declaring ``wgpu=1`` runs ``tasks_per_worker`` chunks at once, so its GPU does
  not drain between chunks.
- **Lost workers.** Dask reschedules the tasks of a worker that died on the others (up
  to ``distributed.scheduler.allowed-failures`` times); the queue keeps the order.
- **Errors.** A worker returns the results before a failed run together with the error,
  so the client yields those and then raises at the failure's place. A
  :class:`~hetero.StageError` keeps ``.stage`` and its ``__cause__`` across the wire.
  Dask waits forever for a resource no worker declares (dask#9587), so every map first
  asks the scheduler and raises :class:`ClusterError` when no worker has it.
- **Which adapter, how busy.** :meth:`DaskRuntime.adapters` asks every worker which
  adapter its Runtime's device runs on (:class:`WorkerAdapter`: the ``HETERO_ADAPTER``
  selector that picks exactly it, its index, name and ids), so a cluster of identical GPUs
  can show that no two workers share one. :meth:`DaskRuntime.worker_stats` returns each
  worker's counters since its plugin was set up (:class:`WorkerStats`: chunks, runs, the
  seconds a chunk was running, the process's CPU time, GPU submissions).
- **Work that is not a graph** (a pipeline driving the worker's Runtime itself, such as
  text generation) runs as one task through :meth:`DaskRuntime.call`, with
  :meth:`HeteroPlugin.keep` for what later tasks on that worker reuse.
- **Any event loop.** The client must be a synchronous ``distributed.Client`` (its own
  loop runs in a thread). Futures are awaited through done-callbacks that wake the
  caller's loop (asyncio or trio) without blocking the client's thread; results are
  fetched on a worker thread. ``run_sync``/``map_sync`` serve plain synchronous code.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import inspect
import itertools
import math
import os
import pickle
import socket
import threading
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.from_thread
import cloudpickle
from distributed import Client, Future, LocalCluster, WorkerPlugin, get_worker

from ._argtypes import check_positive_int
from ._bridge import loop_caller, running_loop
from ._graph import Graph
from ._runtime import Runtime
from .errors import GraphError, HeteroError, NoAdapterError, StageError, _own_reducers

_own_reducers()  # importing distributed (above) replaced the reducers of hetero's errors

__all__ = ["ChunkTuning", "ClusterError", "DaskRuntime", "HeteroPlugin", "LocalWGPUCluster", "PLUGIN_NAME", "WorkerAdapter",
           "WorkerStats", "dask_setup", "ensure_plugin"]

PLUGIN_NAME = "hetero"
_GRAPH_CACHE = 16  # graphs a worker keeps unpickled (least recently used dropped)


class ClusterError(HeteroError):
    """The cluster cannot run hetero graphs: no worker declares the resource, or a chunk was lost for good."""


@dataclass(frozen=True)
class WorkerAdapter:
    """The adapter a worker's Runtime runs on (:meth:`DaskRuntime.adapters`).

    ``selector`` is the ``HETERO_ADAPTER`` value that selects exactly this adapter in the
    worker's enumeration (``"vulkan#1"``, as ``hetero info`` prints it) and ``index`` its
    position among all adapters; both are None when the worker asked for none and
    identical GPUs share the summary of the one wgpu preferred. ``requested`` is what the
    worker asked for (``HeteroPlugin(adapter=...)``, else ``$HETERO_ADAPTER``; None: wgpu's
    high-performance preference). wgpu exposes no PCI bus or UUID: identical GPUs differ
    only by ``index``.
    """

    selector: str | None
    index: int | None
    name: str
    backend: str
    type: str
    summary: str
    vendor_id: int | None
    device_id: int | None
    requested: str | None
    pid: int
    host: str


@dataclass(frozen=True)
class WorkerStats:
    """A worker's counters since its :class:`HeteroPlugin` was set up (:meth:`DaskRuntime.worker_stats`).

    ``busy_s`` counts the wall seconds during which at least one chunk was running on the
    worker (host time, not GPU time); ``cpu_s`` is the worker process's CPU time (every
    thread), ``submissions`` its device's GPU submissions, ``uptime_s`` the seconds since
    setup. ``run_s`` sums, over chunks, the wall seconds a chunk spent in ``rt.map`` on the
    worker's event loop, and ``hop_s`` the rest of its task: handing the chunk to that loop
    and back (the portal), and finding its graph. Differences of two snapshots describe
    what happened between them.
    """

    chunks: int
    runs: int
    busy_s: float
    cpu_s: float
    submissions: int
    uptime_s: float
    run_s: float = 0.0
    hop_s: float = 0.0


# -- worker side ------------------------------------------------------------------------------------------------
class HeteroPlugin(WorkerPlugin):
    """Gives each dask worker one :class:`hetero.Runtime` and an event loop to run it.

    ``runtime_options`` are :class:`hetero.Runtime`'s keyword arguments (``adapter=``,
    ``cpu_threads=``, ...); without ``adapter`` the worker's ``HETERO_ADAPTER`` decides.
    Register it with ``client.register_plugin(HeteroPlugin())``, or start workers with
    ``dask worker ... --preload hetero.dask``. The Runtime and its device are created in
    ``setup`` (so a worker without a usable adapter fails at registration, not in a
    task) and closed in ``teardown``.
    """

    name = PLUGIN_NAME

    def __init__(self, **runtime_options: Any) -> None:
        try:
            inspect.signature(Runtime).bind(**runtime_options)
        except TypeError as e:
            raise TypeError(f"HeteroPlugin takes hetero.Runtime's keyword arguments: {e}") from None
        self.runtime_options = dict(runtime_options)
        self.runtime: Runtime | None = None
        self._portal: anyio.from_thread.BlockingPortal | None = None
        self._portal_cm: contextlib.AbstractContextManager[anyio.from_thread.BlockingPortal] | None = None
        self._count_lock = threading.Lock()
        self._active = 0  # chunks running now
        self._busy_since = 0  # perf_counter_ns when _active became 1
        self._busy_ns = 0
        self._chunks = self._runs = 0
        self._run_ns = self._hop_ns = 0
        self._setup_ns = time.perf_counter_ns()
        self._graph_cache: collections.OrderedDict[str, Graph] = collections.OrderedDict()
        self._graph_lock = threading.Lock()
        self._kept: dict[Any, Any] = {}
        self._keep_lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"runtime_options": self.runtime_options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state["runtime_options"])  # type: ignore[misc]

    async def setup(self, worker: Any) -> None:
        address = getattr(worker, "address", None)
        await asyncio.to_thread(self._start, f"worker {address}" if address else "this worker")

    async def teardown(self, worker: Any) -> None:
        await asyncio.to_thread(self._stop)

    def _start(self, where: str = "this worker") -> None:
        self._stop()  # set up twice (registered again): one Runtime at a time
        cm = anyio.from_thread.start_blocking_portal(name="hetero-dask")
        portal = cm.__enter__()
        rt: Runtime | None = None
        try:
            rt = Runtime(**self.runtime_options)
            rt.device()  # warm: adapter, device, fence thread; a worker without a GPU fails here
        except BaseException as e:
            # Whatever was made is released: the Runtime (what it started, its trace file), then the portal.
            try:
                if rt is not None:
                    rt.close()
            finally:
                cm.__exit__(None, None, None)
            if isinstance(e, NoAdapterError):
                raise NoAdapterError(f"hetero's dask plugin cannot open a GPU device on {where}: {e} "
                                     "(HeteroPlugin(adapter=...) or the worker's HETERO_ADAPTER chooses the "
                                     "adapter)") from None
            raise
        self._portal_cm, self._portal, self.runtime = cm, portal, rt
        with self._count_lock:
            self._busy_ns = self._chunks = self._runs = self._run_ns = self._hop_ns = 0
            self._busy_since = self._setup_ns = time.perf_counter_ns()

    def _stop(self) -> None:
        rt, cm = self.runtime, self._portal_cm
        self.runtime = self._portal = self._portal_cm = None
        with self._keep_lock:
            kept, self._kept = list(self._kept.values()), {}
        for obj in kept:  # what lived on the Runtime goes before it
            close = getattr(obj, "close", None)
            if callable(close):
                close()
        if rt is not None:
            rt.close()
        if cm is not None:
            cm.__exit__(None, None, None)

    def graph(self, token: str, payload: bytes) -> Graph:
        """The graph pickled as ``payload`` by the graph task ``token``: unpickled once, then cached."""
        with self._graph_lock:  # chunks of one graph start together: one of them unpickles it
            graph = self._graph_cache.get(token)
            if graph is None:
                graph = self._graph_cache[token] = pickle.loads(payload)
                while len(self._graph_cache) > _GRAPH_CACHE:
                    self._graph_cache.popitem(last=False)
            else:
                self._graph_cache.move_to_end(token)
            return graph

    def run_chunk(self, graph: Graph, inputs: list[Any], max_in_flight: int,
                  started_ns: int | None = None) -> tuple[list[Any], Any, tuple[float, float]]:
        """Run ``inputs`` through ``graph`` on this worker's Runtime.

        Returns ``(results, packed error or None, (task_s, run_s))``: ``run_s`` is the wall
        time in ``rt.map`` on the worker's event loop, ``task_s`` the whole task's since
        ``started_ns`` (a ``perf_counter_ns``; default: this call), the client's measure of
        what the worker spent on the chunk.
        """
        t0 = time.perf_counter_ns() if started_ns is None else started_ns
        rt, portal = self.runtime, self._portal
        if rt is None or portal is None:
            raise ClusterError("this worker's HeteroPlugin is not set up (or was torn down)")
        loop_ns = [0, 0]

        async def collect() -> tuple[list[Any], Any]:
            loop_ns[0] = time.perf_counter_ns()
            out: list[Any] = []
            try:
                async for r in rt.map(graph, inputs, max_in_flight=max_in_flight):
                    out.append(r)
            except Exception as e:  # noqa: BLE001 - every failure travels back at its place in the order
                return out, _pack_error(e)
            finally:
                loop_ns[1] = time.perf_counter_ns()
            return out, None

        self._count(+1)
        results: list[Any] = []
        try:
            results, err = portal.call(collect)
        finally:
            run_ns = loop_ns[1] - loop_ns[0] if loop_ns[1] else 0
            task_ns = time.perf_counter_ns() - t0
            self._count(-1, len(results), run_ns, task_ns - run_ns)
        return results, err, (task_ns / 1e9, run_ns / 1e9)

    def keep(self, key: Any, make: Callable[[], Any]) -> Any:
        """The object kept under ``key`` on this worker, made by ``make()`` on first use (blocking).

        For what a task builds on the worker's Runtime and the next tasks reuse (a loaded
        model, say): it lives as long as the Runtime, and its ``close()``, if it has one, is
        called at teardown, before the Runtime closes. One ``make`` runs at a time.
        """
        self._require()
        with self._keep_lock:
            if key not in self._kept:
                self._kept[key] = make()
            return self._kept[key]

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``await fn(self, *args, **kwargs)`` on this worker's event loop; its result (blocking)."""
        portal = self._portal
        if self.runtime is None or portal is None:
            raise ClusterError("this worker's HeteroPlugin is not set up (or was torn down)")
        self._count(+1)
        try:
            return portal.call(functools.partial(fn, self, *args, **kwargs))
        finally:
            self._count(-1)

    def _count(self, step: int, runs: int = 0, run_ns: int = 0, hop_ns: int = 0) -> None:
        now = time.perf_counter_ns()
        with self._count_lock:
            if step > 0 and self._active == 0:
                self._busy_since = now
            self._active += step
            if step < 0:
                self._chunks += 1
                self._runs += runs
                self._run_ns += run_ns
                self._hop_ns += hop_ns
                if self._active == 0:
                    self._busy_ns += now - self._busy_since

    def adapter(self) -> WorkerAdapter:
        """The adapter this worker's Runtime runs on."""
        from ._gpu.device import adapter_labels, adapter_position, list_adapters

        rt = self._require()
        dev = rt.device()
        adapters = list_adapters()
        index = adapter_position(dev.adapter, adapters)
        info = dev.adapter.info
        requested = self.runtime_options.get("adapter")
        if requested is None:
            requested = os.environ.get("HETERO_ADAPTER") or None

        def as_int(v: Any) -> int | None:
            return v if isinstance(v, int) and not isinstance(v, bool) else None

        return WorkerAdapter(
            selector=None if index is None else adapter_labels(adapters)[index], index=index,
            name=dev.summary["name"], backend=dev.summary["backend"], type=dev.summary["type"],
            summary=dev.summary["summary"], vendor_id=as_int(info.get("vendor_id")),
            device_id=as_int(info.get("device_id")),
            requested=requested if requested is None or isinstance(requested, str) else repr(requested),
            pid=os.getpid(), host=socket.gethostname())

    def stats(self) -> WorkerStats:
        """This worker's counters since setup."""
        rt = self._require()
        now = time.perf_counter_ns()
        with self._count_lock:
            busy = self._busy_ns + (now - self._busy_since if self._active else 0)
            chunks, runs, since = self._chunks, self._runs, self._setup_ns
            run_ns, hop_ns = self._run_ns, self._hop_ns
        return WorkerStats(chunks=chunks, runs=runs, busy_s=busy / 1e9, cpu_s=time.process_time(),
                           submissions=rt.device().submission.submissions, uptime_s=(now - since) / 1e9,
                           run_s=run_ns / 1e9, hop_s=hop_ns / 1e9)

    def _require(self) -> Runtime:
        if self.runtime is None:
            raise ClusterError("this worker's HeteroPlugin is not set up (or was torn down)")
        return self.runtime


def _plugin(worker: Any) -> HeteroPlugin:
    plugin = worker.plugins.get(PLUGIN_NAME)
    if not isinstance(plugin, HeteroPlugin):
        raise ClusterError(f"worker {worker.address} has no HeteroPlugin; register it with "
                           "client.register_plugin(hetero.dask.HeteroPlugin()) or start workers with "
                           "'--preload hetero.dask'")
    return plugin


def _graph_bytes(token: str, payload: bytes) -> tuple[str, bytes]:
    """The graph task: its token and the pickled graph (a result dask computes again if lost)."""
    return token, payload


def _run_chunk(graph: tuple[str, bytes] | Graph, inputs: list[Any],
               max_in_flight: int) -> tuple[list[Any], Any, tuple[float, float]]:
    """The cluster task: a chunk of whole graph runs on the worker's Runtime (with its timing)."""
    t0 = time.perf_counter_ns()
    plugin = _plugin(get_worker())
    return plugin.run_chunk(graph if isinstance(graph, Graph) else plugin.graph(*graph), inputs, max_in_flight, t0)


def _call_task(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """The cluster task of :meth:`DaskRuntime.call`: ``(result, None)`` or ``(None, packed error)``
    (an error travels as data, as a chunk's does: dask's own error path turns some into strings)."""
    plugin = _plugin(get_worker())
    try:
        return plugin.call(fn, *args, **kwargs), None
    except Exception as e:  # noqa: BLE001 - raised again on the client
        return None, _pack_error(e)


def _worker_adapter(dask_worker: Any) -> WorkerAdapter:
    return _plugin(dask_worker).adapter()


def _worker_stats(dask_worker: Any) -> WorkerStats:
    return _plugin(dask_worker).stats()


def _on_worker(fn: Callable[[Runtime], Any], dask_worker: Any) -> Any:
    return fn(_plugin(dask_worker)._require())


async def dask_setup(worker: Any) -> None:
    """``dask worker ... --preload hetero.dask`` registers a :class:`HeteroPlugin` with default options."""
    await worker.plugin_add(HeteroPlugin())


def _has_plugin(dask_worker: Any) -> bool:
    return isinstance(dask_worker.plugins.get(PLUGIN_NAME), HeteroPlugin)


def ensure_plugin(client: Client, **runtime_options: Any) -> bool:
    """Register ``HeteroPlugin(**runtime_options)`` unless every worker already has one; True if it did.

    Registering replaces a plugin of the same name on every worker (its Runtime is closed
    and a new one created), so this leaves a cluster that is already set up alone.
    """
    if all(client.run(_has_plugin).values()):
        return False
    client.register_plugin(HeteroPlugin(**runtime_options))
    return True


def _portable(e: BaseException | None) -> BaseException | None:
    """``e`` itself if it pickles, else a HeteroError naming it (an error must not break the reply)."""
    if e is None:
        return None
    try:
        pickle.dumps(e)
        return e
    except Exception:  # noqa: BLE001 - anything that fails to pickle is replaced
        return HeteroError(f"{type(e).__name__}: {e}")


def _pack_error(e: BaseException) -> tuple[str, Any, str | None, BaseException | None]:
    cause = _portable(e.__cause__)
    if isinstance(e, StageError):
        return "stage", str(e), e.stage, cause
    return "error", _portable(e), None, cause


def _unpack_error(packed: tuple[str, Any, str | None, BaseException | None]) -> BaseException:
    kind, payload, stage, cause = packed
    err: BaseException = StageError(payload, stage or "") if kind == "stage" else payload
    err.__cause__ = cause
    return err


# -- client side ------------------------------------------------------------------------------------------------
DEFAULT_CHUNK_SIZE = 16
"""The fixed chunk size :class:`DaskRuntime` used before chunk sizes adapted, for programs that
pin one (``DaskRuntime(chunk_size=DEFAULT_CHUNK_SIZE)``). By default (``chunk_size=None``)
the size follows the measured run time; see :class:`ChunkTuning` for the rule."""
DEFAULT_WORKER_IN_FLIGHT = 4
"""Runs in flight inside one chunk on its worker (the worker's ``rt.map``), as ``rt.map``'s
own default: enough to keep the GPU fed while the host records the next runs."""
CHUNK_ROUND_TRIPS = 20
"""An adaptive chunk runs for at least this many client round trips (:class:`ChunkTuning`)."""
CHUNK_MIN_S = 0.05
"""... and for at least this many seconds,"""
CHUNK_MAX_S = 1.0
"""... but for at most this many, so that the last chunks of a map balance across workers."""
MAX_CHUNK_SIZE = 4096
"""The largest chunk an adaptive size chooses (results wait on the worker until fetched)."""
MAX_IN_FLIGHT = 32
"""The most chunks per worker an adaptive map keeps in flight."""


@dataclass(frozen=True)
class ChunkTuning:
    """How a :class:`DaskRuntime` sizes the chunks of one graph's maps (:meth:`DaskRuntime.tuning`).

    The rule, for ``chunk_size=None`` (the default) and maps without ``max_in_flight``:

    - ``run_s``: seconds per run on the worker, the median over the last three chunks of
      ``rt.map``'s wall time on the worker divided by the chunk's runs (with
      ``tasks_per_worker`` chunks sharing a worker, each chunk's share of it);
    - ``round_trip_s``: what a chunk costs the client beyond the worker's time on it:
      submission, scheduling, the wire both ways and fetching its results; the smallest
      seen (a chunk that waited in the worker's queue measures more);
    - ``chunk_size`` = ``target_s / run_s`` runs, at least ``worker_in_flight`` (so the
      chunk's own pipeline fills) and at most :data:`MAX_CHUNK_SIZE`, where ``target_s`` =
      :data:`CHUNK_ROUND_TRIPS` round trips, within [:data:`CHUNK_MIN_S`,
      :data:`CHUNK_MAX_S`]: the per-chunk cost stays a few percent of a chunk, and a map's
      last chunk is short enough to balance across workers;
    - ``max_in_flight`` (chunks per worker) = ``tasks_per_worker`` running, one being
      fetched and yielded, and enough queued behind them to cover a round trip:
      ``tasks_per_worker + 1 + ceil(tasks_per_worker * round_trip_s / (chunk_size * run_s))``.

    Before the first chunk of a graph comes back, chunks hold ``worker_in_flight`` runs and
    ``tasks_per_worker + 2`` are in flight per worker. The measurements are kept per graph
    for the DaskRuntime's life, so a second map starts where the first ended. An explicit
    ``DaskRuntime(chunk_size=...)`` or ``map(..., max_in_flight=...)`` is used as given.
    ``chunks`` counts the chunks measured; ``fixed`` is True when ``chunk_size`` was given.
    """

    chunk_size: int
    max_in_flight: int
    run_s: float | None
    round_trip_s: float | None
    chunks: int
    fixed: bool


class _Tuner:
    """The measurements behind :class:`ChunkTuning` for one graph (thread-safe: maps run anywhere)."""

    def __init__(self, fixed: int | None, min_size: int, tasks_per_worker: int) -> None:
        self.fixed, self.min_size, self.tasks = fixed, min_size, tasks_per_worker
        self._runs: collections.deque[float] = collections.deque(maxlen=3)
        self._round_trip: float | None = None
        self._chunks = 0
        self._lock = threading.Lock()

    def observe(self, runs: int, run_s: float, task_s: float, latency_s: float, fetch_s: float) -> None:
        """A chunk of ``runs`` came back: ``run_s``/``task_s`` on the worker, ``latency_s`` from
        submission to done and ``fetch_s`` to fetch its results, both on the client."""
        if runs <= 0:
            return
        with self._lock:
            self._chunks += 1
            self._runs.append(max(run_s, 1e-9) / runs)
            trip = max(0.0, latency_s - task_s) + max(0.0, fetch_s)
            self._round_trip = trip if self._round_trip is None else min(self._round_trip, trip)

    def tuning(self) -> ChunkTuning:
        with self._lock:
            run_s = sorted(self._runs)[len(self._runs) // 2] if self._runs else None
            trip, chunks = self._round_trip, self._chunks
        size = self.fixed if self.fixed is not None else self._size(run_s, trip)
        return ChunkTuning(chunk_size=size, max_in_flight=self._in_flight(size, run_s, trip), run_s=run_s,
                           round_trip_s=trip, chunks=chunks, fixed=self.fixed is not None)

    def _size(self, run_s: float | None, trip: float | None) -> int:
        if run_s is None or trip is None:
            return self.min_size
        target = min(CHUNK_MAX_S, max(CHUNK_MIN_S, CHUNK_ROUND_TRIPS * trip))
        return max(self.min_size, min(MAX_CHUNK_SIZE, int(target / run_s)))

    def _in_flight(self, size: int, run_s: float | None, trip: float | None) -> int:
        if run_s is None or trip is None:
            return self.tasks + 2
        return min(MAX_IN_FLIGHT, self.tasks + 1 + math.ceil(self.tasks * trip / max(size * run_s, 1e-9)))


@dataclass(eq=False)
class _Chunk:
    """A submitted chunk: its future, its runs, when it was sent and when it was seen done (client clock)."""

    future: Future
    runs: int
    sent_at: float
    done_at: float | None = None

    def stamp(self, _fut: Future) -> None:
        self.done_at = time.perf_counter()


@dataclass(eq=False)
class _MapState:
    """One map's graph, its graph task, its tuner and its in-flight rule."""

    graph: Graph
    gfut: Future
    tuner: _Tuner
    per_worker: int | None  # the caller's max_in_flight, else None: the tuner's
    workers: int

    def limit(self) -> int:
        """Chunks in flight at most, now (the tuner's advice changes as chunks come back)."""
        per = self.per_worker if self.per_worker is not None else self.tuner.tuning().max_in_flight
        return per * self.workers


class DaskRuntime:
    """Runs graphs on a dask.distributed cluster, keeping :class:`hetero.Runtime`'s contract.

    ``client`` is a synchronous ``distributed.Client`` whose workers carry a
    :class:`HeteroPlugin` and declare ``resource`` (``dask worker ADDR --resources
    wgpu=1``, or :class:`LocalWGPUCluster`). ``chunk_size`` graph runs make one cluster
    task (default None: sized from the measured run time and round trip, see
    :class:`ChunkTuning`); ``worker_in_flight`` of them run at once on the worker (its ``rt.map``);
    ``tasks_per_worker`` chunks run at once on a worker that declares one unit of the
    resource. ``workers`` (addresses) keeps the chunks on those of the workers: they go
    elsewhere only while none of them is alive (a lost worker's chunks are still retried).

    From asyncio or trio: ``async with DaskRuntime(client) as drt``, then ``await
    drt.run(g, **inputs)`` and ``async for r in drt.map(g, inputs)``. From synchronous
    code: ``with DaskRuntime(client) as drt``, then ``drt.run_sync(...)`` and ``for r in
    drt.map_sync(...)``. Closing releases the graph tasks of its graphs; it does not
    close the client.
    """

    def __init__(self, client: Client, *, resource: str = "wgpu", chunk_size: int | None = None,
                 worker_in_flight: int = DEFAULT_WORKER_IN_FLIGHT, tasks_per_worker: int = 2,
                 workers: Sequence[str] | None = None) -> None:
        if not isinstance(client, Client):
            raise HeteroError(f"DaskRuntime needs a distributed.Client, got {type(client).__name__}")
        if client.asynchronous:
            raise HeteroError("DaskRuntime needs a synchronous distributed.Client (Client(address), without "
                              "asynchronous=True); it runs from asyncio, trio and plain code alike")
        if not isinstance(resource, str) or not resource:
            raise ValueError(f"resource must be a non-empty string, got {resource!r}")
        self.client = client
        self.resource = resource
        self.chunk_size: int | None = None if chunk_size is None else check_positive_int(
            "chunk_size", chunk_size, rule="an integer >= 1 or None (adaptive)")
        self.worker_in_flight = check_positive_int("worker_in_flight", worker_in_flight)
        self.tasks_per_worker = check_positive_int("tasks_per_worker", tasks_per_worker)
        if workers is not None and (isinstance(workers, str) or not workers
                                    or not all(isinstance(w, str) for w in workers)):
            raise ValueError(f"workers must be a non-empty sequence of worker addresses, got {workers!r}")
        self._only: tuple[str, ...] | None = None if workers is None else tuple(workers)
        self._graphs: dict[int, tuple[Graph, int, Future]] = {}
        self._tuners: dict[int, tuple[Graph, _Tuner]] = {}
        self._lock = threading.Lock()
        self._closed = False

    # -- lifecycle ------------------------------------------------------------------
    async def __aenter__(self) -> DaskRuntime:
        await anyio.to_thread.run_sync(self.workers)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await anyio.to_thread.run_sync(self.close)

    def __enter__(self) -> DaskRuntime:
        self.workers()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the graph tasks of this runtime's graphs. The client stays open."""
        with self._lock:
            self._closed = True
            graphs, self._graphs = self._graphs, {}
            self._tuners = {}
        for _, _, fut in graphs.values():
            fut.release()

    def _check_open(self) -> None:
        if self._closed:
            raise HeteroError("this DaskRuntime is closed; create a new one")

    # -- the cluster ----------------------------------------------------------------
    def workers(self) -> list[str]:
        """Addresses of the workers that declare the resource (those of ``workers=`` only, when given); raises
        :class:`ClusterError` if none (blocking)."""
        self._check_open()
        info = self.client.scheduler_info(n_workers=-1)
        workers: dict[str, Any] = dict(info.get("workers") or {})
        have = [addr for addr, w in workers.items() if (w.get("resources") or {}).get(self.resource, 0) > 0]
        if not have:
            seen = "; ".join(f"{addr}: {w.get('resources') or {}}" for addr, w in workers.items()) or "no workers"
            raise ClusterError(
                f"no worker of the cluster at {info.get('address', '?')} declares the resource {self.resource!r} "
                f"(workers and their resources: {seen}); start workers with 'dask worker ADDRESS --resources "
                f"{self.resource}=1 --preload hetero.dask' or use hetero.dask.LocalWGPUCluster")
        if self._only is not None:
            chosen = [addr for addr in have if addr in self._only]
            if not chosen:
                raise ClusterError(f"none of the workers given ({', '.join(self._only)}) declares the resource "
                                   f"{self.resource!r}; those that do: {', '.join(have)}")
            return chosen
        return have

    def adapters(self) -> dict[str, WorkerAdapter]:
        """The adapter of each worker that declares the resource, by worker address (blocking).

        Raises :class:`ClusterError` when no worker declares the resource or one has no
        :class:`HeteroPlugin`. From async code, call it in a thread
        (``await anyio.to_thread.run_sync(drt.adapters)``).
        """
        return self._each(_worker_adapter)

    def worker_stats(self) -> dict[str, WorkerStats]:
        """Each worker's :class:`WorkerStats`, by worker address (blocking, as :meth:`adapters`)."""
        return self._each(_worker_stats)

    def on_workers(self, fn: Callable[[Runtime], Any]) -> dict[str, Any]:
        """``fn(runtime)`` on each worker's :class:`hetero.Runtime`, by worker address (blocking, as
        :meth:`adapters`).

        ``fn`` travels to the workers (a module-level function pickles by reference) and runs
        on the worker's event-loop thread (``client.run``), so it must be quick: questions a
        pipeline asks of the runtime that will run it (its adapter, its placement), not graph
        runs. An exception it raises is raised here.
        """
        return self._each(functools.partial(_on_worker, fn))

    def _each(self, fn: Callable[..., Any]) -> dict[str, Any]:
        """``fn(dask_worker=...)`` on each worker that declares the resource, by address (``client.run``)."""
        return dict(sorted(self.client.run(fn, workers=self.workers()).items()))

    def _graph_future(self, graph: Graph, workers: list[str]) -> Future:
        """The future of ``graph``'s graph task (scattered to ``workers`` if it does not pickle): one
        per graph and version (blocking)."""
        with self._lock:
            self._check_open()
            hit = self._graphs.get(id(graph))
            if hit is not None and hit[0] is graph and hit[1] == graph.version:
                return hit[2]
        graph.plan()  # a malformed graph fails here, not on every worker
        try:
            payload = cloudpickle.dumps(graph, protocol=pickle.HIGHEST_PROTOCOL)  # __main__'s functions by value
        except Exception as e:  # noqa: BLE001 - a closure over a lock, say: fine for workers in this process
            # Scattered as itself, which only workers in the client's process can take; such data dies with
            # the worker that holds it.
            try:
                fut = self.client.scatter(graph, workers=workers, broadcast=True, hash=False)
            except Exception as scattered:  # noqa: BLE001 - dask's serialization error names its own objects
                raise GraphError(
                    f"graph {graph.name!r} cannot travel to workers in other processes: it does not pickle "
                    f"({type(e).__name__}: {e}); use module-level stage functions and picklable constants, "
                    "or workers in this process") from scattered
        else:
            token = f"hetero-graph-{uuid.uuid4().hex}"
            fut = self.client.submit(_graph_bytes, token, payload, key=token, pure=False)
        with self._lock:
            old = self._graphs.get(id(graph))
            self._graphs[id(graph)] = (graph, graph.version, fut)
        if old is not None and old[2] is not fut:
            old[2].release()
        return fut

    def tuning(self, graph: Graph) -> ChunkTuning:
        """How the next map of ``graph`` sizes its chunks and how many it keeps in flight per worker
        (:class:`ChunkTuning`: the rule and what was measured so far)."""
        return self._tuner(graph).tuning()

    def _tuner(self, graph: Graph) -> _Tuner:
        with self._lock:
            hit = self._tuners.get(id(graph))
            if hit is None or hit[0] is not graph:
                hit = self._tuners[id(graph)] = (graph, _Tuner(self.chunk_size, self.worker_in_flight,
                                                               self.tasks_per_worker))
            return hit[1]

    def _prepare(self, graph: Graph, max_in_flight: int | None) -> _MapState:
        if not isinstance(graph, Graph):
            raise GraphError(f"run() expects a hetero.Graph, got {type(graph).__name__}")
        workers = self.workers()
        per_worker = None if max_in_flight is None else check_positive_int("max_in_flight", max_in_flight)
        return _MapState(graph, self._graph_future(graph, workers), self._tuner(graph), per_worker, len(workers))

    def _submit(self, state: _MapState, chunk: list[Any]) -> _Chunk:
        sent = time.perf_counter()
        fut = self.client.submit(_run_chunk, state.gfut, chunk, self.worker_in_flight, pure=False,
                                 resources={self.resource: 1.0 / self.tasks_per_worker},
                                 workers=None if self._only is None else list(self._only),
                                 allow_other_workers=self._only is not None)
        c = _Chunk(fut, len(chunk), sent)
        fut.add_done_callback(c.stamp)  # on the client's loop thread, as soon as the scheduler says so
        return c

    @staticmethod
    def _chunk_result(state: _MapState, c: _Chunk) -> tuple[list[Any], Any]:
        """The chunk's ``(results, packed error)`` (blocking: fetches the results from the worker),
        measured into the graph's tuner."""
        t0 = time.perf_counter()
        try:
            results, err, (task_s, run_s) = c.future.result()
        except HeteroError:
            raise
        except Exception as e:  # noqa: BLE001 - KilledWorker, CancelledError, a lost connection
            raise ClusterError(f"a chunk of graph {state.graph.name!r} failed on the cluster: "
                               f"{type(e).__name__}: {e}") from e
        fetched = time.perf_counter()
        if err is None:
            state.tuner.observe(c.runs, run_s, task_s, (c.done_at or t0) - c.sent_at, fetched - max(t0, c.done_at or t0))
        return results, err

    @staticmethod
    def _chunks(state: _MapState, inputs: Iterable[Mapping[str, Any]]) -> Iterator[list[Any]]:
        source = iter(inputs)
        while chunk := list(itertools.islice(source, state.tuner.tuning().chunk_size)):
            yield chunk

    # -- running (async) ------------------------------------------------------------
    async def run(self, graph: Graph, /, **inputs: Any) -> Any:
        """Run ``graph`` once on the cluster; return its output (a tuple for several)."""
        if isinstance(graph, Graph):
            graph.plan().check_inputs(inputs)  # wrong inputs fail here, before anything is submitted
        async with contextlib.aclosing(self.map(graph, [inputs], max_in_flight=1)) as results:
            async for r in results:
                return r
        raise AssertionError("unreachable: one input gives one result or an error")  # pragma: no cover

    async def map(self, graph: Graph, inputs: Iterable[Mapping[str, Any]], *,
                  max_in_flight: int | None = None) -> AsyncGenerator[Any, None]:
        """Run ``graph`` over many inputs on the cluster; yield results in input order.

        Inputs go out in chunks (``chunk_size``, else sized as :class:`ChunkTuning` says);
        at most ``max_in_flight`` chunks per worker holding the resource (counted when the
        map starts; default: as :class:`ChunkTuning` says, from the measured run time and
        round trip) are submitted or waiting to be yielded, so a slow consumer holds the
        producer back. The first failure is raised at its place in the order and stops the
        runs behind it.
        """
        state = await anyio.to_thread.run_sync(self._prepare, graph, max_in_flight)
        pending: collections.deque[_Chunk] = collections.deque()
        chunks = self._chunks(state, inputs)
        try:
            for chunk in itertools.chain([None], chunks):  # None: first fill before any wait
                if chunk is not None:
                    pending.append(self._submit(state, chunk))
                if len(pending) < state.limit():
                    continue
                async for r in self._drain_head(state, pending):
                    yield r
            while pending:
                async for r in self._drain_head(state, pending):
                    yield r
        finally:
            for c in pending:
                c.future.release()

    async def _drain_head(self, state: _MapState, pending: collections.deque[_Chunk]) -> AsyncIterator[Any]:
        await _done(pending[0].future)
        results, err = await anyio.to_thread.run_sync(self._chunk_result, state, pending[0])
        for r in results:
            yield r
        if err is not None:
            raise _unpack_error(err)
        pending.popleft().future.release()

    # -- a task of its own ----------------------------------------------------------
    async def call(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """``await fn(plugin, *args, **kwargs)`` as one cluster task on a worker; its result.

        For work that is not a graph's runs, such as a pipeline that drives the worker's
        Runtime itself: ``fn`` is an async function (a module-level one pickles by
        reference), run on the worker's event loop with that worker's :class:`HeteroPlugin`
        (its ``runtime``, and ``keep`` for what later calls reuse). The task asks for
        ``1 / tasks_per_worker`` of the resource, as a chunk does, and stays on ``workers=``
        when given. An exception it raises is raised here; a lost task raises
        :class:`ClusterError`.
        """
        fut = await anyio.to_thread.run_sync(self._submit_call, fn, args, kwargs)
        try:
            await _done(fut)
            return await anyio.to_thread.run_sync(self._call_result, fn, fut)
        finally:
            fut.release()

    def call_sync(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """:meth:`call` from synchronous code (not from inside a running event loop)."""
        self._not_in_loop("call_sync")
        fut = self._submit_call(fn, args, kwargs)
        try:
            return self._call_result(fn, fut)
        finally:
            fut.release()

    def _submit_call(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Future:
        if not callable(fn):
            raise TypeError(f"DaskRuntime.call() expects an async function, got {type(fn).__name__}")
        self.workers()  # no worker with the resource: ClusterError now, not a task waiting forever
        return self.client.submit(_call_task, fn, args, kwargs, pure=False,
                                  resources={self.resource: 1.0 / self.tasks_per_worker},
                                  workers=None if self._only is None else list(self._only),
                                  allow_other_workers=self._only is not None)

    @staticmethod
    def _call_result(fn: Callable[..., Any], fut: Future) -> Any:
        try:
            result, err = fut.result()
        except HeteroError:
            raise
        except Exception as e:  # noqa: BLE001 - KilledWorker, CancelledError, a lost connection
            name = getattr(fn, "__qualname__", repr(fn))
            raise ClusterError(f"a call of {name} failed on the cluster: {type(e).__name__}: {e}") from e
        if err is not None:
            raise _unpack_error(err)
        return result

    # -- running (sync) -------------------------------------------------------------
    def run_sync(self, graph: Graph, /, **inputs: Any) -> Any:
        """:meth:`run` from synchronous code (not from inside a running event loop)."""
        self._not_in_loop("run_sync")
        for r in self.map_sync(graph, [inputs], max_in_flight=1):
            return r
        raise AssertionError("unreachable: one input gives one result or an error")  # pragma: no cover

    def map_sync(self, graph: Graph, inputs: Iterable[Mapping[str, Any]], *,
                 max_in_flight: int | None = None) -> Iterator[Any]:
        """:meth:`map` from synchronous code: a generator of results in input order."""
        self._not_in_loop("map_sync")
        state = self._prepare(graph, max_in_flight)
        pending: collections.deque[_Chunk] = collections.deque()
        try:
            for chunk in self._chunks(state, inputs):
                pending.append(self._submit(state, chunk))
                while len(pending) >= state.limit():
                    yield from self._drain_head_sync(state, pending)
            while pending:
                yield from self._drain_head_sync(state, pending)
        finally:
            for c in pending:
                c.future.release()

    def _drain_head_sync(self, state: _MapState, pending: collections.deque[_Chunk]) -> Iterator[Any]:
        results, err = self._chunk_result(state, pending[0])
        yield from results
        if err is not None:
            raise _unpack_error(err)
        pending.popleft().future.release()

    @staticmethod
    def _not_in_loop(what: str) -> None:
        lib = running_loop()
        if lib is not None:
            raise HeteroError(f"DaskRuntime.{what}() cannot be called inside a running {lib} event loop; "
                              f"use 'async with DaskRuntime(client) as drt' and the async methods")


async def _done(fut: Future) -> None:
    """Wait for ``fut`` without blocking the caller's loop (asyncio or trio) or the client's thread."""
    if not fut.done():
        done = anyio.Event()
        call = loop_caller()
        fut.add_done_callback(lambda _f: call(done.set))
        await done.wait()


# -- a local cluster, one worker per adapter -------------------------------------------------------------------
class LocalWGPUCluster(LocalCluster):
    """A local dask cluster with one worker process per GPU adapter, as ``LocalCUDACluster`` per CUDA device.

    ``adapter`` is a ``HETERO_ADAPTER`` pattern, by default :meth:`default_pattern`
    (``$HETERO_ADAPTER``, else the backend of the adapter hetero would pick: every GPU of
    that backend). The ``n`` adapters are those :meth:`selectors_for` finds for it (in
    enumeration order, as ``hetero info`` lists them; software rasterizers only where no
    GPU matches; an ``adapter`` with its own ``#k``, such as ``"vulkan#0"``, is that one
    alone), or, when ``adapter`` is a list of ``HETERO_ADAPTER`` values (``["vulkan#0",
    "vulkan#2"]``), those (each must select an adapter). Worker ``i`` runs with
    ``HETERO_ADAPTER`` set to the ``i mod n``-th and declares ``resources={resource: 1}``.
    ``n_workers`` defaults to ``n``; more workers than adapters share them round-robin.
    Register a :class:`HeteroPlugin` through a client (``client.register_plugin(
    HeteroPlugin())``); the scheduler hands it to workers that start later, such as one
    the nanny restarted. Other keyword arguments go to ``distributed.LocalCluster``
    (always with worker processes: the adapter is chosen per process).
    :meth:`DaskRuntime.adapters` tells which adapter each worker runs on.
    """

    def __init__(self, n_workers: int | None = None, *, adapter: str | Sequence[str] | None = None,
                 resource: str = "wgpu", threads_per_worker: int = 2, **kwargs: Any) -> None:
        if adapter is None or isinstance(adapter, str):
            selectors = self.selectors_for(adapter if adapter is not None else self.default_pattern())
        else:
            selectors = self._checked_selectors(adapter)
        self.selectors = selectors
        n = len(selectors) if n_workers is None else check_positive_int("n_workers", n_workers)
        kwargs.setdefault("dashboard_address", ":0")
        kwargs.pop("processes", None)
        super().__init__(n_workers=0, threads_per_worker=threads_per_worker, processes=True,
                         resources={resource: 1}, **kwargs)
        self.scale(n)
        if not self.asynchronous:
            self.wait_for_workers(n)

    @staticmethod
    def default_pattern() -> str:
        """``$HETERO_ADAPTER`` when set, else the backend of the adapter hetero picks (``"vulkan"``, ``"metal"``)."""
        from ._gpu.device import select_adapter

        env = os.environ.get("HETERO_ADAPTER")
        return env if env else str(select_adapter().info.get("backend_type", "")).lower()

    @staticmethod
    def _checked_selectors(given: Sequence[str]) -> list[str]:
        from ._gpu.device import adapter_index, list_adapters

        selectors = list(given)
        if not selectors or not all(isinstance(s, str) and s for s in selectors):
            raise ValueError(f"adapter: a list of HETERO_ADAPTER values must hold non-empty strings, got {given!r}")
        adapters = list_adapters()
        for sel in selectors:
            adapter_index(adapters, sel)  # raises NoAdapterError listing the adapters
        return selectors

    @staticmethod
    def selectors_for(adapter: str) -> list[str]:
        """``HETERO_ADAPTER`` values for every adapter matching ``adapter``: ``adapter#0``, ``adapter#1``, ...

        Adapters of type CPU (software rasterizers such as lavapipe) are left out when a
        GPU matches too. Raises :class:`~hetero.NoAdapterError` (listing the adapters)
        when none matches.
        """
        from ._gpu.device import adapter_index, list_adapters

        adapters = list_adapters()
        if "#" in adapter:  # one adapter named exactly: every worker shares it
            adapter_index(adapters, adapter)
            return [adapter]
        matches: list[tuple[str, Any]] = []
        while True:
            sel = f"{adapter}#{len(matches)}"
            try:
                matches.append((sel, adapters[adapter_index(adapters, sel)]))  # type: ignore[index]
            except HeteroError:
                break
        if not matches:
            adapter_index(adapters, f"{adapter}#0")  # raises NoAdapterError listing what exists
        gpus = [sel for sel, a in matches if str(a.info.get("adapter_type", "")).casefold() != "cpu"]
        return gpus or [sel for sel, _ in matches]  # software rasterizers only where there is no GPU

    def new_worker_spec(self) -> dict[Any, Any]:
        """The next worker: the smallest free integer name, pinned to its adapter through the environment."""
        name = next(i for i in itertools.count() if i not in self.worker_spec)
        spec = {**self.new_spec, "options": dict(self.new_spec["options"])}
        env = dict(spec["options"].get("env") or {})
        env["HETERO_ADAPTER"] = self.selectors[name % len(self.selectors)]
        spec["options"]["env"] = env
        return {name: spec}

