"""hetero embed: standard input and output, JSON lines, the progress switch."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest

import hetero
from hetero import _cli
from hetero.pipelines import embed_cli
from hetero.pipelines.embed import embed
from hetero.pipelines.embed_weights import get_model
from hetero.pipelines.testing import write_random_model

TINY = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            max_position_embeddings=40, max_seq_length=24)
# Lines we did not write: the first lines of standard-library docstrings, one empty, one with a quote.
LINES = [(json.__doc__ or "").splitlines()[0], "", (io.__doc__ or "").strip().splitlines()[0], 'say "hi" 🤖']


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_model(tmp_path_factory.mktemp("m"), seed=5, **TINY)


@pytest.fixture(scope="module")
def want(model_dir: Path) -> np.ndarray:
    with hetero.Runtime(cpu_threads=2) as rt:
        return embed(LINES, model=get_model(str(model_dir)), runtime=rt)


def test_jsonl_output_file(tmp_path: Path, model_dir: Path, want: np.ndarray,
                           capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "in.txt"
    src.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    out = tmp_path / "out.jsonl"
    assert _cli.main(["embed", "--model", str(model_dir), "--input", str(src), "--output", str(out),
                      "--no-progress"]) == 0
    assert "float32 as JSON lines -> " in capsys.readouterr().out
    records = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [r["index"] for r in records] == [0, 1, 2, 3]
    assert [r["text"] for r in records] == LINES
    got = np.array([r["embedding"] for r in records], np.float32)
    assert np.array_equal(got, want)  # 9 significant digits give float32 back exactly


def test_stdin_to_stdout_as_npy(model_dir: Path, want: np.ndarray, monkeypatch: pytest.MonkeyPatch,
                                capfdbinary: pytest.CaptureFixture[bytes]) -> None:
    data = ("\n".join(LINES) + "\n").encode("utf-8")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))
    assert _cli.main(["embed", "--model", str(model_dir), "--input", "-", "--output", "-"]) == 0
    got = capfdbinary.readouterr()
    assert np.array_equal(np.load(io.BytesIO(got.out)), want)
    assert b"embedded 4 sentence(s)" in got.err and b"-> standard output" in got.err


def test_stdin_to_stdout_as_jsonl(model_dir: Path, want: np.ndarray, monkeypatch: pytest.MonkeyPatch,
                                  capfdbinary: pytest.CaptureFixture[bytes]) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("one\r\n\xe9t\xe9\n".encode()), encoding="utf-8"))
    assert _cli.main(["embed", "--model", str(model_dir), "--input", "-", "--output", "-", "--format", "jsonl"]) == 0
    lines = capfdbinary.readouterr().out.decode("utf-8").splitlines()
    assert [json.loads(x)["text"] for x in lines] == ["one", "été"]


def test_bad_stdin_and_formats_are_one_line_errors(tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"ok\n\xff\n")))
    assert _cli.main(["embed", "--model", str(model_dir), "--input", "-", "--output", str(tmp_path / "o.npy")]) == 1
    assert capsys.readouterr().err == "hetero: error: standard input is not UTF-8: invalid byte 0xff on line 2\n"
    assert _cli.main(["embed", "--model", str(model_dir), "--input", "-", "--output", str(tmp_path / "o.txt"),
                      "--format", "npy"]) == 1
    assert capsys.readouterr().err == (f"hetero: error: output file {str(tmp_path / 'o.txt')!r} must end in .npy "
                                       "(np.save would add the suffix), or pass --format jsonl\n")
    assert _cli.main(["embed", "--model", "m", "--input", "-", "--output", "-", "--format", "csv"]) == 2
    assert "invalid choice: 'csv'" in capsys.readouterr().err
    assert not any(p.name.startswith("o.") for p in tmp_path.iterdir())


def test_progress_switch(tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "in.txt"
    src.write_text("a\nb\n", encoding="utf-8")
    base = ["embed", "--model", str(model_dir), "--input", str(src), "--output", str(tmp_path / "o.npy")]
    assert _cli.main([*base, "--progress"]) == 0
    assert "2/2" in capsys.readouterr().err  # the bar, shown although stderr is no terminal
    assert _cli.main([*base, "--no-progress"]) == 0
    assert "2/2" not in capsys.readouterr().err
    p = __import__("argparse").ArgumentParser()
    embed_cli.add_parser(p.add_subparsers())
    assert p.parse_args(["embed", "--model", "m", "--input", "-", "--output", "-"]).progress is None
