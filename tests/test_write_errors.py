"""Files and standard output that cannot be written: one line with the OS's reason, exit status 1, no
partial file and no claim of success. ``/dev/full`` is the full disk: every write to it fails with ENOSPC
(reached through a link with the suffix the command wants)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import anyio
import numpy as np
import pytest

import hetero
from hetero import _cli
from hetero.pipelines.testing import write_random_model

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")

FULL = "No space left on device"
TINY = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            max_position_embeddings=40, max_seq_length=24)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_model(tmp_path_factory.mktemp("m"), seed=5, **TINY)


@pytest.fixture
def lines(tmp_path: Path) -> Path:
    src = tmp_path / "in.txt"
    src.write_text("one sentence\nanother one\n", encoding="utf-8")
    return src


def full(tmp_path: Path, name: str) -> Path:
    """``tmp_path/name``, a link to /dev/full."""
    link = tmp_path / name
    link.symlink_to("/dev/full")
    return link


def leftovers(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("."))


def test_embed_output_on_a_full_disk(tmp_path: Path, model_dir: Path, lines: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("out.npy", "out.jsonl"):
        dest = full(tmp_path, name)
        assert _cli.main(["embed", "--model", str(model_dir), "--input", str(lines), "--output", str(dest),
                          "--no-progress"]) == 1
        got = capsys.readouterr()
        assert (got.out, got.err) == ("", f"hetero: error: cannot write output file {str(dest)!r}: {FULL}\n")
        assert stat.S_ISCHR(os.stat("/dev/full").st_mode)  # written in place, never renamed over
    assert leftovers(tmp_path) == []


def test_embed_trace_on_a_full_disk(tmp_path: Path, model_dir: Path, lines: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    trace, out = full(tmp_path, "t.json"), tmp_path / "out.npy"
    assert _cli.main(["embed", "--model", str(model_dir), "--input", str(lines), "--output", str(out),
                      "--trace", str(trace), "--no-progress"]) == 1
    got = capsys.readouterr()
    assert (got.out, got.err) == ("", f"hetero: error: cannot write trace file {str(trace)!r}: {FULL}\n")
    assert not out.exists() and leftovers(tmp_path) == []


def test_demo_trace_on_a_full_disk(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = full(tmp_path, "t.json")
    assert _cli.main(["demo", "--size", "100", "--runs", "1", "--trace", str(trace)]) == 1
    err = capsys.readouterr().err
    assert err == f"hetero: error: cannot write trace file {str(trace)!r}: {FULL}\n"


def test_graph_picture_on_a_full_disk(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dest = full(tmp_path, "g.dot")
    assert _cli.main(["graph", "--pipeline", "embed", "-o", str(dest)]) == 1
    got = capsys.readouterr()
    assert (got.out, got.err) == ("", f"hetero: error: graph 'embed': cannot write {str(dest)!r}: {FULL}\n")


@pytest.mark.parametrize("command", [["graph", "--pipeline", "embed"], ["embed-stdout"]])
def test_standard_output_on_a_full_disk(tmp_path: Path, model_dir: Path, lines: Path, command: list[str]) -> None:
    if command == ["embed-stdout"]:
        command = ["embed", "--model", str(model_dir), "--input", str(lines), "--output", "-"]
    with open("/dev/full", "wb") as stdout:
        done = subprocess.run([sys.executable, "-m", "hetero", *command], stdout=stdout, stderr=subprocess.PIPE,
                              timeout=120)
    assert (done.returncode, done.stderr.decode()) == (1, f"hetero: error: cannot write standard output: {FULL}\n")


def test_runtime_close_raises_when_its_trace_cannot_be_written(tmp_path: Path) -> None:
    trace = full(tmp_path, "t.json")
    rt = hetero.Runtime(cpu_threads=1, trace=trace)
    g = hetero.Graph("one")
    g.output(g.cpu(abs, -1, name="abs"))
    assert anyio.run(lambda: rt.run(g)) == 1
    with pytest.raises(hetero.HeteroError) as e:
        rt.close()
    assert str(e.value) == f"cannot write trace file {str(trace)!r}: {FULL}"
    rt.close()  # closed: nothing more to say


def test_a_failing_block_keeps_its_own_error_over_the_trace(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    trace = full(tmp_path, "t.json")
    with pytest.raises(ZeroDivisionError), hetero.Runtime(cpu_threads=1, trace=trace):
        1 / 0
    assert [r.getMessage() for r in caplog.records] == [f"cannot write trace file {str(trace)!r}: {FULL}"]


@pytest.mark.skipif(not hasattr(os, "umask"), reason="POSIX modes")
def test_trace_and_outputs_get_the_mode_of_other_files(tmp_path: Path, model_dir: Path, lines: Path) -> None:
    trace, out = tmp_path / "t.json", tmp_path / "out.npy"
    assert _cli.main(["embed", "--model", str(model_dir), "--input", str(lines), "--output", str(out),
                      "--trace", str(trace), "--no-progress"]) == 0
    plain = tmp_path / "plain"
    plain.write_text("")
    want = stat.S_IMODE(plain.stat().st_mode)
    assert (stat.S_IMODE(trace.stat().st_mode), stat.S_IMODE(out.stat().st_mode)) == (want, want)
    assert np.load(out).shape == (2, 32)
