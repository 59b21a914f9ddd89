"""Process stages: g.cpu(fn, ..., process=True) runs fn in a worker process of the runtime's pool.

The stage functions live at module level: workers import this module to find them.
One runtime (two worker processes) serves the module; tests that kill workers check
that the pool replaced them.
"""

from __future__ import annotations

import ctypes
import gc
import json
import mmap
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import hetero
from hetero import GraphError, StageError, _process
from hetero._process import SHM_THRESHOLD, open_segments, shm_segments

pytestmark = pytest.mark.anyio

WAIT = 60.0  # generous bound for a worker to start on a loaded machine (never hit when passing)
BIG = SHM_THRESHOLD // 4 * 4  # float32 elements: 4x the shared-memory threshold in bytes


# -- stage functions (module level, so that they pickle by reference) ---------------------
def add(a: int, b: int, *, scale: int = 1) -> int:
    return (a + b) * scale


def pid() -> int:
    return os.getpid()


def count_words(text: str) -> dict[str, int]:
    """Pure-Python work that holds the GIL."""
    counts: dict[str, int] = {}
    for w in text.split():
        counts[w] = counts.get(w, 0) + 1
    return counts


def ramp(n: int) -> np.ndarray:
    return np.arange(n, dtype=np.float32)


def scale_arrays(d: dict[str, np.ndarray], k: float) -> dict[str, Any]:
    return {"x": d["x"] * k, "small": d["small"] + 1, "shape": d["x"].shape}


def explode(x: int, *arrays: np.ndarray) -> int:
    raise ValueError(f"cannot handle {x}")


class Unpicklable(Exception):
    def __init__(self, a: int, b: int) -> None:  # pickling calls Unpicklable(msg): too few arguments
        super().__init__(f"{a}/{b}")


def raise_unpicklable(x: int) -> int:
    raise Unpicklable(x, 2)


def give_lock(x: int) -> Any:
    return threading.Lock()


def exit_hard(x: int) -> int:
    os._exit(3)


def segfault(x: int) -> int:
    ctypes.string_at(0)
    return x


STASHED: list[np.ndarray] = []  # in a worker: arguments a stage kept beyond its call


def stash(x: np.ndarray) -> float:
    """Keep the argument (a view of shared memory) and add up the first element of all kept."""
    STASHED.append(x)
    return float(sum(a[0] for a in STASHED))


def same(x: np.ndarray) -> np.ndarray:
    return x


def flaky(path: str) -> str:
    """Fails on its first call (per path), succeeds on the second."""
    p = Path(path)
    if not p.exists():
        p.write_text("x")
        raise RuntimeError("first attempt fails")
    return "ok"


def rendezvous(directory: str, me: str, n: int) -> int:
    """Arrive, then wait until ``n`` parties arrived (all must run at once to return)."""
    d = Path(directory)
    (d / me).write_text("")
    deadline = time.monotonic() + WAIT
    while len(list(d.iterdir())) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{me}: only {len(list(d.iterdir()))} of {n} arrived")
        time.sleep(0.01)
    return os.getpid()


def sleep_then(started: str, x: np.ndarray, seconds: float) -> float:
    Path(started).write_text(str(os.getpid()))
    time.sleep(seconds)
    return float(x.sum())


# -- fixtures ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def prt() -> Iterator[hetero.Runtime]:
    rt = hetero.Runtime(cpu_threads=2, cpu_processes=2)
    yield rt
    rt.close()
    assert shm_segments() == []
    gc.collect()  # arrays of failed tests' tracebacks
    assert open_segments() == 0, "the closed pool still holds shared memory"


@pytest.fixture(autouse=True)
def no_segments_left() -> Iterator[None]:
    yield
    assert shm_segments() == [], "shared-memory segments left in /dev/shm"


def one_stage(fn: Any, *args: Any, name: str | None = None, **kw: Any) -> hetero.Graph:
    g = hetero.Graph(name or fn.__name__)
    x = g.input("x")
    g.output(g.cpu(fn, x, *args, process=True, name=name, **kw))
    return g


async def started_pool(rt: hetero.Runtime) -> Any:
    """The runtime's process pool, its workers started (a process stage ran)."""
    assert await rt.run(one_stage(add, 1), x=0) == 1
    return rt._sched.procs()


async def wait_for_file(p: Path) -> int:
    with anyio.fail_after(WAIT):
        while not p.exists() or not p.read_text():
            await anyio.sleep(0.02)
    return int(p.read_text())


# -- correctness -----------------------------------------------------------------------------
async def test_stages_run_in_worker_processes(prt: hetero.Runtime) -> None:
    """
    ::

        x --> a (process) --> b (thread) --> c (process)
        pid (process)
    """
    g = hetero.Graph("chain")
    x = g.input("x")
    a = g.cpu(add, x, 1, scale=10, process=True, name="a")
    b = g.cpu(add, a, 2, name="b")
    c = g.cpu(add, b, x, process=True, name="c")
    p = g.cpu(pid, process=True)
    g.output(a, b, c, p)
    a_, b_, c_, p_ = await prt.run(g, x=4)
    assert (a_, b_, c_) == (50, 52, 56)
    assert p_ != os.getpid() and p_ in prt._sched.procs().pids
    stats = prt.stats()
    assert [s.kind for s in stats.stages] == ["process", "cpu", "process", "process"]
    assert all(s.completed is not None and s.started is not None for s in stats.stages)


async def test_process_stages_hold_no_thread(prt: hetero.Runtime, tmp_path: Path) -> None:
    """Two process stages and two thread stages run at once on 2 CPU threads and 2 workers.

    ::

        d --> p1, p2 (process), t1, t2 (thread): all four wait for each other
    """
    g = hetero.Graph("meet")
    d = g.input("d")
    outs = [g.cpu(rendezvous, d, name, 4, process=name.startswith("p"), name=name)
            for name in ("p1", "p2", "t1", "t2")]
    g.output(*outs)
    p1, p2, t1, t2 = await prt.run(g, d=str(tmp_path))
    assert t1 == t2 == os.getpid()
    assert {p1, p2} == set(prt._sched.procs().pids)


async def test_real_text_and_map_backpressure(prt: hetero.Runtime) -> None:
    """rt.map over process stages: results in input order, at most max_in_flight runs at once."""
    docs = [m.__doc__ or "" for m in (json, os.path, threading, subprocess, textwrap)]
    g = one_stage(count_words)
    got = []
    async for r in prt.map(g, ({"x": d} for d in docs), max_in_flight=2):
        got.append(r)
        assert len(prt._sched._active) <= 2
    assert got == [count_words(d) for d in docs]


async def test_large_arrays_travel_through_shared_memory(prt: hetero.Runtime) -> None:
    """
    ::

        n --> ramp (process) --> scale_arrays (process, nested in a dict) --> caller
    """
    g = hetero.Graph("arrays")
    n = g.input("n")
    small = g.input("small")
    r = g.cpu(ramp, n, process=True)
    d = g.cpu(dict, x=r, small=small, name="pack")
    g.output(r, g.cpu(scale_arrays, d, 2.0, process=True))
    small_in = np.ones(4, np.int64)
    r_, out = await prt.run(g, n=BIG, small=small_in)
    np.testing.assert_array_equal(r_, np.arange(BIG, dtype=np.float32))
    np.testing.assert_array_equal(out["x"], 2 * np.arange(BIG, dtype=np.float32))
    np.testing.assert_array_equal(out["small"], small_in + 1)
    assert out["shape"] == (BIG,)
    # Large results are views of a shared mapping (no pickle copy); small ones are plain arrays.
    for big in (r_, out["x"]):
        assert isinstance(_owner(big), memoryview) and isinstance(_owner(big).obj, mmap.mmap)
        big[0] = 7.0  # writable, owned by the caller
    assert not isinstance(getattr(_owner(out["small"]), "obj", None), mmap.mmap)


def _memfds() -> list[str]:
    out = []
    for f in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{f}"))
        except OSError:
            pass
    return sorted(n for n in out if "memfd" in n)


def _owner(a: np.ndarray) -> Any:
    """What finally holds an array's memory (its first base that is not an array)."""
    b: Any = a
    while isinstance(b, np.ndarray):
        b = b.base
    return b


def test_encode_decode_round_trip() -> None:
    """Large contiguous buffers go to one segment; small and strided ones stay in the pickle.
    The segment is free again (on_free) only once every array unpickled from it died."""
    from hetero import _process

    rng = np.random.default_rng(0)
    value = {"f32": rng.standard_normal(BIG).astype(np.float32), "i8": np.arange(SHM_THRESHOLD + 3, dtype=np.int8),
             "strided": np.arange(BIG * 2, dtype=np.float32)[::2], "small": np.ones(3), "bytes": b"x" * BIG}
    segs: list[_process.Segment] = []
    before = open_segments()

    def acquire(n: int) -> _process.Segment:
        segs.append(_process.Segment.new(len(segs), _process._size_class(n), "t"))
        return segs[-1]

    data, seg, layout = _process.encode(value, SHM_THRESHOLD, acquire)
    assert seg is segs[0] and len(segs) == 1 and len(layout) == 2  # f32 and i8; bytes pickle in-band
    assert all(o % 64 == 0 for o, _ in layout) and seg.size >= layout[-1][0] + layout[-1][1]
    assert len(data) > BIG * 4  # the strided array and the bytes were copied into the pickle
    freed: list[int] = []
    got = _process.decode(data, seg, layout, lambda: freed.append(1))
    assert got.keys() == value.keys()
    for k, v in value.items():
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(v))
    assert isinstance(_owner(got["f32"]).obj, mmap.mmap)
    view = got["f32"][10:20]
    del got
    assert freed == []  # a view of one of its arrays is alive
    del view
    assert freed == [1]
    seg.close()
    assert open_segments() == before


async def test_segments_are_reused_and_results_kept_stay_intact() -> None:
    """A stream of large arguments and results reuses one argument segment and the result
    segments the caller dropped; results the caller keeps are never written again."""
    gc.collect()
    base = open_segments()  # those of the module's runtime
    async with hetero.Runtime(cpu_processes=1) as rt:
        g = one_stage(same)
        x = np.arange(BIG, dtype=np.float32)
        kept = [await rt.run(g, x=x + k) for k in range(3)]
        for k in range(3, 10):
            np.testing.assert_array_equal(await rt.run(g, x=x + k), x + k)  # dropped at once
        for k, y in enumerate(kept):
            np.testing.assert_array_equal(y, x + k)
        pool = rt._sched.procs()
        assert pool.segments_made == 1
        (w,) = pool._workers
        # Three kept, a few taking turns for the other seven (a result's segment is free once
        # the worker hears of it with its next job; the runtime's last run holds its values).
        assert w is not None and len(w.results) <= 6
        assert open_segments() > base
        # Bursts: queued runs each hold an argument segment, so at most 4 exist at once.
        for _ in range(3):
            got = [r async for r in rt.map(g, ({"x": x + k} for k in range(8)), max_in_flight=4)]
            for k, r in enumerate(got):
                np.testing.assert_array_equal(r, x + k)
            del got, r
        made = pool.segments_made
        assert 1 < made <= 4
        # trim() drops the free ones; the worker lets go of its mappings with its next job.
        assert rt.trim() == made * BIG * 4
        np.testing.assert_array_equal(await rt.run(g, x=x), x)
        assert pool.segments_made == made + 1 and len(w.known) == 1
    del rt, pool, w  # the runtime's last run holds a result too
    gc.collect()
    # The closed pool let go of its segments; each kept array holds its own (and the event
    # loop may still hold the last run, and so its result).
    assert base + 3 <= open_segments() <= base + 4, _memfds()
    for k, y in enumerate(kept):
        np.testing.assert_array_equal(y, x + k)  # valid after the runtime closed
    del kept, y
    gc.collect()
    assert open_segments() <= base + 1, _memfds()


@pytest.mark.skipif(not _process._SHM, reason="no shared memory on this platform")
def test_shared_memory_that_cannot_be_made_holds_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """An argument segment the system refuses (shared memory full) fails the job with an error
    that says so, and the pool holds none of its bytes."""
    pool = _process.ProcessPool(1)
    x = np.ones(BIG, np.float32)

    def full(size: int, tag: str) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_process, "_new_fd", full)
    with pytest.raises(MemoryError, match=r"^no shared memory for the stage's arguments: a segment of \d+ bytes "
                                          r"could not be made \(\[Errno 28\] No space left on device\)"):
        pool.job(0, add, (x, 1), {}, lambda *a: None)
    assert pool._in_use == 0
    monkeypatch.undo()
    job = pool.job(0, add, (x, 1), {}, lambda *a: None)
    assert pool._in_use > 0
    pool.cancel(job)
    assert pool._in_use == 0
    pool.close()


async def test_an_argument_the_stage_keeps_is_not_overwritten() -> None:
    """A stage that stores its (shared-memory) argument keeps it intact: the parent does not
    reuse that segment for later calls."""
    async with hetero.Runtime(cpu_processes=1) as rt:
        g = one_stage(stash)
        got = [await rt.run(g, x=np.full(BIG, k, np.float32)) for k in (1, 10, 100)]
        assert got == [1.0, 11.0, 111.0]
        assert rt._sched.procs().segments_made == 3


# -- pickling ----------------------------------------------------------------------------
def test_unpicklable_function_is_refused_at_declaration() -> None:
    g = hetero.Graph("p")
    x = g.input("x")

    def local(v: int) -> int:
        return v

    with pytest.raises(GraphError) as e:
        g.cpu(local, x, process=True)
    assert str(e.value).startswith("graph 'p': process stage 'local': its function ")
    assert "cannot be pickled (AttributeError: Can't pickle local object" in str(e.value)
    assert str(e.value).endswith("; process stages need module-level functions and picklable constants")
    with pytest.raises(GraphError, match=r"process stage 'lam': its function .*lambda.* cannot be pickled"):
        g.cpu(lambda v: v, x, process=True, name="lam")
    with pytest.raises(GraphError, match=r"process stage 'add': its argument 1 \(lock\) cannot be pickled "
                                         r"\(TypeError: cannot pickle '_thread.lock' object\)"):
        g.cpu(add, x, threading.Lock(), process=True)
    with pytest.raises(GraphError, match=r"process stage 'add': its keyword argument 'scale' \(lock\)"):
        g.cpu(add, x, 1, scale=threading.Lock(), process=True)
    with pytest.raises(GraphError, match=r"^process must be True or False, got 'yes'$"):
        g.cpu(add, x, 1, process="yes")  # type: ignore[arg-type]
    assert g.nodes == []  # nothing was declared
    g.cpu(local, x, name="thread")  # a thread stage may be anything


async def test_unpicklable_values_at_run_time(prt: hetero.Runtime) -> None:
    """A value from an earlier stage, or a result, that does not pickle fails the stage that moves it."""
    g = hetero.Graph("lockin")
    x = g.input("x")
    g.output(g.cpu(add, g.cpu(give_lock, x, name="make"), 1, process=True))
    with pytest.raises(StageError, match=r"^process stage 'add' failed: TypeError: the stage's arguments cannot "
                                         r"be pickled \(TypeError: cannot pickle '_thread.lock' object\)"):
        await prt.run(g, x=1)
    with pytest.raises(StageError, match=r"^process stage 'give_lock' failed: TypeError: the stage's result "
                                         r"cannot be pickled \(TypeError: cannot pickle '_thread.lock' object\)"):
        await prt.run(one_stage(give_lock), x=1)


# -- failures --------------------------------------------------------------------------------
async def test_exception_chained_with_worker_traceback(prt: hetero.Runtime) -> None:
    with pytest.raises(StageError) as e:
        await prt.run(one_stage(explode, np.zeros(BIG, np.float32)), x=5)  # and a segment to free
    err = e.value
    assert str(err) == "process stage 'explode' failed: ValueError: cannot handle 5"
    assert err.stage == "explode"
    cause = err.__cause__
    assert isinstance(cause, ValueError) and str(cause) == "cannot handle 5"
    tb = str(cause.__cause__)
    assert "worker traceback:" in tb and ", in explode" in tb and 'raise ValueError(f"cannot handle {x}")' in tb
    back = pickle.loads(pickle.dumps(err))  # it can travel on, e.g. out of a process stage of its own
    assert str(back) == str(err) and back.stage == "explode" and str(back.__cause__) == "cannot handle 5"
    # An exception that does not survive pickling comes back as a RuntimeError naming it.
    with pytest.raises(StageError, match=r"failed: RuntimeError: Unpicklable: 5/2 \(the exception itself "
                                         r"could not be pickled"):
        await prt.run(one_stage(raise_unpicklable), x=5)


async def test_retries_rerun_in_a_worker(prt: hetero.Runtime, tmp_path: Path) -> None:
    g = one_stage(flaky, retries=1)
    assert await prt.run(g, x=str(tmp_path / "once")) == "ok"
    with pytest.raises(StageError, match="failed after 2 attempts: FileNotFoundError: "):
        await prt.run(g, x=str(tmp_path / "never") + "/x")  # the directory is missing: fails every time


@pytest.mark.parametrize("fn, how", [(exit_hard, "exited with code 3"),
                                     (segfault, "was killed by signal SIGSEGV")])
async def test_crashing_worker_fails_the_stage_and_the_pool_recovers(prt: hetero.Runtime, fn: Any,
                                                                     how: str) -> None:
    before = (await started_pool(prt)).pids
    with pytest.raises(StageError) as e:
        await prt.run(one_stage(fn), x=np.zeros(BIG, np.float32))  # with an argument in shared memory
    assert str(e.value).startswith(f"process stage '{fn.__name__}' failed: BrokenProcessPool: the worker process")
    assert str(e.value).endswith(how)
    after = prt._sched.procs().pids
    assert len(after) == 2 and len(set(before) - set(after)) == 1  # the dead worker was replaced
    assert await prt.run(one_stage(add, 1), x=1) == 2


async def test_cancelled_run_kills_its_workers(prt: hetero.Runtime, tmp_path: Path) -> None:
    """
    ::

        s0, s1, s2 (process, each with an array in shared memory): two run, one waits for a worker
    """
    g = hetero.Graph("slow")
    files = [g.input(f"f{k}") for k in range(3)]
    g.output(*[g.cpu(sleep_then, f, np.ones(BIG, np.float32), 60.0, process=True, name=f"s{k}")
               for k, f in enumerate(files)])
    started = [tmp_path / f"started{k}" for k in range(3)]

    async def run() -> None:
        await prt.run(g, **{f"f{k}": str(p) for k, p in enumerate(started)})

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        with anyio.fail_after(WAIT):
            while sum(p.exists() and bool(p.read_text()) for p in started) < 2:
                await anyio.sleep(0.02)
        workers = {int(p.read_text()) for p in started if p.exists()}
        assert open_segments() >= 3  # the three stages' arguments are in shared memory
        tg.cancel_scope.cancel()
    with anyio.fail_after(WAIT):
        while workers & set(prt._sched.procs().pids) or len(prt._sched.procs().pids) < 2:
            await anyio.sleep(0.02)
    assert not any(_alive(p) for p in workers)
    assert await prt.run(one_stage(add, 1), x=2) == 3


async def test_timeout_ends_the_worker(prt: hetero.Runtime, tmp_path: Path) -> None:
    pool = await started_pool(prt)
    before, killed = pool.pids, pool.killed
    g = one_stage(sleep_then, np.ones(BIG, np.float32), 60.0, name="slow", timeout=0.5)
    with pytest.raises(StageError, match=r"^process stage 'slow' timed out after 0.5 s$"):
        await prt.run(g, x=str(tmp_path / "started"))
    assert pool.killed == killed + 1
    with anyio.fail_after(WAIT):
        while len(set(before) - set(pool.pids)) != 1 or len(pool.pids) != 2:
            await anyio.sleep(0.02)
    assert not any(_alive(p) for p in set(before) - set(pool.pids))
    assert await prt.run(one_stage(add, 1), x=3) == 4


async def test_failed_map_stops_queued_process_stages(prt: hetero.Runtime) -> None:
    g = one_stage(explode)
    with pytest.raises(StageError, match="cannot handle 0"):
        async for _ in prt.map(g, ({"x": i} for i in range(6)), max_in_flight=4):
            pass
    assert await prt.run(one_stage(add, 1), x=4) == 5


def _alive(p: int) -> bool:
    try:
        os.kill(p, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie awaiting its parent's wait() counts as ended
        with open(f"/proc/{p}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


# -- GPU, stats, trace --------------------------------------------------------------------------
async def test_process_stage_feeds_a_gpu_stage(shared_rt: hetero.Runtime) -> None:
    """
    ::

        n --> ramp (process) --> square (thread) --> mm (gpu) --> caller
    """
    g = hetero.Graph("hybrid")
    n = g.input("n")
    a = g.cpu(ramp, n, process=True)
    a2 = g.cpu(np.reshape, a, (8, 8), name="square")
    g.output(g.gpu(lambda gpu, m: hetero.ops.matmul(gpu, m, m), a2, name="mm"))
    got = [r async for r in shared_rt.map(g, ({"n": 64} for _ in range(3)), max_in_flight=2)]
    assert [s.kind for s in shared_rt.stats().stages] == ["process", "cpu", "gpu"]
    m = np.arange(64, dtype=np.float32).reshape(8, 8)
    for r in got:
        np.testing.assert_allclose(r, m @ m, rtol=1e-5)


def test_trace_puts_process_stages_on_their_own_track(tmp_path: Path) -> None:
    trace = tmp_path / "t.json"
    g = hetero.Graph("traced")
    x = g.input("x")
    g.output(g.cpu(add, g.cpu(add, x, 1, process=True), 1, name="inc"))
    with hetero.Runtime(cpu_threads=1, cpu_processes=1, trace=trace) as rt:
        for i in range(3):
            assert anyio.run(lambda: rt.run(g, x=i)) == i + 2
    data = json.loads(trace.read_text())
    names = {e["tid"]: e["args"]["name"] for e in data["traceEvents"] if e["name"] == "thread_name"}
    spans = [e for e in data["traceEvents"] if e["ph"] == "X" and e["name"] in ("add", "inc")]
    assert sorted((e["name"], e["cat"], names[e["tid"]]) for e in spans) == (
        [("add", "process", "hetero-proc-0")] * 3 + [("inc", "cpu", "hetero-cpu-0")] * 3)


# -- Ctrl-C --------------------------------------------------------------------------------------
SCRIPT = """
import os, time
import anyio, numpy as np
import hetero

def sleep_then(started, x, seconds):
    with open(started, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(seconds)
    return float(x.sum())

async def main():
    g = hetero.Graph("slow")
    x = g.input("x")
    g.output(*[g.cpu(sleep_then, x, np.ones({n}, np.float32), 60.0, process=True, name=f"s{{k}}")
               for k in range(2)])
    async with hetero.Runtime(cpu_processes=1) as rt:  # one stage runs, the other waits
        await rt.run(g, x={started!r})

if __name__ == "__main__":
    anyio.run(main, backend={backend!r})
"""


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_ctrl_c_leaves_no_segment_and_no_worker(tmp_path: Path, backend: str) -> None:
    started = tmp_path / "started"
    script = tmp_path / "main.py"
    script.write_text(SCRIPT.format(n=BIG, started=str(started), backend=backend))
    proc = subprocess.Popen([sys.executable, str(script)], stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # even if ignored here
    try:
        deadline = time.monotonic() + WAIT
        while not started.exists() or not started.read_text():
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline
            time.sleep(0.05)
        worker = int(started.read_text())
        assert open_segments(proc.pid) >= 2  # both stages' arguments are in shared memory
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=WAIT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    assert shm_segments(proc.pid) == []
    deadline = time.monotonic() + WAIT
    while _alive(worker):
        assert time.monotonic() < deadline, "the worker outlived its parent"
        time.sleep(0.05)


def test_pool_size_option() -> None:
    with hetero.Runtime() as rt:
        assert rt.cpu_processes == max(1, (os.cpu_count() or 2) - 1)
        assert rt._sched._procs is None  # nothing started without a process stage
    with hetero.Runtime(cpu_processes=3) as rt:
        assert rt.cpu_processes == rt.options.cpu_processes == 3
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=rf"^cpu_processes must be an integer >= 1, got {bad!r}$"):
            hetero.Runtime(cpu_processes=bad)  # type: ignore[arg-type]


async def test_warmup_starts_the_pool() -> None:
    g = one_stage(add, 1)
    with hetero.Runtime(cpu_processes=2) as rt:
        assert rt._sched._procs is None
        await rt.warmup(g)
        assert len(rt._sched.procs().pids) == 2
        assert await rt.run(g, x=1) == 2
