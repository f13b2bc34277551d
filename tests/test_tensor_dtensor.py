"""DTensor construction, description and bad input, on the local engine."""

from __future__ import annotations

import itertools
import pickle

import numpy as np
import pytest
from tensor_cases import new_records

import meshkit
from meshkit.comm import local
from meshkit.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor


def test_distribute_tensor_gives_each_rank_its_block_and_the_global_description():
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2, 2))
        a = np.arange(24.0).reshape(6, 4)
        d = distribute_tensor(a, mesh, [Shard(0), Shard(1)])
        assert d.shape == (6, 4) and d.ndim == 2 and d.dtype == np.float64 and d.size == 24
        assert d.device_mesh is mesh and d.placements == (Shard(0), Shard(1))
        nested = distribute_tensor(np.arange(6), mesh, [Shard(0), Shard(-1)])
        assert nested.placements == (Shard(0), Shard(0))
        return d.to_local().tolist(), nested.to_local().tolist()

    blocks = local.run(body, 4)
    a = np.arange(24.0).reshape(6, 4)
    assert [b for b, _ in blocks] == [a[0:3, 0:2].tolist(), a[0:3, 2:4].tolist(), a[3:6, 0:2].tolist(),
                                      a[3:6, 2:4].tolist()]
    assert [n for _, n in blocks] == [[0, 1], [2], [3, 4], [5]]


def test_from_local_even_and_uneven():
    def body():
        mesh = meshkit.init_device_mesh("cpu", (4,))
        rank = meshkit.get_rank()
        even = DTensor.from_local(np.full((2, 3), rank), mesh, [Shard(0)])
        sizes = [2, 2, 1, 0]  # 5 rows over 4 ranks, torch.chunk
        uneven = DTensor.from_local(np.full((sizes[rank], 3), float(rank)), mesh, [Shard(0)], shape=(5, 3),
                                    run_check=True)
        return even.shape, uneven.full_tensor()[:, 0].tolist()

    for shape, column in local.run(body, 4):
        assert shape == (8, 3) and column == [0, 0, 1, 1, 2]


def test_bad_placements_are_named_with_rank_and_argument():
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2,))
        a = np.zeros((4, 4))
        errors = []
        for placements, kind in [([Shard(0), Shard(1)], ValueError), ([Shard(2)], IndexError),
                                 ([Shard(-3)], IndexError), (["S0"], TypeError), (Shard(0), TypeError)]:
            with pytest.raises(kind) as info:
                distribute_tensor(a, mesh, placements)
            errors.append(str(info.value))
        with pytest.raises(ValueError) as info:
            DTensor.from_local(np.zeros((3, 4)), mesh, [Shard(0)], shape=(4, 4))
        errors.append(str(info.value))
        return errors

    errors = local.run(body, 2)[1]
    assert "rank 1: distribute_tensor: placements has 2 entries" in errors[0] and "mesh has 1 dimensions" in errors[0]
    assert "placements[0] Shard(dim=2): dim 2 is out of range for an array of 2 dimensions" in errors[1]
    assert "Shard(dim=-3)" in errors[2] and "placements[0] must be Shard, Replicate or Partial" in errors[3]
    assert "a sequence of Placement" in errors[4]
    assert "rank 1: DTensor.from_local: local has shape (3, 4)" in errors[5] and "(2, 4)" in errors[5]


def test_inconsistent_from_local_fails_on_every_rank_when_checked():
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2,))
        rows = 3 if meshkit.get_rank() == 1 else 2  # shape (4, 2) gives each rank 2 rows
        with pytest.raises(ValueError) as info:
            DTensor.from_local(np.zeros((rows, 2)), mesh, [Shard(0)], shape=(4, 2), run_check=True)
        return str(info.value)

    for msg in local.run(body, 2):
        assert "rank 1's local has shape (3, 2) but global shape (4, 2)" in msg


def test_dtensor_is_never_silently_an_ndarray_and_meshes_do_not_mix():
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2,))
        other = meshkit.DeviceMesh("cpu", [1, 0])
        d = distribute_tensor(np.ones(4), mesh, [Shard(0)])
        with pytest.raises(TypeError, match="full_tensor"):
            np.asarray(d)
        with pytest.raises(ValueError, match="not this DTensor's mesh"):
            d.redistribute(other, [Replicate()])
        assert "placements=(Shard(dim=0),)" in repr(d)
        p = distribute_tensor(np.arange(4.0), mesh, [Partial()])
        return p.to_local().tolist(), p.full_tensor().tolist()

    (l0, f0), (l1, f1) = local.run(body, 2)
    assert l0 == [0, 1, 2, 3] and f0 == f1 == [0, 1, 2, 3]
    assert all(x == 0 and np.signbit(x) for x in l1), "sum Partial: -0.0 (the identity) on the other ranks"


def test_detail_mode_checks_from_local_across_ranks(monkeypatch):
    monkeypatch.setenv("MESHKIT_DEBUG", "detail")

    def body():
        mesh = meshkit.init_device_mesh("cpu", (2, 2))
        rank = meshkit.get_rank()
        # 5 rows over mesh dim 0 (3, 2); rank 2 claims the global shape is (6, 4)
        rows = 3 if mesh.get_coordinate()[0] == 0 else 2
        shape = (6, 4) if rank == 2 else (5, 4)
        with pytest.raises(ValueError) as info:
            DTensor.from_local(np.zeros((rows, 2)), mesh, [Shard(0), Shard(1)], shape=shape)
        good = DTensor.from_local(np.zeros((rows, 2)), mesh, [Shard(0), Shard(1)], shape=(5, 4))
        return str(info.value), good.shape

    results = local.run(body, 4)
    for rank, (msg, shape) in enumerate(results):
        assert msg.startswith(f"meshkit.tensor: rank {rank}: DTensor.from_local:"), msg
        assert shape == (5, 4)
    # rank 1 shares no mesh dim with rank 2 (mesh [[0, 1], [2, 3]]) but hears of it too: every rank
    # raises the same error, none waits
    assert len({msg.split(": ", 2)[2] for msg, _ in results}) == 1
    assert "rank 2 passed shape (6, 4)" in results[1][0]


def test_ranks_outside_the_mesh_and_a_bad_src_data_rank_are_named():
    def body():
        mesh = meshkit.DeviceMesh("cpu", [0, 1])
        if meshkit.get_rank() == 2:
            with pytest.raises(ValueError, match=r"rank 2: distribute_tensor: this rank is not in the mesh \[0, 1\]"):
                distribute_tensor(np.ones(4), mesh, [Shard(0)])
            return None
        with pytest.raises(ValueError, match=r"distribute_tensor: src_data_rank=2 is not a rank of every mesh "
                                             r"dimension: the mesh has shape \(2,\)"):
            distribute_tensor(np.ones(4), mesh, [Shard(0)], src_data_rank=2)
        with pytest.raises(TypeError, match=r"src_data_rank must be an int or None, got '0'"):
            distribute_tensor(np.ones(4), mesh, [Shard(0)], src_data_rank="0")
        return distribute_tensor(np.arange(4.0), mesh, [Shard(0)]).to_local().tolist()

    assert local.run(body, 3) == [[0.0, 1.0], [2.0, 3.0], None]


@pytest.mark.parametrize("mesh_shape,src", [((3,), 0), ((3,), 2), ((2, 2), 0), ((2, 2), 1)])
def test_src_data_rank_scatters_and_broadcasts_from_that_rank(mesh_shape, src):
    # torch's default: ranks need not agree; only the source's values count (here each rank's
    # array differs). The source is group rank src on every mesh dim (global rank mesh[src, src]).
    a = np.arange(35.0).reshape(5, 7) - 11.5
    options = [Shard(0), Shard(1), Replicate(), Partial()]

    def body():
        mesh = meshkit.init_device_mesh("cpu", mesh_shape)
        mine = a + 100 * meshkit.get_rank()
        source = int(mesh.mesh[(src,) * len(mesh_shape)])
        groups = [mesh.get_group(i).name for i in range(len(mesh_shape))]
        out = []
        for pl in itertools.product(options, repeat=len(mesh_shape)):
            start = meshkit.flight_record()
            d = distribute_tensor(mine, mesh, pl, src_data_rank=src)
            issued = [(r["group"], r["op"]) for r in new_records(start)]
            # the argument check (one all-gather of a fingerprint per mesh dim, right to left), then the data
            assert issued == [(g, "all_gather_into_tensor") for g in reversed(groups)] + \
                [(g, "scatter" if p.is_shard() else "broadcast") for g, p in zip(groups, pl)], issued
            assert d.to_local().shape == distribute_tensor(mine, mesh, pl).to_local().shape
            out.append((pl, d.full_tensor(), source))
        return out

    for rank in local.run(body, int(np.prod(mesh_shape))):
        for pl, full, source in rank:
            np.testing.assert_array_equal(full, a + 100 * source, err_msg=str(pl))


def test_distributed_blocks_never_alias_the_callers_array_or_the_source_dtensor():
    # an in-place step on a parameter must not write into the array it came from
    a = np.arange(35.0).reshape(5, 7)

    def body():
        mesh = meshkit.init_device_mesh("cpu", (2, 2))
        mine = a.copy()
        options = [Shard(0), Shard(1), Replicate(), Partial(), Partial("max")]
        for pl in itertools.product(options, repeat=2):
            for src in (None, 0):
                d = distribute_tensor(mine, mesh, pl, src_data_rank=src)
                assert not np.shares_memory(d.to_local(), mine), (pl, src)
                d.to_local()[...] = -1.0  # what an optimizer's in-place step does to a block
            r = distribute_tensor(mine, mesh, [Replicate(), Replicate()])
            if pl != r.placements:  # (an unchanged placement returns r itself, as torch)
                moved = r.redistribute(placements=pl)
                assert not np.shares_memory(moved.to_local(), r.to_local()), pl
                moved.to_local()[...] = -1.0
                np.testing.assert_array_equal(r.to_local(), a)
        return mine

    for mine in local.run(body, 4):
        np.testing.assert_array_equal(mine, a)


def test_truth_value_and_len_are_never_silently_wrong():
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2,))
        zero = distribute_tensor(np.zeros(1), mesh, [Replicate()])
        with pytest.raises(TypeError, match=r"bool\(\): the truth value of a DTensor.*full_tensor\(\)"):
            bool(zero)  # was True: an object's default truth
        loss = np.sum(distribute_tensor(np.arange(4.0), mesh, [Shard(0)]))  # 0-d, Partial
        with pytest.raises(TypeError, match=r"bool\(\).*\(Partial\(sum\),\)"):
            bool(loss)
        with pytest.raises(TypeError, match=r"bool\(\).*\(Replicate\(\),\)"):
            if loss > 100:  # the comparison all-reduces; the branch still needs an explicit value
                pass
        with pytest.raises(TypeError, match=r"len\(\) of a 0-d DTensor"):
            len(loss)  # was IndexError
        return len(distribute_tensor(np.zeros((5, 2)), mesh, [Shard(0)])), bool(zero.full_tensor())

    assert local.run(body, 2) == [(5, False)] * 2


# ---- Ranks that disagree on the global shape never read what nobody wrote -----------


@pytest.mark.parametrize("world", [2, 3, 4])
def test_from_local_without_shape_gathers_the_sizes_of_uneven_blocks(world):
    # 5 rows cut as torch.chunk cuts them (3, 2 / 2, 2, 1 / 2, 2, 1, 0): every rank infers (5, 3); the
    # old rule (local rows times the mesh size) gave each rank another shape, and full_tensor
    # returned uninitialised memory under MPI (2.28e+243 with exit status 0)
    a = np.arange(15.0).reshape(5, 3)

    def body():
        mesh = meshkit.init_device_mesh("cpu", (world,))
        rank = meshkit.get_rank()
        block = np.array_split(a, [min(k * -(-5 // world), 5) for k in range(1, world)])[rank]
        d = DTensor.from_local(block, mesh, [Shard(0)])
        cols = DTensor.from_local(np.ascontiguousarray(block.T), mesh, [Shard(1)])
        return d.shape, d.full_tensor(), cols.shape, cols.full_tensor()

    for shape, full, cols_shape, cols in local.run(body, world):
        assert shape == (5, 3) and cols_shape == (3, 5)
        np.testing.assert_array_equal(full, a)
        np.testing.assert_array_equal(cols, a.T)


@pytest.mark.parametrize("placements,blocks", [
    # (placements on mesh [[0, 1], [2, 3]], each rank's block of np.arange(35).reshape(5, 7))
    ((Shard(0), Shard(0)), [(0, 2), (2, 3), (3, 4), (4, 5)]),          # nested: 5 = (3: 2 + 1) + (2: 1 + 1)
    ((Shard(0), Shard(1)), [((0, 3), (0, 4)), ((0, 3), (4, 7)), ((3, 5), (0, 4)), ((3, 5), (4, 7))]),
    ((Replicate(), Shard(0)), [(0, 3), (3, 5), (0, 3), (3, 5)]),
    ((Partial(), Shard(1)), [(None, (0, 4)), (None, (4, 7)), (None, (0, 4)), (None, (4, 7))]),
])
def test_from_local_without_shape_on_a_2d_mesh(placements, blocks):
    a = np.arange(35.0).reshape(5, 7)

    def body():
        mesh = meshkit.init_device_mesh("cpu", (2, 2))
        spec = blocks[meshkit.get_rank()]
        if isinstance(spec[0], int):
            spec = (spec,)
        index = tuple(slice(*s) if s is not None else slice(None) for s in spec)
        block = a[index] / 2 if placements[0] == Partial() else a[index]
        d = DTensor.from_local(np.ascontiguousarray(block), mesh, list(placements))
        return d.shape, d.full_tensor()

    for shape, full in local.run(body, 4):
        assert shape == (5, 7)
        np.testing.assert_array_equal(full, a)


def test_from_local_blocks_that_are_not_a_torch_chunk_cutting_raise_on_every_rank():
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2,))
        rows = [2, 3][meshkit.get_rank()]  # 5 rows are cut 3, 2
        with pytest.raises(ValueError) as info:
            DTensor.from_local(np.zeros((rows, 4)), mesh, [Shard(0)])
        return str(info.value)

    for rank, msg in enumerate(local.run(body, 2)):
        assert msg == (f"meshkit.tensor: rank {rank}: DTensor.from_local: the blocks of ranks [0, 1] (mesh dim 0, "
                       "Shard(dim=0)) have [2, 3] along array dim 0, which is not how 5 are cut over 2 ranks: "
                       "blocks follow torch.chunk ([3, 2]: ceil(5/2) each, the rest last); cut the blocks that way")


def test_a_bad_block_in_one_group_raises_on_every_rank_of_the_mesh():
    # mesh [[0, 1], [2, 3]], [Replicate(), Shard(0)]: only the tp group [2, 3] is wrong (2, 3 rows);
    # ranks 0 and 1 share no group with the bad pair on the sharded dim but hear of it
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2, 2))
        rows = [3, 2, 2, 3][meshkit.get_rank()]
        with pytest.raises(ValueError) as info:
            DTensor.from_local(np.zeros((rows, 2)), mesh, [Replicate(), Shard(0)])
        return str(info.value).split(": ", 2)[2]

    messages = local.run(body, 4)
    assert len(set(messages)) == 1, messages
    assert "the blocks of ranks [2, 3] (mesh dim 1, Shard(dim=0)) have [2, 3] along array dim 0" in messages[0]


@pytest.mark.parametrize("case", ["placements", "dtype", "other dims", "replicas"])
def test_from_local_blocks_that_do_not_make_one_dtensor_raise_on_every_rank(case):
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2,) if case != "replicas" else (2, 2))
        rank = meshkit.get_rank()
        block, placements = np.zeros((2, 3)), [Shard(0)]
        if case == "placements":
            placements = [Shard(rank)]
        elif case == "dtype":
            block = block.astype(np.float32) if rank == 1 else block
        elif case == "other dims":
            block = np.zeros((2, 3 + rank))
        else:
            placements = [Shard(0), Replicate()]
            block = np.zeros((2, 3 + (rank == 3)))  # rank 3's replica of rank 2's block differs
        with pytest.raises(ValueError) as info:
            DTensor.from_local(block, mesh, placements)
        return str(info.value).split(": ", 2)[2]

    messages = local.run(body, 2 if case != "replicas" else 4)
    assert len(set(messages)) == 1, messages
    expected = {
        "placements": "the ranks passed blocks that do not make one DTensor: rank 0 passed placements "
                      "(Shard(dim=0),) with a 2-d float64 block; rank 1 passed placements (Shard(dim=1),) with a 2-d "
                      "float64 block",
        "dtype": "rank 1 passed placements (Shard(dim=0),) with a 2-d float32 block",
        "other dims": "the blocks of ranks [0, 1] (mesh dim 0, Shard(dim=0)) have shapes [(2, 3), (2, 4)], which "
                      "differ outside array dim 0",
        "replicas": "the blocks of ranks [2, 3] (mesh dim 1, Replicate()) have shapes [(2, 3), (2, 4)]; along a "
                    "Replicate mesh dim every rank holds a block of the same shape"}[case]
    assert expected in messages[0], messages[0]


@pytest.mark.parametrize("src_data_rank", [None, 0])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_distribute_tensor_refuses_arguments_that_differ_on_every_rank(world, src_data_rank):
    def body():
        mesh = meshkit.init_device_mesh("cpu", (world,))
        rank = meshkit.get_rank()
        last = rank == world - 1
        messages = []
        for tensor, placements in [(np.zeros(4 + 2 * last), [Shard(0)]),                    # shape
                                   (np.zeros(6), [Replicate() if last else Shard(0)]),      # placements
                                   (np.zeros(6, np.float32 if last else np.float64), [Shard(0)])]:  # dtype
            with pytest.raises(ValueError) as info:
                distribute_tensor(tensor, mesh, placements, src_data_rank=src_data_rank)
            messages.append(str(info.value))
        # a rank whose own arguments are bad raises its own error, the others one that names it
        with pytest.raises(IndexError if last else ValueError) as info:
            distribute_tensor(np.zeros((2, 2)), mesh, [Shard(2) if last else Shard(0)], src_data_rank=src_data_rank)
        messages.append(str(info.value))
        return messages

    others = "ranks [0, 1, 2]" if world == 4 else "ranks [0, 1]" if world == 3 else "rank 0"
    for rank, messages in enumerate(local.run(body, world)):
        head = f"meshkit.tensor: rank {rank}: distribute_tensor: "
        same = f"{head}every rank must pass the same shape, dtype, placements and src_data_rank, but "
        assert messages[0] == (f"{same}{others} passed shape (4,), dtype float64, placements (Shard(dim=0),), "
                               f"src_data_rank {src_data_rank}; rank {world - 1} passed shape (6,), dtype float64, "
                               f"placements (Shard(dim=0),), src_data_rank {src_data_rank}")
        assert f"rank {world - 1} passed shape (6,), dtype float64, placements (Replicate(),)" in messages[1]
        assert f"rank {world - 1} passed shape (6,), dtype float32" in messages[2]
        if rank == world - 1:
            assert messages[3] == f"{head}placements[0] Shard(dim=2): dim 2 is out of range for an array of 2 dimensions"
        else:
            assert messages[3].startswith(same) and (
                f"rank {world - 1} passed arguments that failed: meshkit.tensor: rank {world - 1}: distribute_tensor: "
                "placements[0] Shard(dim=2): dim 2 is out of range") in messages[3]


def test_distribute_tensor_checks_every_rank_of_a_2d_mesh():
    # rank 3 alone differs (mesh [[0, 1], [2, 3]]): rank 0, which shares no group with it, raises too
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2, 2))
        with pytest.raises(ValueError) as info:
            distribute_tensor(np.zeros(5 if meshkit.get_rank() == 3 else 4), mesh, [Shard(0), Shard(0)])
        return str(info.value).split(": ", 2)[2]

    messages = local.run(body, 4)
    assert len(set(messages)) == 1
    assert "ranks [0, 1, 2] passed shape (4,)" in messages[0] and "rank 3 passed shape (5,)" in messages[0]


# ---- distribute_tensor's default src_data_rank is torch's (0) -------------------------


def test_separately_seeded_inits_make_one_array_by_default_as_in_torch():
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2, 2))
        rank = meshkit.get_rank()
        mine = np.random.default_rng(rank).standard_normal((5, 7))  # a per-rank seed, ported from torch code
        d = distribute_tensor(mine, mesh, [Shard(0), Shard(1)])
        cut = distribute_tensor(mine, mesh, [Shard(0), Shard(1)], src_data_rank=None)  # each its own array
        return d.full_tensor(), cut.to_local(), mine

    results = local.run(body, 4)
    rank0 = np.random.default_rng(0).standard_normal((5, 7))
    for rank, (full, cut, mine) in enumerate(results):
        np.testing.assert_array_equal(full, rank0)  # was rank r's block of rank r's array: four arrays mixed
        row, col = divmod(rank, 2)
        np.testing.assert_array_equal(cut, mine[[slice(0, 3), slice(3, 5)][row], [slice(0, 4), slice(4, 7)][col]])


@pytest.mark.parametrize("n", [2, 3])
def test_layout_agreement_on_real_processes(mpirun, n):
    out = mpirun("mpi_tensor_agreement.py", n).stdout
    assert out.count("AGREEMENT OK") == n, out


# ---- from_local's trusted shape= is checked where the data first crosses ranks ------

ROWS5 = np.arange(15.0).reshape(5, 3)


def _torch_chunk_block(a, world, rank):
    """``rank``'s block of ``a``'s rows cut as torch.chunk cuts them (5 rows: 3, 2 / 2, 2, 1 / 2, 2, 1, 0)."""
    c = -(-a.shape[0] // world)
    return a[min(rank * c, a.shape[0]):min((rank + 1) * c, a.shape[0])]


def _ported(mesh):
    """The porting mistake: torch's even rule, ``shape=(local rows * n, ...)``, on uneven blocks:
    each rank's claim fits its own block (3 rows claim 6, 2 rows claim 4), so from_local accepts it."""
    block = _torch_chunk_block(ROWS5, mesh.size(), meshkit.get_rank())
    return DTensor.from_local(block, mesh, [Shard(0)], shape=(block.shape[0] * mesh.size(), 3))


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("use", ["full_tensor", "redistribute", "x * 2", "x @ w", "x[:, 1:] @ w[1:]", "np.sum(x)"])
def test_explicit_shapes_that_differ_raise_on_every_rank_where_the_data_crosses(world, use):
    # under MPI these read past what was sent (values nobody wrote, exit status 0): here, the local engine
    # raised a size mismatch from the collective, now the named layout error
    def body():
        mesh = meshkit.init_device_mesh("cpu", (world,))
        x = _ported(mesh)
        w = distribute_tensor(np.ones((3, 2)), mesh, [Replicate()])
        with pytest.raises(ValueError) as info:
            if use == "full_tensor":
                x.full_tensor()
            elif use == "redistribute":
                x.redistribute(placements=[Replicate()])
            elif use == "x * 2":
                y = x * 2  # local: the result inherits x's unchecked shape
                y.full_tensor()
            elif use == "x @ w":
                y = x @ w
                y.full_tensor()
            elif use == "x[:, 1:] @ w[1:]":  # indexing keeps the claim
                y = x[:, 1:] @ w[1:]
                y.redistribute(placements=[Replicate()])
            else:
                y = np.sum(x, axis=1)
                y.full_tensor()
        return str(info.value)

    op = "DTensor.redistribute" if use in ("redistribute", "x[:, 1:] @ w[1:]") else "DTensor.full_tensor"
    messages = local.run(body, world)
    assert len({m.split(": ", 2)[2] for m in messages}) == 1, messages
    claims = [_torch_chunk_block(ROWS5, world, r).shape[0] for r in range(world)]
    groups = {rows * world: [r for r in range(world) if claims[r] == rows] for rows in claims}
    passed = "; ".join(f"{'rank' if len(rs) == 1 else 'ranks'} {rs[0] if len(rs) == 1 else rs} passed "
                       f"DTensor.from_local(shape=({rows}, 3) with placements (Shard(dim=0),) and dtype float64)"
                       for rows, rs in groups.items())
    for rank, msg in enumerate(messages):
        assert msg == (f"meshkit.tensor: rank {rank}: {op}: the ranks built this DTensor (or the DTensors it was "
                       f"computed from) on global layouts that differ, so its blocks do not make one array: {passed}; "
                       "from_local trusts shape= without communication (checked here, where the data first crosses "
                       "ranks): pass the same global shape on every rank (not the local size times the mesh size: "
                       "uneven blocks make that differ), or leave shape= out to have the block sizes gathered"), msg


def test_explicit_shapes_that_differ_raise_where_an_op_moves_the_data():
    # a Partial's terms with rank-dependent shapes (each shape= fits its own block): x + 1 reduces the
    # terms first (an all-reduce of 9 floats against 6: past what rank 1 sent, under MPI)
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2,))
        block = np.ones((3 - meshkit.get_rank(), 3))
        x = DTensor.from_local(block, mesh, [Partial()], shape=block.shape)
        with pytest.raises(ValueError) as info:
            x + 1
        return str(info.value)

    for rank, msg in enumerate(local.run(body, 2)):
        assert msg.startswith(f"meshkit.tensor: rank {rank}: np.add: the ranks built this DTensor"), msg
        assert "rank 0 passed DTensor.from_local(shape=(3, 3) with placements (Partial(sum),)" in msg, msg
        assert "rank 1 passed DTensor.from_local(shape=(2, 3)" in msg, msg


def _checks(records):
    """The layout checks among flight-recorder records: all-gathers of int64 fingerprints."""
    return [r for r in records if r["dtype"] == "int64"]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_a_consistent_explicit_shape_is_checked_once(world):
    def body():
        mesh = meshkit.init_device_mesh("cpu", (world,))
        block = _torch_chunk_block(ROWS5, world, meshkit.get_rank())
        start = meshkit.flight_record()
        x = DTensor.from_local(block, mesh, [Shard(0)], shape=(5, 3))  # trusted: no communication
        assert new_records(start) == []
        w = distribute_tensor(np.eye(3), mesh, [Replicate()])
        y = x * 2  # made before the check: shares x's claim
        z = x @ w
        start = meshkit.flight_record()
        fulls = [y.full_tensor(), x.full_tensor(), z.full_tensor(), x.redistribute(placements=[Replicate()]).to_local(),
                 (x @ w + 1).full_tensor()]
        issued = new_records(start)
        return fulls, len(_checks(issued)), [r["op"] for r in issued]

    for fulls, checks, ops in local.run(body, world):
        assert checks == 1, ops  # one all-gather of a fingerprint (the mesh is 1-D), the first time only
        assert ops == ["all_gather_into_tensor"] * 6, ops
        for full, want in zip(fulls, [2 * ROWS5, ROWS5, ROWS5, ROWS5, ROWS5 + 1]):
            np.testing.assert_array_equal(full, want)


def test_checked_dtensors_pay_no_layout_check():
    # distribute_tensor, from_local without shape= or with run_check=True: their ops issue the data
    # collectives only, as before
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2, 2))
        block = _torch_chunk_block(ROWS5, 2, mesh.get_coordinate()[0])
        w = distribute_tensor(np.eye(3), mesh, [Replicate(), Replicate()])
        made = [distribute_tensor(ROWS5, mesh, [Shard(0), Replicate()]),
                DTensor.from_local(block, mesh, [Shard(0), Replicate()]),
                DTensor.from_local(block, mesh, [Shard(0), Replicate()], shape=(5, 3), run_check=True)]
        out = []
        for x in made:
            start = meshkit.flight_record()
            out.append(((x * 2) @ w).full_tensor())
            issued = new_records(start)
            assert [(r["op"], r["dtype"]) for r in issued] == [("all_gather_into_tensor", "float64")], issued
        return out

    for fulls in local.run(body, 4):
        for full in fulls:
            np.testing.assert_array_equal(full, 2 * ROWS5)


def test_explicit_shape_on_a_2d_mesh_is_checked_on_every_rank_of_it():
    # mesh [[0, 1], [2, 3]], [Shard(0), Replicate()]: only rank 3 claims another shape; rank 0, which
    # shares no group with it, raises too
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2, 2))
        block = _torch_chunk_block(ROWS5, 2, mesh.get_coordinate()[0])
        x = DTensor.from_local(block, mesh, [Shard(0), Replicate()],
                               shape=(4, 3) if meshkit.get_rank() == 3 else (5, 3))
        with pytest.raises(ValueError) as info:
            x.full_tensor()
        return str(info.value).split(": ", 2)[2]

    messages = local.run(body, 4)
    assert len(set(messages)) == 1, messages
    assert "ranks [0, 1, 2] passed DTensor.from_local(shape=(5, 3)" in messages[0]
    assert "rank 3 passed DTensor.from_local(shape=(4, 3)" in messages[0]


def test_tp_prepare_input_with_a_shape_is_checked():
    from meshkit.tensor.parallel import ColwiseParallel

    def body():
        mesh = meshkit.init_device_mesh("cpu", (2,))
        block = _torch_chunk_block(ROWS5, 2, meshkit.get_rank())
        with pytest.raises(ValueError, match=r"ColwiseParallel.prepare_input|DTensor.redistribute: the ranks built"):
            ColwiseParallel(input_layouts=Shard(0)).prepare_input(block, mesh, shape=(2 * block.shape[0], 3))
        good = ColwiseParallel(input_layouts=Shard(0)).prepare_input(block, mesh, shape=(5, 3))
        return good.to_local()

    for full in local.run(body, 2):
        np.testing.assert_array_equal(full, ROWS5)


def test_checked_and_dropped_claims_stop_ops_looking_for_claims():
    # ops pass claims on only while some are pending: checked or dropped, none are, and ops on
    # checked DTensors pay one global read again
    import gc

    from meshkit.tensor import dtensor

    gc.collect()  # claims that earlier tests dropped in cycles: else collected mid-test, and counted here
    before = len(dtensor._pending)

    def body():
        mesh = meshkit.init_device_mesh("cpu", (2,))
        block = _torch_chunk_block(ROWS5, 2, meshkit.get_rank())
        x = DTensor.from_local(block, mesh, [Shard(0)], shape=(5, 3))
        y = x * 2
        assert y._claims == x._claims and len(dtensor._pending) >= before + 1
        full = y.full_tensor()
        assert x._claims[0].verified and y._claims is None
        dropped = DTensor.from_local(block, mesh, [Shard(0)], shape=(5, 3))
        copied = pickle.loads(pickle.dumps(dropped._claims[0]))  # made without __init__: counted too
        assert not copied.verified and copied.key == dropped._claims[0].key
        del dropped, copied
        return full

    for full in local.run(body, 2):
        np.testing.assert_array_equal(full, 2 * ROWS5)
    gc.collect()
    assert len(dtensor._pending) == before


def test_size_is_numpys_count_and_torchs_method():
    """``DTensor.size`` was a property (NumPy's element count) where torch's is a
    method (``size()`` the shape, ``size(dim)`` one size): ported torch code called an int."""
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2,))
        d = distribute_tensor(np.zeros((5, 3)), mesh, [Shard(0)])  # uneven: blocks of 3 and 2 rows
        assert d.size == 15 and d.size * 2 == 30 and np.arange(d.size).shape == (15,)  # NumPy's
        assert d.size() == (5, 3) and d.size(0) == 5 and d.size(-1) == 3  # torch's, the global shape
        assert pickle.loads(pickle.dumps(d.size)) == 15 and type(pickle.loads(pickle.dumps(d.size))) is int
        with pytest.raises(IndexError, match=r"rank \d: DTensor.size: size\(dim\): dim 2 is out of range for an "
                                             r"array of 2 dimensions"):
            d.size(2)
        with pytest.raises(TypeError, match=r"DTensor.size: dim must be an int or None, got 'x'"):
            d.size("x")
        return d.to_local().size  # the local block's, NumPy's own

    assert local.run(body, 2) == [9, 6]
