"""Inputs hetero converts or names: big-endian arrays, unexpected graph inputs."""

from __future__ import annotations

import operator
from pathlib import Path

import numpy as np
import pytest

import hetero

pytestmark = pytest.mark.anyio

DOUBLE = """
@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> out: array<f32>;
@group(0) @binding(2) var<uniform> k: vec4<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) id: vec3<u32>) {
    if (id.x < arrayLength(&x)) { out[id.x] = x[id.x] * k.x; }
}
"""


def scaled(gpu: hetero.GPUContext, x: hetero.Tensor, k: float) -> hetero.Tensor:
    out = gpu.empty(x.shape, np.float32)
    gpu.dispatch(DOUBLE, (-(-x.shape[0] // 64),), x, out, np.array([k, 0, 0, 0], ">f4"))  # a big-endian uniform
    return out


async def test_big_endian_arrays_are_converted_on_upload(shared_rt: hetero.Runtime) -> None:
    """
    ::

        x (big-endian)   k
              \\          /
             scaled (gpu)
    """
    g = hetero.Graph("big_endian")
    g.output(g.gpu(scaled, g.input("x"), g.input("k"), name="scaled"))
    x = np.arange(100, dtype=">f4")
    got = await shared_rt.run(g, x=x, k=2.0)
    assert got.dtype == np.float32 and got.dtype.isnative
    assert np.array_equal(got, np.arange(100, dtype=np.float32) * 2)
    assert x.dtype == np.dtype(">f4")  # the caller's array is left as it is


def test_unexpected_input_is_named() -> None:
    g = hetero.Graph("g")
    g.output(g.cpu(operator.neg, g.input("x"), name="neg"))
    with pytest.raises(hetero.InputError) as e:
        hetero.run(g, y=1)
    assert str(e.value) == "graph 'g' got unknown input(s): y and is missing input(s): x (expected: x)"
    with pytest.raises(hetero.InputError) as e:
        hetero.run(g, x=1, y=1, z=2)
    assert str(e.value) == "graph 'g' got unknown input(s): y, z (expected: x)"


async def test_unexpected_input_is_named_by_run_and_map(rt: hetero.Runtime) -> None:
    g = hetero.Graph("g")
    g.output(g.cpu(operator.neg, g.input("x"), name="neg"))
    want = "graph 'g' got unknown input(s): y and is missing input(s): x (expected: x)"
    with pytest.raises(hetero.InputError) as e:
        await rt.run(g, y=1)
    assert str(e.value) == want
    with pytest.raises(hetero.InputError) as e:
        _ = [r async for r in rt.map(g, [{"x": 1}, {"y": 1}])]
    assert str(e.value) == want


def test_a_lone_surrogate_is_an_input_error_naming_its_index(tmp_path: Path) -> None:
    from hetero.pipelines import Encoder
    from hetero.pipelines.embed import embed
    from hetero.pipelines.embed_tokens import check_texts
    from hetero.pipelines.testing import write_random_model

    model = write_random_model(tmp_path / "m", seed=1, vocab_size=300, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=1, num_attention_heads=4, max_position_embeddings=40,
                               max_seq_length=24)
    want = ("texts[1] is not valid Unicode: a lone surrogate U+D800 at character 3; pass text decoded as UTF-8 "
            "(invalid bytes replaced, errors='replace')")
    with pytest.raises(hetero.InputError) as e:
        check_texts(["fine", "abc\ud800def"])
    assert str(e.value) == want
    check_texts(["fine", "été 🤖"])  # valid text passes
    with hetero.Runtime(cpu_threads=1) as rt:
        with pytest.raises(hetero.InputError) as e:
            embed(["fine", "abc\ud800def"], model=str(model), runtime=rt)
        assert str(e.value) == want
        with pytest.raises(hetero.InputError) as e:
            Encoder(str(model), runtime=rt).encode("\udfff")
        assert str(e.value).startswith("texts[0] is not valid Unicode: a lone surrogate U+DFFF at character 0")
