"""What hetero reads from WGSL source: its resource bindings, with the comments taken out.

hetero never compiles WGSL itself (wgpu does); it reads just enough of it to check a
dispatch before anything is recorded: how many ``@group(0)`` bindings the shader
declares, the address space and access of each (``var<uniform>``, ``var<storage,
read>``, ``var<storage, read_write>``, or a texture or sampler), and the element type of
buffers (``array<f32>``, ``array<vec4<u32>>``, ``atomic<i32>``, ``u32``, through ``alias``
declarations). Every reading works on :func:`strip_comments` of the source, so a
declaration inside ``//`` or (nested) ``/* */`` comments counts for nothing.

The dtype rule a storage Tensor, or a numpy array bound as a uniform, is checked
against (:func:`dtype_mismatch`); ``bytes`` are taken as they are:

* ``f32`` and ``f16`` elements (scalars, vectors, matrices) hold float32 and float16
  data only: any other dtype would be read as garbage.
* ``i32`` and ``u32`` elements (scalars, vectors, atomics) are words: they take any
  dtype whose items tile the element, so packed bytes (four int8 per ``u32``), the bits
  of float32 or float16 data, and int64 in ``vec2<u32>`` bind; a dtype wider than the
  element (int64 or float64 in an ``array<u32>``) is refused.
* Structs, and types hetero cannot resolve, are not checked; neither are structured
  numpy dtypes (records are byte layouts the caller matches to a struct).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

__all__ = ["Binding", "dtype_mismatch", "group_bindings", "strip_comments"]

_ATTRS_VAR = re.compile(
    r"((?:@\s*\w+\s*(?:\([^()]*\))?\s*)+)"  # attributes: @group(0) @binding(1), in any order
    r"var\b\s*(?:<([^<>]*)>)?\s*"  # address space and access
    r"(\w+)\s*:\s*([^;=]+?)\s*;"  # name: type;
)
_ATTR = re.compile(r"@\s*(group|binding)\s*\(\s*(\d+)\s*,?\s*\)")
_ALIAS = re.compile(r"\b(?:alias|type)\s+(\w+)\s*=\s*([^;]+?)\s*;")
_SCALAR_BYTES = {"f32": 4, "i32": 4, "u32": 4, "f16": 2}
_SHORT = {"f": "f32", "i": "i32", "u": "u32", "h": "f16"}
# What Python's str.splitlines breaks at (a superset of WGSL's line breaks): kept as they are.
_BREAKS = frozenset("\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029")
NUMPY_OF = {"f32": "float32", "f16": "float16", "i32": "int32", "u32": "uint32"}


@dataclass(frozen=True)
class Binding:
    """One ``@group(g) @binding(b) var<...> name: type;`` declaration.

    ``space`` is ``"uniform"``, ``"storage"`` or ``"handle"`` (textures and samplers,
    declared without an address space); ``access`` is ``"read"`` or ``"read_write"``
    for storage. ``scalar`` (``f32``, ``f16``, ``i32``, ``u32``) and ``element_bytes``
    describe one element of the buffer (of an array, or the whole type), None where
    hetero does not check it (structs).
    """

    group: int
    binding: int
    name: str
    space: str
    access: str | None
    type: str
    scalar: str | None = None
    element_bytes: int | None = None

    @property
    def declared(self) -> str:
        """The declaration as the shader spells it: ``var<storage, read_write>``."""
        if self.space == "storage":
            return f"var<storage, {self.access}>"
        if self.space == "uniform":
            return "var<uniform>"
        return f"a {self.type} (not a buffer)"


def strip_comments(wgsl: str) -> str:
    """``wgsl`` with every ``//`` and (nested) ``/* */`` comment blanked out.

    Comment characters become spaces and line breaks stay, so line numbers and the
    columns of the remaining code are those of the source. WGSL has no string literals.
    """
    out = list(wgsl)
    i, n, depth = 0, len(wgsl), 0
    while i < n:
        two = wgsl[i:i + 2]
        if depth:
            if two == "/*":
                depth += 1
            elif two == "*/":
                depth -= 1
            else:
                if wgsl[i] not in _BREAKS:
                    out[i] = " "
                i += 1
                continue
            out[i] = out[i + 1] = " "
            i += 2
        elif two == "/*":
            depth = 1
            out[i] = out[i + 1] = " "
            i += 2
        elif two == "//":
            while i < n and wgsl[i] not in _BREAKS:
                out[i] = " "
                i += 1
        else:
            i += 1
    return "".join(out)


def group_bindings(wgsl: str, group: int = 0) -> dict[int, Binding]:
    """The bindings ``wgsl`` declares in ``group``, by binding number (comments ignored)."""
    code = strip_comments(wgsl)
    aliases = {m.group(1): m.group(2) for m in _ALIAS.finditer(code)}
    found: dict[int, Binding] = {}
    for m in _ATTRS_VAR.finditer(code):
        attrs = dict((k, int(v)) for k, v in _ATTR.findall(m.group(1)))
        if attrs.get("group") != group or "binding" not in attrs:
            continue
        template = [p.strip() for p in (m.group(2) or "").split(",")]
        space = template[0] if template[0] else "handle"
        access = (template[1] if len(template) > 1 else "read") if space == "storage" else None
        type_ = " ".join(m.group(4).split())
        scalar, size = _element(type_, aliases) if space != "handle" else (None, None)
        found[attrs["binding"]] = Binding(group, attrs["binding"], m.group(3), space, access, type_, scalar, size)
    return found


def _element(type_: str, aliases: dict[str, str]) -> tuple[str | None, int | None]:
    """(scalar, bytes) of one element of a storage buffer of ``type_``; (None, None) when unknown."""
    t = type_.replace(" ", "")
    for _ in range(32):  # aliases and wrappers, outermost first
        if t in aliases:
            t = aliases[t].replace(" ", "")
            continue
        m = re.fullmatch(r"array<(.+?)(?:,[^<>,]+)?>", t)
        if m:
            t = m.group(1)
            continue
        m = re.fullmatch(r"atomic<(\w+)>", t)
        if m:
            t = m.group(1)
            continue
        break
    t = aliases.get(t, t).replace(" ", "")
    m = re.fullmatch(r"vec([234])(?:<(\w+)>|([fiuh]))", t)
    if m:
        scalar = _resolve(m.group(2) or _SHORT[m.group(3)], aliases)
        if scalar is None:
            return None, None
        count = 4 if m.group(1) == "3" else int(m.group(1))  # vec3 is aligned like vec4
        return scalar, count * _SCALAR_BYTES[scalar]
    m = re.fullmatch(r"mat([234])x([234])(?:<(\w+)>|([fh]))", t)
    if m:
        scalar = _resolve(m.group(3) or _SHORT[m.group(4)], aliases)
        if scalar is None:
            return None, None
        rows = 4 if m.group(2) == "3" else int(m.group(2))
        return scalar, int(m.group(1)) * rows * _SCALAR_BYTES[scalar]
    scalar = _resolve(t, aliases)
    return (scalar, _SCALAR_BYTES[scalar]) if scalar is not None else (None, None)


def _resolve(name: str, aliases: dict[str, str]) -> str | None:
    for _ in range(32):
        if name in _SCALAR_BYTES:
            return name
        if name not in aliases:
            return None
        name = aliases[name].replace(" ", "")
    return None


def dtype_mismatch(b: Binding, dtype: Any) -> str | None:
    """The numpy dtype a storage binding needs where ``dtype`` does not fit it (see the module doc), else None."""
    if b.scalar is None or b.element_bytes is None:
        return None
    return _dtype_rule(b.scalar, b.element_bytes, dtype if isinstance(dtype, np.dtype) else np.dtype(dtype))


@lru_cache(maxsize=4096)  # called on every dispatch: a few (element, dtype) pairs recur
def _dtype_rule(scalar: str, element_bytes: int, dt: np.dtype[Any]) -> str | None:
    if dt.fields is not None or dt.kind == "V":
        return None
    want = NUMPY_OF[scalar]
    if scalar in ("f32", "f16"):
        return None if dt == np.dtype(want) else want
    if dt.itemsize == 0 or dt.hasobject or element_bytes % dt.itemsize:
        return want
    return None
