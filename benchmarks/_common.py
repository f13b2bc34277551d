"""Helpers shared by meshkit's benchmarks: sizes, timing, progress, output, JSON and plots.

A benchmark script imports this module by name (``from _common import ...``): Python puts the
script's own folder first on ``sys.path``, so it works under ``python``, ``mpiexec`` and
``meshkit-run`` from any working directory. Nothing here imports meshkit, so a benchmark can
time raw mpi4py with the same code; mpi4py is imported lazily by the functions that talk
to other ranks, and matplotlib only by :func:`require_pyplot`.

Timing rules every benchmark follows (see ``collectives.py`` for the whole protocol):

* a barrier before each timed block, so that no rank starts while another is still busy;
* the time of one call is the MAX over ranks of each rank's per-call average (a collective
  is as slow as its slowest rank);
* repeated rounds, reported as the median, which rejects the bursts of noise of a shared
  machine (a 2-core CI runner running 4 ranks is oversubscribed by design).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import io
import json
import logging
import math
import os
import platform
import re
import socket
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Iterable, NoReturn, Sequence

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = [
    "LOG",
    "parse_size",
    "format_size",
    "size_sweep",
    "setup_logging",
    "add_output_args",
    "choice_list",
    "positive_int",
    "positive_int_list",
    "parse_args_rank0",
    "usage_error",
    "parse_checked",
    "matplotlib_missing",
    "print0",
    "Progress",
    "time_calls",
    "barrier",
    "max_over_ranks",
    "calibrate_iters",
    "median",
    "placement",
    "limit_blas_threads",
    "run_metadata",
    "host_metadata",
    "write_json",
    "save_results",
    "load_result",
    "png_path",
    "redraw",
    "require_pyplot",
    "save_figure",
    "log2_size_axis",
]

#: The benchmarks' logger (a child of meshkit's, so ``logging.getLogger("meshkit")`` sees it).
LOG = logging.getLogger("meshkit.bench")

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


# --------------------------------------------------------------------------- sizes
def parse_size(text: str) -> int:
    """Bytes of a size written as ``8``, ``64K``, ``64M``, ``1G`` (binary multiples, as nccl-tests).

    A trailing ``B`` or ``iB`` is accepted (``64KB``, ``64KiB``); case does not matter.

    Raises:
        argparse.ArgumentTypeError: not a size (so argparse reports it as a usage error).
    """
    match = _SIZE_RE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}; write bytes as an integer with an optional K, M, G or T suffix "
            "(binary multiples), e.g. 8, 64K, 64M")
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def format_size(nbytes: int) -> str:
    """The shortest exact form of ``nbytes``: ``8``, ``64K``, ``1M``; ``1536`` stays ``1536``."""
    for suffix in ("T", "G", "M", "K"):
        unit = _UNITS[suffix]
        if nbytes >= unit and nbytes % unit == 0:
            return f"{nbytes // unit}{suffix}"
    return str(nbytes)


def size_sweep(min_bytes: int, max_bytes: int, factor: float = 2.0, *, multiple: int = 1) -> list[int]:
    """Sizes from ``min_bytes`` to ``max_bytes`` (both included), each ``factor`` times the last.

    Every size is rounded up to a multiple of ``multiple`` (e.g. ranks x itemsize, so that a
    buffer splits into one whole-element chunk per rank); sizes that round to the same value
    appear once.

    Raises:
        ValueError: ``min_bytes`` > ``max_bytes``, a non-positive size or ``factor`` <= 1.
    """
    if min_bytes <= 0 or max_bytes <= 0:
        raise ValueError(f"sizes must be positive, got min {min_bytes} and max {max_bytes}")
    if min_bytes > max_bytes:
        raise ValueError(f"min size {format_size(min_bytes)} is larger than max size {format_size(max_bytes)}")
    if not factor > 1:
        raise ValueError(f"step factor must be > 1, got {factor}")
    raw = []
    size = float(min_bytes)
    while size <= max_bytes * (1 + 1e-9):
        raw.append(round(size))
        size *= factor
    if raw[-1] != max_bytes:
        raw.append(max_bytes)
    rounded = (-(-s // multiple) * multiple for s in raw)
    return sorted(set(rounded))


# --------------------------------------------------------------------------- output
def setup_logging(rank: int, verbose: bool = False) -> None:
    """meshkit's loggers at INFO (DEBUG when ``verbose``) on rank 0, warnings only elsewhere.

    Other libraries stay at WARNING, so e.g. matplotlib's font-cache notice does not show.
    """
    logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(name)s %(levelname)s: %(message)s",
                        stream=sys.stderr)
    level = (logging.DEBUG if verbose else logging.INFO) if rank == 0 else logging.WARNING
    logging.getLogger("meshkit").setLevel(level)


def choice_list(valid: Sequence[str], what: str) -> Callable[[str], list[str]]:
    """An argparse ``type``: comma-separated names, each one of ``valid`` (e.g. ``ddp,fsdp``).

    The names keep their order. ``what`` names them in the error, e.g. ``strategies``:
    ``unknown strategies ['x']; valid: ddp,fsdp`` (argparse reports it as a usage error).
    """
    def parse(text: str) -> list[str]:
        names = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in names if v not in valid]
        if not names or bad:
            raise argparse.ArgumentTypeError(f"unknown {what} {bad or text!r}; valid: {','.join(valid)}")
        return names

    return parse


def positive_int(text: str) -> int:
    """An argparse ``type``: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def positive_int_list(example: str) -> Callable[[str], list[int]]:
    """An argparse ``type``: comma-separated integers, each >= 1; ``example`` shows one in the error."""
    def parse(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            values = []
        if not values or any(v < 1 for v in values):
            raise argparse.ArgumentTypeError(f"invalid list {text!r}; write positive integers like {example}")
        return values

    return parse


#: ``--plot-from``'s help for a script that redraws its PNG from one earlier JSON result.
_PLOT_FROM_HELP = "measure nothing: draw --plot (default: JSON's path with .png) from an earlier run's JSON"


def add_output_args(parser: argparse.ArgumentParser, *, json_help: str, json_default: Path | None = None,
                    plot_from_help: str | None = _PLOT_FROM_HELP, plot_from_nargs: str | None = None) -> None:
    """Add the options every benchmark shares: --json, --plot, --plot-from, --no-progress, -v.

    ``json_help`` and ``json_default`` describe the result file. ``plot_from_help`` None leaves
    --plot-from out; ``plot_from_nargs`` (e.g. ``"+"``) lets it take several files.
    """
    parser.add_argument("--json", type=Path, default=json_default, help=json_help)
    parser.add_argument("--plot", type=Path, nargs="?", const=Path(), default=None,
                        help="draw a PNG (default path: the JSON path with .png)")
    if plot_from_help is not None:
        parser.add_argument("--plot-from", type=Path, nargs=plot_from_nargs, default=None, metavar="JSON",
                            help=plot_from_help)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar or progress log lines")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def parse_args_rank0(parser: argparse.ArgumentParser, rank: int,
                     argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``parser.parse_args`` on every rank, with ``--help`` and usage errors printed by rank 0 only.

    Every rank parses the same command line, so every rank reaches the same verdict and exits
    together; only the text is silenced elsewhere.
    """
    if rank == 0:
        return parser.parse_args(argv)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return parser.parse_args(argv)


def usage_error(parser: argparse.ArgumentParser, rank: int, message: str) -> NoReturn:
    """Exit with a usage error (status 2) on every rank; only rank 0 prints it."""
    if rank == 0:
        parser.error(message)
    raise SystemExit(2)


def parse_checked(parser: argparse.ArgumentParser, rank: int, argv: Sequence[str] | None,
                  check: Callable[[argparse.Namespace], str | None]) -> argparse.Namespace:
    """:func:`parse_args_rank0`, then a :func:`usage_error` for the problem ``check`` returns, if any."""
    args = parse_args_rank0(parser, rank, argv)
    error = check(args)
    if error:
        usage_error(parser, rank, error)
    return args


def matplotlib_missing(args: argparse.Namespace) -> str | None:
    """The usage error for ``--plot`` or ``--plot-from`` without matplotlib installed, else None."""
    if args.plot is None and getattr(args, "plot_from", None) is None:
        return None
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "--plot needs matplotlib, which is not installed; run `pip install matplotlib` (or meshkit[bench])"
    return None


def init_gloo(comm: Any) -> str:
    """``torch.distributed.init_process_group("gloo")`` over the ranks of the mpi4py ``comm``;
    returns the rendezvous address.

    The rendezvous is torch's ``env://``: rank 0 picks a free TCP port (a socket bound to port
    0), mpi4py broadcasts it, and RANK/WORLD_SIZE come from MPI. MASTER_ADDR is 127.0.0.1 when
    all ranks share a host, else rank 0's host name.

    Raises:
        ImportError: torch is not installed.
    """
    import torch.distributed as dist

    rank, size = comm.Get_rank(), comm.Get_size()
    hosts = comm.allgather(socket.gethostname())
    addr = "127.0.0.1" if len(set(hosts)) == 1 else hosts[0]
    port = 0
    if rank == 0:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("" if addr != "127.0.0.1" else addr, 0))
            port = s.getsockname()[1]
    port = comm.bcast(port, root=0)
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(size))
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=size)
    return f"{addr}:{port}"


def print0(rank: int, *args: Any, **kwargs: Any) -> None:
    """``print`` on rank 0 only, flushed (mpiexec forwards output in chunks)."""
    if rank == 0:
        print(*args, **kwargs, flush=True)


class Progress:
    """A tqdm bar on rank 0 when tqdm is installed, else one log line per group of steps.

    ``write`` prints a line to stdout without breaking the bar. Other ranks show nothing.

    Example::

        with Progress(total=10, enabled=rank == 0) as progress:
            progress.start_group("all_reduce")   # logged when tqdm is missing
            progress.step("64K")                  # advances the bar by one
    """

    def __init__(self, total: int, *, enabled: bool, unit: str = "step") -> None:
        self._enabled = enabled
        self._bar: Any = None
        self._done = 0
        self._total = total
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            LOG.info("tqdm is not installed (a dependency of meshkit: pip install tqdm): logging progress instead")
            return
        self._bar = tqdm(total=total, unit=unit, dynamic_ncols=True, mininterval=0.5, file=sys.stderr)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start_group(self, name: str) -> None:
        """A new group of steps begins (e.g. one op's size sweep)."""
        if not self._enabled:
            return
        if self._bar is not None:
            self._bar.set_description(name)
        else:
            LOG.info("%s (%d/%d steps done)", name, self._done, self._total)

    def step(self, label: str = "") -> None:
        """One step finished; ``label`` (e.g. the size) is shown beside the bar."""
        self._done += 1
        if self._bar is not None:
            self._bar.set_postfix_str(label, refresh=False)
            self._bar.update(1)

    def write(self, line: str) -> None:
        """Print ``line`` to stdout (rank 0 only), above the bar when there is one."""
        if not self._enabled:
            return
        if self._bar is not None:
            self._bar.write(line, file=sys.stdout)
            sys.stdout.flush()
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


# --------------------------------------------------------------------------- timing
def time_calls(fn: Callable[[], object], iters: int, finish: Callable[[], object] | None = None) -> float:
    """Seconds per call of ``fn``, averaged over ``iters`` back-to-back calls on this rank.

    ``finish`` (e.g. a GPU stream synchronize) runs once after the loop, inside the timed
    span: calls that only enqueue work on a device are timed until that work is done.
    """
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if finish is not None:
        finish()
    return (time.perf_counter() - start) / iters


def barrier(comm: MPI.Comm) -> None:
    """A barrier whose waiting ranks yield the core instead of spinning in MPI.

    With more ranks than cores (4 ranks on a 2-core runner), a rank spinning in a blocking
    ``MPI_Barrier`` takes CPU time from the ranks it waits for, which are still in their timed
    block; yielding keeps the harness out of the measurement.
    """
    request = comm.Ibarrier()
    while not request.Test():
        os.sched_yield()


def max_over_ranks(comm: MPI.Comm, values: Sequence[float]) -> list[float]:
    """Elementwise MAX over the ranks of ``comm`` of a list of floats (one Allreduce)."""
    import numpy as np
    from mpi4py import MPI
    buf = np.asarray(values, dtype=np.float64)
    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
    return buf.tolist()


def calibrate_iters(fn: Callable[[], object], comm: MPI.Comm, *, budget_s: float, min_iters: int,
                    max_iters: int = 1 << 20, probe_s: float = 0.01,
                    finish: Callable[[], object] | None = None) -> int:
    """Iterations of ``fn`` that take about ``budget_s`` seconds, the same number on every rank.

    ``fn`` is a collective: it is timed in growing batches (1, 8, 64, ... calls) until a batch
    lasts ``probe_s`` on the slowest rank. Each decision uses the MAX over ranks, so every rank
    takes the same branch and calls ``fn`` equally often. ``finish`` ends each timed batch, as
    in :func:`time_calls`.
    """
    fn()  # first call: page faults, lazy setup
    if finish is not None:
        finish()
    batch = 1
    while True:
        barrier(comm)
        per_call = max_over_ranks(comm, [time_calls(fn, batch, finish)])[0]
        if per_call * batch >= probe_s or batch >= max_iters:
            break
        batch *= 8
    return max(min_iters, min(max_iters, math.ceil(budget_s / max(per_call, 1e-9))))


def median(values: Iterable[float]) -> float:
    return statistics.median(values)


# --------------------------------------------------------------------------- results
def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _base_metadata() -> dict[str, Any]:
    """Package versions, date and argv: the fields :func:`run_metadata` and :func:`host_metadata` share."""
    return {
        "python": platform.python_version(),
        "numpy": _version("numpy"),
        "mpi4py": _version("mpi4py"),
        "meshkit": _version("meshkit"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv,
    }


def run_metadata(comm: MPI.Comm, **extra: Any) -> dict[str, Any]:
    """What a result depends on: ranks and cores per host, MPI library, versions, date, argv.

    Collective: every rank of ``comm`` must call it (it gathers each rank's host and cores).
    """
    from mpi4py import MPI
    library = MPI.Get_library_version().strip().splitlines()
    return {
        "world_size": comm.Get_size(),
        **placement(comm),
        "mpi_library": " ".join(library[0].split()) if library else "",
        "mpi_version": "{}.{}".format(*MPI.Get_version()),
        "hostname": socket.gethostname(),
        # 1, 5 and 15 min load averages at the end of the run: other jobs on a shared host show here
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        **_base_metadata(),
        **extra,
    }


def placement(comm: MPI.Comm) -> dict[str, Any]:
    """Hosts, the most ranks on one host, and the fewest cores a rank may run on.

    Collective: every rank of ``comm`` must call it.
    """
    hosts = comm.allgather((socket.gethostname(), _cores()))
    per_host: dict[str, int] = {}
    for host, _ in hosts:
        per_host[host] = per_host.get(host, 0) + 1
    most = max(per_host.values())
    least_cores = min(c for _, c in hosts)
    return {"hosts": len(per_host), "ranks_per_host": most, "cores_per_host": least_cores,
            "oversubscribed": most > least_cores}


def host_metadata(**extra: Any) -> dict[str, Any]:
    """:func:`run_metadata` for a run without an MPI communicator (meshkit's ``local`` engine).

    Host, cores, package versions, date and argv, plus ``extra``; it does not import mpi4py,
    so it does not initialize MPI.
    """
    return {"hostname": socket.gethostname(), "cores_per_host": _cores(), **_base_metadata(), **extra}


def write_json(path: Path, metadata: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """Write ``{"metadata": ..., "rows": [...]}`` to ``path``, creating its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        json.dump({"metadata": metadata, "rows": rows}, f, indent=1)
        f.write("\n")


def save_results(args: argparse.Namespace, default: Path, metadata: dict[str, Any], rows: list[dict[str, Any]],
                 draw: Callable[[Path], None]) -> None:
    """Write the JSON (``args.json`` or ``default``) and, with ``--plot``, call ``draw(png path)``."""
    path = args.json or default
    write_json(path, metadata, rows)
    LOG.info("wrote %s", path)
    if args.plot is not None:
        png = png_path(args.plot, path)
        draw(png)
        LOG.info("wrote %s", png)


def load_result(path: Path, benchmark: str) -> dict[str, Any]:
    """The JSON that ``benchmarks/{benchmark}.py`` wrote to ``path``, for ``--plot-from``.

    Raises:
        SystemExit: ``path`` cannot be read, is not JSON, or is another benchmark's result.
    """
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"meshkit.bench: --plot-from: cannot read {path}: {exc}") from None
    if data.get("metadata", {}).get("benchmark") != benchmark:
        raise SystemExit(f"meshkit.bench: --plot-from: {path} is not a result of benchmarks/{benchmark}.py")
    return data


def png_path(plot: Path | None, json_path: Path) -> Path:
    """Where ``--plot`` draws: its path, or ``json_path`` with ``.png`` when given without one."""
    return json_path.with_suffix(".png") if plot in (None, Path()) else plot


def redraw(args: argparse.Namespace, benchmark: str, draw: Callable[[list[dict[str, Any]], Path, str], None],
           title: Callable[[dict[str, Any]], str]) -> None:
    """``--plot-from``: draw ``benchmark``'s earlier JSON with ``draw(rows, png, title(metadata))``."""
    data = load_result(args.plot_from, benchmark)
    png = png_path(args.plot, args.plot_from)
    draw(data["rows"], png, title(data["metadata"]))
    LOG.info("wrote %s", png)


# --------------------------------------------------------------------------- plots
def require_pyplot() -> ModuleType:
    """``matplotlib.pyplot`` on the non-interactive Agg backend.

    Raises:
        SystemExit: matplotlib is not installed (with the command that installs it).
    """
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("meshkit.bench: --plot needs matplotlib, which is not installed; "
                         "run `pip install matplotlib` (or `pip install meshkit[bench]`)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig: Any, path: Path, title: str, *, rect: Sequence[float] | None = None) -> None:
    """Title ``fig``, lay it out (within ``rect``, if given), write it to ``path`` (110 dpi) and close it."""
    import matplotlib.pyplot as plt
    fig.suptitle(title, fontsize="medium")
    fig.tight_layout(rect=rect)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def log2_size_axis(ax: Any, sizes: Sequence[int], max_ticks: int = 9) -> None:
    """Make ``ax``'s x axis a log2 axis over ``sizes`` (bytes), labelled 8, 1K, 64K, 1M, ...

    Ticks sit on powers of two, every 1, 2, 3 ... doublings so that at most ``max_ticks`` show.
    """
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator
    ax.set_xscale("log", base=2)
    lo, hi = math.floor(math.log2(min(sizes))), math.ceil(math.log2(max(sizes)))
    step = max(1, math.ceil((hi - lo + 1) / max_ticks))
    ax.xaxis.set_major_locator(FixedLocator([2.0 ** e for e in range(lo, hi + 1, step)]))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: format_size(round(x)) if x >= 1 else ""))


# --------------------------------------------------------------------------- BLAS threads
def limit_blas_threads(threads: int = 1) -> dict[str, Any]:
    """Cap the BLAS threads of this process now, even if NumPy is already imported.

    Setting ``OPENBLAS_NUM_THREADS`` before ``import numpy`` is not enough under ``meshkit-run``:
    its bootstrap imports NumPy before the script runs, so OpenBLAS has already started one
    (spin-waiting) thread per core in every rank. This uses ``threadpoolctl`` when installed,
    else calls the ``*_set_num_threads`` entry point of every OpenBLAS library loaded in the
    process (found in ``/proc/self/maps``). Returns what it did, for the results' metadata:
    ``{"method": ..., "libraries": [...], "threads": threads}`` (``method`` None if nothing).
    """
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(threads)
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        pass
    else:
        threadpool_limits(limits=threads, user_api="blas")
        return {"method": "threadpoolctl", "libraries": [], "threads": threads}
    import ctypes
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "openblas" in line.rsplit("/", 1)[-1].lower()})
    except OSError:
        paths = []
    done = []
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for symbol in ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_",
                       "scipy_openblas_set_num_threads", "openblas_set_num_threads"):
            fn = getattr(lib, symbol, None)
            if fn is not None:
                fn.argtypes = [ctypes.c_int]
                fn(threads)
                done.append(os.path.basename(path))
                break
    return {"method": "openblas_set_num_threads" if done else None, "libraries": done, "threads": threads}
