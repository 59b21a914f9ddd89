"""Closing a runtime: nothing reaches the GPU queue once its device is torn down.

A submission naming a destroyed buffer aborts the process inside wgpu-native, so a
thread still recording when the runtime closes must be refused, not submitted.
"""

from __future__ import annotations

import pytest
import wgpu

import hetero
from hetero.errors import RuntimeClosedError

CLOSED = "the GPU device of this Runtime is closed: nothing more can be submitted; create a new Runtime"


def test_a_submission_after_close_is_refused_not_an_abort() -> None:
    rt = hetero.Runtime()
    dev = rt.device()
    usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_DST | wgpu.BufferUsage.COPY_SRC
    a, b = dev.pool.acquire(4096, usage), dev.pool.acquire(4096, usage)
    buffers = []
    for _ in range(2):  # recorded before close, as a recording thread would have
        enc = dev.device.create_command_encoder()
        enc.copy_buffer_to_buffer(a.buffer, a.offset, b.buffer, b.offset, 256)
        buffers.append(enc.finish())
    rt.close()  # destroys the pool's buffers, a and b included
    with pytest.raises(RuntimeClosedError) as e:
        dev.enqueue(buffers[0], flush=True)
    assert str(e.value) == CLOSED
    with pytest.raises(RuntimeClosedError) as e:
        dev.submit([buffers[1]])
    assert str(e.value) == CLOSED
    dev.flush()  # nothing to do once closed, and no error
    dev.close()
    rt.close()  # both idempotent


def test_close_submits_what_was_recorded_before_it() -> None:
    """Work enqueued before close still runs and completes: close drains, then tears down."""
    rt = hetero.Runtime()
    dev = rt.device()
    usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_DST | wgpu.BufferUsage.COPY_SRC
    a, b = dev.pool.acquire(4096, usage), dev.pool.acquire(4096, usage)
    done: list[int] = []
    for n in range(3):
        enc = dev.device.create_command_encoder()
        enc.copy_buffer_to_buffer(a.buffer, a.offset, b.buffer, b.offset, 256)
        dev.enqueue(enc.finish(), lambda n=n: done.append(n))  # batched while the first runs
    rt.close()
    assert done == [0, 1, 2]
