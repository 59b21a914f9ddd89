"""Cooperative matrices (tensor cores) through wgpu: offered, requestable, right, and how fast.

``python -m bench tensor_cores [--ms 50]``. wgpu-native lists the ``cooperative-matrix`` feature
where the Vulkan driver has VK_KHR_cooperative_matrix in a configuration wgpu accepts; WGSL then
reaches it with ``enable wgpu_cooperative_matrix;`` (``coop_mat16x16<f16, A>``, ``coopLoad``,
``coopMultiplyAdd``, ``coopStore``). For each fragment shape this says, one JSON line each:

- whether the adapter offers the feature and a device with it can be made (the error if not);
- whether a kernel of that shape compiles, and whether one product of two fragments equals numpy's
  (and in which layout ``coopLoad`` reads: row-major or transposed);
- its rate: a subgroup's loop of products on four accumulators, TFLOP/s, beside a loop of fp32
  FMAs on the same adapter in the same run (the rate the decoder's GEMMs work against).

Where the adapter offers another of wgpu's experimental features (``ray-query``: lavapipe from Mesa
24 has it), a device asking for it says whether this wgpu-native lets experimental features be
enabled at all; cooperative matrices are one of them.

Nothing here is used by hetero's kernels yet: it decides whether a tensor-core GEMM is worth
writing for prefill and many streams.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np

from bench._common import emitter

emit = emitter("tensor_cores")

# (name, WGSL scalar of A and B, of C, fragment side, numpy dtype of A and B)
SHAPES = (("16x16x16 f16->f32", "f16", "f32", 16, np.float16),
          ("8x8x8 f32", "f32", "f32", 8, np.float32))
EXPERIMENTAL = ("cooperative-matrix", "ray-query")  # wgpu-native's features behind wgpu's experimental gate
SUBGROUP = 32  # a fragment's scope is a subgroup: a workgroup of one subgroup (NVIDIA's 32)
ACCUMULATORS = 4  # independent accumulators a subgroup's loop keeps (latency hidden behind each other)


def _header(ab: str) -> str:
    return ("enable f16;\n" if ab == "f16" else "") + "enable wgpu_cooperative_matrix;\n"


def product_source(ab: str, c: str, n: int) -> str:
    """One product C = A B of two n x n fragments loaded from storage, stored row-major."""
    return _header(ab) + f"""
@group(0) @binding(0) var<storage, read> a: array<{ab}>;
@group(0) @binding(1) var<storage, read> b: array<{ab}>;
@group(0) @binding(2) var<storage, read_write> out: array<{c}>;
@compute @workgroup_size({SUBGROUP})
fn main() {{
    let ma = coopLoad<coop_mat{n}x{n}<{ab}, A>>(&a[0], {n}u);
    let mb = coopLoad<coop_mat{n}x{n}<{ab}, B>>(&b[0], {n}u);
    var mc = coop_mat{n}x{n}<{c}, C>();
    mc = coopMultiplyAdd(ma, mb, mc);
    coopStore(mc, &out[0], {n}u);
}}
"""


def rate_source(ab: str, c: str, n: int) -> str:
    """A subgroup's loop of ``p.iters`` x ACCUMULATORS products, its accumulators stored at the end."""
    accs = range(ACCUMULATORS)
    decl = "\n".join(f"    var c{i} = coop_mat{n}x{n}<{c}, C>();" for i in accs)
    step = "\n".join(f"        c{i} = coopMultiplyAdd(ma, mb, c{i});" for i in accs)
    store = "\n".join(f"    coopStore(c{i}, &out[base + {i * n * n}u], {n}u);" for i in accs)
    return _header(ab) + f"""
struct P {{ iters: u32, pad0: u32, pad1: u32, pad2: u32 }}
@group(0) @binding(0) var<storage, read> a: array<{ab}>;
@group(0) @binding(1) var<storage, read_write> out: array<{c}>;
@group(0) @binding(2) var<uniform> p: P;
@compute @workgroup_size({SUBGROUP})
fn main(@builtin(workgroup_id) wid: vec3<u32>) {{
    let ma = coopLoad<coop_mat{n}x{n}<{ab}, A>>(&a[0], {n}u);
    let mb = coopLoad<coop_mat{n}x{n}<{ab}, B>>(&a[{n * n}u], {n}u);
{decl}
    for (var i = 0u; i < p.iters; i++) {{
{step}
    }}
    let base = wid.x * {ACCUMULATORS * n * n}u;
{store}
}}
"""


FMA_SOURCE = """
struct P { iters: u32, pad0: u32, pad1: u32, pad2: u32 }
@group(0) @binding(0) var<storage, read> a: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read_write> out: array<vec4<f32>>;
@group(0) @binding(2) var<uniform> p: P;
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let x = a[0];
    let y = a[1];
    var c0 = a[2]; var c1 = a[3]; var c2 = a[4]; var c3 = a[5];
    var c4 = a[6]; var c5 = a[7]; var c6 = a[8]; var c7 = a[9];
    for (var i = 0u; i < p.iters; i++) {
        c0 = fma(c0, x, y); c1 = fma(c1, x, y); c2 = fma(c2, x, y); c3 = fma(c3, x, y);
        c4 = fma(c4, x, y); c5 = fma(c5, x, y); c6 = fma(c6, x, y); c7 = fma(c7, x, y);
    }
    out[gid.x] = c0 + c1 + c2 + c3 + c4 + c5 + c6 + c7;
}
"""
FMA_FLOPS_A_THREAD_ITER = 8 * 4 * 2  # 8 vec4 FMAs


def _buffer(device: Any, data: np.ndarray | None, nbytes: int = 0, read: bool = False) -> Any:
    import wgpu

    usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_DST | wgpu.BufferUsage.COPY_SRC
    if data is not None:
        buf = device.create_buffer(size=max(16, data.nbytes), usage=usage)
        device.queue.write_buffer(buf, 0, np.ascontiguousarray(data).tobytes())
        return buf
    return device.create_buffer(size=max(16, nbytes), usage=usage)


def _run(device: Any, module: Any, buffers: list[Any], groups: int, uniform: bytes | None = None) -> None:
    import wgpu

    pipeline = device.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": "main"})
    entries = [{"binding": i, "resource": {"buffer": b}} for i, b in enumerate(buffers)]
    if uniform is not None:
        ub = device.create_buffer(size=16, usage=wgpu.BufferUsage.UNIFORM | wgpu.BufferUsage.COPY_DST)
        device.queue.write_buffer(ub, 0, uniform)
        entries.append({"binding": len(buffers), "resource": {"buffer": ub}})
    bind = device.create_bind_group(layout=pipeline.get_bind_group_layout(0), entries=entries)
    enc = device.create_command_encoder()
    cp = enc.begin_compute_pass()
    cp.set_pipeline(pipeline)
    cp.set_bind_group(0, bind)
    cp.dispatch_workgroups(groups)
    cp.end()
    device.queue.submit([enc.finish()])


def _timed(device: Any, module: Any, buffers: list[Any], groups: int, iters: int, sync: Any) -> float:
    """Seconds one dispatch of ``iters`` iterations takes, waited for by reading ``sync`` back."""
    t0 = time.perf_counter()
    _run(device, module, buffers, groups, np.array([iters, 0, 0, 0], np.uint32).tobytes())
    device.queue.read_buffer(sync, 0, 16)
    return time.perf_counter() - t0


def _calibrated(device: Any, module: Any, buffers: list[Any], groups: int, target_s: float) -> tuple[int, float]:
    """(iterations, seconds): the loop grown until one dispatch takes about ``target_s``, best of 3."""
    iters = 256
    _timed(device, module, buffers, groups, iters, buffers[1])  # compile and warm
    while True:
        dt = _timed(device, module, buffers, groups, iters, buffers[1])
        if dt >= target_s / 4 or iters >= 1 << 24:
            break
        iters *= 4
    iters = max(1, int(iters * target_s / max(dt, 1e-6)))
    best = min(_timed(device, module, buffers, groups, iters, buffers[1]) for _ in range(3))
    return iters, best


def fma_rate(device: Any, groups: int, target_s: float) -> float:
    """fp32 TFLOP/s of :data:`FMA_SOURCE` over ``groups`` workgroups of 256 threads."""
    module = device.create_shader_module(code=FMA_SOURCE)
    a = _buffer(device, np.full(64, 0.5, np.float32))
    out = _buffer(device, None, groups * 256 * 16)
    iters, dt = _calibrated(device, module, [a, out], groups, target_s)
    return groups * 256 * iters * FMA_FLOPS_A_THREAD_ITER / dt / 1e12


def probe_shape(device: Any, name: str, ab: str, c: str, n: int, dtype: Any, groups: int,
                target_s: float) -> dict[str, Any]:
    """Compile, check and time one fragment shape; what went wrong, where it did."""
    out: dict[str, Any] = {"shape": name}
    try:
        module = device.create_shader_module(code=product_source(ab, c, n))
    except Exception as e:  # the WGSL front end or the adapter refused the shape
        return {**out, "compiled": False, "error": str(e).strip()[:600]}
    rng = np.random.default_rng(0)
    a = rng.integers(-4, 5, (n, n)).astype(dtype)  # small integers: every product exact in f16
    b = rng.integers(-4, 5, (n, n)).astype(dtype)
    bufs = [_buffer(device, a), _buffer(device, b), _buffer(device, None, n * n * 4)]
    try:
        _run(device, module, bufs, 1)
        got = np.frombuffer(device.queue.read_buffer(bufs[2], 0, n * n * 4), np.float32).reshape(n, n)
    except Exception as e:
        return {**out, "compiled": True, "ran": False, "error": str(e).strip()[:600]}
    af, bf = a.astype(np.float64), b.astype(np.float64)
    layouts = {"row-major": af @ bf, "transposed": (af.T @ bf.T).T, "a-transposed": af.T @ bf, "b-transposed": af @ bf.T}
    match = [k for k, want in layouts.items() if np.array_equal(got.astype(np.float64), want)]
    out.update(compiled=True, ran=True, layout=match[0] if match else None,
               max_error=float(np.abs(got - layouts["row-major"]).max()))
    if not match:
        return out
    try:
        rmod = device.create_shader_module(code=rate_source(ab, c, n))
        src = _buffer(device, np.full(2 * n * n, 0.0078125, dtype))
        sink = _buffer(device, None, groups * ACCUMULATORS * n * n * 4)
        iters, dt = _calibrated(device, rmod, [src, sink], groups, target_s)
        out["tflops"] = round(groups * iters * ACCUMULATORS * 2 * n ** 3 / dt / 1e12, 2)
    except Exception as e:
        out["rate_error"] = str(e).strip()[:600]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench tensor_cores", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", type=float, default=50.0, help="GPU time a timed dispatch aims at (default 50)")
    ap.add_argument("--groups", type=int, default=2048, help="workgroups of a timed dispatch (default 2048)")
    a = ap.parse_args(argv)
    if a.ms <= 0 or a.groups < 1:
        ap.error("--ms must be > 0 and --groups >= 1")
    import hetero
    from hetero.lowlevel import device_of

    from bench._common import adapter_fields

    rt = hetero.Runtime()  # the adapter hetero would pick (HETERO_ADAPTER and all); its own device is not used
    dev = device_of(rt)
    adapter = dev.adapter
    offered = "cooperative-matrix" in adapter.features
    emit(**adapter_fields(dev), offered=offered, shader_f16="shader-f16" in adapter.features)
    try:
        return _probe(adapter, offered, a)
    finally:
        rt.close()


def _probe(adapter: Any, offered: bool, a: argparse.Namespace) -> int:
    target = a.ms / 1e3
    plain = adapter.request_device_sync(label="fma")
    emit(measure="fp32 FMA loop", tflops=round(fma_rate(plain, a.groups, target), 2))
    for feature in (f for f in EXPERIMENTAL if f in adapter.features and f != "cooperative-matrix"):
        try:
            adapter.request_device_sync(label=feature, required_features=[feature])
            emit(experimental_feature=feature, device=True)
        except Exception as e:  # "experimental features are not enabled": the gate is shut in this build
            emit(experimental_feature=feature, device=False, error=" ".join(str(e).split())[:400])
    if not offered:
        emit(verdict="the adapter does not offer cooperative-matrix: no tensor cores through wgpu here")
        return 0
    features = ["cooperative-matrix"] + (["shader-f16"] if "shader-f16" in adapter.features else [])
    try:
        device = adapter.request_device_sync(label="coop", required_features=features)
    except Exception as e:
        emit(device=False, error=str(e).strip()[:600],
             verdict="offered, but no device with it can be made through this wgpu-native")
        return 0
    emit(device=True, features=features)
    for name, ab, c, n, dtype in SHAPES:
        if ab == "f16" and "shader-f16" not in features:
            emit(shape=name, skipped="no shader-f16")
            continue
        emit(**probe_shape(device, name, ab, c, n, dtype, a.groups, target))
    return 0


if __name__ == "__main__":
    sys.exit(main())
