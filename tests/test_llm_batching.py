"""Continuous batching (hetero.pipelines.llm_batch): concurrent callers share the engine's steps."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import sys
import threading

import anyio
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from llm_fixtures import write_tiny_gguf  # noqa: E402

from hetero.errors import OverloadedError, RuntimeClosedError  # noqa: E402
from hetero.pipelines import LLM  # noqa: E402
from hetero.pipelines.kv_cache import kv_block_bytes  # noqa: E402
from hetero.pipelines.llm_model import load_model  # noqa: E402

KV = 1 << 20  # 128 blocks of 16 tokens for the tiny model
PROMPTS = ["The quick brown fox", "What is the capital of France?", "def f(x):\n    return", "A",
           "Return the number of items in a container.", "Open file and return a stream.",
           "Split the string at the first occurrence of sep.", "The sum of a sequence of numbers."]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The tiny llama with no end-of-sequence token, so that every generation runs its full length."""
    m = load_model(write_tiny_gguf(tmp_path_factory.mktemp("batch") / "llama.gguf", "llama", "f32"))
    m.config = dataclasses.replace(m.config, eos_token_ids=())
    return m


@pytest.fixture(scope="module")
def llm(model, shared_rt):
    with LLM(model, runtime=shared_rt, kv_cache_bytes=KV) as llm:
        yield llm


@pytest.fixture(scope="module")
def alone(llm):
    """Each prompt's greedy tokens, run by itself."""
    return [llm.generate(p, max_tokens=12).token_ids for p in PROMPTS]


async def each_prompt(target: LLM, kw: list[dict]) -> list:
    """``agenerate`` of every prompt of PROMPTS at once, prompt i with ``kw[i]``; the completions in order."""
    out: list = [None] * len(PROMPTS)

    async def one(i: int) -> None:
        out[i] = await target.agenerate(PROMPTS[i], **kw[i])
    async with anyio.create_task_group() as tg:
        for i in range(len(PROMPTS)):
            tg.start_soon(one, i)
    return out


def count_runs(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The steps of every run ``llm``'s engine launches from now on, in order."""
    runs: list[int] = []
    launch = llm.engine.launch

    def counted(rows, steps=1):
        runs.append(steps)
        return launch(rows, steps)
    monkeypatch.setattr(llm.engine, "launch", counted)
    return runs


def idle(llm: LLM) -> bool:
    s = llm.stats()
    return s.running == 0 and s.waiting == 0 and s.kv_blocks_used == 0 and llm.engine.reserved_blocks == 0


@pytest.mark.anyio
async def test_callers_arriving_at_random_times_get_their_tokens_alone(llm, alone):
    rng = random.Random(7)
    delays = [rng.uniform(0, 0.05) for _ in PROMPTS]
    got: dict[int, list[int]] = {}

    async def caller(i: int) -> None:
        await anyio.sleep(delays[i])
        if i % 2:
            c = await llm.agenerate(PROMPTS[i], max_tokens=12)
            got[i] = c.token_ids
        else:
            got[i] = [p.token_id async for p in llm.stream(PROMPTS[i], max_tokens=12) if p.token_id is not None]

    async with anyio.create_task_group() as tg:
        for i in range(len(PROMPTS)):
            tg.start_soon(caller, i)
    assert [got[i] for i in range(len(PROMPTS))] == alone
    assert idle(llm)


@pytest.mark.anyio
async def test_a_stream_joins_the_running_steps(llm, alone):
    """B starts while A decodes: both run in the same steps, and each gets its tokens alone."""
    steps0 = llm.stats().steps
    a_tokens: list[int] = []
    b_tokens: list[int] = []
    running_seen = []
    async with contextlib.aclosing(llm.stream(PROMPTS[0], max_tokens=200)) as a:
        async for piece in a:
            a_tokens.append(piece.token_id)
            if len(a_tokens) == 1:
                async for q in llm.stream(PROMPTS[1], max_tokens=12):
                    running_seen.append(llm.stats().running)
                    b_tokens.append(q.token_id)
            if len(a_tokens) == 20:
                break
    assert b_tokens == alone[1]
    assert a_tokens[:12] == alone[0]
    assert 2 in running_seen  # B's tokens came while A was running
    steps = llm.stats().steps - steps0
    assert steps < 200  # A was cancelled, not run to its end
    assert idle(llm)


@pytest.mark.anyio
async def test_a_long_prompt_enters_in_chunks_while_a_stream_decodes(model, shared_rt):
    """With prefill_chunk 16, a 160-token prompt takes 10 steps; the running stream gets a token each."""
    with LLM(model, runtime=shared_rt, kv_cache_bytes=KV, prefill_chunk=16) as llm:
        long_ids = (llm.encode(" ".join(PROMPTS)) * 8)[:160]
        want_long = (await llm.agenerate(long_ids, max_tokens=4)).token_ids
        a_count = 0
        a_at_b_first = None
        b_tokens: list[int] = []
        async with contextlib.aclosing(llm.stream(PROMPTS[0], max_tokens=200)) as a:
            async with anyio.create_task_group() as tg:
                async def b() -> None:
                    nonlocal a_at_b_first
                    async for q in llm.stream(long_ids, max_tokens=4):
                        if a_at_b_first is None:
                            a_at_b_first = a_count
                        b_tokens.append(q.token_id)

                async for _ in a:
                    a_count += 1
                    if a_count == 1:
                        tg.start_soon(b)
                    if b_tokens and len(b_tokens) == 4:
                        break
        assert b_tokens == want_long
        assert a_at_b_first is not None and a_at_b_first - 1 >= 160 // 16 - 1  # A decoded while B's prompt went in
        assert idle(llm)


@pytest.mark.anyio
async def test_leaving_or_cancelling_frees_the_blocks_at_once(llm):
    async with contextlib.aclosing(llm.stream(PROMPTS[2], max_tokens=150)) as stream:
        async for _ in stream:
            assert llm.stats().kv_blocks_used > 0
            break
    assert idle(llm)  # aclose returned after the loop freed them
    with anyio.move_on_after(0.2):
        await llm.agenerate(PROMPTS * 2, max_tokens=200)
    assert idle(llm)


@pytest.mark.anyio
async def test_a_tiny_cache_runs_every_caller_in_turn_and_loses_nothing(model, shared_rt, alone):
    kv = 4 * kv_block_bytes(model.config, 16, 4)  # 3 blocks and the scratch block: one or two sequences at a time
    with LLM(model, runtime=shared_rt, kv_cache_bytes=kv) as llm:
        assert llm.engine.num_blocks == 3
        got: dict[int, list[int]] = {}

        async def caller(i: int) -> None:
            c = await llm.agenerate(PROMPTS[i], max_tokens=12)
            got[i] = c.token_ids

        async with anyio.create_task_group() as tg:
            for i in range(len(PROMPTS)):
                tg.start_soon(caller, i)
        assert [got[i] for i in range(len(PROMPTS))] == alone
        assert idle(llm)
        assert llm.stats().requests_finished == len(PROMPTS)


@pytest.mark.anyio
async def test_past_max_waiting_a_call_is_refused_at_once(model, shared_rt, alone):
    with LLM(model, runtime=shared_rt, kv_cache_bytes=KV, max_running=1, max_waiting=1) as llm:
        async with contextlib.aclosing(llm.stream(PROMPTS[0], max_tokens=200)) as a:
            await a.__anext__()  # A runs: the one running place is taken
            async with anyio.create_task_group() as tg:
                done: list[list[int]] = []

                async def b() -> None:
                    done.append((await llm.agenerate(PROMPTS[1], max_tokens=12)).token_ids)

                tg.start_soon(b)
                while llm.stats().waiting < 1:
                    await anyio.sleep(0.001)
                with pytest.raises(OverloadedError, match="max_waiting is 1"):
                    await llm.agenerate(PROMPTS[2], max_tokens=4)
                with pytest.raises(OverloadedError):
                    await llm.stream(PROMPTS[2], max_tokens=4).__anext__()
                await a.aclose()  # B starts now
        assert done == [alone[1]]
        assert idle(llm)


@pytest.mark.anyio
async def test_logits_between_steps_equal_logits_alone(llm):
    ids = llm.encode(PROMPTS[4])
    want = await llm.alogits(ids)
    async with contextlib.aclosing(llm.stream(PROMPTS[0], max_tokens=100)) as a:
        await a.__anext__()
        got = await llm.alogits(ids)
    np.testing.assert_array_equal(got, want)
    assert idle(llm)


def test_sync_callers_in_threads_share_the_loop(llm, alone):
    got: dict[int, list[int]] = {}

    def caller(i: int) -> None:
        got[i] = llm.generate(PROMPTS[i], max_tokens=12).token_ids

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [got[i] for i in range(4)] == alone[:4]
    assert idle(llm)


def test_stats_count_tokens_and_requests(model, shared_rt):
    with LLM(model, runtime=shared_rt, kv_cache_bytes=KV) as llm:
        s0 = llm.stats()
        assert (s0.running, s0.waiting, s0.tokens_generated, s0.requests_finished, s0.steps) == (0, 0, 0, 0, 0)
        assert s0.kv_blocks_total == llm.engine.num_blocks
        cs = llm.generate(PROMPTS[:3], max_tokens=5)
        s = llm.stats()
        assert s.tokens_generated == 15 and s.requests_finished == 3
        assert s.prompt_tokens == sum(c.prompt_tokens for c in cs)
        assert 5 <= s.steps < 15  # the three decoded together


@pytest.mark.anyio
async def test_closing_the_llm_fails_a_running_stream(model, shared_rt):
    llm = LLM(model, runtime=shared_rt, kv_cache_bytes=KV)
    with pytest.raises(RuntimeClosedError):
        async with contextlib.aclosing(llm.stream(PROMPTS[0], max_tokens=200)) as a:
            async for _ in a:
                await anyio.to_thread.run_sync(llm.close)
    with pytest.raises(RuntimeClosedError):
        await llm.agenerate(PROMPTS[0], max_tokens=2)


# -- overlapping steps (pipeline) -------------------------------------------------------------------
@pytest.fixture(scope="module")
def serial(model, shared_rt):
    with LLM(model, runtime=shared_rt, kv_cache_bytes=KV, pipeline=False) as llm:
        assert not llm.pipeline
        yield llm


def test_overlapping_steps_start_each_step_before_the_last_is_taken(llm, serial, monkeypatch):
    assert llm.pipeline
    events: list[str] = []

    def watch(target):
        launch = target.engine.launch

        def launched(rows, steps=1):
            started = launch(rows, steps)
            events.append(f"launch:{sum(r.src >= 0 for r in rows)}")
            result = started.result

            async def taken():
                events.append("take")
                return await result()
            started.result = taken
            return started
        monkeypatch.setattr(target.engine, "launch", launched)

    watch(llm)
    assert llm.generate(PROMPTS[0], max_tokens=5).token_ids == serial.generate(PROMPTS[0], max_tokens=5).token_ids
    # the prompt's step, then four steps each started before the one before it is taken (its one
    # row read on the GPU), the last token known in advance: no fifth
    assert events == ["launch:0", "launch:1", "take", "launch:1", "take", "launch:1", "take", "launch:1", "take",
                      "take"]
    events.clear()
    watch(serial)
    serial.generate(PROMPTS[0], max_tokens=3)
    assert events == ["launch:0", "take", "launch:0", "take", "launch:0", "take"]
    assert idle(llm) and idle(serial)


@pytest.mark.anyio
async def test_overlapping_steps_give_serial_steps_tokens(llm, serial):
    """Greedy and seeded sampling, prompts of many lengths sharing steps, different max_tokens and a
    stop string: the same tokens and text either way."""
    kw = [dict(max_tokens=3 + i, temperature=0.0 if i % 2 else 0.9, seed=i, top_k=5 * (i % 3))
          for i in range(len(PROMPTS))]

    a, b = await each_prompt(llm, kw), await each_prompt(serial, kw)
    assert [(c.token_ids, c.text, c.finish_reason) for c in a] == [(c.token_ids, c.text, c.finish_reason) for c in b]
    stop = b[3].text[2:4]  # a stop string inside one greedy answer: it ends there both ways
    x = await llm.agenerate(PROMPTS[3], max_tokens=kw[3]["max_tokens"], stop=stop)
    y = await serial.agenerate(PROMPTS[3], max_tokens=kw[3]["max_tokens"], stop=stop)
    assert (x.text, x.finish_reason, x.token_ids) == (y.text, y.finish_reason, y.token_ids)
    assert idle(llm) and idle(serial)


def test_an_end_of_sequence_token_seen_a_step_late_wastes_one_row(model, shared_rt, alone, monkeypatch):
    """The step after an end-of-sequence token was already started with the sequence in it: its
    token is dropped, the blocks come back, and a sequence that joins next gets its own tokens."""
    eos = alone[1][4]
    m = dataclasses.replace(model, config=dataclasses.replace(model.config, eos_token_ids=(eos,)))
    with LLM(m, runtime=shared_rt, kv_cache_bytes=KV) as llm, \
            LLM(m, runtime=shared_rt, kv_cache_bytes=KV, pipeline=False) as ref:
        launches = {name: count_runs(target, monkeypatch) for name, target in (("llm", llm), ("ref", ref))}
        want = ref.generate(PROMPTS[1], max_tokens=12)
        got = llm.generate(PROMPTS[1], max_tokens=12)
        assert got.finish_reason == want.finish_reason == "stop"
        assert got.token_ids == want.token_ids == alone[1][:alone[1].index(eos)]
        assert idle(llm)
        assert len(launches["llm"]) == len(launches["ref"]) + 1 == len(got.token_ids) + 2  # one wasted step
        both = llm.generate([PROMPTS[1], PROMPTS[2]], max_tokens=12)
        assert [c.token_ids for c in both] == [c.token_ids for c in ref.generate([PROMPTS[1], PROMPTS[2]],
                                                                                  max_tokens=12)]
        assert idle(llm)


# -- several decode steps a run (steps_per_run) -------------------------------------------------------
@pytest.mark.anyio
@pytest.mark.parametrize("steps, pipeline", [(2, True), (3, False), (4, True)])
async def test_runs_of_several_steps_give_single_steps_tokens(model, shared_rt, serial, steps, pipeline,
                                                              monkeypatch):
    """Greedy and seeded sampling, prompts sharing runs, max_tokens that are not multiples of the run,
    a stop string inside a run: the tokens and text of one step a run. Runs of several steps happen
    (counted), the steps count each, and everything is back at the end."""
    kw = [dict(max_tokens=3 + 2 * i, temperature=0.0 if i % 2 else 0.9, seed=i, top_k=5 * (i % 3))
          for i in range(len(PROMPTS))]
    with LLM(model, runtime=shared_rt, kv_cache_bytes=KV, steps_per_run=steps, pipeline=pipeline) as llm:
        assert llm.steps_per_run == steps
        runs = count_runs(llm, monkeypatch)

        a, b = await each_prompt(llm, kw), await each_prompt(serial, kw)
        assert [(c.token_ids, c.text, c.finish_reason) for c in a] == \
            [(c.token_ids, c.text, c.finish_reason) for c in b]
        assert 1 < max(runs) <= steps and llm.stats().steps == sum(runs)
        runs.clear()
        lone = await llm.agenerate(PROMPTS[0], max_tokens=12)
        assert lone.token_ids == (await serial.agenerate(PROMPTS[0], max_tokens=12)).token_ids
        assert runs[0] == 1 and steps in runs and sum(runs) == 12  # the prompt's step, then runs of up to `steps`
        stop = b[5].text[3:5]
        x = await llm.agenerate(PROMPTS[5], max_tokens=kw[5]["max_tokens"], stop=stop)
        y = await serial.agenerate(PROMPTS[5], max_tokens=kw[5]["max_tokens"], stop=stop)
        assert (x.text, x.finish_reason, x.token_ids) == (y.text, y.finish_reason, y.token_ids)
        assert idle(llm)


def test_a_run_of_several_steps_drops_the_tokens_past_an_end_of_sequence(model, shared_rt, alone):
    """An end-of-sequence token in the middle of a run: the tokens after it are computed and dropped,
    the blocks come back, and the next caller gets its own tokens."""
    eos = alone[1][5]
    m = dataclasses.replace(model, config=dataclasses.replace(model.config, eos_token_ids=(eos,)))
    with LLM(m, runtime=shared_rt, kv_cache_bytes=KV, steps_per_run=4) as llm:
        got = llm.generate(PROMPTS[1], max_tokens=12)
        assert got.finish_reason == "stop" and got.token_ids == alone[1][:alone[1].index(eos)]
        assert idle(llm)
        assert llm.generate(PROMPTS[2], max_tokens=7).token_ids == alone[2][:7]
        assert idle(llm)


def test_several_steps_a_run_bad_values_and_the_engine_s_rules(model, shared_rt):
    for bad in (0, 5, 1.5, True):
        with pytest.raises(ValueError, match="LLM: steps_per_run must be"):
            LLM(model, runtime=shared_rt, kv_cache_bytes=KV, steps_per_run=bad)
    with LLM(model, runtime=shared_rt, kv_cache_bytes=KV) as llm:
        from hetero.pipelines.llm_engine import StepRow

        with pytest.raises(ValueError, match="decode rows only"):
            llm.engine.feed([StepRow("x", [1, 2], 0)], steps=2)
        with pytest.raises(ValueError, match="steps must be from 1 to MAX_STEPS_PER_RUN"):
            llm.engine.feed([StepRow("x", [1], 0)], steps=5)


@pytest.mark.anyio
async def test_runs_of_several_steps_free_the_blocks_of_a_cancelled_stream_and_fill_a_tiny_cache(
        model, shared_rt, alone, monkeypatch):
    """A stream closed while runs of four steps are in flight gives its blocks back; a cache of three
    blocks (sequences in turn, the waiting ones starting as runs end) still gives every caller its
    tokens, and runs of several steps happen meanwhile."""
    with LLM(model, runtime=shared_rt, kv_cache_bytes=KV, steps_per_run=4) as llm:
        async with contextlib.aclosing(llm.stream(PROMPTS[2], max_tokens=150)) as stream:
            n = 0
            async for _ in stream:
                n += 1
                if n == 6:
                    break
        assert idle(llm)
    kv = 4 * kv_block_bytes(model.config, 16, 4)
    with LLM(model, runtime=shared_rt, kv_cache_bytes=kv, steps_per_run=4) as llm:
        got: dict[int, list[int]] = {}
        runs = count_runs(llm, monkeypatch)

        async def caller(i: int) -> None:
            got[i] = (await llm.agenerate(PROMPTS[i], max_tokens=12)).token_ids

        async with anyio.create_task_group() as tg:
            for i in range(len(PROMPTS)):
                tg.start_soon(caller, i)
        assert [got[i] for i in range(len(PROMPTS))] == alone
        assert idle(llm) and max(runs) > 1


@pytest.mark.anyio
async def test_a_steps_pieces_reach_each_callers_loop_in_one_call() -> None:
    """The loop thread hands a step's pieces to all the tickets of one event loop (a server's streams)
    with one call into that loop, each ticket its own batch, in order; a ticket of another loop gets a
    call of its own."""
    from hetero.pipelines.llm_batch import StreamPiece, Ticket

    tickets = [Ticket([]) for _ in range(5)]
    other = Ticket([])
    other.loop = object()  # as if made on another event loop
    calls: list[str] = []
    for name, t in [("here", t) for t in tickets] + [("there", other)]:
        def call(fn, name=name):  # type: ignore[no-untyped-def]
            calls.append(name)
            fn()
        t.call = call
    batches = [[(None, StreamPiece(f"piece {i}", i))] for i in range(6)]
    Ticket.post_each(list(zip([*tickets, other], batches)))  # type: ignore[arg-type]
    assert sorted(calls) == ["here", "there"]
    assert [t.pieces[0][1].text for t in [*tickets, other]] == [f"piece {i}" for i in range(6)]
