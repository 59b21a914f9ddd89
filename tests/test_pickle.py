"""Errors and graphs survive pickle (process stages and distributed engines send them)."""

from __future__ import annotations

import pickle
import pickletools

import numpy as np
import pytest

import hetero
from hetero import errors
from hetero.pipelines import embed_cli
from hetero.pipelines import minilm

SCALE_WGSL = """
@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> out: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) id: vec3<u32>) {
    if (id.x < arrayLength(&out)) { out[id.x] = 3.0 * x[id.x]; }
}
"""


def prepare(n: int) -> np.ndarray:
    return np.arange(n, dtype=np.float32) - 2.5


def triple(gpu: hetero.GPUContext, x: hetero.Tensor) -> hetero.Tensor:
    out = gpu.empty(x.shape, np.float32)
    gpu.dispatch(SCALE_WGSL, (-(-x.shape[0] // 64),), x, out)
    return out


def total(x: np.ndarray, y: np.ndarray, offset: float = 0.0) -> float:
    return float(np.sum(x) + np.sum(y) + offset)


def build() -> hetero.Graph:
    """::

        n -> prepare (cpu) -> triple (gpu) -> total (cpu)
                     \\_____________________/
    """
    g = hetero.Graph("pickled")
    x = g.cpu(prepare, g.input("n"))
    y = g.gpu(triple, x, kernels=[SCALE_WGSL])
    g.output(g.cpu(total, x, y, offset=0.5))
    return g


def public_errors() -> list[type[BaseException]]:
    found = [getattr(errors, name) for name in errors.__all__]
    found += [minilm.ModelError, minilm.ModelNotFoundError, minilm.ModelConfigError, minilm.ModelWeightsError,
              embed_cli.InputFileError]
    return found


def make(cls: type[BaseException]) -> BaseException:
    if cls is errors.StageError:
        return errors.StageError("gpu stage 'encode' failed: ValueError: bad", "encode")
    return cls(f"{cls.__name__.lower()} message")


@pytest.mark.parametrize("cls", public_errors(), ids=lambda c: c.__name__)
def test_every_public_error_survives_pickle(cls: type[BaseException]) -> None:
    err = make(cls)
    err.__cause__ = ValueError("the cause")
    err.note = "an attribute"  # type: ignore[attr-defined]
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls
    assert str(back) == str(err)
    assert back.args == err.args
    assert back.note == "an attribute"  # type: ignore[attr-defined]
    assert isinstance(back.__cause__, ValueError) and str(back.__cause__) == "the cause"
    if cls is errors.StageError:
        assert isinstance(back, errors.StageError)
        assert back.stage == "encode"
        assert str(back) == "gpu stage 'encode' failed: ValueError: bad"


def test_an_error_whose_cause_does_not_pickle_still_travels() -> None:
    err = errors.StageError("cpu stage 'a' failed: TypeError: x", "a")
    err.__cause__ = TypeError(lambda: None)  # a lambda does not pickle
    back = pickle.loads(pickle.dumps(err))
    assert (str(back), back.stage, back.__cause__) == ("cpu stage 'a' failed: TypeError: x", "a", None)


def test_a_stage_error_from_a_run_survives_pickle(rt: hetero.Runtime) -> None:
    def boom(v: int) -> int:
        raise KeyError(v)

    g = hetero.Graph("fails")
    g.output(g.cpu(boom, g.input("v")))
    with pytest.raises(errors.StageError) as e:
        import anyio

        anyio.run(lambda: rt.run(g, v=7))
    back = pickle.loads(pickle.dumps(e.value))
    assert (str(back), back.stage) == ("cpu stage 'boom' failed: KeyError: 7", "boom")
    assert isinstance(back.__cause__, KeyError)


def _globals_in(data: bytes) -> set[str]:
    """Modules a pickle stream imports from (STACK_GLOBAL takes module and name from the memo/stack)."""
    strings = [arg for op, arg, _ in pickletools.genops(data) if isinstance(arg, str)]
    return {s for s in strings if s in ("itertools",) or s.startswith("itertools.")}


def test_a_graph_of_module_level_functions_survives_pickle(shared_rt: hetero.Runtime) -> None:
    import anyio

    g = build()
    want = anyio.run(lambda: shared_rt.run(g, n=100))  # also caches the plan, which stays behind
    data = pickle.dumps(g)
    assert _globals_in(data) == set()  # itertools.count no longer pickles on Python 3.14
    back = pickle.loads(data)
    assert [(n.name, n.kind) for n in back.nodes] == [("prepare", "cpu"), ("triple", "gpu"), ("total", "cpu")]
    assert list(back.inputs) == ["n"]
    assert all(n.graph is back for n in back.nodes)
    assert back.nodes[1].kernels == ((SCALE_WGSL, "main"),)
    got = anyio.run(lambda: shared_rt.run(back, n=100))
    assert got == want == pytest.approx(float(np.sum(prepare(100)) * 4 + 0.5))
    # The unpickled graph is still a graph one can change: its plan follows.
    back.nodes[2].after(back.nodes[0])
    assert anyio.run(lambda: shared_rt.run(back, n=10)) == pytest.approx(float(np.sum(prepare(10)) * 4 + 0.5))


def test_out_of_memory_is_also_a_memory_error() -> None:
    """Code that handles running out of memory (``except MemoryError``) catches hetero's too, pickled or not."""
    err = errors.OutOfMemoryError("a buffer of 8 GiB can never fit the memory budget of 1 GiB")
    back = pickle.loads(pickle.dumps(err))
    assert isinstance(back, MemoryError) and isinstance(back, errors.GPUError) and str(back) == str(err)
    with pytest.raises(MemoryError):
        raise back
