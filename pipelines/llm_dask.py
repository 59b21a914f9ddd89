"""Text generation on a dask cluster: :class:`DaskLLM`, ``LLM.generate`` of prompt lists through a ``DaskRuntime``.

::

    from hetero.dask import DaskRuntime
    from hetero.pipelines.llm_dask import DaskLLM

    with DaskRuntime(client) as drt:
        llm = DaskLLM("/models/smollm2.gguf", runtime=drt, kv_cache_bytes=64 << 20)
        completions = llm.generate(prompts, max_tokens=64, temperature=0.8, seed=1)

A generation is not a graph of runs: the :class:`~hetero.pipelines.LLM` steps its sequences
itself, on one Runtime. So a cluster task here is **one prompt list**, generated on a worker
by an ``LLM`` that lives on that worker's Runtime (``DaskRuntime.call``): made on the first
list that reaches the worker (the model loads from its path there, which must exist on the
workers) and kept for the next ones (``HeteroPlugin.keep``: closed at teardown, one per
model and options). The prompts of one call are split, in order, into lists of
``prompts_per_task`` (default: an even split over every worker's ``tasks_per_worker``
slots), all in flight at once; on a worker, the lists that meet share its steps
(continuous batching). The completions come back in prompt order.

Sampling is as a local ``generate`` of the whole list: prompt ``i`` uses ``seed + i``, so the
tokens are the same wherever a prompt ran. ``ttft_s`` and ``tokens_per_s`` are measured on
the worker, from the start of its list.
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Sequence
from typing import Any

import anyio
import numpy as np

import hetero
from hetero.dask import DaskRuntime
from hetero.errors import InputError
from hetero.lowlevel import check_positive_int, running_loop

from .llm import LLM, Completion

__all__ = ["DaskLLM"]

_KEEP = "hetero.pipelines.llm_dask.LLM"


async def generate_on_worker(plugin: Any, model: str, options: dict[str, Any], prompts: list[Any],
                             sampling: dict[str, Any]) -> list[Completion]:
    """The task: ``prompts`` through the worker's LLM for ``model`` and ``options`` (made once per worker)."""
    key = (_KEEP, model, tuple(sorted((k, repr(v)) for k, v in options.items())))
    runtime = plugin.runtime
    llm = await anyio.to_thread.run_sync(plugin.keep, key, lambda: LLM(model, runtime=runtime, **options))
    out = await llm.agenerate(prompts, **sampling)
    return out if isinstance(out, list) else [out]


class DaskLLM:
    """:class:`~hetero.pipelines.LLM`'s ``generate`` on the workers of a ``hetero.dask.DaskRuntime``.

    ``model``: a ``.gguf`` file, a Hugging Face directory (a path that exists on the
    workers) or ``"smollm2"`` (installed there). ``llm_options`` are the LLM's keyword
    arguments (``kv_cache_bytes=``, ``weights=``, ``max_seq_len=``, ...), checked here and
    used on every worker. ``prompts_per_task``: prompts per cluster task (default: the
    prompts split evenly over ``workers x tasks_per_worker`` tasks).
    """

    def __init__(self, model: str | os.PathLike[str] = "smollm2", *, runtime: DaskRuntime,
                 prompts_per_task: int | None = None, **llm_options: Any) -> None:
        if not isinstance(runtime, DaskRuntime):
            raise TypeError(f"DaskLLM runs on a hetero.dask.DaskRuntime, got {type(runtime).__name__}; "
                            "for a local runtime use hetero.pipelines.LLM(model, runtime=...)")
        if not isinstance(model, (str, os.PathLike)):
            raise TypeError(f"DaskLLM: model must be a path or 'smollm2' (it loads on each worker), got "
                            f"{type(model).__name__}")
        if "runtime" in llm_options:
            raise TypeError("DaskLLM: runtime= is the DaskRuntime; each worker's LLM runs on that worker's Runtime")
        try:
            inspect.signature(LLM).bind(model, **llm_options)
        except TypeError as e:
            raise TypeError(f"DaskLLM takes hetero.pipelines.LLM's keyword arguments: {e}") from None
        if prompts_per_task is not None:
            check_positive_int("DaskLLM: prompts_per_task", prompts_per_task, rule="a positive integer or None")
        self.model = os.fspath(model)
        self.runtime = runtime
        self.options = dict(llm_options)
        self.prompts_per_task = prompts_per_task

    def __repr__(self) -> str:
        return f"DaskLLM({self.model!r}, options={self.options!r})"

    def _lists(self, prompts: list[Any]) -> list[tuple[int, list[Any]]]:
        """``(offset, prompts)`` per task, in order."""
        per = self.prompts_per_task
        if per is None:
            slots = len(self.runtime.workers()) * self.runtime.tasks_per_worker
            per = math.ceil(len(prompts) / max(1, slots))
        return [(i, prompts[i:i + per]) for i in range(0, len(prompts), per)]

    async def agenerate(self, prompt: str | Sequence[int] | Sequence[str | Sequence[int]], *, max_tokens: int = 256,
                        temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                        stop: str | Sequence[str] | None = None) -> Completion | list[Completion]:
        """:meth:`generate` from async code (asyncio or trio)."""
        single, prompts = _prompts(prompt)
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise InputError(f"seed must be an integer or None, got {seed!r}")
        lists = await anyio.to_thread.run_sync(self._lists, prompts)
        results: list[list[Completion] | None] = [None] * len(lists)

        failed: list[tuple[int, Exception]] = []

        async def one(k: int, offset: int, part: list[Any], scope: anyio.CancelScope) -> None:
            sampling = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            seed=None if seed is None else seed + offset, stop=stop)
            try:
                results[k] = await self.runtime.call(generate_on_worker, self.model, self.options, part, sampling)
            except Exception as e:  # noqa: BLE001 - the first list's failure is raised as itself, below
                failed.append((k, e))
                scope.cancel()

        async with anyio.create_task_group() as tg:
            for k, (offset, part) in enumerate(lists):
                tg.start_soon(one, k, offset, part, tg.cancel_scope)
        if failed:
            raise min(failed, key=lambda f: f[0])[1]
        done = [c for part in results for c in (part or [])]
        if len(done) != len(prompts):  # pragma: no cover - each task returns one completion per prompt
            raise hetero.HeteroError(f"DaskLLM: {len(done)} completions came back for {len(prompts)} prompts")
        return done[0] if single else done

    def generate(self, prompt: str | Sequence[int] | Sequence[str | Sequence[int]], *, max_tokens: int = 256,
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 stop: str | Sequence[str] | None = None) -> Completion | list[Completion]:
        """Generate from one prompt (a :class:`~hetero.pipelines.Completion`) or a list (a list, in order), as
        ``LLM.generate`` does, on the cluster. Synchronous: from async code use :meth:`agenerate`."""
        lib = running_loop()
        if lib is not None:
            raise hetero.HeteroError(f"DaskLLM.generate() cannot be called inside a running {lib} event loop; "
                                     "use 'await llm.agenerate(...)'")
        out: list[Any] = []

        async def main() -> None:
            out.append(await self.agenerate(prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                            top_k=top_k, seed=seed, stop=stop))

        anyio.run(main)
        return out[0]


def _prompts(prompt: Any) -> tuple[bool, list[Any]]:
    """``(single, prompts)``: one prompt (a str or token ids) or a list of them, as LLM.generate takes."""
    if isinstance(prompt, str):
        return True, [prompt]
    if isinstance(prompt, np.ndarray):
        return (True, [prompt.tolist()]) if prompt.ndim == 1 else (False, [p.tolist() for p in prompt])
    if isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
        if not prompt:
            raise InputError("generate() got an empty list of prompts")
        if all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in prompt):
            return True, [[int(i) for i in prompt]]
        return False, list(prompt)
    raise InputError(f"a prompt must be a str, a list of token ids, or a list of those; got {type(prompt).__name__}")
