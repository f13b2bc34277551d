"""Ending the whole job: the policy both ways meshkit ends a job go through.

:func:`tear_down` ends it when device work failed after its ``Work.wait()`` had returned (the
progress agent's watchdog, :meth:`~meshkit.comm.work.RequestWork.watchdog`); the MPI excepthook of
:mod:`~meshkit.comm.lifecycle` ends it on an uncaught exception. Both go through
:func:`abort_job`, the default engine's ``abort`` (MPI_Abort) where it has one
(``capabilities.aborts_job``).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from . import env

__all__ = ["abort_job", "tear_down", "ASYNC_ERROR_HANDLING_ENV"]

logger = logging.getLogger("meshkit")

#: What the watchdog does when device work fails after its ``Work.wait()`` returned (the caller
#: may already have used the unreduced buffer): ``abort`` (default) ends the whole job, as torch
#: does by default (``TORCH_NCCL_ASYNC_ERROR_HANDLING``: a silently wrong result is worse than a
#: crash); ``log`` only logs it, keeps it on ``Work.exception()`` and breaks the group.
ASYNC_ERROR_HANDLING_ENV = env.ASYNC_ERROR_HANDLING


def abort_job(world: Any, announce: str | None = None) -> None:
    """Flush this rank's output, then end the whole job through the default engine's ``abort``
    (MPI_Abort), printing ``announce`` to stderr first if given; return if the engine cannot
    (``capabilities.aborts_job`` False: the local engine's ranks are threads)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed stream must not stop the abort
            pass
    engine = world.default_group.engine
    if engine is not None and engine.capabilities.aborts_job:
        if announce is not None:
            print(announce, file=sys.stderr, flush=True)
        engine.abort(1)


def tear_down(world: Any, reason: str) -> None:
    """End the whole job now: the default engine's abort (MPI_Abort), else this process."""
    logger.critical("meshkit: rank %s: %s; ending the job (set %s=log to only log this)", world.rank, reason,
                    ASYNC_ERROR_HANDLING_ENV)
    try:
        abort_job(world)
    finally:
        os._exit(1)
