"""The public surface: ``__all__`` matches what the package exports, both ways."""

from __future__ import annotations

import hetero
import hetero.errors


def test_all_lists_every_public_name_and_only_those() -> None:
    assert hetero.Graph  # the public names load on first use
    public = {n for n in vars(hetero) if not n.startswith("_") and not _is_module(getattr(hetero, n))}
    public.discard("annotations")
    assert sorted(hetero.__all__) == hetero.__all__
    assert set(hetero.__all__) == public


def test_errors_module_exports_the_tree() -> None:
    assert sorted(hetero.errors.__all__) == hetero.errors.__all__
    for name in hetero.errors.__all__:
        cls = getattr(hetero.errors, name)
        assert issubclass(cls, hetero.HeteroError)
        assert getattr(hetero, name) is cls
    assert issubclass(hetero.StageError, hetero.HeteroError)


def test_kernels_and_pipelines_ship_as_subpackages() -> None:
    import hetero.kernels
    import hetero.pipelines

    assert hetero.kernels.__doc__ and hetero.pipelines.__doc__


def _is_module(obj: object) -> bool:
    import types

    return isinstance(obj, types.ModuleType)


def test_ops_namespace_lists_its_ops() -> None:
    import hetero.ops

    assert sorted(hetero.ops.__all__) == hetero.ops.__all__
    for name in hetero.ops.__all__:
        if name != "cpu":
            assert callable(getattr(hetero.ops, name))
    # hetero.ops.cpu: the numpy implementations, one per GPU op but the INT8 ones.
    cpu = hetero.ops.cpu
    assert sorted(cpu.__all__) == cpu.__all__
    assert set(cpu.__all__) == set(hetero.ops.__all__) - {"cpu", "matmul_int8", "quantize_weight"}
    assert all(callable(getattr(cpu, name)) for name in cpu.__all__)


def test_dask_namespace_lists_its_names() -> None:
    import pytest

    pytest.importorskip("distributed")
    import hetero.dask

    assert sorted(hetero.dask.__all__) == hetero.dask.__all__
    public = {n for n in vars(hetero.dask) if not n.startswith("_") and not _is_module(getattr(hetero.dask, n))}
    public.discard("annotations")
    assert set(hetero.dask.__all__) == public
    assert issubclass(hetero.dask.ClusterError, hetero.HeteroError)


def test_import_hetero_and_the_cli_entry_stay_light() -> None:
    """The command line's entry module imports neither numpy nor wgpu: Ctrl-C during those
    imports lands in its handler (``hetero: interrupted``), not in a traceback."""
    import subprocess
    import sys

    code = "import sys, hetero._cli; print(sorted({'numpy', 'wgpu'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (0, "[]\n", "")
