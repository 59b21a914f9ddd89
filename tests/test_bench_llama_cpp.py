"""``bench generate --gguf/--make-gguf/--vs-llama-cpp``: llama.cpp's outputs read, its command lines, the kit's
files, and the hetero half of the bench run on a tiny GGUF file.

The llama-bench and llama-batched-bench outputs below are laid out as their printers write
them (llama.cpp's tools/llama-bench ``json_printer``: a JSON array, one object a test, every
field on its line, then ``samples_ns`` and ``samples_ts``; tools/batched-bench's jsonl
``LOG``: one object a line, blank lines around), with figures of the H200's order.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import stat
import sys
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from llm_fixtures import write_tiny_gguf  # noqa: E402

from bench import generate, llama_cpp  # noqa: E402
from bench.llama_cpp import (  # noqa: E402
    BatchedRow,
    LlamaCppError,
    LlamaCppMissing,
    parse_batched_bench,
    parse_llama_bench,
)

# The llm-anchor kit, where its README puts it (the project root's .llm-anchor/) or where this says.
KIT = Path(os.environ.get("HETERO_LLM_ANCHOR", Path(__file__).resolve().parent.parent / ".llm-anchor"))


def _test(n_prompt: int, n_gen: int, avg_ns: int, stddev_ns: int, avg_ts: str, stddev_ts: str, ns: str, ts: str) -> str:
    fields = [
        ("build_commit", '"0c1e5709"'), ("build_number", "0"), ("cpu_info", '"AMD EPYC 9654 96-Core Processor"'),
        ("gpu_info", '"NVIDIA H200"'), ("backends", '"CUDA"'),
        ("model_filename", '"/tmp/llm-models/smollm2-orig.gguf"'), ("model_type", '"llama ?B Q4_1"'),
        ("model_size", "96468480"), ("model_n_params", "134515008"), ("n_batch", "2048"), ("n_ubatch", "512"),
        ("n_threads", "16"), ("cpu_mask", '"0x0"'), ("cpu_strict", "false"), ("poll", "50"), ("type_k", '"f16"'),
        ("type_v", '"f16"'), ("n_gpu_layers", "99"), ("n_cpu_moe", "0"), ("split_mode", '"layer"'),
        ("main_gpu", "0"), ("no_kv_offload", "false"), ("flash_attn", "1"), ("devices", '"auto"'),
        ("tensor_split", '"0.00"'), ("tensor_buft_overrides", '"none"'), ("load_mode", '"mmap"'),
        ("lazy_mode", '"off"'), ("embeddings", "false"), ("no_op_offload", "0"), ("no_host", "false"),
        ("repack", "true"), ("fit_target", "0"), ("fit_min_ctx", "0"), ("n_prompt", str(n_prompt)),
        ("n_gen", str(n_gen)), ("n_depth", "0"), ("test_time", '"2026-12-03T10:11:12Z"'), ("avg_ns", str(avg_ns)),
        ("stddev_ns", str(stddev_ns)), ("avg_ts", avg_ts), ("stddev_ts", stddev_ts)]
    body = "".join(f'    "{k}": {v},\n' for k, v in fields)
    return f'  {{\n{body}    "samples_ns": [ {ns} ],\n    "samples_ts": [ {ts} ]\n  }}'


LLAMA_BENCH_JSON = "[\n" + ",\n".join([
    _test(512, 0, 9470222, 51987, "54066.529150", "296.433907", "9410218, 9500111, 9500337",
          "54408.7, 53893.9, 53892.6"),
    _test(0, 128, 143016405, 1104311, "895.012755", "6.891052", "141876542, 142998760, 144173913",
          "902.192, 895.112, 887.812"),
]) + "\n]\n"

BATCHED_JSONL = """
{"n_kv_max": 16384, "n_batch": 2048, "n_ubatch": 512, "flash_attn": 1, "is_pp_shared": 0, "n_gpu_layers": 99, \
"n_threads": 16, "n_threads_batch": 16, "pp": 128, "tg": 128, "pl": 1, "n_kv": 256, "t_pp": 0.004213, \
"speed_pp": 30382.150391, "t_tg": 0.150118, "speed_tg": 852.662598, "t": 0.154331, "speed": 1658.772217}
{"n_kv_max": 16384, "n_batch": 2048, "n_ubatch": 512, "flash_attn": 1, "is_pp_shared": 0, "n_gpu_layers": 99, \
"n_threads": 16, "n_threads_batch": 16, "pp": 128, "tg": 128, "pl": 64, "n_kv": 16384, "t_pp": 0.149832, \
"speed_pp": 54674.568850, "t_tg": 0.736681, "speed_tg": 11120.145626, "t": 0.886513, "speed": 18481.398468}

"""


def test_llama_bench_json_is_read_as_its_tests():
    pp, tg = parse_llama_bench(LLAMA_BENCH_JSON)
    assert (pp.test, pp.n_prompt, pp.n_gen, pp.avg_ts, pp.stddev_ts) == ("pp512", 512, 0, 54066.52915, 296.433907)
    assert (tg.test, tg.n_prompt, tg.n_gen, tg.avg_ts) == ("tg128", 0, 128, 895.012755)
    assert tg.samples_ts == (902.192, 895.112, 887.812) and tg.flash_attn == 1
    assert tg.model_type == "llama ?B Q4_1" and tg.model_size == 96468480
    # the run.sh summary reads the same file the same way
    assert [r["avg_ts"] for r in json.loads(LLAMA_BENCH_JSON)] == [pp.avg_ts, tg.avg_ts]


def test_llama_bench_tests_with_both_parts_or_a_depth_are_named_so():
    data = json.loads(LLAMA_BENCH_JSON)
    data[0].update(n_prompt=512, n_gen=128, n_depth=4096)
    (row, _) = parse_llama_bench(json.dumps(data))
    assert row.test == "pp512+tg128@d4096"


def test_unreadable_llama_bench_output_is_refused_saying_what_is_wrong():
    with pytest.raises(LlamaCppError, match=r"^x.gguf: output is not JSON \(.*\); was it run with -o json\?$"):
        parse_llama_bench("| model | size |\n", "x.gguf")
    with pytest.raises(LlamaCppError, match="expected a JSON array of tests, got dict"):
        parse_llama_bench("{}")
    data = json.loads(LLAMA_BENCH_JSON)
    del data[1]["avg_ts"]
    with pytest.raises(LlamaCppError, match="llama-bench: test 1 lacks a field or has a bad value \\(KeyError"):
        parse_llama_bench(json.dumps(data))


def test_batched_bench_jsonl_is_read_line_by_line():
    one, many = parse_batched_bench(BATCHED_JSONL)
    assert one == BatchedRow(128, 128, 1, 0.004213, 30382.150391, 0.150118, 852.662598, 0.154331, 1658.772217)
    assert (many.pl, many.speed_tg, many.speed) == (64, 11120.145626, 18481.398468)
    # its definitions: S_TG = pl * tg / t_tg, S = (pl * pp + pl * tg) / t
    assert many.speed_tg == pytest.approx(many.pl * many.tg / many.t_tg, rel=1e-5)
    assert many.speed == pytest.approx(many.pl * (many.pp + many.tg) / many.t, rel=1e-5)
    assert parse_batched_bench("main: n_kv_max = 16384\n\n") == []
    with pytest.raises(LlamaCppError, match="llama-batched-bench: line 2 is not a batched-bench row \\(KeyError"):
        parse_batched_bench('\n{"pp": 1}\n')


def _fake_bin(d: Path, *names: str) -> None:
    d.mkdir(parents=True, exist_ok=True)
    for n in names:
        p = d / n
        p.write_text("#!/bin/sh\nexit 1\n")
        p.chmod(p.stat().st_mode | stat.S_IXUSR)


def test_missing_binaries_say_how_to_build_them(tmp_path):
    with pytest.raises(LlamaCppMissing) as e:
        llama_cpp.binaries(tmp_path / "bin")
    assert str(e.value) == (f"llama.cpp: llama-bench, llama-batched-bench not found (or not executable) in "
                            f"{str(tmp_path / 'bin')!r}; build them with the llm-anchor kit (bash .llm-anchor/run.sh "
                            "builds into .llm-build/build/bin) and pass that directory to --vs-llama-cpp")
    _fake_bin(tmp_path / "bin", "llama-bench")
    with pytest.raises(LlamaCppMissing, match="llama.cpp: llama-batched-bench not found"):
        llama_cpp.binaries(tmp_path / "bin")
    _fake_bin(tmp_path / "bin", "llama-batched-bench")
    assert set(llama_cpp.binaries(tmp_path / "bin")) == {"llama-bench", "llama-batched-bench"}


def test_command_lines_are_the_anchor_s(tmp_path):
    _fake_bin(tmp_path, "llama-bench", "llama-batched-bench")
    assert llama_cpp.llama_bench_command(tmp_path, "m.gguf")[1:] == [
        "-m", "m.gguf", "-ngl", "99", "-p", "512", "-n", "128", "-r", "3", "-fa", "1", "-o", "json"]
    assert llama_cpp.batched_bench_command(tmp_path, "m.gguf")[1:] == [
        "-m", "m.gguf", "-ngl", "99", "-fa", "on", "-c", "16384", "-npp", "128", "-ntg", "128", "-npl", "1,64",
        "--output-format", "jsonl"]
    # a failing program's exit status and command come back in the error
    with pytest.raises(LlamaCppError, match=r"^llama-bench exited with 1: .*llama-bench -m m.gguf"):
        llama_cpp.run_llama_bench(tmp_path, "m.gguf")


def test_the_bench_refuses_missing_llama_cpp_before_any_work(tmp_path, capsys):
    rc = generate.main(["--gguf", str(tmp_path / "none.gguf"), "--vs-llama-cpp", str(tmp_path)])
    out, err = capsys.readouterr()
    assert rc == 2 and "llama-bench, llama-batched-bench not found" in err
    assert json.loads(out.splitlines()[-1])["error"].startswith("llama.cpp: llama-bench")
    with pytest.raises(SystemExit):
        generate.main(["--vs-llama-cpp", str(tmp_path)])  # and no file to run it on
    assert "--vs-llama-cpp needs GGUF files" in capsys.readouterr().err


def test_kit_models_and_missing_kit(tmp_path):
    with pytest.raises(LlamaCppMissing, match="the llm-anchor kit has no make_random_gguf.py in"):
        llama_cpp.make_ggufs(tmp_path, tmp_path / "out", ["smollm2-orig"])
    assert llama_cpp.KIT_MODELS["llama1b-q4_1"] == ("--type", "q4_1", "--layers", "16", "--hidden", "2048", "--ff",
                                                   "8192", "--heads", "32", "--kv-heads", "8")


@pytest.mark.skipif(not (KIT / "make_random_gguf.py").is_file(), reason="the llm-anchor kit is not on this machine")
def test_the_kit_writes_files_hetero_loads(tmp_path):
    from hetero.pipelines.llm_model import load_model

    with pytest.raises(ValueError, match="unknown kit model\\(s\\) smollm3; known: smollm2-orig"):
        llama_cpp.make_ggufs(KIT, tmp_path, ["smollm3"])
    (f,) = llama_cpp.make_ggufs(KIT, tmp_path, ["smollm2-orig"], layers=1)
    assert f.name == "smollm2-orig-l1.gguf"
    m = load_model(f)
    c = m.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size) == (1, 576, 9, 3, 49152)
    assert m.weights["model.embed_tokens.weight"].kind == "q8_0"
    assert m.weights["model.layers.0.mlp.down_proj.weight"].kind == "q4_1"
    assert m.decode(m.encode("The capital of France is Paris.")) == "The capital of France is Paris."
    mtime = f.stat().st_mtime_ns
    assert llama_cpp.make_ggufs(KIT, tmp_path, ["smollm2-orig"], layers=1) == [f]  # kept, not rewritten
    assert f.stat().st_mtime_ns == mtime


def test_the_hetero_half_prints_llama_bench_s_measures(tmp_path):
    f = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", "q4_1")
    out = io.StringIO()
    with redirect_stdout(out):
        rc = generate.main(["--gguf", str(f), "--tg", "4", "--pp", "8", "--npp", "4", "--ntg", "3", "--npl", "1,3",
                            "--reps", "2"])
    assert rc == 0
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert all(x["bench"] == "generate" for x in lines)
    loaded = next(x for x in lines if "loaded_s" in x)
    assert loaded["model"] == "tiny" and loaded["matrices"] == {"q4_1": 16} and loaded["layers"] == 2
    fig = next(x for x in lines if x.get("weights") == "auto")
    assert set(fig) >= {"tg4", "pp8", "b1", "b3"}
    # the figures' fields are there, as numbers (their sizes are the bench's business, not a test's)
    numbers = [fig["tg4"]["tok_s"], fig["pp8"]["tok_s"], fig["b3"]["total_tok_s"], fig["b1"]["ttft_ms"]]
    assert all(isinstance(v, float) for v in numbers) and "decode_tok_s" in fig["b3"]
    step = next(x for x in lines if x.get("measure") == "step")
    assert step["dispatches_per_layer"] == 5  # QKV+norm+RoPE+KV write, attention, o+residual, gate/up+SiLU, down
    assert step["dispatches_per_step"] == sum(step["kernels_per_step"].values())
    assert {"step_gpu_us", "step_wall_us", "step_host_us"} <= step.keys()
    many = next(x for x in lines if x.get("measure") == "streams step")
    assert many["streams"] == 3 and {"step_wall_us", "step_gpu_us", "note"} <= many.keys()
    kernels = many["kernels_dispatches_per_step"]
    assert kernels.keys() == many["kernels_gpu_us_per_step"].keys()
    assert not any(".tiled." in k for k in kernels)  # 3 rows decode through the GEMV (the prompts' GEMM is subtracted)
    assert sum(v for k, v in kernels.items() if "paged_attention" in k) == pytest.approx(2, abs=0.01)  # a layer


def test_ratios_pair_each_measure_both_sides_have(capsys):
    mine = {"tg128": {"tok_s": 450.0, "std": 3.0}, "b64": {"decode_tok_s": 5000.0, "total_tok_s": 9000.0},
            "pp512": {"tok_s": 20000.0}}
    ref = {"tg128": {"tok_s": 900.0, "std": 7.0}, "b64": {"decode_tok_s": 10000.0, "total_tok_s": 18000.0}}
    generate.ratios("smollm2-orig", mine, ref, "llama.cpp")
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [(x["measure"], x["figure"], x["ratio"]) for x in lines] == [
        ("tg128", "tok_s", 0.5), ("b64", "decode_tok_s", 0.5), ("b64", "total_tok_s", 0.5)]
    assert lines[0] == {"bench": "generate", "model": "smollm2-orig", "measure": "tg128", "figure": "tok_s",
                        "hetero": 450.0, "reference": "llama.cpp", "reference_value": 900.0, "ratio": 0.5}


def test_ttft_target_is_llama_cpps_prefill_plus_a_step(capsys):
    mine = {"b1": {"decode_tok_s": 400.0, "total_tok_s": 700.0, "ttft_ms": 6.0}}
    generate.ttft_target("m", mine, {"b1": {"decode_tok_s": 900.0, "prefill_ms": 4.0, "step_ms": 1.0}})
    generate.ttft_target("m", mine, {"b1": {"decode_tok_s": 900.0, "prefill_ms": 5.0, "step_ms": 1.5}})
    generate.ttft_target("m", mine, {"b64": {"decode_tok_s": 9000.0, "prefill_ms": 5.0, "step_ms": 1.5}})  # no b1
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [(x["target_ms"], x["ratio"], x["met"]) for x in lines] == [(5.0, 1.2, False), (6.5, 0.923, True)]
    assert lines[0]["hetero_ms"] == 6.0 and lines[0]["llama_cpp_prefill_ms"] == 4.0


def test_outputs_captured_from_a_cpu_build_read_the_same():
    # llama-bench -p 16 -n 4 -r 2 and llama-batched-bench -npp 8 -ntg 4 -npl 1,2 of a CPU build of the
    # anchor's llama.cpp commit, on the kit's SmolLM2 layout with 2 layers (tests/fixtures/)
    fixtures = Path(__file__).parent / "fixtures"
    pp, tg = parse_llama_bench((fixtures / "llama_bench_cpu.json").read_text())
    assert (pp.test, tg.test, pp.flash_attn, pp.model_type) == ("pp16", "tg4", 1, "llama ?B Q4_1")
    assert len(pp.samples_ts) == len(tg.samples_ts) == 2
    assert tg.avg_ts == pytest.approx(sum(tg.samples_ts) / 2, rel=1e-4)
    rows = parse_batched_bench((fixtures / "batched_bench_cpu.jsonl").read_text())
    assert [(r.pp, r.tg, r.pl) for r in rows] == [(8, 4, 1), (8, 4, 2)]
    for r in rows:
        assert r.speed_tg == pytest.approx(r.pl * r.tg / r.t_tg, rel=1e-4)


def test_gemv_tiled_and_steps_per_run_settings_are_timed_in_turn_and_compared_with_the_first(tmp_path):
    from hetero.kernels import decoder

    f = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", "q8_0")
    out = io.StringIO()
    with redirect_stdout(out):
        rc = generate.main(["--gguf", str(f), "--tg", "3", "--pp", "12", "--npp", "2", "--ntg", "3", "--npl", "1",
                            "--reps", "1", "--no-profile", "--gemv", "auto,units", "--tiled", "blocked,t32",
                            "--steps-per-run", "1,2"])
    assert rc == 0 and (decoder.GEMV_IMPL, decoder.TILED_IMPL, decoder.ATTN_PREFETCH) == ("auto", "auto", False)
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [(x["gemv"], x["tiled"], x["steps_per_run"]) for x in lines if x.get("weights") == "auto"] == [
        (g, t, k) for g in ("auto", "units") for t in ("blocked", "t32") for k in (1, 2)]
    compared = {x["model"] for x in lines if "ratio" in x}
    assert len(compared) == 7 and {"tiny (steps_per_run 1 / 2)", "tiny (gemv auto / units)", "tiny (tiled blocked / t32)",
                                   "tiny (gemv auto / units, tiled blocked / t32, steps_per_run 1 / 2)"} <= compared
    for bad in (["--gemv", "fast"], ["--tiled", "t64"], ["--steps-per-run", "5"], ["--steps-per-run", "2,2"]):
        with pytest.raises(SystemExit):
            generate.main(["--gguf", str(f), *bad])


def test_knobs_are_timed_in_every_combination_and_set_back(tmp_path):
    from hetero.kernels import decoder, decoder_gemm

    f = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", "q8_0")
    out = io.StringIO()
    with redirect_stdout(out):
        rc = generate.main(["--gguf", str(f), "--tg", "3", "--pp", "12", "--npp", "2", "--ntg", "3", "--npl", "1",
                            "--reps", "1", "--no-profile", "--knob", "ATTN_PREFETCH=False,True",
                            "--knob", "DP4A_SLICE_BLOCKS=4,1"])
    assert rc == 0 and decoder.ATTN_PREFETCH is False and decoder_gemm.DP4A_SLICE_BLOCKS == 4  # set back
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [x["knobs"] for x in lines if x.get("weights") == "auto"] == [
        {"ATTN_PREFETCH": p, "DP4A_SLICE_BLOCKS": b} for p in (False, True) for b in (4, 1)]
    assert {x["model"] for x in lines if "ratio" in x} == {
        "tiny (DP4A_SLICE_BLOCKS 4 / 1)", "tiny (ATTN_PREFETCH False / True)",
        "tiny (ATTN_PREFETCH False / True, DP4A_SLICE_BLOCKS 4 / 1)"}


def test_profile_each_traces_the_step_under_every_setting(tmp_path):
    """--profile-each: a step profile and a streams-step profile per setting, each named, with the
    setting's kernels (the GEMV forced to units shows in its labels); without it, the first only."""
    f = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", "q8_0")
    args = ["--gguf", str(f), "--tg", "3", "--pp", "4", "--npp", "2", "--ntg", "2", "--npl", "1,2", "--reps", "1",
            "--gemv", "lanes,units"]
    out = io.StringIO()
    with redirect_stdout(out):  # the KV cache's type is a setting too
        assert generate.main(args[:-2] + ["--kv-cache", "f32,f16", "--no-profile"]) == 0
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert {x["model"] for x in lines if "ratio" in x} == {"tiny (kv_cache f32 / f16)"}
    (acc,) = [x for x in lines if x.get("measure") == "accuracy"]  # the second setting's, against the first
    assert "kv_cache=f16" in acc["setting"] and "kv_cache" not in acc["against"]
    assert isinstance(acc["logits_max_row_error"], float) and 0.0 <= acc["argmax_agree"] <= 1.0
    assert 0 <= acc["greedy_same_tokens"] <= acc["greedy_tokens"] == generate.ACCURACY_TOKENS
    for extra, count in (([], 1), (["--profile-each"], 2)):
        out = io.StringIO()
        with redirect_stdout(out):
            assert generate.main(args + extra) == 0
        lines = [json.loads(x) for x in out.getvalue().splitlines()]
        steps = [x for x in lines if x.get("measure") == "step"]
        assert len(steps) == count == len([x for x in lines if x.get("measure") == "streams step"])
        assert [x["setting"].split()[0] for x in steps] == ["gemv=lanes", "gemv=units"][:count]
        for x in steps:
            impl = x["setting"].split()[0].removeprefix("gemv=")
            assert any(k.startswith("decoder.linear.lanes." if impl == "lanes" else "decoder.linear.gemv.")
                       for k in x["kernels_per_step"]), x["kernels_per_step"]


def test_agreement_of_two_settings_outputs():
    ref = np.array([[1.0, 3.0, 2.0], [4.0, -8.0, 0.0]])
    got = np.array([[1.0, 2.5, 2.9], [4.0, -8.0, 0.4]])
    a = generate.agreement(ref, [5, 6, 7, 8], got, [5, 6, 9, 8])
    assert a == {"logits_max_row_error": pytest.approx(0.3), "argmax_agree": 0.5, "greedy_same_tokens": 2,
                 "greedy_tokens": 4}
    assert generate.agreement(ref, [1, 2], ref, [1, 2])["greedy_same_tokens"] == 2


def test_knob_each_varies_one_knob_at_a_time():
    knobs = [("A", [1, 2, 3]), ("B", [False, True]), ("C", ["x"])]
    assert generate.knob_grid(knobs, each=True) == [
        (("A", 1), ("B", False), ("C", "x")), (("A", 2), ("B", False), ("C", "x")),
        (("A", 3), ("B", False), ("C", "x")), (("A", 1), ("B", True), ("C", "x"))]
    assert len(generate.knob_grid(knobs)) == 6 and generate.knob_grid([], each=True) == [()]


def test_a_tuple_knob_joins_its_items_with_plus():
    assert generate.parse_knob("GEMV_LANES_WIDE_KINDS=q8_0, q8_0+q4_1,()") == (
        "GEMV_LANES_WIDE_KINDS", [("q8_0",), ("q8_0", "q4_1"), ()])


@pytest.mark.parametrize("text,error", [
    ("NOT_A_KNOB=1", "a knob of hetero.kernels.decoder"), ("ATTN_PREFETCH", "NAME=V1"),
    ("ATTN_PREFETCH=1", "ATTN_PREFETCH is a bool"), ("TILED_MIN_GROUPS=512,512", "distinct values"),
    ("GEMV_LANES_WIDE_KINDS=1+2", "GEMV_LANES_WIDE_KINDS is a tuple of str"),
    ("GEMV_LANES_WIDE_KINDS=q8_0,q8_0", "distinct values")])
def test_a_knob_must_name_an_attribute_and_match_its_type(text, error):
    with pytest.raises(argparse.ArgumentTypeError, match=error):
        generate.parse_knob(text)
