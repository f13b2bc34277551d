"""Redistribution cases checked by every rank (local engine tests and the MPI script).

Every pair of placements, uneven shapes included: the block each rank holds after
``redistribute`` is the one the torch.chunk rule gives it, the global array survives (there and
back), and the collectives issued (read from the flight recorder) are exactly the ones the plan
names, on the group of the mesh dim that changes. The array survives bit for bit wherever no
Partial("avg") is involved; through Partial("avg") to within a few ulp: its terms are the value
on every rank (torch's rule too) and the AVG all-reduce computes (x + x + x) / 3, which rounds
(3 ranks: one ulp off for some values).
"""

from __future__ import annotations

import itertools
import threading

import numpy as np

import meshkit
import meshkit.tensor
from meshkit.tensor import Partial, Replicate, Shard
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


def same_or_close(a: np.ndarray, b: np.ndarray, exact: bool) -> bool:
    """``same_bits``, or (``exact`` False: Partial("avg") was involved) equal to a few ulp, NaN where NaN."""
    if exact or a.dtype.kind not in "fc":
        return same_bits(a, b)
    eps = np.finfo(a.dtype).eps
    return a.shape == b.shape and a.dtype == b.dtype and bool(np.allclose(a, b, rtol=4 * eps, atol=0, equal_nan=True))


_building = threading.local()  # per rank (a thread of the local engine): records of building operands


def distribute_tensor(tensor, device_mesh, placements=None, *, src_data_rank=None):
    """meshkit's ``distribute_tensor`` as these tests use it: every rank builds the same array, so
    each cuts its own block (``src_data_rank=None``: no data sent), and the collectives it issues
    (the check that every rank passed the same arguments) are left out of :func:`new_records`,
    which counts the collectives of the ops, not of building their operands."""
    before = meshkit.flight_record()
    out = meshkit.tensor.distribute_tensor(tensor, device_mesh, placements, src_data_rank=src_data_rank)
    made = getattr(_building, "records", [])
    _building.records = (made + _new(before))[-256:]
    return out


def _new(before: list[dict]) -> list[dict]:
    after = meshkit.flight_record()
    for k in range(len(after) + 1):
        kept = len(after) - k
        if after[:kept] == before[len(before) - kept:] if kept else True:
            return after[kept:]
    raise AssertionError("unreachable")


def new_records(before: list[dict]) -> list[dict]:
    """The flight-recorder entries added since ``before`` (the recorder keeps only the last 64),
    but those of :func:`distribute_tensor` here (each record is unique: it has its times)."""
    building = getattr(_building, "records", [])
    return [r for r in _new(before) if r not in building]


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
            exact = Partial("avg") not in (*src, *dst)
            if not any(p.is_partial() for p in dst):
                block = a[local_slices(a.shape, mesh.shape, coordinate, dst)]
                assert same_or_close(e.to_local(), block, exact), (src, dst, e.to_local(), block)
            assert same_or_close(e.full_tensor(), a, exact), (src, dst)
            back = e.redistribute(placements=src)
            assert same_or_close(back.full_tensor(), a, exact), (src, dst, "back")
            if not any(p.is_partial() for p in src):
                assert same_or_close(back.to_local(), d.to_local(), exact), (src, dst, "back, local")
            count += 1
    return count


# ---- the Megatron MLP: plain NumPy, run on arrays and on DTensors ----------------------------


def forward(x, t, w1, w2):
    """Plain NumPy: no DTensor in sight."""
    pre = x @ w1
    h = np.tanh(pre)
    y = h @ w2
    err = y - t
    loss = 0.5 * np.sum(err ** 2) / x.shape[0]
    return pre, h, y, err, loss


def backward(x, h, err, w1, w2):
    """Plain NumPy, hand-written: gradients of the loss above."""
    dy = err / x.shape[0]
    dw2 = h.T @ dy
    dh = dy @ w2.T
    dpre = dh * (1 - h ** 2)
    dw1 = x.T @ dpre
    dx = dpre @ w1.T
    return dw1, dw2, dx


def data(batch=5, d_in=3, hidden=6, d_out=2):
    rng = np.random.default_rng(7)
    return (rng.standard_normal((batch, d_in)), rng.standard_normal((batch, d_out)),
            rng.standard_normal((d_in, hidden)) / 2, rng.standard_normal((hidden, d_out)) / 2)


def reference():
    x, t, w1, w2 = data()
    pre, h, y, err, loss = forward(x, t, w1, w2)
    return (loss, *backward(x, h, err, w1, w2))


def ops_of(records):
    return [(r["group"], r["op"]) for r in records]


def check_megatron(world: int) -> None:
    """The MLP on a 1-D mesh of ``world`` ranks: NumPy's values, Megatron's collectives (asserted)."""
    tp, fwd, bwd_local, bwd, placements, got = megatron(world)
    assert fwd == [(tp, "all_reduce")], fwd
    assert bwd_local == [], "the backward is local until the input gradient is needed"
    assert bwd == [(tp, "all_reduce")], bwd
    assert placements == dict(pre=(Shard(1),), h=(Shard(1),), y=(Partial(),), err=(Replicate(),),
                              loss=(Replicate(),), dw1=(Shard(1),), dw2=(Shard(0),), dx=(Partial(),))
    for g, w in zip(got, reference()):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-10)


def megatron(world: int):
    mesh = meshkit.init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    x, t, w1, w2 = data()
    X, T = distribute_tensor(x, mesh, [Replicate()]), distribute_tensor(t, mesh, [Replicate()])
    W1, W2 = distribute_tensor(w1, mesh, [Shard(1)]), distribute_tensor(w2, mesh, [Shard(0)])
    start = meshkit.flight_record()
    pre, h, y, err, loss = forward(X, T, W1, W2)
    fwd = new_records(start)
    mark = meshkit.flight_record()
    dw1, dw2, dx = backward(X, h, err, W1, W2)
    bwd_local = new_records(mark)
    mark = meshkit.flight_record()
    dx_full = dx.full_tensor()
    bwd = new_records(mark)
    placements = {name: v.placements for name, v in
                  dict(pre=pre, h=h, y=y, err=err, loss=loss, dw1=dw1, dw2=dw2, dx=dx).items()}
    tp = mesh.get_group("tp").name  # a 1-D mesh over the whole world uses the world's group
    return (tp, ops_of(fwd), ops_of(bwd_local), ops_of(bwd), placements,
            [float(loss.full_tensor()), dw1.full_tensor(), dw2.full_tensor(), dx_full])
