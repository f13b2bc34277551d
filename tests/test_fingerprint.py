"""A collective mismatch is caught by default: each group's calls as a running
fingerprint, compared where the ranks already exchange something.

The local engine compares every call itself, so a real mismatch never reaches these comparisons
there: the in-process tests give one rank's fingerprint a call the others did not make (as if the
engine had let it through) and check the comparison points; the one process test makes the
mismatches of the issue under MPI, where nothing else catches them.
"""

from __future__ import annotations

import numpy as np
import pytest

import meshkit
from meshkit.comm.groups import call_fingerprint
from meshkit.comm import local
from meshkit.comm.groups.call_fingerprint import CallSequence, entry
from meshkit.comm.reduce_op import ReduceOp
from meshkit.comm.groups.world import current_world
from meshkit.parallel import SGD, data_parallel

F64, F32 = np.dtype(np.float64), np.dtype(np.float32)


def _fingerprint(*calls) -> int:
    sequence = CallSequence()
    for seq, args in enumerate(calls):
        sequence.add(seq, *entry(*args))
    return sequence.value


def test_the_fingerprint_is_the_calls_in_order_and_not_the_all_to_all_counts():
    a = ("all_reduce", F64, (4,), ReduceOp.SUM, None, None)
    b = ("broadcast", F64, (4,), None, 0, None)
    assert _fingerprint(a, b) == _fingerprint(a, b)
    for other in [("all_reduce", F64, (8,), ReduceOp.SUM, None, None), ("all_reduce", F32, (4,), ReduceOp.SUM, None, None),
                  ("all_reduce", F64, (4,), ReduceOp.MAX, None, None), ("broadcast", F64, (4,), None, 1, None)]:
        assert _fingerprint(other, b) != _fingerprint(a, b), other
    assert _fingerprint(b, a) != _fingerprint(a, b)  # the order counts
    assert _fingerprint(a) != _fingerprint(a, a)  # so does the number of calls
    # all_to_all's counts differ between ranks by design: not part of what must agree
    assert _fingerprint(("all_to_all", F64, None, None, None, ((1, 2), (2, 1)))) == \
        _fingerprint(("all_to_all", F64, None, None, None, ((3, 0), (0, 3))))
    # every value of the comparison fits an int32 (the strategies' agreement arrays)
    values, _ = call_fingerprint._halves(_fingerprint(a, b)), None
    assert all(-2 ** 31 < int(v) < 2 ** 31 for v in values)


def _stray_call(rank: int, group=None) -> None:
    """On ``rank``: its last call on ``group`` (the world's) becomes ``all_reduce`` of 8 float32, one
    the others did not make, as the MPI engine lets such a call through (the local engine would
    have raised at once): only the fingerprint, compared later, sees it."""
    if meshkit.get_rank() == rank:
        sequence = (group or current_world().default_group).queue.sequence
        seq, _, _ = sequence.ring.pop()
        sequence.value = sequence.ring[-1][1] if sequence.ring else 0
        sequence.add(seq, *entry("all_reduce", F32, (8,), ReduceOp.SUM, None, None))


def _errors(fn):
    try:
        fn()
    except meshkit.DistError as exc:  # noqa: BLE001
        return exc
    return None


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_a_step_after_calls_that_differed_raises_on_every_rank_and_applies_nothing(strategy):
    def body():
        rank = meshkit.get_rank()
        mesh = meshkit.init_device_mesh("cpu", (2,))
        model = data_parallel({"w": np.ones(4), "b": np.zeros(2)}, mesh, strategy, optimizer=SGD(lr=0.5))
        meshkit.all_reduce(np.ones(3))  # #k on every rank: the calls agree up to here
        _stray_call(1)
        model.zero_grad()
        model.mark_grad_ready("b", np.full(2, 1.0 + rank))
        model.mark_grad_ready("w", np.full(4, 1.0 + rank))
        error = _errors(model.step)
        read = _errors(lambda: model.grads["w"]) if strategy == "ddp" else None
        return error, {k: np.array(v) for k, v in model.params.items()}, read

    for rank, (error, params, read) in enumerate(local.run(body, 2, timeout=30)):
        assert isinstance(error, meshkit.CollectiveMismatchError), (rank, error)
        message = str(error)
        assert f"rank {rank}: collective mismatch on group world (ranks [0, 1]), found by " in message
        assert "gradient sync" in message
        # the call number, the ranks and what each called
        assert "rank 0: all_reduce(shape=(3,), dtype=float64, op=SUM) #" in message and \
            "rank 1: all_reduce(shape=(8,), dtype=float32, op=SUM) #" in message, message
        assert params["w"].tolist() == [1.0] * 4 and params["b"].tolist() == [0.0] * 2  # no update applied
        if read is not None:
            assert isinstance(read, meshkit.DistValueError) and "collective mismatch" in str(read)


@pytest.mark.parametrize("strategy", ["zero1", "fsdp", "hsdp"])
def test_every_strategy_s_step_finds_a_mismatch_on_every_rank_of_the_mesh(strategy):
    """The agreement every strategy shares (parallel/data_parallelism/protocol.py) carries the
    fingerprint: FSDP's too, and HSDP's first stage (a shard group's mismatch) reaches the ranks of
    the other shard groups through the second, so that no rank of the mesh applies the step."""
    hsdp = strategy == "hsdp"

    def body():
        rank = meshkit.get_rank()
        mesh = (meshkit.init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if hsdp
                else meshkit.init_device_mesh("cpu", (2,)))
        model = data_parallel({"w": np.ones(4), "b": np.zeros(2)}, mesh, strategy, optimizer=SGD(lr=0.5))
        group = mesh.get_group("shard") if hsdp else mesh.get_group()
        meshkit.all_reduce(np.ones(3), group=group)
        _stray_call(1, group)
        before = {k: np.array(v) for k, v in model.params.items()}
        model.zero_grad()
        model.mark_grad_ready("b", np.full(2, 1.0 + rank))
        model.mark_grad_ready("w", np.full(4, 1.0 + rank))
        error = _errors(model.step)
        return error, all(np.array_equal(before[k], np.array(v)) for k, v in model.params.items())

    n = 4 if hsdp else 2
    for rank, (error, unchanged) in enumerate(local.run(body, n, timeout=30)):
        assert isinstance(error, meshkit.CollectiveMismatchError), (rank, error)
        assert unchanged, rank  # no update applied anywhere
        message = str(error)
        if rank < 2:  # the group whose calls differed names them
            assert "gradient sync" in message and "rank 1: all_reduce(shape=(8,), dtype=float32, op=SUM) #" in message, \
                message
        else:  # HSDP's other shard group: told through the replicate groups' stage
            assert f"rank {rank}: FullyShardedDataParallel's gradient sync found a collective mismatch on another " \
                   "group of the strategy" in message, message


def test_object_collectives_compare_the_fingerprint_before_using_the_sizes():
    def body():
        meshkit.barrier()
        _stray_call(2)
        got = [None] * 3
        error = _errors(lambda: meshkit.all_gather_object(got, meshkit.get_rank()))
        after = _errors(lambda: meshkit.all_reduce(np.ones(2)))  # the group broke: later calls raise
        return error, after

    for rank, (error, after) in enumerate(local.run(body, 3, timeout=30)):
        assert isinstance(error, meshkit.CollectiveMismatchError), (rank, error)
        assert "found by all_gather_object: the members' calls differ from #0 on: ranks [0, 1]: barrier() #0; " \
               "rank 2: all_reduce(shape=(8,), dtype=float32, op=SUM) #0" in str(error), str(error)
        assert error.calls[2].startswith("all_reduce(shape=(8,)")
        assert isinstance(after, meshkit.DistError) and "collective mismatch" in str(after)


def test_group_creation_checks_that_every_rank_makes_the_same_call():
    def body():
        rank = meshkit.get_rank()
        wrong = _errors(lambda: meshkit.new_group([0, 1] if rank == 0 else [1, 2]))
        return wrong

    for rank, wrong in enumerate(local.run(body, 3, timeout=30)):
        assert isinstance(wrong, meshkit.CollectiveMismatchError), (rank, wrong)
        assert (f"rank {rank}: group creation mismatch on group world (ranks [0, 1, 2]): every member must create the "
                "same groups at the same point; rank 0: split(groups=[[0, 1]]) #0; ranks [1, 2]: "
                "split(groups=[[1, 2]]) #0") in str(wrong), str(wrong)


def test_group_creation_after_calls_that_differed_names_the_first_one():
    def body():
        meshkit.all_reduce(np.ones(1))
        _stray_call(0)
        return _errors(lambda: meshkit.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))

    for rank, error in enumerate(local.run(body, 4, timeout=30)):
        assert isinstance(error, meshkit.CollectiveMismatchError), (rank, error)
        assert "the members' calls differ from #0 on: rank 0: all_reduce(shape=(8,), dtype=float32, op=SUM) #0; " \
               "ranks [1, 2, 3]: all_reduce(shape=(1,), dtype=float64, op=SUM) #0" in str(error), str(error)


def test_calls_that_agree_pass_every_comparison():
    """Barriers, creations, object collectives and steps of a job whose calls agree raise nothing,
    and each comparison that passed moves the point a later report starts from."""
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2,))
        model = data_parallel({"w": np.ones(4)}, mesh, "ddp", optimizer=SGD(lr=0.5))
        for step in range(2):
            model.zero_grad()
            model.mark_grad_ready("w", np.full(4, 1.0 + meshkit.get_rank()))
            model.step()
        got = [None] * 2
        meshkit.all_gather_object(got, meshkit.get_rank())
        group = current_world().default_group
        return got, model.params["w"].tolist(), group.queue.sequence.agreed[0], group.queue.seq

    for got, w, agreed, calls in local.run(body, 2, timeout=30):
        assert got == [0, 1] and w == pytest.approx([1 - 2 * 0.5 * 1.5] * 4)  # two steps on the average, 1.5
        assert agreed == calls - 2  # the all_gather_object's comparison, before its two gathers


def test_the_watchdog_ends_a_call_that_never_returns(monkeypatch):
    import threading
    import time

    from meshkit.comm import job_end
    from meshkit.comm.engines import watchdog

    ended = []
    done = threading.Event()
    monkeypatch.setattr(job_end, "end_hung", lambda reason: (ended.append(reason), done.set()))
    with watchdog.watched("split (mpi engine)", 2, "dp", [0, 2], 0.1):
        done.wait(5)  # the call that does not return within its 0.1 s
    assert len(ended) == 1
    assert ended[0].startswith("meshkit.comm: rank 2: split (mpi engine) on group dp (ranks [0, 2]) has not "
                               "returned after 0.1 s (the group's timeout is 0.1 s: MESHKIT_TIMEOUT or "
                               "init_process_group(timeout=)); the call cannot be interrupted, so the watchdog ends "
                               "this process"), ended[0]
    with watchdog.watched("split (mpi engine)", 2, "dp", [0, 2], 0.1):
        pass  # returned in time: nothing ends
    time.sleep(0.2)
    assert len(ended) == 1


def test_mismatches_under_mpi_are_reported_on_every_rank(mpirun):
    """The issue's cases under MPI, where the engine lets them through (tests/scripts/mpi_mismatch.py):
    4 float64 against 8 and float32 against float64 (found by the next barrier; garbage on main), a
    sequence shifted by a caught one-rank error (found by the next object collective; an allocation
    of 8 EiB, or an UnpicklingError, on main), and a mismatch inside a DDP step (found by the step's
    agreement, which applies nothing). Each case on a 2-rank group of its own."""
    # MPI's path: the call numbers below are its own (on one node, the shared-memory path adds DDP's
    # shared_buffer call per bucket to the group's calls; its mismatches are tests/test_shm.py's)
    out = mpirun("mpi_mismatch.py", 4, env={"MESHKIT_TIMEOUT": "20", "MESHKIT_SHM": "0"}, timeout=90).stdout
    cases = {
        "size": ((0, 1), "barrier()", "#0 on: rank 0: all_reduce(shape=(4,), dtype=float64, op=SUM) #0; rank 1: "
                                      "all_reduce(shape=(8,), dtype=float64, op=SUM) #0"),
        "dtype": ((2, 3), "barrier()", "#0 on: rank 2: all_reduce(shape=(4,), dtype=float32, op=SUM) #0; rank 3: "
                                       "all_reduce(shape=(4,), dtype=float64, op=SUM) #0"),
        "shift": ((0, 2), "", "#0 on: rank 0: all_reduce(shape=(3,), dtype=float64, op=SUM) #0; rank 2: "
                              "all_gather_into_tensor(shape=(2,), dtype=int64) #0"),
        "ddp": ((1, 3), "DistributedDataParallel's gradient sync", "#3 on: rank 1: all_reduce(shape=(2,), "
                "dtype=float64, op=SUM) #3; rank 3: all_reduce(shape=(4,), dtype=float64, op=SUM) #3"),
    }
    for case, (ranks, found, listing) in cases.items():
        for rank in ranks:
            line = next((x for x in out.splitlines() if x.startswith(f"[rank{rank}]: {case}: ")), "")
            assert line.startswith(f"[rank{rank}]: {case}: CollectiveMismatchError: meshkit.comm: rank {rank}: "
                                   f"collective mismatch on group group{list(ranks)}"), (case, rank, out)
            assert f"found by {found}" in line and f"the members' calls differ from {listing}" in line, (case, line)
    for rank in (1, 3):
        assert f"[rank{rank}]: ddp params unchanged: True" in out, out
    for rank in range(4):
        assert f"[rank{rank}]: world still works: [2.0, 2.0]" in out, out
