"""bench decode_host on a tiny random model: a line per round and setting, then the medians, with
the fields it promises. It times CPU, so nothing here asserts a figure's size."""

from __future__ import annotations

import json
import os
import sys
from contextlib import redirect_stdout
from io import StringIO

sys.path.insert(0, os.path.dirname(__file__))

from llm_fixtures import write_tiny_gguf  # noqa: E402

from bench import decode_host  # noqa: E402


def test_rounds_and_summaries_per_streams_and_pipeline(tmp_path) -> None:
    f = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", "q8_0")
    out = StringIO()
    with redirect_stdout(out):
        assert decode_host.main(["--model", str(f), "--streams", "1,3", "--steps", "3", "--prompt", "5",
                                 "--rounds", "2", "--pipeline", "both"]) == 0
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    head, rows = lines[0], lines[1:]
    assert "adapter" in head and head["steps"] == 3 and head["prompt_tokens"] == 5
    rounds = [r for r in rows if "round" in r]
    summaries = [r for r in rows if r.get("summary")]
    assert [(r["streams"], r["pipeline"], r["round"]) for r in rounds] == [
        (s, p, n) for s in (1, 3) for p in (True, False) for n in (0, 1)]
    assert [(r["streams"], r["pipeline"], r["rounds"]) for r in summaries] == [
        (s, p, 2) for s in (1, 3) for p in (True, False)]
    for r in rounds + summaries:
        assert set(decode_host.KINDS) | {"process", "dispatches", "record_us_per_dispatch"} <= r.keys()
        # a tiny model's step replays a few dispatches a layer; the count is the same each round
        assert r["dispatches"] >= 2
    for s in (1, 3):
        for p in (True, False):
            assert len({r["dispatches"] for r in rounds if (r["streams"], r["pipeline"]) == (s, p)}) == 1


def test_bad_arguments_are_refused(capsys) -> None:
    import pytest

    for argv in (["--streams", "1,x"], ["--steps", "0"], ["--streams", "0"]):
        with pytest.raises(SystemExit):
            decode_host.main(argv)
    assert "--streams" in capsys.readouterr().err
