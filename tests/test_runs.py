"""Runs over many inputs (map: ordered or as completed, closing early) and retries (retry_on, backoff)."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import anyio
import pytest

import hetero
from hetero import GraphError, StageError
from hetero._graph import MAX_BACKOFF_S, StageOptions

pytestmark = pytest.mark.anyio

WAIT = 10.0  # bounds a wait that a passing test never reaches


async def test_unordered_map_yields_as_runs_complete(rt: hetero.Runtime) -> None:
    release = threading.Event()

    def work(i: int) -> int:
        if i == 0:
            release.wait(WAIT)  # input 0 finishes only once another result was consumed
        return i * 10

    g = hetero.Graph("asdone")
    g.output(g.cpu(work, g.input("i"), name="work"))
    got = []
    async for r in rt.map(g, ({"i": i} for i in range(2)), max_in_flight=2, ordered=False):
        got.append(r)
        release.set()
    assert got == [10, 0]


async def test_unordered_map_runs_everything_with_backpressure(rt: hetero.Runtime) -> None:
    in_flight = worst = 0
    lock = threading.Lock()

    def work(i: int) -> int:
        nonlocal in_flight, worst
        with lock:
            in_flight += 1
            worst = max(worst, in_flight)
        return i

    g = hetero.Graph("many")
    g.output(g.cpu(work, g.input("i"), name="work"))
    got = []
    async for r in rt.map(g, ({"i": i} for i in range(25)), max_in_flight=3, ordered=False):
        with lock:
            in_flight -= 1
        got.append(r)
    assert sorted(got) == list(range(25))
    assert worst <= 3


async def test_unordered_map_raises_a_failure_and_stops_the_rest(rt: hetero.Runtime) -> None:
    ran: list[int] = []

    def work(i: int) -> int:
        if i == 2:
            raise KeyError(i)
        ran.append(i)
        return i

    g = hetero.Graph("fails")
    g.output(g.cpu(work, g.input("i"), name="work"))
    with pytest.raises(StageError) as e:
        async for _ in rt.map(g, ({"i": i} for i in range(50)), max_in_flight=2, ordered=False):
            pass
    assert str(e.value) == "cpu stage 'work' failed: KeyError: 2"
    assert len(ran) < 50
    with pytest.raises(hetero.HeteroError, match="map\\(\\) inputs must be dicts of graph inputs, got int"):
        async for _ in rt.map(g, [3], ordered=False):  # type: ignore[list-item]
            pass


async def test_unordered_map_enforces_stage_timeouts(rt: hetero.Runtime) -> None:
    release = threading.Event()

    def work(i: int) -> int:
        if i == 1:
            release.wait(WAIT)
        return i

    g = hetero.Graph("slowone")
    g.output(g.cpu(work, g.input("i"), name="work", timeout=0.2))
    got = []
    try:
        with pytest.raises(StageError, match="cpu stage 'work' timed out after 0.2 s"):
            async for r in rt.map(g, ({"i": i} for i in range(2)), max_in_flight=2, ordered=False):
                got.append(r)
    finally:
        release.set()
    assert got == [0]


@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("closer", ["async with", "aclosing"])
async def test_leaving_map_early_stops_the_runs_in_flight(rt: hetero.Runtime, ordered: bool, closer: str) -> None:
    release = threading.Event()
    reached: list[int] = []

    def first(i: int) -> int:
        if i > 0:
            release.wait(WAIT)
        return i

    def second(i: int) -> int:
        reached.append(i)
        return i

    g = hetero.Graph("early")
    g.output(g.cpu(second, g.cpu(first, g.input("i"), name="first"), name="second"))
    inputs = ({"i": i} for i in range(2))
    results = rt.map(g, inputs, max_in_flight=2, ordered=ordered)
    cm = results if closer == "async with" else contextlib.aclosing(results)
    try:
        async with cm as it:
            async for r in it:
                assert r == 0
                break
        # closed: run 1 was stopped while its first stage was running; its second never starts
    finally:
        release.set()
    await anyio.sleep(0.05)
    assert reached == [0]
    with pytest.raises(StopAsyncIteration):
        await results.__anext__()
    ok = hetero.Graph("after")
    ok.output(ok.cpu(lambda: 1, name="one"))
    assert await rt.run(ok) == 1


async def test_retry_on_filters_what_is_retried(rt: hetero.Runtime) -> None:
    calls = 0

    def flaky() -> str:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ConnectionError("reset")
        if calls == 2:
            raise ValueError("bad data")
        return "ok"

    g = hetero.Graph("filtered")
    g.output(g.cpu(flaky, name="flaky", retries=5, retry_on=ConnectionError, backoff=0))
    with pytest.raises(StageError) as e:
        await rt.run(g)
    assert str(e.value) == "cpu stage 'flaky' failed after 2 attempts: ValueError: bad data"
    assert calls == 2

    calls = 0
    g2 = hetero.Graph("both")
    g2.output(g2.cpu(flaky, name="flaky", retries=5, retry_on=(ConnectionError, ValueError), backoff=0.001))
    assert await rt.run(g2) == "ok"
    assert calls == 3


async def test_gpu_stage_retries_only_what_retry_on_names(shared_rt: hetero.Runtime) -> None:
    calls = 0

    def flaky(gpu: hetero.GPUContext) -> int:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise TimeoutError(f"try {calls}")
        return calls

    g = hetero.Graph("gpuretry")
    g.output(g.gpu(flaky, name="flaky", retries=2, retry_on=(TimeoutError,), backoff=0.001))
    assert await shared_rt.run(g) == 3
    calls = 0
    g2 = hetero.Graph("gpunoretry")
    g2.output(g2.gpu(flaky, name="flaky", retries=2, retry_on=KeyError))
    with pytest.raises(StageError, match="gpu stage 'flaky' failed: TimeoutError: try 1"):
        await shared_rt.run(g2)
    assert calls == 1


async def test_backoff_is_cut_short_when_the_run_stops() -> None:
    calls = 0

    def fails() -> None:
        nonlocal calls
        calls += 1
        raise ConnectionError("down")

    g = hetero.Graph("longwait")
    g.output(g.cpu(fails, name="fails", retries=3, backoff=3600, timeout=0.2))
    with hetero.Runtime(cpu_threads=1) as rt:
        with pytest.raises(StageError, match="timed out"):
            await rt.run(g)
        ok = hetero.Graph("next")
        ok.output(ok.cpu(lambda: 2, name="two"))
        assert await rt.run(ok) == 2  # the only worker left its backoff when the run stopped
    assert calls == 1


def test_backoff_doubles_up_to_a_cap() -> None:
    o = StageOptions(retries=10, backoff_s=0.01)
    assert [o.retry_delay_s(n) for n in (1, 2, 3, 4)] == [0.01, 0.02, 0.04, 0.08]
    assert o.retry_delay_s(20) == MAX_BACKOFF_S
    assert StageOptions(backoff_s=0).retry_delay_s(5) == 0.0
    assert StageOptions(backoff_s=60).retry_delay_s(3) == 60.0


@pytest.mark.parametrize(("kw", "msg"), [
    ({"retry_on": ValueError("x")}, "retry_on must be an exception type or a non-empty tuple of them, got ValueError('x')"),
    ({"retry_on": ()}, "retry_on must be an exception type or a non-empty tuple of them, got ()"),
    ({"retry_on": (int,)}, "retry_on must be an exception type or a non-empty tuple of them, got (<class 'int'>,)"),
    ({"backoff": -1}, "backoff must be a number of seconds >= 0, got -1"),
    ({"backoff": float("inf")}, "backoff must be a number of seconds >= 0, got inf"),
])
def test_bad_retry_options(kw: dict, msg: str) -> None:
    g = hetero.Graph("opts")
    with pytest.raises(GraphError) as e:
        g.cpu(int, 1, name="s", retries=1, **kw)
    assert str(e.value) == msg


def connection_then_value_error(path: str) -> str:
    """Raises ConnectionError on its first call (per path), ValueError after."""
    p = Path(path)
    if not p.exists():
        p.write_text("x")
        raise ConnectionError("first")
    raise ValueError("second")


async def test_process_stage_retries_follow_retry_on(tmp_path: Path) -> None:
    g = hetero.Graph("procretry")
    g.output(g.cpu(connection_then_value_error, g.input("x"), process=True, retries=3, retry_on=ConnectionError,
                   backoff=0.001))
    with hetero.Runtime(cpu_threads=1, cpu_processes=1) as rt:
        with pytest.raises(StageError, match="failed after 2 attempts: ValueError: second"):
            await rt.run(g, x=str(tmp_path / "marker"))


async def test_start_returns_before_the_run_ends_and_result_waits(rt: hetero.Runtime) -> None:
    release = threading.Event()

    def work(i: int) -> int:
        release.wait(WAIT)
        return i + 1

    g = hetero.Graph("started")
    g.output(g.cpu(work, g.input("i"), name="work"))
    first, second = rt.start(g, i=1), rt.start(g, i=2)
    assert not first.done and not second.done
    assert "running" in repr(first)
    release.set()
    assert await second.result() == 3
    assert await first.result() == 2
    assert first.done
    with pytest.raises(hetero.HeteroError, match="already taken"):
        await first.result()


async def test_start_raises_bad_inputs_at_once_and_errors_at_result(rt: hetero.Runtime) -> None:
    def boom(i: int) -> int:
        raise ValueError(f"bad {i}")

    g = hetero.Graph("startfail")
    g.output(g.cpu(boom, g.input("i"), name="boom"))
    with pytest.raises(hetero.HeteroError, match="i"):
        rt.start(g)  # the input is missing
    started = rt.start(g, i=7)
    with pytest.raises(StageError, match="bad 7"):
        await started.result()


async def test_cancelling_a_started_run_stops_what_it_has_not_begun(rt: hetero.Runtime) -> None:
    release = threading.Event()
    ran: list[str] = []

    def first(i: int) -> int:
        release.wait(WAIT)
        ran.append("first")
        return i

    def second(i: int) -> int:
        ran.append("second")
        return i

    g = hetero.Graph("startcancel")
    g.output(g.cpu(second, g.cpu(first, g.input("i"), name="first"), name="second"))
    started = rt.start(g, i=1)
    threading.Timer(0.2, release.set).start()  # "first" ends after the run was stopped
    await started.cancel()
    await started.cancel()  # a second cancel does nothing
    assert started.done
    release.wait(WAIT)
    await anyio.sleep(0.2)
    assert "second" not in ran
    with pytest.raises(hetero.HeteroError, match="already taken"):
        await started.result()


def _double(x: int) -> int:
    return 2 * x


async def test_a_run_of_inline_stages_yields_to_the_loop_and_leaves_nothing_queued(rt: hetero.Runtime) -> None:
    """Such a run ends inside ``rt.run`` before it awaits anything: the caller still yields once to the
    loop's other tasks (a loop of runs must not starve them), and no wake-up of it waits on the loop
    (callbacks that would each hold a finished run until the caller next yields)."""
    import gc

    from hetero._run import Run

    g = hetero.Graph("inline-runs-yield")
    g.output(g.cpu(_double, g.input("x"), name="double", inline=True))
    ticks = 0

    async def other() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        tg.start_soon(other)
        await anyio.lowlevel.checkpoint()
        start = ticks
        for i in range(100):
            assert await rt.run(g, x=i) == 2 * i
        assert ticks - start >= 50  # the other task ran between the runs
        tg.cancel_scope.cancel()
    gc.collect()
    alive = [o for o in gc.get_objects() if isinstance(o, Run) and o.plan.name == g.name]
    assert len(alive) <= 1  # the runtime keeps its last run (for its stats)
