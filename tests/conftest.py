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
    """One runtime (and so one GPU device) for the GPU tests; device creation is slow on lavapipe."""
    rt = hetero.Runtime(cpu_threads=2)
    yield rt
    rt.close()


@pytest.fixture
def rt():
    rt = hetero.Runtime(cpu_threads=2)
    yield rt
    rt.close()
