"""Declaring graphs and the validation that happens before anything runs."""

from __future__ import annotations

import operator

import pytest

import hetero
from hetero import GraphError, InputError


def inc(v: int) -> int:
    return v + 1


def test_duplicate_stage_name() -> None:
    g = hetero.Graph("dup")
    g.cpu(inc, 1, name="a")
    with pytest.raises(GraphError) as e:
        g.cpu(inc, 2, name="a")
    assert str(e.value) == "graph 'dup' already has a stage named 'a'; pass a unique name="


def test_default_name_is_function_name_and_must_be_unique() -> None:
    g = hetero.Graph("names")
    assert g.cpu(inc, 1).name == "inc"
    with pytest.raises(GraphError, match="already has a stage named 'inc'"):
        g.cpu(inc, 2)


def test_non_callable_stage() -> None:
    g = hetero.Graph("nc")
    with pytest.raises(GraphError) as e:
        g.cpu(42, name="answer")  # type: ignore[arg-type]
    assert str(e.value) == "graph 'nc': cpu stage 'answer' is not callable: got 42"


def test_lambda_needs_a_name() -> None:
    g = hetero.Graph("lam")
    with pytest.raises(GraphError) as e:
        g.cpu(lambda v: v, 1)
    assert str(e.value) == "graph 'lam': a lambda stage needs name="


def test_no_outputs() -> None:
    g = hetero.Graph("empty")
    g.cpu(inc, 1)
    with pytest.raises(GraphError) as e:
        hetero.run(g)
    assert str(e.value) == "graph 'empty' has no outputs; declare them with graph.output(...)"


def test_cycle_is_printed() -> None:
    """
    a -> b, and a ordered after b::

        a <-> b
    """
    g = hetero.Graph("cyc")
    a = g.cpu(inc, 1, name="a")
    b = g.cpu(inc, a, name="b")
    a.after(b)
    g.output(b)
    with pytest.raises(GraphError) as e:
        g.plan()
    assert str(e.value) == "graph 'cyc' has a cycle: a->b->a"


def test_longer_cycle_is_printed_in_order() -> None:
    g = hetero.Graph("cyc3")
    a = g.cpu(inc, 1, name="a")
    b = g.cpu(inc, a, name="b")
    c = g.cpu(inc, b, name="c")
    a.after(c)
    g.output(c)
    with pytest.raises(GraphError, match=r"^graph 'cyc3' has a cycle: a->b->c->a$"):
        g.plan()


def test_missing_and_unknown_inputs_are_named() -> None:
    g = hetero.Graph("io")
    x, y = g.input("x"), g.input("y")
    g.output(g.cpu(operator.add, x, y, name="add"))
    with pytest.raises(InputError) as e:
        hetero.run(g, x=1)
    assert str(e.value) == "graph 'io' is missing input(s): y (expected: x, y)"
    with pytest.raises(InputError) as e:
        hetero.run(g, x=1, y=2, z=3)
    assert str(e.value) == "graph 'io' got unknown input(s): z (expected: x, y)"


def test_values_of_another_graph_are_rejected() -> None:
    g1, g2 = hetero.Graph("one"), hetero.Graph("two")
    x = g1.input("x")
    with pytest.raises(GraphError) as e:
        g2.cpu(inc, x, name="s")
    assert str(e.value) == (
        "graph 'two': 's' uses 'x' of graph 'one'; stages can only read values of their own graph"
    )


def test_output_once() -> None:
    g = hetero.Graph("out")
    a = g.cpu(inc, 1, name="a")
    g.output(a)
    with pytest.raises(GraphError, match=r"already has outputs \(a\); call output\(\) once"):
        g.output(a)


@pytest.mark.parametrize(
    ("kw", "msg"),
    [
        ({"retries": -1}, "retries must be an integer >= 0, got -1"),
        ({"timeout": 0}, "timeout must be > 0 seconds, got 0"),
        ({"timeout": "1s"}, "timeout must be a number of seconds or None, got '1s'"),
    ],
)
def test_bad_options(kw: dict, msg: str) -> None:
    g = hetero.Graph("opts")
    with pytest.raises(GraphError) as e:
        g.cpu(inc, 1, name="s", **kw)
    assert str(e.value) == msg


def test_bad_names() -> None:
    with pytest.raises(GraphError, match="graph name must be a non-empty string"):
        hetero.Graph("")
    g = hetero.Graph("n")
    with pytest.raises(GraphError, match="stage name must be a non-empty string without blanks or '>'"):
        g.cpu(inc, 1, name="a->b")


def test_plan_is_computed_once_and_invalidated_by_changes() -> None:
    g = hetero.Graph("cache")
    a = g.cpu(inc, 1, name="a")
    g.output(a)
    p = g.plan()
    assert g.plan() is p
    g.cpu(inc, a, name="b")
    assert g.plan() is not p


def test_critical_path_priorities() -> None:
    """
    ::

        a -> b -> c
        d
    """
    g = hetero.Graph("prio")
    a = g.cpu(inc, 1, name="a")
    b = g.cpu(inc, a, name="b")
    c = g.cpu(inc, b, name="c")
    d = g.cpu(inc, 1, name="d")
    g.output(c, d)
    p = g.plan()
    prio = {s.name: s.priority for s in p.stages}
    assert prio == {"a": 3, "b": 2, "c": 1, "d": 1}
    assert [p.stages[i].name for i in p.roots] == ["a", "d"]
