"""NVIDIA GPUs as ``nvidia-smi`` sees them: the list, utilization sampled in the background, processes per GPU.

Every function returns None (or an empty result) where ``nvidia-smi`` is absent or fails,
so a benchmark prints what it could learn and goes on.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
import xml.etree.ElementTree as ET
from typing import Any

FIELDS = ("index", "pci.bus_id", "utilization.gpu", "memory.used", "memory.total", "name")  # name last: may hold commas


def available() -> bool:
    return shutil.which("nvidia-smi") is not None


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def parse_line(line: str) -> dict[str, Any] | None:
    """One ``--query-gpu`` CSV line of :data:`FIELDS` (noheader, nounits) as a dict; None if malformed."""
    parts = [p.strip() for p in line.split(",", len(FIELDS) - 1)]
    if len(parts) != len(FIELDS) or not parts[0].isdigit():
        return None
    return {"index": int(parts[0]), "bus_id": parts[1], "name": parts[5], "util": _number(parts[2]),
            "mem_mib": _number(parts[3]), "mem_total_mib": _number(parts[4])}


def _query_args() -> list[str]:
    return ["nvidia-smi", f"--query-gpu={','.join(FIELDS)}", "--format=csv,noheader,nounits"]


def gpus(timeout: float = 30.0) -> list[dict[str, Any]] | None:
    """One dict per GPU (index, bus_id, name, util %, mem_mib, mem_total_mib); None without nvidia-smi."""
    if not available():
        return None
    try:
        out = subprocess.run(_query_args(), capture_output=True, text=True, timeout=timeout, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    rows = [parse_line(line) for line in out.splitlines()]
    return [r for r in rows if r is not None]


def processes() -> dict[int, int]:
    """``{pid: GPU index}`` of the processes holding a context on each GPU (``nvidia-smi -q -x``).

    A GPU's index is its place in the XML, which is nvidia-smi's order. Empty where
    nvidia-smi is absent, or cannot see the processes (another PID namespace).
    """
    if not available():
        return {}
    try:
        xml = subprocess.run(["nvidia-smi", "-q", "-x"], capture_output=True, text=True, timeout=30,
                             check=True).stdout
        root = ET.fromstring(xml)
    except (OSError, subprocess.SubprocessError, ET.ParseError):
        return {}
    found: dict[int, int] = {}
    for index, gpu in enumerate(root.findall("gpu")):
        for proc in gpu.iter("process_info"):
            pid = (proc.findtext("pid") or "").strip()
            if pid.isdigit():
                found[int(pid)] = index
    return found


class Sampler:
    """Queries every GPU (``nvidia-smi --query-gpu``) every ``interval_ms`` on a thread, stamping each answer.

    One query per call, not ``-lms`` (its output may sit in a pipe's buffer and is lost
    when the process is stopped). ``with Sampler() as s: ...``, then, once it stopped,
    ``s.summary(t0, t1)``: per GPU index, the samples answered between
    ``time.perf_counter()`` instants ``t0`` and ``t1``. ``s.running`` is False where
    nvidia-smi is absent.
    """

    def __init__(self, interval_ms: int = 200) -> None:
        self.interval_ms = interval_ms
        self.samples: list[tuple[float, dict[str, Any]]] = []
        self.failures = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None

    def __enter__(self) -> Sampler:
        if available():
            self._thread = threading.Thread(target=self._poll, name="nvidia-smi", daemon=True)
            self._thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop.is_set():
            rows = gpus(timeout=10.0)
            t = time.perf_counter()
            if rows is None:
                self.failures += 1
            else:
                self.samples.extend((t, row) for row in rows)
            self._stop.wait(self.interval_ms / 1e3)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=15)

    def summary(self, t0: float, t1: float) -> dict[int, dict[str, Any]]:
        """Per GPU index: samples, mean and max utilization (%), max memory used (MiB) within [t0, t1]."""
        per: dict[int, list[dict[str, Any]]] = {}
        for t, row in self.samples:
            if t0 <= t <= t1:
                per.setdefault(row["index"], []).append(row)
        out: dict[int, dict[str, Any]] = {}
        for index, rows in sorted(per.items()):
            utils = [r["util"] for r in rows if r["util"] is not None]
            mems = [r["mem_mib"] for r in rows if r["mem_mib"] is not None]
            out[index] = {"samples": len(rows),
                          "util_mean": round(sum(utils) / len(utils), 1) if utils else None,
                          "util_max": max(utils) if utils else None,
                          "mem_max_mib": max(mems) if mems else None}
        return out
