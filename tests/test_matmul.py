"""``hetero.kernels.matmul`` against numpy on a real device (Mesa lavapipe in CI), and its tuner cache."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

import hetero
import hetero.kernels.matmul as MM
import hetero.kernels.matmul.cache as MC
import hetero.kernels.matmul.codegen as MG
from hetero import StageError, Tensor
from hetero.kernels.matmul import MatmulConfig, matmul

pytestmark = pytest.mark.anyio
ASYNCIO_ONLY = pytest.mark.parametrize("anyio_backend", ["asyncio"])  # heavy: once is enough


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test sees an empty tuning cache of its own (never the user's ~/.cache)."""
    d = tmp_path / "cache"
    monkeypatch.setenv("HETERO_CACHE_DIR", str(d))
    return d


def rand(shape: tuple[int, ...], seed: int, dtype: Any = np.float32) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def reference(a: np.ndarray, b: np.ndarray, transpose_b: bool = False, bias: np.ndarray | None = None) -> np.ndarray:
    b64 = np.swapaxes(b, -1, -2).astype(np.float64) if transpose_b else b.astype(np.float64)
    r = a.astype(np.float64) @ b64
    return r + bias.astype(np.float64) if bias is not None else r


def check(got: np.ndarray, want: np.ndarray, rtol: float = 1e-4, what: str = "") -> None:
    """Within float32 accuracy: every element within rtol of the largest result, and the norms."""
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err = np.abs(got.astype(np.float64) - want)
    scale = float(np.max(np.abs(want), initial=0.0))
    assert float(np.max(err, initial=0.0)) <= rtol * max(scale, 1e-30) + 1e-30, (what, float(err.max()), scale)
    assert float(np.linalg.norm(err)) <= rtol * float(np.linalg.norm(want)) + 1e-30, what


def mm_graph(**kw: Any) -> hetero.Graph:
    """
    ::

        a, b --> matmul (gpu) --> (output)
    """
    def stage(gpu: hetero.GPUContext, a: Tensor, b: Tensor) -> Tensor:
        return matmul(gpu, a, b, **kw)

    g = hetero.Graph("matmul")
    g.output(g.gpu(stage, g.input("a"), g.input("b"), name="matmul"))
    return g


def mm_bias_graph(transpose_b: bool = False, config: MatmulConfig | None = None) -> hetero.Graph:
    """
    ::

        a, b, bias --> matmul (gpu) --> (output)
    """
    def stage(gpu: hetero.GPUContext, a: Tensor, b: Tensor, bias: Tensor) -> Tensor:
        return matmul(gpu, a, b, transpose_b=transpose_b, bias=bias, config=config)

    g = hetero.Graph("matmul-bias")
    g.output(g.gpu(stage, g.input("a"), g.input("b"), g.input("bias"), name="matmul"))
    return g


SHAPES = [(1, 1, 1), (1, 7, 1), (5, 3, 7), (33, 65, 17), (64, 64, 64), (127, 129, 131)]  # M, N, K


# -- values against numpy -----------------------------------------------------------------------
async def test_shapes_match_numpy(shared_rt: hetero.Runtime) -> None:
    g = mm_graph()
    inputs = [{"a": rand((m, k), i), "b": rand((k, n), 100 + i)} for i, (m, n, k) in enumerate(SHAPES)]
    results = [r async for r in shared_rt.map(g, inputs, max_in_flight=4)]
    for (m, n, k), x, got in zip(SHAPES, inputs, results):
        assert got.dtype == np.float32
        check(got, reference(x["a"], x["b"]), what=f"{m}x{n}x{k}")


@ASYNCIO_ONLY
@pytest.mark.parametrize("transpose_b", [False, True])
async def test_transpose_b_and_fused_bias(shared_rt: hetero.Runtime, transpose_b: bool) -> None:
    g = mm_bias_graph(transpose_b)
    for i, (m, n, k) in enumerate(SHAPES):
        a, b = rand((m, k), i), rand((n, k) if transpose_b else (k, n), 50 + i)
        bias = rand((n,), 70 + i)
        got = await shared_rt.run(g, a=a, b=b, bias=bias)
        check(got, reference(a, b, transpose_b, bias), what=f"{m}x{n}x{k} transpose_b={transpose_b}")


@ASYNCIO_ONLY
async def test_batched_and_broadcast_operands(shared_rt: hetero.Runtime) -> None:
    cases: list[tuple[tuple[int, ...], tuple[int, ...], bool]] = [
        ((3, 5, 7), (3, 7, 6), False),         # batched, odd sizes
        ((2, 33, 64), (2, 20, 64), True),      # batched, transposed b
        ((4, 16, 8), (8, 12), False),          # one weight for every batch (folded into M)
        ((2, 9, 16), (12, 16), True),          # ... transposed, as torch.nn.Linear stores it
        ((9, 16), (3, 16, 5), False),          # one left operand for every batch
    ]
    for i, (sa, sb, tb) in enumerate(cases):
        a, b = rand(sa, i), rand(sb, 10 + i)
        got = await shared_rt.run(mm_graph(transpose_b=tb), a=a, b=b)
        check(got, reference(a, b, tb), what=f"{sa} @ {sb} transpose_b={tb}")


@ASYNCIO_ONLY
async def test_bert_style_linear_layer(shared_rt: hetero.Runtime) -> None:
    """[B, S, K] activations times a torch-layout weight [N, K] plus bias, as in BERT's dense layers."""
    x, w, bias = rand((2, 7, 48), 1), rand((36, 48), 2), rand((36,), 3)
    got = await shared_rt.run(mm_bias_graph(transpose_b=True), a=x, b=w, bias=bias)
    assert got.shape == (2, 7, 36)
    check(got, reference(x, w, True, bias))


async def test_results_stay_on_the_gpu_and_out_is_reused(shared_rt: hetero.Runtime) -> None:
    """
    ::

        a, b --> first (gpu) --> second (gpu, writes into a given out) --> (output)
    """
    def first(gpu: hetero.GPUContext, a: Tensor, b: Tensor) -> Tensor:
        return matmul(gpu, a, b)

    def second(gpu: hetero.GPUContext, ab: Tensor, b: Tensor) -> Tensor:
        out = gpu.empty((ab.shape[0], b.shape[1]), np.float32)
        r = matmul(gpu, ab, b, out=out)
        assert r is out and isinstance(ab, Tensor)
        return r

    g = hetero.Graph("chain")
    a, b = g.input("a"), g.input("b")
    g.output(g.gpu(second, g.gpu(first, a, b), b))
    x, y = rand((20, 12), 1), rand((12, 12), 2)
    check(await shared_rt.run(g, a=x, b=y), reference(reference(x, y).astype(np.float32), y))


@ASYNCIO_ONLY
async def test_every_kind_of_configuration(shared_rt: hetero.Runtime) -> None:
    """Single and double buffering, BK 16, 4x8 blocks, partial thread loads, K splits."""
    limits = shared_rt.device().limits
    configs = [MatmulConfig(32, 32, 8, 4, 4, double_buffer=False), MatmulConfig(64, 64, 16, 4, 4),
               MatmulConfig(64, 64, 8, 4, 8), MatmulConfig(16, 16, 4, 4, 4), MatmulConfig(64, 32, 8, 8, 4),
               MatmulConfig(32, 32, 8, 4, 4, split_k=3)]
    assert all(c.fits(limits) is None for c in configs)
    a, b, bias = rand((37, 600), 1), rand((70, 600), 2), rand((70,), 3)  # K = 600: split into 2 parts
    want = reference(a, b, True, bias)
    for c in configs:
        check(await shared_rt.run(mm_bias_graph(True, c), a=a, b=b, bias=bias), want, what=c.name)
    a, b = rand((3, 9, 520), 4), rand((3, 520, 16), 5)  # batched K split (vec4 path)
    check(await shared_rt.run(mm_graph(config=configs[-1]), a=a, b=b), reference(a, b), what="batched split")


@ASYNCIO_ONLY
async def test_float16_inputs_accumulate_in_float32(shared_rt: hetero.Runtime) -> None:
    cases = [((33, 17), (17, 65), False), ((64, 64), (64, 64), False), ((5, 8), (6, 8), True),
             ((2, 5, 7), (2, 7, 3), False)]
    for i, (sa, sb, tb) in enumerate(cases):
        a, b = rand(sa, i, np.float16), rand(sb, 9 + i, np.float16)
        n = sb[-2] if tb else sb[-1]
        bias = rand((n,), 20 + i, np.float16)

        def stage(gpu: hetero.GPUContext, x: Tensor, y: Tensor, z: Tensor) -> Tensor:
            return matmul(gpu, x, y, transpose_b=tb, bias=z if x.ndim == 2 else None)

        g = hetero.Graph("f16")
        g.output(g.gpu(stage, g.input("a"), g.input("b"), g.input("bias"), name="matmul"))
        got = await shared_rt.run(g, a=a, b=b, bias=bias)
        assert got.dtype == np.float16
        want = reference(a, b, tb, bias if a.ndim == 2 else None)
        check(got, want, rtol=2e-3, what=f"f16 {sa} @ {sb}")


def gelu_ref(x: np.ndarray) -> np.ndarray:
    import math

    return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


@ASYNCIO_ONLY
async def test_fused_gelu_activation(shared_rt: hetero.Runtime) -> None:
    """``activation="gelu"``: gelu(a @ b + bias) in the store, in every store path and the K split's sum."""
    def graph(**kw: Any) -> hetero.Graph:
        def stage(gpu: hetero.GPUContext, a: Tensor, b: Tensor, bias: Tensor) -> Tensor:
            return matmul(gpu, a, b, bias=bias, activation="gelu", **kw)

        g = hetero.Graph("matmul-gelu")
        g.output(g.gpu(stage, g.input("a"), g.input("b"), g.input("bias"), name="matmul"))
        return g

    split = MatmulConfig(32, 32, 8, 4, 4, split_k=3)
    cases = [((37, 600), (70, 600), True, None), ((33, 17), (17, 65), False, None),  # vec4 / scalar stores
             ((5, 8), (7, 8), True, None), ((37, 600), (70, 600), True, split),   # K split: gelu in the sum
             ((9, 520), (520, 16), False, split), ((1, 1), (1, 1), False, None)]
    for i, (sa, sb, tb, cfg) in enumerate(cases):
        a, b = rand(sa, i, np.float32) * 0.2, rand(sb, 10 + i, np.float32) * 0.2
        bias = rand((sb[0] if tb else sb[1],), 20 + i)
        got = await shared_rt.run(graph(transpose_b=tb, config=cfg), a=a, b=b, bias=bias)
        check(got, gelu_ref(reference(a, b, tb, bias)), rtol=2e-5, what=f"gelu {sa} @ {sb} {cfg}")
    a, b = rand((6, 10), 1, np.float16), rand((10, 5), 2, np.float16)  # float16 in and out, odd N
    got = await shared_rt.run(graph(), a=a, b=b, bias=rand((5,), 3, np.float16))
    assert got.dtype == np.float16
    check(got, gelu_ref(reference(a, b, False, rand((5,), 3, np.float16))), rtol=3e-3, what="f16 gelu")
    with pytest.raises(StageError) as ei:
        await shared_rt.run(mm_graph(activation="relu"), a=rand((2, 2), 1), b=rand((2, 2), 2))
    assert str(ei.value.__cause__) == "matmul: activation must be None or one of 'gelu', got 'relu'"


@ASYNCIO_ONLY
async def test_empty_dimensions(shared_rt: hetero.Runtime) -> None:
    got = await shared_rt.run(mm_graph(), a=np.zeros((0, 4), np.float32), b=rand((4, 3), 1))
    assert got.shape == (0, 3)
    bias = rand((3,), 2)
    got = await shared_rt.run(mm_bias_graph(), a=np.zeros((2, 0), np.float32), b=np.zeros((0, 3), np.float32),
                              bias=bias)
    np.testing.assert_array_equal(got, np.broadcast_to(bias, (2, 3)))  # K = 0: just the bias


class LimitSpy:
    """A GPUContext stand-in that pretends the per-dimension grid limit is 2 and notes the grids."""

    def __init__(self, gpu: hetero.GPUContext) -> None:
        self._gpu = gpu
        self.limits = dict(gpu.limits, **{"max-compute-workgroups-per-dimension": 2})
        self.grids: list[tuple[int, ...]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._gpu, name)

    def dispatch(self, kernel: Any, workgroups: Any, *bindings: Any) -> Any:
        self.grids.append(tuple(workgroups))
        return self._gpu.dispatch(kernel, workgroups, *bindings)


@ASYNCIO_ONLY
async def test_grids_past_the_limit_become_several_dispatches(shared_rt: hetero.Runtime) -> None:
    grids: list[tuple[int, ...]] = []

    def stage(gpu: hetero.GPUContext, a: Tensor, b: Tensor) -> Tensor:
        spy = LimitSpy(gpu)
        out = matmul(spy, a, b, config=MatmulConfig(16, 16, 4, 4, 4))
        grids.extend(spy.grids)
        return out

    g = hetero.Graph("limit")
    g.output(g.gpu(stage, g.input("a"), g.input("b"), name="matmul"))
    a, b = rand((5, 40, 8), 1), rand((5, 8, 50), 2)  # 3 row tiles, 4 column tiles, batch 5
    check(await shared_rt.run(g, a=a, b=b), reference(a, b))
    assert all(y <= 2 and z <= 2 for _, y, z in grids) and len(grids) == 2 * 3  # x is hetero's to split
    assert all(x == 4 for x, _, _ in grids)


# -- errors ---------------------------------------------------------------------------------------
async def run_error(rt: hetero.Runtime, fn: Callable[..., Any], **inputs: Any) -> str:
    g = hetero.Graph("bad")
    names = sorted(inputs)
    g.output(g.gpu(lambda gpu, *xs: fn(gpu, **dict(zip(names, xs))), *[g.input(n) for n in names], name="matmul"))
    with pytest.raises(StageError) as e:
        await rt.run(g, **inputs)
    return str(e.value)


async def test_errors_name_the_op_the_shapes_and_the_rule(shared_rt: hetero.Runtime) -> None:
    f32 = np.float32
    pre = "gpu stage 'matmul' failed: "
    cases: list[tuple[Callable[..., Any], dict[str, Any], str]] = [
        (lambda gpu, a, b: matmul(gpu, a, b), dict(a=np.ones((3, 5), f32), b=np.ones((4, 2), f32)),
         "ValueError: matmul: a is [3, 5] and b is [4, 2]: inner dimensions 5 and 4 differ"),
        (lambda gpu, a, b: matmul(gpu, a, b, transpose_b=True), dict(a=np.ones((3, 5), f32), b=np.ones((4, 2), f32)),
         "ValueError: matmul: a is [3, 5] and b is [4, 2] with transpose_b: inner dimensions 5 and 2 differ"),
        (lambda gpu, a, b: matmul(gpu, a, b), dict(a=np.ones((2, 3, 5), f32), b=np.ones((3, 5, 2), f32)),
         "ValueError: matmul: a is [2, 3, 5] and b is [3, 5, 2]: batch dimensions 2 and 3 differ"),
        (lambda gpu, a, b: matmul(gpu, a, b), dict(a=np.ones(5, f32), b=np.ones((5, 2), f32)),
         "ValueError: matmul: a is [5] (1-D): a must be [M, K] or [B, M, K]"),
        (lambda gpu, a, b: matmul(gpu, a, b), dict(a=np.ones((3, 5)), b=np.ones((5, 2), f32)),
         "TypeError: matmul: a is float64 and b is float32: both must be float32, or both float16"),
        (lambda gpu, a, b, c: matmul(gpu, a, b, bias=c),
         dict(a=np.ones((3, 5), f32), b=np.ones((5, 2), f32), c=np.ones(3, f32)),
         "ValueError: matmul: bias is [3] and the result has N = 2 columns: bias must be [2]"),
        (lambda gpu, a, b: matmul(gpu, a, b, out=gpu.empty((2, 3), f32)),
         dict(a=np.ones((3, 5), f32), b=np.ones((5, 2), f32)),
         "ValueError: matmul: out is [2, 3] float32 but the result is [3, 2] float32"),
        (lambda gpu, a, b: matmul(gpu, a, b, out=a), dict(a=np.ones((2, 2), f32), b=np.ones((2, 2), f32)),
         "ValueError: matmul: out shares memory with a: pass a separate output tensor"),
        (lambda gpu, a, b: matmul(gpu, a, [[1.0]]), dict(a=np.ones((1, 1), f32), b=np.ones((1, 1), f32)),
         "TypeError: matmul: b must be a hetero.Tensor or a numpy array, got list"),
        (lambda gpu, a, b: matmul(gpu, a, b, config=MatmulConfig(128, 128, 64, 8, 8)),
         dict(a=np.ones((2, 2), f32), b=np.ones((2, 2), f32)),
         "ValueError: matmul: config 128x128x64/8x8/db cannot run on this device: needs 135168 bytes of "
         "workgroup memory, the device has 32768"),
    ]
    limit = shared_rt.device().limits["max-compute-workgroup-storage-size"]
    for fn, inputs, message in cases:
        assert await run_error(shared_rt, fn, **inputs) == pre + message.replace("32768", str(limit))


def test_config_validation() -> None:
    with pytest.raises(ValueError, match=r"matmul config: bk must be a positive multiple of 4, got 6"):
        MatmulConfig(64, 64, 6, 4, 4)
    with pytest.raises(ValueError, match=r"matmul config 256x256x8/4x4/db: 4096 threads per workgroup"):
        MatmulConfig(256, 256, 8, 4, 4)
    with pytest.raises(ValueError, match=r"split_k must be an int from 1 to 64"):
        MatmulConfig(64, 64, 8, 4, 4, split_k=0)
    c = MatmulConfig(128, 64, 16, 8, 8, False, 2)
    assert c.threads == 128 and c.name == "128x64x16/8x8/sk2"
    assert MatmulConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    assert c.fits({"max-compute-workgroup-storage-size": 1024}) == (
        "needs 12800 bytes of workgroup memory, the device has 1024")
    assert MM.size_class(4096, 4096) == 12 and MM.size_class(1, 1) == 0 and MM.size_class(32, 32, 4) == 6
    assert MM.default_config("CPU", 1000, 1000).fits({}) is None
    assert MM.default_config("DiscreteGPU", 4096, 4096) == MatmulConfig(128, 128, 8, 8, 8)
    assert MM.default_config("DiscreteGPU", 64, 64).bm == 32


# -- the tuner and its cache ------------------------------------------------------------------------
SMALL = (MatmulConfig(16, 16, 4, 4, 4), MatmulConfig(32, 32, 8, 4, 4))


def test_tune_writes_the_cache_and_matmul_reads_it(shared_rt: hetero.Runtime, private_cache: Path) -> None:
    dev = shared_rt.device()
    r = MM.tune(dev, 48, 40, 24, configs=SMALL, min_ms=1, repeat=1)
    assert r.best in SMALL and r.gflops > 0 and r.key == "f32:n5" and r.shape == (48, 40, 24, 1)
    assert [name for name, _, _ in r.results] == [c.name for c in SMALL]
    path = MM.cache_path(dev)
    assert r.path == str(path) and path.parent == private_cache
    doc = json.loads(path.read_text())
    assert doc["version"] == 1 and doc["adapter"]["name"] == dev.summary["name"]
    assert doc["entries"]["f32:n5"]["config"] == r.best.to_dict()
    assert os.listdir(private_cache) == [path.name]  # the atomic write left no temporary file
    # matmul uses the tuned entry for this size class and its neighbours, the default further away
    chosen = MM.choose_config(MockGPU(dev), 40, 40, 24)
    assert chosen == r.best
    assert MM.choose_config(MockGPU(dev), 4096, 4096, 24) == MM.default_config(dev.summary["type"], 4096, 4096,
                                                                                limits=dev.limits)
    # another size merges into the same file
    other = SMALL[1] if r.best == SMALL[0] else SMALL[0]
    MC.save(path, MC.adapter_info(dev), {"f32:n9": {"config": other.to_dict()}})
    doc = json.loads(path.read_text())
    assert set(doc["entries"]) == {"f32:n5", "f32:n9"}
    assert MM.choose_config(MockGPU(dev), 512, 512, 512) == other
    assert MM.explain_config(MockGPU(dev), 512, 512, 512) == (other, "cache f32:n9")
    # batched and transposed problems tune too (the full-size check handles the batch)
    r = MM.tune(dev, 8, 12, 16, batch=2, transpose_b=True, configs=SMALL[:1], min_ms=1, repeat=1, save=False)
    assert r.best == SMALL[0] and r.shape == (8, 12, 16, 2) and r.key == "f32:n4"


def test_corrupt_or_foreign_cache_is_ignored(shared_rt: hetero.Runtime, private_cache: Path,
                                             caplog: pytest.LogCaptureFixture) -> None:
    dev = shared_rt.device()
    gpu = MockGPU(dev)
    default = MM.choose_config(gpu, 64, 64, 64)
    path = MM.cache_path(dev)
    path.parent.mkdir(parents=True)
    good = MatmulConfig(16, 16, 4, 4, 4)
    for text in ("{not json", "[]", json.dumps({"version": 99, "entries": {}}),
                 json.dumps({"version": 1, "entries": {"f32:n6": {"config": {"bm": 5}}}}),
                 json.dumps({"version": 1, "entries": {"f32:n6": {"config": {"bm": 64, "evil": 1}}}}),
                 json.dumps({"version": 1, "entries": {"f32:n6": "nope"}})):
        path.write_text(text)
        os.utime(path, ns=(len(text), len(text)))  # a new mtime each time: the memo must notice
        assert MM.choose_config(gpu, 64, 64, 64) == default, text
    assert "ignoring" in caplog.text
    # one bad entry does not hide the good ones
    path.write_text(json.dumps({"version": 1, "entries": {"f32:n6": {"config": good.to_dict()},
                                                          "f32:n7": {"config": {"bm": 3}}}}))
    assert MM.choose_config(gpu, 64, 64, 64) == good
    # a tune over a corrupt file replaces it
    path.write_text("garbage")
    MM.tune(dev, 16, 16, 16, configs=SMALL[:1], min_ms=1, repeat=1)
    assert set(json.loads(path.read_text())["entries"]) == {"f32:n4"}


def test_tuner_skips_configurations_that_cannot_run(shared_rt: hetero.Runtime,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    dev = shared_rt.device()
    too_big = MatmulConfig(128, 128, 64, 8, 8)  # 132 KB of workgroup memory
    broken = MatmulConfig(16, 32, 4, 4, 4)
    real = MG.source

    def wgsl(c: MatmulConfig, v: Any) -> str:
        return "fn main( {" if c == broken else real(c, v)

    monkeypatch.setattr(MG, "source", wgsl)
    r = MM.tune(dev, 20, 20, 20, configs=(too_big, broken, SMALL[0]), min_ms=1, repeat=1, save=False)
    assert r.best == SMALL[0] and r.path is None
    notes = {name: note for name, _, note in r.results}
    assert notes[too_big.name].startswith("skipped: needs 135168 bytes of workgroup memory")
    assert notes[broken.name].startswith("skipped: GPUValidationError")
    with pytest.raises(RuntimeError, match=r"matmul tune: no configuration ran correctly for 20x20x20"):
        MM.tune(dev, 20, 20, 20, configs=(broken,), min_ms=1, repeat=1, save=False)


class MockGPU:
    """What ``choose_config`` reads of a GPUContext: the device (for the adapter) and the limits."""

    def __init__(self, dev: Any) -> None:
        self.device = dev.device
        self.limits = dev.limits
