"""``meshkit-run``: start N ranks of a script under ``mpiexec``, with rank-tagged output.

``meshkit-run -n 4 train.py ARGS`` (or ``python -m meshkit.launch -n 4 train.py ARGS``) starts
4 ranks, prefixes every line they print with ``[rank{r}]: `` and ends the whole job when one
rank fails.

The launcher is its own package: it imports nothing of :mod:`meshkit.comm` (it must not
initialize MPI in the launcher process), and nothing in comm imports it. The ranks run
:mod:`meshkit.launch.bootstrap` by path, importing only the standard library.

Modules: :mod:`~meshkit.launch.cli` (the command line and the running job),
:mod:`~meshkit.launch.bootstrap` (the rank side), :mod:`~meshkit.launch.mpich_tuning`
(MPICH's collective selection).
"""

from .cli import KILL_GRACE_S, THREAD_ENV_VARS, TIMEOUT_EXIT_CODE, LaunchError, find_mpiexec, main, thread_limits

__all__ = ["main", "find_mpiexec", "thread_limits", "THREAD_ENV_VARS", "LaunchError", "KILL_GRACE_S",
           "TIMEOUT_EXIT_CODE"]
