"""What uses the shared-memory path, on 4 ranks as 2 simulated nodes (tests/test_shm_use.py):
ranks 0, 1 on node 0 and 2, 3 on node 1 (``meshkit-run --simulate-nodes 2``), with
MESHKIT_SHM_MIN_BYTES=2048 and MESHKIT_SHM_CHUNK_BYTES=4096.

1. ZeRO-1, ZeRO-2 and FSDP over a node's group ([0, 1] or [2, 3]): their flat buffers lie in the
   group's shared memory (their collectives take the path below MESHKIT_SHM_MIN_BYTES: in place),
   and two SGD steps in float64 equal NumPy's update on the mean gradient bitwise (2 ranks: one
   addition, the same in any order); ``memory_report()["shared_memory_mapped"]``: the group's segment
   and every shared buffer, written out from the settings; none on a group across nodes of one rank each.
2. The hierarchical collectives over the world (2 nodes of 2) and over [0, 2, 3] (nodes of 1 and
   2): all_reduce, reduce (to a leader and to a rank that is not one), broadcast (likewise),
   all_gather and reduce_scatter of float64, exactly NumPy's sums in the order node by node, then
   between the nodes; path ``shm+mpi``.
3. The leaders' step timing out on group [0, 1, 2] (timeout 1.5 s; rank 2, alone on its node, never
   calls): rank 0 names rank 2, which did not arrive; rank 1, waiting within its node, names rank 0.
"""

import numpy as np

import meshkit
from meshkit import ReduceOp
from meshkit.comm._seams import resolve_group
from meshkit.comm.engines.shm_layout import segment_bytes
from meshkit.comm.engines.shm_settings import chunk_bytes
from meshkit.parallel import SGD, FullyShardedDataParallel, ZeroRedundancyOptimizer

meshkit.init_process_group("mpi", timeout=60)
rank, n = meshkit.get_rank(), meshkit.get_world_size()
assert n == 4, "run at 4 ranks with --simulate-nodes 2"
mesh = meshkit.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "node"))
node_group = mesh.get_group("node")  # [0, 1] or [2, 3]: one simulated node
me = node_group.rank


def last(op: str) -> dict:
    """The flight record of this rank's last float64 ``op`` (not the strategies' agreements' int32)."""
    return [e for e in meshkit.flight_record() if e["op"] == op and e["dtype"] == "float64"][-1]


def region(nbytes: int) -> int:  # a shared buffer's region per rank: 64-byte multiples
    return -(-nbytes // 64) * 64


# ---------------------------------------------------------------------------- 1. strategies
SHAPES = {"w0": (8, 6), "b0": (6,), "w1": (6, 5)}  # 84 float64 (672 bytes): below MESHKIT_SHM_MIN_BYTES
LR = 0.125


def start() -> dict:
    rng = np.random.default_rng(7)
    return {k: rng.standard_normal(s) for k, s in SHAPES.items()}


def grads(r: int, step: int) -> dict:
    rng = np.random.default_rng(100 * step + r)
    return {k: rng.standard_normal(s) for k, s in SHAPES.items()}


def expected(steps: int) -> dict:
    p = start()
    for step in range(steps):
        g0, g1 = grads(0, step), grads(1, step)
        for k in p:
            p[k] = p[k] - LR * ((g0[k] + g1[k]) / 2)
    return p


def train(model, steps: int) -> None:
    for step in range(steps):
        model.zero_grad()
        mine = grads(me, step)
        if isinstance(model, FullyShardedDataParallel):
            for u in reversed(range(len(model.units))):
                with model.unshard(u):
                    pass
                for name in model.units[u]:
                    model.mark_grad_ready(name, mine[name])
        else:
            for name in reversed(list(SHAPES)):
                model.mark_grad_ready(name, mine[name])
        model.step()


segment = segment_bytes(2, chunk_bytes(2))
flat_bytes = 8 * 84  # 84 elements: 2 shards of 42
zero1 = ZeroRedundancyOptimizer(start(), optimizer=SGD(lr=LR), group=node_group, stage=1)
# the group's segment, then ZeRO-1's parameters and gradients: one shared buffer each, 2 regions
assert zero1.memory_report()["shared_memory_mapped"] == segment + 2 * 2 * region(flat_bytes), zero1.memory_report()
train(zero1, 2)
assert last("all_reduce")["path"] == "shm" and last("all_gather_into_tensor")["path"] == "shm", meshkit.flight_record()[-3:]
want = expected(2)
for k in SHAPES:
    assert np.array_equal(zero1.params[k], want[k]), ("zero1", k)
zero2 = ZeroRedundancyOptimizer(start(), optimizer=SGD(lr=LR), group=node_group, stage=2)
train(zero2, 2)
assert last("all_gather_into_tensor")["path"] == "shm"
for k in SHAPES:
    assert np.array_equal(zero2.params[k], want[k]), ("zero2", k)
fsdp = FullyShardedDataParallel(start(), mesh=mesh["node"], optimizer=SGD(lr=LR), units=[["w0", "b0"], ["w1"]])
train(fsdp, 2)
assert last("reduce_scatter_tensor")["path"] == "shm", last("reduce_scatter_tensor")
full = fsdp.full_state_dict()["model"]
for k in SHAPES:
    assert np.array_equal(full[k], want[k]), ("fsdp", k)
report = fsdp.memory_report()
slot = 8 * 54  # unit 0: 54 elements (2 shards of 27), the widest
assert report["comm_buffers"] == 0, report  # nothing unsharded; the gradient slots are counted below
# on the same group: ZeRO-1's two buffers, ZeRO-2's parameters and FSDP's two slots, each of 2 regions
assert report["shared_memory_mapped"] == segment + 2 * 2 * region(flat_bytes) + 2 * region(flat_bytes) + \
    2 * 2 * region(slot), report
across = ZeroRedundancyOptimizer(start(), optimizer=SGD(lr=LR), group=mesh.get_group("dp"), stage=1)
assert "shared_memory_mapped" not in across.memory_report()  # [0, 2]: one rank per node, over MPI
print(f"STRATEGIES OK on rank {rank}", flush=True)


# ---------------------------------------------------------------------------- 2. hierarchical collectives
def part(r: int, count: int) -> np.ndarray:
    return np.random.default_rng(r * 31 + count).standard_normal(count)


def check_group(ranks: list[int], nodes: list[list[int]]) -> int:
    """Every hierarchical collective over ``ranks`` (global; ``nodes``: their nodes' ranks, in order)."""
    group = meshkit.new_group(ranks)
    if rank not in ranks:
        return 0
    g, size, count = ranks.index(rank), len(ranks), 600  # 4800 bytes: above MESHKIT_SHM_MIN_BYTES
    parts = {r: part(r, count) for r in ranks}

    def ordered(values: dict) -> np.ndarray:  # node by node in rank order, then the nodes in order
        sums = []
        for node in nodes:
            acc = values[node[0]].copy()
            for r in node[1:]:
                acc = acc + values[r]
            sums.append(acc)
        total = sums[0]
        for other in sums[1:]:
            total = total + other
        return total

    buf = parts[rank].copy()
    meshkit.all_reduce(buf, group=group)
    assert last("all_reduce")["path"] == "shm+mpi", last("all_reduce")
    assert np.array_equal(buf, ordered(parts)), ("all_reduce", ranks)
    checks = 1
    for root in (ranks[0], ranks[-1]):  # a leader, then a rank that leads no node
        buf = parts[rank].copy()
        meshkit.reduce(buf, dst=root, group=group)
        assert last("reduce")["path"] == "shm+mpi"
        assert np.array_equal(buf, ordered(parts) if rank == root else parts[rank]), ("reduce", root)
        buf = parts[rank].copy()
        meshkit.broadcast(buf, src=root, group=group, async_op=True).wait()
        assert last("broadcast")["path"] == "shm+mpi"
        assert np.array_equal(buf, parts[root]), ("broadcast", root)
        checks += 2
    out = np.empty(size * count)
    meshkit.all_gather_into_tensor(out, parts[rank], group=group)
    assert last("all_gather_into_tensor")["path"] == "shm+mpi"
    assert np.array_equal(out, np.concatenate([parts[r] for r in ranks])), ("all_gather", ranks)
    blocks = {r: part(r, size * count) for r in ranks}
    mine = blocks[rank].copy()
    piece = np.empty(count)
    meshkit.reduce_scatter_tensor(piece, mine, op=ReduceOp.AVG, group=group)
    assert last("reduce_scatter_tensor")["path"] == "shm+mpi"
    assert np.array_equal(mine, blocks[rank]), "reduce_scatter changed its input"
    whole = ordered(blocks) / size
    assert np.array_equal(piece, whole[g * count:(g + 1) * count]), ("reduce_scatter", ranks)
    return checks + 3


total = check_group([0, 1, 2, 3], [[0, 1], [2, 3]]) + check_group([0, 2, 3], [[0], [2, 3]])
print(f"HIERARCHY OK {total} checks on rank {rank}", flush=True)

# ---------------------------------------------------------------------------- 3. the leaders' timeout
slow = meshkit.new_group([0, 1, 2], timeout=1.5)  # node 0: ranks 0, 1; node 1: rank 2 alone
if rank in (0, 1):
    try:
        meshkit.all_reduce(np.ones(1000), group=slow)
    except meshkit.CollectiveTimeout as exc:
        print(f"TIMEOUT {exc}", flush=True)
    else:
        raise AssertionError("an all_reduce rank 2 never joined did not time out")
meshkit.barrier()
print(f"OK on rank {rank}", flush=True)
meshkit.destroy_process_group()
