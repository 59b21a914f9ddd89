"""hetero: heterogeneous async task graphs.

Declare a DAG of CPU stages (Python functions on a thread pool) and GPU stages
(WebGPU compute recorded through wgpu-py); run it from sync code, asyncio or trio.
"""

# Layout. Two layers, one concept per module; imports point down this list, and the GPU
# runtime layer (the private package _gpu/, whose modules drop the underscore) never
# imports the graph and scheduling layer (tests/test_layout.py checks both).
#
#   graph and scheduling layer (hetero/)
#     _cli        the ``hetero`` command line     _argtypes  argparse types it shares with the pipelines
#     _dask       DaskRuntime, HeteroPlugin: chunks of runs on a dask cluster, a Runtime per worker
#     _runtime    Runtime: worker pools, the device, the run/map entry points
#     _batcher    Batcher: single requests gathered into batched runs
#     _scheduler  Scheduler: routes ready stages to the executors; the active runs, memory parking
#     _run        Run: one execution of a plan, its state and the transitions that change it
#     _exec_cpu   CpuExecutor: CPU thread stages, workers walking the graph, abandoned threads
#     _exec_process
#                 ProcessExecutor: process stages handed to the process pool (_process)
#     _exec_gpu   GpuExecutor: GPU stages recorded, committed to the queue, completed by fences
#     _workers    WorkerPool: worker threads serving a priority queue of jobs
#     _process    process stages: the worker-process pool, shared memory for large arrays
#     _graph      Graph: declaration only   _dot  pictures of a graph (DOT, networkx, files)
#     _plan       a Graph validated once: order, consumers, last uses, transfers
#     _placement  where a stage with CPU and GPU implementations runs: a calibrated performance model
#     _nodes      Input, Node, StageOptions: what a graph is made of (the plan reads them)
#     _stats      RunStats, StageStats
#
#   GPU runtime layer (hetero/_gpu/)
#     context     GPUContext: what a GPU stage records into (allocate, upload, dispatch)
#     capture     captured GPU stages: a stage's dispatches recorded once per signature, replayed
#     recorder    the command encoders stages record into
#     device      adapter selection, Device: the device, its pipeline cache and resources
#     submission  Submission: the queue, batching of command buffers, the fence thread
#     lost        LossWatch: watching for device loss
#     fence       Fence: awaiting a submission from asyncio or trio
#     pool        the buffer pool            bindcache  uniforms, bind groups
#     transfer    StagingRing, Ticket: uploads and downloads through staging buffers, built on
#                 staging (the pool of staging buffers) and hostcopy (copies on the copy threads);
#                 bufmap maps staging buffers through wgpu-native directly
#     grid        TDR-safe dispatch splitting, the cost model   timing  GPU timestamps
#     tensor      Tensor                     wgsl       what hetero reads of WGSL
#
#   shared by both: errors, _trace (Chrome/Perfetto traces), _bridge (waking an event loop),
#     _files (atomic writes)
#
#   public faces: this module (graphs), ops (GPU ops), lowlevel (the extension API),
#   dask (graphs on a dask.distributed cluster; the optional [dask] extra, not imported here);
#   built on lowlevel only: kernels/ (hetero.kernels) and pipelines/ (hetero.pipelines)

from __future__ import annotations

TYPE_CHECKING = False  # typing is not imported for it: see _EXPORTS


def _map_source_checkout() -> None:
    """Import ``kernels/`` and ``pipelines/`` as ``hetero.kernels``/``hetero.pipelines`` from a checkout.

    Installed (also editable), the build backend maps these top-level folders into the
    package. Run straight from a source tree (``PYTHONPATH=.``), nothing does: map them here.
    """
    import importlib.util
    import pathlib
    import sys

    root = pathlib.Path(__file__).resolve().parent.parent
    for sub in ("kernels", "pipelines"):
        name = f"{__name__}.{sub}"
        init = root / sub / "__init__.py"
        if name in sys.modules or not init.is_file() or importlib.util.find_spec(name) is not None:
            continue
        spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(init.parent)])
        if spec is None or spec.loader is None:
            continue
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        globals()[sub] = module
        spec.loader.exec_module(module)


# The public names load on first use (PEP 562): ``import hetero`` and the ``hetero``
# command line's entry module (``hetero._cli``) import almost nothing, so that Ctrl-C
# during the heavy imports (numpy, wgpu) lands inside the command's handler. The first
# public name asked for loads them all, in this order.
_EXPORTS = {
    "Batcher": "_batcher",
    "Kernel": "_gpu.device",
    "Fence": "_gpu.fence",
    "GPUContext": "_gpu.context",
    "Graph": "_graph",
    "Input": "_graph",
    "Node": "_graph",
    "MapResults": "_runtime",
    "Runtime": "_runtime",
    "StartedRun": "_runtime",
    "RuntimeOptions": "_runtime",
    "run": "_runtime",
    "MemoryStats": "_gpu.pool",
    "PerfModel": "_placement",
    "Placement": "_placement",
    "DispatchInfo": "_gpu.grid",
    "RunStats": "_stats",
    "StageStats": "_stats",
    "Tensor": "_gpu.tensor",
    "DeviceLostError": "errors",
    "GPUError": "errors",
    "GraphError": "errors",
    "GraphvizError": "errors",
    "HeteroError": "errors",
    "InputError": "errors",
    "NoAdapterError": "errors",
    "OutOfMemoryError": "errors",
    "OverloadedError": "errors",
    "RuntimeClosedError": "errors",
    "StageError": "errors",
}
# Public namespaces, loaded with the names: lowlevel (the extension API for kernel and
# pipeline authors) and ops (the op namespace: hetero.ops.sum, ...).
_NAMESPACES = ("lowlevel", "ops")

if TYPE_CHECKING:
    from typing import Any

    from . import lowlevel, ops
    from ._batcher import Batcher
    from ._gpu.context import GPUContext
    from ._gpu.device import Kernel
    from ._gpu.fence import Fence
    from ._gpu.grid import DispatchInfo
    from ._gpu.pool import MemoryStats
    from ._gpu.tensor import Tensor
    from ._graph import Graph, Input, Node
    from ._placement import PerfModel, Placement
    from ._runtime import MapResults, Runtime, RuntimeOptions, StartedRun, run
    from ._stats import RunStats, StageStats
    from .errors import (
        DeviceLostError,
        GPUError,
        GraphError,
        GraphvizError,
        HeteroError,
        InputError,
        NoAdapterError,
        OutOfMemoryError,
        OverloadedError,
        RuntimeClosedError,
        StageError,
    )


def _load() -> None:
    """Import every public name and namespace into this module (once; later calls find them)."""
    import importlib

    g = globals()
    for name, module in _EXPORTS.items():
        if name not in g:
            g[name] = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    for sub in _NAMESPACES:
        g[sub] = importlib.import_module(f"{__name__}.{sub}")


def __getattr__(name: str) -> Any:
    if name in _EXPORTS or name in _NAMESPACES:
        _load()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS, *_NAMESPACES})


_map_source_checkout()
del TYPE_CHECKING

__version__ = "0.1.0"

__all__ = [
    "Batcher",
    "DeviceLostError",
    "DispatchInfo",
    "Fence",
    "GPUContext",
    "GPUError",
    "Graph",
    "GraphError",
    "GraphvizError",
    "HeteroError",
    "Input",
    "InputError",
    "Kernel",
    "MapResults",
    "MemoryStats",
    "NoAdapterError",
    "Node",
    "OutOfMemoryError",
    "OverloadedError",
    "PerfModel",
    "Placement",
    "RunStats",
    "Runtime",
    "RuntimeClosedError",
    "RuntimeOptions",
    "StageError",
    "StageStats",
    "StartedRun",
    "Tensor",
    "run",
]
