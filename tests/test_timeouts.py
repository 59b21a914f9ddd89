"""Timed-out CPU thread stages give their worker back: the pool replaces the stuck thread."""

from __future__ import annotations

import logging
import operator
import threading
from collections.abc import Iterator

import anyio
import pytest

import hetero
from hetero import StageError

pytestmark = pytest.mark.anyio

WAIT = 20.0  # hang guard for anything that should happen soon (never hit when passing)
TIMEOUT = 0.05


@pytest.fixture
def release() -> Iterator[threading.Event]:
    """Set at teardown: every hanging stage function of the test returns, no thread outlives it."""
    ev = threading.Event()
    yield ev
    ev.set()


def hanging_graph(release: threading.Event, name: str = "hang") -> hetero.Graph:
    """
    ::

        hang (timeout)
    """
    def hang() -> int:
        release.wait(WAIT)
        return 1

    g = hetero.Graph("hangs")
    g.output(g.cpu(hang, name=name, timeout=TIMEOUT))
    return g


def adding_graph() -> hetero.Graph:
    """
    ::

        x
        |
        a   b
         \\ /
          c
    """
    g = hetero.Graph("fresh")
    x = g.input("x")
    a = g.cpu(operator.add, x, 1, name="a")
    b = g.cpu(operator.mul, x, 10, name="b")
    g.output(g.cpu(operator.add, a, b, name="c"))
    return g


async def wait_abandoned(rt: hetero.Runtime, n: int) -> None:
    with anyio.fail_after(WAIT):
        while rt.abandoned_threads != n:
            await anyio.sleep(0.01)


async def test_ten_hung_stages_leave_the_pool_serving(release: threading.Event) -> None:
    with hetero.Runtime(cpu_threads=2) as rt:
        g = hanging_graph(release)
        errors = []
        with anyio.fail_after(WAIT):
            for _ in range(10):
                with pytest.raises(StageError) as e:
                    await rt.run(g)
                errors.append(str(e.value))
        timed_out = "cpu stage 'hang' timed out after 0.05 s"
        cap = ("cpu stage 'hang' with a timeout cannot start: 8 threads abandoned by timed-out stages are still "
               "running, the cap is 8 (4 x cpu_threads); a thread cannot be killed: run code that may hang as a "
               "process stage (g.cpu(fn, ..., process=True)), whose worker is killed on timeout")
        assert errors == [timed_out] * 8 + [cap] * 2
        assert rt.abandoned_threads == 8
        assert rt.cpu_threads == 2
        with anyio.fail_after(WAIT):  # the two live workers still serve a fresh graph
            assert await rt.run(adding_graph(), x=2) == 23
            assert [r async for r in rt.map(adding_graph(), ({"x": i} for i in range(20)))] == \
                [11 * i + 1 for i in range(20)]
        release.set()  # the hung functions return, and their threads end
        await wait_abandoned(rt, 0)
        with anyio.fail_after(WAIT):  # below the cap again: timed stages run
            g2 = hetero.Graph("timed")
            g2.output(g2.cpu(operator.add, 1, 2, name="add", timeout=5))
            assert await rt.run(g2) == 3


async def test_abandoned_threads_count_up_then_down(release: threading.Event) -> None:
    with hetero.Runtime(cpu_threads=1) as rt:
        assert rt.abandoned_threads == 0
        g = hanging_graph(release)
        for n in (1, 2):
            with anyio.fail_after(WAIT), pytest.raises(StageError):
                await rt.run(g)
            assert rt.abandoned_threads == n
        release.set()
        await wait_abandoned(rt, 0)
        with anyio.fail_after(WAIT):
            assert await rt.run(adding_graph(), x=0) == 1


async def test_timeout_logs_a_warning_naming_the_stage(release: threading.Event,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    with hetero.Runtime(cpu_threads=1) as rt, caplog.at_level(logging.WARNING, logger="hetero"):
        with anyio.fail_after(WAIT), pytest.raises(StageError):
            await rt.run(hanging_graph(release, name="stuck_fetch"))
        warnings = [r for r in caplog.records if r.name == "hetero" and r.levelno == logging.WARNING]
        assert [r.getMessage() for r in warnings] == [
            "cpu stage 'stuck_fetch' (timeout 0.05 s) is still running as its run ends, and a thread cannot be "
            "killed: its thread is abandoned and a new worker replaces it (1 abandoned threads still running)"]
        release.set()
        await wait_abandoned(rt, 0)


async def test_a_stage_finishing_late_keeps_its_worker(release: threading.Event) -> None:
    """A timed stage that returns (past its timeout) before the watcher saw it is not abandoned."""
    def late() -> int:
        import time
        time.sleep(0.1)
        return 1

    with hetero.Runtime(cpu_threads=1) as rt:
        g = hetero.Graph("late")
        g.output(g.cpu(late, name="late", timeout=0.01))
        with anyio.fail_after(WAIT), pytest.raises(StageError) as e:
            await rt.run(g)
        assert str(e.value) == "cpu stage 'late' timed out after 0.01 s"
        await wait_abandoned(rt, 0)  # abandoned or not, the count returns to 0 once it ended
        with anyio.fail_after(WAIT):
            assert await rt.run(adding_graph(), x=1) == 12


def test_sync_run_after_hung_stages(release: threading.Event) -> None:
    """The same from plain sync code: each run on a fresh event loop, one Runtime."""
    with hetero.Runtime(cpu_threads=1) as rt:
        g = hanging_graph(release)
        for _ in range(3):
            with pytest.raises(StageError):
                anyio.run(lambda: rt.run(g))
        assert rt.abandoned_threads == 3
        assert anyio.run(lambda: rt.run(adding_graph(), x=1)) == 12


def failing_beside_hung_graph(release: threading.Event, started: threading.Event) -> hetero.Graph:
    """A timed stage that hangs (its timeout far off) beside one that fails once it started.

    ::

        hang (timeout 60 s)    boom (raises once hang runs)
    """
    def hang() -> int:
        started.set()
        release.wait(WAIT)
        return 1

    def boom() -> int:
        started.wait(WAIT)
        raise ValueError("boom")

    g = hetero.Graph("fails")
    g.output(g.cpu(hang, name="hang", timeout=60), g.cpu(boom, name="boom"))
    return g


def pair_graph() -> hetero.Graph:
    """Two stages that each wait for the other: the run finishes only on two live workers.

    ::

        left   right   (a barrier of two)
    """
    barrier = threading.Barrier(2, timeout=WAIT)

    def meet(side: str) -> str:
        barrier.wait()
        return side

    g = hetero.Graph("pair")
    g.output(g.cpu(meet, "l", name="left"), g.cpu(meet, "r", name="right"))
    return g


async def test_a_hung_timed_stage_of_a_failed_run_gives_back_its_worker(release: threading.Event) -> None:
    started = threading.Event()
    with hetero.Runtime(cpu_threads=2) as rt:
        with anyio.fail_after(WAIT), pytest.raises(StageError) as e:
            await rt.run(failing_beside_hung_graph(release, started))
        assert str(e.value) == "cpu stage 'boom' failed: ValueError: boom"
        assert rt.abandoned_threads == 1  # 'hang' is still in its function, its thread given up on
        with anyio.fail_after(WAIT):  # both workers serve: the stuck one was replaced
            assert await rt.run(pair_graph()) == ("l", "r")
        release.set()
        await wait_abandoned(rt, 0)
        with anyio.fail_after(WAIT):
            assert await rt.run(pair_graph()) == ("l", "r")


async def test_a_hung_timed_stage_of_a_cancelled_run_gives_back_its_worker(release: threading.Event) -> None:
    started = threading.Event()

    def hang() -> int:
        started.set()
        release.wait(WAIT)
        return 1

    g = hetero.Graph("cancelled")
    g.output(g.cpu(hang, name="hang", timeout=60))
    with hetero.Runtime(cpu_threads=1) as rt:
        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(rt.run, g)
                while not started.is_set():
                    await anyio.sleep(0.01)
                tg.cancel_scope.cancel()
        assert rt.abandoned_threads == 1
        with anyio.fail_after(WAIT):  # the one worker is a new one: the stuck thread no longer holds the pool
            assert await rt.run(adding_graph(), x=1) == 12
        release.set()
        await wait_abandoned(rt, 0)


async def test_an_untimed_stage_of_a_failed_run_keeps_its_worker(release: threading.Event) -> None:
    """Only stages with a timeout are given up on: a stage without one is trusted to return."""
    started = threading.Event()

    def slow() -> int:
        started.set()
        release.wait(WAIT)
        return 1

    def boom() -> int:
        started.wait(WAIT)
        raise ValueError("boom")

    g = hetero.Graph("untimed")
    g.output(g.cpu(slow, name="slow"), g.cpu(boom, name="boom"))
    with hetero.Runtime(cpu_threads=2) as rt:
        with anyio.fail_after(WAIT), pytest.raises(StageError):
            await rt.run(g)
        assert rt.abandoned_threads == 0
        release.set()
        with anyio.fail_after(WAIT):
            assert await rt.run(pair_graph()) == ("l", "r")
