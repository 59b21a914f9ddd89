"""Writing files: so that a reader never sees half of one, and checking ahead that one can be written."""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from .errors import HeteroError

__all__ = ["atomic_write", "atomic_write_text", "check_writable", "write_error"]


def atomic_write(path: str | os.PathLike[str], write: Callable[[BinaryIO], object]) -> None:
    """Call ``write(f)`` on a temporary file beside ``path``, then rename it over ``path``.

    Readers see the old file or the new one, never a partial write; on failure the
    temporary file is removed and the error propagates (``OSError`` and the like). The
    file gets the mode ``open(path, "w")`` would give it (``0o666`` less the umask). A
    path that exists and is not a regular file (``/dev/null``, ``/dev/stdout``, a FIFO,
    or a link to one) is written in place: renaming over a device would replace it.
    """
    path = os.path.abspath(path)
    try:
        special = not stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        special = False  # absent (or unreadable: the write says why)
    if special:
        with open(path, "wb") as f:
            write(f)
        return
    directory, name = os.path.split(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _umask() -> int:
    """The process's umask, read without setting it where the OS tells it (setting it races other threads)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """:func:`atomic_write` of ``text`` in UTF-8."""
    data = text.encode("utf-8")
    atomic_write(path, lambda f: f.write(data))


def write_error(what: str, path: str | os.PathLike[str], e: OSError,
                error: type[HeteroError] | None = None) -> HeteroError:
    """The error for a failed write: ``cannot write <what> '<path>': <the OS's reason>``."""
    return (error or HeteroError)(f"cannot write {what} {os.fspath(path)!r}: {e.strerror or e}")


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
