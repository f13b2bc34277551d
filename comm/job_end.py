"""Ending the whole job: the policy both ways meshkit ends a job go through.

:func:`tear_down` ends it when device work failed after its ``Work.wait()`` had returned (the
progress agent's watchdog, :meth:`~meshkit.comm.groups.work.RequestWork.watchdog`); the MPI excepthook of
:mod:`~meshkit.comm.setup.lifecycle` ends it on an uncaught exception. Both go through
:func:`abort_job`, the default engine's ``abort`` (MPI_Abort) where it has one
(``capabilities.aborts_job``).
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
import sys
import termios
import time
from typing import Any

from . import env
from .milestones import report_failure

__all__ = ["abort_job", "tear_down", "end_hung", "drain_output", "ASYNC_ERROR_HANDLING_ENV", "DRAIN_SECONDS",
           "HUNG_EXIT_CODE"]

logger = logging.getLogger("meshkit")

#: What the watchdog does when device work fails after its ``Work.wait()`` returned (the caller
#: may already have used the unreduced buffer): ``abort`` (default) ends the whole job, as torch
#: does by default (``TORCH_NCCL_ASYNC_ERROR_HANDLING``: a silently wrong result is worse than a
#: crash); ``log`` only logs it, keeps it on ``Work.exception()`` and breaks the group.
ASYNC_ERROR_HANDLING_ENV = env.ASYNC_ERROR_HANDLING


#: Seconds an ending rank waits for the process reading its output (hydra's proxy, under plain
#: ``mpiexec``) to take what it wrote before MPI_Abort. The proxy reads a rank's pipes and its
#: PMI socket in one event loop: when the abort and the traceback are both pending (a loaded
#: machine, where the proxy did not run between the write and the abort), it may handle the
#: abort first, and the job is killed with the traceback still in the pipe: the job ended with
#: an empty stderr once in 4 loaded runs, and every time with the proxy stopped
#: across the abort (tests/test_notices.py). A proxy that runs takes a pipe within milliseconds;
#: the bound is for one that never reads (output to a file or a terminal is not waited for).
DRAIN_SECONDS = 2.0
#: Seconds between looks at what the reader has not taken yet.
_DRAIN_POLL = 0.002


def _unread(fd: int) -> int:
    """Bytes written to pipe ``fd`` that its reader has not taken (0: not a pipe, or unknown)."""
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return 0
        return int.from_bytes(fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"), sys.byteorder)
    except (OSError, ValueError):
        return 0


def drain_output(limit: float = DRAIN_SECONDS) -> None:
    """Flush ``sys.stdout``/``sys.stderr``, then wait (at most ``limit`` s) until the process
    reading them through a pipe has taken every byte: before MPI_Abort, so that what this rank
    printed last (its traceback) is not lost when the process manager kills the job."""
    fds = []
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
            fds.append(stream.fileno())
        except Exception:  # a closed or replaced stream must not stop the abort
            pass
    deadline = time.monotonic() + limit
    while any(_unread(fd) for fd in fds) and time.monotonic() < deadline:
        time.sleep(_DRAIN_POLL)


def abort_job(world: Any, announce: str | None = None) -> None:
    """Flush this rank's output and let its reader take it (:func:`drain_output`), then end the
    whole job through the default engine's ``abort`` (MPI_Abort), printing ``announce`` to stderr
    first if given; return if the engine cannot (``capabilities.aborts_job`` False: the local
    engine's ranks are threads)."""
    engine = world.default_group.engine
    if engine is not None and engine.capabilities.aborts_job:
        if announce is not None:
            print(announce, file=sys.stderr, flush=True)
        drain_output()
        engine.abort(1)
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed stream must not stop the abort
            pass


#: The exit status of a process its watchdog ended (comm/engines/watchdog.py): a call that never returned.
HUNG_EXIT_CODE = 1


def end_hung(reason: str) -> None:
    """End this process now: a call into the engine's library did not return within its timeout
    (``reason`` says which; comm/engines/watchdog.py). Called from the watchdog's thread while another
    thread is inside that call, so MPI is not called (MPI_Abort could wait for the lock the
    stuck call holds): ``reason`` goes to stderr, ``meshkit-run`` is told that this rank hung
    (its status directory: the launcher names it as the job's cause), the output is drained and
    the process exits, which ends the job (mpiexec kills the others when one exits unfinalized)."""
    logger.critical("%s", reason)
    print(reason, file=sys.stderr, flush=True)
    report_failure(HUNG_EXIT_CODE, "hung")
    drain_output()
    os._exit(HUNG_EXIT_CODE)


def tear_down(world: Any, reason: str) -> None:
    """End the whole job now: the default engine's abort (MPI_Abort), else this process."""
    logger.critical("meshkit: rank %s: %s; ending the job (set %s=log to only log this)", world.rank, reason,
                    ASYNC_ERROR_HANDLING_ENV)
    try:
        abort_job(world)
    finally:
        os._exit(1)
