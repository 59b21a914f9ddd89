"""Writing files: so that a reader never sees half of one, and checking ahead that one can be written."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .errors import HeteroError

__all__ = ["atomic_write_text", "check_writable"]


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8) to a temporary file beside ``path``, then rename it over ``path``.

    Readers see the old file or the new one, never a partial write; on failure the
    temporary file is removed and the error propagates (``OSError`` and the like).
    """
    path = os.path.abspath(path)
    directory, name = os.path.split(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def check_writable(path: str | os.PathLike[str], what: str, error: type[HeteroError] | None = None) -> Path:
    """Check, before any work, that ``path`` can be created or replaced; raise ``error`` naming it if not.

    The check creates and removes a temporary file beside ``path``: permissions alone
    do not tell (a read-only file system, or a user who bypasses them).
    """
    err = error or HeteroError
    p = Path(path)
    parent = p.parent
    if p.is_dir():
        raise err(f"cannot write {what} {str(p)!r}: it is a directory")
    if not parent.exists():
        raise err(f"cannot write {what} {str(p)!r}: directory {str(parent)!r} does not exist")
    if not parent.is_dir():
        raise err(f"cannot write {what} {str(p)!r}: {str(parent)!r} is not a directory")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".hetero-check-", dir=parent)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise err(f"cannot write {what} {str(p)!r}: {e.strerror or e}") from e
    if p.exists() and not os.access(p, os.W_OK):
        raise err(f"cannot write {what} {str(p)!r}: permission denied")
    return p
