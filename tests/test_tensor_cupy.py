"""DTensor on device arrays: tests/doubles/fake_cupy.py's strict CuPy arrays (not np.ndarray; an implicit
host copy raises) over the NCCL engine on the double. Every redistribution pair and the op rules
keep the blocks on the device and match NumPy."""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
from tensor_cases import global_array, same_bits

from doubles import fake_cupy
import meshkit
from meshkit.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor, logsumexp
from support.nccl import on_nccl

S0, S1, R, P = Shard(0), Shard(1), Replicate(), Partial()


# The ``cupy`` fixture (tests/conftest.py) installs the fake module and the double for a test.
def on_mesh(fn, mesh_shape):
    """``fn(mesh, cupy)`` on thread-ranks of an ``nccl`` world over the double (one fake GPU each)."""
    def main():
        import cupy

        return fn(meshkit.init_device_mesh("cuda", mesh_shape), cupy)
    return on_nccl(main, int(np.prod(mesh_shape)), timeout=60)


def host(x):
    """A device block as a NumPy array, through the explicit ``.get()`` (and asserting it is one)."""
    assert isinstance(x, fake_cupy.ndarray), type(x)
    return x.get()


@pytest.mark.parametrize("mesh_shape", [(2,), (3,), (2, 2)])
def test_every_redistribution_pair_on_device_arrays(cupy, mesh_shape):
    a = global_array((5, 3), "float64")  # uneven over 2, 3 and 2x2; a NaN and a -0.0
    options = [S0, S1, R, P, Partial("max")]

    def body(mesh, cp):
        dev = cp.asarray(a)
        count = 0
        for src in itertools.product(options, repeat=len(mesh_shape)):
            d = distribute_tensor(dev, mesh, src)
            assert isinstance(d.to_local(), fake_cupy.ndarray)
            for dst in itertools.product(options, repeat=len(mesh_shape)):
                e = d.redistribute(placements=dst)
                assert same_bits(host(e.full_tensor()), a), (src, dst)
                assert same_bits(host(e.redistribute(placements=src).full_tensor()), a), (src, dst, "back")
                count += 1
            s = distribute_tensor(dev if meshkit.get_rank() == 0 else dev * 0, mesh, src, src_data_rank=0)
            assert same_bits(host(s.full_tensor()), a), (src, "src_data_rank=0")
        return count

    assert on_mesh(body, mesh_shape) == [len(options) ** (2 * len(mesh_shape))] * int(np.prod(mesh_shape))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("mesh_shape", [(3,), (2, 2)])
def test_op_rules_on_device_arrays(cupy, mesh_shape):
    rng = np.random.default_rng(4)
    x, w, t = rng.standard_normal((5, 7)), rng.standard_normal((7, 3)), rng.standard_normal((5, 7))
    k = len(mesh_shape)
    cases = {
        "mlp": (lambda X, W, T, m: np.tanh(X(R) @ W(S1)) @ W(S1).T, np.tanh(x @ w) @ w.T),
        "matmul P": (lambda X, W, T, m: X(S1) @ W(S0), x @ w),
        "sum S0": (lambda X, W, T, m: np.sum(X(S0), axis=0), x.sum(0)),
        "mean": (lambda X, W, T, m: X(S1).mean(), x.mean()),
        "max empty block": (lambda X, W, T, m: np.max(X(S0), axis=0), x.max(0)),
        "bool max": (lambda X, W, T, m: (X(S0) > 0).max(axis=0), (x > 0).max(0)),
        "P + 1": (lambda X, W, T, m: X(P) + 1.0, x + 1),
        "P * inf": (lambda X, W, T, m: X(P) * np.inf, x * np.inf),
        "P / R": (lambda X, W, T, m: X(P) / T(R), x / t),
        "y / y": (lambda X, W, T, m: (lambda y: y / y)(X(S1) @ W(S0)), (x @ w) / (x @ w)),
        "where": (lambda X, W, T, m: np.where(X(S0) > 0, X(S0), T(S0)), np.where(x > 0, x, t)),
        "clip": (lambda X, W, T, m: np.clip(X(P), -0.5, 0.5), np.clip(x, -0.5, 0.5)),
        "astype": (lambda X, W, T, m: X(P).astype(np.float32), x.astype(np.float32)),
        "copy": (lambda X, W, T, m: copy.deepcopy(X(S1)).copy(), x),
        "index": (lambda X, W, T, m: X(S1)[1:4, None], x[1:4, None]),
        "reshape T": (lambda X, W, T, m: X(S1).reshape(5, 7, 1).T, x.reshape(5, 7, 1).T),
        "in place": (lambda X, W, T, m: (lambda d: (d.__iadd__(T(S0)), d)[1])(X(S0)), x + t),
        "einsum P": (lambda X, W, T, m: np.einsum("td,dh->th", X(S1), W(S0)), x @ w),
        "einsum S": (lambda X, W, T, m: np.einsum("td,th->dh", X(S0), T(S0) * 1), x.T @ t),
        "logsumexp": (lambda X, W, T, m: logsumexp(X(S1), axis=1), np.log(np.exp(x).sum(1))),
        "exp P": (lambda X, W, T, m: np.exp(X(P)), np.exp(x)),
        "concatenate": (lambda X, W, T, m: np.concatenate([X(S1), T(S0)]), np.concatenate([x, t])),
        "array_split": (lambda X, W, T, m: np.array_split(X(S0), 2, axis=1)[1], np.array_split(x, 2, axis=1)[1]),
        "take S": (lambda X, W, T, m: np.take(X(S1), [4, 0], axis=0), x[[4, 0]]),
        "take along S": (lambda X, W, T, m: np.take(X(S1), [6, 0], axis=1), x[:, [6, 0]]),
        # cupy.take has no mode (and wraps out-of-range indices): the modes are applied to the indices
        "take wrap": (lambda X, W, T, m: np.take(X(S0), [7, -9, 2], axis=1, mode="wrap"),
                      np.take(x, [7, -9, 2], axis=1, mode="wrap")),
        "take clip": (lambda X, W, T, m: np.take(X(S1), [[9, -1]], axis=0, mode="clip"),
                      np.take(x, [[9, -1]], axis=0, mode="clip")),
        "take flat": (lambda X, W, T, m: np.take(X(S0), [34, -35, 3]), np.take(x, [34, -35, 3])),
    }

    def body(mesh, cp):
        def lay(a):
            return lambda p: distribute_tensor(cp.asarray(a), mesh, [p] * k)
        out = {}
        for name, (f, _) in cases.items():
            r = f(lay(x), lay(w), lay(t), mesh)
            assert isinstance(r, DTensor) and isinstance(r.to_local(), fake_cupy.ndarray), name
            out[name] = host(r.full_tensor())
        return out

    for rank in on_mesh(body, mesh_shape):
        for name, (_, want) in cases.items():
            got = rank[name]
            assert got.dtype == want.dtype, name
            np.testing.assert_allclose(got, want, rtol=1e-6 if got.dtype == np.float32 else 1e-12,
                                       atol=1e-12, err_msg=name)


def test_take_out_of_range_raises_on_device_arrays_as_numpy_does(cupy):
    """cupy.take has no mode and wraps an index out of range: np.take of a DTensor on the device
    raises NumPy's IndexError on every rank instead (mode='raise', NumPy's default), and refuses a
    mode NumPy does not have."""
    a = np.arange(10.0).reshape(5, 2)

    def body(mesh, cp):
        d = distribute_tensor(cp.asarray(a), mesh, [S1])
        with pytest.raises(IndexError, match=r"rank \d: np.take: index 5 is out of bounds for axis 0 with size 5"):
            np.take(d, [0, 5], axis=0)
        with pytest.raises(IndexError, match=r"np.take: index -11 is out of bounds for the flattened array with "
                                             r"size 10"):
            np.take(d, [-11])
        with pytest.raises(ValueError, match=r"np.take: mode must be one of \['raise', 'wrap', 'clip'\], got 'wrapp'"):
            np.take(d, [0], axis=0, mode="wrapp")
        return host(np.take(d, [-5, 4], axis=0).full_tensor()).tolist()

    assert on_mesh(body, (2,)) == [a[[0, 4]].tolist()] * 2
