"""llama.cpp beside hetero: its benchmark programs run and read, and the kit's random GGUF files.

Used by ``python -m bench generate --vs-llama-cpp BIN_DIR`` (see :mod:`bench.generate`).

* :func:`run_llama_bench` runs ``llama-bench -m FILE -ngl 99 -p 512 -n 128 -r 3 -fa 1 -o json``
  and :func:`parse_llama_bench` reads what it prints: a JSON array, one object a test, with
  ``n_prompt``, ``n_gen``, ``n_depth``, ``avg_ts`` and ``stddev_ts`` (tokens a second over the
  repetitions: ``(n_prompt + n_gen) / seconds`` of each) among llama-bench's fields. A test
  with ``n_gen == 0`` is ``pp<n_prompt>`` (one batch of that many prompt tokens), one with
  ``n_prompt == 0`` is ``tg<n_gen>`` (that many single-token decode steps after an empty
  prompt, each waited for).
* :func:`run_batched_bench` runs ``llama-batched-bench -m FILE -ngl 99 -fa on -c 16384 -npp 128
  -ntg 128 -npl 1,64 --output-format jsonl`` and :func:`parse_batched_bench` reads one JSON
  object a line (other lines are skipped): for ``pl`` streams, each prefilled with ``pp``
  tokens, then ``tg`` steps that decode one token for every stream: ``t_pp``/``speed_pp``
  (``pl * pp / t_pp``), ``t_tg``/``speed_tg`` (``pl * tg / t_tg``, the aggregate decode rate)
  and ``t``/``speed`` (all tokens over both).
* :func:`make_ggufs` writes random-weight GGUF files with the llm-anchor kit's
  ``make_random_gguf.py`` (SmolLM2-135M's metadata, tokenizer included, from
  ``smollm2_meta.gguf.xz``): the names of :data:`KIT_MODELS`, which the kit's ``run.sh`` uses too.

The binaries come from the kit's ``run.sh`` (``.llm-build/build/bin``); a missing one raises
:class:`LlamaCppMissing`, which says how to build it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["BATCHED_BENCH", "KIT_MODELS", "L1B", "LLAMA_BENCH", "BatchedRow", "BenchRow", "LlamaCppError",
           "LlamaCppMissing", "binaries", "make_ggufs", "parse_batched_bench", "parse_llama_bench",
           "run_batched_bench", "run_llama_bench"]

LLAMA_BENCH = "llama-bench"
BATCHED_BENCH = "llama-batched-bench"
# The 1.07B Llama shape the kit writes beside SmolLM2-135M's (SmolLM2's vocabulary and tokenizer).
L1B = ("--layers", "16", "--hidden", "2048", "--ff", "8192", "--heads", "32", "--kv-heads", "8")
KIT_MODELS: dict[str, tuple[str, ...]] = {  # file stem -> make_random_gguf.py write arguments
    "smollm2-orig": ("--type", "orig"),  # the real file's types: Q8_0 embeddings, Q4_1 matrices
    "smollm2-q8_0": ("--type", "q8_0"),
    "smollm2-f16": ("--type", "f16"),
    "smollm2-q4_1": ("--type", "q4_1"),
    "llama1b-q4_1": ("--type", "q4_1", *L1B),
    "llama1b-q8_0": ("--type", "q8_0", *L1B),
}


class LlamaCppMissing(RuntimeError):
    """A llama.cpp binary (or the kit) is not where it was looked for."""


class LlamaCppError(RuntimeError):
    """A llama.cpp program failed or printed what cannot be read."""


@dataclass(frozen=True)
class BenchRow:
    """One test of ``llama-bench -o json``."""

    test: str  # "pp512", "tg128", "pp512+tg128" (both), with "@d<depth>" after a depth
    n_prompt: int
    n_gen: int
    n_depth: int
    avg_ts: float  # tokens a second, the mean over the repetitions
    stddev_ts: float
    samples_ts: tuple[float, ...]
    model_type: str  # e.g. "llama 135M Q4_1"
    model_size: int  # bytes
    flash_attn: int


@dataclass(frozen=True)
class BatchedRow:
    """One line of ``llama-batched-bench --output-format jsonl``."""

    pp: int
    tg: int
    pl: int
    t_pp: float
    speed_pp: float
    t_tg: float
    speed_tg: float  # pl * tg / t_tg: the streams' aggregate decode rate
    t: float
    speed: float


def _test_name(n_prompt: int, n_gen: int, n_depth: int) -> str:
    parts = ([f"pp{n_prompt}"] if n_prompt else []) + ([f"tg{n_gen}"] if n_gen else [])
    return "+".join(parts) + (f"@d{n_depth}" if n_depth else "")


def parse_llama_bench(text: str, source: str = "llama-bench") -> list[BenchRow]:
    """The tests of ``llama-bench -o json`` output (``source`` names it in errors)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise LlamaCppError(f"{source}: output is not JSON ({e}); was it run with -o json?") from e
    if not isinstance(data, list):
        raise LlamaCppError(f"{source}: expected a JSON array of tests, got {type(data).__name__}")
    rows = []
    for n, r in enumerate(data):
        try:
            n_prompt, n_gen, n_depth = int(r["n_prompt"]), int(r["n_gen"]), int(r.get("n_depth", 0))
            rows.append(BenchRow(_test_name(n_prompt, n_gen, n_depth), n_prompt, n_gen, n_depth,
                                 float(r["avg_ts"]), float(r["stddev_ts"]),
                                 tuple(float(x) for x in r.get("samples_ts", ())), str(r.get("model_type", "")),
                                 int(r.get("model_size", 0)), int(r.get("flash_attn", -1))))
        except (KeyError, TypeError, ValueError) as e:
            raise LlamaCppError(f"{source}: test {n} lacks a field or has a bad value ({type(e).__name__}: {e})") \
                from e
    return rows


def parse_batched_bench(text: str, source: str = "llama-batched-bench") -> list[BatchedRow]:
    """The rows of ``llama-batched-bench --output-format jsonl`` output; lines not an object are skipped."""
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            r = json.loads(line)
            rows.append(BatchedRow(int(r["pp"]), int(r["tg"]), int(r["pl"]), float(r["t_pp"]), float(r["speed_pp"]),
                                   float(r["t_tg"]), float(r["speed_tg"]), float(r["t"]), float(r["speed"])))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise LlamaCppError(f"{source}: line {n} is not a batched-bench row ({type(e).__name__}: {e})") from e
    return rows


def binaries(bin_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """``{name: path}`` of llama-bench and llama-batched-bench in ``bin_dir``; LlamaCppMissing if one is not there."""
    d = Path(bin_dir)
    found = {name: d / name for name in (LLAMA_BENCH, BATCHED_BENCH)}
    missing = [name for name, p in found.items() if not (p.is_file() and os.access(p, os.X_OK))]
    if missing:
        raise LlamaCppMissing(
            f"llama.cpp: {', '.join(missing)} not found (or not executable) in {str(d)!r}; build them with the "
            "llm-anchor kit (bash .llm-anchor/run.sh builds into .llm-build/build/bin) and pass that directory "
            "to --vs-llama-cpp")
    return found


def _run(cmd: list[str], timeout: float) -> str:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise LlamaCppError(f"{Path(cmd[0]).name}: no answer within {timeout:.0f} s: {' '.join(cmd)}") from e
    if p.returncode != 0:
        tail = "\n".join(p.stderr.strip().splitlines()[-12:])
        raise LlamaCppError(f"{Path(cmd[0]).name} exited with {p.returncode}: {' '.join(cmd)}\n{tail}")
    return p.stdout


def llama_bench_command(bin_dir: str | os.PathLike[str], gguf: str | os.PathLike[str], *, n_prompt: int = 512,
                        n_gen: int = 128, reps: int = 3) -> list[str]:
    """The llama-bench command line: all layers on the GPU, flash attention on, JSON out."""
    return [str(binaries(bin_dir)[LLAMA_BENCH]), "-m", str(gguf), "-ngl", "99", "-p", str(n_prompt), "-n",
            str(n_gen), "-r", str(reps), "-fa", "1", "-o", "json"]


def batched_bench_command(bin_dir: str | os.PathLike[str], gguf: str | os.PathLike[str], *, npp: int = 128,
                          ntg: int = 128, npl: tuple[int, ...] = (1, 64), ctx: int = 16384) -> list[str]:
    """The llama-batched-bench command line: ``npl`` streams of ``npp`` prompt and ``ntg`` decoded tokens."""
    return [str(binaries(bin_dir)[BATCHED_BENCH]), "-m", str(gguf), "-ngl", "99", "-fa", "on", "-c", str(ctx),
            "-npp", str(npp), "-ntg", str(ntg), "-npl", ",".join(map(str, npl)), "--output-format", "jsonl"]


def run_llama_bench(bin_dir: str | os.PathLike[str], gguf: str | os.PathLike[str], *, timeout: float = 120,
                    **kw: Any) -> list[BenchRow]:
    """Run llama-bench on ``gguf`` (:func:`llama_bench_command`'s options) and read its tests."""
    cmd = llama_bench_command(bin_dir, gguf, **kw)
    return parse_llama_bench(_run(cmd, timeout), f"llama-bench on {gguf}")


def run_batched_bench(bin_dir: str | os.PathLike[str], gguf: str | os.PathLike[str], *, timeout: float = 120,
                      **kw: Any) -> list[BatchedRow]:
    """Run llama-batched-bench on ``gguf`` (:func:`batched_bench_command`'s options) and read its rows."""
    cmd = batched_bench_command(bin_dir, gguf, **kw)
    return parse_batched_bench(_run(cmd, timeout), f"llama-batched-bench on {gguf}")


def make_ggufs(kit: str | os.PathLike[str], out_dir: str | os.PathLike[str], names: list[str], *,
               layers: int | None = None, timeout: float = 300) -> list[Path]:
    """The kit's random GGUF files ``names`` (of :data:`KIT_MODELS`) in ``out_dir``, written where missing.

    ``layers`` overrides the layer count (a smoke test); the file is then ``<name>-l<layers>.gguf``.
    A file already there is kept (the kit's run.sh writes the same names).
    """
    k = Path(kit)
    script, meta = k / "make_random_gguf.py", k / "smollm2_meta.gguf.xz"
    for needed in (script, meta):
        if not needed.is_file():
            raise LlamaCppMissing(f"the llm-anchor kit has no {needed.name} in {str(k)!r}; copy the kit there "
                                  "(cp -r ../shared/llm-anchor .llm-anchor) or pass --kit DIR")
    unknown = [n for n in names if n not in KIT_MODELS]
    if unknown:
        raise ValueError(f"unknown kit model(s) {', '.join(unknown)}; known: {', '.join(KIT_MODELS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for name in names:
        args = list(KIT_MODELS[name])
        if layers:
            if "--layers" in args:
                i = args.index("--layers")
                del args[i:i + 2]
            args += ["--layers", str(layers)]
        f = out / (f"{name}-l{layers}.gguf" if layers else f"{name}.gguf")
        if not (f.is_file() and f.stat().st_size > 0):
            tmp = f.with_suffix(".gguf.tmp")
            p = subprocess.run([sys.executable, str(script), "write", str(meta), str(tmp), *args],
                               capture_output=True, text=True, timeout=timeout)
            if p.returncode != 0:
                tmp.unlink(missing_ok=True)
                raise LlamaCppError(f"make_random_gguf.py write {name} failed ({p.returncode}):\n"
                                    + "\n".join(p.stderr.strip().splitlines()[-8:]))
            tmp.rename(f)
        files.append(f)
    return files
