"""``meshkit-run``: start N ranks of a script under ``mpiexec``, with rank-tagged output.

``meshkit-run -n 4 train.py ARGS`` (or ``python -m meshkit.launch -n 4 train.py ARGS``) starts
4 ranks, prefixes every line they print with ``[rank{r}]: ``, ends the whole job when one rank
fails (after every rank failing with it has printed its traceback), names a rank that died
without one, and exits with the status of the first rank to fail.

The launcher is its own package: it imports nothing of :mod:`meshkit.comm` (it must not
initialize MPI in the launcher process), and nothing in comm imports it. The ranks run
:mod:`meshkit.launch.bootstrap` by path, importing only the standard library (and
:mod:`meshkit.launch_protocol`, the names the launcher and the ranks share, loaded by path).

Modules: :mod:`~meshkit.launch.cli` (the command line), :mod:`~meshkit.launch.job` (running and
ending a job), :mod:`~meshkit.launch.output` (mpiexec's output), :mod:`~meshkit.launch.bootstrap`
(the rank side), :mod:`~meshkit.launch.mpich_tuning` (MPICH's collective selection),
:mod:`~meshkit.launch.spawn` and :mod:`~meshkit.launch.spawn_rank` (``meshkit.spawn``: torch's
``spawn(fn, args, nprocs)`` over the same job), :mod:`~meshkit.launch.restarts` (``--max-restarts``:
a failed job restarted, the way back timed), :mod:`~meshkit.launch.slots` (``-n MIN:MAX``,
``--slots``, ``--hostfile``), :mod:`~meshkit.launch.fault_tolerant` (``--survive``: Open MPI's
ULFM), :mod:`~meshkit.launch.survived` (``--survive``'s report of each failure survived, by phase) and
:mod:`~meshkit.launch.secret` (the job's secret).

Modules: ``cli.py`` (the flags), ``job.py`` (the mpiexec job, exit codes), ``output.py`` (rank
prefixes), ``bootstrap.py`` (what each rank runs first), ``mpich_tuning.py``, ``__main__.py``
(``python -m meshkit.launch``), ``spawn.py``/``spawn_rank.py`` (``meshkit.spawn`` over the same job),
``restarts.py`` (``--max-restarts``), ``slots.py`` (``-n MIN:MAX``, host files), ``secret.py`` (the
job's secret), ``deathsig.py`` (mpiexec dies with the launcher), ``fault_tolerant.py`` (``--survive``),
``survived.py`` (``--survive-report``: each survived failure, by phase).
"""

import sys
import warnings
from importlib import import_module
from typing import Any

from .cli import allocator_settings, find_mpiexec, main, thread_limits
from .job import LaunchConfigError, LaunchError
from .spawn import ProcessException, ProcessExitedException, ProcessRaisedException, SpawnContext, spawn

__all__ = ["main", "find_mpiexec", "thread_limits", "allocator_settings", "LaunchError", "LaunchConfigError", "spawn",
           "SpawnContext", "ProcessException", "ProcessRaisedException", "ProcessExitedException"]

#: Constants that were in ``__all__`` in 0.1 (the package exports no constants: the protocol's names are
#: :mod:`meshkit.launch_protocol`'s, the launcher's own settings its modules'): importable from here for one
#: more release, with a warning naming their module.
_MOVED = {"ALLOCATOR_ENV": "meshkit.launch.cli", "THREAD_ENV_VARS": "meshkit.launch.cli",
          "FAILURE_SETTLE_S": "meshkit.launch.job", "KILL_GRACE_S": "meshkit.launch.job",
          "TIMEOUT_EXIT_CODE": "meshkit.launch.job", "JOB_SECRET_ENV": "meshkit.launch_protocol"}


def __getattr__(name: str) -> Any:
    """The names of :data:`_MOVED`, with a DeprecationWarning (as ``meshkit.comm._seams.moved_names``
    does for the other packages; launch imports nothing of comm)."""
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    new = _MOVED[name]
    if sys._getframe(1).f_code.co_name != "_handle_fromlist":  # a from-import asks twice: warn once
        warnings.warn(f"{__name__}.{name} is not public API and goes in the next release: import it from {new} "
                      f"({new}.{name})", DeprecationWarning, stacklevel=2)
    return getattr(import_module(new), name)
