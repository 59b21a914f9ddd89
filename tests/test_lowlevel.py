"""``hetero.lowlevel``, the extension API: its names, and the per-device key kernels cache by."""

from __future__ import annotations

import weakref
from typing import Any

import pytest

import hetero
import hetero.lowlevel as ll

pytestmark = pytest.mark.anyio
ASYNCIO_ONLY = pytest.mark.parametrize("anyio_backend", ["asyncio"])


def test_every_name_is_listed_sorted_and_documented() -> None:
    assert sorted(ll.__all__) == ll.__all__
    for name in ll.__all__:
        obj = getattr(ll, name)
        assert obj.__doc__ and obj.__doc__.strip(), f"hetero.lowlevel.{name} has no docstring"
    for name in ("GPUContext", "Kernel", "Tensor", "DispatchInfo"):
        assert getattr(ll, name) is getattr(hetero, name)
    assert hetero.lowlevel is ll


@ASYNCIO_ONLY
async def test_device_of_gives_one_weakly_referenceable_key_per_device(shared_rt: hetero.Runtime) -> None:
    seen: list[Any] = []

    def record(gpu: ll.GPUContext) -> int:
        seen.append(ll.device_of(gpu))
        return 1

    g = hetero.Graph("device-of")
    g.output(g.gpu(record))
    assert await shared_rt.run(g) == 1
    dev = shared_rt.device()
    assert seen == [dev]
    assert ll.device_of(shared_rt) is dev and ll.device_of(dev) is dev
    cache: weakref.WeakKeyDictionary[ll.Device, str] = weakref.WeakKeyDictionary()
    cache[ll.device_of(shared_rt)] = "weights"
    assert cache[dev] == "weights"
    with pytest.raises(TypeError, match="device_of: expected a GPUContext, Runtime or Device, got int"):
        ll.device_of(3)


def test_default_runtime_is_the_one_hetero_run_uses() -> None:
    rt = ll.default_runtime()
    assert isinstance(rt, hetero.Runtime)
    assert ll.default_runtime() is rt
    g = hetero.Graph("default")
    g.output(g.cpu(seven))
    assert hetero.run(g) == 7
    assert ll.default_runtime() is rt


def seven() -> int:
    return 7


def test_positive_int_is_the_one_count_type_of_every_command() -> None:
    import argparse

    from hetero.pipelines import embed_cli

    assert ll.positive_int("3") == 3
    for bad, shown in (("0", "0"), ("-2", "-2"), ("x", "'x'")):
        with pytest.raises(argparse.ArgumentTypeError, match=f"expected an integer >= 1, got {shown}"):
            ll.positive_int(bad)
    assert embed_cli.positive_int is ll.positive_int
