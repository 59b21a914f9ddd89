"""The batched embedding service path and ``hetero serve`` (a tiny random model on the test adapter)."""

from __future__ import annotations

import base64
import json
import struct
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import hetero
from hetero._cli import main as cli_main
import hetero.pipelines.embed_graph as graph_mod
import hetero.pipelines.embed_tokens as tokens_mod
from hetero.pipelines.embed import aembed
from hetero.pipelines.embed_graph import service_graph
from hetero.pipelines.embed_service import EmbeddingService
from hetero.pipelines.embed_shapes import (length_bucket, length_buckets, pack_tokens, packed_tokens, row_bucket,
                                           service_examples, service_shapes, token_bucket)
from hetero.pipelines.embed_tokens import LOOP_TOKENIZE_MAX, TokenGroups, token_ids
from hetero.pipelines.minilm import Model, load_model
from hetero.pipelines.testing import write_random_model

httpx = pytest.importorskip("httpx")
pytest.importorskip("hypercorn")
pytest.importorskip("prometheus_client")

from hetero.pipelines.serve import EmbeddingServer, encode_embeddings, serve_async  # noqa: E402
from hetero.pipelines.serve_http import resolve_http  # noqa: E402
from hetero.pipelines.serve_engine import EmbeddingEngine, EngineClient, EngineError  # noqa: E402

from bench.serve import RawClient, check_embedding, free_port, raw_request  # noqa: E402

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
    "Return True if the object argument appears callable, False if not.",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Model:
    return load_model(write_random_model(tmp_path_factory.mktemp("tiny-serve"), seed=3, scale=0.3, **TINY))


def ids_of(model: Model, text: str) -> np.ndarray:
    return np.asarray(model.tokenizer.encode(text).ids, np.int32)


# -- the service path ---------------------------------------------------------------------------------------
@pytest.mark.anyio
async def test_packing_does_not_change_an_embedding(tiny: Model, shared_rt: hetero.Runtime) -> None:
    short, long = ids_of(tiny, TEXTS[3]), ids_of(tiny, TEXTS[4])
    assert len(long) > 4 * len(short)
    bulk = await aembed([TEXTS[3], TEXTS[4]], model=tiny, runtime=shared_rt, batch_size=2)  # padded batches
    async with hetero.Runtime(placement="gpu") as gpu_rt:  # the encoder's GPU stages (shared_rt: the CPU twins)
        for rt in (shared_rt, gpu_rt):
            g = service_graph(tiny, cpu=rt is shared_rt)
            alone = await rt.run(g, ids=[short])
            packed = await rt.run(g, ids=[long, short])
            np.testing.assert_allclose(packed[1], alone[0], atol=1e-5)
            np.testing.assert_allclose(bulk[0], alone[0], atol=1e-5)
            # three sentences pack as four rows (the fourth empty) and padding tokens; three come back
            three = await rt.run(g, ids=[short, long, short])
            assert three.shape == (3, tiny.dim)
            np.testing.assert_allclose(three[[0, 2]], np.stack([alone[0], alone[0]]), atol=1e-5)
            np.testing.assert_allclose(three[1], packed[0], atol=1e-5)


@pytest.mark.anyio
async def test_the_padded_graph_and_small_packed_batches_ask_for_the_small_split(
        tiny: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """embed()'s runs wait on the GPU: their linear layers ask matmul for the K split on small
    outputs (SPLIT_SMALL), and so do packed batches of at most PACKED_SPLIT_MAX_TOKENS tokens (a
    lone client's); a larger served batch's leave it to the default (off)."""
    seen: list[Any] = []

    def spying(real: Any) -> Any:
        def spy(*args: Any, small_split: Any = "unset", **kwargs: Any) -> Any:
            seen.append(small_split)
            return real(*args, small_split=None if small_split == "unset" else small_split, **kwargs)
        return spy

    for name in ("matmul", "matmul_layernorm"):  # the linear layers: two of four end in a layernorm
        monkeypatch.setattr(graph_mod.ops, name, spying(getattr(graph_mod.ops, name)))
    # and the Q/K/V projection, whose partial products attention may sum
    monkeypatch.setattr(graph_mod, "matmul_partials", spying(graph_mod.matmul_partials))
    async with hetero.Runtime(placement="gpu", capture=False) as rt:
        await aembed([TEXTS[0]], model=tiny, runtime=rt)
        assert len(seen) == 4 * tiny.config.num_hidden_layers and set(seen) == {True}
        seen.clear()
        one = [ids_of(tiny, TEXTS[0])]
        assert token_bucket(len(one[0])) <= graph_mod.PACKED_SPLIT_MAX_TOKENS
        await rt.run(service_graph(tiny, cpu=False), ids=one)
        assert len(seen) == 4 * tiny.config.num_hidden_layers and set(seen) == {True}
        seen.clear()
        many = [ids_of(tiny, t) for t in TEXTS[:5]]
        assert sum(map(len, many)) > graph_mod.PACKED_SPLIT_MAX_TOKENS
        await rt.run(service_graph(tiny, cpu=False), ids=many)
        assert len(seen) == 4 * tiny.config.num_hidden_layers and set(seen) == {None}


def test_a_served_batch_is_packed_on_the_thread_that_starts_its_run(tiny: Model) -> None:
    """Packing is inline (the batcher starts runs on the event loop): no hand-off to a CPU worker."""
    for cpu in (True, False):
        stages = {n.name: n for n in service_graph(tiny, cpu=cpu).nodes}
        assert stages["pack"].options.inline and stages["pack"].kind == "cpu"


@pytest.mark.anyio
async def test_packed_int8_and_past_the_budget(tiny: Model, shared_rt: hetero.Runtime) -> None:
    """The int8 service graph packs too; a run past the token budget (not one the batcher forms) still packs."""
    texts = [TEXTS[4], TEXTS[3], TEXTS[0]]
    ids = [ids_of(tiny, t) for t in texts]
    async with hetero.Runtime(placement="gpu") as rt:
        want = await aembed(texts, model=tiny, runtime=rt, batch_size=3, int8=True)
        got = await rt.run(service_graph(tiny, int8=True, max_batch_tokens=24), ids=ids)
        assert sum(map(len, ids)) > 24
        np.testing.assert_allclose(got, want, atol=1e-5)
        assert [s.name for s in rt.stats().stages if s.kind == "gpu"] == ["encoder0", "encoder1"]


@pytest.mark.anyio
async def test_packed_pooling_matches_numpy(shared_rt: hetero.Runtime) -> None:
    from hetero.pipelines.embed_graph import mean_pool_l2_packed, mean_pool_l2_packed_cpu

    x = np.random.default_rng(1).standard_normal((1, 23, 40)).astype(np.float32)
    bounds = np.array([[0, 5], [5, 6], [6, 20], [20, 20], [20, 20]], np.int32)  # two empty rows: zeros
    g = hetero.Graph("pool")
    g.output(g.gpu(mean_pool_l2_packed, g.input("x"), g.input("b")))
    got = await shared_rt.run(g, x=x, b=bounds)
    want = np.stack([x[0, a:b].mean(0) / np.linalg.norm(x[0, a:b].mean(0)) if b > a else np.zeros(40)
                     for a, b in bounds.tolist()])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(mean_pool_l2_packed_cpu(x, bounds), want, rtol=1e-5, atol=1e-6)


def test_bucketed_shapes() -> None:
    for max_len in (24, 256, 512):
        buckets = length_buckets(max_len)
        assert buckets[-1] == max_len and buckets == sorted(set(buckets))
        for n in range(1, max_len + 1):
            b = length_bucket(n, max_len)
            assert n <= b <= max_len and b in buckets
    assert length_buckets(256) == [16, 32, 48, 64, 96, 128, 192, 256]
    assert [token_bucket(n) for n in (1, 17, 64, 65, 97, 129, 200, 5000)] == [16, 32, 64, 96, 128, 192, 256, 6144]
    assert [row_bucket(n) for n in (1, 2, 3, 5, 9, 13, 17, 100)] == [1, 2, 4, 8, 12, 16, 24, 128]
    assert packed_tokens(12289, 16384) == 16384 and packed_tokens(9000, 10000) == 10000  # the budget caps
    assert packed_tokens(20000, 16384) == 24576  # a run past the budget (not the batcher's) still packs


def test_service_shapes_cover_every_batch_the_budget_allows() -> None:
    max_len, budget, most = 24, 64, 32
    examples = service_examples(max_len, budget, most)
    assert sorted(examples) == service_shapes(max_len, budget, most)
    for (packed, rows), (total, n) in examples.items():  # each example packs to its shape
        assert (packed_tokens(total, budget), row_bucket(n)) == (packed, rows) and 2 * n <= total
    rng = np.random.default_rng(0)
    for _ in range(2000):  # batches the batcher may form: n sentences of 2..24 tokens within the padded budget
        n = int(rng.integers(1, most + 1))
        lens = rng.integers(2, max_len + 1, n)
        if n > 1 and length_bucket(int(lens.max()), max_len) * n > budget:
            continue
        assert (packed_tokens(int(lens.sum()), budget), row_bucket(n)) in examples


def test_pack_tokens() -> None:
    tok = (np.array([2, 7, 3], np.int32), np.array([2, 3], np.int32))

    class M:  # what pack_tokens reads of a model
        class config:
            pad_token_id = 0

    ids, types, pos, spans, bounds = pack_tokens(tok, M, tokens=8, rows=4)  # type: ignore[arg-type]
    assert ids.tolist() == [[2, 7, 3, 2, 3, 0, 0, 0]] and pos.tolist() == [[0, 1, 2, 0, 1, 0, 0, 0]]
    assert spans.tolist() == [[0, 3]] * 3 + [[3, 5]] * 2 + [[5, 8]] * 3  # the padding: a sequence of its own
    assert bounds.tolist() == [[0, 3], [3, 5], [5, 5], [5, 5]] and not types.any()
    assert all(a.dtype == np.int32 for a in (ids, types, pos, spans, bounds))
    with pytest.raises(ValueError, match="fewer"):
        pack_tokens(tok, M, tokens=4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fewer"):
        pack_tokens(tok, M, rows=1)  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_warmup_captures_every_packed_shape(tiny: Model) -> None:
    async with hetero.Runtime(placement="gpu") as rt:  # captures are of GPU executions
        svc = EmbeddingService(rt, tiny, max_batch_tokens=48)
        # (tokens, sentences): three sentences of up to 16 tokens fit the padded budget; they pack to 4 rows
        assert svc.shapes == [(16, 1), (16, 2), (16, 4), (32, 1), (32, 2), (32, 4), (48, 2), (48, 4)]
        assert await svc.warmup() == 8
        stages = 2  # GPU stages alone: the encoder in two (encoder0, encoder1)
        assert rt.device().captures.stats()["captures"] == 8 * stages
        out = await svc.aembed(TEXTS[:3])  # a batch of whatever shape replays its stages
        assert rt.device().captures.stats()["captures"] == 8 * stages
        assert {rt.stats().stage(name).capture for name in ("encoder0", "encoder1")} == {"replayed"}
        np.testing.assert_allclose(out, await aembed(TEXTS[:3], model=tiny, runtime=rt), atol=1e-5)
        await svc.aclose()


@pytest.mark.anyio
async def test_service_matches_embed_under_concurrency(tiny: Model, shared_rt: hetero.Runtime) -> None:
    batches: list[tuple[int, int]] = []
    svc = EmbeddingService(shared_rt, tiny, max_batch_tokens=64, on_batch=lambda n, c: batches.append((n, c)))
    texts = TEXTS * 4
    out: dict[int, np.ndarray] = {}

    async def one(i: int) -> None:
        out[i] = (await svc.aembed([texts[i]]))[0]

    async with anyio.create_task_group() as tg:
        for i in range(len(texts)):
            tg.start_soon(one, i)
    ref = await aembed(texts, model=tiny, runtime=shared_rt)
    np.testing.assert_allclose(np.stack([out[i] for i in range(len(texts))]), ref, atol=1e-5)
    assert sum(n for n, _ in batches) == len(texts)
    assert all(c <= 64 or n == 1 for n, c in batches)
    await svc.aclose()
    with pytest.raises(ValueError, match="max_seq_length"):
        EmbeddingService(shared_rt, tiny, max_batch_tokens=8)


@pytest.mark.anyio
async def test_concurrent_callers_are_tokenized_together(tiny: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """TokenGroups: callers asking in one pass of the loop share one tokenizer call and each gets
    its own texts' ids; a bad caller fails alone; a cancelled first caller still tokenizes for
    the others; past LOOP_TOKENIZE_MAX texts the call goes to a worker thread."""
    groups = TokenGroups(tiny)
    want = [token_ids(tiny, [t])[0] for t in TEXTS]
    requests = [[i % len(TEXTS)] if i % 3 else [i % len(TEXTS), (i + 1) % len(TEXTS)] for i in range(30)]
    got: dict[int, list[np.ndarray]] = {}
    threads: set[str] = set()
    real = tokens_mod.token_ids

    def spy(model: Model, texts: Any) -> list[np.ndarray]:
        threads.add(threading.current_thread().name)
        return real(model, texts)

    monkeypatch.setattr(tokens_mod, "token_ids", spy)

    async def one(k: int) -> None:
        got[k] = await groups([TEXTS[i] for i in requests[k]])

    async def cancelled_first() -> None:
        with anyio.CancelScope() as scope:
            scope.cancel()
            got[-1] = await groups([TEXTS[0]])
        assert scope.cancelled_caught

    async def bad() -> None:
        with pytest.raises(TypeError, match=r"texts\[1\] must be str"):
            await groups(["fine", 3])  # type: ignore[list-item]

    async with anyio.create_task_group() as tg:
        tg.start_soon(cancelled_first)
        tg.start_soon(bad)
        for k in range(len(requests)):
            tg.start_soon(one, k)
    assert groups.calls == 1 and -1 not in got
    assert sum(len(r) for r in requests) + 1 > LOOP_TOKENIZE_MAX and threading.current_thread().name not in threads
    for k, r in enumerate(requests):
        assert len(got[k]) == len(r)
        for ids, i in zip(got[k], r):
            np.testing.assert_array_equal(ids, want[i])
    # a few texts: on the loop's own thread; alone: one call each
    threads.clear()
    assert [x.tolist() for x in await groups(TEXTS[:2])] == [w.tolist() for w in want[:2]]
    assert groups.calls == 2 and threads == {threading.current_thread().name}
    assert await groups([]) == [] and groups.calls == 2

    # the joint call failing: each caller tokenizes its own texts
    def fails_jointly(model: Model, texts: Any) -> list[np.ndarray]:
        if len(texts) > 1:
            raise RuntimeError("joint call failed")
        return real(model, texts)

    monkeypatch.setattr(tokens_mod, "token_ids", fails_jointly)
    got.clear()
    async with anyio.create_task_group() as tg:
        for k in (1, 2, 4):
            tg.start_soon(one, k)
    for k in (1, 2, 4):
        np.testing.assert_array_equal(got[k][0], want[requests[k][0]])


# -- the app in process ---------------------------------------------------------------------------------------
def client(server: EmbeddingServer) -> Any:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app), base_url="http://test")


@pytest.mark.anyio
async def test_max_wait_reaches_the_batcher_and_info(tiny: Model, shared_rt: hetero.Runtime,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """``max_wait`` (``--max-wait`` ms) is the engine batcher's, /info reports it; bad values are refused."""
    server = EmbeddingServer(tiny, runtime=shared_rt, auto_truncate=True, max_wait=0.002, precapture=False)
    async with client(server) as c, server.running():
        await server.wait_ready()
        assert server.service is not None and server.service.batcher.max_wait == 0.002
        assert (await c.get("/info")).json()["max_wait_ms"] == 2.0
        r = await c.post("/v1/embeddings", json={"input": TEXTS[:2]})
        assert r.status_code == 200, r.text
    for bad in (-0.001, float("nan"), 60.0, True, "1"):
        with pytest.raises(hetero.HeteroError, match="max_wait must be seconds from 0 to below 60"):
            EmbeddingServer(tiny, runtime=shared_rt, auto_truncate=True, max_wait=bad)  # type: ignore[arg-type]
    for bad_ms in ("-1", "nan", "x", "60000"):
        assert cli_main(["serve", "--model", "minilm", "--max-wait", bad_ms]) == 2
        assert "--max-wait: expected milliseconds" in capsys.readouterr().err


@pytest.mark.anyio
async def test_embeddings_endpoint(tiny: Model, shared_rt: hetero.Runtime) -> None:
    server = EmbeddingServer(tiny, runtime=shared_rt, auto_truncate=True, model_name="tiny", max_client_batch_size=8, precapture=False)
    async with client(server) as c:
        r = await c.get("/health")
        assert r.status_code == 503  # not started, not warmed up
        async with server.running():
            await server.wait_ready()
            assert (await c.get("/health")).json() == {"status": "ok"}
            r = await c.post("/v1/embeddings", json={"input": TEXTS, "model": "tiny"})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["object"] == "list" and body["model"] == "tiny"
            assert [d["index"] for d in body["data"]] == list(range(len(TEXTS)))
            assert all(d["object"] == "embedding" for d in body["data"])
            vecs = np.array([d["embedding"] for d in body["data"]], np.float32)
            np.testing.assert_allclose(vecs, await aembed(TEXTS, model=tiny, runtime=shared_rt), atol=1e-5)
            tokens = sum(len(ids_of(tiny, t)) for t in TEXTS)
            assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}

            r = await c.post("/v1/embeddings", json={"input": TEXTS, "encoding_format": "base64"})
            b64 = np.array([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in r.json()["data"]])
            np.testing.assert_array_equal(b64, vecs)
            for fast in (True, False):  # orjson where installed, and the standard library
                plain = json.loads(encode_embeddings(b64, "float", "tiny", tokens, fast=fast))
                assert plain["usage"] == body["usage"] and plain["model"] == "tiny"
                np.testing.assert_array_equal(np.array([d["embedding"] for d in plain["data"]], np.float32), b64)

            one = (await c.post("/v1/embeddings", json={"input": TEXTS[0]})).json()
            assert len(one["data"]) == 1 and len(one["data"][0]["embedding"]) == tiny.dim

            bad: list[tuple[Any, int, str | None]] = [
                (b"{not json", 400, None), ({"input": []}, 400, "input"), ({"input": ""}, 400, "input"),
                ({"input": ["a", 3.5]}, 400, "input"), ({"input": [101, 102]}, 400, "input"),
                ({"input": [[101, 102]]}, 400, "input"), ({"model": "tiny"}, 400, "input"),
                ({"input": "a", "encoding_format": "int8"}, 400, "encoding_format"),
                ({"input": "a", "model": 3}, 400, "model"), ({"input": ["a"] * 9}, 413, "input"),
            ]
            for payload, status, param in bad:
                if isinstance(payload, bytes):
                    r = await c.post("/v1/embeddings", content=payload)
                else:
                    r = await c.post("/v1/embeddings", json=payload)
                assert r.status_code == status, (payload, r.text)
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"}
                assert err["param"] == param and err["message"]
            r = await c.post("/v1/embeddings", json={"input": ["a", True]})  # JSON true is no token id
            assert r.json()["error"]["message"] == "'input[1]' must be a string, got bool"

            info = (await c.get("/info")).json()
            assert info["model"] == "tiny" and info["dimension"] == tiny.dim
            assert info["max_input_tokens"] == 24 and info["max_client_batch_size"] == 8
            assert info["adapter"]

            metrics = (await c.get("/metrics")).text
            for name in ('hetero_embed_requests_total{code="200"} 3.0', 'hetero_embed_requests_total{code="413"}',
                         "hetero_embed_inputs_total", "hetero_embed_batches_total",
                         "hetero_embed_request_duration_seconds_bucket", "hetero_embed_batch_size_bucket",
                         "hetero_embed_queue_inputs", "hetero_gpu_memory_in_use_bytes",
                         "hetero_embed_queue_duration_seconds_bucket", "hetero_embed_batch_duration_seconds_bucket"):
                assert name in metrics, name
        assert (await c.get("/health")).status_code == 503  # stopped


# Requests whose answers are compared across the HTTP servers: (method, path, JSON or raw body)
SAME_ANSWERS: list[tuple[str, str, Any]] = [
    ("POST", "/v1/embeddings", {"input": TEXTS[:3], "model": "tiny"}),
    ("POST", "/embeddings", {"input": TEXTS[4], "encoding_format": "base64"}),
    ("POST", "/v1/embeddings", b"{not json"),
    ("POST", "/v1/embeddings", b'{"input": [123456789012345678901234567890]}'),  # past orjson's integers
    ("POST", "/v1/embeddings", b'{"input": NaN}'),
    ("POST", "/v1/embeddings", {"input": ["a"] * 5}),
    ("GET", "/v1/embeddings", None),
    ("GET", "/v2/nothing", None),
]
SAME_STATUSES = [200, 200, 400, 400, 400, 413, 405, 404]


async def answers(c: Any) -> list[tuple[int, dict[str, str], bytes]]:
    """Status, the headers every server must agree on, and body of each of SAME_ANSWERS."""
    out = []
    for method, path, payload in SAME_ANSWERS:
        if isinstance(payload, bytes):
            r = await c.request(method, path, content=payload)
        else:
            r = await c.request(method, path, json=payload)
        keep = ("content-type", "content-length", "retry-after", "allow")
        out.append((r.status_code, {k: v for k, v in r.headers.items() if k in keep}, r.content))
    return out


@pytest.mark.anyio
async def test_the_application_answers_every_route(tiny: Model, shared_rt: hetero.Runtime) -> None:
    """The ASGI entry point in process: embeddings, errors in OpenAI's shape, 404 and 405 (with Allow)."""
    server = EmbeddingServer(tiny, runtime=shared_rt, auto_truncate=True, model_name="tiny", max_client_batch_size=4, precapture=False)
    async with client(server) as direct:
        cold = await direct.post("/v1/embeddings", json={"input": "a"})
        assert cold.status_code == 503 and cold.headers["retry-after"] == "1"
        async with server.running():
            await server.wait_ready()
            got = await answers(direct)
    assert [s for s, _, _ in got] == SAME_STATUSES
    assert "token ids" in json.loads(got[3][2])["error"]["message"]
    assert got[0][1]["content-type"] == "application/json"
    assert got[6][1]["allow"] == "POST"
    for status, _, body in got[2:]:
        err = json.loads(body)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], (status, body)
    assert json.loads(got[6][2])["error"]["message"] == "/v1/embeddings takes POST, not GET"
    assert json.loads(got[7][2])["error"]["code"] == "not_found"


HTTP = ["granian", "hypercorn"]


def skip_unless_serves(http: str, anyio_backend: str) -> None:
    """Skip where ``http`` cannot run: granian is not installed, or the loop is trio's."""
    if http == "granian":
        pytest.importorskip("granian")
        if anyio_backend == "trio":
            pytest.skip("granian runs on asyncio only")


@asynccontextmanager
async def served(server: EmbeddingServer, http: str, **kw: Any) -> AsyncIterator[str]:
    """``server`` behind ``http`` on an ephemeral port, for the body of the block: yields its URL."""
    urls: list[str] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: serve_async(server, "127.0.0.1", 0, http=http, ready=urls.append, signals=False,
                                          graceful_timeout=10, **kw))
        with anyio.fail_after(60):
            while not urls:
                await anyio.sleep(0.01)
        yield urls[0]
        server.shutdown()


@pytest.mark.anyio
async def test_both_http_servers_answer_the_same_bytes(tiny: Model, shared_rt: hetero.Runtime,
                                                       anyio_backend: str) -> None:
    """granian (RSGI) and hypercorn (ASGI) over real sockets answer SAME_ANSWERS byte for byte, as the
    application does in process; /info names the server in use."""
    if anyio_backend == "trio":
        pytest.skip("granian runs on asyncio only; hypercorn on trio is covered by the other socket tests")
    pytest.importorskip("granian")
    got: dict[str, Any] = {}
    for http in HTTP:
        server = EmbeddingServer(tiny, runtime=shared_rt, auto_truncate=True, model_name="tiny", max_client_batch_size=4,
                                 precapture=False)
        async with served(server, http) as url, httpx.AsyncClient(base_url=url) as c:
            with anyio.fail_after(60):
                while (await c.get("/health")).status_code != 200:
                    await anyio.sleep(0.02)
            got[http] = await answers(c)
            info = (await c.get("/info")).json()
            assert info["http_server"] == http
    assert [s for s, _, _ in got["granian"]] == SAME_STATUSES
    assert got["granian"] == got["hypercorn"]
    direct = EmbeddingServer(tiny, runtime=shared_rt, auto_truncate=True, model_name="tiny", max_client_batch_size=4, precapture=False)
    async with client(direct) as c, direct.running():
        await direct.wait_ready()
        assert await answers(c) == got["granian"]


def test_http_servers_resolve() -> None:
    """--http auto is granian but on trio; granian on trio, and unknown names, are refused."""
    pytest.importorskip("granian")
    assert resolve_http("auto", "uvloop") == resolve_http("auto", "asyncio") == "granian"
    assert resolve_http("auto", "trio") == resolve_http("hypercorn", "trio") == "hypercorn"
    with pytest.raises(hetero.HeteroError, match=r"^--http granian runs on asyncio only, not --backend trio"):
        resolve_http("granian", "trio")
    with pytest.raises(hetero.HeteroError, match=r"^--http must be one of auto, granian, hypercorn; got 'nginx'"):
        resolve_http("nginx", "asyncio")


def test_base64_body_is_the_same_with_and_without_orjson() -> None:
    emb = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    fast = json.loads(encode_embeddings(emb, "base64", "m", 7, fast=True))
    plain = json.loads(encode_embeddings(emb, "base64", "m", 7, fast=False))
    assert fast == plain
    assert [d["index"] for d in fast["data"]] == [0, 1, 2]
    np.testing.assert_array_equal(np.frombuffer(base64.b64decode(fast["data"][2]["embedding"]), "<f4"), emb[2])


def blocking_graph() -> tuple[threading.Event, hetero.Graph]:
    """A graph whose one CPU stage holds its worker until the event is set (30 s at most)."""
    gate = threading.Event()

    def hold(x: int) -> int:
        gate.wait(30)
        return x

    blocker = hetero.Graph("blocker")
    blocker.output(blocker.cpu(hold, blocker.input("x")))
    return gate, blocker


@pytest.mark.anyio
async def test_overload_429_and_graceful_shutdown(tiny: Model) -> None:
    gate, blocker = blocking_graph()
    rt = hetero.Runtime(cpu_threads=1)  # one CPU worker: the blocker holds it, so batches wait
    try:
        server = EmbeddingServer(tiny, runtime=rt, max_queued=1, max_in_flight=1, precapture=False)
        status: dict[str, int] = {}
        async with client(server) as c:

            async def post(name: str) -> None:
                r = await c.post("/v1/embeddings", json={"input": name})
                status[name] = r.status_code

            async with server.running():
                await server.wait_ready()
                async with anyio.create_task_group() as tg:
                    tg.start_soon(lambda: rt.run(blocker, x=1))
                    await anyio.sleep(0.05)
                    tg.start_soon(post, "first")
                    with anyio.fail_after(30):
                        while server.service is None or server.service.batcher.in_flight < 1:
                            await anyio.sleep(0.005)
                    tg.start_soon(post, "second")
                    with anyio.fail_after(30):
                        while server.service.batcher.queued < 1:
                            await anyio.sleep(0.005)
                    r = await c.post("/v1/embeddings", json={"input": "third"})
                    assert r.status_code == 429 and r.headers["retry-after"] == "1"
                    assert r.json()["error"]["type"] == "rate_limit_error"
                    server.shutdown()  # what SIGTERM and Ctrl-C do
                    r = await c.post("/v1/embeddings", json={"input": "fourth"})
                    assert r.status_code == 503
                    assert (await c.get("/health")).status_code == 503
                    gate.set()
        assert status == {"first": 200, "second": 200}  # in flight when the shutdown began: they finished
    finally:
        gate.set()
        rt.close()


@pytest.mark.anyio
async def test_shutdown_drains_over_a_real_socket(tiny: Model, anyio_backend: str, http: str) -> None:
    """SIGTERM's shutdown on each HTTP server: a request in flight finishes with 200, a request on a
    new connection meanwhile gets 503 (the listener stays open while draining), /health says 503,
    then the server stops by itself."""
    skip_unless_serves(http, anyio_backend)
    gate, blocker = blocking_graph()
    rt = hetero.Runtime(cpu_threads=1)  # one CPU worker: the blocker holds it, so the batch waits
    try:
        server = EmbeddingServer(tiny, runtime=rt, max_in_flight=1, precapture=False)
        status: dict[str, int] = {}
        with anyio.fail_after(90):
            async with anyio.create_task_group() as outer:
                async with served(server, http) as url, httpx.AsyncClient(base_url=url) as c:
                    while (await c.get("/health")).status_code != 200:
                        await anyio.sleep(0.02)

                    async def first() -> None:
                        status["first"] = (await c.post("/v1/embeddings", json={"input": "first"})).status_code

                    outer.start_soon(lambda: rt.run(blocker, x=1))
                    await anyio.sleep(0.05)
                    outer.start_soon(first)
                    while server.active < 1:
                        await anyio.sleep(0.005)
                    server.shutdown()  # what SIGTERM and Ctrl-C do
                    async with httpx.AsyncClient(base_url=url) as fresh:  # a new connection
                        r = await fresh.post("/v1/embeddings", json={"input": "second"})
                        assert r.status_code == 503 and r.headers["retry-after"] == "1"
                        assert "shutting down" in r.json()["error"]["message"]
                        assert (await fresh.get("/health")).status_code == 503
                    gate.set()
                    while "first" not in status:
                        await anyio.sleep(0.005)
        assert status == {"first": 200}
    finally:
        gate.set()
        rt.close()


@pytest.fixture(params=HTTP)
def http(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.mark.anyio
async def test_served_over_a_real_socket(tiny: Model, shared_rt: hetero.Runtime, anyio_backend: str,
                                         http: str) -> None:
    import gc

    skip_unless_serves(http, anyio_backend)
    server = EmbeddingServer(tiny, runtime=shared_rt, auto_truncate=True, max_batch_tokens=48,
                             precapture=True)  # 5 padded shapes captured at warm-up
    urls: list[str] = []
    assert gc.get_freeze_count() == 0
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: serve_async(server, "127.0.0.1", 0, http=http, ready=urls.append, signals=False,
                                              graceful_timeout=5, freeze_heap=True))
            while not urls:
                await anyio.sleep(0.01)
            async with httpx.AsyncClient(base_url=urls[0]) as c:
                while (await c.get("/health")).status_code != 200:
                    await anyio.sleep(0.02)
                while not gc.get_freeze_count():  # the heap is frozen once warm-up is over
                    await anyio.sleep(0.01)
                gc.unfreeze()  # (this process is the tests', not the server's)
                r = await c.post("/v1/embeddings", json={"input": TEXTS[:3]})
                assert r.status_code == 200
                vecs = np.array([d["embedding"] for d in r.json()["data"]], np.float32)
            np.testing.assert_allclose(vecs, await aembed(TEXTS[:3], model=tiny, runtime=shared_rt), atol=1e-5)
            # bench serve's raw load client: two requests and an error on one keep-alive connection
            host, port = urls[0].split("//", 1)[1].rsplit(":", 1)
            raw = RawClient(host, int(port))
            try:
                for text in TEXTS[3:5]:
                    status, body = await raw.post(raw_request(host, text))
                    assert status == 200
                    check_embedding(body)
                    vec = np.frombuffer(base64.b64decode(json.loads(body)["data"][0]["embedding"]), "<f4")
                    np.testing.assert_allclose(vec, (await aembed([text], model=tiny, runtime=shared_rt))[0],
                                               atol=1e-5)
                status, body = await raw.post(b"POST /v1/embeddings HTTP/1.1\r\nhost: t\r\n"
                                              b"content-length: 2\r\n\r\n{}")
                assert status == 400 and json.loads(body)["error"]["message"]
                with pytest.raises(ValueError, match="not one base64 embedding"):
                    check_embedding(body.replace(b'"error"', b'"data"'))
            finally:
                await raw.aclose()
            server.shutdown()
    assert server.draining


def test_serve_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["serve", "--help"]) == 0
    assert "/v1/embeddings" in capsys.readouterr().out
    assert cli_main(["serve", "--model", "minilm", "--port", "70000"]) == 2
    assert cli_main(["serve", "--model", str(tmp_path / "missing")]) == 1
    assert "hetero: error:" in capsys.readouterr().err
    d = write_random_model(tmp_path / "m", seed=4, **TINY)
    assert cli_main(["serve", "--model", str(d), "--max-batch-tokens", "8"]) == 1
    assert "max_seq_length" in capsys.readouterr().err


def test_backends_resolve_and_uvloop_runs_the_loop(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """``--backend auto`` is uvloop where installed; ``run_on`` runs on the loop named; a backend
    that cannot run is refused before anything starts."""
    import asyncio
    import importlib.util

    from hetero.pipelines.serve import resolve_backend, run_on

    pytest.importorskip("uvloop")
    assert resolve_backend("auto") == "uvloop"
    assert [resolve_backend(b) for b in ("asyncio", "uvloop", "trio")] == ["asyncio", "uvloop", "trio"]

    async def loop_kind() -> str:
        from hetero.lowlevel import running_loop

        return "trio" if running_loop() == "trio" else type(asyncio.get_running_loop()).__module__

    assert run_on("uvloop", loop_kind).startswith("uvloop")
    assert run_on("asyncio", loop_kind).startswith("asyncio")
    assert run_on("trio", loop_kind) == "trio"
    with pytest.raises(hetero.HeteroError, match="one of auto, asyncio, uvloop, trio; got 'tornado'"):
        resolve_backend("tornado")

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvloop" else real(name, *a))
    assert resolve_backend("auto") == "asyncio"
    with pytest.raises(hetero.HeteroError, match="needs uvloop, which is not installed"):
        resolve_backend("uvloop")
    assert cli_main(["serve", "--model", "minilm", "--backend", "uvloop"]) == 1  # before the model loads
    assert "needs uvloop" in capsys.readouterr().err


def test_worker_processes_and_sigterm(tmp_path: Path, shared_rt: hetero.Runtime, http: str) -> None:
    """``hetero serve --workers 3 --engines 2`` in a subprocess: every front serves embed()'s vectors
    (two of them through one engine, the third through the other), /metrics sums the fronts'
    requests and the engines' batches, SIGTERM stops all."""
    from hetero.pipelines.embed import embed

    import os
    import signal
    import socket
    import subprocess
    import sys
    import time

    d = write_random_model(tmp_path / "m", seed=5, **TINY)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "hetero", "serve", "--model", str(d), "--port", str(port),
                             "--workers", "3", "--engines", "2", "--max-batch-tokens", "256", "--no-precapture",
                             "--max-in-flight", "3", "--backend", "uvloop", "--max-wait", "0.5", "--http", http,
                             "--auto-truncate"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    try:
        deadline = time.monotonic() + 120
        pids: set[int] = set()
        while len(pids) < 3:  # every front's engine warmed up (new connections land on any front)
            assert time.monotonic() < deadline and proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    info = httpx.get(url + "/info", timeout=5).json()
                    assert info["max_batches_in_flight"] == 3 and info["max_wait_ms"] == 0.5
                    assert info["http_server"] == http
                    pids.add(info["worker_pid"])
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        ref = embed(TEXTS[:2], model=str(d), runtime=shared_rt)
        for _ in range(8):  # new connections: spread over the fronts
            r = httpx.post(url + "/v1/embeddings", json={"input": TEXTS[:2]}, timeout=30)
            assert r.status_code == 200, r.text
            got = np.array([row["embedding"] for row in r.json()["data"]], np.float32)
            np.testing.assert_allclose(got, ref, atol=1e-5)
        metrics = httpx.get(url + "/metrics", timeout=10).text
        ok = re_float(metrics, r'^hetero_embed_requests_total\{code="200"\} (\S+)$')
        assert ok >= 8  # the sum over both workers
        assert re_float(metrics, r"^hetero_embed_inputs_total (\S+)$") >= 16
        # The engine process formed the batches: every sentence served went through one.
        assert re_float(metrics, r"^hetero_embed_batch_size_sum (\S+)$") >= 16
        assert re_float(metrics, r"^hetero_embed_batches_total (\S+)$") >= 1
        assert re_float(metrics, r"^hetero_embed_batch_duration_seconds_count (\S+)$") == \
            re_float(metrics, r"^hetero_embed_batches_total (\S+)$")  # each batch that formed also ended
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        log.seek(0)
        out = log.read()
        assert "hetero serve: stopped" in out and "Traceback" not in out, out
        assert f"({http} on uvloop, 3 front processes and 2 engine processes)" in out, out
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the server and its workers, if anything is left
        except ProcessLookupError:
            pass
        proc.wait()
        log.close()


def test_the_engine_dying_stops_the_server_with_status_1(tmp_path: Path, http: str) -> None:
    """The engine process of ``hetero serve --workers 2`` is killed: whatever the fronts still answer is
    503, the supervisor names the process, stops the fronts and exits with status 1."""
    import os
    import signal
    import subprocess
    import sys
    import time

    psutil = pytest.importorskip("psutil")
    if http == "granian":
        pytest.importorskip("granian")
    d = write_random_model(tmp_path / "m", seed=5, **TINY)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "hetero", "serve", "--model", str(d), "--port", str(port),
                             "--workers", "2", "--max-batch-tokens", "256", "--no-precapture", "--http", http],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    try:
        fronts: set[int] = set()
        for _ in range(2400):  # a hang guard: about two minutes of polls
            if len(fronts) == 2:
                break
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    fronts.add(httpx.get(url + "/info", timeout=5).json()["worker_pid"])
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        assert len(fronts) == 2, (tmp_path / "serve.log").read_text()
        children = [c for c in psutil.Process(proc.pid).children()
                    if c.pid not in fronts and "resource_tracker" not in " ".join(c.cmdline())]
        assert len(children) == 1, children
        os.kill(children[0].pid, signal.SIGKILL)
        codes = []
        while True:
            try:
                codes.append(httpx.post(url + "/v1/embeddings", json={"input": "a"}, timeout=10).status_code)
            except httpx.HTTPError:
                break  # the fronts have stopped
            time.sleep(0.01)
        assert set(codes) <= {503}, codes
        assert proc.wait(timeout=60) == 1
        log.seek(0)
        out = log.read()
        assert "hetero serve: hetero-serve-engine exited with status -9; stopping the others" in out, out
        assert "hetero serve: stopped" in out
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        log.close()


def test_engines_need_as_many_workers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hetero.pipelines.serve import serve_workers

    with pytest.raises(hetero.HeteroError, match=r"^--engines must be an integer from 1 to --workers \(2\), got 3"):
        serve_workers({}, "127.0.0.1", 0, "asyncio", 2, engines=3)
    d = write_random_model(tmp_path / "m", seed=8, **TINY)
    assert cli_main(["serve", "--model", str(d), "--workers", "2", "--engines", "3"]) == 1
    assert "--engines must be an integer from 1 to --workers (2), got 3" in capsys.readouterr().err


def test_workers_on_a_taken_port_leave_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A port that cannot be bound fails before any worker starts, and leaves neither the
    metrics directory nor PROMETHEUS_MULTIPROC_DIR behind."""
    import os
    import socket
    import tempfile

    from hetero.pipelines.serve import serve_workers

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(hetero.HeteroError, match=f"^cannot listen on 127.0.0.1:{port}"):
            serve_workers({}, "127.0.0.1", port, "asyncio", 2)
    finally:
        taken.close()
    assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ
    assert list(tmp_path.iterdir()) == []


def test_a_worker_that_cannot_start_stops_those_started(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second of three workers fails to start (the OS refuses the process): the engine and the
    first worker, already started, are stopped, the third never starts, and the error names the
    worker and the cause."""
    import multiprocessing
    import os
    import tempfile
    from multiprocessing.context import SpawnProcess

    from hetero.pipelines.serve import serve_workers

    d = write_random_model(tmp_path / "m", seed=6, **TINY)
    real_start = SpawnProcess.start
    tried: list[str] = []

    def start(self: SpawnProcess) -> None:
        tried.append(self.name)
        if self.name == "hetero-serve-1":
            raise OSError(12, "Cannot allocate memory")
        real_start(self)

    monkeypatch.setattr(SpawnProcess, "start", start)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    try:
        with pytest.raises(hetero.HeteroError, match=r"^cannot start worker process hetero-serve-1 \(2 of 3\): "
                           r"OSError: \[Errno 12\] Cannot allocate memory; stopped the engine and the 1 worker "
                           r"started before it$"):
            serve_workers(dict(model=str(d), max_batch_tokens=256, precapture=False), "127.0.0.1", 0, "asyncio", 3)
        assert tried == ["hetero-serve-engine", "hetero-serve-0", "hetero-serve-1"]
        assert [p.name for p in multiprocessing.active_children() if p.name.startswith("hetero-serve-")] == []
    finally:
        for p in multiprocessing.active_children():  # what a failure above left running
            if p.name.startswith("hetero-serve-"):
                p.kill()
                p.join()
    assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ
    assert list((tmp_path / "tmp").iterdir()) == []


def re_float(text: str, pattern: str) -> float:
    import re

    m = re.search(pattern, text, re.M)
    assert m is not None, pattern
    return float(m.group(1))


# -- the engine process's link: an engine and its fronts over real loopback TCP, in process --------------
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


def _count_embed_frames(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The sentence counts of each EMBED frame the engine parses from now on, in arrival order."""
    import hetero.pipelines.serve_engine as link_mod

    frames: list[list[int]] = []
    parse = link_mod._parse_embed

    def counting(body: bytes) -> tuple[list[int], list[int], list[np.ndarray]]:
        rids, counts, ids = parse(body)
        frames.append(counts)
        return rids, counts, ids

    monkeypatch.setattr(link_mod, "_parse_embed", counting)
    return frames


@pytest.mark.anyio
async def test_the_requests_of_one_pass_travel_as_one_frame(tiny: Model, shared_rt: hetero.Runtime, sock_path: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests made in one pass of a front's event loop reach the engine as one EMBED frame, which
    the engine admits to the batcher in one call; an empty request is answered at once."""
    frames = _count_embed_frames(monkeypatch)
    engine = EmbeddingEngine(tiny, runtime=shared_rt, max_batch_tokens=256, precapture=False)
    requests = [TEXTS[:2], [], TEXTS[2:3], TEXTS[1:4], TEXTS[4:5]]
    got: dict[int, np.ndarray] = {}
    async with engine_serving(engine, sock_path):
        front = EngineClient(sock_path, SECRET)
        async with front.running():
            await ready(front)
            ids = [token_ids(tiny, r) for r in requests]

            async def one(i: int) -> None:
                got[i] = await front.embed_ids(ids[i])  # each sends before its first await

            async with anyio.create_task_group() as tg:
                for i in range(len(requests)):
                    tg.start_soon(one, i)
    assert len(frames) == 1 and sorted(frames[0]) == [0, 1, 1, 2, 3]  # (trio starts tasks in any order)
    ref = {t: row for t, row in zip(TEXTS, await aembed(TEXTS, model=tiny, runtime=shared_rt))}
    for i, texts in enumerate(requests):
        assert got[i].shape == (len(texts), tiny.dim)
        if texts:
            np.testing.assert_allclose(got[i], np.stack([ref[t] for t in texts]), atol=1e-5)


@pytest.mark.anyio
async def test_a_failed_batch_fails_each_of_its_requests_through_the_link(
        tiny: Model, shared_rt: hetero.Runtime, sock_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = EmbeddingEngine(tiny, runtime=shared_rt, max_batch_tokens=256, precapture=False)
    async with engine_serving(engine, sock_path):
        front = EngineClient(sock_path, SECRET)
        async with front.running():
            await ready(front)

            async def failing_run(graph: hetero.Graph, **inputs: Any) -> Any:
                raise hetero.HeteroError("stage 'encoder0' failed: out of memory")

            monkeypatch.setattr(shared_rt, "run", failing_run)
            outcomes: dict[int, object] = {}
            requests = [TEXTS[:2], [], TEXTS[2:3]]

            async def one(i: int) -> None:
                try:
                    outcomes[i] = await front.embed_ids(token_ids(tiny, requests[i]))
                except EngineError as e:
                    outcomes[i] = e

            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    for i in range(len(requests)):
                        tg.start_soon(one, i)
            monkeypatch.undo()
            for i in (0, 2):
                e = outcomes[i]
                assert isinstance(e, EngineError) and e.status == 500 and e.code == "internal_error"
                assert "stage 'encoder0' failed: out of memory" in e.message
            empty = outcomes[1]
            assert isinstance(empty, np.ndarray) and empty.shape == (0, tiny.dim)
            rows = await front.embed_ids(token_ids(tiny, TEXTS[:1]))  # the engine serves on
            assert rows.shape == (1, tiny.dim)
    assert engine.queued == 0


@pytest.mark.anyio
async def test_a_front_splits_what_it_gathered_past_the_frame_size(tiny: Model, shared_rt: hetero.Runtime,
                                                                   sock_path: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import hetero.pipelines.serve_engine as link_mod

    frames = _count_embed_frames(monkeypatch)
    monkeypatch.setattr(link_mod, "_GATHER_BYTES", 1)  # every request fills a frame
    engine = EmbeddingEngine(tiny, runtime=shared_rt, max_batch_tokens=256, precapture=False)
    got: dict[int, np.ndarray] = {}
    async with engine_serving(engine, sock_path):
        front = EngineClient(sock_path, SECRET)
        async with front.running():
            await ready(front)
            ids = [token_ids(tiny, [t]) for t in TEXTS[:3]]

            async def one(i: int) -> None:
                got[i] = await front.embed_ids(ids[i])

            async with anyio.create_task_group() as tg:
                for i in range(3):
                    tg.start_soon(one, i)
    assert frames == [[1], [1], [1]]
    ref = await aembed(TEXTS[:3], model=tiny, runtime=shared_rt)
    for i in range(3):
        np.testing.assert_allclose(got[i][0], ref[i], atol=1e-5)


def test_link_frames_round_trip_and_refuse_what_does_not_add_up() -> None:
    from hetero.pipelines.serve_engine import _embed_parts, _parse_embed, _parse_result

    sent = [(7, [np.array([101, 5, 102], np.int32)]), (9, []),
            (2**40, [np.array([101, 102], np.int32), np.array([101, 8, 9, 102], np.int32)])]
    body = b"".join(_embed_parts(sent))
    rids, counts, ids = _parse_embed(body)
    assert rids == [7, 9, 2**40] and counts == [1, 0, 2]
    assert [x.tolist() for x in ids] == [[101, 5, 102], [101, 102], [101, 8, 9, 102]]
    with pytest.raises(hetero.HeteroError, match="do not add up"):
        _parse_embed(body[:-4])  # a token id short
    with pytest.raises(hetero.HeteroError, match="does not fit"):
        _parse_embed(body[:12])
    with pytest.raises(hetero.HeteroError, match="shorter than its counts"):
        _parse_embed(body[:4])
    rows = np.arange(12, dtype=np.float32).reshape(3, 4)
    result = struct.pack("<II", 2, 4) + np.array([5, 6], np.uint64).tobytes() + \
        np.array([1, 2], np.uint32).tobytes() + rows.tobytes()
    (a, ra), (b, rb) = _parse_result(result)
    assert (a, b) == (5, 6) and ra.tolist() == rows[:1].tolist() and rb.tolist() == rows[1:].tolist()


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


def test_the_http_floor_serves_from_several_processes_on_one_port() -> None:
    """bench serve --floor: hypercorn processes sharing a port answer the load processes' requests."""
    import time

    from bench.serve import floor_processes, free_port, level_figures, load_process, stop_floor

    port = free_port()
    procs = floor_processes(port, "asyncio", 2)
    try:
        assert all(p.is_alive() for p in procs)
        rows, _ = load_process(f"http://127.0.0.1:{port}", ["a sentence"], 4, 200.0, 1.0, time.time() + 0.2, 1,
                               10.0, "raw")
    finally:
        stop_floor(procs)
    assert not any(p.is_alive() for p in procs)
    figures = level_figures(rows, 0.0, 1000.0, 0.01)
    assert figures["requests"] == figures["ok"] == len(rows) > 0 and figures["failed"] == figures["n_429"] == 0


_FRONT_TOKENIZE = """
import os, sys
from hetero.pipelines.embed_tokens import encodings
from hetero.pipelines.embed_weights import get_model
from hetero.pipelines.serve_procs import front_environment

front_environment()
model = get_model(sys.argv[1])
before = len(os.listdir("/proc/self/task"))
for _ in range(20):
    encodings(model, ["The quick brown fox.", "jumps over", "the lazy dog", "again and again"])
print(os.environ["TOKENIZERS_PARALLELISM"], before, len(os.listdir("/proc/self/task")))
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
@pytest.mark.parametrize("user_value", [None, "true"])
def test_fronts_tokenize_without_a_thread_pool(tmp_path: Path, user_value: str | None) -> None:
    """A front process tokenizes several texts on its own thread: the tokenizers package starts no
    thread pool there (many fronts' pools would wait for cores). A value the user set is kept,
    and then the pool starts (so this test sees one where there is one)."""
    import os
    import subprocess
    import sys

    d = write_random_model(tmp_path / "m", seed=5, **TINY)
    env = {k: v for k, v in os.environ.items() if k != "TOKENIZERS_PARALLELISM"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)
    if user_value is not None:
        env["TOKENIZERS_PARALLELISM"] = user_value
    out = subprocess.run([sys.executable, "-c", _FRONT_TOKENIZE, str(d)], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    value, before, after = out.stdout.split()
    if user_value is None:
        assert (value, int(after)) == ("false", int(before))
    else:
        assert value == "true" and int(after) > int(before)


# -- hostile and careless requests ---------------------------------------------------------------------------
@pytest.mark.anyio
async def test_limits_names_keys_and_dimensions(tiny: Model, shared_rt: hetero.Runtime) -> None:
    """413 past the body limit and past the model's longest input (unless truncating), 400 for a
    lone surrogate and bad dimensions, 404 for a model the server does not serve, /v1/models."""
    server = EmbeddingServer(tiny, runtime=shared_rt, precapture=False, max_request_bytes=4096,
                             served_model_names=("tiny", "alias"))
    long_text = " ".join(["word"] * 60)  # the tiny model takes 24 tokens
    async with client(server) as c, server.running():
        await server.wait_ready()
        r = await c.post("/v1/embeddings", content=b'{"input": "' + b"a" * 5000 + b'"}')
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert r.json()["error"]["message"] == ("the request body has 5013 bytes, more than this server's "
                                                "max_request_bytes of 4096; split the request")
        r = await c.post("/v1/embeddings", json={"input": ["ok", long_text]})
        err = r.json()["error"]
        assert r.status_code == 413 and err["code"] == "input_too_long" and err["param"] == "input"
        assert err["message"].startswith("'input[1]' has 242 tokens, more than the model's maximum of 24; shorten it, or send \"truncate\": true")
        r = await c.post("/v1/embeddings", json={"input": ["ok", long_text], "truncate": True})
        assert r.status_code == 200
        cut = np.array(r.json()["data"][1]["embedding"], np.float32)
        np.testing.assert_allclose(cut, (await aembed([long_text], model=tiny, runtime=shared_rt))[0], atol=1e-5)
        r = await c.post("/v1/embeddings", content=b'{"input": ["ok", "\\ud800 x"]}')
        assert r.status_code == 400
        assert r.json()["error"]["message"] == "'input[1]' is not valid Unicode text: a lone surrogate '\\ud800' " \
                                               "at character 0"
        models = (await c.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["tiny", "alias"] and models["object"] == "list"
        assert (await c.post("/v1/embeddings", json={"input": "a", "model": "alias"})).status_code == 200
        r = await c.post("/v1/embeddings", json={"input": "a", "model": "gpt-4"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        full = np.array((await c.post("/v1/embeddings", json={"input": "hi there"})).json()["data"][0]["embedding"])
        r = await c.post("/v1/embeddings", json={"input": "hi there", "dimensions": 5})
        short = np.array(r.json()["data"][0]["embedding"])
        np.testing.assert_allclose(short, full[:5] / np.linalg.norm(full[:5]), atol=1e-6)
        for bad in (0, tiny.dim + 1, "5", 2.5, True):
            r = await c.post("/v1/embeddings", json={"input": "a", "dimensions": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions", bad
    auto = EmbeddingServer(tiny, runtime=shared_rt, precapture=False, auto_truncate=True)
    async with client(auto) as c, auto.running():
        await auto.wait_ready()
        assert (await c.post("/v1/embeddings", json={"input": long_text})).status_code == 200


@pytest.mark.anyio
async def test_api_key_and_500s_with_a_request_id(tiny: Model, shared_rt: hetero.Runtime,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    server = EmbeddingServer(tiny, runtime=shared_rt, precapture=False, api_key="sesame")
    assert "sesame" not in repr(server.settings)
    async with client(server) as c, server.running():
        await server.wait_ready()
        assert (await c.get("/health")).status_code == 200  # open to load balancers
        for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "sesame"}):
            r = await c.get("/info", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", headers
        ok = {"authorization": "Bearer sesame"}
        assert (await c.post("/v1/embeddings", json={"input": "a"}, headers=ok)).status_code == 200

        async def broken(ids: Any) -> Any:
            raise RuntimeError("a bug")

        server.backend.embed_ids = broken  # type: ignore[method-assign]
        r = await c.post("/v1/embeddings", json={"input": "a"}, headers=ok)
        assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
        rid = r.headers["x-request-id"]
        assert rid in r.json()["error"]["message"]
        assert any(rid in rec.getMessage() and rec.exc_info for rec in caplog.records)


def raw_answer(port: int, head: bytes, body_parts: Any) -> tuple[int, bytes]:
    """Send ``head`` then the parts of a body over one connection, as long as the server reads;
    the status and body of its answer."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head)
        try:
            for part in body_parts:
                sock.sendall(part)
        except OSError:
            pass  # the server answered and closed before the body ended
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        header, _, rest = data.partition(b"\r\n\r\n")
        status = int(header.split(b" ", 2)[1])
        length = int(next(line.split(b":", 1)[1] for line in header.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        while len(rest) < length:
            chunk = sock.recv(65536)
            if not chunk:
                break
            rest += chunk
        return status, rest


@pytest.mark.anyio
async def test_oversized_bodies_are_refused_over_a_real_socket(tiny: Model, shared_rt: hetero.Runtime,
                                                               anyio_backend: str, http: str) -> None:
    """A Content-Length past --max-request-bytes gets 413 before the body is read; a chunked body is
    cut off at the limit; the server answers the next request as usual."""
    skip_unless_serves(http, anyio_backend)
    server = EmbeddingServer(tiny, runtime=shared_rt, precapture=False, max_request_bytes=65536)
    async with served(server, http) as url, httpx.AsyncClient(base_url=url) as c:
        with anyio.fail_after(60):
            while (await c.get("/health")).status_code != 200:
                await anyio.sleep(0.02)
        port = int(url.rsplit(":", 1)[1])
        head = b"POST /v1/embeddings HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
        status, body = await anyio.to_thread.run_sync(
            raw_answer, port, head + b"content-length: 50000000\r\n\r\n", [b'{"input": "' + b"a" * 65536])
        assert status == 413 and b"50000000 bytes" in body
        chunk = b"%x\r\n%s\r\n" % (16384, b"a" * 16384)
        status, body = await anyio.to_thread.run_sync(
            raw_answer, port, head + b"transfer-encoding: chunked\r\n\r\n", [b"b\r\n{\"input\": \"\r\n"] + [chunk] * 64)
        assert status == 413 and b"more than 65536 bytes" in body
        assert (await c.post("/v1/embeddings", json={"input": "a"})).status_code == 200
