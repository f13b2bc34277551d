"""mpiexec's output, passed on to the user without MPICH's own notices about ending a job.

``meshkit-run`` reads what ``mpiexec`` writes (the ranks' output, which hydra forwards, and
hydra's own messages) and passes it on line by line, dropping two kinds of lines:

* always, hydra's notices about a job it ends, which say less than the launcher's own line
  naming the rank and how it ended, and which would otherwise follow every failed job:
  the ``BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES`` box (its rules, ``PID ...
  RUNNING AT``, ``EXIT CODE``, ``CLEANING UP``..., and the blank line before it), the
  three lines ``YOUR APPLICATION TERMINATED WITH THE EXIT STRING: ...`` / ``This typically
  refers to a problem with your application.`` / ``Please see the FAQ page ...``, and the
  Ctrl-C notices ``[mpiexec@host] Sending Ctrl-C to processes as requested`` / ``Press Ctrl-C
  again to force abort`` / ``Ctrl-C caught... cleaning up processes``;
* once the launcher is ending the job (a rank failed, a signal, ``--timeout``), what MPICH and
  hydra print because ranks are being killed: ``Assertion failed in file ... at line N: ...``,
  ``internal ABORT - process N``, the backtrace lines after them (``libmpi.so.12(+0x1234)
  [0x7f...]``), ``Fatal error in ...`` and its error-stack lines (``MPIR_Barrier(123)...: ...``),
  and ``[mpiexec@host]``/``[proxy:...]`` complaints about connections closing. Before that,
  such lines are real errors and pass.

Lines the ranks wrote through Python carry a ``[rank{r}]: `` prefix and always pass. Nothing
else is held back: a partial line goes out once the stream pauses for 0.1 s.
"""

from __future__ import annotations

import collections
import os
import re
import select
import threading
from typing import Callable

__all__ = ["OutputFilter", "RankTails", "start_pump"]

_IDLE_S = 0.1
_RANK_LINE = re.compile(rb"\[rank\d+\]: ")
_RANK_OF_LINE = re.compile(rb"\[rank(\d+)\]: ?(.*)")
_HYDRA_NOTICE = re.compile(
    rb"={20,}"
    rb"|=   (BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES|PID \d+ RUNNING AT \S+|EXIT CODE: \d+"
    rb"|CLEANING UP REMAINING PROCESSES|YOU CAN IGNORE THE BELOW CLEANUP MESSAGES)"
    rb"|YOUR APPLICATION TERMINATED WITH THE EXIT STRING: .*"
    rb"|This typically refers to a problem with your application\."
    rb"|Please see the FAQ page for debugging suggestions"
    rb"|\[mpiexec@[^\]]+\] (Sending Ctrl-C to processes as requested|Press Ctrl-C again to force abort"
    rb"|Ctrl-C caught\.\.\. cleaning up processes)"
)
_TEARDOWN_NOISE = re.compile(
    rb"Assertion failed in file .* at line \d+: .*"
    rb"|internal ABORT - process \d+.*"
    rb"|\S*\(\S*\+0x[0-9a-f]+\) ?\[0x[0-9a-f]+\]"
    rb"|Fatal error in .*"
    rb"|\w+\(\d+\)\.*: .*"
    rb"|\[(mpiexec|proxy:[\d:]+)@[^\]]+\] .*"
)
_LINE = re.compile(rb"[^\r\n]*(\r\n|\n|\r(?!$))")


class RankTails:
    """The last :attr:`keep` lines each rank printed (both streams), for a failure's report."""

    def __init__(self, keep: int = 10) -> None:
        self.keep = keep
        self._lines: dict[int, collections.deque[str]] = {}
        self._lock = threading.Lock()

    def add(self, line: bytes) -> None:
        """Record ``line`` if a rank wrote it (it carries the ``[rank{r}]: `` prefix)."""
        match = _RANK_OF_LINE.match(line.rstrip(b"\r\n"))
        if match is None:
            return
        rank, text = int(match.group(1)), match.group(2).decode("utf-8", "replace")
        with self._lock:
            self._lines.setdefault(rank, collections.deque(maxlen=self.keep)).append(text)

    def last(self, rank: int | None) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._lines.get(rank, ())) if rank is not None else ()


class OutputFilter:
    """Drops MPICH's notices from a stream of mpiexec's output (see the module docstring).

    Args:
        ending: returns True once the launcher is ending the job.
        tails: where the ranks' lines are recorded (every line, kept or dropped), or None.
    """

    def __init__(self, ending: Callable[[], bool], tails: RankTails | None = None) -> None:
        self._ending = ending
        self._tails = tails
        self._pending = b""  # a line not yet ended
        self._blank: list[bytes] = []  # blank lines held back: the last may open a BAD TERMINATION box
        self._after_blank = False  # the line before was blank

    def feed(self, data: bytes) -> bytes:
        """The part of ``data`` (and of what came before it) to pass on now."""
        data = self._pending + data
        out = []
        start = 0
        for match in _LINE.finditer(data):
            out.append(self._line(match.group()))
            start = match.end()
        self._pending = data[start:]
        return b"".join(out)

    def idle(self) -> bytes:
        """What to pass on when the stream has paused: the partial line, and held blank lines."""
        pending, self._pending = self._pending, b""
        text = self._line(pending) if pending else b""
        blank, self._blank = self._blank, []
        return b"".join(blank) + text

    def _line(self, line: bytes) -> bytes:
        text = line.rstrip(b"\r\n")
        if self._tails is not None:
            self._tails.add(text)
        after_blank, self._after_blank = self._after_blank, False
        if not text.strip() and line.endswith((b"\n", b"\r")):
            self._blank.append(line)
            self._after_blank = True
            return b""
        if not _RANK_LINE.match(text) and (
            _HYDRA_NOTICE.fullmatch(text.rstrip()) or (self._ending() and _TEARDOWN_NOISE.fullmatch(text.rstrip()))
        ):
            if text.startswith(b"====") and after_blank:  # the box's first rule: the blank line is the box's
                self._blank.pop()
            return b""
        blank, self._blank = self._blank, []
        return b"".join(blank) + line


def _write_all(fd: int, data: bytes) -> bool:
    """Write ``data`` to ``fd``; False once the reader is gone (a closed pipe)."""
    while data:
        try:
            written = os.write(fd, data)
        except OSError:
            return False
        data = data[written:]
    return True


def start_pump(source: int, target: int, keep: OutputFilter) -> threading.Thread:
    """Copy ``source`` to ``target`` through ``keep`` in a daemon thread, until end of file.

    Once ``target`` is closed the rest is read and dropped, so that mpiexec never blocks on a
    full pipe.
    """

    def pump() -> None:
        open_target = True
        while True:
            ready, _, _ = select.select([source], [], [], _IDLE_S)
            data = os.read(source, 65536) if ready else None
            out = keep.feed(data) if data else keep.idle()  # None (a pause) or b"" (the end)
            if open_target and out:
                open_target = _write_all(target, out)
            if data == b"":
                return

    thread = threading.Thread(target=pump, name=f"meshkit-run output {target}", daemon=True)
    thread.start()
    return thread
