"""Waking an event loop (asyncio or trio) from a worker thread, without blocking the worker."""

from __future__ import annotations

from typing import Any, Callable

import anyio.lowlevel

__all__ = ["loop_caller", "running_loop"]


def loop_caller() -> Callable[[Callable[[], Any]], None]:
    """Return ``call(fn)`` that schedules ``fn()`` on the current event loop from any thread.

    Calls made after the loop has closed are dropped: by then nobody waits for them.
    """
    native: Any = anyio.lowlevel.current_token().native_token
    schedule = getattr(native, "call_soon_threadsafe", None) or native.run_sync_soon

    def call(fn: Callable[[], Any]) -> None:
        try:
            schedule(fn)
        except RuntimeError:  # the loop is closed (asyncio) or finished (trio)
            pass

    return call


def running_loop() -> str | None:
    """Name of the event loop running in this thread, if any."""
    import asyncio
    import sys

    try:
        asyncio.get_running_loop()
        return "asyncio"
    except RuntimeError:
        pass
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            trio.lowlevel.current_trio_token()
            return "trio"
        except RuntimeError:
            pass
    return None
