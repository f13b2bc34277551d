"""``breakpoint(rank)``: a pdb session on one rank while every other rank waits for it.

As torch's ``torch.distributed.breakpoint``: the chosen rank stops in ``pdb`` at the caller's
next line; every other rank waits in a barrier of the world group that has **no deadline** (a
debugging session takes as long as it takes; the group's timeout does not apply), and is released
when the debugged rank resumes (``c``, ``n``, ``s``, ``r``, ``unt``, ``q``). The wait still reads
notices, so a debugged rank that fails or leaves ends the others' wait at once.

Where pdb reads its commands: ``/dev/tty``, the terminal of the job, where it can be opened
(plain ``mpiexec`` or ``srun --pty`` in a terminal, a local job); else the rank's standard input
and output: ``meshkit-run`` starts ``mpiexec`` in a session of its own (it must signal the whole
job), so its ranks have no terminal, and ``mpiexec`` forwards the launcher's standard input to
rank 0 only, so under ``meshkit-run`` pdb runs on rank 0 and reads what is typed into the
launcher (its prompt and answers come back through the launcher's rank-tagged output). Another
rank there, or a rank whose input is ``/dev/null``, cannot be debugged: every rank raises, saying so.
"""

from __future__ import annotations

import io
import math
import os
import pdb
import stat
import sys
from typing import IO, Any, Callable

from . import env
from .errors import DistError, DistTypeError, DistValueError
from .groups.world import current_world

__all__ = ["breakpoint"]


def _terminal(rank: int, backend: str) -> tuple[IO[str], IO[str]] | str:
    """``(input, output)`` for pdb on this rank, or why there is none."""
    try:
        return open("/dev/tty"), open("/dev/tty", "w")  # noqa: SIM115 (they live as long as the session)
    except OSError as exc:
        why = f"/dev/tty cannot be opened ({exc.strerror})"
    if rank != 0 and backend != "local" and env.launched():
        # mpiexec (hydra) gives every rank a pipe for stdin but writes the launcher's input to
        # rank 0's only: pdb on another rank would wait for input forever (seen).
        return f"{why} and under meshkit-run only rank 0 receives the launcher's input"
    stdin = sys.stdin
    try:
        fd = stdin.fileno()
        info = os.fstat(fd)
        null = os.stat(os.devnull)
        if stat.S_ISCHR(info.st_mode) and info.st_rdev == null.st_rdev:
            return f"{why} and its standard input is {os.devnull}"
    except (AttributeError, ValueError, OSError, io.UnsupportedOperation):
        return f"{why} and it has no standard input"
    return stdin, sys.stdout


class _RankPdb(pdb.Pdb):
    """pdb that calls ``release`` once, the first time the session resumes the program."""

    def __init__(self, release: Callable[[], None], stdin: IO[str], stdout: IO[str]) -> None:
        super().__init__(stdin=stdin, stdout=stdout)
        self._release: Callable[[], None] | None = None
        self._pending_release = release

    def set_trace(self, frame: Any = None, **kwargs: Any) -> None:
        super().set_trace(frame, **kwargs)  # calls set_step: not a resumption yet
        # Armed here, in a frame started before tracing was (it has no trace function): armed
        # in a new call after it, pdb would stop in that call instead of the caller.
        self._release = self._pending_release

    def _resume(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()

    def set_continue(self) -> None:
        self._resume()
        super().set_continue()

    def set_step(self) -> None:
        self._resume()
        super().set_step()

    def set_next(self, frame: Any) -> None:
        self._resume()
        super().set_next(frame)

    def set_return(self, frame: Any) -> None:
        self._resume()
        super().set_return(frame)

    def set_until(self, frame: Any, lineno: int | None = None) -> None:
        self._resume()
        super().set_until(frame, lineno)

    def set_quit(self) -> None:
        self._resume()
        super().set_quit()


def _wait_for_all(group: Any, problem: str | None) -> None:
    """The barrier of the world group with no deadline (``math.inf``), carrying the debugged
    rank's problem, if it had one, so that every rank raises it."""
    told = group.queue.blocking("breakpoint",
                                lambda seq, deadline: group.engine.exchange(problem, seq, deadline, watched=True),
                                math.inf)
    problems = [p for p in told if p]
    if problems:
        raise DistError(problems[0])


def breakpoint(rank: int = 0, skip: int = 0) -> None:  # noqa: A001 (torch.distributed's name)
    """Stop rank ``rank`` in ``pdb`` at the caller's next line; every other rank waits for it.

    Collective over the world: every rank calls it. The other ranks wait without a deadline
    (the group's timeout does not apply) until the debugged rank resumes with ``c`` (or ``n``,
    ``s``, ``r``, ``unt``, ``q``). pdb reads ``/dev/tty`` where it can be opened, else the rank's
    standard input: under ``meshkit-run``, only rank 0 has one (see the module docstring).

    Args:
        rank: the global rank that runs pdb.
        skip: frames to skip above the caller (for a helper that wraps this function).

    Raises:
        DistValueError: ``rank`` or ``skip`` out of range (on every rank, before anything waits).
        DistError: the debugged rank has no terminal and no standard input (raised on every rank).

    Example (under ``meshkit-run -n 2``)::

        x = compute()
        meshkit.breakpoint(rank=0)   # rank 0: (Pdb) p x ... c; rank 1 waits, however long
    """
    world = current_world()
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise DistTypeError(f"meshkit.comm: rank {world.rank}: breakpoint: rank must be an int, got "
                            f"{type(rank).__name__} {rank!r}")
    if not 0 <= rank < world.size:
        raise DistValueError(f"meshkit.comm: rank {world.rank}: breakpoint: rank={rank} is out of range for a world "
                             f"of size {world.size} (valid: 0..{world.size - 1})")
    if isinstance(skip, bool) or not isinstance(skip, int) or skip < 0:
        raise DistValueError(f"meshkit.comm: rank {world.rank}: breakpoint: skip must be an int >= 0, got {skip!r}")
    group = world.default_group
    if world.rank != rank:
        _wait_for_all(group, None)
        return
    streams = _terminal(rank, world.backend)
    if isinstance(streams, str):
        _wait_for_all(group, f"meshkit.comm: breakpoint(rank={rank}): rank {rank} has no terminal for pdb: "
                             f"{streams}: use breakpoint(rank=0) under meshkit-run, or run the job in a terminal "
                             "(plain mpiexec, srun --pty) where each rank can open /dev/tty")
        return
    debugger = _RankPdb(lambda: _wait_for_all(group, None), *streams)
    debugger.message(f"meshkit: rank {rank} stopped in pdb; the other {world.size - 1} rank(s) wait until it "
                     "resumes (c, n, s, r, unt or q)")
    debugger.set_trace(sys._getframe(1 + skip))  # the last statement: pdb stops at the caller's next line
