"""Dynamic batching (rt.batcher): fake graphs whose cost is a sleep, under asyncio and trio."""

from __future__ import annotations

import threading
import time

import anyio
import numpy as np
import pytest

import hetero

pytestmark = pytest.mark.anyio


def doubling_graph(seen: list[list[int]], delay: float = 0.02, gate: threading.Event | None = None) -> hetero.Graph:
    """x -> 2x per item; notes each batch it runs; its cost is a sleep (or a gate for item 0)."""

    def work(xs: list[int]) -> np.ndarray:
        seen.append(list(xs))
        if gate is not None and 0 in xs:
            gate.wait(10)
        time.sleep(delay)
        if -1 in xs:
            raise ValueError("item -1 is poison")
        return np.array(xs, np.int64) * 2

    g = hetero.Graph("double")
    g.output(g.cpu(work, g.input("x"), name="work"))
    return g


async def call_all(b: hetero.Batcher, xs: range) -> dict[int, int]:
    """``await b(x=i)`` for each ``i``, every caller started in the same pass of the loop: their results."""
    results: dict[int, int] = {}

    async def call(i: int) -> None:
        results[i] = int(await b(x=i))

    async with anyio.create_task_group() as tg:
        for i in xs:
            tg.start_soon(call, i)
    return results


async def test_concurrent_callers_share_batches(rt: hetero.Runtime) -> None:
    seen: list[list[int]] = []
    b = rt.batcher(doubling_graph(seen, delay=0.05), max_in_flight=1)
    results = await call_all(b, range(1, 65))
    assert results == {i: 2 * i for i in range(1, 65)}
    assert sorted(x for batch in seen for x in batch) == list(range(1, 65))
    # 64 callers and a 50 ms batch: they gather into a few batches, not 64 runs.
    assert len(seen) <= 8
    assert b.batches == len(seen) and b.items == 64
    await b.aclose()


async def test_lone_caller_runs_at_once_and_gets_its_row(rt: hetero.Runtime) -> None:
    seen: list[list[int]] = []
    b = rt.batcher(doubling_graph(seen, delay=0.0))
    for i in range(3):
        out = await b(x=i)
        assert isinstance(out, np.integer) and int(out) == 2 * i
    assert seen == [[0], [1], [2]]  # sequential calls: one batch each, no waiting for company
    await b.aclose()


async def test_limits_fifo_and_cost_rule(rt: hetero.Runtime) -> None:
    seen: list[list[int]] = []
    gate = threading.Event()
    costs = {i: (i % 7) + 1 for i in range(40)}
    b = rt.batcher(doubling_graph(seen, delay=0.0, gate=gate), max_batch_size=6, max_cost=12, max_in_flight=1,
                   cost=lambda inp: costs[inp["x"]])
    arrived: list[int] = []

    async def call(i: int) -> None:
        arrived.append(i)  # no checkpoint between this and the enqueue inside b()
        assert int(await b(x=i)) == 2 * i

    async with anyio.create_task_group() as tg:
        tg.start_soon(call, 0)
        while not seen:  # item 0's batch holds the runtime until the gate opens
            await anyio.sleep(0.001)
        for i in range(1, 40):
            tg.start_soon(call, i)
        while b.queued < 39:
            await anyio.sleep(0.001)
        gate.set()
    assert [x for batch in seen for x in batch] == arrived  # FIFO across and within batches
    for batch in seen[1:]:
        assert len(batch) <= 6
        assert len(batch) == 1 or max(costs[x] for x in batch) * len(batch) <= 12
    # FIFO never skips: a batch stops only at the size limit or where the next item would break the cost
    for batch, nxt in zip(seen[1:], seen[2:]):
        m = max(costs[x] for x in batch)
        assert len(batch) == 6 or max(m, costs[nxt[0]]) * (len(batch) + 1) > 12
    await b.aclose()


async def test_cancelled_caller_leaves_its_batch_running(rt: hetero.Runtime) -> None:
    seen: list[list[int]] = []
    gate = threading.Event()
    b = rt.batcher(doubling_graph(seen, delay=0.0, gate=gate), max_in_flight=1)
    results: dict[int, int] = {}
    cancelled = anyio.CancelScope()

    async def call(i: int) -> None:
        results[i] = int(await b(x=i))

    async def cancellable(i: int) -> None:
        with cancelled:
            await call(i)

    async with anyio.create_task_group() as tg:
        tg.start_soon(cancellable, 0)
        tg.start_soon(call, 5)
        while not seen:
            await anyio.sleep(0.001)
        assert seen == [[0, 5]] or seen == [[5, 0]] or seen[0] in ([0], [5])
        cancelled.cancel()  # item 0's caller leaves while its batch runs
        await anyio.sleep(0.01)
        gate.set()
    assert 0 not in results
    assert results[5] == 10


async def test_cancelled_queued_item_never_runs(rt: hetero.Runtime) -> None:
    seen: list[list[int]] = []
    gate = threading.Event()
    b = rt.batcher(doubling_graph(seen, delay=0.0, gate=gate), max_in_flight=1)
    results: dict[int, int] = {}
    scope = anyio.CancelScope()

    async def call(i: int) -> None:
        results[i] = int(await b(x=i))

    async def queued(i: int) -> None:
        with scope:
            await call(i)

    async with anyio.create_task_group() as tg:
        tg.start_soon(call, 0)
        while not seen:
            await anyio.sleep(0.001)
        tg.start_soon(queued, 7)
        tg.start_soon(call, 8)
        while b.queued < 2:
            await anyio.sleep(0.001)
        scope.cancel()
        while b.queued > 1:
            await anyio.sleep(0.001)
        gate.set()
    assert results == {0: 0, 8: 16}
    assert [x for batch in seen for x in batch] == [0, 8]


async def test_error_fails_exactly_its_batch(rt: hetero.Runtime) -> None:
    seen: list[list[int]] = []
    b = rt.batcher(doubling_graph(seen, delay=0.01), max_batch_size=3, max_in_flight=1)
    outcome: dict[int, object] = {}

    async def call(i: int) -> None:
        try:
            outcome[i] = int(await b(x=i))
        except hetero.StageError as e:
            outcome[i] = e

    async with anyio.create_task_group() as tg:
        for i in [1, 2, -1, 3, 4, 5, 6, 7]:
            tg.start_soon(call, i)
    poisoned = next(batch for batch in seen if -1 in batch)
    for i, out in outcome.items():
        if i in poisoned:
            assert isinstance(out, hetero.StageError) and out.stage == "work"
            assert isinstance(out.__cause__, ValueError)
        else:
            assert out == 2 * i
    assert any(not isinstance(v, BaseException) for v in outcome.values())
    # the batcher goes on after a failed batch
    assert int(await b(x=9)) == 18


async def test_overload_raises_at_once(rt: hetero.Runtime) -> None:
    seen: list[list[int]] = []
    gate = threading.Event()
    b = rt.batcher(doubling_graph(seen, delay=0.0, gate=gate), max_in_flight=1, max_queued=3)
    results: dict[int, int] = {}

    async def call(i: int) -> None:
        results[i] = int(await b(x=i))

    async with anyio.create_task_group() as tg:
        tg.start_soon(call, 0)
        while not seen:
            await anyio.sleep(0.001)
        for i in (1, 2, 3):
            tg.start_soon(call, i)
        while b.queued < 3:
            await anyio.sleep(0.001)
        with pytest.raises(hetero.OverloadedError, match="max_queued=3"):
            await b(x=4)
        with pytest.raises(hetero.OverloadedError):
            await b.gather([{"x": 5}])
        assert isinstance(hetero.OverloadedError("x"), hetero.HeteroError)
        gate.set()
    assert results == {i: 2 * i for i in range(4)}


async def test_submit_calls_back_per_item_without_tasks(rt: hetero.Runtime) -> None:
    """submit(): every item's result (or its batch's error) reaches on_done on the loop, once; admission
    is all or none; a failing on_done does not disturb the other items."""
    seen: list[list[int]] = []
    gate = threading.Event()
    b = rt.batcher(doubling_graph(seen, delay=0.01, gate=gate), max_batch_size=3, max_in_flight=1, max_queued=8)
    calls: list[tuple[str, int, object]] = []
    loop_thread = threading.get_ident()

    def on_done(tag: str) -> object:
        def done(i: int, result: object, error: BaseException | None) -> None:
            assert threading.get_ident() == loop_thread
            calls.append((tag, i, error if error is not None else result))
            if tag == "c":
                raise RuntimeError("a submitter's bug")
        return done

    b.submit([{"x": 0}], on_done("a"))  # holds the gate: the next items queue behind it
    while not seen:
        await anyio.sleep(0.001)
    b.submit([{"x": 1}, {"x": -1}, {"x": 2}], on_done("b"))  # one batch of three, poisoned
    b.submit([{"x": 3}, {"x": 4}], on_done("c"))
    with pytest.raises(hetero.OverloadedError, match="max_queued=8"):
        b.submit([{"x": k} for k in range(10, 14)], on_done("d"))  # 5 queued + 4 > 8: none admitted
    with pytest.raises(hetero.InputError):
        b.submit([{"x": 5}, {"y": 6}], on_done("e"))  # a bad item: none admitted
    assert b.queued == 5
    gate.set()
    with anyio.fail_after(30):
        while len(calls) < 6:
            await anyio.sleep(0.005)
    await b.aclose()
    by = {(tag, i): v for tag, i, v in calls}
    assert len(calls) == 6 and by[("a", 0)] == 0 and by[("c", 0)] == 6 and by[("c", 1)] == 8
    for i in range(3):
        assert isinstance(by[("b", i)], hetero.StageError)
    assert sorted(x for batch in seen for x in batch) == [-1, 0, 1, 2, 3, 4]


async def test_several_outputs_and_lists(rt: hetero.Runtime) -> None:
    def work(xs: list[str], ys: list[int]) -> tuple[list[str], np.ndarray]:
        return [x.upper() for x in xs], np.stack([np.full(3, y) for y in ys])

    def first(t: tuple[list[str], np.ndarray]) -> list[str]:
        return t[0]

    def second(t: tuple[list[str], np.ndarray]) -> np.ndarray:
        return t[1]

    g = hetero.Graph("two")
    w = g.cpu(work, g.input("x"), g.input("y"))
    g.output(g.cpu(first, w), g.cpu(second, w))
    b = rt.batcher(g)
    out = await b.gather([{"x": "a", "y": 1}, {"x": "b", "y": 2}])
    assert out[0][0] == "A" and out[1][0] == "B"
    np.testing.assert_array_equal(out[1][1], [2, 2, 2])
    with pytest.raises(hetero.InputError):
        await b(x="c")


async def test_wrong_output_length_fails_the_batch(rt: hetero.Runtime) -> None:
    g = hetero.Graph("bad")
    g.output(g.cpu(lambda xs: [0], g.input("x"), name="one"))
    b = rt.batcher(g)
    with pytest.raises(hetero.HeteroError, match="one per caller"):
        await b.gather([{"x": 1}, {"x": 2}])


async def test_unsized_output_fails_the_batch_with_its_name(rt: hetero.Runtime) -> None:
    g = hetero.Graph("scalar")
    g.output(g.cpu(lambda xs: np.array(float(len(xs))), g.input("x"), name="count"))
    b = rt.batcher(g)
    with pytest.raises(hetero.HeteroError, match="output 0 has a 0-d ndarray.*one per caller"):
        await b(x=1)


async def test_max_wait_gathers_sequential_arrivals(rt: hetero.Runtime) -> None:
    seen: list[list[int]] = []
    b = rt.batcher(doubling_graph(seen, delay=0.0), max_wait=5.0, max_batch_size=3)
    results: dict[int, int] = {}

    async def call(i: int) -> None:
        results[i] = int(await b(x=i))

    async with anyio.create_task_group() as tg:
        for i in range(3):
            tg.start_soon(call, i)
            await anyio.sleep(0.01)
    # the first item waited (up to 5 s) until the batch was full
    assert [sorted(s) for s in seen] == [[0, 1, 2]]
    assert results == {0: 0, 1: 2, 2: 4}


async def test_split_runs_groups_as_one_batch(rt: hetero.Runtime) -> None:
    seen: list[list[int]] = []
    gate = threading.Event()
    b = rt.batcher(doubling_graph(seen, delay=0.0, gate=gate), max_in_flight=1,
                   split=lambda costs: [list(range(0, len(costs), 2)), list(range(1, len(costs), 2))])
    results: dict[int, int] = {}

    async def call(i: int) -> None:
        results[i] = int(await b(x=i))

    async with anyio.create_task_group() as tg:
        tg.start_soon(call, 0)
        while not seen:
            await anyio.sleep(0.001)
        for i in range(1, 5):  # one at a time: the task order of a start is not the arrival order
            tg.start_soon(call, i)
            while b.queued < i:
                await anyio.sleep(0.001)
        gate.set()
    assert results == {i: 2 * i for i in range(5)}
    assert sorted(sorted(s) for s in seen[1:]) == [[1, 3], [2, 4]]


async def test_closed_batcher_and_bad_arguments(rt: hetero.Runtime) -> None:
    seen: list[list[int]] = []
    g = doubling_graph(seen, delay=0.0)
    b = rt.batcher(g)
    assert int(await b(x=1)) == 2
    await b.aclose()
    with pytest.raises(hetero.RuntimeClosedError):
        await b(x=1)
    for kw in ({"max_batch_size": 0}, {"max_queued": -1}, {"max_wait": -1.0}, {"max_cost": 0},
               {"max_in_flight": True}):
        with pytest.raises(ValueError):
            rt.batcher(g, **kw)  # type: ignore[arg-type]


def test_batcher_rebinds_after_its_loop_ends(rt: hetero.Runtime) -> None:
    seen: list[list[int]] = []
    b = rt.batcher(doubling_graph(seen, delay=0.0))

    async def one(i: int) -> int:
        return int(await b(x=i))

    assert anyio.run(one, 1, backend="asyncio") == 2
    assert anyio.run(one, 2, backend="trio") == 4
    assert anyio.run(one, 3, backend="asyncio") == 6


async def test_batch_observers_see_each_batch_form_and_end(rt: hetero.Runtime) -> None:
    """One batch runs (50 ms of sleep) while more callers queue: the next batch's items waited
    at least until it ended; a failed batch is observed too."""
    seen: list[list[int]] = []
    formed: list[tuple[int, int]] = []
    ended: list[tuple[int, float, float]] = []
    b = rt.batcher(doubling_graph(seen, delay=0.05), max_in_flight=1, on_batch=lambda n, c: formed.append((n, c)),
                   on_batch_done=lambda n, waited, ran: ended.append((n, waited, ran)))

    async def call(i: int) -> None:
        try:
            await b(x=i)
        except hetero.StageError:
            assert i in (2, 3, -1)  # the poisoned batch fails its callers

    async with anyio.create_task_group() as tg:
        tg.start_soon(call, 1)
        await anyio.sleep(0.01)  # the first batch (item 1) is running
        for i in (2, 3, -1):
            tg.start_soon(call, i)
    assert [n for n, _ in formed] == [len(s) for s in seen] == [n for n, _, _ in ended] == [1, 3]
    (_, first_wait, first_ran), (_, second_wait, second_ran) = ended
    assert first_ran >= 0.05 and second_ran >= 0.05  # each ran its sleep (the second failed after it)
    assert second_wait >= 0.03  # queued behind the first batch's remaining sleep
    assert first_wait >= 0.0
    await b.aclose()


async def test_idle_batcher_forms_the_batch_in_the_call(rt: hetero.Runtime) -> None:
    """Nothing queued, nothing running: a lone caller's batch runs in the caller's own task, and
    submit() forms its batch before returning; a burst that follows is gathered by the dispatcher."""
    seen: list[list[int]] = []
    gate = threading.Event()
    runners: list[object] = []
    b = rt.batcher(doubling_graph(seen, delay=0.0, gate=gate), max_in_flight=2,
                   on_batch=lambda n, c: runners.append(anyio.get_current_task().id))
    gate.set()
    assert int(await b(x=3)) == 6
    assert runners == [anyio.get_current_task().id]  # no hand-off to the dispatching task

    gate.clear()
    done: list[tuple[int, object]] = []
    b.submit([{"x": 0}], lambda i, r, e: done.append((0, r)))
    assert (b.batches, b.in_flight, b.queued) == (2, 1, 0)  # formed before submit() returned
    b.submit([{"x": 1}, {"x": 2}], lambda i, r, e: done.append((i + 1, r)))
    assert (b.batches, b.in_flight, b.queued) == (2, 1, 2)  # a batch runs: these wait for the dispatcher
    gate.set()
    with anyio.fail_after(30):
        while len(done) < 3:
            await anyio.sleep(0.005)
    assert sorted((i, int(r)) for i, r in done) == [(0, 0), (1, 2), (2, 4)]
    assert sorted(seen[1:]) == [[0], [1, 2]]  # two batches at once: their workers may start in either order

    # A burst of callers after a lull: the first runs alone at once, the dispatcher gathers the rest.
    seen.clear()
    assert await call_all(b, range(10, 20)) == {i: 2 * i for i in range(10, 20)}
    assert [len(s) for s in seen] == [1, 9]
    await b.aclose()


async def test_aclose_waits_for_a_batch_run_by_its_caller(rt: hetero.Runtime) -> None:
    seen: list[list[int]] = []
    gate = threading.Event()
    b = rt.batcher(doubling_graph(seen, delay=0.0, gate=gate))
    order: list[str] = []

    async def call() -> None:
        assert int(await b(x=0)) == 0
        order.append("result")

    async def close() -> None:
        await b.aclose()
        order.append("closed")

    async with anyio.create_task_group() as tg:
        tg.start_soon(call)
        while not seen:  # the lone caller's batch runs in its task, held by the gate
            await anyio.sleep(0.001)
        tg.start_soon(close)
        await anyio.sleep(0.05)
        assert order == [] and b.in_flight == 1
        gate.set()
    assert order == ["result", "closed"]


async def test_cancelled_lone_caller_stops_only_its_own_batch(rt: hetero.Runtime) -> None:
    seen: list[list[int]] = []
    gate = threading.Event()
    b = rt.batcher(doubling_graph(seen, delay=0.0, gate=gate))
    scope = anyio.CancelScope()
    results: list[int] = []

    async def lone() -> None:
        with scope:
            results.append(int(await b(x=0)))

    async with anyio.create_task_group() as tg:
        tg.start_soon(lone)
        while not seen:  # its batch runs in its task, held by the gate
            await anyio.sleep(0.001)
        assert b.in_flight == 1
        scope.cancel()
        gate.set()
    assert results == [] and scope.cancelled_caught
    assert b.in_flight == 0 and b.queued == 0
    assert int(await b(x=5)) == 10  # the batcher goes on
    await b.aclose()
