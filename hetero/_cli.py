"""The ``hetero`` command line: ``info [--check]``, ``demo``, ``embed``, ``generate``, ``serve`` and ``graph``.

``info`` shows what the GPU side of hetero will run on; ``info --check`` is the
one-line probe setup scripts use to decide whether to install a software Vulkan
driver; ``demo`` runs a small hybrid CPU/GPU graph and checks it against numpy.
``embed`` (``hetero.pipelines.embed_cli``), ``generate`` (``hetero.pipelines.generate_cli``),
``serve`` (``hetero.pipelines.serve``) and ``graph`` (``hetero.pipelines.picture``) come from
the pipelines.
Errors hetero raises are printed as ``hetero: error: <message>`` (exit status 1),
not as tracebacks. Files a command will write (``--trace``, ``--output``) are checked
before any work starts, so a bad path costs nothing; Ctrl-C ends any command with
``hetero: interrupted`` (exit status 130).
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import time
from collections.abc import Iterator, Sequence

# This is the console script's entry module: it imports only what the interpreter has
# loaded already, so that Ctrl-C during the heavy imports (argparse, numpy, wgpu) lands
# inside main()'s handler. (mypy reads a name TYPE_CHECKING as true, like typing's.)
TYPE_CHECKING = False
if TYPE_CHECKING:
    import argparse
    from typing import Any, TextIO

__all__ = ["main"]

# Backends with real compute support. wgpu's OpenGL backend is a downlevel fallback
# (limited compute, no timestamp queries in practice), so --check does not count it.
COMPUTE_BACKENDS = ("Vulkan", "Metal", "D3D12")
KEY_LIMITS = (
    "max-buffer-size",
    "max-storage-buffer-binding-size",
    "max-compute-workgroups-per-dimension",
    "max-compute-invocations-per-workgroup",
    "max-compute-workgroup-storage-size",
)
_BYTE_LIMITS = {"max-buffer-size", "max-storage-buffer-binding-size", "max-compute-workgroup-storage-size"}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    try:
        with _interrupts_redelivered():
            return _main(argv)
    except KeyboardInterrupt:  # anywhere once hetero's code runs: while parsing, working or closing
        print("hetero: interrupted", file=sys.stderr)
        _forget_unhandled_interrupt()
        return 130


@contextlib.contextmanager
def _interrupts_redelivered() -> Iterator[None]:
    """While the block runs, a KeyboardInterrupt that Python ignores is delivered again.

    Ctrl-C raises KeyboardInterrupt in whatever code the main thread is running. If that code is a
    callback whose exceptions Python only reports, the interrupt is lost and the command goes on.
    Such callbacks are a weakref callback (the import system's module locks have one), a
    ``__del__`` or a garbage collector callback. The unraisable hook then has a new thread signal
    the main thread again (``_thread.interrupt_main``), and the handler raises the interrupt in
    the code the main thread runs next. The signal must come from another thread: raised in the
    hook itself, it would be ignored again."""
    import _thread  # loaded with the interpreter (the import system uses it)

    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
            _thread.start_new_thread(_thread.interrupt_main, ())
            return
        previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous


def _forget_unhandled_interrupt() -> None:
    """Keep the exit status the interrupt handler returns.

    An interrupt that ends code run through ``PyRun_*`` (an extension module's import may run
    some) leaves the interpreter a note to end the process by SIGINT at exit, whatever status
    ``main`` returns; running an empty string the same way clears that note."""
    try:
        import ctypes

        ctypes.pythonapi.PyRun_SimpleStringFlags(b"", None)
    except Exception:  # no ctypes, or an interpreter without the C API
        pass


def _main(argv: Sequence[str] | None) -> int:
    with _interrupts_seen() as seen:
        try:
            parser = _parser()
        except Exception:
            # An extension module may turn an interrupt during its import into an ImportError
            # (numpy does): the interrupt it swallowed is still the reason.
            if seen:
                raise KeyboardInterrupt from None
            raise
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version and usage errors: return instead of exiting
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    from .errors import HeteroError

    try:
        code = int(args.func(args))
        try:
            sys.stdout.flush()  # here, not at exit: a failed write must change the exit status
        except BrokenPipeError:
            raise
        except OSError as e:  # what print() buffered could not be written (a full disk)
            raise HeteroError(f"cannot write standard output: {e.strerror or e}") from e
        return code
    except HeteroError as e:
        print(f"hetero: error: {e}", file=sys.stderr)
        try:
            sys.stdout.flush()
        except OSError:  # it would fail again at exit, with a traceback
            _drop_stdout()
        return 1
    except BrokenPipeError:
        # The reader went away (``hetero info | head``).
        _drop_stdout()
        return 1
    except OSError as e:
        # A write error with no file name that reached this far is standard output's: hetero
        # reports its own files' errors naming them (and print() gives no file name).
        if e.filename is not None or e.errno not in _WRITE_ERRNOS:
            raise
        print(f"hetero: error: cannot write standard output: {e.strerror}", file=sys.stderr)
        _drop_stdout()
        return 1


# What writing to a full or failing device raises.
_WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO})


@contextlib.contextmanager
def _interrupts_seen() -> Iterator[list[int]]:
    """While the block runs, Ctrl-C raises KeyboardInterrupt as usual and is also noted in the list
    yielded. Where SIGINT is not Python's default handler (ignored, or the main thread's only) nothing changes."""
    import signal

    seen: list[int] = []

    def on_sigint(signum: int, frame: object) -> None:
        seen.append(signum)
        raise KeyboardInterrupt

    previous = None
    try:
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            previous = signal.signal(signal.SIGINT, on_sigint)
    except ValueError:  # not the main thread
        pass
    try:
        yield seen
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _drop_stdout() -> None:
    """Point stdout at devnull, dropping what is buffered, so the interpreter's final flush does not raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def _parser() -> argparse.ArgumentParser:
    import argparse

    from . import __version__
    from ._argtypes import positive_int

    p = argparse.ArgumentParser(
        prog="hetero",
        description="Heterogeneous async task graphs: CPU stages on a thread pool, GPU stages on WebGPU.",
    )
    p.add_argument("--version", action="version", version=f"hetero {__version__} (wgpu {_wgpu_version()})")
    sub = p.add_subparsers(dest="command", required=True, metavar="command")

    info = sub.add_parser(
        "info",
        help="list GPU adapters, the one hetero selects, its limits and features",
        description="List every WebGPU adapter with the HETERO_ADAPTER value that selects it (backend#index), "
        "mark the one hetero selects (set HETERO_ADAPTER to a part of an adapter's name, backend or type, "
        "optionally with #k for the k-th match, to choose another), and show its limits and features.",
    )
    info.add_argument(
        "--check", action="store_true",
        help="print one line; exit 0 only if a Vulkan, Metal or D3D12 adapter runs a compute shader",
    )
    info.set_defaults(func=cmd_info)

    demo = sub.add_parser(
        "demo",
        help="run a small CPU -> GPU -> CPU graph and check it against numpy",
        description="Run a hybrid graph (CPU: make and normalise inputs; GPU: a WGSL saxpy kernel; "
        "CPU: check against numpy and checksum) once with Runtime.run, then over several inputs with "
        "Runtime.map.",
    )
    demo.add_argument("--size", type=positive_int, default=1 << 20, metavar="N",
                      help="elements per array (default: %(default)s)")
    demo.add_argument("--runs", type=positive_int, default=8, metavar="R",
                      help="inputs to stream through Runtime.map (default: %(default)s)")
    demo.add_argument("--trace", metavar="T.json", default=None,
                      help="write a Chrome/Perfetto trace of the runs to this file (open it in ui.perfetto.dev)")
    demo.set_defaults(func=cmd_demo)

    from hetero.pipelines import embed_cli

    embed_cli.add_parser(sub)

    from hetero.pipelines import generate_cli

    generate_cli.add_parser(sub)

    from hetero.pipelines import serve as serve_cli

    serve_cli.add_parser(sub)

    from hetero.pipelines import picture

    picture.add_parser(sub)
    return p


def _wgpu_version() -> str:
    try:
        import wgpu

        return str(wgpu.__version__)
    except Exception:  # noqa: BLE001 - --version must work even when wgpu cannot load
        return "not importable"


# -- info ---------------------------------------------------------------------------------
def cmd_info(args: argparse.Namespace) -> int:
    from ._gpu import device as _device
    from .errors import NoAdapterError

    out = sys.stdout
    if args.check:
        return _check(out)

    adapters = _device.list_adapters()
    if not adapters:
        raise NoAdapterError(f"no WebGPU adapter found; {_device.INSTALL_HINT}; then run 'hetero info' again")
    pattern = os.environ.get("HETERO_ADAPTER") or None
    print(f"adapters ({len(adapters)}):", file=out)
    # select_adapter() is the single source of truth for the choice; it returns its own
    # adapter object, so the listed one it corresponds to is found by its summary.
    try:
        chosen = _device.select_adapter()
    except Exception:
        _print_adapters(out, adapters, None)
        raise
    index = _device.adapter_index(adapters, pattern)
    _print_adapters(out, adapters, chosen.summary, index)
    how = f"HETERO_ADAPTER={pattern!r}" if pattern else "high-performance preference; set HETERO_ADAPTER to choose"
    print(f"selected: {chosen.summary} ({how})", file=out)

    dev = _device.Device(chosen)
    try:
        print("limits:", file=out)
        width = max(len(k) for k in KEY_LIMITS)
        for key in KEY_LIMITS:
            value = dev.limits.get(key)
            shown = "n/a" if value is None else (_bytes(value) if key in _BYTE_LIMITS else f"{value}")
            print(f"  {key:<{width}}  {shown}", file=out)
        flags = ", ".join(f"{f} {'yes' if f in dev.features else 'no'}" for f in _device.WANTED_FEATURES)
        print(f"compute features enabled: {flags}", file=out)
        print(f"adapter features: {', '.join(sorted(chosen.features)) or '(none)'}", file=out)
    finally:
        dev.close()
    return 0


def _print_adapters(out: TextIO, adapters: list[Any], chosen: str | None, index: int | None = None) -> None:
    """One row per adapter: the HETERO_ADAPTER value that selects it (``vulkan#1``), name, backend, type."""
    from ._gpu.device import adapter_labels, adapter_summary

    rows = [adapter_summary(a) for a in adapters]
    labels = adapter_labels(adapters)
    w_label = max(len(x) for x in labels)
    w_name = max(len(r["name"]) for r in rows)
    w_backend = max(len(r["backend"]) for r in rows)
    marked = False
    for i, (label, r) in enumerate(zip(labels, rows)):
        mark = not marked and (i == index if index is not None else r["summary"] == chosen)
        marked = marked or mark
        print(f"  {'*' if mark else ' '} {label:<{w_label}}  {r['name']:<{w_name}}  {r['backend']:<{w_backend}}  "
              f"{r['type']}{'   <- selected' if mark else ''}", file=out)


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n} ({n / size:.1f} {unit})"
    return f"{n}"


def _check(out: TextIO) -> int:
    """One line, exit 0 iff a Vulkan/Metal/D3D12 adapter really runs a compute shader.

    HETERO_ADAPTER is ignored on purpose: the question is whether installing a driver
    is needed, not which adapter a run would pick.
    """
    from ._gpu.device import INSTALL_HINT, adapter_summary, list_adapters

    adapters = list_adapters()
    failures = []
    for a in adapters:
        s = adapter_summary(a)
        if s["backend"] not in COMPUTE_BACKENDS:
            continue
        try:
            _probe_compute(a)
        except Exception as e:  # noqa: BLE001 - any failure means "not usable"
            failures.append(f"{s['summary']}: {type(e).__name__}: {e}")
            continue
        print(f"ok: compute works on {s['summary']}", file=out)
        return 0
    found = "; ".join(a.summary for a in adapters) or "none"
    tried = f"; failed: {' | '.join(failures)}" if failures else ""
    print(f"no compute-capable Vulkan, Metal or D3D12 adapter (adapters: {found}{tried}); {INSTALL_HINT}",
          file=out)
    return 1


_PROBE_WGSL = """
@group(0) @binding(0) var<storage, read_write> data: array<u32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) id: vec3<u32>) {
    if (id.x < arrayLength(&data)) { data[id.x] = data[id.x] * 2u + 1u; }
}
"""


def _probe_compute(adapter: Any) -> None:
    """Run one tiny compute dispatch with plain wgpu and check the result.

    Plain wgpu rather than hetero's runtime, so the probe answers "does the driver
    compute" independently of the rest of hetero.
    """
    import numpy as np
    import wgpu

    device = adapter.request_device_sync(label="hetero-check")
    try:
        data = np.arange(256, dtype=np.uint32)
        usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
        buf = device.create_buffer_with_data(data=data, usage=usage)
        module = device.create_shader_module(code=_PROBE_WGSL)
        pipeline = device.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": "main"})
        group = device.create_bind_group(
            layout=pipeline.get_bind_group_layout(0),
            entries=[{"binding": 0, "resource": {"buffer": buf, "offset": 0, "size": buf.size}}],
        )
        enc = device.create_command_encoder()
        cpass = enc.begin_compute_pass()
        cpass.set_pipeline(pipeline)
        cpass.set_bind_group(0, group)
        cpass.dispatch_workgroups(data.size // 64)
        cpass.end()
        device.queue.submit([enc.finish()])
        got = np.frombuffer(device.queue.read_buffer(buf), dtype=np.uint32)
        if not np.array_equal(got, data * 2 + 1):
            raise RuntimeError("the probe kernel computed wrong values")
    finally:
        device.destroy()


# -- demo ---------------------------------------------------------------------------------
SAXPY_WGSL = """
struct Params { a: f32, n: u32 }

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read> y: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
@group(0) @binding(3) var<uniform> p: Params;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) id: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    // Grids with more than max-compute-workgroups-per-dimension groups spill into y.
    let i = id.x + id.y * groups.x * 64u;
    if (i < p.n) {
        out[i] = p.a * x[i] + y[i];
    }
}
"""
PARAMS = [("a", "<f4"), ("n", "<u4")]  # matches the WGSL struct: 8 bytes
A = 2.5
WORKGROUP = 64


class _Timings:
    """Seconds spent in each stage function per run (by seed), and which threads ran them; thread-safe."""

    def __init__(self) -> None:
        import threading

        self.lock = threading.Lock()
        self.seconds: dict[tuple[str, int], float] = {}  # (stage, seed) -> seconds
        self.threads: dict[str, set[str]] = {}
        self.recorded_at: dict[int, float] = {}  # seed -> when the GPU stage finished recording

    def add(self, stage: str, seed: int, seconds: float) -> None:
        with self.lock:
            self.seconds[(stage, seed)] = self.seconds.get((stage, seed), 0.0) + seconds
            self.threads.setdefault(stage, set()).add(_thread_name())

    def ms(self, stage: str, seeds: Sequence[int]) -> float:
        """Mean milliseconds of ``stage`` over the runs with ``seeds``."""
        got = [self.seconds[(stage, s)] for s in seeds if (stage, s) in self.seconds]
        return 1e3 * sum(got) / len(got) if got else 0.0


def build_demo_graph(size: int, timings: _Timings) -> Any:
    """The demo graph::

        seed -> prepare (cpu) --(x, y)--> saxpy (gpu) --out--> check (cpu)
                        \\__________________(x, y)_____________/
    """
    import numpy as np

    import hetero

    def prepare(seed: int) -> tuple[np.ndarray, np.ndarray]:
        t0 = time.perf_counter()
        rng = np.random.default_rng(seed)
        x, y = rng.standard_normal((2, size)).astype(np.float32)
        x = (x - x.mean()) / (x.std() + 1e-12)  # normalised to mean 0, std 1
        y = (y - y.mean()) / (y.std() + 1e-12)
        timings.add("prepare", seed, time.perf_counter() - t0)
        return x.astype(np.float32), y.astype(np.float32)

    def saxpy(gpu: hetero.GPUContext, xy: tuple[hetero.Tensor, hetero.Tensor], seed: int) -> hetero.Tensor:
        t0 = time.perf_counter()
        x, y = xy  # the CPU stage's arrays arrive uploaded, as Tensors
        limit = gpu.limits["max-storage-buffer-binding-size"]
        if x.nbytes > limit:
            raise ValueError(f"--size {size} needs {x.nbytes} bytes per binding, "
                             f"over the adapter's max-storage-buffer-binding-size of {limit}")
        out = gpu.empty(x.shape, np.float32)
        groups = -(-size // WORKGROUP)
        per_dim = gpu.limits["max-compute-workgroups-per-dimension"]
        grid = (groups, 1) if groups <= per_dim else (per_dim, -(-groups // per_dim))
        gpu.dispatch(SAXPY_WGSL, grid, x, y, out, np.array([(A, size)], dtype=PARAMS))
        t1 = time.perf_counter()
        timings.add("saxpy", seed, t1 - t0)
        with timings.lock:
            timings.recorded_at[seed] = t1
        return out

    def check(xy: tuple[np.ndarray, np.ndarray], out: np.ndarray, seed: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        with timings.lock:
            waited = t0 - timings.recorded_at.pop(seed)
        x, y = xy
        want = np.float32(A) * x + y
        err = float(np.max(np.abs(out - want)))
        ok = bool(out.shape == want.shape and np.allclose(out, want, rtol=1e-5, atol=1e-5))
        result = {"seed": seed, "ok": ok, "max_abs_err": err, "checksum": float(np.sum(out, dtype=np.float64))}
        timings.add("check", seed, time.perf_counter() - t0)
        timings.add("gpu->host", seed, waited)
        return result

    g = hetero.Graph("demo")
    seed = g.input("seed")
    xy = g.cpu(prepare, seed)
    out = g.gpu(saxpy, xy, seed)
    g.output(g.cpu(check, xy, out, seed))
    return g


def cmd_demo(args: argparse.Namespace) -> int:
    import anyio

    import hetero

    if args.trace is not None:
        from ._files import check_writable

        check_writable(args.trace, "trace file")
    size, runs = args.size, args.runs
    timings = _Timings()
    graph = build_demo_graph(size, timings)
    report: dict[str, Any] = {}

    async def go() -> None:
        async with hetero.Runtime(trace=args.trace) as rt:
            device = await anyio.to_thread.run_sync(rt.device)  # creating the device blocks
            report["adapter"] = device.summary["summary"]
            t0 = time.perf_counter()
            report["first"] = await rt.run(graph, seed=0)
            t1 = time.perf_counter()
            results = [r async for r in rt.map(graph, ({"seed": s} for s in range(1, runs + 1)))]
            t2 = time.perf_counter()
            report.update(results=results, t_first=t1 - t0, t_map=t2 - t1, cpu_threads=rt.cpu_threads)

    t_start = time.perf_counter()
    anyio.run(go)
    total = time.perf_counter() - t_start

    out = sys.stdout
    results = [report["first"], *report["results"]]
    total_runs = len(results)
    print(f"adapter: {report['adapter']}", file=out)
    print(f"graph 'demo': {size} float32 elements per array, out = {A} * x + y; "
          f"1 run + {runs} through Runtime.map (max_in_flight=4), {report['cpu_threads']} CPU threads", file=out)
    first, mapped = [0], list(range(1, runs + 1))
    print("stages: mean time inside the stage functions (first run includes kernel compilation)", file=out)
    print(f"  {'stage':<8} {'kind':<4} {'what':<9} {'first run':>10} {'mapped runs':>12}  where", file=out)
    rows = [(n.name, n.kind, "record" if n.kind == "gpu" else "compute", n.name) for n in graph.nodes]
    rows.insert(2, ("", "gpu", "to host", "gpu->host"))
    for name, kind, what, key in rows:
        threads = ", ".join(sorted({_thread_group(t) for t in timings.threads.get(key, ())}))
        if key == "gpu->host":
            threads = "device queue, then the fence thread"
        print(f"  {name:<8} {kind:<4} {what:<9} {timings.ms(key, first):7.3f} ms {timings.ms(key, mapped):9.3f} ms"
              f"  {threads}", file=out)
    print("  ('to host': from the end of recording to the CPU consumer starting: submit, GPU execution,\n"
          "   fence, download and hand-off; mapped runs overlap, so these include queueing)", file=out)
    cpu_ms = timings.ms("prepare", mapped) + timings.ms("check", mapped)
    print(f"per kind, mapped runs: cpu {cpu_ms:.3f} ms/run computing, gpu {timings.ms('saxpy', mapped):.3f} ms/run "
          f"recording + {timings.ms('gpu->host', mapped):.3f} ms/run until the result is on the host", file=out)
    print(f"time: first run {1e3 * report['t_first']:.1f} ms, {runs} mapped runs {1e3 * report['t_map']:.1f} ms "
          f"({1e3 * report['t_map'] / runs:.2f} ms/run), total {1e3 * total:.1f} ms (includes device creation)",
          file=out)
    bad = [r for r in results if not r["ok"]]
    checksum = sum(r["checksum"] for r in results)
    worst = max(r["max_abs_err"] for r in results)
    if bad:
        seeds = ", ".join(str(r["seed"]) for r in bad)
        print(f"result: MISMATCH against numpy for seed(s) {seeds} (max abs error {worst:.3g})", file=out)
        return 1
    print(f"result: matches numpy in all {total_runs} runs (max abs error {worst:.3g}, "
          f"checksum {checksum:.6f})", file=out)
    return 0


def _thread_name() -> str:
    import threading

    return threading.current_thread().name


def _thread_group(name: str) -> str:
    # "hetero-cpu-3" -> "hetero-cpu threads"; keeps the line short when many threads ran a stage.
    base, _, num = name.rpartition("-")
    return f"{base} threads" if num.isdigit() and base else name


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
