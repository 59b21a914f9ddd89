"""Frames over a byte stream, for the links between ``hetero serve``'s front and engine processes.

A frame is ``u32 body length | u8 kind | body`` in the machine's byte order (both ends run on
it). :class:`FrameLink` gathers what is sent while its event loop runs and one writer task
writes it in one ``send``: the frames of one pass of the loop leave together, which keeps
the link's cost per request small when many requests are in flight. Subclasses queue their
own items and turn them into frames in :meth:`FrameLink.gather`, which the writer calls
before each write (and :meth:`FrameLink.send` before a frame of its own, so that frames keep
the order they were made in).
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import AsyncIterator

import anyio
import anyio.abc

from hetero.errors import HeteroError

__all__ = ["HEADER", "MAX_FRAME", "FrameLink"]

HEADER = struct.Struct("=IB")
RECEIVE_BYTES = 1 << 20
MAX_FRAME = 1 << 30  # the longest frame either side accepts: a link that announces more is not one of ours


class FrameLink:
    """Frames over one byte stream: ``send`` gathers them, :meth:`writer` writes what gathered in one call.

    ``name`` says which link an error is about (``"generation link: a frame of ..."``).
    """

    def __init__(self, stream: anyio.abc.ByteStream, name: str = "engine link") -> None:
        self.stream = stream
        self.name = name
        self.closed = False
        self._out = bytearray()
        self._wake = anyio.Event()

    def send(self, kind: int, *parts: bytes | memoryview) -> None:
        """Queue one frame (after what :meth:`gather` holds) and wake the writer."""
        self.gather()
        self.put(kind, *parts)
        self._wake.set()

    def put(self, kind: int, *parts: bytes | memoryview) -> None:
        """Append one frame to what the next write sends (the writer is not woken)."""
        self._out += HEADER.pack(sum(len(p) for p in parts), kind)
        for p in parts:
            self._out += p

    def wake(self) -> None:
        """Have the writer run soon (a subclass queued an item of its own)."""
        self._wake.set()

    def gather(self) -> None:
        """Put the frames made of the items a subclass queued since the last write."""

    async def writer(self) -> None:
        """Write what gathered since the last write, until the stream breaks or closes."""
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            while True:
                await self._wake.wait()
                self._wake = anyio.Event()
                self.gather()
                data, self._out = self._out, bytearray()
                if data:
                    await self.stream.send(bytes(data))

    async def frames(self, first_limit: int = MAX_FRAME) -> AsyncIterator[tuple[int, bytes]]:
        """``(kind, body)`` of each frame received, until the other side closes (then it returns).

        A frame longer than :data:`MAX_FRAME` bytes (the first one: ``first_limit``) is a
        HeteroError: the link is broken or not one of this server's.
        """
        buf = bytearray()
        limit = first_limit
        while True:
            try:
                buf += await self.stream.receive(RECEIVE_BYTES)
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                return
            pos = 0
            while len(buf) - pos >= HEADER.size:
                size, kind = HEADER.unpack_from(buf, pos)
                if size > limit:
                    raise HeteroError(f"{self.name}: a frame of {size} bytes, more than the {limit} allowed")
                limit = MAX_FRAME
                end = pos + HEADER.size + size
                if end > len(buf):
                    break
                yield kind, bytes(buf[pos + HEADER.size:end])
                pos = end
            del buf[:pos]
