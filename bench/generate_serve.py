"""``hetero serve`` text generation under C concurrent streaming clients, beside in-process ``generate()``.

``python -m bench generate_serve [--shapes smollm2-135m,qwen2.5-0.5b] [--model PATH|smollm2|tiny]
[--clients 1,16,64,256] [--prompt 128] [--new 128] [--weights auto] [--http auto] [--backend auto]
[--workers 1]``

For each shape a random model is built with transformers (bench generate's builder, fp16
safetensors) beside a word-level stand-in tokenizer in which every id is a word, so that
every generated token is text the stream carries; the model has no end-of-sequence id, so
every request generates ``--new`` tokens. ``--model`` serves a given model instead
(``tiny``: a 2-layer random llama written here with numpy, for machines without torch;
``smollm2`` or a path: a real model, whose end-of-sequence token may end a request early:
the figures count the tokens each answer's ``usage`` reports). Prompts are random token ids.

First the references, in this process on a Runtime of its own (closed before the server
starts): ``llm.generate()`` of the same C prompts in one call (aggregate tokens/s, after a
warm-up call of the same size), and for one client ``llm.stream`` (TTFT and tokens/s after
the first) and the batch-1 decode step time (one over that rate).

Then ``hetero serve`` runs in a subprocess (``--http`` granian or hypercorn; ``--workers N``:
N fronts and the LLM in an engine process) and, for each C,
C clients on keep-alive connections of their own each send one streaming ``POST
/v1/completions`` (``"stream": true``, ``stream_options.include_usage``, greedy) and read the
server-sent events off the socket with a small raw HTTP/1.1 client (chunked transfer
encoding decoded by hand: the GPU machine has no ``openai`` package). A warm-up round of
short requests at the same concurrency goes first (it captures the step at that batch),
then ``--rounds`` measured rounds. Per level: aggregate output tokens/s (every client's
tokens over the wall time from the round's first send to its last event; the median of the
rounds), TTFT p50/p99 (send to first content event), inter-token
p50/p99 (gaps between a stream's content events), the client's CPU seconds per wall second
(near 1.0: the client, not the server, set the pace) and the ratios to the references.

A last line judges issue 44's targets: 64 clients aggregate >= 0.8x ``generate()`` of 64
prompts, TTFT p99 <= 250 ms and inter-token p50 <= 1.5x a batch-1 decode step; 256 clients
at least as fast as 64 (``c256_over_c64``); 1 client TTFT and tokens/s within 1.2x of
in-process ``llm.stream``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from bench._common import adapter_fields, emitter

emit = emitter("generate_serve")

TINY_CONFIG: dict[str, Any] = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "max_position_embeddings": 1024, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
    "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": None, "eos_token_id": None,
    "torch_dtype": "float32",
}


def word_tokenizer(path: Path, vocab: int) -> None:
    """A word-level ``tokenizer.json`` of ``vocab`` words (``w0`` ...): every id decodes to text."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel

    tok = Tokenizer(WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok.save(str(path))


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    header: dict[str, Any] = {}
    offset = 0
    for name, a in tensors.items():
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for a in tensors.values():
            f.write(np.ascontiguousarray(a, np.float32).tobytes())


def tiny_model(d: Path, seed: int = 0) -> None:
    """A 2-layer random llama (float32 safetensors) with the word-level tokenizer, written with numpy."""
    c = TINY_CONFIG
    rng = np.random.default_rng(seed)
    h, i, v, hd = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * 0.2).astype(np.float32)

    w = {"model.embed_tokens.weight": mat(v, h), "model.norm.weight": np.ones(h, np.float32),
         "lm_head.weight": mat(v, h)}
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        w.update({p + "input_layernorm.weight": np.ones(h, np.float32),
                  p + "post_attention_layernorm.weight": np.ones(h, np.float32),
                  p + "self_attn.q_proj.weight": mat(q, h), p + "self_attn.k_proj.weight": mat(kv, h),
                  p + "self_attn.v_proj.weight": mat(kv, h), p + "self_attn.o_proj.weight": mat(h, q),
                  p + "mlp.gate_proj.weight": mat(i, h), p + "mlp.up_proj.weight": mat(i, h),
                  p + "mlp.down_proj.weight": mat(h, i)})
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(c, indent=1))
    write_safetensors(d / "model.safetensors", w)
    word_tokenizer(d / "tokenizer.json", v)


def shaped_model(shape: str, d: Path, layers: int | None) -> None:
    """bench generate's random transformers model of ``shape`` (fp16 safetensors), with the word-level tokenizer."""
    from bench.generate import SHAPES, make_model

    make_model(shape, d, layers, 0)
    word_tokenizer(d / "tokenizer.json", SHAPES[shape]["vocab_size"])


def percentile(xs: list[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(xs), q)) if xs else None


def ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 3)


# -- the in-process references ------------------------------------------------------------------------------
def references(model: str, args: argparse.Namespace, prompts: list[list[int]], levels: list[int]) -> dict[str, Any]:
    import hetero
    from hetero.lowlevel import device_of
    from hetero.pipelines import LLM

    out: dict[str, Any] = {}
    rt = hetero.Runtime()
    emit(**adapter_fields(device_of(rt)))
    with LLM(model, runtime=rt, weights=args.weights, kv_cache_bytes=args.kv_cache_bytes,
             steps_per_run=args.steps_per_run) as llm:
        for c in levels:
            ps = prompts[:c]
            llm.generate(ps, max_tokens=4)  # captures the step at this batch
            t0 = time.perf_counter()
            done = llm.generate(ps, max_tokens=args.new)
            wall = time.perf_counter() - t0
            tokens = sum(x.completion_tokens for x in (done if isinstance(done, list) else [done]))
            out[f"generate{c}_tok_s"] = tokens / wall
            emit(reference=f"llm.generate() of {c} prompts in one call", clients=c, tokens=tokens,
                 wall_s=round(wall, 3), aggregate_tok_s=round(tokens / wall, 1))

        async def stream_one() -> tuple[float, float | None, int]:
            t0 = time.perf_counter()
            times = []
            async for piece in llm.stream(prompts[0], max_tokens=args.new):
                if piece.token_id is not None:
                    times.append(time.perf_counter())
            rate = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else None
            return times[0] - t0, rate, len(times)

        anyio.run(stream_one)  # warm
        best: tuple[float, float | None, int] | None = None
        for _ in range(args.repeats):
            r = anyio.run(stream_one)
            best = r if best is None or r[0] < best[0] else best
        assert best is not None
        ttft, rate, n = best
        out["stream_ttft_s"], out["stream_tok_s"] = ttft, rate
        out["step_s"] = 1 / rate if rate else None
        emit(reference="llm.stream, one client", ttft_ms=ms(ttft), tok_s=None if rate is None else round(rate, 1),
             tokens=n, batch1_step_ms=ms(out["step_s"]))
    rt.close()
    return out


# -- the load -------------------------------------------------------------------------------------------------
class SSEClient:
    """One keep-alive HTTP/1.1 connection that posts streaming completions and reads their events."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.stream: Any = None
        self.buf = b""

    async def _fill(self) -> None:
        data = await self.stream.receive(65536)
        if not data:
            raise ConnectionError("the server closed the connection")
        self.buf += data

    async def _line(self) -> bytes:
        while b"\r\n" not in self.buf:
            await self._fill()
        line, _, self.buf = self.buf.partition(b"\r\n")
        return line

    async def _exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            await self._fill()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    async def complete(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        """One streaming request: send time, each content event's time, the usage the server reported."""
        if self.stream is None:
            self.stream = await anyio.connect_tcp(self.host, self.port)
        body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                           "stream_options": {"include_usage": True}}).encode()
        t0 = time.perf_counter()
        await self.stream.send(b"POST /v1/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
                               b"content-length: %d\r\n\r\n%s" % (len(body), body))
        status = int((await self._line()).split(b" ", 2)[1])
        chunked, length = False, 0
        while True:
            line = await self._line()
            if not line:
                break
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
            elif name.strip().lower() == b"content-length":
                length = int(value)
        if status != 200 or not chunked:
            text = await self._exactly(length) if not chunked else b""
            raise RuntimeError(f"status {status}: {text[:300]!r}")
        times: list[float] = []
        usage: dict[str, Any] | None = None
        pending = b""
        while True:
            size = int((await self._line()).split(b";")[0], 16)
            if size == 0:
                await self._line()
                break
            pending += await self._exactly(size)
            await self._exactly(2)
            now = time.perf_counter()
            while b"\n\n" in pending:
                event, _, pending = pending.partition(b"\n\n")
                data = event[len(b"data: "):]
                if data == b"[DONE]":
                    continue
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices", ()):
                    if choice.get("text"):
                        times.append(now)
        return {"t0": t0, "times": times, "tokens": (usage or {}).get("completion_tokens", len(times))}

    async def aclose(self) -> None:
        if self.stream is not None:
            await self.stream.aclose()


async def level(host: str, port: int, prompts: list[list[int]], clients: int, new: int,
                rounds: int) -> dict[str, Any]:
    """``rounds`` rounds of ``clients`` concurrent requests (after a warm-up round); the figures pooled
    over the rounds, the aggregate rate the median of the rounds'."""
    conns = [SSEClient(host, port) for _ in range(clients)]
    results: list[dict[str, Any]] = [{} for _ in range(clients)]
    pooled: list[list[dict[str, Any]]] = []
    cpu = wall_all = 0.0
    try:
        async def one(i: int, max_tokens: int) -> None:
            results[i] = await conns[i].complete(prompts[i], max_tokens)

        async with anyio.create_task_group() as tg:  # warm-up round: connections open, the step captured
            for i in range(clients):
                tg.start_soon(one, i, 4)
        for _ in range(rounds):
            cpu0, wall0 = time.process_time(), time.perf_counter()
            async with anyio.create_task_group() as tg:
                for i in range(clients):
                    tg.start_soon(one, i, new)
            cpu, wall_all = cpu + time.process_time() - cpu0, wall_all + time.perf_counter() - wall0
            pooled.append(list(results))
    finally:
        for c in conns:
            await c.aclose()
    rates, walls, tokens = [], [], 0
    for rs in pooled:
        start = min(r["t0"] for r in rs)
        end = max(r["times"][-1] for r in rs if r["times"])
        n = sum(r["tokens"] for r in rs)
        rates.append(n / (end - start))
        walls.append(end - start)
        tokens += n
    every = [r for rs in pooled for r in rs]
    ttft = [r["times"][0] - r["t0"] for r in every if r["times"]]
    gaps = [b - a for r in every for a, b in zip(r["times"], r["times"][1:])]
    return {"tokens": tokens, "wall_s": float(np.median(walls)), "aggregate_tok_s": float(np.median(rates)),
            "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99), "itl_p50": percentile(gaps, 50),
            "itl_p99": percentile(gaps, 99), "client_cpu_per_wall_s": cpu / wall_all}


def start_server(model: str, port: int, args: argparse.Namespace, log: Any) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "hetero", "serve", "--model", model, "--port", str(port), "--http", args.http,
           "--backend", args.backend, "--weights", args.weights, "--max-waiting", "100000",
           "--default-max-tokens", str(args.new), "--served-model-name", "bench"]
    if args.kv_cache_bytes:
        cmd += ["--kv-cache-bytes", str(args.kv_cache_bytes)]
    if args.steps_per_run != 1:
        cmd += ["--steps-per-run", str(args.steps_per_run)]
    if args.workers > 1:
        cmd += ["--workers", str(args.workers)]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_healthy(port: int, proc: subprocess.Popen[bytes], log_path: Path, timeout: float = 600) -> dict[str, Any]:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"hetero serve did not become ready:\n{log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/info", timeout=5) as i:
                        info: dict[str, Any] = json.loads(i.read())
                        return info
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.1)


def served(model: str, args: argparse.Namespace, prompts: list[list[int]], levels: list[int],
           refs: dict[str, Any], label: dict[str, Any]) -> dict[int, dict[str, Any]]:
    from bench.serve import free_port

    port = free_port()
    with tempfile.NamedTemporaryFile("w+", prefix="bench-generate-serve-", suffix=".log", delete=False) as log:
        log_path = Path(log.name)
        proc = start_server(model, port, args, log)
        out: dict[int, dict[str, Any]] = {}
        try:
            t0 = time.perf_counter()
            info = wait_healthy(port, proc, log_path)
            emit(**label, server_ready_s=round(time.perf_counter() - t0, 1), http_server=info["http_server"],
                 kv_blocks=info["kv_cache"]["blocks"], max_seq_len=info["max_seq_len"])
            for c in levels:
                f = anyio.run(level, "127.0.0.1", port, prompts, c, args.new, args.rounds)
                out[c] = f
                ref = refs.get(f"generate{c}_tok_s")
                row = {**label, "clients": c, "rounds": args.rounds, "tokens": f["tokens"],
                       "wall_s": round(f["wall_s"], 3),
                       "aggregate_tok_s": round(f["aggregate_tok_s"], 1), "ttft_p50_ms": ms(f["ttft_p50"]),
                       "ttft_p99_ms": ms(f["ttft_p99"]), "itl_p50_ms": ms(f["itl_p50"]),
                       "itl_p99_ms": ms(f["itl_p99"]), "client_cpu_per_wall_s": round(f["client_cpu_per_wall_s"], 2),
                       "generate_tok_s": None if ref is None else round(ref, 1),
                       "aggregate_over_generate": None if not ref else round(f["aggregate_tok_s"] / ref, 3)}
                if refs.get("step_s"):
                    row["itl_p50_over_batch1_step"] = round(f["itl_p50"] / refs["step_s"], 3) if f["itl_p50"] else None
                emit(**row)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    os.unlink(log_path)
    return out


def judge(levels: dict[int, dict[str, Any]], refs: dict[str, Any], label: dict[str, Any]) -> None:
    """Issue 44's targets, each figure over its same-run reference (None where a level did not run)."""
    t: dict[str, Any] = dict(label, targets="issue 44")

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    c64, c256, c1 = levels.get(64), levels.get(256), levels.get(1)
    if c64 is not None:
        t["c64_aggregate_over_generate64"] = ratio(c64["aggregate_tok_s"], refs.get("generate64_tok_s"))
        t["c64_ttft_p99_ms"] = ms(c64["ttft_p99"])
        t["c64_itl_p50_over_batch1_step"] = ratio(c64["itl_p50"], refs.get("step_s"))
        t["c64_met"] = bool((t["c64_aggregate_over_generate64"] or 0) >= 0.8 and c64["ttft_p99"] is not None
                            and c64["ttft_p99"] <= 0.25 and (t["c64_itl_p50_over_batch1_step"] or 99) <= 1.5)
    if c64 is not None and c256 is not None:
        t["c256_over_c64"] = ratio(c256["aggregate_tok_s"], c64["aggregate_tok_s"])
    if c1 is not None:
        t["c1_ttft_over_stream"] = ratio(c1["ttft_p50"], refs.get("stream_ttft_s"))
        gaps = c1["itl_p50"]
        t["c1_tok_s_over_stream"] = ratio(1 / gaps if gaps else None, refs.get("stream_tok_s"))
        t["c1_met"] = bool(t["c1_ttft_over_stream"] is not None and t["c1_ttft_over_stream"] <= 1.2
                           and (t["c1_tok_s_over_stream"] or 0) >= 1 / 1.2)
    emit(**t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="smollm2-135m,qwen2.5-0.5b", help="random models of these shapes")
    ap.add_argument("--model", default=None, help="serve this instead: a path, smollm2, or tiny (no torch needed)")
    ap.add_argument("--clients", default="1,16,64,256")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens of each request")
    ap.add_argument("--new", type=int, default=128, help="tokens each request generates")
    ap.add_argument("--weights", default="auto", choices=("auto", "f32", "f16", "q8_0"))
    ap.add_argument("--layers", type=int, default=None, help="fewer layers for the shaped models")
    ap.add_argument("--kv-cache-bytes", type=int, default=None, help="default: the server's own default")
    from hetero.pipelines.llm_engine import MAX_STEPS_PER_RUN

    ap.add_argument("--steps-per-run", type=int, default=1, choices=range(1, MAX_STEPS_PER_RUN + 1),
                    help="the LLM's steps_per_run, in the references and the server (default: 1)")
    ap.add_argument("--http", default="auto", choices=("auto", "granian", "hypercorn"))
    ap.add_argument("--workers", type=int, default=1, help="HTTP front processes (more than 1: the LLM in an "
                    "engine process behind them)")
    ap.add_argument("--backend", default="auto", choices=("auto", "asyncio", "uvloop", "trio"))
    ap.add_argument("--repeats", type=int, default=3, help="llm.stream reference runs (the best TTFT counts)")
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds of each level (after a warm-up round)")
    a = ap.parse_args(argv)
    levels = [int(x) for x in a.clients.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-generate-serve-") as tmp:
        if a.model is None:
            models = []
            for shape in a.shapes.split(","):
                d = Path(tmp) / shape
                t0 = time.perf_counter()
                shaped_model(shape, d, a.layers)
                emit(shape=shape, made_s=round(time.perf_counter() - t0, 1))
                models.append((shape, str(d)))
        elif a.model == "tiny":
            tiny_model(Path(tmp) / "tiny")
            models = [("tiny", str(Path(tmp) / "tiny"))]
        else:
            models = [(a.model, a.model)]
        for name, path in models:
            from hetero.pipelines.llm_model import load_model

            vocab = load_model(path).config.vocab_size
            rng = np.random.default_rng(0)
            prompts = [rng.integers(3, vocab, size=a.prompt).tolist() for _ in range(max(levels))]
            label = {"model": name, "weights": a.weights, "prompt": a.prompt, "new": a.new, "workers": a.workers,
                     "steps_per_run": a.steps_per_run}
            refs = references(path, a, prompts, levels)
            judge(served(path, a, prompts, levels, refs, label), refs, label)
    return 0


if __name__ == "__main__":
    sys.exit(main())
