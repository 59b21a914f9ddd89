"""Helpers shared by the benchmark programs: sizes, JSON lines, references, round trips."""

from __future__ import annotations

import argparse
import bisect
import json
import math
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """``"16M"`` -> 16 MiB in bytes (a positive multiple of 4)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1] if t and t[-1] in UNITS else ""
    n = int(float(t[: len(t) - len(unit)]) * UNITS[unit])
    if n <= 0 or n % 4:
        raise argparse.ArgumentTypeError(f"size {text!r} must be a positive multiple of 4 bytes")
    return n


def human(n: int) -> str:
    """Bytes as ``16M`` / ``1G`` when they are whole units."""
    for unit in ("G", "M", "K"):
        if n >= UNITS[unit] and n % UNITS[unit] == 0:
            return f"{n // UNITS[unit]}{unit}"
    return str(n)


def emitter(bench: str) -> Callable[..., None]:
    """A function printing one JSON line per figure, tagged with the benchmark's name."""

    def emit(**kw: Any) -> None:
        print(json.dumps({"bench": bench, **kw}), flush=True)

    return emit


def adapter_fields(dev: Any) -> dict[str, Any]:
    """The adapter line's fields of a benchmark: summary, backend and type of ``dev``'s adapter."""
    return {"adapter": dev.summary["summary"], "backend": dev.summary["backend"], "type": dev.summary["type"]}


def empty_round_trip(dev: Any, repeat: int = 20) -> float:
    """Best seconds to submit an empty command buffer and wait for it (subtracted from timings)."""
    best = math.inf
    for _ in range(repeat):
        cb = dev.device.create_command_encoder().finish()
        t0 = time.perf_counter()
        dev.wait(dev.submit([cb]))
        best = min(best, time.perf_counter() - t0)
    return best


def best_of(fn: Callable[[], Any], repeat: int, *, warmup: bool = False) -> float:
    """The shortest wall time of ``repeat`` calls of ``fn`` (after one untimed call if ``warmup``)."""
    if warmup:
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def torch_cuda() -> Any:
    """The torch module when it is importable and sees a CUDA device, else None."""
    try:
        import torch
    except Exception:
        return None
    return torch if torch.cuda.is_available() else None


def cuda_seconds(torch: Any, op: Callable[[], Any], repeat: int, min_s: float) -> tuple[float, int]:
    """Best seconds per ``op()`` on CUDA, timed with CUDA events over K calls (K fills ``min_s``)."""
    op()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    op()
    end.record()
    torch.cuda.synchronize()
    one = max(start.elapsed_time(end) / 1e3, 1e-6)
    k = max(1, min(1000, math.ceil(min_s / one)))
    best = math.inf
    for _ in range(repeat):
        start.record()
        for _ in range(k):
            op()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / k)
    return best, k


class Spy:
    """A GPUContext stand-in that notes every dispatch (kernel, workgroups, bindings)."""

    def __init__(self, gpu: Any) -> None:
        self._gpu = gpu
        self.dispatches: list[tuple[Any, Any, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._gpu, name)

    @property
    def labels(self) -> list[str]:
        """The kernels dispatched so far, by label (the pass plan of an op)."""
        return [k.label for k, _, _ in self.dispatches]

    def dispatch(self, kernel: Any, workgroups: Any, *bindings: Any) -> Any:
        self.dispatches.append((kernel, workgroups, bindings))
        return self._gpu.dispatch(kernel, workgroups, *bindings)


def submit_timed(dev: Any, ctx: Any) -> float:
    """Submit what ``ctx`` recorded and wait: seconds from submit to completion (recording
    excluded). The context's blocks go back to the pool afterwards."""
    cb = ctx.encoder.finish()
    t0 = time.perf_counter()
    dev.wait(dev.submit([cb]))
    dt = time.perf_counter() - t0
    ctx.release_blocks()
    return dt


def replay_timed(dev: Any, record: Callable[[Any], Any], k: int) -> float:
    """Seconds for one submission of ``k`` calls of an op: the first recorded by ``record(gpu)``,
    the others repeating its dispatches (the same GPU work, but one set of scratch buffers
    instead of k, which one stage would hold until it is recorded)."""
    import hetero

    ctx = hetero.GPUContext(dev, "bench")
    spy = Spy(ctx)
    record(spy)
    for _ in range(k - 1):
        for kernel, groups, bindings in spy.dispatches:
            ctx.dispatch(kernel, groups, *bindings)
    return submit_timed(dev, ctx)


def run_once(dev: Any, record: Callable[[Any], Any]) -> Any:
    """Record one op in a fresh GPU context, submit, wait, and download its result."""
    import hetero

    ctx = hetero.GPUContext(dev, "bench-check")
    out = record(ctx)
    ctx.stage_download(out)
    dev.wait(dev.submit([ctx.encoder.finish()]))
    result = ctx.read_downloads()[id(out)]
    ctx.settle(ran=True)
    ctx.release_blocks()
    return result


def gpu_time_by_name(trace: dict[str, Any], track: str = "GPU dispatches",
                     since_us: float = 0.0) -> dict[str, tuple[int, float]]:
    """From a hetero trace (``Runtime(trace=...)``'s JSON): ``{name: (count, total ms)}`` of the
    spans on ``track`` (per-dispatch GPU times on "GPU dispatches", per-stage on "GPU queue")
    that start at or after ``since_us`` (trace time)."""
    events = trace["traceEvents"]
    tids = {e["tid"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"
            and e.get("args", {}).get("name") == track}
    out: dict[str, tuple[int, float]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("tid") in tids and e["ts"] >= since_us:
            n, ms = out.get(e["name"], (0, 0.0))
            out[e["name"]] = (n + 1, ms + e["dur"] / 1000.0)
    return dict(sorted(out.items(), key=lambda kv: -kv[1][1]))


def dispatches_between(trace: dict[str, Any], first: str, last: str, track: str = "GPU dispatches") -> list[int]:
    """From a hetero trace: for each dispatch whose name starts with ``first``, how many dispatches run
    after it before the next whose name starts with ``last`` (in start order on ``track``)."""
    events = trace["traceEvents"]
    tids = {e["tid"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"
            and e.get("args", {}).get("name") == track}
    names = [e["name"] for e in sorted((e for e in events if e.get("ph") == "X" and e.get("tid") in tids),
                                       key=lambda e: e["ts"])]
    out: list[int] = []
    count: int | None = None
    for name in names:
        if name.startswith(first):
            count = 0
        elif count is not None and name.startswith(last):
            out.append(count)
            count = None
        elif count is not None:
            count += 1
    return out


class TraceIndex:
    """What :func:`gpu_idle_causes` and :func:`lone_timeline` read of a hetero trace (the JSON of
    ``Runtime(trace=..., trace_dispatches=False)``), by run where the events name one."""

    def __init__(self, trace: dict[str, Any]) -> None:
        events = trace["traceEvents"]
        names = {e["tid"]: e.get("args", {}).get("name") for e in events
                 if e.get("ph") == "M" and e.get("name") == "thread_name"}
        self.starts: dict[int, float] = {}  # run -> its start instant
        self.gpu: list[dict[str, Any]] = []  # per-stage GPU spans (the "GPU queue" track), by start
        self.recorded: dict[tuple[int, str], tuple[float, float]] = {}  # (run, stage) -> its recording
        self.cpu: dict[int, list[tuple[str, float]]] = {}  # run -> (CPU stage, end)
        self.submits: list[tuple[float, float]] = []  # queue submissions, by start
        self.downloads: list[float] = []  # the ends of downloads, in order
        for e in events:
            ph, cat = e.get("ph"), e.get("cat")
            if ph == "i" and cat == "run":
                m = re.match(r"run (\d+) of ", e["name"])
                if m:
                    self.starts[int(m.group(1))] = e["ts"]
                continue
            if ph != "X":
                continue
            a, b = e["ts"], e["ts"] + e["dur"]
            run = e.get("args", {}).get("run")
            if names.get(e.get("tid")) == "GPU queue":
                self.gpu.append(e)
            elif cat == "submit":
                self.submits.append((a, b))
            elif cat == "transfer" and e["name"] == "download":
                self.downloads.append(b)
            elif run is not None and cat == "gpu-record":
                self.recorded[(run, e["name"])] = (a, b)
            elif run is not None and cat == "cpu":
                self.cpu.setdefault(run, []).append((e["name"], b))
        self.gpu.sort(key=lambda e: e["ts"])
        self.submits.sort()
        self.downloads.sort()
        self._submit_starts = [a for a, _ in self.submits]

    def submission_after(self, t: float) -> tuple[float, float] | None:
        """The submission that carried a stage recorded until ``t``: the first to begin after it
        (submissions go out in order); None if there is none (or the trace has no submit spans)."""
        k = bisect.bisect_left(self._submit_starts, t)
        return self.submits[k] if k < len(self.submits) else None


# What the run whose stage ran next was doing while the GPU idled (gpu_idle_causes), in its order.
IDLE_CAUSES = ("run not started", "CPU stages", "waiting to be recorded", "recording", "waiting to be submitted",
               "submitting", "submitted, not yet running")


def gpu_idle_causes(trace: dict[str, Any], since_us: float, until_us: float) -> dict[str, float]:
    """Why the GPU idled between ``since_us`` and ``until_us`` (trace time), from a trace with
    per-stage GPU spans (the "GPU queue" track): ms of idle time per cause, plus ``gaps`` and
    ``busy_ms``.

    Each gap before a stage's GPU span is charged to what that stage's run was doing, in
    :data:`IDLE_CAUSES` order: its run had not started; its CPU stages were running (the
    latest of them to end before the stage's recording began); it waited for the recording
    thread; it was being recorded; it waited to be submitted (held in an open encoder for
    a later submission, or handed to another thread that had not yet begun submitting);
    its submission was in the queue's submit call; it was submitted but not yet running
    (the GPU's own start-up). The submission carrying a stage is
    :meth:`TraceIndex.submission_after` its recording.
    The GPU spans come from timestamps, the rest from the host clock; their offset is
    calibrated, so a cause under about 0.1 ms per gap is within the clocks' agreement."""
    ix = TraceIndex(trace)
    out = dict.fromkeys(IDLE_CAUSES, 0.0)
    gaps, busy, end = 0, 0.0, None
    for e in ix.gpu:
        a, b = e["ts"], e["ts"] + e["dur"]
        if b <= since_us or a >= until_us:
            end = b if end is None else max(end, b)
            continue
        busy += max(0.0, min(b, until_us) - max(a, since_us, end if end is not None else a))
        idle_from = max(end if end is not None else since_us, since_us)
        end = b if end is None else max(end, b)
        if a <= idle_from or "run" not in e.get("args", {}):
            continue
        run = e["args"]["run"]
        rec = ix.recorded.get((run, e["name"]))
        if rec is None:
            continue
        gaps += 1
        cpu_done = max((t for _, t in ix.cpu.get(run, ()) if t <= rec[0] + 1.0), default=idle_from)
        sub = ix.submission_after(rec[1]) or (a, a)  # no submit spans (an older trace): all "waiting"
        cur = idle_from
        steps = (ix.starts.get(run, idle_from), cpu_done, rec[0], rec[1], sub[0], sub[1], a)
        for cause, mark in zip(IDLE_CAUSES, steps):
            mark = min(max(mark, cur), a)
            out[cause] += (mark - cur) / 1e3
            cur = mark
    return {"gaps": gaps, "busy_ms": round(busy / 1e3, 2), **{k: round(v, 2) for k, v in out.items()}}


def lone_timeline(trace: dict[str, Any], calls: list[tuple[int, int]]) -> dict[str, float]:
    """Where one-run calls spend their time, from a trace with per-stage GPU spans: for calls
    given as ``(start, end)`` ``perf_counter_ns`` instants, the median of each mark in µs
    from the call's start, in order, plus ``calls`` (how many were matched to exactly one run).

    Marks: the run's start; each CPU stage done; each GPU stage's recording (start and end),
    its submission (the end of :meth:`TraceIndex.submission_after` its recording) and its GPU
    span; the last download done; the call's return."""
    ix = TraceIndex(trace)
    origin = trace["otherData"]["origin_perf_counter_ns"]
    recorded: dict[int, list[tuple[str, float, float]]] = {}
    for (run, stage), (x, y) in ix.recorded.items():
        recorded.setdefault(run, []).append((stage, x, y))
    on_gpu: dict[int, list[tuple[str, float, float]]] = {}
    for e in ix.gpu:
        if "run" in e.get("args", {}):
            on_gpu.setdefault(e["args"]["run"], []).append((e["name"], e["ts"], e["ts"] + e["dur"]))
    marks: dict[str, list[float]] = {}

    def note(mark: str, us: float) -> None:
        marks.setdefault(mark, []).append(us)

    matched = 0
    for t0, t1 in calls:
        a, b = (t0 - origin) / 1e3, (t1 - origin) / 1e3
        runs = [r for r, ts in ix.starts.items() if a <= ts <= b]
        if len(runs) != 1:
            continue
        matched += 1
        run = runs[0]
        note("run starts", ix.starts[run] - a)
        for name, y in ix.cpu.get(run, ()):
            note(f"{name} done", y - a)
        for stage, x, y in recorded.get(run, ()):
            note(f"{stage} recording starts", x - a)
            note(f"{stage} recorded", y - a)
            sub = ix.submission_after(y)
            if sub is not None and sub[1] <= b:
                note(f"{stage} submitted", sub[1] - a)
        for stage, x, y in on_gpu.get(run, ()):
            note(f"{stage} on the GPU from", x - a)
            note(f"{stage} on the GPU until", y - a)
        k = bisect.bisect_right(ix.downloads, b) - 1
        if k >= 0 and ix.downloads[k] >= a:
            note("downloaded", ix.downloads[k] - a)
        note("call returns", b - a)
    medians = sorted(((m, float(statistics.median(v))) for m, v in marks.items()), key=lambda kv: kv[1])
    return {"calls": matched, **{m: round(v, 1) for m, v in medians}}


def bench_model(name: str, prefix: str) -> tuple[Path, tempfile.TemporaryDirectory[str] | None]:
    """The model directory for ``--model NAME`` (``minilm``, ``random`` or a directory), and the
    temporary directory holding a ``random`` one (the caller cleans it up)."""
    if name == "random":
        from hetero.pipelines.testing import write_random_model

        tmp = tempfile.TemporaryDirectory(prefix=prefix)
        return write_random_model(tmp.name, seed=0), tmp
    from hetero.pipelines.minilm import find_minilm

    return (find_minilm() if name == "minilm" else Path(name)), None


def thread_cpu_ns(ident: int) -> int:
    """CPU time of the thread ``ident`` (a ``threading`` ident), in ns; 0 once it has ended."""
    try:
        return time.clock_gettime_ns(time.pthread_getcpuclockid(ident))
    except OSError:
        return 0
