"""Ready-made graphs, shipped as ``hetero.pipelines``."""
