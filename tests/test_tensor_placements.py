"""Placements and the torch.chunk shard arithmetic (pure, no process group)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import meshkit
from meshkit.comm import local
from meshkit.tensor import Partial, Replicate, Shard
from meshkit.tensor.chunks import chunk_range, local_shape_and_offset, local_slices


def test_placements_print_compare_and_hash_as_torch():
    assert repr(Shard(0)) == "Shard(dim=0)" and repr(Shard(dim=-1)) == "Shard(dim=-1)"
    assert repr(Replicate()) == "Replicate()"
    assert repr(Partial()) == "Partial(sum)" and repr(Partial("avg")) == "Partial(avg)"
    assert str(Shard(1)) == "S(1)" and str(Replicate()) == "R" and str(Partial("max")) == "P(max)"
    assert Shard(1) == Shard(1) and Shard(1) != Shard(0) and Replicate() == Replicate()
    assert Partial() == Partial("sum") and Partial("min") != Partial("max") and Partial() != Replicate()
    assert len({Shard(0), Shard(0), Replicate(), Replicate(), Partial(), Partial("sum")}) == 3
    assert Shard(0).is_shard() and Shard(0).is_shard(0) and not Shard(0).is_shard(1)
    assert Replicate().is_replicate() and Partial().is_partial() and not Replicate().is_shard()
    with pytest.raises(AttributeError):
        Shard(0).dim = 1


def test_bad_placement_values_are_named():
    with pytest.raises(ValueError, match="reduce_op.*'prod'"):
        Partial("prod")
    with pytest.raises(TypeError, match="dim must be an int"):
        Shard("0")


def test_bad_placement_values_name_the_rank_as_every_dtensor_error_does():
    # Partial("bogus") said "Partial(reduce_op): ..." without "meshkit.tensor: rank R: "
    def body():
        rank = meshkit.get_rank()
        head = rf"^meshkit\.tensor: rank {rank}: "
        with pytest.raises(ValueError, match=head + r"Partial\(reduce_op\): must be one of \['avg', 'max', 'min', "
                                                  r"'sum'\], got 'bogus'$"):
            Partial("bogus")
        with pytest.raises(TypeError, match=head + r"Partial\(reduce_op\): reduce_op must be a str, one of .*, "
                                                 r"got \['sum'\]$"):
            Partial(["sum"])  # was a bare "unhashable type: 'list'"
        with pytest.raises(TypeError, match=head + r"Shard\(dim\): dim must be an int, got '0'$"):
            Shard("0")
        with pytest.raises(TypeError, match=head + r"Replicate\(\): takes no arguments, got \(0,\)$"):
            Replicate(0)
        return rank

    assert local.run(body, 2) == [0, 1]


@pytest.mark.parametrize("size,n,sizes", [(6, 4, [2, 2, 2, 0]), (5, 4, [2, 2, 1, 0]), (8, 4, [2, 2, 2, 2]),
                                          (1, 3, [1, 0, 0]), (0, 2, [0, 0]), (7, 3, [3, 3, 1])])
def test_chunks_follow_torch_chunk(size, n, sizes):
    ranges = [chunk_range(size, n, r) for r in range(n)]
    assert [b - a for a, b in ranges] == sizes
    assert ranges[0][0] == 0 and all(ranges[i][1] == ranges[i + 1][0] for i in range(n - 1))
    assert ranges[-1][1] == size


def test_nested_shards_cut_left_to_right():
    # (6,) over a 2x2 mesh, both mesh dims on array dim 0: [0:3] and [3:6], each cut again.
    got = {c: local_shape_and_offset((6,), (2, 2), c, [Shard(0), Shard(0)]) for c in
           [(0, 0), (0, 1), (1, 0), (1, 1)]}
    assert got == {(0, 0): ((2,), (0,)), (0, 1): ((1,), (2,)), (1, 0): ((2,), (3,)), (1, 1): ((1,), (5,))}
    assert local_slices((6, 4), (2, 2), (1, 1), [Shard(0), Shard(1)]) == (slice(3, 6), slice(2, 4))
    assert local_slices((5, 4), (2, 2), (0, 1), [Replicate(), Partial()]) == (slice(0, 5), slice(0, 4))


@given(shape=st.lists(st.integers(0, 7), min_size=1, max_size=3),
       mesh_shape=st.lists(st.integers(1, 4), min_size=1, max_size=3), data=st.data())
def test_blocks_tile_the_global_array_exactly_once(shape, mesh_shape, data):
    """Every element of the global array is in exactly one block per Partial-free layout, up to
    replication: ranks that differ only on Replicate mesh dims hold the same block."""
    options = [Replicate()] + [Shard(d) for d in range(len(shape))]
    placements = data.draw(st.lists(st.sampled_from(options), min_size=len(mesh_shape), max_size=len(mesh_shape)))
    owners = np.zeros(shape, dtype=int)
    for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
        if any(c and p.is_replicate() for c, p in zip(coordinate, placements)):
            continue  # a replica of the block at coordinate 0 of that mesh dim
        owners[local_slices(shape, mesh_shape, coordinate, placements)] += 1
    assert (owners == 1).all()
