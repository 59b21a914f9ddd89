"""Matrix multiplication for GPU stages: ``matmul(gpu, a, b, transpose_b=, bias=, out=)``.

Shapes (row-major, contiguous)::

    a [M, K]     @ b [K, N]       -> [M, N]
    a [B, M, K]  @ b [B, K, N]    -> [B, M, N]      batched
    a [B, M, K]  @ b [K, N]       -> [B, M, N]      one weight for every batch (folded into M)
    a [M, K]     @ b [B, K, N]    -> [B, M, N]      one left operand for every batch
    transpose_b=True: b is [N, K] (or [B, N, K]), as torch.nn.Linear stores its weight
    bias [N] is added to every row of the result (fused into the store)

float32 in and out, or float16 in and out: products and sums in float32, so only the
inputs and the result are rounded to float16. Halves travel as u32 words converted
with ``unpack2x16float``/``pack2x16float`` (core WGSL), so float16 works on every
adapter, ``shader-f16`` or not; it halves memory and traffic, not arithmetic time.
(Native f16 arithmetic would need ``enable f16;``, which must open the module, and
hetero prepends its grid prelude to kernels that use ``hetero_workgroup_id``.)

Kernel. One workgroup computes a ``BM x BN`` tile of C; its ``(BM/TM) * (BN/TN)``
threads each compute a ``TM x TN`` block of it in registers (``TM/4 * TN/4`` vec4
accumulators, every one a named WGSL variable, so nothing is indexed dynamically
and no accumulator spills to local memory). The K loop walks ``BK``-deep slices:

* every thread loads its share of the A slice (``BM x BK``) and of the B slice as
  vec4 (4 consecutive floats along K for A and for a transposed B, along N for a
  plain B; bounds-checked, so any M, N, K work; scalar loads where a row length is
  not a multiple of 4) into registers;
* the slices go to workgroup memory as ``As[k][m]`` and ``Bs[k][n]`` (K-major), rows
  padded by 4 floats: a warp storing a transposed A slice (two K-quads of 16 rows
  for BK = 8) hits all 32 banks once (BK = 16: 2-way conflicts on these stores only);
* the inner loop, unrolled over ``BK`` in the generated WGSL, reads per k ``TM/4``
  vec4 of A and ``TN/4`` vec4 of B and does ``TM * TN`` fused multiply-adds (8x8:
  64 FMAs per 4 vec4 loads). Thread ``(tx, ty)`` owns rows ``g * BM/(TM/4) + 4 ty +
  i`` and columns ``h * BN/(TN/4) + 4 tx + j``: threads next to each other read
  neighbouring vec4 (conflict-free) and write neighbouring vec4 of C (coalesced);
* double buffering: the next slice is loaded from global memory into registers
  while the current one is multiplied, then stored into the other workgroup
  buffer, so each slice costs one barrier (``double_buffer=False``: one buffer,
  two barriers, half the workgroup memory);
* ``split_k = S`` (small outputs with a long K, which would leave most of a large
  GPU idle): the grid's z holds batch x S workgroups per tile, each summing its
  part of K into float32 partials ``[S, B, M, N]``; a second dispatch adds the S
  partials and the bias (every part gets at least the configuration's ``split_min``
  of K, by default :data:`MIN_SPLIT_K`; :data:`SMALL_M_CANDIDATES` split into parts
  of :data:`SMALL_SPLIT_MIN`). :func:`split_k_parts` tells a caller whether a product
  splits; :func:`matmul_partials` leaves the summing to a consumer that can fold it into
  its own pass (:func:`hetero.kernels.nn.matmul_layernorm`).

The grid is x over N tiles, y over M tiles, z over the batch; the kernel finds its
tile through ``hetero_workgroup_id``, so hetero may split x into sub-dispatches under
the GPU-time budget (TDR safety); y and z beyond the per-dimension limit are
covered by several dispatches (``y0``/``z0`` in the uniform).

Configurations (:class:`MatmulConfig`: BM, BN, BK, TM, TN, double buffering, split_k)
are code generation parameters; :data:`CANDIDATES` holds the ones the tuner tries.
The choice per call: ``config=`` if given, else the on-disk tuning cache for this
adapter and size class, else :func:`default_config` (by adapter type and output
size). Nothing is tuned implicitly inside a stage; fill the cache with::

    python -m hetero.kernels.matmul --tune [--sizes 1024,2048,4096]

or :func:`tune` from Python. The cache is ``$HETERO_CACHE_DIR/matmul-<adapter>.json``
(default ``$XDG_CACHE_HOME/hetero``, else ``~/.cache/hetero``); see :func:`cache_path`
for its format.
"""

from __future__ import annotations

from hetero.kernels.matmul.cache import cache_path, choose_config, explain_config, size_class
from hetero.kernels.matmul.codegen import ACTIVATIONS, wgsl
from hetero.kernels.matmul.config import (CANDIDATES, MIN_SPLIT_K, SMALL_M_CANDIDATES, SMALL_SPLIT_MIN,
                                          MatmulConfig, default_config, small_output_config)
from hetero.kernels.matmul.op import SPLIT_K_MAX_TILES, matmul, matmul_partials, split_k_parts
from hetero.kernels.matmul.tuner import TuneResult, tune

__all__ = ["ACTIVATIONS", "CANDIDATES", "MIN_SPLIT_K", "MatmulConfig", "SMALL_M_CANDIDATES", "SMALL_SPLIT_MIN",
           "SPLIT_K_MAX_TILES", "TuneResult", "cache_path", "choose_config", "default_config", "explain_config",
           "matmul", "matmul_partials", "size_class", "small_output_config", "split_k_parts", "tune", "wgsl"]
