"""meshkit-run retunes MPICH's Iallreduce selection; everything else is left to MPICH."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshkit import launch
from meshkit.launch.mpich_tuning import (IALLREDUCE_RECURSIVE_DOUBLING_MAX, OPT_OUT_ENV, SELECTION_ENV, retune,
                                       tuned_environment)

SCRIPTS = Path(__file__).parent / "scripts"
RD = "algorithm=MPIR_Iallreduce_intra_sched_recursive_doubling"
RSA = "algorithm=MPIR_Iallreduce_intra_sched_reduce_scatter_allgather"
# The shape of MPICH 5.0's built-in rule for Iallreduce (other collectives elided)
MPICH_LIKE = {
    "collective=bcast": {"algorithm=MPIR_Bcast_intra_binomial": {}},
    "collective=iallreduce": {
        "comm_type=intra": {
            "avg_msg_size<=2048": {RD: {}},
            "avg_msg_size=any": {"is_op_built_in=no": {RD: {}}, "is_op_built_in=yes": {"count=any": {RSA: {}}}},
        },
        "comm_type=inter": {"algorithm=MPIR_Iallreduce_inter_sched_remote_reduce_local_bcast": {}},
    },
}


def test_retune_raises_the_recursive_doubling_bound_and_keeps_the_rule_order():
    tree = copy.deepcopy(MPICH_LIKE)
    assert retune(tree)
    intra = tree["collective=iallreduce"]["comm_type=intra"]
    assert list(intra) == [f"avg_msg_size<={IALLREDUCE_RECURSIVE_DOUBLING_MAX}", "avg_msg_size=any"]
    assert intra[f"avg_msg_size<={IALLREDUCE_RECURSIVE_DOUBLING_MAX}"] == {RD: {}}
    assert intra["avg_msg_size=any"] == MPICH_LIKE["collective=iallreduce"]["comm_type=intra"]["avg_msg_size=any"]
    assert tree["collective=bcast"] == MPICH_LIKE["collective=bcast"]


@pytest.mark.parametrize("change", ["no iallreduce", "other first rule", "other algorithm", "bound already higher"])
def test_retune_leaves_a_tree_it_does_not_recognise_alone(change):
    tree = copy.deepcopy(MPICH_LIKE)
    intra = tree["collective=iallreduce"]["comm_type=intra"]
    if change == "no iallreduce":
        del tree["collective=iallreduce"]
    elif change == "other first rule":
        intra["count<pow2"] = intra.pop("avg_msg_size<=2048")
        tree["collective=iallreduce"]["comm_type=intra"] = {"count<pow2": intra.pop("count<pow2"), **intra}
    elif change == "other algorithm":
        intra["avg_msg_size<=2048"] = {RSA: {}}
    else:
        tree["collective=iallreduce"]["comm_type=intra"] = {"avg_msg_size<=65536": {RD: {}}}
    before = copy.deepcopy(tree)
    assert not retune(tree)
    assert tree == before


def _fake_installation(root: Path, library_bytes: bytes | None) -> str:
    (root / "bin").mkdir(parents=True)
    mpiexec = root / "bin" / "mpiexec"
    mpiexec.write_text("#!/bin/sh\n")
    mpiexec.chmod(0o755)
    if library_bytes is not None:
        (root / "lib").mkdir()
        (root / "lib" / "libmpi.so").write_text("INPUT(libmpi.so.12)\n")  # a linker script, as in the wheel
        (root / "lib" / "libmpi.so.12").write_bytes(library_bytes)
    return str(mpiexec)


def test_the_selection_is_read_from_the_library_beside_mpiexec(tmp_path):
    blob = b"\x7fELF...\0other string\0" + json.dumps(MPICH_LIKE).encode() + b"\0more\0"
    mpiexec = _fake_installation(tmp_path / "mpich", blob)
    env = tuned_environment(mpiexec, str(tmp_path), {})
    assert env == {SELECTION_ENV: str(tmp_path / "mpich-coll-selection.json")}
    written = json.loads(Path(env[SELECTION_ENV]).read_text())
    expected = copy.deepcopy(MPICH_LIKE)
    retune(expected)
    assert written == expected


@pytest.mark.parametrize("case", ["no library", "library without the rule", "repeated key", "user's own file",
                                  "opted out"])
def test_nothing_is_tuned_when_it_should_not_be(tmp_path, case):
    blob = b"\0" + json.dumps(MPICH_LIKE).encode() + b"\0"
    env: dict[str, str] = {}
    if case == "no library":
        blob = None
    elif case == "library without the rule":
        blob = b"\0" + json.dumps({"collective=bcast": {}}).encode() + b"\0"
    elif case == "repeated key":  # a dict would keep one of them: the rewrite would lose a rule
        blob = b"\0" + json.dumps(MPICH_LIKE).encode()[:-1] + b', "collective=bcast": {}}\0'
    elif case == "user's own file":
        env = {SELECTION_ENV: "/users/own.json"}
    else:
        env = {OPT_OUT_ENV: "0"}
    mpiexec = _fake_installation(tmp_path / "mpi", blob)
    assert tuned_environment(mpiexec, str(tmp_path), env) == {}
    assert not (tmp_path / "mpich-coll-selection.json").exists()


def test_ranks_get_the_retuned_selection_and_mpich_accepts_it(tmp_path):
    try:
        mpiexec = launch.find_mpiexec()[0]
    except launch.LaunchError:
        pytest.skip("no mpiexec (pip install mpich)")
    # What the launcher will do with this installation: retune, or (another MPI) nothing.
    expected = tuned_environment(mpiexec, str(tmp_path), {k: v for k, v in os.environ.items() if k != SELECTION_ENV})
    env = {k: v for k, v in os.environ.items() if k != SELECTION_ENV}
    result = subprocess.run([sys.executable, "-m", "meshkit.launch", "-n", "2", "--timeout", "60",
                             str(SCRIPTS / "launch_selection.py")], capture_output=True, text=True, env=env,
                            timeout=90)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("all_reduce ok: True") == 2
    if expected:
        assert result.stdout.count("selection file: /") == 2
        rules = f"iallreduce rules: ['avg_msg_size<={IALLREDUCE_RECURSIVE_DOUBLING_MAX}', 'avg_msg_size=any']"
        assert result.stdout.count(rules) == 2, result.stdout
    else:
        assert result.stdout.count("selection file: None") == 2
