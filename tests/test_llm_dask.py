"""Text generation on a dask cluster (hetero.pipelines.llm_dask.DaskLLM) against a local LLM, tiny random model.

Two in-process workers, each with its own Runtime (and device): the prompt list is split into
one list per task, in order, and every completion matches the local ``generate`` of the whole
list, greedy and sampled (prompt ``i`` samples with ``seed + i`` wherever it ran).
"""

from __future__ import annotations

import os
import sys

import anyio
import pytest

pytest.importorskip("distributed")
sys.path.insert(0, os.path.dirname(__file__))

from distributed import Client, LocalCluster  # noqa: E402
from llm_fixtures import write_tiny_gguf  # noqa: E402

import hetero  # noqa: E402
from hetero.dask import ClusterError, DaskRuntime, HeteroPlugin  # noqa: E402
from hetero.errors import InputError  # noqa: E402
from hetero.pipelines import LLM  # noqa: E402
from hetero.pipelines.llm_dask import DaskLLM  # noqa: E402

KV = 1 << 20
PROMPTS = ["The quick brown fox", "What is the capital of France?", "def f(x):\n    return", "A", "Once", "B c"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_tiny_gguf(tmp_path_factory.mktemp("llm-dask") / "llama.gguf", "llama", "f32"))


@pytest.fixture(scope="module")
def client() -> Client:
    with LocalCluster(n_workers=2, processes=False, threads_per_worker=2, resources={"wgpu": 1},
                      dashboard_address=":0") as cluster, Client(cluster) as c:
        c.wait_for_workers(2, timeout=120)
        c.register_plugin(HeteroPlugin(cpu_threads=1))
        yield c


@pytest.fixture(scope="module")
def local(model: str) -> LLM:
    with hetero.Runtime(cpu_threads=1) as rt, LLM(model, runtime=rt, kv_cache_bytes=KV) as llm:
        yield llm


def test_generate_of_a_list_matches_local_and_spreads_over_the_workers(client: Client, model: str,
                                                                      local: LLM) -> None:
    greedy = local.generate(PROMPTS, max_tokens=6)
    sampled = local.generate(PROMPTS, max_tokens=6, temperature=1.0, seed=5)
    with DaskRuntime(client) as drt:
        before = drt.worker_stats()
        llm = DaskLLM(model, runtime=drt, kv_cache_bytes=KV)
        got = llm.generate(PROMPTS, max_tokens=6)
        after = drt.worker_stats()
        assert [c.token_ids for c in got] == [c.token_ids for c in greedy]
        assert [c.text for c in got] == [c.text for c in greedy]
        assert [c.finish_reason for c in got] == [c.finish_reason for c in greedy]
        # 2 workers x 2 tasks each: 6 prompts in three lists of two, every worker ran some
        assert sum(after[w].chunks - before[w].chunks for w in after) == 3
        assert all(after[w].chunks > before[w].chunks for w in after)
        lone = DaskLLM(model, runtime=drt, prompts_per_task=1, kv_cache_bytes=KV)
        assert [c.token_ids for c in lone.generate(PROMPTS, max_tokens=6, temperature=1.0, seed=5)] == \
            [c.token_ids for c in sampled]
        one = llm.generate(PROMPTS[1], max_tokens=6)
        assert one.token_ids == greedy[1].token_ids


@pytest.mark.anyio
async def test_agenerate_from_async_code(client: Client, model: str, local: LLM) -> None:
    expect = await anyio.to_thread.run_sync(lambda: local.generate(PROMPTS[:3], max_tokens=4))
    async with DaskRuntime(client) as drt:
        got = await DaskLLM(model, runtime=drt, prompts_per_task=2, kv_cache_bytes=KV).agenerate(
            PROMPTS[:3], max_tokens=4)
    assert [c.token_ids for c in got] == [c.token_ids for c in expect]


def test_errors_say_what_was_wrong(client: Client, model: str, tmp_path) -> None:
    with DaskRuntime(client) as drt:
        with pytest.raises(TypeError, match=r"^DaskLLM runs on a hetero.dask.DaskRuntime, got Runtime"):
            DaskLLM(model, runtime=hetero.Runtime())  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"^DaskLLM takes hetero.pipelines.LLM's keyword arguments: "):
            DaskLLM(model, runtime=drt, kv_bytes=KV)
        with pytest.raises(ValueError, match=r"^DaskLLM: prompts_per_task must be a positive integer or None, got 0$"):
            DaskLLM(model, runtime=drt, prompts_per_task=0)
        llm = DaskLLM(model, runtime=drt, kv_cache_bytes=KV)
        with pytest.raises(InputError, match="^generate\\(\\) got an empty list of prompts$"):
            llm.generate([])
        with pytest.raises(hetero.HeteroError, match="model .*nowhere.gguf' does not exist"):
            DaskLLM(str(tmp_path / "nowhere.gguf"), runtime=drt).generate("x", max_tokens=2)
    with pytest.raises(ClusterError, match="declares the resource 'tpu'"):
        DaskRuntime(client, resource="tpu").call_sync(_noop)


async def _noop(plugin: HeteroPlugin) -> None:
    return None
