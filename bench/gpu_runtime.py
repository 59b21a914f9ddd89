"""GPU runtime figures: fence round trip and the gain of coalescing tiny GPU stages.

    python -m bench.gpu_runtime [--fences 2000] [--stages 1000]

* fence: record an empty command buffer, then submit it and await its ``Fence`` from
  asyncio; the figure is submit -> coroutine resumed, with the recording cost printed
  beside it: as ``Fence.wait()`` does it by default (the loop watches for a
  while first), with the fence thread alone waking the loop (``spin_s=0``),
  and under trio. The reference is torch launch + synchronize of a tiny kernel when
  torch with CUDA is importable.
* coalesce: a chain of N tiny GPU stages run with ``submit_batch=1`` (one submission
  per stage) and with the default batch; the ratio is the gain.
* graph_download (``--download-mib``): runs of a graph whose GPU stage fills a tensor of
  that size and returns it as the graph output, each result dropped when the next one
  arrives; GB/s = bytes / median run time, with ``zero_copy_outputs`` on (the default)
  and off; then the times of six runs whose results are all kept. References: torch
  ``.cpu()`` (a new pageable tensor) and a copy into preallocated pinned memory, after
  the same fill.
* graph_roundtrip (``--roundtrip-mib``): host array -> GPU stage -> host array.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

import anyio
import numpy as np

import hetero
from bench._common import emitter

TINY = """
@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (gid.x < arrayLength(&x)) { x[gid.x] = x[gid.x] + 1.0; }
}
"""


emit = emitter("gpu_runtime")


async def fence_round_trip(rt: hetero.Runtime, n: int, spin_s: float | None) -> tuple[list[float], list[float]]:
    """(fence, encode) times: submit of a recorded empty command buffer until the coroutine
    awaiting its ``Fence`` resumes, and the recording (create_command_encoder + finish)
    before it. ``spin_s``: how long the loop watches (0: the fence thread wakes it; None:
    ``Fence.wait``'s default)."""
    dev = await anyio.to_thread.run_sync(rt.device)
    fences, encodes = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        cb = dev.device.create_command_encoder().finish()
        t1 = time.perf_counter()
        dev.enqueue(cb, flush=True)
        fence = dev.fence()
        await (fence.wait() if spin_s is None else fence.wait(spin_s))
        fences.append(time.perf_counter() - t1)
        encodes.append(t1 - t0)
    return fences, encodes


def torch_round_trip(n: int) -> list[float] | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    x = torch.zeros(64, device="cuda")
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        x.add_(1.0)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def chain_graph(n: int) -> hetero.Graph:
    def step(gpu: hetero.GPUContext, t: hetero.Tensor) -> hetero.Tensor:
        gpu.dispatch(TINY, 1, t)
        return t

    g = hetero.Graph("tiny_chain")
    v = g.input("x")
    for i in range(n):
        v = g.gpu(step, v, name=f"s{i}")
    g.output(v)
    return g


def roundtrip_graph() -> hetero.Graph:
    """x (host) -> touch (gpu: one pass over the data) -> y (host): an upload and a download per run."""
    def touch(gpu: hetero.GPUContext, t: hetero.Tensor) -> hetero.Tensor:
        groups = (t.size + 63) // 64
        gpu.dispatch(TINY_2D, (min(groups, 65535), (groups + 65534) // 65535), t)
        return t

    g = hetero.Graph("roundtrip")
    y = g.gpu(touch, g.input("x"))
    g.output(y, g.cpu(lambda v: float(v[-1]), y, name="peek"))
    return g


TINY_2D = """
@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x + gid.y * 65535u * 64u;
    if (i < arrayLength(&x)) { x[i] = x[i] + 1.0; }
}
"""


FILL = """
@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x + gid.y * 65535u * 64u;
    if (i < arrayLength(&x)) { x[i] = f32(i); }
}
"""


def graph_download(mib: int, runs: int) -> None:
    n = mib << 18

    def fill(gpu: hetero.GPUContext) -> hetero.Tensor:
        t = gpu.empty((n,), np.float32)
        groups = (n + 63) // 64
        gpu.dispatch(FILL, (min(groups, 65535), (groups + 65534) // 65535), t)
        return t

    g = hetero.Graph("download")
    g.output(g.gpu(fill))
    medians = {}
    for zero_copy in (True, False):
        with hetero.Runtime(zero_copy_outputs=zero_copy) as rt:
            async def loop() -> list[float]:
                times = []
                y = None
                for _ in range(runs + 3):
                    t0 = time.perf_counter()
                    y = await rt.run(g)
                    times.append(time.perf_counter() - t0)
                assert y is not None and y[-1] == n - 1, "wrong result"
                return times[3:]

            async def keep_all() -> list[float]:
                kept, times = [], []
                for _ in range(6):
                    t0 = time.perf_counter()
                    kept.append(await rt.run(g))
                    times.append(time.perf_counter() - t0)
                return times

            times = anyio.run(loop)
            kept_ms = [round(t * 1e3, 1) for t in anyio.run(keep_all)]
        med = statistics.median(times)
        medians[zero_copy] = med
        emit(figure="graph_download", mib=mib, impl=f"hetero zero_copy_outputs={zero_copy}",
             GBps=round(n * 4 / med / 1e9, 1), best_GBps=round(n * 4 / min(times) / 1e9, 1),
             median_ms=round(med * 1e3, 2), caller_keeps_every_result_ms=kept_ms)
    try:
        import torch
    except ImportError:
        return
    if not torch.cuda.is_available():
        return
    d = torch.empty(n, dtype=torch.float32, device="cuda")
    pinned = torch.empty(n, dtype=torch.float32).pin_memory()

    def torch_times(step: object) -> list[float]:
        out = []
        for _ in range(runs + 3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            torch.arange(n, out=d, dtype=torch.float32)
            step()  # type: ignore[operator]
            torch.cuda.synchronize()
            out.append(time.perf_counter() - t0)
        return out[3:]

    for impl, step in (("torch .cpu() (new pageable tensor)", lambda: d.cpu()),
                       ("torch copy into pinned", lambda: pinned.copy_(d, non_blocking=True))):
        med = statistics.median(torch_times(step))
        emit(figure="graph_download", mib=mib, impl=impl, GBps=round(n * 4 / med / 1e9, 1),
             median_ms=round(med * 1e3, 2), ratio_hetero_over_this=round(med / medians[True], 2))


def graph_roundtrip(mib: int, repeat: int) -> None:
    x = np.zeros(mib << 18, np.float32)
    g = roundtrip_graph()
    with hetero.Runtime() as rt:
        out = anyio.run(lambda: rt.run(g, x=x))
        assert out[1] == 1.0
        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            anyio.run(lambda: rt.run(g, x=x))
            best = min(best, time.perf_counter() - t0)
    gbps = 2 * x.nbytes / best / 1e9
    emit(figure="graph_roundtrip", mib=mib, impl="hetero run (upload + kernel + download)", GBps=round(gbps, 1))
    try:
        import torch
    except ImportError:
        return
    if not torch.cuda.is_available():
        return
    h = torch.zeros(mib << 18, dtype=torch.float32).pin_memory()
    back = torch.empty_like(h).pin_memory()
    tbest = float("inf")
    for _ in range(repeat + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        d = h.to("cuda", non_blocking=True)
        d += 1
        back.copy_(d, non_blocking=True)
        torch.cuda.synchronize()
        tbest = min(tbest, time.perf_counter() - t0)
    tg = 2 * x.nbytes / tbest / 1e9
    emit(figure="graph_roundtrip", mib=mib, impl="torch pinned (to + add + copy back)", GBps=round(tg, 1),
         ratio_hetero_over_torch=round(gbps / tg, 2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fences", type=int, default=2000)
    ap.add_argument("--stages", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--roundtrip-mib", type=int, default=256)
    ap.add_argument("--download-mib", type=int, default=256)
    ap.add_argument("--download-runs", type=int, default=20)
    a = ap.parse_args()

    with hetero.Runtime() as rt:
        emit(adapter=rt.device().summary["summary"])
        for backend, spin_s, impl in (("asyncio", None, "hetero"),
                                      ("asyncio", 0.0, "hetero, fence thread wakes the loop"),
                                      ("trio", None, "hetero")):
            if backend == "trio" and importlib.util.find_spec("trio") is None:
                emit(figure="fence_round_trip_trio", skipped="trio is not installed")
                continue
            fences, encodes = anyio.run(fence_round_trip, rt, a.fences, spin_s, backend=backend)
            times, encodes = fences[a.fences // 10:], encodes[a.fences // 10:]
            m = statistics.median(times) * 1e6
            enc = statistics.median(encodes) * 1e6
            if (backend, spin_s) == ("asyncio", None):
                med = m
            emit(figure=f"fence_round_trip_{backend}", impl=impl, what="submit -> awaiting coroutine resumed",
                 median_us=round(m, 1), p90_us=round(float(np.percentile(times, 90)) * 1e6, 1),
                 encode_empty_command_buffer_us=round(enc, 1), encode_plus_fence_us=round(enc + m, 1))
    ref = torch_round_trip(a.fences)
    if ref:
        tmed = statistics.median(ref[a.fences // 10:]) * 1e6
        emit(figure="fence_round_trip", impl="torch launch+synchronize", median_us=round(tmed, 1),
             ratio_hetero_over_torch=round(med / tmed, 2))

    g = chain_graph(a.stages)
    x = np.zeros(64, np.float32)
    per = {}
    for batch in (1, 32):
        with hetero.Runtime(submit_batch=batch) as rt:
            anyio.run(lambda: rt.run(g, x=x))  # warm: device, pipeline
            best = float("inf")
            for _ in range(a.repeat):
                t0 = time.perf_counter()
                res = anyio.run(lambda: rt.run(g, x=x))
                best = min(best, time.perf_counter() - t0)
            assert np.all(res == a.stages), "wrong result"
            subs = rt.device().submissions
        per[batch] = best / a.stages * 1e6
        emit(figure="tiny_gpu_stage_chain", submit_batch=batch, stages=a.stages,
             us_per_stage=round(per[batch], 2), submissions_total=subs)
    emit(figure="coalescing_gain", ratio=round(per[1] / per[32], 2))
    if a.download_mib:
        graph_download(a.download_mib, a.download_runs)
    if a.roundtrip_mib:
        graph_roundtrip(a.roundtrip_mib, a.repeat)


if __name__ == "__main__":
    main()
