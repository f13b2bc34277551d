"""Reusable flat buffers for buckets that hold a buffer only while they are filled and reduced.

ZeRO-2 keeps no full-size gradients: a bucket takes a buffer from the pool when one of its
gradients is first used and gives it back once its reduction has finished. At most ``limit``
buckets hold buffers at once (2: one being filled while the previous one is reduced, so
communication still overlaps the backward pass); a bucket that needs one beyond that waits for
the oldest launched holder's reduction first. Buckets that were not launched (inside
``no_sync()``, where micro-batches must add up first) keep theirs and do not count against it.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["BufferPool"]


class Bucket(Protocol):
    """What the pool uses of a bucket (buckets.Bucket; declared here so that the two modules do
    not import each other)."""

    size: int
    dtype: Any
    buffer: Any
    launched: bool

    def wait(self) -> None: ...


class BufferPool:
    """Flat buffers per dtype, handed to buckets and taken back.

    A request takes the smallest free buffer that fits it, else a new one of exactly its size,
    so a small bucket never costs a large buffer.

    Args:
        xp: the array library buffers are made with (``numpy`` or ``cupy``).
        limit: buckets that may hold a buffer before a new one waits for a reduction.

    Attributes:
        nbytes: bytes of every buffer ever made (the pool's footprint).
        live, peak_live: bytes handed out now, and the most ever handed out at once.
    """

    def __init__(self, xp: Any, limit: int = 2) -> None:
        self._xp, self.limit = xp, limit
        self._free: dict[Any, list[Any]] = {}
        self._holders: list[Bucket] = []
        self.nbytes = self.live = self.peak_live = 0

    def _fits(self, size: int, dtype: Any) -> bool:
        return any(buf.size >= size for buf in self._free.get(dtype, ()))

    def attach(self, bucket: Bucket) -> None:
        """Give ``bucket`` a zeroed buffer of its size, waiting for a reduction if ``limit`` buckets hold one."""
        while not self._fits(bucket.size, bucket.dtype) and len(self._holders) >= self.limit:
            oldest = next((b for b in self._holders if b.launched), None)
            if oldest is None:
                break  # no reduction to wait for: the holders are still being filled
            oldest.wait()  # gives its buffer back
        free = self._free.setdefault(bucket.dtype, [])
        fits = [i for i, buf in enumerate(free) if buf.size >= bucket.size]
        if fits:
            buf = free.pop(min(fits, key=lambda i: free[i].size))
        else:
            buf = self._xp.empty(bucket.size, dtype=bucket.dtype)
            self.nbytes += int(buf.nbytes)
        self.live += int(buf.nbytes)
        self.peak_live = max(self.peak_live, self.live)
        view = buf[:bucket.size]
        view[...] = 0
        bucket.buffer = view
        self._holders.append(bucket)

    def release(self, bucket: Bucket) -> None:
        """Take ``bucket``'s buffer back (after its reduction finished)."""
        view = bucket.buffer
        if view is None:
            return
        buf = view.base if view.base is not None else view
        self.live -= int(buf.nbytes)
        self._free.setdefault(buf.dtype, []).append(buf)
        bucket.buffer = None
        self._holders.remove(bucket)
