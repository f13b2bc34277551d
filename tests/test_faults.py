"""Faults never hang: timeouts name who did not arrive, mismatches are reported on every rank."""

from __future__ import annotations

import time

import numpy as np
import pytest

import meshkit
from meshkit.comm import local
from meshkit.comm._seams import current_world


def catch(fn):
    """Run ``fn`` and return the exception it raised (or None), so every rank can report."""
    try:
        fn()
    except meshkit.DistError as exc:
        return exc
    return None


def test_rank_that_skips_a_barrier_is_named_in_the_timeout():
    def body():
        if meshkit.get_rank() != 2:
            return catch(meshkit.barrier)
        time.sleep(1.0)  # present but never arriving (a rank that left would be named at once)
    errors = local.run(body, 4, timeout=0.5)
    for rank in (0, 1, 3):
        assert isinstance(errors[rank], meshkit.CollectiveTimeout)
        assert errors[rank].missing == [2]
        assert errors[rank].op == "barrier" and errors[rank].seq == 0
        assert f"rank {rank}: barrier #0 on group world (ranks [0, 1, 2, 3]) timed out after 0.5 s; " \
               "ranks that did not arrive: [2]" in str(errors[rank])


def test_group_is_unusable_after_a_timeout():
    def body():
        if meshkit.get_rank() == 0:
            catch(meshkit.barrier)
            with pytest.raises(meshkit.DistError, match=r"group world is unusable after an earlier failure: "
                                                        r"barrier #0 timed out"):
                meshkit.all_reduce(np.ones(1))
        else:
            time.sleep(0.6)  # present but never arriving
    local.run(body, 2, timeout=0.3)


def test_monitored_barrier_names_every_missing_rank():
    def body():
        if meshkit.get_rank() in (0, 1, 4):
            return catch(lambda: meshkit.monitored_barrier(timeout=0.5))
    errors = local.run(body, 5, timeout=30)
    assert errors[0].missing == [2, 3]
    assert "ranks that did not arrive: [2, 3]" in str(errors[0])
    assert "monitored_barrier" in str(errors[4])


def test_failing_rank_wakes_the_others_quickly():
    def body():
        if meshkit.get_rank() == 1:
            raise ValueError("boom on rank 1")
        meshkit.barrier()  # would wait 60 s if nobody woke it
    start = time.monotonic()
    with pytest.raises(ValueError, match="boom on rank 1"):
        local.run(body, 3, timeout=60)
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("debug", ["detail"])
def test_mismatched_collectives_are_reported_on_every_rank(monkeypatch, debug):
    monkeypatch.setenv("MESHKIT_DEBUG", debug)

    def body():
        if meshkit.get_rank() == 0:
            return catch(lambda: meshkit.all_reduce(np.ones(4, np.float32)))
        return catch(lambda: meshkit.broadcast(np.ones(4, np.float32), src=0))
    errors = local.run(body, 2, timeout=5)
    for exc in errors:
        assert isinstance(exc, meshkit.CollectiveMismatchError)
        assert "rank 0: all_reduce(shape=(4,), dtype=float32, op=SUM) #0" in str(exc)
        assert "rank 1: broadcast(shape=(4,), dtype=float32, root=0) #0" in str(exc)
        assert set(exc.calls) == {0, 1}


def test_mismatched_shapes_and_all_to_all_counts_are_detected(monkeypatch):
    monkeypatch.setenv("MESHKIT_DEBUG", "detail")

    def body():
        r = meshkit.get_rank()
        shape_error = catch(lambda: meshkit.all_reduce(np.ones(3 + r)))
        return shape_error

    errors = local.run(body, 2, timeout=5)
    assert all("all_reduce(shape=(3,)" in str(e) and "all_reduce(shape=(4,)" in str(e) for e in errors)

    def a2a():
        r = meshkit.get_rank()
        # rank 0 sends 1 row to rank 1, but rank 1 expects 2 rows from rank 0
        splits_in = [1, 1] if r == 0 else [1, 1]
        splits_out = [1, 1] if r == 0 else [2, 0]
        return catch(lambda: meshkit.all_to_all_single(np.empty(2), np.ones(2), splits_out, splits_in))
    errors = local.run(a2a, 2, timeout=5)
    assert all(isinstance(e, meshkit.CollectiveMismatchError) for e in errors)
    assert ("ranks [0, 1]: all_to_all_single(dtype=float64) #0; counts disagree: rank 0 sends 1 element to rank 1, "
            "which expects 2 from it; rank 1 sends 1 element to rank 1, which expects 0 from it") in str(errors[0])
    assert errors[0].calls[1] == "all_to_all_single(dtype=float64, send_counts=[1, 1], recv_counts=[2, 0]) #0"


def test_detail_mode_agrees_when_calls_match(monkeypatch):
    monkeypatch.setenv("MESHKIT_DEBUG", "detail")

    def body():
        x = np.full(3, meshkit.get_rank(), np.float64)
        meshkit.all_reduce(x)
        out = np.empty(3)
        meshkit.all_to_all_single(out, np.arange(3.0), [1, 1, 1], [1, 1, 1])
        return x
    assert all((x == 3).all() for x in local.run(body, 3, timeout=5))


def test_flight_recorder_keeps_the_last_64_operations():
    def body():
        for _ in range(70):
            meshkit.all_reduce(np.ones(2))
        meshkit.broadcast(np.ones(3, np.int32), src=0)
        records = meshkit.flight_record()
        if meshkit.get_rank() == 0:
            catch(meshkit.barrier)  # rank 1 never comes: timed out
            return records, meshkit.flight_record(), meshkit.format_flight_record()
        time.sleep(0.6)  # present but never arriving
        return records, None, None
    (records, after, text), _ = local.run(body, 2, timeout=0.3)
    assert len(records) == 64
    assert records[-1]["op"] == "broadcast" and records[-1]["shapes"] == ((3,),)
    assert records[-1]["dtype"] == "int32" and records[-1]["state"] == "completed"
    assert [r["seq"] for r in records] == list(range(7, 71))
    assert after[-1]["op"] == "barrier" and after[-1]["state"] == "timed_out"
    assert "timed_out" in text and "meshkit flight recorder, rank 0" in text


@pytest.mark.parametrize("op", ["all_reduce", "all_reduce_async", "broadcast", "broadcast_async"])
def test_an_engine_that_fails_to_start_a_call_leaves_a_failed_record(op):
    """all_reduce has a fast path of its own (it posts before writing the record): an engine
    failing at the start must be handled there as on every other operation's path, and a
    RankFailedError at the start must make the group unusable."""
    name, async_op = op.removesuffix("_async"), op.endswith("_async")
    call = {"all_reduce": lambda g: g.all_reduce(np.ones(2), async_op=async_op),
            "broadcast": lambda g: g.broadcast(np.ones(2), 0, async_op=async_op)}[name]

    def body():
        group = current_world().default_group
        real = getattr(group.engine, name)

        def fail(error):
            def start(*args, **kwargs):
                raise error
            return start

        setattr(group.engine, name, fail(RuntimeError("engine could not start")))
        with pytest.raises(RuntimeError, match="engine could not start"):
            call(group)
        plain = meshkit.flight_record()[-1]
        setattr(group.engine, name, fail(meshkit.RankFailedError("rank 1 is gone")))
        with pytest.raises(meshkit.RankFailedError, match="rank 1 is gone"):
            call(group)
        setattr(group.engine, name, real)
        with pytest.raises(meshkit.DistError, match="failed"):
            call(group)  # the group broke at the RankFailedError
        return plain

    plain = local.run(body, 1)[0]
    assert plain["op"] == name and plain["state"] == "failed" and plain["seq"] == 0
    assert "engine could not start" in plain["error"]


@pytest.mark.parametrize("case", ["skip-barrier", "skip-all-reduce", "monitored", "detail-skip", "mismatch"])
def test_faults_on_real_processes(mpirun, case):
    env = {"MESHKIT_DEBUG": "detail"} if case in ("detail-skip", "mismatch") else {}
    out = mpirun("mpi_faults.py", 3, case, env=env, timeout=60).stdout
    if case == "skip-all-reduce":
        for rank in (0, 2):
            assert (f"[rank{rank}]: CollectiveTimeout: meshkit.comm: rank {rank}: all_reduce #0 on group world "
                    "(ranks [0, 1, 2]) timed out after 1.5 s") in out, out
            assert f"[rank{rank}]: RECORD all_reduce 0 timed_out" in out, out
            assert (f"[rank{rank}]: DistError: meshkit.comm: rank {rank}: all_reduce: group world is unusable after "
                    "an earlier failure: all_reduce #0 timed out") in out, out
    elif case == "skip-barrier":
        assert "[rank0]: CollectiveTimeout" in out
        assert "the mpi engine cannot tell which ranks did not arrive; run with MESHKIT_DEBUG=detail" in out
    elif case in ("monitored", "detail-skip"):
        for rank in (0, 2):
            assert f"[rank{rank}]: CollectiveTimeout" in out and "ranks that did not arrive: [1]" in out, out
    else:
        for rank in (0, 1, 2):
            assert f"[rank{rank}]: CollectiveMismatchError" in out, out
        assert "rank 1: all_reduce(shape=(5,), dtype=float64, op=SUM) #0" in out


def test_raising_rank_ends_a_real_job_quickly(mpirun):
    start = time.monotonic()
    proc = mpirun("mpi_faults.py", 3, "raise", check=False, timeout=60)
    assert proc.returncode != 0
    assert "ValueError: rank 2 gives up" in proc.stderr + proc.stdout
    assert time.monotonic() - start < 20  # includes starting three interpreters on two cores
