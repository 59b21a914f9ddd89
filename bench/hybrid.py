"""A pure-Python CPU stage beside a GPU stage: threads against process stages.

    python -m bench.hybrid [--n 400] [--cpu-ms 8.7] [--size 1024] [--matmuls 16]
                           [--max-in-flight 8] [--processes N] [--calls 2000]
                           [--shm-size 64M] [--switch-intervals 0.0005]

The graph of issue 16, over ``--n`` items with ``rt.map(max_in_flight=...)``::

    seed --> words (CPU: pure Python, ~cpu-ms, holds the GIL) --> mm (GPU: `matmuls` matmuls
                                                                       of size^3, bias from words)

Figures, all measured in this run:

* ``rate``: items/s of the CPU stage alone (thread, then the process pool), the GPU
  stage alone, both with a thread CPU stage, both with ``process=True``. ``overlap`` is
  both-with-processes over min(CPU with the pool, GPU) (target >= 0.9); ``serial`` is
  what no overlap at all would give, 1/(1/CPU thread + 1/GPU).
* ``record``: median host ms to record the GPU stage in each configuration; beside
  the GPU-alone figure it shows whether the recording thread still loses the GIL.
* ``in_flight_x2``: both with ``process=True`` at twice ``--max-in-flight`` (its
  overlap against the same bound): whether the runs in flight, rather than the GIL,
  limit the overlap (the CPU stage's latency now precedes the GPU's).
* ``parent_cpu``: µs of this process's CPU time per item (all threads, the GPU
  driver's included) for the CPU stage with the pool, the GPU stage alone and both;
  ``process_stage_extra`` is what a process stage adds beside the GPU stage.
  ``--switch-intervals`` repeats the process run with ``sys.setswitchinterval`` at
  each of those values, each followed by a run at the default (0.005 s) as its control
  (a candidate remedy; hetero adopts none unless it measures better).
* ``call``: microseconds per process-stage call with small arguments (a run of one
  process stage minus a run of the same stage on a thread; target <= 200 µs), beside
  ``concurrent.futures.ProcessPoolExecutor``'s submit+result round trip.
* ``shm``: GB/s moving ``--shm-size`` float32 arrays into a process stage and back
  (through shared memory), beside the executor (pickled through its pipe) and a plain
  numpy copy into fresh memory (new pages each time) and into one reused array.

On lavapipe use small sizes, e.g. ``--n 40 --size 128 --matmuls 4 --calls 200 --shm-size 16M``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import mmap
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

import anyio
import numpy as np

import hetero
from hetero import ops
from bench._common import adapter_fields, emitter, human, parse_size

emit = emitter("hybrid")
RECORD_MS: list[float] = []  # filled by the GPU stage (it runs in this process)


# -- stage functions (module level: process stages pickle them by reference) ---------------
def words(seed: int, iters: int, size: int) -> np.ndarray:
    """Pure-Python work holding the GIL (a linear congruential generator), then a bias vector."""
    acc = seed
    for _ in range(iters):
        acc = (acc * 1103515245 + 12345) & 0x7FFFFFFF
    return np.full(size, (acc % 7) * 1e-3, np.float32)


def mm(gpu: hetero.GPUContext, bias: Any, w: Any, k: int) -> Any:
    t0 = time.perf_counter()
    h = w
    for _ in range(k):
        h = ops.matmul(gpu, h, w, bias=bias)
    out = ops.sum(gpu, h)
    RECORD_MS.append((time.perf_counter() - t0) * 1e3)
    return out


def add_one(x: int) -> int:
    return x + 1


def first(x: np.ndarray) -> float:
    return float(x[0])


def same(x: np.ndarray) -> np.ndarray:
    return x


# -- graphs -----------------------------------------------------------------------------------
def cpu_graph(process: bool, iters: int, size: int) -> hetero.Graph:
    g = hetero.Graph("cpu")
    g.output(g.cpu(words, g.input("seed"), iters, size, process=process))
    return g


def gpu_graph(w: np.ndarray, k: int) -> hetero.Graph:
    g = hetero.Graph("gpu")
    g.output(g.gpu(mm, g.input("bias"), w, k, name="mm"))
    return g


def both_graph(process: bool, iters: int, size: int, w: np.ndarray, k: int) -> hetero.Graph:
    g = hetero.Graph("both")
    b = g.cpu(words, g.input("seed"), iters, size, process=process)
    g.output(g.gpu(mm, b, w, k, name="mm"))
    return g


def one_stage(fn: Any, process: bool) -> hetero.Graph:
    g = hetero.Graph(fn.__name__)
    g.output(g.cpu(fn, g.input("x"), process=process))
    return g


PARENT_CPU_US: list[float] = []  # this process's CPU time per item (all its threads) in the last rate()


async def rate(rt: hetero.Runtime, g: hetero.Graph, items: list[dict[str, Any]], max_in_flight: int) -> float:
    """Items per second of ``rt.map`` over ``items`` (after a short warm-up)."""
    async for _ in rt.map(g, items[: max(2, len(items) // 10)], max_in_flight=max_in_flight):
        pass
    RECORD_MS.clear()
    c0 = time.process_time()
    t0 = time.perf_counter()
    async for _ in rt.map(g, items, max_in_flight=max_in_flight):
        pass
    dt = time.perf_counter() - t0
    PARENT_CPU_US[:] = [(time.process_time() - c0) / len(items) * 1e6]
    return len(items) / dt


async def per_run_us(rt: hetero.Runtime, g: hetero.Graph, x: Any, n: int) -> float:
    for _ in range(max(3, n // 20)):
        await rt.run(g, x=x)
    t0 = time.perf_counter()
    for _ in range(n):
        await rt.run(g, x=x)
    return (time.perf_counter() - t0) / n * 1e6


def calibrate(ms: float) -> int:
    """Iterations of ``words`` that take about ``ms`` milliseconds here."""
    n = 20000
    while True:
        dts = []
        for _ in range(5):  # the fastest of five: a loaded machine only slows some down
            t0 = time.perf_counter()
            words(1, n, 4)
            dts.append(time.perf_counter() - t0)
        dt = min(dts)
        if dt > 0.02:
            return max(1, int(n * ms / 1e3 / dt))
        n *= 2


def record_ms() -> float | None:
    return round(statistics.median(RECORD_MS), 3) if RECORD_MS else None


async def main_async(a: argparse.Namespace) -> None:
    iters = calibrate(a.cpu_ms)
    t0 = time.perf_counter()
    words(1, iters, 4)
    cpu_ms = (time.perf_counter() - t0) * 1e3
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((a.size, a.size), dtype=np.float32) / np.sqrt(a.size)).astype(np.float32)
    seeds = [{"seed": i} for i in range(a.n)]
    biases = [{"bias": np.full(a.size, 1e-3, np.float32)} for _ in range(a.n)]
    async with hetero.Runtime(cpu_processes=a.processes) as rt:
        emit(what="setup", **adapter_fields(rt.device()), processes=rt.cpu_processes, cpu_count=os.cpu_count(),
             cpu_stage_ms=round(cpu_ms, 2), size=a.size, matmuls=a.matmuls, n=a.n, max_in_flight=a.max_in_flight,
             switch_interval=sys.getswitchinterval())
        await rt.warmup(gpu_graph(w, a.matmuls))
        r: dict[str, float] = {}
        rec: dict[str, float | None] = {}
        cpu_us: dict[str, float] = {}
        r["cpu_thread"] = await rate(rt, cpu_graph(False, iters, a.size), seeds, a.max_in_flight)
        r["cpu_process"] = await rate(rt, cpu_graph(True, iters, a.size), seeds, a.max_in_flight)
        cpu_us["cpu_process"] = PARENT_CPU_US[0]
        r["gpu"] = await rate(rt, gpu_graph(w, a.matmuls), biases, a.max_in_flight)
        rec["gpu"] = record_ms()
        cpu_us["gpu"] = PARENT_CPU_US[0]
        r["both_threads"] = await rate(rt, both_graph(False, iters, a.size, w, a.matmuls), seeds, a.max_in_flight)
        rec["both_threads"] = record_ms()
        r["both_process"] = await rate(rt, both_graph(True, iters, a.size, w, a.matmuls), seeds, a.max_in_flight)
        rec["both_process"] = record_ms()
        cpu_us["both_process"] = PARENT_CPU_US[0]
        # The same with twice the runs in flight: the CPU stage's latency now sits in front of
        # the GPU's, so fewer runs wait at the GPU than when it runs alone.
        deeper = await rate(rt, both_graph(True, iters, a.size, w, a.matmuls), seeds, 2 * a.max_in_flight)
        deeper_rec = record_ms()
        serial = 1 / (1 / r["cpu_thread"] + 1 / r["gpu"])
        bound = min(r["cpu_process"], r["gpu"])
        emit(what="rate", **{k: round(v, 1) for k, v in r.items()}, serial=round(serial, 1),
             overlap=round(r["both_process"] / bound, 3), threads_overlap=round(r["both_threads"] / bound, 3),
             process_vs_threads=round(r["both_process"] / r["both_threads"], 2), target_overlap=0.9)
        emit(what="record", unit="ms per GPU stage (median)", **rec,
             process_vs_gpu_alone=round(rec["both_process"] / rec["gpu"], 2)
             if rec["both_process"] and rec["gpu"] else None)
        emit(what="in_flight_x2", max_in_flight=2 * a.max_in_flight, both_process=round(deeper, 1),
             overlap=round(deeper / bound, 3), record_ms=deeper_rec)
        emit(what="parent_cpu", unit="µs of this process's CPU per item (all threads)",
             **{k: round(v, 1) for k, v in cpu_us.items()},
             process_stage_extra=round(cpu_us["both_process"] - cpu_us["gpu"], 1))
        # Each candidate switch interval, then the default again right after it (a paired control).
        default = sys.getswitchinterval()
        both = both_graph(True, iters, a.size, w, a.matmuls)
        for si in a.switch_intervals:
            sys.setswitchinterval(si)
            try:
                got = await rate(rt, both, seeds, a.max_in_flight)
            finally:
                sys.setswitchinterval(default)
            got_rec = record_ms()
            control = await rate(rt, both, seeds, a.max_in_flight)
            emit(what="switch_interval", seconds=si, both_process=round(got, 1), record_ms=got_rec,
                 default_seconds=default, default_both_process=round(control, 1), default_record_ms=record_ms(),
                 vs_default=round(got / control, 3))

        # Per-call overhead with small arguments.
        t_proc = await per_run_us(rt, one_stage(add_one, True), 1, a.calls)
        t_thread = await per_run_us(rt, one_stage(add_one, False), 1, a.calls)
        ref = executor_call_us(a.calls)
        emit(what="call", process_run_us=round(t_proc, 1), thread_run_us=round(t_thread, 1),
             overhead_us=round(t_proc - t_thread, 1), executor_round_trip_us=round(ref, 1), target_us=200)

        # Shared-memory bandwidth.
        x = np.ones(a.shm_size // 4, np.float32)
        n = max(3, min(20, (1 << 31) // a.shm_size))
        small = await per_run_us(rt, one_stage(first, True), np.ones(4, np.float32), n)
        into = await per_run_us(rt, one_stage(first, True), x, n) - small
        trip = await per_run_us(rt, one_stage(same, True), x, n) - small
        ref_into, ref_both = executor_bandwidth(x, n)
        fresh, reused = numpy_copy(x, n)
        gb = x.nbytes / 1e9
        emit(what="shm", size=human(x.nbytes), into_gbs=round(gb / (into / 1e6), 2),
             round_trip_gbs=round(2 * gb / (trip / 1e6), 2), executor_into_gbs=round(gb / ref_into, 2),
             executor_round_trip_gbs=round(2 * gb / ref_both, 2), numpy_copy_fresh_gbs=round(gb / fresh, 2),
             numpy_copy_reused_gbs=round(gb / reused, 2), target_gbs=5)


def numpy_copy(x: np.ndarray, n: int) -> tuple[float, float]:
    """Seconds per copy of ``x`` into fresh memory (new pages each time) and into one reused array."""
    dst = np.empty_like(x)
    np.copyto(dst, x)
    t0 = time.perf_counter()
    for _ in range(n):
        np.copyto(dst, x)
    reused = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for _ in range(n):
        # A new anonymous mapping each time (malloc would hand back the pages just freed).
        with mmap.mmap(-1, x.nbytes) as mm:
            dst = np.frombuffer(mm, x.dtype)
            np.copyto(dst, x.ravel())
            del dst
    return (time.perf_counter() - t0) / n, reused


def executor_call_us(n: int) -> float:
    ctx = mp.get_context("forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as ex:
        for _ in range(max(3, n // 20)):
            ex.submit(add_one, 1).result()
        t0 = time.perf_counter()
        for _ in range(n):
            ex.submit(add_one, 1).result()
        return (time.perf_counter() - t0) / n * 1e6


def executor_bandwidth(x: np.ndarray, n: int) -> tuple[float, float]:
    ctx = mp.get_context("forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as ex:
        def per_call(fn: Any, arg: Any) -> float:
            ex.submit(fn, arg).result()
            t0 = time.perf_counter()
            for _ in range(n):
                ex.submit(fn, arg).result()
            return (time.perf_counter() - t0) / n

        small = per_call(first, np.ones(4, np.float32))
        return per_call(first, x) - small, per_call(same, x) - small


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=400, help="items per configuration")
    p.add_argument("--cpu-ms", type=float, default=8.7, help="pure-Python CPU stage cost (ms)")
    p.add_argument("--size", type=int, default=1024, help="matmul size")
    p.add_argument("--matmuls", type=int, default=16, help="matmuls per GPU stage")
    p.add_argument("--max-in-flight", type=int, default=8)
    p.add_argument("--processes", type=int, default=None, help="process pool size (default: cores - 1)")
    p.add_argument("--calls", type=int, default=2000, help="runs for the per-call overhead")
    p.add_argument("--shm-size", type=parse_size, default=parse_size("64M"), help="array size for bandwidth")
    p.add_argument("--switch-intervals", type=lambda s: [float(v) for v in s.split(",") if v], default=[0.0005],
                   help="sys.setswitchinterval values to try (comma-separated; empty for none)")
    anyio.run(main_async, p.parse_args())


if __name__ == "__main__":
    main()
