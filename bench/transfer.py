"""Host<->device bandwidth: hetero's staging ring against wgpu's queue calls and torch.

    python -m bench.transfer [--sizes 1M,16M,256M,1G] [--repeat 3] [--threads 8,16] [--chunk 8M]

Each figure is end to end and the best of ``--repeat`` runs after one warm-up; the ring's
figures also print the phases of their best run (``phases_ms``):

* up, ``staging_ring``: host numpy array -> device buffer: ``ring.upload`` into an
  encoder, submit, wait for the fence (``ticket.complete()``, which re-maps the staging
  for the next upload, runs after the clock stops, as it does on the fence thread).
* down, ``staging_ring``: device buffer -> a new numpy array: ``ring.download``, submit,
  wait, ``complete()`` and ``read()`` (a new array: allocated when the download is
  recorded and touched by the copy threads while the GPU copies, page faults included);
  ``staging_ring_out`` reads into a preallocated array instead; ``staging_ring_zero_copy``
  downloads with ``zero_copy=True``: the array returned is the mapped staging memory (no
  copy-out), and dropping it gives the buffer back.
* ``write_buffer``: ``queue.write_buffer`` then an empty submit and the fence wait;
  ``read_buffer``: ``queue.read_buffer`` into a numpy array.
* ``numpy_copy``: a host-to-host copy of the same size on the ring's thread count, the
  ceiling of the CPU side of a staging copy on this machine.
* torch, when importable with CUDA: ``copy_`` between a CUDA tensor and a pinned or a
  pageable host tensor (both preallocated), then ``torch.cuda.synchronize()``.

One JSON line per figure: ``{"bench": "transfer", "direction", "impl", "bytes", "GBps"}``
(GB = 1e9 bytes), then ratio lines against torch pinned (when present) and against the
wgpu queue call of the same direction.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from typing import Any, Callable

import numpy as np
import wgpu

from hetero.lowlevel import Device, StagingRing
from bench._common import best_of, emitter, human, parse_size

STORAGE = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
emit = emitter("transfer")


def wgpu_figures(dev: Device, ring: StagingRing, n: int, repeat: int, tag: str,
                 queue_refs: bool) -> dict[tuple[str, str], float]:
    host = np.arange(n // 4, dtype=np.uint32)
    out = np.empty_like(host)
    buf = dev.device.create_buffer(size=n, usage=STORAGE)
    queue = dev.device.queue
    res: dict[tuple[str, str], float] = {}

    def phases(fn: Callable[[], list[float]], key: tuple[str, str], names: list[str]) -> None:
        """Best end-to-end of ``fn`` (which returns its phase times); emits that run's phases."""
        fn()
        runs = [fn() for _ in range(repeat)]
        best = min(runs, key=sum)
        res[key] = sum(best)
        emit(direction=key[0], impl=key[1], bytes=n, size=human(n),
             phases_ms={name: round(t * 1e3, 3) for name, t in zip(names, best)})

    def ring_up() -> list[float]:
        t0 = time.perf_counter()
        enc = dev.device.create_command_encoder()
        t = ring.upload(enc, host, buf)
        t1 = time.perf_counter()
        dev.wait(dev.submit([enc.finish()]))
        t2 = time.perf_counter()
        t.complete()  # after the clock: the fence thread's job, off the critical path
        return [t1 - t0, t2 - t1]

    def ring_down(into: np.ndarray | None) -> list[float]:
        t0 = time.perf_counter()
        enc = dev.device.create_command_encoder()
        t = ring.download(enc, buf, 0, n, prefault=into is None)
        dev.wait(dev.submit([enc.finish()]))
        t1 = time.perf_counter()
        t.complete()
        t.read(host.shape, host.dtype, out=into)
        return [t1 - t0, time.perf_counter() - t1]

    def ring_down_zero_copy() -> list[float]:
        t0 = time.perf_counter()
        enc = dev.device.create_command_encoder()
        t = ring.download(enc, buf, 0, n, zero_copy=True)
        dev.wait(dev.submit([enc.finish()]))
        t1 = time.perf_counter()
        t.complete()
        a = t.read(host.shape, host.dtype)
        t2 = time.perf_counter()
        del a  # the staging buffer goes back to the ring with the array
        return [t1 - t0, t2 - t1]

    phases(ring_up, ("up", "staging_ring" + tag), ["fill_unmap_record", "submit_fence"])
    phases(lambda: ring_down(None), ("down", "staging_ring" + tag), ["record_submit_fence", "map_copy_out"])
    phases(lambda: ring_down(out), ("down", "staging_ring_out" + tag), ["record_submit_fence", "map_copy_out"])
    phases(ring_down_zero_copy, ("down", "staging_ring_zero_copy" + tag), ["record_submit_fence", "map"])
    enc = dev.device.create_command_encoder()
    t = ring.download(enc, buf, 0, n)
    dev.wait(dev.submit([enc.finish()]))
    if not np.array_equal(t.read(host.shape, host.dtype), host):
        raise SystemExit(f"staging ring round trip of {n} bytes returned wrong data")
    if not queue_refs:
        buf.destroy()
        return res

    def write_buffer() -> None:
        queue.write_buffer(buf, 0, host)
        dev.wait(dev.submit([dev.device.create_command_encoder().finish()]))

    def read_buffer() -> np.ndarray:
        return np.frombuffer(queue.read_buffer(buf), np.uint32)

    res[("up", "write_buffer")] = best_of(write_buffer, repeat, warmup=True)
    res[("down", "read_buffer")] = best_of(read_buffer, repeat, warmup=True)
    buf.destroy()
    return res


def host_copy_figure(n: int, threads: int, repeat: int) -> float:
    """A host-to-host ``np.copyto`` of ``n`` bytes on ``threads`` threads: the CPU side's ceiling."""
    import concurrent.futures

    src = np.ones(n, np.uint8)
    dst = np.empty_like(src)
    step = -(-n // threads)
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        def run() -> None:
            list(pool.map(lambda i: np.copyto(dst[i:i + step], src[i:i + step]), range(0, n, step)))
        return best_of(run, repeat, warmup=True)


def torch_figures(n: int, repeat: int) -> dict[tuple[str, str], float]:
    try:
        import torch
    except ImportError:
        return {}
    if not torch.cuda.is_available():
        return {}
    gpu = torch.empty(n, dtype=torch.uint8, device="cuda")
    pinned = torch.ones(n, dtype=torch.uint8, pin_memory=True)
    pageable = torch.ones(n, dtype=torch.uint8)

    def copy(dst: Any, src: Any) -> Callable[[], None]:
        def run() -> None:
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
        return run

    res = {
        ("up", "torch_pinned"): best_of(copy(gpu, pinned), repeat, warmup=True),
        ("up", "torch_pageable"): best_of(copy(gpu, pageable), repeat, warmup=True),
        ("down", "torch_pinned"): best_of(copy(pinned, gpu), repeat, warmup=True),
        ("down", "torch_pageable"): best_of(copy(pageable, gpu), repeat, warmup=True),
    }
    del gpu, pinned, pageable
    torch.cuda.empty_cache()
    return res


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1M,16M,256M,1G", help="comma-separated sizes (K, M, G = KiB, MiB, GiB)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per figure (best is reported)")
    p.add_argument("--threads", default="", help="copy threads of the ring; a comma list adds one ring per value")
    p.add_argument("--chunk", default="8M", help="the ring's chunk_bytes (largest staging buffer)")
    p.add_argument("--no-torch", action="store_true", help="skip the torch reference")
    args = p.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    threads = [int(t) for t in args.threads.split(",") if t.strip()] or [min(16, os.cpu_count() or 1)]
    chunk = parse_size(args.chunk)

    dev = Device()
    emit(adapter=dev.summary, python=platform.python_version(), wgpu=wgpu.__version__, numpy=np.__version__,
         cpus=os.cpu_count())
    print(f"# adapter: {dev.summary['summary']}", flush=True)
    # Enough pooled staging for the largest transfer three ways (upload chunks, download
    # chunks, one zero-copy buffer): the figures show the steady state, not the pool cap
    # (the ring's default cap grows to twice the largest transfer, which is one short
    # here; a staging buffer created anew costs far more than the copy, e.g. ~250 ms for
    # 1 GiB on an H200).
    pool = 3 * max(sizes) + chunk
    rings = [StagingRing(dev.device, copy_threads=t, chunk_bytes=chunk, max_pooled_bytes=pool)
             for t in threads]
    emit(config={"copy_threads": threads, "chunk_bytes": chunk, "max_pooled_bytes": pool,
                 "repeat": args.repeat})

    for n in sizes:
        res: dict[tuple[str, str], float] = {}
        for i, ring in enumerate(rings):
            tag = "" if len(rings) == 1 else f"[t={ring.copy_threads}]"
            res.update(wgpu_figures(dev, ring, n, args.repeat, tag, queue_refs=i == 0))
            ring.trim()  # leave the memory to the next size
        res[("host", f"numpy_copy[t={threads[-1]}]")] = host_copy_figure(n, threads[-1], args.repeat)
        if not args.no_torch:
            res.update(torch_figures(n, args.repeat))
        gbps = {k: n / s / 1e9 for k, s in res.items()}
        order = sorted(gbps.items(), key=lambda kv: (["up", "down", "host"].index(kv[0][0]), kv[0][1]))
        for (direction, impl), g in order:
            emit(direction=direction, impl=impl, bytes=n, size=human(n), GBps=round(g, 3))
        for (direction, impl), g in order:
            if not impl.startswith("staging_ring"):
                continue
            for ref in ("torch_pinned", "write_buffer" if direction == "up" else "read_buffer"):
                if (direction, ref) in gbps:
                    emit(direction=direction, impl=impl, bytes=n, size=human(n), vs=ref,
                         ratio=round(g / gbps[(direction, ref)], 3))
    for ring in rings:
        emit(ring_stats=ring.stats())
        ring.close()
    dev.close()


if __name__ == "__main__":
    main()
