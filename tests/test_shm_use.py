"""What uses the shared-memory path: ZeRO's and FSDP's flat buffers in the group's segment,
``memory_report``'s count of it, the hierarchical collectives across nodes and their timeout.

One meshkit-run job (tests/scripts/mpi_shm_use.py: 4 ranks as 2 simulated nodes; process starts
are CI's scarcest resource) and in-process tests of the node layout's arithmetic.
"""

from __future__ import annotations

import os
import re

import pytest

from meshkit.comm.engines.shm_hierarchy import NodeLayout

SIM = ("--simulate-nodes", "2")
SMALL = {"MESHKIT_SHM_MIN_BYTES": "2048", "MESHKIT_SHM_MOVE_MIN_BYTES": "2048", "MESHKIT_SHM_CHUNK_BYTES": "4096",
         "MESHKIT_SHM_SHARED_MIN_BYTES": "0"}


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm (POSIX shared memory)")
def test_flat_buffers_memory_report_hierarchical_collectives_and_the_leaders_timeout(mpirun):
    out = mpirun("mpi_shm_use.py", 4, options=SIM, env=SMALL, timeout=180).stdout
    for r in range(4):
        assert f"[rank{r}]: STRATEGIES OK on rank {r}" in out, out
        # eight checks per group: ranks 0, 2, 3 are in both, rank 1 only in the world
        assert f"[rank{r}]: HIERARCHY OK {8 if r == 1 else 16} checks on rank {r}" in out, out
        assert f"[rank{r}]: OK on rank {r}" in out, out
    assert re.search(r"\[rank0\]: TIMEOUT meshkit.comm: rank 0: all_reduce #\d+ on group group\[0, 1, 2\] \(ranks "
                     r"\[0, 1, 2\]\) timed out after 1.5 s; ranks that did not arrive: \[2\] \(all_reduce through "
                     r"shared memory within each node and mpi among the nodes' leaders, stalled in the nodes' "
                     r"leaders' arrival before their mpi step\)", out), out
    assert re.search(r"\[rank1\]: TIMEOUT meshkit.comm: rank 1: all_reduce #\d+ on group group\[0, 1, 2\] .*ranks that "
                     r"did not arrive: \[0\] \(all_reduce .* stalled in a step within this rank's node over shared "
                     r"memory\)", out), out


@pytest.mark.parametrize("leader_of, rank, want", [
    ([0, 0, 2, 2], 3, NodeLayout((0, 0, 1, 1), (0, 1, 0, 1), ((0, 1), (2, 3)), 1)),
    ([0, 1, 0, 1], 2, NodeLayout((0, 1, 0, 1), (0, 0, 1, 1), ((0, 2), (1, 3)), 0)),
    ([0, 1, 1], 0, NodeLayout((0, 1, 1), (0, 0, 1), ((0,), (1, 2)), 0)),
])
def test_the_node_layout_of_a_group_across_nodes(leader_of, rank, want):
    layout = NodeLayout.of(leader_of, rank)
    assert layout == want
    assert layout.widest == max(len(m) for m in want.members)


def test_a_level_prices_the_shared_memory_path_apart_and_estimate_uses_it_for_shared_buffers(tmp_path):
    from meshkit.plan import Config, Layer, Level, LinkCost, Machine, Model, estimate

    slow, fast = LinkCost(1e-4, 1e-9), LinkCost(1e-6, 1e-11)
    plain = Machine([Level("node", 2, {"all_reduce": slow, "all_gather": slow, "reduce_scatter": slow})], 0,
                    {"float32": 1e10})
    shm = Machine([Level("node", 2, dict(plain.levels[0].costs), paths={"shm": {"all_reduce": fast,
                                                                               "reduce_scatter": fast}})], 0,
                  {"float32": 1e10})
    assert shm.levels[0].cost("all_reduce", path="shm") is fast and shm.levels[0].cost("all_reduce") is slow
    assert shm.levels[0].cost("all_gather", path="shm") is slow  # no path cost for it: the level's links
    shm.save(tmp_path / "m.json")
    assert Machine.load(tmp_path / "m.json") == shm and Machine.median([shm, shm]) == shm
    model = Model([Layer("l0", {"w": (64, 64)}, 64, 2 * 64 * 64), Layer("l1", {"w": (64, 64)}, 64, 2 * 64 * 64)],
                  batch=8)
    for strategy, op in (("ddp", "all_reduce"), ("fsdp", "reduce_scatter")):
        cheap, dear = estimate(Config(strategy, dp_shard=2), model, shm), estimate(Config(strategy, dp_shard=2), model, plain)
        shared = [(c.op, c.seconds) for c in cheap.collectives if c.shared]
        assert shared and all(o == op or o == "all_gather" for o, _ in shared), shared
        assert cheap.comm_s < dear.comm_s, (strategy, cheap.comm_s, dear.comm_s)
        # the per-pass agreement (an ordinary int32 array) keeps the links' price
        agreement = [c for c in cheap.collectives if not c.shared and c.op == "all_reduce"][-1]
        assert agreement.seconds == pytest.approx(slow.alpha + 2 * 0.5 * agreement.nbytes * slow.beta)
    with pytest.raises(ValueError, match=r"Machine.levels\[0\].paths: unknown path 'nvlink'; valid paths are shm"):
        Machine([Level("node", 2, {"all_reduce": slow}, paths={"nvlink": {"all_reduce": fast}})], 0, {})
