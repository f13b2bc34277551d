"""Bad input: a clear error naming the argument, the value, what is valid, and the rank."""

from __future__ import annotations

import datetime

import numpy as np
import pytest

import meshkit
from meshkit import ReduceOp
from meshkit.comm import local


def on_rank0(fn, world_size=2):
    """Run ``fn`` on rank 0 of a local job while the other ranks do nothing."""
    def body():
        if meshkit.get_rank() == 0:
            fn()
    local.run(body, world_size, timeout=5)


@pytest.mark.parametrize("call, error, message", [
    (lambda: meshkit.all_reduce([1.0, 2.0]), TypeError, r"rank 0: all_reduce: tensor must be a numpy.ndarray, got list"),
    (lambda: meshkit.all_reduce(np.ones((4, 4))[:, 1]), ValueError,
     r"rank 0: all_reduce: tensor is not C-contiguous \(shape \(4,\), strides \(32,\)\)"),
    (lambda: meshkit.all_reduce(np.array(["a"])), TypeError, r"tensor has dtype <U1, which cannot be communicated"),
    (lambda: meshkit.all_reduce(np.ones(2, bool)), TypeError,
     r"ReduceOp.SUM is not defined for dtype bool; valid ops for this dtype are \['BAND', 'BOR', 'BXOR', 'MAX', 'MIN'\]"),
    (lambda: meshkit.all_reduce(np.ones(2, np.int32), ReduceOp.AVG), TypeError,
     r"ReduceOp.AVG is not defined for dtype int32"),
    (lambda: meshkit.all_reduce(np.ones(2, complex), ReduceOp.MAX), TypeError,
     r"ReduceOp.MAX is not defined for dtype complex128"),
    (lambda: meshkit.all_reduce(np.ones(2), "mean"), TypeError, r"op='mean' is not a ReduceOp; valid ops are \['SUM'"),
    (lambda: meshkit.broadcast(np.ones(2), src=7), ValueError,
     r"rank 0: broadcast: src=7 is not a rank of group world \(global ranks \[0, 1\]\)"),
    (lambda: meshkit.broadcast(np.ones(2), group_src=5), ValueError,
     r"src=5 is out of range for group world of size 2 \(valid: 0..1\)"),
    (lambda: meshkit.broadcast(np.ones(2)), ValueError, r"src \(a global rank\) or group_src .* is required"),
    (lambda: meshkit.broadcast(np.ones(2), src=0, group_src=0), ValueError, r"pass either src or group_src, not both"),
    (lambda: meshkit.all_gather_into_tensor(np.empty(5), np.ones(4)), ValueError,
     r"all_gather_into_tensor: output has 5 elements \(shape \(5,\)\), expected 8"),
    (lambda: meshkit.all_gather_into_tensor(np.empty(8, np.float32), np.ones(4)), TypeError,
     r"output has dtype float32 but input has dtype float64; they must match"),
    (lambda: meshkit.reduce_scatter_tensor(np.empty(2), np.ones(5)), ValueError,
     r"reduce_scatter_tensor: input has 5 elements \(shape \(5,\)\), expected 4"),
    (lambda: meshkit.all_gather([np.empty(2)], np.ones(2)), ValueError,
     r"all_gather: tensor_list has 1 arrays, expected one per rank of the group \(2\)"),
    (lambda: meshkit.all_gather([np.empty(2), np.empty(3)], np.ones(2)), ValueError,
     r"tensor_list\[1\] has shape \(3,\), expected \(2,\)"),
    (lambda: meshkit.gather(np.ones(2), None, dst=0), ValueError, r"gather_list is required on the root rank"),
    (lambda: meshkit.scatter(np.ones(2), [np.ones(2)] * 2, src=1), ValueError,
     r"scatter_list must be None or empty on non-root ranks"),
    (lambda: meshkit.all_to_all_single(np.empty(3), np.ones(3)), ValueError,
     r"dim 0 of length 3 does not divide into 2 equal parts; pass input_split_sizes"),
    (lambda: meshkit.all_to_all_single(np.empty(4), np.ones(4), [2, 2], [1, 2]), ValueError,
     r"input_split_sizes=\[1, 2\] must hold 2 non-negative sizes summing to dim 0 of the array \(4\)"),
    (lambda: meshkit.isend(np.ones(2), dst=1, tag=-1), ValueError, r"isend: tag=-1 is out of range"),
    (lambda: meshkit.all_reduce(_readonly()), ValueError, r"tensor is read-only but is written by all_reduce"),
    (lambda: meshkit.new_group([0, 2]), ValueError, r"new_group: ranks \[2\] are out of range for a world of size 2"),
    (lambda: meshkit.new_group([1, 1]), ValueError, r"new_group: ranks \[1\] appear more than once"),
    (lambda: meshkit.init_process_group("local"), meshkit.DistError, r"init_process_group was already called"),
])
def test_bad_input_names_argument_value_and_rank(call, error, message):
    with pytest.raises(error, match=message) as info:
        on_rank0(call)
    assert isinstance(info.value, meshkit.DistError)


def _readonly():
    x = np.ones(2)
    x.flags.writeable = False
    return x


def test_non_member_group_handle_raises_on_every_collective():
    def body():
        group = meshkit.new_group([0])
        if meshkit.get_rank() == 1:
            assert meshkit.get_rank(group) == -1
            with pytest.raises(ValueError, match=r"rank 1: all_reduce: this rank is not a member of group "
                                                 r"group\[0\] \(ranks \[0\]\)"):
                meshkit.all_reduce(np.ones(1), group=group)
            with pytest.raises(ValueError, match="not a member"):
                meshkit.barrier(group=group)
    local.run(body, 2, timeout=5)


def test_collective_before_init_and_after_destroy():
    with pytest.raises(meshkit.DistError, match=r"not initialized; call meshkit.init_process_group\(\) first"):
        meshkit.all_reduce(np.ones(1))

    def body():
        group = meshkit.new_group([0, 1])
        meshkit.destroy_process_group()
        with pytest.raises(meshkit.DistError, match="not initialized"):
            meshkit.barrier()
        with pytest.raises(meshkit.DistError, match="process group was destroyed"):
            meshkit.all_reduce(np.ones(1), group=group)
        assert not meshkit.is_initialized()
        meshkit.init_process_group("auto")  # picks "local" inside local.run; re-init works
        assert meshkit.get_backend() == "local"
    local.run(body, 2, timeout=5)


def test_init_arguments_are_checked(monkeypatch):
    with pytest.raises(ValueError, match=r"unknown backend 'gloo'; valid backends are \['auto', 'mpi', 'local', 'nccl'\]"):
        meshkit.init_process_group("gloo")
    with pytest.raises(ValueError, match="timeout must be positive, got -1"):
        meshkit.init_process_group("mpi", timeout=-1)
    monkeypatch.setenv("MESHKIT_TIMEOUT", "soon")
    with pytest.raises(ValueError, match=r"MESHKIT_TIMEOUT='soon' is not a number of seconds"):
        meshkit.init_process_group("mpi")
    monkeypatch.delenv("MESHKIT_TIMEOUT")
    with pytest.raises(meshkit.DistBackendError, match="backend 'local' runs inside meshkit.comm.local.run"):
        meshkit.init_process_group("local")
    monkeypatch.setenv("MESHKIT_DEBUG", "verbose")
    with pytest.raises(ValueError, match=r"MESHKIT_DEBUG='verbose' is not valid; use one of \['off', 'info', 'detail'\]"):
        local.run(lambda: None, 1)


def test_timedelta_timeout_and_world_size_checks():
    assert local.run(lambda: meshkit.get_world_size(), 2, timeout=datetime.timedelta(seconds=3).total_seconds()) == [2, 2]
    with pytest.raises(ValueError, match="world_size must be a positive int, got 0"):
        local.run(lambda: None, 0)


def test_recv_into_a_buffer_of_the_wrong_size():
    def body():
        if meshkit.get_rank() == 0:
            meshkit.send(np.ones(3), dst=1)
        else:
            with pytest.raises(ValueError, match="recv buffer has 2 elements but the message from group rank 0 has 3"):
                meshkit.recv(np.empty(2), src=0)
    local.run(body, 2, timeout=5)


def test_object_collectives_bad_input():
    def body():
        with pytest.raises(ValueError, match=r"all_gather_object: object_list has 1 slots, expected one per rank \(2\)"):
            meshkit.all_gather_object([None], 1)
        with pytest.raises(TypeError, match=r"broadcast_object_list: object_list must be a list, got tuple"):
            meshkit.broadcast_object_list((1,), src=0)
        if meshkit.get_rank() == 0:
            with pytest.raises(ValueError, match=r"scatter_object_input_list has 3 slots, expected one per rank"):
                meshkit.scatter_object_list([None], [1, 2, 3], src=0)
        else:  # the others are told, in the same call: nobody waits for the timeout
            with pytest.raises(meshkit.ObjectCollectiveError, match=r"rank 1: scatter_object_list: the source, "
                                                                    r"rank 0, could not send .*has 3 slots"):
                meshkit.scatter_object_list([None], None, src=0)
    local.run(body, 2, timeout=5)
