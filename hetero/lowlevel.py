"""The extension API for kernel and pipeline authors: what ``hetero.kernels`` and ``hetero.pipelines`` build on.

``hetero`` itself is for people who declare and run graphs; this namespace is for
people who write the GPU ops those graphs call (as ``trio.lowlevel`` is for people
who extend trio). Everything a kernel or pipeline needs from hetero's runtime is
named here; the ``hetero._x`` modules behind it are implementation and may change.

Recording work (inside a GPU stage, or a context of your own):

- :class:`GPUContext`: the ``gpu`` a stage receives. ``gpu.kernel(wgsl)`` compiles (cached
  per device), ``gpu.dispatch(kernel, workgroups, *bindings)`` records one dispatch and
  returns a :class:`DispatchInfo`; ``gpu.empty``/``gpu.upload``/``gpu.resident`` make
  :class:`Tensor` objects; ``gpu.limits`` holds the device's limits. Outside a stage
  (a tuner, weights kept across runs), ``GPUContext(device, label)`` records into a
  context of your own: submit ``ctx.encoder.finish()`` with ``device.submit``, wait
  with ``device.wait``, then ``ctx.settle(ran=True)``; ``ctx.release_blocks()`` gives
  its pool blocks back. ``recorder``, ``noting``, ``block_requests``, ``take_blocks`` and
  ``write_uploads`` are the runtime's capture interface (what replaying a captured stage
  uses); stage functions have no need of them.
- :class:`Kernel`: a compiled pipeline (``kernel.pipeline``; ``kernel.grid`` is true when
  its entry point uses ``hetero_workgroup_id`` and so takes the grid uniform in ``@group(0)``,
  at ``@binding(kernel.n_bindings)``, after the dispatch's own bindings).
- :class:`Tensor`: a typed view of a GPU buffer (``buffer``, ``offset``, ``shape``, ``dtype``).

Devices and caches:

- :func:`device_of`: the :class:`Device` behind a GPUContext, Runtime or Device. It is
  the per-device key for caches (hashable by identity, weakly referenceable, alive as
  long as the device is): key a ``weakref.WeakKeyDictionary`` with it.
- :class:`Device`: one WebGPU device. Supported for extensions: ``device`` (the
  ``wgpu.GPUDevice``; its ``adapter_info`` names the adapter), ``limits``, ``summary``,
  ``kernel(wgsl, ...)``, ``submit(command_buffers)`` (returns a submission index) and
  ``wait(index)``.
- :func:`list_adapters`: every adapter wgpu can see, on every backend; :func:`adapter_labels`
  names each by the ``HETERO_ADAPTER`` value that selects exactly it (``backend#k``), as
  ``hetero info`` lists them.
- :class:`StagingRing`: host<->device copies through pooled, mapped staging buffers (the one
  a Device moves data through); a ring of your own over a ``wgpu.GPUDevice`` takes its copy
  threads, chunk size and pool cap as arguments.
- :func:`default_runtime`: the shared Runtime behind ``hetero.run``.
- :func:`running_loop`: the event loop running in this thread (``"asyncio"``, ``"trio"``
  or None); a synchronous entry point refuses to start inside one, as ``hetero.run`` does.
- :func:`loop_caller`: ``call = loop_caller()`` inside an event loop gives ``call(fn)``, which
  any thread may use to run ``fn()`` on that loop without blocking (how a worker thread hands
  results to a coroutine; calls after the loop closed are dropped).

Recording outside ``gpu.dispatch`` (timing one submission, for instance):
:func:`grid_uniform` builds the grid uniform a grid kernel reads (its last binding). Tuning caches are
written with :func:`atomic_write_text` (:func:`atomic_write` for bytes); :func:`check_writable` checks, before any work,
that an output file can be written. :func:`positive_int` is the ``argparse`` type of a
count option (``--workers N``), as hetero's own command line reads it (:func:`non_negative_int`
where 0 is allowed), and
:func:`check_positive_int` the check of an integer option passed in Python (bounds,
multiple, the error type and the words of its message are the caller's).
"""

from __future__ import annotations

from typing import Any

from ._gpu.device import Device, Kernel, adapter_labels, list_adapters
from ._argtypes import check_positive_int, non_negative_int, positive_int
from ._files import atomic_write, atomic_write_text, check_writable
from ._gpu.context import GPUContext
from ._bridge import loop_caller
from ._bridge import running_loop as _running_loop
from ._runtime import Runtime, _default_runtime
from ._gpu.grid import DispatchInfo, grid_uniform
from ._gpu.tensor import Tensor
from ._gpu.transfer import StagingRing

__all__ = [
    "Device",
    "DispatchInfo",
    "GPUContext",
    "Kernel",
    "StagingRing",
    "Tensor",
    "adapter_labels",
    "atomic_write",
    "atomic_write_text",
    "check_positive_int",
    "check_writable",
    "default_runtime",
    "device_of",
    "grid_uniform",
    "list_adapters",
    "loop_caller",
    "non_negative_int",
    "positive_int",
    "running_loop",
]


def device_of(target: Any) -> Device:
    """The :class:`Device` behind ``target``: a :class:`GPUContext`, a ``hetero.Runtime`` or a Device.

    The Device is also the per-device key for caches (weights kept on a device, tuned
    choices): it is hashable by identity and weakly referenceable, and a
    ``weakref.WeakKeyDictionary`` keyed by it forgets the entry with the device.
    """
    if isinstance(target, Device):
        return target
    if isinstance(target, GPUContext):
        return target.runtime_device
    device = getattr(target, "device", None)
    if callable(device):  # a Runtime: its device, opened on first use
        dev = device()
        if isinstance(dev, Device):
            return dev
    raise TypeError(f"device_of: expected a GPUContext, Runtime or Device, got {type(target).__name__}")


def default_runtime() -> Runtime:
    """The shared ``hetero.Runtime`` behind ``hetero.run()``: created on first use, closed at exit."""
    return _default_runtime()


def running_loop() -> str | None:
    """The event loop running in this thread: ``"asyncio"``, ``"trio"`` or None.

    A synchronous entry point (``hetero.run``, ``embed``) cannot start a loop inside a
    running one: it checks this and raises a HeteroError that names the async call to use.
    """
    return _running_loop()
