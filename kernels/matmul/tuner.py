"""The matmul tuner: time the candidate configurations on an adapter and cache the fastest correct one."""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from hetero.kernels.matmul import cache
from hetero.kernels.matmul.cache import adapter_info, cache_key, cache_path, size_class
from hetero.kernels.matmul.config import CANDIDATES, MatmulConfig
from hetero.kernels.matmul.op import (SPLIT_K_MAX_TILES, Problem, Step, matmul, plan, problem,
                                      split_parts)
from hetero.lowlevel import Device, GPUContext, Tensor, device_of, grid_uniform

__all__ = ["TuneResult", "tune"]


@dataclass(frozen=True)
class TuneResult:
    """What :func:`tune` found: the winner and every candidate's figure or reason."""

    shape: tuple[int, int, int, int]  # M, N, K, batch
    dtype: str
    best: MatmulConfig
    gflops: float
    key: str  # the cache key it was stored under
    path: str | None  # the cache file (None: not saved)
    results: tuple[tuple[str, float | None, str], ...] = field(default_factory=tuple)  # name, GFLOP/s, note


def _submit_wait(dev: Device, cbs: list[Any]) -> float:
    t0 = time.perf_counter()
    dev.wait(dev.submit(cbs))
    return time.perf_counter() - t0


def _raw_timing(dev: Device, steps: list[Step], reps: int) -> float:
    """Seconds for one submission of ``reps`` matmuls, recorded straight into a wgpu encoder.

    The tuner bypasses ``gpu.dispatch`` so that hetero's GPU-time budget never splits
    the timed submission (the budget protects graphs; a timing wants one submission).
    """
    import wgpu

    device = dev.device
    usage = wgpu.BufferUsage.UNIFORM

    def resource(x: Any) -> dict[str, Any]:
        if isinstance(x, Tensor):
            return {"buffer": x.buffer, "offset": x.offset, "size": x.binding_size}
        data = np.ascontiguousarray(x).tobytes()
        data += bytes(-len(data) % 16)
        return {"buffer": device.create_buffer_with_data(data=data, usage=usage), "offset": 0, "size": len(data)}

    recorded = []
    for kern, wg, bindings in steps:
        # A grid kernel's group 0 ends with the grid uniform, after the dispatch's own bindings.
        grid = [np.frombuffer(grid_uniform((0, 0, 0), wg), np.uint8)] if kern.grid else []
        bg0 = device.create_bind_group(layout=kern.pipeline.get_bind_group_layout(0), entries=[
            {"binding": i, "resource": resource(x)} for i, x in enumerate([*bindings, *grid])])
        recorded.append((kern.pipeline, wg, bg0))
    enc = device.create_command_encoder()
    cp = enc.begin_compute_pass()
    for _ in range(reps):
        for pipeline, wg, bg0 in recorded:
            cp.set_pipeline(pipeline)
            cp.set_bind_group(0, bg0)
            cp.dispatch_workgroups(*wg)
    cp.end()
    return _submit_wait(dev, [enc.finish()])


def _run(dev: Device, record: Any) -> np.ndarray:
    """Record with a fresh GPUContext, submit, wait, and download the returned Tensor."""
    ctx = GPUContext(dev, "matmul-tune")
    try:
        t = record(ctx)
        ctx.stage_download(t)
        dev.wait(dev.submit([ctx.encoder.finish()]))
        r = ctx.read_downloads()[id(t)]
        ctx.settle(ran=True)
        return r
    finally:
        ctx.release_blocks()


def _rel_err(got: np.ndarray, want: np.ndarray) -> float:
    scale = float(np.max(np.abs(want))) if want.size else 0.0
    return float(np.max(np.abs(got.astype(np.float64) - want))) / max(scale, 1e-30) if want.size else 0.0


def _check_config(dev: Device, c: MatmulConfig, p: Problem, dtype: Any) -> str | None:
    """Correctness on a small shape with the same divisibility (so the same kernel variant)."""
    def shrink(x: int, cap: int) -> int:
        return x if x <= cap else cap - cap % 4 + x % 4  # same residue mod 4, partial tiles

    k_cap = 3 * c.bk + 5 if c.split_k == 1 else c.split_k * c.split_min + 5  # long enough to split
    m, n, k = shrink(p.m, 2 * c.bm + 5), shrink(p.n, 2 * c.bn + 5), shrink(p.k, k_cap)
    rng = np.random.default_rng(1)
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((n, k) if p.trans_b else (k, n)).astype(dtype)
    want = a.astype(np.float64) @ (b.T if p.trans_b else b).astype(np.float64)
    got = _run(dev, lambda ctx: matmul(ctx, ctx.upload(a), ctx.upload(b), transpose_b=p.trans_b, config=c))
    err = _rel_err(got, want)
    tol = 5e-3 if p.f16 else 1e-4
    return None if err <= tol else f"wrong results on {m}x{n}x{k}: relative error {err:.2e}"


def tune(target: Any, m: int, n: int, k: int, *, batch: int = 1, transpose_b: bool = False,
         dtype: Any = np.float32, configs: Sequence[MatmulConfig] | None = None, min_ms: float = 20.0,
         repeat: int = 3, save: bool = True, verbose: bool = False) -> TuneResult:
    """Time the candidate configurations on ``target``'s adapter for one problem size; cache the fastest.

    ``target`` is a Runtime, a Device or a GPUContext. Each candidate that fits the
    device's limits is compiled (a failure skips it), checked against numpy on a
    small shape with the same divisibility, then timed on resident random data of
    the given size: one submission of as many matmuls as run ``min_ms``, best of
    ``repeat``. The winner is also checked at full size (Freivalds' test:
    ``C v`` against ``A (B v)``) and stored in :func:`cache_path` under
    ``<dtype>:n<size_class(m, n, batch)>`` when ``save``. Blocks the calling thread
    (do not call it on an event loop, nor inside a stage).
    """
    dev = device_of(target)
    dt = np.dtype(dtype)
    limits = dev.limits
    rng = np.random.default_rng(0)
    a_h = (rng.random((batch, m, k) if batch > 1 else (m, k), dtype=np.float32) - 0.5).astype(dt)
    b_shape = (n, k) if transpose_b else (k, n)
    b_h = (rng.random((batch, *b_shape) if batch > 1 else b_shape, dtype=np.float32) - 0.5).astype(dt)
    holder = GPUContext(dev, "matmul-tune-data")
    a_t, b_t = holder.upload(a_h), holder.upload(b_h)
    c_t = holder.empty((batch, m, n) if batch > 1 else (m, n), dt)
    dev.wait(dev.submit([holder.encoder.finish()]))
    holder.settle(ran=True)
    p = problem(a_t, b_t, transpose_b, None, None)
    results: list[tuple[str, float | None, str]] = []
    timed: list[tuple[float, MatmulConfig]] = []
    flops = 2.0 * p.batch * p.m * p.n * p.k
    rtt = min(_submit_wait(dev, [dev.device.create_command_encoder().finish()]) for _ in range(5))

    def note(c: MatmulConfig, g: float | None, why: str) -> None:
        results.append((c.name, g, why))
        if verbose:
            print(json.dumps({"tune": c.name, "gflops": g, "note": why}), file=sys.stderr, flush=True)

    try:
        for c in (configs if configs is not None else CANDIDATES):
            why = c.fits(limits)
            if why is None and configs is None and c.split_k > 1:
                split, _ = split_parts(p, c, limits.get("max-storage-buffer-binding-size", 1 << 27))
                if split == 1:
                    why = f"K = {p.k} is too short to split"
                elif p.batch * -(-p.m // c.bm) * -(-p.n // c.bn) >= SPLIT_K_MAX_TILES:
                    why = "the output alone gives enough workgroups"
            if why is not None:
                note(c, None, f"skipped: {why}")
                continue
            scratch = GPUContext(dev, "matmul-tune")  # holds this candidate's split-K partials
            try:
                try:
                    steps = plan(scratch, p, c, a_t, b_t, c_t, None)
                    bad = _check_config(dev, c, p, dt)
                except Exception as e:  # noqa: BLE001 - a candidate that fails to compile is skipped
                    first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
                    note(c, None, f"skipped: {type(e).__name__}: {first}")
                    continue
                if bad is not None:
                    note(c, None, f"skipped: {bad}")
                    continue
                one = max(_raw_timing(dev, steps, 1) - rtt, 1e-6)  # warm-up, estimate
                reps = max(1, min(1000, math.ceil(min_ms / 1e3 / one)))
                best = min(_raw_timing(dev, steps, reps) for _ in range(max(1, repeat)))
            finally:
                scratch.release_blocks()
            sec = max(best - rtt, 1e-9) / reps
            gflops = flops / sec / 1e9
            timed.append((sec, c))
            note(c, round(gflops, 3), f"{reps} per submission")
        timed.sort(key=lambda x: x[0])
        winner: MatmulConfig | None = None
        for sec, c in timed:
            if _freivalds(dev, c, a_t, b_t, a_h, b_h, transpose_b):
                winner, best_sec = c, sec
                break
            note(c, None, "rejected: wrong results at full size")
        if winner is None:
            raise RuntimeError(f"matmul tune: no configuration ran correctly for {m}x{n}x{k} (batch {batch}): "
                               + "; ".join(f"{name}: {why}" for name, _, why in results))
    finally:
        holder.release_blocks()
    gflops = round(flops / best_sec / 1e9, 3)
    key = cache_key(dt, size_class(m, n, batch))
    path: Path | None = None
    if save:
        path = cache_path(dev)
        cache.save(path, adapter_info(dev), {key: {
            "config": winner.to_dict(), "gflops": gflops, "shape": [m, n, k, batch],
            "tuned_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}})
    return TuneResult((m, n, k, batch), dt.name, winner, gflops, key, str(path) if path else None, tuple(results))


def _freivalds(dev: Device, c: MatmulConfig, a_t: Tensor, b_t: Tensor, a_h: np.ndarray, b_h: np.ndarray,
               transpose_b: bool) -> bool:
    """Is ``C = A B`` at full size? Compare ``C v`` with ``A (B v)`` for a random ``v`` (float64)."""
    got = _run(dev, lambda ctx: matmul(ctx, a_t, b_t, transpose_b=transpose_b, config=c)).astype(np.float64)
    v = np.random.default_rng(2).standard_normal(got.shape[-1])
    a64 = a_h.astype(np.float64)
    b64 = (np.swapaxes(b_h, -1, -2) if transpose_b else b_h).astype(np.float64)

    def times(a: np.ndarray, x: np.ndarray) -> np.ndarray:  # a x for a [.., M, K], x [.., K]
        return (a @ x[..., None])[..., 0]

    lhs, want = got @ v, times(a64, b64 @ v)
    scale = float(np.max(times(np.abs(a64), np.abs(b64) @ np.abs(v))))  # the size of the terms summed
    tol = 5e-3 if a_h.dtype == np.float16 else 1e-5
    return bool(np.max(np.abs(lhs - want)) <= tol * max(scale, 1e-30))
