"""hetero on a dask.distributed cluster (install the ``hetero[dask]`` extra).

``HeteroPlugin`` gives each worker a Runtime; ``DaskRuntime`` runs graphs on the cluster
with Runtime's contract; ``LocalWGPUCluster`` starts one worker process per adapter.
``dask worker ADDRESS --resources wgpu=1 --preload hetero.dask`` registers the plugin
on a worker started from the command line (``dask_setup``). See docs/dask.md.
"""

from __future__ import annotations

from ._dask import (ChunkTuning, ClusterError, DEFAULT_CHUNK_SIZE, DEFAULT_WORKER_IN_FLIGHT, DaskRuntime,
                    HeteroPlugin, LocalWGPUCluster, PLUGIN_NAME, WorkerAdapter, WorkerStats, dask_setup,
                    ensure_plugin)

__all__ = ["ChunkTuning", "ClusterError", "DEFAULT_CHUNK_SIZE", "DEFAULT_WORKER_IN_FLIGHT", "DaskRuntime",
           "HeteroPlugin", "LocalWGPUCluster", "PLUGIN_NAME", "WorkerAdapter", "WorkerStats", "dask_setup",
           "ensure_plugin"]
