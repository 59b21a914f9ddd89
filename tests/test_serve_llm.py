"""``hetero serve`` for text generation: OpenAI's chat and completions endpoints, SSE, disconnects, errors.

A tiny random llama model (tests/llm_fixtures.py) with a 1 MiB KV cache, one LLM for the
module; each test serves it with a GenerationServer of its own. Its end-of-sequence id is
taken away, so that every generation runs to its ``max_tokens`` (counts are exact).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from llm_fixtures import write_tiny_gguf, write_tiny_hf_dir  # noqa: E402

import hetero  # noqa: E402
from hetero._cli import main as cli_main  # noqa: E402
from hetero.pipelines import LLM  # noqa: E402
from hetero.pipelines.llm_model import load_model  # noqa: E402
from hetero.pipelines.testing import write_random_model  # noqa: E402

httpx = pytest.importorskip("httpx")
pytest.importorskip("hypercorn")
pytest.importorskip("prometheus_client")

from hetero.pipelines.serve import GenerationServer, model_kind, serve_async  # noqa: E402

KV = 1 << 20  # 127 blocks of 16 tokens for the tiny model
HTTP = ["granian", "hypercorn"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("serve-llm") / "tiny.gguf", "llama", "f32")


@pytest.fixture(scope="module")
def llm(gguf: Path, shared_rt: hetero.Runtime) -> Any:
    model = load_model(gguf)
    model.config = dataclasses.replace(model.config, eos_token_ids=())  # every generation runs to max_tokens
    with LLM(model, runtime=shared_rt, kv_cache_bytes=KV) as llm:
        yield llm


@pytest.fixture(params=HTTP)
def http(request: pytest.FixtureRequest) -> str:
    return request.param


def skip_unless_serves(http: str, anyio_backend: str) -> None:
    if http == "granian":
        pytest.importorskip("granian")
        if anyio_backend == "trio":
            pytest.skip("granian runs on asyncio only")


def idle(llm: LLM) -> bool:
    st = llm.stats()
    return st.running == 0 and st.waiting == 0 and st.kv_blocks_used == 0


@asynccontextmanager
async def served(server: GenerationServer, http: str) -> AsyncIterator[str]:
    """``server`` behind ``http`` on an ephemeral port, warmed up: yields its URL."""
    urls: list[str] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: serve_async(server, "127.0.0.1", 0, http=http, ready=urls.append, signals=False,
                                          graceful_timeout=10))
        with anyio.fail_after(60):
            while not urls:
                await anyio.sleep(0.01)
            await server.wait_ready()
        assert server.ready, server.warmup_error
        yield urls[0]
        server.shutdown()


def asgi(server: GenerationServer) -> Any:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app), base_url="http://t")


def sse_events(raw: bytes) -> list[str]:
    """The ``data:`` payloads of a server-sent event stream, checking its framing on the way."""
    assert raw.endswith(b"\n\n"), raw[-80:]
    blocks = raw.decode("utf-8").split("\n\n")
    assert blocks[-1] == ""
    out = []
    for block in blocks[:-1]:
        assert block.startswith("data: ") and "\n" not in block, block
        out.append(block[len("data: "):])
    return out


def metric(text: str, line: str) -> float:
    m = re.search(rf"^{re.escape(line)} (\S+)$", text, re.M)
    assert m is not None, f"{line} not in the metrics"
    return float(m.group(1))


def test_model_kind(gguf: Path, tmp_path: Path) -> None:
    assert model_kind(gguf) == model_kind("smollm2") == "generation"
    assert model_kind(write_tiny_hf_dir(tmp_path / "qwen", "qwen2")) == "generation"
    assert model_kind(write_random_model(tmp_path / "bert", vocab_size=200, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2)) == "embedding"
    assert model_kind("minilm") == model_kind(tmp_path / "missing") == "embedding"


@pytest.mark.anyio
async def test_the_openai_client_over_a_real_socket(llm: LLM, anyio_backend: str, http: str) -> None:
    """The official client, streaming and not, chat and completions: greedy text equals the LLM's own,
    the stream's deltas add up to it (role first, finish_reason last, usage when asked)."""
    openai = pytest.importorskip("openai")
    skip_unless_serves(http, anyio_backend)
    server = GenerationServer(llm, model_name="tiny")
    chat_ids = llm.model.chat_ids(CHAT)
    want_chat = await llm.agenerate(chat_ids, max_tokens=8)
    want_text = await llm.agenerate("The quick brown fox", max_tokens=6)
    async with served(server, http) as url:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
            assert [m.id for m in (await client.models.list()).data] == ["tiny"]
            r = await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=0)
            assert r.object == "chat.completion" and r.model == "tiny" and r.id.startswith("chatcmpl-")
            assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "length"
            assert r.choices[0].message.content == want_chat.text
            assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(chat_ids), 8)

            chunks = [c async for c in await client.chat.completions.create(
                model="tiny", messages=CHAT, max_completion_tokens=8, temperature=0, stream=True,
                stream_options={"include_usage": True})]
            assert chunks[0].choices[0].delta.role == "assistant"
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want_chat.text
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
            assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
            assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
            assert chunks[-1].usage.total_tokens == len(chat_ids) + 8
            assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)

            c = await client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=6,
                                                temperature=0)
            assert c.object == "text_completion" and c.choices[0].text == want_text.text
            assert c.usage.completion_tokens == 6
            ids = llm.encode("The quick brown fox")
            streamed = [x async for x in await client.completions.create(
                model="tiny", prompt=ids, max_tokens=6, temperature=0, stream=True)]
            assert "".join(x.choices[0].text for x in streamed) == want_text.text
            assert streamed[-1].choices[0].finish_reason == "length" and streamed[-1].usage is None

            sampled = [await client.completions.create(model="tiny", prompt="A", max_tokens=6, temperature=0.9,
                                                       seed=7) for _ in range(2)]
            assert sampled[0].choices[0].text == sampled[1].choices[0].text  # a seed repeats its draw
            assert sampled[0].choices[0].text == (await llm.agenerate("A", max_tokens=6, temperature=0.9,
                                                                      seed=7)).text

            with pytest.raises(openai.NotFoundError) as e:
                await client.chat.completions.create(model="other", messages=CHAT, max_tokens=2)
            assert e.value.code == "model_not_found"
            with pytest.raises(openai.BadRequestError) as e:
                await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, n=2)
            assert e.value.param == "n"

        # the framing itself, as bytes off the socket
        async with httpx.AsyncClient(base_url=url) as raw:
            async with raw.stream("POST", "/v1/chat/completions", json={
                    "model": "tiny", "messages": CHAT, "max_tokens": 4, "temperature": 0, "stream": True}) as resp:
                assert resp.status_code == 200
                assert resp.headers["content-type"].startswith("text/event-stream")
                assert "content-length" not in resp.headers
                body = b"".join([part async for part in resp.aiter_raw()])
        events = sse_events(body)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
        assert "usage" not in chunks[0]
    assert idle(llm)


async def open_stream(port: int, body: dict[str, Any], path: str = "/v1/chat/completions") -> Any:
    """A raw connection that sent ``body`` to ``path``; the stream (still open)."""
    data = json.dumps(body).encode()
    s = await anyio.connect_tcp("127.0.0.1", port)
    await s.send(b"POST %s HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                 % (path.encode(), len(data), data))
    return s


@pytest.mark.anyio
async def test_a_client_that_disconnects_cancels_its_sequence(llm: LLM, anyio_backend: str, http: str) -> None:
    """A streaming client that hangs up after its first tokens, and one that hangs up while waiting for
    a whole answer: their sequences stop well before max_tokens and free their KV blocks (499)."""
    skip_unless_serves(http, anyio_backend)
    server = GenerationServer(llm)
    most = 200
    async with served(server, http) as url:
        port = int(url.rsplit(":", 1)[1])
        before = llm.stats().tokens_generated
        s = await open_stream(port, {"messages": CHAT, "max_tokens": most, "stream": True, "temperature": 0})
        got = b""
        with anyio.fail_after(30):
            while got.count(b"data: ") < 3:  # the role chunk and two with content
                got += await s.receive()
        assert got.startswith(b"HTTP/1.1 200") and llm.stats().running == 1
        await s.aclose()
        with anyio.fail_after(30):
            while not idle(llm):
                await anyio.sleep(0.01)
        assert llm.stats().tokens_generated - before < most // 2

        before = llm.stats().tokens_generated
        s = await open_stream(port, {"prompt": "A", "max_tokens": most, "temperature": 0}, "/v1/completions")
        with anyio.fail_after(30):
            while llm.stats().tokens_generated - before < 2:  # decoding has begun
                await anyio.sleep(0.005)
        await s.aclose()
        with anyio.fail_after(30):
            while not idle(llm) or server.active:
                await anyio.sleep(0.01)
        assert llm.stats().tokens_generated - before < most // 2
        async with httpx.AsyncClient(base_url=url) as c:
            metrics = (await c.get("/metrics")).text
            r = await c.post("/v1/completions", json={"prompt": "A", "max_tokens": 3})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3  # it serves on
    assert metric(metrics, 'hetero_generate_requests_total{code="499"}') == 2
    assert idle(llm)


@pytest.mark.anyio
async def test_errors_keep_the_openai_shape(llm: LLM) -> None:
    """400 naming the parameter, 404, 405, 413, 503 while warming up and while shutting down: each an
    OpenAI error object; nothing is left running."""
    server = GenerationServer(llm, max_request_bytes=4096, served_model_names=("tiny", "alias"))
    long_prompt = list(range(3, 3 + llm.max_seq_len))
    cases: list[tuple[str, dict[str, Any], int, str | None, str]] = [
        ("chat", {"messages": CHAT, "n": 2}, 400, "n", "'n' must be 1"),
        ("chat", {"messages": CHAT, "temperature": 3}, 400, "temperature", "in [0, 2]"),
        ("chat", {"messages": CHAT, "top_p": 0}, 400, "top_p", "in (0, 1]"),
        ("chat", {"messages": CHAT, "max_tokens": 0}, 400, "max_tokens", "positive integer"),
        ("chat", {"messages": CHAT, "max_completion_tokens": "8"}, 400, "max_completion_tokens", "positive"),
        ("chat", {"messages": CHAT, "max_tokens": 10_000}, 400, "max_tokens", "at most"),
        ("chat", {"messages": CHAT, "stop": [""]}, 400, "stop", "non-empty"),
        ("chat", {"messages": CHAT, "stop": 5}, 400, "stop", "a string or a list"),
        ("chat", {"messages": CHAT, "seed": 1.5}, 400, "seed", "integer"),
        ("chat", {"messages": CHAT, "logprobs": True}, 400, "logprobs", "not supported"),
        ("chat", {"messages": CHAT, "stream": "yes"}, 400, "stream", "true or false"),
        ("chat", {"messages": CHAT, "stream_options": {"include_usage": True}}, 400, "stream_options", "only with"),
        ("chat", {"messages": []}, 400, "messages", "non-empty list"),
        ("chat", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages", "role"),
        ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages", "text"),
        ("chat", {"messages": CHAT, "model": 5}, 400, "model", "must be a string"),
        ("chat", {"messages": CHAT, "model": "gpt-4"}, 404, "model", "does not exist"),
        ("text", {}, 400, "prompt", "required"),
        ("text", {"prompt": ["a", "b"]}, 400, "prompt", "one per request"),
        ("text", {"prompt": [1, 10 ** 6]}, 400, "prompt", "outside this model's vocabulary"),
        ("text", {"prompt": 3}, 400, "prompt", "a string or"),
        ("text", {"prompt": long_prompt}, 400, "prompt", "max_seq_len"),
        ("text", {"prompt": "x" * 5000}, 413, None, "max_request_bytes"),
    ]
    async with asgi(server) as c:
        cold = await c.post("/v1/chat/completions", json={"messages": CHAT})
        assert cold.status_code == 503 and cold.headers["retry-after"] == "1"
        assert cold.json()["error"]["code"] == "unavailable"
        async with server.running():
            await server.wait_ready()
            for kind, body, status, param, words in cases:
                path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
                r = await c.post(path, json=body)
                err = r.json()["error"]
                assert (r.status_code, err["param"]) == (status, param), (body, r.text)
                assert words in err["message"] and set(err) == {"message", "type", "param", "code"}, err
            r = await c.post("/v1/completions", content=b"{nope")
            assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
            r = await c.post("/v1/embeddings", json={"input": "a"})
            assert r.status_code == 404 and "/v1/chat/completions" in r.json()["error"]["message"]
            r = await c.get("/v1/completions")
            assert r.status_code == 405 and r.headers["allow"] == "POST"
            r = await c.post("/v1/completions", json={"prompt": long_prompt[:-20], "max_tokens": 30})
            assert r.json()["error"]["code"] == "context_length_exceeded"
            ok = await c.post("/completions", json={"prompt": "A", "max_tokens": 2, "model": "alias"})
            assert ok.status_code == 200 and ok.json()["model"] == "tiny"
            assert [m["id"] for m in (await c.get("/v1/models")).json()["data"]] == ["tiny", "alias"]
            info = (await c.get("/info")).json()
            assert info["kind"] == "generation" and info["max_seq_len"] == llm.max_seq_len
            assert info["kv_cache"]["blocks"] == llm.stats().kv_blocks_total and info["layers"] == 2
            assert info["architecture"] == "llama" and info["ready"] is True
            server.shutdown()
            r = await c.post("/v1/chat/completions", json={"messages": CHAT})
            assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
            assert (await c.get("/health")).status_code == 503
    assert idle(llm)


@pytest.mark.anyio
async def test_429_past_max_waiting_and_the_metrics(gguf: Path, shared_rt: hetero.Runtime) -> None:
    """With one sequence running and one waiting (max_running=1, max_waiting=1), a third request gets
    429 with Retry-After; /metrics counts tokens, TTFT, inter-token gaps, sequences and KV blocks."""
    model = load_model(gguf)
    model.config = dataclasses.replace(model.config, eos_token_ids=())
    async with LLM(model, runtime=shared_rt, kv_cache_bytes=KV, max_running=1, max_waiting=1) as small:
        server = GenerationServer(small)
        async with asgi(server) as c, server.running():
            await server.wait_ready()
            async with anyio.create_task_group() as tg:
                for want in ((1, 0), (1, 1)):  # one at a time: a sequence not yet admitted counts as waiting
                    tg.start_soon(lambda: c.post("/v1/completions", json={"prompt": "A", "max_tokens": 150}))
                    with anyio.fail_after(30):
                        while (small.stats().running, small.stats().waiting) != want:
                            await anyio.sleep(0.005)
                metrics = (await c.get("/metrics")).text
                assert metric(metrics, "hetero_generate_running_sequences") == 1
                assert metric(metrics, "hetero_generate_waiting_sequences") == 1
                assert metric(metrics, "hetero_kv_cache_blocks_in_use") >= 1
                r = await c.post("/v1/chat/completions", json={"messages": CHAT, "stream": True})
                assert r.status_code == 429 and r.headers["retry-after"] == "1"
                assert r.json()["error"]["type"] == "rate_limit_error"
                tg.cancel_scope.cancel()
            with anyio.fail_after(30):
                while not idle(small) or server.active:
                    await anyio.sleep(0.01)
            r = await c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 5, "stream": True})
            assert r.status_code == 200 and sse_events(r.content)[-1] == "[DONE]"
            metrics = (await c.get("/metrics")).text
        assert metric(metrics, 'hetero_generate_requests_total{code="429"}') == 1
        assert metric(metrics, 'hetero_generate_requests_total{code="200"}') == 1
        assert metric(metrics, "hetero_generate_tokens_total") == 5
        assert metric(metrics, "hetero_generate_time_to_first_token_seconds_count") == 1
        assert metric(metrics, "hetero_generate_inter_token_latency_seconds_count") == 4
        assert metric(metrics, "hetero_kv_cache_blocks") == small.stats().kv_blocks_total
        assert metric(metrics, "hetero_generate_running_sequences") == 0


def test_the_serve_command_checks_its_options(gguf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["serve", "--help"]) == 0
    assert "/v1/chat/completions" in capsys.readouterr().out
    assert cli_main(["serve", "--model", str(gguf), "--workers", "2", "--engines", "2"]) == 1
    assert "a generation model runs in one engine process" in capsys.readouterr().err
    assert cli_main(["serve", "--model", str(gguf), "--int8"]) == 1
    assert "--int8 is an option of embedding models" in capsys.readouterr().err
    assert cli_main(["serve", "--model", "minilm", "--kv-cache-bytes", "1M"]) == 1
    assert "--kv-cache-bytes is an option of text generation" in capsys.readouterr().err
    assert cli_main(["serve", "--model", str(gguf), "--kv-cache-bytes", "lots"]) == 2
    assert cli_main(["serve", "--model", "minilm", "--steps-per-run", "2"]) == 1
    assert "--steps-per-run is an option of text generation" in capsys.readouterr().err
    assert cli_main(["serve", "--model", str(gguf), "--steps-per-run", "5"]) == 1
    assert "--steps-per-run must be from 1 to 4, got 5" in capsys.readouterr().err


def test_generation_settings_give_the_llm_its_options() -> None:
    from hetero.pipelines.serve import GenerateSettings

    opts = GenerateSettings(steps_per_run=3, max_running=8).llm_options()
    assert opts["steps_per_run"] == 3 and opts["max_running"] == 8
    assert GenerateSettings().llm_options()["steps_per_run"] == 1


def test_hetero_serve_generates_in_a_subprocess(gguf: Path, tmp_path: Path) -> None:
    """``hetero serve --model FILE.gguf``: ready on /health, answers a chat request, stops on SIGTERM."""
    import signal
    import subprocess
    import time

    from bench.serve import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "hetero", "serve", "--model", str(gguf), "--port", str(port),
                             "--kv-cache-bytes", "1M", "--served-model-name", "tiny", "--default-max-tokens", "4"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    try:
        deadline = time.monotonic() + 120
        while True:
            assert time.monotonic() < deadline and proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        r = httpx.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": CHAT}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 4, r.text
        assert httpx.get(url + "/info", timeout=5).json()["kv_cache"]["blocks"] == 127
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        log.seek(0)
        out = log.read()
        assert "text generation: llama, 2 layers" in out and "hetero serve: stopped" in out, out
        assert "Traceback" not in out, out
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        log.close()


def test_bench_generate_serve_runs_on_the_tiny_model(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m bench generate_serve --model tiny --steps-per-run 2``: its raw SSE client reads every
    token the server streamed (the tiny model has no end-of-sequence id), beside the in-process references."""
    from bench import generate_serve

    assert generate_serve.main(["--model", "tiny", "--clients", "1,3", "--new", "5", "--prompt", "16",
                                "--rounds", "2", "--repeats", "1", "--http", "hypercorn", "--steps-per-run", "2"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert all(ln["bench"] == "generate_serve" for ln in lines)
    refs = [ln for ln in lines if "reference" in ln]
    assert [ln["clients"] for ln in refs if "clients" in ln] == [1, 3] and refs[-1]["tokens"] == 5
    levels = {ln["clients"]: ln for ln in lines if "aggregate_tok_s" in ln and "reference" not in ln}
    assert sorted(levels) == [1, 3] and all(levels[c]["steps_per_run"] == 2 for c in (1, 3))
    assert [levels[c]["tokens"] for c in (1, 3)] == [1 * 5 * 2, 3 * 5 * 2]  # runs of two steps: every token
    assert all(levels[c]["aggregate_over_generate"] > 0 and levels[c]["ttft_p99_ms"] > 0 for c in (1, 3))
    assert lines[-1]["targets"] == "issue 44" and lines[-1]["c1_ttft_over_stream"] > 0


SECRET = b"s" * 32


@pytest.mark.anyio
async def test_the_engine_link_carries_streams_errors_and_cancels(llm: LLM, tmp_path: Path) -> None:
    """A front's GenerationClient through the loopback link to a GenerationEngine: the same tokens as
    the LLM alone (one request, and four at once), the LLM's refusals as the same exceptions, and a
    stream closed early cancels its sequence in the engine."""
    from hetero.errors import InputError, RuntimeClosedError
    from hetero.pipelines.serve_llm_link import GenerationClient, GenerationEngine

    engine = GenerationEngine(llm)
    address = str(tmp_path / "engine.port")
    prompts = [llm.encode(t) for t in ("The quick brown fox", "def f(x):", "A", "What is")]
    want = [await llm.agenerate(p, max_tokens=8) for p in prompts]
    serving = anyio.CancelScope()

    async def serve_fronts(*, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        with serving:
            await engine.serve_fronts(address, SECRET, task_status=task_status)

    async with engine.running(), anyio.create_task_group() as tg:
        await tg.start(serve_fronts)
        client = GenerationClient(address, SECRET)
        async with client.running():
            with anyio.fail_after(60):
                while not client.ready:
                    await anyio.sleep(0.01)
            assert client.max_seq_len == llm.max_seq_len and client.facts["layers"] == 2
            got = await client.agenerate(prompts[0], max_tokens=8, temperature=0.0)
            assert (got.text, got.token_ids, got.finish_reason) == (want[0].text, want[0].token_ids, "length")
            assert got.prompt_tokens == len(prompts[0])
            together: dict[int, Any] = {}

            async def one(i: int) -> None:
                together[i] = [p async for p in client.stream(prompts[i], max_tokens=8)]

            async with anyio.create_task_group() as inner:
                for i in range(4):
                    inner.start_soon(one, i)
            for i in range(4):
                assert "".join(p.text for p in together[i]) == want[i].text
                assert [p.token_id for p in together[i]] == want[i].token_ids
                assert together[i][-1].finish_reason == "length"
            with pytest.raises(InputError, match="out of range"):
                await client.agenerate([1, 10 ** 6], max_tokens=2)
            before = llm.stats().tokens_generated
            async with contextlib.aclosing(client.stream(prompts[0], max_tokens=200)) as s:  # type: ignore[type-var]
                n = 0
                async for _ in s:
                    n += 1
                    if n == 3:
                        break
            with anyio.fail_after(30):
                while not idle(llm):
                    await anyio.sleep(0.01)
            assert llm.stats().tokens_generated - before < 100
            serving.cancel()  # the engine stops serving: the front says so and refuses what follows
            with anyio.fail_after(30):
                while client.lost is None:
                    await anyio.sleep(0.01)
            assert "engine process stopped" in client.lost and not client.ready
            with pytest.raises(RuntimeClosedError, match="engine process stopped"):
                await client.agenerate(prompts[0], max_tokens=2)


def test_workers_serve_generation_through_one_engine(gguf: Path, tmp_path: Path, shared_rt: hetero.Runtime) -> None:
    """``hetero serve --model FILE.gguf --workers 2``: both fronts answer what the LLM generates alone
    (streaming and not), /metrics sums the fronts and shows the engine's gauges, a client that hangs
    up cancels its sequence in the engine, SIGTERM stops all."""
    import signal
    import socket
    import subprocess
    import time

    from bench.serve import free_port

    with LLM(gguf, runtime=shared_rt, kv_cache_bytes=KV) as alone:
        want = alone.generate(alone.model.chat_ids(CHAT), max_tokens=6)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "hetero", "serve", "--model", str(gguf), "--port", str(port),
                             "--kv-cache-bytes", "1M", "--workers", "2", "--http", "hypercorn"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    try:
        deadline = time.monotonic() + 120
        pids: set[int] = set()
        while len(pids) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    pids.add(httpx.get(url + "/info", timeout=5).json()["worker_pid"])
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        for stream in (False, True) * 3:  # new connections: spread over the fronts
            r = httpx.post(url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 6, "temperature": 0,
                                                               "stream": stream}, timeout=30)
            assert r.status_code == 200, r.text
            if stream:
                chunks = [json.loads(e) for e in sse_events(r.content)[:-1]]
                text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
            else:
                text = r.json()["choices"][0]["message"]["content"]
            assert text == want.text
        info = httpx.get(url + "/info", timeout=5).json()
        assert info["kv_cache"]["blocks"] == 127 and info["max_seq_len"] == 256
        before = info["tokens_generated"]
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            body = json.dumps({"prompt": "A", "max_tokens": 200, "stream": True}).encode()
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body))
            got = b""
            while got.count(b"data: ") < 3:
                got += sock.recv(65536)
        while True:  # the engine's counts reach the fronts four times a second
            assert time.monotonic() < deadline + 60
            info = httpx.get(url + "/info", timeout=5).json()
            if info["running"] == 0 and info["kv_cache"]["blocks_in_use"] == 0 and info["tokens_generated"] > before:
                break
            time.sleep(0.05)
        assert info["tokens_generated"] - before < 100
        metrics = httpx.get(url + "/metrics", timeout=10).text
        # summed over the fronts: the six above, and the stream whose client hung up: 499, or 200 where its
        # sampled tokens (no seed, temperature 1) reached an end-of-sequence token before the hang-up landed
        ok = metric(metrics, 'hetero_generate_requests_total{code="200"}')
        gone = metric(metrics, 'hetero_generate_requests_total{code="499"}') if 'code="499"' in metrics else 0
        assert ok in (6, 7) and ok + gone == 7, (ok, gone)
        assert metric(metrics, "hetero_kv_cache_blocks") == 127  # set by the engine process
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        log.seek(0)
        out = log.read()
        assert "2 front processes and an engine process" in out and "hetero serve: stopped" in out, out
        assert "Traceback" not in out, out
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        log.close()
