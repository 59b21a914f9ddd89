"""Awaiting a submission from asyncio or trio: ``Fence``.

``await fence.wait()`` first watches the submission from the event loop itself, for
up to ``spin_s`` (``LOOP_POLL_US``): each turn is a checkpoint (every other task
runs), a look at the completed index (with a non-blocking ``wgpuDevicePoll`` unless
the fence thread is polling, see ``Submission.completed``), then a sleep of at most
``SLICE_S`` on a lock that the completion releases. Only then does it sleep until the
device's fence thread wakes the loop. The loop is never held longer than one slice
(20 µs plus the OS timer slack).

Why. A submission of little work completes tens of microseconds after it was
submitted. Reaching the loop through the fence thread costs a thread hand-off and an
event-loop wake-up; the lock hands the completion straight to the waiting thread.
A blocking poll holds up every non-blocking one, the loop's included, until the work
finished, so the fence thread polls without blocking first where it spins at all (see
``Submission._await_completion``). Past ``spin_s`` the loop stops
watching (long GPU work must not cost the loop's CPU time) and the fence thread
wakes it, in order with every other completion.

``wgpuDevicePoll(wait=False)`` returns true even while work is in flight (measured:
it does so at once after a submit whose work runs for milliseconds, although
wgpu-native documents it as "queue empty"), so its result is never used.

Completion is monotonic: when a fence is done, every fence of an earlier submission is
done too (``Submission.completed``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import anyio
import anyio.lowlevel

from .._bridge import loop_caller

if TYPE_CHECKING:
    from .device import Device
    from .submission import Submission

__all__ = ["Fence", "LOOP_POLL_US"]

# How long ``Fence.wait`` polls from the event loop before it sleeps: several times what a
# tiny submission takes to complete; longer ones are left to the fence thread after this.
LOOP_POLL_US = 200.0
# Between two polls the loop sleeps on a lock (GIL released) for at most this long, or
# until whoever sees the completion releases it (the fence thread needs the GIL to
# report it, and a loop that only polls in Python would hold it).
SLICE_S = 20e-6


class Fence:
    """The completion of submission ``index`` on a device's queue (everything enqueued before it included)."""

    __slots__ = ("index", "_dev")

    def __init__(self, device: Device | Submission, index: int) -> None:
        self.index = index
        # A Device submits through its Submission.
        self._dev: Submission = device.submission if hasattr(device, "submission") else device

    def __repr__(self) -> str:
        return f"<Fence #{self.index} {'done' if self.done() else 'pending'}>"

    def done(self) -> bool:
        """Whether the submission completed (never blocks; safe on the event loop).

        Raises ``DeviceLostError`` once the device is lost.
        """
        return self._dev.completed(self.index)

    async def wait(self, spin_s: float = LOOP_POLL_US / 1e6) -> None:
        """Wait without blocking the event loop for long: watch for up to ``spin_s``, then sleep until woken."""
        dev = self._dev
        if dev.completed(self.index):
            return
        if spin_s > 0:
            lock = dev.sleeper(self.index)
            if lock is None:
                return
            try:
                deadline = time.perf_counter() + spin_s
                while True:
                    await anyio.lowlevel.checkpoint()
                    if dev.completed(self.index):
                        return
                    # GIL released: the fence thread can report the completion meanwhile.
                    if lock.acquire(timeout=SLICE_S):
                        dev.check_alive()
                        return
                    if time.perf_counter() >= deadline:
                        break
            finally:
                dev.drop_sleeper(lock)
        event = anyio.Event()
        call = loop_caller()
        dev.on_done(self.index, lambda: call(event.set))
        await event.wait()
        dev.check_alive()

    def wait_sync(self) -> None:
        """Block the calling thread until the submission completed (never call on the event loop)."""
        if not self._dev.completed(self.index):
            self._dev.wait(self.index)
        self._dev.check_alive()
