"""Which embedding graph a caller asks for on a runtime: with the stages' CPU implementations, or GPU only.

The graph builders (:mod:`hetero.pipelines.embed_graph`) are told, as ``cpu=``; they never
look at a runtime. The entry points decide once, from what they know: ``hetero embed`` and
``hetero graph`` from the runtime they made with ``--placement``; :class:`~hetero.pipelines.Encoder`,
:func:`~hetero.pipelines.embed.embed` and :class:`~hetero.pipelines.embed_service.EmbeddingService`
take ``cpu=`` from their caller and, without it, ask this module about the runtime they were given.
"""

from __future__ import annotations

import weakref

import anyio

import hetero

__all__ = ["aoffers_cpu", "offers_cpu"]


def offers_cpu(runtime: object) -> bool:
    """Whether the embedding graphs run on ``runtime`` should carry the CPU implementations.

    They should where the runtime's placement may choose them: ``placement="cpu"``, no GPU,
    or a CPU-emulated adapter (lavapipe, llvmpipe, WARP), where the model picks numpy.
    On a real GPU the graph is GPU stages only: placement prices each stage's own
    transfers, not the fence round trip that a CPU stage inside a chain of GPU stages
    costs, and measured on the H200 it moved small batches' embeddings and pooling to
    the CPU at several times the latency (BENCHMARKS.md). On a ``hetero.dask.DaskRuntime``
    the question goes to every worker's Runtime (blocking: one round trip), and the graph
    carries the twins when each of them would; any other runtime gets the GPU graph.
    May open the runtime's device: from async code use :func:`aoffers_cpu`.
    """
    if not isinstance(runtime, hetero.Runtime):
        on_workers = getattr(runtime, "on_workers", None)  # a DaskRuntime (hetero.dask needs distributed)
        return callable(on_workers) and all(on_workers(offers_cpu).values())
    mode = runtime.options.placement
    if mode != "auto":
        return mode == "cpu"
    try:
        kind = str(runtime.device().summary.get("type", ""))
    except hetero.NoAdapterError:
        return True
    return kind.strip().lower() == "cpu"


# offers_cpu's answer per Runtime: its placement and adapter do not change while it lives.
_offered: weakref.WeakKeyDictionary[hetero.Runtime, bool] = weakref.WeakKeyDictionary()


async def aoffers_cpu(runtime: object) -> bool:
    """:func:`offers_cpu`, asked on a worker thread (it may open the device, or ask a cluster)
    the first time for a Runtime, then remembered: a lone sentence's call would otherwise
    pay a thread round trip before its run starts."""
    known = _offered.get(runtime) if isinstance(runtime, hetero.Runtime) else None
    if known is not None:
        return known
    cpu = await anyio.to_thread.run_sync(offers_cpu, runtime)
    if isinstance(runtime, hetero.Runtime):
        _offered[runtime] = cpu
    return cpu
