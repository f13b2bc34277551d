"""``meshkit-run``: start N ranks of a script under ``mpiexec``, with rank-tagged output.

``meshkit-run -n 4 train.py ARGS`` (or ``python -m meshkit.launch -n 4 train.py ARGS``) starts
4 ranks, prefixes every line they print with ``[rank{r}]: ``, ends the whole job when one rank
fails (after every rank failing with it has printed its traceback), names a rank that died
without one, and exits with the status of the first rank to fail.

The launcher is its own package: it imports nothing of :mod:`meshkit.comm` (it must not
initialize MPI in the launcher process), and nothing in comm imports it. The ranks run
:mod:`meshkit.launch.bootstrap` by path, importing only the standard library.

Modules: :mod:`~meshkit.launch.cli` (the command line), :mod:`~meshkit.launch.job` (running and
ending a job), :mod:`~meshkit.launch.output` (mpiexec's output), :mod:`~meshkit.launch.bootstrap`
(the rank side), :mod:`~meshkit.launch.mpich_tuning` (MPICH's collective selection),
:mod:`~meshkit.launch.spawn` and :mod:`~meshkit.launch.spawn_rank` (``meshkit.spawn``: torch's
``spawn(fn, args, nprocs)`` over the same job), :mod:`~meshkit.launch.restarts` (``--max-restarts``:
a failed job restarted, the way back timed), :mod:`~meshkit.launch.slots` (``-n MIN:MAX``,
``--slots``, ``--hostfile``) and :mod:`~meshkit.launch.secret` (the job's secret).

Modules: ``cli.py`` (the flags), ``job.py`` (the mpiexec job, exit codes), ``output.py`` (rank
prefixes), ``bootstrap.py`` (what each rank runs first), ``mpich_tuning.py``, ``__main__.py``
(``python -m meshkit.launch``), ``spawn.py``/``spawn_rank.py`` (``meshkit.spawn`` over the same job),
``restarts.py`` (``--max-restarts``), ``slots.py`` (``-n MIN:MAX``, host files), ``secret.py`` (the
job's secret), ``deathsig.py`` (mpiexec dies with the launcher).
"""

from .cli import ALLOCATOR_ENV, THREAD_ENV_VARS, allocator_settings, find_mpiexec, main, thread_limits
from .job import FAILURE_SETTLE_S, KILL_GRACE_S, TIMEOUT_EXIT_CODE, LaunchConfigError, LaunchError
from .secret import JOB_SECRET_ENV
from .spawn import ProcessException, ProcessExitedException, ProcessRaisedException, SpawnContext, spawn

__all__ = ["main", "find_mpiexec", "thread_limits", "THREAD_ENV_VARS", "allocator_settings", "ALLOCATOR_ENV",
           "LaunchError", "LaunchConfigError", "JOB_SECRET_ENV", "FAILURE_SETTLE_S", "KILL_GRACE_S",
           "TIMEOUT_EXIT_CODE", "spawn", "SpawnContext", "ProcessException", "ProcessRaisedException",
           "ProcessExitedException"]
