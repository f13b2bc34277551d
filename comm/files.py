"""Reading back a file that a job wrote, when someone else may have put something else there.

A reader of a trace folder or a checkpoint meets whatever is at the path: a FIFO (which would
block an ``open``), ``/dev/zero`` or a symlink to it (which never ends), a file of gigabytes. It
takes regular files only, opened without blocking, and reads no further than a bound:
:func:`read_bounded` raises :class:`NotRegular` or :class:`TooLarge`, and each reader turns them
into its own error (debug/divergence.py, checkpoint/format.py).
"""

from __future__ import annotations

import os
import stat

__all__ = ["NotRegular", "TooLarge", "file_kind", "check_regular", "open_regular", "read_bounded"]


class NotRegular(ValueError):
    """The path names something that is not a regular file; ``kind`` says what."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


class TooLarge(ValueError):
    """The file holds more than the reader's bound."""


def file_kind(mode: int) -> str | None:
    """None for a regular file, else what ``mode`` says it is (``"a FIFO"``, ...)."""
    if stat.S_ISREG(mode):
        return None
    return ("a FIFO" if stat.S_ISFIFO(mode) else "a character device" if stat.S_ISCHR(mode) else
            "a block device" if stat.S_ISBLK(mode) else "a directory" if stat.S_ISDIR(mode) else
            "a socket" if stat.S_ISSOCK(mode) else "not a file")


def check_regular(mode: int) -> None:
    """NotRegular unless ``mode`` is a regular file's."""
    kind = file_kind(mode)
    if kind is not None:
        raise NotRegular(kind)


def open_regular(path: str | os.PathLike) -> int:
    """A descriptor of the regular file at ``path`` (a symlink followed to one), checked before and
    after opening it without blocking (``O_NONBLOCK``: a FIFO swapped in between does not wait for
    a writer). Raises NotRegular, FileNotFoundError or OSError."""
    check_regular(os.stat(path).st_mode)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        check_regular(os.fstat(fd).st_mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_bounded(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of the regular file at ``path``, at most ``limit`` of them (a file that grows
    while it is read is refused too). Raises NotRegular, TooLarge, FileNotFoundError or OSError."""
    fd = open_regular(path)
    try:
        if os.fstat(fd).st_size > limit:
            raise TooLarge(limit)
        parts, size, want = [], 0, os.fstat(fd).st_size + 1  # a read allocates what it asks for: ask for the size
        while size <= limit:
            part = os.read(fd, min(want, limit + 1 - size))
            want = 1 << 16
            if not part:
                break
            parts.append(part)
            size += len(part)
        if size > limit:
            raise TooLarge(limit)
        return b"".join(parts)
    finally:
        os.close(fd)
