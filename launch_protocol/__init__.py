"""The names ``meshkit-run`` and its ranks talk by: environment variables, status files, milestones.

The launcher (:mod:`meshkit.launch`) and the ranks (the rank bootstrap, :mod:`meshkit.comm`'s
milestones and environment, :mod:`meshkit.elastic`) must spell every one of these the same way; they
are written here once, and every side imports them from here.

This package imports only the standard library (and nothing imports it but those sides), because of
who reads it: ``launch`` and ``elastic`` import nothing else of meshkit, and the rank bootstrap runs
by path, before the user's script, so it loads this file by path too
(:func:`meshkit.launch.bootstrap` ``_load_protocol``) without importing ``meshkit`` (and NumPy).

The status directory's files (one small file per event, ``{name}.{rank}`` for the per-rank ones)
are described in :mod:`meshkit.launch.bootstrap`.
"""

from __future__ import annotations

__all__ = [
    "STATUS_DIR_ENV", "LAUNCHER_ENV", "LAUNCHER_START_ENV", "LAUNCHED_ENV", "WORLD_SIZE_ENV", "SIMULATED_NODES_ENV",
    "HOST_NAME_ENV", "JOB_SECRET_ENV", "RESTART_COUNT_ENV", "MAX_RESTARTS_ENV", "MIN_NPROC_ENV", "MAX_NPROC_ENV",
    "RESTART_ENV", "SURVIVE_ENV", "SPARES_ENV", "START", "FAILED", "ENDED", "RELEASE", "TIMED_OUT", "FINISHED", "MILESTONE", "SHM_RECORD", "GONE",
    "IMPORTED", "RENDEZVOUS", "RESTORED", "FIRST_STEP", "MILESTONES", "milestone_file", "SURVIVED", "survived_file",
]

# ---- environment variables the launcher sets for every rank --------------------------------------

#: The status directory (a folder the launcher made, mode 0700).
STATUS_DIR_ENV = "MESHKIT_LAUNCH_STATUS_DIR"
#: "HOST PID" of the launcher: ranks on another host (which cannot see its folder, or see it
#: through a shared file system) and watchers whose launcher is gone do not wait for it. Readers
#: take the host as everything before the last space: keep two fields.
LAUNCHER_ENV = "MESHKIT_LAUNCHER"
#: The launcher's start time, field 22 of ``/proc/PID/stat`` (clock ticks since boot): a process
#: with the launcher's pid and another start time is another process that reused the pid.
LAUNCHER_START_ENV = "MESHKIT_LAUNCHER_START"
#: ``1``: the rank was started by ``meshkit-run`` (or ``meshkit.spawn``).
LAUNCHED_ENV = "MESHKIT_LAUNCHED"
#: The number of ranks the launcher started (read where no process manager announces it).
WORLD_SIZE_ENV = "MESHKIT_WORLD_SIZE"
#: ``K``: the launcher's ``--simulate-nodes K``: ranks form K simulated nodes of this machine.
SIMULATED_NODES_ENV = "MESHKIT_SIMULATED_NODES"
#: The host name a rank reports in place of the machine's (set per rank with ``--simulate-nodes``).
HOST_NAME_ENV = "MESHKIT_HOST_NAME"
#: The job's secret (docs/security.md), generated per job unless the user set it.
JOB_SECRET_ENV = "MESHKIT_JOB_SECRET"
#: Under ``--max-restarts``: restarts before this attempt (0 on the first, as torchrun's
#: ``TORCHELASTIC_RESTART_COUNT``), the job's ``--max-restarts``, and ``-n MIN:MAX``'s bounds.
RESTART_COUNT_ENV, MAX_RESTARTS_ENV = "MESHKIT_RESTART_COUNT", "MESHKIT_MAX_RESTARTS"
MIN_NPROC_ENV, MAX_NPROC_ENV = "MESHKIT_MIN_NPROC", "MESHKIT_MAX_NPROC"
#: ``K``: the launcher's ``--survive K``: the job runs on MPI's fault tolerance (ULFM) and its
#: survivors carry on after up to K rank failures (docs/elastic.md "Surviving failures").
SURVIVE_ENV = "MESHKIT_SURVIVE"
#: ``N``: the launcher's ``--spares N`` (with ``--survive``): the last N processes of the job wait,
#: started and imported, and take a failed rank's place (docs/elastic.md "Spares").
SPARES_ENV = "MESHKIT_SPARES"
#: What every rank of an attempt is told (read by :mod:`meshkit.elastic`), in this order.
RESTART_ENV = (RESTART_COUNT_ENV, MAX_RESTARTS_ENV, MIN_NPROC_ENV, MAX_NPROC_ENV)

# ---- files of the status directory ---------------------------------------------------------------

#: Names of the status files (``{name}.{rank}`` for the per-rank ones).
START, FAILED, ENDED, RELEASE, TIMED_OUT = "start", "failed", "ended", "release", "timed-out"
#: The rank's script is over (returned, or sys.exit(0)); the interpreter is shutting down (atexit
#: handlers, MPI_Finalize). Written before shutdown, so the launcher can tell a rank that is still
#: working from one stuck in MPI_Finalize waiting for ranks that left without it.
FINISHED = "finished"
#: ``milestone-{name}.{rank}``: the rank passed a point of a (re)start that the launcher times.
MILESTONE = "milestone"
#: The launcher's record of the MPICH shared-memory files the ranks hold.
SHM_RECORD = "shm"
#: ``gone.{rank}``: the launcher died and this rank's watcher has killed its rank.
GONE = "gone"

# ---- milestones ----------------------------------------------------------------------------------

#: The milestones the launcher times, in the order a restarted job passes them: the ``meshkit``
#: package imported, ``init_process_group``'s rendezvous, a checkpoint restored, the first step.
IMPORTED, RENDEZVOUS, RESTORED, FIRST_STEP = "imported", "rendezvous", "restored", "first_step"
MILESTONES = (IMPORTED, RENDEZVOUS, RESTORED, FIRST_STEP)


def milestone_file(name: str) -> str:
    """The status file's name (before ``.{rank}``) that says a rank passed milestone ``name``."""
    return f"{MILESTONE}-{name}"


# ---- survived failures (--survive) ----------------------------------------------------------------

#: ``survived-{n}.{rank}``: rank ``rank`` (as launched) recovered from the job's n-th survived failure
#: (n from 1): one line of wall-clock times in ns, ``detected agreed shrunk rebuilt redone``, then the
#: step redone and the lost ranks (as launched, comma-separated); ``redone`` is 0 until the rank's next
#: optimizer step after the recovery, when the file is written again (:mod:`meshkit.comm.milestones`).
SURVIVED = "survived"


def survived_file(n: int) -> str:
    """The status file's name (before ``.{rank}``) of a rank's recovery from survived failure ``n``."""
    return f"{SURVIVED}-{int(n)}"
