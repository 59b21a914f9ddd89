"""Running graphs: ordering, overlap, failures, cancellation, retries, timeouts, map."""

from __future__ import annotations

import operator
import threading
import time

import anyio
import numpy as np
import pytest

import hetero
from hetero import StageError

pytestmark = pytest.mark.anyio

WAIT = 10.0  # generous bound for anything that should happen at once (never hit when passing)


async def test_diamond(rt: hetero.Runtime) -> None:
    """
    ::

          x
         / \\
        a   b
         \\ /
          c
    """
    g = hetero.Graph("diamond")
    x = g.input("x")
    a = g.cpu(operator.add, x, 1, name="a")
    b = g.cpu(operator.mul, x, 10, name="b")
    c = g.cpu(operator.sub, b, a, name="c")
    g.output(c)
    assert await rt.run(g, x=3) == 26
    assert await rt.run(g, x=0) == -1  # the plan is reused across runs


async def test_wide_fan_out_fan_in(rt: hetero.Runtime) -> None:
    """
    ::

        x -> s0 .. s63 -> total
    """
    g = hetero.Graph("wide")
    x = g.input("x")
    parts = [g.cpu(operator.mul, x, k, name=f"s{k}") for k in range(64)]
    g.output(g.cpu(lambda *v: sum(v), *parts, name="total"), parts[5])
    assert await rt.run(g, x=2) == (2 * sum(range(64)), 10)


async def test_constants_kwargs_and_input_outputs(rt: hetero.Runtime) -> None:
    def fmt(value: int, *, prefix: str, suffix: str = "") -> str:
        return f"{prefix}{value}{suffix}"

    g = hetero.Graph("kw")
    x = g.input("x")
    sep = g.input("sep")
    s = g.cpu(fmt, x, prefix="<", suffix=sep, name="fmt")
    g.output(s, x)
    assert await rt.run(g, x=7, sep=">") == ("<7>", 7)


async def test_independent_stages_really_overlap(rt: hetero.Runtime) -> None:
    """Two stages that can only finish if they run at the same time (a barrier of 2)."""
    barrier = threading.Barrier(2)

    def meet(tag: str) -> str:
        barrier.wait(timeout=WAIT)  # raises BrokenBarrierError if run one after the other
        return tag

    g = hetero.Graph("overlap")
    g.output(g.cpu(meet, "a", name="a"), g.cpu(meet, "b", name="b"))
    assert await rt.run(g) == ("a", "b")


async def test_thread_pool_is_bounded() -> None:
    seen: set[str] = set()
    active = 0
    peak = 0
    lock = threading.Lock()

    def work(i: int) -> int:
        nonlocal active, peak
        with lock:
            active += 1
            peak = max(peak, active)
            seen.add(threading.current_thread().name)
        time.sleep(0.002)
        with lock:
            active -= 1
        return i

    g = hetero.Graph("bounded")
    g.output(*[g.cpu(work, i, name=f"w{i}") for i in range(30)])
    with hetero.Runtime(cpu_threads=3) as rt:
        assert await rt.run(g) == tuple(range(30))
    assert peak <= 3
    assert len(seen) <= 3


async def test_critical_path_runs_first_when_workers_are_scarce() -> None:
    """
    With one worker, the head of the long chain goes before the short stages::

        short0 short1 short2
        long0 -> long1 -> long2 -> long3
    """
    order: list[str] = []

    def rec(name: str, *_: object) -> str:
        order.append(name)
        return name

    g = hetero.Graph("prio")
    shorts = [g.cpu(rec, f"short{i}", name=f"short{i}") for i in range(3)]
    prev = g.cpu(rec, "long0", name="long0")
    for k in range(1, 4):
        prev = g.cpu(rec, f"long{k}", prev, name=f"long{k}")
    g.output(prev, *shorts)
    with hetero.Runtime(cpu_threads=1) as rt:
        await rt.run(g)
    assert order[0] == "long0"
    assert order.index("long1") < order.index("short0")


async def test_failure_names_the_stage_and_chains_the_cause(rt: hetero.Runtime) -> None:
    def boom(v: int) -> int:
        raise ValueError(f"bad value {v}")

    g = hetero.Graph("fail")
    x = g.input("x")
    a = g.cpu(boom, x, name="explode")
    g.output(g.cpu(operator.neg, a, name="after"))
    with pytest.raises(StageError) as e:
        await rt.run(g, x=3)
    assert str(e.value) == "cpu stage 'explode' failed: ValueError: bad value 3"
    assert e.value.stage == "explode"
    assert isinstance(e.value.__cause__, ValueError)


async def test_first_failure_stops_scheduling(rt: hetero.Runtime) -> None:
    """
    ::

        fail          slow -> never
    """
    release = threading.Event()
    ran: list[str] = []

    def fail() -> None:
        raise RuntimeError("no")

    def slow() -> int:
        release.wait(WAIT)
        return 1

    def never(v: int) -> int:
        ran.append("never")
        return v

    g = hetero.Graph("stop")
    g.cpu(fail, name="fail")
    s = g.cpu(slow, name="slow")
    g.output(g.cpu(never, s, name="never"))
    with pytest.raises(StageError, match="'fail'"):
        await rt.run(g)
    release.set()
    await anyio.sleep(0.05)
    assert ran == []


async def test_cancellation_mid_run_then_reuse(rt: hetero.Runtime) -> None:
    started = threading.Event()
    release = threading.Event()
    ran_after: list[int] = []

    def block() -> int:
        started.set()
        release.wait(WAIT)
        return 1

    def after(v: int) -> int:
        ran_after.append(v)
        return v

    g = hetero.Graph("cancel")
    g.output(g.cpu(after, g.cpu(block, name="block"), name="after"))

    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            async def cancel_when_started() -> None:
                await anyio.to_thread.run_sync(started.wait, WAIT)
                scope.cancel()

            tg.start_soon(cancel_when_started)
            await rt.run(g)
    assert scope.cancelled_caught
    release.set()
    await anyio.sleep(0.05)
    assert ran_after == []  # nothing was scheduled after the cancel

    ok = hetero.Graph("ok")
    ok.output(ok.cpu(operator.add, 1, 2, name="add"))
    assert await rt.run(ok) == 3  # the runtime is still usable


async def test_retries(rt: hetero.Runtime) -> None:
    calls = 0

    def flaky() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise ConnectionError(f"try {calls}")
        return "ok"

    g = hetero.Graph("retry")
    g.output(g.cpu(flaky, name="flaky", retries=2))
    assert await rt.run(g) == "ok"
    assert calls == 3

    calls = 0
    g2 = hetero.Graph("retry2")
    g2.output(g2.cpu(flaky, name="flaky", retries=1))
    with pytest.raises(StageError) as e:
        await rt.run(g2)
    assert str(e.value) == "cpu stage 'flaky' failed after 2 attempts: ConnectionError: try 2"


async def test_timeout_fails_a_stuck_stage(rt: hetero.Runtime) -> None:
    release = threading.Event()
    returned: list[int] = []

    def stuck() -> int:
        release.wait(WAIT)  # until the test lets it go (WAIT only bounds a broken watcher)
        returned.append(1)
        return 1

    g = hetero.Graph("slow")
    g.output(g.cpu(stuck, name="stuck", timeout=0.1))
    try:
        with pytest.raises(StageError) as e:
            await rt.run(g)
        assert returned == []  # raised by the watcher while the stage was still stuck
    finally:
        release.set()
    assert str(e.value) == "cpu stage 'stuck' timed out after 0.1 s"
    assert isinstance(e.value.__cause__, TimeoutError)


async def test_timeout_not_hit(rt: hetero.Runtime) -> None:
    g = hetero.Graph("fast")
    g.output(g.cpu(operator.add, 1, 1, name="add", timeout=5))
    assert await rt.run(g) == 2


async def test_map_keeps_input_order(rt: hetero.Runtime) -> None:
    def work(i: int) -> int:
        time.sleep(0.001 * ((7 * i) % 5))  # later inputs sometimes finish first
        return i * i

    g = hetero.Graph("sq")
    g.output(g.cpu(work, g.input("i"), name="work"))
    out = [r async for r in rt.map(g, ({"i": i} for i in range(40)), max_in_flight=6)]
    assert out == [i * i for i in range(40)]


async def test_map_backpressure(rt: hetero.Runtime) -> None:
    """A slow consumer holds back the producer: never more than max_in_flight unconsumed runs."""
    started = 0
    consumed = 0
    worst = 0
    lock = threading.Lock()

    def work(i: int) -> int:
        nonlocal started, worst
        with lock:
            started += 1
            worst = max(worst, started - consumed)
        return i

    g = hetero.Graph("bp")
    g.output(g.cpu(work, g.input("i"), name="work"))
    async for _ in rt.map(g, ({"i": i} for i in range(30)), max_in_flight=3):
        await anyio.sleep(0.002)
        with lock:
            consumed += 1
    assert started == 30
    assert worst <= 3


async def test_map_raises_first_failure_in_order(rt: hetero.Runtime) -> None:
    def work(i: int) -> int:
        if i == 5:
            raise KeyError(i)
        return i

    g = hetero.Graph("mapfail")
    g.output(g.cpu(work, g.input("i"), name="work"))
    got = []
    with pytest.raises(StageError, match="'work' failed: KeyError: 5"):
        async for r in rt.map(g, ({"i": i} for i in range(10)), max_in_flight=4):
            got.append(r)
    assert got == [0, 1, 2, 3, 4]


async def test_map_input_errors_come_in_order(rt: hetero.Runtime) -> None:
    g = hetero.Graph("mapin")
    g.output(g.cpu(operator.neg, g.input("i"), name="neg"))
    got = []
    with pytest.raises(hetero.InputError, match="missing input"):
        async for r in rt.map(g, [{"i": 1}, {"i": 2}, {"j": 3}]):
            got.append(r)
    assert got == [-1, -2]


async def test_stage_raising_base_exception_does_not_kill_workers(rt: hetero.Runtime) -> None:
    def bye() -> None:
        raise SystemExit(3)

    g = hetero.Graph("exit")
    g.output(g.cpu(bye, name="bye"))
    with pytest.raises(StageError, match="'bye' failed: SystemExit: 3"):
        await rt.run(g)
    ok = hetero.Graph("ok")
    ok.output(*[ok.cpu(operator.add, i, 1, name=f"a{i}") for i in range(4)])
    assert await rt.run(ok) == (1, 2, 3, 4)


async def test_closed_runtime_refuses() -> None:
    rt = hetero.Runtime()
    rt.close()
    g = hetero.Graph("c")
    g.output(g.cpu(operator.add, 1, 2, name="add"))
    with pytest.raises(hetero.RuntimeClosedError):
        await rt.run(g)


def test_sync_run() -> None:
    g = hetero.Graph("sync")
    g.output(g.cpu(operator.add, g.input("x"), 1, name="inc"))
    assert hetero.run(g, x=41) == 42


async def test_sync_run_inside_a_loop_is_refused() -> None:
    g = hetero.Graph("nested")
    g.output(g.cpu(operator.add, 1, 1, name="add"))
    with pytest.raises(hetero.HeteroError, match="cannot be called inside a running .* event loop"):
        hetero.run(g)


def test_asyncio_task_cancel_then_reuse() -> None:
    import asyncio

    release = threading.Event()
    started = threading.Event()

    def block() -> int:
        started.set()
        release.wait(WAIT)
        return 1

    g = hetero.Graph("acancel")
    g.output(g.cpu(block, name="block"))

    async def main(rt: hetero.Runtime) -> int:
        task = asyncio.ensure_future(rt.run(g))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, WAIT)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        ok = hetero.Graph("ok")
        ok.output(ok.cpu(operator.add, 2, 2, name="add"))
        return await rt.run(ok)

    with hetero.Runtime() as rt:
        assert asyncio.run(main(rt)) == 4


@pytest.mark.parametrize(
    ("kw", "msg"),
    [
        ({"cpu_threads": 0}, "cpu_threads must be an integer >= 1, got 0"),
        ({"gpu_threads": 1.5}, "gpu_threads must be an integer >= 1, got 1.5"),
        ({"submit_batch": True}, "submit_batch must be an integer >= 1, got True"),
        ({"memory_budget": -1}, "memory_budget must be a positive number of bytes, got -1"),
        ({"gpu_budget_ms": 0}, "gpu_budget_ms must be a positive number of milliseconds, got 0.0"),
    ],
)
def test_runtime_options_are_validated(kw: dict, msg: str) -> None:
    with pytest.raises(ValueError) as e:
        hetero.Runtime(**kw)
    assert str(e.value) == msg


def test_runtime_options_record() -> None:
    with hetero.Runtime(cpu_threads=3, gpu_budget_ms=50) as rt:
        assert rt.options == hetero.RuntimeOptions(cpu_threads=3, gpu_budget_ms=50.0)
        assert rt.cpu_threads == 3


ADD_ONE = """
@group(0) @binding(0) var<storage, read> src: array<f32>;
@group(0) @binding(1) var<storage, read_write> dst: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if (i < arrayLength(&dst)) { dst[i] = src[i] + 1.0; }
}
"""


def _slow_gpu_graph(started: threading.Event, release: threading.Event) -> hetero.Graph:
    """
    ::

        x -> first (gpu) -> slow (gpu: takes temporaries, then waits inside recording) -> out
    """
    def first(gpu: hetero.GPUContext, t: hetero.Tensor) -> hetero.Tensor:
        out = gpu.empty(t.shape)
        gpu.dispatch(ADD_ONE, (t.size + 63) // 64, t, out)
        return out

    def slow(gpu: hetero.GPUContext, t: hetero.Tensor) -> hetero.Tensor:
        tmp = [gpu.empty(64 * 1024) for _ in range(3)]  # pooled temporaries held while recording
        out = gpu.empty(t.shape)
        gpu.dispatch(ADD_ONE, (t.size + 63) // 64, t, tmp[0])
        started.set()
        release.wait(WAIT)
        gpu.dispatch(ADD_ONE, (t.size + 63) // 64, tmp[0], out)
        return out

    g = hetero.Graph("slow-record")
    g.output(g.gpu(slow, g.gpu(first, g.input("x"), name="first"), name="slow"))
    return g


@pytest.mark.parametrize("how", ["cancel", "deadline"])
async def test_cancelled_run_returns_its_gpu_memory_before_it_returns(shared_rt: hetero.Runtime, how: str) -> None:
    """A run cancelled while a GPU stage is being recorded returns only once that stage let go
    of its temporaries and its input; the event loop keeps running meanwhile."""
    started, release = threading.Event(), threading.Event()
    g = _slow_gpu_graph(started, release)
    x = np.arange(1000, dtype=np.float32)
    np.testing.assert_array_equal(await shared_rt.run(_slow_gpu_graph(threading.Event(), _set()), x=x), x + 3)
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await anyio.sleep(0.005)

    async def cancel_when_recording(scope: anyio.CancelScope) -> None:
        await anyio.to_thread.run_sync(started.wait, WAIT)
        if how == "cancel":
            scope.cancel()
        else:
            scope.deadline = anyio.current_time()  # as move_on_after does when it expires
        before = ticks
        while ticks < before + 3:  # the loop runs while the cancelled run waits for the stage
            await anyio.sleep(0.005)
        release.set()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(tick)
            with anyio.move_on_after(WAIT) as scope:
                tg.start_soon(cancel_when_recording, scope)
                await shared_rt.run(g, x=x)
            s = shared_rt.memory_stats()
            assert (s.in_use_bytes, s.blocks_in_use) == (0, 0)
            assert scope.cancelled_caught and release.is_set()  # it returned once the stage let go
            tg.cancel_scope.cancel()
    finally:
        release.set()


def _set() -> threading.Event:
    e = threading.Event()
    e.set()
    return e


@pytest.mark.parametrize("ordered", [True, False])
async def test_map_failure_returns_the_memory_of_the_runs_behind_it(shared_rt: hetero.Runtime, ordered: bool) -> None:
    """
    ::

        mode -> gate (cpu: fails for mode 1)
        x ----> work (gpu: temporaries; for mode 2 waits inside recording)

    Run 0 fails while run 1's GPU stage is being recorded; map() raises once run 1 let go.
    """
    started, release = threading.Event(), threading.Event()

    def gate(mode: int) -> int:
        if mode == 1:
            started.wait(WAIT)
            raise ValueError("planned failure")
        return mode

    def work(gpu: hetero.GPUContext, t: hetero.Tensor, mode: int) -> hetero.Tensor:
        tmp = gpu.empty(64 * 1024)
        out = gpu.empty(t.shape)
        gpu.dispatch(ADD_ONE, (t.size + 63) // 64, t, tmp)
        if mode == 2:
            started.set()
            release.wait(WAIT)
        gpu.dispatch(ADD_ONE, (t.size + 63) // 64, tmp, out)
        return out

    g = hetero.Graph("map-letgo")
    x, mode = g.input("x"), g.input("mode")
    g.output(g.cpu(gate, mode, name="gate"), g.gpu(work, x, mode, name="work"))
    xs = np.zeros(500, np.float32)

    async def release_later() -> None:
        await anyio.to_thread.run_sync(started.wait, WAIT)
        await anyio.sleep(0.1)
        release.set()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(release_later)
            with pytest.raises(StageError, match="'gate' failed: ValueError: planned failure"):
                async for _ in shared_rt.map(g, [{"x": xs, "mode": m} for m in (1, 2, 0, 0)], max_in_flight=3,
                                             ordered=ordered):
                    pass
            s = shared_rt.memory_stats()
            assert (s.in_use_bytes, s.blocks_in_use) == (0, 0)
            assert release.is_set()
    finally:
        release.set()


def test_asyncio_task_cancel_returns_gpu_memory() -> None:
    """A plain ``task.cancel()`` (no anyio scope) also lets the run return only once its memory is back."""
    import asyncio

    started, release = threading.Event(), threading.Event()
    g = _slow_gpu_graph(started, release)

    async def main(rt: hetero.Runtime) -> tuple[bool, int]:
        task = asyncio.ensure_future(rt.run(g, x=np.ones(100, np.float32)))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, WAIT)
        task.cancel()
        asyncio.get_running_loop().call_later(0.05, release.set)
        with pytest.raises(asyncio.CancelledError):
            await task
        return release.is_set(), rt.memory_stats().in_use_bytes

    try:
        with hetero.Runtime() as rt:
            assert asyncio.run(main(rt)) == (True, 0)
    finally:
        release.set()


async def test_cancelled_run_stops_waiting_for_a_stage_that_never_lets_go(
        shared_rt: hetero.Runtime, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A stage function stuck in recording does not hang the cancelled caller: the run returns
    after the cleanup wait, says so in the log, and the memory comes back when the stage ends."""
    import hetero._scheduler

    monkeypatch.setattr(hetero._scheduler, "_CLEANUP_WAIT", 0.05)
    started, release = threading.Event(), threading.Event()
    g = _slow_gpu_graph(started, release)
    try:
        with anyio.move_on_after(WAIT) as scope:
            async with anyio.create_task_group() as tg:
                async def cancel_when_recording() -> None:
                    await anyio.to_thread.run_sync(started.wait, WAIT)
                    scope.cancel()

                tg.start_soon(cancel_when_recording)
                await shared_rt.run(g, x=np.ones(10, np.float32))
        assert scope.cancelled_caught and not release.is_set()
        assert "a GPU stage is still being recorded 0.05 s after the run stopped" in caplog.text
    finally:
        release.set()
    with anyio.fail_after(WAIT):
        while shared_rt.memory_stats().in_use_bytes:
            await anyio.sleep(0.01)


@pytest.mark.parametrize("end", ["done", "failed", "cancelled"])
async def test_a_returned_run_keeps_no_intermediate_values(rt: hetero.Runtime, end: str) -> None:
    """
    ::

        x -> big (cpu) -> small (cpu) -> last (cpu: fails or waits when asked)

    Once the run returned, however it ended, the runtime holds none of its values (``stats()``
    of the last run included): a large intermediate is freed when its consumers are done.
    """
    import weakref

    refs: list[weakref.ref[np.ndarray]] = []
    started, release = threading.Event(), threading.Event()

    def big(x: int) -> np.ndarray:
        a = np.full(1 << 16, x, np.float32)
        refs.append(weakref.ref(a))
        return a

    def last(v: float) -> float:
        started.set()
        if end == "failed":
            raise ValueError("planned failure")
        if end == "cancelled":
            release.wait(WAIT)
        return v

    g = hetero.Graph("drop")
    small = g.cpu(lambda a: float(a[0]), g.cpu(big, g.input("x"), name="big"), name="small")
    g.output(g.cpu(last, small, name="last"))
    if end == "done":
        assert await rt.run(g, x=3) == 3.0
    elif end == "failed":
        with pytest.raises(StageError, match="'last' failed"):
            await rt.run(g, x=3)
    else:
        with anyio.move_on_after(WAIT) as scope:
            async with anyio.create_task_group() as tg:
                async def cancel_when_started() -> None:
                    await anyio.to_thread.run_sync(started.wait, WAIT)
                    scope.cancel()
                    release.set()

                tg.start_soon(cancel_when_started)
                await rt.run(g, x=3)
        assert scope.cancelled_caught
    assert len(refs) == 1 and refs[0]() is None
    assert rt.stats().stages[0].name == "big"  # what stats() reports is kept


async def test_a_returned_run_keeps_no_download_on_staging_memory(shared_rt: hetero.Runtime) -> None:
    """
    ::

        x -> first (gpu, 1 MiB) -> head (cpu: reads it as a view of mapped staging memory)

    The view is the run's value only: once the run returned, its staging buffer is back in the ring.
    """
    def add_one(gpu: hetero.GPUContext, t: hetero.Tensor) -> hetero.Tensor:
        out = gpu.empty(t.shape)
        groups = (t.size + 63) // 64
        gpu.dispatch(ADD_ONE, groups, t, out)
        return out

    g = hetero.Graph("staged")
    g.output(g.cpu(lambda a: float(a[-1]), g.gpu(add_one, g.input("x"), name="first"), name="head"))
    x = np.arange(1 << 18, dtype=np.float32)  # 1 MiB: CPU stages read it without a copy
    ring = shared_rt.device().ring
    before = ring.stats()["zero_copy_bytes"]  # arrays other tests may still hold
    assert await shared_rt.run(g, x=x) == float(x[-1] + 1)
    assert ring.stats()["zero_copy_bytes"] <= before


async def test_gpu_stage_returning_a_tensor_it_kept_from_an_earlier_run(shared_rt: hetero.Runtime,
                                                                        rt: hetero.Runtime) -> None:
    """A tensor kept across runs (its memory went back to the pool) or made by another Runtime
    is refused naming the stage; the recording thread survives and the pool's counts stay right."""
    kept: dict[str, hetero.Tensor] = {}

    def keep(gpu: hetero.GPUContext, t: hetero.Tensor) -> hetero.Tensor:
        if "t" not in kept:
            kept["t"] = gpu.empty(t.shape)
            gpu.dispatch(ADD_ONE, (t.size + 63) // 64, t, kept["t"])
        return kept["t"]

    g = hetero.Graph("keep")
    g.output(g.gpu(keep, g.input("x"), name="keep"))
    x = np.ones(4, np.float32)
    with anyio.fail_after(WAIT):
        np.testing.assert_array_equal(await shared_rt.run(g, x=x), x + 1)
        with pytest.raises(StageError) as e:
            await shared_rt.run(g, x=x)
        assert str(e.value) == (
            "gpu stage 'keep' failed: ValueError: the stage returned a Tensor whose memory (16 bytes) was "
            "already given back to the pool, e.g. one kept from an earlier run; return tensors made in this "
            "stage or passed to it, and make tensors that outlive a run with gpu.resident()")
        assert shared_rt.memory_stats().in_use_bytes == 0
        with pytest.raises(StageError, match="'keep' failed: ValueError: the stage returned a Tensor of "
                                             "another Runtime's device"):
            await rt.run(g, x=x)
        assert rt.memory_stats().in_use_bytes == 0
        kept.clear()
        for r in (shared_rt, rt):  # both recording threads still work
            np.testing.assert_array_equal(await r.run(g, x=x), x + 1)
            kept.clear()


async def test_a_defect_outside_the_stage_function_fails_the_run_not_the_thread(
        rt: hetero.Runtime, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A fault injected into the scheduler's own bookkeeping while a GPU stage is recorded fails
    that run naming the stage, and is logged; the recording thread goes on serving later runs."""
    from hetero._scheduler import Run

    hold = Run.hold
    faults = [RuntimeError("injected fault")]

    def faulty_hold(self: Run, i: int, blocks: list) -> bool:
        if faults:
            raise faults.pop()
        return hold(self, i, blocks)

    monkeypatch.setattr(Run, "hold", faulty_hold)

    def add_one(gpu: hetero.GPUContext, t: hetero.Tensor) -> hetero.Tensor:
        out = gpu.empty(t.shape)
        gpu.dispatch(ADD_ONE, (t.size + 63) // 64, t, out)
        return out

    g = hetero.Graph("fault")
    g.output(g.gpu(add_one, g.input("x"), name="add_one"))
    x = np.zeros(8, np.float32)
    with anyio.fail_after(WAIT):
        with pytest.raises(StageError, match="^gpu stage 'add_one' failed: RuntimeError: injected fault$"):
            await rt.run(g, x=x)
        assert "recording GPU stage 'add_one' failed outside the stage function" in caplog.text
        np.testing.assert_array_equal(await rt.run(g, x=x), x + 1)


async def test_a_defect_completing_a_gpu_stage_fails_the_run(rt: hetero.Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault injected where the fence thread completes a GPU stage fails the run naming the
    stage instead of leaving it waiting forever; later runs complete."""
    from hetero._scheduler import Scheduler

    completed = Scheduler._gpu_completed
    faults = [RuntimeError("injected fault")]

    def faulty(self: Scheduler, *args: object) -> None:
        if faults:
            raise faults.pop()
        completed(self, *args)

    monkeypatch.setattr(Scheduler, "_gpu_completed", faulty)
    g = hetero.Graph("fault-done")
    g.output(g.gpu(lambda gpu, t: hetero.ops.add(gpu, t, t), g.input("x"), name="double"))
    x = np.ones(8, np.float32)
    with anyio.fail_after(WAIT):
        with pytest.raises(StageError, match="^gpu stage 'double' failed: RuntimeError: injected fault$"):
            await rt.run(g, x=x)
        np.testing.assert_array_equal(await rt.run(g, x=x), 2 * x)


async def test_a_defect_after_a_cpu_stage_fails_the_run(rt: hetero.Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault injected into the bookkeeping after a CPU stage returned fails the run naming the
    stage instead of leaving it waiting forever; later runs complete."""
    from hetero._scheduler import Run

    complete = Run.complete
    faults = [RuntimeError("injected fault")]

    def faulty(self: Run, *args: Any) -> tuple[list[int], list[int]]:
        if faults:
            raise faults.pop()
        return complete(self, *args)

    monkeypatch.setattr(Run, "complete", faulty)
    g = hetero.Graph("fault-cpu")
    g.output(g.cpu(operator.neg, g.cpu(operator.add, g.input("x"), 1, name="inc"), name="neg"))
    with anyio.fail_after(WAIT):
        with pytest.raises(StageError, match="^cpu stage 'inc' failed: RuntimeError: injected fault$"):
            await rt.run(g, x=1)
        assert await rt.run(g, x=1) == -2


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_settled_waits_through_a_cancellation_requested_before_its_shield(shared_rt: hetero.Runtime) -> None:
    """Under asyncio, a task.cancel() that lands just before a stopped run's shielded wait still
    arrives inside it: the wait goes on until the run's blocks are back, then the cancellation
    is raised."""
    import asyncio

    started, release = threading.Event(), threading.Event()
    x = np.arange(1000, dtype=np.float32)
    run = shared_rt._start(_slow_gpu_graph(started, release), {"x": x})
    try:
        await anyio.to_thread.run_sync(started.wait, WAIT)
        run.stop()  # the slow stage is still being recorded, holding its temporaries
        assert shared_rt.memory_stats().in_use_bytes > 0
        timer = threading.Timer(0.2, release.set)
        timer.start()
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run.settled()
        task.uncancel()
        assert release.is_set()  # it waited for the stage to let go
        s = shared_rt.memory_stats()
        assert (s.in_use_bytes, s.blocks_in_use) == (0, 0)
    finally:
        release.set()
        run.forget_values()


async def test_inline_stages_run_on_the_thread_that_makes_them_ready(shared_rt: hetero.Runtime) -> None:
    """``inline=True``: no hand-off to a CPU worker; what an inline stage readies that is not
    inline still goes to a worker, so a slow stage never holds up the thread it was readied on."""
    def where(*_: object) -> str:
        return threading.current_thread().name

    g = hetero.Graph("inline")
    x = g.input("x")
    first = g.cpu(where, x, name="first", inline=True)  # readied at the start: the caller's thread
    worker = g.cpu(where, x, name="worker")
    after_worker = g.cpu(where, worker, name="after_worker", inline=True)
    dev = g.gpu(lambda gpu, a: hetero.ops.add(gpu, a, a), x, name="dev")
    after_gpu = g.cpu(where, dev, name="after_gpu", inline=True)  # readied where the download lands
    heavy = g.cpu(where, after_gpu, name="heavy")  # not inline: a CPU worker, not that thread
    g.output(first, worker, after_worker, after_gpu, heavy)
    loop_thread = threading.current_thread().name
    for _ in range(3):
        got = await shared_rt.run(g, x=np.arange(4, dtype=np.float32))
        assert got[0] == loop_thread
        assert got[1].startswith("hetero-cpu-") and got[2] == got[1]
        assert not got[3].startswith("hetero-cpu-") and got[3] != loop_thread
        assert got[4].startswith("hetero-cpu-")


def test_inline_takes_no_process_or_timeout() -> None:
    g = hetero.Graph("inline-bad")
    x = g.input("x")
    for kw in ({"process": True}, {"timeout": 1.0}):
        with pytest.raises(hetero.GraphError, match="inline=True runs the stage on the thread that makes it ready"):
            g.cpu(abs, x, name="bad", inline=True, **kw)
    with pytest.raises(hetero.GraphError, match="inline must be True or False, got 1"):
        g.cpu(abs, x, name="bad", inline=1)  # type: ignore[arg-type]


async def test_a_graph_of_one_inline_stage_and_an_inline_failure(rt: hetero.Runtime) -> None:
    g = hetero.Graph("one-inline")
    g.output(g.cpu(operator.add, g.input("x"), 1, name="inc", inline=True))
    assert await rt.run(g, x=1) == 2  # the whole run happens inside its start, on this thread
    bad = hetero.Graph("inline-fails")
    bad.output(g2 := bad.cpu(operator.truediv, bad.input("x"), 0, name="boom", inline=True))
    assert g2.name == "boom"
    with pytest.raises(StageError, match="cpu stage 'boom' failed: ZeroDivisionError"):
        await rt.run(bad, x=1)
    assert await rt.run(g, x=5) == 6
