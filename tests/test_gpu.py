"""GPU stages on a real WebGPU device (Mesa lavapipe in CI): kernels, transfers, errors."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

import hetero
from hetero import StageError, Tensor

pytestmark = pytest.mark.anyio

SAXPY = """
@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
struct Params { a: f32, n: u32 }
@group(0) @binding(2) var<uniform> p: Params;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if (i < p.n) { y[i] = p.a * x[i] + y[i]; }
}
"""

SCALE = """
@group(0) @binding(0) var<storage, read> src: array<f32>;
@group(0) @binding(1) var<storage, read_write> dst: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (gid.x < arrayLength(&dst)) { dst[gid.x] = src[gid.x] * 2.0; }
}
"""


def params(a: float, n: int) -> np.ndarray:
    return np.array([(a, n)], dtype=[("a", "<f4"), ("n", "<u4")])


def saxpy(gpu: hetero.GPUContext, x: Tensor, y: Tensor, a: float) -> Tensor:
    assert isinstance(x, Tensor) and isinstance(y, Tensor)
    gpu.dispatch(SAXPY, (x.size + 63) // 64, x, y, params(a, x.size))
    return y


def scale(gpu: hetero.GPUContext, src: Tensor) -> Tensor:
    out = gpu.empty(src.shape, src.dtype)
    gpu.dispatch(gpu.kernel(SCALE), (src.size + 63) // 64, src, out)
    return out


def saxpy_graph() -> hetero.Graph:
    """
    ::

        x, y -> prepare (cpu) -> saxpy (gpu) -> check (cpu)
    """
    g = hetero.Graph("saxpy")
    x, y = g.input("x"), g.input("y")
    xy = g.cpu(lambda a, b: (np.asarray(a, np.float32), np.asarray(b, np.float32)), x, y, name="prepare")
    xs = g.cpu(lambda t: t[0], xy, name="xs")
    ys = g.cpu(lambda t: t[1], xy, name="ys")
    r = g.gpu(saxpy, xs, ys, 3.0)
    g.output(g.cpu(lambda v: (v.dtype.name, v.shape, float(v.sum())), r, name="check"), r)
    return g


async def test_cpu_gpu_cpu_saxpy_matches_numpy(shared_rt: hetero.Runtime) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal(1000)
    y = rng.standard_normal(1000)
    (dtype, shape, total), r = await shared_rt.run(saxpy_graph(), x=x, y=y)
    expect = 3.0 * x.astype(np.float32) + y.astype(np.float32)
    assert isinstance(r, np.ndarray) and dtype == "float32" and shape == (1000,)
    np.testing.assert_allclose(r, expect, rtol=1e-5, atol=1e-6)  # GPUs may fuse a*x+y (FMA)
    assert total == pytest.approx(float(expect.sum()), rel=1e-4)


async def test_gpu_to_gpu_chain_and_structured_results(shared_rt: hetero.Runtime) -> None:
    """
    ::

        x -> scale (gpu) -> scale2 (gpu) -> pair (gpu) -> (cpu reads a dict)
    """
    def pair(gpu: hetero.GPUContext, a: Tensor, b: Tensor) -> dict:
        return {"a": a, "b": (b, "label")}

    g = hetero.Graph("chain")
    s1 = g.gpu(scale, g.input("x"), name="scale1")
    s2 = g.gpu(scale, s1, name="scale2")
    p = g.gpu(pair, s1, s2)
    g.output(g.cpu(lambda d: (d["a"].tolist(), d["b"][0].tolist(), d["b"][1]), p, name="read"))
    x = np.arange(5, dtype=np.float32)
    a, b, label = await shared_rt.run(g, x=x)
    assert a == (2 * x).tolist() and b == (4 * x).tolist() and label == "label"


async def test_many_gpu_runs_through_map(shared_rt: hetero.Runtime) -> None:
    g = saxpy_graph()
    inputs = [{"x": np.full(300 + i, i, np.float32), "y": np.ones(300 + i, np.float32)} for i in range(24)]
    results = [r async for r in shared_rt.map(g, inputs, max_in_flight=4)]
    for i, (_, r) in enumerate(results):
        assert r.shape == (300 + i,)
        np.testing.assert_allclose(r, 3.0 * i + 1.0)


async def test_odd_sizes_and_dtypes_round_trip(shared_rt: hetero.Runtime) -> None:
    def ident(gpu: hetero.GPUContext, t: Tensor) -> Tensor:
        return t

    g = hetero.Graph("rt")
    g.output(g.gpu(ident, g.input("x")))
    for arr in (np.arange(7, dtype=np.uint8), np.arange(3, dtype=np.float16), np.zeros((0, 3), np.float32),
                np.arange(6, dtype=np.int32).reshape(2, 3), np.float32(5.0) * np.ones((1, 1, 1), np.float32)):
        out = await shared_rt.run(g, x=arr)
        assert out.dtype == arr.dtype and out.shape == arr.shape
        np.testing.assert_array_equal(out, arr)


async def test_tensor_properties(shared_rt: hetero.Runtime) -> None:
    seen = {}

    def look(gpu: hetero.GPUContext, t: Tensor) -> int:
        e = gpu.empty((3, 5), np.int32)
        seen.update(shape=t.shape, dtype=t.dtype.name, nbytes=t.nbytes, e=(e.shape, e.nbytes, e.ndim))
        return 0

    g = hetero.Graph("props")
    g.output(g.gpu(look, g.input("x")))
    await shared_rt.run(g, x=np.zeros((4, 6), np.float32))
    assert seen == {"shape": (4, 6), "dtype": "float32", "nbytes": 96, "e": ((3, 5), 60, 2)}


async def test_bad_wgsl_is_a_stage_error_and_runtime_survives(shared_rt: hetero.Runtime) -> None:
    def bad(gpu: hetero.GPUContext, t: Tensor) -> Tensor:
        gpu.dispatch("fn main( {", 1, t)
        return t

    g = hetero.Graph("badwgsl")
    g.output(g.gpu(bad, g.input("x"), name="broken"))
    with pytest.raises(StageError) as e:
        await shared_rt.run(g, x=np.ones(4, np.float32))
    assert str(e.value).startswith("gpu stage 'broken' failed: GPUValidationError")
    assert "parsing error" in str(e.value)
    await test_cpu_gpu_cpu_saxpy_matches_numpy(shared_rt)


async def test_wrong_binding_count(shared_rt: hetero.Runtime) -> None:
    def wrong(gpu: hetero.GPUContext, t: Tensor) -> Tensor:
        gpu.dispatch(SCALE, 1, t)
        return t

    g = hetero.Graph("bindings")
    g.output(g.gpu(wrong, g.input("x"), name="wrong"))
    with pytest.raises(StageError) as e:
        await shared_rt.run(g, x=np.ones(4, np.float32))
    assert str(e.value) == (
        "gpu stage 'wrong' failed: ValueError: kernel 'main' declares 2 binding(s) in @group(0), dispatch got 1"
    )


async def test_wrong_binding_type(shared_rt: hetero.Runtime) -> None:
    def wrong(gpu: hetero.GPUContext, t: Tensor) -> Tensor:
        gpu.dispatch(SCALE, 1, t, "not a buffer")
        return t

    g = hetero.Graph("btype")
    g.output(g.gpu(wrong, g.input("x"), name="wrong"))
    with pytest.raises(StageError) as e:
        await shared_rt.run(g, x=np.ones(4, np.float32))
    assert str(e.value) == ("gpu stage 'wrong' failed: TypeError: kernel 'main' binding 1 (dst): expected a Tensor "
                            "(storage) or a numpy array/bytes (uniform), got str")


async def test_workgroups_over_the_limit(shared_rt: hetero.Runtime) -> None:
    def huge(gpu: hetero.GPUContext, t: Tensor) -> Tensor:
        out = gpu.empty(t.shape)
        gpu.dispatch(SCALE, 10**6, t, out)
        return out

    g = hetero.Graph("huge")
    g.output(g.gpu(huge, g.input("x"), name="huge"))
    with pytest.raises(StageError, match=r"1000000 workgroups in x exceed the adapter's limit of \d+ per dimension"):
        await shared_rt.run(g, x=np.ones(4, np.float32))


async def test_kernels_compile_once_per_device(shared_rt: hetero.Runtime) -> None:
    kernels = []

    def twice(gpu: hetero.GPUContext, t: Tensor) -> int:
        kernels.append(gpu.kernel(SCALE))
        return 0

    g = hetero.Graph("cache")
    g.output(g.gpu(twice, g.input("x")))
    await shared_rt.run(g, x=np.ones(1, np.float32))
    await shared_rt.run(g, x=np.ones(1, np.float32))
    assert kernels[0] is kernels[1]


async def test_one_source_under_two_labels_shares_its_pipeline(shared_rt: hetero.Runtime) -> None:
    """Kernels that share a WGSL source keep the label each was asked for (traces name them apart)."""
    kernels = []

    def labelled(gpu: hetero.GPUContext, t: Tensor) -> int:
        kernels.extend([gpu.kernel(SCALE, label="first"), gpu.kernel(SCALE, label="second"),
                        gpu.kernel(SCALE, label="first"), gpu.kernel(SCALE)])
        return 0

    g = hetero.Graph("labels")
    g.output(g.gpu(labelled, g.input("x")))
    await shared_rt.run(g, x=np.ones(1, np.float32))
    first, second, again, plain = kernels
    assert (first.label, second.label, again.label) == ("first", "second", "first")
    assert first.pipeline is second.pipeline is plain.pipeline and first.key == second.key
    assert again is first


def test_adapter_selection_by_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from hetero._gpu.device import select_adapter

    first = hetero._gpu.device.list_adapters()[0]
    backend = first.info["backend_type"]
    monkeypatch.setenv("HETERO_ADAPTER", backend.upper())
    assert backend in select_adapter().summary
    monkeypatch.setenv("HETERO_ADAPTER", "no-such-gpu-xyz")
    with pytest.raises(hetero.NoAdapterError, match="no adapter matches HETERO_ADAPTER='no-such-gpu-xyz'; available: "):
        select_adapter()


def test_adapter_selection_by_index(monkeypatch: pytest.MonkeyPatch) -> None:
    import anyio

    from hetero._gpu.device import adapter_index, adapter_labels, list_adapters, select_adapter

    adapters = list_adapters()
    labels = adapter_labels(adapters)
    assert len(set(labels)) == len(adapters)
    for i, label in enumerate(labels):  # each printed selector picks its own adapter
        assert adapter_index(adapters, label) == i
        assert adapter_index(adapters, label.upper()) == i
    assert adapter_index(adapters, len(adapters) - 1) == len(adapters) - 1
    assert adapter_index(adapters, f"#{len(adapters) - 1}") == len(adapters) - 1
    assert adapter_index(adapters, None) is None
    backend = adapters[0].info["backend_type"].lower()
    monkeypatch.setenv("HETERO_ADAPTER", f"{backend}#0")
    assert select_adapter().summary == adapters[0].summary
    n = sum(1 for a in adapters if backend in a.summary.lower())
    with pytest.raises(hetero.NoAdapterError, match=rf"^HETERO_ADAPTER='{backend}#{n}' asks for adapter #{n} of the "
                       rf"{n} that match; available: {labels[0]}: "):
        select_adapter(f"{backend}#{n}")
    with pytest.raises(hetero.NoAdapterError, match=r"the part after '#' must be an index \(0, 1, ...\), got 'x'"):
        select_adapter(f"{backend}#x")
    rt = hetero.Runtime(adapter=f"{backend}#0", cpu_threads=1)
    try:
        g = hetero.Graph("pinned")
        g.output(g.gpu(lambda gpu, x: x, g.input("x"), name="same"))
        assert anyio.run(lambda: rt.run(g, x=np.ones(2, np.float32))).tolist() == [1.0, 1.0]
        assert rt.device().summary["summary"] == adapters[0].summary
    finally:
        rt.close()


# Threads that look adapters up (and collect garbage) at once. Each lookup used to
# enumerate afresh and drop the previous adapters; an OpenGL adapter's release racing
# with another thread's enumeration aborted the process inside wgpu-native.
ADAPTER_LOOKUPS = """
import threading
from hetero._gpu import device as _device

def look():
    for _ in range(25):
        adapters = _device.list_adapters()
        _device.select_adapter(_device.adapter_labels(adapters)[-1])
        _device.select_adapter()
        del adapters

threads = [threading.Thread(target=look) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("looked up", len(_device.list_adapters()))
"""


def test_adapter_lookups_from_many_threads_never_abort() -> None:
    import subprocess
    import sys

    from hetero._gpu.device import list_adapters, select_adapter

    done = subprocess.run([sys.executable, "-c", ADAPTER_LOOKUPS], capture_output=True, text=True, timeout=300)
    why = [line for line in done.stderr.splitlines() if "panicked at" in line or "Fatal Python error" in line]
    assert (done.returncode, done.stdout) == (0, f"looked up {len(list_adapters())}\n"), why or done.stderr[-2000:]
    # One enumeration per process: every lookup hands out the same adapter objects.
    assert [a is b for a, b in zip(list_adapters(), list_adapters())] == [True] * len(list_adapters())
    assert select_adapter() is select_adapter()


async def test_zero_size_results_arrive_as_empty_arrays(shared_rt: hetero.Runtime) -> None:
    def empty(gpu: hetero.GPUContext) -> Tensor:
        return gpu.empty((0, 3), np.float32)

    g = hetero.Graph("empty_out")
    e = g.gpu(empty)
    g.output(e, g.cpu(lambda a: a.shape, e, name="shape"))
    out, shape = await shared_rt.run(g)
    assert isinstance(out, np.ndarray) and out.shape == (0, 3) and out.dtype == np.float32
    assert shape == (0, 3)


async def test_empty_refuses_sizes_past_the_limits(shared_rt: hetero.Runtime) -> None:
    """Sizes are computed in Python ints: a shape whose bytes overflow 64 bits is refused, not wrapped."""
    shapes: dict[str, tuple] = {
        "overflow": ((1 << 32, 1 << 32), np.float32),
        "wraps_to_small": ((1 << 62, 4), np.uint8),
        "too_big": ((1 << 31,), np.float32),
        "negative": ((3, -1), np.float32),
        "fractional": ((2.5,), np.float32),
        "objects": ((4,), object),
        "scalar_float": (2.5, np.float32),
    }

    def alloc(gpu: hetero.GPUContext, which: str) -> Tensor:
        shape, dtype = shapes[which]
        return gpu.empty(shape, dtype)

    limit = shared_rt.device().limits["max-buffer-size"]
    want = {
        "overflow": "ValueError: gpu.empty: shape (4294967296, 4294967296) of float32 is 73786976294838206464 bytes, "
                    f"more than the adapter's max-buffer-size of {limit} bytes; split the work into smaller tensors",
        "wraps_to_small": "ValueError: gpu.empty: shape (4611686018427387904, 4) of uint8 is 18446744073709551616 "
                          f"bytes, more than the adapter's max-buffer-size of {limit} bytes; split the work into "
                          "smaller tensors",
        "too_big": "ValueError: gpu.empty: shape (2147483648,) of float32 is 8589934592 bytes, more than the "
                   f"adapter's max-buffer-size of {limit} bytes; split the work into smaller tensors",
        "negative": "ValueError: gpu.empty: shape (3, -1) has a negative dimension",
        "fractional": "TypeError: gpu.empty: shape (2.5,) must hold ints, got float 2.5",
        "objects": "TypeError: gpu.empty: dtype object holds Python objects, which cannot live on the GPU",
        "scalar_float": "TypeError: gpu.empty: shape must be an int or a tuple of ints, got float 2.5",
    }
    for which, tail in want.items():
        g = hetero.Graph(f"alloc_{which}")
        g.output(g.gpu(alloc, which, name=which))
        with pytest.raises(StageError) as e:
            await shared_rt.run(g)
        assert e.value.stage == which
        assert str(e.value) == f"gpu stage {which!r} failed: {tail}"
    assert shared_rt.memory_stats().in_use_bytes == 0


async def test_resident_refuses_arrays_past_max_buffer_size() -> None:
    """``gpu.resident`` makes its own buffer: the same limit holds (here lowered to 1 KiB)."""
    def weights(gpu: hetero.GPUContext, n: int) -> Tensor:
        return gpu.resident(np.ones(n, np.float32))

    g = hetero.Graph("resident")
    g.output(g.gpu(weights, g.input("n"), name="weights"))
    async with hetero.Runtime() as rt:
        dev = await anyio.to_thread.run_sync(rt.device)
        dev.limits["max-buffer-size"] = 1024
        with pytest.raises(StageError) as e:
            await rt.run(g, n=257)
        assert str(e.value) == (
            "gpu stage 'weights' failed: ValueError: gpu.resident: shape (257,) of float32 is 1028 bytes, more than "
            "the adapter's max-buffer-size of 1024 bytes; split the work into smaller tensors"
        )
        np.testing.assert_array_equal(await rt.run(g, n=256), np.ones(256))
