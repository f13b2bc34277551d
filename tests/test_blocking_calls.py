"""No blocking call waits past its timeout.

Group creation checks that every rank makes the same call before MPI's ``Comm.Split`` (which has
no deadline); the calls that cannot be interrupted run under a watchdog that ends the process
(comm/engines/watchdog.py), reporting ``hung`` to ``meshkit-run``; the launcher names the rank that hung,
not the ranks whose timeouts fired while they waited for it (launch/job.py).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from meshkit.comm import job_end
from meshkit.launch import bootstrap, job


def _status(folder: Path, **files: str) -> None:
    for name, text in files.items():
        (folder / name.replace("_", ".")).write_text(text)


def _failure(folder: Path, nproc: int, killed: set[int] = frozenset(), **files: str) -> job.JobFailure | None:
    run = job.Job([], {}, nproc=nproc, status_dir=str(folder), timeout=None)
    me = str(os.getpid())  # a live pid; nothing is killed here
    _status(folder, **{f"start_{r}": me for r in range(nproc)}, **files)
    run._refresh()
    run.killed |= set(killed)
    try:
        return run.failure()
    finally:
        for rank in run.ranks.values():
            if rank.pidfd is not None:
                os.close(rank.pidfd)


def test_the_rank_a_timeout_named_as_not_arrived_is_the_cause(tmp_path: Path) -> None:
    failure = _failure(tmp_path, 3, failed_0="1 timeout 1000 2", failed_1="1 timeout 1005 2",
                       failed_2="1 timeout 1010")
    assert failure is not None and failure.rank == 2
    assert failure.description.startswith("hung: ranks 0, 1 timed out in a collective waiting for it (named by "
                                          "their timeouts as not arrived)"), failure.description
    assert failure.failed_ns == 1000


def test_a_rank_still_running_when_the_others_timed_out_is_the_cause(tmp_path: Path) -> None:
    # no engine knew who was missing: the rank that reported nothing and was still working when
    # the job was ended (killed by the launcher, its script not over) never reached the collective
    failure = _failure(tmp_path, 3, killed={1}, failed_0="1 timeout 1000", failed_2="1 timeout 1003")
    assert failure is not None and failure.rank == 1
    assert failure.description.startswith("hung: ranks 0, 2 timed out in a collective waiting for it (still running, "
                                          "without reporting a failure, when the job was ended)"), failure.description
    # an exception that is not a timeout names its own rank, as before
    other = _failure(tmp_path / "x" if (tmp_path / "x").mkdir() is None else tmp_path, 3, killed={1},
                     failed_0="1 exception 1000")
    assert other is not None and other.rank == 0 and other.description.startswith("raised an exception")


def test_a_watchdog_report_is_the_cause_over_earlier_timeouts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """comm's watchdog ends the process through job_end.end_hung: it reports ``hung`` in the
    launcher's status directory, which the launcher names before the timeouts that fired earlier."""
    monkeypatch.setenv(bootstrap.STATUS_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(bootstrap.LAUNCHER_ENV, f"{bootstrap.launcher_host()} {os.getpid()}")
    monkeypatch.setenv("RANK", "1")
    exits = []

    def leave(code):
        exits.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(os, "_exit", leave)
    with pytest.raises(SystemExit):
        job_end.end_hung("meshkit.comm: rank 1: split (mpi engine) on group world has not returned after 2.0 s")
    assert exits == [job_end.HUNG_EXIT_CODE]
    status, how, when = (tmp_path / "failed.1").read_text().split()
    assert (status, how) == ("1", "hung") and abs(int(when) - time.time_ns()) < 60e9
    failure = _failure(tmp_path, 3, failed_0="1 timeout 1000", failed_2="1 exception 900")
    assert failure is not None and failure.rank == 1
    assert failure.description.startswith("hung: a call into the engine's library"), failure.description


def test_a_group_created_by_some_ranks_only_ends_the_job_and_the_hung_rank_is_named(mpirun):
    start = time.monotonic()
    proc = mpirun("mpi_blocking_calls.py", 3, check=False, timeout=60, options=("--max-restarts", "1"))
    elapsed = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "all_reduce gave" not in out and "new_group returned" not in out, out  # no wrong value, no hang
    for rank in (0, 1):
        assert (f"[rank{rank}]: meshkit.comm.errors.CollectiveTimeout: meshkit.comm: rank {rank}: split #0 on group "
                "world (ranks [0, 1, 2]) timed out after 2.0 s; ranks that did not arrive: [2]") in out, out
    assert "attempt 0 failed: rank 2 hung: ranks 0, 1 timed out in a collective waiting for it (named by their " \
           "timeouts as not arrived)" in out, out
    assert "attempt 1 failed: rank 1 hung: ranks 0, 2 timed out in a collective waiting for it (still running, " \
           "without reporting a failure, when the job was ended)" in out, out
    assert elapsed < 40, f"{elapsed:.0f} s"
