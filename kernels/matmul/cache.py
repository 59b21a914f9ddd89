"""The matmul tuning cache: which configuration ``matmul`` uses on an adapter, and where that is stored.

One JSON file per adapter under :func:`cache_dir` (format: :func:`cache_path`); entries
are keyed by dtype and :func:`size_class`. :func:`choose_config` reads it (memoised by
the file's mtime), :func:`save` merges entries into it atomically.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import weakref
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from hetero.kernels.matmul.config import MatmulConfig, default_config
from hetero.lowlevel import atomic_write_text, device_of

__all__ = ["CACHE_VERSION", "adapter_info", "cache_dir", "cache_key", "cache_path", "choose_config", "explain_config",
           "load", "save", "size_class"]

log = logging.getLogger("hetero")

CACHE_VERSION = 1


_INFO_KEYS = (("name", "device"), ("backend", "backend_type"), ("type", "adapter_type"), ("driver", "description"),
              ("vendor", "vendor"))
_infos: weakref.WeakKeyDictionary[Any, tuple[tuple[str, str], ...]] = weakref.WeakKeyDictionary()


def adapter_info(target: Any) -> dict[str, str]:
    """name, backend, type, driver and vendor of the adapter behind a GPUContext or Device (memoised)."""
    dev = getattr(target, "device", target)  # GPUContext / Device -> wgpu.GPUDevice
    dev = getattr(dev, "device", dev)
    try:
        hit = _infos.get(dev)
    except TypeError:  # not weak-referenceable
        hit = None
    if hit is None:
        info = getattr(dev, "adapter_info", None) or {}
        hit = tuple((k, str(info.get(src, "") or ("unknown" if k == "name" else ""))) for k, src in _INFO_KEYS)
        try:
            _infos[dev] = hit
        except TypeError:
            pass
    return dict(hit)


@lru_cache(maxsize=64)
def _adapter_id_of(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _adapter_id(info: dict[str, str]) -> str:
    return _adapter_id_of("|".join(info[k] for k, _ in _INFO_KEYS))


@lru_cache(maxsize=16)
def _cache_dir(env: str | None, xdg: str | None) -> Path:
    if env:
        return Path(env)
    return (Path(xdg) if xdg else Path.home() / ".cache") / "hetero"


def cache_dir() -> Path:
    """``$HETERO_CACHE_DIR``, else ``$XDG_CACHE_HOME/hetero``, else ``~/.cache/hetero`` (read at each call)."""
    return _cache_dir(os.environ.get("HETERO_CACHE_DIR") or None, os.environ.get("XDG_CACHE_HOME") or None)


def cache_path(target: Any) -> Path:
    """Where the tuned choices for ``target``'s adapter live (a GPUContext, Device or Runtime).

    Format (JSON)::

        {"version": 1,
         "adapter": {"name": ..., "backend": ..., "type": ..., "driver": ..., "vendor": ...},
         "entries": {"f32:n12": {"config": {"bm": 128, "bn": 128, "bk": 8, "tm": 8, "tn": 8,
                                            "double_buffer": true},
                                 "gflops": 25000.0, "shape": [4096, 4096, 4096, 1],
                                 "tuned_at": "2026-12-01T10:00:00Z"}, ...}}

    Keys are ``<dtype>:n<size class>`` (:func:`size_class`). The file is replaced
    atomically; an unreadable or malformed file, or entry, is ignored (and rewritten
    by the next tune).
    """
    return Path(_cache_file(adapter_info(device_of(target))))


def _cache_file(info: dict[str, str]) -> str:
    return _join(str(cache_dir()), _adapter_id(info))


@lru_cache(maxsize=64)
def _join(directory: str, adapter_id: str) -> str:
    return os.path.join(directory, f"matmul-{adapter_id}.json")


def size_class(m: int, n: int, batch: int = 1) -> int:
    """The tuning cache's size class: log2 of the output's side, ``round(log2(B*M*N) / 2)``."""
    return max(0, round(math.log2(max(1, batch * m * n)) / 2))


def cache_key(dtype: Any, cls: int) -> str:
    """The cache entry's key: ``<dtype>:n<size class>``, e.g. ``f32:n12``."""
    return f"{'f16' if np.dtype(dtype) == np.float16 else 'f32'}:n{cls}"


_memo: dict[str, tuple[tuple[int, int], dict[str, MatmulConfig]]] = {}


def load(path: str | Path) -> dict[str, MatmulConfig]:
    """The valid entries of a cache file ({} when absent or unreadable); memoised by mtime."""
    try:
        st = os.stat(path)
    except OSError:
        return {}
    stamp = (st.st_mtime_ns, st.st_size)
    hit = _memo.get(str(path))
    if hit is not None and hit[0] == stamp:
        return hit[1]
    entries: dict[str, MatmulConfig] = {}
    try:
        doc = json.loads(Path(path).read_text())
        if not isinstance(doc, dict) or doc.get("version") != CACHE_VERSION or not isinstance(doc.get("entries"), dict):
            raise ValueError("not a version-1 matmul cache")
        for key, e in doc["entries"].items():
            try:
                entries[str(key)] = MatmulConfig.from_dict(e["config"])
            except (ValueError, TypeError, KeyError) as err:
                log.warning("hetero: ignoring matmul cache entry %r in %s: %s", key, path, err)
    except (OSError, ValueError) as err:
        log.warning("hetero: ignoring unreadable matmul tuning cache %s: %s", path, err)
        entries = {}
    _memo[str(path)] = (stamp, entries)
    return entries


def save(path: Path, info: dict[str, str], new: dict[str, dict[str, Any]]) -> None:
    """Merge ``new`` entries into the cache file and replace it atomically."""
    doc: dict[str, Any] = {"version": CACHE_VERSION, "adapter": info, "entries": {}}
    try:
        old = json.loads(path.read_text())
        if isinstance(old, dict) and old.get("version") == CACHE_VERSION and isinstance(old.get("entries"), dict):
            doc["entries"].update(old["entries"])
    except (OSError, ValueError):
        pass
    doc["entries"].update(new)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(doc, indent=1, sort_keys=True) + "\n")


def choose_config(gpu: Any, m: int, n: int, k: int, batch: int = 1, *, dtype: Any = np.float32,
                  small_split: bool | None = None) -> MatmulConfig:
    """The configuration ``matmul`` uses for this problem on ``gpu``'s adapter.

    The tuned entry of the nearest size class of this dtype (within 2 classes, so
    within a factor 4 of the output's side; ties: the larger class), if it fits the
    device; else :func:`default_config` (with ``small_split``).
    """
    return explain_config(gpu, m, n, k, batch, dtype=dtype, small_split=small_split)[0]


def explain_config(gpu: Any, m: int, n: int, k: int, batch: int = 1, *,
                   dtype: Any = np.float32, small_split: bool | None = None) -> tuple[MatmulConfig, str]:
    """:func:`choose_config` and where the choice came from: ``"cache f32:n12"`` or ``"default"``."""
    info = adapter_info(gpu)
    limits: dict[str, int] = gpu.limits
    entries = load(_cache_file(info))
    if entries:
        cls = size_class(m, n, batch)
        prefix = cache_key(dtype, 0).split(":")[0] + ":n"
        best: tuple[int, int, MatmulConfig, str] | None = None
        for key, c in entries.items():
            if key.startswith(prefix) and key[len(prefix):].isdigit():
                d = abs(int(key[len(prefix):]) - cls)
                if d <= 2 and c.fits(limits) is None and (best is None or (d, -int(key[len(prefix):])) < best[:2]):
                    best = (d, -int(key[len(prefix):]), c, key)
        if best is not None:
            return best[2], f"cache {best[3]}"
    return default_config(info["type"], m, n, batch, limits, k=k, small_split=small_split), "default"
