"""Continuous batching: one engine thread steps every running sequence of an :class:`~hetero.pipelines.LLM`.

Callers (``generate``, ``agenerate``, ``stream``, from any thread and any event loop, asyncio
or trio) hand their sequences to the LLM's :class:`GenerationLoop` and receive pieces back;
they never step the engine themselves. The loop runs in a thread of its own, with its own
event loop, started on the first submission and stopped by :meth:`GenerationLoop.close`.

**An iteration** (the rules the loop keeps):

1. *Absorb.* New sequences join the waiting queue (first come, first served); cancelled
   ones leave it, or leave the running set, and their KV blocks return to the pool before
   the canceller is told.
2. *Admit.* While fewer than ``max_running`` sequences run, the oldest waiting one starts
   if the KV cache can reserve its worst case (prompt plus ``max_tokens``, at most
   ``max_seq_len``). A sequence that would not fit waits; nothing is preempted, since
   every running sequence already holds the room it can ever need, and no request is
   dropped. Younger sequences do not pass an older one that waits for room.
3. *Step.* Every running sequence that is decoding gives its one token; then prompts enter
   the cache in chunks, oldest first: up to ``max_batch_tokens`` rows in all, and no more
   than ``prefill_chunk`` prompt rows while some sequence decodes, so that a long prompt
   costs each running stream a short step, not a stall. All of it is one engine step (one
   captured GPU stage); only the sampled ids come back.

   *Steps overlap* (``pipeline``): step n+1 is started before step n's ids come back, so the
   host plans, feeds and records it while the GPU runs step n. A sequence that step n
   samples for gets its row in step n+1 at once, its token read on the GPU from step n's
   output (:class:`~hetero.pipelines.llm_engine.StepRow` ``src``), unless the host already
   knows that token is its last (``max_tokens``, ``max_seq_len``). Only an end-of-sequence
   token or a stop string, seen one step late, costs a row of wasted work: that row's token
   is dropped, and nothing it wrote is read. Results are the same as with serial steps
   (sampling depends only on the seed and the token's index). Jobs (logits passes) run with
   no step in flight.

   *Several steps a run* (``steps_per_run`` k > 1): while every row decodes (no prompt chunk in
   the step) and each has k tokens left (``max_tokens``, ``max_seq_len``), one engine run
   takes k decode steps, each step's tokens embedded on the GPU from the step before; each
   sequence's cache positions for the k tokens are taken first. Its tokens are delivered
   together; those past an end-of-sequence token or a stop string are dropped. A sequence
   admitted meanwhile (a new request, or room freed by one that ended) enters when the run
   ends. The tokens are the same as with one step a run.
4. *Deliver.* Each new token is detokenized and checked against its sequence's stop
   strings and limits here, in the loop; each caller is handed its pieces on its own event
   loop. A sequence that ends (end-of-sequence token, stop string, ``max_tokens``,
   ``max_seq_len``) leaves the running set and its blocks return at once.

An iteration with nothing to run waits for a submission; it costs nothing while idle.

**Limits.** ``max_waiting`` sequences may wait (``None``: no limit); a submission past it
raises :class:`~hetero.errors.OverloadedError` at once (a server answers 429). A failed step
(device lost, runtime closed) fails the sequences it ran, and the loop goes on with the
next submission.

Greedy results do not depend on what else shares a step: each row's arithmetic is its own.
"""

from __future__ import annotations

import functools
import secrets
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import numpy as np

from hetero import StartedRun
from hetero.errors import OverloadedError, RuntimeClosedError
from hetero.lowlevel import loop_caller

from .llm_engine import DecoderEngine, StepRow

__all__ = ["GenerationLoop", "GenerationStats", "Sampling", "SeqState", "StreamPiece", "Ticket"]

DEFAULT_MAX_RUNNING = 256
"""Most sequences decoding at once (each is one row of every step)."""
DEFAULT_PREFILL_CHUNK = 512
"""Most prompt rows a step takes while some sequence is decoding."""
_CANCEL_WAIT_S = 30.0  # a canceller waits at most this long for the loop to free its blocks


@dataclass(frozen=True)
class StreamPiece:
    """One step of a stream: the text it completes (often one token's, sometimes ``""`` while a
    multi-byte character or a possible stop string is held back) and the token id. The last
    piece has ``finish_reason`` set, and ``token_id`` ``None`` when it carries no new token (an
    end-of-sequence token, or the held-back text)."""

    text: str
    token_id: int | None
    finish_reason: str | None = None


@dataclass(frozen=True)
class Sampling:
    """How one request samples and when it stops (checked by the LLM before submission)."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]


@dataclass(eq=False)
class SeqState:
    """One prompt's state. The loop's thread writes it; its caller reads it after the last piece."""

    index: int
    prompt: list[int]
    sampling: Sampling
    seed: int
    budget: int  # positions reserved in the KV cache
    detok: Any
    key: Any = None  # the KV pool's key, while it runs
    ids: list[int] = field(default_factory=list)  # prompt + generated
    fed: int = 0  # positions in the cache
    text: str = ""  # generated text so far (stop strings cut)
    emitted: int = 0  # characters of text already streamed
    finish: str | None = None
    reserved: bool = False
    first_at: float | None = None
    last_at: float | None = None
    gpu_ms: float = 0.0

    @property
    def generated(self) -> list[int]:
        return self.ids[len(self.prompt):]

    @property
    def n_generated(self) -> int:
        """``len(generated)`` without the copy (read every step)."""
        return len(self.ids) - len(self.prompt)


def cut_at_stop(s: SeqState) -> bool:
    """End ``s``'s text before the first stop string in it (``finish = "stop"``); whether one was there.

    Only the text not yet streamed is searched (from a stop string's length before it): earlier
    text was released because no stop string could start in it.
    """
    hits = [i for i in (s.text.find(x, max(0, s.emitted - len(x))) for x in s.sampling.stop) if i >= 0]
    if not hits:
        return False
    s.text = s.text[:min(hits)]
    s.finish = "stop"
    return True


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """Characters at the end of ``text`` that could be the start of a stop string."""
    most = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), most, -1):
            if text.endswith(s[:n]):
                most = n
                break
    return most


def _release_text(s: SeqState, final: bool) -> str:
    safe = len(s.text) if final else len(s.text) - held_back(s.text, s.sampling.stop)
    safe = max(safe, s.emitted)
    piece = s.text[s.emitted:safe]
    s.emitted = safe
    return piece


@dataclass(frozen=True)
class GenerationStats:
    """The loop's state now, and its totals since the LLM was made."""

    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    tokens_generated: int
    prompt_tokens: int
    requests_finished: int
    steps: int


class Ticket:
    """One caller's sequences, and the caller's side of their delivery.

    Made on the caller's event loop; the loop's thread hands it pieces with
    :meth:`post` (run on the caller's loop through ``loop_caller``).
    """

    def __init__(self, seqs: Sequence[SeqState]) -> None:
        self.seqs = list(seqs)
        self.call = loop_caller()
        self.loop = anyio.lowlevel.current_token().native_token  # the caller's loop (post_each groups by it)
        self.pieces: deque[tuple[SeqState, StreamPiece]] = deque()
        self.error: BaseException | None = None
        self.cancelled = False
        self.open = len(self.seqs)  # sequences not yet finished (the thread's count)
        self._arrived = anyio.Event()
        self.released = anyio.Event()

    # -- the caller's loop ----------------------------------------------------------------------
    def receive(self, batch: list[tuple[SeqState, StreamPiece]] | BaseException) -> None:
        """Take pieces (or the error) the loop's thread sent (on this ticket's loop)."""
        if isinstance(batch, BaseException):
            self.error = batch
        else:
            self.pieces.extend(batch)
        self._arrived.set()

    async def next_batch(self) -> None:
        """Wait until pieces (or an error) have arrived."""
        while not self.pieces and self.error is None:
            await self._arrived.wait()
            self._arrived = anyio.Event()

    # -- any thread -----------------------------------------------------------------------------
    def post(self, batch: list[tuple[SeqState, StreamPiece]] | BaseException) -> None:
        self.call(lambda: self.receive(batch))

    def post_released(self) -> None:
        self.call(self.released.set)

    @staticmethod
    def post_each(items: Sequence[tuple[Ticket, list[tuple[SeqState, StreamPiece]]]]) -> None:
        """:meth:`post` each ticket its batch, with one call into each callers' loop (a server's
        streams share one: a call each would cost the loop's thread a wake-up each)."""
        by_loop: dict[int, list[tuple[Ticket, list[tuple[SeqState, StreamPiece]]]]] = {}
        for t, batch in items:
            by_loop.setdefault(id(t.loop), []).append((t, batch))
        for group in by_loop.values():
            def take(group: list[tuple[Ticket, list[tuple[SeqState, StreamPiece]]]] = group) -> None:
                for t, batch in group:
                    t.receive(batch)
            group[0][0].call(take)


@dataclass(eq=False)
class _Job:
    """A pass the loop runs between steps (logits), with ``tokens`` positions reserved for it, and who waits."""

    fn: Callable[[Any], Awaitable[Any]]
    tokens: int
    call: Callable[[Callable[[], Any]], None]
    done: Callable[[Any, BaseException | None], None]


@dataclass(eq=False)
class _Step:
    """A started engine step: its run, its rows, and the (ticket, sequence) of each row."""

    run: StartedRun
    rows: list[StepRow]
    takers: list[tuple[Ticket, SeqState]]
    steps: int = 1  # decode steps the run takes (each row one token a step)


class GenerationLoop:
    """The engine thread of one LLM (see the module doc).

    ``eos``: end-of-sequence token ids. ``timing``: add each step's GPU time (from
    ``gpu_ms()``) to the sequences it ran.
    """

    def __init__(self, engine: DecoderEngine, *, eos: Sequence[int], max_seq_len: int, max_batch_tokens: int,
                 max_running: int = DEFAULT_MAX_RUNNING, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 max_waiting: int | None = None, timing: bool = False,
                 gpu_ms: Callable[[], float] | None = None, pipeline: bool = True, steps_per_run: int = 1) -> None:
        self.engine = engine
        self.eos = frozenset(int(e) for e in eos)
        self.max_seq_len = max_seq_len
        self.max_batch_tokens = max_batch_tokens
        self.max_running = min(max_running, max_batch_tokens)
        self.prefill_chunk = prefill_chunk
        self.max_waiting = max_waiting
        self.timing = timing
        self._gpu_ms = gpu_ms
        # steps overlap only where the engine's steps run in the order started, and not while each
        # step's GPU time is read back for its sequences (it would be the overlapping step's)
        self.pipeline = bool(pipeline) and engine.chains_in_order and not timing
        self.steps_per_run = steps_per_run
        self._lock = threading.Lock()  # guards what callers hand over: _inbox, _cancels, _jobs, _queued, _closed
        self._inbox: list[Ticket] = []
        self._cancels: list[Ticket] = []
        self._jobs: list[_Job] = []
        self._deferred: list[_Job] = []  # jobs waiting for KV room (the thread's)
        self._queued = 0  # sequences submitted and not yet admitted (the inbox's and the waiting queue's)
        self._closed = False
        self._crash: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._call: Callable[[Callable[[], Any]], None] | None = None
        self._wake: anyio.Event | None = None
        # the thread's own state
        self._waiting: deque[tuple[Ticket, SeqState]] = deque()
        self._running: list[tuple[Ticket, SeqState]] = []
        self._ahead: _Step | None = None  # the step started and not yet taken back
        self._keys = 0
        self._tokens = 0
        self._prompt_tokens = 0
        self._finished = 0
        self._steps = 0

    # -- callers (any thread) -------------------------------------------------------------------
    def submit(self, ticket: Ticket) -> None:
        """Queue ``ticket``'s sequences; raises OverloadedError past ``max_waiting``, RuntimeClosedError once closed."""
        n = len(ticket.seqs)
        with self._lock:
            if self._closed:
                raise self._closed_error()
            if self.max_waiting is not None and self._queued + n > self.max_waiting:
                raise OverloadedError(
                    f"LLM: {self._queued} sequences are waiting to start, and max_waiting is {self.max_waiting}; "
                    "retry later, or make the LLM with a larger max_waiting")
            self._inbox.append(ticket)
            self._queued += n
            self._start()
        self._poke()

    def cancel(self, ticket: Ticket) -> None:
        """Stop ``ticket``'s sequences; the loop frees their blocks and then calls ``ticket.post_released``."""
        with self._lock:
            ticket.cancelled = True
            if self._closed and self._thread is None:
                ticket.post_released()
                return
            self._cancels.append(ticket)
        self._poke()

    async def run_job(self, fn: Callable[[Any], Awaitable[Any]], tokens: int) -> Any:
        """Run ``await fn(key)`` on the loop's thread between steps, with room for ``tokens`` positions
        reserved under the pool key ``key`` (it waits, in turn, until they fit); its result here."""
        done = anyio.Event()
        box: list[Any] = []

        def finish(value: Any, error: BaseException | None) -> None:
            box.append((value, error))
            done.set()

        job = _Job(fn, tokens, loop_caller(), finish)
        with self._lock:
            if self._closed:
                raise self._closed_error()
            self._jobs.append(job)
            self._start()
        self._poke()
        await done.wait()
        value, error = box[0]
        if error is not None:
            raise error
        return value

    def stats(self) -> GenerationStats:
        """Running and waiting sequences, KV blocks in use, and totals (a snapshot; any thread)."""
        with self._lock:
            queued = self._queued
        pool = self.engine.pool
        return GenerationStats(len(self._running), queued, pool.num_used - 1, self.engine.num_blocks, self._tokens,
                               self._prompt_tokens, self._finished, self._steps)

    def close(self) -> None:
        """Fail what is queued or running with RuntimeClosedError, and stop the thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        self._poke()
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _start(self) -> None:  # under the lock
        if self._thread is None:
            self._thread = threading.Thread(target=anyio.run, args=(self._main,), name="hetero-llm-loop",
                                            daemon=True)
            self._thread.start()

    def _poke(self) -> None:
        call = self._call
        if call is not None:
            call(self._set_wake)

    def _set_wake(self) -> None:
        if self._wake is not None:
            self._wake.set()

    # -- the loop's thread ----------------------------------------------------------------------
    async def _main(self) -> None:
        with self._lock:
            self._call = loop_caller()
            self._wake = anyio.Event()
        try:
            await self._iterate()
        except BaseException as e:  # a defect of the loop itself: later calls say so instead of waiting forever
            with self._lock:
                self._crash = e
                self._closed = True
            raise
        finally:
            ahead, self._ahead = self._ahead, None
            if ahead is not None:  # its memory back before the loop ends
                await ahead.run.cancel()
            self._fail_all(self._closed_error())
            with self._lock:
                self._call = None
                jobs, self._jobs = self._deferred + self._jobs, []
                self._deferred = []
            for job in jobs:
                job.call(functools.partial(job.done, None, self._closed_error()))

    async def _iterate(self) -> None:
        while True:
            jobs, closed = self._absorb()
            if closed:
                return
            jobs, self._deferred = self._deferred + jobs, []
            for job in jobs:
                await self._run_job(job)
            self._admit()
            if not self._running and self._ahead is None:
                with self._lock:
                    idle = not (self._inbox or self._cancels or self._jobs or self._closed)
                if idle:  # deferred jobs wait for room that only a finishing sequence frees
                    assert self._wake is not None
                    await self._wake.wait()
                self._wake = anyio.Event()
                continue
            await self._step()

    def _closed_error(self) -> BaseException:
        if self._crash is not None:
            return RuntimeClosedError(f"this LLM's generation loop stopped on an error ({self._crash!r}); make a new "
                                      "LLM")
        return RuntimeClosedError("this LLM is closed; make a new one")

    def _absorb(self) -> tuple[list[_Job], bool]:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, []
            jobs, self._jobs = self._jobs, []
            closed = self._closed
        for t in inbox:
            if t.cancelled:  # cancelled before it was seen
                with self._lock:
                    self._queued -= len(t.seqs)
                continue
            self._waiting.extend((t, s) for s in t.seqs)
        for t in cancels:
            self._drop(t)
            t.post_released()
        return jobs, closed

    def _drop(self, t: Ticket) -> None:
        """Take ``t``'s sequences out of the queue and the running set, freeing their blocks."""
        kept = deque(x for x in self._waiting if x[0] is not t)
        with self._lock:
            self._queued -= len(self._waiting) - len(kept)
        self._waiting = kept
        for x in [x for x in self._running if x[0] is t]:
            self._running.remove(x)
            self._free(x[1])

    def _free(self, s: SeqState) -> None:
        if s.reserved:
            self.engine.release(s.key, s.budget)
            s.reserved = False

    async def _run_job(self, job: _Job) -> None:
        if self._waiting or not self.engine.reserve(job.tokens):  # in turn: after the sequences queued before it
            self._deferred.append(job)
            return
        await self._drain()
        self._keys += 1
        key = ("hetero.llm.job", id(self), self._keys)
        value, error = None, None
        try:
            value = await job.fn(key)
        except Exception as e:  # the job's own error goes to its caller
            error = e
        finally:
            self.engine.release(key, job.tokens)  # before the caller hears
        job.call(functools.partial(job.done, value, error))

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.max_running:
            t, s = self._waiting[0]
            if not self.engine.reserve(s.budget):
                return
            self._waiting.popleft()
            with self._lock:
                self._queued -= 1
            s.reserved = True
            self._keys += 1
            s.key = ("hetero.llm", id(self), self._keys)
            self._prompt_tokens += len(s.prompt)
            self._running.append((t, s))

    def _plan(self, ahead: _Step | None) -> tuple[list[StepRow], list[tuple[Ticket, SeqState]], int]:
        """This step's rows: every decoding sequence's one token, then prompt chunks, oldest first;
        and the decode steps the run takes (more than one only with ``steps_per_run``, when every
        row decodes and each has that many tokens left).

        With ``ahead`` (the step in flight) each sequence is taken as it will be once that step's
        rows are in the cache: one it samples for decodes its token straight from that step's
        output row, unless the host knows that token ends it.
        """
        in_flight = {id(s): (j, row) for j, ((_, s), row) in enumerate(zip(ahead.takers, ahead.rows))} \
            if ahead is not None else {}
        k_ahead = ahead.steps if ahead is not None else 1  # tokens the run in flight samples a sequence
        decoding: list[tuple[Ticket, SeqState, int, int, int]] = []  # (ticket, seq, fed, generated, src)
        filling: list[tuple[Ticket, SeqState, int]] = []
        for t, s in self._running:
            if t.cancelled:
                continue
            fed, gen = s.fed, s.n_generated
            hit = in_flight.get(id(s))
            if hit is not None:
                j, row = hit
                fed += len(row.tokens)
                if fed >= len(s.ids):  # the step in flight samples this sequence's next tokens
                    if gen + k_ahead >= s.sampling.max_tokens or len(s.ids) + k_ahead >= self.max_seq_len:
                        continue  # ... and the last of them is its last
                    decoding.append((t, s, fed + k_ahead - 1, gen + k_ahead, j))
                    continue
            if len(s.ids) - fed == 1:
                decoding.append((t, s, fed, gen, -1))
            else:
                filling.append((t, s, fed))
        budget = self.max_batch_tokens - len(decoding)
        if decoding:
            budget = min(budget, self.prefill_chunk)
        rows: list[StepRow] = []
        takers: list[tuple[Ticket, SeqState]] = []
        for t, s, fed, gen, src in decoding:
            sp = s.sampling
            tokens = [0] if src >= 0 else s.ids[fed:fed + 1]
            rows.append(StepRow(s.key, tokens, fed, sp.temperature, sp.top_k, sp.top_p, s.seed, gen, src))
            takers.append((t, s))
        for t, s, fed in filling:
            n = min(len(s.ids) - fed, budget)
            if n < 1:
                break
            sp = s.sampling
            rows.append(StepRow(s.key, s.ids[fed:fed + n], fed, sp.temperature, sp.top_k, sp.top_p, s.seed,
                                s.n_generated))
            takers.append((t, s))
            budget -= n
        steps = 1
        # (a sequence still waiting could not start now: the admission before this step took every one
        # that fits; one that fits once a run ends starts after that run)
        if self.steps_per_run > 1 and decoding and len(rows) == len(decoding):
            left = min(min(s.sampling.max_tokens - gen, self.max_seq_len - fed - 1) for _, s, fed, gen, _ in decoding)
            steps = max(1, min(self.steps_per_run, left))
        return rows, takers, steps

    async def _step(self) -> None:
        """Start the next step; take back the one before it (pipelined), or this one (serial)."""
        ahead, self._ahead = self._ahead, None
        rows, takers, steps = self._plan(ahead)
        started: _Step | None = None
        if rows:
            try:
                started = _Step(self.engine.launch(rows, steps), rows, takers, steps)
            except Exception as e:  # it could not start: the sequences it was for fail
                self._fail_tickets(takers, e)
        if ahead is not None:
            self._ahead = started
            await self._take(ahead)
        elif started is not None:
            if self.pipeline:
                self._ahead = started
            else:
                await self._take(started)

    async def _drain(self) -> None:
        """Take back the step in flight, if any."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            await self._take(ahead)

    def _fail_tickets(self, takers: list[tuple[Ticket, SeqState]], error: BaseException) -> None:
        for t in {id(t): t for t, _ in takers}.values():
            self._drop(t)
            t.post(error)

    async def _take(self, st: _Step) -> None:
        """A started step's ids: each sequence still running takes its token."""
        try:
            result = await st.run.result()
        except Exception as e:  # the step failed: so do the sequences it ran
            self._fail_tickets([x for x in st.takers if x[1].reserved], e)
            return
        outs = [np.asarray(o) for o in result] if st.steps > 1 else [np.asarray(result)]
        self._steps += st.steps
        now = time.perf_counter()
        gpu_ms = self._gpu_ms() if self.timing and self._gpu_ms is not None else 0.0
        batches: dict[int, tuple[Ticket, list[tuple[SeqState, StreamPiece]]]] = {}
        for i, ((t, s), row) in enumerate(zip(st.takers, st.rows)):
            if not s.reserved or s.finish is not None:  # it ended (or failed, or was cancelled) meanwhile
                continue
            s.fed += len(row.tokens) + st.steps - 1
            s.gpu_ms += gpu_ms
            if s.fed < len(s.ids) or t.cancelled:  # a prompt chunk: no token yet
                continue
            batch = batches.setdefault(id(t), (t, []))[1]
            for out in outs:  # a run of several steps: its tokens past one that ends the sequence are dropped
                batch.append((s, self._accept(s, int(out[i]), now)))
                if s.finish is not None:
                    break
        for x in [x for x in self._running if x[1].finish is not None]:  # blocks free before the caller hears
            self._running.remove(x)
            self._free(x[1])
            self._finished += 1
        Ticket.post_each(list(batches.values()))

    def _accept(self, s: SeqState, tok: int, now: float) -> StreamPiece:
        """Take sequence ``s``'s new token; the piece it releases (the last carries the finish reason)."""
        if s.first_at is None:
            s.first_at = now
        s.last_at = now
        if tok in self.eos:
            s.text += s.detok.flush()
            s.finish = "stop"
            return StreamPiece(_release_text(s, final=True), None, "stop")
        self._tokens += 1
        s.ids.append(tok)
        s.text += s.detok.push(tok)
        if cut_at_stop(s):
            return StreamPiece(_release_text(s, final=True), tok, "stop")
        if s.n_generated >= s.sampling.max_tokens or len(s.ids) >= self.max_seq_len:
            s.text += s.detok.flush()
            s.finish = "stop" if cut_at_stop(s) else "length"  # the flushed tail may hold a stop string
            return StreamPiece(_release_text(s, final=True), tok, s.finish)
        return StreamPiece(_release_text(s, final=False), tok)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, []
        self._waiting.extend((t, s) for t in inbox for s in t.seqs)
        tickets = {id(t): t for t, _ in list(self._waiting) + self._running}
        for t in list(tickets.values()):
            self._drop(t)
            t.post(error)
            t.post_released()
        for t in cancels:
            t.post_released()
        with self._lock:
            self._queued = 0


def new_seed() -> int:
    """A fresh sampling seed (for a request that gives none)."""
    return secrets.randbits(32)


async def wait_released(ticket: Ticket) -> None:
    """After :meth:`GenerationLoop.cancel`: wait (shielded from cancellation) until the blocks are free."""
    with anyio.CancelScope(shield=True), anyio.move_on_after(_CANCEL_WAIT_S):
        await ticket.released.wait()
