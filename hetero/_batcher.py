"""Dynamic batching: concurrent callers gathered into one run of a graph (the rules are :class:`Batcher`'s)."""

from __future__ import annotations

import collections
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np

from ._argtypes import check_positive_int
from ._bridge import running_loop
from .errors import HeteroError, InputError, OverloadedError, RuntimeClosedError

if TYPE_CHECKING:
    from ._graph import Graph
    from ._runtime import Runtime

__all__ = ["Batcher", "padded_cost"]

log = logging.getLogger("hetero")


def padded_cost(costs: Sequence[int]) -> int:
    """A batch's cost under the padded rule: item count times the largest item cost."""
    return max(costs) * len(costs) if costs else 0


class _Item:
    __slots__ = ("inputs", "cost", "arrived", "event", "result", "error", "done", "on_done", "index")

    def __init__(self, inputs: dict[str, Any], cost: int, arrived: float,
                 on_done: Callable[[int, Any, BaseException | None], None] | None = None, index: int = 0) -> None:
        self.inputs = inputs
        self.cost = cost
        self.arrived = arrived
        # A caller waiting in a task waits on the event (made by _admit unless the caller runs the item
        # itself); a submitter gets on_done(index, ...) instead.
        self.event: anyio.Event | None = None
        self.on_done = on_done
        self.index = index
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = False


class Batcher:
    """An async callable gathering concurrent calls into batched runs of a graph.

    ``rt.batcher(graph, ...)`` returns one; ``await b(**inputs)`` submits one item and
    returns that item's share of the batch's outputs.

    Rules:

    - **Gathering.** A batch's run gets, for each graph input, the list of its callers'
      values in arrival order. Each graph output must have one entry per caller along its
      first axis (a numpy array or a sequence; a tuple of those for several outputs); caller
      ``i`` gets entry ``i`` (a tuple of entries for several outputs; numpy rows are copied
      out of the batch's array).
    - **Continuous batching.** A batch forms as soon as the runtime can take one: fewer than
      ``max_in_flight`` of this batcher's batches are running and an item is queued. It takes
      queued items in FIFO order (never skipping one) up to ``max_batch_size`` items and up
      to ``max_cost``. No timer: under light load a lone item runs at once; under heavy load
      items queue while the batches in flight run, and the next batch takes them all. An
      item (or a :meth:`gather` or :meth:`submit` call's items) that finds nothing queued
      and no batch running forms its batch in the call itself, without waiting for the
      dispatching task to wake; a lone ``await b(...)`` then runs its batch in the caller's
      own task.
      ``max_wait > 0`` (seconds) makes a batch wait up to that long after its first item
      arrived for more items, unless it is already full.
    - **Cost rule** (text-embeddings-inference's padded-token budget): each item has a cost
      (``cost(inputs)``, default 1); a batch's cost is its item count times its largest item
      cost, as if every item were padded to the longest. An item joins a batch of ``n``
      items whose largest cost is ``m`` while ``max(m, c) * (n + 1) <= max_cost``. The first
      item of a batch always joins, so an item costlier than ``max_cost`` runs alone.
    - **Splitting** (optional ``split``): a function from the formed batch's item costs to
      groups of item indices; each group runs as a graph run of its own, concurrently, and
      together they count as one batch in flight (the embedding pipeline sorts by length
      and splits where padding would waste much).
    - **Cancellation.** A batch runs in a task the batcher owns, unless it is a lone
      ``await b(...)``'s own batch (see above), whose run that call's cancellation stops: it
      has no other items. Cancelling a caller whose item is still queued removes the item;
      cancelling one whose item is in a running batch only stops that caller's wait: the
      batch runs on for the others.
    - **Errors.** A failed run fails exactly its callers, each with the run's error (a
      :class:`~hetero.StageError` names the stage).
    - **Overload.** A call that finds ``max_queued`` items queued raises
      :class:`~hetero.OverloadedError` at once.
    - **Event loops.** The batcher starts its dispatching task on the event loop (asyncio or
      trio) of its first call and is bound to that loop while the loop runs; a call from
      another running loop raises :class:`~hetero.HeteroError`. Once that loop has ended (its
      dispatching task was cancelled), the next call binds the batcher to the caller's loop.
    - **Observers** (optional, called on the event loop; an exception they raise is ignored):
      ``on_batch(items, cost)`` when a batch forms; ``on_batch_done(items, waited, ran)``
      when its runs have ended (done or failed), with the mean seconds its items waited in
      the queue and the seconds from forming to the end.
    """

    def __init__(self, runtime: Runtime, graph: Graph, *, max_batch_size: int = 64, max_wait: float = 0.0,
                 cost: Callable[[Mapping[str, Any]], int] | None = None, max_cost: int | None = None,
                 max_queued: int = 4096, max_in_flight: int = 2,
                 split: Callable[[list[int]], list[list[int]]] | None = None,
                 on_batch: Callable[[int, int], None] | None = None,
                 on_batch_done: Callable[[int, float, float], None] | None = None) -> None:
        from ._graph import Graph

        if not isinstance(graph, Graph):
            raise HeteroError(f"batcher() expects a hetero.Graph, got {type(graph).__name__}")
        check_positive_int("batcher: max_batch_size", max_batch_size)
        if max_cost is not None:
            check_positive_int("batcher: max_cost", max_cost)
        check_positive_int("batcher: max_queued", max_queued)
        check_positive_int("batcher: max_in_flight", max_in_flight)
        if isinstance(max_wait, bool) or not isinstance(max_wait, (int, float)) or not max_wait >= 0 \
                or math.isinf(max_wait):
            raise ValueError(f"batcher: max_wait must be a finite number of seconds >= 0, got {max_wait!r}")
        self.runtime = runtime
        self.graph = graph
        self.max_batch_size = max_batch_size
        self.max_wait = float(max_wait)
        self.cost = cost
        self.max_cost = max_cost
        self.max_queued = max_queued
        self.max_in_flight = max_in_flight
        self.split = split
        self.on_batch = on_batch
        self.on_batch_done = on_batch_done
        self._plan = graph.plan()
        self._queue: collections.deque[_Item] = collections.deque()
        self._in_flight = 0
        self._changed: anyio.Event | None = None  # events are made on the loop (in _bind)
        self._loop: object | None = None  # the event loop the dispatcher runs on
        self._running = False  # the dispatcher task is alive
        self._closing = False
        self._closed = False
        self._stopped: anyio.Event | None = None
        self._task: Any = None
        self._tg: Any = None  # the dispatching task's task group, while it runs
        self.batches = 0  # batches formed so far
        self.items = 0  # items handed to batches so far

    # -- what callers see -------------------------------------------------------------
    @property
    def queued(self) -> int:
        """Items waiting for a batch."""
        return len(self._queue)

    @property
    def in_flight(self) -> int:
        """This batcher's batches running now."""
        return self._in_flight

    async def __call__(self, **inputs: Any) -> Any:
        """Submit one item; return its entry of the batch's outputs (a tuple for several outputs)."""
        item = self._admit([inputs], inline=True)[0]
        if item.done:  # formed its own batch at once: run it here (cancelling this call cancels only it)
            await self._run_batch([item])
            if item.error is not None:
                raise item.error
            return item.result
        return await self._await(item)

    async def gather(self, items: Sequence[Mapping[str, Any]]) -> list[Any]:
        """Submit several items at once (admitted together or not at all); return their results in order.

        They may land in different batches. The first failed item's error is raised once all
        have finished.
        """
        admitted = self._admit(list(items))
        results: list[Any] = []
        try:
            for item in admitted:
                assert item.event is not None
                await item.event.wait()
        finally:
            self._forget(admitted)
        for item in admitted:
            if item.error is not None:
                raise item.error
            results.append(item.result)
        return results

    def submit(self, items: Sequence[Mapping[str, Any]],
               on_done: Callable[[int, Any, BaseException | None], None]) -> None:
        """Submit several items without waiting for them, from the batcher's event loop.

        ``on_done(i, result, error)`` is called on the event loop once item ``i`` (its index
        in ``items``) has finished: with its share of the batch's outputs, or with the error
        that failed its batch. Admission is as for :meth:`gather`: all items or none, and
        :class:`~hetero.OverloadedError` at once when the queue is full. Submitted items
        cannot be withdrawn; they run even if their result is no longer wanted. For servers
        that answer many requests from one task (no task per item); an exception raised by
        ``on_done`` is logged (logger ``"hetero"``) and affects nothing else.
        """
        self._admit(list(items), on_done)

    async def aclose(self) -> None:
        """Stop taking items; let queued items and running batches finish; stop the dispatching task."""
        self._closing = True
        self._poke()
        if self._running and self._stopped is not None:
            await self._stopped.wait()
        self._closed = True

    async def __aenter__(self) -> Batcher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- admission ----------------------------------------------------------------------
    def _admit(self, inputs: list[Any], on_done: Callable[[int, Any, BaseException | None], None] | None = None,
               inline: bool = False) -> list[_Item]:
        """Check and queue items (all or none). With nothing queued and no batch running, the
        first batch forms at once: ``inline`` (a lone caller's one item) leaves it to the caller
        to run (the item is marked done); otherwise it starts in the dispatcher's task group.
        """
        if self._closing or self._closed:
            raise RuntimeClosedError("this batcher is closed; create a new one with rt.batcher(...)")
        self.runtime._check_open()
        items = []
        now = time.monotonic()
        check, cost = self._plan.check_inputs, self.cost
        for i, x in enumerate(inputs):
            if not isinstance(x, Mapping):
                raise InputError(f"batcher items must be dicts of graph inputs, got {type(x).__name__}")
            check(x)
            c = 1
            if cost is not None:
                c = cost(x)
                if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c < 0:
                    raise HeteroError(f"batcher: cost() must return an integer >= 0, got {c!r}")
            items.append(_Item(dict(x), int(c), now, on_done, i))
        if len(self._queue) + len(items) > self.max_queued:
            raise OverloadedError(
                f"the batcher of graph {self.graph.name!r} is overloaded: {len(self._queue)} items queued, "
                f"{len(items)} more would pass max_queued={self.max_queued}; retry later or raise max_queued")
        self._bind()
        idle = not self._queue and self._in_flight == 0 and self.max_wait == 0
        self._queue.extend(items)
        if idle and (inline or self._tg is not None):
            batch = self._take()
            self._in_flight += 1
            if not inline:
                self._tg.start_soon(self._run_batch, batch)
        if on_done is None and not (inline and items[0].done):  # a lone caller running its own item needs no event
            for item in items:
                item.event = anyio.Event()
        if self._queue:
            self._poke()
        return items

    async def _await(self, item: _Item) -> Any:
        assert item.event is not None
        try:
            await item.event.wait()
        finally:
            self._forget([item])
        if item.error is not None:
            raise item.error
        return item.result

    def _forget(self, items: list[_Item]) -> None:
        """Drop items still queued (their callers left)."""
        for item in items:
            if not item.done:
                try:
                    self._queue.remove(item)
                except ValueError:
                    pass  # in a running batch: it runs on for the others

    def _poke(self) -> None:
        if self._changed is not None:
            self._changed.set()

    async def _changes(self) -> None:
        """Wait for the next enqueue or batch completion."""
        event = self._changed = anyio.Event()
        await event.wait()

    # -- the dispatching task -------------------------------------------------------------
    def _bind(self) -> None:
        lib = running_loop()
        if lib == "asyncio":
            import asyncio

            loop: object = asyncio.get_running_loop()
        elif lib == "trio":
            import trio

            loop = trio.lowlevel.current_trio_token()
        else:
            raise HeteroError("a batcher must be called from a running asyncio or trio event loop")
        if self._running:
            if loop is not self._loop:
                raise HeteroError(f"this batcher runs on another event loop (it is bound to the {lib} loop of its "
                                  "first call while that loop runs); create one batcher per event loop")
            return
        self._loop = loop
        self._running = True
        self._stopped = anyio.Event()
        self._changed = anyio.Event()
        if lib == "asyncio":
            import asyncio

            task = asyncio.get_running_loop().create_task(self._dispatch())
            self._task = task  # keep a reference: the loop holds only a weak one
        else:
            import trio

            trio.lowlevel.spawn_system_task(self._dispatch, name=f"hetero batcher of {self.graph.name!r}")

    async def _dispatch(self) -> None:
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                while True:
                    if not self._queue:
                        if self._closing and self._in_flight == 0:  # batches run in callers' tasks too
                            break
                        await self._changes()
                        continue
                    if self._in_flight >= self.max_in_flight:
                        await self._changes()
                        continue
                    if self.max_wait > 0 and not self._closing and not self._full():
                        left = self._queue[0].arrived + self.max_wait - time.monotonic()
                        if left > 0:
                            with anyio.move_on_after(left):
                                await self._changes()
                            continue
                    batch = self._take()
                    self._in_flight += 1
                    tg.start_soon(self._run_batch, batch)
                # closing: the task group waits for the running batches
        except BaseException as e:
            # The loop is ending (cancelled) or a bug: fail whatever is still queued.
            err: HeteroError = RuntimeClosedError("the event loop of this batcher ended before the item ran")
            if isinstance(e, Exception):
                err = HeteroError(f"the batcher of graph {self.graph.name!r} failed: {type(e).__name__}: {e}")
            while self._queue:
                self._settle(self._queue.popleft(), None, err)
            if not isinstance(e, Exception):
                raise
        finally:
            self._running = False
            self._loop = None
            self._task = None
            self._tg = None
            if self._stopped is not None:
                self._stopped.set()

    def _full(self) -> bool:
        q = self._queue
        if len(q) >= self.max_batch_size:
            return True
        if self.max_cost is None:
            return False
        m, n = 0, 0
        for item in q:
            m = max(m, item.cost)
            n += 1
            if m * n > self.max_cost:
                return True
        return False

    def _take(self) -> list[_Item]:
        q = self._queue
        batch = [q.popleft()]
        m = batch[0].cost
        while q and len(batch) < self.max_batch_size:
            c = max(m, q[0].cost)
            if self.max_cost is not None and c * (len(batch) + 1) > self.max_cost:
                break
            m = c
            batch.append(q.popleft())
        for item in batch:
            item.done = True  # no longer queued: a caller that leaves now leaves it running
        self.batches += 1
        self.items += len(batch)
        return batch

    async def _run_batch(self, batch: list[_Item]) -> None:
        formed = time.monotonic()
        try:
            if self.on_batch is not None:
                _observe(self.on_batch, len(batch), padded_cost([it.cost for it in batch]))
            groups = [list(range(len(batch)))]
            if self.split is not None and len(batch) > 1:
                groups = self._groups(batch)
            if len(groups) == 1:
                await self._run_group([batch[i] for i in groups[0]])
            else:
                async with anyio.create_task_group() as tg:
                    for g in groups:
                        tg.start_soon(self._run_group, [batch[i] for i in g])
        finally:
            self._in_flight -= 1
            if self._queue or self._closing:  # else the dispatcher has nothing to do until the next admission
                self._poke()
            if self.on_batch_done is not None:
                _observe(self.on_batch_done, len(batch), formed - sum(it.arrived for it in batch) / len(batch),
                         time.monotonic() - formed)

    def _groups(self, batch: list[_Item]) -> list[list[int]]:
        assert self.split is not None
        try:
            groups = [list(g) for g in self.split([it.cost for it in batch])]
        except Exception as e:
            groups = []
            err: BaseException = HeteroError(f"batcher: split() failed: {type(e).__name__}: {e}")
        else:
            flat = sorted(i for g in groups for i in g)
            if flat == list(range(len(batch))) and all(groups):
                return groups
            err = HeteroError(f"batcher: split() must return non-empty groups covering each of the "
                              f"{len(batch)} item indices once, got {groups!r}")
        for it in batch:
            self._settle(it, None, err)
        return []

    async def _run_group(self, items: list[_Item]) -> None:
        names = self._plan.input_names
        inputs = {name: [it.inputs[name] for it in items] for name in names}
        try:
            out = await self.runtime.run(self.graph, **inputs)
            shares = self._share(out, len(items))
        except Exception as e:
            for it in items:
                self._settle(it, None, e)
            return
        except BaseException:  # the batcher's loop is ending
            err = RuntimeClosedError("the event loop of this batcher ended while the item's batch ran")
            for it in items:
                self._settle(it, None, err)
            raise
        for it, share in zip(items, shares):
            self._settle(it, share, None)

    def _share(self, out: Any, n: int) -> list[Any]:
        outs = out if not self._plan.single_output else (out,)
        per: list[list[Any]] = []
        for k, o in enumerate(outs):
            try:
                size: int | None = len(o)
            except TypeError:  # no length (a scalar, a 0-d array)
                size = None
            if size != n:
                what = f"{size} entries" if size is not None else (
                    "a 0-d ndarray" if isinstance(o, np.ndarray) else f"a {type(o).__name__}")
                raise HeteroError(f"batched run of graph {self.graph.name!r}: output {k} has {what} along its "
                                  f"first axis, expected {n} (one per caller); the graph must return one entry "
                                  "per input item")
            if isinstance(o, np.ndarray):
                per.append(list(o.copy()))  # rows of one copy: out of the batch's array in one call
            else:
                per.append([o[i] for i in range(n)])
        if self._plan.single_output:
            return per[0]
        return [tuple(p[i] for p in per) for i in range(n)]

    @staticmethod
    def _settle(item: _Item, result: Any, error: BaseException | None) -> None:
        item.done = True
        item.result = result
        item.error = error
        if item.event is not None:
            item.event.set()
        elif item.on_done is not None:
            try:
                item.on_done(item.index, result, error)
            except Exception:  # a submitter's failure must not fail the batch for the others
                log.exception("batcher: an on_done callback of Batcher.submit failed (item %d)", item.index)


def _observe(observer: Callable[..., None], *args: Any) -> None:
    """Call a batch observer (``on_batch``, ``on_batch_done``): its failure must not fail the batch."""
    try:
        observer(*args)
    except Exception:
        pass
