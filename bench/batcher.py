"""The batcher's own host cost: a lone ``await b(x=...)`` beside ``await rt.run(g, x=[...])``.

    python -m bench batcher [--calls 2000] [--rounds 5] [--backend asyncio|trio|both]

The graph is one inline CPU stage (a numpy product), so a call's time is the scheduler's
and the batcher's host work. Each round times ``--calls`` sequential ``rt.run`` calls of the
one-item batch, then as many sequential batcher calls (each one item, alone: what a server
does for one client), in one event loop; the figure is the median over the rounds, per
call, and the batcher's own cost is the difference. (This machine kind's speed moves from
one state to another: compare trees by alternating whole runs of this program.)
"""

from __future__ import annotations

import argparse
import importlib.util
import time

import anyio
import numpy as np

import hetero
from bench._common import emitter

emit = emitter("batcher")


def _double(xs: list[int]) -> np.ndarray:
    return np.asarray(xs, np.int64) * 2


async def lone_calls(calls: int, rounds: int) -> tuple[list[float], list[float]]:
    g = hetero.Graph("double")
    g.output(g.cpu(_double, g.input("x"), name="double", inline=True))
    async with hetero.Runtime() as rt:
        b = rt.batcher(g)
        for i in range(200):  # warm: the plan, the dispatching task, the allocator
            await rt.run(g, x=[i])
            assert int(await b(x=i)) == 2 * i
        direct: list[float] = []
        batched: list[float] = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for i in range(calls):
                await rt.run(g, x=[i])
            direct.append((time.perf_counter() - t0) / calls)
            t0 = time.perf_counter()
            for i in range(calls):
                await b(x=i)
            batched.append((time.perf_counter() - t0) / calls)
        assert b.batches == 200 + rounds * calls  # every lone call ran as a batch of its own
        await b.aclose()
    return direct, batched


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--backend", choices=("asyncio", "trio", "both"), default="both")
    a = ap.parse_args(argv)
    backends = ["asyncio", "trio"] if a.backend == "both" else [a.backend]
    if a.backend == "both" and importlib.util.find_spec("trio") is None:
        backends.remove("trio")
        print("# trio is not installed: asyncio only")
    for backend in backends:
        direct, batched = anyio.run(lone_calls, a.calls, a.rounds, backend=backend)
        d, b = float(np.median(direct)) * 1e6, float(np.median(batched)) * 1e6
        emit(backend=backend, calls=a.calls, rounds=a.rounds, rt_run_us=round(d, 1), batcher_call_us=round(b, 1),
             batcher_own_us=round(b - d, 1), batcher_over_run=round(b / d, 3))


if __name__ == "__main__":
    main()
