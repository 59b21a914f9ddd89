"""The Prometheus metrics of ``hetero serve``, in one process or summed over several.

With several server processes (``PROMETHEUS_MULTIPROC_DIR`` set before prometheus_client
is imported), each process writes its samples to files there and ``/metrics`` sums them
all: the fronts count requests, the engine process counts batches and sets the gauges
(``livesum``: refreshed by the process that knows them, not read at scrape time).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from hetero.errors import HeteroError

__all__ = ["ServeMetrics", "import_serve"]


def import_serve() -> Any:
    """prometheus_client, after checking that the optional extra ``serve`` is installed."""
    try:
        import prometheus_client
    except ImportError as e:
        raise HeteroError(f"hetero serve needs the optional extra 'serve' ({e.name} is not installed): "
                          "pip install 'hetero[serve]'") from e
    return prometheus_client


class ServeMetrics:
    """Every metric ``/metrics`` shows, and ``exposed``, the registry it renders.

    ``queued`` and ``memory_in_use`` (callables) feed the gauges at scrape time in a
    single-process server; with several processes :meth:`set_gauges` writes them instead.
    """

    def __init__(self, queued: Callable[[], int], memory_in_use: Callable[[], int]) -> None:
        prom = self.prom = import_serve()
        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        reg = prom.CollectorRegistry()
        self.requests = prom.Counter("hetero_embed_requests", "Embedding requests by HTTP status code",
                                     ["code"], registry=reg)
        self.inputs = prom.Counter("hetero_embed_inputs", "Sentences embedded", registry=reg)
        self.batches = prom.Counter("hetero_embed_batches", "Batches formed by the batcher", registry=reg)
        self.duration = prom.Histogram(
            "hetero_embed_request_duration_seconds", "Time to serve an embedding request", registry=reg,
            buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10))
        self.batch_size = prom.Histogram(
            "hetero_embed_batch_size", "Sentences per batch formed", registry=reg,
            buckets=tuple(float(1 << k) for k in range(13)))
        waits = (.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10)
        self.queue_duration = prom.Histogram(
            "hetero_embed_queue_duration_seconds", "Mean time the sentences of a batch waited for it to form "
            "(one observation per batch)", registry=reg, buckets=waits)
        self.batch_duration = prom.Histogram(
            "hetero_embed_batch_duration_seconds", "Time from a batch forming to its rows (one observation per "
            "batch)", registry=reg, buckets=waits)
        self.queue = prom.Gauge("hetero_embed_queue_inputs", "Sentences waiting for a batch", registry=reg,
                                multiprocess_mode="livesum")
        self.memory = prom.Gauge("hetero_gpu_memory_in_use_bytes", "Device memory in use by the buffer pool",
                                 registry=reg, multiprocess_mode="livesum")
        if self.multiprocess:
            from prometheus_client import multiprocess

            self.exposed = prom.CollectorRegistry()
            multiprocess.MultiProcessCollector(self.exposed)
        else:
            self.exposed = reg
            self.queue.set_function(queued)
            self.memory.set_function(memory_in_use)

    def on_batch(self, items: int, cost: int) -> None:
        self.batches.inc()
        self.batch_size.observe(items)

    def on_batch_done(self, items: int, waited: float, ran: float) -> None:
        self.queue_duration.observe(waited)
        self.batch_duration.observe(ran)

    def set_gauges(self, queued: int, memory_in_use: int) -> None:
        self.queue.set(queued)
        self.memory.set(memory_in_use)

    def render(self) -> bytes:
        """The Prometheus text of ``exposed``."""
        data: bytes = self.prom.generate_latest(self.exposed)
        return data
