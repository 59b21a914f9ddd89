"""Watching for device loss: the state of one device's loss and the watcher of wgpu's log.

A lost device must never be submitted to (wgpu-native aborts the process); every
submission first calls :meth:`LossWatch.check_alive`, and a loss fails the runs waiting
on the device through the callbacks given to :meth:`LossWatch.on_lost`.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Callable

from ..errors import DeviceLostError

__all__ = ["LossWatch", "reports_loss"]

log = logging.getLogger("hetero")


def reports_loss(exc: BaseException) -> bool:
    """Whether ``exc``, raised by a call on a device, says that the device may be lost.

    hetero raises :class:`~hetero.DeviceLostError`; wgpu 0.32 raises no type of its own
    for a lost parent device, only an error whose message says so ("Parent device is lost").
    """
    return isinstance(exc, DeviceLostError) or "device is lost" in str(exc).lower()


class LossWatch:
    """Whether one device was lost (``lost``: the reason, else None) and who to tell."""

    def __init__(self, device: Any, summary: str) -> None:
        self._device = device  # the wgpu device
        self._summary = summary
        self.closed = False  # set when the device closes: a closed device is not probed
        self.lost: str | None = None
        self._callbacks: list[Callable[[str], None]] = []
        self._lock = threading.Lock()
        _LostWatcher.register(self)

    def check_alive(self) -> None:
        if self.lost is not None:
            raise DeviceLostError(f"the GPU device was lost ({self.lost}); create a new Runtime")

    def on_lost(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` once if the device is lost (at once if it already is).

        Under the lock, a callback either joins the list the loss will run, or (the loss
        having taken the list already) runs here: never both, never neither.
        """
        with self._lock:
            reason = self.lost
            if reason is None:
                self._callbacks.append(callback)
                return
        callback(reason)

    def lost_after(self, exc: BaseException) -> str | None:
        """A call on this device raised ``exc``: why the device was lost, or None while it is
        not (probed first when ``exc`` reports a loss: a loss found runs the callbacks)."""
        if self.lost is None and reports_loss(exc):
            self.probe()
        return self.lost

    def probe(self) -> None:
        """wgpu reported that *a* device was lost: find out whether it was this one."""
        with self._lock:
            if self.lost is not None or self.closed:
                return
            try:
                self._device.create_command_encoder().finish()
                return
            except Exception as e:  # "Parent device is lost"
                if "lost" not in str(e).lower():
                    return
        self.mark_lost("reported by the driver")

    def mark_lost(self, reason: str) -> None:
        """The device is lost for ``reason``: record it and run every loss callback once.

        Whoever finds the loss calls this (the probe, the fence thread when waiting for a
        submission fails); the first reason is kept and later calls do nothing.
        """
        with self._lock:
            if self.lost is not None:
                return
            self.lost = reason
            callbacks, self._callbacks = self._callbacks, []
        log.error("hetero: the GPU device %s was lost (%s)", self._summary, reason)
        for cb in callbacks:  # outside the lock: a callback may register another
            try:
                cb(reason)
            except Exception:  # pragma: no cover
                log.exception("device-lost callback failed")


class _LostWatcher(logging.Handler):
    """wgpu 0.32 hides ``device.lost``; its device-lost callback only logs. Watch that log.

    On a "device was lost" record every live device probes itself (a lost device
    fails ``encoder.finish()`` with "Parent device is lost") and, if lost, fails its
    runs with :class:`DeviceLostError` and refuses further submissions, which would
    otherwise abort the process.
    """

    _installed: _LostWatcher | None = None
    _watches: weakref.WeakSet[LossWatch] = weakref.WeakSet()

    @classmethod
    def register(cls, watch: LossWatch) -> None:
        if cls._installed is None:
            cls._installed = cls(level=logging.ERROR)
            logging.getLogger("wgpu").addHandler(cls._installed)
        cls._watches.add(watch)

    def emit(self, record: logging.LogRecord) -> None:
        if "device was lost" not in record.getMessage():
            return
        watches = list(self._watches)

        def probe() -> None:
            for w in watches:
                w.probe()

        # Probe off the thread that logged (it may be inside a wgpu call).
        threading.Thread(target=probe, name="hetero-lost-probe", daemon=True).start()
