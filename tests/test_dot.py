"""Pictures of a graph: DOT text (golden strings), networkx, rendered files."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import hetero
from hetero import GraphError, GraphvizError


def same(v: object) -> object:
    return v


def first(gpu: hetero.GPUContext, *values: object) -> object:
    return values[0]


def odd_graph() -> hetero.Graph:
    """Names with ':', quotes and a backslash; every kind of node and edge."""
    g = hetero.Graph('pic:"1"')
    x = g.input("x:raw")
    a = g.cpu(same, x, name="load:v2")
    b = g.gpu(first, a, x, name='say"hi"')
    c = g.cpu(same, b, name="back\\slash")
    d = g.gpu(first, b, name="gpu2")
    g.cpu(same, 1, name="side", after=[a])
    c.after(d, b)  # b is already a value edge: only d -> c is drawn as "after"
    g.output(c, d, x)
    return g


GOLDEN = r'''digraph "pic:\"1\"" {
  graph [rankdir="LR", label="pic:\"1\"", labelloc=t, fontname=Helvetica];
  node [fontname=Helvetica, fontsize=11];
  edge [fontname=Helvetica, fontsize=9];
  "input x:raw" [label="x:raw", shape=oval, style=filled, fillcolor="#f2f2f2"];
  "load:v2" [label="load:v2\ncpu", shape=box, style="rounded,filled", fillcolor="#dbe8f7"];
  "say\"hi\"" [label="say\"hi\"\ngpu", shape=box, style="filled,bold", fillcolor="#d5f0d0"];
  "back\\slash" [label="back\\slash\ncpu", shape=box, style="rounded,filled", fillcolor="#dbe8f7"];
  "gpu2" [label="gpu2\ngpu", shape=box, style="filled,bold", fillcolor="#d5f0d0"];
  "side" [label="side\ncpu", shape=box, style="rounded,filled", fillcolor="#dbe8f7"];
  "output 0" [label="output 0", shape=oval, peripheries=2, style=filled, fillcolor="#f2f2f2"];
  "output 1" [label="output 1", shape=oval, peripheries=2, style=filled, fillcolor="#f2f2f2"];
  "output 2" [label="output 2", shape=oval, peripheries=2, style=filled, fillcolor="#f2f2f2"];
  "input x:raw" -> "load:v2";
  "load:v2" -> "say\"hi\"" [label="upload", color="#2e7d32", fontcolor="#2e7d32"];
  "input x:raw" -> "say\"hi\"" [label="upload", color="#2e7d32", fontcolor="#2e7d32"];
  "say\"hi\"" -> "back\\slash" [label="download", color="#1565c0", fontcolor="#1565c0"];
  "gpu2" -> "back\\slash" [label="after", style=dashed, color="#757575", fontcolor="#757575"];
  "say\"hi\"" -> "gpu2";
  "load:v2" -> "side" [label="after", style=dashed, color="#757575", fontcolor="#757575"];
  "back\\slash" -> "output 0";
  "gpu2" -> "output 1" [label="download", color="#1565c0", fontcolor="#1565c0"];
  "input x:raw" -> "output 2";
}
'''


def test_golden_dot_with_odd_names() -> None:
    assert odd_graph().to_dot() == GOLDEN


def test_golden_dot_of_a_small_graph_top_to_bottom() -> None:
    g = hetero.Graph("small")
    g.output(g.cpu(same, g.input("x"), name="s"))
    assert g.to_dot(rankdir="TB") == '''digraph "small" {
  graph [rankdir="TB", label="small", labelloc=t, fontname=Helvetica];
  node [fontname=Helvetica, fontsize=11];
  edge [fontname=Helvetica, fontsize=9];
  "input x" [label="x", shape=oval, style=filled, fillcolor="#f2f2f2"];
  "s" [label="s\\ncpu", shape=box, style="rounded,filled", fillcolor="#dbe8f7"];
  "output" [label="output", shape=oval, peripheries=2, style=filled, fillcolor="#f2f2f2"];
  "input x" -> "s";
  "s" -> "output";
}
'''


def test_a_graph_without_outputs_is_drawn() -> None:
    g = hetero.Graph("draft")
    g.gpu(first, g.input("x"), name="k")
    assert '"input x" -> "k" [label="upload"' in g.to_dot()


def test_bad_rankdir_and_stats_of_another_graph() -> None:
    g = odd_graph()
    with pytest.raises(GraphError) as e:
        g.to_dot(rankdir="up")
    assert str(e.value) == "graph 'pic:\"1\"': rankdir must be one of LR, TB, RL, BT, got 'up'"
    other = hetero.Graph("other")
    other.output(other.cpu(same, 1, name="one"))
    with hetero.Runtime(cpu_threads=1) as rt:
        import anyio

        anyio.run(lambda: rt.run(other))
        stats = rt.stats()
    with pytest.raises(GraphError, match="stats describe a run of graph 'other'"):
        g.to_dot(stats=stats)


def test_stats_add_per_stage_times(shared_rt: hetero.Runtime) -> None:
    import anyio

    g = hetero.Graph("timed")
    x = g.input("x")
    a = g.cpu(lambda v: np.asarray(v, np.float32) * 2, x, name="double")
    b = g.gpu(first, a, name="keep")
    g.output(b)
    anyio.run(lambda: shared_rt.run(g, x=np.arange(4.0)))
    text = g.to_dot(stats=shared_rt.stats())
    assert re.search(r'"double" \[label="double\\ncpu\\nwall [0-9.e+-]+ ms"', text), text
    assert re.search(r'"keep" \[label="keep\\ngpu\\nwall [0-9.e+-]+ ms', text), text


def test_to_networkx_keeps_full_names_and_edge_kinds() -> None:
    nxg = odd_graph().to_networkx()
    assert set(nxg.nodes) == {"input x:raw", "load:v2", 'say"hi"', "back\\slash", "gpu2", "side",
                              "output 0", "output 1", "output 2"}
    assert nxg.nodes["load:v2"] == {"kind": "cpu", "name": "load:v2"}
    assert nxg.nodes['say"hi"']["kind"] == "gpu"
    assert nxg.nodes["output 1"] == {"kind": "output", "name": "gpu2"}
    kinds = {(u, v): d["kind"] for u, v, d in nxg.edges(data=True)}
    assert kinds == {
        ("input x:raw", "load:v2"): "value",
        ("load:v2", 'say"hi"'): "upload",
        ("input x:raw", 'say"hi"'): "upload",
        ('say"hi"', "back\\slash"): "download",
        ("gpu2", "back\\slash"): "after",
        ('say"hi"', "gpu2"): "value",
        ("load:v2", "side"): "after",
        ("back\\slash", "output 0"): "value",
        ("gpu2", "output 1"): "download",
        ("input x:raw", "output 2"): "value",
    }


def test_visualize_writes_dot_text_without_graphviz(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no 'dot' here
    out = odd_graph().visualize(tmp_path / "g.dot")
    assert out.read_text() == GOLDEN


def test_visualize_without_dot_says_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(GraphvizError) as e:
        odd_graph().visualize(tmp_path / "g.svg")
    assert "needs Graphviz's 'dot' program" in str(e.value)
    assert "apt-get install graphviz" in str(e.value)
    assert not (tmp_path / "g.svg").exists()


def test_visualize_refuses_unknown_formats_and_missing_folders(tmp_path: Path) -> None:
    with pytest.raises(GraphvizError, match="cannot tell the picture format of"):
        odd_graph().visualize(tmp_path / "g.txt")
    with pytest.raises(GraphvizError, match="does not exist"):
        odd_graph().visualize(tmp_path / "nope" / "g.svg")


needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is not installed")


@needs_dot
def test_dot_parses_the_text_and_keeps_every_name(tmp_path: Path) -> None:
    g = odd_graph()
    # dot reads the text back with every name whole: -Tcanon writes the same ids again
    canon = subprocess.run(["dot", "-Tcanon"], input=g.to_dot(), capture_output=True, text=True, check=True).stdout
    for node in ('"input x:raw"', '"load:v2"', '"say\\"hi\\""', '"back\\\\slash"', '"output 0"'):
        assert f"\t{node}\t[" in canon, (node, canon)
    svg = g.visualize(tmp_path / "g.svg").read_text()
    titles = re.findall(r"<title>(.*?)</title>", svg)
    assert {"load:v2", "say&quot;hi&quot;", "back\\\\slash", "input x:raw"} <= set(titles)
    assert "say&quot;hi&quot;&#45;&gt;back\\\\slash" in titles


@needs_dot
def test_embed_pipeline_picture_renders(tmp_path: Path) -> None:
    from hetero.pipelines.embed_graph import embedding_graph
    from hetero.pipelines.testing import write_random_model
    from hetero.pipelines.minilm import load_model

    model = load_model(write_random_model(tmp_path / "m"))
    path = embedding_graph(model).visualize(tmp_path / "embed.svg")
    assert path.read_text().lstrip().startswith("<?xml")


def test_cli_graph_prints_dot_and_writes_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hetero import _cli
    from hetero.pipelines.testing import write_random_model

    model = str(write_random_model(tmp_path / "m", num_hidden_layers=2))
    assert _cli.main(["graph", "--pipeline", "embed", "--model", model]) == 0
    text = capsys.readouterr().out
    assert text.startswith('digraph "embed" {') and '"layer1" -> "pool";' in text
    # embeddings ... pool have CPU and GPU implementations: their transfers depend on placement.
    assert '"tokenize" -> "embeddings" [label="upload if on gpu"' in text
    assert '"pool" -> "output" [label="download if on gpu"' in text
    assert '"embeddings" [label="embeddings\\ncpu | gpu, captured"' in text
    assert _cli.main(["graph", "--pipeline", "embed", "--model", model, "-o", str(tmp_path / "e.dot")]) == 0
    assert (tmp_path / "e.dot").read_text() == text
    assert _cli.main(["graph", "--pipeline", "embed", "--model", model, "-o", str(tmp_path / "e.txt")]) == 1
    assert "hetero: error: graph 'embed': cannot tell the picture format" in capsys.readouterr().err


def test_cli_graph_draws_the_graph_that_would_run(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The embed pipeline offers CPU twins only where placement may choose them (offers_cpu): the
    picture shows the GPU-only graph under --placement gpu, and follows the adapter under auto."""
    from hetero import _cli
    from hetero.pipelines.embed_graph import embedding_graph
    from hetero.pipelines.embed_placement import offers_cpu
    from hetero.pipelines.minilm import load_model
    from hetero.pipelines.testing import write_random_model

    d = write_random_model(tmp_path / "m", num_hidden_layers=2)
    model = load_model(d)
    for placement in ("auto", "cpu", "gpu"):
        assert _cli.main(["graph", "--pipeline", "embed", "--model", str(d), "--placement", placement]) == 0
        text = capsys.readouterr().out
        with hetero.Runtime(placement=placement) as rt:  # the runtime `hetero embed --placement` makes
            expected = embedding_graph(model, cpu=offers_cpu(rt))
            twins = placement == "cpu" or (placement == "auto" and rt.device().summary["type"].lower() == "cpu")
        assert text == expected.to_dot(rankdir="LR")
        assert ('"embeddings" [label="embeddings\\ncpu | gpu, captured"' in text) is twins, (placement, text)
        assert ('"tokenize" -> "embeddings" [label="upload if on gpu"' in text) is twins
    gpu_only = text
    assert gpu_only.startswith('digraph "embed-gpu" {') and '"embeddings" [label="embeddings\\ngpu, captured"' in text
    # the adapter the runtime would open decides under auto (none at all: placement runs on the CPU)
    monkeypatch.setenv("HETERO_ADAPTER", "no-such-adapter")
    assert _cli.main(["graph", "--pipeline", "embed", "--model", str(d)]) == 0
    assert '"embeddings" [label="embeddings\\ncpu | gpu, captured"' in capsys.readouterr().out
    assert _cli.main(["graph", "--pipeline", "embed", "--model", str(d), "--placement", "gpu", "--int8"]) == 0
    assert capsys.readouterr().out.startswith('digraph "embed-int8" {')


@needs_dot
def test_cli_graph_renders_svg(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hetero import _cli
    from hetero.pipelines.testing import write_random_model

    model = str(write_random_model(tmp_path / "m", num_hidden_layers=1))
    assert _cli.main(["graph", "--pipeline", "embed", "--model", model, "-o", str(tmp_path / "embed.svg")]) == 0
    assert "(5 stages)" in capsys.readouterr().out
    assert "<title>layer0&#45;&gt;pool</title>" in (tmp_path / "embed.svg").read_text()


def test_process_stages_are_told_apart() -> None:
    g = hetero.Graph("procs")
    a = g.cpu(same, g.input("x"), name="parse", process=True)
    b = g.gpu(first, a, name="k")
    g.output(g.cpu(same, b, name="proc2", process=True))
    text = g.to_dot()
    assert '  "parse" [label="parse\\nprocess", shape=box, style="rounded,filled", fillcolor="#e6dcf5"];' in text
    assert '"parse" -> "k" [label="upload"' in text and '"k" -> "proc2" [label="download"' in text
    assert g.to_networkx().nodes["parse"]["kind"] == "process"


def test_captured_gpu_stages_say_so() -> None:
    g = hetero.Graph("cap")
    g.output(g.gpu(first, g.input("x"), name="k", capture=True))
    assert '  "k" [label="k\\ngpu, captured", shape=box, style="filled,bold", fillcolor="#d5f0d0"];' in g.to_dot()
