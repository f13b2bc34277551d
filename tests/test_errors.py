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
    with pytest.raises(ValueError, match=r"unknown backend 'ucc'; valid backends are \['auto', 'mpi', 'local', 'nccl', "
                                         r"'gloo'\]"):
        meshkit.init_process_group("ucc")
    with pytest.raises(ValueError, match="timeout must be positive, got -1"):
        meshkit.init_process_group("mpi", timeout=-1)
    with pytest.raises(ValueError, match=r"timeout must be at most 1e\+06 seconds \(11.6 days.*got inf"):
        meshkit.init_process_group("mpi", timeout=float("inf"))
    monkeypatch.setenv("MESHKIT_TIMEOUT", "soon")
    with pytest.raises(ValueError, match=r"MESHKIT_TIMEOUT='soon' is not valid; valid values are a positive number "
                                         r"of seconds \(e.g. 300\)"):
        meshkit.init_process_group("mpi")
    monkeypatch.delenv("MESHKIT_TIMEOUT")
    with pytest.raises(meshkit.DistBackendError, match="backend 'local' runs inside meshkit.comm.local.run"):
        meshkit.init_process_group("local")
    monkeypatch.setenv("MESHKIT_DEBUG", "verbose")
    with pytest.raises(ValueError, match=r"MESHKIT_DEBUG='verbose' is not valid; valid values are \['off', 'info', "
                                         r"'detail'\]"):
        local.run(lambda: None, 1)


#: Every MESHKIT_* variable the library reads: a bad value, and the message naming it,
#: its value and the valid values. Before, the middle three were ignored and -5 gave "timeout
#: must be positive" without the variable's name.
BAD_SETTINGS = [
    ("MESHKIT_TIMEOUT", "-5", r"MESHKIT_TIMEOUT='-5' is not valid; valid values are a positive number of seconds"),
    ("MESHKIT_TIMEOUT", "0", r"MESHKIT_TIMEOUT='0' is not valid"),
    # Each of these failed somewhere else (an overflow in a wait) with a message naming nothing
    *((("MESHKIT_TIMEOUT", v, rf"MESHKIT_TIMEOUT='{v}' is not valid; valid values are a positive number of seconds "
        r"\(e.g. 300\), at most 1e\+06 \(11.6 days") for v in ("inf", "1e10", "2e9"))),
    ("MESHKIT_JOB_SECRET", "short", r"MESHKIT_JOB_SECRET is not valid \(5 characters; its value is not shown\): valid "
                                    r"values are at least 32 printable ASCII characters"),
    ("MESHKIT_JOB_SECRET", "a b" * 20, r"MESHKIT_JOB_SECRET is not valid \(it holds whitespace"),
    ("MESHKIT_STORE_MAX_BYTES", "1G", r"MESHKIT_STORE_MAX_BYTES='1G' is not valid; valid values are a positive integer"),
    ("MESHKIT_STORE_IDLE_TIMEOUT", "inf", r"MESHKIT_STORE_IDLE_TIMEOUT='inf' is not valid; valid values are a positive "
                                          r"number at most 1e\+06"),
    ("MESHKIT_CONTROL_MAX_DEPTH", "0", r"MESHKIT_CONTROL_MAX_DEPTH='0' is not valid; valid values are integers 1..500"),
    ("MESHKIT_ASYNC_ERROR_HANDLING", "ignore", r"MESHKIT_ASYNC_ERROR_HANDLING='ignore' is not valid; valid values are "
                                               r"'abort' \(end the job .*\) and 'log'"),
    ("MESHKIT_CUDA_AWARE_MPI", "yes", r"MESHKIT_CUDA_AWARE_MPI='yes' is not valid; valid values are 0 \(stage device "
                                      r"arrays through host memory\) and 1 \(MPI reads device memory\)"),
    ("MESHKIT_LAUNCHED", "true", r"MESHKIT_LAUNCHED='true' is not valid; valid values are 1 \(set by meshkit-run"),
    ("MESHKIT_DEBUG", "detailed", r"MESHKIT_DEBUG='detailed' is not valid; valid values are \['off', 'info', "
                                  r"'detail'\]"),
    ("MESHKIT_DEVICE_ID", "gpu1", r"MESHKIT_DEVICE_ID='gpu1' is not valid; valid values are a GPU index of this "
                                  r"process \(0, 1, \.\.\.\)"),
    # the shared-memory path's sizes, each with its own default (before: "default 0", whatever it was)
    ("MESHKIT_SHM_MIN_BYTES", "4X", r"MESHKIT_SHM_MIN_BYTES='4X' is not valid; valid values are integers "
                                    r"0..1073741824 \(bytes, or with a K, M or G suffix: 512K, 4M; default 524288 where "
                                    r"cross-memory attach works, else 33554432\)\n"),
    ("MESHKIT_SHM_MIN_BYTES", "2G", r"MESHKIT_SHM_MIN_BYTES='2G' is not valid; valid values are integers 0..1073741824"),
    ("MESHKIT_SHM_CHUNK_BYTES", "100", r"MESHKIT_SHM_CHUNK_BYTES='100' is not valid; valid values are integers "
                                       r"64..1073741824 \(bytes, or with a K, M or G suffix: 512K, 4M, a multiple of 64; "
                                       r"default 4194304, at most 33554432 / the ranks, at least 65536\)\n"),
    ("MESHKIT_SHM_CHUNK_BYTES", "1.5M", r"MESHKIT_SHM_CHUNK_BYTES='1.5M' is not valid"),
    ("MESHKIT_SHM_SMALL_BYTES", "x", r"MESHKIT_SHM_SMALL_BYTES='x' .*\(bytes, .*; default 1048576\)\n"),
    ("MESHKIT_SHM_SMALL_MIN_BYTES", "x", r"MESHKIT_SHM_SMALL_MIN_BYTES='x' .*\(bytes, .*; default 16384\)\n"),
    ("MESHKIT_SHM_SHARED_MIN_BYTES", "x", r"MESHKIT_SHM_SHARED_MIN_BYTES='x' .*\(bytes, .*; default 65536\)\n"),
    ("MESHKIT_SHM_MOVE_MIN_BYTES", "-1", r"MESHKIT_SHM_MOVE_MIN_BYTES='-1' .*\(bytes, .*; default 1073741824\)\n"),
]


@pytest.mark.parametrize("name, value, message", BAD_SETTINGS, ids=[f"{n}={v}" for n, v, _ in BAD_SETTINGS])
def test_every_meshkit_setting_is_validated_at_init(monkeypatch, name, value, message):
    monkeypatch.setenv(name, value)
    with pytest.raises(meshkit.DistValueError, match=r"^meshkit.comm: " + message):
        local.run(lambda: None, 2, timeout=5)


@pytest.mark.parametrize("name, good", [("MESHKIT_TIMEOUT", " 7.5 "), ("MESHKIT_ASYNC_ERROR_HANDLING", "LOG"),
                                        ("MESHKIT_CUDA_AWARE_MPI", "0"), ("MESHKIT_LAUNCHED", "0"),
                                        ("MESHKIT_DEBUG", "Info"), ("MESHKIT_DEVICE_ID", "1"),
                                        ("MESHKIT_JOB_SECRET", "0123456789abcdef" * 2)])
def test_valid_settings_are_accepted(monkeypatch, name, good):
    monkeypatch.setenv(name, good)
    from meshkit.comm.groups.world import current_world

    timeouts = local.run(lambda: current_world().timeout, 2)
    if name == "MESHKIT_TIMEOUT":
        assert timeouts == [7.5, 7.5]


@pytest.mark.parametrize("value, bytes_", [("4M", 4 << 20), ("512k", 512 << 10), (" 2 MiB ", 2 << 20), ("1GB", 1 << 30),
                                           ("65536", 65536), ("0", 0)])
def test_the_shared_memory_sizes_take_the_benchmarks_suffixes(monkeypatch, value, bytes_):
    # MESHKIT_SHM_MIN_BYTES=4M was refused while benchmarks/collectives.py --sizes took 4M
    from meshkit.comm import env

    monkeypatch.setenv("MESHKIT_SHM_MIN_BYTES", value)
    assert env.shm_bytes("MESHKIT_SHM_MIN_BYTES", 7, zero=True) == bytes_
    monkeypatch.setenv("MESHKIT_SHM_CHUNK_BYTES", value)
    if bytes_:
        assert env.shm_bytes("MESHKIT_SHM_CHUNK_BYTES", 64, multiple=64) == bytes_


def test_the_launchers_mpich_tuning_setting_is_validated(tmp_path):
    from meshkit.launch import LaunchError
    from meshkit.launch.mpich_tuning import tuned_environment

    with pytest.raises(LaunchError, match=r"^meshkit.launch: MESHKIT_MPICH_TUNING='off' is not valid; valid values "
                                          r"are 1 \(the default: .*\) and 0 \(leave MPICH's selection alone\)"):
        tuned_environment("mpiexec", str(tmp_path), {"MESHKIT_MPICH_TUNING": "off"})
    assert tuned_environment("mpiexec", str(tmp_path), {"MESHKIT_MPICH_TUNING": "0"}) == {}


def test_the_async_error_handling_setting_is_read_through_the_validating_reader(monkeypatch):
    from meshkit.comm import env

    monkeypatch.setenv("MESHKIT_ASYNC_ERROR_HANDLING", " Log ")
    assert env.async_error_handling() == "log"
    monkeypatch.delenv("MESHKIT_ASYNC_ERROR_HANDLING")
    assert env.async_error_handling() == "abort"
    monkeypatch.setenv("MESHKIT_ASYNC_ERROR_HANDLING", "1")
    with pytest.raises(ValueError, match="MESHKIT_ASYNC_ERROR_HANDLING='1' is not valid"):
        env.async_error_handling()


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


# ---------------------------------------------------------------- mismatch messages grow with the calls, not the ranks

def _mismatch_messages(world_size, call):
    def body():
        try:
            call(meshkit.get_rank())
        except meshkit.CollectiveMismatchError as exc:
            return str(exc), exc.calls
    return local.run(body, world_size, timeout=20)


@pytest.mark.parametrize("debug", ["off", "detail"])
def test_a_mismatch_message_groups_the_ranks_by_what_they_called(monkeypatch, debug):
    monkeypatch.setenv("MESHKIT_DEBUG", debug)
    results = _mismatch_messages(6, lambda r: meshkit.all_reduce(np.ones(4, np.float64 if r == 2 else np.float32)))
    for rank, (message, calls) in enumerate(results):
        assert message == (f"meshkit.comm: rank {rank}: collective mismatch on group world at #0: ranks [0, 1, 3, 4, 5]: "
                           "all_reduce(shape=(4,), dtype=float32, op=SUM) #0; rank 2: all_reduce(shape=(4,), "
                           "dtype=float64, op=SUM) #0")
        assert calls[2] == "all_reduce(shape=(4,), dtype=float64, op=SUM) #0" and len(calls) == 6


def test_an_all_to_all_mismatch_names_the_pairs_that_disagree_a_few_of_them(monkeypatch):
    """Each rank's counts are a list per peer: listing them all was quadratic (4.4 KB at 6 ranks)."""
    def call(rank, n):
        splits = [1] * n if rank != 2 else [2, 0] + [1] * (n - 2)
        recv = [1] * n if rank != 3 else [0] * n
        meshkit.all_to_all_single(np.empty(sum(recv)), np.ones(n), recv, splits)

    sizes = {}
    for n in (6, 12):
        results = _mismatch_messages(n, lambda r: call(r, n))
        message = results[0][0]
        assert message.startswith(f"meshkit.comm: rank 0: collective mismatch on group world at #0: ranks "
                                  f"{list(range(n))}: all_to_all_single(dtype=float64) #0; counts disagree: rank 0 "
                                  "sends 1 element to rank 3, which expects 0 from it; rank 1 sends 1 element to "
                                  "rank 3, which expects 0 from it; rank 2 sends 2 elements to rank 0, which expects "
                                  "1 from it; rank 2 sends 0 elements to rank 1, which expects 1 from it and "), message
        assert message.endswith(f" and {n + 2 - 4} more pairs"), message  # rank 3 expects nothing from its n peers
        sizes[n] = len(message)
    assert sizes[12] - sizes[6] < 40, sizes  # the rank list grows; nothing else does


def test_real_processes_report_a_bad_setting_on_every_rank_and_the_launcher_its_own(mpirun):
    proc = mpirun("mpi_faults.py", 2, "skip-barrier", env={"MESHKIT_ASYNC_ERROR_HANDLING": "bogus"}, check=False,
                  timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "DistValueError: meshkit.comm: MESHKIT_ASYNC_ERROR_HANDLING='bogus' is not valid; valid values are " \
           "'abort'" in out, out
    proc = mpirun("mpi_faults.py", 2, "skip-barrier", env={"MESHKIT_MPICH_TUNING": "no"}, check=False, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "meshkit.launch: MESHKIT_MPICH_TUNING='no' is not valid; valid values are 1" in proc.stderr, proc.stderr
