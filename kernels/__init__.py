"""GPU kernels (WGSL) and their thin Python wrappers, shipped as ``hetero.kernels``."""
