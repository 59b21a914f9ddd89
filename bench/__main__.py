"""Benchmark suite: ``python -m bench <name> [args...]`` or ``python -m bench all``.

Every benchmark checks correctness, measures a reference in the same run (torch on
CUDA when present, numpy or dask otherwise) and prints one JSON line per figure.
``all`` runs each with its default sizes, one after the other, in fresh processes.
"""

from __future__ import annotations

import subprocess
import sys
import time

BENCHES = {
    "overhead": "scheduler overhead per stage beside dask.threaded and asyncio",
    "transfer": "host<->device bandwidth through the staging ring beside wgpu and torch",
    "gpu_runtime": "fence round trip, coalescing of tiny GPU stages, graph round trip",
    "stage_cost": "host cost of the layers under a tiny GPU stage",
    "op_record": "host time to record one op (dispatch, gelu, layernorm, matmul) in a GPU stage, and to replay it",
    "replay_cost": "CPU time per thread of a replayed run of the GPU embedding graph beside recording every run",
    "batcher": "host cost of a lone batcher call beside a run of the same one-item graph (asyncio, trio)",
    "split": "TDR-safe splitting overhead at GPU-time budgets",
    "reduce": "hetero.ops.sum bandwidth beside torch.sum, and its accuracy",
    "matmul": "fp32 matmul TFLOP/s beside torch (with --tune: autotune first; --small-m: MiniLM's linears, few rows)",
    "matmul_int8": "INT8 weight-quantized matmul (both strategies) beside hetero's fp32 matmul",
    "nn": "softmax, layernorm, gelu, attention, ... at MiniLM shapes beside torch",
    "embed": "MiniLM sentence embeddings of real text beside sentence-transformers (random weights without the model)",
    "dask": "embed on a DaskRuntime (one and two worker processes) beside local embed(), chunk overhead",
    "multigpu": "embed on one dask worker per GPU beside one worker on one GPU; adapters and GPU use per worker",
    "hybrid": "pure-Python CPU stage beside a GPU stage: threads vs process stages, call cost, shared memory",
    "serve": "hetero serve under open-loop Poisson load (1, 16, 256 clients) beside in-process embed()",
    "placement": "a mixed workload (many small products, a few large) placed auto against all-CPU and all-GPU",
    "embed_cpu": "hetero embed with placement on a CPU machine beside sentence-transformers on torch CPU",
    "generate": "LLM text generation (decode, prefill, batched) beside transformers on the same random weights",
    "generate_serve": "hetero serve text generation under 1-256 streaming clients beside in-process generate()",
    "decode_host": "host CPU time of a decode step per thread (recording, the LLM's loop, fences), on any adapter",
    "decode_profile": "each decoder op of a decode step alone on the GPU (both GEMV kernels), the step, its host replay",
    "tensor_cores": "cooperative matrices through wgpu: offered, requestable, right, TFLOP/s beside an fp32 FMA loop",
    "accuracy": "each kernel setting's logits and greedy tokens on a real model and real text beside float64 numpy",
}
# What `all` passes to each (kept within ~10 minutes on an H200). A benchmark missing here is
# not part of `all` (multigpu needs a machine with several GPUs; run it alone).
ALL_ARGS = {
    "overhead": ["--repeat", "3"],
    "transfer": ["--sizes", "1M,16M,256M,1G"],
    "gpu_runtime": ["--fences", "1000", "--stages", "1000"],
    "stage_cost": ["--n", "2000"],
    "op_record": [],
    "replay_cost": ["--model", "random", "--runs", "200"],
    "batcher": [],
    "split": ["--iters", "40000", "--budgets", "5,50,500", "--repeat", "2"],
    "reduce": ["--sizes", "1M,16M,256M,1G"],
    "matmul": ["--tune", "--sizes", "1024,2048,4096"],
    "matmul_int8": ["--sizes", "1024,4096", "--strategy", "dequant,dp4a,dp4a-g64"],
    "nn": [],
    "embed": ["--n", "1024", "--batch", "128"],
    "dask": ["--n", "100000", "--batch", "128"],
    "hybrid": [],
    "serve": ["--concurrency", "1,16,256", "--duration", "10"],
    "placement": [],
    "embed_cpu": ["--n", "1024"],
    "tensor_cores": [],
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        for name, what in BENCHES.items():
            print(f"  {name:<12} {what}")
        print("  all          every benchmark above but multigpu, with default sizes")
        return 0
    name, rest = argv[0], argv[1:]
    if name == "all":
        failed = []
        start = time.perf_counter()
        for bench in BENCHES:
            if bench not in ALL_ARGS:
                print(f"# bench {bench}: not part of all; run it alone: python -m bench {bench}", flush=True)
                continue
            t0 = time.perf_counter()
            print(f"# bench {bench}", flush=True)
            rc = subprocess.call([sys.executable, "-m", f"bench.{bench}", *ALL_ARGS[bench], *rest])
            print(f"# bench {bench}: exit {rc}, {time.perf_counter() - t0:.1f} s", flush=True)
            if rc:
                failed.append(bench)
        print(f"# bench all: {time.perf_counter() - start:.1f} s", flush=True)
        if failed:
            print(f"# failed: {', '.join(failed)}", flush=True)
        return 1 if failed else 0
    if name not in BENCHES:
        print(f"bench: unknown benchmark {name!r}; choose one of: {', '.join(BENCHES)}, all", file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, "-m", f"bench.{name}", *rest])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
