"""``python -m hetero.kernels.matmul [--tune] [--sizes ...]``: show or fill this adapter's tuning cache."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

import numpy as np

import hetero
from hetero.kernels.matmul.cache import cache_path, load
from hetero.kernels.matmul.tuner import tune

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Show the tuning cache of this machine's adapter, or (``--tune``) fill it."""
    ap = argparse.ArgumentParser(prog="python -m hetero.kernels.matmul",
                                 description="Tune hetero's matmul for this machine's adapter and cache the choice.")
    ap.add_argument("--tune", action="store_true", help="run the tuner (otherwise: show the cache)")
    ap.add_argument("--sizes", default="1024,2048,4096",
                    help="comma-separated square sizes, or MxNxK[xB] shapes (default 1024,2048,4096)")
    ap.add_argument("--transpose-b", action="store_true")
    ap.add_argument("--f16", action="store_true", help="tune float16 inputs and outputs")
    ap.add_argument("--min-ms", type=float, default=20.0)
    a = ap.parse_args(argv)
    with hetero.Runtime(gpu_budget_ms=1e9) as rt:
        dev = rt.device()
        path = cache_path(dev)
        print(json.dumps({"adapter": dev.summary["summary"], "cache": str(path)}))
        if a.tune:
            for s in a.sizes.split(","):
                dims = [int(x) for x in s.lower().split("x")] if "x" in s else [int(s)] * 3
                m, n, k = dims[:3]
                batch = dims[3] if len(dims) > 3 else 1
                r = tune(dev, m, n, k, batch=batch, transpose_b=a.transpose_b,
                         dtype=np.float16 if a.f16 else np.float32, min_ms=a.min_ms, verbose=True)
                print(json.dumps({"shape": list(r.shape), "key": r.key, "best": r.best.name,
                                  "gflops": r.gflops}), flush=True)
        else:
            entries = load(path)
            print(json.dumps({key: c.name for key, c in sorted(entries.items())}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
