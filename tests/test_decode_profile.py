"""``python -m bench decode_profile`` on the tiny shape: every op line, the checks, the step's dispatch count.

No figure is asserted (a software adapter's times say nothing); the structure is: an op line
for each op of a step, both GEMV kernels for the linear ops at one decode row, each checked
against numpy, and the step's dispatches equal to what its ops record.
"""

from __future__ import annotations

import json

import pytest

from bench import decode_profile


def test_decode_profile_lines(capsys: pytest.CaptureFixture[str]) -> None:
    rc = decode_profile.main(["--shape", "tiny", "--layers", "2", "--kinds", "q4_1", "--batches", "1",
                              "--min-ms", "1", "--repeat", "1", "--steps", "2", "--copy-mb", "1", "--no-sweep"])
    assert rc == 0
    lines = [json.loads(s) for s in capsys.readouterr().out.splitlines() if s.startswith("{")]
    assert all(ln["bench"] == "decode_profile" for ln in lines)
    assert [ln["figure"] for ln in lines if "figure" in ln][:2] == ["adapter", "copy"]
    ops = [ln for ln in lines if "op" in ln]
    names = ["embedding", "qkv", "qkv_rope_kv", "rope_kv", "attention", "o", "gate_up", "down", "gather_rows",
             "head", "sample"]
    assert [ln["op"] for ln in ops if ln["impl"] in ("-", "lanes")] == names
    linear = [(ln["op"], ln["impl"], ln.get("check")) for ln in ops if ln["impl"] != "-"]
    assert linear == [(op, impl, None if op == "qkv_rope_kv" else "ok")
                      for op in ("qkv", "qkv_rope_kv", "o", "gate_up", "down", "head") for impl in ("lanes", "units")]
    fused = {ln["impl"]: ln["dispatches"] for ln in ops if ln["op"] == "qkv_rope_kv"}
    assert fused == {"lanes": 1, "units": 1}  # QKV, RoPE and the KV write in one dispatch on either GEMV
    assert all(ln["head_kind"] == "q8_0" for ln in ops)  # Q4_1 layers, a Q8_0 head (SmolLM2's layout)
    per_call = {ln["op"]: ln["dispatches"] for ln in ops if ln["impl"] in ("-", "lanes")}
    for impl in ("lanes", "units"):
        step = next(ln for ln in lines if ln.get("figure") == "step" and ln["impl"] == impl)
        layer = sum(per_call[o] for o in ("qkv", "rope_kv", "attention", "o", "gate_up", "down"))
        assert step["dispatches_per_layer"] == layer
        assert step["dispatches"] == 2 * layer + sum(per_call[o] for o in ("embedding", "gather_rows", "head",
                                                                           "sample"))
        rep = next(ln for ln in lines if ln.get("figure") == "replay" and ln["impl"] == impl)
        assert rep["dispatches"] == step["dispatches"] and rep["replay_us"] > 0
