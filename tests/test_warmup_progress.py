"""Warm-up that a user can see through: precapture reports its progress as it goes, on stderr and in
the engine's state (what /info reports, and what fronts of a multi-process server are told)."""

from __future__ import annotations

import re
from pathlib import Path

import anyio
import pytest

import hetero
from hetero.pipelines.embed import EmbeddingService
from hetero.pipelines.minilm import Model, load_model
from hetero.pipelines.serve_engine import EmbeddingEngine, EngineClient
from hetero.pipelines.testing import write_random_model
from tests.test_serve import SECRET, TINY, engine_serving, ready

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Model:
    return load_model(write_random_model(tmp_path_factory.mktemp("tiny-warm"), seed=3, scale=0.3, **TINY))


@pytest.fixture(scope="module")
def shapes(tiny: Model) -> int:
    """The packed shapes a 48-token batch of the tiny model comes in: at most 10, so each is a tenth."""
    n = len(EmbeddingService.examples_for(tiny, 48))
    assert 1 < n <= 10
    return n


async def test_the_service_reports_each_shape_as_it_runs(tiny: Model, shapes: int, shared_rt: hetero.Runtime) -> None:
    calls: list[tuple[int, int]] = []
    service = EmbeddingService(shared_rt, tiny, max_batch_tokens=48, cpu=False,
                               on_warmup=lambda done, total: calls.append((done, total)))
    try:
        assert await service.warmup(True) == shapes
        assert calls == [(i, shapes) for i in range(shapes + 1)]
        calls.clear()
        assert await service.warmup(False) == 1
        assert calls == [(0, 1), (1, 1)]
    finally:
        await service.aclose()


async def until_ready(engine: EmbeddingEngine) -> list[dict[str, float]]:
    """Wait for the engine's warm-up; the distinct progress states seen on the way, in order."""
    seen: list[dict[str, float]] = []
    with anyio.fail_after(120):
        while not engine.ready:
            assert engine.warmup_error is None, engine.warmup_error
            if engine.warmup_progress is not None and (not seen or seen[-1] != engine.warmup_progress):
                seen.append(dict(engine.warmup_progress))
            await anyio.sleep(0)
    assert engine.warmup_progress is not None
    seen.append(dict(engine.warmup_progress))
    return seen


async def test_precapture_prints_its_progress_as_it_goes(tiny: Model, shapes: int, shared_rt: hetero.Runtime,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    engine = EmbeddingEngine(tiny, runtime=shared_rt, max_batch_tokens=48, precapture=True)
    assert engine.warmup_progress is None
    async with engine.running():
        seen = await until_ready(engine)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("hetero serve: warm-up")]
    assert lines[0] == (f"hetero serve: warm-up: capturing {shapes} batch shapes (--no-precapture starts at once "
                        "and captures each shape when it first comes)")
    # Each tenth passed prints a line: with at most 10 shapes, after each but the last.
    steps = [re.fullmatch(rf"hetero serve: warm-up: (\d+) of {shapes} batch shapes captured in \d+\.\d s", ln)
             for ln in lines[1:-1]]
    assert all(steps), lines
    assert [int(m.group(1)) for m in steps if m] == list(range(1, shapes))
    assert re.fullmatch(rf"hetero serve: warm-up captured {shapes} batch shapes in \d+\.\d s", lines[-1])
    # The state /info reports: counts that only go up, to all shapes done.
    assert [(p["shapes_done"], p["shapes_total"]) for p in seen] == \
        sorted({(p["shapes_done"], p["shapes_total"]) for p in seen})
    assert {p["shapes_total"] for p in seen} == {shapes}
    final = seen[-1]
    assert final["shapes_done"] == shapes and final["seconds"] >= 0


async def test_without_precapture_one_shape_and_no_progress_lines(tiny: Model, shared_rt: hetero.Runtime,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    engine = EmbeddingEngine(tiny, runtime=shared_rt, max_batch_tokens=48, precapture=False)
    async with engine.running():
        seen = await until_ready(engine)
    assert (seen[-1]["shapes_done"], seen[-1]["shapes_total"]) == (1, 1)
    assert "hetero serve: warm-up" not in capsys.readouterr().err


async def test_fronts_are_told_the_engine_s_progress(tiny: Model, shapes: int, shared_rt: hetero.Runtime,
                                                     tmp_path: Path) -> None:
    engine = EmbeddingEngine(tiny, runtime=shared_rt, max_batch_tokens=48, precapture=True)
    path = str(tmp_path / "engine.port")
    async with engine_serving(engine, path):
        front = EngineClient(path, SECRET)
        async with front.running():
            await ready(front)
            assert front.warmup_progress == engine.warmup_progress
            assert front.warmup_progress is not None and front.warmup_progress["shapes_done"] == shapes


async def test_info_reports_the_warm_up_as_it_goes(tiny: Model, shapes: int, shared_rt: hetero.Runtime) -> None:
    import httpx

    from hetero.pipelines.serve_app import EmbeddingServer

    server = EmbeddingServer(tiny, runtime=shared_rt, max_batch_tokens=48, precapture=True)
    seen: list[tuple[int, int] | None] = []
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app), base_url="http://test") as c, \
            server.running():
        with anyio.fail_after(120):
            while True:
                info = (await c.get("/info")).json()
                w = info["warmup"]
                seen.append(None if w is None else (w["shapes_done"], w["shapes_total"]))
                if info["ready"]:
                    break
                await anyio.sleep(0.02)  # the in-process transport never yields: let the warm-up run
    assert seen[-1] == (shapes, shapes)
    reported = [s for s in seen if s is not None]
    assert reported == sorted(reported) and {t for _, t in reported} == {shapes}
    assert seen.index(reported[0]) == len(seen) - len(reported)  # null only before the first shape count
