"""Building blocks of the register-tiled matmul kernels, shared by the float32 and int8 generators.

A thread computes a ``(4*gm) x (4*gn)`` block of C in named vec4 accumulators
``c{r}_{h}``; the blocks here emit the K loop over workgroup-memory slices, the
per-k fragment loads and FMAs, and the guarded store.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

__all__ = ["XYZW", "emit_block", "emit_k_loop", "emit_store", "fma_rows", "fragments", "guard_slot"]

XYZW = "xyzw"
"""Swizzle letters of vec4 lanes 0..3."""


def emit_block(emit: Callable[[str], Any], lines: Iterable[str], indent: int) -> None:
    """Emit ``lines``, each indented by ``indent`` spaces."""
    pad = " " * indent
    for line in lines:
        emit(pad + line)


def guard_slot(i: int, nt: int, count: int, body: list[str]) -> list[str]:
    """``body`` for tile slot ``i`` of ``nt`` threads, guarded when the tile's ``count``
    elements end inside the slot (a tile smaller than a multiple of the threads)."""
    if (i + 1) * nt > count:
        return [f"if ((tid + {i * nt}u) < {count}u) {{"] + ["    " + s for s in body] + ["}"]
    return body


def fragments(buf: int, k: int, gm: int, gn: int, rsa4: int, rsb4: int, ty_n: int, tx_n: int) -> list[str]:
    """The thread's vec4s of K row ``k`` of the shared tiles: ``a{g}`` of As, ``b{h}`` of Bs."""
    return ([f"    let a{g} = As{buf}[{k * rsa4 + g * ty_n}u + ty];" for g in range(gm)]
            + [f"    let b{h} = Bs{buf}[{k * rsb4 + h * tx_n}u + tx];" for h in range(gn)])


def fma_rows(g: int, gn: int) -> list[str]:
    """Accumulate the outer product of ``a{g}`` (rows 4g..4g+3) and every ``b{h}`` in float32."""
    out: list[str] = []
    for i in range(4):
        r = g * 4 + i
        out.append(f"    let s{r} = vec4<f32>(a{g}.{XYZW[i]});")
        out += [f"    c{r}_{h} = fma(s{r}, b{h}, c{r}_{h});" for h in range(gn)]
    return out


def emit_store(emit: Callable[[str], Any], gm: int, gn: int, ty_n: int, tx_n: int,
               tile: Callable[[int, int], list[str]], row: Callable[[int], list[str]] = lambda r: []) -> None:
    """The store of a thread's (4*gm) x (4*gn) block, shared by the fp32 and int8 kernels.

    Result row ``r = g*4 + i`` is ``m0 + g*4*TY + 4*ty + i`` (skipped past ``p.M``, after
    the lines ``row(r)``); each column group ``h`` gets a scope with ``col`` =
    ``n0 + h*4*TX + 4*tx`` and the lines ``tile(r, h)``, which hold its 4 columns in
    accumulator ``r, h``.
    """
    for g in range(gm):
        for i in range(4):
            r = g * 4 + i
            emit(f"    let row{r} = m0 + {g * 4 * ty_n + i}u + ty * 4u;")
            emit(f"    if (row{r} < p.M) {{")
            emit_block(emit, row(r), 8)
            for h in range(gn):
                emit(f"        {{ let col = n0 + {h * 4 * tx_n}u + tx * 4u;")
                emit_block(emit, tile(r, h), 10)
                emit("        }")
            emit("    }")


def emit_k_loop(emit: Callable[[str], Any], double_buffer: bool, next_k: Callable[[str], str],
                load_all: Callable[[str], Iterable[str]], compute: Callable[[int], Iterable[str]],
                store_all: Callable[[int], Iterable[str]]) -> None:
    """Emit the K loop shared by the matmul generators (fp32 here, int8 in ``matmul_int8``).

    Before it: slice 0 is loaded into registers and ``t`` is 0. ``next_k(t)`` is the WGSL
    expression of the next slice's first k; ``load_all(k)`` loads a slice into registers,
    ``store_all(buf)`` moves them into workgroup buffer ``buf``, ``compute(buf)``
    multiplies out of it. Double-buffered: the next slice loads while this one is used,
    one barrier per slice.
    """
    if double_buffer:
        emit_block(emit, store_all(0), 4)
        emit("    workgroupBarrier();")
        emit("    loop {")
        for cur, nxt in ((0, 1), (1, 0)):
            emit("        if (t >= nt) { break; }")
            emit(f"        let k1_{cur} = {next_k('t')};")
            emit_block(emit, load_all(f"k1_{cur}"), 8)  # the next slice (zeros past the end)
            emit_block(emit, compute(cur), 8)
            emit_block(emit, store_all(nxt), 8)
            emit("        workgroupBarrier();")
            emit("        t = t + 1u;")
        emit("    }")
    else:
        emit("    loop {")
        emit("        if (t >= nt) { break; }")
        emit_block(emit, store_all(0), 8)
        emit("        workgroupBarrier();")
        emit(f"        let k1 = {next_k('t')};")
        emit_block(emit, load_all("k1"), 8)
        emit_block(emit, compute(0), 8)
        emit("        workgroupBarrier();")
        emit("        t = t + 1u;")
        emit("    }")
