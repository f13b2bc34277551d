"""``meshkit-run --simulate-nodes K``: N ranks of one machine as K nodes, and everything in meshkit
that follows host boundaries follows the simulated ones.

Real jobs through meshkit-run for what ranks see (host names, node-local ranks, torchrun's
variables, ``describe()``, the NCCL engine's device choice on the double); the launcher's
usage errors and environment, the bootstrap's placement and the local engine in process.
"""

from __future__ import annotations

import ast
import re

import pytest

import meshkit
from meshkit import launch
from meshkit.comm import env, local
from meshkit.comm.setup import init_methods
from meshkit.launch import bootstrap, cli
from meshkit.mesh import init_device_mesh

HOST = bootstrap.launcher_host()
SIM = ("--simulate-nodes", "2")


def _env_lines(out: str) -> dict[int, dict[str, str | None]]:
    """Each rank's ``env {...}`` line of tests/scripts/simulated_nodes.py."""
    return {int(r): ast.literal_eval(d) for r, d in re.findall(r"\[rank(\d)\]: env (\{.*\})", out)}


def test_each_rank_reports_its_simulated_host_and_node_local_rank_and_describe_groups_by_host(mpirun):
    proc = mpirun("simulated_nodes.py", 4, "hosts", options=SIM, timeout=90,
                  env={"MESHKIT_SHM_MIN_BYTES": "512"})  # its 512 KB all_reduces take the path
    out = proc.stdout
    # every notice sent is received before MPI_Finalize (comm/engines/mpi_mailbox.py): MPICH's UCX netmod
    # between the nodes printed "unexpected tag-receive descriptor ... was not matched" twice a rank
    assert "was not matched" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    seen = _env_lines(out)
    for rank in range(4):
        node, local_rank = divmod(rank, 2)  # blocks: ranks 0, 1 on node 0, ranks 2, 3 on node 1
        assert seen[rank] == {"MESHKIT_HOST_NAME": f"{HOST}-sim{node}", "LOCAL_RANK": str(local_rank),
                              "LOCAL_WORLD_SIZE": "2", "MPI_LOCALRANKID": str(local_rank), "UCX_TLS": "tcp,self"}, out
        assert f"[rank{rank}]: host {HOST}-sim{node} local rank {local_rank}\n" in out, out
        # the world's large all_reduce: shared memory within each node, MPI between them; tp's: shared memory
        assert f"[rank{rank}]: paths ['shm+mpi', 'shm']\n" in out, out
        # MPICH itself sees 2 nodes: shared memory within one, its network module between them.
        assert f"[rank{rank}]: MPI shared-memory node of 2 ranks\n" in out, out
    # describe() of the same job groups the ranks by simulated host and names the dimension that crosses
    described = re.search(r"describe:\n(.*?)\[rank0\]: end", out, re.S).group(1)
    assert "dim 0 'dp' (size 2) crosses hosts: groups [[0, 2], [1, 3]]" in described, out
    assert "dim 1 'tp' (size 2): groups [[0, 1], [2, 3]]" in described, out
    assert f"host {HOST}-sim0: ranks [0, 1]" in described and f"host {HOST}-sim1: ranks [2, 3]" in described, out
    assert "warning" not in described, out  # the launch order: the node dimension first
    transposed = re.search(r"transposed:\n(.*?)\[rank0\]: end", out, re.S).group(1)
    assert "dim 1 'dp' (size 2) crosses hosts: groups [[0, 2], [1, 3]]" in transposed, out
    assert "warning: dim 'dp' crosses hosts while the earlier dim 'tp' does not" in transposed, out


def test_the_node_local_rank_follows_host_names_a_user_sets(mpirun):
    # Under plain meshkit-run, hydra's MPI_LOCALRANKID (0..3) and MPI's shared-memory split count
    # the real machine: with MESHKIT_HOST_NAME set (and no LOCAL_RANK) the names decide.
    out = mpirun("simulated_nodes.py", 4, "named", timeout=90).stdout
    for rank in range(4):
        assert f"[rank{rank}]: named host box{rank // 2} local rank {rank % 2}\n" in out, out


def test_nccl_device_selection_follows_the_simulated_nodes(mpirun):
    share = {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}
    # One job: 4 GPUs on each of 2 simulated nodes, then 2 GPUs with sharing refused.
    out = mpirun("simulated_nodes.py", 4, "devices", "4", "2:0", options=SIM, env=share, timeout=90).stdout
    for rank in range(4):  # node-local rank modulo visible GPUs, per simulated node
        assert f"[rank{rank}]: device {rank % 2} (0000:0{rank % 2}:00.0)" in out, out
    # The simulated nodes are one machine: GPUs really shared are refused as NCCL would.
    assert "[rank2]: DistBackendError: meshkit.comm: rank 2: ranks [0, 2] would share one GPU" in out, out
    out = mpirun("simulated_nodes.py", 4, "devices", "4", env=share, timeout=90).stdout
    for rank in range(4):  # one real node of 4 ranks: a GPU each
        assert f"[rank{rank}]: device {rank} (0000:0{rank}:00.0)" in out, out


def test_a_user_set_transport_is_kept(mpirun):
    out = mpirun("simulated_nodes.py", 2, "env", options=SIM, env={"UCX_TLS": "all"}, timeout=90).stdout
    assert {r: e["UCX_TLS"] for r, e in _env_lines(out).items()} == {0: "all", 1: "all"}, out
    assert "[rank1]: MPI shared-memory node of 1 ranks" in out, out  # 2 nodes of 1 rank


def test_the_launcher_sets_the_transport_and_the_node_count_only_when_asked(monkeypatch, tmp_path):
    monkeypatch.delenv("UCX_TLS", raising=False)
    monkeypatch.setenv(bootstrap.SIMULATED_NODES_ENV, "2")  # left over: the flag alone decides
    plain = cli.job_environment(["mpiexec"], 4, str(tmp_path), [])
    assert "UCX_TLS" not in plain and bootstrap.SIMULATED_NODES_ENV not in plain
    simulated = cli.job_environment(["mpiexec"], 4, str(tmp_path), [], simulate_nodes=2)
    assert (simulated["UCX_TLS"], simulated[bootstrap.SIMULATED_NODES_ENV]) == ("tcp,self", "2")
    monkeypatch.setenv("UCX_TLS", "sm,self")
    assert cli.job_environment(["mpiexec"], 4, str(tmp_path), [], simulate_nodes=2)["UCX_TLS"] == "sm,self"


def test_hydra_starts_the_simulated_hosts_and_another_mpiexec_is_refused():
    assert cli.simulated_node_arguments(cli.find_mpiexec(), 2, 6) == [
        "-launcher", "fork", "-hosts", f"{HOST}-sim0:3,{HOST}-sim1:3"]
    with pytest.raises(launch.LaunchError, match=r"--simulate-nodes needs MPICH's hydra mpiexec \(the mpich "
                                                 r"wheel's\), and /bin/echo is not one"):
        cli.simulated_node_arguments(["/bin/echo"], 2, 4)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-n", "3", "--simulate-nodes", "2"], r"argument --simulate-nodes: 2 nodes do not divide -n 3 ranks; pass "
                                               r"a number of nodes that divides it \(valid: \[1, 3\]\)"),
        (["-n", "2:4", "--simulate-nodes", "2"], r"argument --simulate-nodes: needs a fixed number of ranks \(-n N\), "
                                                 r"got -n 2:4"),
        (["-n", "4", "--simulate-nodes", "0"], r"argument --simulate-nodes: expected an integer >= 1, got 0"),
        (["-n", "4", "--simulate-nodes", "2", "--hostfile", "hosts"],
         r"argument --simulate-nodes: simulates nodes on this host and cannot be combined with --hostfile hosts"),
        (["-n", "4", "--simulate-nodes", "2", "--mpiexec-args", "-hosts a,b"],
         r"cannot be combined with --mpiexec-args naming hosts \(-hosts\)"),
    ],
)
def test_bad_simulated_nodes_are_usage_errors(tmp_path, monkeypatch, capsys, args, message):
    (tmp_path / "script.py").write_text("")
    (tmp_path / "hosts").write_text("localhost:4\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        launch.main([*args, "script.py"])
    assert info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_the_bootstrap_places_ranks_in_blocks():
    for rank, (node, local_rank) in enumerate([(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]):
        environ = {"PMI_RANK": str(rank), "PMI_SIZE": "6", bootstrap.SIMULATED_NODES_ENV: "2"}
        bootstrap.set_torchrun_env(environ)
        assert (environ[bootstrap.HOST_NAME_ENV], environ["LOCAL_RANK"], environ["LOCAL_WORLD_SIZE"]) == (
            f"{HOST}-sim{node}", str(local_rank), "3")
    environ = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1"}
    bootstrap.set_torchrun_env(environ)
    assert bootstrap.HOST_NAME_ENV not in environ and environ["LOCAL_RANK"] == "1"
    with pytest.raises(ValueError, match=r"meshkit-run: rank 1: MESHKIT_SIMULATED_NODES='3' is not valid for "
                                         r"WORLD_SIZE=4: it must be a number of nodes >= 1 that divides"):
        bootstrap.set_torchrun_env({"PMI_RANK": "1", "PMI_SIZE": "4", bootstrap.SIMULATED_NODES_ENV: "3"})


def test_comm_repeats_the_bootstraps_host_name_variable():
    assert env.HOST_NAME == bootstrap.HOST_NAME_ENV


def test_the_local_engine_and_the_store_rendezvous_report_the_simulated_host(monkeypatch):
    monkeypatch.setenv(env.HOST_NAME, "box-sim1")

    def rank() -> tuple[str, str]:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        return meshkit.comm._seams.current_world().default_group.host_name(), mesh.describe()

    for host, described in local.run(rank, 2):
        assert host == "box-sim1" and "host box-sim1: ranks [0, 1]" in described
    assert init_methods._here().endswith(" on host box-sim1")  # what the store engine's local_rank() reads


# --------------------------------------------------------------------------- two levels (meshkit.plan)
def _mesh_lines(out: str) -> dict[int, str]:
    return dict((int(r), line) for r, line in re.findall(r"\[rank(\d)\]: (mesh .*)", out))


def test_calibrate_over_the_host_mesh_gives_two_levels_that_estimate_times_hsdp_on(mpirun, tmp_path):
    """benchmarks/two_level.py's host mesh over 2 simulated nodes of 2: ``local`` within a host,
    ``node`` across; calibrate returns a level per dimension, innermost first, and ``estimate``
    times HSDP 2x2's shard collectives on the intra-node level and its replicate all-reduces on the
    inter-node one (the costs are fitted from measurements: no timing is asserted beyond their
    being two different levels)."""
    from meshkit.plan import Config, Layer, Machine, Model, bus_bytes, estimate

    out = mpirun("plan_two_level.py", 4, "calibrate", str(tmp_path / "calib.json"), options=SIM, timeout=120).stdout
    lines = _mesh_lines(out)
    for rank in range(4):
        node = rank // 2
        assert lines[rank] == (f"mesh [[0, 1], [2, 3]] local group [{2 * node}, {2 * node + 1}] hosts "
                               f"['{HOST}-sim{node}', '{HOST}-sim{node}']"), out
        # examples/mlp.py's hsdp mesh (replicate, shard) is the same array: its shard groups stay within a host
        assert f"[rank{rank}]: init_device_mesh (2, 2) [[0, 1], [2, 3]]\n" in out, out
    machine = Machine.load(tmp_path / "calib.json")
    assert [(lv.name, lv.size) for lv in machine.levels] == [("local", 2), ("node", 4)]
    local_level, node_level = machine.levels
    # each host's group shares memory: its shared buffers' path is priced too (docs/collectives.md); the
    # groups across hosts are hierarchical, with no shared buffers of their own
    assert sorted(machine.fit_error) == sorted(f"{d}.{k}" for d in ("local", "local.shm", "node", "node@4")
                                               for k in ("all_reduce", "all_gather", "reduce_scatter"))
    assert set(node_level.sized) == {4}  # the 4 ranks timed as one group: what flat data parallelism pays
    assert set(local_level.paths) == {"shm"} and not node_level.paths

    model = Model([Layer("l0", {"w": (64, 64), "b": (64,)}, activation_bytes=512, flops=2 * 64 * 64),
                   Layer("l1", {"w": (64, 8)}, activation_bytes=64, flops=2 * 64 * 8)], batch=16, dtype="float64")
    b = estimate(Config("hsdp", dp_replicate=2, dp_shard=2), model, machine)
    seen = {c.dim for c in b.collectives}
    assert seen == {"dp_shard", "dp_replicate"}, b.collectives
    for c in b.collectives:
        level, other = (node_level, local_level) if c.dim == "dp_replicate" else (local_level, node_level)
        path = "shm" if c.shared else None  # FSDP's reduce_scatter of its gradient slots, in place
        cost = level.cost(c.op, path=path)
        assert c.seconds == pytest.approx(cost.alpha + bus_bytes(c.op, c.nbytes, 2) * cost.beta, rel=1e-12), c
        assert c.seconds == machine.collective_time(c.op, c.nbytes, 2, level.size, path), c
        wrong = other.cost(c.op, path=path)
        assert c.seconds != pytest.approx(wrong.alpha + bus_bytes(c.op, c.nbytes, 2) * wrong.beta, rel=1e-9), c
    assert {c.op for c in b.collectives if c.dim == "dp_replicate"} == {"all_reduce"}
    # flat fsdp over the 4 ranks crosses the nodes: the inter-node level, at its cost for 4 ranks
    for c in estimate(Config("fsdp", dp_shard=4), model, machine).collectives:
        cost = node_level.sized[4][c.op]
        assert c.seconds == pytest.approx(cost.alpha + bus_bytes(c.op, c.nbytes, 4) * cost.beta, rel=1e-12), c
        assert c.seconds == machine.collective_time(c.op, c.nbytes, 4, node_level.size), c


def test_the_host_mesh_follows_host_names_not_the_rank_order(mpirun):
    # Hosts named box0 (ranks 0, 2) and box1 (ranks 1, 3): an order-based (2, 2) mesh would put
    # ranks 0 and 1 together across the hosts; the host mesh keeps each row on one host.
    out = mpirun("plan_two_level.py", 4, "named", timeout=90).stdout
    lines = _mesh_lines(out)
    for rank in range(4):
        assert lines[rank] == (f"mesh [[0, 2], [1, 3]] local group [{rank % 2}, {rank % 2 + 2}] hosts "
                               f"['box{rank % 2}', 'box{rank % 2}']"), out


def test_the_store_engine_follows_simulated_host_names_for_local_rank_describe_and_device(monkeypatch):
    """A world met through a store (no MPI: ``init_process_group(store=...)``, the nccl engine on
    the double) where no launcher sets ``LOCAL_RANK``: each rank's node-local rank is its place
    among the ranks that claimed their rank from its (simulated) host name, and ``describe()`` and
    the device choice follow. Hosts interleave (box0: ranks 0, 2; box1: ranks 1, 3), so the rank
    order alone would give other answers."""
    from doubles import nccl_double as double

    from meshkit.comm.engines import cuda_runtime
    from meshkit.comm.groups.world import local_context

    previous = cuda_runtime.set_runtime(double.FakeRuntime(devices=2))
    monkeypatch.setattr(env, "this_host", lambda: f"box{local_context().rank % 2}")  # per thread, as per process
    monkeypatch.setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1")  # box0's and box1's GPU 0 are one GPU of this process
    for name in ("LOCAL_RANK", "SLURM_LOCALID"):
        monkeypatch.delenv(name, raising=False)
    store = meshkit.HashStore()

    def rank() -> tuple[int, int, str]:
        me = local_context().rank
        meshkit.init_process_group("nccl", store=store, world_size=4, rank=me, timeout=20)
        try:
            world = meshkit.comm._seams.current_world().default_group
            text = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")).describe()
            return world.engine.host.local_rank(), int(world.device), text
        finally:
            meshkit.destroy_process_group()

    try:
        results = local.run(rank, 4, init=False)
    finally:
        cuda_runtime.set_runtime(previous)
    for r, (local_rank, device, text) in enumerate(results):
        assert (local_rank, device) == (r // 2, r // 2), results
        assert "host box0: ranks [0, 2]" in text and "host box1: ranks [1, 3]" in text, text
        assert "dim 1 'tp' (size 2) crosses hosts" in text, text
