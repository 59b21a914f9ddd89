from __future__ import annotations

import os
import tempfile

import pytest

# The Vulkan loader wants a runtime dir even for headless compute.
os.environ.setdefault("XDG_RUNTIME_DIR", tempfile.mkdtemp(prefix="hetero-test-xdg-"))

import hetero  # noqa: E402


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="session")
def shared_rt():
    """One runtime (and so one GPU device) for the GPU tests; device creation is slow on lavapipe.

    Stages with a CPU and a GPU implementation run on the GPU here (placement="gpu"): these
    tests exercise the GPU paths, and compare results bit for bit across runs.
    """
    rt = hetero.Runtime(cpu_threads=2, placement="gpu")
    yield rt
    rt.close()


@pytest.fixture
def rt():
    rt = hetero.Runtime(cpu_threads=2)
    yield rt
    rt.close()
