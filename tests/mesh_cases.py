"""Expected groups written out by hand, checked by every rank (local engine and MPI scripts)."""

from __future__ import annotations

import numpy as np

import meshkit
from meshkit.comm._seams import current_world

# shape -> names, and for each dim the groups (every rank's group along that dim).
EXPECTED = {
    (2, 2): (("dp", "tp"), {"dp": [[0, 2], [1, 3]], "tp": [[0, 1], [2, 3]]}),
    (2, 4): (("dp", "tp"), {"dp": [[0, 4], [1, 5], [2, 6], [3, 7]], "tp": [[0, 1, 2, 3], [4, 5, 6, 7]]}),
    (4, 2): (("dp", "tp"), {"dp": [[0, 2, 4, 6], [1, 3, 5, 7]], "tp": [[0, 1], [2, 3], [4, 5], [6, 7]]}),
    (2, 2, 2): (("pp", "dp", "tp"), {"pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
                                     "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
                                     "tp": [[0, 1], [2, 3], [4, 5], [6, 7]]}),
}


def check_expected_groups(shape) -> int:
    """Build the mesh (over the first prod(shape) ranks) and check every dim on this rank."""
    names, groups = EXPECTED[shape]
    rank = meshkit.get_rank()
    size = int(np.prod(shape))
    world = current_world()
    splits = world.split_count
    mesh = meshkit.DeviceMesh("cpu", np.arange(size).reshape(shape), mesh_dim_names=names)
    subset = size < meshkit.get_world_size()
    assert world.split_count - splits == len(shape) + subset, "one split per dimension (+1 for a subset mesh)"
    again = meshkit.DeviceMesh("cpu", np.arange(size).reshape(shape), mesh_dim_names=names)
    assert world.split_count - splits == len(shape) + subset, "the same mesh again: its groups exist, no split"
    assert all(a is b for a, b in zip(again._groups, mesh._groups))
    if rank >= size:
        assert mesh.get_coordinate() is None
        return 0
    checks = 0
    for d, name in enumerate(names):
        mine = next(g for g in groups[name] if rank in g)
        group = mesh.get_group(name)
        assert list(group.ranks) == mine, (name, group.ranks, mine)
        assert mesh.get_local_rank(name) == mine.index(rank)
        assert meshkit.get_rank(group) == mine.index(rank)
        assert mesh[name].mesh.tolist() == mine
        assert mesh.get_group(d) is group
        x = np.array([float(rank)])
        meshkit.all_reduce(x, group=group)
        assert x[0] == sum(mine), (name, x, mine)
        checks += 1
    assert mesh.get_coordinate() == tuple(int(c) for c in np.argwhere(mesh.mesh == rank)[0])
    before = world.split_count
    again = mesh[names[0]].flatten()  # a 1-D slice flattened: the same groups, no split
    assert world.split_count == before and again.get_group() is mesh.get_group(names[0])
    assert mesh[tuple(reversed(names))].mesh.tolist() == np.arange(size).reshape(shape).T.tolist()
    assert world.split_count == before, "slicing never splits"
    return checks
