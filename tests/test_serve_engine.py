"""The engine process's link (``hetero.pipelines.serve_engine``): an engine and its fronts over real loopback TCP, in process."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import numpy as np
import pytest

import hetero
from hetero.pipelines.embed import aembed, token_ids
from hetero.pipelines.minilm import Model, load_model
from hetero.pipelines.testing import write_random_model

pytest.importorskip("starlette")
pytest.importorskip("prometheus_client")

from hetero.pipelines.serve_engine import EmbeddingEngine, EngineClient, EngineError  # noqa: E402

TINY = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=40, max_seq_length=24)
# Real text: sentences from the standard library's documentation.
TEXTS = [
    "Return the absolute value of a number.",
    "Open file and return a corresponding file object.",
    "Return a new sorted list from the items in iterable.",
    "hi",
    "The optional arguments mode, buffering, encoding, errors, newline, closefd and opener are "
    "passed on to the underlying file object when the file is opened.",
    "Return the number of items in a container.",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Model:
    return load_model(write_random_model(tmp_path_factory.mktemp("tiny-engine"), seed=7, scale=0.3, **TINY))


SECRET = b"s" * 32


@pytest.fixture
def sock_path(tmp_path: Path) -> str:
    return str(tmp_path / "engine.port")


@asynccontextmanager
async def engine_serving(engine: EmbeddingEngine, path: str) -> AsyncIterator[anyio.CancelScope]:
    """``engine`` running and accepting fronts at ``path``; cancel the scope it yields to stop accepting."""
    async with engine.running(), anyio.create_task_group() as tg:
        await tg.start(engine.serve_fronts, path, SECRET)
        yield tg.cancel_scope
        tg.cancel_scope.cancel()


async def ready(client: EngineClient) -> None:
    with anyio.fail_after(120):
        while not client.ready:
            assert client.lost is None and client.warmup_error is None, (client.lost, client.warmup_error)
            await anyio.sleep(0.01)


@pytest.mark.anyio
async def test_two_fronts_share_the_engine_and_get_embed_s_vectors(tiny: Model, shared_rt: hetero.Runtime,
                                                                   sock_path: str) -> None:
    batches: list[int] = []
    engine = EmbeddingEngine(tiny, runtime=shared_rt, max_batch_tokens=256, precapture=False,
                             on_batch=lambda n, c: batches.append(n))
    requests = [TEXTS[i:i + k] for i in range(len(TEXTS)) for k in (1, 2)]  # 12 requests, 1-2 sentences each
    got: dict[int, np.ndarray] = {}
    async with engine_serving(engine, sock_path):
        fronts = [EngineClient(sock_path, SECRET), EngineClient(sock_path, SECRET)]
        async with fronts[0].running(), fronts[1].running():
            await ready(fronts[0])
            await ready(fronts[1])
            assert fronts[0].adapter == engine.adapter is not None

            async def one(i: int) -> None:
                got[i] = await fronts[i % 2].embed_ids(token_ids(tiny, requests[i]))

            async with anyio.create_task_group() as tg:
                for i in range(len(requests)):
                    tg.start_soon(one, i)
    ref = {t: row for t, row in zip(TEXTS, await aembed(TEXTS, model=tiny, runtime=shared_rt))}
    for i, texts in enumerate(requests):
        assert got[i].shape == (len(texts), tiny.dim) and got[i].dtype == np.float32
        np.testing.assert_allclose(got[i], np.stack([ref[t] for t in texts]), atol=1e-5)
    assert sum(batches) == sum(len(r) for r in requests)


@pytest.mark.anyio
async def test_overload_reaches_the_front_as_429(tiny: Model, shared_rt: hetero.Runtime, sock_path: str) -> None:
    """One batch in flight, one sentence queued: of twenty requests sent together, the rest get 429 at once."""
    engine = EmbeddingEngine(tiny, runtime=shared_rt, max_batch_tokens=256, precapture=False, max_queued=1,
                             max_in_flight=1)
    outcomes: list[object] = []
    async with engine_serving(engine, sock_path):
        front = EngineClient(sock_path, SECRET)
        async with front.running():
            await ready(front)

            async def one(i: int) -> None:
                try:
                    outcomes.append(await front.embed_ids(token_ids(tiny, [TEXTS[i % len(TEXTS)]])))
                except EngineError as e:
                    outcomes.append(e)

            async with anyio.create_task_group() as tg:
                for i in range(20):
                    tg.start_soon(one, i)
    refused = [e for e in outcomes if isinstance(e, EngineError)]
    assert len(outcomes) == 20 and refused
    assert all(e.status == 429 and e.code == "overloaded" and "overloaded" in e.message for e in refused)
    served = [x for x in outcomes if not isinstance(x, EngineError)]
    assert served and all(isinstance(x, np.ndarray) and x.shape == (1, tiny.dim) for x in served)
    assert engine.queued == 0


@pytest.mark.anyio
async def test_a_front_that_leaves_mid_request_does_not_disturb_the_others(tiny: Model, shared_rt: hetero.Runtime,
                                                                          sock_path: str) -> None:
    engine = EmbeddingEngine(tiny, runtime=shared_rt, max_batch_tokens=256, precapture=False)
    async with engine_serving(engine, sock_path):
        leaving, staying = EngineClient(sock_path, SECRET), EngineClient(sock_path, SECRET)
        async with staying.running():
            async with leaving.running():
                await ready(leaving)
                await ready(staying)
                with anyio.move_on_after(0):  # sent, then the caller is cancelled and the front closes its link
                    await leaving.embed_ids(token_ids(tiny, TEXTS))
            rows = await staying.embed_ids(token_ids(tiny, TEXTS[:2]))
            assert rows.shape == (2, tiny.dim)
            with anyio.fail_after(30):
                while len(engine._links) != 1:  # the engine dropped the link of the front that left
                    await anyio.sleep(0.01)


@pytest.mark.anyio
async def test_the_engine_stopping_fails_requests_with_503(tiny: Model, shared_rt: hetero.Runtime,
                                                         sock_path: str) -> None:
    engine = EmbeddingEngine(tiny, runtime=shared_rt, max_batch_tokens=256, precapture=False)
    front = EngineClient(sock_path, SECRET)
    async with front.running():
        async with engine_serving(engine, sock_path):
            await ready(front)
            assert (await front.embed_ids(token_ids(tiny, TEXTS[:1]))).shape == (1, tiny.dim)
        with anyio.fail_after(30):
            while front.lost is None:  # the engine's links closed with it
                await anyio.sleep(0.01)
        assert not front.ready and front.lost == "the embedding engine process stopped"
        with pytest.raises(EngineError) as info:
            await front.embed_ids(token_ids(tiny, TEXTS[:1]))
        assert info.value.status == 503 and "restart the server" in info.value.message


@pytest.mark.anyio
async def test_a_front_without_an_engine_gives_up_with_a_reason(sock_path: str) -> None:
    front = EngineClient(sock_path, SECRET, connect_timeout=0.2)
    async with front.running():
        with anyio.fail_after(30):
            while front.lost is None:
                await anyio.sleep(0.01)
    assert front.lost.startswith(f"cannot reach the embedding engine (address file {sock_path}) within 0.2 s")


@pytest.mark.anyio
async def test_a_connection_without_the_secret_is_closed(tiny: Model, shared_rt: hetero.Runtime,
                                                         sock_path: str) -> None:
    engine = EmbeddingEngine(tiny, runtime=shared_rt, max_batch_tokens=256, precapture=False)
    async with engine_serving(engine, sock_path):
        stranger = EngineClient(sock_path, b"x" * 32)
        async with stranger.running():
            with anyio.fail_after(30):
                while stranger.lost is None:
                    await anyio.sleep(0.01)
            assert stranger.lost == "the embedding engine process stopped" and not stranger.ready
        assert engine._links == set()


@pytest.mark.anyio
async def test_a_stranger_announcing_a_huge_frame_is_dropped_at_once(tiny: Model, shared_rt: hetero.Runtime,
                                                                     sock_path: str) -> None:
    import struct

    engine = EmbeddingEngine(tiny, runtime=shared_rt, max_batch_tokens=256, precapture=False)
    async with engine_serving(engine, sock_path):
        port = int(Path(sock_path).read_text())
        async with await anyio.connect_tcp("127.0.0.1", port) as stranger:
            await stranger.send(struct.pack("<IB", 1 << 31, 5))  # "a 2 GiB hello follows"
            with anyio.fail_after(30), pytest.raises((anyio.EndOfStream, anyio.BrokenResourceError)):
                await stranger.receive()  # closed by the engine without reading on
        front = EngineClient(sock_path, SECRET)
        async with front.running():
            await ready(front)
            assert (await front.embed_ids(token_ids(tiny, TEXTS[:1]))).shape == (1, tiny.dim)


@pytest.mark.anyio
async def test_a_failed_warm_up_reaches_the_fronts(tiny: Model, shared_rt: hetero.Runtime, sock_path: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's warm-up fails (the service's warm-up raises what a kernel that does not compile
    would): the front learns why and never turns ready."""
    from hetero.pipelines.embed import EmbeddingService

    async def failing_warmup(self: EmbeddingService, precapture: bool = True) -> int:
        raise hetero.HeteroError("stage 'layer0' failed to compile: out of registers")

    monkeypatch.setattr(EmbeddingService, "warmup", failing_warmup)
    engine = EmbeddingEngine(tiny, runtime=shared_rt, max_batch_tokens=256, precapture=False)
    async with engine_serving(engine, sock_path):
        front = EngineClient(sock_path, SECRET)
        async with front.running():
            with anyio.fail_after(30):
                while front.warmup_error is None:
                    await anyio.sleep(0.01)
            assert front.warmup_error == "stage 'layer0' failed to compile: out of registers"
            assert not front.ready and front.lost is None
