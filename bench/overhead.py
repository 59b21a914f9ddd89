"""Per-stage scheduler overhead on a wide x deep chain DAG of trivial CPU stages.

Runs the same DAG through hetero, ``dask.threaded.get`` and plain asyncio +
``run_in_executor`` in one process and prints microseconds per stage and ratios.

    python -m bench.overhead [--width 100] [--depth 100] [--repeat 5]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import operator
import os
import platform

import hetero
from bench._common import best_of, emitter

emit = emitter("overhead")


def build_hetero(width: int, depth: int) -> hetero.Graph:
    g = hetero.Graph("chains")
    x = g.input("x")
    ends = []
    for w in range(width):
        prev = x
        for d in range(depth):
            prev = g.cpu(operator.add, prev, 1, name=f"s{w}_{d}")
        ends.append(prev)
    g.output(*ends)
    return g


def build_dask(width: int, depth: int) -> tuple[dict, list]:
    dsk: dict = {"x": 0}
    ends = []
    for w in range(width):
        prev = "x"
        for d in range(depth):
            key = f"s{w}_{d}"
            dsk[key] = (operator.add, prev, 1)
            prev = key
        ends.append(prev)
    return dsk, ends


async def asyncio_chains(width: int, depth: int, pool: concurrent.futures.Executor) -> list[int]:
    loop = asyncio.get_running_loop()

    async def chain() -> int:
        v = 0
        for _ in range(depth):
            v = await loop.run_in_executor(pool, operator.add, v, 1)
        return v

    return await asyncio.gather(*(chain() for _ in range(width)))



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=100)
    ap.add_argument("--depth", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    n = a.width * a.depth
    threads = os.cpu_count() or 1

    g = build_hetero(a.width, a.depth)
    rt = hetero.Runtime()
    import anyio

    def run_hetero() -> None:
        out = anyio.run(lambda: rt.run(g, x=0))
        assert out == (a.depth,) * a.width

    run_hetero()  # plan once, start threads
    results = {"hetero": best_of(run_hetero, a.repeat)}
    rt.close()

    try:
        import dask
        import dask.threaded

        dsk, ends = build_dask(a.width, a.depth)

        def run_dask() -> None:
            out = dask.threaded.get(dsk, ends, num_workers=threads)
            assert tuple(out) == (a.depth,) * a.width

        run_dask()
        results["dask.threaded"] = best_of(run_dask, a.repeat)
    except ImportError:
        print("# dask not installed: skipping the dask reference")

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        def run_asyncio() -> None:
            assert asyncio.run(asyncio_chains(a.width, a.depth, pool)) == [a.depth] * a.width

        run_asyncio()
        results["asyncio+run_in_executor"] = best_of(run_asyncio, a.repeat)

    per = {k: v / n * 1e6 for k, v in results.items()}
    for k, us in per.items():
        emit(impl=k, stages=n, threads=threads, us_per_stage=round(us, 2), seconds=round(results[k], 4))
    for ref in ("dask.threaded", "asyncio+run_in_executor"):
        if ref in per:
            emit(reference=ref, speedup_of_hetero=round(per[ref] / per["hetero"], 2))
    print(f"# {platform.processor() or platform.machine()}, {threads} threads, python {platform.python_version()}")


if __name__ == "__main__":
    main()
