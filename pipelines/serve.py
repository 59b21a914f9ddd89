"""``hetero serve``: an OpenAI-compatible embeddings or text generation server, and its command line.

Needs the optional extra ``hetero[serve]`` (granian, hypercorn, prometheus-client, orjson).
``--model`` decides what is served (:func:`~hetero.pipelines.serve_llm.model_kind`): a
``.gguf`` file, a directory whose ``config.json`` names a llama or qwen2 model, or
``smollm2`` is a generation model (``/v1/chat/completions``, ``/v1/completions``); anything
else an embedding model (``/v1/embeddings``). The server is these rooms:

- :mod:`~hetero.pipelines.serve_base`: what every application shares (the HTTP entry points,
  the common routes, errors, the lifecycle);
- :mod:`~hetero.pipelines.serve_app`: the embeddings application (routes, checks, answers)
  for any HTTP server, and :class:`~hetero.pipelines.serve_app.ServeSettings`;
- :mod:`~hetero.pipelines.serve_llm`: the text generation application and
  :class:`~hetero.pipelines.serve_llm.GenerateSettings`;
- :mod:`~hetero.pipelines.serve_http`: the HTTP runner (granian or hypercorn, on asyncio,
  uvloop or trio; graceful shutdown);
- :mod:`~hetero.pipelines.serve_procs`: the supervisor of ``--workers N`` front processes and
  the engine processes behind them;
- :mod:`~hetero.pipelines.serve_engine`: the engine (GPU, batcher, warm-up) and its link.

This module is the ``serve`` command; it re-exports the names users reach for.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from typing import Any, TextIO

from hetero.errors import HeteroError
from hetero.lowlevel import positive_int

from .serve_app import EmbeddingServer, RequestError, ServeSettings, encode_embeddings
from .serve_http import (BACKENDS, HTTP_SERVERS, listen_socket, resolve_backend, resolve_http, run_on, serve,
                         serve_async)
from .serve_llm import GenerateSettings, GenerationServer, model_kind
from .serve_procs import check_engines, serve_workers

__all__ = ["BACKENDS", "EmbeddingServer", "GenerateSettings", "GenerationServer", "HTTP_SERVERS", "RequestError",
           "ServeSettings", "add_parser", "encode_embeddings", "listen_socket", "model_kind", "resolve_backend",
           "resolve_http", "run", "run_on", "serve", "serve_async", "serve_workers"]

# The embedding options and their defaults: a generation model refuses one given another value.
EMBEDDING_OPTIONS = {"int8": False, "max_client_batch_size": 2048, "max_queued": 4096, "max_in_flight": 2,
                     "max_wait_ms": 0.0, "auto_truncate": False, "precapture": None}
# The generation options (None unless given): an embedding model refuses them.
GENERATION_OPTIONS = ("weights", "max_seq_len", "kv_cache_bytes", "kv_cache_dtype", "max_running", "max_waiting",
                      "default_max_tokens", "steps_per_run")


# -- the command line --------------------------------------------------------------------------------------
def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``serve`` command to an ``argparse`` subparsers object; its ``func`` is :func:`run`."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "serve",
        help="an OpenAI-compatible server: embeddings (POST /v1/embeddings) or text generation "
        "(POST /v1/chat/completions, /v1/completions)",
        description="Serve sentence embeddings (POST /v1/embeddings) or text generation (POST /v1/chat/completions "
        "and /v1/completions, streamed as server-sent events with \"stream\": true) over HTTP, OpenAI-compatible, "
        "with GET /v1/models, /health, /info and /metrics (Prometheus). Concurrent embedding requests share GPU "
        "batches under a padded-token budget; concurrent generations share decode steps. SIGTERM or Ctrl-C shut "
        "down gracefully. Needs pip install 'hetero[serve]'.",
    )
    p.add_argument("--model", required=True, metavar="DIR|minilm|FILE.gguf|smollm2",
                   help="an embedding model directory (config.json, model.safetensors, tokenizer.json) or 'minilm'; "
                   "or a generation model: a .gguf file, a Hugging Face llama/qwen2 directory, or 'smollm2'")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=_port, default=8080, help="port to listen on (default: %(default)s)")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="event loop the server runs on: asyncio, asyncio on uvloop's loop (less CPU time per "
                   "request), trio; auto: uvloop where installed, else asyncio (default: %(default)s)")
    p.add_argument("--http", choices=HTTP_SERVERS, default="auto",
                   help="HTTP server in front: granian (Rust; HTTP parsed outside the interpreter; asyncio and "
                   "uvloop only) or hypercorn (asyncio and trio); auto: granian unless --backend trio "
                   "(default: %(default)s)")
    p.add_argument("--max-batch-tokens", type=positive_int, default=None, metavar="N",
                   help="embeddings: padded tokens per batch, sentences x longest sentence (default: 16384); "
                   "generation: most rows of one step, prompt chunks and decode tokens (default: 2048)")
    p.add_argument("--max-client-batch-size", type=positive_int, default=2048, metavar="N",
                   help="most strings in one request; more get 413 (default: %(default)s)")
    p.add_argument("--max-queued", type=positive_int, default=4096, metavar="N",
                   help="sentences waiting for a batch before requests get 429 (default: %(default)s)")
    p.add_argument("--max-in-flight", type=positive_int, default=2, metavar="N",
                   help="batches an engine runs at once: the next forms while the GPU encodes these "
                   "(default: %(default)s)")
    p.add_argument("--max-wait", dest="max_wait_ms", type=_milliseconds, default=0.0, metavar="MS",
                   help="how long a batch may wait for more sentences after its first, unless full; 0: a batch "
                   "forms as soon as the engine can take it (default: %(default)s)")
    p.add_argument("--workers", type=positive_int, default=1, metavar="N",
                   help="HTTP front processes on the port (parsing, tokenizing, answering); with more than one, "
                   "they share one engine process that owns the GPU and batches the sentences (or decodes the "
                   "sequences) of all of them; /metrics sums them (default: %(default)s)")
    p.add_argument("--engines", type=positive_int, default=1, metavar="K",
                   help="embeddings: engine processes behind the --workers fronts (front i uses engine i mod K), "
                   "each with "
                   "a device of its own on the GPU: one engine's host work is bound by one interpreter lock "
                   "(default: %(default)s)")
    p.add_argument("--max-request-bytes", type=positive_int, default=2 * 1024 * 1024, metavar="N",
                   help="largest request body; a larger one gets 413 before it is read (default: %(default)s, "
                   "2 MiB)")
    p.add_argument("--auto-truncate", action="store_true",
                   help="embed the first max-input-tokens of a longer input instead of answering 413 (a request "
                   "may ask for it with \"truncate\": true)")
    p.add_argument("--served-model-name", action="append", default=None, metavar="NAME",
                   help="the model id that requests name and GET /v1/models lists; repeat for several ids "
                   "(default: the model directory's name, or the name given to --model)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: the "
                   "HETERO_API_KEY environment variable, else none)")
    p.add_argument("--int8", action="store_true",
                   help="int8 weights for the encoder's linear layers (see hetero embed --int8)")
    p.add_argument("--precapture", dest="precapture", action=argparse.BooleanOptionalAction, default=None,
                   help="capture every packed batch shape at warm-up, so that every batch replays captured stages "
                   "(--no-precapture: one sentence, a faster start and slower first batches of each shape); "
                   "default: on, except on a CPU adapter (lavapipe, llvmpipe, SwiftShader), where it takes minutes")
    g = p.add_argument_group("text generation (a .gguf file, a llama/qwen2 directory, smollm2)")
    g.add_argument("--weights", choices=("auto", "f32", "f16", "q8_0"), default=None,
                   help="weights on the GPU: auto keeps the file's quantization (default: auto)")
    g.add_argument("--max-seq-len", type=positive_int, default=None, metavar="N",
                   help="most positions (prompt and generated) a sequence takes (default: the model's context, "
                   "at most what the KV cache holds)")
    g.add_argument("--kv-cache-bytes", type=_size, default=None, metavar="BYTES",
                   help="the KV cache's size, e.g. 512M or 4G (default: a quarter of the GPU memory budget; 256M on "
                   "a CPU adapter)")
    g.add_argument("--kv-cache-dtype", choices=("f32", "f16"), default=None, help="the KV cache's type (default: f32)")
    g.add_argument("--max-running", type=positive_int, default=None, metavar="N",
                   help="sequences that decode at once (default: the LLM's)")
    g.add_argument("--max-waiting", type=positive_int, default=None, metavar="N",
                   help="sequences waiting to start before requests get 429 (default: 1024)")
    g.add_argument("--default-max-tokens", type=positive_int, default=None, metavar="N",
                   help="tokens a request that names no max_tokens may generate (default: 256)")
    g.add_argument("--steps-per-run", type=positive_int, default=None, metavar="K",
                   help="decode steps one GPU run may take while every sequence decodes, 1 to 4 (default: 1; "
                   "see LLM(steps_per_run=))")
    p.set_defaults(func=run)
    return p


def _size(text: str) -> int:
    """A byte count: an integer, or with a K, M or G suffix (powers of 1024)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    try:
        value = int(float(t[:-1] if scale > 1 else t) * scale)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive byte count such as 268435456 or 256M, got {text!r}")
    return value


def _milliseconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value < 60_000:
        raise argparse.ArgumentTypeError(f"expected milliseconds from 0 to below 60000, got {text!r}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number in [0, 65535], got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number in [0, 65535], got {value}")
    return value


def _loopback(host: str) -> bool:
    """Whether ``host`` is only reachable from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run ``hetero serve`` with parsed ``args`` until SIGTERM or Ctrl-C; return the exit status."""
    out = out if out is not None else sys.stdout
    api_key = getattr(args, "api_key", None) or os.environ.get("HETERO_API_KEY") or None
    if model_kind(args.model) == "generation":
        return _run_generation(args, out, api_key, args.model)
    from .encoder import resolve_model

    model = os.fspath(resolve_model(args.model))  # what hetero embed accepts: a directory, minilm, a cached id
    if model_kind(model) == "generation":  # a llama or qwen2 model in the Hugging Face cache
        return _run_generation(args, out, api_key, model)
    given = [n for n in GENERATION_OPTIONS if getattr(args, n, None) is not None]
    if given:
        raise HeteroError(f"--{given[0].replace('_', '-')} is an option of text generation, and --model "
                          f"{args.model!r} is an embedding model; drop it, or serve a .gguf file, a llama/qwen2 "
                          "directory or smollm2")
    settings = ServeSettings(model=model, model_name=None if model == args.model else args.model,
                             int8=bool(args.int8), max_batch_tokens=args.max_batch_tokens or 16384,
                             max_client_batch_size=args.max_client_batch_size, max_queued=args.max_queued,
                             max_in_flight=int(getattr(args, "max_in_flight", 2)),
                             max_wait=float(getattr(args, "max_wait_ms", 0.0)) / 1e3,
                             precapture=getattr(args, "precapture", None),
                             max_request_bytes=int(getattr(args, "max_request_bytes", 2 * 1024 * 1024)),
                             auto_truncate=bool(getattr(args, "auto_truncate", False)),
                             served_model_names=tuple(getattr(args, "served_model_name", None) or ()),
                             api_key=api_key)
    _warn_open(args.host, api_key)
    workers = int(getattr(args, "workers", 1))
    engines = int(getattr(args, "engines", 1))
    check_engines(engines, workers)  # before the model loads
    backend = resolve_backend(getattr(args, "backend", "auto"))
    http = resolve_http(getattr(args, "http", "auto"), backend)
    server = EmbeddingServer(settings.model, settings=settings, http_server=http)  # a bad --model or limit fails here

    def ready(url: str) -> None:
        procs = f", {workers} front processes and " + ("an engine process" if engines == 1 else
                                                         f"{engines} engine processes") if workers > 1 else ""
        print(f"hetero serve: {server.model_name} ({server.model.dim}-d) on {url} ({http} on {backend}{procs}); "
              "warming up, GET /health says when ready", file=out, flush=True)

    if workers > 1:
        status = serve_workers(settings, args.host, args.port, backend, workers, ready=ready, engines=engines,
                               http=http)
    else:
        serve(server, args.host, args.port, backend, http=http, ready=ready)
        status = 0
    print("hetero serve: stopped", file=out, flush=True)
    return status


def _warn_open(host: str, api_key: str | None) -> None:
    if api_key is None and not _loopback(host):
        print(f"hetero serve: warning: --host {host} is reachable from other machines and no --api-key "
              "(or HETERO_API_KEY) is set: anyone who reaches it can use it", file=sys.stderr, flush=True)


def _run_generation(args: argparse.Namespace, out: TextIO, api_key: str | None, model: str) -> int:
    """``hetero serve`` with the generation model ``model`` (a file, a directory or smollm2): the LLM
    in the server process, or with ``--workers N`` in an engine process behind N fronts."""
    bad = [n for n, default in EMBEDDING_OPTIONS.items() if getattr(args, n, default) != default]
    if bad:
        name = "--max-wait" if bad[0] == "max_wait_ms" else f"--{bad[0].replace('_', '-')}"
        raise HeteroError(f"{name} is an option of embedding models, and --model {args.model!r} is a generation "
                          "model; drop it (see hetero serve --help, text generation)")
    workers = int(getattr(args, "workers", 1))
    engines = int(getattr(args, "engines", 1))
    if engines != 1:
        raise HeteroError(f"--engines {engines}: a generation model runs in one engine process, whose LLM batches "
                          "the sequences of every front; drop --engines")
    given = {n: getattr(args, n) for n in GENERATION_OPTIONS if getattr(args, n, None) is not None}
    if getattr(args, "max_batch_tokens", None) is not None:
        given["max_batch_tokens"] = args.max_batch_tokens
    settings = GenerateSettings(model=model, model_name=None if model == args.model else args.model,
                                max_request_bytes=int(getattr(args, "max_request_bytes", 2 * 1024 * 1024)),
                                served_model_names=tuple(getattr(args, "served_model_name", None) or ()),
                                api_key=api_key, **given)
    _warn_open(args.host, api_key)
    backend = resolve_backend(getattr(args, "backend", "auto"))
    http = resolve_http(getattr(args, "http", "auto"), backend)
    if workers > 1:
        from .llm_model import load_model

        c = load_model(model).config  # a bad model fails here, before any process starts
        shape = f"{c.arch}, {c.num_layers} layers, hidden {c.hidden_size}"
        procs = f", {workers} front processes and an engine process"
    else:
        server = GenerationServer(settings.model, settings=settings, http_server=http)  # a bad model fails here
        c = server.model.config
        shape = f"{c.arch}, {c.num_layers} layers, hidden {c.hidden_size}, max_seq_len {server.max_seq_len}"
        procs = ""

    def ready(url: str) -> None:
        print(f"hetero serve: {settings.served_name} (text generation: {shape}) on {url} ({http} on {backend}"
              f"{procs}); warming up, GET /health says when ready", file=out, flush=True)

    status = 0
    if workers > 1:
        status = serve_workers(settings, args.host, args.port, backend, workers, ready=ready, http=http)
    else:
        serve(server, args.host, args.port, backend, http=http, ready=ready)
    print("hetero serve: stopped", file=out, flush=True)
    return status
