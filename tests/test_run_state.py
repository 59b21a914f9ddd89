"""A Run's transitions, driven by hand: no threads, no event loop, no device.

The run is built on a host of the test's own (what a Run asks of its scheduler) and a
clock of the test's own; each test moves it through its transitions as the executors
would, and checks what the run returns and what it asked of its host.
"""

from __future__ import annotations

import operator
from typing import Any

import pytest

import hetero
import hetero._run
from hetero import StageError
from hetero._placement import Placement
from hetero._plan import Plan, StagePlan
from hetero._run import Run
from hetero._workers import Worker


class Host:
    """A scheduler that records what the run asks of it and does nothing else."""

    tracer = None
    cleanup_wait = 0.0

    def __init__(self) -> None:
        self.dispatched: list[list[int]] = []
        self.started: list[Run] = []
        self.ended: list[Run] = []
        self.placements: list[tuple[int, float | None]] = []
        self.abandoned: list[tuple[str, Worker]] = []
        self.cancelled: list[Any] = []

    def dispatch(self, run: Run, ready: list[int]) -> None:
        self.dispatched.append(ready)

    def run_started(self, run: Run) -> None:
        self.started.append(run)

    def run_ended(self, run: Run) -> None:
        self.ended.append(run)

    def placement_done(self, run: Run, i: int, seconds: float | None) -> None:
        run.end_placement(i)
        self.placements.append((i, seconds))

    def abandon_worker(self, st: StagePlan, worker: Worker) -> None:
        self.abandoned.append((st.name, worker))

    def cancel_jobs(self, jobs: list[Any]) -> None:
        self.cancelled.extend(jobs)


class Clock:
    """``time`` as hetero._run sees it: monotonic seconds that move only when told."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now

    def perf_counter_ns(self) -> int:
        return int(self.now * 1e9)

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(hetero._run, "time", c)
    return c


class Pool:
    """A buffer pool that counts retains and releases."""

    def __init__(self) -> None:
        self.retained: list[Block] = []
        self.released: list[Block] = []

    def retain(self, b: Block) -> None:
        self.retained.append(b)

    def release_many(self, blocks: list[Block]) -> None:
        self.released.extend(blocks)


class Block:
    def __init__(self, pool: Pool) -> None:
        self.pool = pool


def make(graph: hetero.Graph, **inputs: Any) -> tuple[Run, Host, Plan, dict[str, StagePlan]]:
    plan = graph.plan()
    host = Host()
    return Run(host, plan, inputs, 0), host, plan, {st.name: st for st in plan.stages}


def diamond() -> hetero.Graph:
    """
    ::

        x -> a (cpu) --> c (cpu)
          \\-> b (cpu) -/
    """
    g = hetero.Graph("diamond")
    x = g.input("x")
    g.output(g.cpu(operator.add, g.cpu(operator.add, x, 1, name="a"), g.cpu(operator.mul, x, 10, name="b"),
                   name="c"))
    return g


def test_completing_stages_readies_their_consumers_and_the_last_finishes_the_run() -> None:
    run, host, plan, st = make(diamond(), x=2)
    a, b, c = st["a"], st["b"], st["c"]
    assert run.stage_args(a) == ((2, 1), {})
    assert run.complete(a.index, 3, a.gpu_consumers, a.cpu_consumers) == ([], [])  # c still waits for b
    assert run.complete(b.index, 20, b.gpu_consumers, b.cpu_consumers) == ([], [c.index])
    assert run.stage_args(c) == ((3, 20), {})
    assert not run.stopped and host.ended == []
    run.complete(c.index, 23, c.gpu_consumers, c.cpu_consumers)
    assert run.stopped and run.done and run.error is None
    assert host.ended == [run] and run.cleaned  # nothing recording: cleaned up at once
    assert run.outputs() == 23
    assert run.stats().ok


def test_the_first_failure_stops_the_run_and_later_ones_are_dropped() -> None:
    run, host, plan, st = make(diamond(), x=2)
    run.fail_stage(st["a"], ValueError("first"), attempts=3)
    run.fail_stage(st["b"], KeyError("second"))
    assert run.stopped and not run.done
    assert isinstance(run.error, StageError)
    assert str(run.error) == "cpu stage 'a' failed after 3 attempts: ValueError: first"
    assert isinstance(run.error.__cause__, ValueError)
    assert host.ended == [run]
    run.stage_done()  # a stage still running when the run stopped ends; nothing changes
    assert run.error is not None and not run.done and host.ended == [run]


def test_a_stopped_run_cancels_its_process_jobs_and_refuses_new_ones() -> None:
    g = hetero.Graph("procs")
    g.output(g.cpu(abs, g.input("x"), name="p", process=True))
    run, host, plan, st = make(g, x=-1)
    job = object()
    assert run.add_job(st["p"].index, job)  # type: ignore[arg-type]
    run.stop()
    assert host.cancelled == [job] and run.proc_jobs == {}
    assert not run.add_job(st["p"].index, object())  # type: ignore[arg-type]
    run.job_done(st["p"].index)  # the cancelled job reports back: nothing left to forget


def timed_graph() -> hetero.Graph:
    """
    ::

        x -> slow (cpu, timeout 1 s)
    """
    g = hetero.Graph("timed")
    g.output(g.cpu(abs, g.input("x"), name="slow", timeout=1.0))
    return g


def started_timed(clock: Clock) -> tuple[Run, Host, StagePlan, Worker]:
    """The timed graph's run with 'slow' started on a worker of its own."""
    run, host, plan, st = make(timed_graph(), x=-1)
    slow, worker = st["slow"], Worker()
    assert run.begin_timed(slow, worker)
    return run, host, slow, worker


def test_a_timed_stage_within_its_timeout(clock: Clock) -> None:
    run, host, slow, worker = started_timed(clock)
    clock.now += 0.5
    assert run.begin_timed(slow)  # started again (after waiting for memory): its timeout runs from the first start
    assert run.check_timeouts() == pytest.approx(0.5)
    assert run.end_timed(slow, worker=True)
    assert run.timed_started == {} and run.timed_workers == {} and not run.stopped
    assert host.abandoned == []


def test_an_overdue_stage_fails_the_run_and_its_worker_is_abandoned(clock: Clock) -> None:
    run, host, slow, worker = started_timed(clock)
    clock.now += 1.5
    assert run.check_timeouts() == 0.0
    assert host.abandoned == [("slow", worker)]
    assert str(run.error) == "cpu stage 'slow' timed out after 1 s"
    # The function returns later: its worker was taken, the stage stores nothing.
    assert not run.end_timed(slow, worker=True)
    run.fail_stage(slow, ValueError("late"), worker=True)
    assert str(run.error) == "cpu stage 'slow' timed out after 1 s"
    assert host.abandoned == [("slow", worker)]  # once


def timed_beside_graph() -> hetero.Graph:
    """
    ::

        x -> slow (cpu, timeout 1 s)
          -> other (cpu)
    """
    g = hetero.Graph("timed_beside")
    x = g.input("x")
    g.output(g.cpu(abs, x, name="slow", timeout=1.0), g.cpu(abs, x, name="other"))
    return g


def test_a_run_failing_elsewhere_abandons_its_running_timed_stages(clock: Clock) -> None:
    run, host, plan, st = make(timed_beside_graph(), x=-1)
    slow, worker = st["slow"], Worker()
    assert run.begin_timed(slow, worker)
    run.fail_stage(st["other"], ValueError("boom"))
    assert str(run.error) == "cpu stage 'other' failed: ValueError: boom"
    assert host.abandoned == [("slow", worker)]  # within its timeout, but it may hang: given up on
    assert run.timed_workers == {}
    assert not run.end_timed(slow, worker=True)  # it returns later: its worker was taken
    assert not run.begin_timed(slow, Worker())  # a stopped run starts nothing
    assert host.abandoned == [("slow", worker)] and run.timed_workers == {}


def test_a_cancelled_run_abandons_its_running_timed_stages(clock: Clock) -> None:
    run, host, slow, worker = started_timed(clock)
    run.stop()
    assert host.abandoned == [("slow", worker)]
    run.stop()  # again (a map stopping runs behind a failure): nothing more
    assert host.abandoned == [("slow", worker)]
    run.fail_stage(slow, ValueError("late"), worker=True)
    assert run.error is None  # the caller is gone; the late failure is dropped


def test_a_stage_that_returns_past_its_timeout_fails_the_run(clock: Clock) -> None:
    run, host, plan, st = make(timed_graph(), x=-1)
    slow = st["slow"]
    assert run.begin_timed(slow)  # no worker: e.g. a process or GPU stage
    clock.now += 2.0
    assert not run.end_timed(slow)
    assert str(run.error) == "cpu stage 'slow' timed out after 1 s"
    assert host.abandoned == []


def test_a_failing_timed_stage_is_no_longer_watched(clock: Clock) -> None:
    run, host, slow, worker = started_timed(clock)
    run.fail_stage(slow, ValueError("boom"), worker=True)
    assert run.timed_started == {}
    assert str(run.error) == "cpu stage 'slow' failed: ValueError: boom"
    assert host.abandoned == []  # its function returned: its worker goes on serving


def test_retries_wait_their_backoff_and_stop_with_the_run(clock: Clock) -> None:
    g = hetero.Graph("retried")
    g.output(g.cpu(abs, g.input("x"), name="flaky", retries=2, retry_on=(OSError,), backoff=0.5))
    run, host, plan, st = make(g, x=-1)
    flaky = st["flaky"]
    assert run.retry(flaky, OSError("again"), 1)
    assert clock.now == pytest.approx(100.5)  # its backoff, on the calling worker
    assert not run.retry(flaky, ValueError("not retried"), 1)
    assert not run.retry(flaky, OSError("no attempts left"), 3)
    run.stop()
    assert not run.retry(flaky, OSError("stopped"), 1)


def gpu_graph() -> hetero.Graph:
    """
    ::

        x -> g1 (gpu) -> g2 (gpu, output)
    """
    def twice(gpu: hetero.GPUContext, t: hetero.Tensor) -> hetero.Tensor:
        return hetero.ops.add(gpu, t, t)

    g = hetero.Graph("gpu")
    g.output(g.gpu(twice, g.gpu(twice, g.input("x"), name="g1"), name="g2"))
    return g


def test_device_blocks_are_held_until_the_last_hold_goes() -> None:
    run, host, plan, st = make(gpu_graph(), x=None)
    g1, g2 = st["g1"], st["g2"]
    pool = Pool()
    blocks = [Block(pool), Block(pool)]
    assert run.begin_recording()
    assert run.hold(g1.index, blocks)  # one hold per GPU consumer, one while recorded
    assert pool.retained == blocks
    run.drop_hold(g1.index)  # recorded
    assert pool.released == []
    assert run.release(g1.gpu_consumers) == [g2.index]
    run.drop_hold(g1.index)  # its consumer was recorded
    assert pool.released == blocks
    run.recording_done()
    assert not run.stopped


def test_a_run_stopped_while_recording_cleans_up_when_the_recording_ends() -> None:
    run, host, plan, st = make(gpu_graph(), x=None)
    g1 = st["g1"]
    pool = Pool()
    block = Block(pool)
    assert run.begin_recording()
    assert run.hold(g1.index, [block])
    run.stop()
    assert host.ended == [] and not run.cleaned  # a stage is still being recorded
    assert not run.hold(g1.index, [Block(pool)])  # nothing more is kept
    assert not run.begin_recording()
    run.recording_done()
    assert run.cleaned and host.ended == [run] and pool.released == [block]


def test_the_device_lost_fails_the_run_with_device_lost_error() -> None:
    run, host, plan, st = make(gpu_graph(), x=None)
    cause = RuntimeError("Parent device is lost")
    run.fail_lost(st["g1"], "reported by the driver", cause)
    assert isinstance(run.error, hetero.DeviceLostError)
    assert str(run.error) == ("the GPU device was lost (reported by the driver) while stage 'g1' was recorded "
                              "or submitted; create a new Runtime")
    assert run.error.__cause__ is cause


def test_a_forgotten_run_stores_and_gives_out_nothing() -> None:
    run, host, plan, st = make(diamond(), x=2)
    a, c = st["a"], st["c"]
    run.set_value(a.index, host=3, dev=3)
    assert run.device_values() == [3, None, None]
    run.stop()
    run.forget_values()
    run.set_value(a.index, host=4)
    assert run.values == [None, None, None]
    assert run.stage_args(c) is None and run.device_values() is None


def test_an_open_placement_is_closed_when_the_run_ends() -> None:
    g = hetero.Graph("mixed")
    g.output(g.stage(g.input("x"), cpu=abs, gpu=lambda gpu, t: t, name="m"))
    run, host, plan, st = make(g, x=-1)
    m = st["m"]
    p = Placement("cpu", "forced", 0, 0)
    run.place(m.index, p, plan.variants[m.index][0])
    assert run.stages[m.index].kind == "cpu" and run.placements[m.index] is p
    assert run.span_args(m.index)["placement"]["device"] == "cpu"
    run.fail_stage(run.stages[m.index], ValueError("boom"))
    assert host.placements == [(m.index, None)]  # dropped: no time measured
    assert run.end_placement(m.index) is None
