"""Placing stages that have a CPU and a GPU implementation: a calibrated performance model.

A stage declared with ``g.stage(..., cpu=fn_cpu, gpu=fn_gpu)`` is placed per execution,
when it becomes ready, by the rule of StarPU's ``dmda`` scheduler: run it where it is
expected to *complete* first,

    expected completion(device) = queue wait + transfer of inputs not already there + execution estimate

Execution estimates
    Measured times, kept per stage, per implementation and per size bucket (the bit
    length of the bytes of the stage's array inputs: one bucket per power of two). An
    estimate is the mean of the bucket's measurements once it holds
    ``calibration_samples`` of them; before that the implementation is *uncalibrated*
    in that bucket. The first execution of each implementation of a stage calibrates
    nothing: it pays one-off costs (compiling kernels, uploading resident weights,
    warming BLAS) that later executions do not.

    Measured fairly: a CPU implementation's time is its function's run time; the wait
    for a free worker is added as its queue wait, and downloading device inputs as its
    transfer. A GPU implementation's time is its recording (host-side uploads included)
    plus its GPU service time: the GPU time measured by timestamps where the runtime
    takes them, else an equal share of its submission's time (from the later of the
    submission and the completion of the work queued before it, to its completion)
    among the stages submitted together.

Transfers
    Inputs already on the implementation's side cost nothing; host arrays going to the
    GPU cost ``bytes / upload_bps``; device tensors coming to the CPU cost
    ``download_latency + bytes / download_bps`` (a download waits for a fence).

Queue waits
    The execution estimates of stages placed on a device and not yet finished: on the
    CPU divided by the number of CPU workers, on the GPU summed (one queue).

Rules, in order (``Runtime(placement="auto")``)
    1. No GPU (no adapter, or the device could not be opened): the CPU.
    2. A CPU-emulated adapter (adapter type "cpu": lavapipe, llvmpipe, WARP) never gets
       heavy work (array inputs of ``HEAVY_BYTES`` or more): the CPU, not even to
       calibrate; such an adapter runs on the same cores, slower than numpy.
    3. Locality: on a real GPU, a stage whose array inputs mostly (by bytes) live on the device runs
       there while its CPU implementation is uncalibrated in the size bucket: the CPU one
       is not run just to calibrate ("locality"), since its download ends the chain of GPU
       work (submission, fence, wake-ups) at a cost the transfer estimate does not see.
    4. Cold start: an implementation uncalibrated in the stage's size bucket runs, so
       that it calibrates (when both are, the GPU one first; on a CPU-emulated adapter the
       CPU one); except one that was at
       least ``DOMINATED_RATIO`` times slower than the other in every bucket where both
       are calibrated: the other one runs ("dominated"), and the slow one is not tried
       at every new size (a CPU encoder layer on a machine with a real GPU).
    5. The smaller expected completion. Ties go to the implementation that moves fewer
       bytes, then to the CPU (keeping the GPU for stages that have no CPU implementation).

``placement="cpu"`` / ``"gpu"`` force every such stage onto one side (rule 0, "forced").
Each decision is a :class:`Placement`: where, why, and the estimates compared; it is
in ``Runtime.stats()`` and in the trace.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np

from ._argtypes import check_positive_int
from ._gpu.tensor import Tensor, map_values

__all__ = ["HEAVY_BYTES", "PLACEMENTS", "PerfModel", "Placement", "Placer", "input_bytes", "size_bucket"]

PLACEMENTS = ("auto", "cpu", "gpu")
Side = Literal["cpu", "gpu"]
# Array inputs from this many bytes on make a stage "heavy": never placed on a CPU-emulated adapter.
HEAVY_BYTES = 1 << 12
CALIBRATION_SAMPLES = 2
# An implementation this many times slower than the other wherever both were measured is
# not calibrated at new sizes: calibrating it costs that many executions of the fast one.
DOMINATED_RATIO = 4.0


def input_bytes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, int]:
    """Bytes of the host arrays and of the device tensors among a stage's arguments."""
    host = dev = 0

    def visit(v: Any) -> Any:
        nonlocal host, dev
        if isinstance(v, Tensor):
            dev += v.nbytes
        else:
            host += v.nbytes
        return v

    for a in (*args, *kwargs.values()):
        map_values(a, visit, (np.ndarray, Tensor))
    return host, dev


def size_bucket(nbytes: int) -> int:
    """The size bucket of a stage whose array inputs hold ``nbytes``: one per power of two."""
    return int(nbytes).bit_length()


@dataclass(frozen=True)
class Placement:
    """Where one execution of a two-implementation stage ran, and why.

    ``device`` is "cpu" or "gpu". ``reason``: "forced" (``Runtime(placement=...)``),
    "no gpu", "cpu adapter" (heavy work and a CPU-emulated adapter), "locality" (inputs
    mostly on a real GPU, the CPU side uncalibrated), "calibrating" (an
    implementation had no estimate for this size), "dominated" (the uncalibrated one was
    far slower wherever both were measured) or "model" (the smaller expected completion). ``cpu_s``/``gpu_s``: the expected completions compared, in seconds
    (None where uncalibrated); ``estimates`` their parts per side (``exec``,
    ``transfer``, ``wait``); ``bucket`` the size bucket; ``bytes`` the array inputs.
    """

    device: Side
    reason: str
    bucket: int
    bytes: int
    cpu_s: float | None = None
    gpu_s: float | None = None
    estimates: tuple[tuple[str, tuple[tuple[str, float | None], ...]], ...] = ()
    charge: float = field(default=0.0, repr=False, compare=False)  # seconds added to the queue wait

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly form (what the trace records)."""
        return {"device": self.device, "reason": self.reason, "bucket": self.bucket, "bytes": self.bytes,
                "cpu_s": self.cpu_s, "gpu_s": self.gpu_s,
                "estimates": {side: dict(parts) for side, parts in self.estimates}}


class PerfModel:
    """Measured execution times per (stage, implementation, size bucket), and transfer costs.

    ``calibration_samples``: measurements a bucket needs before its mean is used.
    ``learn=False`` freezes the model (only :meth:`seed` changes it): decisions then
    depend on nothing measured, e.g. in tests. ``upload_bps``, ``download_bps`` and
    ``download_latency`` price transfers: a host array going to the GPU costs ``bytes /
    upload_bps``, a device tensor coming to the CPU ``download_latency + bytes /
    download_bps``. Thread-safe; one model may serve several runtimes.
    """

    def __init__(self, *, calibration_samples: int = CALIBRATION_SAMPLES, learn: bool = True,
                 upload_bps: float = 8e9, download_bps: float = 8e9, download_latency: float = 50e-6) -> None:
        check_positive_int("calibration_samples", calibration_samples)
        for name, v in (("upload_bps", upload_bps), ("download_bps", download_bps)):
            if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a positive number of bytes per second, got {v!r}")
        if not (isinstance(download_latency, (int, float)) and download_latency >= 0):
            raise ValueError(f"download_latency must be a number of seconds >= 0, got {download_latency!r}")
        self.calibration_samples = calibration_samples
        self.learn = learn
        self.upload_bps = float(upload_bps)
        self.download_bps = float(download_bps)
        self.download_latency = float(download_latency)
        self._lock = threading.Lock()
        self._sums: dict[tuple[str, str, int], tuple[int, float]] = {}  # key -> (count, total seconds)
        self._warm: set[tuple[str, str]] = set()  # (stage, side) whose first execution was seen

    def seed(self, stage: str, device: Side, bucket: int, seconds: float, samples: int | None = None) -> None:
        """Set the estimate of ``stage`` on ``device`` for size ``bucket`` (calibrated at once by default)."""
        if device not in ("cpu", "gpu"):
            raise ValueError(f"device must be 'cpu' or 'gpu', got {device!r}")
        if not (isinstance(seconds, (int, float)) and seconds >= 0 and math.isfinite(seconds)):
            raise ValueError(f"seconds must be a finite number >= 0, got {seconds!r}")
        n = self.calibration_samples if samples is None else samples
        with self._lock:
            self._sums[(stage, device, bucket)] = (n, float(seconds) * n)
            self._warm.add((stage, device))

    def record(self, stage: str, device: Side, bucket: int, seconds: float) -> None:
        """One measured execution (ignored when the model does not learn, and for the first one per side)."""
        if not self.learn or not seconds >= 0:
            return
        with self._lock:
            if (stage, device) not in self._warm:
                self._warm.add((stage, device))
                return
            n, total = self._sums.get((stage, device, bucket), (0, 0.0))
            self._sums[(stage, device, bucket)] = (n + 1, total + seconds)

    def estimate(self, stage: str, device: Side, bucket: int) -> float | None:
        """The mean measured seconds, or None while the bucket holds fewer than ``calibration_samples``."""
        with self._lock:
            n, total = self._sums.get((stage, device, bucket), (0, 0.0))
        return total / n if n >= self.calibration_samples else None

    def slowest_ratio(self, stage: str, slow: Side, fast: Side) -> float | None:
        """The smallest ratio of ``slow``'s estimate to ``fast``'s over buckets where both are calibrated."""
        need = self.calibration_samples
        with self._lock:
            means: dict[tuple[str, int], float] = {}
            for (st, side, bucket), (n, total) in self._sums.items():
                if st == stage and n >= need:
                    means[(side, bucket)] = total / n
        ratios = [t / means[(fast, b)] if means[(fast, b)] > 0 else math.inf
                  for (side, b), t in means.items() if side == slow and (fast, b) in means]
        return min(ratios) if ratios else None

    def samples(self, stage: str, device: Side, bucket: int) -> int:
        with self._lock:
            return self._sums.get((stage, device, bucket), (0, 0.0))[0]

    def upload_s(self, nbytes: int) -> float:
        return nbytes / self.upload_bps if nbytes else 0.0

    def download_s(self, nbytes: int) -> float:
        return self.download_latency + nbytes / self.download_bps if nbytes else 0.0

    def table(self) -> dict[str, dict[str, dict[int, tuple[int, float]]]]:
        """Everything measured: ``{stage: {device: {bucket: (samples, mean seconds)}}}``."""
        out: dict[str, dict[str, dict[int, tuple[int, float]]]] = {}
        with self._lock:
            for (stage, side, bucket), (n, total) in sorted(self._sums.items()):
                out.setdefault(stage, {}).setdefault(side, {})[bucket] = (n, total / n if n else 0.0)
        return out


class Placer:
    """One runtime's placement policy: the mode, the model, and the work placed and not finished."""

    def __init__(self, mode: str, model: PerfModel, cpu_workers: int) -> None:
        if mode not in PLACEMENTS:
            raise ValueError(f"placement must be one of {', '.join(map(repr, PLACEMENTS))}, got {mode!r}")
        self.mode = mode
        self.model = model
        self.cpu_workers = cpu_workers
        self._lock = threading.Lock()
        self._pending = {"cpu": 0.0, "gpu": 0.0}

    def decide(self, stage: str, host_bytes: int, dev_bytes: int, gpu: bool, adapter_type: str) -> Placement:
        """Where to run one execution of ``stage`` (``gpu``: a GPU device is available)."""
        total = host_bytes + dev_bytes
        bucket = size_bucket(total)
        if self.mode != "auto":
            return self._placed(Placement("cpu" if self.mode == "cpu" else "gpu", "forced", bucket, total), stage)
        if not gpu:
            return self._placed(Placement("cpu", "no gpu", bucket, total), stage)
        emulated = adapter_type.strip().lower() == "cpu"
        if emulated and total >= HEAVY_BYTES:
            return self._placed(Placement("cpu", "cpu adapter", bucket, total), stage)
        m = self.model
        ex = {"cpu": m.estimate(stage, "cpu", bucket), "gpu": m.estimate(stage, "gpu", bucket)}
        with self._lock:
            wait = {"cpu": self._pending["cpu"] / max(self.cpu_workers, 1), "gpu": self._pending["gpu"]}
        moved = {"cpu": dev_bytes, "gpu": host_bytes}
        transfer = {"cpu": m.download_s(dev_bytes), "gpu": m.upload_s(host_bytes)}
        done: dict[str, float | None] = {
            side: None if ex[side] is None else wait[side] + transfer[side] + ex[side]  # type: ignore[operator]
            for side in ("cpu", "gpu")
        }
        parts = tuple((side, (("exec", ex[side]), ("transfer", transfer[side]), ("wait", wait[side])))
                      for side in ("cpu", "gpu"))
        c, g = done["cpu"], done["gpu"]
        if c is None and dev_bytes > host_bytes and not emulated:
            # Data mostly on a real GPU stays there until the model knows better: the CPU
            # implementation is not run just to calibrate (a download ends the GPU's chain).
            return self._placed(Placement("gpu", "locality", bucket, total, c, g, parts), stage)
        if c is None or g is None:
            side: Side = "gpu" if g is None and not (emulated and c is None) else "cpu"
            reason = "calibrating"
            if (c is None) != (g is None):
                other: Side = "cpu" if side == "gpu" else "gpu"
                ratio = m.slowest_ratio(stage, side, other)
                if ratio is not None and ratio >= DOMINATED_RATIO:
                    side, reason = other, "dominated"
        else:
            reason = "model"
            if c != g:
                side = "cpu" if c < g else "gpu"
            elif moved["cpu"] != moved["gpu"]:
                side = "cpu" if moved["cpu"] < moved["gpu"] else "gpu"
            else:
                side = "cpu"
        return self._placed(Placement(side, reason, bucket, total, c, g, parts), stage)

    def _placed(self, p: Placement, stage: str) -> Placement:
        est = self.model.estimate(stage, p.device, p.bucket)
        if not est:
            return p
        with self._lock:
            self._pending[p.device] += est
        return replace(p, charge=est)

    def finished(self, stage: str, p: Placement, seconds: float | None) -> None:
        """The execution placed by ``p`` ended; ``seconds``: its measured time (None: failed)."""
        if p.charge:
            with self._lock:
                self._pending[p.device] = max(0.0, self._pending[p.device] - p.charge)
        if seconds is not None:
            self.model.record(stage, p.device, p.bucket, seconds)
