"""Redistribution cases checked by every rank (local engine tests and the MPI script).

Every pair of placements, uneven shapes included: the block each rank holds after
``redistribute`` is the one the torch.chunk rule gives it, the global array survives bit for
bit (there and back), and the collectives issued (read from the flight recorder) are exactly
the ones the plan names, on the group of the mesh dim that changes.
"""

from __future__ import annotations

import itertools

import numpy as np

import meshkit
from meshkit.tensor import Partial, Replicate, Shard, distribute_tensor
from meshkit.tensor.chunks import local_slices
from meshkit.tensor.redistribute import plan

#: the collective each kind of step uses (None: a local step, no communication)
COLLECTIVE = {("S", "R"): "all_gather_into_tensor", ("S", "P"): "all_gather_into_tensor",
              ("P", "R"): "all_reduce", ("P", "S"): "reduce_scatter_tensor", ("S", "S"): "all_to_all_single",
              ("R", "S"): None, ("R", "P"): None, ("P", "P"): "all_reduce"}


def _kind(p) -> str:
    return "S" if p.is_shard() else "P" if p.is_partial() else "R"


def global_array(shape, dtype) -> np.ndarray:
    """Values with signed zeros, fractions and (for floats) a NaN: bit-exactness shows."""
    a = np.arange(int(np.prod(shape))).reshape(shape)
    if np.dtype(dtype).kind == "f":
        a = (a - a.size / 2) / 7.0
        flat = a.reshape(-1)
        flat[0] = -0.0
        if flat.size > 2:
            flat[-1] = np.nan
    return a.astype(dtype)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and np.ascontiguousarray(a).tobytes() == \
        np.ascontiguousarray(b).tobytes()


def new_records(before: list[dict]) -> list[dict]:
    """The flight-recorder entries added since ``before`` (the recorder keeps only the last 64)."""
    after = meshkit.flight_record()
    for k in range(len(after) + 1):
        kept = len(after) - k
        if after[:kept] == before[len(before) - kept:] if kept else True:
            return after[kept:]
    raise AssertionError("unreachable")


def check_all_pairs(mesh_shape, shape, dtype="float64", placements=None) -> int:
    """Check every (src, dst) pair on a mesh over the first prod(mesh_shape) ranks; returns the count."""
    mesh = meshkit.init_device_mesh("cpu", mesh_shape)
    coordinate = mesh.get_coordinate()
    a = global_array(shape, dtype)
    options = placements or [Shard(d) for d in range(len(shape))] + [Replicate(), Partial()]
    groups = [mesh.get_group(i).name for i in range(len(mesh_shape))]
    count = 0
    for src in itertools.product(options, repeat=len(mesh_shape)):
        d = distribute_tensor(a, mesh, src)
        for dst in itertools.product(options, repeat=len(mesh_shape)):
            before = meshkit.flight_record()
            e = d.redistribute(placements=dst)
            issued = [(r["group"], r["op"]) for r in new_records(before)]
            expected = [(groups[i], COLLECTIVE[_kind(p), _kind(q)]) for i, p, q in plan(src, dst)
                        if COLLECTIVE[_kind(p), _kind(q)]]
            assert issued == expected, (src, dst, issued, expected)
            assert e.placements == tuple(dst) and e.shape == a.shape
            if not any(p.is_partial() for p in dst):
                block = a[local_slices(a.shape, mesh.shape, coordinate, dst)]
                assert same_bits(e.to_local(), block), (src, dst, e.to_local(), block)
            assert same_bits(e.full_tensor(), a), (src, dst)
            back = e.redistribute(placements=src)
            assert same_bits(back.full_tensor(), a), (src, dst, "back")
            if not any(p.is_partial() for p in src):
                assert same_bits(back.to_local(), d.to_local()), (src, dst, "back, local")
            count += 1
    return count
