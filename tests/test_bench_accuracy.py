"""bench accuracy on a tiny random model: a line per setting, the defaults first, with the fields it promises."""

from __future__ import annotations

import json
import os
import sys
from contextlib import redirect_stdout
from io import StringIO

sys.path.insert(0, os.path.dirname(__file__))

from llm_fixtures import write_tiny_gguf  # noqa: E402

from bench import accuracy  # noqa: E402


def test_each_setting_is_a_line_against_the_float64_reference(tmp_path) -> None:
    f = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", "q8_0")
    out = StringIO()
    with redirect_stdout(out):
        assert accuracy.main(["--model", str(f), "--tokens", "12", "--new", "4", "--knob", "TILED_IMPL=blocked,dp4a",
                              "--knob", "TILED_MIN_GROUPS=1,512", "--knob-each"]) == 0
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    head, rows = lines[0], lines[1:]
    assert head["prompt_tokens"] == 12 and head["new_tokens"] == 4 and "adapter" in head
    assert [r["setting"] for r in rows] == ["defaults", {"TILED_IMPL": "blocked", "TILED_MIN_GROUPS": 1},
                                            {"TILED_IMPL": "dp4a", "TILED_MIN_GROUPS": 1},
                                            {"TILED_IMPL": "blocked", "TILED_MIN_GROUPS": 512}]
    for r in rows:
        assert isinstance(r["logits_max_row_error"], float) and 0.0 <= r["argmax_agree"] <= 1.0
        assert 0 <= r["greedy_same_tokens"] <= r["greedy_tokens"] == 4
    # the float32 blocked kernel is within float32's rounding of the reference on every position
    assert rows[1]["logits_max_row_error"] < 1e-4 and rows[1]["argmax_agree"] == 1.0
