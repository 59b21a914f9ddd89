"""What hetero reads from WGSL (comments out) and the checks it makes before a dispatch is recorded:
the kind of each binding, the dtype a storage binding holds, and the adapter's binding sizes."""

from __future__ import annotations

from typing import Any, Callable

import anyio
import numpy as np
import pytest

import hetero
from hetero import StageError, Tensor

pytestmark = pytest.mark.anyio

# The README's quickstart kernel.
AFFINE = """
@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@group(0) @binding(2) var<uniform> n: u32;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) id: vec3<u32>) {
    if (id.x < n) { y[id.x] = 2.0 * x[id.x] + 1.0; }
}
"""


def affine(gpu: hetero.GPUContext, x: Tensor) -> Tensor:
    y = gpu.empty(x.shape, np.float32)
    gpu.dispatch(AFFINE, -(-x.size // 64), x, y, np.array([x.size], np.uint32))
    return y


def one_stage(fn: Callable[..., Any], name: str, *args: Any) -> hetero.Graph:
    """
    ::

        x -> name (gpu)
    """
    g = hetero.Graph(name)
    g.output(g.gpu(fn, g.input("x"), *args, name=name))
    return g


async def stage_error(rt: hetero.Runtime, g: hetero.Graph, x: Any) -> str:
    with pytest.raises(StageError) as e:
        await rt.run(g, x=x)
    assert rt.memory_stats().in_use_bytes == 0  # nothing of the refused stage is held
    return str(e.value)


# -- dtypes of storage bindings ---------------------------------------------------------------------
async def test_quickstart_without_its_cpu_stage_refuses_float64(shared_rt: hetero.Runtime) -> None:
    """The float64 input reaches an array<f32> binding as it is: refused, naming stage, binding, dtypes."""
    msg = await stage_error(shared_rt, one_stage(affine, "affine"), np.arange(8.0))
    assert msg == (
        "gpu stage 'affine' failed: TypeError: kernel 'main' binding 0 (x: array<f32>): got a float64 Tensor "
        "where the shader reads float32; pass float32 data (e.g. .astype(np.float32) in a CPU stage)"
    )
    # The same graph with float32 data gives the quickstart's answer.
    out = await shared_rt.run(one_stage(affine, "affine"), x=np.arange(8.0, dtype=np.float32))
    np.testing.assert_array_equal(out, 2 * np.arange(8.0) + 1)


IDS = """
@group(0) @binding(0) var<storage, read> ids: array<u32>;
@group(0) @binding(1) var<storage, read_write> out: array<i32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) id: vec3<u32>) {
    if (id.x < arrayLength(&out)) { out[id.x] = i32(ids[id.x]) * 3; }
}
"""


def triple(gpu: hetero.GPUContext, ids: Tensor) -> Tensor:
    out = gpu.empty(ids.shape, np.int32)
    gpu.dispatch(IDS, -(-ids.size // 64), ids, out)
    return out


async def test_int64_where_the_shader_reads_u32_is_refused(shared_rt: hetero.Runtime) -> None:
    msg = await stage_error(shared_rt, one_stage(triple, "triple"), np.arange(5))
    assert msg == (
        "gpu stage 'triple' failed: TypeError: kernel 'main' binding 0 (ids: array<u32>): got an int64 Tensor "
        "where the shader reads uint32; pass uint32 data (e.g. .astype(np.uint32) in a CPU stage)"
    )
    out = await shared_rt.run(one_stage(triple, "triple"), x=np.arange(5, dtype=np.uint32))
    np.testing.assert_array_equal(out, np.arange(5) * 3)


HALF = """
enable f16;
@group(0) @binding(0) var<storage, read> x: array<f16>;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) id: vec3<u32>) {
    if (id.x < arrayLength(&y)) { y[id.x] = f32(x[id.x]) + 0.5; }
}
"""


def widen(gpu: hetero.GPUContext, x: Tensor) -> Tensor:
    y = gpu.empty(x.shape, np.float32)
    gpu.dispatch(HALF, -(-x.size // 64), x, y)
    return y


async def test_float32_where_the_shader_reads_f16_is_refused(shared_rt: hetero.Runtime) -> None:
    if "shader-f16" not in shared_rt.device().features:
        pytest.skip("the adapter has no shader-f16")
    msg = await stage_error(shared_rt, one_stage(widen, "widen"), np.ones(4, np.float32))
    assert msg == (
        "gpu stage 'widen' failed: TypeError: kernel 'main' binding 0 (x: array<f16>): got a float32 Tensor "
        "where the shader reads float16; pass float16 data (e.g. .astype(np.float16) in a CPU stage)"
    )
    out = await shared_rt.run(one_stage(widen, "widen"), x=np.arange(4, dtype=np.float16))
    np.testing.assert_array_equal(out, np.arange(4) + 0.5)


# Words of 32 bits read whatever the host put in them: packed bytes, bit patterns of floats, halves of int64.
WORDS = """
alias Word = u32;
@group(0) @binding(0) var<storage, read> a: array<Word>;
@group(0) @binding(1) var<storage, read> b: array<vec2<u32>>;
@group(0) @binding(2) var<storage, read_write> out: array<u32>;
@compute @workgroup_size(1)
fn main() {
    out[0] = a[0];
    out[1] = b[0].x;
    out[2] = b[0].y;
}
"""


async def test_integer_words_take_packed_and_reinterpreted_data(shared_rt: hetero.Runtime) -> None:
    """u32/i32 arrays hold 4-byte words: any dtype whose items tile a word (or a vec of words) binds."""
    cases = [
        (np.array([1, 2, 3, 4], np.uint8), np.array([5], np.int64)),  # four bytes in a word; an int64 in vec2<u32>
        (np.array([1.0], np.float32), np.array([-1.0], np.float64)),  # float bits, read as words
    ]

    def words(gpu: hetero.GPUContext, pair: tuple[Tensor, Tensor]) -> Tensor:
        out = gpu.empty(3, np.uint32)
        gpu.dispatch(WORDS, 1, pair[0], pair[1], out)
        return out

    g = hetero.Graph("words")
    g.output(g.gpu(words, g.input("x")))
    for a, b in cases:
        want = np.concatenate([a.view(np.uint32), b.view(np.uint32)])
        np.testing.assert_array_equal(await shared_rt.run(g, x=(a, b)), want)
    # An item wider than the element does not fit: an int64 in a u32 word is refused, through the alias too.
    with pytest.raises(StageError) as e:
        await shared_rt.run(g, x=(np.array([7], np.int64), np.array([5], np.int64)))
    assert str(e.value) == (
        "gpu stage 'words' failed: TypeError: kernel 'main' binding 0 (a: array<Word>): got an int64 Tensor "
        "where the shader reads uint32; pass uint32 data (e.g. .astype(np.uint32) in a CPU stage)"
    )


STRUCTS = """
struct Pair { a: f32, b: u32 }
@group(0) @binding(0) var<storage, read_write> pairs: array<Pair>;
@compute @workgroup_size(1)
fn main() { pairs[0].b = pairs[0].b + 1u; }
"""


async def test_struct_bindings_are_not_checked(shared_rt: hetero.Runtime) -> None:
    """A struct's layout is the caller's business: a structured array of the same layout binds."""
    def bump(gpu: hetero.GPUContext, t: Tensor) -> Tensor:
        gpu.dispatch(STRUCTS, 1, t)
        return t

    x = np.array([(1.5, 41)], dtype=[("a", "<f4"), ("b", "<u4")])
    out = await shared_rt.run(one_stage(bump, "bump"), x=x)
    assert out.dtype == x.dtype and out["b"][0] == 42 and out["a"][0] == 1.5


# -- the kind of each binding -------------------------------------------------------------------------
async def test_an_array_where_the_shader_declares_storage(shared_rt: hetero.Runtime) -> None:
    def wrong(gpu: hetero.GPUContext, x: Tensor) -> Tensor:
        gpu.dispatch(AFFINE, 1, x, np.zeros(8, np.float32), np.array([8], np.uint32))
        return x

    msg = await stage_error(shared_rt, one_stage(wrong, "wrong"), np.ones(8, np.float32))
    assert msg == (
        "gpu stage 'wrong' failed: TypeError: kernel 'main' binding 1 (y): got a numpy array (float32, shape (8,)), "
        "which binds as a uniform, where the shader declares var<storage, read_write>; pass a Tensor "
        "(gpu.upload(array) or gpu.empty(...))"
    )


async def test_a_tensor_where_the_shader_declares_a_uniform(shared_rt: hetero.Runtime) -> None:
    def wrong(gpu: hetero.GPUContext, x: Tensor) -> Tensor:
        y = gpu.empty(x.shape, np.float32)
        gpu.dispatch(AFFINE, 1, x, y, gpu.upload(np.array([8], np.uint32)))
        return y

    msg = await stage_error(shared_rt, one_stage(wrong, "wrong"), np.ones(8, np.float32))
    assert msg == (
        "gpu stage 'wrong' failed: TypeError: kernel 'main' binding 2 (n): got a Tensor (uint32, shape (1,)) "
        "where the shader declares var<uniform>; pass a numpy array or bytes for a uniform"
    )


# -- comments -------------------------------------------------------------------------------------------
COMMENTED = """
// A dispatch binds x and y; n used to be a uniform:
// @group(0) @binding(2) var<uniform> n: u32;
/* and once there was a third buffer /* (nested comment) */
   @group(0) @binding(3) var<storage, read> z: array<f32>;
*/
@group(0) @binding(0) var<storage, read> x: array<f32>; // @group(0) @binding(4) var<uniform> m: u32;
@group(0) /* the output */ @binding(1) var<storage, read_write> y: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) id: vec3<u32>) {
    if (id.x < arrayLength(&y)) { y[id.x] = x[id.x] + 1.0; }
}
"""


async def test_bindings_inside_comments_are_not_counted(shared_rt: hetero.Runtime) -> None:
    def inc(gpu: hetero.GPUContext, x: Tensor) -> Tensor:
        y = gpu.empty(x.shape, np.float32)
        gpu.dispatch(COMMENTED, 1, x, y)
        return y

    out = await shared_rt.run(one_stage(inc, "inc"), x=np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal(out, np.arange(4) + 1)


GRID_COMMENTED = """
/* A kernel of hetero's grid helpers (hetero_workgroup_id); it does not declare
   struct HeteroGrid itself. */
enable f16;
@group(0) @binding(0) var<storage, read_write> out: array<u32>;
@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = hetero_workgroup_id(wid).x * 64u + lid.x;
    if (i < arrayLength(&out)) { out[i] = i + u32(f16(1.0)); }
}
"""


async def test_grid_prelude_reads_wgsl_without_comments(shared_rt: hetero.Runtime) -> None:
    """A name in a comment neither adds nor suppresses the prelude, which goes after the directives."""
    if "shader-f16" not in shared_rt.device().features:
        pytest.skip("the adapter has no shader-f16")

    def iota(gpu: hetero.GPUContext, n: int) -> Tensor:
        out = gpu.empty(n, np.uint32)
        assert gpu.kernel(GRID_COMMENTED).grid
        gpu.dispatch(GRID_COMMENTED, -(-n // 64), out)
        return out

    out = await shared_rt.run(one_stage(iota, "iota"), x=200)
    np.testing.assert_array_equal(out, np.arange(200) + 1)


# -- binding sizes past the adapter's limits ------------------------------------------------------------
async def test_a_uniform_past_the_adapter_limit(shared_rt: hetero.Runtime) -> None:
    limit = shared_rt.device().limits["max-uniform-buffer-binding-size"]
    big = np.zeros(limit // 4 + 1, np.uint32)

    def wrong(gpu: hetero.GPUContext, x: Tensor) -> Tensor:
        y = gpu.empty(x.shape, np.float32)
        gpu.dispatch(AFFINE, 1, x, y, big)
        return y

    msg = await stage_error(shared_rt, one_stage(wrong, "wrong"), np.ones(8, np.float32))
    assert msg == (
        f"gpu stage 'wrong' failed: ValueError: kernel 'main' binding 2 (n): a uniform of {big.nbytes} bytes "
        f"exceeds the adapter's max-uniform-buffer-binding-size of {limit} bytes; pass it as a Tensor "
        "and declare var<storage, read>"
    )


async def test_a_storage_tensor_past_the_adapter_limit() -> None:
    """A tensor may be larger than one storage binding can cover (here with the limit lowered to 1 KiB)."""
    async with hetero.Runtime() as rt:
        dev = await anyio.to_thread.run_sync(rt.device)
        dev.limits["max-storage-buffer-binding-size"] = 1024
        msg = await stage_error(rt, one_stage(affine, "affine"), np.ones(300, np.float32))
        assert msg == (
            "gpu stage 'affine' failed: ValueError: kernel 'main' binding 0 (x): a Tensor of 1200 bytes exceeds "
            "the adapter's max-storage-buffer-binding-size of 1024 bytes; split the work into smaller tensors"
        )
        out = await rt.run(one_stage(affine, "affine"), x=np.ones(256, np.float32))
        np.testing.assert_array_equal(out, np.full(256, 3.0))


# -- reading WGSL (no device) ------------------------------------------------------------------------------
def test_strip_comments_keeps_lines_and_nesting() -> None:
    from hetero._gpu.wgsl import strip_comments

    src = "a // b /* c\nd /* e /* f */ g\n h */ i\r\nj /* k */ l // m"
    out = strip_comments(src)
    assert [line.rstrip() for line in out.splitlines()] == ["a", "d", "      i", "j         l"]
    assert len(out) == len(src) and out.index("l") == src.index("l")  # columns stay
    assert strip_comments("x /* never closed\n y").split() == ["x"]
    assert strip_comments("a / b * c") == "a / b * c"  # lone slashes and stars are code


def test_group_bindings_reads_declarations() -> None:
    from hetero._gpu.wgsl import Binding, group_bindings

    src = """
    alias T = f32;
    alias V = vec4<T>;
    struct P { n: u32 }
    @binding(0) @group(0) var<storage> a: array<V>;
    @group(0)
      @binding(1) var<storage,read_write> b : array< array<vec3u, 2> >;
    @group(0) @binding(2) var<uniform> p: P;
    @group(0) @binding(3) var t: texture_2d<f32>;
    @group(0) @binding(4) var<storage, read_write> m: array<mat2x3h>;
    @group(0) @binding(5) var<storage, read_write> c: atomic<i32>;
    @group(0) @binding(6) var<storage, read> s: array<P>;
    @group(1) @binding(0) var<uniform> other: u32;
    // @group(0) @binding(7) var<uniform> gone: u32;
    """
    got = group_bindings(src)
    assert sorted(got) == [0, 1, 2, 3, 4, 5, 6]
    assert got[0] == Binding(0, 0, "a", "storage", "read", "array<V>", "f32", 16)
    assert got[1] == Binding(0, 1, "b", "storage", "read_write", "array< array<vec3u, 2> >", "u32", 16)
    assert got[2] == Binding(0, 2, "p", "uniform", None, "P")
    assert got[3] == Binding(0, 3, "t", "handle", None, "texture_2d<f32>")
    assert (got[4].scalar, got[4].element_bytes) == ("f16", 16)  # two columns of vec3<f16>, each 8-byte aligned
    assert (got[5].scalar, got[5].element_bytes) == ("i32", 4)
    assert (got[6].scalar, got[6].element_bytes) == (None, None)  # a struct: not checked
    assert [b.declared for b in (got[0], got[1], got[2])] == ["var<storage, read>", "var<storage, read_write>",
                                                             "var<uniform>"]
    assert sorted(group_bindings(src, 1)) == [0]


def test_dtype_rule() -> None:
    from hetero._gpu.wgsl import Binding, dtype_mismatch

    def b(scalar: str, size: int) -> Binding:
        return Binding(0, 0, "x", "storage", "read", "t", scalar, size)

    assert dtype_mismatch(b("f32", 4), np.float32) is None
    assert dtype_mismatch(b("f32", 16), np.float32) is None  # vec4<f32>
    for dt in (np.float64, np.float16, np.int32, np.uint32):
        assert dtype_mismatch(b("f32", 4), dt) == "float32"
    assert dtype_mismatch(b("f16", 2), np.float16) is None
    assert dtype_mismatch(b("f16", 2), np.float32) == "float16"
    for dt in (np.uint32, np.int32, np.float32, np.int8, np.uint8, np.float16, np.bool_):
        assert dtype_mismatch(b("u32", 4), dt) is None, dt  # words: packed or reinterpreted
    assert dtype_mismatch(b("u32", 4), np.int64) == "uint32"
    assert dtype_mismatch(b("i32", 4), np.float64) == "int32"
    assert dtype_mismatch(b("u32", 8), np.int64) is None  # vec2<u32>
    assert dtype_mismatch(b("u32", 4), np.dtype([("a", "<f4"), ("b", "<u8")])) is None  # records: the caller's layout


def test_wgpu_usage_errors_are_explained_the_right_way_round() -> None:
    """Where hetero could not read a declaration, wgpu's usage error is turned around correctly."""
    from hetero._gpu.context import _explain_bind_error

    head = "Validation Error\n\nCaused by:\n  In wgpuDeviceCreateBindGroup\n    "
    t = Tensor(None, (8,), np.float32)  # type: ignore[arg-type]  # no buffer needed to describe it
    storage_needed = head + ("Usage flags BufferUsages(UNIFORM) of Buffer with '' label do not contain required "
                             "usage flags BufferUsages(STORAGE)")
    assert _explain_bind_error("k", (t, np.zeros(8, np.float32)), Exception(storage_needed)) == (
        "kernel 'k': a numpy array or bytes (binding 1), which binds as a uniform, was bound where the shader "
        "declares var<storage>; pass a Tensor"
    )
    uniform_needed = head + ("Usage flags BufferUsages(STORAGE) of Buffer with '' label do not contain required "
                             "usage flags BufferUsages(UNIFORM)")
    assert _explain_bind_error("k", (t, np.zeros(8, np.float32)), Exception(uniform_needed)) == (
        "kernel 'k': a Tensor (binding 0) was bound where the shader declares var<uniform>; pass a numpy array or "
        "bytes for uniform bindings"
    )


async def test_a_uniform_array_of_the_wrong_dtype(shared_rt: hetero.Runtime) -> None:
    """``np.array([2.0])`` for a ``var<uniform> k: f32`` would be read as the low half of a double."""
    scale = """
    @group(0) @binding(0) var<storage, read_write> y: array<f32>;
    @group(0) @binding(1) var<uniform> k: f32;
    @compute @workgroup_size(64)
    fn main(@builtin(global_invocation_id) id: vec3<u32>) { if (id.x < arrayLength(&y)) { y[id.x] *= k; } }
    """

    ks: dict[str, Any] = {"float64": np.array([2.0]), "float32": np.array([2.0], np.float32),
                          "scalar": np.float32(2.0), "bytes": np.float32(2.0).tobytes()}

    def scaled(gpu: hetero.GPUContext, y: Tensor, which: str) -> Tensor:
        gpu.dispatch(scale, 1, y, ks[which])  # made here: an array reaching a GPU stage would be uploaded
        return y

    g = hetero.Graph("scaled")
    g.output(g.gpu(scaled, g.input("x"), g.input("k"), name="scaled"))
    with pytest.raises(StageError) as e:
        await shared_rt.run(g, x=np.ones(4, np.float32), k="float64")
    assert str(e.value) == (
        "gpu stage 'scaled' failed: TypeError: kernel 'main' binding 1 (k: f32): got a float64 array where the "
        "shader reads float32; pass float32 data (e.g. np.array([...], np.float32))"
    )
    assert shared_rt.memory_stats().in_use_bytes == 0
    for which in ("float32", "scalar", "bytes"):
        np.testing.assert_array_equal(await shared_rt.run(g, x=np.ones(4, np.float32), k=which), np.full(4, 2.0))


async def test_a_buffer_where_the_shader_declares_a_texture(shared_rt: hetero.Runtime) -> None:
    textured = """
    @group(0) @binding(0) var<storage, read_write> y: array<f32>;
    @group(0) @binding(1) var t: texture_2d<f32>;
    @compute @workgroup_size(1)
    fn main() { y[0] = textureLoad(t, vec2<i32>(0, 0), 0).x; }
    """

    def wrong(gpu: hetero.GPUContext, y: Tensor) -> Tensor:
        gpu.dispatch(textured, 1, y, y)
        return y

    msg = await stage_error(shared_rt, one_stage(wrong, "wrong"), np.ones(4, np.float32))
    assert msg == (
        "gpu stage 'wrong' failed: TypeError: kernel 'main' binding 1 (t): got a Tensor (float32, shape (4,)) where "
        "the shader declares a texture_2d<f32> (not a buffer); hetero binds buffers only: bind textures and "
        "samplers through gpu.device and gpu.encoder"
    )
