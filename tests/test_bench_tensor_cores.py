"""bench tensor_cores on the adapter at hand: the lines it prints, and the refusal of a shape."""

from __future__ import annotations

import json

import pytest

from bench import tensor_cores


def test_the_probe_reports_the_adapter_and_an_fma_rate(capsys: pytest.CaptureFixture[str]) -> None:
    assert tensor_cores.main(["--ms", "2", "--groups", "4"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    first = lines[0]
    assert first["bench"] == "tensor_cores" and isinstance(first["offered"], bool) and "adapter" in first
    fma = next(x for x in lines if x.get("measure") == "fp32 FMA loop")
    assert isinstance(fma["tflops"], float) and fma["tflops"] >= 0
    if not first["offered"]:
        assert "does not offer" in lines[-1]["verdict"]
    else:  # a shape line each, or why no device could be made
        assert any("shape" in x for x in lines) or any(x.get("device") is False for x in lines)


def test_a_shape_the_device_lacks_is_reported_not_raised() -> None:
    """Without the feature (a device made without it), the WGSL front end refuses the extension: the
    shape's line says so."""
    import wgpu

    device = wgpu.gpu.request_adapter_sync().request_device_sync(label="plain")
    got = tensor_cores.probe_shape(device, "8x8x8 f32", "f32", "f32", 8, "float32", 4, 0.001)
    assert got["shape"] == "8x8x8 f32" and got["compiled"] is False
    assert "wgpu_cooperative_matrix" in got["error"]


def test_the_sources_declare_what_they_use() -> None:
    src = tensor_cores.rate_source("f16", "f32", 16)
    assert src.startswith("enable f16;\nenable wgpu_cooperative_matrix;")
    assert src.count("coopMultiplyAdd") == tensor_cores.ACCUMULATORS
    assert "enable f16" not in tensor_cores.product_source("f32", "f32", 8)
